//! Human decisions on pending approvals, shared by the HTTP and gRPC front doors.

use serde_json::json;

use super::Gate;
use crate::audit::{AuditKind, NewAuditEvent, redact};
use crate::auth::Principal;
use crate::store::{
    Approval, ApprovalPage, ApprovalQuery, ApprovalStatus, ExpiredApproval, RememberedApproval,
    StoreError, now_millis,
};

#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    #[error("no such approval")]
    NotFound,
    #[error(
        "[approvals] distinct_approver is set: a request must be approved by someone other than its requester"
    )]
    SelfApproval,
    /// The approver decided on other arguments than the call holds.
    #[error(
        "input_sha256 {given} does not match the call's input ({actual}): look at the approval again"
    )]
    InputChanged { given: String, actual: String },
    /// Under a quorum, the same approver again: only distinct approvers count.
    #[error("{0}")]
    AlreadyApproved(StoreError),
    /// `"remember": "session"` where it cannot hold: on an approval that needs more than
    /// one approver (one approver must not approve the calls after it alone), or for a
    /// call that named no session (the session `default` never ends).
    #[error("{0}")]
    CannotRemember(String),
    #[error("{0}")]
    Conflict(StoreError),
    /// The requester lost the right to the call since it asked: the approval was
    /// turned into a denial instead.
    #[error("the call can no longer be approved, so it was denied: {0}")]
    Revoked(String),
    #[error("the store is unavailable: {0}")]
    Store(StoreError),
}

/// One page of approvals, their inputs redacted like audit records.
pub async fn list(gate: &Gate, query: &ApprovalQuery) -> Result<ApprovalPage, StoreError> {
    let mut page = gate.store.approvals_page(query).await?;
    for approval in &mut page.approvals {
        let schema = gate
            .catalog
            .get(&approval.tool)
            .map(|t| t.definition.input_schema.clone())
            .unwrap_or(serde_json::Value::Null);
        approval.input = redact(&approval.input, &schema, &gate.audit_config.secret_fields);
    }
    Ok(page)
}

/// Who decided an approval that a re-check turned into a denial.
pub const REVOKED_BY: &str = "system:revoked";

/// The longest reason an approver may give, in bytes, on every door: it is stored with
/// the approval, written into the audit log and shown to the model on a denial.
pub const MAX_REASON_BYTES: usize = 4096;

/// Checks an approver's reason, the same on every door: at most [`MAX_REASON_BYTES`],
/// and no control characters but newlines and tabs — it is stored as text (PostgreSQL
/// refuses a NUL, which would fail the decision as a store error), written into the
/// audit log and shown to the model and in the console. The error says what to change.
pub fn check_reason(reason: &str) -> Result<(), String> {
    if reason.len() > MAX_REASON_BYTES {
        return Err(format!(
            "reason must be at most {MAX_REASON_BYTES} bytes; shorten it"
        ));
    }
    if reason
        .chars()
        .any(|c| c.is_control() && !matches!(c, '\n' | '\r' | '\t'))
    {
        return Err(
            "reason must not contain control characters other than newlines and tabs".to_owned(),
        );
    }
    Ok(())
}

/// Those of `names` who are not approvers in the principals in force.
pub(super) fn no_longer_approvers(gate: &Gate, names: &[String]) -> Vec<String> {
    names
        .iter()
        .filter(|name| {
            !gate
                .principals
                .by_name(name)
                .is_some_and(|p| p.has(crate::auth::Role::Approver))
        })
        .cloned()
        .collect()
}

