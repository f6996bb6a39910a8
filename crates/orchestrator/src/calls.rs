//! Calls in flight and recently finished, for `GET /v1/calls/{id}` and for waiting.
//!
//! Bounded by bytes (`[limits] result_memory_bytes`, DESIGN §15) and by count: finished
//! calls are forgotten oldest first once their results take more than the budget or the
//! table is full (older calls are read from the store). A call in flight is never
//! forgotten; a waiter that holds a forgotten call's receiver still sees its result.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_policy::{CallStatus, ToolOutcome};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How many finished calls are remembered in memory at most, whatever their size.
const CAPACITY: usize = 2_048;
/// What a remembered call costs beyond its result's text: ids, names, the record.
const RECORD_OVERHEAD: usize = 512;

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
    /// Shared, not owned: every waiter and `GET /v1/calls/{id}` gets the record by
    /// clone, and a result may be megabytes that would otherwise be copied each time.
    pub result: Option<Arc<ToolOutcome>>,
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
    /// Counted among the finished calls (once, when it became final).
    finished: bool,
}

pub struct CallRegistry {
    inner: Mutex<Table>,
    /// Bytes of finished calls kept at most.
    budget: usize,
}

#[derive(Default)]
struct Table {
    entries: HashMap<String, Entry>,
    /// Finished calls in the order they finished, with what each costs.
    finished: VecDeque<(String, usize)>,
    finished_bytes: usize,
}

impl Table {
    /// Forgets the oldest finished calls until both bounds hold.
    fn evict(&mut self, budget: usize) {
        while self.finished_bytes > budget || self.finished.len() > CAPACITY {
            let Some((call_id, bytes)) = self.finished.pop_front() else {
                return;
            };
            self.finished_bytes = self.finished_bytes.saturating_sub(bytes);
            self.entries.remove(&call_id);
        }
    }
}

/// What keeping `record` costs: its result's text (the bulk) and a fixed overhead.
fn record_bytes(record: &CallRecord) -> usize {
    let result = record.result.as_ref().map_or(0, |r| {
        r.content.iter().map(String::len).sum::<usize>()
            + r.isolation.as_ref().map_or(0, |i| i.to_string().len())
    });
    RECORD_OVERHEAD + result
}

impl CallRegistry {
    /// A registry that keeps at most `budget` bytes of finished calls.
    pub fn new(budget: u64) -> Self {
        Self {
            inner: Mutex::default(),
            budget: usize::try_from(budget).unwrap_or(usize::MAX),
        }
    }

    /// Registers a new call; returns the receiver that follows its state.
    pub fn insert(
        &self,
        record: CallRecord,
        cancel: CancellationToken,
    ) -> watch::Receiver<CallRecord> {
        let (tx, rx) = watch::channel(record.clone());
        let mut table = self.lock();
        table.entries.insert(
            record.call_id,
            Entry {
                state: tx,
                cancel,
                finished: false,
            },
        );
        rx
    }

    pub fn update(&self, call_id: &str, change: impl FnOnce(&mut CallRecord)) {
        let mut table = self.lock();
        let Some(entry) = table.entries.get_mut(call_id) else {
            return;
        };
        entry.state.send_modify(change);
        if entry.finished || !entry.state.borrow().status.is_final() {
            return;
        }
        entry.finished = true;
        let bytes = record_bytes(&entry.state.borrow());
        table.finished.push_back((call_id.to_owned(), bytes));
        table.finished_bytes += bytes;
        table.evict(self.budget);
    }

    /// Bytes and number of the finished calls kept now.
    #[cfg(test)]
    fn kept(&self) -> (usize, usize) {
        let table = self.lock();
        (table.finished_bytes, table.finished.len())
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

    fn finish(registry: &CallRegistry, call_id: &str, text_bytes: usize) {
        registry.update(call_id, |r| {
            r.status = CallStatus::Ok;
            r.result = Some(Arc::new(ToolOutcome::text("x".repeat(text_bytes))));
            r.checked = true;
        });
    }

    /// 300 finished 1 MiB results under a 4 MiB budget: what is kept stays under it,
    /// the newest are answered from memory, the oldest are gone; a call in flight is
    /// never forgotten, and a waiter keeps the result it was handed.
    #[tokio::test]
    async fn finished_calls_are_kept_by_bytes_not_by_count() {
        const MIB: usize = 1 << 20;
        let registry = CallRegistry::new(4 * MIB as u64);
        let running = registry.insert(
            CallRecord::running("call_long", "t0", "execute_shell", "local"),
            CancellationToken::new(),
        );
        let mut held = None;
        for i in 0..300 {
            let id = format!("call_{i}");
            let rx = registry.insert(
                CallRecord::running(&id, "t", "read_file", "local"),
                CancellationToken::new(),
            );
            finish(&registry, &id, MIB);
            if i == 0 {
                held = Some(rx);
            }
            let (bytes, _) = registry.kept();
            assert!(bytes <= 4 * MIB, "call {i}: {bytes} bytes kept");
        }
        let (bytes, count) = registry.kept();
        assert!(count >= 3, "the newest calls are kept: {count}");
        assert!(bytes > 2 * MIB, "{bytes}");
        assert!(registry.watch("call_299").is_some());
        assert!(
            registry.watch("call_0").is_none(),
            "the oldest went to the store"
        );
        assert!(
            registry.watch("call_long").is_some(),
            "a running call stays"
        );
        assert!(registry.cancel("call_long"));
        let held = held.unwrap();
        assert_eq!(held.borrow().result.as_ref().unwrap().content[0].len(), MIB);
        drop(running);
        // Small results are kept by count.
        let registry = CallRegistry::new(u64::MAX);
        for i in 0..(CAPACITY + 100) {
            let id = format!("small_{i}");
            let _ = registry.insert(
                CallRecord::running(&id, "t", "read_file", "local"),
                CancellationToken::new(),
            );
            finish(&registry, &id, 10);
        }
        assert_eq!(registry.kept().1, CAPACITY);
        assert!(registry.watch("small_0").is_none());
    }

    #[tokio::test]
    async fn a_zero_wait_still_waits_for_the_gates_checks() {
        let registry = CallRegistry::new(u64::MAX);
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
