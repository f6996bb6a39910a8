//! `[[tools]]` entries as `airlock.toml` spells them (DESIGN §11): the part every
//! declared tool shares — name, description, input schema, annotations — and its
//! checks. The shell worker serves the entries with `command`, the http worker those
//! with `http`; the orchestrator derives each tool's Cedar action from the same entry.

use std::collections::{BTreeMap, BTreeSet};

use airlock_policy::{ToolAnnotations, ToolDefinition};
use serde::Deserialize;
use serde_json::{Map, Value};

/// Why a declared tool cannot be served; a start-up error naming the tool.
#[derive(Debug, thiserror::Error)]
pub enum DeclaredToolError {
    #[error("[[tools]] {tool}: {reason}")]
    Invalid { tool: String, reason: String },
    #[error("tool_packs: unknown pack {pack:?} (known: {known})")]
    UnknownPack { pack: String, known: String },
    #[error("the {pack} pack cannot be read: {reason}")]
    Pack { pack: String, reason: String },
}

/// Network a command tool's sandbox has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolNetwork {
    /// Only its own loopback, like `execute_shell` (the default).
    #[default]
    None,
    /// Egress through the shell worker's proxy (DESIGN §12), where `[sandbox] network =
    /// "proxy"`: the hosts `[sandbox.egress] allow` names, narrowed by `egress_allow`.
    Proxy,
}

/// Annotations as `[[tools]]` spells them; each defaults to false.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AnnotationsEntry {
    pub read_only: bool,
    pub destructive: bool,
    pub idempotent: bool,
    pub open_world: bool,
}

/// One `[[tools]]` entry: `command` (the shell worker's) or `http` (the http worker's).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolEntry {
    pub name: String,
    #[serde(default)]
    pub title: Option<String>,
    pub description: String,
    /// The JSON Schema of the arguments (a TOML table).
    pub input_schema: Value,
    #[serde(default)]
    pub annotations: AnnotationsEntry,
    /// Whether every call waits for a human's approval; by default, when the tool is
    /// destructive.
    #[serde(default)]
    pub approval: Option<bool>,
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// `"{field}"`: that (string) argument on standard input.
    #[serde(default)]
    pub stdin: Option<String>,
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    /// Fixed environment variables (the operator's; no argument reaches them).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub network: ToolNetwork,
    /// The hosts a `network = "proxy"` tool may reach: patterns as `[sandbox.egress]
    /// allow`, and only those that list also allows (DESIGN §12).
    #[serde(default)]
    pub egress_allow: Option<Vec<String>>,
    /// An HTTP-backed tool (`{ method, url, headers, body }`), served by the http worker.
    #[serde(default)]
    pub http: Option<Value>,
}

impl ToolEntry {
    /// Whether the shell worker serves the entry.
    pub fn is_command(&self) -> bool {
        self.command.is_some()
    }

    /// Whether the http worker serves the entry.
    pub fn is_http(&self) -> bool {
        self.http.is_some()
    }

