//! The connection a replica's calls share: gRPC over one HTTP/2 connection, driven by
//! `h2` directly.
//!
//! Why not tonic's `Channel`: between a call and its connection it puts three tasks —
//! a `tower` buffer's worker, hyper's dispatch task and a task hyper spawns for every
//! request to wait for its response — and every hand-off between them is a wake-up, on
//! a runtime of two threads often one that was asleep. Here the call's own task opens
//! the stream, writes the request into it and reads the answer from it; one task per
//! connection does the socket's I/O and its keepalive. The rest is what `Channel` did
//! for Airlock: a connection made on first use and made again once it has closed, a
//! connect timeout, HTTP/2 pings that close a connection whose worker stopped
//! answering, and a `grpc-timeout` that bounds the wait for the answer's headers.
//!
//! What a failure means to the dispatch is kept ([`crate::replicas::never_started`]): a
//! connection that could not be made, or a stream that could not be opened on it, is
//! tonic's `ConnectError` (UNAVAILABLE), a stream the worker refused with GOAWAY
//! `NO_ERROR` is UNAVAILABLE with that `h2::Error` as its source, and any other failure
//! of the transport is the `h2::Error`, which tonic maps to a status carrying it as its
//! source.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body::{Body as _, Frame};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long connecting to a worker may take (the dial and HTTP/2's preface).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a connection to a worker is pinged, and how long the answer may take: a
/// replica that is frozen (SIGSTOP, a hung node) loses its connection within about
/// 8 s, which fails its calls and ejects it, rather than holding them until their
/// deadline.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(3);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 settings, hyper's client defaults (which `Channel` used): a 1 MiB result
/// arrives without waiting for a window update.
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 5 * 1024 * 1024;
const MAX_SEND_BUFFER: usize = 1024 * 1024;
const MAX_HEADER_LIST: u32 = 16 * 1024;
/// The origin requests carry (`:scheme`, `:authority`); never resolved — the dialer
/// decides where the connection goes.
pub const ORIGIN: &str = "http://worker.airlock.invalid";

#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("connecting to the worker took longer than {0:?}")]
    ConnectTimeout(Duration),
    #[error("the worker's HTTP/2 handshake failed: {0}")]
    Handshake(#[source] h2::Error),
    #[error("the connection to the worker could not open a stream: {0}")]
    Open(#[source] h2::Error),
    #[error("the request to the worker has no origin ({ORIGIN} is expected)")]
    NoOrigin,
}

/// Anything a connection to a worker runs over: a Unix socket, TCP, TLS.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// Makes a new connection to the replica.
pub type Dial = Arc<dyn Fn() -> BoxFuture<'static, std::io::Result<Box<dyn Io>>> + Send + Sync>;

/// A replica's channel: cheap to clone, connects on first use, reconnects after the
/// connection has closed. A `tower::Service` of HTTP/2 requests, so tonic's generated
/// clients take it as they take `Channel`.
#[derive(Clone)]
pub struct WorkerChannel {
    shared: Arc<Shared>,
}

struct Shared {
    dial: Dial,
    /// The open connection, if any.
    live: Mutex<Option<Live>>,
    /// Held while a connection is made, so that calls finding none make one between
    /// them, not one each. It keeps the last attempt that failed, and when: calls that
    /// waited for that attempt fail with it rather than dialing again one after another
    /// (a replica that does not answer would make the last of them wait for every
    /// attempt before it).
    connecting: tokio::sync::Mutex<Option<(tokio::time::Instant, String)>>,
    generation: AtomicU64,
    /// Ends the connection's task once the channel is gone (h2 does not notice that
    /// every sender was dropped while its connection is parked).
    closed: CancellationToken,
}

#[derive(Clone)]
struct Live {
    sender: h2::client::SendRequest<Bytes>,
    generation: u64,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.closed.cancel();
    }
}

impl WorkerChannel {
    /// A channel whose connections `dial` makes; nothing is dialed until a call.
    pub fn new(dial: Dial) -> Self {
        Self {
            shared: Arc::new(Shared {
                dial,
                live: Mutex::new(None),
                connecting: tokio::sync::Mutex::new(None),
                generation: AtomicU64::new(0),
                closed: CancellationToken::new(),
            }),
        }
    }
}

