//! Calls in flight and recently finished, for `GET /v1/calls/{id}` and for waiting.
//!
//! Bounded: the oldest finished calls are forgotten first once the table is full.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use airlock_policy::{CallStatus, ToolOutcome};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How many calls are remembered in memory (older ones are read from the store).
const CAPACITY: usize = 2_048;

/// Everything known about one call.
#[derive(Debug, Clone)]
pub struct CallRecord {
    pub call_id: String,
    pub tool_use_id: String,
    pub tool: String,
    pub principal: String,
    pub status: CallStatus,
    pub approval_id: Option<String>,
    /// Time the call ran: the gate's checks and the worker, without the time it was
    /// held for approval (that is `approval_wait_ms`).
    pub duration_ms: Option<u64>,
    /// How long the call was held for approval, from the request for approval to the
    /// decision (or expiry, or withdrawal); only for calls that were held.
    pub approval_wait_ms: Option<u64>,
    pub replica: Option<String>,
    pub result: Option<ToolOutcome>,
    /// The gate's checks are done: the call is held for approval, on a worker, or
    /// final. Until then `running` would not yet say whether a human is needed, so
    /// waits (even `wait_ms: 0`) last at least until this is set.
    pub checked: bool,
}

impl CallRecord {
    /// A call that has just started.
    pub fn running(call_id: &str, tool_use_id: &str, tool: &str, principal: &str) -> Self {
        Self {
            call_id: call_id.to_owned(),
            tool_use_id: tool_use_id.to_owned(),
            tool: tool.to_owned(),
            principal: principal.to_owned(),
            status: CallStatus::Running,
            approval_id: None,
            duration_ms: None,
            approval_wait_ms: None,
            replica: None,
            result: None,
            checked: false,
        }
    }

    pub fn isolation(&self) -> Option<&serde_json::Value> {
        self.result.as_ref().and_then(|r| r.isolation.as_ref())
    }
}

struct Entry {
    state: watch::Sender<CallRecord>,
    cancel: CancellationToken,
}

#[derive(Default)]
pub struct CallRegistry {
    inner: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    entries: HashMap<String, Entry>,
    order: VecDeque<String>,
}

impl CallRegistry {
    /// Registers a new call; returns the receiver that follows its state.
    pub fn insert(
        &self,
        record: CallRecord,
        cancel: CancellationToken,
    ) -> watch::Receiver<CallRecord> {
        let (tx, rx) = watch::channel(record.clone());
        let mut table = self.lock();
        while table.entries.len() >= CAPACITY {
            let Some(oldest) = table.order.pop_front() else {
                break;
            };
            table.entries.remove(&oldest);
        }
        table.order.push_back(record.call_id.clone());
        table
            .entries
            .insert(record.call_id, Entry { state: tx, cancel });
        rx
    }

    pub fn update(&self, call_id: &str, change: impl FnOnce(&mut CallRecord)) {
        if let Some(entry) = self.lock().entries.get(call_id) {
            entry.state.send_modify(change);
        }
    }

    pub fn watch(&self, call_id: &str) -> Option<watch::Receiver<CallRecord>> {
        self.lock()
            .entries
            .get(call_id)
            .map(|e| e.state.subscribe())
    }

    /// Cancels a running call; `false` when the call is unknown.
    pub fn cancel(&self, call_id: &str) -> bool {
        match self.lock().entries.get(call_id) {
            Some(entry) => {
                entry.cancel.cancel();
                true
            }
            None => false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        match self.inner.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

/// The longest a wait lasts beyond its own `wait` for the gate's checks to finish. They
/// are local (schema, policy, a store write) and normally take milliseconds; the bound
/// only keeps a stuck store from holding the request forever.
const CHECKS_BOUND: Duration = Duration::from_secs(10);

/// Waits until the call is final or `wait` has passed; returns its state either way.
/// Even with a `wait` of zero it returns only once the gate's checks are done (bounded
/// by [`CHECKS_BOUND`]), so a call that needs approval is reported `pending_approval`
/// with its approval id, never as a `running` call that has not reached the gate.
pub async fn wait_final(mut rx: watch::Receiver<CallRecord>, wait: Duration) -> CallRecord {
    let _ = tokio::time::timeout(wait, rx.wait_for(|r| r.status.is_final())).await;
    if !rx.borrow().checked {
        let _ = tokio::time::timeout(
            CHECKS_BOUND,
            rx.wait_for(|r| r.checked || r.status.is_final()),
        )
        .await;
    }
    rx.borrow().clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_zero_wait_still_waits_for_the_gates_checks() {
        let registry = CallRegistry::default();
        let rx = registry.insert(
            CallRecord::running("call_1", "t1", "write_file", "local"),
            CancellationToken::new(),
        );
        let waiting = tokio::spawn(wait_final(rx, Duration::ZERO));
        // On this single-threaded runtime, yielding lets the waiter run up to its wait.
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished(), "answered before the gate's checks");
        registry.update("call_1", |r| {
            r.status = CallStatus::PendingApproval;
            r.approval_id = Some("apr_1".into());
            r.checked = true;
        });
        let record = waiting.await.unwrap();
        assert_eq!(record.status, CallStatus::PendingApproval);
        assert_eq!(record.approval_id.as_deref(), Some("apr_1"));

        // A call that is already checked is answered as it is.
        let rx = registry.watch("call_1").unwrap();
        let record = wait_final(rx, Duration::ZERO).await;
        assert_eq!(record.status, CallStatus::PendingApproval);
    }
}
