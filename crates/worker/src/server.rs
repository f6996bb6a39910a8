//! The `airlock.v1.ToolWorker` gRPC server.
//!
//! Four promises are kept here rather than in each tool: the worker's own timer ends a
//! call at its deadline (`DEADLINE_EXCEEDED`), a caller that goes away cancels its call
//! (unless it is detached), `Cancel` stops any call by its id and answers once it has
//! ended, and shutdown drains (no new calls, in-flight calls finish up to a grace
//! period).

use std::future::Future;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use airlock_policy::{SessionId, ToolOutcome, validate_segment};
use airlock_proto::v1 as pb;
use airlock_proto::v1::tool_worker_server::{ToolWorker, ToolWorkerServer};
use airlock_telemetry::{CallSpan, SpanKind, SpanStart};
use futures::{Stream, StreamExt};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream, UnixListenerStream};
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status};

use crate::metrics::{CallMeter, WorkerMetrics};
use crate::{CallContext, ListenAddr, OutputStream, ToolEvent, ToolSet};

/// Largest gRPC message accepted or sent (arguments and results of one call).
const MAX_MESSAGE_BYTES: usize = 32 * 1024 * 1024;
/// How long a cancelled call may take to clean up (kill its sandbox, remove temp files)
/// before its future is dropped.
const CANCEL_GRACE: Duration = Duration::from_secs(5);
/// How long connections may stay open once every call has ended in a drain.
const CLOSE_GRACE: Duration = Duration::from_secs(5);
/// How long a drained worker still answers (refusing every new call as not started)
/// before it closes its connections: a call the orchestrator sent just before it
/// learnt of the drain then gets a refusal it can send elsewhere, not a connection
/// torn down under it, which would leave it unsure whether the call ran.
const REFUSE_LINGER: Duration = Duration::from_millis(300);

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot bind {addr}: {source}")]
    Bind { addr: String, source: io::Error },
    #[error("cannot prepare socket directory {path}: {source}")]
    SocketDir { path: String, source: io::Error },
    #[error("cannot build reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("grpc server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Deadlines and drain behaviour of a worker.
#[derive(Debug, Clone)]
pub struct WorkerSettings {
    /// Deadline of a call whose request names none.
    pub default_timeout: Duration,
    /// Upper bound of any call's deadline.
    pub max_timeout: Duration,
    /// How long in-flight calls may run on after shutdown starts.
    pub drain_grace: Duration,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        Self {
            default_timeout: Duration::from_secs(30),
            max_timeout: Duration::from_secs(600),
            drain_grace: Duration::from_secs(30),
        }
    }
}

/// A health "service" that a worker serving plaintext TCP reports as SERVING
/// (`grpc_health_probe -service airlock.insecure_plaintext`); unknown otherwise.
pub const INSECURE_PLAINTEXT_SERVICE: &str = "airlock.insecure_plaintext";

/// A bound, not yet serving, listener. Binding is synchronous so that a process can bind,
/// confine itself and only then start its async runtime.
#[derive(Debug)]
pub enum BoundListener {
    Unix(std::os::unix::net::UnixListener),
    Tcp(std::net::TcpListener),
    /// TCP under mutual TLS (see [`BoundListener::with_mutual_tls`]).
    TcpTls(
        std::net::TcpListener,
        std::sync::Arc<airlock_tls::mtls::Reloading>,
    ),
}

impl BoundListener {
    /// Binds `addr`. A Unix socket replaces a stale socket file and is made accessible to
    /// the owner only, so only the orchestrator running as the same user can connect.
    pub fn bind(addr: &ListenAddr) -> Result<Self, ServeError> {
        let bind_err = |source| ServeError::Bind {
            addr: addr.to_string(),
            source,
        };
        match addr {
            ListenAddr::Unix(path) => {
                prepare_socket_path(path)?;
                let listener = std::os::unix::net::UnixListener::bind(path).map_err(bind_err)?;
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                    .map_err(bind_err)?;
                listener.set_nonblocking(true).map_err(bind_err)?;
                Ok(BoundListener::Unix(listener))
            }
            ListenAddr::Tcp(sock) => {
                let listener = std::net::TcpListener::bind(sock).map_err(bind_err)?;
                listener.set_nonblocking(true).map_err(bind_err)?;
                Ok(BoundListener::Tcp(listener))
            }
        }
    }

