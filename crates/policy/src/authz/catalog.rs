//! The tool catalog as policies see it: which tools the schema declares, how each
//! tool's `context.arguments` is derived from the tool's own input schema (the one its
//! worker reports in `ListTools`), and the conversion of a call's JSON arguments into the
//! Cedar context (typed, normalised, with a few derived facts).
//!
//! The table below holds only what a JSON Schema cannot say: the worker group, which
//! string arguments are paths (normalised) or upper-cased, and which arguments policies
//! do not see ([`NOT_IN_CONTEXT`], each with its reason). Names, types and required flags
//! come from the worker's schema; [`super::declared`] checks them against
//! `deploy/policies/schema.cedarschema`, the policies' view.

use std::borrow::Cow;
use std::collections::HashSet;
use std::path::Path;

use serde_json::{Map, Value, json};

use crate::paths::normalize_path;

/// The type of one argument field, as the schema declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Str,
    /// A string that is upper-cased (http methods).
    Upper,
    /// A workspace path, lexically normalised.
    Path,
    Long,
    Bool,
    StrSet,
    /// edit_file's `edits`: a set of `{old_text, new_text, replace_all?}`.
    Edits,
}

impl Kind {
    /// The Cedar type that holds this kind.
    pub(crate) fn cedar_type(self) -> &'static str {
        match self {
            Self::Str | Self::Upper | Self::Path => "String",
            Self::Long => "Long",
            Self::Bool => "Bool",
            Self::StrSet => "Set<String>",
            Self::Edits => "Set<Edit>",
        }
    }
}

/// Derived facts added beside `arguments`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Extra {
    None,
    /// `program`, `shell`, `env_names` (execute_shell).
    Shell,
    /// `url` parsed (http tools).
    Url,
}

/// One argument as policies see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Field {
    pub name: String,
    pub kind: Kind,
    pub required: bool,
}

#[derive(Debug)]
pub(crate) struct ToolSpec {
    pub name: Cow<'static, str>,
    /// The worker group that serves the tool.
    pub group: Cow<'static, str>,
    /// Arguments whose kind the JSON type alone does not say, in the order `paths`
    /// lists them.
    pub refined: &'static [(&'static str, Kind)],
    pub extra: Extra,
}

use Kind::{Edits, Path as P, Upper};

/// Every tool of the catalog (DESIGN §4), in the order of the table there.
pub(crate) static TOOLS: &[ToolSpec] = &[
    ToolSpec {
        name: Cow::Borrowed("execute_shell"),
        group: Cow::Borrowed("shell"),
        refined: &[("cwd", P)],
        extra: Extra::Shell,
    },
    fs("read_file", &[("path", P)]),
    fs("write_file", &[("path", P)]),
    fs("edit_file", &[("path", P), ("edits", Edits)]),
    fs("list_directory", &[("path", P)]),
    fs("search_files", &[("path", P)]),
    fs("get_file_info", &[("path", P)]),
    fs("create_directory", &[("path", P)]),
    fs("move_path", &[("source", P), ("destination", P)]),
    fs("delete_path", &[("path", P)]),
    ToolSpec {
        name: Cow::Borrowed("http_request"),
        group: Cow::Borrowed("http"),
        refined: &[("method", Upper)],
        extra: Extra::Url,
    },
    ToolSpec {
        name: Cow::Borrowed("fetch_url"),
        group: Cow::Borrowed("http"),
        refined: &[],
        extra: Extra::Url,
    },
    db("list_databases"),
    db("list_tables"),
    db("describe_table"),
    db("query_database"),
    db("execute_sql"),
];

const fn fs(name: &'static str, refined: &'static [(&'static str, Kind)]) -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed(name),
        group: Cow::Borrowed("fs"),
        refined,
        extra: Extra::None,
    }
}

const fn db(name: &'static str) -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed(name),
        group: Cow::Borrowed("db"),
        refined: &[],
        extra: Extra::None,
    }
}

