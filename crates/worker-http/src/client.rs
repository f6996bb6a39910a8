//! One HTTP/1.1 exchange per hop, on a connection to an address the egress policy
//! checked, with redirects followed by hand (each hop re-checked) and bounded bodies.
//!
//! The client is built directly on hyper's connection API: it opens the TCP connection
//! itself to the checked addresses, so no resolver, proxy or connection pool of a
//! higher-level client can ever connect anywhere else.

use std::io::Read;
use std::net::IpAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use url::{Host, Url};

use crate::config::Settings;
use crate::resolve::{self, Lookup, ResolveError, Target};

/// Why a request produced no response.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error("stopped at redirect {hop} from {from} to {to}: {source}")]
    Redirect {
        hop: u32,
        from: String,
        to: String,
        source: ResolveError,
    },
    #[error(
        "stopped after {max} redirects (the most followed); the last one pointed to {to}; request that URL directly if it is what you want"
    )]
    TooManyRedirects { max: u32, to: String },
    #[error("redirect from {from} has an invalid location {location:?}: {reason}")]
    BadLocation {
        from: String,
        location: String,
        reason: String,
    },
    #[error("cannot connect to {target}: {reasons}")]
    Connect { target: String, reasons: String },
    #[error("tls handshake with {host} failed: {reason}")]
    Tls { host: String, reason: String },
    #[error("http exchange with {target} failed: {reason}")]
    Http { target: String, reason: String },
}

/// What the caller asks for (already validated).
#[derive(Debug, Clone)]
pub struct Request {
    pub method: Method,
    pub url: Url,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// Most body bytes returned (after decoding); also the most read from the wire.
    pub max_bytes: u64,
}

/// What came back, bounded.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    /// The body was cut at `max_bytes` (or its gzip stream ended early).
    pub truncated: bool,
    /// Why and where the body was cut or left undecoded.
    pub notes: Vec<String>,
    pub final_url: Url,
    pub redirects: u32,
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Aborts the task driving a connection when the exchange is over or abandoned.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A client bound to the validated `[http]` settings.
#[derive(Clone)]
pub struct Client {
    settings: Arc<Settings>,
    tls: tokio_rustls::TlsConnector,
    lookup: Option<Lookup>,
}