    /// Serves a TCP listener under mutual TLS: only peers authenticated by `mtls` reach
    /// the worker. A Unix socket is left as it is (its file mode is its access control).
    pub fn with_mutual_tls(self, mtls: std::sync::Arc<airlock_tls::mtls::Reloading>) -> Self {
        match self {
            BoundListener::Tcp(l) | BoundListener::TcpTls(l, _) => BoundListener::TcpTls(l, mtls),
            unix @ BoundListener::Unix(_) => unix,
        }
    }

    pub fn is_tcp(&self) -> bool {
        !matches!(self, BoundListener::Unix(_))
    }

    /// The address actually bound (resolves port 0).
    pub fn local_addr(&self) -> String {
        match self {
            BoundListener::Unix(l) => l
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(|p| format!("unix:{}", p.display())))
                .unwrap_or_else(|| "unix:?".to_owned()),
            BoundListener::Tcp(l) | BoundListener::TcpTls(l, _) => l
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_else(|_| "tcp:?".to_owned()),
        }
    }
}

fn prepare_socket_path(path: &Path) -> Result<(), ServeError> {
    let dir_err = |source| ServeError::SocketDir {
        path: path.display().to_string(),
        source,
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(dir_err)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(dir_err(e)),
    }
}

/// Server reflection that lists exactly what a worker serves: `airlock.v1.ToolWorker`,
/// health, and reflection itself in both versions (v1, and v1alpha for grpcurl up to 1.8
/// and grpcio-reflection's client) — not `airlock.v1.Orchestrator`, which shares the
/// descriptor file. Called once per version: the builder is consumed by `build_*`.
fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(airlock_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
        .include_reflection_service(false)
        .with_service_name("airlock.v1.ToolWorker")
        .with_service_name("grpc.health.v1.Health")
        .with_service_name("grpc.reflection.v1.ServerReflection")
        .with_service_name("grpc.reflection.v1alpha.ServerReflection")
}

/// A worker: a tool set plus the settings it is served with.
pub struct WorkerServer {
    tools: ToolSet,
    settings: WorkerSettings,
    metrics: Arc<WorkerMetrics>,
    /// Run once the worker has gone idle (see `crate::idle`).
    release_when_idle: Option<fn()>,
}

impl WorkerServer {
    pub fn new(tools: ToolSet, settings: WorkerSettings) -> Self {
        Self {
            tools,
            settings,
            metrics: Arc::default(),
            release_when_idle: None,
        }
    }

    /// Runs `release` each time the worker has started no call for a while and has
    /// none in flight: a worker that keeps its large buffers warm between calls gives
    /// them back there (`airlock_sandbox::heap::give_back_free_memory`).
    pub fn with_idle_release(mut self, release: fn()) -> Self {
        self.release_when_idle = Some(release);
        self
    }

    /// Counts calls in `metrics` (registered where the worker's `/metrics` serves them).
    pub fn with_metrics(mut self, metrics: WorkerMetrics) -> Self {
        self.metrics = Arc::new(metrics);
        self
    }

    /// Serves until `shutdown` resolves, then drains (DESIGN §9):
    /// 1. health turns NOT_SERVING at once and every health `Watch` ends, so the
    ///    orchestrator stops choosing this replica;
    /// 2. `Execute` refuses new calls as not started (the orchestrator may send them to
    ///    another replica), while the listener stays open for the calls in flight;
    /// 3. in-flight calls get `drain_grace` to finish, and are cancelled after that;
    /// 4. only then does the server stop, closing its connections.
    pub async fn serve(
        self,
        listener: BoundListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let (health, _) = tonic_health::server::health_reporter();
        health
            .set_serving::<ToolWorkerServer<WorkerService>>()
            .await;
        if matches!(listener, BoundListener::Tcp(_)) {
            // Plaintext TCP exists only with `[tls] insecure_plaintext = true`; health
            // says so to anyone who asks, not only the start-up log.
            health
                .set_service_status(
                    INSECURE_PLAINTEXT_SERVICE,
                    tonic_health::ServingStatus::Serving,
                )
                .await;
        }
        let reflection_v1 = reflection().build_v1()?;
        let reflection_v1alpha = reflection().build_v1alpha()?;

        let draining = CancellationToken::new();
        let all_calls = CancellationToken::new();
        let in_flight = TaskTracker::new();
        let activity = crate::idle::Activity::default();
        let service = WorkerService {
            tools: self.tools,
            settings: self.settings.clone(),
            draining: draining.clone(),
            all_calls: all_calls.clone(),
            in_flight: in_flight.clone(),
            ledger: Ledger::default(),
            running: Running::default(),
            metrics: self.metrics,
            activity: activity.clone(),
        };
        let router = tonic::transport::Server::builder()
            .add_service(crate::health::DrainingHealth::server(
                &health,
                draining.clone(),
            ))
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(
                ToolWorkerServer::new(service)
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES),
            );

