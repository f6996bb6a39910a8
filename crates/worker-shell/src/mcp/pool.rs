//! The running instances of one `[[mcp_servers]]` entry: one per session (or one for
//! all, `per_session = false`), started on a session's first call, started again after
//! a crash, stopped when idle, and at most `max_sessions` at once.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use airlock_policy::ToolDefinition;
use airlock_sandbox::Sandbox;
use airlock_worker::CallContext;
use airlock_worker::mcp::McpServerEntry;
use serde_json::Value;

use super::instance::{Instance, InstanceError, Launch};
use super::{lock, read, write};
use crate::config::ShellConfig;

/// How often idle instances are looked for.
const REAP_INTERVAL: Duration = Duration::from_secs(5);

/// Which instance a call uses: its session's, or the shared one.
type Key = Option<(String, String)>;

/// One key's instance, or none yet; locked while it starts.
type Slot = Arc<tokio::sync::Mutex<Option<Arc<Instance>>>>;

/// One entry's instances and the definitions of its tools.
pub struct McpPool {
    entry: McpServerEntry,
    config: ShellConfig,
    sandbox: Arc<Sandbox>,
    /// The workspace of the shared instance (and of the first listing): empty, the
    /// worker's own.
    private_workspace: PathBuf,
    /// Each key's slot; a slot's lock is held while its instance starts, so one
    /// session's slow start does not hold up another's.
    slots: Mutex<HashMap<Key, Slot>>,
    /// The server's tools by their MCP names, as last listed.
    definitions: RwLock<BTreeMap<String, ToolDefinition>>,
}

impl McpPool {
    /// Starts the server once in its private workspace to learn its tools; keeps that
    /// instance as the shared one when the entry is not per session.
    pub(super) async fn start(
        entry: McpServerEntry,
        config: ShellConfig,
        sandbox: Arc<Sandbox>,
        private_workspace: PathBuf,
    ) -> Result<Arc<Self>, InstanceError> {
        let (instance, tools) = Instance::start(Launch {
            entry: &entry,
            sandbox: &sandbox,
            workspace: private_workspace.clone(),
        })
        .await?;
        let pool = Arc::new(McpPool {
            entry,
            config,
            sandbox,
            private_workspace,
            slots: Mutex::new(HashMap::new()),
            definitions: RwLock::new(BTreeMap::new()),
        });
        pool.learn(&tools);
        if !pool.entry.per_session {
            pool.watch_tools(&instance);
            let slot = Arc::new(tokio::sync::Mutex::new(Some(instance)));
            lock(&pool.slots).insert(None, slot);
        }
        tokio::spawn(reap(Arc::downgrade(&pool)));
        Ok(pool)
    }

    pub fn entry(&self) -> &McpServerEntry {
        &self.entry
    }

    /// The MCP names of the tools, as first listed.
    pub(super) fn tool_names(&self) -> Vec<String> {
        read(&self.definitions).keys().cloned().collect()
    }

    /// A tool's definition as the server last listed it.
    pub(super) fn definition(&self, mcp_name: &str) -> Option<ToolDefinition> {
        read(&self.definitions).get(mcp_name).cloned()
    }

    /// Takes in a `tools/list`: a tool already known gets its new definition (which the
    /// orchestrator compares with the one it pinned); a tool that cannot be served is
    /// logged and left out. New tools are served after a restart of the worker.
    fn learn(&self, tools: &[Value]) {
        let mut definitions = write(&self.definitions);
        let first = definitions.is_empty();
        for tool in tools {
            let mcp_name = tool
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            match self.entry.definition(tool) {
                Ok(definition) if first || definitions.contains_key(&mcp_name) => {
                    definitions.insert(mcp_name, definition);
                }
                Ok(_) => {
                    tracing::warn!(server = %self.entry.name, tool = %mcp_name, "the MCP server lists a new tool; it is served after the shell worker restarts");
                }
                Err(reason) => {
                    tracing::warn!(server = %self.entry.name, tool = %mcp_name, %reason, "not serving an MCP tool");
                }
            }
        }
    }