/// Builds the TLS configuration: rustls with the Mozilla roots compiled in (no files to
/// read, so it works inside a confined worker), HTTP/1.1 ALPN.
fn tls_config() -> Result<rustls::ClientConfig, rustls::Error> {
    let roots: rustls::RootCertStore = webpki_roots::TLS_SERVER_ROOTS.iter().cloned().collect();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

fn is_redirect(status: StatusCode) -> bool {
    matches!(status.as_u16(), 301 | 302 | 303 | 307 | 308)
}

fn origin(url: &Url) -> (String, Option<String>, Option<u16>) {
    (
        url.scheme().to_owned(),
        url.host_str().map(str::to_owned),
        url.port_or_known_default(),
    )
}

impl Client {
    pub(crate) fn new(
        settings: Arc<Settings>,
        lookup: Option<Lookup>,
    ) -> Result<Self, rustls::Error> {
        Ok(Self {
            settings,
            tls: tokio_rustls::TlsConnector::from(Arc::new(tls_config()?)),
            lookup,
        })
    }

    pub(crate) fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Sends `req`, following at most `max_redirects` redirects, each re-checked.
    pub async fn send(&self, req: Request) -> Result<Response, ClientError> {
        let Request {
            mut method,
            mut url,
            mut headers,
            mut body,
            max_bytes,
        } = req;
        let policy = &self.settings.policy;
        let mut target = resolve::check(policy, &url, self.lookup.as_ref()).await?;
        let mut redirects = 0u32;
        loop {
            let resp = self
                .exchange(&target, &method, &headers, body.clone())
                .await?;
            let location = resp
                .headers()
                .get(header::LOCATION)
                .map(|l| String::from_utf8_lossy(l.as_bytes()).into_owned());
            let (Some(location), true) = (location, is_redirect(resp.status())) else {
                return self.finish(resp, url, redirects, max_bytes).await;
            };
            let from = url.to_string();
            let next = url
                .join(location.trim())
                .map_err(|e| ClientError::BadLocation {
                    from: from.clone(),
                    location: location.clone(),
                    reason: e.to_string(),
                })?;
            if redirects >= self.settings.max_redirects {
                return Err(ClientError::TooManyRedirects {
                    max: self.settings.max_redirects,
                    to: next.to_string(),
                });
            }
            redirects += 1;
            let status = resp.status().as_u16();
            drop(resp);
            if (status == 303 && method != Method::HEAD)
                || (matches!(status, 301 | 302) && method == Method::POST)
            {
                method = Method::GET;
                body = Bytes::new();
                headers.remove(header::CONTENT_TYPE);
            }
            if origin(&next) != origin(&url) {
                for h in [
                    header::AUTHORIZATION,
                    header::COOKIE,
                    header::PROXY_AUTHORIZATION,
                ] {
                    headers.remove(h);
                }
                // A declared tool marks every header holding a secret as sensitive,
                // whatever its name (X-Api-Key…): it is for the origin it was set for.
                let sensitive: Vec<HeaderName> = headers
                    .iter()
                    .filter(|(_, value)| value.is_sensitive())
                    .map(|(name, _)| name.clone())
                    .collect();
                for h in sensitive {
                    headers.remove(h);
                }
            }
            target = resolve::check(policy, &next, self.lookup.as_ref())
                .await
                .map_err(|source| ClientError::Redirect {
                    hop: redirects,
                    from,
                    to: next.to_string(),
                    source,
                })?;
            url = next;
        }
    }

    /// One request whose response the caller reads as it arrives (an MCP server's
    /// event stream): the URL is checked and resolved exactly as for [`Self::send`],
    /// and no redirect is followed, so the answer comes from the checked address or
    /// from nowhere. The body is the caller's to bound.
    pub(crate) async fn open(
        &self,
        method: Method,
        url: &Url,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<http::Response<Incoming>, ClientError> {
        let target = resolve::check(&self.settings.policy, url, self.lookup.as_ref()).await?;
        self.exchange(&target, &method, headers, body).await
    }

    async fn connect(&self, target: &Target) -> Result<Box<dyn Io>, ClientError> {
        let mut reasons = Vec::new();
        let mut tcp = None;
        for addr in &target.addrs {
            match tokio::time::timeout(self.settings.connect_timeout, TcpStream::connect(addr))
                .await
            {
                Ok(Ok(s)) => {
                    tcp = Some(s);
                    break;
                }
                Ok(Err(e)) => reasons.push(format!("{addr}: {e}")),
                Err(_) => reasons.push(format!(
                    "{addr}: no answer within {} ms (connect_timeout_ms)",
                    self.settings.connect_timeout.as_millis()
                )),
            }
        }
        let tcp = tcp.ok_or_else(|| ClientError::Connect {
            target: crate::egress::host_port(&target.host, target.port),
            reasons: reasons.join("; "),
        })?;
        let _ = tcp.set_nodelay(true);
        if target.url.scheme() != "https" {
            return Ok(Box::new(tcp));
        }
        let tls_err = |reason: String| ClientError::Tls {
            host: target.host.to_string(),
            reason,
        };
        let name = match &target.host {
            Host::Domain(d) => {
                ServerName::try_from(d.clone()).map_err(|e| tls_err(e.to_string()))?
            }
            Host::Ipv4(ip) => ServerName::IpAddress(IpAddr::V4(*ip).into()),
            Host::Ipv6(ip) => ServerName::IpAddress(IpAddr::V6(*ip).into()),
        };
        let tls = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(|e| tls_err(e.to_string()))?;
        Ok(Box::new(tls))
    }

    /// One request/response on a fresh connection to the checked target. The returned
    /// response owns the task driving the connection.
    async fn exchange(
        &self,
        target: &Target,
        method: &Method,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<http::Response<Incoming>, ClientError> {
        let io = self.connect(target).await?;
        let http_err = |e: &dyn std::fmt::Display| ClientError::Http {
            target: crate::egress::host_port(&target.host, target.port),
            reason: e.to_string(),
        };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| http_err(&e))?;
        let driver = AbortOnDrop(tokio::spawn(async move {
            let _ = conn.await;
        }));
        let url = &target.url;
        let path = match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_owned(),
        };
        let host = match url.port() {
            Some(p) => crate::egress::host_port(&target.host, p),
            None => target.host.to_string(),
        };
        let mut req = http::Request::builder()
            .method(method.clone())
            .uri(path)
            .body(Full::new(body))
            .map_err(|e| http_err(&e))?;
        let h = req.headers_mut();
        h.clone_from(headers);
        h.insert(
            header::HOST,
            HeaderValue::from_str(&host).map_err(|e| http_err(&e))?,
        );
        h.insert(header::USER_AGENT, self.settings.user_agent.clone());
        // Callers of `send` cannot set it (`forbidden_header`): their bodies are gzip
        // at most, decoded within the cap. A streamed answer asks for `identity`.
        if !h.contains_key(header::ACCEPT_ENCODING) {
            h.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("gzip"));
        }
        h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        if !h.contains_key(header::ACCEPT) {
            h.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
        }
        let resp = sender.send_request(req).await.map_err(|e| http_err(&e))?;
        Ok(resp.map(|body| Incoming {
            body,
            _driver: driver,
        }))
    }

    async fn finish(
        &self,
        resp: http::Response<Incoming>,
        final_url: Url,
        redirects: u32,
        max_bytes: u64,
    ) -> Result<Response, ClientError> {
        let cap = usize::try_from(max_bytes).unwrap_or(usize::MAX);
        let (parts, mut incoming) = resp.into_parts();
        let mut wire: Vec<u8> = Vec::new();
        let mut truncated = false;
        let mut notes = Vec::new();
        while let Some(frame) = incoming.body.frame().await {
            let frame = frame.map_err(|e| ClientError::Http {
                target: final_url.to_string(),
                reason: format!("while reading the body: {e}"),
            })?;
            if let Ok(data) = frame.into_data() {
                let room = cap.saturating_sub(wire.len());
                if data.len() > room {
                    wire.extend_from_slice(&data[..room]);
                    truncated = true;
                    break;
                }
                wire.extend_from_slice(&data);
            }
        }
        drop(incoming);
        if truncated {
            notes.push(format!(
                "response body cut after {cap} bytes received (max_response_bytes)"
            ));
        }
        let encoding = parts
            .headers
            .get(header::CONTENT_ENCODING)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim().to_ascii_lowercase());
        let body = match encoding.as_deref() {
            None | Some("" | "identity") => wire,
            Some("gzip" | "x-gzip") if !wire.is_empty() => {
                let (body, cut, error) = gunzip(&wire, cap);
                if cut {
                    truncated = true;
                    notes.push(format!(
                        "decoded (gzip) body cut at {cap} bytes (max_response_bytes)"
                    ));
                }
                if let Some(e) = error
                    && !truncated
                {
                    truncated = true;
                    notes.push(format!("gzip body is corrupt or incomplete: {e}"));
                }
                body
            }
            Some(other) => {
                notes.push(format!(
                    "body is in content-encoding {other:?}, returned undecoded"
                ));
                wire
            }
        };
        Ok(Response {
            status: parts.status,
            headers: parts.headers,
            body,
            truncated,
            notes,
            final_url,
            redirects,
        })
    }
}

