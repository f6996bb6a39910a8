//! Calls that outlive the task that started them: approvals that expire, calls
//! approved while their orchestrator was down or dispatched by a replica whose lease
//! ran out, and calls known only to the store.

use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_policy::{CallStatus, SessionId, ToolOutcome};
use airlock_telemetry::{CallSpan, StageParent};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::ctx::{CallCtx, ToolUse};
use super::ending::{Ending, Held};
use super::{Dispatch, Gate, Record};
use crate::audit::{AuditKind, NewAuditEvent};
use crate::auth::Principal;
use crate::calls::CallRecord;
use crate::dispatch;
use crate::store::{CallState, ExpiredApproval, StoreError, StoredCall, now_millis};

/// Approvals one expiry sweep transaction takes at most.
const EXPIRE_BATCH: usize = 256;
/// A call this young is left to its own task by the resume loop.
const RESUME_AFTER: Duration = Duration::from_secs(5);
/// How often the resume loop looks at the store.
const RESUME_EVERY: Duration = Duration::from_secs(2);

impl Gate {
    /// Marks overdue approvals expired and audits each (once, across replicas).
    pub async fn expire_sweep(&self) -> Result<(), StoreError> {
        let now = now_millis();
        // In batches, so that a sweep after a long outage holds a bounded number of
        // rows, never every overdue approval at once.
        loop {
            let batch = self.store.expire_approvals(now, EXPIRE_BATCH).await?;
            let full = batch.len() >= EXPIRE_BATCH;
            for approval in batch {
                self.audit_expired(approval).await;
            }
            self.notify_decided();
            if !full {
                return Ok(());
            }
        }
    }

    /// The `expired` audit event of one approval that the store has just moved to
    /// `expired`: by the sweep, or by a decision or withdrawal that came after the
    /// deadline (the store expires it then, and the sweep never sees it again).
    pub(super) async fn audit_expired(&self, approval: ExpiredApproval) {
        self.audit(
            NewAuditEvent::new(
                AuditKind::Expired,
                json!({"approval_id": approval.approval_id}),
            )
            .call_id(approval.call_id)
            .principal(approval.principal)
            .session_id(approval.session_id),
        )
        .await;
    }

