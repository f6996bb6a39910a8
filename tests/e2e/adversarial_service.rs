//! The service itself under attack: what an outsider (or a runaway agent) can make the
//! orchestrator keep, store or hold open, through every front door.
//!
//! - Megabytes of pending input must not break the approvals listing (HTTP, gRPC, CLI),
//!   and the listing pages.
//! - Arguments are resolved and size-checked before the first audit event: oversized
//!   arguments, and any sent to a tool that does not exist, leave only their digest and
//!   size in the append-only log; the request cap holds on gRPC as on HTTP.
//! - Idle and half-sent connections are closed by the server, a connection cap keeps the
//!   orchestrator's descriptors bounded, and real requests are still served.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use airlock_proto::v1 as pb;
use airlock_proto::v1::orchestrator_client::OrchestratorClient;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::Request;
use tonic::transport::{Channel, Endpoint};

use crate::support::{AIRLOCK, Airlock, cmdline, descendants};

const MIB: usize = 1024 * 1024;
/// Generous bound for anything the server should do "soon".
const BOUND: Duration = Duration::from_secs(120);

fn authed<T>(message: T, token: &str) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("metadata"),
    );
    request
}

async fn grpc_client(airlock: &Airlock) -> OrchestratorClient<Channel> {
    let channel = Endpoint::from_shared(airlock.grpc.clone())
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    // Large answers (pages of approvals with megabytes of input) must be readable here:
    // the limits under test are the server's.
    OrchestratorClient::new(channel)
        .max_decoding_message_size(64 * MIB)
        .max_encoding_message_size(64 * MIB)
}