        let stop_serving = CancellationToken::new();
        if let Some(release) = self.release_when_idle {
            tokio::spawn(crate::idle::release_when_idle(
                activity,
                in_flight.clone(),
                release,
                stop_serving.clone(),
            ));
        }
        let grace = self.settings.drain_grace;
        let drain = {
            let (draining, stop_serving) = (draining.clone(), stop_serving.clone());
            async move {
                shutdown.await;
                let calls = in_flight.len();
                tracing::info!(
                    calls,
                    grace_ms = grace.as_millis() as u64,
                    "shutdown requested: NOT_SERVING, taking no new calls, draining those in flight"
                );
                health
                    .set_not_serving::<ToolWorkerServer<WorkerService>>()
                    .await;
                health
                    .set_service_status("", tonic_health::ServingStatus::NotServing)
                    .await;
                draining.cancel();
                in_flight.close();
                if tokio::time::timeout(grace, in_flight.wait()).await.is_err() {
                    tracing::warn!(
                        grace_ms = grace.as_millis() as u64,
                        calls = in_flight.len(),
                        "drain grace period over: cancelling in-flight calls"
                    );
                    all_calls.cancel();
                    let _ = tokio::time::timeout(CANCEL_GRACE, in_flight.wait()).await;
                }
                tracing::info!("drained");
                tokio::time::sleep(REFUSE_LINGER).await;
                stop_serving.cancel();
            }
        };
        tokio::spawn(drain);
        let stopped = stop_serving.clone().cancelled_owned();
        let serving = async move {
            match listener {
                BoundListener::Unix(l) => {
                    let incoming =
                        UnixListenerStream::new(tokio::net::UnixListener::from_std(l).map_err(
                            |source| ServeError::Bind {
                                addr: "unix socket".to_owned(),
                                source,
                            },
                        )?);
                    router
                        .serve_with_incoming_shutdown(incoming, stopped)
                        .await?;
                }
                BoundListener::Tcp(l) => {
                    let incoming =
                        TcpListenerStream::new(tokio::net::TcpListener::from_std(l).map_err(
                            |source| ServeError::Bind {
                                addr: "tcp socket".to_owned(),
                                source,
                            },
                        )?)
                        .map(|accepted| {
                            // Small gRPC frames must not wait for Nagle and delayed ACKs.
                            accepted.inspect(|tcp| {
                                let _ = tcp.set_nodelay(true);
                            })
                        });
                    router
                        .serve_with_incoming_shutdown(incoming, stopped)
                        .await?;
                }
                BoundListener::TcpTls(l, mtls) => {
                    airlock_tls::mtls::watch(mtls.clone(), "worker");
                    let listener = tokio::net::TcpListener::from_std(l).map_err(|source| {
                        ServeError::Bind {
                            addr: "tcp socket".to_owned(),
                            source,
                        }
                    })?;
                    router
                        .serve_with_incoming_shutdown(crate::tls::incoming(listener, mtls), stopped)
                        .await?;
                }
            }
            Ok::<(), ServeError>(())
        };
        tokio::select! {
            result = serving => result,
            // Every call has ended; a connection that does not close (a client that
            // keeps a stream open) does not hold the process beyond this.
            _ = async { stop_serving.cancelled().await; tokio::time::sleep(CLOSE_GRACE).await } => {
                tracing::warn!("connections still open after the drain; closing them");
                Ok(())
            }
        }
    }
}

