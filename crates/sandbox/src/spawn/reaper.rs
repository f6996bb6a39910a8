//! Sandboxes torn down after their call has been answered.
//!
//! When a strict sandbox's command has exited, init reports its status and exits, and
//! the kernel then tears down what init leaves: its copy of the worker's address space,
//! the mount namespace of the new root, the pid namespace, the call's cgroups. Measured
//! on the spawn bench (bpftrace, from init's status report to the end of the parent's
//! last `rmdir`), that was 0.74 ms of a 2.6 ms run: init's exit 0.4 ms, the four v1
//! cgroup directories 0.19 ms. None of it changes the call's result, so once the
//! parent knows that nothing of the command runs any more (init's report is in, the
//! cgroup holds init alone, the output is at end-of-file) it answers, and the sandbox
//! is handed here: one thread per factory reaps init and removes the cgroups.
//!
//! Bounded: at most as many sandboxes wait here as the factory runs at once; a call
//! that finds the queue full tears its own sandbox down, as every call did before.
//! The factory's drop waits until every handed-over sandbox is gone.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use super::parent::Child;

/// The teardown thread of one factory, started by the first sandbox handed to it.
#[derive(Debug)]
pub(crate) struct Reaper {
    capacity: usize,
    running: Mutex<Option<Running>>,
    shared: Arc<Shared>,
}

/// What the thread shares with the factory.
#[derive(Debug, Default)]
struct Shared {
    /// Sandboxes handed over and not yet gone.
    pending: AtomicUsize,
    /// Taken by the thread around each teardown; a test holds it to look at a
    /// sandbox whose call was answered before its teardown.
    turn: Mutex<()>,
}

#[derive(Debug)]
struct Running {
    queue: SyncSender<Child>,
    thread: JoinHandle<()>,
}

impl Reaper {
    /// A reaper that holds at most `capacity` sandboxes waiting for their teardown.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            running: Mutex::new(None),
            shared: Arc::default(),
        }
    }

    /// Hands `child` over for its teardown; gives it back when the queue is full or the
    /// thread cannot be started, for the caller to tear it down itself.
    pub(super) fn hand_over(&self, child: Child) -> Result<(), Child> {
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        if running.is_none() {
            let (queue, waiting) = std::sync::mpsc::sync_channel(self.capacity);
            let shared = self.shared.clone();
            // Started on first use, not with the factory: a worker confines itself
            // before it starts threads, and its first call comes after that.
            let thread = std::thread::Builder::new()
                .name("airlock-reaper".into())
                .spawn(move || tear_down(&waiting, &shared));
            match thread {
                Ok(thread) => *running = Some(Running { queue, thread }),
                Err(_) => return Err(child),
            }
        }
        let Some(running) = running.as_ref() else {
            return Err(child);
        };
        self.shared.pending.fetch_add(1, Ordering::Relaxed);
        match running.queue.try_send(child) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(child) | TrySendError::Disconnected(child)) => {
                self.shared.pending.fetch_sub(1, Ordering::Relaxed);
                Err(child)
            }
        }
    }

    /// Sandboxes handed over whose teardown has not finished.
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.shared.pending.load(Ordering::Relaxed)
    }

    /// Stops the thread before its next teardown while the guard lives.
    #[cfg(test)]
    pub(crate) fn hold(&self) -> std::sync::MutexGuard<'_, ()> {
        self.shared
            .turn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// The thread: each sandbox is reaped and its cgroup removed, in turn.
fn tear_down(waiting: &Receiver<Child>, shared: &Shared) {
    for mut child in waiting {
        let _turn = shared.turn.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = child.finish_after_report() {
            tracing::warn!(error = %e, "a finished sandbox could not be torn down");
        }
        shared.pending.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        let running = self
            .running
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(Running { queue, thread }) = running {
            // The thread ends when the queue is closed and empty.
            drop(queue);
            let _ = thread.join();
        }
    }
}
