//! The egress proxy over real sockets on 127.0.0.1: a proxy per test, with upstream
//! servers of the test's own that record every connection and every byte they get.
//!
//! Loopback is a special-purpose address, so every allowed target is named by an exact
//! `host:port` allow entry (or a `hosts` pin with one), as the rules require.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_worker_http::PrivateAddresses;
use airlock_worker_http::resolve::Lookup;
use airlock_worker_shell::egress::{
    EgressAttempt, EgressConfig, EgressLog, EgressRules, Verdict, serve,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const HTTP_REPLY: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello";
const TLS_REPLY: &[u8] = b"\x16\x03\x03server-hello-and-more";
const TLS_ACCESS_DENIED: &[u8] = &[21, 3, 3, 0, 2, 2, 49];

struct Proxy {
    addr: SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<EgressLog>,
}

impl Proxy {
    fn start(rules: EgressRules) -> Proxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve(listener, Arc::new(rules), stop.clone()));
        Proxy { addr, stop, task }
    }

    /// Ends the call and returns its log; the proxy must stop promptly.
    async fn finish(self) -> EgressLog {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("serve returns soon after stop")
            .unwrap()
    }

    /// Sends `request` and reads the answer to its end.
    async fn exchange(&self, request: &[u8]) -> String {
        let mut s = TcpStream::connect(self.addr).await.unwrap();
        let _ = s.write_all(request).await;
        String::from_utf8_lossy(&read_all(&mut s).await).into_owned()
    }

    /// `CONNECT target`; on a 200, sends `then` and reads to the end. Returns the
    /// proxy's answer head and what came through the tunnel.
    async fn tunnel(&self, target: &str, then: &[u8]) -> (String, Vec<u8>) {
        let mut s = TcpStream::connect(self.addr).await.unwrap();
        s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut b = [0u8; 1];
            match tokio::time::timeout(Duration::from_secs(15), s.read(&mut b)).await {
                Ok(Ok(1)) => head.push(b[0]),
                _ => break,
            }
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        if !head.starts_with("HTTP/1.1 200 ") {
            let rest = read_all(&mut s).await;
            return (head + &String::from_utf8_lossy(&rest), Vec::new());
        }
        s.write_all(then).await.unwrap();
        (head, read_all(&mut s).await)
    }
}

async fn read_all(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(15), s.read_to_end(&mut out)).await;
    out
}

