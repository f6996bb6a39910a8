//! Calls held for approval as a newcomer meets them: `airlock call` announces the held
//! call at once and prints the result once it is approved; `wait_ms: 0` answers at once
//! on HTTP and gRPC; SSE and MCP name the approval at once; MCP answers before a client
//! times out, and ends the approval when its only waiter goes away; `duration_ms` is the
//! run time and `approval_wait_ms` the wait. Also how `airlock call` prints a command's
//! output and JSON results.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use airlock_proto::v1 as pb;
use serde_json::{Value, json};

use crate::support::{AIRLOCK, Airlock};

/// Only `write_file` is held, so other tools run at once.
const HELD: &str = "[approvals]\ntools = [\"write_file\"]\n";
/// Generous bound for anything that happens "at once" or soon.
const BOUND: Duration = Duration::from_secs(60);
const MCP_HELD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/e2e/mcp_held.py");

fn cli(airlock: &Airlock, args: &[&str]) -> Command {
    airlock.cli(args)
}

/// Output of a finished CLI run.
struct Ran {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

/// Runs the CLI to its end (bounded; killed after that).
fn run(mut command: Command) -> Ran {
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn airlock");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let output = rx
        .recv_timeout(BOUND)
        .expect("the CLI did not finish within the bound")
        .expect("wait for the CLI");
    Ran {
        status: output.status,
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// A CLI run whose stderr is read line by line while it runs.
struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    fn spawn(mut command: Command) -> Self {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn airlock");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The first stderr line holding `needle` (bounded).
    fn wait_for_line(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + BOUND;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(_) => {
                    let _ = self.child.kill();
                    panic!(
                        "the CLI printed no line with {needle:?} on stderr; it printed: {:?}",
                        self.seen
                    );
                }
            }
        }
    }

    /// Waits for the end; returns the status, stdout and the rest of stderr.
    fn finish(mut self) -> Ran {
        let mut stdout = self.child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        let mut child = self.child;
        std::thread::spawn(move || {
            let mut out = String::new();
            let _ = stdout.read_to_string(&mut out);
            let _ = tx.send((child.wait(), out));
        });
        let (status, stdout) = rx
            .recv_timeout(BOUND)
            .expect("the CLI did not finish within the bound");
        let mut stderr = self.seen;
        stderr.extend(self.lines.try_iter());
        Ran {
            status: status.expect("wait"),
            stdout,
            stderr: stderr.join("\n"),
        }
    }
}

/// Runs a command the CLI printed (`airlock approvals approve apr_… --data-dir …`).
fn run_printed(printed: &str) -> Ran {
    let words: Vec<&str> = printed.split_whitespace().collect();
    assert_eq!(words.first(), Some(&"airlock"), "{printed}");
    let mut command = Command::new(AIRLOCK);
    for key in ["AIRLOCK_URL", "AIRLOCK_TOKEN", "AIRLOCK_DATA_DIR"] {
        command.env_remove(key);
    }
    command.args(&words[1..]).stdin(Stdio::null());
    run(command)
}

fn approval_id_in(text: &str) -> String {
    let start = text
        .find("apr_")
        .unwrap_or_else(|| panic!("no approval id in {text:?}"));
    text[start..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

fn call_id_in(text: &str) -> String {
    let start = text
        .find("call_")
        .unwrap_or_else(|| panic!("no call id in {text:?}"));
    text[start..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The approval `id` as `GET /v1/approvals` lists it.
async fn approval(airlock: &Airlock, id: &str) -> Value {
    let (status, body) = airlock.get("/v1/approvals").await;
    assert_eq!(status, 200, "{body}");
    body["approvals"]
        .as_array()
        .expect("approvals")
        .iter()
        .find(|a| a["approval_id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("approval {id} not listed: {body}"))
}

/// Waits (bounded) until approval `id` is no longer pending; returns it.
async fn approval_ended(airlock: &Airlock, id: &str) -> Value {
    let deadline = Instant::now() + BOUND;
    loop {
        let a = approval(airlock, id).await;
        if a["status"] != "pending" {
            return a;
        }
        assert!(
            Instant::now() < deadline,
            "approval {id} is still pending though its only waiter went away: {a}\n{}",
            airlock.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (bounded) until a held call's approval is listed as pending; returns it.
async fn pending_approval_of(airlock: &Airlock, path: &str) -> Value {
    let deadline = Instant::now() + BOUND;
    loop {
        let (status, body) = airlock.get("/v1/approvals?status=pending").await;
        assert_eq!(status, 200, "{body}");
        if let Some(a) = body["approvals"]
            .as_array()
            .expect("approvals")
            .iter()
            .find(|a| a["input"]["path"] == path)
        {
            return a.clone();
        }
        assert!(Instant::now() < deadline, "no pending approval for {path}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn cli_announces_a_held_call_at_once_and_prints_the_result_once_approved() {
    let airlock = Airlock::start_with(HELD).await;
    let input = json!({"path": "held.txt", "content": "approved by a human\n"}).to_string();
    let mut call = Running::spawn(cli(
        &airlock,
        &["call", "write_file", &input, "--session", "cli-held"],
    ));
    // Announced while the call waits, not after some timeout: nobody has decided yet.
    let waiting = call.wait_for_line("is waiting for approval");
    let approval_id = approval_id_in(&waiting);
    let approve_line = call.wait_for_line("approve it with: ");
    let command = approve_line
        .split("approve it with: ")
        .nth(1)
        .expect("the command")
        .trim();
    assert!(
        command.starts_with(&format!("airlock approvals approve {approval_id}")),
        "{approve_line}"
    );
    assert_eq!(approval(&airlock, &approval_id).await["status"], "pending");
    assert!(!airlock.workspace("cli-held").join("held.txt").exists());

    // The printed command is the one that approves it; the waiting CLI then prints the
    // result and exits 0.
    let approved = run_printed(command);
    assert!(
        approved.status.success(),
        "{command}: {}\n{}",
        approved.stdout,
        approved.stderr
    );
    let ran = call.finish();
    assert!(
        ran.status.success(),
        "{:?}\nstdout: {}\nstderr: {}",
        ran.status,
        ran.stdout,
        ran.stderr
    );
    assert!(ran.stdout.contains("held.txt"), "{}", ran.stdout);
    assert_eq!(
        std::fs::read_to_string(airlock.workspace("cli-held").join("held.txt")).expect("written"),
        "approved by a human\n"
    );
}

#[tokio::test]
async fn cli_wait_that_runs_out_exits_75_and_leaves_the_call_approvable() {
    let airlock = Airlock::start_with(HELD).await;
    let input = json!({"path": "later.txt", "content": "later"}).to_string();
    let ran = run(cli(
        &airlock,
        &[
            "call",
            "write_file",
            &input,
            "--session",
            "cli-later",
            "--wait",
            "0",
        ],
    ));
    assert_eq!(
        ran.status.code(),
        Some(75),
        "stdout: {}\nstderr: {}",
        ran.stdout,
        ran.stderr
    );
    assert!(
        ran.stderr.contains("is waiting for approval"),
        "{}",
        ran.stderr
    );
    assert!(ran.stderr.contains("stopped waiting"), "{}", ran.stderr);
    let approval_id = approval_id_in(&ran.stderr);
    let stopped = ran
        .stderr
        .lines()
        .find(|l| l.contains("stopped waiting"))
        .expect("line");
    let call_id = call_id_in(stopped);

    // The call outlived the CLI's wait: approving it runs it once.
    assert_eq!(approval(&airlock, &approval_id).await["status"], "pending");
    let (status, body) = airlock
        .post(&format!("/v1/approvals/{approval_id}/approve"), &json!({}))
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, detail) = airlock
        .get(&format!("/v1/calls/{call_id}?wait_ms=30000"))
        .await;
    assert_eq!(status, 200, "{detail}");
    assert_eq!(detail["status"], "ok", "{detail}");
    assert_eq!(
        std::fs::read_to_string(airlock.workspace("cli-later").join("later.txt")).expect("file"),
        "later"
    );
}

#[tokio::test]
async fn wait_ms_zero_answers_at_once_on_http_and_grpc() {
    // A default wait far beyond the bound: a door that took 0 for "the default" fails.
    let airlock =
        Airlock::start_with(&format!("{HELD}\n[limits]\ndefault_wait_ms = 600000\n")).await;
    let marker = format!("held-zero-{}", std::process::id());
    let uses = |suffix: &str| {
        json!([
            {"type": "tool_use", "id": "w", "name": "write_file",
             "input": {"path": format!("zero-{suffix}.txt"), "content": "x"}},
            {"type": "tool_use", "id": "s", "name": "execute_shell",
             "input": {"command": format!("sleep 120; echo {marker}")}},
        ])
    };
    let check = |calls: &[(String, String, String)], door: &str| {
        let (status, approval, _) = &calls[0];
        assert_eq!(status, "pending_approval", "{door}: {calls:?}");
        assert!(approval.starts_with("apr_"), "{door}: {calls:?}");
        assert_eq!(calls[1].0, "running", "{door}: {calls:?}");
        assert!(calls[1].1.is_empty(), "{door}: {calls:?}");
    };

    // HTTP.
    let (status, body) = airlock
        .post(
            "/v1/tool_calls",
            &json!({"session_id": "zero", "wait_ms": 0, "tool_uses": uses("http")}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["tool_results"], json!([]), "{body}");
    let http: Vec<(String, String, String)> = body["calls"]
        .as_array()
        .expect("calls")
        .iter()
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_owned(),
                c["approval_id"].as_str().unwrap_or_default().to_owned(),
                c["call_id"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    check(&http, "HTTP");

    // gRPC: the same request, the same answer.
    let mut client = airlock.grpc_client().await;
    let tool_uses = uses("grpc")
        .as_array()
        .expect("uses")
        .iter()
        .map(|u| pb::ToolUse {
            id: u["id"].as_str().expect("id").to_owned(),
            name: u["name"].as_str().expect("name").to_owned(),
            input_json: u["input"].to_string(),
        })
        .collect();
    let mut request = tonic::Request::new(pb::CallToolsRequest {
        session_id: "zero".into(),
        tool_uses,
        wait_ms: Some(0),
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", airlock.token)
            .parse()
            .expect("metadata"),
    );
    let response = tokio::time::timeout(BOUND, client.call_tools(request))
        .await
        .expect("CallTools with wait_ms 0 did not answer")
        .expect("CallTools")
        .into_inner();
    assert!(response.tool_results.is_empty(), "{response:?}");
    let grpc: Vec<(String, String, String)> = response
        .calls
        .iter()
        .map(|c| (c.status.clone(), c.approval_id.clone(), c.call_id.clone()))
        .collect();
    check(&grpc, "gRPC");

    // Tidy up: the long commands are cancelled (and their sandboxes killed).
    for (_, _, call_id) in [&http[1], &grpc[1]] {
        let (status, body) = airlock
            .post(&format!("/v1/calls/{call_id}/cancel"), &json!({}))
            .await;
        assert_eq!(status, 200, "{body}");
    }
    airlock
        .wait_gone(&marker, "cancelled commands kept running")
        .await;
}

/// The `calls[]` metadata of a held call that was approved: the run time is
/// `duration_ms`, the wait `approval_wait_ms`, the same on every door and in the audit.
#[tokio::test]
async fn duration_ms_is_the_run_time_and_approval_wait_ms_the_wait() {
    let airlock = Airlock::start_with(HELD).await;
    let started = Instant::now();
    let body = json!({"session_id": "timing", "wait_ms": 0, "tool_uses": [
        {"type": "tool_use", "id": "w", "name": "write_file",
         "input": {"path": "timed.txt", "content": "t"}}]});
    let (status, first) = airlock.post("/v1/tool_calls", &body).await;
    assert_eq!(status, 200, "{first}");
    let call_id = first["calls"][0]["call_id"]
        .as_str()
        .expect("call id")
        .to_owned();
    let approval_id = first["calls"][0]["approval_id"]
        .as_str()
        .expect("approval id")
        .to_owned();
    assert!(
        first["calls"][0].get("approval_wait_ms").is_none(),
        "{first}"
    );
    // A human takes a moment: here, the time to run the approve command.
    let approved = run(cli(&airlock, &["approvals", "approve", &approval_id]));
    assert!(approved.status.success(), "{}", approved.stderr);
    let (status, detail) = airlock
        .get(&format!("/v1/calls/{call_id}?wait_ms=30000"))
        .await;
    let observed = started.elapsed().as_millis() as u64;
    assert_eq!(status, 200, "{detail}");
    assert_eq!(detail["status"], "ok", "{detail}");
    let duration = detail["duration_ms"].as_u64().expect("duration_ms");
    let wait = detail["approval_wait_ms"]
        .as_u64()
        .unwrap_or_else(|| panic!("no approval_wait_ms in {detail}"));
    // Both happened within what this test observed, one after the other: a duration
    // that still counted the wait would make the sum exceed it (1 ms of rounding each).
    assert!(
        duration + wait <= observed + 2,
        "duration_ms {duration} + approval_wait_ms {wait} > {observed} ms observed: {detail}"
    );

    // The audit's completion event reports the same two numbers.
    let (status, audit) = airlock
        .get(&format!("/v1/audit?call_id={call_id}&limit=100"))
        .await;
    assert_eq!(status, 200, "{audit}");
    let completed = audit["events"]
        .as_array()
        .expect("events")
        .iter()
        .find(|e| e["kind"] == "completed")
        .unwrap_or_else(|| panic!("no completed event: {audit}"));
    assert_eq!(completed["data"]["duration_ms"], duration, "{completed}");
    assert_eq!(completed["data"]["approval_wait_ms"], wait, "{completed}");

    // gRPC reports them too, for a call held and approved while CallTools waits.
    let mut client = airlock.grpc_client().await;
    let mut request = tonic::Request::new(pb::CallToolsRequest {
        session_id: "timing".into(),
        tool_uses: vec![pb::ToolUse {
            id: "g".into(),
            name: "write_file".into(),
            input_json: json!({"path": "grpc-timed.txt", "content": "g"}).to_string(),
        }],
        wait_ms: Some(60_000),
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", airlock.token)
            .parse()
            .expect("metadata"),
    );
    let grpc_started = Instant::now();
    let pending = tokio::spawn(async move { client.call_tools(request).await });
    let held = pending_approval_of(&airlock, "grpc-timed.txt").await;
    let id = held["approval_id"].as_str().expect("id");
    let (status, decided) = airlock
        .post(&format!("/v1/approvals/{id}/approve"), &json!({}))
        .await;
    assert_eq!(status, 200, "{decided}");
    let response = tokio::time::timeout(BOUND, pending)
        .await
        .expect("CallTools did not answer after the approval")
        .expect("task")
        .expect("CallTools")
        .into_inner();
    let observed = grpc_started.elapsed().as_millis() as u64;
    let info = &response.calls[0];
    assert_eq!(info.status, "ok", "{response:?}");
    let wait = info
        .approval_wait_ms
        .unwrap_or_else(|| panic!("no approval_wait_ms over gRPC: {response:?}"));
    assert!(
        info.duration_ms + wait <= observed + 2,
        "gRPC duration_ms {} + approval_wait_ms {wait} > {observed} ms observed",
        info.duration_ms
    );
    let (status, detail) = airlock.get(&format!("/v1/calls/{}", info.call_id)).await;
    assert_eq!(status, 200, "{detail}");
    assert_eq!(detail["approval_wait_ms"], wait, "{detail}");
    assert_eq!(detail["duration_ms"], info.duration_ms, "{detail}");
}

#[tokio::test]
async fn sse_names_the_approval_at_once_then_completes_when_approved() {
    let airlock = Airlock::start_with(HELD).await;
    let body = json!({"session_id": "sse-held", "tool_uses": [
        {"type": "tool_use", "id": "w", "name": "write_file",
         "input": {"path": "sse.txt", "content": "s"}}]});
    let mut response = airlock
        .request(reqwest::Method::POST, "/v1/tool_calls?stream=true")
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    let mut text = String::new();
    let mut approval_id = None;
    let mut approved = false;
    let deadline = tokio::time::Instant::now() + BOUND;
    while !text.contains("event: call.completed") {
        let chunk = tokio::time::timeout_at(deadline, response.chunk())
            .await
            .unwrap_or_else(|_| panic!("the stream stalled: {text}"))
            .expect("read the stream")
            .unwrap_or_else(|| panic!("the stream ended early: {text}"));
        text.push_str(&String::from_utf8_lossy(&chunk));
        if approval_id.is_none()
            && let Some(line) = text
                .lines()
                .skip_while(|l| *l != "event: call.pending_approval")
                .nth(1)
            && let Some(data) = line.strip_prefix("data: ")
            && let Ok(data) = serde_json::from_str::<Value>(data)
        {
            approval_id = data["approval_id"].as_str().map(str::to_owned);
            assert!(approval_id.is_some(), "no approval_id in {data}");
        }
        // Approve only once the stream has named the approval: it came while the call
        // was still undecided.
        if let (Some(id), false) = (&approval_id, approved) {
            approved = true;
            assert_eq!(approval(&airlock, id).await["status"], "pending");
            let (status, decided) = airlock
                .post(&format!("/v1/approvals/{id}/approve"), &json!({}))
                .await;
            assert_eq!(status, 200, "{decided}");
        }
    }
    assert!(approved, "{text}");
    let completed = text
        .lines()
        .skip_while(|l| *l != "event: call.completed")
        .nth(1)
        .and_then(|l| l.strip_prefix("data: "))
        .expect("completed data");
    let completed: Value = serde_json::from_str(completed).expect("JSON");
    assert_eq!(completed["call"]["status"], "ok", "{completed}");
    assert!(
        completed["call"]["approval_wait_ms"].is_u64(),
        "{completed}"
    );
}

/// A raw JSON-RPC `tools/call` to `/mcp` as a streaming response.
async fn mcp_call(airlock: &Airlock, session: &str, id: u64, path: &str) -> reqwest::Response {
    let call = json!({
        "jsonrpc": "2.0",
        "id": id,
        "method": "tools/call",
        "params": {
            "name": "write_file",
            "arguments": {"path": path, "content": "dropped"},
            "_meta": {"progressToken": format!("p{id}")},
        },
    });
    let response = airlock
        .http()
        .post(format!("{}/mcp?session_id={session}", airlock.url))
        .bearer_auth(&airlock.token)
        .header("Accept", "application/json, text/event-stream")
        .header("MCP-Protocol-Version", "2025-06-18")
        .json(&call)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    response
}

/// Reads an MCP response stream until the progress notification naming the approval.
async fn read_until_approval_named(response: &mut reqwest::Response) -> String {
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        if let Some(line) = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
            .find(|m| {
                m["method"] == "notifications/progress"
                    && m["params"]["message"]
                        .as_str()
                        .is_some_and(|t| t.contains("waiting for approval"))
            })
        {
            return approval_id_in(line["params"]["message"].as_str().unwrap_or_default());
        }
        let chunk = tokio::time::timeout_at(deadline, response.chunk())
            .await
            .unwrap_or_else(|_| panic!("no progress notification naming the approval: {text}"))
            .expect("read")
            .unwrap_or_else(|| panic!("the response ended before naming the approval: {text}"));
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
}

#[tokio::test]
async fn mcp_connection_dropped_before_a_decision_ends_the_approval() {
    // A long MCP wait, so that only the dropped connection can end the request.
    let airlock = Airlock::start_with(&format!("{HELD}\n[limits]\nmcp_wait_ms = 600000\n")).await;
    let mut response = mcp_call(&airlock, "mcp-drop", 1, "dropped.txt").await;
    let approval_id = read_until_approval_named(&mut response).await;
    assert_eq!(approval(&airlock, &approval_id).await["status"], "pending");
    drop(response);

    let ended = approval_ended(&airlock, &approval_id).await;
    assert_eq!(ended["status"], "denied", "{ended}");
    assert_eq!(ended["decided_by"], "system:cancelled", "{ended}");
    let (status, detail) = airlock
        .get(&format!(
            "/v1/calls/{}?wait_ms=20000",
            ended["call_id"].as_str().expect("call")
        ))
        .await;
    assert_eq!(status, 200, "{detail}");
    assert_eq!(detail["status"], "cancelled", "{detail}");
    // Nobody can approve it into running any more.
    let (status, body) = airlock
        .post(&format!("/v1/approvals/{approval_id}/approve"), &json!({}))
        .await;
    assert_eq!(status, 409, "{body}");
    assert!(!airlock.workspace("mcp-drop").join("dropped.txt").exists());
}

/// Fails (never skips) when python3 or the MCP SDK is missing.
async fn run_sdk(airlock: &Airlock, what: &str, session: &str) -> serde_json::Map<String, Value> {
    let mut command = tokio::process::Command::new("python3");
    command
        .arg(MCP_HELD)
        .arg(what)
        .arg(&airlock.url)
        .arg(&airlock.token)
        .arg(session)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(300), command.output())
        .await
        .expect("mcp_held.py did not finish within 300 s")
        .unwrap_or_else(|e| panic!("python3 is not available ({e}); install Python 3.10+ and `python3 -m pip install 'mcp>=1.10'`"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "mcp_held.py {what} failed ({}); the MCP Python SDK is needed (`python3 -m pip install 'mcp>=1.10'`):\nstdout: {stdout}\nstderr: {stderr}\nairlock log:\n{}",
        output.status,
        airlock.log()
    );
    let runs: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("mcp_held.py printed no JSON ({e}): {stdout}\n{stderr}"));
    let runs = runs.as_object().expect("runs by mode").clone();
    assert!(runs.contains_key("legacy"), "{runs:?}");
    runs
}

#[tokio::test]
async fn mcp_client_with_a_short_timeout_reads_how_to_approve() {
    // The default MCP wait, against a client that gives up after 20 s (as MCP hosts do,
    // some much sooner): Airlock must answer first.
    let airlock = Airlock::start_with(HELD).await;
    let runs = run_sdk(&airlock, "timeout", "mcp-short").await;
    for (mode, run) in &runs {
        assert!(
            run.get("client_error").is_none(),
            "{mode}: the client timed out before Airlock answered: {run}"
        );
        assert_eq!(run["is_error"], true, "{mode}: {run}");
        let approval_id = run["meta"]["airlock/approval_id"]
            .as_str()
            .unwrap_or_else(|| panic!("{mode}: no approval id in {run}"));
        let text = run["text"].as_str().expect("text");
        assert!(
            text.contains(&format!("airlock approvals approve {approval_id}")),
            "{mode}: {text}"
        );
        assert!(
            run["progress"]
                .as_array()
                .expect("progress")
                .iter()
                .any(|m| m.as_str().is_some_and(|m| m.contains(approval_id))),
            "{mode}: no progress notification named the approval: {run}"
        );
        // The wait ran out, the client got the message: the approval stays pending and
        // the command it names runs the call.
        assert_eq!(approval(&airlock, approval_id).await["status"], "pending");
        let (status, decided) = airlock
            .post(&format!("/v1/approvals/{approval_id}/approve"), &json!({}))
            .await;
        assert_eq!(status, 200, "{mode}: {decided}");
        let call_id = run["meta"]["airlock/call_id"].as_str().expect("call id");
        let (status, detail) = airlock
            .get(&format!("/v1/calls/{call_id}?wait_ms=30000"))
            .await;
        assert_eq!(status, 200, "{detail}");
        assert_eq!(detail["status"], "ok", "{mode}: {detail}");
        assert!(
            airlock
                .workspace("mcp-short")
                .join(format!("{mode}.txt"))
                .exists(),
            "{mode}"
        );
    }
}

#[tokio::test]
async fn mcp_request_abandoned_before_a_decision_ends_the_approval() {
    let airlock = Airlock::start_with(&format!("{HELD}\n[limits]\nmcp_wait_ms = 600000\n")).await;
    let runs = run_sdk(&airlock, "abandon", "mcp-abandon").await;
    for (mode, run) in &runs {
        assert_eq!(run["finished"], false, "{mode}: {run}");
        let approval_id = run["approval_id"]
            .as_str()
            .unwrap_or_else(|| panic!("{mode}: no progress notification named the approval"));
        let ended = approval_ended(&airlock, approval_id).await;
        assert_eq!(ended["status"], "denied", "{mode}: {ended}");
        assert_eq!(ended["decided_by"], "system:cancelled", "{mode}: {ended}");
        assert!(
            !airlock
                .workspace("mcp-abandon")
                .join(format!("{mode}.txt"))
                .exists(),
            "{mode}"
        );
    }
}

#[tokio::test]
async fn cli_prints_a_commands_stdout_and_stderr_and_exits_with_its_status() {
    let airlock = Airlock::start().await;
    let call = |input: Value| {
        run(cli(
            &airlock,
            &["call", "execute_shell", &input.to_string()],
        ))
    };

    let ran = call(json!({"command": "echo out; echo err >&2; exit 3"}));
    assert_eq!(ran.status.code(), Some(3), "{}\n{}", ran.stdout, ran.stderr);
    assert_eq!(ran.stdout, "out\n");
    assert!(ran.stderr.starts_with("err\n"), "{}", ran.stderr);
    assert!(ran.stderr.contains("exit code 3"), "{}", ran.stderr);

    let ran = call(json!({"command": "printf 'a \"quoted\"\\nline\\n'"}));
    assert!(ran.status.success(), "{}\n{}", ran.stdout, ran.stderr);
    assert_eq!(ran.stdout, "a \"quoted\"\nline\n");
    assert_eq!(ran.stderr, "");

    let ran = call(json!({"command": "kill -TERM $$"}));
    assert_eq!(ran.status.code(), Some(128 + 15), "{}", ran.stderr);
    assert!(ran.stderr.contains("signal 15"), "{}", ran.stderr);

    let ran = call(json!({"command": "sleep 30", "timeout_seconds": 1}));
    assert_eq!(ran.status.code(), Some(124), "{}", ran.stderr);
    assert!(ran.stderr.contains("timed out"), "{}", ran.stderr);

    // --json is still the whole response.
    let ran = run(cli(
        &airlock,
        &[
            "call",
            "execute_shell",
            r#"{"command": "echo j"}"#,
            "--json",
        ],
    ));
    assert!(ran.status.success(), "{}", ran.stderr);
    let body: Value = serde_json::from_str(&ran.stdout).expect("--json prints JSON");
    assert_eq!(body["calls"][0]["status"], "ok", "{body}");
    let inner: Value = serde_json::from_str(
        body["tool_results"][0]["content"][0]["text"]
            .as_str()
            .expect("text"),
    )
    .expect("the result text is the command's JSON");
    assert_eq!(inner["stdout"], "j\n");

    // A JSON result (db tools, http tools) is pretty-printed, not one escaped line.
    let ran = run(cli(
        &airlock,
        &[
            "call",
            "query_database",
            r#"{"database": "demo", "sql": "SELECT 1 AS one, 'two' AS two"}"#,
        ],
    ));
    assert!(ran.status.success(), "{}\n{}", ran.stdout, ran.stderr);
    let printed: Value = serde_json::from_str(&ran.stdout).expect("JSON document");
    assert!(printed.is_object(), "{}", ran.stdout);
    assert!(
        ran.stdout.lines().count() > 3 && ran.stdout.contains("\n  \""),
        "not pretty-printed: {}",
        ran.stdout
    );
}

/// Runs the CLI on a pseudo-terminal (Python's `pty`), returning what the terminal got.
fn run_on_terminal(airlock: &Airlock, args: &[&str]) -> (i32, String) {
    const DRIVER: &str = r#"
import json, os, pty, sys
pid, fd = pty.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
out = b""
while True:
    try:
        chunk = os.read(fd, 65536)
    except OSError:
        break
    if not chunk:
        break
    out += chunk
_, status = os.waitpid(pid, 0)
print(json.dumps({"code": os.waitstatus_to_exitcode(status), "output": out.decode("utf-8", "replace")}))
"#;
    let mut command = Command::new("python3");
    command.arg("-c").arg(DRIVER).arg(AIRLOCK).args(args);
    command.arg("--data-dir").arg(airlock.data_dir());
    for key in ["AIRLOCK_URL", "AIRLOCK_TOKEN", "AIRLOCK_DATA_DIR"] {
        command.env_remove(key);
    }
    let ran = run(command);
    assert!(
        ran.status.success(),
        "the pty driver failed (python3 is needed): {}",
        ran.stderr
    );
    let report: Value = serde_json::from_str(ran.stdout.trim()).expect("driver JSON");
    (
        report["code"].as_i64().expect("code") as i32,
        report["output"].as_str().expect("output").to_owned(),
    )
}

#[tokio::test]
async fn control_characters_reach_a_terminal_escaped_and_a_pipe_unchanged() {
    let airlock = Airlock::start().await;
    // A window-title escape, colours, clear-screen on stderr, and a C1 CSI.
    let input = json!({"command": "printf '\\033]0;pwned\\007\\033[31mred\\033[0m\\tok\\n'; printf 'e\\033[2Jrr\\302\\233\\n' >&2"}).to_string();
    let (code, shown) = run_on_terminal(&airlock, &["call", "execute_shell", &input]);
    assert_eq!(code, 0, "{shown}");
    assert!(
        !shown.contains('\u{1b}') && !shown.contains('\u{7}') && !shown.contains('\u{9b}'),
        "raw control characters reached the terminal: {shown:?}"
    );
    assert!(
        shown.contains("\\x1b]0;pwned\\x07\\x1b[31mred\\x1b[0m\tok"),
        "{shown:?}"
    );
    assert!(shown.contains("e\\x1b[2Jrr\\u{9b}"), "{shown:?}");

    // Redirected, the output is the command's own bytes.
    let ran = run(cli(&airlock, &["call", "execute_shell", &input]));
    assert!(ran.status.success(), "{}", ran.stderr);
    assert_eq!(
        ran.stdout,
        "\u{1b}]0;pwned\u{7}\u{1b}[31mred\u{1b}[0m\tok\n"
    );
    assert_eq!(ran.stderr, "e\u{1b}[2Jrr\u{9b}\n");
}

/// The orchestrator's resident memory, from `/proc/<pid>/status`.
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

/// Calls held for approval keep nothing of their arguments in memory while they wait
/// (the store has them): forty held writes of 1 MiB each leave the orchestrator's
/// resident memory where it was, and an approved one still writes its whole content,
/// read back from the store.
#[tokio::test]
async fn held_calls_do_not_keep_their_arguments_in_memory() {
    const HELD_CALLS: usize = 40;
    const CONTENT: usize = 1 << 20;
    let airlock = Airlock::start_with(HELD).await;
    let orchestrator = airlock.process("serve orchestrator");
    let content = |n: usize| format!("{n:04}{}", "m".repeat(CONTENT - 4));
    let hold = |n: usize| {
        json!({"session_id": "held-memory", "wait_ms": 0, "tool_uses": [{"type": "tool_use", "id": "w",
            "name": "write_file", "input": {"path": format!("big{n}.txt"), "content": content(n)}}]})
    };
    // One held, approved and written first: what a first call allocates for good is in
    // the baseline.
    let (status, first) = airlock.post("/v1/tool_calls", &hold(0)).await;
    assert_eq!(status, 200, "{first}");
    let approval = first["calls"][0]["approval_id"]
        .as_str()
        .expect("held")
        .to_owned();
    airlock
        .post(&format!("/v1/approvals/{approval}/approve"), &json!({}))
        .await;
    let (_, done) = airlock
        .get(&format!(
            "/v1/calls/{}?wait_ms=60000",
            first["calls"][0]["call_id"].as_str().expect("id")
        ))
        .await;
    assert_eq!(done["status"], "ok", "{done}");
    let before = rss_bytes(orchestrator);

    // Half of them with a caller that waits (10 minutes) on the open request, as the
    // default `wait_ms` has it wait a minute: that door must not keep them either.
    let client = reqwest::Client::new();
    let mut waiting = Vec::new();
    for n in (1..HELD_CALLS).step_by(2) {
        let mut body = hold(n);
        body["wait_ms"] = json!(600_000);
        let request = client
            .post(format!("{}/v1/tool_calls", airlock.url))
            .bearer_auth(&airlock.token)
            .json(&body);
        waiting.push(tokio::spawn(async move { request.send().await }));
    }
    let mut held = Vec::new();
    for n in (2..=HELD_CALLS).step_by(2) {
        let (status, body) = airlock.post("/v1/tool_calls", &hold(n)).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["calls"][0]["status"], "pending_approval", "{body}");
        held.push((
            body["calls"][0]["call_id"].as_str().expect("id").to_owned(),
            body["calls"][0]["approval_id"]
                .as_str()
                .expect("held")
                .to_owned(),
        ));
    }
    // Every one of them held (the waiting ones too) before memory is read.
    let deadline = std::time::Instant::now() + BOUND;
    loop {
        // Counted in the store: a page of the listing is bounded in bytes, and these
        // approvals carry a megabyte each.
        let count = {
            let db =
                rusqlite::Connection::open(airlock.data_dir().join("airlock.db")).expect("store");
            db.busy_timeout(Duration::from_secs(10)).expect("timeout");
            db.query_row(
                "SELECT COUNT(*) FROM approvals WHERE status = 'pending'",
                [],
                |row| row.get::<_, i64>(0),
            )
            .expect("count") as usize
        };
        if count >= HELD_CALLS {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{count} of {HELD_CALLS} calls held"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = rss_bytes(orchestrator);
    let grown = after.saturating_sub(before);
    assert!(
        grown < (HELD_CALLS * CONTENT / 2) as u64,
        "{HELD_CALLS} held calls of {CONTENT} bytes grew the orchestrator by {} MiB ({} → {} MiB)",
        grown >> 20,
        before >> 20,
        after >> 20
    );

    // The last one approved: its arguments come back whole from the store.
    let (call_id, approval) = held.pop().expect("held");
    let (status, body) = airlock
        .post(&format!("/v1/approvals/{approval}/approve"), &json!({}))
        .await;
    assert_eq!(status, 200, "{body}");
    let (_, done) = airlock
        .get(&format!("/v1/calls/{call_id}?wait_ms=60000"))
        .await;
    assert_eq!(done["status"], "ok", "{done}");
    let written = std::fs::read_to_string(
        airlock
            .workspace("held-memory")
            .join(format!("big{HELD_CALLS}.txt")),
    )
    .expect("written");
    assert!(
        written == content(HELD_CALLS),
        "the approved write lost its content"
    );
    for request in waiting {
        request.abort();
    }
}
