//! The client against a small Streamable HTTP server of the test's own, on loopback:
//! JSON and event-stream answers, the session id, paging, progress, cancellation,
//! garbage, an oversize event, refusals, a server gone, header secrets.

use std::sync::atomic::AtomicUsize;

use airlock_policy::SessionId;
use airlock_worker::{CancellationToken, ToolEvent};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use super::*;
use crate::config::{HttpConfig, PrivateAddresses};

/// One request as the server got it.
#[derive(Debug, Clone)]
struct Seen {
    head: String,
    body: Value,
}

impl Seen {
    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    }

    fn method(&self) -> &str {
        self.body["method"].as_str().unwrap_or_default()
    }
}

/// The test server: what it saw, and sessions it has forgotten.
#[derive(Default)]
struct Mock {
    seen: Mutex<Vec<Seen>>,
    sessions: AtomicUsize,
    known: Mutex<std::collections::HashSet<String>>,
}

fn http(status: &str, headers: &[(&str, String)], body: &[u8]) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    for (name, value) in headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut out = out.into_bytes();
    out.extend_from_slice(body);
    out
}

fn json_answer(id: &Value, result: Value) -> Vec<u8> {
    let body = json!({"jsonrpc": "2.0", "id": id, "result": result}).to_string();
    http(
        "200 OK",
        &[("Content-Type", "application/json".into())],
        body.as_bytes(),
    )
}

/// Reads one request: its head and its JSON body.
async fn read_request(stream: &mut tokio::net::TcpStream) -> Option<Seen> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = serde_json::from_slice(&buf[head_end..head_end + length]).unwrap_or(Value::Null);
    Some(Seen { head, body })
}

