//! What every worker that keeps MCP servers' sessions shares: which session a call
//! uses, making room when `max_sessions` are open, and the tools a server listed. The
//! shell worker's sessions are sandboxed processes, the http worker's are Streamable
//! HTTP sessions; both are kept the same way.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use airlock_policy::ToolDefinition;
use serde_json::Value;

use super::{MAX_SERVER_DEFINITIONS_BYTES, McpServerEntry, json_size};
use crate::CallContext;

/// Which session a call uses: its principal's and session's own, or (`None`) the one
/// shared by every call when the entry is not per session.
pub type SessionKey = Option<(String, String)>;

/// One key's session, or none yet; locked while it opens, so one session's slow start
/// does not hold up another's.
pub type SessionSlot<T> = Arc<tokio::sync::Mutex<Option<Arc<T>>>>;

/// A pooled session that can say how long it has been idle.
pub trait IdleSince {
    /// When its last call ended, or `None` while a call runs.
    fn idle_since(&self) -> Option<Instant>;
}

/// The key of the session `ctx` uses under `entry`.
pub fn session_key(entry: &McpServerEntry, ctx: &CallContext) -> SessionKey {
    entry
        .per_session
        .then(|| (ctx.principal.clone(), ctx.session_id.as_str().to_owned()))
}

/// Makes room for one more session: removes the slot idle the longest (an empty slot
/// counts as idle since now) and returns what it held, for the caller to close. Slots
/// whose lock is held (a session opening) or whose session is in a call are never
/// chosen; when every slot is busy the call is refused with what to do.
pub fn evict_idle<T: IdleSince>(
    slots: &mut HashMap<SessionKey, SessionSlot<T>>,
    entry: &McpServerEntry,
) -> Result<Option<Arc<T>>, String> {
    let oldest = slots
        .iter()
        .filter_map(|(key, slot)| {
            let held = slot.try_lock().ok()?;
            let idle = held
                .as_ref()
                .map_or(Some(Instant::now()), |s| s.idle_since())?;
            Some((idle, key.clone()))
        })
        .min_by_key(|(idle, _)| *idle);
    let Some((_, key)) = oldest else {
        return Err(format!(
            "the MCP server {} already has {} sessions, all busy (max_sessions); try again when one of their calls ends",
            entry.name, entry.max_sessions
        ));
    };
    Ok(slots
        .remove(&key)
        .and_then(|slot| slot.try_lock().ok().and_then(|mut held| held.take())))
}

/// The tools of one server by their MCP names, as last listed. The first listing fixes
/// which tools are served; a later one updates their definitions (which the
/// orchestrator compares with the ones it pinned), and a tool it adds waits for the
/// worker's restart.
#[derive(Default)]
pub struct ListedTools {
    definitions: RwLock<BTreeMap<String, ToolDefinition>>,
}

impl ListedTools {
    /// The MCP names of the tools served.
    pub fn names(&self) -> Vec<String> {
        self.read().keys().cloned().collect()
    }

    /// A tool's definition as the server last listed it.
    pub fn definition(&self, mcp_name: &str) -> Option<ToolDefinition> {
        self.read().get(mcp_name).cloned()
    }

    /// Takes in a `tools/list` of `entry`'s server (run by the `worker` named in the
    /// log); a tool that cannot be served is logged and left out, and so is one that
    /// would take the server's definitions past [`MAX_SERVER_DEFINITIONS_BYTES`] (its
    /// last accepted definition, if any, stays).
    pub fn learn(&self, entry: &McpServerEntry, tools: &[Value], worker: &str) {
        let mut definitions = self
            .definitions
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let first = definitions.is_empty();
        let mut total: usize = definitions.values().map(json_size).sum();
        for tool in tools {
            let mcp_name = tool
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            match entry.definition(tool) {
                Ok(definition) if first || definitions.contains_key(&mcp_name) => {
                    let before = definitions.get(&mcp_name).map_or(0, json_size);
                    let after = total - before + json_size(&definition);
                    if after > MAX_SERVER_DEFINITIONS_BYTES {
                        tracing::warn!(server = %entry.name, tool = %mcp_name, bytes = after, "not serving an MCP tool: the server's tool definitions would take more than {MAX_SERVER_DEFINITIONS_BYTES} bytes together");
                        continue;
                    }
                    total = after;
                    definitions.insert(mcp_name, definition);
                }
                Ok(_) => {
                    tracing::warn!(server = %entry.name, tool = %mcp_name, "the MCP server lists a new tool; it is served after the {worker} worker restarts");
                }
                Err(reason) => {
                    tracing::warn!(server = %entry.name, tool = %mcp_name, %reason, "not serving an MCP tool");
                }
            }
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, ToolDefinition>> {
        // A panic while listing leaves the map whole (inserts are single operations).
        self.definitions
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