/// Arguments a worker's input schema has that policies do not see in
/// `context.arguments`, each with the reason: `(tool, argument, why)`. Any other schema
/// argument that Cedar cannot type is a defect — a new argument silently invisible to
/// policy — and [`fields`] refuses it.
pub static NOT_IN_CONTEXT: &[(&str, &str, &str)] = &[
    (
        "execute_shell",
        "env",
        "values may be secrets; policies see the names as context.env_names",
    ),
    (
        "http_request",
        "headers",
        "values may be credentials; an override of the method is refused before policy",
    ),
    (
        "http_request",
        "body",
        "free content, unbounded in shape; a body on a safe method counts as a write",
    ),
    (
        "query_database",
        "params",
        "values bound to the statement's placeholders: data, not the statement; rules judge sql",
    ),
    (
        "execute_sql",
        "params",
        "values bound to the statement's placeholders: data, not the statement; rules judge sql",
    ),
];

/// The spec of a tool the schema declares, if any.
pub(crate) fn spec(tool: &str) -> Option<&'static ToolSpec> {
    TOOLS.iter().find(|spec| spec.name == tool)
}

fn left_out(tool: &str, argument: &str) -> bool {
    NOT_IN_CONTEXT
        .iter()
        .any(|(t, a, _)| *t == tool && *a == argument)
}

/// An object schema's `properties` (or `empty`) and the names its top-level `required`
/// lists.
pub(crate) fn properties_and_required<'a>(
    input_schema: &'a Value,
    empty: &'a Map<String, Value>,
) -> (&'a Map<String, Value>, HashSet<&'a str>) {
    let properties = input_schema
        .get("properties")
        .and_then(Value::as_object)
        .unwrap_or(empty);
    let required = input_schema
        .get("required")
        .and_then(Value::as_array)
        .map(|names| names.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    (properties, required)
}

/// The arguments policies see of a tool whose worker reports `input_schema`: every
/// property of the schema but those [`NOT_IN_CONTEXT`] leaves out, required as the
/// schema's top-level `required` says, typed by the schema (`number` as `Long`: Cedar
/// has no fractions) and refined by the table. `Err` lists every argument that cannot
/// be seen, so that a new argument is never silently invisible to policy.
pub(crate) fn fields(spec: &ToolSpec, input_schema: &Value) -> Result<Vec<Field>, Vec<String>> {
    let tool = &*spec.name;
    let empty = Map::new();
    let (properties, required) = properties_and_required(input_schema, &empty);
    let mut problems = Vec::new();
    let mut fields = Vec::new();
    // Refined arguments first, in the table's order (`context.paths` follows it).
    for (name, kind) in spec.refined {
        let Some(property) = properties.get(*name) else {
            problems.push(format!(
                "`{tool}.{name}`: the policy table refines it, the worker's schema has no such argument"
            ));
            continue;
        };
        let expected = if *kind == Kind::Edits {
            "array"
        } else {
            "string"
        };
        if json_type(property) != Some(expected) {
            problems.push(format!(
                "`{tool}.{name}`: the policy reads it as {}, the worker's schema types it {}",
                kind.cedar_type(),
                describe(property)
            ));
            continue;
        }
        fields.push(Field {
            name: (*name).to_owned(),
            kind: *kind,
            required: required.contains(name),
        });
    }
    for (name, property) in properties {
        if left_out(tool, name) || spec.refined.iter().any(|(r, _)| r == name) {
            continue;
        }
        let kind = match json_type(property) {
            Some("string") => Kind::Str,
            Some("integer" | "number") => Kind::Long,
            Some("boolean") => Kind::Bool,
            Some("array") if property.pointer("/items/type") == Some(&json!("string")) => {
                Kind::StrSet
            }
            _ => {
                problems.push(format!(
                    "`{tool}.{name}`: a {} argument that Cedar cannot type; the policy table must leave it out of context.arguments with its reason (NOT_IN_CONTEXT)",
                    describe(property)
                ));
                continue;
            }
        };
        fields.push(Field {
            name: name.clone(),
            kind,
            required: required.contains(name.as_str()),
        });
    }
    for (t, name, _) in NOT_IN_CONTEXT {
        if *t == tool && !properties.contains_key(*name) {
            problems.push(format!(
                "`{tool}.{name}`: left out of policy on purpose, but the worker's schema has no such argument"
            ));
        }
    }
    if problems.is_empty() {
        Ok(fields)
    } else {
        Err(problems)
    }
}

/// A property's one JSON type (`["string", "null"]` counts as `string`).
pub(crate) fn json_type(property: &Value) -> Option<&str> {
    match property.get("type")? {
        Value::String(one) => Some(one),
        Value::Array(many) => {
            let mut types = many
                .iter()
                .filter_map(Value::as_str)
                .filter(|t| *t != "null");
            let first = types.next()?;
            types.next().is_none().then_some(first)
        }
        _ => None,
    }
}

fn describe(property: &Value) -> String {
    match property.get("type") {
        Some(ty) => format!("`{ty}`"),
        None => "untyped".to_owned(),
    }
}

/// Why a call's arguments cannot be handed to the policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgumentError {
    #[error("the arguments of `{tool}` are not a JSON object")]
    NotAnObject { tool: String },
    #[error("argument `{field}` of `{tool}` is missing")]
    Missing { tool: String, field: String },
    #[error("argument `{field}` of `{tool}` must be {expected}")]
    WrongType {
        tool: String,
        field: String,
        expected: &'static str,
    },
    #[error("argument `url` of `{tool}` is not a valid absolute url: {message}")]
    BadUrl { tool: String, message: String },
}

