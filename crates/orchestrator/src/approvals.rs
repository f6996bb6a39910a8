//! Human decisions on pending approvals, shared by the HTTP and gRPC front doors.

use serde_json::json;

use crate::audit::{NewAuditEvent, redact};
use crate::auth::Principal;
use crate::gate::Gate;
use crate::store::{Approval, ApprovalPage, ApprovalQuery, StoreError, now_millis};

#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    #[error("no such approval")]
    NotFound,
    #[error(
        "[approvals] distinct_approver is set: a request must be approved by someone other than its requester"
    )]
    SelfApproval,
    #[error("{0}")]
    Conflict(StoreError),
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

/// Approves or denies; the caller has checked the approver role.
pub async fn decide(
    gate: &Gate,
    approver: &Principal,
    approval_id: &str,
    approve: bool,
    reason: Option<&str>,
) -> Result<Approval, DecideError> {
    let approval = gate
        .store
        .get_approval(approval_id)
        .await
        .map_err(DecideError::Store)?
        .ok_or(DecideError::NotFound)?;
    if gate.approvals.distinct_approver && approval.principal == approver.name {
        return Err(DecideError::SelfApproval);
    }
    let decided = gate
        .store
        .decide_approval(approval_id, approve, &approver.name, reason, now_millis())
        .await
        .map_err(|e| match e {
            StoreError::NotFound { .. } => DecideError::NotFound,
            e @ (StoreError::AlreadyDecided { .. } | StoreError::Expired { .. }) => {
                DecideError::Conflict(e)
            }
            e => DecideError::Store(e),
        })?;
    gate.audit(
        NewAuditEvent::new(
            if approve {
                "approved"
            } else {
                "approval_denied"
            },
            json!({"approval_id": approval_id, "decided_by": approver.name, "reason": reason}),
        )
        .call_id(decided.call_id.clone())
        .principal(decided.principal.clone())
        .session_id(decided.session_id.clone()),
    )
    .await;
    gate.notify_decided();
    Ok(decided)
}
