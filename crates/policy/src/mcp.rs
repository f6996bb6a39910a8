//! MCP servers' tools as policy sees them (DESIGN §11).

use crate::tool::ToolDefinition;

/// What policy needs of an `[[mcp_servers]]` entry: which tools are its
/// (`<name>__<tool>`) and whether their calls need approval. Such tools are discovered
/// from the worker that runs the server, like an external worker's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct McpServerPolicy {
    pub name: String,
    /// `None`: the calls of every tool not marked read-only need approval; `Some(b)`:
    /// every call does (`true`) or none does (`false`).
    pub approval: Option<bool>,
}

impl McpServerPolicy {
    /// Whether `tool` is one of this server's tools.
    pub fn owns(&self, tool: &str) -> bool {
        tool.strip_prefix(self.name.as_str())
            .is_some_and(|rest| rest.starts_with("__"))
    }

    /// Why every call of `definition` needs approval, when it does.
    pub fn approval_reason(&self, definition: &ToolDefinition) -> Option<String> {
        match self.approval {
            Some(false) => None,
            Some(true) => Some(format!(
                "{} is a tool of the MCP server {}, whose [[mcp_servers]] entry sets approval = true",
                definition.name, self.name
            )),
            None => (!definition.annotations.read_only).then(|| {
                format!(
                    "{} is not marked read-only by the MCP server {}, so every call needs approval",
                    definition.name, self.name
                )
            }),
        }
    }
}
