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
    pub duration_ms: Option<u64>,
    pub replica: Option<String>,
    pub result: Option<ToolOutcome>,
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
            replica: None,
            result: None,
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

/// Waits until the call is final or `wait` has passed; returns its state either way.
pub async fn wait_final(mut rx: watch::Receiver<CallRecord>, wait: Duration) -> CallRecord {
    let _ = tokio::time::timeout(wait, rx.wait_for(|r| r.status.is_final())).await;
    rx.borrow().clone()
}