impl tower::Service<http::Request<tonic::body::Body>> for WorkerChannel {
    type Response = http::Response<RecvBody>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is the connection's, waited for in `call` (a connection that has
        // closed is replaced there).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let shared = self.shared.clone();
        Box::pin(async move {
            match grpc_timeout(request.headers()) {
                Some(limit) => tokio::time::timeout(limit, shared.exchange(request))
                    .await
                    .map_err(|_| -> BoxError { Box::new(tonic::TimeoutExpired(())) })?,
                None => shared.exchange(request).await,
            }
        })
    }
}

impl Shared {
    /// Sends `request` on a stream of its own and waits for the answer's headers; the
    /// body is read by whoever reads the response.
    async fn exchange(
        self: &Arc<Self>,
        request: http::Request<tonic::body::Body>,
    ) -> Result<http::Response<RecvBody>, BoxError> {
        if request.uri().scheme().is_none() {
            return Err(Box::new(ChannelError::NoOrigin));
        }
        let mut sender = self.ready_sender().await?;
        let (head, body) = request.into_parts();
        let end_of_stream = body.is_end_stream();
        // A stream h2 could not open was never sent: the call did not start.
        let (response, mut outgoing) = sender
            .send_request(http::Request::from_parts(head, ()), end_of_stream)
            .map_err(|e| connect_error(ConnectFailure::Channel(ChannelError::Open(e))))?;
        if !end_of_stream && let Err(sending) = send_body(body, &mut outgoing).await {
            // The worker may have answered and closed the stream before the end of the
            // request was written: a gRPC server answers a unary call once it has its
            // message, and resets the stream (`NO_ERROR`) when the client has not
            // half-closed it yet, so the empty frame that ends the request finds the
            // stream gone. The answer is the call's (hyper, under tonic's channel, did
            // the same); with no answer, the failure to send is what happened.
            return match response.await {
                Ok(response) => Ok(response.map(RecvBody::new)),
                Err(_) => Err(sending),
            };
        }
        let response = response.await.map_err(transport_error)?;
        Ok(response.map(RecvBody::new))
    }

    /// A sender on an open connection that may open a stream now, connecting first
    /// when there is no open connection.
    async fn ready_sender(self: &Arc<Self>) -> Result<h2::client::SendRequest<Bytes>, BoxError> {
        if let Some(sender) = self.open_sender().await {
            return Ok(sender);
        }
        let asked = tokio::time::Instant::now();
        let mut last_failure = self.connecting.lock().await;
        // Another call may have connected while this one waited for the lock.
        if let Some(sender) = self.open_sender().await {
            return Ok(sender);
        }
        if let Some((at, why)) = last_failure.as_ref()
            && *at >= asked
        {
            return Err(connect_error(ConnectFailure::Shared(why.clone())));
        }
        let sender = match self.connect().await {
            Ok(sender) => sender,
            Err(failure) => {
                *last_failure = Some((tokio::time::Instant::now(), failure.to_string()));
                return Err(connect_error(failure));
            }
        };
        sender
            .ready()
            .await
            .map_err(|e| connect_error(ConnectFailure::Channel(ChannelError::Open(e))))
    }

    /// The open connection's sender once it may open a stream, or `None` when there is
    /// no open connection; one found closed (the worker went away, or said GOAWAY) is
    /// forgotten, so that the next call makes another.
    async fn open_sender(&self) -> Option<h2::client::SendRequest<Bytes>> {
        let live = self.current()?;
        match live.sender.ready().await {
            Ok(sender) => Some(sender),
            Err(_) => {
                self.forget(live.generation);
                None
            }
        }
    }

    fn current(&self) -> Option<Live> {
        self.live.lock().ok().and_then(|live| live.clone())
    }

    /// Drops the connection `generation` as the one to use, unless a newer one has
    /// replaced it already.
    fn forget(&self, generation: u64) {
        if let Ok(mut live) = self.live.lock()
            && live.as_ref().is_some_and(|l| l.generation == generation)
        {
            *live = None;
        }
    }

