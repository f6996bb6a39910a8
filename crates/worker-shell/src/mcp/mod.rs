//! Stdio MCP servers behind the gate (DESIGN §11): each `[[mcp_servers]]` entry with a
//! `command` runs as a process in the shell sandbox — its own namespaces, Landlock,
//! seccomp, cgroup limits and no network, exactly like a call of `execute_shell` — with
//! the session's workspace at `/workspace` (or an empty one of its own when the entry
//! is not per session). Its tools are served as `<name>__<tool>`; each call is a
//! `tools/call` on the session's instance, with progress and cancellation passed on.
//!
//! The server is a stranger: its messages are bounded, its crash or hang is an
//! `is_error` result for the call at hand, and the next call starts it again. What the
//! worker writes to it is bounded too (see `outbound.rs`): a server that stops reading
//! its stdin is held back, then stopped.

mod instance;
mod outbound;
mod pool;
mod tool;

use std::path::Path;
use std::sync::Arc;

use airlock_sandbox::Sandbox;
use airlock_worker::mcp::McpServerEntry;

pub use instance::InstanceError;
pub use pool::McpPool;
pub use tool::McpTool;

use crate::config::ShellConfig;

/// Starts each stdio server once to learn its tools; returns the tools to serve. A
/// server that does not start is an error naming it: the worker refuses to start
/// rather than serve a catalog without its tools.
pub async fn start(
    entries: &[McpServerEntry],
    config: &ShellConfig,
    sandbox: &Arc<Sandbox>,
    state_dir: &Path,
) -> Result<Vec<McpTool>, InstanceError> {
    let mut tools = Vec::new();
    for entry in entries.iter().filter(|e| e.is_stdio()) {
        let private = state_dir.join(&entry.name);
        std::fs::create_dir_all(&private).map_err(|e| InstanceError::Start {
            server: entry.name.clone(),
            reason: format!("cannot create its workspace {}: {e}", private.display()),
        })?;
        let pool = McpPool::start(entry.clone(), config.clone(), sandbox.clone(), private).await?;
        let names = pool.tool_names();
        tracing::info!(server = %entry.name, tools = names.len(), "MCP server started");
        tools.extend(
            names
                .into_iter()
                .map(|name| McpTool::new(pool.clone(), name)),
        );
    }
    Ok(tools)
}

// A panic while holding one of the pool's locks leaves the data as it was (each holder
// only inserts, removes or replaces whole values), so a poisoned lock is used as is.

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
