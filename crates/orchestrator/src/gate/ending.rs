//! How a call ends: a stage's typed [`Rejection`], or an [`Ending`] that a worker, the
//! cache or another replica produced; and the one place both are recorded
//! ([`Gate::conclude`]).

use std::sync::Arc;
use std::time::Duration;

use airlock_policy::{CallStatus, ToolOutcome};
use airlock_telemetry::CallSpan;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::Gate;
use super::ctx::CallCtx;
use crate::audit::{AuditKind, NewAuditEvent};
use crate::dispatch::DispatchError;
use crate::metrics::Refusal;
use crate::store::{Approval, CallChange, CallOutcome, CallWrite, StoreError, now_millis};

/// How long a call was held for approval.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Held {
    /// Measured here (monotonic clock): taken out of the call's `duration_ms`, which is
    /// the time the call itself took.
    pub local: Duration,
    /// Reported as `approval_wait_ms`: from the approval's creation to its decision as
    /// the store recorded them, so every replica reports the same number.
    pub reported_ms: u64,
}

impl Held {
    pub fn new(approval: Option<&Approval>, local: Duration) -> Self {
        let from_store = approval.and_then(|a| {
            let decided = a.decided_at?;
            u64::try_from(decided.saturating_sub(a.created_at)).ok()
        });
        Self {
            local,
            reported_ms: from_store.unwrap_or(local.as_millis() as u64),
        }
    }
}

/// How a call ended, before it is recorded.
pub(super) struct Ending {
    pub status: CallStatus,
    pub outcome: ToolOutcome,
    pub replica: Option<String>,
    /// Whether this task owns the call's outcome. A replica that lost the dispatch
    /// claim only reports what the winner recorded; it never writes an outcome.
    pub owned: bool,
}

impl Ending {
    pub fn error(status: CallStatus, message: impl Into<String>) -> Self {
        Self {
            status,
            outcome: ToolOutcome::error(message),
            replica: None,
            owned: true,
        }
    }

    /// A result the call produced (a worker's, or the cache's).
    pub fn produced(status: CallStatus, outcome: ToolOutcome, replica: Option<String>) -> Self {
        Self {
            status,
            outcome,
            replica,
            owned: true,
        }
    }

    /// An ending another replica owns: reported here, recorded there.
    pub fn observed(mut self) -> Self {
        self.owned = false;
        self
    }
}

/// Why a stage stopped a call. The message is the `is_error` text the caller sees, so
/// it says what to change.
#[derive(Debug, thiserror::Error)]
pub(super) enum Rejection {
    #[error("unknown tool {name:?}; list the available tools with GET /v1/tools")]
    UnknownTool { name: String },
    /// The call's id or tool name (`what`) is empty, too long, or holds control
    /// characters.
    #[error(
        "the tool call's {what} must be 1 to 256 characters without control characters; send it as such"
    )]
    MalformedToolUse { what: &'static str },
    #[error(
        "arguments of {tool} are {bytes} bytes, over the limit of {limit} bytes; send less data per call"
    )]
    ArgumentsTooLarge {
        tool: String,
        bytes: u64,
        limit: u64,
    },
    #[error(
        "arguments of {tool} nest {depth} levels deep, over the limit of {limit}; flatten them"
    )]
    ArgumentsTooDeep {
        tool: String,
        depth: usize,
        limit: usize,
    },
    #[error(
        "invalid arguments for {tool}: {}. Fix the arguments to match the tool's input_schema and call again",
        violations.join("; ")
    )]
    InvalidArguments {
        tool: String,
        /// What the caller is told: each violation with the value it is about.
        violations: Vec<String>,
        /// What the audit log keeps: the same violations with every value masked.
        audited: Vec<String>,
    },
    #[error("{reason}")]
    OverBudget { reason: String },
    #[error("denied by policy: {}", reasons.join("; "))]
    DeniedByPolicy { reasons: Vec<String> },
    #[error("the approval was denied by {by}{}", reason.as_ref().map(|r| format!(": {r}")).unwrap_or_default())]
    ApprovalDenied { by: String, reason: Option<String> },
    #[error("the approval expired before anyone decided; ask an approver and call again")]
    ApprovalExpired,
    #[error("the pending approval disappeared from the store")]
    ApprovalMissing,
    /// The caller cancelled while the call waited; the request was withdrawn so that a
    /// later approval cannot run it.
    #[error("the call was cancelled while it waited for approval")]
    Withdrawn { approval_id: String },
    /// Checked again after the claim (`stage`: dispatch or resume), the call no longer
    /// holds.
    #[error(
        "denied: the approved call was checked again before it ran, and {}",
        reasons.join("; ")
    )]
    Revoked {
        stage: &'static str,
        reasons: Vec<String>,
    },
    #[error("no worker group serves {tool}")]
    NoWorkerGroup { tool: String },
    /// Sent to its worker by a replica that went away before recording its end.
    #[error(
        "the orchestrator that sent this call to its worker stopped before recording how it ended, and the worker kept no record of it: the call may have run, in part or whole; check its effects before calling it again"
    )]
    LostInFlight,
    #[error("the store cannot {doing}: {error}")]
    Store {
        doing: &'static str,
        error: StoreError,
    },
    #[error(transparent)]
    Dispatch(#[from] DispatchError),
}