    /// Dials, does HTTP/2's handshake and starts the connection's task.
    async fn connect(self: &Arc<Self>) -> Result<h2::client::SendRequest<Bytes>, ConnectFailure> {
        let handshake = async {
            let io = (self.dial)().await.map_err(ConnectFailure::Dial)?;
            h2::client::Builder::new()
                .initial_window_size(STREAM_WINDOW)
                .initial_connection_window_size(CONNECTION_WINDOW)
                .max_send_buffer_size(MAX_SEND_BUFFER)
                .max_header_list_size(MAX_HEADER_LIST)
                .enable_push(false)
                .handshake::<_, Bytes>(io)
                .await
                .map_err(|e| ConnectFailure::Channel(ChannelError::Handshake(e)))
        };
        let (sender, mut connection) = tokio::time::timeout(CONNECT_TIMEOUT, handshake)
            .await
            .map_err(|_| {
                ConnectFailure::Channel(ChannelError::ConnectTimeout(CONNECT_TIMEOUT))
            })??;
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let pings = connection.ping_pong();
        tokio::spawn(drive(
            connection,
            pings,
            Arc::downgrade(self),
            generation,
            self.closed.clone(),
        ));
        if let Ok(mut live) = self.live.lock() {
            *live = Some(Live {
                sender: sender.clone(),
                generation,
            });
        }
        Ok(sender)
    }
}

/// Why a connection could not be made; carried inside tonic's `ConnectError`.
#[derive(Debug, thiserror::Error)]
enum ConnectFailure {
    #[error("{0}")]
    Dial(#[source] std::io::Error),
    #[error("{0}")]
    Channel(#[source] ChannelError),
    /// The attempt another call made while this one waited for it.
    #[error("{0}")]
    Shared(String),
}

fn connect_error(failure: ConnectFailure) -> BoxError {
    Box::new(tonic::ConnectError(Box::new(failure)))
}

/// The connection's task: its socket's I/O until it closes, its keepalive pings, and
/// its end once the channel is dropped. Whatever ends it, the channel stops handing it
/// out; dropping the connection fails the streams still open on it.
async fn drive(
    connection: h2::client::Connection<Box<dyn Io>, Bytes>,
    pings: Option<h2::PingPong>,
    channel: Weak<Shared>,
    generation: u64,
    closed: CancellationToken,
) {
    tokio::select! {
        ended = connection => {
            if let Err(e) = ended {
                tracing::debug!(error = %e, "the connection to a worker closed");
            }
        }
        () = keepalive(pings) => {
            tracing::warn!(
                "a worker did not answer an HTTP/2 ping within {KEEPALIVE_TIMEOUT:?}: closing its connection"
            );
        }
        () = closed.cancelled() => {}
    }
    if let Some(channel) = channel.upgrade() {
        channel.forget(generation);
    }
}

/// Pings every `KEEPALIVE_INTERVAL`; returns when an answer is late. A connection
/// whose pings fail otherwise is closing anyway: its task ends with it.
async fn keepalive(pings: Option<h2::PingPong>) {
    let Some(mut pings) = pings else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(KEEPALIVE_INTERVAL).await;
        match tokio::time::timeout(KEEPALIVE_TIMEOUT, pings.ping(h2::Ping::opaque())).await {
            Ok(Ok(_pong)) => {}
            Ok(Err(_)) => return std::future::pending().await,
            Err(_) => return,
        }
    }
}

/// Writes a request's body into its stream. A unary request's body is one message,
/// ready at once; h2 holds what the stream's window does not take yet.
async fn send_body(
    mut body: tonic::body::Body,
    outgoing: &mut h2::SendStream<Bytes>,
) -> Result<(), BoxError> {
    loop {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        let frame = match frame {
            None => {
                return outgoing
                    .send_data(Bytes::new(), true)
                    .map_err(transport_error);
            }
            Some(Err(e)) => {
                outgoing.send_reset(h2::Reason::CANCEL);
                return Err(e.into());
            }
            Some(Ok(frame)) => frame,
        };
        match frame.into_data() {
            Ok(data) => {
                let end = body.is_end_stream();
                outgoing.send_data(data, end).map_err(transport_error)?;
                if end {
                    return Ok(());
                }
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    return outgoing.send_trailers(trailers).map_err(transport_error);
                }
            }
        }
    }
}

/// An h2 failure as the dispatch reads it: a stream the worker's GOAWAY `NO_ERROR`
/// left unprocessed is UNAVAILABLE (it never started; tonic would say INTERNAL), with
/// the `h2::Error` as its source; anything else is the `h2::Error` itself.
fn transport_error(error: h2::Error) -> BoxError {
    if error.is_go_away() && error.is_remote() && error.reason() == Some(h2::Reason::NO_ERROR) {
        let mut status = tonic::Status::unavailable(format!(
            "the worker closed the connection without taking the call: {error}"
        ));
        status.set_source(Arc::new(error));
        return Box::new(status);
    }
    Box::new(error)
}

