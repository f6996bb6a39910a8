//! MCP servers behind the gate (DESIGN §11): the `[[mcp_servers]]` entry as
//! `airlock.toml` spells it, and the translation between an MCP server's tools and
//! results and Airlock's, in one place for every worker that talks to such servers.
//!
//! A server's tool `t` is served as `<name>__t`. Its MCP annotations are hints from an
//! untrusted party; they are read with MCP's own defaults (a tool is not read-only and
//! is destructive unless it says otherwise), and the orchestrator holds every tool not
//! marked read-only for approval unless the operator's entry says otherwise.

use std::collections::{BTreeMap, BTreeSet};

use airlock_policy::{McpServerPolicy, ToolAnnotations, ToolDefinition, ToolOutcome};
use serde::Deserialize;
use serde_json::{Value, json};

mod sessions;

pub use sessions::{IdleSince, ListedTools, SessionKey, SessionSlot, evict_idle, session_key};

/// Between a server's name and its tool's: `time__get_current_time`.
pub const SEPARATOR: &str = "__";

/// Most tools served of one server.
pub const MAX_TOOLS: usize = 1000;
/// Most `tools/list` pages read of one server.
pub const MAX_PAGES: usize = 100;
/// Longest definition of one tool served (its `tools/list` entry as JSON). A worker
/// lists all its tools in one gRPC answer of at most 32 MiB: a server must not be able
/// to grow it past that (the orchestrator would then count the whole group as down).
pub const MAX_DEFINITION_BYTES: usize = 64 * 1024;
/// Most bytes of definitions served of one server, all its tools together.
pub const MAX_SERVER_DEFINITIONS_BYTES: usize = 2 * 1024 * 1024;

/// Longest server name: the tool names built from it must fit in 64 characters.
const MAX_SERVER_NAME: usize = 32;

/// Why an `[[mcp_servers]]` entry cannot be served: a start-up error naming the entry.
#[derive(Debug, thiserror::Error)]
pub enum McpEntryError {
    #[error("[[mcp_servers]] {server}: {reason}")]
    Invalid { server: String, reason: String },
}

/// One `[[mcp_servers]]` entry.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpServerEntry {
    /// The prefix of its tools' names: letters, digits and `-`.
    pub name: String,
    /// A stdio server: program and arguments, run by the shell worker in the sandbox.
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// A Streamable HTTP server's URL (`http://` or `https://`), reached by the http
    /// worker under its egress rules.
    #[serde(default)]
    pub url: Option<String>,
    /// Headers of every request to a Streamable HTTP server; values may name secrets
    /// as `${env:NAME}` or `${file:/path}`, which only the http worker reads.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Fixed environment variables of a stdio server (the operator's; no secret
    /// belongs here, the sandbox's environment is visible to the server's code).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// One server per session (with that session's workspace at `/workspace`), for
    /// servers that keep state or touch files; `false`: one server for every call,
    /// with an empty workspace of its own.
    #[serde(default = "default_per_session")]
    pub per_session: bool,
    /// Whether every call of its tools waits for a human: by default, the calls of
    /// every tool the server does not mark read-only.
    #[serde(default)]
    pub approval: Option<bool>,
    /// A session's server is stopped after this long without a call.
    #[serde(default = "default_idle_seconds")]
    pub idle_seconds: u64,
    /// Servers of this entry that run at once (one per session); a call of a further
    /// session stops the longest idle one, or waits for none and fails.
    #[serde(default = "default_max_sessions")]
    pub max_sessions: usize,
    /// How long the server may take to start and answer `initialize` and `tools/list`.
    #[serde(default = "default_start_timeout_seconds")]
    pub start_timeout_seconds: u64,
}

fn default_per_session() -> bool {
    true
}

fn default_idle_seconds() -> u64 {
    300
}

fn default_max_sessions() -> usize {
    8
}

fn default_start_timeout_seconds() -> u64 {
    30
}

