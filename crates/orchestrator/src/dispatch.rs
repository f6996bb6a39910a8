//! Running one call on a replica of its worker group: which replica, what happens when
//! it fails, and how a cancel reaches it.

use std::sync::Arc;
use std::time::Duration;

use airlock_policy::ToolOutcome;
use airlock_proto::v1 as pb;
use airlock_telemetry::StageParent;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::replicas::{Replica, never_started};

/// Grace beyond the worker's own deadline before the orchestrator gives up on it.
const DEADLINE_SLACK: Duration = Duration::from_secs(5);
/// How long a cancelled call may take to end on its worker once the worker was asked
/// to stop it: the worker's own cleanup grace (5 s) and slack.
const STOP_BOUND: Duration = Duration::from_secs(15);

/// Something a running call reports before its result.
#[derive(Debug, Clone)]
#[allow(
    dead_code,
    reason = "progress is forwarded by the streaming front doors that report it"
)]
pub enum WorkerEvent {
    Progress {
        progress: f64,
        total: Option<f64>,
        message: String,
    },
    Output {
        stream: &'static str,
        data: Vec<u8>,
    },
}

/// Why a call did not produce a tool result.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    #[error("no replica of the {group} worker is reachable ({detail}); retry shortly")]
    Unavailable { group: String, detail: String },
    #[error("the call did not finish within its deadline of {timeout_ms} ms and was stopped")]
    DeadlineExceeded { timeout_ms: u64 },
    #[error("the call was cancelled")]
    Cancelled,
    #[error(
        "the {group} worker failed during the call ({detail}); it may or may not have taken effect"
    )]
    Failed { group: String, detail: String },
    #[error("the {group} worker refused the call: {detail}")]
    Refused { group: String, detail: String },
}

/// The result of a dispatched call and the replica that ran it.
pub struct Dispatched {
    pub outcome: ToolOutcome,
    pub replica: String,
}

/// One call as the gate hands it to a worker; converted to the wire's
/// `ExecuteRequest` here, at the boundary, and nowhere else.
pub struct WorkerCall<'a> {
    pub call_id: String,
    pub tool: String,
    pub input: &'a serde_json::Value,
    pub principal: String,
    pub session_id: String,
    /// The deadline the worker enforces.
    pub timeout_ms: u64,
    /// Whether the worker keeps running the call when this side goes away (an approved
    /// call must not be lost with its replica).
    pub detached: bool,
    /// The tool is read-only and idempotent: a call whose replica failed before
    /// answering may run on another replica (each at most once).
    pub retryable: bool,
    /// What the worker's spans are children of.
    pub trace: &'a StageParent,
}

impl WorkerCall<'_> {
    fn into_wire(self) -> pb::ExecuteRequest {
        pb::ExecuteRequest {
            call_id: self.call_id,
            tool: self.tool,
            arguments_json: self.input.to_string(),
            principal: self.principal,
            session_id: self.session_id,
            timeout_ms: self.timeout_ms,
            trace_context: Default::default(),
            detached: self.detached,
        }
    }
}