/// `airlock <args…> --data-dir <data dir>`, bounded; returns (success, stdout, stderr).
async fn cli(airlock: &Airlock, args: &[&str]) -> (bool, String, String) {
    let mut command = tokio::process::Command::from(airlock.cli(args));
    command.kill_on_drop(true);
    let output = tokio::time::timeout(BOUND, command.output())
        .await
        .expect("the CLI did not finish within the bound")
        .expect("run airlock");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Every approval the HTTP listing shows, page by page (bounded), and the pages' sizes.
async fn http_pages(airlock: &Airlock, query: &str) -> (Vec<Value>, Vec<usize>) {
    let mut approvals = Vec::new();
    let mut sizes = Vec::new();
    let mut after: Option<String> = None;
    for _ in 0..100 {
        let cursor = after
            .as_ref()
            .map(|c| format!("&after={c}"))
            .unwrap_or_default();
        let (status, body) = airlock.get(&format!("/v1/approvals?{query}{cursor}")).await;
        assert_eq!(status, 200, "{query}{cursor}: {body}");
        let page = body["approvals"].as_array().expect("approvals").clone();
        sizes.push(page.len());
        approvals.extend(page);
        match body["next_cursor"].as_str() {
            Some(next) => {
                assert_ne!(after.as_deref(), Some(next), "the cursor did not move");
                after = Some(next.to_owned());
            }
            None => {
                assert!(body["next_cursor"].is_null(), "{body}");
                return (approvals, sizes);
            }
        }
    }
    panic!("more than 100 pages of approvals");
}

/// Every approval gRPC ListApprovals shows, page by page (bounded).
async fn grpc_pages(
    client: &mut OrchestratorClient<Channel>,
    token: &str,
    status: &str,
    limit: u32,
) -> Vec<pb::ApprovalInfo> {
    let mut approvals = Vec::new();
    let mut after = String::new();
    for _ in 0..100 {
        let page = client
            .list_approvals(authed(
                pb::ListApprovalsRequest {
                    status: status.to_owned(),
                    limit,
                    after: after.clone(),
                },
                token,
            ))
            .await
            .expect("ListApprovals")
            .into_inner();
        approvals.extend(page.approvals);
        if page.next_cursor.is_empty() {
            return approvals;
        }
        assert_ne!(page.next_cursor, after, "the cursor did not move");
        after = page.next_cursor;
    }
    panic!("more than 100 pages of approvals");
}

// ---------------------------------------------------------------------------------
// 1. The approvals listing with megabytes of pending input
// ---------------------------------------------------------------------------------

#[tokio::test]
async fn megabytes_of_pending_input_leave_the_approvals_listing_working_and_paged() {
    let airlock = Airlock::start_with("[approvals]\ntools = [\"write_file\"]\n").await;
    // The reported case (1 MB and 1.5 MB), then more of them: 10.5 MB of pending input.
    let sizes = [
        1_000_000usize,
        1_500_000,
        1_500_000,
        2_000_000,
        1_500_000,
        3_000_000,
    ];
    let mut expected = Vec::new();
    for (i, size) in sizes.iter().enumerate() {
        let content = char::from(b'a' + i as u8).to_string().repeat(*size);
        let body = json!({
            "session_id": "big-pending",
            "wait_ms": 0,
            "tool_uses": [{"type": "tool_use", "id": format!("t{i}"), "name": "write_file",
                "input": {"path": format!("big{i}.txt"), "content": content}}],
        });
        let (status, body) = airlock.post("/v1/tool_calls", &body).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["calls"][0]["status"], "pending_approval", "{body}");
        expected.push(
            body["calls"][0]["approval_id"]
                .as_str()
                .expect("approval id")
                .to_owned(),
        );
    }
    let content_len = |a: &Value| a["input"]["content"].as_str().map_or(0, str::len);

    // HTTP, unfiltered and pending, default pages and one approval per page.
    for query in ["", "status=pending", "status=pending&limit=1", "limit=2"] {
        let (approvals, pages) = http_pages(&airlock, query).await;
        let ids: Vec<&str> = approvals
            .iter()
            .map(|a| a["approval_id"].as_str().expect("id"))
            .collect();
        assert_eq!(ids, expected, "{query}");
        for (approval, size) in approvals.iter().zip(sizes) {
            assert_eq!(
                content_len(approval),
                size,
                "{query}: an input came back cut"
            );
        }
        // 10.5 MB of inputs never come back in one answer.
        assert!(pages.len() >= 2, "{query}: {pages:?}");
        if query.contains("limit=1") {
            assert!(pages.iter().all(|n| *n == 1), "{pages:?}");
        }
    }

    // gRPC, the same pages.
    let mut client = grpc_client(&airlock).await;
    for (status, limit) in [("", 0), ("pending", 0), ("pending", 2)] {
        let approvals = grpc_pages(&mut client, &airlock.token, status, limit).await;
        let ids: Vec<&str> = approvals.iter().map(|a| a.approval_id.as_str()).collect();
        assert_eq!(ids, expected, "status {status:?} limit {limit}");
        for (approval, size) in approvals.iter().zip(sizes) {
            let input: Value = serde_json::from_str(&approval.input_json).expect("input JSON");
            assert_eq!(content_len(&json!({ "input": input })), size);
        }
    }

    // The CLI pages through them all.
    let (ok, stdout, stderr) = cli(&airlock, &["approvals", "list"]).await;
    assert!(ok, "approvals list failed:\n{stderr}");
    for id in &expected {
        assert!(stdout.contains(id.as_str()), "{id} not listed:\n{stderr}");
    }
    let (ok, stdout, stderr) = cli(&airlock, &["approvals", "list", "--all", "--json"]).await;
    assert!(ok, "approvals list --json failed:\n{stderr}");
    let listed: Value = serde_json::from_str(&stdout).expect("JSON listing");
    assert_eq!(
        listed["approvals"].as_array().map(Vec::len),
        Some(sizes.len())
    );

    // Everything decided: the unfiltered listing still answers, the pending one is empty.
    for id in &expected {
        let (status, body) = airlock
            .post(
                &format!("/v1/approvals/{id}/deny"),
                &json!({"reason": "too big"}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    let (approvals, _) = http_pages(&airlock, "").await;
    assert_eq!(approvals.len(), sizes.len());
    assert!(approvals.iter().all(|a| a["status"] == "denied"));
    let (status, body) = airlock.get("/v1/approvals?status=pending").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["approvals"], json!([]));
    let approvals = grpc_pages(&mut client, &airlock.token, "", 0).await;
    assert_eq!(approvals.len(), sizes.len());
    let (ok, stdout, stderr) = cli(&airlock, &["approvals", "list"]).await;
    assert!(ok, "{stderr}");
    assert!(stdout.contains("no pending approvals"), "{stdout}");
}

#[tokio::test]
async fn forged_paging_parameters_get_a_clear_400() {
    let airlock = Airlock::start_with("[approvals]\ntools = [\"write_file\"]\n").await;
    for query in [
        "limit=-1",
        "limit=abc",
        "limit=99999999999999999999999",
        "after=apr_doesnotexist",
        "after=..%2F..%2Fetc",
        "after=%27%20OR%201%3D1%20--",
        &format!("after={}", "a".repeat(4096)),
        "status=bogus",
    ] {
        let (status, body) = airlock.get(&format!("/v1/approvals?{query}")).await;
        assert_eq!(status, 400, "{query}: {body}");
        assert_eq!(body["error"]["code"], "invalid_request", "{query}: {body}");
    }
    // A huge limit is not an error, just the largest page.
    let (status, body) = airlock.get("/v1/approvals?limit=1000000").await;
    assert_eq!(status, 200, "{body}");

    let mut client = grpc_client(&airlock).await;
    for after in ["apr_doesnotexist", "../../etc", &"a".repeat(4096)] {
        let refused = client
            .list_approvals(authed(
                pb::ListApprovalsRequest {
                    status: String::new(),
                    limit: 0,
                    after: after.to_owned(),
                },
                &airlock.token,
            ))
            .await
            .expect_err("a forged cursor");
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    }
}

// ---------------------------------------------------------------------------------
// 2. Arguments: resolved and size-checked before the first audit event
// ---------------------------------------------------------------------------------

/// Bytes the SQLite store holds on disk (database and write-ahead log).
fn store_bytes(data_dir: &Path) -> u64 {
    ["airlock.db", "airlock.db-wal"]
        .iter()
        .filter_map(|f| std::fs::metadata(data_dir.join(f)).ok())
        .map(|m| m.len())
        .sum()
}

/// The audit events of `call_id`.
async fn events_of(airlock: &Airlock, call_id: &str) -> Vec<Value> {
    let (status, body) = airlock
        .get(&format!("/v1/audit?call_id={call_id}&limit=100"))
        .await;
    assert_eq!(status, 200, "{body}");
    body["events"].as_array().expect("events").clone()
}

/// Compact JSON with object keys sorted, as the audit log digests arguments.
fn canonical(value: &Value) -> String {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            let inner: Vec<String> = entries
                .into_iter()
                .map(|(k, v)| format!("{}:{}", Value::String(k.clone()), canonical(v)))
                .collect();
            format!("{{{}}}", inner.join(","))
        }
        Value::Array(items) => {
            let inner: Vec<String> = items.iter().map(canonical).collect();
            format!("[{}]", inner.join(","))
        }
        scalar => scalar.to_string(),
    }
}