/// Builds the JSON form of the Cedar context of one call (to be parsed against the
/// schema with the action of `spec`).
pub(crate) fn context_json(
    spec: &ToolSpec,
    fields: &[Field],
    arguments: &Value,
    session_id: &str,
    workspace: Option<&Path>,
    network: Option<&str>,
) -> Result<Value, ArgumentError> {
    let empty = Map::new();
    let object = match arguments {
        Value::Object(object) => object,
        // A tool without arguments may be called with `null`.
        Value::Null if fields.iter().all(|field| !field.required) => &empty,
        _ => {
            return Err(ArgumentError::NotAnObject {
                tool: spec.name.to_string(),
            });
        }
    };
    let workspace = workspace.and_then(Path::to_str);
    let mut projected = Map::new();
    for field in fields {
        match object.get(&field.name) {
            // JSON Schema lets optional fields be absent; `null` counts as absent too.
            None | Some(Value::Null) => {
                if field.required {
                    return Err(ArgumentError::Missing {
                        tool: spec.name.to_string(),
                        field: field.name.clone(),
                    });
                }
            }
            Some(value) => {
                let converted = convert(&spec.name, &field.name, field.kind, value, workspace)?;
                projected.insert(field.name.to_owned(), converted);
            }
        }
    }
    let mut context = Map::new();
    context.insert("session_id".to_owned(), Value::from(session_id));
    // The network the call's sandbox has (execute_shell and declared command tools).
    if let Some(network) = network {
        context.insert("network".to_owned(), Value::from(network));
    }
    if spec.group == "fs" {
        // Every path the call touches, so that one rule covers every fs tool (move_path
        // has `source` and `destination`, not `path`).
        let paths: Vec<Value> = fields
            .iter()
            .filter(|field| field.kind == Kind::Path)
            .filter_map(|field| projected.get(&field.name).cloned())
            .collect();
        context.insert("paths".to_owned(), Value::Array(paths));
    }
    match spec.extra {
        Extra::None => {}
        Extra::Shell => shell_facts(&spec.name, object, &mut context)?,
        Extra::Url => {
            let raw = object
                .get("url")
                .and_then(Value::as_str)
                .unwrap_or_default();
            context.insert("url".to_owned(), parse_url(&spec.name, raw)?);
        }
    }
    context.insert("arguments".to_owned(), Value::Object(projected));
    Ok(Value::Object(context))
}

fn wrong(tool: &str, field: &str, expected: &'static str) -> ArgumentError {
    ArgumentError::WrongType {
        tool: tool.to_owned(),
        field: field.to_owned(),
        expected,
    }
}

