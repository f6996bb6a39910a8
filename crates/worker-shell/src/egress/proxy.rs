//! Serving one call's listener: reading a request head, judging its target, relaying.
//!
//! Every connection is one attempt and one request: a CONNECT tunnel, or one plain HTTP
//! request forwarded with `Connection: close`. Whatever happens, the attempt is recorded
//! when its connection ends; every wait is bounded (a timeout, or the end of the call).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use airlock_worker_http::egress::host_port;
use airlock_worker_http::resolve;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use url::{Host, Url};

use super::tls::{self, HelloError, RECORD_HEADER};
use super::{Blocked, EgressAttempt, EgressLog, EgressRules, Verdict};

/// The most bytes of a request head (request line and headers).
const MAX_HEAD: usize = 16 * 1024;
/// The most headers in a request head.
const MAX_HEADERS: usize = 100;
/// Time for a client to send its request head, and its ClientHello after the 200.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Time to write an error answer, and then to read what the client still sends (so that
/// closing does not reset the connection before the client has read the answer).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(1);
/// The most bytes read and thrown away after an error answer.
const MAX_DRAIN: usize = 64 * 1024;
/// Connections beyond `max_connections` being refused at one time; more wait in the
/// listener's backlog.
const REFUSING: usize = 32;
const RELAY_BUFFER: usize = 16 * 1024;
/// The longest host and reason kept in a record.
const MAX_HOST: usize = 256;
const MAX_REASON: usize = 1024;
/// TLS alert `access_denied`, fatal: what a client sees when its tunnel is closed after
/// the 200 (for the SNI rule), instead of a bare end of stream.
const TLS_ACCESS_DENIED: [u8; 7] = [21, 3, 3, 0, 2, 2, 49];
/// The plain HTTP methods served; any other is refused.
const METHODS: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];
/// Hop-by-hop headers (RFC 9110 §7.6.1), never forwarded; `Proxy-*` neither.
const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
];

/// What one call's connections share.
struct Shared {
    rules: Arc<EgressRules>,
    /// Bytes relayed by the whole call, against `max_bytes`.
    relayed: AtomicU64,
    log: Mutex<EgressLog>,
}

impl Shared {
    /// Takes up to `n` bytes of the call's budget; fewer when it runs out.
    fn take(&self, n: u64) -> u64 {
        let max = self.rules.max_bytes;
        let mut granted = 0;
        let _ = self
            .relayed
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                granted = n.min(max.saturating_sub(used));
                Some(used.saturating_add(granted))
            });
        granted
    }

    /// Refuses a new target once the call's budget is spent, before connecting to it.
    fn spent(&self) -> Result<(), Failure> {
        if self.relayed.load(Ordering::Acquire) >= self.rules.max_bytes {
            return Err(self.budget_refusal(Answer::Http(403)));
        }
        Ok(())
    }

    fn budget_refusal(&self, answer: Answer) -> Failure {
        Failure::refused(
            answer,
            format!(
                "refused: this call has relayed {} bytes, the most [sandbox.egress] max_bytes allows",
                self.rules.max_bytes
            ),
        )
    }
}

/// Serves one call's listener until `stop` is cancelled (the call ended), then ends every
/// connection and returns what was attempted.
///
/// The listener is made non-blocking here; if that fails, nothing is served (the sandbox
/// reaches nothing) and the log is empty.
pub async fn serve(
    listener: std::net::TcpListener,
    rules: Arc<EgressRules>,
    stop: CancellationToken,
) -> EgressLog {
    let listener = match listener
        .set_nonblocking(true)
        .and_then(|()| tokio::net::TcpListener::from_std(listener))
    {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "egress proxy: cannot serve the listener");
            return EgressLog::default();
        }
    };
    let max_connections = u64::from(rules.max_connections);
    let slots = usize::try_from(rules.max_connections)
        .unwrap_or(usize::MAX)
        .saturating_add(REFUSING)
        .min(Semaphore::MAX_PERMITS);
    let shared = Arc::new(Shared {
        rules,
        relayed: AtomicU64::new(0),
        log: Mutex::new(EgressLog::default()),
    });
    let slots = Arc::new(Semaphore::new(slots));
    let mut tasks = JoinSet::new();
    let mut accepted: u64 = 0;
    loop {
        // A slot first, so the number of connections held open stays bounded.
        let permit = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            permit = slots.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let client = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => client,
                Err(e) => {
                    // Out of descriptors and the like: wait a little rather than spin.
                    tracing::debug!(error = %e, "egress proxy: accept failed");
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = tokio::time::sleep(Duration::from_millis(50)) => continue,
                    }
                }
            },
        };
        while tasks.try_join_next().is_some() {}
        accepted = accepted.saturating_add(1);
        let over = accepted > max_connections;
        tasks.spawn(connection(
            shared.clone(),
            client,
            over,
            stop.clone(),
            permit,
        ));
    }
    drop(listener);
    while tasks.join_next().await.is_some() {}
    std::mem::take(&mut *shared.log.lock().unwrap_or_else(PoisonError::into_inner))
}

