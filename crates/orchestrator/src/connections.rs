//! Connection limits of the front doors (DESIGN §16): at most `[limits] max_connections`
//! open per front door, and connections that do not send what the server waits for
//! within `[limits] header_read_timeout_ms` are closed.
//!
//! Nobody is authenticated before a request head has arrived, so without these an
//! anonymous peer could hold every file descriptor of the orchestrator with idle or
//! half-sent connections, and real requests would time out.
//!
//! - **HTTP** (`/v1`, `/mcp`, health): HTTP/1.1 served by hyper directly, with its
//!   header-read timer. The timer runs whenever the connection waits for a request head
//!   (from accept, and again after each response) until the head is complete, so one
//!   timeout closes slow headers and idle keep-alive connections alike. Request bodies
//!   are read by the handlers under their own deadline.
//! - **gRPC**: the client's HTTP/2 preface (its first 24 bytes) must arrive within the
//!   timeout; afterwards HTTP/2 keep-alive pings (see `server.rs`) close peers that stop
//!   answering. With `[orchestrator] grpc_tls` the TLS handshake comes first, on its
//!   own task within the handshake timeout and under the same cap; the preface timer
//!   starts when it is done.
//! - **The cap**: a semaphore permit is taken before each `accept` and released when the
//!   connection closes. At the cap the server stops accepting: new connections wait in
//!   the kernel's listen backlog (they cost the orchestrator no descriptor) and are
//!   served as soon as timed-out or finished connections make room.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use airlock_policy::Limits;
use airlock_tls::accept::{Side, handshake_each};
use airlock_tls::mtls::Reloading;
use futures::{Stream, StreamExt as _};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long to wait before accepting again after an error that is not the peer's (out
/// of descriptors or memory): retrying at once would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The connection limits of one front door.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Connections open at once.
    pub max: usize,
    /// See [`Limits::header_read_timeout_ms`]; `None` when configured as 0.
    pub header_read_timeout: Option<Duration>,
}

impl ConnectionLimits {
    pub fn from_limits(limits: &Limits) -> Self {
        Self {
            // A cap of 0 would serve nobody; it reads as "one at a time".
            max: limits.max_connections.max(1),
            header_read_timeout: (limits.header_read_timeout_ms > 0)
                .then(|| Duration::from_millis(limits.header_read_timeout_ms)),
        }
    }
}

/// Takes a permit, then accepts one connection. `None` once `stop` fires.
async fn accept(
    listener: &TcpListener,
    permits: &Arc<Semaphore>,
    stop: &CancellationToken,
    door: &'static str,
) -> Option<(TcpStream, SocketAddr, OwnedSemaphorePermit)> {
    let permit = tokio::select! {
        permit = permits.clone().acquire_owned() => permit.ok()?,
        () = stop.cancelled() => return None,
    };
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stop.cancelled() => return None,
        };
        match accepted {
            Ok((stream, peer)) => {
                // Answers must not wait for Nagle and delayed ACKs (40 ms).
                let _ = stream.set_nodelay(true);
                return Some((stream, peer, permit));
            }
            // The peer gave up before we accepted it: nothing is wrong here.
            Err(e) if is_peer_error(&e) => continue,
            Err(e) => {
                tracing::warn!(door, error = %e, "cannot accept a connection; retrying");
                tokio::select! {
                    () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                    () = stop.cancelled() => return None,
                }
            }
        }
    }
}

fn is_peer_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Serves `router` over HTTP/1.1 on `listener` until `stop` fires; then stops accepting,
/// lets open connections finish the response they are sending (idle ones close at
/// once), and returns when all are closed.
pub async fn serve_http(
    listener: TcpListener,
    router: axum::Router,
    limits: ConnectionLimits,
    stop: CancellationToken,
) {
    let permits = Arc::new(Semaphore::new(limits.max));
    let connections = TaskTracker::new();
    while let Some((stream, _peer, permit)) = accept(&listener, &permits, &stop, "http").await {
        let service = TowerToHyperService::new(router.clone());
        let stop = stop.clone();
        connections.spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .keep_alive(true);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            let mut connection = std::pin::pin!(connection);
            tokio::select! {
                served = connection.as_mut() => {
                    if let Err(e) = served {
                        tracing::debug!(error = %e, "http connection ended");
                    }
                }
                () = stop.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
            drop(permit);
        });
    }
    connections.close();
    connections.wait().await;
}

