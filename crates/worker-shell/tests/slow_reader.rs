//! A caller that reads the output stream slowly (or not at all) cannot hold up the
//! thread that enforces a command's wall clock: the call still ends by its timeout, and
//! its result still holds the output, within its caps. Needs root or unprivileged user
//! namespaces (a strict sandbox), as the sandbox crate's own tests do.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::time::{Duration, Instant};

#[path = "../../../tests/support/cgroups.rs"]
mod cgroups;
#[path = "support/strict_config.rs"]
mod strict_config;
use strict_config::strict_config;

use airlock_policy::SessionId;
use airlock_worker::{CallContext, ToolEvent};
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_nobody_reads_does_not_hold_the_call_past_its_timeout() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(root.path().join("alice/s1")).unwrap();
    let (config, parent) = strict_config("slow-reader", root.path());
    let (tools, sandbox) = airlock_worker_shell::tools(config, Vec::new())
        .unwrap_or_else(|e| panic!("this host cannot run a strict sandbox: {e}"));
    // Room for one event, and a receiver that never reads: the stream is full at once.
    let (events, _never_read) = tokio::sync::mpsc::channel::<ToolEvent>(1);
    let ctx = CallContext::new(
        "call-slow-reader".into(),
        "alice".into(),
        SessionId::parse("s1").unwrap(),
        Instant::now() + Duration::from_secs(600),
        CancellationToken::new(),
        events,
    );
    let tool = tools.get("execute_shell").expect("execute_shell");
    let started = Instant::now();
    // Output in many small writes, for longer than the timeout.
    let outcome = tokio::time::timeout(
        Duration::from_secs(120),
        tool.execute(
            json!({"command": "i=0; while [ $i -lt 100000 ]; do echo line $i; i=$((i+1)); done; sleep 30", "timeout_seconds": 2}),
            ctx,
        ),
    )
    .await
    .expect("the call was held past its timeout by a stream nobody reads");
    let result: serde_json::Value = serde_json::from_str(&outcome.content[0]).expect("JSON");
    assert_eq!(result["timed_out"], true, "{result}");
    assert!(
        result["stdout"]
            .as_str()
            .is_some_and(|s| s.starts_with("line 0\n")),
        "the result keeps the output: {}",
        &outcome.content[0][..outcome.content[0].len().min(300)]
    );
    assert!(started.elapsed() < Duration::from_secs(120));
    // The test's cgroup parents go with it (the calls' own are gone once the factory
    // is dropped).
    drop(tool);
    drop(tools);
    drop(sandbox);
    let mut dirs = cgroups::cgroup_dirs(|name| name == parent);
    // The deepest first: a cgroup goes only once it has no children.
    dirs.sort_by_key(|dir| std::cmp::Reverse(dir.components().count()));
    for dir in dirs {
        let _ = std::fs::remove_dir(&dir);
    }
}
