//! The http tools, called the way the worker runtime calls them, against small HTTP/1.1
//! servers that each test starts on loopback (random free ports). Every refusal test
//! also checks that the target server saw no connection.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_worker::{CallContext, CancellationToken, SessionId, ToolOutcome};
use airlock_worker_http::declared::{HttpTemplate, ToolEntry};
use airlock_worker_http::{
    HttpConfig, check_egress, tools, tools_with_declared, tools_with_resolver,
};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

// ---------------------------------------------------------------- test server

/// What the server answers to one request.
enum Reply {
    /// A complete response.
    Full {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
    /// 200 and a body that never ends (bounded to 2 GiB so the loop ends).
    Endless,
    /// Reads the request and answers nothing for 30 s.
    Hang,
}

fn ok(content_type: &str, body: impl Into<Vec<u8>>) -> Reply {
    Reply::Full {
        status: 200,
        headers: vec![("Content-Type".into(), content_type.into())],
        body: body.into(),
    }
}

fn redirect(status: u16, location: &str) -> Reply {
    Reply::Full {
        status,
        headers: vec![("Location".into(), location.into())],
        body: b"moved".to_vec(),
    }
}

type Handler = dyn Fn(&Seen) -> Reply + Send + Sync;

/// One request as the server received it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    target: String,
    head: String,
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().skip(1).find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
    }
}

struct Server {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    requests: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    async fn start(handler: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let handler: Arc<Handler> = Arc::new(handler);
        let (c, r) = (Arc::clone(&connections), Arc::clone(&requests));
        let task = tokio::spawn(async move {
            for _ in 0..10_000 {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                c.fetch_add(1, Ordering::SeqCst);
                let (handler, r) = (Arc::clone(&handler), Arc::clone(&r));
                tokio::spawn(async move {
                    let _ = answer(stream, &*handler, &r).await;
                });
            }
        });
        Server {
            addr,
            connections,
            requests,
            task,
        }
    }

    /// A server that must never be reached; it answers 200 "reached" if it is.
    async fn canary() -> Server {
        Server::start(|_| ok("text/plain", "reached")).await
    }