/// How a refused or failed connection is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// An HTTP error response whose body is the reason.
    Http(u16),
    /// After the 200 of a CONNECT: a TLS alert, then close.
    Alert,
    /// Just close (the client is gone, or bytes already flowed).
    Close,
}

/// Why a connection ends early.
#[derive(Debug)]
struct Failure {
    answer: Answer,
    reason: String,
    /// `Refused` when a rule refused; `Allowed` when the rules allowed the target but it
    /// could not be reached.
    verdict: Verdict,
}

impl Failure {
    fn refused(answer: Answer, reason: String) -> Self {
        Self {
            answer,
            reason,
            verdict: Verdict::Refused,
        }
    }

    fn unreachable(status: u16, reason: String) -> Self {
        Self {
            answer: Answer::Http(status),
            reason,
            verdict: Verdict::Allowed,
        }
    }

    fn bad_request(reason: String) -> Self {
        Self::refused(Answer::Http(400), reason)
    }
}

impl From<Blocked> for Failure {
    fn from(b: Blocked) -> Self {
        match b {
            Blocked::Refused(reason) => Self::refused(Answer::Http(403), reason),
            Blocked::Unresolved(reason) => Self::unreachable(502, reason),
        }
    }
}

/// One connection, from accept to the record.
async fn connection(
    shared: Arc<Shared>,
    mut client: TcpStream,
    over_cap: bool,
    stop: CancellationToken,
    _slot: OwnedSemaphorePermit,
) {
    let mut attempt = EgressAttempt {
        host: String::new(),
        port: 0,
        method: "-",
        verdict: Verdict::Refused,
        reason: None,
        bytes_sent: 0,
        bytes_received: 0,
    };
    let outcome = if over_cap {
        Err(Failure::refused(
            Answer::Http(429),
            format!(
                "refused: this call already opened {} connections, the most [sandbox.egress] max_connections allows",
                shared.rules.max_connections
            ),
        ))
    } else {
        tokio::select! {
            () = stop.cancelled() => Err(Failure::refused(
                Answer::Close,
                "the call ended while the connection was open".to_owned(),
            )),
            outcome = handle(&shared, &mut client, &mut attempt) => outcome,
        }
    };
    if let Err(failure) = outcome {
        // A connection that the end of the call cut after it was allowed stays allowed.
        if !(stop.is_cancelled() && attempt.verdict == Verdict::Allowed) {
            attempt.verdict = failure.verdict;
            attempt.reason = Some(clip(failure.reason.clone(), MAX_REASON));
        }
        if !stop.is_cancelled() {
            tokio::select! {
                () = stop.cancelled() => {}
                () = answer(&mut client, &failure) => {}
            }
        }
    }
    attempt.host = clip(std::mem::take(&mut attempt.host), MAX_HOST);
    shared
        .log
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .record(attempt);
}

/// Cuts `s` to at most `max` bytes, on a character boundary.
fn clip(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

fn status_text(status: u16) -> &'static str {
    match status {
        400 => "Bad Request",
        403 => "Forbidden",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        502 => "Bad Gateway",
        504 => "Gateway Timeout",
        _ => "Error",
    }
}

