//! The gate: what happens to one tool call between a front door and a worker.
//!
//! resolve → size cap → schema validation → dispatch, each step recorded on the call.
//! Later steps (policy, approval, budgets, audit) slot in between validation and
//! dispatch without changing the front doors.

use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_policy::{CallStatus, Limits, SessionId, ToolOutcome};
use airlock_proto::v1 as pb;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::auth::Principal;
use crate::calls::{CallRecord, CallRegistry};
use crate::catalog::{Catalog, CatalogTool};
use crate::dispatch::{self, DispatchError, WorkerEvent};

/// How many schema violations are listed in one error result.
const MAX_REPORTED_VIOLATIONS: usize = 5;

/// One proposed call, already in domain form.
#[derive(Debug, Clone)]
pub struct ToolUse {
    pub id: String,
    pub name: String,
    pub input: serde_json::Value,
}

pub struct Gate {
    pub catalog: Arc<Catalog>,
    pub calls: CallRegistry,
    pub limits: Limits,
}

impl Gate {
    /// Starts a call; it runs to completion even if the caller stops waiting.
    pub fn submit(
        self: &Arc<Self>,
        principal: &Principal,
        session: &SessionId,
        tool_use: ToolUse,
        events: Option<mpsc::Sender<WorkerEvent>>,
    ) -> watch::Receiver<CallRecord> {
        let call_id = format!("call_{}", uuid::Uuid::new_v4().simple());
        let cancel = CancellationToken::new();
        let record = CallRecord {
            call_id: call_id.clone(),
            tool_use_id: tool_use.id.clone(),
            tool: tool_use.name.clone(),
            principal: principal.name.clone(),
            status: CallStatus::Running,
            approval_id: None,
            duration_ms: None,
            replica: None,
            result: None,
        };
        let rx = self.calls.insert(record, cancel.clone());
        let gate = self.clone();
        let principal = principal.clone();
        let session = session.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let (status, outcome, replica) = gate
                .run(&call_id, &principal, &session, tool_use, events, &cancel)
                .await;
            let duration_ms = started.elapsed().as_millis() as u64;
            tracing::info!(call_id, principal = %principal.name, status = status.as_str(), duration_ms, "call finished");
            gate.calls.update(&call_id, |r| {
                r.status = status;
                r.duration_ms = Some(duration_ms);
                r.replica = replica;
                r.result = Some(outcome);
            });
        });
        rx
    }

    async fn run(
        &self,
        call_id: &str,
        principal: &Principal,
        session: &SessionId,
        tool_use: ToolUse,
        events: Option<mpsc::Sender<WorkerEvent>>,
        cancel: &CancellationToken,
    ) -> (CallStatus, ToolOutcome, Option<String>) {
        // Resolve: unknown and (later) hidden tools get the same answer.
        let Some(tool) = self.catalog.get(&tool_use.name) else {
            return error(format!(
                "unknown tool {:?}; list the available tools with GET /v1/tools",
                tool_use.name
            ));
        };
        // Size cap before the schema, so a huge argument is never walked.
        let size = serde_json::to_vec(&tool_use.input)
            .map(|v| v.len())
            .unwrap_or(usize::MAX);
        if size as u64 > self.limits.max_argument_bytes {
            return error(format!(
                "arguments of {} are {size} bytes, over the limit of {} bytes; send less data per call",
                tool_use.name, self.limits.max_argument_bytes
            ));
        }
        if let Err(message) = validate(&tool, &tool_use.input) {
            return error(message);
        }
        let Some(group) = self.catalog.group(&tool.group) else {
            return error(format!("no worker group serves {}", tool_use.name));
        };
        let timeout_ms = self.call_timeout_ms(&tool_use.input);
        let request = pb::ExecuteRequest {
            call_id: call_id.to_owned(),
            tool: tool_use.name.clone(),
            arguments_json: tool_use.input.to_string(),
            principal: principal.name.clone(),
            session_id: session.as_str().to_owned(),
            timeout_ms,
            trace_context: Default::default(),
            detached: false,
        };
        match dispatch::execute(&group, request, events, cancel).await {
            Ok(done) => {
                let status = match (done.outcome.timed_out, done.outcome.is_error) {
                    (true, _) => CallStatus::Timeout,
                    (false, true) => CallStatus::Error,
                    (false, false) => CallStatus::Ok,
                };
                (status, done.outcome, Some(done.replica))
            }
            Err(e @ DispatchError::DeadlineExceeded { .. }) => {
                (CallStatus::Timeout, ToolOutcome::error(e.to_string()), None)
            }
            Err(e @ DispatchError::Cancelled) => (
                CallStatus::Cancelled,
                ToolOutcome::error(e.to_string()),
                None,
            ),
            Err(e) => (CallStatus::Error, ToolOutcome::error(e.to_string()), None),
        }
    }

    /// The deadline the worker enforces: the call's own `timeout_seconds` when the tool
    /// takes one (plus a second for set-up), else the default; never above the maximum.
    fn call_timeout_ms(&self, input: &serde_json::Value) -> u64 {
        let requested = input
            .get("timeout_seconds")
            .and_then(serde_json::Value::as_f64)
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(|s| (s * 1000.0) as u64 + 1000);
        requested
            .unwrap_or(self.limits.default_call_timeout_ms)
            .min(self.limits.max_call_timeout_ms)
    }

    pub fn default_wait(&self) -> Duration {
        Duration::from_millis(self.limits.default_wait_ms)
    }
}

fn error(message: String) -> (CallStatus, ToolOutcome, Option<String>) {
    (CallStatus::Error, ToolOutcome::error(message), None)
}

/// Checks `input` against the tool's schema; the error names each field and rule so the
/// model can correct itself.
fn validate(tool: &CatalogTool, input: &serde_json::Value) -> Result<(), String> {
    if !input.is_object() {
        return Err(format!(
            "input of {} must be a JSON object",
            tool.definition.name
        ));
    }
    let violations: Vec<String> = tool
        .validator
        .iter_errors(input)
        .take(MAX_REPORTED_VIOLATIONS)
        .map(|e| {
            let at = e.instance_path().to_string();
            let field = if at.is_empty() {
                "(arguments)".to_owned()
            } else {
                at
            };
            let schema_path = e.schema_path().to_string();
            let rule = schema_path
                .rsplit('/')
                .next()
                .unwrap_or_default()
                .to_owned();
            format!("{field}: {e} (rule: {rule})")
        })
        .collect();
    if violations.is_empty() {
        return Ok(());
    }
    Err(format!(
        "invalid arguments for {}: {}. Fix the arguments to match the tool's input_schema and call again",
        tool.definition.name,
        violations.join("; ")
    ))
}

impl Gate {
    /// Records a call that failed before it could enter the gate (arguments that are not
    /// a JSON object); it is final at once.
    pub fn reject(
        &self,
        principal: &Principal,
        tool_use_id: String,
        tool: String,
        message: String,
    ) -> watch::Receiver<CallRecord> {
        let record = CallRecord {
            call_id: format!("call_{}", uuid::Uuid::new_v4().simple()),
            tool_use_id,
            tool,
            principal: principal.name.clone(),
            status: CallStatus::Error,
            approval_id: None,
            duration_ms: Some(0),
            replica: None,
            result: Some(ToolOutcome::error(message)),
        };
        self.calls.insert(record, CancellationToken::new())
    }
}
