//! Stage 6, approval (DESIGN §3 step 5): the call is approved at once (its row kept for
//! its first store write), or recorded durably and held as a pending approval until a
//! human decides on any replica, it expires, or the caller cancels. The human's side is in [`super::decisions`].

use std::time::{Duration, Instant};

use airlock_policy::CallStatus;
use serde_json::json;

use super::Gate;
use super::ctx::{CallCtx, PendingRow};
use super::ending::{Held, Rejection};
use super::policy::Verdict;
use crate::audit::AuditKind;
use crate::store::{
    ApprovalStatus, CallChange, CallState, CallWrite, ExpiredApproval, NewApproval, NewCall,
    RememberedApproval, StoreError, now_millis,
};

/// How many times an approved call's arguments are read from the store (every `POLL`)
/// before the call ends as a store error.
const MAX_READ_FAILURES: u32 = 40;

/// How often waiting calls look at the store (decisions made on other replicas).
const POLL: Duration = Duration::from_millis(250);

impl Gate {
    /// Lets the call run at once when policy allows it (its row is written later, see
    /// [`Gate::hold_row`]), else holds it until a human decides. `Ok` means the call
    /// may run.
    pub(super) async fn approve(
        &self,
        ctx: &mut CallCtx,
        verdict: &Verdict,
    ) -> Result<(), Rejection> {
        match verdict {
            Verdict::Allow => {
                self.hold_row(ctx);
                Ok(())
            }
            Verdict::NeedsApproval { reasons, quorum } => {
                // A remembered approval stands for one approver: a call that now needs
                // more is held again.
                if *quorum <= 1
                    && let Some(remembered) = self.remembered(ctx).await
                {
                    ctx.note(
                        AuditKind::ApprovalRemembered,
                        json!({"approval_id": remembered.approval_id, "reasons": reasons,
                            "input_sha256": remembered.input_sha256,
                            "remembered_until": crate::store::rfc3339(remembered.expires_at)}),
                    );
                    self.hold_row(ctx);
                    return Ok(());
                }
                self.await_approval(ctx, reasons, *quorum).await
            }
        }
    }

