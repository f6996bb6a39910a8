//! Tools that are not built in (`[[tools]]`, the packs of `tool_packs`) as policies see
//! them: one Cedar action per tool, derived from the tool's own definition — its input
//! schema and annotations, the same definition its worker serves in `ListTools` — and
//! declared in a second schema fragment beside the embedded one, so a policy can name
//! the tool and type-check its arguments (`context.arguments.message`).
//!
//! The built-in tools keep their hand-written actions (`deploy/policies/schema.cedarschema`,
//! checked against their workers by [`super::declared`]); an extension cannot take a
//! built-in's name. `airlock policy schema` prints both fragments.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{Map, Value};

use super::catalog::{self, Extra, Field, Kind, ToolSpec};
use super::declared::ANNOTATION_GROUPS;
use crate::tool::{BUILT_IN_TOOLS, ToolDefinition};

/// The worker groups the embedded schema declares as actions; any other group is an
/// external worker whose `ListTools` defines its tools.
pub const BUILT_IN_GROUPS: [&str; 4] = ["shell", "fs", "http", "db"];

/// A tool that is not built in, as the binary hands it to the policy: the definition
/// its worker serves, the group that serves it, and whether its calls need approval.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolExtension {
    /// The worker group that serves it (`shell` for command tools).
    pub group: String,
    pub definition: ToolDefinition,
    /// `Some(reason)`: every call needs a human's approval, whatever the policy says
    /// (a policy may add approvals, never remove this one).
    pub approval: Option<String>,
    /// The network its sandbox has (`"none"`, `"proxy"` or `"host"`), which policies see
    /// as `context.network`; `None` for a tool that runs in no sandbox of the shell
    /// worker's (http-backed, external, MCP).
    pub network: Option<String>,
}

/// Why the extension tools cannot be declared to policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExtensionError {
    #[error("tool `{tool}`: {reason}")]
    Invalid { tool: String, reason: String },
}

/// One extension as the authorizer uses it.
#[derive(Debug)]
pub(crate) struct Extended {
    pub spec: ToolSpec,
    pub definition: ToolDefinition,
    /// The arguments policies see, typed.
    pub fields: Vec<Field>,
    /// The arguments they do not see, each with why (Cedar cannot type it).
    pub left_out: Vec<(String, &'static str)>,
    pub approval: Option<String>,
    pub network: Option<String>,
}

/// Every extension tool, checked, by name, and the network of `execute_shell`'s
/// sandboxes: what policies know of the deployment beyond the embedded schema.
#[derive(Debug, Default)]
pub struct ToolExtensions {
    tools: BTreeMap<String, Extended>,
    /// `[sandbox] network` (`"none"` when not set), seen as `context.network` by
    /// execute_shell's policies.
    shell_network: Option<String>,
}

impl ToolExtensions {
    /// Checks `tools`: a name that is built in, defined twice, or not a valid tool name
    /// is an error naming it.
    pub fn new(tools: &[ToolExtension]) -> Result<Self, ExtensionError> {
        let mut checked = BTreeMap::new();
        for tool in tools {
            let name = tool.definition.name.as_str();
            let invalid = |reason: String| ExtensionError::Invalid {
                tool: name.to_owned(),
                reason,
            };
            crate::validate_tool_name(name).map_err(|e| invalid(e.to_string()))?;
            if BUILT_IN_TOOLS.contains(&name) {
                return Err(invalid("the name of a built-in tool".into()));
            }
            if ANNOTATION_GROUPS.contains(&name) || BUILT_IN_GROUPS.contains(&name) {
                return Err(invalid(
                    "the name of a Cedar action group (a worker group or an annotation)".into(),
                ));
            }
            if tool.group.is_empty() || ANNOTATION_GROUPS.contains(&tool.group.as_str()) {
                return Err(invalid(format!(
                    "`{}` cannot be a worker group",
                    tool.group
                )));
            }
            if checked.contains_key(name) {
                return Err(invalid("defined twice".into()));
            }
            let (fields, left_out) = typed_fields(&tool.definition.input_schema);
            checked.insert(
                name.to_owned(),
                Extended {
                    spec: ToolSpec {
                        name: Cow::Owned(name.to_owned()),
                        group: Cow::Owned(tool.group.clone()),
                        refined: &[],
                        extra: Extra::None,
                    },
                    definition: tool.definition.clone(),
                    fields,
                    left_out,
                    approval: tool.approval.clone(),
                    network: tool.network.clone(),
                },
            );
        }
        Ok(Self {
            tools: checked,
            shell_network: None,
        })
    }

