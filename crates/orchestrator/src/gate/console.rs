//! What the approvals console (`/ui`, [`crate::ui`]) reads through the gate: calls and
//! approvals with their inputs redacted as the audit shows them, the policy's reasons
//! for a hold, and read-only looks at a call's workspace for the diff an approver sees.

use airlock_policy::ToolOutcome;
use airlock_telemetry::StageParent;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::Gate;
use crate::audit::{AuditKind, AuditQuery, redact};
use crate::dispatch::{self, DispatchError, WorkerCall};
use crate::store::{Approval, ApprovalPage, ApprovalQuery, CallListFilter, StoreError, StoredCall};

/// How long one preview read may take on its worker.
const PREVIEW_TIMEOUT_MS: u64 = 5_000;

/// Why a read-only look into a call's workspace gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum PreviewError {
    #[error("no worker serves {tool}, which the preview needs")]
    NoTool { tool: String },
    #[error(
        "{tool} is served by the {actual} worker, not by {expected} like the call's tool, so it would not see the same files"
    )]
    OtherGroup {
        tool: String,
        expected: String,
        actual: String,
    },
    #[error(transparent)]
    Dispatch(#[from] DispatchError),
}

/// Why a pending approval waits, as recorded when the call was held.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HoldReasons {
    /// The policy's reasons (Cedar permits' and `[approvals]`'s).
    pub reasons: Vec<String>,
    /// Distinct approvers the call needs.
    pub quorum: u32,
}

impl Gate {
    /// `[approvals] distinct_approver`: whether a requester may decide their own call.
    pub fn distinct_approver(&self) -> bool {
        self.approvals.distinct_approver
    }

    /// `input` with secrets replaced by `[redacted]`, as the audit and approvers see it.
    pub fn redact_input(&self, tool: &str, input: &Value) -> Value {
        let schema = self
            .catalog
            .get(tool)
            .map(|t| t.definition.input_schema.clone())
            .unwrap_or(Value::Null);
        redact(input, &schema, &self.audit_config.secret_fields)
    }

    /// `text` with the secrets that string redaction recognises replaced (a diff, a file's
    /// content, a result).
    pub fn redact_text(&self, text: &str) -> String {
        match redact(
            &Value::String(text.to_owned()),
            &Value::Null,
            &self.audit_config.secret_fields,
        ) {
            Value::String(redacted) => redacted,
            _ => String::new(),
        }
    }

    /// The latest calls that match `filter`, newest first, inputs redacted.
    pub async fn recent_calls(
        &self,
        filter: &CallListFilter,
    ) -> Result<Vec<StoredCall>, StoreError> {
        let mut calls = self.store.recent_calls(filter).await?;
        for call in &mut calls {
            call.input = self.redact_input(&call.tool, &call.input);
        }
        Ok(calls)
    }

    /// One stored call, input redacted.
    pub async fn stored_call(&self, call_id: &str) -> Result<Option<StoredCall>, StoreError> {
        let mut call = self.store.get_call(&call_id.into()).await?;
        if let Some(call) = &mut call {
            call.input = self.redact_input(&call.tool, &call.input);
        }
        Ok(call)
    }

    /// A page of approvals as stored (inputs not redacted: redact before showing them).
    pub async fn approvals_page(&self, query: &ApprovalQuery) -> Result<ApprovalPage, StoreError> {
        self.store.approvals_page(query).await
    }

    /// Resolves when an approval is next decided through this replica.
    pub fn decided_notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.decided.notified()
    }

    /// One approval as stored (its input not redacted: redact before showing it).
    pub async fn approval(&self, approval_id: &str) -> Result<Option<Approval>, StoreError> {
        self.store.get_approval(&approval_id.into()).await
    }

    /// The reasons and quorum recorded in the `pending_approval` event of `approval`.
    pub async fn hold_reasons(&self, approval: &Approval) -> Result<HoldReasons, StoreError> {
        let events = self
            .store
            .audit(AuditQuery {
                call_id: Some(approval.call_id.to_string()),
                limit: 200,
                ..AuditQuery::default()
            })
            .await?;
        let held = events.iter().find(|e| {
            e.kind == AuditKind::PendingApproval.as_str()
                && e.data.get("approval_id").and_then(Value::as_str)
                    == Some(approval.approval_id.as_str())
        });
        Ok(held.map_or_else(HoldReasons::default, |e| HoldReasons {
            reasons: e
                .data
                .get("reasons")
                .and_then(Value::as_array)
                .map(|r| {
                    r.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
            quorum: e
                .data
                .get("quorum")
                .and_then(Value::as_u64)
                .and_then(|q| u32::try_from(q).ok())
                .unwrap_or(1),
        }))
    }

    /// Runs `tool` (read-only, or `edit_file` with `dry_run`) with `input` in the
    /// workspace of `approval`'s principal and session, on the worker that serves
    /// `approval`'s own tool, for what an approver is shown. It is not a call: no policy,
    /// no approval, no audit record, nothing stored; the worker confines it to that
    /// workspace like any call.
    pub async fn preview_run(
        &self,
        approval: &Approval,
        tool: &str,
        input: &Value,
    ) -> Result<ToolOutcome, PreviewError> {
        let no_tool = || PreviewError::NoTool {
            tool: tool.to_owned(),
        };
        let expected = self
            .catalog
            .get(&approval.tool)
            .map(|t| t.group.clone())
            .ok_or_else(no_tool)?;
        let served = self.catalog.get(tool).ok_or_else(no_tool)?;
        if served.group != expected {
            return Err(PreviewError::OtherGroup {
                tool: tool.to_owned(),
                expected,
                actual: served.group.clone(),
            });
        }
        let group = self.catalog.group(&expected).ok_or_else(no_tool)?;
        let call = WorkerCall {
            call_id: format!("preview_{}", uuid::Uuid::new_v4().simple()),
            tool: tool.to_owned(),
            input,
            principal: approval.principal.clone(),
            session_id: approval
                .session_id
                .clone()
                .unwrap_or_else(|| airlock_policy::SessionId::DEFAULT.to_owned()),
            timeout_ms: PREVIEW_TIMEOUT_MS,
            detached: false,
            retryable: served.definition.annotations.read_only,
            trace: &StageParent::current(),
        };
        let done = dispatch::execute(&group, call, None, &CancellationToken::new()).await?;
        Ok(done.outcome)
    }
}
