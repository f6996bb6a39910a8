//! The launcher: restarts a crashed worker, and stops everything on SIGTERM.

use std::time::{Duration, Instant};

use rustix::process::Signal;
use serde_json::json;

use crate::support::{Airlock, alive, cmdline, descendants, signal};

fn worker_pid(airlock: &Airlock) -> u32 {
    descendants(airlock.pid())
        .into_iter()
        .find(|p| cmdline(*p).contains("serve worker fs"))
        .expect("fs worker process")
}

#[tokio::test]
async fn a_worker_killed_mid_call_gives_a_clear_error_and_comes_back() {
    let airlock = Airlock::start().await;
    let (err, _, _) = airlock
        .call("write_file", json!({"path": "a.txt", "content": "x"}))
        .await;
    assert!(!err);

    // Freeze the worker so the next call is stuck inside it, then kill it mid-call.
    let pid = worker_pid(&airlock);
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
    assert_ne!(worker_pid(&airlock), pid);
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
