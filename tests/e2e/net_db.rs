//! The http and db workers through `airlock up`: egress policy, approvals by method,
//! the demo database, read-only enforcement.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};

use crate::support::Airlock;

/// A loopback HTTP server answering every request with a small page; counts connections.
fn page_server() -> (u16, Arc<AtomicUsize>) {
    page_server_on("127.0.0.1:0")
}

/// [`page_server`] on a given address (`[::1]:<port>` for an IPv6 canary).
fn page_server_on(addr: &str) -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind(addr).unwrap_or_else(|e| panic!("bind {addr}: {e}"));
    let port = listener.local_addr().expect("addr").port();
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(64) {
            let Ok(mut stream) = stream else { continue };
            counter.fetch_add(1, Ordering::SeqCst);
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf);
            let body = "<html><head><meta charset=\"utf-8\"><title>Hi</title></head><body><h1>Café</h1><p>hello</p></body></html>";
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (port, hits)
}

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

#[tokio::test]
async fn http_tools_follow_the_egress_policy_and_approvals_by_method() {
    let (allowed, hits) = page_server();
    let (refused, refused_hits) = page_server();
    let airlock = Airlock::start_with(&format!(
        "[http]\nallow = [\"127.0.0.1:{allowed}\"]\n[approvals]\ntools = [\"http_request\"]\n"
    ))
    .await;

    let (err, text, _) = airlock
        .call(
            "fetch_url",
            json!({"url": format!("http://127.0.0.1:{allowed}/")}),
        )
        .await;
    assert!(!err, "{text}");
    assert!(
        parse(&text)["content"]
            .as_str()
            .expect("content")
            .contains("Café"),
        "{text}"
    );
    let (err, text, call) = airlock
        .call(
            "http_request",
            json!({"method": "GET", "url": format!("http://127.0.0.1:{allowed}/x")}),
        )
        .await;
    assert!(
        !err && call["status"] == "ok",
        "GET needs no approval: {text}"
    );
    assert_eq!(parse(&text)["status"], 200);

    // A canary listens behind every refused URL but the metadata address (which cannot
    // be bound without changing the host's network): a refusal must come from the
    // egress rules before any connection, so every canary sees none, and the message
    // names the rule (a plain "connection refused" would not).
    let (_, v6_hits) = page_server_on(&format!("[::1]:{allowed}"));
    let special = |addr: &str, kind: &str, target: &str| {
        format!(
            "refused: {addr} is {kind} (special-purpose); internal and special addresses are \
             not reachable unless an operator adds \"{target}\" to [http] allow"
        )
    };
    let v4_loopback = special(
        "127.0.0.1",
        "a loopback address",
        &format!("127.0.0.1:{refused}"),
    );
    for (url, expected) in [
        (format!("http://127.0.0.1:{refused}/"), v4_loopback.clone()),
        (format!("http://2130706433:{refused}/"), v4_loopback.clone()),
        (
            "http://169.254.169.254/latest/meta-data/".to_owned(),
            special(
                "169.254.169.254",
                "a link-local address (cloud metadata lives here)",
                "169.254.169.254:80",
            ),
        ),
        (
            format!("http://[::1]:{allowed}/"),
            special("::1", "the loopback address", &format!("[::1]:{allowed}")),
        ),
        (format!("http://0x7f000001:{refused}/"), v4_loopback),
    ] {
        let (err, text, _) = airlock.call("fetch_url", json!({"url": url})).await;
        assert!(err, "{url}: {text}");
        assert_eq!(text, expected, "{url}");
    }
    assert_eq!(
        refused_hits.load(Ordering::SeqCst),
        0,
        "the refused server saw no connection"
    );
    assert_eq!(
        v6_hits.load(Ordering::SeqCst),
        0,
        "the IPv6 loopback canary saw no connection"
    );

    // A POST needs a human.
    let body = json!({"wait_ms": 300, "tool_uses": [{"type": "tool_use", "id": "p", "name": "http_request",
        "input": {"method": "POST", "url": format!("http://127.0.0.1:{allowed}/"), "body": "x"}}]});
    let (_, response) = airlock.post("/v1/tool_calls", &body).await;
    assert_eq!(
        response["calls"][0]["status"], "pending_approval",
        "{response}"
    );
    // fetch_url and the GET reached it; the POST waits for a human and has not.
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn the_demo_database_is_served_read_only_in_depth() {
    let airlock = Airlock::start_with("[approvals]\ntools = [\"execute_sql\"]\n").await;
    let (err, text, _) = airlock.call("list_databases", json!({})).await;
    assert!(!err && text.contains("demo"), "{text}");
    let (err, text, _) = airlock
        .call("list_tables", json!({"database": "demo"}))
        .await;
    assert!(
        !err && text.contains("order_totals"),
        "views are listed: {text}"
    );
    let (err, text, _) = airlock
        .call("query_database", json!({"database": "demo", "sql": "SELECT name FROM customers WHERE id = ?", "params": [2]}))
        .await;
    assert!(!err, "{text}");
    assert_eq!(parse(&text)["rows"], json!([["Grace Hopper"]]));
    for sql in [
        "DELETE FROM customers",
        "SELECT 1; DROP TABLE orders",
        "WITH x AS (DELETE FROM orders RETURNING *) SELECT * FROM x",
        "ATTACH DATABASE '/tmp/x.db' AS x",
    ] {
        let (err, text, _) = airlock
            .call("query_database", json!({"database": "demo", "sql": sql}))
            .await;
        assert!(err, "{sql} was accepted: {text}");
    }
    let (_, text, _) = airlock
        .call(
            "query_database",
            json!({"database": "demo", "sql": "SELECT count(*) FROM orders"}),
        )
        .await;
    assert_eq!(parse(&text)["rows"], json!([[4]]), "nothing changed");

    // execute_sql waits for approval by default.
    let body = json!({"wait_ms": 300, "tool_uses": [{"type": "tool_use", "id": "w", "name": "execute_sql",
        "input": {"database": "demo", "sql": "DELETE FROM orders"}}]});
    let (_, response) = airlock.post("/v1/tool_calls", &body).await;
    assert_eq!(
        response["calls"][0]["status"], "pending_approval",
        "{response}"
    );
}

/// A read that reaches outside Airlock is on record before it goes out: while the
/// server `fetch_url` asked still holds the request, the audit log already shows the call
/// requested and dispatched (a read that stays inside, `read_file`, is written once when
/// it ends). Were the orchestrator to die or the store to fail before the call ended, the
/// log would still say that the URL was fetched.
#[tokio::test]
async fn a_read_that_reaches_outside_is_on_record_before_it_goes_out() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (arrived_tx, arrived_rx) = std::sync::mpsc::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Some(Ok(mut stream)) = listener.incoming().next() {
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf);
            let _ = arrived_tx.send(());
            let _ = release_rx.recv_timeout(std::time::Duration::from_secs(60));
            let body = "held";
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    let airlock = Airlock::start_with(&format!("[http]\nallow = [\"127.0.0.1:{port}\"]\n")).await;
    let body = json!({"session_id": "outside", "wait_ms": 0, "tool_uses": [{"type": "tool_use", "id": "f",
        "name": "fetch_url", "input": {"url": format!("http://127.0.0.1:{port}/secret-in-the-url")}}]});
    let (status, response) = airlock.post("/v1/tool_calls", &body).await;
    assert_eq!(status, 200, "{response}");
    let call_id = response["calls"][0]["call_id"]
        .as_str()
        .expect("id")
        .to_owned();
    tokio::task::spawn_blocking(move || {
        arrived_rx.recv_timeout(std::time::Duration::from_secs(60))
    })
    .await
    .expect("join")
    .expect("the request reached the server");
    assert_eq!(
        airlock.audit_kinds(&call_id).await,
        ["requested", "dispatched"],
        "while the request is out, the log shows it"
    );
    release_tx.send(()).expect("release");
    let (_, call) = airlock
        .get(&format!("/v1/calls/{call_id}?wait_ms=60000"))
        .await;
    assert_eq!(call["status"], "ok", "{call}");
    assert_eq!(
        airlock
            .audit_kinds(&call_id)
            .await
            .last()
            .map(String::as_str),
        Some("completed")
    );
}