/// A server that counts connections and records every byte of each; it answers `reply`
/// (then half-closes) once it has seen `after` (at once when `after` is empty).
struct Upstream {
    port: u16,
    accepted: Arc<AtomicUsize>,
    done: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl Upstream {
    async fn start(reply: Vec<u8>, after: &'static [u8]) -> Upstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(Mutex::new(Vec::new()));
        let (a, d) = (accepted.clone(), done.clone());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                let (reply, d) = (reply.clone(), d.clone());
                tokio::spawn(async move {
                    let mut got = Vec::new();
                    let mut replied = false;
                    let mut buf = [0u8; 8192];
                    loop {
                        if !replied && contains(&got, after) {
                            let _ = s.write_all(&reply).await;
                            let _ = s.shutdown().await;
                            replied = true;
                        }
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                    }
                    d.lock().unwrap().push(got);
                });
            }
        });
        Upstream {
            port,
            accepted,
            done,
        }
    }

    async fn http() -> Upstream {
        Upstream::start(HTTP_REPLY.to_vec(), b"\r\n\r\n").await
    }

    async fn tls() -> Upstream {
        Upstream::start(TLS_REPLY.to_vec(), b"").await
    }

    fn connections(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// What the first `n` connections received, once they have ended.
    async fn received(&self, n: usize) -> Vec<Vec<u8>> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let done = self.done.lock().unwrap().clone();
            if done.len() >= n || Instant::now() > deadline {
                return done;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}

fn config(allow: &[String], deny: &[&str], hosts: &[(&str, &str)]) -> EgressConfig {
    EgressConfig {
        allow: allow.to_vec(),
        deny: deny.iter().map(|s| s.to_string()).collect(),
        hosts: hosts
            .iter()
            .map(|(n, a)| (n.to_string(), a.to_string()))
            .collect(),
        ..EgressConfig::default()
    }
}

fn rules(allow: &[String], deny: &[&str], hosts: &[(&str, &str)]) -> EgressRules {
    config(allow, deny, hosts).check().unwrap()
}

/// A resolver that answers `ip` for every name and counts the questions.
fn resolver(ip: &'static str, asked: Arc<AtomicUsize>) -> Lookup {
    Arc::new(move |_: &str| {
        asked.fetch_add(1, Ordering::SeqCst);
        Ok(vec![ip.parse().unwrap()])
    })
}

/// A TLS record carrying a ClientHello, with `sni` as its server name (or none).
fn client_hello(sni: Option<&str>) -> Vec<u8> {
    fn vec16(data: &[u8]) -> Vec<u8> {
        let mut v = (data.len() as u16).to_be_bytes().to_vec();
        v.extend_from_slice(data);
        v
    }
    let mut extensions = Vec::new();
    if let Some(name) = sni {
        let mut entry = vec![0u8];
        entry.extend(vec16(name.as_bytes()));
        extensions.extend([0, 0]);
        extensions.extend(vec16(&vec16(&entry)));
    }
    extensions.extend([0, 0x2b]); // supported_versions
    extensions.extend(vec16(&[2, 3, 4]));
    let mut hello = vec![3, 3];
    hello.extend([7u8; 32]);
    hello.push(0);
    hello.extend(vec16(&[0x13, 0x01]));
    hello.extend([1, 0]);
    hello.extend(vec16(&extensions));
    let mut handshake = vec![1, 0];
    handshake.extend((hello.len() as u16).to_be_bytes());
    handshake.extend(hello);
    let mut record = vec![22, 3, 1];
    record.extend(vec16(&handshake));
    record
}

fn only(log: &EgressLog) -> &EgressAttempt {
    assert_eq!(log.attempts.len(), 1, "{log:#?}");
    &log.attempts[0]
}

fn refused_with<'a>(attempt: &'a EgressAttempt, text: &str) -> &'a EgressAttempt {
    assert_eq!(attempt.verdict, Verdict::Refused, "{attempt:#?}");
    let reason = attempt.reason.as_deref().unwrap_or_default();
    assert!(reason.contains(text), "{text:?} not in {reason:?}");
    attempt
}

#[tokio::test]
async fn connect_allowed_through_a_pin_and_relayed_with_bytes_counted() {
    let up = Upstream::tls().await;
    let asked = Arc::new(AtomicUsize::new(0));
    let target = format!("mirror.internal:{}", up.port);
    let rules = rules(
        std::slice::from_ref(&target),
        &[],
        &[("Mirror.Internal", "127.0.0.1")],
    )
    .with_resolver(resolver("192.0.2.1", asked.clone()));
    let proxy = Proxy::start(rules);

    let hello = client_hello(Some("mirror.internal"));
    let mut sent = hello.clone();
    sent.extend_from_slice(b"application data after the hello");
    let (head, body) = proxy.tunnel(&target, &sent).await;
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    assert_eq!(body, TLS_REPLY);
    assert_eq!(up.received(1).await, vec![sent.clone()]);
    assert_eq!(
        asked.load(Ordering::SeqCst),
        0,
        "a pinned name asks no resolver"
    );

    let log = proxy.finish().await;
    let a = only(&log);
    assert_eq!(a.verdict, Verdict::Allowed, "{a:#?}");
    assert_eq!(
        (a.host.as_str(), a.port, a.method),
        ("mirror.internal", up.port, "CONNECT")
    );
    assert_eq!(a.bytes_sent, sent.len() as u64);
    assert_eq!(a.bytes_received, TLS_REPLY.len() as u64);
    assert_eq!(a.reason, None);
    let json = serde_json::to_value(&log.attempts).unwrap();
    assert_eq!(json[0]["verdict"], "allowed");
}