/// The `requested` event of a call holds the digest and size of `input`, not the input.
async fn assert_digest_only(airlock: &Airlock, call_id: &str, input: &Value) {
    let events = events_of(airlock, call_id).await;
    let requested = events
        .iter()
        .find(|e| e["kind"] == "requested")
        .unwrap_or_else(|| panic!("no requested event for {call_id}: {events:?}"));
    let text = canonical(input);
    let digest = hex::encode(Sha256::digest(text.as_bytes()));
    assert_eq!(requested["data"]["arguments_sha256"], digest, "{requested}");
    assert_eq!(
        requested["data"]["arguments_bytes"],
        text.len(),
        "{requested}"
    );
    assert!(requested["data"].get("arguments").is_none(), "{requested}");
    let recorded: usize = events.iter().map(|e| e.to_string().len()).sum();
    assert!(
        recorded < 16 * 1024,
        "{recorded} bytes of audit for one call"
    );
}

#[tokio::test]
async fn oversized_or_unknown_arguments_leave_only_a_digest_in_the_audit_log() {
    let airlock = Airlock::start().await;
    let before = store_bytes(&airlock.data_dir());

    // Ten calls to a tool that does not exist, 9 MiB each (under the 10 MiB body cap).
    let big = json!({"blob": "A".repeat(9 * MIB)});
    for i in 0..10 {
        let body = json!({"tool_uses": [{"type": "tool_use", "id": format!("u{i}"),
            "name": "no_such_tool", "input": big}]});
        let (status, body) = airlock.post("/v1/tool_calls", &body).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["tool_results"][0]["is_error"], true, "{body}");
        let call_id = body["calls"][0]["call_id"].as_str().expect("call id");
        if i == 0 {
            assert_digest_only(&airlock, call_id, &big).await;
        }
    }
    // The OpenAI shape: arguments as a 9 MiB JSON string.
    let chat = json!({"tool_calls": [{"id": "c1", "type": "function", "function":
        {"name": "write_file", "arguments": json!({"path": "x.txt", "content": "B".repeat(9 * MIB)}).to_string()}}]});
    let (status, body) = airlock.post("/v1/tool_calls", &chat).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body["messages"][0]["content"]
            .as_str()
            .is_some_and(|t| t.contains("over the limit")),
        "{body}"
    );
    // A known tool over the argument cap (4 MiB): refused, never written, only a digest.
    let write = json!({"path": "big.txt", "content": "C".repeat(5 * MIB)});
    let (is_error, text, call) = airlock.call("write_file", write.clone()).await;
    assert!(is_error && text.contains("over the limit"), "{text}");
    assert!(!airlock.workspace("default").join("big.txt").exists());
    assert_digest_only(&airlock, call["call_id"].as_str().expect("id"), &write).await;
    // A secret sent to a tool that does not exist is not kept either.
    let secret = json!({"note": "hunter2-secret"});
    let (is_error, _, call) = airlock.call("exfiltrate", secret.clone()).await;
    assert!(is_error);
    assert_digest_only(&airlock, call["call_id"].as_str().expect("id"), &secret).await;
    // A tool name far longer than any tool's is cut in the log (HTTP refuses it outright).
    let (status, _) = airlock
        .post(
            "/v1/tool_calls",
            &json!({"tool_uses": [{"type": "tool_use", "id": "n", "name": "n".repeat(100_000), "input": {}}]}),
        )
        .await;
    assert_eq!(status, 400);

    // An ordinary call is still recorded with its (redacted) arguments.
    let (is_error, text, call) = airlock
        .call(
            "write_file",
            json!({"path": "small.txt", "content": "hello"}),
        )
        .await;
    assert!(!is_error, "{text}");
    let events = events_of(&airlock, call["call_id"].as_str().expect("id")).await;
    let requested = events
        .iter()
        .find(|e| e["kind"] == "requested")
        .expect("requested");
    assert_eq!(requested["data"]["arguments"]["content"], "hello");

    let grown = store_bytes(&airlock.data_dir()).saturating_sub(before);
    eprintln!("the store grew by {grown} bytes for 105 MiB of attacking arguments");
    assert!(
        grown < 4 * MIB as u64,
        "the store grew by {grown} bytes for arguments it refused"
    );
    let (_, verify) = airlock.get("/v1/audit/verify").await;
    assert_eq!(verify["ok"], true, "{verify}");
}