/// Runs `call` on one replica of `group`, the least loaded healthy one.
///
/// A replica that certainly did not start the call (no connection, draining, refused
/// by GOAWAY) is passed over for the next, whatever the tool. A replica that failed
/// after the call went out may have run it: a read-only, idempotent call then runs on
/// another replica (each replica is tried at most once: during a rolling restart the
/// next one may be going away too), and any other call fails with an error that says
/// it may or may not have taken effect, never sent twice.
///
/// When `cancel` fires after the request went out, the worker is asked to stop the call
/// (`Cancel`, which kills its sandbox, detached or not) and this returns only once the
/// call's stream has ended: [`DispatchError::Cancelled`] then means the worker stopped
/// it, and a call that finished before the cancel reached it keeps its result. Nothing
/// here reports a call cancelled while it may still run.
pub async fn execute(
    group: &crate::catalog::WorkerGroup,
    call: WorkerCall<'_>,
    events: Option<mpsc::Sender<WorkerEvent>>,
    cancel: &CancellationToken,
) -> Result<Dispatched, DispatchError> {
    let retryable = call.retryable;
    let trace = call.trace;
    let request = call.into_wire();
    let timeout_ms = request.timeout_ms;
    let overall = Duration::from_millis(timeout_ms) + DEADLINE_SLACK;
    let mut tried: Vec<Arc<Replica>> = Vec::new();
    let mut last_unreachable = String::from("no replicas are known");
    while let Some(replica) = group.replicas.choose(&tried) {
        tried.push(replica.clone());
        if cancel.is_cancelled() {
            // Nothing has gone out: there is nothing to stop.
            return Err(DispatchError::Cancelled);
        }
        let _load = replica.start_call();
        let mut wire_request = tonic::Request::new(request.clone());
        wire_request.set_timeout(overall);
        // The worker's spans join the call's trace (W3C trace context in metadata).
        airlock_telemetry::propagate::inject_metadata(trace, wire_request.metadata_mut());
        let mut client = replica.client();
        // Not raced against `cancel`: once the request is out the worker may be running
        // the call (a detached one even if this side goes away), so a cancel is dealt
        // with on the stream the worker answers with, below. Starting is quick (the
        // worker answers before the tool runs) and bounded by the deadline.
        let started = client.execute(wire_request).await;
        let failure = match started {
            Ok(response) => {
                let mut stream = response.into_inner();
                let deadline = tokio::time::Instant::now() + overall;
                let consumed = tokio::select! {
                    _ = cancel.cancelled() => {
                        return stop(group, &replica, &request, &mut stream, events.as_ref(), deadline).await;
                    }
                    r = tokio::time::timeout_at(deadline, consume(&mut stream, events.as_ref())) => r,
                };
                match consumed {
                    Ok(Ok(outcome)) => {
                        group.replicas.answered(&replica);
                        return Ok(Dispatched {
                            outcome,
                            replica: replica.endpoint.clone(),
                        });
                    }
                    Ok(Err(status)) => status,
                    Err(_) => return Err(DispatchError::DeadlineExceeded { timeout_ms }),
                }
            }
            Err(status) => status,
        };
        if never_started(&failure) {
            tracing::warn!(group = %group.name, endpoint = %replica.endpoint, status = %failure, "replica did not take the call; trying another");
            if failure
                .metadata()
                .get(airlock_proto::NOT_STARTED_METADATA)
                .is_none()
            {
                group.replicas.failed(&replica, failure.message());
            }
            last_unreachable = failure.message().to_owned();
            continue;
        }
        if !is_unreachable(&failure) {
            return Err(status_error(&group.name, failure, timeout_ms));
        }
        // The connection failed after the call went out: the worker may have run it.
        group.replicas.failed(&replica, failure.message());
        if retryable {
            tracing::warn!(group = %group.name, endpoint = %replica.endpoint, status = %failure, "replica failed before answering; running the read-only call on another replica");
            last_unreachable = format!(
                "replica {} failed before answering: {}",
                replica.endpoint,
                failure.message()
            );
            continue;
        }
        return Err(DispatchError::Failed {
            group: group.name.clone(),
            detail: format!(
                "replica {} failed before answering: {}",
                replica.endpoint,
                failure.message()
            ),
        });
    }
    group.mark_down();
    Err(DispatchError::Unavailable {
        group: group.name.clone(),
        detail: last_unreachable,
    })
}

/// Asks `replica` to stop the call whose `stream` is open and waits for the stream's
/// last word: the call's result if it finished first, else the worker's CANCELLED.
async fn stop(
    group: &crate::catalog::WorkerGroup,
    replica: &Replica,
    request: &pb::ExecuteRequest,
    stream: &mut tonic::Streaming<pb::ExecuteEvent>,
    events: Option<&mpsc::Sender<WorkerEvent>>,
    deadline: tokio::time::Instant,
) -> Result<Dispatched, DispatchError> {
    let asked = tokio::time::timeout(
        STOP_BOUND,
        replica.client().cancel(pb::CancelRequest {
            call_id: request.call_id.clone(),
        }),
    )
    .await;
    let refusal = match asked {
        Ok(Ok(_)) => None,
        Ok(Err(status)) => Some(status.to_string()),
        Err(_) => Some(format!("no answer within {} s", STOP_BOUND.as_secs())),
    };
    let until = match refusal {
        None => tokio::time::Instant::now() + STOP_BOUND,
        Some(why) if !request.detached => {
            // A worker that cannot take `Cancel` (an external one predating it) stops an
            // attached call when its stream goes away, which returning here does.
            tracing::warn!(call_id = %request.call_id, endpoint = %replica.endpoint, %why, "the worker did not take Cancel; dropping the call's stream to stop it");
            return Err(DispatchError::Cancelled);
        }
        Some(why) => {
            // Nothing else stops a detached call: it runs to its end and is reported as
            // what it did, not as cancelled.
            tracing::warn!(call_id = %request.call_id, endpoint = %replica.endpoint, %why, "the worker did not take Cancel; the detached call runs to its end");
            deadline
        }
    };
    match tokio::time::timeout_at(until, consume(stream, events)).await {
        Ok(Ok(outcome)) => Ok(Dispatched {
            outcome,
            replica: replica.endpoint.clone(),
        }),
        Ok(Err(status)) => Err(status_error(&group.name, status, request.timeout_ms)),
        Err(_) if until == deadline => Err(DispatchError::DeadlineExceeded {
            timeout_ms: request.timeout_ms,
        }),
        Err(_) => Err(DispatchError::Failed {
            group: group.name.clone(),
            detail: "it was asked to cancel the call and did not report the call's end".to_owned(),
        }),
    }
}