impl Rejection {
    pub fn status(&self) -> CallStatus {
        match self {
            Self::DeniedByPolicy { .. }
            | Self::ApprovalDenied { .. }
            | Self::ApprovalExpired
            | Self::Revoked { .. } => CallStatus::Denied,
            Self::Withdrawn { .. } | Self::Dispatch(DispatchError::Cancelled) => {
                CallStatus::Cancelled
            }
            Self::Dispatch(DispatchError::DeadlineExceeded { .. }) => CallStatus::Timeout,
            Self::UnknownTool { .. }
            | Self::MalformedToolUse { .. }
            | Self::ArgumentsTooLarge { .. }
            | Self::ArgumentsTooDeep { .. }
            | Self::InvalidArguments { .. }
            | Self::OverBudget { .. }
            | Self::ApprovalMissing
            | Self::NoWorkerGroup { .. }
            | Self::LostInFlight
            | Self::Store { .. }
            | Self::Dispatch(_) => CallStatus::Error,
        }
    }

    /// The audit event that records the rejection itself, for stages whose decision is
    /// not recorded elsewhere (a human's denial and an expiry are audited where they are
    /// made; a worker's failure is in the `completed` event).
    pub fn audit(&self) -> Option<(AuditKind, Value)> {
        Some(match self {
            Self::UnknownTool { .. } => (AuditKind::Rejected, json!({"reason": "unknown_tool"})),
            Self::MalformedToolUse { what } => (
                AuditKind::Rejected,
                json!({"reason": "malformed_tool_use", "field": what}),
            ),
            Self::ArgumentsTooLarge { bytes, .. } => (
                AuditKind::Rejected,
                json!({"reason": "arguments_too_large", "bytes": bytes}),
            ),
            Self::ArgumentsTooDeep { depth, .. } => (
                AuditKind::Rejected,
                json!({"reason": "arguments_too_deep", "depth": depth}),
            ),
            Self::InvalidArguments { audited, .. } => {
                (AuditKind::RejectedSchema, json!({"violations": audited}))
            }
            Self::OverBudget { reason } => (AuditKind::BudgetExceeded, json!({"reason": reason})),
            Self::DeniedByPolicy { reasons } => (AuditKind::Denied, json!({"reasons": reasons})),
            Self::Withdrawn { approval_id } => (
                AuditKind::ApprovalWithdrawn,
                json!({"approval_id": approval_id}),
            ),
            Self::Revoked { stage, reasons } => (
                AuditKind::Revoked,
                json!({"stage": stage, "reasons": reasons}),
            ),
            Self::ApprovalDenied { .. }
            | Self::ApprovalExpired
            | Self::ApprovalMissing
            | Self::NoWorkerGroup { .. }
            | Self::LostInFlight
            | Self::Store { .. }
            | Self::Dispatch(_) => return None,
        })
    }
}