    /// The network of `execute_shell`'s sandboxes (`[sandbox] network`: `"none"`,
    /// `"proxy"` or `"host"`).
    pub fn with_shell_network(mut self, network: &str) -> Self {
        self.shell_network = Some(network.to_owned());
        self
    }

    /// What `context.network` holds for execute_shell.
    pub fn shell_network(&self) -> &str {
        self.shell_network.as_deref().unwrap_or("none")
    }

    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tools.contains_key(name)
    }

    pub(crate) fn get(&self, name: &str) -> Option<&Extended> {
        self.tools.get(name)
    }

    /// The names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tools.keys().map(String::as_str)
    }

    /// Every way the definition a worker of `group` serves for a tool disagrees with
    /// what policies see of it; empty when they agree. Built-in tools are checked
    /// against the embedded schema, extensions against the definition they were
    /// declared with (the worker and the orchestrator read different files, say).
    pub fn check_tool(&self, group: &str, tool: &ToolDefinition) -> Vec<String> {
        let name = tool.name.as_str();
        let Some(extended) = self.tools.get(name) else {
            return super::declared::check_tool(tool);
        };
        let mut problems = Vec::new();
        if extended.spec.group != group {
            problems.push(format!(
                "`{name}`: declared for the {} worker, served by the {group} worker",
                extended.spec.group
            ));
        }
        if extended.definition.input_schema != tool.input_schema {
            problems.push(format!(
                "`{name}`: the worker serves another input schema than the one policies were built from (the orchestrator's and the {group} worker's [[tools]] differ)"
            ));
        }
        if extended.definition.annotations != tool.annotations {
            problems.push(format!(
                "`{name}`: the worker annotates it {:?}, policies were built from {:?}",
                tool.annotations, extended.definition.annotations
            ));
        }
        problems
    }

    /// The Cedar schema fragment that declares these tools (and any worker group the
    /// embedded schema lacks), in the text form operators read.
    pub fn cedar_schema(&self) -> String {
        let mut text = String::from(
            "// Tools that are not built in ([[tools]], tool_packs), derived from each tool's\n\
             // own definition: the worker serves the same input schema and annotations.\n\
             namespace Airlock {\n",
        );
        let mut groups: Vec<&str> = self
            .tools
            .values()
            .map(|tool| &*tool.spec.group)
            .filter(|group| !BUILT_IN_GROUPS.contains(group))
            .collect();
        groups.sort_unstable();
        groups.dedup();
        if !groups.is_empty() {
            let quoted: Vec<String> = groups.iter().map(|g| quote(g)).collect();
            let _ = writeln!(text, "  action {};", quoted.join(", "));
        }
        for (name, tool) in &self.tools {
            let annotations = tool.definition.annotations;
            let mut parents = vec![quote(&tool.spec.group)];
            for (group, member) in [
                ("read_only", annotations.read_only),
                ("destructive", annotations.destructive),
                ("idempotent", annotations.idempotent),
                ("open_world", annotations.open_world),
            ] {
                if member {
                    parents.push(quote(group));
                }
            }
            for (argument, why) in &tool.left_out {
                let _ = writeln!(text, "  // {name}.{argument}: not in context: {why}");
            }
            let _ = writeln!(
                text,
                "  action {} in [{}] appliesTo {{\n    principal: Principal,\n    resource: Tool,\n    context: {{\n      session_id: String,",
                quote(name),
                parents.join(", ")
            );
            if tool.network.is_some() {
                let _ = writeln!(text, "      network: String,");
            }
            let arguments: Vec<String> = tool
                .fields
                .iter()
                .map(|field| {
                    format!(
                        "{}{}: {}",
                        quote(&field.name),
                        if field.required { "" } else { "?" },
                        field.kind.cedar_type()
                    )
                })
                .collect();
            let _ = writeln!(
                text,
                "      arguments: {{ {} }},\n    }},\n  }};",
                arguments.join(", ")
            );
        }
        text.push_str("}\n");
        text
    }
}

/// A Cedar string literal; names reaching here are plain (tool names are validated,
/// argument names checked by [`typed_fields`]).
fn quote(name: &str) -> String {
    format!("\"{name}\"")
}

