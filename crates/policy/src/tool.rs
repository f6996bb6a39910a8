//! Tool definitions as the catalog, the schema validator and the front doors see them.

use serde::{Deserialize, Serialize};

/// Behavioural hints about a tool, the same four that MCP defines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ToolAnnotations {
    /// The tool does not change its environment.
    pub read_only: bool,
    /// The tool may change or delete state irreversibly.
    pub destructive: bool,
    /// Calling it twice with the same arguments has no further effect.
    pub idempotent: bool,
    /// The tool reaches outside Airlock's own resources (the network).
    pub open_world: bool,
}

/// One tool of the catalog.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDefinition {
    pub name: String,
    pub title: String,
    pub description: String,
    /// JSON Schema 2020-12 of the arguments (always an object schema).
    pub input_schema: serde_json::Value,
    pub annotations: ToolAnnotations,
}

/// The names of Airlock's built-in tools, in the order of DESIGN §4's table: the names no
/// tool an operator declares may take. (The Cedar catalog lists the same tools; a test
/// there keeps the two equal.)
pub const BUILT_IN_TOOLS: &[&str] = &[
    "execute_shell",
    "read_file",
    "write_file",
    "edit_file",
    "list_directory",
    "search_files",
    "get_file_info",
    "create_directory",
    "move_path",
    "delete_path",
    "http_request",
    "fetch_url",
    "list_databases",
    "list_tables",
    "describe_table",
    "query_database",
    "execute_sql",
];