/// The gRPC front door's connections as tonic takes them: at most `limits.max` open,
/// each closed if its HTTP/2 preface does not arrive in time. Accept errors are handled
/// here (logged, retried), so the stream never yields one.
pub fn grpc_incoming(
    listener: TcpListener,
    limits: ConnectionLimits,
    stop: CancellationToken,
) -> impl Stream<Item = Result<GuardedStream<TcpStream>, io::Error>> + Send + 'static {
    accepted(listener, limits, stop).map(move |(stream, peer, permit)| {
        let local = stream.local_addr().ok();
        Ok(GuardedStream::new(stream, peer, permit, limits, local))
    })
}

/// [`grpc_incoming`] under TLS (`[orchestrator] grpc_tls`): the same limits, and each
/// connection handshaken on its own task within the handshake timeout, holding its
/// permit meanwhile; the preface deadline starts once the handshake is done. No client
/// certificate is asked for: callers authenticate with their bearer token. A failed
/// handshake is logged and closes only its own connection.
pub fn grpc_incoming_tls(
    listener: TcpListener,
    limits: ConnectionLimits,
    stop: CancellationToken,
    identity: Arc<Reloading>,
) -> impl Stream<Item = Result<GuardedStream<TlsStream<TcpStream>>, io::Error>> + Send + 'static {
    handshake_each(
        accepted(listener, limits, stop),
        identity,
        Side::ServerOnly,
        move |stream, peer, permit, _| {
            let local = stream.get_ref().0.local_addr().ok();
            Some(GuardedStream::new(stream, peer, permit, limits, local))
        },
    )
}

/// The front door's accepted TCP connections, each with its permit, until `stop` fires.
fn accepted(
    listener: TcpListener,
    limits: ConnectionLimits,
    stop: CancellationToken,
) -> impl Stream<Item = (TcpStream, SocketAddr, OwnedSemaphorePermit)> + Send + 'static {
    let permits = Arc::new(Semaphore::new(limits.max));
    futures::stream::unfold(
        (listener, permits, stop),
        move |(listener, permits, stop)| async move {
            let accepted = accept(&listener, &permits, &stop, "grpc").await?;
            Some((accepted, (listener, permits, stop)))
        },
    )
}

/// Length of the HTTP/2 client connection preface (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
const HTTP2_PREFACE_LEN: usize = 24;

/// An accepted gRPC connection: holds its permit until it is dropped, and fails its
/// reads once the deadline for the client's HTTP/2 preface has passed without all of it
/// (a lone byte does not buy a connection). After the preface, HTTP/2 keep-alive pings
/// watch the peer.
pub struct GuardedStream<IO> {
    inner: IO,
    /// What tonic reports as the connection's addresses.
    addrs: tonic::transport::server::TcpConnectInfo,
    _permit: OwnedSemaphorePermit,
    /// Preface bytes still to come.
    preface_left: usize,
    /// Cleared once the preface is in.
    preface_by: Option<Pin<Box<Sleep>>>,
}

impl<IO> GuardedStream<IO> {
    fn new(
        inner: IO,
        peer: SocketAddr,
        permit: OwnedSemaphorePermit,
        limits: ConnectionLimits,
        local: Option<SocketAddr>,
    ) -> Self {
        Self {
            inner,
            addrs: tonic::transport::server::TcpConnectInfo {
                local_addr: local,
                remote_addr: Some(peer),
            },
            _permit: permit,
            preface_left: HTTP2_PREFACE_LEN,
            preface_by: limits
                .header_read_timeout
                .map(|t| Box::pin(tokio::time::sleep(t))),
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for GuardedStream<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let read = buf.filled().len() - before;
                this.preface_left = this.preface_left.saturating_sub(read);
                if this.preface_left == 0 {
                    this.preface_by = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                // Polling the timer registers this task to be woken when it fires.
                let expired = this
                    .preface_by
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if expired {
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client did not send its HTTP/2 preface within [limits] header_read_timeout_ms",
                    )))
                } else {
                    Poll::Pending
                }
            }
            failed => failed,
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for GuardedStream<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<IO> tonic::transport::server::Connected for GuardedStream<IO> {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.addrs.clone()
    }
}