#[tokio::test]
async fn an_unpinned_name_goes_to_the_resolver_not_the_pin() {
    let up = Upstream::tls().await;
    let asked = Arc::new(AtomicUsize::new(0));
    // The resolver answers a documentation address: reachable by no rule.
    let rules = rules(
        &[format!("*.internal:{}", up.port)],
        &[],
        &[("mirror.internal", "127.0.0.1")],
    )
    .with_resolver(resolver("192.0.2.1", asked.clone()));
    let proxy = Proxy::start(rules);
    let (head, _) = proxy
        .tunnel(&format!("other.internal:{}", up.port), b"")
        .await;
    assert!(head.starts_with("HTTP/1.1 403 "), "{head}");
    assert!(head.contains("192.0.2.1 (address of other.internal) is a documentation address"));
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    assert_eq!(up.connections(), 0);
    proxy.finish().await;
}

#[tokio::test]
async fn connect_to_a_host_not_allowed_is_refused_before_any_connection() {
    let allowed = Upstream::tls().await;
    let other = Upstream::tls().await;
    let proxy = Proxy::start(rules(&[format!("127.0.0.1:{}", allowed.port)], &[], &[]));
    let (head, _) = proxy
        .tunnel(&format!("127.0.0.1:{}", other.port), &client_hello(None))
        .await;
    assert!(head.starts_with("HTTP/1.1 403 Forbidden"), "{head}");
    assert!(head.contains("[sandbox.egress] allow"), "{head}");
    let (head, _) = proxy
        .tunnel(&format!("127.0.0.1:{}", allowed.port), &client_hello(None))
        .await;
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    assert_eq!(
        other.connections(),
        0,
        "a refused target is never connected to"
    );
    assert_eq!(allowed.connections(), 1);
    let log = proxy.finish().await;
    assert_eq!(log.attempts.len(), 2);
    // Loopback, not named exactly: the special-address rule is the one that refuses.
    refused_with(&log.attempts[0], "to [sandbox.egress] allow");
    assert_eq!(log.attempts[0].port, other.port);
}

#[tokio::test]
async fn empty_allow_reaches_nothing() {
    let up = Upstream::tls().await;
    let proxy = Proxy::start(rules(&[], &[], &[("mirror.internal", "127.0.0.1")]));
    let (head, _) = proxy
        .tunnel(&format!("mirror.internal:{}", up.port), b"")
        .await;
    assert!(head.starts_with("HTTP/1.1 403 "), "{head}");
    assert!(head.contains("[sandbox.egress] allow is empty"), "{head}");
    assert_eq!(up.connections(), 0);
    proxy.finish().await;
}

#[tokio::test]
async fn deny_beats_allow() {
    let up = Upstream::tls().await;
    let target = format!("mirror.internal:{}", up.port);
    let proxy = Proxy::start(rules(
        std::slice::from_ref(&target),
        &["*.internal"],
        &[("mirror.internal", "127.0.0.1")],
    ));
    let (head, _) = proxy
        .tunnel(&target, &client_hello(Some("mirror.internal")))
        .await;
    assert!(head.starts_with("HTTP/1.1 403 "), "{head}");
    assert_eq!(up.connections(), 0);
    let log = proxy.finish().await;
    refused_with(
        only(&log),
        "matches [sandbox.egress] deny pattern \"*.internal\"",
    );
}

#[tokio::test]
async fn an_ip_literal_needs_an_address_entry() {
    let up = Upstream::tls().await;
    let literal = format!("127.0.0.1:{}", up.port);
    // Private addresses open, so only the literal rule stands between "*" and loopback.
    let open = |allow: &[String]| EgressConfig {
        private_addresses: PrivateAddresses::Allow,
        ..config(allow, &[], &[])
    };
    let proxy = Proxy::start(open(&["*".to_owned()]).check().unwrap());
    let (head, _) = proxy.tunnel(&literal, &client_hello(None)).await;
    assert!(head.starts_with("HTTP/1.1 403 "), "{head}");
    // Other spellings of the same address are the same literal.
    let (head, _) = proxy
        .tunnel(&format!("2130706433:{}", up.port), &client_hello(None))
        .await;
    assert!(head.starts_with("HTTP/1.1 403 "), "{head}");
    let log = proxy.finish().await;
    for a in &log.attempts {
        refused_with(a, "is an IP address");
        assert_eq!(a.host, "127.0.0.1");
    }
    assert_eq!(up.connections(), 0);

    let proxy = Proxy::start(
        open(&["*".to_owned(), "127.0.0.0/8".to_owned()])
            .check()
            .unwrap(),
    );
    let (head, body) = proxy.tunnel(&literal, &client_hello(None)).await;
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    assert_eq!(body, TLS_REPLY);
    // An address target may send no server name, never another one.
    let (head, body) = proxy
        .tunnel(&literal, &client_hello(Some("example.com")))
        .await;
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    assert_eq!(body, TLS_ACCESS_DENIED);
    let log = proxy.finish().await;
    assert_eq!(log.attempts[0].verdict, Verdict::Allowed);
    refused_with(
        &log.attempts[1],
        "does not match CONNECT host \"127.0.0.1\"",
    );
}