#[tokio::test]
async fn mcp_and_grpc_apply_the_same_argument_and_request_caps() {
    let airlock = Airlock::start().await;
    let before = store_bytes(&airlock.data_dir());
    let big = json!({"blob": "D".repeat(9 * MIB)});

    // MCP tools/call to an unknown tool with 9 MiB of arguments.
    let call = json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
        "params": {"name": "no_such_tool", "arguments": big}});
    let response = airlock
        .http()
        .post(format!("{}/mcp", airlock.url))
        .bearer_auth(&airlock.token)
        .header("Accept", "application/json, text/event-stream")
        .header("MCP-Protocol-Version", "2025-06-18")
        .json(&call)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    let text = response.text().await.expect("body");
    assert!(
        text.contains("\"isError\":true"),
        "{}",
        &text[..text.len().min(500)]
    );
    // gRPC: 9 MiB is under the request cap, over the argument cap: an error result.
    let mut client = grpc_client(&airlock).await;
    let tool_use = |name: &str, input: String| pb::ToolUse {
        id: "g1".into(),
        name: name.into(),
        input_json: input,
    };
    let answer = client
        .call_tools(authed(
            pb::CallToolsRequest {
                session_id: String::new(),
                tool_uses: vec![tool_use("no_such_tool", big.to_string())],
                wait_ms: None,
            },
            &airlock.token,
        ))
        .await
        .expect("CallTools")
        .into_inner();
    assert!(answer.tool_results[0].is_error);
    assert_digest_only(&airlock, &answer.calls[0].call_id, &big).await;
    let answer = client
        .call_tools(authed(
            pb::CallToolsRequest {
                session_id: String::new(),
                tool_uses: vec![tool_use(
                    "write_file",
                    json!({"path": "g.txt", "content": "F".repeat(5 * MIB)}).to_string(),
                )],
                wait_ms: None,
            },
            &airlock.token,
        ))
        .await
        .expect("CallTools")
        .into_inner();
    assert!(answer.tool_results[0].is_error);
    assert!(
        answer.tool_results[0]
            .content
            .join("")
            .contains("over the limit")
    );

    // 30 MiB, three times the request cap: refused before it is decoded.
    for input in [
        json!({"blob": "G".repeat(30 * MIB)}).to_string(),
        json!({"blob": "H".repeat(11 * MIB)}).to_string(),
    ] {
        let refused = client
            .call_tools(authed(
                pb::CallToolsRequest {
                    session_id: String::new(),
                    tool_uses: vec![tool_use("no_such_tool", input)],
                    wait_ms: None,
                },
                &airlock.token,
            ))
            .await
            .expect_err("over the request cap");
        assert!(
            matches!(
                refused.code(),
                tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
            ),
            "{refused:?}"
        );
    }
    // Names and ids are bounded as on HTTP.
    let refused = client
        .call_tools(authed(
            pb::CallToolsRequest {
                session_id: String::new(),
                tool_uses: vec![tool_use(&"n".repeat(100_000), "{}".into())],
                wait_ms: None,
            },
            &airlock.token,
        ))
        .await
        .expect_err("a 100 000-character tool name");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);

    let grown = store_bytes(&airlock.data_dir()).saturating_sub(before);
    eprintln!("the store grew by {grown} bytes for the MCP and gRPC attacks");
    assert!(grown < 4 * MIB as u64, "the store grew by {grown} bytes");
}