/// Serves until the test ends; returns the URL and what it saw.
async fn serve() -> (String, Arc<Mock>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/mcp", listener.local_addr().unwrap());
    let mock = Arc::new(Mock::default());
    let state = mock.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let state = state.clone();
            tokio::spawn(async move {
                let Some(seen) = read_request(&mut stream).await else {
                    return;
                };
                state.seen.lock().unwrap().push(seen.clone());
                let reply = answer(&state, &seen, &mut stream).await;
                let _ = stream.write_all(&reply).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    (url, mock)
}

/// The mock's protocol: a session per `initialize`, two pages of tools, and tools
/// that answer in every way a server may.
async fn answer(state: &Mock, seen: &Seen, stream: &mut tokio::net::TcpStream) -> Vec<u8> {
    let id = seen.body["id"].clone();
    let session = seen.header("mcp-session-id");
    if seen.head.starts_with("DELETE ") {
        return http("200 OK", &[], b"");
    }
    if seen.method() == "initialize" {
        let n = state.sessions.fetch_add(1, Ordering::SeqCst) + 1;
        state.known.lock().unwrap().insert(format!("session-{n}"));
        let body = json!({"jsonrpc": "2.0", "id": id, "result": {
            "protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
            "serverInfo": {"name": "mock", "version": "1"}}})
        .to_string();
        return http(
            "200 OK",
            &[
                ("Content-Type", "application/json".into()),
                ("Mcp-Session-Id", format!("session-{n}")),
            ],
            body.as_bytes(),
        );
    }
    let known = session
        .as_deref()
        .is_some_and(|s| state.known.lock().unwrap().contains(s));
    if !known {
        return http("404 Not Found", &[], b"no such session");
    }
    if seen.body.get("id").is_none() {
        return http("202 Accepted", &[], b"");
    }
    match seen.method() {
        "tools/list" if seen.body["params"]["cursor"].is_null() => json_answer(
            &id,
            json!({"tools": [{"name": "echo", "inputSchema": {"type": "object"},
                "annotations": {"readOnlyHint": true}}], "nextCursor": "page-2"}),
        ),
        "tools/list" => json_answer(
            &id,
            json!({"tools": [
                {"name": "slow", "inputSchema": {"type": "object"}},
                {"name": "bad name!", "inputSchema": {"type": "object"}},
            ]}),
        ),
        "tools/call" => {
            let args = &seen.body["params"]["arguments"];
            let token = seen.body["params"]["_meta"]["progressToken"].clone();
            match args["mode"].as_str().unwrap_or("json") {
                "json" => json_answer(
                    &id,
                    json!({"content": [{"type": "text", "text": format!(
                        "{} in {} with {}", args["say"], session.unwrap_or_default(),
                        seen.header("authorization").unwrap_or_default())}]}),
                ),
                "sse" => {
                    // Progress first, in pieces, then the answer.
                    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n";
                    let _ = stream.write_all(head.as_bytes()).await;
                    let _ = stream
                        .write_all(b": hello\n\nid: 1\nevent: message\n")
                        .await;
                    for step in 1..=3 {
                        let note = json!({"jsonrpc": "2.0", "method": "notifications/progress",
                            "params": {"progressToken": token, "progress": step, "total": 3,
                            "message": format!("step {step}")}});
                        let _ = stream
                            .write_all(format!("data: {note}\n\n").as_bytes())
                            .await;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let other = json!({"jsonrpc": "2.0", "method": "notifications/progress",
                        "params": {"progressToken": "someone-else", "progress": 9}});
                    let done = json!({"jsonrpc": "2.0", "id": id, "result": {
                        "content": [{"type": "text", "text": "progressed"}]}});
                    format!("data: {other}\n\ndata: {done}\r\n\r\n").into_bytes()
                }
                "garbage" => http(
                    "200 OK",
                    &[("Content-Type", "application/json".into())],
                    b"this is not json",
                ),
                "huge" => {
                    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\ndata: ";
                    let _ = stream.write_all(head.as_bytes()).await;
                    let filler = vec![b'x'; 1 << 20];
                    for _ in 0..5 {
                        if stream.write_all(&filler).await.is_err() {
                            break;
                        }
                    }
                    b"\n\n".to_vec()
                }
                "status" => http("500 Internal Server Error", &[], b"boom"),
                // The bearer token sent, placed so that the quote's cut at 300 bytes
                // falls inside it.
                "status-secret" => {
                    let auth = seen.header("authorization").unwrap_or_default();
                    let token = auth.strip_prefix("Bearer ").unwrap_or(&auth);
                    let body = format!("{}{token}", "x".repeat(294));
                    http("500 Internal Server Error", &[], body.as_bytes())
                }
                "html" => http(
                    "200 OK",
                    &[("Content-Type", "text/html".into())],
                    b"<html></html>",
                ),
                "tool-error" => json_answer(
                    &id,
                    json!({"isError": true, "content": [{"type": "text", "text": "no such city"}]}),
                ),
                // The bearer token sent, in a refusal's message, its letters escaped
                // as JSON allows (`\u0074` for `t`, `\/`).
                "rpc-error-escaped" => {
                    let auth = seen.header("authorization").unwrap_or_default();
                    let token = auth.strip_prefix("Bearer ").unwrap_or(&auth);
                    let escaped: String = token
                        .chars()
                        .map(|c| format!("\\u{:04x}", c as u32))
                        .collect();
                    let body = format!(
                        r#"{{"jsonrpc":"2.0","id":{id},"error":{{"code":-32000,"message":"bad key \/ {escaped}"}}}}"#
                    );
                    http(
                        "200 OK",
                        &[("Content-Type", "application/json".into())],
                        body.as_bytes(),
                    )
                }
                "rpc-error" => {
                    let body = json!({"jsonrpc": "2.0", "id": id,
                        "error": {"code": -32602, "message": "unknown tool"}})
                    .to_string();
                    http(
                        "200 OK",
                        &[("Content-Type", "application/json".into())],
                        body.as_bytes(),
                    )
                }
                "hang" => {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    Vec::new()
                }
                other => panic!("unknown mode {other}"),
            }
        }
        other => panic!("unexpected method {other}"),
    }
}

fn loopback() -> HttpConfig {
    HttpConfig {
        private_addresses: PrivateAddresses::Allow,
        ..HttpConfig::default()
    }
}

fn entry(url: &str, extra: &str) -> McpServerEntry {
    toml::from_str(&format!("name = \"mock\"\nurl = \"{url}\"\n{extra}")).unwrap()
}

async fn start_with(
    config: HttpConfig,
    entry: &McpServerEntry,
) -> Result<Vec<McpHttpTool>, String> {
    let resolved = McpHttpServer::compile(entry)
        .map_err(|e| e.to_string())?
        .resolve()
        .map_err(|e| e.to_string())?;
    let client = crate::tools::client(config, None).unwrap();
    start(vec![resolved], &client)
        .await
        .map_err(|e| e.to_string())
}

fn tool<'a>(tools: &'a [McpHttpTool], name: &str) -> &'a McpHttpTool {
    tools
        .iter()
        .find(|t| t.definition().name == name)
        .unwrap_or_else(|| panic!("no tool {name}"))
}

fn context(session: &str, timeout: Duration) -> (CallContext, mpsc::Receiver<ToolEvent>) {
    let (tx, rx) = mpsc::channel(64);
    let ctx = CallContext::new(
        "call-1".into(),
        "alice".into(),
        SessionId::parse(session).unwrap(),
        Instant::now() + timeout,
        CancellationToken::new(),
        tx,
    );
    (ctx, rx)
}

async fn run(tool: &McpHttpTool, session: &str, args: Value) -> ToolOutcome {
    let (ctx, _events) = context(session, Duration::from_secs(20));
    tool.execute(args, ctx).await
}

#[tokio::test]
async fn tools_are_listed_across_pages_and_answer_in_json_or_a_stream() {
    let (url, mock) = serve().await;
    let tools = start_with(loopback(), &entry(&url, "per_session = false"))
        .await
        .unwrap();
    let mut names: Vec<String> = tools.iter().map(|t| t.definition().name).collect();
    names.sort();
    // "bad name!" cannot be an Airlock name: left out, the others served.
    assert_eq!(names, ["mock__echo", "mock__slow"]);
    assert!(
        tool(&tools, "mock__echo")
            .definition()
            .annotations
            .read_only
    );
    assert!(
        !tool(&tools, "mock__slow")
            .definition()
            .annotations
            .read_only
    );

    // JSON answer; the session made at start is the one used (per_session = false).
    let out = run(tool(&tools, "mock__echo"), "a", json!({"say": "hi"})).await;
    assert!(!out.is_error, "{out:?}");
    assert!(out.content[0].starts_with("\"hi\" in session-1"), "{out:?}");

    // Event-stream answer with progress for this call's token only.
    let (ctx, mut events) = context("a", Duration::from_secs(20));
    let out = tool(&tools, "mock__slow")
        .execute(json!({"mode": "sse"}), ctx)
        .await;
    assert!(!out.is_error, "{out:?}");
    assert_eq!(out.content, ["progressed"]);
    let mut progress = Vec::new();
    while let Ok(event) = events.try_recv() {
        progress.push(event);
    }
    assert_eq!(progress.len(), 3, "{progress:?}");
    assert_eq!(
        progress[2],
        ToolEvent::Progress {
            progress: 3.0,
            total: Some(3.0),
            message: "step 3".into()
        }
    );

    // Every request carried what the transport asks for.
    let seen = mock.seen.lock().unwrap().clone();
    let methods: Vec<&str> = seen.iter().map(Seen::method).collect();
    assert_eq!(
        methods,
        [
            "initialize",
            "notifications/initialized",
            "tools/list",
            "tools/list",
            "tools/call",
            "tools/call"
        ]
    );
    for request in &seen {
        assert!(
            request.head.starts_with("POST /mcp HTTP/1.1"),
            "{}",
            request.head
        );
        assert_eq!(
            request.header("accept").as_deref(),
            Some("application/json, text/event-stream")
        );
        assert_eq!(
            request.header("content-type").as_deref(),
            Some("application/json")
        );
    }
    assert_eq!(seen[0].header("mcp-session-id"), None);
    assert_eq!(seen[0].body["params"]["protocolVersion"], "2025-06-18");
    for request in &seen[1..] {
        assert_eq!(
            request.header("mcp-session-id").as_deref(),
            Some("session-1")
        );
        assert_eq!(
            request.header("mcp-protocol-version").as_deref(),
            Some("2025-06-18")
        );
    }
    assert_eq!(seen[3].body["params"]["cursor"], "page-2");
    assert!(seen[5].body["params"]["_meta"]["progressToken"].is_number());
}

#[tokio::test]
async fn sessions_are_per_principal_and_session_and_started_again_when_forgotten() {
    let (url, mock) = serve().await;
    let tools = start_with(loopback(), &entry(&url, "")).await.unwrap();
    let echo = tool(&tools, "mock__echo");
    let first = run(echo, "one", json!({"say": 1})).await;
    let again = run(echo, "one", json!({"say": 2})).await;
    let other = run(echo, "two", json!({"say": 3})).await;
    // The listing's session (1) was closed; each session has its own, kept.
    assert!(first.content[0].contains("in session-2"), "{first:?}");
    assert!(again.content[0].contains("in session-2"), "{again:?}");
    assert!(other.content[0].contains("in session-3"), "{other:?}");
    assert!(
        mock.seen
            .lock()
            .unwrap()
            .iter()
            .any(|s| s.head.starts_with("DELETE ")
                && s.header("mcp-session-id").as_deref() == Some("session-1"))
    );
    // The server forgets the session (404): a new one, and the call goes through.
    mock.known.lock().unwrap().clear();
    let after = run(echo, "one", json!({"say": 4})).await;
    assert!(!after.is_error, "{after:?}");
    assert!(after.content[0].contains("in session-4"), "{after:?}");
}

#[tokio::test]
async fn garbage_refusals_and_oversize_events_fail_only_that_call() {
    let (url, _mock) = serve().await;
    let tools = start_with(loopback(), &entry(&url, "per_session = false"))
        .await
        .unwrap();
    let slow = tool(&tools, "mock__slow");
    for (mode, says) in [
        ("garbage", "not JSON"),
        ("status", "HTTP 500 Internal Server Error: boom"),
        ("html", "content type \"text/html\""),
        ("huge", "longer than 4194304 bytes"),
        (
            "rpc-error",
            "refused the call of slow (error -32602): unknown tool",
        ),
    ] {
        let out = run(slow, "a", json!({"mode": mode})).await;
        assert!(out.is_error, "{mode}: {out:?}");
        assert!(
            out.content[0].contains("the MCP server mock"),
            "{mode}: {out:?}"
        );
        assert!(out.content[0].contains(says), "{mode}: {out:?}");
        // The server still answers the next call.
        let ok = run(slow, "a", json!({"mode": "json", "say": mode})).await;
        assert!(!ok.is_error, "after {mode}: {ok:?}");
    }
    let out = run(slow, "a", json!({"mode": "tool-error"})).await;
    assert!(out.is_error && out.content == ["no such city"], "{out:?}");
}

#[tokio::test]
async fn a_cancelled_or_late_call_tells_the_server() {
    let (url, mock) = serve().await;
    let tools = start_with(loopback(), &entry(&url, "per_session = false"))
        .await
        .unwrap();
    let slow = tool(&tools, "mock__slow");
    let (ctx, _events) = context("a", Duration::from_secs(30));
    let cancel = ctx.cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        cancel.cancel();
    });
    let out = slow.execute(json!({"mode": "hang"}), ctx).await;
    assert!(
        out.is_error && out.content[0].contains("was cancelled"),
        "{out:?}"
    );
    let (ctx, _events) = context("a", Duration::from_millis(700));
    let started = Instant::now();
    let out = slow.execute(json!({"mode": "hang"}), ctx).await;
    assert!(
        out.is_error && out.content[0].contains("ran out of time"),
        "{out:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let cancelled: Vec<Value> = mock
            .seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.method() == "notifications/cancelled")
            .map(|s| s.body["params"].clone())
            .collect();
        if cancelled.len() == 2 {
            assert!(
                cancelled.iter().all(|p| p["requestId"].is_number()),
                "{cancelled:?}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "{cancelled:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn header_secrets_are_sent_and_never_returned() {
    let (url, mock) = serve().await;
    let file = std::env::temp_dir().join(format!("airlock-mcp-secret-{}", std::process::id()));
    std::fs::write(&file, "tok-3f9a71c2\n").unwrap();
    let entry = entry(
        &url,
        &format!(
            "per_session = false\nheaders = {{ Authorization = \"Bearer ${{file:{}}}\" }}",
            file.display()
        ),
    );
    let by_env = self::entry(&url, "headers = { X-Key = \"${env:MCP_KEY}\" }");
    assert_eq!(
        McpHttpServer::compile(&by_env).unwrap().env_names(),
        ["MCP_KEY"]
    );
    let tools = start_with(loopback(), &entry).await.unwrap();
    let out = run(tool(&tools, "mock__echo"), "a", json!({"say": "hi"})).await;
    assert!(!out.is_error, "{out:?}");
    // The server echoes the header back; the result says [redacted].
    assert!(
        out.content[0].ends_with("with Bearer [redacted]"),
        "{out:?}"
    );
    assert!(!out.content[0].contains("tok-3f9a71c2"));
    let seen = mock.seen.lock().unwrap().clone();
    assert!(
        seen.iter()
            .all(|s| s.header("authorization").as_deref() == Some("Bearer tok-3f9a71c2"))
    );
    // A refusal's body is quoted up to 300 bytes; a token cut there leaves no prefix.
    let out = run(
        tool(&tools, "mock__echo"),
        "a",
        json!({"mode": "status-secret"}),
    )
    .await;
    assert!(out.is_error, "{out:?}");
    let text = out.content.join("\n");
    assert!(
        text.contains("HTTP 500") && text.ends_with("x[redacted]") && !text.contains("tok-3f"),
        "{out:?}"
    );
    // A refusal that spells the token with JSON escapes: decoded, then redacted.
    let out = run(
        tool(&tools, "mock__echo"),
        "a",
        json!({"mode": "rpc-error-escaped"}),
    )
    .await;
    assert!(out.is_error, "{out:?}");
    let text = out.content.join("\n");
    assert!(
        text.contains("bad key / [redacted]") && !text.contains("tok-3f9a71c2"),
        "{out:?}"
    );
    let _ = std::fs::remove_file(&file);
    // A missing variable names the variable, at start.
    let missing = self::entry(
        &url,
        "headers = { Authorization = \"Bearer ${env:AIRLOCK_UNIT_MCP_UNSET}\" }",
    );
    let e = McpHttpServer::compile(&missing)
        .unwrap()
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "headers.Authorization: the environment variable AIRLOCK_UNIT_MCP_UNSET is not set"
        ),
        "{e}"
    );
    for (headers, says) in [
        (
            "{ Accept = \"x\" }",
            "the MCP client sets this header itself",
        ),
        ("{ Host = \"x\" }", "the worker sets this header itself"),
        ("{ X = \"${nope}\" }", "not a secret reference"),
    ] {
        let bad = self::entry(&url, &format!("headers = {headers}"));
        let e = McpHttpServer::compile(&bad).unwrap_err().to_string();
        assert!(
            e.contains("[[mcp_servers]] mock: headers.") && e.contains(says),
            "{e}"
        );
    }
}

#[tokio::test]
async fn the_egress_policy_and_a_server_gone_are_named() {
    let (url, _mock) = serve().await;
    // Loopback is refused unless allowed; a deny rule refuses it even then.
    let e = start_with(HttpConfig::default(), &entry(&url, ""))
        .await
        .err()
        .unwrap();
    assert!(
        e.contains("the MCP server mock could not be started"),
        "{e}"
    );
    assert!(e.contains("loopback"), "{e}");
    let deny = HttpConfig {
        deny: vec!["127.0.0.1".into()],
        ..loopback()
    };
    let e = start_with(deny, &entry(&url, "")).await.err().unwrap();
    assert!(e.contains("deny"), "{e}");

    // Nothing listens: the start fails naming the connection.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let e = start_with(
        loopback(),
        &entry(&format!("http://127.0.0.1:{closed}/mcp"), ""),
    )
    .await
    .err()
    .unwrap();
    assert!(e.contains("initialize failed: cannot connect"), "{e}");

    // A server that never answers is given start_timeout_seconds.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("http://{}/mcp", silent.local_addr().unwrap());
    let started = Instant::now();
    let e = start_with(loopback(), &entry(&silent_url, "start_timeout_seconds = 1"))
        .await
        .err()
        .unwrap();
    assert!(e.contains("within 1s (start_timeout_seconds)"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5));
    drop(silent);
}
