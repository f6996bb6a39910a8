//! Signal handling, in one place: every long-running command stops on SIGINT or SIGTERM.

/// Resolves on the first SIGINT or SIGTERM.
pub async fn shutdown() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut interrupt), Ok(mut terminate)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        tracing::error!("cannot install signal handlers; stop the process with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = interrupt.recv() => tracing::info!("SIGINT received"),
        _ = terminate.recv() => tracing::info!("SIGTERM received"),
    }
}

/// A message per SIGHUP: reload the policy and the principals.
pub fn reloads() -> tokio::sync::mpsc::Receiver<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    match signal(SignalKind::hangup()) {
        Ok(mut hangups) => {
            tokio::spawn(async move {
                while hangups.recv().await.is_some() {
                    tracing::info!("SIGHUP received: reloading the policy and the principals");
                    let _ = tx.try_send(());
                }
            });
        }
        Err(e) => {
            tracing::error!(error = %e, "cannot watch SIGHUP; reloading the policy and the principals is unavailable")
        }
    }
    rx
}

/// For a child of `airlock up`: asks the kernel to send SIGTERM when the launcher dies,
/// so no component outlives it, even after a `kill -9` of the launcher.
pub fn follow_launcher() -> anyhow::Result<()> {
    let Ok(expected) = std::env::var(LAUNCHER_PID_ENV) else {
        return Ok(());
    };
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))?;
    let parent = rustix::process::getppid().map(|p| p.as_raw_nonzero().get().to_string());
    if parent.as_deref() != Some(expected.as_str()) {
        anyhow::bail!("the launcher (pid {expected}) is gone; exiting");
    }
    Ok(())
}

/// Set by the launcher in its children's environment.
pub const LAUNCHER_PID_ENV: &str = "AIRLOCK_LAUNCHER_PID";