#[tokio::test]
async fn sni_mismatch_and_missing_sni_close_the_tunnel_before_any_byte_goes_up() {
    let up = Upstream::tls().await;
    let target = format!("mirror.internal:{}", up.port);
    let proxy = Proxy::start(rules(
        std::slice::from_ref(&target),
        &[],
        &[("mirror.internal", "127.0.0.1")],
    ));
    for sni in [Some("evil.example"), None] {
        let mut sent = client_hello(sni);
        sent.extend_from_slice(b"GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n");
        let (head, body) = proxy.tunnel(&target, &sent).await;
        assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
        assert_eq!(
            body, TLS_ACCESS_DENIED,
            "a TLS alert, not the upstream's bytes"
        );
    }
    // Not TLS at all.
    let (head, body) = proxy.tunnel(&target, b"SSH-2.0-OpenSSH_9.6\r\n").await;
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    assert_eq!(body, TLS_ACCESS_DENIED);

    let log = proxy.finish().await;
    assert_eq!(log.attempts.len(), 3);
    refused_with(
        &log.attempts[0],
        "SNI \"evil.example\" does not match CONNECT host \"mirror.internal\"",
    );
    refused_with(
        &log.attempts[1],
        "SNI (none sent) does not match CONNECT host \"mirror.internal\"",
    );
    refused_with(&log.attempts[2], "CONNECT tunnels carry TLS only");
    for a in &log.attempts {
        assert_eq!((a.bytes_sent, a.bytes_received), (0, 0), "{a:#?}");
    }
    let received = up.received(3).await;
    assert!(received.iter().all(Vec::is_empty), "{received:?}");
}

#[tokio::test]
async fn plain_http_is_forwarded_in_origin_form_and_a_host_mismatch_refused() {
    let up = Upstream::http().await;
    let target = format!("web.internal:{}", up.port);
    let proxy = Proxy::start(rules(
        std::slice::from_ref(&target),
        &[],
        &[("web.internal", "127.0.0.1")],
    ));
    let request = format!(
        "POST http://{target}/a/b?c=1 HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic c2VjcmV0\r\nProxy-Connection: keep-alive\r\nContent-Length: 4\r\n\r\nbodyNEXT REQUEST"
    );
    let answer = proxy.exchange(request.as_bytes()).await;
    assert_eq!(answer.as_bytes(), HTTP_REPLY);
    let forwarded = format!(
        "POST /a/b?c=1 HTTP/1.1\r\nHost: {target}\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbody"
    );
    assert_eq!(
        up.received(1).await,
        vec![forwarded.as_bytes().to_vec()],
        "one request, its body and nothing after it"
    );

    let mismatch = format!("GET http://{target}/ HTTP/1.1\r\nHost: evil.example\r\n\r\n");
    let answer = proxy.exchange(mismatch.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 403 "), "{answer}");
    assert!(
        answer.contains("Host header \"evil.example\" does not match"),
        "{answer}"
    );

    let log = proxy.finish().await;
    assert_eq!(log.attempts.len(), 2);
    let a = &log.attempts[0];
    assert_eq!((a.verdict, a.method), (Verdict::Allowed, "POST"));
    assert_eq!(a.bytes_sent, forwarded.len() as u64);
    assert_eq!(a.bytes_received, HTTP_REPLY.len() as u64);
    refused_with(&log.attempts[1], "does not match the URL's host");
    assert_eq!(up.connections(), 1);
}

#[tokio::test]
async fn requests_the_proxy_does_not_serve() {
    let up = Upstream::http().await;
    let target = format!("web.internal:{}", up.port);
    let proxy = Proxy::start(rules(
        std::slice::from_ref(&target),
        &[],
        &[("web.internal", "127.0.0.1")],
    ));
    for (request, status, reason) in [
        (
            format!("GET / HTTP/1.1\r\nHost: {target}\r\n\r\n"),
            "400",
            "not an absolute http:// URL",
        ),
        (
            format!("GET https://{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n"),
            "400",
            "goes through CONNECT",
        ),
        (
            format!("TRACE http://{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n"),
            "405",
            "method \"TRACE\" is not served",
        ),
        (
            format!(
                "POST http://{target}/ HTTP/1.1\r\nHost: {target}\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            ),
            "411",
            "Transfer-Encoding",
        ),
        (
            format!("GET http://u:p@{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n"),
            "403",
            "user name or password",
        ),
        (
            "\x16\x03\x01garbage that is no request\r\n\r\n".to_owned(),
            "400",
            "not HTTP/1.x",
        ),
        (
            format!(
                "GET http://{target}/ HTTP/1.1\r\nX-Big: {}\r\n\r\n",
                "a".repeat(20_000)
            ),
            "431",
            "over 16384 bytes",
        ),
    ] {
        let answer = proxy.exchange(request.as_bytes()).await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status} ")),
            "{request:.60}: {answer}"
        );
        assert!(answer.contains(reason), "{request:.60}: {answer}");
    }
    let log = proxy.finish().await;
    assert_eq!(log.attempts.len(), 7);
    assert!(log.attempts.iter().all(|a| a.verdict == Verdict::Refused));
    assert_eq!(log.attempts[2].method, "other");
    assert_eq!(up.connections(), 0);
}

