//! The HTTP client the agent loop talks to model providers with: HTTP/1.1 over TCP
//! (loopback and on-premises servers) or TLS (rustls with the Mozilla roots compiled in,
//! so it needs no certificate files inside the confined orchestrator). One connection
//! per request; no proxy support.
//!
//! Error messages name the URL and the failure, never a header: the API key travels only
//! in a header marked sensitive.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};

/// How long connecting (TCP and TLS) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a response may stay silent (providers send pings while they think).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{0:?} is not a valid provider URL (use http://host:port/... or https://...)")]
    Url(String),
    #[error("cannot connect to {target}: {reason}")]
    Connect { target: String, reason: String },
    #[error("tls handshake with {host} failed: {reason}")]
    Tls { host: String, reason: String },
    #[error("http exchange with {target} failed: {reason}")]
    Http { target: String, reason: String },
    #[error("{target} sent nothing for {seconds} s")]
    Idle { target: String, seconds: u64 },
    #[error("the response of {target} is over {limit} bytes")]
    TooLarge { target: String, limit: usize },
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Aborts the task driving a connection when the response is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A response whose body is read chunk by chunk.
pub struct Response {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    body: hyper::body::Incoming,
    target: String,
    _driver: AbortOnDrop,
}

impl Response {
    /// The next chunk of the body; `None` at its end.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, ClientError> {
        loop {
            let frame = tokio::time::timeout(IDLE_TIMEOUT, self.body.frame())
                .await
                .map_err(|_| ClientError::Idle {
                    target: self.target.clone(),
                    seconds: IDLE_TIMEOUT.as_secs(),
                })?;
            match frame {
                None => return Ok(None),
                Some(Err(e)) => {
                    return Err(ClientError::Http {
                        target: self.target.clone(),
                        reason: format!("while reading the body: {e}"),
                    });
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        return Ok(Some(data));
                    }
                }
            }
        }
    }

    /// The whole body, up to `limit` bytes.
    pub async fn bytes(mut self, limit: usize) -> Result<Vec<u8>, ClientError> {
        let mut out = Vec::new();
        while let Some(chunk) = self.chunk().await? {
            if out.len() + chunk.len() > limit {
                return Err(ClientError::TooLarge {
                    target: self.target.clone(),
                    limit,
                });
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    }
}

#[derive(Clone)]
pub struct HttpClient {
    tls: Arc<std::sync::OnceLock<Result<tokio_rustls::TlsConnector, String>>>,
}

impl Default for HttpClient {
    fn default() -> Self {
        Self {
            tls: Arc::new(std::sync::OnceLock::new()),
        }
    }
}

fn tls_connector() -> Result<tokio_rustls::TlsConnector, String> {
    let roots: rustls::RootCertStore = webpki_roots::TLS_SERVER_ROOTS.iter().cloned().collect();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

impl HttpClient {
    /// POSTs `body` (JSON) to `url` with `headers`; answers once the response head is in.
    pub async fn post_json(
        &self,
        url: &str,
        headers: Vec<(HeaderName, HeaderValue)>,
        body: Vec<u8>,
    ) -> Result<Response, ClientError> {
        let uri: Uri = url.parse().map_err(|_| ClientError::Url(url.to_owned()))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(ClientError::Url(url.to_owned())),
        };
        let host = uri
            .host()
            .ok_or_else(|| ClientError::Url(url.to_owned()))?
            .to_owned();
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let target = format!(
            "{}://{}{}",
            uri.scheme_str().unwrap_or("http"),
            authority(&host, port),
            uri.path()
        );
        let io = self.connect(&host, port, https, &target).await?;
        let http_err = |e: &dyn std::fmt::Display| ClientError::Http {
            target: target.clone(),
            reason: e.to_string(),
        };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| http_err(&e))?;
        let driver = AbortOnDrop(tokio::spawn(async move {
            let _ = conn.await;
        }));
        let path = uri
            .path_and_query()
            .map(|p| p.as_str().to_owned())
            .unwrap_or_else(|| "/".to_owned());
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(path)
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| http_err(&e))?;
        let h = request.headers_mut();
        let host_header = match uri.port_u16() {
            Some(p) => authority(&host, p),
            None => host.clone(),
        };
        h.insert(
            header::HOST,
            HeaderValue::from_str(&host_header).map_err(|e| http_err(&e))?,
        );
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert(
            header::USER_AGENT,
            HeaderValue::from_static(concat!("airlock/", env!("CARGO_PKG_VERSION"))),
        );
        h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        for (name, value) in headers {
            h.insert(name, value);
        }
        let response = tokio::time::timeout(IDLE_TIMEOUT, sender.send_request(request))
            .await
            .map_err(|_| ClientError::Idle {
                target: target.clone(),
                seconds: IDLE_TIMEOUT.as_secs(),
            })?
            .map_err(|e| http_err(&e))?;
        let (parts, body) = response.into_parts();
        Ok(Response {
            status: parts.status,
            headers: parts.headers,
            body,
            target,
            _driver: driver,
        })
    }

    async fn connect(
        &self,
        host: &str,
        port: u16,
        https: bool,
        target: &str,
    ) -> Result<Box<dyn Io>, ClientError> {
        let connect_err = |reason: String| ClientError::Connect {
            target: target.to_owned(),
            reason,
        };
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let tcp = tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio::net::TcpStream::connect((bare, port)),
        )
        .await
        .map_err(|_| connect_err(format!("no answer within {} s", CONNECT_TIMEOUT.as_secs())))?
        .map_err(|e| connect_err(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        if !https {
            return Ok(Box::new(tcp));
        }
        let tls_err = |reason: String| ClientError::Tls {
            host: host.to_owned(),
            reason,
        };
        let connector = self
            .tls
            .get_or_init(tls_connector)
            .clone()
            .map_err(tls_err)?;
        let name = ServerName::try_from(bare.to_owned()).map_err(|e| tls_err(e.to_string()))?;
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(name, tcp))
            .await
            .map_err(|_| tls_err(format!("no answer within {} s", CONNECT_TIMEOUT.as_secs())))?
            .map_err(|e| tls_err(e.to_string()))?;
        Ok(Box::new(stream))
    }
}

fn authority(host: &str, port: u16) -> String {
    format!("{host}:{port}")
}
