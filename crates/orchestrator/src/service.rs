//! The one call service under the front doors (HTTP, SSE, gRPC, MCP, the agent loop):
//! admission — the agent role, the per-minute rate, submission to the gate — and a
//! [`CallHandle`] that follows each call to its end. A door parses its own wire format
//! into [`Proposed`] calls and maps [`AdmitError`] and the handle's [`Update`]s back
//! into it; nothing else about a call differs between doors.
//!
//! Cancellation has one rule, chosen per batch by the door ([`OnDrop`]): a handle
//! dropped before its call ended cancels the call (the follower went away: a closed
//! stream, an agent run that stopped), unless the door admitted the batch to keep
//! running (a request that answers after `wait_ms` and names `GET /v1/calls/{id}`).
//! Explicit cancellation is [`CallHandle::cancel`].

use std::sync::Arc;
use std::time::Duration;

use airlock_policy::{CallStatus, SessionId};
use tokio::sync::{mpsc, watch};

use crate::auth::{Principal, Role};
use crate::budget::BudgetError;
use crate::calls::{CallRecord, wait_final};
use crate::dispatch::WorkerEvent;
use crate::gate::{Gate, ToolUse};

/// Worker events buffered per call for a door that forwards them.
const EVENT_BUFFER: usize = 256;

/// A call a door could not turn into a tool use (arguments that are not a JSON object);
/// it is recorded and answered as an `is_error` result, like any failed call.
#[derive(Debug, Clone)]
pub struct Refused {
    pub id: String,
    pub name: String,
    pub message: String,
}

impl From<(String, String, String)> for Refused {
    fn from((id, name, message): (String, String, String)) -> Self {
        Self { id, name, message }
    }
}

/// One proposed call as a door parsed it.
pub type Proposed = Result<ToolUse, Refused>;

/// What becomes of a call whose handle is dropped before the call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDrop {
    /// The follower went away: stop the call and its sandbox.
    Cancel,
    /// The call outlives the request by design; its result stays at `GET /v1/calls/{id}`.
    KeepRunning,
}

/// A batch of calls from one request, in request order.
pub struct Batch {
    /// The session the request named, if it named one (only those count against session
    /// budgets); the rest run in `default`.
    pub session: Option<SessionId>,
    pub calls: Vec<Proposed>,
    /// Whether the door forwards the workers' progress and output.
    pub with_events: bool,
    pub on_drop: OnDrop,
}

/// Why a batch was not admitted; each door says it in its own wire format.
#[derive(Debug, thiserror::Error)]
pub enum AdmitError {
    #[error("principal {principal:?} lacks the agent role")]
    NotAnAgent { principal: String },
    #[error(transparent)]
    RateLimited(BudgetError),
}

/// What happened next to a followed call.
pub enum Update {
    /// A worker's progress or output (those sent before the call ended come first).
    Event(WorkerEvent),
    /// The call changed state without ending (it waits for approval, it runs again).
    Changed(CallRecord),
    /// The call ended; every later [`CallHandle::next`] says so again.
    Final(CallRecord),
}

#[derive(Clone)]
pub struct CallService {
    gate: Arc<Gate>,
}