    /// Re-lists the tools whenever the instance says they changed.
    fn watch_tools(self: &Arc<Self>, instance: &Arc<Instance>) {
        let pool = Arc::downgrade(self);
        let watched = Arc::downgrade(instance);
        tokio::spawn(async move {
            loop {
                let Some(instance) = watched.upgrade() else {
                    return;
                };
                instance.tools_changed().await;
                let listed = instance.list_tools().await;
                drop(instance);
                let (Some(pool), Ok(tools)) = (pool.upgrade(), listed) else {
                    return;
                };
                pool.learn(&tools);
            }
        });
    }

    /// Runs one call of the server's tool `mcp_name` on the call's instance.
    pub(super) async fn call(
        self: &Arc<Self>,
        mcp_name: &str,
        arguments: serde_json::Map<String, Value>,
        ctx: &CallContext,
    ) -> airlock_policy::ToolOutcome {
        let instance = match self.instance(ctx).await {
            Ok(instance) => instance,
            Err(message) => return airlock_policy::ToolOutcome::error(message),
        };
        instance.call(mcp_name, arguments, ctx).await
    }

    /// The call's instance, started when it has none (or its last one died).
    async fn instance(self: &Arc<Self>, ctx: &CallContext) -> Result<Arc<Instance>, String> {
        let key: Key = self
            .entry
            .per_session
            .then(|| (ctx.principal.clone(), ctx.session_id.as_str().to_owned()));
        let slot = {
            let mut slots = lock(&self.slots);
            if !slots.contains_key(&key) && slots.len() >= self.entry.max_sessions {
                self.evict_idle(&mut slots)?;
            }
            slots.entry(key.clone()).or_default().clone()
        };
        let mut held = slot.lock().await;
        if let Some(instance) = held.as_ref().filter(|i| i.is_alive()) {
            return Ok(instance.clone());
        }
        let workspace = match &key {
            None => self.private_workspace.clone(),
            Some(_) => {
                crate::execute::ensure_volume(&self.config, ctx).await?;
                crate::execute::timeout_and_workspace(&self.config, ctx, 1.0)?.1
            }
        };
        let (instance, tools) = Instance::start(Launch {
            entry: &self.entry,
            sandbox: &self.sandbox,
            workspace,
        })
        .await
        .map_err(|e| e.to_string())?;
        self.learn(&tools);
        self.watch_tools(&instance);
        *held = Some(instance.clone());
        Ok(instance)
    }

    /// Makes room for one more session: stops the instance idle the longest.
    fn evict_idle(&self, slots: &mut HashMap<Key, Slot>) -> Result<(), String> {
        let oldest = slots
            .iter()
            .filter_map(|(key, slot)| {
                let held = slot.try_lock().ok()?;
                let idle = held
                    .as_ref()
                    .map_or(Some(Instant::now()), |i| i.idle_since())?;
                Some((idle, key.clone()))
            })
            .min_by_key(|(idle, _)| *idle);
        match oldest {
            Some((_, key)) => {
                slots.remove(&key);
                Ok(())
            }
            None => Err(format!(
                "the MCP server {} already runs for {} sessions, all busy (max_sessions); try again when one of their calls ends",
                self.entry.name, self.entry.max_sessions
            )),
        }
    }

    /// Stops the session instances idle longer than `idle_seconds`, and forgets dead ones.
    fn reap_idle(&self) {
        let limit = Duration::from_secs(self.entry.idle_seconds);
        let mut slots = lock(&self.slots);
        slots.retain(|key, slot| {
            let Ok(held) = slot.try_lock() else {
                return true;
            };
            match held.as_ref() {
                None => false,
                Some(instance) if !instance.is_alive() => key.is_none(),
                Some(instance) => {
                    key.is_none()
                        || instance
                            .idle_since()
                            .is_none_or(|since| since.elapsed() < limit)
                }
            }
        });
    }
}

/// Stops idle instances until the pool is gone.
async fn reap(pool: std::sync::Weak<McpPool>) {
    loop {
        tokio::time::sleep(REAP_INTERVAL).await;
        match pool.upgrade() {
            Some(pool) => pool.reap_idle(),
            None => return,
        }
    }
}