/// The `grpc-timeout` a request carries (`tonic::Request::set_timeout`).
fn grpc_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    airlock_proto::parse_grpc_timeout(headers.get("grpc-timeout")?.to_str().ok()?)
}

/// A response's body as tonic reads it: the stream's data, then its trailers (where
/// gRPC puts the status). Each chunk's window is given back as the chunk is taken.
pub struct RecvBody {
    stream: h2::RecvStream,
    state: BodyState,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum BodyState {
    Data,
    Trailers,
    Done,
}

impl RecvBody {
    fn new(stream: h2::RecvStream) -> Self {
        Self {
            stream,
            state: BodyState::Data,
        }
    }
}

impl http_body::Body for RecvBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.state == BodyState::Data {
            match this.stream.poll_data(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(data))) => {
                    // Fails only once the stream is gone, which the next poll reports.
                    let _ = this.stream.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(Some(Err(e))) => {
                    this.state = BodyState::Done;
                    return Poll::Ready(Some(Err(transport_error(e))));
                }
                Poll::Ready(None) => this.state = BodyState::Trailers,
            }
        }
        if this.state == BodyState::Trailers {
            let polled = this.stream.poll_trailers(cx);
            if polled.is_ready() {
                this.state = BodyState::Done;
            }
            return match polled {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Ok(Some(trailers))) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
                Poll::Ready(Ok(None)) => Poll::Ready(None),
                Poll::Ready(Err(e)) => Poll::Ready(Some(Err(transport_error(e)))),
            };
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.state == BodyState::Done || self.stream.is_end_stream()
    }
}

/// A boxed future, for `Dial`s written as closures.
pub fn dial<F, Fut, S>(connect: F) -> Dial
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = std::io::Result<S>> + Send + 'static,
    S: Io,
{
    Arc::new(move || {
        let connecting = connect();
        Box::pin(async move { Ok(Box::new(connecting.await?) as Box<dyn Io>) })
    })
}

