//! The tool catalog as policies see it: which tools the schema declares, the shape of
//! each tool's `context.arguments`, and the conversion of a call's JSON arguments into
//! the Cedar context (typed, normalised, with a few derived facts).
//!
//! This table mirrors `deploy/policies/schema.cedarschema`; a unit test checks that
//! the two agree (every tool of the table is an action of the schema and a maximal
//! argument object of each tool is accepted as its context).

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

/// Derived facts added beside `arguments`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Extra {
    None,
    /// `program`, `shell`, `env_names` (execute_shell).
    Shell,
    /// `url` parsed (http tools).
    Url,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Field {
    pub name: &'static str,
    pub kind: Kind,
    pub required: bool,
}

#[derive(Debug)]
pub(crate) struct ToolSpec {
    pub name: &'static str,
    /// The worker group that serves the tool.
    pub group: &'static str,
    pub fields: &'static [Field],
    pub extra: Extra,
}

const fn req(name: &'static str, kind: Kind) -> Field {
    Field {
        name,
        kind,
        required: true,
    }
}

const fn opt(name: &'static str, kind: Kind) -> Field {
    Field {
        name,
        kind,
        required: false,
    }
}

use Kind::{Bool, Edits, Long, Path as P, Str, StrSet, Upper};

/// Every tool of the catalog (DESIGN §4), in the order of the table there.
pub(crate) static TOOLS: &[ToolSpec] = &[
    ToolSpec {
        name: "execute_shell",
        group: "shell",
        fields: &[
            opt("command", Str),
            opt("argv", StrSet),
            opt("cwd", P),
            opt("stdin", Str),
            opt("timeout_seconds", Long),
        ],
        extra: Extra::Shell,
    },
    ToolSpec {
        name: "read_file",
        group: "fs",
        fields: &[req("path", P), opt("offset", Long), opt("limit", Long)],
        extra: Extra::None,
    },
    ToolSpec {
        name: "write_file",
        group: "fs",
        fields: &[req("path", P), req("content", Str)],
        extra: Extra::None,
    },
    ToolSpec {
        name: "edit_file",
        group: "fs",
        fields: &[req("path", P), req("edits", Edits), opt("dry_run", Bool)],
        extra: Extra::None,
    },
    ToolSpec {
        name: "list_directory",
        group: "fs",
        fields: &[
            req("path", P),
            opt("recursive", Bool),
            opt("max_entries", Long),
        ],
        extra: Extra::None,
    },
    ToolSpec {
        name: "search_files",
        group: "fs",
        fields: &[
            req("path", P),
            opt("glob", Str),
            opt("content_regex", Str),
            opt("max_results", Long),
        ],
        extra: Extra::None,
    },
    ToolSpec {
        name: "get_file_info",
        group: "fs",
        fields: &[req("path", P)],
        extra: Extra::None,
    },
    ToolSpec {
        name: "create_directory",
        group: "fs",
        fields: &[req("path", P)],
        extra: Extra::None,
    },
    ToolSpec {
        name: "move_path",
        group: "fs",
        fields: &[req("source", P), req("destination", P)],
        extra: Extra::None,
    },
    ToolSpec {
        name: "delete_path",
        group: "fs",
        fields: &[req("path", P), opt("recursive", Bool)],
        extra: Extra::None,
    },
    ToolSpec {
        name: "http_request",
        group: "http",
        fields: &[
            req("method", Upper),
            req("url", Str),
            opt("timeout_seconds", Long),
            opt("max_response_bytes", Long),
        ],
        extra: Extra::Url,
    },
    ToolSpec {
        name: "fetch_url",
        group: "http",
        fields: &[
            req("url", Str),
            opt("format", Str),
            opt("start_index", Long),
            opt("max_length", Long),
        ],
        extra: Extra::Url,
    },
    ToolSpec {
        name: "list_databases",
        group: "db",
        fields: &[],
        extra: Extra::None,
    },
    ToolSpec {
        name: "list_tables",
        group: "db",
        fields: &[req("database", Str)],
        extra: Extra::None,
    },
    ToolSpec {
        name: "describe_table",
        group: "db",
        fields: &[req("database", Str), req("table", Str)],
        extra: Extra::None,
    },
    ToolSpec {
        name: "query_database",
        group: "db",
        fields: &[req("database", Str), req("sql", Str), opt("max_rows", Long)],
        extra: Extra::None,
    },
    ToolSpec {
        name: "execute_sql",
        group: "db",
        fields: &[req("database", Str), req("sql", Str)],
        extra: Extra::None,
    },
];

/// Arguments a worker's input schema has that policies do not see in
/// `context.arguments`, each with the reason: `(tool, argument, why)`. Any other schema
/// argument missing from [`TOOLS`] is a defect — a new argument silently invisible to
/// policy — and the catalog test fails on it.
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

