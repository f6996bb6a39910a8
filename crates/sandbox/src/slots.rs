//! How many sandboxes of one [`Sandbox`](crate::Sandbox) run at once.
//!
//! Every sandbox reserves up to its memory limit; without a bound one request with 64
//! parallel calls of 512 MiB each could reserve 32 GiB on a 23 GiB host. A call beyond
//! `max_concurrent` waits for a slot, inside its own deadline: its wall clock starts
//! when it is accepted, so the time it queued counts against its timeout, and a call
//! whose timeout runs out while it waits never starts.

use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::Cancel;

/// One `thiserror` enum per module: waiting for a slot failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    #[error(
        "no sandbox became free within the call's timeout ({waited_ms} ms): {max} sandboxes \
         already run at once ([sandbox] max_concurrent); try again later or with a longer \
         timeout_seconds"
    )]
    Busy { max: usize, waited_ms: u64 },
    #[error("the call was cancelled while it waited for a free sandbox")]
    Cancelled,
}

/// A counting semaphore for blocking callers (sandbox runs happen on blocking threads).
#[derive(Debug)]
pub(crate) struct Slots {
    max: usize,
    in_use: Mutex<usize>,
    freed: Condvar,
}

/// A taken slot, given back on drop.
#[derive(Debug)]
pub(crate) struct Slot<'a> {
    slots: &'a Slots,
}

/// How often a waiting caller looks at its cancel flag (which has no wake-up of its own).
const CANCEL_POLL: Duration = Duration::from_millis(20);

impl Slots {
    pub(crate) fn new(max: usize) -> Self {
        Slots {
            max: max.max(1),
            in_use: Mutex::new(0),
            freed: Condvar::new(),
        }
    }

    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// Takes a slot, waiting until `deadline` at most; gives up when `cancel` is set.
    pub(crate) fn take(&self, deadline: Instant, cancel: &Cancel) -> Result<Slot<'_>, SlotError> {
        let started = Instant::now();
        // A poisoned lock only means another thread panicked while counting; the count
        // itself is still right (it is updated in single statements).
        let mut in_use = self.in_use.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if cancel.is_cancelled() {
                return Err(SlotError::Cancelled);
            }
            if *in_use < self.max {
                *in_use += 1;
                return Ok(Slot { slots: self });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(SlotError::Busy {
                    max: self.max,
                    waited_ms: u64::try_from(now.duration_since(started).as_millis())
                        .unwrap_or(u64::MAX),
                });
            }
            let wait = (deadline - now).min(CANCEL_POLL);
            in_use = self
                .freed
                .wait_timeout(in_use, wait)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    #[cfg(test)]
    fn in_use(&self) -> usize {
        *self.in_use.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut in_use = self
            .slots
            .in_use
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *in_use = in_use.saturating_sub(1);
        self.slots.freed.notify_one();
    }
}

/// The default `max_concurrent`: twice the CPUs this process may use.
pub fn default_max_concurrent() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get() * 2)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
    use super::*;
    use std::sync::Arc;
    use std::sync::mpsc;

    #[test]
    fn a_full_set_makes_callers_wait_and_a_freed_slot_lets_one_in() {
        let slots = Arc::new(Slots::new(2));
        let never = Cancel::new();
        let far = Instant::now() + Duration::from_secs(60);
        let a = slots.take(far, &never).unwrap();
        let _b = slots.take(far, &never).unwrap();
        assert_eq!(slots.in_use(), 2);
        let (tx, rx) = mpsc::channel();
        let waiter = {
            let slots = slots.clone();
            std::thread::spawn(move || {
                let never = Cancel::new();
                let slot = slots.take(Instant::now() + Duration::from_secs(60), &never);
                tx.send(slot.is_ok()).unwrap();
            })
        };
        // The waiter cannot have a slot while both are held.
        assert!(rx.try_recv().is_err());
        drop(a);
        assert_eq!(rx.recv_timeout(Duration::from_secs(30)), Ok(true));
        waiter.join().unwrap();
    }

    #[test]
    fn a_deadline_that_passes_while_waiting_is_busy_and_cancel_stops_the_wait() {
        let slots = Slots::new(1);
        let never = Cancel::new();
        let _held = slots
            .take(Instant::now() + Duration::from_secs(60), &never)
            .unwrap();
        let err = slots.take(Instant::now(), &never).unwrap_err();
        assert!(matches!(err, SlotError::Busy { max: 1, .. }), "{err}");
        assert!(err.to_string().contains("max_concurrent"), "{err}");
        let cancel = Cancel::new();
        cancel.cancel();
        let err = slots
            .take(Instant::now() + Duration::from_secs(60), &cancel)
            .unwrap_err();
        assert_eq!(err, SlotError::Cancelled);
    }
}