struct WorkerService {
    tools: ToolSet,
    settings: WorkerSettings,
    /// Cancelled when the worker starts draining: new calls are refused as not started.
    draining: CancellationToken,
    all_calls: CancellationToken,
    in_flight: TaskTracker,
    ledger: Ledger,
    running: Running,
    metrics: Arc<WorkerMetrics>,
    activity: crate::idle::Activity,
}

impl WorkerService {
    fn call_timeout(&self, requested_ms: u64, grpc_timeout: Option<Duration>) -> Duration {
        let requested = match requested_ms {
            0 => self.settings.default_timeout,
            ms => Duration::from_millis(ms),
        };
        let bounded = requested.min(self.settings.max_timeout);
        grpc_timeout.map_or(bounded, |t| bounded.min(t))
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::ExecuteEvent, Status>> + Send>>;

#[tonic::async_trait]
impl ToolWorker for WorkerService {
    async fn list_tools(
        &self,
        _request: Request<pb::ListToolsRequest>,
    ) -> Result<Response<pb::ListToolsResponse>, Status> {
        let tools = self
            .tools
            .definitions()
            .iter()
            .map(pb::ToolDefinition::from)
            .collect();
        Ok(Response::new(pb::ListToolsResponse {
            group: self.tools.group().to_owned(),
            tools,
        }))
    }

    type ExecuteStream = EventStream;

    async fn execute(
        &self,
        request: Request<pb::ExecuteRequest>,
    ) -> Result<Response<Self::ExecuteStream>, Status> {
        self.activity.call_started();
        let grpc_timeout = request
            .metadata()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok().and_then(airlock_proto::parse_grpc_timeout));
        let span = execute_span(&request);
        let request = request.into_inner();
        let tool = self.tools.get(&request.tool).ok_or_else(|| {
            Status::not_found(format!("tool {:?} is not served here", request.tool))
        })?;
        let arguments: serde_json::Value = serde_json::from_str(&request.arguments_json)
            .map_err(|e| Status::invalid_argument(format!("arguments are not valid JSON: {e}")))?;
        if !arguments.is_object() {
            return Err(Status::invalid_argument("arguments must be a JSON object"));
        }
        validate_segment("principal", &request.principal)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let session_id = if request.session_id.is_empty() {
            SessionId::default_session()
        } else {
            SessionId::parse(&request.session_id)
                .map_err(|e| Status::invalid_argument(e.to_string()))?
        };

        // Counted as in flight from here, so that a drain starting now waits for this
        // call rather than stopping the server under it.
        let _admitted = self.in_flight.token();
        if self.draining.is_cancelled() {
            // A detached call sent again joins its run, which is in flight; anything
            // else is new, and a draining worker starts nothing new.
            if let Some(existing) = self.ledger.answer(&request.call_id) {
                return Ok(Response::new(replay(existing)));
            }
            return Err(not_started("the worker is draining"));
        }
        // Only detached (durable, approved) calls are ever sent again; the ledger keeps
        // just those, so ordinary results are not retained.
        let ledger = if request.call_id.is_empty() || !request.detached {
            watch::channel(None).0
        } else {
            match self.ledger.register(&request.call_id) {
                Ok(ledger) => ledger,
                Err(existing) => {
                    tracing::info!(call_id = %request.call_id, "repeated call id: joining the original run");
                    return Ok(Response::new(replay(existing)));
                }
            }
        };
        let detached = request.detached;
        let timeout = self.call_timeout(request.timeout_ms, grpc_timeout);
        let deadline = Instant::now() + timeout;
        let cancel = self.all_calls.child_token();
        // Every call with an id can be cancelled by it, detached ones included (nothing
        // else stops those), until it ends.
        let registered = (!request.call_id.is_empty()).then(|| {
            self.running
                .register(&request.call_id, cancel.clone(), ledger.subscribe())
        });
        let (event_tx, event_rx) = mpsc::channel(256);
        let (out_tx, out_rx) = mpsc::channel(256);
        let ctx = CallContext::new(
            request.call_id.clone(),
            request.principal,
            session_id,
            deadline,
            cancel.clone(),
            event_tx,
        );
        tracing::debug!(call_id = %request.call_id, tool = %request.tool, "execute");
        let ending = CallEnding {
            meter: self.metrics.start(&request.tool),
            span: span.clone(),
        };
        let call = async move { tool.execute(arguments, ctx).await };
        self.in_flight.spawn(span.attach_to(run_call(
            call,
            event_rx,
            out_tx,
            cancel.clone(),
            timeout,
            detached,
            ledger,
            registered,
            ending,
        )));
        let stream = ReceiverStream::new(out_rx);
        if detached {
            return Ok(Response::new(Box::pin(stream)));
        }
        Ok(Response::new(Box::pin(CancelOnDrop {
            inner: stream,
            _guard: cancel.drop_guard(),
        })))
    }

    async fn cancel(
        &self,
        request: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::CancelResponse>, Status> {
        let call_id = request.into_inner().call_id;
        if call_id.is_empty() {
            return Err(Status::invalid_argument("call_id is required"));
        }
        let answer = match self.running.cancel(&call_id) {
            Some(answer) => Some(answer),
            // A detached call that already ended is still known: nothing to stop.
            None => self.ledger.answer(&call_id),
        };
        let Some(mut answer) = answer else {
            return Ok(Response::new(pb::CancelResponse {
                found: false,
                stopped: false,
            }));
        };
        // Answered once the call has ended, so that a caller never reports a call
        // cancelled while its sandbox still runs. A closed channel means the call's task
        // is gone, which is an end too.
        let stopped = tokio::time::timeout(
            CANCEL_GRACE + CANCEL_ANSWER_SLACK,
            answer.wait_for(Option::is_some),
        )
        .await
        .is_ok();
        tracing::info!(%call_id, stopped, "cancel requested");
        Ok(Response::new(pb::CancelResponse {
            found: true,
            stopped,
        }))
    }
}

/// The final answer of a call: its result, or the status that ended it.
type Final = Result<pb::ToolResult, Status>;

/// Drives one call: forwards its events, then its result; ends it at the deadline;
/// cancels it when the caller goes away (unless detached). The final answer is also
/// published to `ledger`, for a caller that asks again with the same call id, and to a
/// `Cancel` waiting for the end; the call leaves the table of running calls (`_running`)
/// after that.
#[allow(clippy::too_many_arguments, reason = "the call's whole context")]
async fn run_call(
    call: impl Future<Output = ToolOutcome> + Send,
    mut events: mpsc::Receiver<ToolEvent>,
    out: mpsc::Sender<Result<pb::ExecuteEvent, Status>>,
    cancel: CancellationToken,
    timeout: Duration,
    detached: bool,
    ledger: watch::Sender<Option<Final>>,
    _running: Option<RunningGuard>,
    ending: CallEnding,
) {
    tokio::pin!(call);
    let expiry = tokio::time::sleep(timeout);
    tokio::pin!(expiry);
    let mut caller_gone = false;
    let answer: Final = loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => {
                // The caller went away (or the drain grace ran out). The tool sees the
                // token and gets a moment to clean up; then its future is dropped, and
                // tools release what they hold (a sandbox is killed) in Drop.
                let _ = tokio::time::timeout(CANCEL_GRACE, &mut call).await;
                break Err(Status::cancelled("the call was cancelled"));
            }
            outcome = &mut call => {
                while let Ok(event) = events.try_recv() {
                    if !caller_gone {
                        let _ = out.send(Ok(wire_event(event))).await;
                    }
                }
                break Ok(outcome.into());
            }
            Some(event) = events.recv() => {
                if !caller_gone && out.send(Ok(wire_event(event))).await.is_err() {
                    caller_gone = true;
                    if !detached {
                        cancel.cancel();
                    }
                }
            }
            _ = &mut expiry => {
                cancel.cancel();
                let _ = tokio::time::timeout(CANCEL_GRACE, &mut call).await;
                let message = format!("the call did not finish within {} ms and was stopped", timeout.as_millis());
                break Err(Status::deadline_exceeded(message));
            }
        }
    };
    let status = match &answer {
        Ok(result) if result.is_error => "error",
        Ok(_) => "ok",
        Err(status) if status.code() == tonic::Code::DeadlineExceeded => "timeout",
        Err(status) if status.code() == tonic::Code::Cancelled => "cancelled",
        Err(_) => "error",
    };
    ending.record(status);
    ledger.send_replace(Some(ledger_copy(&answer, detached)));
    let _ = out.send(answer.map(result_event)).await;
}

