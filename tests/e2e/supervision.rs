//! The launcher: restarts a crashed worker, and stops everything on SIGTERM.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use rustix::process::Signal;
use serde_json::json;

use crate::support::{Airlock, alive, cmdline, descendants, signal};

#[tokio::test]
async fn a_worker_killed_mid_call_gives_a_clear_error_and_comes_back() {
    let airlock = Airlock::start().await;
    let (err, _, _) = airlock
        .call("write_file", json!({"path": "a.txt", "content": "x"}))
        .await;
    assert!(!err);

    // Freeze the worker so the next call is stuck inside it, then kill it mid-call.
    let pid = airlock.process("serve worker fs");
    signal(pid, Signal::STOP);
    let call = {
        let body = json!({"tool_uses": [{"type": "tool_use", "id": "t", "name": "read_file", "input": {"path": "a.txt"}}]});
        let request = airlock
            .request(reqwest::Method::POST, "/v1/tool_calls")
            .json(&body);
        tokio::spawn(async move {
            request
                .send()
                .await
                .expect("send")
                .json::<serde_json::Value>()
                .await
                .expect("json")
        })
    };
    // The call has been handed to the frozen worker once the orchestrator counts it in
    // flight on the fs replica (a read is audited when it ends, so the log cannot say).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, ready) = airlock.get("/readyz").await;
        let in_flight = ready["replicas"]["fs"][0]["in_flight"].as_u64();
        if in_flight == Some(1) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the read_file call was never dispatched: {ready}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !call.is_finished(),
        "the call should be waiting on the frozen worker"
    );
    signal(pid, Signal::KILL);
    let body = tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .expect("answer in time")
        .expect("task");
    let result = &body["tool_results"][0];
    assert_eq!(result["is_error"], true, "{body}");
    let text = result["content"][0]["text"].as_str().expect("text");
    assert!(
        text.contains("fs worker"),
        "the error names the worker: {text}"
    );
    assert_eq!(body["calls"][0]["status"], "error");

    // The launcher restarts the worker; the next call succeeds.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (err, text, _) = airlock.call("read_file", json!({"path": "a.txt"})).await;
        if !err {
            assert_eq!(text, "x");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "worker did not come back: {text}\n{}",
            airlock.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!alive(pid));
    assert_ne!(airlock.process("serve worker fs"), pid);
}

#[tokio::test]
async fn sigterm_stops_every_component_and_leaves_no_process() {
    let mut airlock = Airlock::start().await;
    let children = descendants(airlock.pid());
    assert!(
        children.len() >= 2,
        "orchestrator and fs worker: {children:?}"
    );
    let status = airlock.stop();
    assert!(status.success(), "launcher exit status {status}");
    for pid in children {
        assert!(
            !alive(pid),
            "process {pid} ({}) outlived the launcher",
            cmdline(pid)
        );
    }
    assert!(!airlock.data_dir().join("endpoints.json").exists());
}

#[tokio::test]
async fn children_die_with_a_killed_launcher() {
    let mut airlock = Airlock::start().await;
    let children = descendants(airlock.pid());
    signal(airlock.pid(), Signal::KILL);
    let _ = airlock.stop_after_kill();
    let deadline = Instant::now() + Duration::from_secs(20);
    while children.iter().any(|p| alive(*p)) {
        assert!(
            Instant::now() < deadline,
            "children outlived a killed launcher"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The socket descriptors (`socket:[<inode>]`) process `pid` holds.
fn sockets(pid: u32) -> BTreeSet<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the process's descriptors")
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .map(|target| target.to_string_lossy().into_owned())
        .filter(|target| target.starts_with("socket:["))
        .collect()
}

/// The socket (`socket:[<inode>]`) listening on local TCP port `port`, from the
/// kernel's TCP tables.
fn listening_socket(port: u16) -> String {
    let port_hex = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|text| text.lines().skip(1).map(str::to_owned).collect::<Vec<_>>())
        .find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.len() > 9 && fields[1].ends_with(&port_hex) && fields[3] == "0A")
                .then(|| format!("socket:[{}]", fields[9]))
        })
        .unwrap_or_else(|| panic!("nothing listens on port {port}"))
}

fn port(url: &str) -> u16 {
    url.trim_end_matches('/')
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {url}"))
}

