//! The gRPC front door: `airlock.v1.Orchestrator`, the same gate as HTTP.

use std::pin::Pin;
use std::sync::Arc;

use airlock_policy::SessionId;
use airlock_proto::v1 as pb;
use airlock_proto::v1::orchestrator_server::Orchestrator;
use futures::Stream;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use crate::auth::{Principal, Role};
use crate::calls::CallRecord;
use crate::dispatch::WorkerEvent;
use crate::gate::decisions::DecideError;
use crate::gate::{Gate, ToolUse};
use crate::service::{AdmitError, Batch, CallService, OnDrop, Proposed, Refused, Update};
use crate::store::{ApprovalQuery, ApprovalStatus, StoreError};
use crate::wire;

pub struct GrpcFrontDoor {
    pub gate: Arc<Gate>,
    /// Admission and following of calls, shared with every front door.
    pub calls: CallService,
    pub agent: Arc<crate::agent::AgentConfig>,
}

impl GrpcFrontDoor {
    /// The caller, as the authentication layer in front of this service found it.
    fn authenticate<T>(&self, request: &Request<T>) -> Result<Principal, Status> {
        // Fail closed: the service is always wrapped in the layer.
        request
            .extensions()
            .get::<Principal>()
            .cloned()
            .ok_or_else(|| {
                Status::unauthenticated("the call reached the service without authentication")
            })
    }

    fn authorize_agent<T>(&self, request: &Request<T>) -> Result<Principal, Status> {
        let principal = self.authenticate(request)?;
        if !principal.has(Role::Agent) {
            return Err(Status::permission_denied(format!(
                "principal {:?} lacks the agent role",
                principal.name
            )));
        }
        Ok(principal)
    }
}

/// A batch the call service did not admit, as gRPC says it.
fn admit_status(error: AdmitError) -> Status {
    match error {
        AdmitError::NotAnAgent { .. } => Status::permission_denied(error.to_string()),
        AdmitError::RateLimited(e) => Status::resource_exhausted(e.to_string()),
    }
}

fn session(value: &str) -> Result<SessionId, Status> {
    if value.is_empty() {
        return Ok(SessionId::default_session());
    }
    SessionId::parse(value).map_err(|e| Status::invalid_argument(format!("session_id: {e}")))
}

fn tool_use(index: usize, wire: pb::ToolUse) -> Result<Proposed, Status> {
    if wire.id.is_empty() || wire.name.is_empty() {
        return Err(Status::invalid_argument(format!(
            "tool_uses[{index}] needs an id and a name"
        )));
    }
    // The same bounds as on HTTP: both end up in the audit log.
    if wire.id.len() > 256 || wire.name.len() > 256 {
        return Err(Status::invalid_argument(format!(
            "tool_uses[{index}]: id and name must be at most 256 characters"
        )));
    }
    if crate::wire::has_control(&wire.id) || crate::wire::has_control(&wire.name) {
        return Err(Status::invalid_argument(format!(
            "tool_uses[{index}]: id and name must not contain control characters"
        )));
    }
    let input_json = if wire.input_json.trim().is_empty() {
        "{}"
    } else {
        &wire.input_json
    };
    Ok(
        match serde_json::from_str::<serde_json::Value>(input_json) {
            Ok(input @ serde_json::Value::Object(_)) => Ok(ToolUse {
                id: wire.id,
                name: wire.name,
                input,
            }),
            Ok(_) => Err(Refused {
                id: wire.id,
                name: wire.name,
                message: "input_json must be a JSON object".to_owned(),
            }),
            Err(e) => Err(Refused {
                id: wire.id,
                name: wire.name,
                message: format!("input_json is not valid JSON ({e})"),
            }),
        },
    )
}