/// Arguments nested as deep as a JSON reader takes (127 levels, which gRPC's and the
/// agent loop's parsers accept): the audit log wraps them in its own objects, and a
/// record past 128 levels could no longer be read — `GET /v1/audit` failed and
/// `audit verify` called the log tampered from there on. Refused like oversized
/// arguments, recorded as their digest; the log stays readable and verified.
#[tokio::test]
async fn arguments_nested_too_deep_are_refused_and_the_log_stays_readable() {
    let airlock = Airlock::start().await;
    let mut client = grpc_client(&airlock).await;
    let nested = |depth: usize| format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
    // An unknown tool is refused as such; its arguments are still recorded as their
    // digest.
    for (name, input, said) in [
        (
            "read_file",
            format!("{{\"path\":{}}}", nested(126)),
            "levels deep",
        ),
        (
            "no_such_tool",
            format!("{{\"x\":{}}}", nested(126)),
            "unknown tool",
        ),
        (
            "read_file",
            format!("{{\"path\":{}}}", nested(65)),
            "levels deep",
        ),
    ] {
        let answer = client
            .call_tools(authed(
                pb::CallToolsRequest {
                    session_id: "deep".into(),
                    tool_uses: vec![pb::ToolUse {
                        id: "d".into(),
                        name: name.into(),
                        input_json: input,
                    }],
                    wait_ms: None,
                },
                &airlock.token,
            ))
            .await
            .expect("CallTools")
            .into_inner();
        let result = &answer.tool_results[0];
        assert!(result.is_error, "{result:?}");
        assert!(result.content.join("").contains(said), "{result:?}");
    }
    let (status, audit) = airlock.get("/v1/audit?session_id=deep&limit=100").await;
    assert_eq!(status, 200, "the log cannot be read: {audit}");
    let deep: Vec<&Value> = audit["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["kind"] == "rejected" && e["data"]["reason"] == "arguments_too_deep")
        .collect();
    assert_eq!(deep.len(), 2, "{audit}");
    let requested: Vec<&Value> = audit["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["kind"] == "requested")
        .collect();
    assert_eq!(requested.len(), 3, "{audit}");
    for event in requested {
        assert!(event["data"]["arguments"].is_null(), "{event}");
        assert!(event["data"]["arguments_sha256"].is_string(), "{event}");
    }
    let (_, verify) = airlock.get("/v1/audit/verify").await;
    assert_eq!(verify["ok"], true, "{verify}");
}

#[tokio::test]
async fn a_lowered_request_cap_holds_on_grpc_as_on_http() {
    let airlock = Airlock::start_with("[limits]\nmax_request_bytes = 1048576\n").await;
    let body = json!({"tool_uses": [{"type": "tool_use", "id": "t", "name": "no_such_tool",
        "input": {"blob": "x".repeat(2 * MIB)}}]});
    let (status, body) = airlock.post("/v1/tool_calls", &body).await;
    assert_eq!(status, 413, "{body}");

    let mut client = grpc_client(&airlock).await;
    let request = |blob: usize| pb::CallToolsRequest {
        session_id: String::new(),
        tool_uses: vec![pb::ToolUse {
            id: "g".into(),
            name: "no_such_tool".into(),
            input_json: json!({"blob": "y".repeat(blob)}).to_string(),
        }],
        wait_ms: None,
    };
    let refused = client
        .call_tools(authed(request(2 * MIB), &airlock.token))
        .await
        .expect_err("over the lowered cap");
    assert!(
        matches!(
            refused.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
        ),
        "{refused:?}"
    );
    let answer = client
        .call_tools(authed(request(1000), &airlock.token))
        .await
        .expect("a small call still goes through")
        .into_inner();
    assert!(answer.tool_results[0].is_error, "no_such_tool is unknown");
}

// ---------------------------------------------------------------------------------
// 7. Connection exhaustion
// ---------------------------------------------------------------------------------

/// Connections on local `port` that process `pid` holds (its socket descriptors matched
/// against the kernel's TCP table), the listening socket not counted.
fn held_connections(pid: u32, port: u16) -> usize {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the orchestrator's descriptors")
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            target
                .strip_prefix("socket:[")
                .and_then(|t| t.strip_suffix(']'))
                .map(str::to_owned)
        })
        .collect();
    let port_hex = format!(":{port:04X}");
    ["tcp", "tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).ok())
        .flat_map(|text| text.lines().skip(1).map(str::to_owned).collect::<Vec<_>>())
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.len() > 9
                && fields[1].ends_with(&port_hex)
                && fields[3] != "0A"
                && inodes.contains(fields[9])
        })
        .count()
}