/// Approves or denies; the caller has checked the approver role. An approval is
/// checked against the principals and the policy in force first
/// ([`Gate::reauthorize`]); one that no longer holds denies the call instead
/// ([`DecideError::Revoked`]). `input_sha256`, when given, must be the approval's: the
/// decision holds for the arguments the approver saw and no others. `remember` (an
/// approval only) lets later calls of the same principal, session, tool and input run
/// without a new approval until this one's expiry or the session's end.
pub async fn decide(
    gate: &Gate,
    approver: &Principal,
    approval_id: &str,
    approve: bool,
    reason: Option<&str>,
    input_sha256: Option<&str>,
    remember: bool,
) -> Result<Approval, DecideError> {
    // An id with a control character names no approval (and is not sent to a store
    // that may refuse it as text, as if it were down).
    if crate::wire::has_control(approval_id) {
        return Err(DecideError::NotFound);
    }
    let approval_id = &crate::store::ApprovalId::from(approval_id);
    let approval = gate
        .store
        .get_approval(approval_id)
        .await
        .map_err(DecideError::Store)?
        .ok_or(DecideError::NotFound)?;
    if gate.approvals.distinct_approver && approval.principal == approver.name {
        return Err(DecideError::SelfApproval);
    }
    // A call's input never changes once stored, so comparing with the row read here is
    // enough: the approval decided below holds this very input.
    if let Some(given) = input_sha256
        && !given.eq_ignore_ascii_case(&approval.input_sha256)
    {
        return Err(DecideError::InputChanged {
            given: given.to_owned(),
            actual: approval.input_sha256,
        });
    }
    let policy_sha256 = gate.policy_sha256();
    let store_error = |e| match e {
        StoreError::NotFound { .. } => DecideError::NotFound,
        e @ (StoreError::AlreadyDecided { .. } | StoreError::Expired { .. }) => {
            DecideError::Conflict(e)
        }
        e @ StoreError::AlreadyApprovedBy { .. } => DecideError::AlreadyApproved(e),
        e => DecideError::Store(e),
    };
    // The requester may have lost the right since it asked (a policy reload, a principal
    // removed or stripped of the agent role): an approval must not revive the call.
    let recheck = (approve && approval.status == ApprovalStatus::Pending).then(|| {
        gate.reauthorize(
            &approval.principal,
            &approval.tool,
            approval
                .session_id
                .as_deref()
                .unwrap_or(airlock_policy::SessionId::DEFAULT),
            &approval.input,
        )
    });
    if let Some(Err(reasons)) = recheck {
        let why = reasons.join("; ");
        let denial = format!("checked again when {} approved it: {why}", approver.name);
        let denied = gate
            .store
            .decide_approval(approval_id, false, REVOKED_BY, Some(&denial), now_millis())
            .await;
        let denied = audit_if_expired(gate, &approval, denied)
            .await
            .map_err(store_error)?;
        gate.audit(
            NewAuditEvent::new(
                AuditKind::Revoked,
                json!({"stage": "decision", "approval_id": approval_id, "attempted_by": approver.name, "reasons": reasons}),
            )
            .call_id(denied.call_id.clone())
            .principal(denied.principal.clone())
            .session_id(denied.session_id.clone()),
        )
        .await;
        gate.audit(
            NewAuditEvent::new(
                AuditKind::ApprovalDenied,
                json!({"approval_id": approval_id, "decided_by": REVOKED_BY, "reason": denial,
                "input_sha256": denied.input_sha256, "policy_sha256": policy_sha256}),
            )
            .call_id(denied.call_id.clone())
            .principal(denied.principal.clone())
            .session_id(denied.session_id.clone()),
        )
        .await;
        gate.notify_decided();
        return Err(DecideError::Revoked(why));
    }
    // The quorum of the policy and `[approvals]` in force now, like the rights checked
    // just above (an approval already decided answers its conflict below).
    let quorum = match recheck {
        Some(Ok(quorum)) => quorum,
        _ => 1,
    };
    if approve && remember && quorum > 1 {
        return Err(DecideError::CannotRemember(format!(
            "this call needs {quorum} distinct approvers, so its approval cannot be remembered for the session"
        )));
    }
    // A call that names no session runs in `default`, which every unnamed call of the
    // principal shares and which never ends: "for the session" would mean for good.
    if approve
        && remember
        && approval
            .session_id
            .as_deref()
            .is_none_or(|s| s == airlock_policy::SessionId::DEFAULT)
    {
        return Err(DecideError::CannotRemember(
            "the call named no session (session_id), and calls without one share the session \"default\", which never ends: an approval is remembered only for a named session".to_owned(),
        ));
    }
    // Votes given by principals who are no longer approvers (removed, or stripped of
    // the role, by a reload) are taken back before this one is counted: revoking an
    // approver revokes what they set up. Audited at once (`revoked`, stage "votes"),
    // whatever becomes of this approval.
    let withdrawn = if approve && approval.status == ApprovalStatus::Pending {
        let gone = no_longer_approvers(gate, &approval.approved_by);
        if !gone.is_empty() {
            let taken = gate
                .store
                .withdraw_votes(approval_id, &gone)
                .await
                .map_err(DecideError::Store)?;
            if taken > 0 {
                gate.audit(
                    NewAuditEvent::new(
                        AuditKind::Revoked,
                        json!({"stage": "votes", "approval_id": approval_id,
                            "votes_withdrawn": gone, "noticed_by": approver.name}),
                    )
                    .call_id(approval.call_id.clone())
                    .principal(approval.principal.clone())
                    .session_id(approval.session_id.clone()),
                )
                .await;
            }
        }
        gone
    } else {
        Vec::new()
    };
    let decided = if approve {
        gate.store
            .approve_approval(
                approval_id,
                &approver.name,
                reason,
                &approval.input_sha256,
                quorum,
                now_millis(),
            )
            .await
    } else {
        gate.store
            .decide_approval(approval_id, false, &approver.name, reason, now_millis())
            .await
    };
    let decided = audit_if_expired(gate, &approval, decided)
        .await
        .map_err(store_error)?;
    let kind = match decided.status {
        ApprovalStatus::Pending => AuditKind::PartiallyApproved,
        _ if approve => AuditKind::Approved,
        _ => AuditKind::ApprovalDenied,
    };
    let mut data = json!({"approval_id": approval_id, "decided_by": approver.name, "reason": reason,
        "input_sha256": decided.input_sha256, "policy_sha256": policy_sha256});
    if approve {
        data["approved_by"] = json!(decided.approved_by);
        data["quorum"] = json!(quorum);
        if !withdrawn.is_empty() {
            data["votes_withdrawn"] = json!(withdrawn);
        }
    }
    if remember && decided.status == ApprovalStatus::Approved {
        data["remember"] = json!("session");
        data["remembered_until"] = match remember_for_session(gate, &decided).await {
            Ok(until) => json!(crate::store::rfc3339(until)),
            // The approval stands; later calls are only held again.
            Err(e) => {
                tracing::warn!(error = %e, approval_id = %approval_id, "cannot remember the approval");
                serde_json::Value::Null
            }
        };
    }
    gate.audit(
        NewAuditEvent::new(kind, data)
            .call_id(decided.call_id.clone())
            .principal(decided.principal.clone())
            .session_id(decided.session_id.clone()),
    )
    .await;
    gate.notify_decided();
    Ok(decided)
}