/// What a call's ledger keeps of its answer. A detached call may be sent again and is
/// answered from the ledger, so it keeps the whole answer; any other call's ledger only
/// tells a `Cancel` that the call has ended, so it keeps the answer without its text
/// (a 1 MiB result was copied here for nothing).
fn ledger_copy(answer: &Final, detached: bool) -> Final {
    match answer {
        Ok(result) if !detached => Ok(pb::ToolResult {
            content: Vec::new(),
            isolation_json: String::new(),
            ..*result
        }),
        _ => answer.clone(),
    }
}

fn result_event(result: pb::ToolResult) -> pb::ExecuteEvent {
    pb::ExecuteEvent {
        event: Some(pb::execute_event::Event::Result(result)),
    }
}

/// Recent calls by id, so a repeated Execute (a restarted orchestrator resuming an
/// approved call) joins the original run instead of starting a second one.
#[derive(Default)]
struct Ledger {
    calls: std::sync::Mutex<std::collections::HashMap<String, LedgerEntry>>,
}

/// When a call started, and where its answer will appear.
type LedgerEntry = (Instant, watch::Receiver<Option<Final>>);

/// How long a call's answer stays available to a repeated Execute.
const LEDGER_TTL: Duration = Duration::from_secs(3600);
const LEDGER_CAPACITY: usize = 10_000;

