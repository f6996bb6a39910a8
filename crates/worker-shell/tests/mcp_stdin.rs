//! A stdio MCP server that stops reading its stdin while it keeps sending requests
//! (`ping`, which the client answers by itself) cannot make the worker hold the answers
//! without bound: the worker's memory stays bounded, the server is stopped with an error
//! naming the cause once a write to it has made no progress for the stall limit, the
//! call at hand gets that error, and the next call gets a fresh server. Needs root or
//! unprivileged user namespaces (a strict sandbox) and /usr/bin/python3, as the
//! sandbox crate's own tests and the e2e MCP tests do; fails naming either when missing.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::time::{Duration, Instant};

#[path = "../../../tests/support/cgroups.rs"]
mod cgroups;
#[path = "support/strict_config.rs"]
mod strict_config;
use strict_config::strict_config;

use airlock_policy::{SessionId, ToolOutcome};
use airlock_worker::mcp::McpServerEntry;
use airlock_worker::{CallContext, Tool, ToolEvent};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// The worker's stall limit (`STDIN_STALL_SECONDS` in `src/mcp/outbound.rs`), as its
/// error message states it.
const STALL_SECONDS: u64 = 60;
/// How much the worker's resident memory may grow while the server floods it: the
/// bounded queue is a few hundred small answers; without a bound it grows by hundreds
/// of megabytes a minute.
const MAX_GROWTH_BYTES: u64 = 64 << 20;

/// On its first run (no `/workspace/flooded` yet) the server answers `initialize` and
/// `tools/list`, then never reads its stdin again and writes `ping` requests, each with
/// an id of its own, as fast as it can. On later runs it is an ordinary server whose
/// one tool, `echo`, answers with its arguments.
const SERVER: &str = r#"
import json, os, sys

def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()

def answer(request):
    method = request.get("method")
    rid = request.get("id")
    params = request.get("params") or {}
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": rid, "result": {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "deaf", "version": "1"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": rid, "result": {"tools": [{
            "name": "echo", "description": "Answers with its arguments.",
            "inputSchema": {"type": "object"},
            "annotations": {"readOnlyHint": True}}]}})
    elif method == "tools/call":
        send({"jsonrpc": "2.0", "id": rid, "result": {
            "content": [{"type": "text", "text": json.dumps(params.get("arguments"))}],
            "isError": False}})
    elif method == "ping":
        send({"jsonrpc": "2.0", "id": rid, "result": {}})

first = not os.path.exists("/workspace/flooded")
if first:
    open("/workspace/flooded", "w").close()
for line in sys.stdin:
    request = json.loads(line)
    answer(request)
    if first and request.get("method") == "tools/list":
        break
if first:
    n = 0
    while True:
        chunk = "".join('{"jsonrpc":"2.0","id":%d,"method":"ping"}\n' % (n + i) for i in range(1000))
        n += 1000
        os.write(1, chunk.encode())
"#;

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

fn context(id: &str) -> CallContext {
    let (events, _) = tokio::sync::mpsc::channel::<ToolEvent>(16);
    CallContext::new(
        id.into(),
        "alice".into(),
        SessionId::parse("s1").unwrap(),
        Instant::now() + Duration::from_secs(600),
        CancellationToken::new(),
        events,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_stops_reading_its_stdin_is_stopped_and_memory_stays_bounded() {
    assert!(
        std::path::Path::new("/usr/bin/python3").exists(),
        "this test runs its MCP server with /usr/bin/python3, which this host lacks"
    );
    let root = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let (config, parent) = strict_config("mcp-stdin", root.path());
    let (_tools, sandbox) = airlock_worker_shell::tools(config.clone(), Vec::new())
        .unwrap_or_else(|e| panic!("this host cannot run a strict sandbox: {e}"));
    let entry: McpServerEntry = serde_json::from_value(json!({
        "name": "deaf",
        "command": ["/usr/bin/python3", "-c", SERVER],
        "per_session": false,
    }))
    .unwrap();
    let tools = airlock_worker_shell::mcp::start(&[entry], &config, &sandbox, state.path())
        .await
        .unwrap_or_else(|e| panic!("the test's MCP server did not start: {e}"));
    let echo = tools
        .iter()
        .find(|tool| tool.definition().name == "deaf__echo")
        .expect("the server's echo tool");
    flood_then_recover(echo).await;

    // The test's cgroup parents go with it, once the servers' sandboxes (killed when
    // their pools are dropped, by the threads that supervise them) have left theirs.
    drop(tools);
    drop(_tools);
    drop(sandbox);
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let mut dirs = cgroups::cgroup_dirs(|name| name == parent);
        if dirs.is_empty() || Instant::now() > until {
            break;
        }
        // The deepest first: a cgroup goes only once it has no children.
        dirs.sort_by_key(|dir| std::cmp::Reverse(dir.components().count()));
        for dir in dirs {
            let _ = std::fs::remove_dir(&dir);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn flood_then_recover(echo: &dyn Tool) {
    // The server floods from now on. The call waits behind the answers that cannot be
    // written; the worker's memory is sampled until the call ends.
    let baseline = rss_bytes();
    let started = Instant::now();
    let wait = Duration::from_secs(STALL_SECONDS + 60);
    let call = echo.execute(json!({"n": 1}), context("call-1"));
    tokio::pin!(call);
    let mut peak = baseline;
    let outcome: ToolOutcome = loop {
        tokio::select! {
            outcome = &mut call => break outcome,
            () = tokio::time::sleep(Duration::from_millis(100)) => {
                peak = peak.max(rss_bytes());
                assert!(
                    peak.saturating_sub(baseline) <= MAX_GROWTH_BYTES,
                    "the worker's memory grew by {} MiB in {:?} while the server did not \
                     read its stdin (bound: {} MiB)",
                    (peak - baseline) >> 20,
                    started.elapsed(),
                    MAX_GROWTH_BYTES >> 20
                );
                assert!(
                    started.elapsed() < wait,
                    "the call to a server that stopped reading its stdin did not end within {wait:?}"
                );
            }
        }
    };
    let text = outcome.content.join("\n");
    assert!(outcome.is_error, "{text}");
    assert!(
        text.contains(&format!(
            "the MCP server deaf stopped reading its stdin for {STALL_SECONDS} s"
        )),
        "the error names the cause: {text}"
    );
    assert!(
        text.contains("must keep reading its stdin"),
        "and the fix: {text}"
    );
    eprintln!(
        "ended after {:?}; memory grew by {} KiB at most; the call's error: {text}",
        started.elapsed(),
        peak.saturating_sub(baseline) >> 10
    );

    // The next call gets a fresh server (an ordinary one on its second run).
    let next = tokio::time::timeout(
        Duration::from_secs(60),
        echo.execute(json!({"n": 2}), context("call-2")),
    )
    .await
    .expect("the next call did not end within 60 s");
    let text = next.content.join("\n");
    assert!(
        !next.is_error,
        "the next call runs on a fresh server: {text}"
    );
    assert!(text.contains(r#"{"n": 2}"#), "{text}");
}