fn result_block(record: &CallRecord) -> Option<pb::ToolResultBlock> {
    record
        .result
        .as_ref()
        .filter(|_| record.status.is_final())
        .map(|o| pb::ToolResultBlock {
            tool_use_id: record.tool_use_id.clone(),
            content: o.content.clone(),
            is_error: o.is_error,
        })
}

fn call_info(record: &CallRecord) -> pb::CallInfo {
    pb::CallInfo {
        tool_use_id: record.tool_use_id.clone(),
        call_id: record.call_id.clone(),
        status: record.status.as_str().to_owned(),
        approval_id: record.approval_id.clone().unwrap_or_default(),
        duration_ms: record.duration_ms.unwrap_or(0),
        approval_wait_ms: record.approval_wait_ms,
        isolation_json: record
            .isolation()
            .map(|v| v.to_string())
            .unwrap_or_default(),
    }
}

type CallEventStream = Pin<Box<dyn Stream<Item = Result<pb::CallEvent, Status>> + Send>>;
type AgentEventStream = Pin<Box<dyn Stream<Item = Result<pb::AgentEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Orchestrator for GrpcFrontDoor {
    async fn list_tools(
        &self,
        request: Request<pb::OrchestratorListToolsRequest>,
    ) -> Result<Response<pb::OrchestratorListToolsResponse>, Status> {
        let principal = self.authenticate(&request)?;
        let tools = self
            .gate
            .visible_tools(&principal)
            .iter()
            .map(|t| {
                let d = &t.definition;
                pb::CatalogTool {
                    name: d.name.clone(),
                    description: d.description.clone(),
                    input_schema_json: d.input_schema.to_string(),
                    title: d.title.clone(),
                    read_only: d.annotations.read_only,
                    destructive: d.annotations.destructive,
                    idempotent: d.annotations.idempotent,
                    open_world: d.annotations.open_world,
                }
            })
            .collect();
        Ok(Response::new(pb::OrchestratorListToolsResponse { tools }))
    }

    async fn call_tools(
        &self,
        request: Request<pb::CallToolsRequest>,
    ) -> Result<Response<pb::CallToolsResponse>, Status> {
        let principal = self.authorize_agent(&request)?;
        let request = request.into_inner();
        let session_named = !request.session_id.is_empty();
        let session = session(&request.session_id)?;
        if request.tool_uses.is_empty() {
            return Err(Status::invalid_argument("tool_uses must not be empty"));
        }
        if request.tool_uses.len() > self.gate.limits().max_tool_uses_per_request {
            return Err(Status::invalid_argument(format!(
                "at most {} tool_uses per request",
                self.gate.limits().max_tool_uses_per_request
            )));
        }
        let mut seen = std::collections::HashSet::new();
        let mut uses = Vec::new();
        for (index, wire) in request.tool_uses.into_iter().enumerate() {
            if !seen.insert(wire.id.clone()) {
                return Err(Status::invalid_argument(format!(
                    "tool_uses[{index}].id is used twice"
                )));
            }
            uses.push(tool_use(index, wire)?);
        }
        // Unset is the server default; an explicit 0 answers at once, as on HTTP.
        let wait = wire::wait_for(request.wait_ms, self.gate.default_wait());
        let batch = Batch {
            session: session_named.then_some(session),
            calls: uses,
            with_events: false,
            // Answered after `wait_ms`; a call still running goes on, its result at
            // GetCall.
            on_drop: OnDrop::KeepRunning,
        };
        let handles = self.calls.admit(&principal, batch).map_err(admit_status)?;
        let records = futures::future::join_all(handles.iter().map(|h| h.wait_final(wait))).await;
        Ok(Response::new(pb::CallToolsResponse {
            tool_results: records.iter().filter_map(result_block).collect(),
            calls: records.iter().map(call_info).collect(),
        }))
    }

    type CallToolStreamStream = CallEventStream;

    async fn call_tool_stream(
        &self,
        request: Request<pb::CallToolStreamRequest>,
    ) -> Result<Response<Self::CallToolStreamStream>, Status> {
        use pb::call_event::Event;
        let principal = self.authorize_agent(&request)?;
        let request = request.into_inner();
        let session_named = !request.session_id.is_empty();
        let session = session(&request.session_id)?;
        let wire = request
            .tool_use
            .ok_or_else(|| Status::invalid_argument("tool_use is required"))?;
        let batch = Batch {
            session: session_named.then_some(session),
            calls: vec![tool_use(0, wire)?],
            with_events: true,
            // The stream is the call's only follower: closing it cancels the call.
            on_drop: OnDrop::Cancel,
        };
        let mut handles = self.calls.admit(&principal, batch).map_err(admit_status)?;
        let Some(mut handle) = handles.pop() else {
            return Err(Status::internal("the call was not admitted"));
        };
        let (out_tx, out_rx) = mpsc::channel::<Result<pb::CallEvent, Status>>(256);
        tokio::spawn(async move {
            let first = handle.record();
            let started = pb::CallEvent {
                event: Some(Event::Started(call_info(&first))),
            };
            if out_tx.send(Ok(started)).await.is_err() {
                return;
            }
            loop {
                let update = tokio::select! {
                    update = handle.next() => update,
                    // The client went away: dropping the handle cancels the call.
                    () = out_tx.closed() => return,
                };
                match update {
                    Update::Event(WorkerEvent::Output { stream, data }) => {
                        let chunk = pb::OutputChunk {
                            stream: stream.to_owned(),
                            data: String::from_utf8_lossy(&data).into_owned(),
                        };
                        let event = pb::CallEvent {
                            event: Some(Event::Output(chunk)),
                        };
                        if out_tx.send(Ok(event)).await.is_err() {
                            return;
                        }
                    }
                    Update::Event(WorkerEvent::Progress { .. }) | Update::Changed(_) => {}
                    Update::Final(record) => {
                        let completed = pb::CallCompleted {
                            call: Some(call_info(&record)),
                            result: result_block(&record),
                        };
                        let event = pb::CallEvent {
                            event: Some(Event::Completed(completed)),
                        };
                        let _ = out_tx.send(Ok(event)).await;
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out_rx),
        )))
    }

    type RunAgentStream = AgentEventStream;

    async fn run_agent(
        &self,
        request: Request<pb::RunAgentRequest>,
    ) -> Result<Response<Self::RunAgentStream>, Status> {
        use futures::StreamExt;
        let principal = self.authorize_agent(&request)?;
        let request = request.into_inner();
        let mut body = serde_json::json!({"prompt": request.prompt});
        if !request.session_id.is_empty() {
            body["session_id"] = serde_json::json!(request.session_id);
        }
        if request.max_turns > 0 {
            body["max_turns"] = serde_json::json!(request.max_turns);
        }
        let run = crate::agent::http::parse_request(&body).map_err(Status::invalid_argument)?;
        let events = crate::agent::start(self.gate.clone(), &self.agent, principal, run).map_err(
            |e| match e {
                crate::agent::AgentError::TooManyRuns { .. } => {
                    Status::resource_exhausted(e.to_string())
                }
                e => Status::failed_precondition(e.to_string()),
            },
        )?;
        // Dropping the stream (the client cancelled) drops the receiver: the run stops.
        let stream = tokio_stream::wrappers::ReceiverStream::new(events).map(|e| {
            Ok(pb::AgentEvent {
                kind: e.kind.to_owned(),
                data: e.data.to_string(),
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list_approvals(
        &self,
        request: Request<pb::ListApprovalsRequest>,
    ) -> Result<Response<pb::ListApprovalsResponse>, Status> {
        let principal = self.authenticate(&request)?;
        if !principal.has(Role::Approver) {
            return Err(Status::permission_denied(
                "listing approvals needs the approver role",
            ));
        }
        let status = match request.get_ref().status.as_str() {
            "" | "all" => None,
            s => Some(s.parse::<ApprovalStatus>().map_err(|_| {
                Status::invalid_argument("status must be one of pending, approved, denied, expired")
            })?),
        };
        let request = request.into_inner();
        let after = match request.after.as_str() {
            "" => None,
            cursor => Some(
                crate::http_api::approval_cursor(cursor)
                    .map_err(|e| Status::invalid_argument(e.0))?,
            ),
        };
        let query = ApprovalQuery {
            status,
            after,
            limit: usize::try_from(request.limit).unwrap_or(usize::MAX),
            ..ApprovalQuery::default()
        };
        let page = crate::gate::decisions::list(&self.gate, &query)
            .await
            .map_err(|e| match e {
                StoreError::NotFound { id, .. } => Status::invalid_argument(format!(
                    "after: no approval {id:?}; pass the next_cursor of the previous page"
                )),
                e => Status::unavailable(format!("the store is unavailable: {e}")),
            })?;
        Ok(Response::new(pb::ListApprovalsResponse {
            approvals: page.approvals.iter().map(approval_info).collect(),
            next_cursor: page.next_cursor.unwrap_or_default(),
        }))
    }

    async fn decide_approval(
        &self,
        request: Request<pb::DecideApprovalRequest>,
    ) -> Result<Response<pb::ApprovalInfo>, Status> {
        let principal = self.authenticate(&request)?;
        if !principal.has(Role::Approver) {
            return Err(Status::permission_denied(
                "deciding approvals needs the approver role",
            ));
        }
        let request = request.into_inner();
        crate::gate::decisions::check_reason(&request.reason).map_err(Status::invalid_argument)?;
        let reason = (!request.reason.is_empty()).then_some(request.reason.as_str());
        let input_sha256 = match request.input_sha256.as_str() {
            "" => None,
            d if d.len() == 64 && d.chars().all(|c| c.is_ascii_hexdigit()) => Some(d),
            _ => {
                return Err(Status::invalid_argument(
                    "input_sha256 must be the 64 hex digits of the approval's input_sha256",
                ));
            }
        };
        let remember = match request.remember.as_str() {
            "" => false,
            "session" if request.approve => true,
            _ => {
                return Err(Status::invalid_argument(
                    "remember must be \"session\" (on an approval) or empty",
                ));
            }
        };
        let approval = crate::gate::decisions::decide(
            &self.gate,
            &principal,
            &request.approval_id,
            request.approve,
            reason,
            input_sha256,
            remember,
        )
        .await
        .map_err(|e| match e {
            DecideError::NotFound => {
                Status::not_found(format!("no approval {:?}", request.approval_id))
            }
            DecideError::SelfApproval => Status::permission_denied(e.to_string()),
            DecideError::InputChanged { .. }
            | DecideError::AlreadyApproved(_)
            | DecideError::CannotRemember(_)
            | DecideError::Conflict(_)
            | DecideError::Revoked(_) => Status::failed_precondition(e.to_string()),
            DecideError::Store(_) => Status::unavailable(e.to_string()),
        })?;
        Ok(Response::new(approval_info(&approval)))
    }
}

fn approval_info(a: &crate::store::Approval) -> pb::ApprovalInfo {
    pb::ApprovalInfo {
        approval_id: a.approval_id.to_string(),
        call_id: a.call_id.to_string(),
        tool: a.tool.clone(),
        input_json: a.input.to_string(),
        principal: a.principal.clone(),
        session_id: a.session_id.clone().unwrap_or_default(),
        status: a.status.as_str().to_owned(),
        created_at: crate::store::rfc3339(a.created_at),
        expires_at: crate::store::rfc3339(a.expires_at),
        decided_by: a.decided_by.clone().unwrap_or_default(),
        reason: a.reason.clone().unwrap_or_default(),
        input_sha256: a.input_sha256.clone(),
        approved_by: a.approved_by.clone(),
    }
}
