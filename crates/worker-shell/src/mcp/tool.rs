//! One tool of an MCP server, as the shell worker serves it.

use std::sync::Arc;

use airlock_policy::{ToolAnnotations, ToolDefinition, ToolOutcome};
use airlock_worker::{CallContext, Tool};
use serde_json::Value;

use super::pool::McpPool;

/// `<server>__<tool>`: a call becomes a `tools/call` of `<tool>` on the call's instance.
pub struct McpTool {
    pool: Arc<McpPool>,
    /// The tool's name on the MCP server.
    mcp_name: String,
}

impl McpTool {
    pub(super) fn new(pool: Arc<McpPool>, mcp_name: String) -> Self {
        Self { pool, mcp_name }
    }
}

#[airlock_worker::async_trait]
impl Tool for McpTool {
    /// The definition as the server last listed it: a server that changes it later is
    /// seen changed by the orchestrator, which pinned the first one.
    fn definition(&self) -> ToolDefinition {
        self.pool.definition(&self.mcp_name).unwrap_or_else(|| {
            // Unreachable in practice: a pool's tools are only ever replaced, never
            // removed. A definition that says so is still better than a panic.
            ToolDefinition {
                name: self
                    .pool
                    .entry()
                    .tool_name(&self.mcp_name)
                    .unwrap_or_else(|_| self.mcp_name.clone()),
                title: String::new(),
                description: "This MCP tool is unavailable.".into(),
                input_schema: serde_json::json!({"type": "object"}),
                annotations: ToolAnnotations::default(),
            }
        })
    }

    async fn execute(&self, arguments: Value, ctx: CallContext) -> ToolOutcome {
        let Value::Object(arguments) = arguments else {
            return ToolOutcome::error("the arguments must be a JSON object");
        };
        self.pool.call(&self.mcp_name, arguments, &ctx).await
    }
}