    fn port(&self) -> u16 {
        self.addr.port()
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn hits(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    fn seen(&self) -> Vec<Seen> {
        self.requests.lock().unwrap().clone()
    }
}

async fn answer(
    mut stream: TcpStream,
    handler: &Handler,
    log: &Mutex<Vec<Seen>>,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > 64 * 1024 {
            return Ok(());
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut body = buf[head_end..].to_vec();
    let mut seen = Seen {
        method: head.split(' ').next().unwrap_or("").to_owned(),
        target: head.split(' ').nth(1).unwrap_or("").to_owned(),
        head,
        body: Vec::new(),
    };
    let length: usize = seen
        .header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    while body.len() < length.min(16 * 1024 * 1024) {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    seen.body = body;
    log.lock().unwrap().push(seen.clone());
    match handler(&seen) {
        Reply::Full {
            status,
            headers,
            body,
        } => {
            let mut out = format!("HTTP/1.1 {status} X\r\nContent-Length: {}\r\n", body.len());
            for (n, v) in headers {
                out.push_str(&format!("{n}: {v}\r\n"));
            }
            out.push_str("Connection: close\r\n\r\n");
            stream.write_all(out.as_bytes()).await?;
            if seen.method != "HEAD" {
                stream.write_all(&body).await?;
            }
        }
        Reply::Endless => {
            stream
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
                .await?;
            let block = vec![b'a'; 64 * 1024];
            for _ in 0..32 * 1024 {
                stream.write_all(&block).await?;
            }
        }
        Reply::Hang => tokio::time::sleep(Duration::from_secs(30)).await,
    }
    stream.shutdown().await
}

// ---------------------------------------------------------------- calling the tools

fn config_toml(toml_text: &str) -> HttpConfig {
    #[derive(serde::Deserialize)]
    struct File {
        http: HttpConfig,
    }
    toml::from_str::<File>(toml_text).unwrap().http
}

fn allowing(servers: &[&Server]) -> HttpConfig {
    let list: Vec<String> = servers
        .iter()
        .map(|s| format!("\"127.0.0.1:{}\"", s.port()))
        .collect();
    config_toml(&format!("[http]\nallow = [{}]\n", list.join(", ")))
}

fn ctx_with(cancel: CancellationToken) -> CallContext {
    let (tx, _rx) = tokio::sync::mpsc::channel(16);
    CallContext::new(
        "call-1".into(),
        "alice".into(),
        SessionId::parse("s1").unwrap(),
        Instant::now() + Duration::from_secs(60),
        cancel,
        tx,
    )
}

async fn call(config: &HttpConfig, tool: &str, args: Value) -> ToolOutcome {
    let set = tools(config.clone()).unwrap();
    set.get(tool)
        .unwrap()
        .execute(args, ctx_with(CancellationToken::new()))
        .await
}

/// A successful call's JSON object.
async fn call_ok(config: &HttpConfig, tool: &str, args: Value) -> Value {
    let out = call(config, tool, args.clone()).await;
    assert!(!out.is_error, "{tool} {args} failed: {:?}", out.content);
    assert_eq!(out.content.len(), 1, "one text block");
    serde_json::from_str(&out.content[0]).unwrap()
}

/// A failed call's message.
async fn call_err(config: &HttpConfig, tool: &str, args: Value) -> String {
    let out = call(config, tool, args.clone()).await;
    assert!(
        out.is_error,
        "{tool} {args} should fail, got {:?}",
        out.content
    );
    out.content.join("\n")
}

async fn get(config: &HttpConfig, url: &str) -> Value {
    call_ok(config, "http_request", json!({"method": "GET", "url": url})).await
}

async fn get_err(config: &HttpConfig, url: &str) -> String {
    call_err(config, "http_request", json!({"method": "GET", "url": url})).await
}

// ---------------------------------------------------------------- tests

#[tokio::test]
async fn allowed_port_works_while_another_port_is_refused() {
    let allowed = Server::start(|req| {
        ok(
            "application/json",
            json!({
                "method": req.method,
                "target": req.target,
                "host": req.header("host"),
                "ua": req.header("user-agent"),
                "accept_encoding": req.header("accept-encoding"),
                "x_token": req.header("x-token"),
                "body": String::from_utf8_lossy(&req.body),
            })
            .to_string(),
        )
    })
    .await;
    let other = Server::canary().await;
    let config = allowing(&[&allowed]);

    let out = get(&config, &allowed.url("/hello?x=1#frag")).await;
    assert_eq!(out["status"], 200);
    assert_eq!(out["body_encoding"], "text");
    assert_eq!(out["truncated"], false);
    assert_eq!(out["final_url"], allowed.url("/hello?x=1#frag"));
    assert!(out["duration_ms"].is_u64());
    assert_eq!(out["headers"]["content-type"], "application/json");
    let echoed: Value = serde_json::from_str(out["body"].as_str().unwrap()).unwrap();
    assert_eq!(echoed["method"], "GET");
    assert_eq!(echoed["target"], "/hello?x=1");
    assert_eq!(echoed["host"], format!("127.0.0.1:{}", allowed.port()));
    assert!(
        echoed["ua"].as_str().unwrap().starts_with("Airlock/"),
        "{echoed}"
    );
    assert_eq!(echoed["accept_encoding"], "gzip");

    let out = call_ok(
        &config,
        "http_request",
        json!({
            "method": "post",
            "url": allowed.url("/items"),
            "headers": {"X-Token": "t0k", "Content-Type": "application/json"},
            "body": "{\"name\":\"café\"}",
        }),
    )
    .await;
    let echoed: Value = serde_json::from_str(out["body"].as_str().unwrap()).unwrap();
    assert_eq!(echoed["method"], "POST");
    assert_eq!(echoed["x_token"], "t0k");
    assert_eq!(echoed["body"], "{\"name\":\"café\"}");

    let e = get_err(&config, &other.url("/")).await;
    assert!(
        e.contains("refused: 127.0.0.1 is a loopback address (special-purpose)")
            && e.contains(&format!(
                "adds \"127.0.0.1:{}\" to [http] allow",
                other.port()
            )),
        "{e}"
    );
    let e = call_err(&config, "fetch_url", json!({"url": other.url("/")})).await;
    assert!(e.contains("loopback"), "{e}");
    assert_eq!(other.hits(), 0, "the refused server saw a connection");
    assert_eq!(allowed.hits(), 2);
}

#[tokio::test]
async fn redirects_are_rechecked_and_bounded() {
    let canary = Server::canary().await;
    let canary_url = canary.url("/secret");
    let canary_port = canary.port();
    let server = Server::start(move |req| {
        let t = req.target.as_str();
        if let Some(n) = t.strip_prefix("/chain/") {
            let n: u32 = n.parse().unwrap();
            return if n == 0 {
                ok("text/plain", "arrived")
            } else {
                redirect(302, &format!("/chain/{}", n - 1))
            };
        }
        if let Some(n) = t.strip_prefix("/loop/") {
            let n: u32 = n.parse().unwrap();
            return redirect(307, &format!("/loop/{}", n + 1));
        }
        match t {
            "/to-canary" => redirect(302, &canary_url),
            "/to-canary-by-name" => redirect(301, &format!("http://localhost:{canary_port}/")),
            "/to-metadata" => redirect(302, "http://169.254.169.254/latest/meta-data/"),
            "/to-decimal" => redirect(302, &format!("http://2130706433:{canary_port}/")),
            "/to-file" => redirect(302, "file:///etc/passwd"),
            "/see-other" => redirect(303, "/chain/0"),
            _ => ok("text/plain", "?"),
        }
    })
    .await;
    let config = allowing(&[&server]);

    // A chain inside the allowed server is followed.
    let out = get(&config, &server.url("/chain/3")).await;
    assert_eq!(out["status"], 200);
    assert_eq!(out["body"], "arrived");
    assert_eq!(out["redirects"], 3);
    assert_eq!(out["final_url"], server.url("/chain/0"));

    // 303 turns a POST into a GET without body.
    let out = call_ok(
        &config,
        "http_request",
        json!({"method": "POST", "url": server.url("/see-other"), "body": "x"}),
    )
    .await;
    assert_eq!(out["body"], "arrived");
    let last = server.seen().last().cloned().unwrap();
    assert_eq!((last.method.as_str(), last.body.len()), ("GET", 0));

    // Redirects to refused targets are stopped, whatever their spelling.
    for (path, rule) in [
        ("/to-canary", "loopback"),
        ("/to-canary-by-name", "(address of localhost)"),
        ("/to-metadata", "169.254.169.254 is a link-local address"),
        ("/to-decimal", "127.0.0.1 is a loopback address"),
        ("/to-file", "scheme \"file\" is not allowed"),
    ] {
        let e = get_err(&config, &server.url(path)).await;
        assert!(e.starts_with("stopped at redirect 1 from "), "{path}: {e}");
        assert!(e.contains(rule), "{path}: {e}");
        let e = call_err(&config, "fetch_url", json!({"url": server.url(path)})).await;
        assert!(e.contains(rule), "fetch_url {path}: {e}");
    }
    assert_eq!(
        canary.hits(),
        0,
        "a refused redirect target saw a connection"
    );

    // More than 5 redirects: stopped, and exactly 6 requests were made.
    let before = server.hits();
    let e = get_err(&config, &server.url("/loop/0")).await;
    assert!(e.contains("stopped after 5 redirects"), "{e}");
    assert!(e.contains("/loop/6"), "{e}");
    assert_eq!(server.hits() - before, 6);
}

#[tokio::test]
async fn every_spelling_of_loopback_and_metadata_is_refused() {
    let canary = Server::canary().await;
    let p = canary.port();
    // Even with the canary's exact port allowed for *another* spelling, nothing below
    // names 127.0.0.1:<p> exactly... except the URL parser's normalised form, so keep
    // allow empty: the public-internet default.
    let config = HttpConfig::default();
    let cases = [
        (
            format!("http://2130706433:{p}/"),
            "127.0.0.1 is a loopback address",
        ),
        (
            format!("http://0177.0.0.1:{p}/"),
            "127.0.0.1 is a loopback address",
        ),
        (
            format!("http://0x7f000001:{p}/"),
            "127.0.0.1 is a loopback address",
        ),
        (
            format!("http://0x7f.0.0.1:{p}/"),
            "127.0.0.1 is a loopback address",
        ),
        (
            format!("http://127.1:{p}/"),
            "127.0.0.1 is a loopback address",
        ),
        (
            format!("http://127.0.0.1:{p}/"),
            "127.0.0.1 is a loopback address",
        ),
        (
            format!("http://127.9.9.9:{p}/"),
            "127.9.9.9 is a loopback address",
        ),
        (format!("http://[::1]:{p}/"), "::1 is the loopback address"),
        (
            format!("http://[::ffff:127.0.0.1]:{p}/"),
            "::ffff:127.0.0.1 is an IPv4-mapped form of 127.0.0.1, a loopback address",
        ),
        (
            format!("http://[::ffff:7f00:1]:{p}/"),
            "::ffff:127.0.0.1 is an IPv4-mapped form of 127.0.0.1, a loopback address",
        ),
        (format!("http://[::]:{p}/"), ":: is the unspecified address"),
        (format!("http://0.0.0.0:{p}/"), "0.0.0.0 is an unspecified"),
        (format!("http://0:{p}/"), "0.0.0.0 is an unspecified"),
        (format!("http://localhost:{p}/"), "(address of localhost)"),
        (format!("http://LOCALHOST.:{p}/"), "(address of localhost)"),
        (
            "http://169.254.169.254/latest/meta-data/".into(),
            "169.254.169.254 is a link-local address",
        ),
        (
            "http://[::ffff:169.254.169.254]/".into(),
            "IPv4-mapped form of 169.254.169.254, a link-local",
        ),
        (
            "http://0xa9fea9fe/".into(),
            "169.254.169.254 is a link-local",
        ),
        (
            "http://[fe80::1]/".into(),
            "fe80::1 is a link-local address",
        ),
        ("http://[64:ff9b::7f00:1]/".into(), "a NAT64 form of"),
        ("http://[64:ff9b::a9fe:a9fe]/".into(), "a NAT64 form of"),
        (
            "http://[2002:7f00:1::]/".into(),
            "is a 6to4 form of 127.0.0.1",
        ),
        ("http://100.64.0.1/".into(), "is a shared (CGNAT) address"),
        ("http://10.0.0.1/".into(), "is a private-use address"),
        ("http://192.168.0.1/".into(), "is a private-use address"),
        ("http://172.16.0.1/".into(), "is a private-use address"),
        ("http://[fd00::1]/".into(), "unique-local"),
        ("http://224.0.0.1/".into(), "multicast"),
        ("http://255.255.255.255/".into(), "broadcast"),
    ];
    for (url, rule) in &cases {
        for tool in ["http_request", "fetch_url"] {
            let args = if tool == "fetch_url" {
                json!({"url": url})
            } else {
                json!({"method": "GET", "url": url})
            };
            let e = call_err(&config, tool, args).await;
            assert!(e.starts_with("refused: "), "{tool} {url}: {e}");
            assert!(e.contains("(special-purpose)"), "{tool} {url}: {e}");
            assert!(e.contains(rule), "{tool} {url}: {e}");
        }
    }
    assert_eq!(canary.hits(), 0, "a loopback spelling reached the server");
}

#[tokio::test]
async fn names_resolving_to_private_addresses_are_refused() {
    let server = Server::start(|_| ok("text/plain", "via name")).await;
    let p = server.port();

    // End to end: localhost resolves (through /etc/hosts) to loopback.
    let e = get_err(&HttpConfig::default(), &format!("http://localhost:{p}/")).await;
    assert!(
        e.contains("is the loopback address") || e.contains("is a loopback address"),
        "{e}"
    );
    assert!(e.contains("(address of localhost)"), "{e}");
    assert!(
        e.contains(&format!("adds \"localhost:{p}\" to [http] allow")),
        "{e}"
    );
    assert_eq!(server.hits(), 0);

    // Naming exactly localhost:<port> opens it (and only that port).
    let config = config_toml(&format!("[http]\nallow = [\"localhost:{p}\"]\n"));
    let out = get(&config, &format!("http://localhost:{p}/")).await;
    assert_eq!(out["body"], "via name");
    let e = get_err(
        &config,
        &format!("http://localhost:{}/", p.wrapping_add(1).max(1)),
    )
    .await;
    assert!(e.contains("refused: "), "{e}");

    // Injected resolutions: a public name that rebinds to internal addresses.
    let open = HttpConfig::default();
    for (addrs, rule) in [
        (
            vec!["127.0.0.1"],
            "127.0.0.1 (address of rebind.example) is a loopback",
        ),
        (
            vec!["93.184.216.34", "10.1.2.3"],
            "10.1.2.3 (address of rebind.example)",
        ),
        (vec!["169.254.169.254"], "link-local"),
        (vec!["::ffff:a9fe:a9fe"], "IPv4-mapped"),
        (vec!["64:ff9b::a00:1"], "NAT64"),
        (vec!["fe80::1"], "link-local"),
    ] {
        let addrs = addrs.iter().map(|a| a.parse().unwrap()).collect();
        let e = check_egress(&open, "https://rebind.example/", addrs).unwrap_err();
        assert!(e.contains(rule), "{e}");
    }
    let ok = check_egress(
        &open,
        "https://rebind.example/",
        vec!["93.184.216.34".parse().unwrap()],
    )
    .unwrap();
    assert_eq!(ok, vec!["93.184.216.34:443".parse().unwrap()]);
}

#[tokio::test]
async fn deny_wins_over_allow() {
    let server = Server::canary().await;
    let config = config_toml(&format!(
        "[http]\nallow = [\"127.0.0.1:{}\"]\ndeny = [\"127.0.0.0/8\"]\n",
        server.port()
    ));
    let e = get_err(&config, &server.url("/")).await;
    assert_eq!(
        e,
        format!(
            "refused: host 127.0.0.1:{} matches [http] deny pattern \"127.0.0.0/8\"",
            server.port()
        )
    );
    let config = config_toml("[http]\nallow = [\"*.example.com\"]\ndeny = [\"bad.example.com\"]\n");
    let e = get_err(&config, "http://bad.example.com/").await;
    assert!(e.contains("deny pattern \"bad.example.com\""), "{e}");
    let e = get_err(&config, "http://example.org/").await;
    assert!(e.contains("is not in [http] allow"), "{e}");
    assert_eq!(server.hits(), 0);
}

#[tokio::test]
async fn slow_server_hits_the_timeout_and_cancel_stops_a_call() {
    let server = Server::start(|_| Reply::Hang).await;
    let config = allowing(&[&server]);
    let started = Instant::now();
    let e = call_err(
        &config,
        "http_request",
        json!({"method": "GET", "url": server.url("/"), "timeout_seconds": 0.5}),
    )
    .await;
    // The server never answers: only the call's own 0.5 s timeout can end it.
    assert!(e.contains("timed out after 0.5 s (timeout_seconds)"), "{e}");
    eprintln!(
        "a 0.5 s timeout ended the call after {:?} (measured, not asserted)",
        started.elapsed()
    );

    // The config's total timeout applies to fetch_url too.
    let short = HttpConfig {
        timeout_ms: 300,
        ..config.clone()
    };
    let e = call_err(&short, "fetch_url", json!({"url": server.url("/")})).await;
    assert!(
        e.contains("timed out after 0.3 s ([http] timeout_ms)"),
        "{e}"
    );

    // The cancel is sent once the server holds the request: the call is in flight.
    let cancel = CancellationToken::new();
    let set = tools(config).unwrap();
    let before = server.seen().len();
    let trigger = async {
        let deadline = Instant::now() + Duration::from_secs(20);
        while server.seen().len() == before {
            assert!(
                Instant::now() < deadline,
                "the request never reached the server"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        cancel.cancel();
    };
    let started = Instant::now();
    let tool = set.get("http_request").unwrap();
    let (out, ()) = tokio::join!(
        tool.execute(
            json!({"method": "GET", "url": server.url("/")}),
            ctx_with(cancel.clone()),
        ),
        trigger
    );
    assert!(
        out.is_error && out.content[0].contains("was cancelled"),
        "{out:?}"
    );
    eprintln!(
        "cancelled after {:?} (measured, not asserted)",
        started.elapsed()
    );
}

#[tokio::test]
async fn endless_body_is_capped() {
    let server = Server::start(|_| Reply::Endless).await;
    let config = allowing(&[&server]);
    let started = Instant::now();
    let out = call_ok(
        &config,
        "http_request",
        json!({"method": "GET", "url": server.url("/"), "max_response_bytes": 100_000}),
    )
    .await;
    assert_eq!(out["truncated"], true);
    assert_eq!(out["body_bytes"], 100_000);
    assert_eq!(out["body"].as_str().unwrap().len(), 100_000);
    assert!(
        out["note"].as_str().unwrap().contains("max_response_bytes"),
        "{out}"
    );

    // The config's cap applies when the call names none (5 MiB by default).
    let out = get(&config, &server.url("/")).await;
    assert_eq!(out["truncated"], true);
    assert_eq!(out["body_bytes"], 5 * 1024 * 1024);

    // fetch_url reads at most max_response_bytes and pages the rest.
    let small = HttpConfig {
        max_response_bytes: 50_000,
        ..config.clone()
    };
    let out = call_ok(
        &small,
        "fetch_url",
        json!({"url": server.url("/"), "max_length": 10}),
    )
    .await;
    assert_eq!(out["body_truncated"], true);
    assert_eq!(out["total_chars"], 50_000);
    assert_eq!(out["content"], "aaaaaaaaaa");
    eprintln!(
        "three capped reads of an endless body: {:?} (measured, not asserted)",
        started.elapsed()
    );
}

/// A gzip stream of `mib` MiB of zeros, built from one compressed, fully flushed MiB
/// repeated (each copy is an independent run of deflate blocks), with a correct trailer.
fn gzip_zeros(mib: usize) -> Vec<u8> {
    let zeros = vec![0u8; 1 << 20];
    let mut deflate = flate2::Compress::new(flate2::Compression::best(), false);
    let mut block = Vec::with_capacity(1 << 16);
    deflate
        .compress_vec(&zeros, &mut block, flate2::FlushCompress::Full)
        .unwrap();
    assert_eq!(deflate.total_in(), zeros.len() as u64);
    assert!(
        block.ends_with(&[0, 0, 0xff, 0xff]),
        "full flush ends byte-aligned"
    );
    let mut crc_one = flate2::Crc::new();
    crc_one.update(&zeros);
    let mut crc = flate2::Crc::new();
    let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff];
    for _ in 0..mib {
        out.extend_from_slice(&block);
        crc.combine(&crc_one);
    }
    out.extend_from_slice(&[0x03, 0x00]); // final, empty fixed-Huffman block
    out.extend_from_slice(&crc.sum().to_le_bytes());
    out.extend_from_slice(&((mib as u64 * (1 << 20)) as u32).to_le_bytes());
    out
}

#[tokio::test]
async fn gzip_bomb_is_bounded_and_gzip_is_decoded() {
    let bomb = gzip_zeros(1024); // 1 GiB of zeros
    let small = gzip_zeros(2);
    assert!(bomb.len() < 8 * 1024 * 1024, "bomb is {} bytes", bomb.len());
    // The small one really decodes to 2 MiB (the construction is valid gzip).
    let mut decoded = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&small[..]), &mut decoded)
        .unwrap();
    assert_eq!(decoded.len(), 2 << 20);

    let mut page = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    page.write_all("<html><body><h1>Zipped café</h1></body></html>".as_bytes())
        .unwrap();
    let page = page.finish().unwrap();
    let server = Server::start(move |req| {
        let body = match req.target.as_str() {
            "/bomb" => bomb.clone(),
            "/page" => page.clone(),
            _ => small.clone(),
        };
        let ct = if req.target == "/page" {
            "text/html; charset=utf-8"
        } else {
            "application/octet-stream"
        };
        Reply::Full {
            status: 200,
            headers: vec![
                ("Content-Type".into(), ct.into()),
                ("Content-Encoding".into(), "gzip".into()),
            ],
            body,
        }
    })
    .await;
    let config = allowing(&[&server]);

    let started = Instant::now();
    let out = call_ok(
        &config,
        "http_request",
        json!({"method": "GET", "url": server.url("/bomb"), "max_response_bytes": 1_048_576}),
    )
    .await;
    assert_eq!(out["truncated"], true);
    assert_eq!(out["body_bytes"], 1_048_576);
    assert_eq!(out["body_encoding"], "base64");
    assert!(
        out["note"]
            .as_str()
            .unwrap()
            .contains("decoded (gzip) body cut"),
        "{out}"
    );
    let default_cap = get(&config, &server.url("/bomb")).await;
    assert_eq!(default_cap["body_bytes"], 5 * 1024 * 1024);
    assert_eq!(default_cap["truncated"], true);
    eprintln!(
        "two capped reads of a 1 GiB gzip bomb: {:?} (measured, not asserted)",
        started.elapsed()
    );

    let out = get(&config, &server.url("/small")).await;
    assert_eq!(
        (out["truncated"].clone(), out["body_bytes"].clone()),
        (json!(false), json!(2 << 20))
    );

    let out = call_ok(&config, "fetch_url", json!({"url": server.url("/page")})).await;
    assert_eq!(out["content"], "# Zipped café");
}

const PAGE: &str = r#"<!DOCTYPE html>
<html><head>{meta}<title>Le Café</title>
<style>body { font-family: serif }</style>
<script>document.write("tracking")</script></head>
<body>
<h1>Café de Flore</h1>
<p>Open <strong>every</strong> day, see the <a href="/menu">menu</a> or
<a href="https://example.org/map">the map</a>.</p>
<h2>Spécialités</h2>
<ul>
  <li>Crêpes à la crème</li>
  <li>Café noir</li>
</ul>
<ol><li>First</li><li>Second</li></ol>
<script type="text/javascript">var secret = "do not show";</script>
</body></html>"#;

fn latin1(s: &str) -> Vec<u8> {
    s.chars()
        .map(|c| u8::try_from(u32::from(c)).unwrap())
        .collect()
}

#[tokio::test]
async fn html_pages_in_utf8_and_latin1_convert() {
    let server = Server::start(|req| {
        let page = |meta: &str| PAGE.replace("{meta}", meta);
        match req.target.as_str() {
            "/utf8" => ok("text/html; charset=utf-8", page("")),
            "/utf8-undeclared" => ok("text/html", page("")),
            "/latin1-header" => ok("text/html; charset=ISO-8859-1", latin1(&page(""))),
            "/latin1-meta" => ok("text/html", latin1(&page("<meta charset=\"iso-8859-1\">"))),
            "/latin1-equiv" => ok(
                "text/html",
                latin1(&page(
                    "<meta http-equiv=\"Content-Type\" content=\"text/html; charset=latin1\">",
                )),
            ),
            "/plain" => ok("text/plain; charset=iso-8859-1", latin1("café au lait\n")),
            "/image" => ok("image/png", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec()),
            _ => Reply::Full {
                status: 404,
                headers: vec![],
                body: b"not found".to_vec(),
            },
        }
    })
    .await;
    let config = allowing(&[&server]);
    let menu = server.url("/menu");

    for path in [
        "/utf8",
        "/utf8-undeclared",
        "/latin1-header",
        "/latin1-meta",
        "/latin1-equiv",
    ] {
        let out = call_ok(&config, "fetch_url", json!({"url": server.url(path)})).await;
        let md = out["content"].as_str().unwrap();
        assert_eq!(out["status"], 200, "{path}");
        assert!(
            md.starts_with("# Le Café\n\n# Café de Flore\n\n"),
            "{path}: {md}"
        );
        assert!(
            md.contains(&format!(
                "Open **every** day, see the [menu]({menu}) or [the map](https://example.org/map)."
            )),
            "{path}: {md}"
        );
        assert!(md.contains("## Spécialités"), "{path}: {md}");
        assert!(
            md.contains("- Crêpes à la crème\n- Café noir"),
            "{path}: {md}"
        );
        assert!(md.contains("1. First\n2. Second"), "{path}: {md}");
        for hidden in ["tracking", "font-family", "do not show", "<"] {
            assert!(!md.contains(hidden), "{path}: {hidden:?} in {md}");
        }
        assert_eq!(out["truncated"], false);
        assert_eq!(out["total_chars"], md.chars().count());

        let text = call_ok(
            &config,
            "fetch_url",
            json!({"url": server.url(path), "format": "text"}),
        )
        .await["content"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(
            text.contains("Café de Flore\n\nOpen every day, see the menu or the map."),
            "{path}: {text}"
        );
        assert!(text.contains("- Crêpes à la crème"), "{path}: {text}");
        assert!(
            !text.contains("**") && !text.contains("tracking"),
            "{path}: {text}"
        );

        let raw = call_ok(
            &config,
            "fetch_url",
            json!({"url": server.url(path), "format": "raw"}),
        )
        .await["content"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(
            raw.contains("<h1>Café de Flore</h1>") && raw.contains("<script>"),
            "{path}"
        );
    }

    // Paging in characters: the pages put together are the whole content.
    let whole = call_ok(
        &config,
        "fetch_url",
        json!({"url": server.url("/latin1-meta")}),
    )
    .await;
    let whole = whole["content"].as_str().unwrap();
    let mut joined = String::new();
    let mut start = 0u64;
    for _ in 0..100 {
        let out = call_ok(
            &config,
            "fetch_url",
            json!({"url": server.url("/latin1-meta"), "start_index": start, "max_length": 37}),
        )
        .await;
        joined.push_str(out["content"].as_str().unwrap());
        assert!(out["returned_chars"].as_u64().unwrap() <= 37);
        match out.get("next_start_index") {
            Some(next) => {
                assert_eq!(out["truncated"], true);
                assert!(
                    out["note"]
                        .as_str()
                        .unwrap()
                        .contains(&format!("start_index={next}"))
                );
                start = next.as_u64().unwrap();
            }
            None => break,
        }
    }
    assert_eq!(joined, whole);
    let e = call_err(
        &config,
        "fetch_url",
        json!({"url": server.url("/utf8"), "start_index": 1_000_000}),
    )
    .await;
    assert!(e.contains("past the end"), "{e}");

    // Plain text honours its charset; binary is refused by fetch_url and base64 in
    // http_request; a 404 is a normal result with its status.
    let out = call_ok(&config, "fetch_url", json!({"url": server.url("/plain")})).await;
    assert_eq!(out["content"], "café au lait\n");
    let out = get(&config, &server.url("/plain")).await;
    assert_eq!(out["body"], "café au lait\n");
    let e = call_err(&config, "fetch_url", json!({"url": server.url("/image")})).await;
    assert!(
        e.contains("image/png") && e.contains("use http_request"),
        "{e}"
    );
    let out = get(&config, &server.url("/image")).await;
    assert_eq!(out["body_encoding"], "base64");
    assert_eq!(out["body"], "iVBORw0KGgoAAAANSUhEUg==");
    let out = call_ok(&config, "fetch_url", json!({"url": server.url("/missing")})).await;
    assert_eq!(
        (out["status"].clone(), out["content"].clone()),
        (json!(404), json!("not found"))
    );
}

#[tokio::test]
async fn forbidden_request_headers_and_oversized_bodies_are_refused() {
    let server = Server::canary().await;
    let config = allowing(&[&server]);
    for header in [
        "Host",
        "Connection",
        "Keep-Alive",
        "Transfer-Encoding",
        "TE",
        "Trailer",
        "Upgrade",
        "Proxy-Authorization",
        "Proxy-Connection",
        "Content-Length",
        "Accept-Encoding",
        "User-Agent",
    ] {
        let e = call_err(
            &config,
            "http_request",
            json!({"method": "GET", "url": server.url("/"), "headers": {header: "x"}}),
        )
        .await;
        assert!(
            e.starts_with(&format!("header \"{header}\" cannot be set by the caller")),
            "{e}"
        );
    }
    let e = call_err(
        &config,
        "http_request",
        json!({"method": "GET", "url": server.url("/"), "headers": {"X-Ok": "a\r\nHost: evil"}}),
    )
    .await;
    assert!(e.contains("line break"), "{e}");
    let small = HttpConfig {
        max_request_body_bytes: 10,
        ..config.clone()
    };
    let e = call_err(
        &small,
        "http_request",
        json!({"method": "POST", "url": server.url("/"), "body": "01234567890"}),
    )
    .await;
    assert!(e.contains("body is 11 bytes; the limit is 10 bytes"), "{e}");
    let e = call_err(
        &config,
        "http_request",
        json!({"method": "TRACE", "url": server.url("/")}),
    )
    .await;
    assert!(e.contains("method \"TRACE\" is not supported"), "{e}");
    assert_eq!(server.hits(), 0);
}

#[tokio::test]
async fn only_http_and_https_schemes() {
    let server = Server::canary().await;
    let p = server.port();
    let config = allowing(&[&server]);
    for url in [
        "file:///etc/passwd".to_owned(),
        format!("gopher://127.0.0.1:{p}/_GET%20/"),
        format!("ftp://127.0.0.1:{p}/"),
        format!("ws://127.0.0.1:{p}/"),
        "data:text/plain,hello".to_owned(),
        "javascript:alert(1)".to_owned(),
    ] {
        let e = get_err(&config, &url).await;
        assert!(e.contains("only http and https"), "{url}: {e}");
        let e = call_err(&config, "fetch_url", json!({"url": url})).await;
        assert!(e.contains("only http and https"), "{url}: {e}");
    }
    let e = get_err(&config, &format!("http://user:pw@127.0.0.1:{p}/")).await;
    assert!(e.contains("user name or password"), "{e}");
    let e = get_err(&config, "not a url").await;
    assert!(e.starts_with("invalid url"), "{e}");
    assert_eq!(server.hits(), 0);
}

#[test]
fn config_from_toml() {
    let config = config_toml(
        "[http]\nallow = [\"127.0.0.1:18080\", \"*.example.com\", \"10.0.0.0/8\", \"[::1]:8080\"]\n\
         deny = [\"evil.example.com\"]\nprivate_addresses = \"deny\"\ntimeout_ms = 5000\n",
    );
    assert_eq!(config.allow.len(), 4);
    assert_eq!(config.timeout_ms, 5000);
    assert_eq!(config.max_response_bytes, 5 * 1024 * 1024);
    assert!(tools(config).is_ok());

    let bad = config_toml("[http]\nallow = [\"ok.example\", \"exa*mple.com\"]\n");
    let e = tools(bad).err().unwrap().to_string();
    assert!(
        e.starts_with("[http] allow: invalid host pattern \"exa*mple.com\""),
        "{e}"
    );
    let bad = config_toml("[http]\ndeny = [\"10.0.0.0/40\"]\n");
    assert!(
        tools(bad)
            .err()
            .unwrap()
            .to_string()
            .contains("\"10.0.0.0/40\"")
    );
    assert!(
        toml::from_str::<toml::Table>("[http]\nnope = 1\n")
            .ok()
            .and_then(|t| t["http"].clone().try_into::<HttpConfig>().ok())
            .is_none()
    );
}

#[tokio::test]
async fn dns_rebinding_cannot_win() {
    // The allowed server on 127.0.0.1:<p>; a canary on 127.0.0.2 with the same port.
    let server = Server::start(|_| ok("text/plain", "checked address")).await;
    let p = server.port();
    let canary_listener = std::net::TcpListener::bind(("127.0.0.2", p)).unwrap_or_else(|e| {
        panic!("this test needs 127.0.0.2 on loopback (Linux routes 127/8 to lo): {e}")
    });
    drop(canary_listener);
    let canary = {
        let listener = TcpListener::bind(("127.0.0.2", p)).await.unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let h = Arc::clone(&hits);
        let task = tokio::spawn(async move {
            for _ in 0..100 {
                if listener.accept().await.is_ok() {
                    h.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        (hits, task)
    };

    // A resolver that answers the checked address once, then rebinds the name to the
    // canary (and later to the metadata address).
    let lookups = Arc::new(AtomicUsize::new(0));
    let l = Arc::clone(&lookups);
    let set = tools_with_resolver(
        config_toml(&format!("[http]\nallow = [\"rebind.test:{p}\"]\n")),
        move |host| {
            assert_eq!(host, "rebind.test");
            let n = l.fetch_add(1, Ordering::SeqCst);
            Ok(vec![
                if n == 0 { "127.0.0.1" } else { "127.0.0.2" }
                    .parse()
                    .unwrap(),
            ])
        },
    )
    .unwrap();
    let out = set
        .get("http_request")
        .unwrap()
        .execute(
            json!({"method": "GET", "url": format!("http://rebind.test:{p}/")}),
            ctx_with(CancellationToken::new()),
        )
        .await;
    assert!(!out.is_error, "{out:?}");
    let v: Value = serde_json::from_str(&out.content[0]).unwrap();
    assert_eq!(v["body"], "checked address");
    assert_eq!(
        lookups.load(Ordering::SeqCst),
        1,
        "exactly one lookup per hop"
    );
    assert_eq!(server.hits(), 1);
    assert_eq!(
        server.seen()[0].header("host").unwrap(),
        format!("rebind.test:{p}")
    );
    assert_eq!(canary.0.load(Ordering::SeqCst), 0);
    canary.1.abort();

    // With the default policy the same name rebinding to loopback is refused outright.
    let set = tools_with_resolver(HttpConfig::default(), |_| {
        Ok(vec![
            "93.184.216.34".parse().unwrap(),
            "127.0.0.1".parse().unwrap(),
        ])
    })
    .unwrap();
    let out = set
        .get("fetch_url")
        .unwrap()
        .execute(
            json!({"url": format!("http://rebind.test:{p}/")}),
            ctx_with(CancellationToken::new()),
        )
        .await;
    assert!(out.is_error);
    assert!(
        out.content[0].contains("127.0.0.1 (address of rebind.test) is a loopback address"),
        "{out:?}"
    );
    assert_eq!(server.hits(), 1);
}

/// A page an attacker serves to crash the converter (20 000 nested `<div>`, about
/// 220 KB, which once overflowed the worker's stack and aborted the process): an
/// `is_error` result that says what to do instead, the source still reachable with
/// `format: raw`, and the worker carrying on with the next page.
#[tokio::test]
async fn a_page_nested_too_deep_is_an_error_result_not_a_crash() {
    let deep = format!(
        "<html><body>{}deepest{}</body></html>",
        "<div>".repeat(20_000),
        "</div>".repeat(20_000)
    );
    let unclosed = format!("<body>{}", "<div/><span>".repeat(50_000));
    let server = Server::start(move |req| match req.target.as_str() {
        "/deep" => ok("text/html", deep.clone()),
        "/unclosed" => ok("text/html", unclosed.clone()),
        _ => ok(
            "text/html",
            "<html><body><h1>Fine</h1><p>still here</p></body></html>",
        ),
    })
    .await;
    let config = allowing(&[&server]);
    for path in ["/deep", "/unclosed"] {
        for format in ["markdown", "text"] {
            let err = call_err(
                &config,
                "fetch_url",
                json!({"url": server.url(path), "format": format}),
            )
            .await;
            assert!(
                err.contains("nests elements more than 512 levels deep")
                    && err.contains("format \"raw\""),
                "{path} {format}: {err}"
            );
        }
    }
    let raw = call_ok(
        &config,
        "fetch_url",
        json!({"url": server.url("/deep"), "format": "raw", "max_length": 20}),
    )
    .await;
    assert!(
        raw["content"]
            .as_str()
            .is_some_and(|c| c.starts_with("<html><body><div>")),
        "{raw}"
    );
    let fine = call_ok(&config, "fetch_url", json!({"url": server.url("/fine")})).await;
    assert!(
        fine["content"]
            .as_str()
            .is_some_and(|c| c.contains("# Fine") && c.contains("still here")),
        "{fine}"
    );
}

/// A declared tool's upstream that echoes the secret header back with JSON escapes
/// (`\/`, as PHP's encoder writes '/', and `\u0074`): any JSON parser would turn either
/// back into the secret, so the result holds neither spelling, only `[redacted]`.
#[tokio::test]
async fn a_declared_tool_redacts_a_secret_its_upstream_spells_with_json_escapes() {
    let server = Server::start(|req| {
        let key = req.header("x-key").unwrap_or_default();
        let slashed = key.replace('/', "\\/");
        let unicode = format!("\\u0074{}", key.strip_prefix('t').unwrap_or(&key));
        ok(
            "application/json",
            format!("{{\"slashed\":\"{slashed}\",\"unicode\":\"{unicode}\"}}"),
        )
    })
    .await;
    let dir = std::env::temp_dir().join(format!("airlock-http-escaped-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("key");
    std::fs::write(&file, "tok/en\n").unwrap();
    let entry: ToolEntry = toml::from_str(&format!(
        "name = \"echo_key\"\n\
         description = \"Echoes the key it is sent with.\"\n\
         input_schema = {{ type = \"object\" }}\n\
         http = {{ method = \"GET\", url = \"{}\", headers = {{ X-Key = \"${{file:{}}}\" }} }}\n",
        server.url("/echo"),
        file.display()
    ))
    .unwrap();
    let resolved = HttpTemplate::compile(&entry).unwrap().resolve().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let set = tools_with_declared(allowing(&[&server]), vec![resolved]).unwrap();
    let out = set
        .get("echo_key")
        .unwrap()
        .execute(json!({}), ctx_with(CancellationToken::new()))
        .await;
    assert!(!out.is_error, "{:?}", out.content);
    assert_eq!(server.seen()[0].header("x-key").as_deref(), Some("tok/en"));
    let text = out.content.join("\n");
    for spelling in ["tok/en", "tok\\/en", "tok\\\\/en", "u0074ok"] {
        assert!(!text.contains(spelling), "{spelling}: {text}");
    }
    let result: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        result["body"], r#"{"slashed":"[redacted]","unicode":"[redacted]"}"#,
        "{result}"
    );
}
