//! The running instances of one `[[mcp_servers]]` entry: one per session (or one for
//! all, `per_session = false`), started on a session's first call, started again after
//! a crash, stopped when idle, and at most `max_sessions` at once.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_policy::ToolDefinition;
use airlock_sandbox::Sandbox;
use airlock_worker::CallContext;
use airlock_worker::mcp::{
    IdleSince, ListedTools, McpServerEntry, SessionKey, SessionSlot, evict_idle, session_key,
};
use serde_json::Value;

use super::instance::{Instance, InstanceError, Launch};
use super::lock;
use crate::config::ShellConfig;

/// How often idle instances are looked for.
const REAP_INTERVAL: Duration = Duration::from_secs(5);

/// One key's instance, or none yet; locked while it starts.
type Slot = SessionSlot<Instance>;

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
    slots: Mutex<HashMap<SessionKey, Slot>>,
    /// The server's tools, as last listed.
    tools: ListedTools,
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
            tools: ListedTools::default(),
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
        self.tools.names()
    }

    /// A tool's definition as the server last listed it.
    pub(super) fn definition(&self, mcp_name: &str) -> Option<ToolDefinition> {
        self.tools.definition(mcp_name)
    }

    /// Takes in a `tools/list` (see [`ListedTools::learn`]).
    fn learn(&self, tools: &[Value]) {
        self.tools.learn(&self.entry, tools, "shell");
    }

    /// Re-lists the tools whenever the instance says they changed, until its process
    /// ends. The watcher holds the instance only while it lists: waiting, it holds the
    /// signals alone, so an instance evicted or idle is dropped (and its process
    /// stopped) even when its server never says its tools changed.
    fn watch_tools(self: &Arc<Self>, instance: &Arc<Instance>) {
        let pool = Arc::downgrade(self);
        let watched = Arc::downgrade(instance);
        let (changed, mut exited) = instance.change_signals();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = changed.notified() => {}
                    _ = super::instance::wait_exit(&mut exited) => return,
                }
                let Some(instance) = watched.upgrade() else {
                    return;
                };
                let listed = instance.list_tools().await;
                drop(instance);
                let Some(pool) = pool.upgrade() else {
                    return;
                };
                match listed {
                    Ok(tools) => pool.learn(&tools),
                    Err(e) => {
                        tracing::warn!(server = %pool.entry.name, error = %e, "cannot list the MCP server's changed tools; keeping the last listing")
                    }
                }
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
        let key = session_key(&self.entry, ctx);
        let slot = {
            let mut slots = lock(&self.slots);
            if !slots.contains_key(&key) && slots.len() >= self.entry.max_sessions {
                // The evicted instance stops when its last reference goes.
                evict_idle(&mut slots, &self.entry)?;
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