    /// The worker group that serves the entry.
    pub fn group(&self) -> &'static str {
        if self.is_http() { "http" } else { "shell" }
    }

    fn invalid(&self, reason: impl Into<String>) -> DeclaredToolError {
        DeclaredToolError::Invalid {
            tool: self.name.clone(),
            reason: reason.into(),
        }
    }

    /// The checks every declared tool passes, and the definition the catalog shows: a
    /// valid name that is not a built-in's, exactly one of `command` and `http`, a
    /// description, and an input schema that is valid JSON Schema for an object.
    pub fn definition(&self) -> Result<ToolDefinition, DeclaredToolError> {
        airlock_policy::names::validate_tool_name(&self.name)
            .map_err(|e| self.invalid(e.to_string()))?;
        if airlock_policy::tool::BUILT_IN_TOOLS.contains(&self.name.as_str()) {
            return Err(self.invalid(format!(
                "{} is a built-in tool; choose another name",
                self.name
            )));
        }
        match (self.is_command(), self.is_http()) {
            (true, true) => return Err(self.invalid("give either command or http, not both")),
            (false, false) => {
                return Err(self.invalid(
                    "give command (a program run in the shell sandbox) or http (a request)",
                ));
            }
            _ => {}
        }
        if self.description.trim().is_empty() {
            return Err(self.invalid(
                "the description is empty; it is what the model reads to choose the tool",
            ));
        }
        schema_properties(&self.input_schema).map_err(|reason| self.invalid(reason))?;
        let annotations = &self.annotations;
        Ok(ToolDefinition {
            name: self.name.clone(),
            title: self.title.clone().unwrap_or_else(|| self.name.clone()),
            description: self.description.trim().to_owned(),
            input_schema: self.input_schema.clone(),
            annotations: ToolAnnotations {
                read_only: annotations.read_only,
                destructive: annotations.destructive,
                idempotent: annotations.idempotent,
                open_world: annotations.open_world,
            },
        })
    }

    /// `properties` of the entry's input schema (checked by [`Self::definition`]).
    pub fn properties(&self) -> Result<Map<String, Value>, DeclaredToolError> {
        schema_properties(&self.input_schema).map_err(|reason| self.invalid(reason))
    }

    /// Why every call of this tool needs approval, or `None`: `approval`, by default
    /// true for a destructive tool.
    pub fn approval_reason(&self) -> Option<String> {
        match self.approval {
            Some(true) => Some(format!("[[tools]] {} says approval = true", self.name)),
            Some(false) => None,
            None if self.annotations.destructive => Some(format!(
                "{} is a declared destructive tool, which needs approval unless its entry says approval = false",
                self.name
            )),
            None => None,
        }
    }
}

/// Every name of `entries` once: a name defined twice (in `[[tools]]` or a pack) is an
/// error naming it.
pub fn check_unique(entries: &[ToolEntry]) -> Result<(), DeclaredToolError> {
    let mut seen = BTreeSet::new();
    for entry in entries {
        if !seen.insert(entry.name.as_str()) {
            return Err(entry.invalid("defined twice (in [[tools]] or a pack of tool_packs)"));
        }
    }
    Ok(())
}

/// `{name}` with a name of letters, digits and `_` (not starting with a digit).
pub fn placeholder(text: &str) -> Option<&str> {
    let name = text.strip_prefix('{')?.strip_suffix('}')?;
    let mut chars = name.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic() || first == '_')
        .then_some(())
        .filter(|()| chars.all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .map(|()| name)
}

/// Whether `text` holds something that looks like a placeholder anywhere.
pub fn mentions_placeholder(text: &str) -> bool {
    text.char_indices().any(|(start, c)| {
        c == '{'
            && text[start..]
                .find('}')
                .is_some_and(|end| placeholder(&text[start..=start + end]).is_some())
    })
}

/// `properties` of an object schema that is itself valid JSON Schema.
fn schema_properties(schema: &Value) -> Result<Map<String, Value>, String> {
    if let Err(e) = jsonschema::meta::validate(schema) {
        return Err(format!("input_schema is not valid JSON Schema: {e}"));
    }
    if let Err(e) = jsonschema::validator_for(schema) {
        return Err(format!("input_schema cannot be compiled: {e}"));
    }
    if schema.get("type") != Some(&Value::from("object")) {
        return Err("input_schema must have \"type\": \"object\"".into());
    }
    Ok(schema
        .get("properties")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default())
}

/// `Ok` when `properties` has `field`; else why, naming `place` and the fields there are.
pub fn check_field(
    properties: &Map<String, Value>,
    field: &str,
    place: &str,
) -> Result<(), String> {
    if properties.contains_key(field) {
        Ok(())
    } else {
        let known: BTreeSet<&str> = properties.keys().map(String::as_str).collect();
        Err(format!(
            "{place} names the field {field:?}, which input_schema.properties lacks (it has: {})",
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.into_iter().collect::<Vec<_>>().join(", ")
            }
        ))
    }
}