impl Gate {
    /// The one place a call ends: a rejection is audited, then the ending is recorded
    /// in memory, in the store (once, across replicas) and in the audit log.
    ///
    /// `duration_ms` is the time since the call started without the time it was held
    /// for approval: a 2 ms write that waited a minute for a human reports 2 ms, and the
    /// minute separately.
    pub(super) async fn conclude(&self, ctx: &mut CallCtx, result: Result<Ending, Rejection>) {
        let mut ending = match result {
            Ok(ending) => ending,
            Err(rejection) => {
                if matches!(rejection, Rejection::OverBudget { .. }) {
                    self.metrics.refused(Refusal::Budget);
                }
                if let Some((kind, data)) = rejection.audit() {
                    ctx.note(kind, data);
                }
                Ending::error(rejection.status(), rejection.to_string())
            }
        };
        let call_id = ctx.call_id.clone();
        let local_wait = ctx.held.map(|h| h.local).unwrap_or_default();
        let duration_ms = ctx.started.elapsed().saturating_sub(local_wait).as_millis() as u64;
        let approval_wait_ms = ctx.held.map(|h| h.reported_ms);
        if !ending.owned {
            // The replica that won the claim records the outcome and its audit event;
            // what this one noted (a resumption) still goes in.
            record_on_span(&ctx.span, &ending);
            self.flush(ctx).await;
            self.remember(&call_id, ending, duration_ms, approval_wait_ms);
            return;
        }
        let digest = result_digest(&ending.outcome.content);
        let stored = CallOutcome {
            status: ending.status,
            result: self.stored_result(&ending.outcome, &digest),
            duration_ms: Some(duration_ms),
            replica: ending.replica.clone(),
            finished_at: now_millis(),
        };
        let completed = self.completed_event(ctx, &ending, duration_ms, approval_wait_ms, &digest);
        // One transaction: the row (inserted finished if the store never had it) with
        // every event the call gathered and its `completed`.
        let row = ctx.row.take();
        let change = match (&row, ctx.recorded) {
            (Some(row), _) => CallChange::InsertFinished {
                call: row.call.clone(),
                outcome: stored,
            },
            (None, true) => CallChange::Finish {
                call_id: call_id.as_str().into(),
                outcome: stored,
            },
            // Refused before it could run: it has events, and no row.
            (None, false) => CallChange::Nothing,
        };
        let events = std::mem::take(&mut ctx.journal);
        let write = CallWrite {
            events: events.clone(),
            change,
            then: vec![completed.clone()],
        };
        match self.write_call(write).await {
            Ok(true) => {}
            // Already finished by another replica: its outcome and audit event stand.
            Ok(false) => return,
            Err(e) if row.is_some() => {
                // Nothing of the call is stored, and no worker changed anything (or it
                // never ran): its result is not handed out unrecorded.
                tracing::error!(call_id, error = %e, "cannot record the call");
                ending = Ending::error(
                    CallStatus::Error,
                    Rejection::Store {
                        doing: "record the call",
                        error: e,
                    }
                    .to_string(),
                );
            }
            Err(e) => {
                // The call is stored and may have run: keep what the log can still take.
                tracing::error!(call_id, error = %e, "cannot record the call's outcome");
                let events_only = CallWrite {
                    events,
                    change: CallChange::Nothing,
                    then: vec![completed],
                };
                if let Err(e) = self.write_call(events_only).await {
                    tracing::error!(call_id, error = %e, "cannot append to the audit log");
                }
            }
        }
        // The store counts the call now (or it ends without a row).
        drop(row);
        self.count_ending(ctx, ending.status, local_wait, duration_ms);
        record_on_span(&ctx.span, &ending);
        tracing::info!(
            call_id,
            principal = %ctx.principal.name,
            status = ending.status.as_str(),
            duration_ms,
            approval_wait_ms,
            "call finished"
        );
        self.remember(&call_id, ending, duration_ms, approval_wait_ms);
    }

