//! `execute_shell`: every call runs in a fresh sandbox (see `airlock-sandbox`), in the
//! call's workspace mounted at `/workspace`, with an empty environment plus the
//! variables the call names and the configuration allows. The declared command tools
//! (`[[tools]]` with `command`, and the packs) run the same way (see [`declared`]).
#![forbid(unsafe_code)]

mod config;
pub mod declared;
pub mod egress;
mod execute;
pub mod mcp;
mod metrics;
mod workspace;

pub use config::ShellConfig;
pub use execute::ExecuteShell;
pub use metrics::SandboxMetrics;

use std::sync::Arc;

use airlock_sandbox::{Network, Sandbox, SandboxError};
use airlock_worker::ToolSet;

/// Why the shell worker cannot serve its tools.
#[derive(Debug, thiserror::Error)]
pub enum ShellError {
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    Egress(#[from] egress::EgressError),
}

/// Probes the host and builds the shell tool set — `execute_shell` and the declared
/// command tools, all in the same sandbox; fails closed (naming the missing layer and
/// the fix) when the host cannot give `[sandbox] min_isolation`, or the egress rules do
/// not compile. Behind the proxy (`network = "proxy"`), `execute_shell` reaches what
/// `[sandbox.egress]` allows, a declared tool with `network = "proxy"` what its
/// `egress_allow` narrows that to, and any other tool nothing.
pub fn tools(
    config: ShellConfig,
    declared: Vec<declared::CommandTemplate>,
) -> Result<(ToolSet, Arc<Sandbox>), ShellError> {
    let sandbox = Arc::new(Sandbox::new(config.sandbox_config())?);
    let rules = match config.network {
        Network::Proxy => Some(Arc::new(config.egress.check()?)),
        Network::None | Network::Host => None,
    };
    let mut tools = ToolSet::new("shell").with(ExecuteShell::new(
        config.clone(),
        sandbox.clone(),
        rules.clone(),
    ));
    for template in declared {
        let egress = match &rules {
            Some(rules) => template.egress_rules(rules)?,
            None => None,
        };
        tools = tools.with(declared::CommandTool::new(
            template,
            config.clone(),
            sandbox.clone(),
            egress,
        ));
    }
    Ok((tools, sandbox))
}
