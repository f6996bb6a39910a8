//! The MCP front door (`/mcp`, Streamable HTTP): driven by the official MCP Python SDK
//! as a real MCP host would, plus raw HTTP checks of authentication, `Origin`
//! validation and pending approvals.

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::Airlock;

const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/e2e/mcp_client.py");
const SDK_FIX: &str = "python3 -m pip install 'mcp>=1.10'";

/// Fails (never skips) when python3 or the MCP SDK is missing, naming the fix.
pub(crate) async fn require_python_sdk() {
    let probe = tokio::process::Command::new("python3")
        .args([
            "-c",
            "import mcp, importlib.metadata as m; print(m.version('mcp'))",
        ])
        .output()
        .await;
    match probe {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!(
            "the MCP Python SDK is not installed (the MCP test drives /mcp with it); install it with: {SDK_FIX}\n{}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => panic!(
            "python3 is not available ({e}); install Python 3.10+ and then the MCP SDK: {SDK_FIX}"
        ),
    }
}

#[tokio::test]
async fn python_sdk_lists_calls_streams_progress_and_gets_error_results() {
    require_python_sdk().await;
    let airlock = Airlock::start().await;
    let mut command = tokio::process::Command::new("python3");
    command
        .arg(CLIENT)
        .arg(&airlock.url)
        .arg(&airlock.token)
        .arg("mcp-e2e")
        .arg(airlock.workspace("mcp-e2e"))
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(180), command.output())
        .await
        .expect("the MCP client did not finish within 180 s")
        .expect("run python3 mcp_client.py");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "mcp_client.py failed ({}):\nstdout: {stdout}\nstderr: {stderr}\nairlock log:\n{}",
        output.status,
        airlock.log()
    );
    let runs: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("mcp_client.py printed no JSON ({e}): {stdout}\n{stderr}"));
    let runs = runs.as_object().expect("runs by negotiation mode");
    assert!(runs.contains_key("legacy"), "{runs:?}");

    for (mode, run) in runs {
        let ctx = format!("mode {mode} (protocol {})", run["protocol_version"]);
        // tools/list: names, titles, schemas and annotations.
        let tools = run["tools"].as_array().expect("tools");
        let tool = |name: &str| {
            tools
                .iter()
                .find(|t| t["name"] == name)
                .unwrap_or_else(|| panic!("{ctx}: {name} missing from {tools:?}"))
        };
        for t in tools {
            assert_eq!(t["input_schema_type"], "object", "{ctx}: {t}");
            assert!(
                t["title"].as_str().is_some_and(|s| !s.is_empty()),
                "{ctx}: {t}"
            );
            assert!(t["annotations"].is_object(), "{ctx}: {t}");
        }
        let shell = tool("execute_shell");
        assert_eq!(shell["annotations"]["destructiveHint"], true, "{ctx}");
        assert_eq!(shell["annotations"]["readOnlyHint"], false, "{ctx}");
        assert_eq!(shell["annotations"]["title"], shell["title"], "{ctx}");
        assert_eq!(
            tool("read_file")["annotations"]["readOnlyHint"],
            true,
            "{ctx}"
        );
        assert_eq!(
            tool("fetch_url")["annotations"]["openWorldHint"],
            true,
            "{ctx}"
        );
        assert_eq!(
            tool("create_directory")["annotations"]["idempotentHint"],
            true,
            "{ctx}"
        );

        // tools/call through the gate, with output as progress while it runs: the
        // command waits for a file the client creates only when the progress for its
        // first line arrives, so a result at all means that progress was streamed first.
        assert_eq!(run["shell"]["is_error"], false, "{ctx}: {}", run["shell"]);
        let result: Value = serde_json::from_str(run["shell"]["text"].as_str().expect("text"))
            .expect("execute_shell returns a JSON object");
        assert_eq!(result["stdout"], "a\nb\n", "{ctx}");
        assert_eq!(result["exit_code"], 0, "{ctx}");
        assert!(
            run["shell"]["meta"]["airlock/call_id"]
                .as_str()
                .is_some_and(|id| id.starts_with("call_")),
            "{ctx}: {}",
            run["shell"]
        );
        let progress = run["progress"].as_array().expect("progress");
        let messages: Vec<&str> = progress
            .iter()
            .filter_map(|p| p["message"].as_str())
            .collect();
        assert!(
            messages.iter().any(|m| m.contains("[stdout] a"))
                && messages.iter().any(|m| m.contains("[stdout] b")),
            "{ctx}: no progress for each output chunk: {progress:?}"
        );
        let released = run["released_at_progress"]
            .as_u64()
            .unwrap_or_else(|| panic!("{ctx}: the first line never came as progress: {run}"));
        let released = usize::try_from(released).expect("index");
        assert!(
            progress[..released]
                .iter()
                .all(|p| !p["message"].as_str().unwrap_or("").contains("[stdout] b")),
            "{ctx}: the second line came before the client released the command: {progress:?}"
        );
        assert!(
            progress[released..]
                .iter()
                .any(|p| p["message"].as_str().unwrap_or("").contains("[stdout] b")),
            "{ctx}: no progress for the second line after the release: {progress:?}"
        );
        let values: Vec<f64> = progress
            .iter()
            .map(|p| p["progress"].as_f64().expect("progress value"))
            .collect();
        assert!(
            values.windows(2).all(|w| w[0] < w[1]),
            "{ctx}: progress must increase: {values:?}"
        );

        // A schema violation is an isError result that names the field and the rule.
        assert_eq!(run["schema_error"]["is_error"], true, "{ctx}");
        let text = run["schema_error"]["text"].as_str().expect("text");
        assert!(
            text.contains("/command") && text.contains("type"),
            "{ctx}: {text}"
        );
        assert_eq!(run["unknown_tool"]["is_error"], true, "{ctx}");
        assert!(
            run["unknown_tool"]["text"]
                .as_str()
                .is_some_and(|t| t.contains("unknown tool")),
            "{ctx}"
        );
        assert_eq!(run["cancel"]["finished"], false, "{ctx}: {}", run["cancel"]);
    }

    // `?session_id=` chose the session, so the workspace of that session was used.
    assert!(
        airlock.workspace("mcp-e2e").is_dir(),
        "no workspace for session mcp-e2e"
    );

    // Every abandoned call was cancelled (its sandbox killed) before its 20 s sleep ended:
    // a call that ran out would be `ok`, not `cancelled`.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, audit) = airlock.get("/v1/audit?session_id=mcp-e2e&limit=1000").await;
        assert_eq!(status, 200, "{audit}");
        let events = audit["events"].as_array().expect("events");
        let abandoned: Vec<&Value> = events
            .iter()
            .filter(|e| e["kind"] == "requested" && e["data"].to_string().contains("cancel-me"))
            .collect();
        assert_eq!(abandoned.len(), runs.len(), "{abandoned:?}");
        let endings: Vec<&Value> = abandoned
            .iter()
            .filter_map(|r| {
                events
                    .iter()
                    .find(|e| e["kind"] == "completed" && e["call_id"] == r["call_id"])
            })
            .collect();
        if endings.len() == abandoned.len() {
            for end in endings {
                assert_eq!(end["data"]["status"], "cancelled", "{end}");
                eprintln!(
                    "an abandoned call was cancelled after {} ms (measured, not asserted)",
                    end["data"]["duration_ms"]
                );
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "abandoned MCP calls were not cancelled: {abandoned:?}\n{}",
            airlock.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A raw JSON-RPC POST to `/mcp`.
fn mcp_post(airlock: &Airlock, path: &str, body: &Value) -> reqwest::RequestBuilder {
    airlock
        .http()
        .post(format!("{}{path}", airlock.url))
        .header("Accept", "application/json, text/event-stream")
        .header("Content-Type", "application/json")
        .header("MCP-Protocol-Version", "2025-06-18")
        .json(body)
}

/// The JSON-RPC messages of an SSE response body.
fn sse_messages(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str(d.trim()).ok())
        .collect()
}

const LIST: &str = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#;

/// `notifications/cancelled` names a request by its id, which clients number from 0 or
/// 1: one sent in another session (`?session_id=`) does not stop a call with the same
/// id, one sent in the call's own session does.
#[tokio::test]
async fn a_cancel_from_another_session_leaves_the_call_running() {
    let airlock = Airlock::start().await;
    let call = json!({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {
        "name": "execute_shell", "arguments": {"command": "sleep 30; echo cancel-test"}}});
    let running = mcp_post(&airlock, "/mcp?session_id=s1", &call)
        .bearer_auth(&airlock.token)
        .send();
    // The response stream is read to its end: a client that closes it cancels the call.
    let running = tokio::spawn(async move { running.await?.text().await });
    // The call's id, once it is recorded.
    let deadline = Instant::now() + Duration::from_secs(30);
    let call_id = loop {
        let (_, audit) = airlock.get("/v1/audit?session_id=s1&limit=100").await;
        let requested = audit["events"].as_array().and_then(|events| {
            events
                .iter()
                .find(|e| e["kind"] == "requested" || e["kind"] == "dispatched")
                .and_then(|e| e["call_id"].as_str().map(str::to_owned))
        });
        if let Some(id) = requested {
            break id;
        }
        assert!(
            Instant::now() < deadline,
            "the call was not recorded: {audit}\n{}",
            airlock.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let cancel = |session: &str| {
        mcp_post(
            &airlock,
            &format!("/mcp?session_id={session}"),
            &json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": 5, "reason": "test"}}),
        )
        .bearer_auth(&airlock.token)
        .send()
    };
    let status = cancel("s2").await.expect("send").status();
    assert!(status.is_success(), "{status}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, detail) = airlock.get(&format!("/v1/calls/{call_id}")).await;
    assert_eq!(
        detail["status"], "running",
        "another session's cancel stopped it: {detail}"
    );

    cancel("s1").await.expect("send");
    let (_, detail) = airlock
        .get(&format!("/v1/calls/{call_id}?wait_ms=20000"))
        .await;
    assert_eq!(detail["status"], "cancelled", "{detail}");
    running.abort();
}

#[tokio::test]
async fn bearer_token_and_origin_are_checked() {
    let airlock = Airlock::start().await;
    let list: Value = serde_json::from_str(LIST).expect("json");

    let response = mcp_post(&airlock, "/mcp", &list)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 401);
    let body: Value = response.json().await.expect("JSON error");
    assert_eq!(body["error"]["code"], "unauthorized", "{body}");

    let response = mcp_post(&airlock, "/mcp", &list)
        .bearer_auth("not-the-token")
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 401);

    // DNS rebinding: a page on another origin is refused even with a valid token.
    for origin in [
        "http://evil.example",
        "http://localhost.evil.example",
        "null",
    ] {
        let response = mcp_post(&airlock, "/mcp", &list)
            .bearer_auth(&airlock.token)
            .header("Origin", origin)
            .send()
            .await
            .expect("send");
        assert_eq!(response.status(), 403, "Origin {origin}");
        let body: Value = response.json().await.expect("JSON error");
        assert_eq!(body["error"]["code"], "forbidden", "{body}");
    }

    // Loopback origins and clients without Origin are served.
    for origin in [
        Some("http://localhost:6274"),
        Some("http://127.0.0.1"),
        None,
    ] {
        let mut request = mcp_post(&airlock, "/mcp", &list).bearer_auth(&airlock.token);
        if let Some(origin) = origin {
            request = request.header("Origin", origin);
        }
        let response = request.send().await.expect("send");
        assert_eq!(response.status(), 200, "Origin {origin:?}");
        let text = response.text().await.expect("body");
        let messages = sse_messages(&text);
        let tools = messages
            .iter()
            .find(|m| m["id"] == 1)
            .and_then(|m| m["result"]["tools"].as_array())
            .unwrap_or_else(|| panic!("no tools/list result in {text}"));
        assert!(tools.iter().any(|t| t["name"] == "execute_shell"));
    }

    // A session id that is not a valid session name is a 400, not a stray workspace.
    let response = mcp_post(&airlock, "/mcp?session_id=..%2Fescape", &list)
        .bearer_auth(&airlock.token)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 400);
}

#[tokio::test]
async fn pending_approval_waits_then_names_the_approval() {
    let airlock = Airlock::start_with(
        "[approvals]\ntools = [\"write_file\"]\n\n[limits]\nmcp_wait_ms = 1500\n",
    )
    .await;
    let call = json!({
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {
            "name": "write_file",
            "arguments": {"path": "approved.txt", "content": "yes"},
            "_meta": {"progressToken": "p7"},
        },
    });
    let started = Instant::now();
    let response = mcp_post(&airlock, "/mcp?session_id=mcp-approvals", &call)
        .bearer_auth(&airlock.token)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    let text = response.text().await.expect("body");
    eprintln!(
        "answered after {:?} with mcp_wait_ms = 1500 (measured, not asserted)",
        started.elapsed()
    );
    let messages = sse_messages(&text);
    // The request is held: first the notice that the call waits for approval, then
    // (once the wait is over, the approval still pending) the result naming it.
    let notice = messages
        .iter()
        .position(|m| {
            m["method"] == "notifications/progress"
                && m["params"]["progressToken"] == "p7"
                && m["params"]["message"]
                    .as_str()
                    .is_some_and(|t| t.contains("waiting for approval"))
        })
        .unwrap_or_else(|| panic!("no progress notification about the approval: {text}"));
    let answer = messages
        .iter()
        .position(|m| m["id"] == 7)
        .unwrap_or_else(|| panic!("no result in {text}"));
    assert!(notice < answer, "the result came before the notice: {text}");
    let result = &messages[answer]["result"];
    assert_eq!(result["isError"], true, "{result}");
    let approval_id = result["_meta"]["airlock/approval_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no approval id in {result}"));
    let call_id = result["_meta"]["airlock/call_id"]
        .as_str()
        .expect("call id");
    let message = result["content"][0]["text"].as_str().expect("text");
    assert!(
        message.contains(&format!("airlock approvals approve {approval_id}")),
        "{message}"
    );
    assert!(
        !airlock
            .workspace("mcp-approvals")
            .join("approved.txt")
            .exists()
    );

    // The call kept waiting: approving it runs it once.
    let (status, body) = airlock
        .post(
            &format!("/v1/approvals/{approval_id}/approve"),
            &json!({"reason": "ok"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, detail) = airlock
        .get(&format!("/v1/calls/{call_id}?wait_ms=15000"))
        .await;
    assert_eq!(status, 200, "{detail}");
    assert_eq!(detail["status"], "ok", "{detail}");
    let written = std::fs::read_to_string(airlock.workspace("mcp-approvals").join("approved.txt"))
        .expect("the approved write happened");
    assert_eq!(written, "yes");
}

/// A tool name or id with control characters: PostgreSQL cannot store a NUL as text (the
/// call's records would be lost) and others make log lines and the console lie. `/v1`
/// answers 400; the MCP door, which takes names as they come, has the gate refuse the
/// call as an error result that is audited, the name recorded escaped.
#[tokio::test]
async fn names_and_ids_with_control_characters_are_refused_and_audited() {
    let airlock = Airlock::start().await;
    for (id, name) in [("a\u{0}b", "read_file"), ("ok", "read_file\u{1b}[2K")] {
        let body = json!({"session_id": "ctl", "tool_uses": [
            {"type": "tool_use", "id": id, "name": name, "input": {"path": "x"}}]});
        let (status, answer) = airlock.post("/v1/tool_calls", &body).await;
        assert_eq!(status, 400, "{answer}");
        assert!(
            answer["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("control characters")),
            "{answer}"
        );
    }
    for (n, name) in ["read_file\u{0}", "read\u{1b}[31m_file", "read_file\n"]
        .into_iter()
        .enumerate()
    {
        let call = json!({"jsonrpc": "2.0", "id": 10 + n, "method": "tools/call", "params": {
            "name": name, "arguments": {"path": "x"}}});
        let response = mcp_post(&airlock, "/mcp?session_id=ctl", &call)
            .bearer_auth(&airlock.token)
            .send()
            .await
            .expect("send");
        assert!(response.status().is_success(), "{}", response.status());
        let text = response.text().await.expect("body");
        let result = sse_messages(&text)
            .into_iter()
            .find(|m| m["id"] == 10 + n)
            .unwrap_or_else(|| panic!("no answer to the call: {text}"));
        assert_eq!(result["result"]["isError"], true, "{result}");
        let said = result["result"]["content"][0]["text"]
            .as_str()
            .unwrap_or_default();
        assert!(
            said.contains("must be 1 to 256 characters without control characters"),
            "{result}"
        );
    }
    let (status, audit) = airlock.get("/v1/audit?session_id=ctl&limit=100").await;
    assert_eq!(status, 200, "{audit}");
    let events = audit["events"].as_array().expect("events");
    let of = |kind: &'static str| events.iter().filter(move |e| e["kind"] == kind);
    let rejected: Vec<_> = of("rejected")
        .filter(|e| e["data"]["reason"] == "malformed_tool_use")
        .collect();
    assert_eq!(rejected.len(), 3, "{audit}");
    let mut names: Vec<&str> = of("requested")
        .filter_map(|e| e["data"]["tool"].as_str())
        .collect();
    names.sort_unstable();
    assert_eq!(
        names,
        ["read\\u{1b}[31m_file", "read_file\\0", "read_file\\n"],
        "{audit}"
    );
    assert!(
        !audit.to_string().contains("\\u0000") && !audit.to_string().contains("\\u001b"),
        "a control character was recorded: {audit}"
    );
    // Nothing of it ran.
    assert_eq!(of("dispatched").count(), 0, "{audit}");
}
