//! A worker's TCP listener under mutual TLS: every connection is handshaken on its own
//! task ([`airlock_tls::accept`]: a slow or silent peer holds up no one), must present a certificate chained to
//! `[tls] ca_file` that carries one of `allowed_peers`, and is refused — and logged with
//! its address and the reason — otherwise. Only authenticated connections reach gRPC.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use airlock_tls::accept::{Side, handshake_each};
use airlock_tls::mtls::Reloading;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;

/// One authenticated connection.
pub struct TlsConn {
    stream: TlsStream<TcpStream>,
    peer: SocketAddr,
}

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = SocketAddr;

    fn connect_info(&self) -> SocketAddr {
        self.peer
    }
}

impl AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The authenticated connections of `listener`, until the returned stream is dropped.
pub fn incoming(
    listener: TcpListener,
    identity: Arc<Reloading>,
) -> ReceiverStream<io::Result<TlsConn>> {
    let accepted = futures::stream::unfold(listener, |listener| async move {
        loop {
            match listener.accept().await {
                Ok((tcp, peer)) => {
                    // Small gRPC frames must not wait for Nagle and delayed ACKs (40 ms).
                    let _ = tcp.set_nodelay(true);
                    return Some(((tcp, peer, ()), listener));
                }
                Err(e) => {
                    // Out of descriptors and the like: the next accept may work.
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    });
    handshake_each(
        accepted,
        identity,
        Side::Mutual,
        |stream, peer, (), mtls| match mtls.allowed_peer(stream.get_ref().1.peer_certificates()) {
            Ok(name) => {
                tracing::debug!(%peer, name, "peer authenticated");
                Some(TlsConn { stream, peer })
            }
            Err(reason) => {
                tracing::warn!(%peer, %reason, "refused a connection: the peer is not allowed ([tls] allowed_peers)");
                None
            }
        },
    )
}