/// Tells the client why, then closes without resetting: what the client still sends is
/// read (bounded) so the kernel does not throw the answer away with a reset.
async fn answer(client: &mut TcpStream, failure: &Failure) {
    let bytes = match failure.answer {
        Answer::Http(status) => {
            let body = format!("{}\n", failure.reason);
            format!(
                "HTTP/1.1 {status} {}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                status_text(status),
                body.len()
            )
            .into_bytes()
        }
        Answer::Alert => TLS_ACCESS_DENIED.to_vec(),
        Answer::Close => Vec::new(),
    };
    let _ = tokio::time::timeout(ANSWER_TIMEOUT, async {
        client.write_all(&bytes).await?;
        client.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut drained = 0;
        while drained < MAX_DRAIN {
            match client.read(&mut sink).await? {
                0 => break,
                n => drained += n,
            }
        }
        Ok::<(), std::io::Error>(())
    })
    .await;
}

/// A request head, owned, with what the client sent after it.
struct Head {
    method: String,
    target: String,
    version: u8,
    headers: Vec<(String, Vec<u8>)>,
    rest: Vec<u8>,
}

impl Head {
    /// Every value of header `name` (case-insensitive).
    fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }
}

/// Reads and parses the request head: at most [`MAX_HEAD`] bytes within [`HEAD_TIMEOUT`].
async fn read_head(client: &mut TcpStream) -> Result<Head, Failure> {
    let mut buf = Vec::with_capacity(1024);
    let read = async {
        loop {
            if buf.len() >= MAX_HEAD {
                return Err(Failure::refused(
                    Answer::Http(431),
                    format!("refused: the request head is over {MAX_HEAD} bytes"),
                ));
            }
            let mut chunk = [0u8; 4096];
            let want = chunk.len().min(MAX_HEAD - buf.len());
            let n = client
                .read(chunk.get_mut(..want).unwrap_or_default())
                .await
                .map_err(|e| {
                    Failure::refused(Answer::Close, format!("cannot read the request: {e}"))
                })?;
            if n == 0 {
                return Err(Failure::refused(
                    Answer::Close,
                    "the client closed the connection before sending a whole request head"
                        .to_owned(),
                ));
            }
            buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            match httparse::Request::new(&mut headers).parse(&buf) {
                Ok(httparse::Status::Complete(len)) => return Ok(len),
                Ok(httparse::Status::Partial) => {}
                Err(e) => {
                    return Err(Failure::bad_request(format!(
                        "refused: the request is not HTTP/1.x ({e}); this is an HTTP proxy: send CONNECT host:port or an absolute-form request"
                    )));
                }
            }
        }
    };
    let len = match tokio::time::timeout(HEAD_TIMEOUT, read).await {
        Ok(len) => len?,
        Err(_) => {
            return Err(Failure::refused(
                Answer::Http(408),
                format!(
                    "refused: no whole request head within {} s",
                    HEAD_TIMEOUT.as_secs()
                ),
            ));
        }
    };
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let parsed = req.parse(&buf);
    let (Ok(httparse::Status::Complete(_)), Some(method), Some(target), Some(version)) =
        (parsed, req.method, req.path, req.version)
    else {
        return Err(Failure::bad_request(
            "refused: the request head cannot be read".to_owned(),
        ));
    };
    Ok(Head {
        method: method.to_owned(),
        target: target.to_owned(),
        version,
        headers: req
            .headers
            .iter()
            .map(|h| (h.name.to_owned(), h.value.to_vec()))
            .collect(),
        rest: buf.get(len..).unwrap_or_default().to_vec(),
    })
}

/// Reads the request and serves it.
async fn handle(
    shared: &Shared,
    client: &mut TcpStream,
    attempt: &mut EgressAttempt,
) -> Result<(), Failure> {
    let head = read_head(client).await?;
    if head.method == "CONNECT" {
        attempt.method = "CONNECT";
        tunnel(shared, client, attempt, head).await
    } else {
        attempt.method = METHODS
            .iter()
            .find(|m| **m == head.method)
            .copied()
            .unwrap_or("other");
        forward(shared, client, attempt, head).await
    }
}

