//! `airlock serve orchestrator|worker <group>`: one component in the foreground.
//!
//! Each component binds its sockets and loads what it reads from outside its data dir
//! first, then (from the sandbox layer) confines itself, and only then starts its async
//! runtime and serves.

use std::process::ExitCode;

use airlock_orchestrator::{BoundListeners, Orchestrator};
use airlock_worker::{BoundListener, ListenAddr, WorkerServer, WorkerSettings};
use anyhow::Context;

use crate::Location;
use crate::config::Loaded;
use crate::signals;

#[derive(Debug, clap::Subcommand)]
pub enum Component {
    /// The orchestrator: front doors and the gate.
    Orchestrator,
    /// A tool worker.
    Worker {
        #[command(subcommand)]
        group: WorkerGroup,
    },
}

#[derive(Debug, clap::Subcommand)]
pub enum WorkerGroup {
    /// File tools confined to the workspace.
    Fs {
        /// Listen address: unix:/path.sock or host:port (default: <data_dir>/sockets/fs.sock).
        #[arg(long, env = "AIRLOCK_LISTEN")]
        listen: Option<String>,
    },
}

pub fn run(component: Component, location: &Location) -> anyhow::Result<ExitCode> {
    signals::follow_launcher()?;
    let loaded = Loaded::load(location.config.as_deref(), location.data_dir.as_deref())?;
    match component {
        Component::Orchestrator => orchestrator(&loaded),
        Component::Worker {
            group: WorkerGroup::Fs { listen },
        } => fs_worker(&loaded, listen),
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn orchestrator(loaded: &Loaded) -> anyhow::Result<ExitCode> {
    let config = loaded.orchestrator();
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("cannot create data dir {}", config.data_dir.display()))?;
    let listeners = BoundListeners::bind(&config)?;
    let prepared = Orchestrator::prepare(&config)?;
    runtime()?.block_on(Orchestrator::serve(
        config,
        prepared,
        listeners,
        signals::shutdown(),
    ))?;
    Ok(ExitCode::SUCCESS)
}

fn fs_worker(loaded: &Loaded, listen: Option<String>) -> anyhow::Result<ExitCode> {
    let addr: ListenAddr = match listen {
        Some(a) => a.parse()?,
        None => ListenAddr::Unix(loaded.socket_path("fs")),
    };
    let fs = loaded.fs();
    std::fs::create_dir_all(&fs.workspaces_root).with_context(|| {
        format!(
            "cannot create workspaces root {}",
            fs.workspaces_root.display()
        )
    })?;
    let listener = BoundListener::bind(&addr)?;
    tracing::info!(listen = %listener.local_addr(), root = %fs.workspaces_root.display(), "fs worker starting");
    let server = WorkerServer::new(airlock_worker_fs::tools(fs), worker_settings(loaded));
    runtime()?.block_on(server.serve(listener, signals::shutdown()))?;
    Ok(ExitCode::SUCCESS)
}

fn worker_settings(loaded: &Loaded) -> WorkerSettings {
    let limits = &loaded.config.limits;
    WorkerSettings {
        default_timeout: std::time::Duration::from_millis(limits.default_call_timeout_ms),
        max_timeout: std::time::Duration::from_millis(limits.max_call_timeout_ms),
        ..WorkerSettings::default()
    }
}