fn port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .expect("port")
}

fn open_descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// (soft, hard) `Max open files` of a process.
fn nofile(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files");
    let fields: Vec<&str> = line.split_whitespace().collect();
    (fields[3].to_owned(), fields[4].to_owned())
}

/// An attacking connection: connects (bounded), sends `prefix`, then only reads. Returns
/// true once the server has closed it (EOF or reset), false if it never connected.
async fn attacker(addr: String, prefix: &'static [u8]) -> bool {
    let Ok(Ok(mut stream)) = tokio::time::timeout(BOUND, TcpStream::connect(&addr)).await else {
        return false;
    };
    if !prefix.is_empty() && stream.write_all(prefix).await.is_err() {
        return true;
    }
    let closed = async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                // A 408 or the server's HTTP/2 settings: keep reading until it closes.
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(BOUND, closed)
        .await
        .unwrap_or_else(|_| panic!("{addr}: the server kept a connection open past the bound"));
    true
}

fn host_port(url: &str) -> String {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned()
}

/// Raises this test process's own descriptor limit: the attack opens hundreds of sockets.
fn raise_own_nofile() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if let Some(hard) = limit.maximum {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(hard),
                maximum: Some(hard),
            },
        );
    }
}

#[tokio::test]
async fn idle_and_half_sent_connections_are_closed_and_real_requests_still_served() {
    raise_own_nofile();
    const CAP: usize = 16;
    let airlock = Airlock::start_with(&format!(
        "[limits]\nmax_connections = {CAP}\nheader_read_timeout_ms = 1000\n"
    ))
    .await;
    let orchestrator = airlock.process("serve orchestrator");
    // The soft limit was raised to the hard one before the orchestrator confined itself.
    let (soft, hard) = nofile(orchestrator);
    assert_eq!(
        soft, hard,
        "the orchestrator's open-file limit was not raised"
    );
    let baseline = open_descriptors(orchestrator);

    let http = host_port(&airlock.url);
    let grpc = host_port(&airlock.grpc);
    let mut attack = tokio::task::JoinSet::new();
    for i in 0..120 {
        // Idle, a request line without its headers' end, and a lone byte.
        let prefix: &'static [u8] = match i % 3 {
            0 => b"",
            1 => b"GET /v1/tools HTTP/1.1\r\nHost: airlock\r\nAuthorization: Bearer x",
            _ => b"G",
        };
        attack.spawn(attacker(http.clone(), prefix));
    }
    for i in 0..60 {
        // Idle, and a cut HTTP/2 preface.
        let prefix: &'static [u8] = if i % 2 == 0 {
            b""
        } else {
            b"PRI * HTTP/2.0\r\n"
        };
        attack.spawn(attacker(grpc.clone(), prefix));
    }
    // A keep-alive connection that asked once and then went quiet is closed too.
    let mut kept = TcpStream::connect(&http).await.expect("connect");
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: airlock\r\n\r\n")
        .await
        .expect("write");

    // Real requests get through while the attack holds (and loses) its connections.
    let client = reqwest::Client::builder()
        .timeout(BOUND)
        .build()
        .expect("client");
    let started = Instant::now();
    let tools = client
        .get(format!("{}/v1/tools", airlock.url))
        .bearer_auth(&airlock.token)
        .send()
        .await
        .expect("a real request during the attack");
    assert_eq!(tools.status(), 200);
    let mut grpc_client = grpc_client(&airlock).await;
    let listed = grpc_client
        .list_tools(authed(pb::OrchestratorListToolsRequest {}, &airlock.token))
        .await
        .expect("a real gRPC call during the attack");
    assert!(!listed.into_inner().tools.is_empty());
    eprintln!(
        "real HTTP and gRPC requests answered {:?} into an attack of 180 connections",
        started.elapsed()
    );
    // However many connections the attack opened, the orchestrator holds a bounded number.
    let during = open_descriptors(orchestrator);
    assert!(
        during <= baseline + 2 * CAP + 16,
        "{during} descriptors open during the attack (baseline {baseline}, cap {CAP})"
    );
    for url in [&airlock.url, &airlock.grpc] {
        let held = held_connections(orchestrator, port_of(url));
        assert!(
            held <= CAP,
            "{url}: {held} connections held, over the cap of {CAP}"
        );
    }

    let mut closed = 0;
    while let Some(outcome) = attack.join_next().await {
        assert!(
            outcome.expect("attacker task"),
            "an attacker never connected"
        );
        closed += 1;
    }
    assert_eq!(closed, 180);
    let mut buf = Vec::new();
    let read = tokio::time::timeout(BOUND, kept.read_to_end(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(_)) | Ok(Err(_))),
        "the idle keep-alive connection was not closed"
    );
    assert!(
        String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&buf)
    );

    // And afterwards everything is served as before.
    let (status, _) = airlock.get("/v1/tools").await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn a_flood_of_connections_beyond_the_cap_waits_instead_of_exhausting_descriptors() {
    raise_own_nofile();
    const CAP: usize = 8;
    // A long header timeout: the flood holds its connections for the whole test.
    let airlock = Airlock::start_with(&format!(
        "[limits]\nmax_connections = {CAP}\nheader_read_timeout_ms = 600000\n"
    ))
    .await;
    let orchestrator = airlock.process("serve orchestrator");
    let baseline = open_descriptors(orchestrator);
    let http = host_port(&airlock.url);
    // Connections the kernel completes for the listen backlog, beyond the cap.
    let mut flood = Vec::new();
    for _ in 0..100 {
        match tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(&http)).await {
            Ok(Ok(stream)) => flood.push(stream),
            // The backlog is full: the rest of the flood is not even accepted.
            _ => break,
        }
    }
    assert!(flood.len() > CAP, "only {} connections", flood.len());
    // Wait (bounded) until the orchestrator has taken all it may take: exactly its cap
    // (the harness's own pooled connection included), never more.
    let port = port_of(&airlock.url);
    let deadline = Instant::now() + BOUND;
    loop {
        let held = held_connections(orchestrator, port);
        assert!(
            held <= CAP,
            "{held} connections held, over the cap of {CAP}"
        );
        if held == CAP {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the orchestrator holds {held} connections, fewer than its cap"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let descriptors = open_descriptors(orchestrator);
    assert!(
        descriptors <= baseline + CAP + 4,
        "{descriptors} descriptors for {} connections (baseline {baseline}, cap {CAP})",
        flood.len()
    );
    // Closing the flood makes room: a real request is served.
    drop(flood);
    let client = reqwest::Client::builder()
        .timeout(BOUND)
        .build()
        .expect("client");
    let response = client
        .get(format!("{}/v1/tools", airlock.url))
        .bearer_auth(&airlock.token)
        .send()
        .await
        .expect("a request after the flood");
    assert_eq!(response.status(), 200);
}

/// `airlock up` started through `sh` with lowered open-file limits; stopped on drop.
struct LimitedUp {
    child: Option<std::process::Child>,
    dir: tempfile::TempDir,
}

impl LimitedUp {
    /// `ulimit` commands run before `airlock up` replaces the shell.
    async fn start(ulimits: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("airlock.toml");
        std::fs::write(
            &config,
            "[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n\
             [approvals]\ntools = []\n",
        )
        .expect("config");
        let log = std::fs::File::create(dir.path().join("up.log")).expect("log");
        let child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("{ulimits} && exec \"$0\" \"$@\""))
            .arg(AIRLOCK)
            .args(["up", "--data-dir"])
            .arg(dir.path().join("data"))
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "info")
            .env_remove("AIRLOCK_URL")
            .env_remove("AIRLOCK_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn airlock up");
        let mut up = Self {
            child: Some(child),
            dir,
        };
        let endpoints = up.dir.path().join("data/endpoints.json");
        let deadline = Instant::now() + BOUND;
        while !endpoints.exists() {
            if let Some(status) = up.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("airlock up exited ({status}):\n{}", up.log());
            }
            assert!(
                Instant::now() < deadline,
                "airlock up did not start:\n{}",
                up.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        up
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("up.log")).unwrap_or_default()
    }

    fn orchestrator(&self) -> u32 {
        let launcher = self.child.as_ref().expect("running").id();
        descendants(launcher)
            .into_iter()
            .find(|p| cmdline(*p).contains("serve orchestrator"))
            .expect("the orchestrator process")
    }
}