/// Asks every replica of `group` to stop `call_id` (a call another orchestrator
/// replica dispatched: only its worker knows where it runs). Best effort; the replica
/// that dispatched it records how it ended.
pub async fn cancel_everywhere(group: &crate::catalog::WorkerGroup, call_id: &str) {
    for replica in group.replicas.all() {
        let asked = tokio::time::timeout(
            STOP_BOUND,
            replica.client().cancel(pb::CancelRequest {
                call_id: call_id.to_owned(),
            }),
        )
        .await;
        match asked {
            Ok(Ok(answer)) if answer.get_ref().found => return,
            Ok(Ok(_)) => {}
            Ok(Err(status)) => {
                tracing::warn!(call_id, endpoint = %replica.endpoint, %status, "cannot cancel the call on this replica")
            }
            Err(_) => {
                tracing::warn!(call_id, endpoint = %replica.endpoint, "cancelling the call on this replica timed out")
            }
        }
    }
}

async fn consume(
    stream: &mut tonic::Streaming<pb::ExecuteEvent>,
    events: Option<&mpsc::Sender<WorkerEvent>>,
) -> Result<ToolOutcome, tonic::Status> {
    use pb::execute_event::Event;
    while let Some(message) = stream.message().await? {
        match message.event {
            Some(Event::Result(result)) => {
                return ToolOutcome::try_from(result)
                    .map_err(|e| tonic::Status::internal(format!("malformed result: {e}")));
            }
            Some(Event::Progress(p)) => {
                if let Some(events) = events {
                    let total = (p.total > 0.0).then_some(p.total);
                    let _ = events
                        .send(WorkerEvent::Progress {
                            progress: p.progress,
                            total,
                            message: p.message,
                        })
                        .await;
                }
            }
            Some(Event::Output(o)) => {
                if let Some(events) = events {
                    let stream = if o.stream == pb::OutputStream::Stderr as i32 {
                        "stderr"
                    } else {
                        "stdout"
                    };
                    let _ = events
                        .send(WorkerEvent::Output {
                            stream,
                            data: o.data,
                        })
                        .await;
                }
            }
            None => {}
        }
    }
    Err(tonic::Status::unavailable(
        "the worker closed the stream without a result",
    ))
}

/// A failure of the replica or of the connection to it, as opposed to an answer the
/// worker gave: UNAVAILABLE, or any status made here from a transport error (a reset
/// connection surfaces as UNKNOWN "transport error", a stream the dying server dropped
/// as CANCELLED). A worker's own answers carry no source; this side's deadline
/// (`TimeoutExpired`) is not the replica's failure.
fn is_unreachable(status: &tonic::Status) -> bool {
    use std::error::Error;
    let mut source = status.source();
    while let Some(error) = source {
        if error.downcast_ref::<tonic::TimeoutExpired>().is_some() {
            return false;
        }
        source = error.source();
    }
    status.code() == tonic::Code::Unavailable || status.source().is_some()
}

fn status_error(group: &str, status: tonic::Status, timeout_ms: u64) -> DispatchError {
    match status.code() {
        tonic::Code::DeadlineExceeded => DispatchError::DeadlineExceeded { timeout_ms },
        tonic::Code::Cancelled => DispatchError::Cancelled,
        tonic::Code::InvalidArgument | tonic::Code::NotFound => DispatchError::Refused {
            group: group.to_owned(),
            detail: status.message().to_owned(),
        },
        _ => DispatchError::Failed {
            group: group.to_owned(),
            detail: status.message().to_owned(),
        },
    }
}