/// The launcher binds the orchestrator's front doors (port 0 here) and holds them; the
/// orchestrator serves on those very sockets, so no other process can take a port
/// between the launcher's choice and the orchestrator's start, nor while a killed
/// orchestrator is restarted.
#[tokio::test]
async fn the_orchestrator_serves_on_the_sockets_the_launcher_bound() {
    let airlock = Airlock::start().await;
    let listeners = [
        listening_socket(port(&airlock.url)),
        listening_socket(port(&airlock.grpc)),
    ];
    let launcher = sockets(airlock.pid());
    let first = airlock.process("serve orchestrator");
    let orchestrator = sockets(first);
    for listener in &listeners {
        assert!(
            launcher.contains(listener),
            "the launcher does not hold the front door {listener}: {launcher:?}"
        );
        assert!(
            orchestrator.contains(listener),
            "the orchestrator does not serve on {listener}: {orchestrator:?}"
        );
    }

    signal(first, Signal::KILL);
    let deadline = Instant::now() + Duration::from_secs(30);
    while alive(first) {
        assert!(
            Instant::now() < deadline,
            "the orchestrator outlived SIGKILL"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Its successor inherits the same sockets; a connection made meanwhile waits in the
    // launcher-held listener's backlog instead of finding the port closed (or taken).
    let body = json!({"tool_uses": [{"type": "tool_use", "id": "t", "name": "write_file",
        "input": {"path": "a.txt", "content": "x"}}]});
    // A client of its own: the shared one may hold a kept-alive connection to the
    // killed process.
    let client = reqwest::Client::new();
    loop {
        let sent = client
            .post(format!("{}/v1/tool_calls", airlock.url))
            .bearer_auth(&airlock.token)
            .json(&body)
            .send()
            .await;
        let answer = match sent {
            Ok(response) => (response.status().as_u16(), response.text().await),
            Err(e) => (0, Err(e)),
        };
        if let (200, Ok(text)) = &answer
            && serde_json::from_str::<serde_json::Value>(text)
                .is_ok_and(|v| v["tool_results"][0]["is_error"] == false)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the orchestrator did not come back: {answer:?}\n{}",
            airlock.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let second = airlock.process("serve orchestrator");
    assert_ne!(second, first);
    let restarted = sockets(second);
    for listener in &listeners {
        assert!(
            restarted.contains(listener),
            "the restarted orchestrator does not serve on {listener}: {restarted:?}"
        );
    }
}

/// The names of the threads of process `pid`.
fn thread_names(pid: u32) -> Vec<String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the process's threads");
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .map(|name| name.trim_end().to_owned())
        .collect()
}

/// A worker whose tools work on the blocking pool (fs, shell, db) drives its calls on
/// its main thread: it has no async worker threads (tokio's `tokio-rt-worker`), only
/// the blocking pool's, named `airlock-pool`, and answers calls, several at once,
/// with them. The orchestrator keeps an async thread per CPU.
#[tokio::test]
async fn workers_that_block_drive_their_calls_on_one_thread() {
    let airlock = Airlock::start().await;
    let (err, text, _) = airlock
        .call("write_file", json!({"path": "t.txt", "content": "threads"}))
        .await;
    assert!(!err, "{text}");
    // Several at once per worker, so that a runtime with more threads would use them.
    let calls = (0..4).flat_map(|_| {
        [
            airlock.call("read_file", json!({"path": "t.txt"})),
            airlock.call("execute_shell", json!({"command": "echo threads"})),
            airlock.call(
                "query_database",
                json!({"database": "demo", "sql": "SELECT 'threads'"}),
            ),
        ]
    });
    for (err, text, _) in futures::future::join_all(calls).await {
        assert!(!err, "{text}");
        assert!(text.contains("threads"), "{text}");
    }
    for worker in ["serve worker fs", "serve worker shell", "serve worker db"] {
        let names = thread_names(airlock.process(worker));
        assert!(
            !names.iter().any(|n| n == "tokio-rt-worker"),
            "{worker} has async worker threads: {names:?}"
        );
        assert!(
            names.iter().any(|n| n == "airlock-pool"),
            "{worker} ran its calls without the blocking pool: {names:?}"
        );
    }
    let orchestrator = thread_names(airlock.process("serve orchestrator"));
    assert!(
        orchestrator.iter().any(|n| n == "tokio-rt-worker"),
        "the orchestrator's async threads: {orchestrator:?}"
    );
}
