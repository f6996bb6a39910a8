//! `execute_shell`: every call runs in a fresh sandbox (see `airlock-sandbox`), in the
//! call's workspace mounted at `/workspace`, with an empty environment plus the
//! variables the call names and the configuration allows. The declared command tools
//! (`[[tools]]` with `command`, and the packs) run the same way (see [`declared`]).
#![forbid(unsafe_code)]

mod config;
pub mod declared;
mod execute;
pub mod mcp;
mod metrics;
mod workspace;

pub use config::ShellConfig;
pub use execute::ExecuteShell;
pub use metrics::SandboxMetrics;

use std::sync::Arc;

use airlock_sandbox::{Sandbox, SandboxError};
use airlock_worker::ToolSet;

/// Probes the host and builds the shell tool set — `execute_shell` and the declared
/// command tools, all in the same sandbox; fails closed (naming the missing layer and
/// the fix) when the host cannot give `[sandbox] min_isolation`.
pub fn tools(
    config: ShellConfig,
    declared: Vec<declared::CommandTemplate>,
) -> Result<(ToolSet, Arc<Sandbox>), SandboxError> {
    let sandbox = Arc::new(Sandbox::new(config.sandbox_config())?);
    let mut tools = ToolSet::new("shell").with(ExecuteShell::new(config.clone(), sandbox.clone()));
    for template in declared {
        tools = tools.with(declared::CommandTool::new(
            template,
            config.clone(),
            sandbox.clone(),
        ));
    }
    Ok((tools, sandbox))
}
