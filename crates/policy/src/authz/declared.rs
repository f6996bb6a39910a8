//! The policies' view of each tool, as `deploy/policies/schema.cedarschema` declares it
//! (the arguments of `context.arguments` with their types and required flags, and the
//! action's groups), and the check that a worker's `ListTools` entry agrees with it.
//!
//! The Cedar schema stays a file that operators read and write policies against, and
//! every policy is validated against it when it loads — before any worker is reachable.
//! So it cannot be generated from the workers; instead the worker's schema and
//! annotations are the source of truth for what a call carries, and a tool whose worker
//! disagrees with the policies' view is named with every difference ([`check_tool`]):
//! the orchestrator refuses to serve it, and the tests fail.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use cedar_policy as cedar;
use serde_json::{Map, Value, json};

use super::SCHEMA_SOURCE;
use super::catalog::{self, Kind};
use crate::tool::ToolDefinition;

/// The annotation groups an action may be a member of, beside its worker group.
pub const ANNOTATION_GROUPS: [&str; 4] = ["read_only", "destructive", "idempotent", "open_world"];

/// One argument of `context.arguments` as the Cedar schema declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeclaredArgument {
    /// `String`, `Long`, `Bool`, `Set<String>`, `Set<Edit>`, …
    pub cedar_type: String,
    pub required: bool,
}

/// One action of the Cedar schema.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeclaredTool {
    pub arguments: BTreeMap<String, DeclaredArgument>,
    /// The groups the action is a member of (`fs`, `read_only`, …).
    pub groups: Vec<String>,
}

/// Every action of the embedded Cedar schema, read once.
pub(crate) fn declared() -> Result<&'static BTreeMap<String, DeclaredTool>, String> {
    static DECLARED: OnceLock<Result<BTreeMap<String, DeclaredTool>, String>> = OnceLock::new();
    DECLARED
        .get_or_init(read_schema)
        .as_ref()
        .map_err(Clone::clone)
}