fn convert(
    tool: &str,
    field: &str,
    kind: Kind,
    value: &Value,
    workspace: Option<&str>,
) -> Result<Value, ArgumentError> {
    match kind {
        Kind::Str => value
            .as_str()
            .map(Value::from)
            .ok_or_else(|| wrong(tool, field, "a string")),
        Kind::Upper => value
            .as_str()
            .map(|text| Value::from(text.to_ascii_uppercase()))
            .ok_or_else(|| wrong(tool, field, "a string")),
        Kind::Path => value
            .as_str()
            .map(|text| Value::from(normalize_path(text, workspace)))
            .ok_or_else(|| wrong(tool, field, "a string")),
        Kind::Long => value
            .as_i64()
            .map(Value::from)
            .ok_or_else(|| wrong(tool, field, "an integer")),
        Kind::Bool => value
            .as_bool()
            .map(Value::from)
            .ok_or_else(|| wrong(tool, field, "a boolean")),
        Kind::StrSet => {
            let items = value
                .as_array()
                .ok_or_else(|| wrong(tool, field, "an array of strings"))?;
            items
                .iter()
                .map(|item| {
                    item.as_str()
                        .map(Value::from)
                        .ok_or_else(|| wrong(tool, field, "an array of strings"))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Value::Array)
        }
        Kind::Edits => {
            let expected = "an array of {old_text, new_text, replace_all?}";
            let items = value
                .as_array()
                .ok_or_else(|| wrong(tool, field, expected))?;
            let mut edits = Vec::with_capacity(items.len());
            for item in items {
                let old_text = item.get("old_text").and_then(Value::as_str);
                let new_text = item.get("new_text").and_then(Value::as_str);
                let (Some(old_text), Some(new_text)) = (old_text, new_text) else {
                    return Err(wrong(tool, field, expected));
                };
                let mut edit = json!({ "old_text": old_text, "new_text": new_text });
                match item.get("replace_all") {
                    None | Some(Value::Null) => {}
                    Some(Value::Bool(all)) => {
                        edit["replace_all"] = Value::Bool(*all);
                    }
                    Some(_) => return Err(wrong(tool, field, expected)),
                }
                edits.push(edit);
            }
            Ok(Value::Array(edits))
        }
    }
}

/// `program`, `shell` and `env_names` of an execute_shell call.
fn shell_facts(
    tool: &str,
    arguments: &Map<String, Value>,
    context: &mut Map<String, Value>,
) -> Result<(), ArgumentError> {
    let argv0 = arguments
        .get("argv")
        .and_then(Value::as_array)
        .and_then(|argv| argv.first())
        .and_then(Value::as_str);
    let command = arguments.get("command").and_then(Value::as_str);
    let program = match (argv0, command) {
        (Some(argv0), _) => program_name(argv0),
        (None, Some(command)) => command_program(command),
        (None, None) => String::new(),
    };
    let env_names = match arguments.get("env") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Object(env)) => env.keys().cloned().map(Value::from).collect(),
        Some(_) => return Err(wrong(tool, "env", "an object")),
    };
    context.insert("program".to_owned(), Value::from(program));
    context.insert("shell".to_owned(), Value::Bool(command.is_some()));
    context.insert("env_names".to_owned(), Value::Array(env_names));
    Ok(())
}

/// The last path segment of a program path: `/usr/bin/curl` → `curl`.
fn program_name(argv0: &str) -> String {
    argv0.rsplit('/').next().unwrap_or(argv0).to_owned()
}

/// Best-effort program of a shell string: its first word that is not a `NAME=value`
/// assignment, unquoted, as [`program_name`].
fn command_program(command: &str) -> String {
    command
        .split_whitespace()
        .find(|word| {
            let assignment = word
                .split_once('=')
                .is_some_and(|(name, _)| !name.is_empty() && !name.contains(['/', '"', '\'']));
            !assignment
        })
        .map(|word| program_name(word.trim_matches(|c| c == '"' || c == '\'')))
        .unwrap_or_default()
}