/// `result` of a decision, after auditing the expiry it found: a decision that comes
/// after the deadline, before the sweep, makes the store expire the approval (the
/// answer is [`StoreError::Expired`]), and the sweep never sees it again.
pub(super) async fn audit_if_expired<T>(
    gate: &Gate,
    approval: &Approval,
    result: Result<T, StoreError>,
) -> Result<T, StoreError> {
    if let Err(StoreError::Expired { .. }) = &result {
        gate.audit_expired(ExpiredApproval {
            approval_id: approval.approval_id.clone(),
            call_id: approval.call_id.clone(),
            principal: approval.principal.clone(),
            session_id: approval.session_id.clone(),
        })
        .await;
        gate.notify_decided();
    }
    result
}

/// Stores an approval given with `"remember": "session"`: it covers later calls until
/// its own expiry or the end of the session's wall time, whichever comes first.
async fn remember_for_session(gate: &Gate, approval: &Approval) -> Result<i64, StoreError> {
    let session = approval
        .session_id
        .as_deref()
        .unwrap_or(airlock_policy::SessionId::DEFAULT);
    let usage = gate
        .store
        .session_usage(&approval.principal, session)
        .await?;
    let until = usage.first_at.map_or(approval.expires_at, |first| {
        approval.expires_at.min(gate.budgets.session_ends_at(first))
    });
    gate.store
        .remember_approval(
            &RememberedApproval {
                principal: approval.principal.clone(),
                session_id: session.to_owned(),
                tool: approval.tool.clone(),
                input_sha256: approval.input_sha256.clone(),
                approval_id: approval.approval_id.clone(),
                expires_at: until,
            },
            now_millis(),
        )
        .await?;
    Ok(until)
}