    /// Resumes calls that no live task will finish: approved while their orchestrator
    /// was down, or dispatched by a replica whose lease ran out.
    pub async fn resume_forever(self: Arc<Self>, stop: CancellationToken) {
        loop {
            if let Err(e) = self.expire_sweep().await {
                tracing::warn!(error = %e, "cannot expire approvals");
            }
            match self.store.resumable_calls(now_millis()).await {
                Ok(calls) => {
                    let cutoff = now_millis() - RESUME_AFTER.as_millis() as i64;
                    for call in calls.into_iter().filter(|c| c.created_at < cutoff) {
                        if self
                            .calls
                            .watch(&call.call_id)
                            .is_some_and(|r| !r.borrow().status.is_final())
                        {
                            continue; // a task of this replica is on it
                        }
                        let gate = self.clone();
                        tokio::spawn(async move { gate.resume(call).await });
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot list resumable calls"),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(RESUME_EVERY) => {}
            }
        }
    }

    async fn resume(self: Arc<Self>, call: StoredCall) {
        let Some(tool) = self.catalog.get(&call.tool) else {
            return;
        };
        // Validated when the call was recorded: a session the store cannot give back
        // as one is a damaged row, left alone rather than run under another session.
        let session = match call.session_id.as_deref().map(SessionId::parse).transpose() {
            Ok(session) => session.unwrap_or_else(SessionId::default_session),
            Err(e) => {
                tracing::error!(call_id = %call.call_id, error = %e, "the stored call's session is unreadable; not resuming it");
                return;
            }
        };
        let cancel = CancellationToken::new();
        let mut record = CallRecord::running(
            &call.call_id,
            &call.tool_use_id,
            &call.tool,
            &call.principal,
        );
        record.approval_id = call.approval_id.clone().map(String::from);
        record.checked = true;
        self.calls.insert(record, cancel.clone());
        // Written with the claim, in its transaction.
        let resumed = NewAuditEvent::new(AuditKind::Resumed, json!({"state": call.state.as_str()}))
            .call_id(call.call_id.clone());
        // The wait was on another task (or before a restart): only the store knows it.
        let held = match &call.approval_id {
            Some(id) => match self.store.get_approval(id).await {
                Ok(Some(a)) => Some(Held::new(Some(&a), Duration::ZERO)),
                _ => None,
            },
            None => None,
        };
        // A call that never reached a worker is checked again like a fresh dispatch; one
        // that did is joined on its worker, where it started while it was allowed.
        let recheck = (call.state == CallState::Approved).then_some("resume");
        // Only approved calls are sent detached (the worker keeps them, and one sent
        // again joins its run). A call policy allowed was sent attached: it ran, or was
        // stopped, when its replica's stream went away, and the worker kept nothing of
        // it. Sent again it would run twice (`echo >> file` twice); it ends instead,
        // saying that it may have run.
        let sent_attached = call.state == CallState::Dispatched && call.approval_id.is_none();
        let mut ctx = CallCtx {
            call_id: call.call_id.into(),
            principal: Principal {
                name: call.principal,
                roles: Vec::new(),
            },
            session,
            session_named: call.session_id.is_some(),
            tool_use: ToolUse {
                id: call.tool_use_id,
                name: call.tool,
                input: call.input,
            },
            events: None,
            cancel,
            held,
            started: Instant::now(),
            journal: vec![resumed],
            budget_slot: None,
            row: None,
            recorded: true,
            // A resumed call continues no request's trace.
            span: CallSpan::default(),
        };
        let result = self
            .claim_and_dispatch(
                &mut ctx,
                &tool,
                Dispatch {
                    record: Record::Stored,
                    durable: true,
                    recheck,
                    trace: StageParent::current(),
                    sent_attached,
                },
            )
            .await;
        self.conclude(&mut ctx, result).await;
    }

    /// Cancels a call this replica holds no task for (another replica's, or one only
    /// the store knows): a pending approval is withdrawn, a dispatched call is stopped
    /// on its worker. The replica running it records how it ended.
    pub async fn cancel_elsewhere(&self, call_id: &str) {
        let Ok(Some(stored)) = self.store.get_call(&call_id.into()).await else {
            return;
        };
        match stored.state {
            CallState::PendingApproval => {
                let Some(approval_id) = stored.approval_id else {
                    return;
                };
                let whose = ExpiredApproval {
                    approval_id: approval_id.clone(),
                    call_id: stored.call_id.clone(),
                    principal: stored.principal.clone(),
                    session_id: stored.session_id.clone(),
                };
                if self.withdraw(whose).await.is_ok() {
                    self.audit(
                        NewAuditEvent::new(
                            AuditKind::ApprovalWithdrawn,
                            json!({"approval_id": approval_id}),
                        )
                        .call_id(call_id),
                    )
                    .await;
                    self.notify_decided();
                }
            }
            CallState::Approved | CallState::Dispatched => {
                let group = self
                    .catalog
                    .get(&stored.tool)
                    .and_then(|tool| self.catalog.group(&tool.group));
                if let Some(group) = group {
                    dispatch::cancel_everywhere(&group, call_id).await;
                }
            }
            CallState::Finished | CallState::Rejected => {}
        }
    }

    /// A call known only to the store (another replica's, or from before a restart).
    /// An id with a control character names no call (and is not sent to a store that
    /// may refuse it as text); a store that cannot answer is an error, not "no call".
    pub async fn stored_record(&self, call_id: &str) -> Result<Option<CallRecord>, StoreError> {
        if crate::wire::has_control(call_id) {
            return Ok(None);
        }
        let Some(stored) = self.store.get_call(&call_id.into()).await? else {
            return Ok(None);
        };
        let mut record = CallRecord::running(
            &stored.call_id,
            &stored.tool_use_id,
            &stored.tool,
            &stored.principal,
        );
        record.approval_id = stored.approval_id.clone().map(String::from);
        record.duration_ms = stored.duration_ms;
        record.replica = stored.replica.clone();
        record.checked = true;
        if let Some(id) = &stored.approval_id
            && let Ok(Some(approval)) = self.store.get_approval(id).await
            && approval.decided_at.is_some()
        {
            record.approval_wait_ms = Some(Held::new(Some(&approval), Duration::ZERO).reported_ms);
        }
        match stored_ending(&stored) {
            Some(ending) => {
                record.status = ending.status;
                record.result = Some(Arc::new(ending.outcome));
            }
            None if stored.state == CallState::PendingApproval => {
                record.status = CallStatus::PendingApproval
            }
            None => {}
        }
        Ok(Some(record))
    }
}

/// The final outcome a stored call holds, if it is finished or rejected.
pub(super) fn stored_ending(stored: &StoredCall) -> Option<Ending> {
    match stored.state {
        CallState::Finished => {
            let outcome: ToolOutcome = stored
                .result
                .clone()
                .and_then(|v| serde_json::from_value(v).ok())
                .unwrap_or_else(|| ToolOutcome::error("the stored result is unreadable"));
            // A finished row always has its final status (one update writes both); the
            // store refuses a row whose status it cannot name.
            let status = stored
                .status
                .filter(|status| status.is_final())
                .unwrap_or(CallStatus::Error);
            Some(Ending::produced(status, outcome, stored.replica.clone()).observed())
        }
        CallState::Rejected => Some(
            Ending::error(
                CallStatus::Denied,
                "the call was denied or its approval expired",
            )
            .observed(),
        ),
        _ => None,
    }
}