impl Ledger {
    /// Registers `call_id`; `Err` carries the existing call's answer receiver.
    fn register(
        &self,
        call_id: &str,
    ) -> Result<watch::Sender<Option<Final>>, watch::Receiver<Option<Final>>> {
        let mut calls = match self.calls.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Some((_, existing)) = calls.get(call_id) {
            return Err(existing.clone());
        }
        if calls.len() >= LEDGER_CAPACITY {
            calls.retain(|_, (at, _)| at.elapsed() < LEDGER_TTL);
        }
        let (tx, rx) = watch::channel(None);
        if calls.len() < LEDGER_CAPACITY {
            calls.insert(call_id.to_owned(), (Instant::now(), rx));
        }
        Ok(tx)
    }
}

impl Ledger {
    /// Where the answer of a known detached call appears.
    fn answer(&self, call_id: &str) -> Option<watch::Receiver<Option<Final>>> {
        let calls = match self.calls.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        calls.get(call_id).map(|(_, answer)| answer.clone())
    }
}

/// `UNAVAILABLE`, marked as a call this worker did not start (see
/// [`airlock_proto::NOT_STARTED_METADATA`]).
fn not_started(why: &str) -> Status {
    let mut status = Status::unavailable(format!("{why}; the call was not started"));
    status.metadata_mut().insert(
        airlock_proto::NOT_STARTED_METADATA,
        tonic::metadata::MetadataValue::from_static("true"),
    );
    status
}

/// Extra time a `Cancel` waits beyond the call's cleanup grace for its answer.
const CANCEL_ANSWER_SLACK: Duration = Duration::from_secs(1);

/// The calls running now, by id: how to cancel each and where its answer appears.
#[derive(Default)]
struct Running {
    calls: std::sync::Arc<std::sync::Mutex<RunningTable>>,
}

#[derive(Default)]
struct RunningTable {
    next: u64,
    calls: std::collections::HashMap<String, RunningCall>,
}

struct RunningCall {
    /// Tells this registration from a later one with the same id.
    generation: u64,
    cancel: CancellationToken,
    answer: watch::Receiver<Option<Final>>,
}

/// Removes its call from [`Running`] when the call's task ends.
struct RunningGuard {
    table: std::sync::Arc<std::sync::Mutex<RunningTable>>,
    call_id: String,
    generation: u64,
}

fn lock_running(table: &std::sync::Mutex<RunningTable>) -> std::sync::MutexGuard<'_, RunningTable> {
    match table.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

impl Running {
    fn register(
        &self,
        call_id: &str,
        cancel: CancellationToken,
        answer: watch::Receiver<Option<Final>>,
    ) -> RunningGuard {
        let mut table = lock_running(&self.calls);
        table.next += 1;
        let generation = table.next;
        table.calls.insert(
            call_id.to_owned(),
            RunningCall {
                generation,
                cancel,
                answer,
            },
        );
        RunningGuard {
            table: self.calls.clone(),
            call_id: call_id.to_owned(),
            generation,
        }
    }