/// The host and port of an authority (`host:port`, `[v6]:port`), normalised as URL hosts
/// are (so `2130706433` is `127.0.0.1` and `Example.COM.` is `example.com`).
fn authority(raw: &str, default_port: Option<u16>) -> Result<(Host<String>, u16), String> {
    if raw.is_empty()
        || raw
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control() || b"/?#@\\".contains(&b))
    {
        return Err("not host:port".to_owned());
    }
    let (host, port) = match raw.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') || h.ends_with(']') => (h, Some(p)),
        _ => (raw, None),
    };
    let port = match (port, default_port) {
        (Some(p), _) => match p.parse::<u16>() {
            Ok(n) if n > 0 && p.bytes().all(|b| b.is_ascii_digit()) => n,
            _ => return Err(format!("invalid port {p:?}")),
        },
        (None, Some(p)) => p,
        (None, None) => return Err("no port".to_owned()),
    };
    let url = Url::parse(&format!("http://{host}:{port}/")).map_err(|e| e.to_string())?;
    resolve::url_parts(&url).map_err(|e| e.to_string())
}

/// Connects to one of the checked addresses, within the connect timeout.
async fn connect(
    shared: &Shared,
    addrs: &[SocketAddr],
    target: &str,
) -> Result<TcpStream, Failure> {
    let timeout = shared.rules.connect_timeout;
    let attempt = async {
        let mut last = String::from("no address");
        for addr in addrs {
            match TcpStream::connect(addr).await {
                Ok(stream) => return Ok(stream),
                Err(e) => last = format!("{addr}: {e}"),
            }
        }
        Err(last)
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(last)) => Err(Failure::unreachable(
            502,
            format!("cannot connect to {target} ({last})"),
        )),
        Err(_) => Err(Failure::unreachable(
            504,
            format!(
                "cannot connect to {target}: no answer within {} ms",
                timeout.as_millis()
            ),
        )),
    }
}

/// `CONNECT host:port`: judge, connect, answer 200, check the ClientHello's server name
/// against the host, relay.
async fn tunnel(
    shared: &Shared,
    client: &mut TcpStream,
    attempt: &mut EgressAttempt,
    head: Head,
) -> Result<(), Failure> {
    attempt.host.clone_from(&head.target);
    let (host, port) = authority(&head.target, None).map_err(|e| {
        Failure::bad_request(format!(
            "refused: CONNECT target {:?} is not host:port ({e})",
            head.target
        ))
    })?;
    attempt.host = host.to_string();
    attempt.port = port;
    shared.spent()?;
    let addrs = shared.rules.admit(&host, port).await?;
    let target = host_port(&host, port);
    let mut upstream = connect(shared, &addrs, &target).await?;
    client
        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .await
        .map_err(|e| Failure::refused(Answer::Close, format!("cannot answer the client: {e}")))?;

    let hello = read_hello(client, head.rest).await?;
    let record = hello
        .get(..RECORD_HEADER.saturating_add(hello_len(&hello)))
        .unwrap_or_default();
    let sni = tls::server_name(record)
        .map_err(|e| Failure::refused(Answer::Alert, format!("refused: CONNECT {target}: {e}")))?;
    check_sni(&host, sni.as_deref())?;

    attempt.verdict = Verdict::Allowed;
    send(
        shared,
        &mut upstream,
        &hello,
        &mut attempt.bytes_sent,
        Answer::Alert,
    )
    .await?;
    relay(shared, client, &mut upstream, attempt, None).await
}

/// The body length of the record that starts `hello` (already checked by `read_hello`).
fn hello_len(hello: &[u8]) -> usize {
    match hello.first_chunk::<RECORD_HEADER>() {
        Some(header) => tls::record_len(header).unwrap_or(0),
        None => 0,
    }
}

/// The server name must be the CONNECT host when that is a name. A CONNECT to an address
/// may send no name, and never another one (the name is what a fronting server routes).
fn check_sni(host: &Host<String>, sni: Option<&str>) -> Result<(), Failure> {
    let refuse = |sni: &str| {
        Failure::refused(
            Answer::Alert,
            format!(
                "refused: SNI {sni} does not match CONNECT host {:?}; a tunnel's TLS server name must be the host it was opened to (no domain fronting)",
                host.to_string()
            ),
        )
    };
    match (host, sni) {
        (Host::Domain(d), Some(name)) if d.eq_ignore_ascii_case(name) => Ok(()),
        (Host::Domain(_), None) => Err(refuse("(none sent)")),
        (_, Some(name)) => Err(refuse(&format!("{name:?}"))),
        (_, None) => Ok(()),
    }
}

