//! `airlock sandbox run [--profile P] -- <cmd…>`: runs one command through the shell
//! worker's own code path (the `execute_shell` tool, its sandbox) and prints what ran
//! and which isolation layers were in force — how an operator checks a host.
//!
//! Without `--data-dir` (or `AIRLOCK_DATA_DIR`) the command runs in a fresh temporary
//! workspace, removed afterwards: checking a host must not leave state in `~/.airlock`,
//! nor in the workspaces a config file names.

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use airlock_policy::{IsolationLevel, SessionId};
use airlock_worker::{CallContext, CancellationToken};
use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::Location;
use crate::config::Loaded;

pub fn run(
    location: &Location,
    profile: Option<&str>,
    command: &[String],
) -> anyhow::Result<ExitCode> {
    if command.is_empty() {
        bail!("give the command after --, e.g. airlock sandbox run -- id");
    }
    let scratch = match &location.data_dir {
        Some(_) => None,
        None => Some(
            tempfile::Builder::new()
                .prefix("airlock-sandbox-")
                .tempdir()
                .context("cannot create a temporary workspace")?,
        ),
    };
    let data_dir = location
        .data_dir
        .as_deref()
        .or(scratch.as_ref().map(tempfile::TempDir::path));
    let loaded = Loaded::load(location.config.as_deref(), data_dir)?;
    let mut shell = loaded.shell();
    if let Some(scratch) = &scratch {
        shell.workspaces_root = scratch.path().join("workspaces");
    }
    let code = run_in(shell, profile, command);
    if let Some(scratch) = scratch {
        let path = scratch.path().to_path_buf();
        if let Err(e) = scratch.close() {
            eprintln!(
                "airlock: cannot remove the temporary workspace {}: {e}",
                path.display()
            );
        }
    }
    code
}

fn run_in(
    mut shell: airlock_worker_shell::ShellConfig,
    profile: Option<&str>,
    command: &[String],
) -> anyhow::Result<ExitCode> {
    shell.force_level = match profile {
        None => None,
        Some("strict") => Some(IsolationLevel::Strict),
        Some("standard") => Some(IsolationLevel::Standard),
        Some(other) => bail!("unknown profile {other:?}; use strict or standard"),
    };
    if let Some(level) = shell.force_level {
        shell.min_isolation = shell.min_isolation.min(level);
    }
    // One call: a pre-built sandbox would only be built, handed that one call, and
    // its spare destroyed on the way out.
    shell.prebuilt = 0;
    std::fs::create_dir_all(&shell.workspaces_root)
        .with_context(|| format!("cannot create {}", shell.workspaces_root.display()))?;
    let timeout = Duration::from_secs(shell.max_timeout_seconds);
    let (tools, _sandbox) = airlock_worker_shell::tools(shell, Vec::new())?;
    let tool = tools
        .get("execute_shell")
        .context("execute_shell is missing")?;

    // One call: a runtime on this thread (the sandbox itself runs on one blocking
    // thread) instead of a pool of workers that would only be started and stopped.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let outcome = runtime.block_on(async {
        let (events, mut receiver) = tokio::sync::mpsc::channel(256);
        let ctx = CallContext::new(
            "sandbox-run".into(),
            airlock_orchestrator::auth::LOCAL_PRINCIPAL.into(),
            SessionId::parse("sandbox-run")?,
            Instant::now() + timeout,
            CancellationToken::new(),
            events,
        );
        // Output is printed from the result; drain the live stream.
        let drain = tokio::spawn(async move { while receiver.recv().await.is_some() {} });
        let outcome = tool.execute(json!({"argv": command}), ctx).await;
        let _ = drain.await;
        anyhow::Ok(outcome)
    })?;

    let Some(text) = outcome.content.first() else {
        bail!("the sandbox returned no result")
    };
    let Ok(result) = serde_json::from_str::<Value>(text) else {
        bail!("{text}");
    };
    print!("{}", result["stdout"].as_str().unwrap_or_default());
    eprint!("{}", result["stderr"].as_str().unwrap_or_default());
    let _ = std::io::stdout().flush();
    let summary = json!({
        "exit_code": result["exit_code"],
        "signal": result["signal"],
        "timed_out": result["timed_out"],
        "duration_ms": result["duration_ms"],
        "usage": result["usage"],
        "isolation": result["isolation"],
    });
    eprintln!("--- airlock sandbox report ---");
    eprintln!("{}", serde_json::to_string_pretty(&summary)?);
    let code = result["exit_code"]
        .as_i64()
        .unwrap_or(128 + result["signal"].as_i64().unwrap_or(0));
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}
