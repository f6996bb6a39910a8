//! Giving a worker's free memory back once it is idle.
//!
//! A worker whose heap keeps its large buffers warm between calls
//! (`airlock_sandbox::heap::keep_large_buffers`) holds what its busiest moment needed
//! for as long as calls keep coming. Once no call has started for a whole period and
//! none is in flight, the worker hands that memory back, so an idle worker holds what
//! it held before its first call. One check a period; a call costs one atomic add.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long a worker must have started no call before its free memory is given back.
pub(crate) const IDLE_FOR: Duration = Duration::from_secs(2);

/// The calls a worker has started, counted by the service and read by the release.
#[derive(Clone, Default)]
pub(crate) struct Activity(Arc<AtomicU64>);

impl Activity {
    pub(crate) fn call_started(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    fn calls(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Whether a period's end is the moment to give memory back: no call started during
/// the period, none in flight, and at least one since the last time.
#[derive(Default)]
struct IdleRelease {
    /// The count of calls at the end of the last period.
    seen: u64,
    /// The count of calls when memory was last given back.
    released: u64,
}

impl IdleRelease {
    fn due(&mut self, calls: u64, in_flight: usize) -> bool {
        let quiet = calls == self.seen;
        self.seen = calls;
        if quiet && in_flight == 0 && calls != self.released {
            self.released = calls;
            return true;
        }
        false
    }
}

/// Runs `release` each time the worker has gone idle, until `stop`.
pub(crate) async fn release_when_idle(
    activity: Activity,
    in_flight: TaskTracker,
    release: fn(),
    stop: CancellationToken,
) {
    let mut idle = IdleRelease::default();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(IDLE_FOR) => {}
        }
        if idle.due(activity.calls(), in_flight.len()) {
            // `malloc_trim` walks every arena under its lock: not on the async thread.
            let _ = tokio::task::spawn_blocking(release).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_goes_back_once_after_a_quiet_period_with_nothing_in_flight() {
        let mut idle = IdleRelease::default();
        // A worker that has served nothing keeps nothing to give back.
        assert!(!idle.due(0, 0));
        assert!(!idle.due(0, 0));
        // Calls during the period: not yet.
        assert!(!idle.due(3, 0));
        // A quiet period, but a call still running (a long shell command, a slow read).
        assert!(!idle.due(3, 1));
        // Quiet and nothing in flight: now, and only once.
        assert!(idle.due(3, 0));
        assert!(!idle.due(3, 0));
        assert!(!idle.due(3, 0));
        // Busy again: each period with a call started waits for the next quiet one.
        assert!(!idle.due(4, 0));
        assert!(!idle.due(9, 0));
        assert!(idle.due(9, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn the_release_runs_after_the_worker_goes_idle_and_stops_with_it() {
        static RELEASED: AtomicU64 = AtomicU64::new(0);
        fn release() {
            RELEASED.fetch_add(1, Ordering::Relaxed);
        }
        let activity = Activity::default();
        let in_flight = TaskTracker::new();
        let stop = CancellationToken::new();
        let task = tokio::spawn(release_when_idle(
            activity.clone(),
            in_flight.clone(),
            release,
            stop.clone(),
        ));
        activity.call_started();
        let call = in_flight.token();
        tokio::time::sleep(IDLE_FOR * 5).await;
        assert_eq!(RELEASED.load(Ordering::Relaxed), 0, "a call is in flight");
        drop(call);
        tokio::time::sleep(IDLE_FOR * 3).await;
        assert_eq!(RELEASED.load(Ordering::Relaxed), 1);
        tokio::time::sleep(IDLE_FOR * 5).await;
        assert_eq!(
            RELEASED.load(Ordering::Relaxed),
            1,
            "nothing new to give back"
        );
        stop.cancel();
        task.await.unwrap();
    }
}