/// The bytes the client sent after the 200, up to the end of its first TLS record,
/// within [`HEAD_TIMEOUT`]; at most one record of [`MAX_RECORD`] bytes is read.
async fn read_hello(client: &mut TcpStream, mut buf: Vec<u8>) -> Result<Vec<u8>, Failure> {
    let alert = |e: HelloError| Failure::refused(Answer::Alert, format!("refused: {e}"));
    let read = async {
        let mut want = RECORD_HEADER;
        let mut header_checked = false;
        loop {
            if !header_checked && let Some(header) = buf.first_chunk::<RECORD_HEADER>() {
                want = RECORD_HEADER + tls::record_len(header).map_err(alert)?;
                header_checked = true;
            }
            if buf.len() >= want {
                return Ok(());
            }
            let mut chunk = vec![0u8; want - buf.len()];
            let n = client.read(&mut chunk).await.map_err(|e| {
                Failure::refused(Answer::Close, format!("cannot read the ClientHello: {e}"))
            })?;
            if n == 0 {
                return Err(Failure::refused(
                    Answer::Close,
                    "refused: the client closed the tunnel before a whole TLS ClientHello"
                        .to_owned(),
                ));
            }
            buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
        }
    };
    match tokio::time::timeout(HEAD_TIMEOUT, read).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(Failure::refused(
                Answer::Alert,
                format!(
                    "refused: no TLS ClientHello within {} s; CONNECT tunnels carry TLS only",
                    HEAD_TIMEOUT.as_secs()
                ),
            ));
        }
    }
    Ok(buf)
}

/// A plain HTTP request in absolute form: judge, connect, forward it in origin form with
/// `Connection: close`, relay the answer.
async fn forward(
    shared: &Shared,
    client: &mut TcpStream,
    attempt: &mut EgressAttempt,
    head: Head,
) -> Result<(), Failure> {
    if attempt.method == "other" {
        return Err(Failure::refused(
            Answer::Http(405),
            format!(
                "refused: method {:?} is not served; the proxy serves CONNECT and {}",
                head.method,
                METHODS.join(", ")
            ),
        ));
    }
    let scheme = head
        .target
        .split_once("://")
        .map(|(s, _)| s.to_ascii_lowercase());
    match scheme.as_deref() {
        Some("http") => {}
        Some("https") => {
            return Err(Failure::bad_request(
                "refused: an https:// URL goes through CONNECT, not as a plain request".to_owned(),
            ));
        }
        _ => {
            return Err(Failure::bad_request(format!(
                "refused: {:?} is not an absolute http:// URL; this is an HTTP proxy: send CONNECT host:port or GET http://host/path",
                clip(head.target.clone(), 200)
            )));
        }
    }
    let url = resolve::parse_url(&head.target)
        .map_err(|e| Failure::bad_request(format!("refused: {e}")))?;
    let (host, port) =
        resolve::url_parts(&url).map_err(|e| Failure::refused(Answer::Http(403), e.to_string()))?;
    attempt.host = host.to_string();
    attempt.port = port;
    let target = host_port(&host, port);
    check_host_header(&head, &host, port, &target)?;
    let body = body_length(&head)?;
    shared.spent()?;

    let addrs = shared.rules.admit(&host, port).await?;
    let mut upstream = connect(shared, &addrs, &target).await?;
    attempt.verdict = Verdict::Allowed;

    let mut out = origin_head(&head, &url);
    let early = usize::try_from(body)
        .unwrap_or(usize::MAX)
        .min(head.rest.len());
    out.extend_from_slice(head.rest.get(..early).unwrap_or_default());
    send(
        shared,
        &mut upstream,
        &out,
        &mut attempt.bytes_sent,
        Answer::Http(403),
    )
    .await?;
    let remaining = body.saturating_sub(u64::try_from(early).unwrap_or(u64::MAX));
    relay(shared, client, &mut upstream, attempt, Some(remaining)).await
}