#[tokio::test]
async fn a_slow_head_times_out() {
    let proxy = Proxy::start(rules(&["example.com".to_owned()], &[], &[]));
    let started = Instant::now();
    let answer = proxy
        .exchange(b"GET http://example.com/ HTTP/1.1\r\nHost: exam")
        .await;
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(9) && waited < Duration::from_secs(14),
        "{waited:?}"
    );
    let log = proxy.finish().await;
    refused_with(only(&log), "no whole request head within 10 s");
}

#[tokio::test]
async fn a_name_pinned_or_resolved_to_a_special_address_is_refused() {
    let up = Upstream::http().await;
    // The allow entry names the host but not host:port, so it does not open loopback.
    let proxy = Proxy::start(rules(
        &["rebind.example".to_owned()],
        &[],
        &[("rebind.example", "127.0.0.1")],
    ));
    let request = format!(
        "GET http://rebind.example:{0}/ HTTP/1.1\r\nHost: rebind.example:{0}\r\n\r\n",
        up.port
    );
    let answer = proxy.exchange(request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 403 "), "{answer}");
    proxy.finish().await;

    // The same through a resolver that rebinds a public-looking name to a private address.
    let asked = Arc::new(AtomicUsize::new(0));
    let rules = rules(&["*.example".to_owned()], &[], &[])
        .with_resolver(resolver("10.0.0.5", asked.clone()));
    let proxy = Proxy::start(rules);
    let (head, _) = proxy.tunnel("cdn.example:443", b"").await;
    assert!(head.starts_with("HTTP/1.1 403 "), "{head}");
    let log = proxy.finish().await;
    refused_with(
        only(&log),
        "10.0.0.5 (address of cdn.example) is a private-use address",
    );
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    assert_eq!(up.connections(), 0);
}

#[tokio::test]
async fn the_connection_cap_refuses_the_next_connection() {
    let up = Upstream::http().await;
    let target = format!("127.0.0.1:{}", up.port);
    let proxy = Proxy::start(
        EgressConfig {
            max_connections: 2,
            ..config(std::slice::from_ref(&target), &[], &[])
        }
        .check()
        .unwrap(),
    );
    let request = format!("GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n");
    for _ in 0..2 {
        assert_eq!(
            proxy.exchange(request.as_bytes()).await.as_bytes(),
            HTTP_REPLY
        );
    }
    let answer = proxy.exchange(request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 429 "), "{answer}");
    assert!(
        answer.contains("[sandbox.egress] max_connections"),
        "{answer}"
    );
    assert_eq!(up.connections(), 2);
    let log = proxy.finish().await;
    assert_eq!(log.attempts.len(), 3);
    refused_with(&log.attempts[2], "already opened 2 connections");
}

#[tokio::test]
async fn the_byte_cap_closes_the_connection_that_crosses_it() {
    let mut reply = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n".to_vec();
    reply.extend(std::iter::repeat_n(b'x', 100_000));
    let up = Upstream::start(reply, b"\r\n\r\n").await;
    let target = format!("127.0.0.1:{}", up.port);
    let proxy = Proxy::start(
        EgressConfig {
            max_bytes: 1000,
            ..config(std::slice::from_ref(&target), &[], &[])
        }
        .check()
        .unwrap(),
    );
    let request = format!("GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n");
    let first = proxy.exchange(request.as_bytes()).await;
    assert!(first.starts_with("HTTP/1.1 200 OK"), "{first:.40}");
    // The budget is spent: the next request is refused before connecting.
    let answer = proxy.exchange(request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 403 "), "{answer}");
    let log = proxy.finish().await;
    assert_eq!(log.attempts.len(), 2);
    let a = refused_with(&log.attempts[0], "[sandbox.egress] max_bytes");
    assert_eq!(a.bytes_sent + a.bytes_received, 1000, "{a:#?}");
    assert_eq!(
        a.bytes_received as usize,
        first.len(),
        "the client got what was counted"
    );
    refused_with(&log.attempts[1], "has relayed 1000 bytes");
    assert_eq!(up.connections(), 1);
}

#[tokio::test]
async fn a_flood_of_connections_is_bounded_in_count_and_time() {
    let proxy = Proxy::start(rules(&["example.com".to_owned()], &[], &[]));
    let started = Instant::now();
    let mut clients = Vec::new();
    for i in 0..200 {
        let addr = proxy.addr;
        clients.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let _ = s
                .write_all(format!("NONSENSE {i}\r\n\r\n").as_bytes())
                .await;
            String::from_utf8_lossy(&read_all(&mut s).await).into_owned()
        }));
    }
    let mut statuses = std::collections::BTreeMap::new();
    for c in clients {
        let answer = c.await.unwrap();
        *statuses
            .entry(answer.get(..12).unwrap_or(&answer).to_owned())
            .or_insert(0) += 1;
    }
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    // 64 (max_connections) read and refused as garbage, the rest refused by the cap.
    assert_eq!(statuses.get("HTTP/1.1 400"), Some(&64), "{statuses:?}");
    assert_eq!(statuses.get("HTTP/1.1 429"), Some(&136), "{statuses:?}");
    let log = proxy.finish().await;
    assert_eq!(log.attempts.len() as u64 + log.dropped, 200);
    assert!(log.attempts.len() <= 256);

    // Idle connections are all closed when the call ends, long before any timeout.
    let proxy = Proxy::start(rules(&["example.com".to_owned()], &[], &[]));
    let mut idle = Vec::new();
    for _ in 0..200 {
        if let Ok(s) = TcpStream::connect(proxy.addr).await {
            idle.push(s);
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let log = proxy.finish().await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(!log.attempts.is_empty() && log.attempts.len() <= 200);
    for a in &log.attempts {
        assert_eq!(a.verdict, Verdict::Refused);
    }
}

#[tokio::test]
async fn a_narrowed_list_refuses_what_the_tool_does_not_allow() {
    let a = Upstream::http().await;
    let b = Upstream::http().await;
    let (ta, tb) = (
        format!("127.0.0.1:{}", a.port),
        format!("127.0.0.1:{}", b.port),
    );
    let base = rules(&[ta.clone(), tb.clone()], &[], &[]);
    let proxy = Proxy::start(base.narrowed(std::slice::from_ref(&ta)).unwrap());
    for t in [&ta, &tb] {
        let _ = proxy
            .exchange(format!("GET http://{t}/ HTTP/1.1\r\nHost: {t}\r\n\r\n").as_bytes())
            .await;
    }
    let log = proxy.finish().await;
    assert_eq!(log.attempts[0].verdict, Verdict::Allowed);
    refused_with(&log.attempts[1], "to the tool's egress_allow");
    assert_eq!((a.connections(), b.connections()), (1, 0));
}
