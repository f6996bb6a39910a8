//! Serving TLS on accepted TCP connections, shared by the workers (mutual TLS) and the
//! orchestrator's gRPC front door (server authentication only).
//!
//! Every connection is handshaken on its own task within [`HANDSHAKE_TIMEOUT`], with the
//! identity in force when it was accepted (a rotation applies from the next
//! connection). A slow, silent or failing peer therefore holds up no other connection;
//! its failure is logged with its address and the reason, and it never reaches gRPC.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use futures::{Stream, StreamExt as _};
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;

use crate::mtls::{HANDSHAKE_TIMEOUT, Mtls, Reloading};

/// Handshaken connections waiting for the server to take them.
const ACCEPTED_BACKLOG: usize = 64;

/// Which server side of the identity a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// [`Mtls::server`]: a client certificate chained to `ca_file` is required.
    Mutual,
    /// [`Mtls::front_door`]: no client certificate is requested.
    ServerOnly,
}

impl Side {
    fn config(self, mtls: &Mtls) -> Arc<ServerConfig> {
        match self {
            Self::Mutual => mtls.server.clone(),
            Self::ServerOnly => mtls.front_door.clone(),
        }
    }

    /// The usual causes of a failed handshake, for the log.
    fn hint(self) -> &'static str {
        match self {
            Self::Mutual => "a client without a certificate from [tls] ca_file, or not TLS",
            Self::ServerOnly => "not TLS, or a client that does not trust this certificate or name",
        }
    }
}

/// Handshakes each connection of `connections` (`(io, peer, extra)`, where `extra` is
/// whatever must live as long as the connection, such as a connection-limit permit) on
/// its own task. `finish` turns a handshaken connection into what the server takes, or
/// refuses it (`None`; it logs why). The stream ends once `connections` has ended and
/// the handshakes under way are done; dropping it stops taking connections.
pub fn handshake_each<S, IO, T, C, F>(
    connections: S,
    identity: Arc<Reloading>,
    side: Side,
    finish: F,
) -> ReceiverStream<io::Result<C>>
where
    S: Stream<Item = (IO, SocketAddr, T)> + Send + 'static,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    T: Send + 'static,
    C: Send + 'static,
    F: Fn(TlsStream<IO>, SocketAddr, T, &Mtls) -> Option<C> + Send + Sync + 'static,
{
    let (accepted, rx) = mpsc::channel(ACCEPTED_BACKLOG);
    let finish = Arc::new(finish);
    tokio::spawn(async move {
        let mut connections = std::pin::pin!(connections);
        loop {
            let (io, peer, extra) = tokio::select! {
                () = accepted.closed() => return,
                next = connections.next() => match next {
                    Some(next) => next,
                    None => return,
                },
            };
            // The identity in force now: a rotation applies from the next connection.
            let mtls = identity.current();
            let acceptor = tokio_rustls::TlsAcceptor::from(side.config(&mtls));
            let (accepted, finish) = (accepted.clone(), finish.clone());
            tokio::spawn(async move {
                let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(io))
                    .await
                {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(e)) => {
                        log_refusal(
                            side,
                            peer,
                            &format!("the TLS handshake failed ({}): {e}", side.hint()),
                        );
                        return;
                    }
                    Err(_) => {
                        log_refusal(
                            side,
                            peer,
                            &format!("no TLS handshake within {} s", HANDSHAKE_TIMEOUT.as_secs()),
                        );
                        return;
                    }
                };
                if let Some(connection) = finish(stream, peer, extra, &mtls) {
                    let _ = accepted.send(Ok(connection)).await;
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// A worker refuses at warn: its only legitimate peer is the orchestrator. The front
/// door logs at info: any caller (or port scanner) can fail a handshake there, and it
/// harms no one else.
fn log_refusal(side: Side, peer: SocketAddr, reason: &str) {
    match side {
        Side::Mutual => tracing::warn!(%peer, %reason, "refused a connection"),
        Side::ServerOnly => tracing::info!(%peer, %reason, "refused a connection"),
    }
}
