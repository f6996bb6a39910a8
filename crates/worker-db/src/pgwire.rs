//! PostgreSQL connections whose server messages are bounded in size.
//!
//! tokio-postgres reads every backend message whole before it hands out a row, so one
//! `SELECT repeat('x', 200000000)` would have the worker buffer 200 MB before any
//! row-by-row accounting could look at it. After the start-up request, every backend
//! message is a type byte and a 4-byte big-endian length; [`Bounded`] reads those headers
//! as the bytes pass and fails the read, which closes the connection, as soon as a header
//! announces more than the call's limit — before the body is buffered anywhere. The call
//! then answers an error naming the limit ([`Guard::tripped`]); the server sees the
//! closed socket and ends the backend.
//!
//! Owning the socket means connecting here, under `Config::connect_raw`: hosts and
//! `hostaddr`s in order, ports, `connect_timeout`, `tcp_user_timeout`, TCP keepalives
//! and `target_session_attrs`, as tokio-postgres does them.
//!
//! TLS (`sslmode=verify-full`, airlock_tls::postgres): the bound must see PostgreSQL's
//! messages, not TLS records, so [`Bounded`] goes *around* the TLS stream. The plain
//! socket is handed to `connect_raw`, which writes the `SSLRequest` and reads the single
//! unframed byte of the answer on it (refusing the connection unless the server says
//! `S`: no fallback to plaintext), then [`BoundedTls`] runs the handshake and wraps the
//! TLS stream in [`Bounded`], so every message after it, start-up included, is bounded
//! as over plaintext. Plaintext connections hand `connect_raw` the [`Bounded`] socket
//! itself (`NoTls`), so no server answers with that unframed byte.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use airlock_tls::postgres::{PgTls, PgTlsError, RustlsStream, RustlsTlsConnect};
use socket2::{SockRef, TcpKeepalive};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio_postgres::config::{Host, TargetSessionAttrs};
use tokio_postgres::tls::{ChannelBinding, TlsConnect, TlsStream};
use tokio_postgres::{Client, Config, NoTls, SimpleQueryMessage};

/// Why a connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    #[error("{0}")]
    SessionAttrs(&'static str),
    #[error("the url names no host")]
    NoHost,
    #[error(transparent)]
    Tls(#[from] PgTlsError),
}

/// The size limit of one connection's server messages, and whether it was hit.
#[derive(Debug)]
pub(crate) struct Guard {
    limit: AtomicUsize,
    /// The announced body size of the message that closed the connection; 0 while none.
    tripped: AtomicUsize,
}

impl Guard {
    fn new(limit: usize) -> Self {
        Self {
            limit: AtomicUsize::new(limit),
            tripped: AtomicUsize::new(0),
        }
    }

    /// Sets the limit for the next call on this connection.
    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// The size of the server message that was refused, if one was.
    pub fn tripped(&self) -> Option<usize> {
        match self.tripped.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        }
    }
}

/// Where a connection went, so that a cancel request reaches the same server.
#[derive(Debug, Clone)]
pub(crate) enum Addr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

/// A plain socket of either kind.
pub(crate) enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Socket::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Socket::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_flush(cx),
            Socket::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Socket::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// The connection's stream (the socket, or TLS over it), reading the header of every
/// server message as it passes.
pub(crate) struct Bounded<S> {
    inner: S,
    guard: Arc<Guard>,
    header: [u8; 5],
    /// Bytes of `header` read so far.
    have: usize,
    /// Body bytes of the current message still to pass.
    body_left: usize,
}

impl<S> Bounded<S> {
    fn new(inner: S, guard: Arc<Guard>) -> Self {
        Self {
            inner,
            guard,
            header: [0; 5],
            have: 0,
            body_left: 0,
        }
    }