#[cfg(test)]
impl WorkerChannel {
    /// How many connections this channel has made.
    pub(crate) fn connections_made(&self) -> u64 {
        self.shared.generation.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replicas::never_started;
    use airlock_proto::v1 as pb;
    use airlock_proto::v1::tool_worker_client::ToolWorkerClient;
    use airlock_worker::{
        BoundListener, CallContext, ListenAddr, Tool, ToolDefinition, ToolOutcome, ToolSet,
        WorkerServer, WorkerSettings,
    };
    use serde_json::Value;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Every wait in these tests is bounded; none is a measurement.
    const BOUND: Duration = Duration::from_secs(30);

    /// `read_file` as the fs worker defines it, answering `bytes` bytes of text.
    struct Answer {
        definition: ToolDefinition,
        bytes: usize,
    }

    #[airlock_worker::async_trait]
    impl Tool for Answer {
        fn definition(&self) -> ToolDefinition {
            self.definition.clone()
        }

        async fn execute(&self, _arguments: Value, _ctx: CallContext) -> ToolOutcome {
            ToolOutcome::text("a".repeat(self.bytes))
        }
    }

    /// A worker serving `read_file` on `socket` until the token is cancelled.
    fn serve(
        socket: &std::path::Path,
        bytes: usize,
    ) -> (CancellationToken, tokio::task::JoinHandle<()>) {
        let definition = airlock_worker_fs::tools(airlock_worker_fs::FsConfig::default())
            .get("read_file")
            .unwrap()
            .definition();
        let tools = ToolSet::new("fs").with(Answer { definition, bytes });
        let listener = BoundListener::bind(&ListenAddr::Unix(socket.to_owned())).unwrap();
        let stop = CancellationToken::new();
        let settings = WorkerSettings {
            drain_grace: Duration::from_millis(100),
            ..WorkerSettings::default()
        };
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            WorkerServer::new(tools, settings)
                .serve(listener, async move { stopped.cancelled().await })
                .await
                .unwrap();
        });
        (stop, task)
    }

    fn client(channel: &WorkerChannel) -> ToolWorkerClient<WorkerChannel> {
        ToolWorkerClient::with_origin(channel.clone(), http::Uri::from_static(ORIGIN))
            .max_decoding_message_size(32 * 1024 * 1024)
    }

    /// Runs one `read_file` call and returns its text.
    async fn read(channel: &WorkerChannel) -> Result<String, tonic::Status> {
        let request = pb::ExecuteRequest {
            call_id: uuid::Uuid::new_v4().to_string(),
            tool: "read_file".into(),
            arguments_json: r#"{"path":"a.txt"}"#.into(),
            principal: "test".into(),
            session_id: "test".into(),
            timeout_ms: 10_000,
            trace_context: Default::default(),
            detached: false,
        };
        let mut stream = client(channel).execute(request).await?.into_inner();
        while let Some(event) = stream.message().await? {
            if let Some(pb::execute_event::Event::Result(result)) = event.event {
                let outcome = airlock_policy::ToolOutcome::try_from(result).unwrap();
                return Ok(outcome.content.join(""));
            }
        }
        Err(tonic::Status::internal("the stream ended without a result"))
    }

    /// An answer larger than the stream's window (and than the connection's) needs the
    /// window given back as it is read; the calls after it share the one connection.
    #[tokio::test]
    async fn an_answer_larger_than_the_windows_arrives_whole_on_one_connection() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("fs.sock");
        let bytes = 3 * CONNECTION_WINDOW as usize / 2;
        let (_stop, _worker) = serve(&socket, bytes);
        let channel = crate::endpoints::unix_channel(socket);
        for _ in 0..3 {
            let text = tokio::time::timeout(BOUND, read(&channel))
                .await
                .expect("the answer stalled: its window was not given back")
                .unwrap();
            assert_eq!(text.len(), bytes);
            assert!(text.bytes().all(|b| b == b'a'));
        }
        assert_eq!(channel.connections_made(), 1);
    }

    /// A worker restarted on the same socket takes the next call: the closed connection
    /// is replaced, not reported.
    #[tokio::test]
    async fn a_restarted_worker_takes_the_next_call_on_a_new_connection() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("fs.sock");
        let (stop, worker) = serve(&socket, 10);
        let channel = crate::endpoints::unix_channel(socket.clone());
        assert_eq!(read(&channel).await.unwrap(), "a".repeat(10));
        stop.cancel();
        tokio::time::timeout(BOUND, worker).await.unwrap().unwrap();
        let (_stop, _worker) = serve(&socket, 20);
        let text = tokio::time::timeout(BOUND, read(&channel)).await.unwrap();
        assert_eq!(text.unwrap(), "a".repeat(20));
        assert_eq!(channel.connections_made(), 2);
    }

    /// The client's connection preface (RFC 9113 §3.4).
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    /// A frame header: 24-bit length, type, flags, stream id.
    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
        let mut out = vec![len[1], len[2], len[3], kind, flags];
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// One frame read whole: its type, flags, stream id and payload.
    async fn read_frame(io: &mut tokio::net::UnixStream) -> (u8, u8, u32, Vec<u8>) {
        let mut header = [0u8; 9];
        io.read_exact(&mut header).await.unwrap();
        let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        let mut payload = vec![0u8; len];
        io.read_exact(&mut payload).await.unwrap();
        let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]);
        (header[3], header[4], stream, payload)
    }

    /// Reads frames until one of `kind` arrives; returns its stream id.
    async fn read_until(io: &mut tokio::net::UnixStream, kind: u8) -> u32 {
        loop {
            let (read, _, stream, _) = read_frame(io).await;
            if read == kind {
                return stream;
            }
        }
    }

    /// A raw HTTP/2 peer on `socket`: takes the preface, sends its SETTINGS, and hands
    /// the connection to `then`.
    fn raw_peer<F, Fut>(socket: &std::path::Path, then: F) -> tokio::task::JoinHandle<()>
    where
        F: FnOnce(tokio::net::UnixStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        tokio::spawn(async move {
            let (mut io, _) = listener.accept().await.unwrap();
            let mut preface = [0u8; 24];
            io.read_exact(&mut preface).await.unwrap();
            assert_eq!(&preface, PREFACE);
            io.write_all(&frame(4, 0, 0, &[])).await.unwrap();
            then(io).await;
        })
    }

    /// A stream the worker's GOAWAY (`NO_ERROR`, last stream 0) left unprocessed never
    /// started: the dispatch may send the call to another replica.
    #[tokio::test]
    async fn a_stream_refused_by_goaway_counts_as_never_started() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("goaway.sock");
        let peer = raw_peer(&socket, |mut io| async move {
            let stream = read_until(&mut io, 1).await;
            assert_eq!(stream, 1);
            let mut payload = 0u32.to_be_bytes().to_vec();
            payload.extend_from_slice(&0u32.to_be_bytes());
            io.write_all(&frame(7, 0, 0, &payload)).await.unwrap();
            // Held open until the client has read it.
            let mut rest = Vec::new();
            let _ = io.read_to_end(&mut rest).await;
        });
        let channel = crate::endpoints::unix_channel(socket);
        let status = tokio::time::timeout(BOUND, read(&channel))
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(never_started(&status), "{status:?}");
        drop(channel);
        tokio::time::timeout(BOUND, peer).await.unwrap().unwrap();
    }

    /// A worker that stops answering (frozen, a hung node) loses its connection to the
    /// keepalive: the call fails as one that may have run, instead of waiting for ever.
    #[tokio::test]
    async fn a_worker_that_answers_no_ping_loses_its_connection() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("frozen.sock");
        let (hold, held) = tokio::sync::oneshot::channel::<()>();
        let _peer = raw_peer(&socket, |mut io| async move {
            read_until(&mut io, 1).await;
            // Reads nothing more and answers nothing, until the test ends.
            let _ = held.await;
            drop(io);
        });
        let channel = crate::endpoints::unix_channel(socket);
        let status = tokio::time::timeout(BOUND, read(&channel))
            .await
            .expect("the call waited past the keepalive")
            .unwrap_err();
        assert!(!never_started(&status), "{status:?}");
        assert!(std::error::Error::source(&status).is_some(), "{status:?}");
        drop(hold);
    }

    /// Calls that find no connection while one is being made wait for that attempt and
    /// share its failure: a replica that does not answer is dialed once, not once per
    /// waiting call, and every call learns it never started.
    #[tokio::test]
    async fn calls_waiting_for_a_failed_attempt_share_it() {
        let dials = Arc::new(AtomicU64::new(0));
        let (release, released) = tokio::sync::watch::channel(false);
        let counted = dials.clone();
        let channel = WorkerChannel::new(dial(move || {
            counted.fetch_add(1, Ordering::Relaxed);
            let mut released = released.clone();
            async move {
                let _ = released.wait_for(|go| *go).await;
                Err::<tokio::net::UnixStream, _>(std::io::Error::from(
                    std::io::ErrorKind::ConnectionRefused,
                ))
            }
        }));
        let calls: Vec<_> = (0..5)
            .map(|_| {
                let channel = channel.clone();
                tokio::spawn(async move { read(&channel).await })
            })
            .collect();
        // Every call is waiting (one dialing, four behind it) before the dial fails.
        while dials.load(Ordering::Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        release.send(true).unwrap();
        for call in calls {
            let status = tokio::time::timeout(BOUND, call)
                .await
                .unwrap()
                .unwrap()
                .unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
            assert!(never_started(&status), "{status:?}");
            assert!(status.message().contains("refused"), "{status:?}");
        }
        assert_eq!(dials.load(Ordering::Relaxed), 1);
        // A later call dials again.
        let status = read(&channel).await.unwrap_err();
        assert!(never_started(&status), "{status:?}");
        assert_eq!(dials.load(Ordering::Relaxed), 2);
    }

    /// A `grpc-timeout` bounds the wait for the answer's headers, as tonic's channel did,
    /// and a dropped channel closes its connection: the worker sees it end.
    #[tokio::test]
    async fn the_timeout_bounds_the_wait_and_a_dropped_channel_closes_its_connection() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("silent.sock");
        let peer = raw_peer(&socket, |mut io| async move {
            read_until(&mut io, 1).await;
            // Nothing is answered; the client's pings are read and left unanswered
            // until the client closes the connection.
            let mut rest = Vec::new();
            let _ = io.read_to_end(&mut rest).await;
        });
        let channel = crate::endpoints::unix_channel(socket);
        let mut request = tonic::Request::new(pb::ListToolsRequest {});
        request.set_timeout(Duration::from_millis(300));
        let status = tokio::time::timeout(BOUND, client(&channel).list_tools(request))
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Cancelled, "{status:?}");
        drop(channel);
        tokio::time::timeout(BOUND, peer)
            .await
            .expect("the connection outlived its channel")
            .unwrap();
    }

    /// A request body that yields one message, then ends only once `end` is sent.
    struct GatedBody {
        message: Option<Bytes>,
        end: tokio::sync::oneshot::Receiver<()>,
    }

    impl http_body::Body for GatedBody {
        type Data = Bytes;
        type Error = tonic::Status;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
            if let Some(message) = self.message.take() {
                return Poll::Ready(Some(Ok(Frame::data(message))));
            }
            Pin::new(&mut self.end).poll(cx).map(|_| None)
        }
    }

    /// A worker that answers a call and resets its stream (`NO_ERROR`, as gRPC servers
    /// do when the client has not half-closed yet) before the request's end is written:
    /// the answer is the call's. Before, writing the request's end failed ("inactive
    /// stream") and the call failed as one that may have run — one of the Python
    /// worker's first calls, now and then, under load.
    #[tokio::test]
    async fn an_answer_before_the_end_of_the_request_is_the_calls() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("early.sock");
        let (answered, answered_rx) = tokio::sync::oneshot::channel::<()>();
        let peer = raw_peer(&socket, |mut io| async move {
            read_until(&mut io, 0).await;
            // `:status: 200` (static index 8), a message, then trailers
            // (`grpc-status: 0`, a literal) that end the stream, then the reset.
            io.write_all(&frame(1, 0x4, 1, &[0x88])).await.unwrap();
            io.write_all(&frame(0, 0, 1, b"hello")).await.unwrap();
            let mut trailers = vec![0x00, 11];
            trailers.extend_from_slice(b"grpc-status");
            trailers.extend_from_slice(&[1, b'0']);
            io.write_all(&frame(1, 0x5, 1, &trailers)).await.unwrap();
            io.write_all(&frame(3, 0, 1, &0u32.to_be_bytes()))
                .await
                .unwrap();
            // Frames are handled in order: once the client acknowledges this ping, it
            // has taken the answer and the reset.
            io.write_all(&frame(6, 0, 0, &[7; 8])).await.unwrap();
            loop {
                let (kind, flags, _, payload) = read_frame(&mut io).await;
                if kind == 6 && flags & 0x1 != 0 && payload == [7; 8] {
                    break;
                }
            }
            answered.send(()).unwrap();
            let mut rest = Vec::new();
            let _ = io.read_to_end(&mut rest).await;
        });
        let mut channel = crate::endpoints::unix_channel(socket);
        let (end, gate) = tokio::sync::oneshot::channel();
        let body = tonic::body::Body::new(GatedBody {
            message: Some(Bytes::from_static(b"request")),
            end: gate,
        });
        let request = http::Request::builder()
            .method("POST")
            .uri(format!("{ORIGIN}/airlock.v1.ToolWorker/ListTools"))
            .body(body)
            .unwrap();
        let call = tokio::spawn(tower::Service::call(&mut channel, request));
        tokio::time::timeout(BOUND, answered_rx)
            .await
            .unwrap()
            .unwrap();
        end.send(()).unwrap();
        let response = tokio::time::timeout(BOUND, call)
            .await
            .unwrap()
            .unwrap()
            .expect("the answer");
        assert_eq!(response.status(), http::StatusCode::OK);
        let mut body = response.into_body();
        let mut data = Vec::new();
        let mut trailers = None;
        while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
        {
            let frame = frame.unwrap();
            match frame.into_data() {
                Ok(chunk) => data.extend_from_slice(&chunk),
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        }
        assert_eq!(data, b"hello");
        assert_eq!(trailers.unwrap()["grpc-status"], "0");
        drop(channel);
        tokio::time::timeout(BOUND, peer).await.unwrap().unwrap();
    }

    #[test]
    fn a_requests_grpc_timeout_is_read_from_its_headers() {
        assert_eq!(grpc_timeout(&http::HeaderMap::new()), None);
        let mut request = tonic::Request::new(());
        request.set_timeout(Duration::from_millis(31_250));
        let headers = request.metadata().clone().into_headers();
        assert_eq!(grpc_timeout(&headers), Some(Duration::from_millis(31_250)));
        let mut headers = http::HeaderMap::new();
        headers.insert("grpc-timeout", http::HeaderValue::from_static("10s"));
        assert_eq!(grpc_timeout(&headers), None);
    }
}