/// A response body together with the task driving its connection.
pub struct Incoming {
    body: hyper::body::Incoming,
    _driver: AbortOnDrop,
}

impl Incoming {
    /// The next piece of the body as it arrives; `None` at its end.
    pub(crate) async fn chunk(&mut self) -> Option<Result<Bytes, String>> {
        loop {
            match self.body.frame().await? {
                Ok(frame) => {
                    if let Ok(data) = frame.into_data() {
                        return Some(Ok(data));
                    }
                }
                Err(e) => return Some(Err(e.to_string())),
            }
        }
    }
}

/// Decodes (multi-member) gzip, producing at most `cap` bytes: a decompression bomb costs
/// at most `cap` bytes of memory and the time to inflate them. Returns the bytes, whether
/// the output was cut, and a decoding error (after which the bytes are what decoded
/// cleanly).
pub fn gunzip(wire: &[u8], cap: usize) -> (Vec<u8>, bool, Option<String>) {
    let limit = u64::try_from(cap).unwrap_or(u64::MAX).saturating_add(1);
    let mut out = Vec::new();
    let error = flate2::read::MultiGzDecoder::new(wire)
        .take(limit)
        .read_to_end(&mut out)
        .err()
        .map(|e| e.to_string());
    let cut = out.len() > cap;
    out.truncate(cap);
    (out, cut, error)
}

/// Header names a caller may not set: hop-by-hop headers, the ones the client owns
/// (`Host`, `Content-Length`, `Accept-Encoding` so that every body stays bounded,
/// `User-Agent`), `Expect`, and the method-override headers.
pub fn forbidden_header(name: &HeaderName) -> bool {
    let n = name.as_str();
    matches!(
        n,
        "connection"
            | "keep-alive"
            | "te"
            | "trailer"
            | "trailers"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
            | "accept-encoding"
            | "user-agent"
            | "expect"
            | "http2-settings"
    ) || n.starts_with("proxy-")
        || is_method_override(name)
}

/// Headers that ask the server to treat the request as another method. The request
/// goes out with the method the call names, nothing else: with one of these a GET,
/// which needs no approval, could act as a DELETE. (The gate's approval rule holds such
/// a call for a human as well; this refusal stands even where approvals are off.)
pub fn is_method_override(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "x-http-method-override" | "x-http-method" | "x-method-override"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn gunzip_is_bounded() {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(&vec![0u8; 10 * 1024 * 1024]).unwrap();
        let gz = enc.finish().unwrap();
        let (out, cut, err) = gunzip(&gz, 1000);
        assert_eq!((out.len(), cut, err), (1000, true, None));
        let (out, cut, err) = gunzip(&gz, 20 * 1024 * 1024);
        assert_eq!((out.len(), cut, err), (10 * 1024 * 1024, false, None));
        let (out, cut, err) = gunzip(&gz[..gz.len() / 2], 20 * 1024 * 1024);
        assert!(!cut && err.is_some() && !out.is_empty());
    }

    #[test]
    fn tls_config_builds() {
        assert!(tls_config().is_ok());
    }

    #[test]
    fn forbidden_headers() {
        for h in [
            "Host",
            "connection",
            "Proxy-Authorization",
            "transfer-encoding",
            "TE",
            "content-length",
            "X-HTTP-Method-Override",
            "x-http-method",
            "X-Method-Override",
        ] {
            assert!(
                forbidden_header(&HeaderName::from_bytes(h.as_bytes()).unwrap()),
                "{h}"
            );
        }
        for h in [
            "authorization",
            "content-type",
            "accept",
            "x-api-key",
            "cookie",
        ] {
            assert!(
                !forbidden_header(&HeaderName::from_bytes(h.as_bytes()).unwrap()),
                "{h}"
            );
        }
    }
}