/// The `Host` header must be there once, and name the URL's host and port.
fn check_host_header(
    head: &Head,
    host: &Host<String>,
    port: u16,
    target: &str,
) -> Result<(), Failure> {
    let mut values = head.values("host");
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(Failure::bad_request(
            "refused: a request needs exactly one Host header".to_owned(),
        ));
    };
    let value = String::from_utf8_lossy(value);
    match authority(value.trim(), Some(80)) {
        Ok((h, p)) if h == *host && p == port => Ok(()),
        _ => Err(Failure::refused(
            Answer::Http(403),
            format!(
                "refused: Host header {:?} does not match the URL's host {target}; they must name the same host",
                clip(value.into_owned(), 200)
            ),
        )),
    }
}

/// The request body's length: `Content-Length`, all copies equal, or none. A chunked
/// body is refused: the proxy forwards exactly one request and would have to parse the
/// chunks to know where it ends.
fn body_length(head: &Head) -> Result<u64, Failure> {
    if head.values("transfer-encoding").next().is_some() {
        return Err(Failure::refused(
            Answer::Http(411),
            "refused: the proxy does not forward Transfer-Encoding request bodies; send Content-Length".to_owned(),
        ));
    }
    let mut length = None;
    for value in head.values("content-length") {
        let parsed = std::str::from_utf8(value)
            .ok()
            .map(str::trim)
            .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|v| v.parse::<u64>().ok());
        match (parsed, length) {
            (Some(n), None) => length = Some(n),
            (Some(n), Some(m)) if n == m => {}
            _ => {
                return Err(Failure::bad_request(
                    "refused: invalid or conflicting Content-Length".to_owned(),
                ));
            }
        }
    }
    Ok(length.unwrap_or(0))
}

/// The request as the origin gets it: origin-form target, no hop-by-hop or `Proxy-*`
/// headers (nor those `Connection` names), `Connection: close`.
fn origin_head(head: &Head, url: &Url) -> Vec<u8> {
    let named: Vec<String> = head
        .values("connection")
        .flat_map(|v| {
            String::from_utf8_lossy(v)
                .split(',')
                .map(|t| t.trim().to_ascii_lowercase())
                .collect::<Vec<_>>()
        })
        .collect();
    let path = match url.query() {
        Some(q) => format!("{}?{q}", url.path()),
        None => url.path().to_owned(),
    };
    let mut out = format!("{} {path} HTTP/1.{}\r\n", head.method, head.version).into_bytes();
    // Host first, as the client sent it (checked equal to the URL's).
    for value in head.values("host") {
        out.extend_from_slice(b"Host: ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    for (name, value) in &head.headers {
        let lower = name.to_ascii_lowercase();
        if HOP_BY_HOP.contains(&lower.as_str())
            || lower.starts_with("proxy-")
            || named.contains(&lower)
        {
            continue;
        }
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"Connection: close\r\n\r\n");
    out
}

/// Writes `bytes` upstream against the call's budget.
async fn send(
    shared: &Shared,
    upstream: &mut TcpStream,
    bytes: &[u8],
    counted: &mut u64,
    on_budget: Answer,
) -> Result<(), Failure> {
    let len = u64::try_from(bytes.len()).unwrap_or(u64::MAX);
    let granted = shared.take(len);
    let part = bytes
        .get(..usize::try_from(granted).unwrap_or(usize::MAX))
        .unwrap_or(bytes);
    let written = upstream.write_all(part).await;
    *counted = counted.saturating_add(granted);
    if granted < len {
        return Err(shared.budget_refusal(on_budget));
    }
    written.map_err(|e| Failure {
        answer: Answer::Close,
        reason: format!("cannot write to the target: {e}"),
        verdict: Verdict::Allowed,
    })
}

/// Why one direction of a relay stopped early.
enum Stopped {
    Budget,
    Io,
}

/// Copies `from` to `to` until end of stream (then half-closes `to`), or until `limit`
/// bytes (then stops reading `from`), counting into `counted` against the call's budget.
async fn pump<R, W>(
    shared: &Shared,
    from: &mut R,
    to: &mut W,
    counted: &mut u64,
    mut limit: Option<u64>,
) -> Result<(), Stopped>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; RELAY_BUFFER];
    loop {
        let want = match limit {
            Some(0) => return Ok(()),
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX).min(buf.len()),
            None => buf.len(),
        };
        let n = from
            .read(buf.get_mut(..want).unwrap_or_default())
            .await
            .map_err(|_| Stopped::Io)?;
        if n == 0 {
            let _ = to.shutdown().await;
            return Ok(());
        }
        let len = u64::try_from(n).unwrap_or(u64::MAX);
        let granted = shared.take(len);
        let part = buf
            .get(..usize::try_from(granted).unwrap_or(0))
            .unwrap_or_default();
        to.write_all(part).await.map_err(|_| Stopped::Io)?;
        *counted = counted.saturating_add(granted);
        if granted < len {
            return Err(Stopped::Budget);
        }
        limit = limit.map(|l| l.saturating_sub(len));
    }
}