    /// The approval remembered for this call's session, tool and input, if one covers
    /// it now. A store that cannot answer covers nothing: the call is held.
    async fn remembered(&self, ctx: &CallCtx) -> Option<RememberedApproval> {
        let digest = crate::audit::value_sha256(&ctx.tool_use.input);
        match self
            .store
            .remembered_approval(
                &ctx.principal.name,
                ctx.session.as_str(),
                &ctx.tool_use.name,
                &digest,
                now_millis(),
            )
            .await
        {
            Ok(Some(found)) => self.still_given(found).await,
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read remembered approvals; holding the call");
                None
            }
        }
    }

    /// A remembered approval counts only while whoever gave it is still an approver: a
    /// principal removed (or stripped of the role) by a reload takes back what they
    /// remembered. Read from the approval itself; one that cannot be read covers nothing.
    async fn still_given(&self, found: RememberedApproval) -> Option<RememberedApproval> {
        let approval = match self.store.get_approval(&found.approval_id).await {
            Ok(Some(approval)) => approval,
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read a remembered approval; holding the call");
                return None;
            }
        };
        let givers: Vec<String> = if approval.approved_by.is_empty() {
            approval.decided_by.into_iter().collect()
        } else {
            approval.approved_by
        };
        let gone = super::decisions::no_longer_approvers(self, &givers);
        if givers.is_empty() || !gone.is_empty() {
            tracing::info!(approval_id = %found.approval_id, no_longer_approvers = ?gone, "a remembered approval no longer counts: its approver is gone; holding the call");
            return None;
        }
        Some(found)
    }

    /// Keeps the call's row (state `approved`) for its first store write: ahead of the
    /// worker for a call with side effects, at its end for one that changes nothing.
    /// Until then the session's budget counts it here.
    pub(super) fn hold_row(&self, ctx: &mut CallCtx) {
        let call = new_call(ctx, CallState::Approved);
        let slot = ctx.budget_slot.take().or_else(|| {
            ctx.session_named.then(|| {
                self.unrecorded
                    .hold(&ctx.principal.name, ctx.session.as_str(), call.created_at)
                    .0
            })
        });
        ctx.row = Some(PendingRow { call, _slot: slot });
    }

    /// Creates the durable pending approval and waits for its decision; `ctx.held` is
    /// how long it waited.
    async fn await_approval(
        &self,
        ctx: &mut CallCtx,
        reasons: &[String],
        quorum: u32,
    ) -> Result<(), Rejection> {
        let since = Instant::now();
        let approval_id = crate::store::fresh_id("apr_");
        let now = now_millis();
        let expires_at = now
            + i64::try_from(self.approvals.timeout_seconds.saturating_mul(1000))
                .unwrap_or(i64::MAX);
        // The request, the held call and its approval in one transaction, durable
        // before anyone can decide it.
        let pending = ctx.event(
            AuditKind::PendingApproval,
            json!({"approval_id": approval_id, "reasons": reasons, "quorum": quorum,
                "expires_at": crate::store::rfc3339(expires_at)}),
        );
        self.write_call(CallWrite {
            events: ctx.journal.clone(),
            change: CallChange::CreateApproval(NewApproval {
                approval_id: approval_id.clone().into(),
                call: new_call(ctx, CallState::PendingApproval),
                created_at: now,
                expires_at,
            }),
            then: vec![pending],
        })
        .await
        .map_err(|error| Rejection::Store {
            doing: "record the pending approval",
            error,
        })?;
        ctx.journal.clear();
        ctx.recorded = true;
        // The store counts the call in its session now.
        ctx.budget_slot = None;
        // The store holds the arguments now. A call may wait an hour and thousands may
        // wait at once, each with up to `[limits] max_argument_bytes` of arguments: the
        // wait does not keep them in memory, and an approved call reads them back.
        ctx.tool_use.input = serde_json::Value::Null;
        self.calls.update(&ctx.call_id, |r| {
            r.status = CallStatus::PendingApproval;
            r.approval_id = Some(approval_id.clone());
            r.checked = true;
        });
        // Set when a withdrawal found the approval decided: from then on the loop only
        // reads that decision (polling, should the store fail to give it at once).
        let mut decided_meanwhile = false;
        // Reads of an approved call's arguments that failed: a store that cannot give
        // them back within some seconds ends the call (as an error), never a loop.
        let mut read_failures = 0u32;
        loop {
            match self.store.get_approval(&approval_id.as_str().into()).await {
                Ok(Some(a)) => match a.status {
                    ApprovalStatus::Pending if a.expires_at <= now_millis() => {
                        let _ = self.expire_sweep().await;
                    }
                    ApprovalStatus::Pending => {}
                    ApprovalStatus::Approved => {
                        match self.store.get_call(&ctx.call_id.as_str().into()).await {
                            Ok(Some(stored)) => ctx.tool_use.input = stored.input,
                            Ok(None) => {
                                ctx.held = Some(Held::new(Some(&a), since.elapsed()));
                                return Err(Rejection::ApprovalMissing);
                            }
                            Err(error) if read_failures >= MAX_READ_FAILURES => {
                                ctx.held = Some(Held::new(Some(&a), since.elapsed()));
                                return Err(Rejection::Store {
                                    doing: "read the approved call's arguments",
                                    error,
                                });
                            }
                            Err(e) => {
                                read_failures += 1;
                                tracing::warn!(error = %e, "cannot read the approved call's arguments; retrying");
                                tokio::time::sleep(POLL).await;
                                continue;
                            }
                        }
                        let waited = Held::new(Some(&a), since.elapsed());
                        ctx.held = Some(waited);
                        self.calls.update(&ctx.call_id, |r| {
                            r.status = CallStatus::Running;
                            r.approval_wait_ms = Some(waited.reported_ms);
                        });
                        return Ok(());
                    }
                    ApprovalStatus::Denied => {
                        ctx.held = Some(Held::new(Some(&a), since.elapsed()));
                        return Err(Rejection::ApprovalDenied {
                            by: a.decided_by.unwrap_or_default(),
                            reason: a.reason,
                        });
                    }
                    ApprovalStatus::Expired => {
                        ctx.held = Some(Held::new(Some(&a), since.elapsed()));
                        return Err(Rejection::ApprovalExpired);
                    }
                },
                Ok(None) => {
                    ctx.held = Some(Held::new(None, since.elapsed()));
                    return Err(Rejection::ApprovalMissing);
                }
                Err(e) => tracing::warn!(error = %e, "cannot read the approval; retrying"),
            }
            tokio::select! {
                _ = ctx.cancel.cancelled(), if !decided_meanwhile => {
                    // Withdraw the request so that a later approval cannot run it.
                    let whose = ExpiredApproval {
                        approval_id: approval_id.as_str().into(),
                        call_id: ctx.call_id.as_str().into(),
                        principal: ctx.principal.name.clone(),
                        session_id: Some(ctx.session.as_str().to_owned()),
                    };
                    match self.withdraw(whose).await {
                        // Decided before the withdrawal (by a replica or a decision this
                        // one has not polled yet): the decision stands. Read again, an
                        // approval goes on to the claim as a cancelled call — stopped
                        // here, or, when another replica claimed it first, cancelled
                        // where it runs — so the store and the log say what happened
                        // instead of "withdrawn" over a call that ran.
                        Err(StoreError::AlreadyDecided { .. }) => {
                            decided_meanwhile = true;
                            continue;
                        }
                        withdrawn => {
                            ctx.held = Some(Held::new(withdrawn.as_ref().ok(), since.elapsed()));
                            return Err(Rejection::Withdrawn { approval_id });
                        }
                    }
                }
                _ = self.decided.notified() => {}
                _ = tokio::time::sleep(POLL) => {}
            }
        }
    }

    /// Denies a pending approval on the caller's behalf (it cancelled the call).
    /// `approval` says whose it is, for the `expired` event should the withdrawal come
    /// after the deadline (the store expires the approval instead, and the sweep never
    /// sees it again).
    pub(super) async fn withdraw(
        &self,
        approval: ExpiredApproval,
    ) -> Result<crate::store::Approval, crate::store::StoreError> {
        let result = self
            .store
            .decide_approval(
                &approval.approval_id,
                false,
                "system:cancelled",
                Some("the caller cancelled the call"),
                now_millis(),
            )
            .await;
        if let Err(StoreError::Expired { .. }) = &result {
            self.audit_expired(approval).await;
            self.notify_decided();
        }
        result
    }
}

fn new_call(ctx: &CallCtx, state: CallState) -> NewCall {
    NewCall {
        call_id: ctx.call_id.clone().into(),
        tool_use_id: ctx.tool_use.id.clone(),
        tool: ctx.tool_use.name.clone(),
        input: ctx.tool_use.input.clone(),
        principal: ctx.principal.name.clone(),
        session_id: Some(ctx.session.as_str().to_owned()),
        state,
        created_at: now_millis(),
    }
}
