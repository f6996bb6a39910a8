//! The shell worker's sandbox series (DESIGN §13): how long a sandbox takes to start,
//! and how many were killed, by why.

use airlock_metrics::{Counter, EncodeLabelSet, Family, Histogram, Registry};
use airlock_sandbox::RunOutcome;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// Cloning shares the series.
#[derive(Clone)]
pub struct SandboxMetrics {
    spawn: Histogram,
    kills: Family<ReasonLabel, Counter>,
}

impl std::fmt::Debug for SandboxMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxMetrics").finish_non_exhaustive()
    }
}

impl Default for SandboxMetrics {
    /// Series that no registry serves (a worker without a metrics listener, tests).
    fn default() -> Self {
        Self::register(&mut Registry::default())
    }
}

/// The series a worker counts in are not configuration: two configs are equal whatever
/// registry their series are in.
impl PartialEq for SandboxMetrics {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Sandbox start-up is milliseconds: 0.5 ms to about 1 s, doubling.
fn spawn_buckets() -> impl Iterator<Item = f64> {
    (0..12).map(|i| 0.0005 * 2f64.powi(i))
}

impl SandboxMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let spawn = Histogram::new(spawn_buckets());
        registry.register(
            "airlock_sandbox_spawn_seconds",
            "From a command's request to its exec in a fresh sandbox",
            spawn.clone(),
        );
        let kills = Family::<ReasonLabel, Counter>::default();
        // Every reason starts at 0, so that a rate over the first kill is seen.
        for reason in KILL_REASONS {
            kills.get_or_create_owned(&ReasonLabel { reason });
        }
        registry.register(
            "airlock_sandbox_kills",
            "Sandboxes killed before their command ended, by reason (timeout, cancelled, signal)",
            kills.clone(),
        );
        Self { spawn, kills }
    }

    /// A sandbox's run ended: its spawn time, and its kill if it was killed.
    pub(crate) fn ran(&self, outcome: &RunOutcome) {
        self.spawn.observe(outcome.spawn.as_secs_f64());
        if let Some(reason) = kill_reason(outcome) {
            self.kills.get_or_create(&ReasonLabel { reason }).inc();
        }
    }
}

const KILL_REASONS: [&str; 3] = ["timeout", "cancelled", "signal"];

/// Why the sandbox's command did not end by itself: the wall-clock limit, a cancel (the
/// caller went away, or asked), or a signal (the kernel's OOM killer in the sandbox's
/// cgroup, the pids limit's victims, or the command's own doing).
fn kill_reason(outcome: &RunOutcome) -> Option<&'static str> {
    if outcome.timed_out {
        Some("timeout")
    } else if outcome.cancelled {
        Some("cancelled")
    } else if outcome.signal.is_some() {
        Some("signal")
    } else {
        None
    }
}