    /// Cancels the running call `call_id`; returns where its answer appears.
    fn cancel(&self, call_id: &str) -> Option<watch::Receiver<Option<Final>>> {
        let table = lock_running(&self.calls);
        let call = table.calls.get(call_id)?;
        call.cancel.cancel();
        Some(call.answer.clone())
    }
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        let mut table = lock_running(&self.table);
        if table
            .calls
            .get(&self.call_id)
            .is_some_and(|c| c.generation == self.generation)
        {
            table.calls.remove(&self.call_id);
        }
    }
}

/// The stream for a repeated Execute: the original call's answer, once it has one.
fn replay(mut answer: watch::Receiver<Option<Final>>) -> EventStream {
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(async move {
        let result = match answer.wait_for(Option::is_some).await {
            Ok(final_answer) => final_answer.clone(),
            Err(_) => None,
        };
        let event = match result {
            Some(answer) => answer.map(result_event),
            None => Err(Status::aborted("the original call ended without an answer")),
        };
        let _ = tx.send(event).await;
    });
    Box::pin(ReceiverStream::new(rx))
}

fn wire_event(event: ToolEvent) -> pb::ExecuteEvent {
    let event = match event {
        ToolEvent::Progress {
            progress,
            total,
            message,
        } => pb::execute_event::Event::Progress(pb::Progress {
            progress,
            total: total.unwrap_or(0.0),
            message,
        }),
        ToolEvent::Output { stream, data } => pb::execute_event::Event::Output(pb::Output {
            stream: match stream {
                OutputStream::Stdout => pb::OutputStream::Stdout,
                OutputStream::Stderr => pb::OutputStream::Stderr,
            } as i32,
            data,
        }),
    };
    pb::ExecuteEvent { event: Some(event) }
}

/// A response stream that cancels its call when the transport drops it, which is how a
/// caller that disconnects (or cancels its RPC) reaches the running tool.
struct CancelOnDrop<S> {
    inner: S,
    _guard: DropGuard,
}

impl<S: Stream + Unpin> Stream for CancelOnDrop<S> {
    type Item = S::Item;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.inner).poll_next(cx)
    }
}

/// Where a call's end is recorded: the worker's metrics and the call's span.
struct CallEnding {
    meter: CallMeter,
    span: CallSpan,
}

impl CallEnding {
    /// `status` is `ok`, `error`, `timeout` or `cancelled`.
    fn record(self, status: &'static str) {
        self.meter.ended(status);
        self.span.set("airlock.status", || status.into());
        if status != "ok" {
            self.span.fail();
        }
        self.span.end();
    }
}

/// The worker's span of one call (service `airlock-worker-<group>`), a child of the
/// orchestrator's dispatch span through the W3C trace context in the request's metadata.
/// The tool's name and the call's ids only: never its arguments.
/// Built through the SDK directly (`airlock_telemetry::CallSpan`): a `tracing` span here
/// cost the worker about 7 % of its CPU on a 100 B read (docs/decisions.md, "Traces").
fn execute_span(request: &Request<pb::ExecuteRequest>) -> CallSpan {
    let parent = airlock_telemetry::propagate::context_from_metadata(request.metadata());
    let call = request.get_ref();
    CallSpan::start(parent, || {
        SpanStart::execute_tool(SpanKind::Server, &call.tool, &call.call_id)
    })
}

#[cfg(test)]
mod tests {
    /// Only a detached call's ledger keeps its result's text: nothing else is replayed.
    #[test]
    fn only_a_detached_calls_ledger_keeps_the_text() {
        let answer: super::Final = Ok(super::pb::ToolResult {
            is_error: true,
            content: vec!["x".repeat(1 << 20)],
            isolation_json: "{}".to_owned(),
            timed_out: true,
        });
        assert_eq!(
            super::ledger_copy(&answer, true).unwrap(),
            *answer.as_ref().unwrap()
        );
        let kept = super::ledger_copy(&answer, false).unwrap();
        assert!(kept.content.is_empty() && kept.isolation_json.is_empty());
        assert!(kept.is_error && kept.timed_out);
        let status: super::Final = Err(tonic::Status::cancelled("gone"));
        let kept = super::ledger_copy(&status, false).unwrap_err();
        assert_eq!(kept.code(), tonic::Code::Cancelled);
    }
}