fn read_schema() -> Result<BTreeMap<String, DeclaredTool>, String> {
    let (fragment, _) = cedar::SchemaFragment::from_cedarschema_str(SCHEMA_SOURCE)
        .map_err(|e| format!("the embedded Cedar schema does not parse: {e}"))?;
    let json = fragment
        .to_json_value()
        .map_err(|e| format!("the embedded Cedar schema has no JSON form: {e}"))?;
    let actions = json
        .pointer("/Airlock/actions")
        .and_then(Value::as_object)
        .ok_or("the embedded Cedar schema has no Airlock actions")?;
    let mut tools = BTreeMap::new();
    for (name, action) in actions {
        let groups = action
            .get("memberOf")
            .and_then(Value::as_array)
            .map(|parents| {
                parents
                    .iter()
                    .filter_map(|p| p.get("id").and_then(Value::as_str))
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let mut arguments = BTreeMap::new();
        if let Some(attributes) = action
            .pointer("/appliesTo/context/attributes/arguments/attributes")
            .and_then(Value::as_object)
        {
            for (argument, ty) in attributes {
                arguments.insert(
                    argument.clone(),
                    DeclaredArgument {
                        cedar_type: type_name(ty),
                        required: ty.get("required").and_then(Value::as_bool).unwrap_or(true),
                    },
                );
            }
        }
        tools.insert(name.clone(), DeclaredTool { arguments, groups });
    }
    Ok(tools)
}

/// A Cedar JSON-schema type as the text form spells it: `String`, `Set<Edit>`.
fn type_name(ty: &Value) -> String {
    let kind = ty.get("type").and_then(Value::as_str).unwrap_or_default();
    match kind {
        "Set" => format!(
            "Set<{}>",
            ty.get("element").map(type_name).unwrap_or_default()
        ),
        "EntityOrCommon" | "Entity" => {
            let name = ty.get("name").and_then(Value::as_str).unwrap_or_default();
            match name {
                "Boolean" | "__cedar::Bool" | "__cedar::Boolean" => "Bool".to_owned(),
                "__cedar::String" => "String".to_owned(),
                "__cedar::Long" => "Long".to_owned(),
                other => other.to_owned(),
            }
        }
        "Boolean" => "Bool".to_owned(),
        other => other.to_owned(),
    }
}

/// Every way `tool` (a worker's `ListTools` entry) and the policies' view of it
/// disagree; empty when they agree. Each line names the tool and argument and says
/// which side has what.
pub fn check_tool(tool: &ToolDefinition) -> Vec<String> {
    let name = tool.name.as_str();
    let Some(spec) = catalog::spec(name) else {
        return vec![format!(
            "`{name}`: the policy table does not know this tool, so no policy can allow it"
        )];
    };
    let declared = match declared() {
        Ok(declared) => declared,
        Err(e) => return vec![e],
    };
    let Some(action) = declared.get(name) else {
        return vec![format!(
            "`{name}`: not an action of the Cedar schema (deploy/policies/schema.cedarschema)"
        )];
    };
    let fields = match catalog::fields(spec, &tool.input_schema) {
        Ok(fields) => fields,
        Err(problems) => return problems,
    };
    let mut problems = Vec::new();
    for field in &fields {
        let argument = &field.name;
        let Some(expected) = action.arguments.get(argument) else {
            problems.push(format!(
                "`{name}.{argument}`: in the worker's schema, but not in the Cedar schema's context.arguments: add it there, or leave it out of policy on purpose (NOT_IN_CONTEXT)"
            ));
            continue;
        };
        if expected.cedar_type != field.kind.cedar_type() {
            problems.push(format!(
                "`{name}.{argument}`: {} in the worker's schema, {} in the Cedar schema",
                field.kind.cedar_type(),
                expected.cedar_type
            ));
        }
        if expected.required != field.required {
            problems.push(format!(
                "`{name}.{argument}`: {} by the worker's schema, {} by the Cedar schema",
                required_word(field.required),
                required_word(expected.required)
            ));
        }
    }
    for argument in action.arguments.keys() {
        if !fields.iter().any(|field| &field.name == argument) {
            problems.push(format!(
                "`{name}.{argument}`: the Cedar schema declares it, the worker's schema has no such argument"
            ));
        }
    }
    if !action.groups.iter().any(|g| *g == spec.group) {
        problems.push(format!(
            "`{name}`: served by the {} worker, but not a member of Action::\"{}\" in the Cedar schema",
            spec.group, spec.group
        ));
    }
    let annotations = tool.annotations;
    for (group, set) in [
        ("read_only", annotations.read_only),
        ("destructive", annotations.destructive),
        ("idempotent", annotations.idempotent),
        ("open_world", annotations.open_world),
    ] {
        let member = action.groups.iter().any(|g| g == group);
        if member != set {
            problems.push(format!(
                "`{name}`: the worker annotates it {group} = {set}, the Cedar schema {} it in Action::\"{group}\"",
                if member { "puts" } else { "does not put" }
            ));
        }
    }
    problems
}

fn required_word(required: bool) -> &'static str {
    if required { "required" } else { "optional" }
}

/// The input schema the policies' view of `tool` implies: its declared arguments with
/// their types and required flags, and the arguments left out of policy as untyped
/// properties. For tests of policies without a worker; a worker's real schema says more
/// (limits, descriptions) and must agree with this one ([`check_tool`]).
pub fn expected_input_schema(tool: &str) -> Option<Value> {
    let declared = declared().ok()?.get(tool)?;
    let spec = catalog::spec(tool)?;
    let mut properties = Map::new();
    let mut required = Vec::new();
    for (argument, declared) in &declared.arguments {
        let refined = spec
            .refined
            .iter()
            .find(|(name, _)| name == argument)
            .map(|(_, kind)| *kind);
        let schema = match (refined, declared.cedar_type.as_str()) {
            (Some(Kind::Edits), _) | (_, "Set<Edit>") => json!({"type": "array", "items": {
                "type": "object",
                "properties": {"old_text": {"type": "string"}, "new_text": {"type": "string"},
                    "replace_all": {"type": "boolean"}},
                "required": ["old_text", "new_text"]}}),
            (_, "Long") => json!({"type": "integer"}),
            (_, "Bool") => json!({"type": "boolean"}),
            (_, "Set<String>") => json!({"type": "array", "items": {"type": "string"}}),
            _ => json!({"type": "string"}),
        };
        properties.insert(argument.clone(), schema);
        if declared.required {
            required.push(Value::from(argument.as_str()));
        }
    }
    for (t, argument, _) in catalog::NOT_IN_CONTEXT {
        if *t == tool {
            properties.insert((*argument).to_owned(), json!({}));
        }
    }
    Some(json!({"type": "object", "properties": properties, "required": required}))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool::ToolAnnotations;

    /// A worker's definition that agrees with the policies' view of `name`.
    fn agreeing(name: &str) -> ToolDefinition {
        let groups = &declared().unwrap()[name].groups;
        let member = |g: &str| groups.iter().any(|x| x == g);
        ToolDefinition {
            name: name.into(),
            title: String::new(),
            description: String::new(),
            input_schema: expected_input_schema(name).unwrap(),
            annotations: ToolAnnotations {
                read_only: member("read_only"),
                destructive: member("destructive"),
                idempotent: member("idempotent"),
                open_world: member("open_world"),
            },
        }
    }

    #[test]
    fn the_schema_declares_every_tool_of_the_table_and_nothing_else() {
        let declared = declared().unwrap();
        for spec in catalog::TOOLS {
            assert!(declared.contains_key(&*spec.name), "{} missing", spec.name);
            assert!(
                check_tool(&agreeing(&spec.name)).is_empty(),
                "{}",
                spec.name
            );
        }
        let groups = 4 + ANNOTATION_GROUPS.len();
        assert_eq!(declared.len(), catalog::TOOLS.len() + groups);
        let read_file = &declared["read_file"];
        assert_eq!(
            read_file.arguments["path"],
            DeclaredArgument {
                cedar_type: "String".into(),
                required: true
            }
        );
        assert!(!read_file.arguments["offset"].required);
        assert_eq!(
            declared["edit_file"].arguments["edits"].cedar_type,
            "Set<Edit>"
        );
        assert_eq!(
            declared["execute_shell"].arguments["argv"].cedar_type,
            "Set<String>"
        );
    }

    #[test]
    fn a_new_argument_the_policy_cannot_see_is_named() {
        let mut tool = agreeing("read_file");
        tool.input_schema["properties"]["follow"] = json!({"type": "boolean"});
        let problems = check_tool(&tool);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("`read_file.follow`"), "{problems:?}");
        assert!(problems[0].contains("NOT_IN_CONTEXT"), "{problems:?}");
        // An argument Cedar cannot type at all is refused before the comparison.
        let mut tool = agreeing("write_file");
        tool.input_schema["properties"]["meta"] = json!({"type": "object"});
        let problems = check_tool(&tool);
        assert!(
            problems
                .iter()
                .any(|p| p.contains("`write_file.meta`") && p.contains("cannot type")),
            "{problems:?}"
        );
    }

    #[test]
    fn a_changed_type_flag_or_annotation_is_named() {
        let mut tool = agreeing("read_file");
        tool.input_schema["properties"]["offset"] = json!({"type": "string"});
        tool.input_schema["required"] = json!([]);
        tool.annotations.destructive = true;
        let problems = check_tool(&tool).join("\n");
        assert!(
            problems.contains("`read_file.offset`: String in the worker's schema, Long"),
            "{problems}"
        );
        assert!(
            problems.contains("`read_file.path`: optional by the worker's schema, required"),
            "{problems}"
        );
        assert!(problems.contains("destructive = true"), "{problems}");
        // An argument the policy reads that the worker dropped, a refined one included.
        let mut tool = agreeing("move_path");
        tool.input_schema["properties"]
            .as_object_mut()
            .unwrap()
            .remove("destination");
        let problems = check_tool(&tool).join("\n");
        assert!(problems.contains("`move_path.destination`"), "{problems}");
        // A path argument typed as something else.
        let mut tool = agreeing("read_file");
        tool.input_schema["properties"]["path"] = json!({"type": "integer"});
        assert!(check_tool(&tool).join("\n").contains("`read_file.path`"));
        // An argument left out on purpose that no longer exists.
        let mut tool = agreeing("execute_sql");
        tool.input_schema["properties"]
            .as_object_mut()
            .unwrap()
            .remove("params");
        assert!(
            check_tool(&tool)
                .join("\n")
                .contains("`execute_sql.params`")
        );
    }

    #[test]
    fn an_unknown_tool_is_named() {
        let mut tool = agreeing("read_file");
        tool.name = "read_files".into();
        let problems = check_tool(&tool);
        assert!(problems[0].contains("does not know"), "{problems:?}");
    }
}