impl McpServerEntry {
    /// Checks one entry; `Ok` means a worker can try to start it.
    pub fn check(&self) -> Result<(), McpEntryError> {
        let invalid = |reason: String| McpEntryError::Invalid {
            server: self.name.clone(),
            reason,
        };
        let name_ok = !self.name.is_empty()
            && self.name.len() <= MAX_SERVER_NAME
            && self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !self.name.starts_with('-');
        if !name_ok {
            return Err(invalid(format!(
                "name {:?} must be 1 to {MAX_SERVER_NAME} letters, digits or '-' (not first): \
                 its tools are named <name>{SEPARATOR}<tool>",
                self.name
            )));
        }
        match (&self.command, &self.url) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "give either command (a stdio server) or url (a Streamable HTTP server), not both"
                        .into(),
                ));
            }
            (None, None) => {
                return Err(invalid(
                    "give command (a stdio server's program and arguments) or url".into(),
                ));
            }
            (None, Some(url)) => {
                check_url(url).map_err(|reason| invalid(format!("url {url:?}: {reason}")))?;
                if !self.env.is_empty() {
                    return Err(invalid(
                        "env is for a stdio server's process; a Streamable HTTP server takes \
                         headers"
                            .into(),
                    ));
                }
            }
            (Some(command), None) => {
                let Some(program) = command.first() else {
                    return Err(invalid("command is empty; give the program first".into()));
                };
                if program.is_empty() {
                    return Err(invalid("command's program is empty".into()));
                }
                if command.iter().any(|a| a.contains('\0')) {
                    return Err(invalid("command may not contain NUL bytes".into()));
                }
                if !self.headers.is_empty() {
                    return Err(invalid(
                        "headers are for a Streamable HTTP server (url); a stdio server takes env"
                            .into(),
                    ));
                }
            }
        }
        for (key, value) in &self.env {
            let key_ok = !key.is_empty()
                && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !key.starts_with(|c: char| c.is_ascii_digit());
            if !key_ok || value.contains('\0') {
                return Err(invalid(format!(
                    "env {key:?} must be a variable name with a value without NUL bytes"
                )));
            }
        }
        if self.max_sessions == 0 {
            return Err(invalid("max_sessions must be at least 1".into()));
        }
        if self.idle_seconds == 0 || self.start_timeout_seconds == 0 {
            return Err(invalid(
                "idle_seconds and start_timeout_seconds must be positive".into(),
            ));
        }
        Ok(())
    }

    /// Whether the shell worker runs it (a stdio server).
    pub fn is_stdio(&self) -> bool {
        self.command.is_some()
    }

    /// Whether the http worker serves it (a Streamable HTTP server).
    pub fn is_http(&self) -> bool {
        self.command.is_none() && self.url.is_some()
    }

    /// The Airlock name of the server's tool `tool`, or why it cannot have one.
    pub fn tool_name(&self, tool: &str) -> Result<String, String> {
        let name = format!("{}{SEPARATOR}{tool}", self.name);
        airlock_policy::validate_tool_name(&name)
            .map(|()| name)
            .map_err(|e| e.to_string())
    }

    /// What policy needs of the entry: which tools are its and which need approval.
    pub fn policy(&self) -> McpServerPolicy {
        McpServerPolicy {
            name: self.name.clone(),
            approval: self.approval,
        }
    }

    /// The Airlock definition of one tool of the server's `tools/list` (a `Tool`
    /// object of the MCP schema), or why it cannot be served.
    pub fn definition(&self, tool: &Value) -> Result<ToolDefinition, String> {
        let mcp_name = tool
            .get("name")
            .and_then(Value::as_str)
            .ok_or("the tool has no name")?;
        let size = json_size(tool);
        if size > MAX_DEFINITION_BYTES {
            return Err(format!(
                "its definition is {size} bytes, more than the {MAX_DEFINITION_BYTES} a tool may take"
            ));
        }
        let name = self.tool_name(mcp_name)?;
        let schema = tool
            .get("inputSchema")
            .filter(|s| s.is_object())
            .cloned()
            .ok_or("the tool's inputSchema is not a JSON object")?;
        jsonschema::validator_for(&schema)
            .map_err(|e| format!("the tool's inputSchema is not valid JSON Schema: {e}"))?;
        let hints = tool.get("annotations").cloned().unwrap_or(Value::Null);
        let hint = |key: &str| hints.get(key).and_then(Value::as_bool);
        // MCP's defaults: readOnlyHint false, destructiveHint true, idempotentHint
        // false, openWorldHint true.
        let read_only = hint("readOnlyHint").unwrap_or(false);
        let title = tool
            .get("title")
            .or_else(|| hints.get("title"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        Ok(ToolDefinition {
            name,
            title: title.to_owned(),
            description: tool
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            input_schema: schema,
            annotations: ToolAnnotations {
                read_only,
                destructive: !read_only && hint("destructiveHint").unwrap_or(true),
                idempotent: hint("idempotentHint").unwrap_or(false),
                open_world: hint("openWorldHint").unwrap_or(true),
            },
        })
    }
}

/// Why `url` cannot be a Streamable HTTP server's address. Where it may go is the
/// http worker's egress policy's to say, at its start and on every request.
fn check_url(url: &str) -> Result<(), String> {
    let parsed = url::Url::parse(url.trim()).map_err(|e| format!("not a URL ({e})"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!(
            "the scheme is {:?}; a Streamable HTTP server's URL is http:// or https://",
            parsed.scheme()
        ));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(
            "it holds a user name or password; send credentials in headers, e.g. \
             headers = { Authorization = \"Bearer ${env:NAME}\" }"
                .into(),
        );
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err("it has no host".into());
    }
    if parsed.fragment().is_some() {
        return Err("a fragment (#…) is never sent; remove it".into());
    }
    Ok(())
}

/// Checks every entry and that no two share a name.
pub fn check_entries(entries: &[McpServerEntry]) -> Result<(), McpEntryError> {
    let mut seen = BTreeSet::new();
    for entry in entries {
        entry.check()?;
        if !seen.insert(entry.name.as_str()) {
            return Err(McpEntryError::Invalid {
                server: entry.name.clone(),
                reason: "the name is defined twice".into(),
            });
        }
    }
    Ok(())
}

/// The outcome of a `tools/call` answer (a `CallToolResult` object of the MCP schema):
/// text blocks as they are, other blocks described in text (the model reads text),
/// `structuredContent` as JSON when the server sent no text.
pub fn outcome(result: &Value) -> ToolOutcome {
    let mut content = Vec::new();
    for block in result
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let kind = block.get("type").and_then(Value::as_str).unwrap_or("");
        match (kind, block.get("text").and_then(Value::as_str)) {
            ("text", Some(text)) => content.push(text.to_owned()),
            _ => content.push(describe_block(kind, block)),
        }
    }
    if content.is_empty()
        && let Some(structured) = result.get("structuredContent")
    {
        content.push(structured.to_string());
    }
    ToolOutcome {
        is_error: result
            .get("isError")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        content,
        isolation: None,
        timed_out: false,
    }
}