/// Argument names that a Cedar schema can spell as a quoted attribute without escapes.
fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// The arguments of an extension's input schema that policies see, and those they do
/// not with why. Unlike a built-in tool (where an argument policy cannot see is a
/// defect to fix in this repository), an operator's tool may have arguments Cedar
/// cannot type: they are left out, and `airlock policy schema` says which.
fn typed_fields(input_schema: &Value) -> (Vec<Field>, Vec<(String, &'static str)>) {
    let empty = Map::new();
    let (properties, required) = catalog::properties_and_required(input_schema, &empty);
    let mut fields = Vec::new();
    let mut left_out = Vec::new();
    for (name, property) in properties {
        if !plain_name(name) {
            left_out.push((
                name.clone(),
                "its name is not letters, digits, '_', '-' and '.'",
            ));
            continue;
        }
        let kind = match catalog::json_type(property) {
            Some("string") => Kind::Str,
            Some("integer") => Kind::Long,
            Some("boolean") => Kind::Bool,
            Some("array") if property.pointer("/items/type") == Some(&Value::from("string")) => {
                Kind::StrSet
            }
            Some("number") => {
                left_out.push((name.clone(), "a number may have a fraction, Cedar has none"));
                continue;
            }
            _ => {
                left_out.push((name.clone(), "Cedar cannot type it"));
                continue;
            }
        };
        fields.push(Field {
            name: name.clone(),
            kind,
            required: required.contains(&name.as_str()),
        });
    }
    (fields, left_out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool::ToolAnnotations;
    use serde_json::json;

    pub(crate) fn commit_tool() -> ToolExtension {
        ToolExtension {
            group: "shell".into(),
            network: Some("none".into()),
            definition: ToolDefinition {
                name: "git_commit".into(),
                title: String::new(),
                description: "commit".into(),
                input_schema: json!({"type": "object", "required": ["message"], "properties": {
                    "message": {"type": "string"},
                    "paths": {"type": "array", "items": {"type": "string"}},
                    "ratio": {"type": "number"},
                    "meta": {"type": "object"},
                    "we\"ird": {"type": "string"}}}),
                annotations: ToolAnnotations {
                    destructive: true,
                    ..ToolAnnotations::default()
                },
            },
            approval: Some("destructive".into()),
        }
    }

    #[test]
    fn the_fragment_types_what_cedar_can_and_names_the_rest() {
        let extensions = ToolExtensions::new(&[commit_tool()]).unwrap();
        let text = extensions.cedar_schema();
        assert!(
            text.contains("action \"git_commit\" in [\"shell\", \"destructive\"]"),
            "{text}"
        );
        assert!(
            text.contains("arguments: { \"message\": String, \"paths\"?: Set<String> }"),
            "{text}"
        );
        assert!(text.contains("git_commit.ratio: not in context"), "{text}");
        assert!(text.contains("git_commit.meta: not in context"), "{text}");
        assert!(!text.contains("we\"ird\":"), "{text}");
    }

    #[test]
    fn built_in_names_twice_defined_and_bad_groups_are_refused() {
        let mut shadow = commit_tool();
        shadow.definition.name = "read_file".into();
        let error = ToolExtensions::new(&[shadow]).unwrap_err().to_string();
        assert!(
            error.contains("`read_file`") && error.contains("built-in"),
            "{error}"
        );
        let error = ToolExtensions::new(&[commit_tool(), commit_tool()])
            .unwrap_err()
            .to_string();
        assert!(error.contains("defined twice"), "{error}");
        let mut group = commit_tool();
        group.group = "destructive".into();
        assert!(ToolExtensions::new(&[group]).is_err());
        let mut named = commit_tool();
        named.definition.name = "read_only".into();
        assert!(ToolExtensions::new(&[named]).is_err());
    }

    #[test]
    fn a_worker_serving_another_definition_is_named() {
        let extensions = ToolExtensions::new(&[commit_tool()]).unwrap();
        let served = commit_tool().definition;
        assert!(extensions.check_tool("shell", &served).is_empty());
        assert!(extensions.check_tool("fs", &served)[0].contains("served by the fs"));
        let mut changed = served.clone();
        changed.input_schema["properties"]["message"] = json!({"type": "integer"});
        changed.annotations.read_only = true;
        let problems = extensions.check_tool("shell", &changed).join("\n");
        assert!(problems.contains("another input schema"), "{problems}");
        assert!(problems.contains("annotates"), "{problems}");
        // Built-in tools are still checked against the embedded schema.
        let mut unknown = served;
        unknown.name = "not_declared".into();
        assert!(extensions.check_tool("shell", &unknown)[0].contains("does not know"));
    }
}
