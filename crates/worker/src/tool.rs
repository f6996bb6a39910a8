//! The `Tool` trait every worker implements, and the set of tools a worker serves.

use std::collections::BTreeMap;
use std::sync::Arc;

use airlock_policy::{ToolDefinition, ToolOutcome};

use crate::CallContext;

/// One tool. Failures the model can act on are `ToolOutcome::error` results with a text
/// that says what to do next; they are not transport errors.
#[async_trait::async_trait]
pub trait Tool: Send + Sync + 'static {
    /// Name, description, JSON Schema of the arguments, annotations.
    fn definition(&self) -> ToolDefinition;

    /// Runs one call. `arguments` has been validated against the schema by the
    /// orchestrator, but a tool re-checks what its safety depends on. Long calls should
    /// watch `ctx.cancel` and may report progress and output through `ctx`.
    async fn execute(&self, arguments: serde_json::Value, ctx: CallContext) -> ToolOutcome;
}

/// The tools of one worker group, by name.
#[derive(Clone)]
pub struct ToolSet {
    group: String,
    tools: BTreeMap<String, Arc<dyn Tool>>,
}

impl ToolSet {
    pub fn new(group: impl Into<String>) -> Self {
        Self {
            group: group.into(),
            tools: BTreeMap::new(),
        }
    }

    /// Adds a tool; a later tool with the same name replaces the earlier one.
    pub fn with(mut self, tool: impl Tool) -> Self {
        let name = tool.definition().name;
        self.tools.insert(name, Arc::new(tool));
        self
    }

    pub fn group(&self) -> &str {
        &self.group
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.tools.get(name).cloned()
    }

    pub fn definitions(&self) -> Vec<ToolDefinition> {
        self.tools.values().map(|t| t.definition()).collect()
    }
}