/// A non-text block, in words: its kind, type and size, never its bytes.
fn describe_block(kind: &str, block: &Value) -> String {
    let mime = block
        .get("mimeType")
        .and_then(Value::as_str)
        .unwrap_or("unknown");
    let size = block
        .get("data")
        .and_then(Value::as_str)
        .map_or(0, |data| data.len() / 4 * 3);
    match kind {
        "resource_link" | "resource" => {
            let uri = block
                .get("uri")
                .or_else(|| block.get("resource").and_then(|r| r.get("uri")))
                .and_then(Value::as_str)
                .unwrap_or("");
            json!({"type": kind, "uri": uri}).to_string()
        }
        _ => json!({"type": kind, "mime_type": mime, "bytes": size, "note": "binary content is not passed on"})
            .to_string(),
    }
}

/// The length of `value` as compact JSON.
pub(crate) fn json_size(value: &impl serde::Serialize) -> usize {
    serde_json::to_vec(value).map_or(usize::MAX, |bytes| bytes.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(text: &str) -> McpServerEntry {
        toml::from_str(text).unwrap()
    }

    /// A server cannot grow what its worker lists past the gRPC answer's bound: one
    /// tool's definition is at most 64 KiB, a server's together at most 2 MiB (the
    /// tools past that are left out, a known tool keeps its last definition).
    #[test]
    fn definitions_are_bounded_per_tool_and_per_server() {
        let server = entry("name = \"big\"\ncommand = [\"x\"]");
        let tool = |name: &str, description_bytes: usize| {
            json!({"name": name, "description": "d".repeat(description_bytes),
                "inputSchema": {"type": "object"}})
        };
        let e = server.definition(&tool("huge", 70 * 1024)).unwrap_err();
        assert!(e.contains("more than the 65536"), "{e}");
        let listed = ListedTools::default();
        let tools: Vec<Value> = (0..120)
            .map(|i| tool(&format!("t{i:03}"), 20 * 1024))
            .collect();
        listed.learn(&server, &tools, "shell");
        let served = listed.names().len();
        assert!((90..120).contains(&served), "{served} of 120 served");
        let total: usize = listed
            .names()
            .iter()
            .filter_map(|n| listed.definition(n))
            .map(|d| json_size(&d))
            .sum();
        assert!(total <= MAX_SERVER_DEFINITIONS_BYTES, "{total}");
        // A known tool that would grow past the server's budget keeps its last
        // definition; new tools wait for a restart anyway.
        let room = MAX_SERVER_DEFINITIONS_BYTES - total;
        let before = listed.definition("t000").unwrap();
        let mut relisted = tools.clone();
        relisted[0] = tool("t000", 20 * 1024 + room + 1);
        relisted.push(tool("t999", 10));
        listed.learn(&server, &relisted, "shell");
        assert_eq!(listed.definition("t000").unwrap(), before);
        assert!(
            listed.definition("t999").is_none(),
            "new tools wait for a restart"
        );
    }

    #[test]
    fn entries_are_checked() {
        let good = entry("name = \"time\"\ncommand = [\"mcp-server-time\"]");
        good.check().unwrap();
        assert!(good.per_session && good.approval.is_none());
        for (text, says) in [
            ("name = \"a__b\"\ncommand = [\"x\"]", "must be 1 to"),
            ("name = \"\"\ncommand = [\"x\"]", "must be 1 to"),
            ("name = \"t\"", "give command"),
            ("name = \"t\"\ncommand = []", "command is empty"),
            (
                "name = \"t\"\ncommand = [\"x\"]\nurl = \"http://h\"",
                "not both",
            ),
            ("name = \"t\"\nurl = \"ftp://h/mcp\"", "http:// or https://"),
            (
                "name = \"t\"\nurl = \"http://u:p@h/mcp\"",
                "user name or password",
            ),
            ("name = \"t\"\nurl = \"mcp.example.com/mcp\"", "not a URL"),
            ("name = \"t\"\nurl = \"http://h/mcp#x\"", "fragment"),
            (
                "name = \"t\"\nurl = \"http://h/mcp\"\nenv = { A = \"1\" }",
                "env is for a stdio",
            ),
            (
                "name = \"t\"\ncommand = [\"x\"]\nheaders = { A = \"1\" }",
                "headers are for",
            ),
            (
                "name = \"t\"\ncommand = [\"x\"]\nmax_sessions = 0",
                "max_sessions",
            ),
            (
                "name = \"t\"\ncommand = [\"x\"]\nenv = { \"A-B\" = \"1\" }",
                "env",
            ),
        ] {
            let err = entry(text).check().unwrap_err().to_string();
            assert!(err.contains(says), "{text}: {err}");
        }
        let remote = entry(
            "name = \"docs\"\nurl = \"https://mcp.example.com/mcp\"\n\
             headers = { Authorization = \"Bearer ${env:DOCS_TOKEN}\" }\nper_session = false",
        );
        remote.check().unwrap();
        assert!(remote.is_http() && !remote.is_stdio() && !good.is_http());
        let twice = [good.clone(), good];
        assert!(
            check_entries(&twice)
                .unwrap_err()
                .to_string()
                .contains("defined twice")
        );
    }

    #[test]
    fn definitions_follow_mcp_defaults() {
        let server = entry("name = \"git\"\ncommand = [\"mcp-server-git\"]");
        let plain = server
            .definition(&json!({"name": "git_status", "description": "Shows the status",
                "inputSchema": {"type": "object", "properties": {"repo_path": {"type": "string"}}}}))
            .unwrap();
        assert_eq!(plain.name, "git__git_status");
        assert!(!plain.annotations.read_only && plain.annotations.destructive);
        assert!(plain.annotations.open_world);
        assert!(server.policy().approval_reason(&plain).is_some());
        let read_only = server
            .definition(
                &json!({"name": "git_log", "inputSchema": {"type": "object"},
                "annotations": {"readOnlyHint": true, "openWorldHint": false}}),
            )
            .unwrap();
        assert!(read_only.annotations.read_only && !read_only.annotations.destructive);
        assert!(server.policy().approval_reason(&read_only).is_none());
        assert!(
            server.policy().owns("git__git_log")
                && !server.policy().owns("gitx__a")
                && !server.policy().owns("git_a")
        );
        for bad in [
            json!({"inputSchema": {"type": "object"}}),
            json!({"name": "a.b", "inputSchema": {"type": "object"}}),
            json!({"name": "x", "inputSchema": "nope"}),
            json!({"name": "x", "inputSchema": {"type": 12}}),
        ] {
            assert!(server.definition(&bad).is_err(), "{bad}");
        }
        let never = entry("name = \"git\"\ncommand = [\"x\"]\napproval = false");
        assert!(never.policy().approval_reason(&plain).is_none());
    }

    #[test]
    fn results_become_text() {
        let out = outcome(&json!({"content": [
            {"type": "text", "text": "12:00"},
            {"type": "image", "mimeType": "image/png", "data": "AAAA"}
        ], "isError": true}));
        assert!(out.is_error);
        assert_eq!(out.content[0], "12:00");
        assert!(out.content[1].contains("image/png") && !out.content[1].contains("AAAA"));
        let structured = outcome(&json!({"content": [], "structuredContent": {"a": 1}}));
        assert_eq!(structured.content, vec!["{\"a\":1}".to_owned()]);
        assert!(!structured.is_error);
    }
}