impl Drop for LimitedUp {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pids = descendants(child.id());
            crate::support::signal(child.id(), rustix::process::Signal::TERM);
            let deadline = Instant::now() + Duration::from_secs(30);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
            for pid in pids {
                crate::support::signal(pid, rustix::process::Signal::KILL);
            }
        }
    }
}

#[tokio::test]
async fn the_orchestrator_raises_its_open_file_limit_and_fits_its_cap_in_it() {
    // A soft limit below the hard one, as many shells and service managers hand out.
    let up = LimitedUp::start("ulimit -S -n 256 && ulimit -H -n 4096").await;
    let (soft, hard) = nofile(up.orchestrator());
    assert_eq!(
        (soft.as_str(), hard.as_str()),
        ("4096", "4096"),
        "{}",
        up.log()
    );
    drop(up);

    // A hard limit too low for two front doors of 1024 connections: the cap is lowered
    // to fit, and the log says so.
    let up = LimitedUp::start("ulimit -S -n 600 && ulimit -H -n 600").await;
    let (soft, _) = nofile(up.orchestrator());
    assert_eq!(soft, "600");
    let deadline = Instant::now() + BOUND;
    while !up.log().contains("does not fit the open-file limit") {
        assert!(
            Instant::now() < deadline,
            "no warning about max_connections:\n{}",
            up.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(up.log().contains("used=172"), "{}", up.log());
}

/// One body reader under every HTTP door: an oversized body on `/mcp` gets the same
/// answer as on `/v1` — read (and thrown away) before a 413 that names the cap —
/// whether it declares its length or streams it chunked.
#[tokio::test]
async fn an_oversized_body_gets_the_same_413_on_mcp_as_on_v1() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const CAP: usize = 65_536;
    let airlock = Airlock::start_with(&format!("[limits]\nmax_request_bytes = {CAP}\n")).await;
    let addr = airlock.url.trim_start_matches("http://").to_owned();
    let blob = "x".repeat(4 * CAP);
    let payload = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"read_file","arguments":{{"path":"{blob}"}}}}}}"#
    );
    for (door, chunked) in [
        ("/mcp", false),
        ("/mcp", true),
        ("/v1/tool_calls", false),
        ("/v1/tool_calls", true),
    ] {
        let mut stream = TcpStream::connect(&addr).await.expect("connect");
        let framing = if chunked {
            "Transfer-Encoding: chunked".to_owned()
        } else {
            format!("Content-Length: {}", payload.len())
        };
        let head = format!(
            "POST {door} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\
             Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n\
             {framing}\r\nConnection: close\r\n\r\n",
            airlock.token
        );
        stream.write_all(head.as_bytes()).await.expect("head");
        if chunked {
            for piece in payload.as_bytes().chunks(8192) {
                stream
                    .write_all(format!("{:x}\r\n", piece.len()).as_bytes())
                    .await
                    .expect("chunk");
                stream.write_all(piece).await.expect("chunk");
                stream.write_all(b"\r\n").await.expect("chunk");
            }
            stream.write_all(b"0\r\n\r\n").await.expect("end");
        } else {
            stream.write_all(payload.as_bytes()).await.expect("body");
        }
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(30), stream.read_to_string(&mut answer))
            .await
            .expect("an answer, not a hang")
            .expect("read");
        assert!(
            answer.starts_with("HTTP/1.1 413"),
            "{door} chunked={chunked}: {}",
            answer.lines().next().unwrap_or("")
        );
        assert!(
            answer.contains("payload_too_large")
                && answer.contains(&format!("limit of {CAP} bytes")),
            "{door} chunked={chunked}: {answer}"
        );
    }
}
