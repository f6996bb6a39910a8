//! What every stage knows about the call it is deciding: who asked, in which session,
//! for what, and how to stop it.

use std::time::Instant;

use airlock_policy::SessionId;
use airlock_telemetry::CallSpan;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::budget::Slot;
use super::ending::Held;
use crate::audit::{AuditKind, NewAuditEvent};
use crate::auth::Principal;
use crate::dispatch::WorkerEvent;
use crate::store::NewCall;

/// One proposed call, already in domain form.
#[derive(Debug, Clone)]
pub struct ToolUse {
    pub id: String,
    pub name: String,
    pub input: Value,
}

/// One call on its way through the gate.
pub(super) struct CallCtx {
    pub call_id: String,
    pub principal: Principal,
    pub session: SessionId,
    /// Whether the request named its session: only those count against session budgets.
    pub session_named: bool,
    /// The call as proposed; admission replaces the input with the tool's own spelling
    /// of it (strict-mode clients send `null` for optional fields and pairs for maps).
    pub tool_use: ToolUse,
    /// Where the worker's progress and output go, for front doors that stream them.
    pub events: Option<mpsc::Sender<WorkerEvent>>,
    pub cancel: CancellationToken,
    /// Set by the approval stage: how long the call waited for a human.
    pub held: Option<Held>,
    pub started: Instant,
    /// The call's audit events not yet in the store, oldest first. They go into the
    /// log with the call's next store write, in the same transaction (see
    /// docs/decisions.md, "One durable write per call").
    pub journal: Vec<NewAuditEvent>,
    /// The call's place in its session's count from the budget check until its row is
    /// held ([`PendingRow`]) or in the store (a held call's approval): calls checked at
    /// the same time each see the others.
    pub budget_slot: Option<Slot>,
    /// The call's row while it is not in the store yet: set once the call may run, and
    /// taken by the write that stores it.
    pub row: Option<PendingRow>,
    /// Whether the store holds the call's row (written ahead, held for approval, or
    /// resumed from the store).
    pub recorded: bool,
    /// The call's span (with tracing on): the gate's stages, the dispatch and the log
    /// lines written while the call runs hang from it.
    pub span: CallSpan,
}

/// A call's row not yet written, and its place in the session's count until it is.
pub(super) struct PendingRow {
    pub call: NewCall,
    /// Counts the call against its session's budget until the store does.
    pub _slot: Option<Slot>,
}

impl CallCtx {
    /// An audit event about this call.
    pub fn event(&self, kind: AuditKind, data: Value) -> NewAuditEvent {
        NewAuditEvent::new(kind, data)
            .call_id(self.call_id.as_str())
            .principal(self.principal.name.as_str())
            .session_id(Some(self.session.as_str().to_owned()))
    }

    /// Notes an audit event about this call, for its next store write.
    pub fn note(&mut self, kind: AuditKind, data: Value) {
        let event = self.event(kind, data);
        self.journal.push(event);
    }
}