    /// Follows the message framing over `bytes`, just read from the server.
    fn scan(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            if self.body_left > 0 {
                let n = self.body_left.min(bytes.len());
                self.body_left -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (self.header.len() - self.have).min(bytes.len());
            self.header[self.have..self.have + n].copy_from_slice(&bytes[..n]);
            self.have += n;
            bytes = &bytes[n..];
            if self.have < self.header.len() {
                break;
            }
            self.have = 0;
            let [_, a, b, c, d] = self.header;
            // The length counts itself; what follows it is the body.
            let body = usize::try_from(u32::from_be_bytes([a, b, c, d]))
                .unwrap_or(usize::MAX)
                .saturating_sub(4);
            let limit = self.guard.limit.load(Ordering::Relaxed);
            if body > limit {
                self.guard.tripped.store(body.max(1), Ordering::Relaxed);
                return Err(io::Error::other(format!(
                    "the server sent a message of {body} bytes, more than the {limit} allowed"
                )));
            }
            self.body_left = body;
        }
        Ok(())
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Bounded<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(size) = this.guard.tripped() {
            return Poll::Ready(Err(io::Error::other(format!(
                "the connection was closed after a server message of {size} bytes"
            ))));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => Poll::Ready(this.scan(&buf.filled()[before..])),
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Bounded<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: TlsStream + Unpin> TlsStream for Bounded<S> {
    fn channel_binding(&self) -> ChannelBinding {
        self.inner.channel_binding()
    }
}

/// The TLS handshake over the plain socket, then the bound around the TLS stream.
pub(crate) struct BoundedTls {
    tls: RustlsTlsConnect,
    guard: Arc<Guard>,
}

type BoundedHandshake =
    Pin<Box<dyn Future<Output = Result<Bounded<RustlsStream<Socket>>, PgTlsError>> + Send>>;

impl TlsConnect<Socket> for BoundedTls {
    type Stream = Bounded<RustlsStream<Socket>>;
    type Error = PgTlsError;
    type Future = BoundedHandshake;

    fn connect(self, stream: Socket) -> BoundedHandshake {
        let Self { tls, guard } = self;
        Box::pin(async move { Ok(Bounded::new(tls.connect(stream).await?, guard)) })
    }
}

/// The TLS name of host `i` of `config` (its `host`, not a `hostaddr`), as tokio-postgres
/// takes it.
pub(crate) fn tls_for(
    tls: &PgTls,
    config: &Config,
    i: usize,
) -> Result<Option<RustlsTlsConnect>, PgTlsError> {
    match tls {
        PgTls::Plaintext => Ok(None),
        PgTls::VerifyFull(rustls) => {
            let host = match config.get_hosts().get(i) {
                Some(Host::Tcp(host)) => host.as_str(),
                _ => "",
            };
            rustls.for_host(host).map(Some)
        }
    }
}

/// One open connection: its client (the connection itself runs on a spawned task), its
/// guard and where it goes.
pub(crate) struct Connected {
    pub client: Client,
    pub guard: Arc<Guard>,
    pub addr: Addr,
    /// TLS for a cancel request to `addr` (None over plaintext).
    pub tls: Option<RustlsTlsConnect>,
}

/// Connects as `config` says, with server messages limited to `limit` bytes (changed per
/// call with [`Guard::set_limit`]). `name` labels the connection task's log lines.
pub(crate) async fn connect(
    config: &Config,
    tls: &PgTls,
    limit: usize,
    name: &str,
) -> Result<Connected, WireError> {
    let (hosts, hostaddrs, ports) = (
        config.get_hosts(),
        config.get_hostaddrs(),
        config.get_ports(),
    );
    let mut last = WireError::NoHost;
    for i in 0..hosts.len().max(hostaddrs.len()) {
        let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
        let candidates = match (hostaddrs.get(i), hosts.get(i)) {
            (Some(ip), _) => vec![Addr::Tcp(SocketAddr::new(*ip, port))],
            (None, Some(Host::Tcp(host))) => {
                match tokio::net::lookup_host((host.as_str(), port)).await {
                    Ok(found) => found.map(Addr::Tcp).collect(),
                    Err(e) => {
                        last = e.into();
                        continue;
                    }
                }
            }
            (None, Some(Host::Unix(dir))) => {
                vec![Addr::Unix(dir.join(format!(".s.PGSQL.{port}")))]
            }
            (None, None) => continue,
        };
        let tls = tls_for(tls, config, i)?;
        for addr in candidates {
            match connect_once(config, addr, tls.clone(), limit, name).await {
                Ok(connected) => return Ok(connected),
                Err(e) => last = e,
            }
        }
    }
    Err(last)
}

async fn connect_once(
    config: &Config,
    addr: Addr,
    tls: Option<RustlsTlsConnect>,
    limit: usize,
    name: &str,
) -> Result<Connected, WireError> {
    let socket = open(config, &addr).await?;
    let guard = Arc::new(Guard::new(limit));
    let label = name.to_owned();
    let ended = move |result: Result<(), tokio_postgres::Error>| {
        if let Err(e) = result {
            tracing::debug!(database = %label, error = %e, "postgres connection ended");
        }
    };
    let client = match tls.clone() {
        None => {
            let (client, connection) = config
                .connect_raw(Bounded::new(socket, Arc::clone(&guard)), NoTls)
                .await?;
            tokio::spawn(async move { ended(connection.await) });
            client
        }
        Some(tls) => {
            let tls = BoundedTls {
                tls,
                guard: Arc::clone(&guard),
            };
            let (client, connection) = config.connect_raw(socket, tls).await?;
            tokio::spawn(async move { ended(connection.await) });
            client
        }
    };
    let wanted = config.get_target_session_attrs();
    if wanted != TargetSessionAttrs::Any {
        let read_only = client
            .simple_query("SHOW transaction_read_only")
            .await?
            .iter()
            .find_map(|m| match m {
                SimpleQueryMessage::Row(row) => row.get(0).map(|v| v == "on"),
                _ => None,
            })
            .unwrap_or(false);
        if wanted == TargetSessionAttrs::ReadWrite && read_only {
            return Err(WireError::SessionAttrs(
                "the server only allows reads, and target_session_attrs asks for read-write",
            ));
        }
        if wanted == TargetSessionAttrs::ReadOnly && !read_only {
            return Err(WireError::SessionAttrs(
                "the server allows writes, and target_session_attrs asks for read-only",
            ));
        }
    }
    Ok(Connected {
        client,
        guard,
        addr,
        tls,
    })
}

/// Opens a socket to `addr` with the url's socket options; also used for cancel requests.
pub(crate) async fn open(config: &Config, addr: &Addr) -> io::Result<Socket> {
    let connect = async {
        match addr {
            Addr::Tcp(a) => {
                let stream = TcpStream::connect(a).await?;
                stream.set_nodelay(true)?;
                let sock = SockRef::from(&stream);
                if let Some(timeout) = config.get_tcp_user_timeout() {
                    sock.set_tcp_user_timeout(Some(*timeout))?;
                }
                if config.get_keepalives() {
                    let mut keepalive = TcpKeepalive::new().with_time(config.get_keepalives_idle());
                    if let Some(interval) = config.get_keepalives_interval() {
                        keepalive = keepalive.with_interval(interval);
                    }
                    if let Some(retries) = config.get_keepalives_retries() {
                        keepalive = keepalive.with_retries(retries);
                    }
                    sock.set_tcp_keepalive(&keepalive)?;
                }
                Ok(Socket::Tcp(stream))
            }
            Addr::Unix(path) => Ok(Socket::Unix(UnixStream::connect(path).await?)),
        }
    };
    match config.get_connect_timeout() {
        Some(timeout) => tokio::time::timeout(*timeout, connect)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connection timed out"))?,
        None => connect.await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: u8, body: u32) -> Vec<u8> {
        let mut h = vec![kind];
        h.extend_from_slice(&(body + 4).to_be_bytes());
        h
    }

    /// A `Bounded` over a socket that is never read: only `scan` is exercised.
    async fn bounded(limit: usize) -> (Bounded<Socket>, Arc<Guard>) {
        let (a, _b) = UnixStream::pair().unwrap();
        let guard = Arc::new(Guard::new(limit));
        (Bounded::new(Socket::Unix(a), Arc::clone(&guard)), guard)
    }

    #[tokio::test]
    async fn framing_is_followed_across_reads() {
        let (mut b, guard) = bounded(10).await;
        // A message of 10 bytes split in every possible place, then one of 3.
        let mut bytes = header(b'D', 10);
        bytes.extend_from_slice(&[7; 10]);
        bytes.extend(header(b'Z', 3));
        bytes.extend_from_slice(b"abc");
        for chunk in bytes.chunks(3) {
            b.scan(chunk).unwrap();
        }
        assert_eq!((b.have, b.body_left), (0, 0));
        assert_eq!(guard.tripped(), None);
        // The header of an 11-byte message is refused, even split in two.
        let big = header(b'D', 11);
        b.scan(&big[..2]).unwrap();
        let err = b.scan(&big[2..]).unwrap_err();
        assert!(err.to_string().contains("11 bytes"), "{err}");
        assert_eq!(guard.tripped(), Some(11));
    }
}