/// `context.url`: the URL read as the http worker reads it (trimmed; the host as it
/// connects to it), so that a rule on a host or a path holds for every spelling of it.
fn parse_url(tool: &str, raw: &str) -> Result<Value, ArgumentError> {
    let url = crate::http_url::parse(raw).map_err(|error| ArgumentError::BadUrl {
        tool: tool.to_owned(),
        message: error.to_string(),
    })?;
    let host = crate::http_url::host(&url).map(|h| h.to_string());
    Ok(json!({
        "scheme": url.scheme(),
        "host": host.unwrap_or_default(),
        "port": url.port_or_known_default().map_or(0, i64::from),
        "path": url.path(),
        "query": url.query().unwrap_or_default(),
    }))
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_built_in_names_are_the_catalogs() {
        let names: Vec<&str> = TOOLS.iter().map(|spec| &*spec.name).collect();
        assert_eq!(names, crate::tool::BUILT_IN_TOOLS);
    }
    use super::*;

    fn fields_of(tool: &str) -> (&'static ToolSpec, Vec<Field>) {
        let spec = spec(tool).unwrap();
        let schema = crate::authz::expected_input_schema(tool).unwrap();
        (spec, fields(spec, &schema).unwrap())
    }

    fn context(tool: &str, arguments: &Value, workspace: Option<&Path>) -> Value {
        let (spec, fields) = fields_of(tool);
        context_json(spec, &fields, arguments, "s1", workspace, None).unwrap()
    }

    #[test]
    fn fs_calls_carry_every_path_they_name() {
        let ws = Some(Path::new("/data/workspaces/alice/s1"));
        let moved = context(
            "move_path",
            &json!({"source": "./.env", "destination": "/data/workspaces/alice/s1/pub/x"}),
            ws,
        );
        assert_eq!(moved["paths"], json!([".env", "pub/x"]));
        assert_eq!(moved["arguments"]["source"], ".env");
        assert_eq!(moved["arguments"]["destination"], "pub/x");
        let read = context("read_file", &json!({"path": "src/h/../../.git/config"}), ws);
        assert_eq!(read["paths"], json!([".git/config"]));
        // Only fs tools have `paths`; the shell's `cwd` stays an argument.
        let shell = context("execute_shell", &json!({"argv": ["ls"], "cwd": "src"}), ws);
        assert!(shell.get("paths").is_none());
    }

    #[test]
    fn shell_programs_are_found() {
        assert_eq!(program_name("/usr/bin/curl"), "curl");
        assert_eq!(program_name("rm"), "rm");
        assert_eq!(command_program("  rm -rf /"), "rm");
        assert_eq!(command_program("FOO=1 BAR=2 /usr/bin/wget x"), "wget");
        assert_eq!(command_program("'curl' x"), "curl");
        assert_eq!(command_program(""), "");
    }

    #[test]
    fn urls_are_parsed_with_lower_case_hosts() {
        let url = parse_url("fetch_url", "HTTPS://API.Example.com/v1?q=1").unwrap();
        assert_eq!(url["host"], "api.example.com");
        assert_eq!(url["scheme"], "https");
        assert_eq!(url["port"], 443);
        assert_eq!(url["path"], "/v1");
        assert_eq!(url["query"], "q=1");
        let userinfo = parse_url("fetch_url", "https://api.example.com@evil.test/").unwrap();
        assert_eq!(userinfo["host"], "evil.test");
        assert!(parse_url("fetch_url", "not a url").is_err());
    }

    #[test]
    fn wrong_types_and_missing_fields_are_refused() {
        let (read, fields) = fields_of("read_file");
        assert!(matches!(
            context_json(read, &fields, &json!({}), "s", None, None),
            Err(ArgumentError::Missing { ref field, .. }) if field == "path"
        ));
        assert!(matches!(
            context_json(read, &fields, &json!({"path": 3}), "s", None, None),
            Err(ArgumentError::WrongType { .. })
        ));
        assert!(matches!(
            context_json(
                read,
                &fields,
                &json!({"path": "a", "limit": 1.5}),
                "s",
                None,
                None
            ),
            Err(ArgumentError::WrongType { .. })
        ));
        assert!(matches!(
            context_json(read, &fields, &json!([]), "s", None, None),
            Err(ArgumentError::NotAnObject { .. })
        ));
        let (none, fields) = fields_of("list_databases");
        assert!(context_json(none, &fields, &Value::Null, "s", None, None).is_ok());
    }
}