    /// The call's ending in the metrics, counted by the replica that recorded it. A tool
    /// the catalog does not serve is `unknown`: the name is the caller's, unbounded.
    fn count_ending(
        &self,
        ctx: &CallCtx,
        status: CallStatus,
        local_wait: Duration,
        duration_ms: u64,
    ) {
        let tool = match self.catalog.get(&ctx.tool_use.name) {
            Some(tool) => tool.definition.name.clone(),
            None => crate::metrics::UNKNOWN_TOOL.to_owned(),
        };
        self.metrics
            .call_ended(&tool, status, Duration::from_millis(duration_ms));
        if ctx.held.is_some() {
            self.metrics.approval_waited(local_wait);
        }
    }

    /// The call's ending, in memory for its waiters.
    fn remember(
        &self,
        call_id: &str,
        ending: Ending,
        duration_ms: u64,
        approval_wait_ms: Option<u64>,
    ) {
        self.calls.update(call_id, |r| {
            r.status = ending.status;
            r.duration_ms = Some(duration_ms);
            r.approval_wait_ms = approval_wait_ms;
            r.replica = ending.replica;
            r.result = Some(Arc::new(ending.outcome));
            r.checked = true;
        });
    }

    /// The `completed` event: the status, the digest of the whole result and timings.
    fn completed_event(
        &self,
        ctx: &CallCtx,
        ending: &Ending,
        duration_ms: u64,
        approval_wait_ms: Option<u64>,
        digest: &str,
    ) -> NewAuditEvent {
        let mut completed = json!({
            "status": ending.status.as_str(),
            "is_error": ending.outcome.is_error,
            "duration_ms": duration_ms,
            "replica": ending.replica,
            "result_sha256": digest,
            "isolation": ending.outcome.isolation,
        });
        if let Some(ms) = approval_wait_ms {
            completed["approval_wait_ms"] = json!(ms);
        }
        ctx.event(AuditKind::Completed, completed)
    }
}

/// The call's status and the sandbox's isolation level on the call's span.
fn record_on_span(span: &CallSpan, ending: &Ending) {
    if !airlock_telemetry::enabled() {
        return;
    }
    span.set("airlock.status", || ending.status.as_str().into());
    if ending.outcome.is_error {
        span.fail();
    }
    let level = ending
        .outcome
        .isolation
        .as_ref()
        .and_then(|i| i.get("level"))
        .and_then(serde_json::Value::as_str);
    if let Some(level) = level {
        span.set("airlock.isolation", || level.to_owned().into());
    }
}

/// The SHA-256 of a result's text blocks joined by newlines (the audit's
/// `result_sha256`), hashed block by block: a 1 MiB result is not copied into a joined
/// string first.
fn result_digest(content: &[String]) -> String {
    let mut hasher = Sha256::new();
    for (i, block) in content.iter().enumerate() {
        if i > 0 {
            hasher.update(b"\n");
        }
        hasher.update(block.as_bytes());
    }
    crate::audit::hex_lower(&hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_result_digest_is_of_the_blocks_joined_by_newlines() {
        for content in [
            vec![],
            vec![String::new()],
            vec!["one".to_owned()],
            vec!["one".to_owned(), String::new(), "three\n".to_owned()],
        ] {
            assert_eq!(
                result_digest(&content),
                hex::encode(Sha256::digest(content.join("\n").as_bytes())),
                "{content:?}"
            );
        }
        assert_eq!(
            result_digest(&["a".to_owned(), "b".to_owned()]),
            // printf 'a\nb' | sha256sum
            "7e18f737311b2dc3b2f269dd78396b0351f14fb66efa879f768cb23181883c78"
        );
    }
}