/// The arguments of `tool` that policies see in `context.arguments`, as `(name,
/// required)`, or `None` for a tool the policy table does not know.
pub fn policy_arguments(tool: &str) -> Option<Vec<(&'static str, bool)>> {
    spec(tool).map(|spec| {
        spec.fields
            .iter()
            .map(|field| (field.name, field.required))
            .collect()
    })
}

/// The spec of a tool the schema declares, if any.
pub(crate) fn spec(tool: &str) -> Option<&'static ToolSpec> {
    TOOLS.iter().find(|spec| spec.name == tool)
}

/// Why a call's arguments cannot be handed to the policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgumentError {
    #[error("the arguments of `{tool}` are not a JSON object")]
    NotAnObject { tool: String },
    #[error("argument `{field}` of `{tool}` is missing")]
    Missing { tool: String, field: &'static str },
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
    arguments: &Value,
    session_id: &str,
    workspace: Option<&Path>,
) -> Result<Value, ArgumentError> {
    let empty = Map::new();
    let object = match arguments {
        Value::Object(object) => object,
        // A tool without arguments may be called with `null`.
        Value::Null if spec.fields.iter().all(|field| !field.required) => &empty,
        _ => {
            return Err(ArgumentError::NotAnObject {
                tool: spec.name.to_owned(),
            });
        }
    };
    let workspace = workspace.and_then(Path::to_str);
    let mut projected = Map::new();
    for field in spec.fields {
        match object.get(field.name) {
            // JSON Schema lets optional fields be absent; `null` counts as absent too.
            None | Some(Value::Null) => {
                if field.required {
                    return Err(ArgumentError::Missing {
                        tool: spec.name.to_owned(),
                        field: field.name,
                    });
                }
            }
            Some(value) => {
                let converted = convert(spec.name, field.name, field.kind, value, workspace)?;
                projected.insert(field.name.to_owned(), converted);
            }
        }
    }
    let mut context = Map::new();
    context.insert("session_id".to_owned(), Value::from(session_id));
    if spec.group == "fs" {
        // Every path the call touches, so that one rule covers every fs tool (move_path
        // has `source` and `destination`, not `path`).
        let paths: Vec<Value> = spec
            .fields
            .iter()
            .filter(|field| field.kind == Kind::Path)
            .filter_map(|field| projected.get(field.name).cloned())
            .collect();
        context.insert("paths".to_owned(), Value::Array(paths));
    }
    match spec.extra {
        Extra::None => {}
        Extra::Shell => shell_facts(spec.name, object, &mut context)?,
        Extra::Url => {
            let raw = object
                .get("url")
                .and_then(Value::as_str)
                .unwrap_or_default();
            context.insert("url".to_owned(), parse_url(spec.name, raw)?);
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

fn parse_url(tool: &str, raw: &str) -> Result<Value, ArgumentError> {
    let url = url::Url::parse(raw).map_err(|error| ArgumentError::BadUrl {
        tool: tool.to_owned(),
        message: error.to_string(),
    })?;
    Ok(json!({
        "scheme": url.scheme(),
        "host": url.host_str().unwrap_or_default(),
        "port": url.port_or_known_default().map_or(0, i64::from),
        "path": url.path(),
        "query": url.query().unwrap_or_default(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fs_calls_carry_every_path_they_name() {
        let ws = Some(Path::new("/data/workspaces/alice/s1"));
        let moved = context_json(
            spec("move_path").unwrap(),
            &json!({"source": "./.env", "destination": "/data/workspaces/alice/s1/pub/x"}),
            "s1",
            ws,
        )
        .unwrap();
        assert_eq!(moved["paths"], json!([".env", "pub/x"]));
        assert_eq!(moved["arguments"]["source"], ".env");
        assert_eq!(moved["arguments"]["destination"], "pub/x");
        let read = context_json(
            spec("read_file").unwrap(),
            &json!({"path": "src/h/../../.git/config"}),
            "s1",
            ws,
        )
        .unwrap();
        assert_eq!(read["paths"], json!([".git/config"]));
        // Only fs tools have `paths`; the shell's `cwd` stays an argument.
        let shell = context_json(
            spec("execute_shell").unwrap(),
            &json!({"argv": ["ls"], "cwd": "src"}),
            "s1",
            ws,
        )
        .unwrap();
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
        let read = spec("read_file").unwrap();
        assert!(matches!(
            context_json(read, &json!({}), "s", None),
            Err(ArgumentError::Missing { field: "path", .. })
        ));
        assert!(matches!(
            context_json(read, &json!({"path": 3}), "s", None),
            Err(ArgumentError::WrongType { .. })
        ));
        assert!(matches!(
            context_json(read, &json!({"path": "a", "limit": 1.5}), "s", None),
            Err(ArgumentError::WrongType { .. })
        ));
        assert!(matches!(
            context_json(read, &json!([]), "s", None),
            Err(ArgumentError::NotAnObject { .. })
        ));
        let none = spec("list_databases").unwrap();
        assert!(context_json(none, &Value::Null, "s", None).is_ok());
    }
}