/// Relays both ways until both ends are done, either fails, or the budget runs out.
/// `body` bounds what goes upstream (a plain HTTP request's body); `None` for a tunnel.
async fn relay(
    shared: &Shared,
    client: &mut TcpStream,
    upstream: &mut TcpStream,
    attempt: &mut EgressAttempt,
    body: Option<u64>,
) -> Result<(), Failure> {
    let (mut client_read, mut client_write) = client.split();
    let (mut upstream_read, mut upstream_write) = upstream.split();
    let up = pump(
        shared,
        &mut client_read,
        &mut upstream_write,
        &mut attempt.bytes_sent,
        body,
    );
    let down = pump(
        shared,
        &mut upstream_read,
        &mut client_write,
        &mut attempt.bytes_received,
        None,
    );
    match tokio::try_join!(up, down) {
        Ok(_) | Err(Stopped::Io) => Ok(()),
        Err(Stopped::Budget) => Err(shared.budget_refusal(Answer::Close)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities() {
        let ok = |raw: &str| authority(raw, None).map(|(h, p)| (h.to_string(), p));
        assert_eq!(ok("Example.COM.:443"), Ok(("example.com".into(), 443)));
        assert_eq!(ok("2130706433:80"), Ok(("127.0.0.1".into(), 80)));
        assert_eq!(ok("[::1]:8443"), Ok(("[::1]".into(), 8443)));
        for bad in [
            "",
            "example.com",
            "example.com:0",
            "example.com:65536",
            "example.com:+1",
            "u@example.com:443",
            "example.com/x:443",
            "exa mple.com:443",
            "::1:443",
            ":443",
        ] {
            assert!(ok(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            authority("example.com", Some(80)).map(|(h, p)| (h.to_string(), p)),
            Ok(("example.com".into(), 80))
        );
    }

    #[test]
    fn sni_must_be_the_connect_host() {
        let name = Host::Domain("example.com".to_owned());
        assert!(check_sni(&name, Some("example.com")).is_ok());
        assert!(check_sni(&name, Some("EXAMPLE.com")).is_ok());
        let e = check_sni(&name, Some("evil.com")).unwrap_err();
        assert!(
            e.reason
                .contains("SNI \"evil.com\" does not match CONNECT host \"example.com\""),
            "{}",
            e.reason
        );
        assert!(check_sni(&name, None).is_err());
        let addr = Host::Ipv4("93.184.216.34".parse().unwrap());
        assert!(check_sni(&addr, None).is_ok());
        assert!(check_sni(&addr, Some("example.com")).is_err());
    }

    #[test]
    fn the_origin_gets_no_proxy_headers() {
        let head = Head {
            method: "GET".into(),
            target: "http://example.com/a?b=1".into(),
            version: 1,
            headers: [
                ("Host", "example.com"),
                ("Proxy-Authorization", "Basic eA=="),
                ("Proxy-Connection", "keep-alive"),
                ("Connection", "keep-alive, X-Secret"),
                ("X-Secret", "1"),
                ("Keep-Alive", "timeout=5"),
                ("Accept", "*/*"),
            ]
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect(),
            rest: Vec::new(),
        };
        let url = Url::parse(&head.target).unwrap();
        let out = String::from_utf8(origin_head(&head, &url)).unwrap();
        assert_eq!(
            out,
            "GET /a?b=1 HTTP/1.1\r\nHost: example.com\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
    }

    #[test]
    fn clip_keeps_characters_whole() {
        assert_eq!(clip("héllo".into(), 2), "h…");
        assert_eq!(clip("abc".into(), 5), "abc");
    }
}
