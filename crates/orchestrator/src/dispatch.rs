//! Running one call on a replica of its worker group: which replica, what happens when
//! it fails, and how a cancel reaches it.

use std::sync::Arc;
use std::time::Duration;

use airlock_policy::ToolOutcome;
use airlock_proto::v1 as pb;
use airlock_telemetry::StageParent;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::execute_stream::ExecuteStream;
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
        // Not raced against `cancel`: once the request is out the worker may be running
        // the call (a detached one even if this side goes away), so a cancel is dealt
        // with on the stream the worker answers with, below. Starting is quick (the
        // worker answers before the tool runs) and bounded by the deadline.
        let started = replica.execute(wire_request).await;
        let failure = match started {
            Ok(mut stream) => {
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
    stream: &mut ExecuteStream,
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

/// How long the end of a call's stream (the worker's trailers, sent right after the
/// result) is waited for once the result is in.
const STREAM_END_BOUND: Duration = Duration::from_secs(1);

/// Reads a call's stream to its end after the result. Dropped before its trailers, a
/// stream is reset (`RST_STREAM`), and trailers that arrive after the client has
/// forgotten the reset count against h2's guard on streams the peer made it reset
/// (1 024 a connection, its defence against rapid-reset floods): under steady load the
/// connection to the worker was closed with `ENHANCE_YOUR_CALM` and every call on it
/// failed. A worker that keeps the stream open past the bound is cut off as before; the
/// result stands either way.
async fn read_to_end(stream: &mut ExecuteStream) {
    if let Ok(Err(status)) = tokio::time::timeout(STREAM_END_BOUND, stream.finish()).await {
        tracing::debug!(%status, "the worker's stream ended with an error after the call's result");
    }
}

async fn consume(
    stream: &mut ExecuteStream,
    events: Option<&mpsc::Sender<WorkerEvent>>,
) -> Result<ToolOutcome, tonic::Status> {
    use pb::execute_event::Event;
    while let Some(message) = stream.message().await? {
        match message.event {
            Some(Event::Result(result)) => {
                let outcome = ToolOutcome::try_from(result)
                    .map_err(|e| tonic::Status::internal(format!("malformed result: {e}")));
                read_to_end(stream).await;
                return outcome;
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

#[cfg(test)]
mod tests {
    use std::pin::Pin;

    use airlock_proto::v1::tool_worker_server::{ToolWorker, ToolWorkerServer};
    use futures::Stream;
    use tonic::{Request, Response, Status};

    use super::*;
    use crate::catalog::Catalog;
    use crate::config::{DispatchConfig, WorkerGroupConfig, WorkerTls};

    /// A worker that answers every call at once and ends the stream a little later (as
    /// one under load sends its trailers after the result), counting the streams the
    /// caller reset instead of reading them to their end.
    struct LateTrailers {
        reset: Arc<std::sync::atomic::AtomicUsize>,
        ended: Arc<std::sync::atomic::AtomicUsize>,
    }

    type Events = Pin<Box<dyn Stream<Item = Result<pb::ExecuteEvent, Status>> + Send>>;

    #[tonic::async_trait]
    impl ToolWorker for LateTrailers {
        async fn list_tools(
            &self,
            _: Request<pb::ListToolsRequest>,
        ) -> Result<Response<pb::ListToolsResponse>, Status> {
            Ok(Response::new(pb::ListToolsResponse::default()))
        }

        type ExecuteStream = Events;

        async fn execute(
            &self,
            _: Request<pb::ExecuteRequest>,
        ) -> Result<Response<Events>, Status> {
            let (send, receive) = mpsc::channel(1);
            let (reset, ended) = (self.reset.clone(), self.ended.clone());
            tokio::spawn(async move {
                let result = pb::ExecuteEvent {
                    event: Some(pb::execute_event::Event::Result(pb::ToolResult {
                        content: vec!["ok".into()],
                        ..Default::default()
                    })),
                };
                let _ = send.send(Ok(result)).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
                // A reset stream is dropped by the server: nobody receives any more.
                if send.is_closed() {
                    reset.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                ended.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                // Dropping the sender ends the stream: the trailers go now.
            });
            Ok(Response::new(Box::pin(
                tokio_stream::wrappers::ReceiverStream::new(receive),
            )))
        }

        async fn cancel(
            &self,
            _: Request<pb::CancelRequest>,
        ) -> Result<Response<pb::CancelResponse>, Status> {
            Ok(Response::new(pb::CancelResponse::default()))
        }
    }

    /// A caller that drops a stream after its result resets it, and trailers in flight
    /// then count against h2's guard on resets the peer caused: past 1 024 on one
    /// connection (as under the soak), h2 closed it and every call on it failed. Each
    /// call reads its stream to its end, so none is reset, however many there are.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_call_reads_its_stream_to_its_end_rather_than_resetting_it() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("late.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let reset = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let ended = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(ToolWorkerServer::new(LateTrailers {
                    reset: reset.clone(),
                    ended: ended.clone(),
                }))
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
        );
        let dialer = WorkerTls {
            mtls: None,
            insecure_plaintext: false,
        }
        .dialer();
        let config = WorkerGroupConfig {
            group: "late".into(),
            endpoints: vec![format!("unix:{}", socket.display())],
            server_name: None,
        };
        let catalog = Catalog::new(&[config], &dialer, &DispatchConfig::default()).unwrap();
        let group = catalog.group("late").unwrap();
        let input = serde_json::json!({});
        let trace = StageParent::default();
        let cancel = CancellationToken::new();
        let calls: usize = 200;
        let next = std::sync::atomic::AtomicUsize::new(0);
        let sender = || async {
            let mut failures = Vec::new();
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < calls {
                let call = WorkerCall {
                    call_id: "call_test".into(),
                    tool: "late".into(),
                    input: &input,
                    principal: "local".into(),
                    session_id: "default".into(),
                    timeout_ms: 10_000,
                    detached: false,
                    retryable: false,
                    trace: &trace,
                };
                match execute(&group, call, None, &cancel).await {
                    Ok(done) => assert_eq!(done.outcome.content, vec!["ok".to_owned()]),
                    Err(e) => failures.push(e.to_string()),
                }
            }
            failures
        };
        let failures: Vec<String> = futures::future::join_all((0..16).map(|_| sender()))
            .await
            .into_iter()
            .flatten()
            .collect();
        assert!(
            failures.is_empty(),
            "{} of {calls} calls failed, first: {}",
            failures.len(),
            failures[0]
        );
        // The worker's side has looked at every stream (bounded: each looks once,
        // 10 ms after its result).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while ended.load(std::sync::atomic::Ordering::Relaxed) < calls {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the worker ended {} of {calls} streams",
                ended.load(std::sync::atomic::Ordering::Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            reset.load(std::sync::atomic::Ordering::Relaxed),
            0,
            "streams reset by the caller after their result"
        );
    }
}