impl CallService {
    pub fn new(gate: Arc<Gate>) -> Self {
        Self { gate }
    }

    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }

    /// Admits a batch: the principal must be an agent and within its rate (one token
    /// per call); then every call enters the gate and runs to its end whether or not
    /// anyone follows it (see [`OnDrop`]).
    pub fn admit(
        &self,
        principal: &Principal,
        batch: Batch,
    ) -> Result<Vec<CallHandle>, AdmitError> {
        if !principal.has(Role::Agent) {
            return Err(AdmitError::NotAnAgent {
                principal: principal.name.clone(),
            });
        }
        let wanted = u32::try_from(batch.calls.len()).unwrap_or(u32::MAX);
        self.gate
            .take_rate(&principal.name, wanted)
            .map_err(AdmitError::RateLimited)?;
        Ok(self.enter(principal, batch))
    }

    /// Records every call of `batch` as failed with `message`, without running any (an
    /// agent run answers a refused batch call by call, so that its model reads why).
    pub fn refuse(&self, principal: &Principal, batch: Batch, message: &str) -> Vec<CallHandle> {
        batch
            .calls
            .into_iter()
            .map(|call| {
                let (id, name) = match call {
                    Ok(tool_use) => (tool_use.id, tool_use.name),
                    Err(refused) => (refused.id, refused.name),
                };
                let state = self.gate.reject(principal, id, name, message.to_owned());
                self.handle(state, None, batch.on_drop)
            })
            .collect()
    }

    fn enter(&self, principal: &Principal, batch: Batch) -> Vec<CallHandle> {
        let named = batch.session.is_some();
        let session = batch.session.unwrap_or_else(SessionId::default_session);
        batch
            .calls
            .into_iter()
            .map(|call| match call {
                Ok(tool_use) => {
                    let (events_tx, events_rx) = if batch.with_events {
                        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
                        (Some(tx), Some(rx))
                    } else {
                        (None, None)
                    };
                    let state = self
                        .gate
                        .submit(principal, &session, named, tool_use, events_tx);
                    self.handle(state, events_rx, batch.on_drop)
                }
                Err(refused) => {
                    let state =
                        self.gate
                            .reject(principal, refused.id, refused.name, refused.message);
                    self.handle(state, None, batch.on_drop)
                }
            })
            .collect()
    }

    fn handle(
        &self,
        state: watch::Receiver<CallRecord>,
        events: Option<mpsc::Receiver<WorkerEvent>>,
        on_drop: OnDrop,
    ) -> CallHandle {
        let first = state.borrow().clone();
        CallHandle {
            gate: self.gate.clone(),
            call_id: first.call_id,
            state,
            events,
            reported: None,
            on_drop,
        }
    }
}

/// Follows one admitted call.
pub struct CallHandle {
    gate: Arc<Gate>,
    call_id: String,
    state: watch::Receiver<CallRecord>,
    events: Option<mpsc::Receiver<WorkerEvent>>,
    /// The state last reported by [`CallHandle::next`].
    reported: Option<CallStatus>,
    on_drop: OnDrop,
}

impl CallHandle {
    pub fn call_id(&self) -> &str {
        &self.call_id
    }

    /// The call as it is now.
    pub fn record(&self) -> CallRecord {
        self.state.borrow().clone()
    }

    /// Stops the call (and its sandbox); it ends `cancelled` once its worker confirmed.
    pub fn cancel(&self) {
        self.gate.cancel(&self.call_id);
    }

    /// The next thing that happens to the call. The first answer is the call's state at
    /// admission (`Changed`, or `Final` for a call refused at once).
    pub async fn next(&mut self) -> Update {
        loop {
            let record = self.state.borrow_and_update().clone();
            if record.status.is_final() {
                if let Some(event) = self.events.as_mut().and_then(|e| e.try_recv().ok()) {
                    return Update::Event(event);
                }
                self.reported = Some(record.status);
                return Update::Final(record);
            }
            if self.reported != Some(record.status) {
                self.reported = Some(record.status);
                return Update::Changed(record);
            }
            tokio::select! {
                changed = self.state.changed() => {
                    if changed.is_err() {
                        // The registry dropped the call: what it last held is all there is.
                        return Update::Final(self.state.borrow().clone());
                    }
                }
                event = recv(&mut self.events) => match event {
                    Some(event) => return Update::Event(event),
                    None => self.events = None,
                },
            }
        }
    }

    /// Waits at most `wait` for the call to end (and briefly for the gate's checks, so
    /// that a call answered early says `pending_approval` rather than `running` when it
    /// is held); the call as it is then.
    pub async fn wait_final(&self, wait: Duration) -> CallRecord {
        wait_final(self.state.clone(), wait).await
    }
}

impl Drop for CallHandle {
    fn drop(&mut self) {
        if self.on_drop == OnDrop::Cancel && !self.state.borrow().status.is_final() {
            self.gate.cancel(&self.call_id);
        }
    }
}

/// Receives from an optional channel; pending forever once it is closed.
async fn recv(events: &mut Option<mpsc::Receiver<WorkerEvent>>) -> Option<WorkerEvent> {
    match events {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}
