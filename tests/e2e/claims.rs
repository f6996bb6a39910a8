//! Claims of the README that no other module proves end to end, each through a real
//! `airlock up`: approvals that expire (the waiting call's own check and the sweep of
//! forgotten ones), a SIGHUP reload that changes a decision, Ctrl-C leaving nothing
//! behind, the `/mcp` origin allow-list, and the session wall-time budget.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rustix::process::Signal;
use serde_json::{Value, json};

use crate::support::{Airlock, alive, cmdline, descendants, signal};

/// How long any awaited event may take on a loaded machine.
const BOUND: Duration = Duration::from_secs(60);

async fn audit_events(airlock: &Airlock) -> Vec<Value> {
    let (status, audit) = airlock.get("/v1/audit?limit=10000").await;
    assert_eq!(status, 200, "{audit}");
    audit["events"].as_array().expect("events").clone()
}

/// Polls the audit log until `count` events satisfy `matches` (bounded).
async fn wait_for_audit(
    airlock: &Airlock,
    what: &str,
    count: usize,
    matches: impl Fn(&Value) -> bool,
) -> Vec<Value> {
    let deadline = Instant::now() + BOUND;
    loop {
        let found: Vec<Value> = audit_events(airlock)
            .await
            .into_iter()
            .filter(|e| matches(e))
            .collect();
        if found.len() >= count {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {found:?}\n{}",
            airlock.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The text of the first tool result of a `POST /v1/tool_calls` answer.
fn result_text(answer: &Value) -> String {
    answer["tool_results"][0]["content"]
        .as_array()
        .expect("content")
        .iter()
        .filter_map(|b| b["text"].as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

// ------------------------------------------------------------------ approval expiry

/// `(status, created_at, expires_at)` of an approval, read from the store itself.
fn stored_approval(airlock: &Airlock, approval_id: &str) -> (String, i64, i64) {
    let db = rusqlite::Connection::open_with_flags(
        airlock.data_dir().join("airlock.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .expect("open the store");
    db.busy_timeout(Duration::from_secs(30))
        .expect("busy timeout");
    db.query_row(
        "SELECT status, created_at, expires_at FROM approvals WHERE approval_id = ?1",
        [approval_id],
        |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)),
    )
    .expect("the approval is stored")
}

/// Proposes a held `write_file` of `path`; returns (call_id, approval_id).
async fn held_write(airlock: &Airlock, path: &str) -> (String, String) {
    let body = json!({"session_id": "expiry", "wait_ms": 0, "tool_uses": [
        {"type": "tool_use", "id": "w", "name": "write_file",
         "input": {"path": path, "content": "too late"}}]});
    let (status, answer) = airlock.post("/v1/tool_calls", &body).await;
    assert_eq!(status, 200, "{answer}");
    let call = &answer["calls"][0];
    assert_eq!(call["status"], "pending_approval", "{answer}");
    (
        call["call_id"].as_str().expect("call id").to_owned(),
        call["approval_id"]
            .as_str()
            .expect("approval id")
            .to_owned(),
    )
}

/// Deciding an expired approval either way is a conflict, and changes nothing.
async fn assert_undecidable(airlock: &Airlock, approval_id: &str) {
    for decision in ["approve", "deny"] {
        let (status, body) = airlock
            .post(
                &format!("/v1/approvals/{approval_id}/{decision}"),
                &json!({"reason": "too late"}),
            )
            .await;
        assert_eq!(status, 409, "{decision} of an expired approval: {body}");
        assert_eq!(body["error"]["code"], "conflict", "{body}");
    }
    assert_eq!(stored_approval(airlock, approval_id).0, "expired");
}

/// Seconds an approval lives in the test below.
const APPROVAL_SECONDS: i64 = 3;

#[tokio::test]
async fn approvals_expire_after_timeout_seconds_and_can_no_longer_be_decided() {
    let airlock = Airlock::start_with(&format!(
        "[approvals]\ntools = [\"write_file\"]\ntimeout_seconds = {APPROVAL_SECONDS}\n"
    ))
    .await;
    let ws = airlock.workspace("expiry");

    // 1. A caller waits on the held call: when nobody decides, its approval expires
    //    `timeout_seconds` after the request, and the call ends denied.
    let (call_id, approval_id) = held_write(&airlock, "waited.txt").await;
    let (status, created, expires) = stored_approval(&airlock, &approval_id);
    assert_eq!(status, "pending");
    assert_eq!(
        expires - created,
        APPROVAL_SECONDS * 1000,
        "[approvals] timeout_seconds"
    );
    let (status, done) = airlock
        .get(&format!("/v1/calls/{call_id}?wait_ms=60000"))
        .await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["status"], "denied", "{done}");
    let text = done["tool_result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert!(
        text.contains("the approval expired before anyone decided"),
        "{done}"
    );
    let (status, listed) = airlock.get("/v1/approvals?status=expired").await;
    assert_eq!(status, 200, "{listed}");
    assert!(
        listed["approvals"]
            .as_array()
            .expect("approvals")
            .iter()
            .any(|a| a["approval_id"] == approval_id.as_str() && a["status"] == "expired"),
        "{listed}"
    );
    wait_for_audit(&airlock, "the expiry was never audited", 1, |e| {
        e["kind"] == "expired" && e["data"]["approval_id"] == approval_id.as_str()
    })
    .await;
    assert_undecidable(&airlock, &approval_id).await;
    assert!(!ws.join("waited.txt").exists());

    // 2. A forgotten approval: its orchestrator is killed, and the one the launcher
    //    starts has no task waiting on it, so only the sweep can expire it. The old
    //    orchestrator is stopped first and the store read, to be sure the approval was
    //    still pending when it died (a machine stalled for the whole lifetime of the
    //    approval retries with a new one, a bounded number of times).
    let mut forgotten = None;
    for attempt in 0..3 {
        let (call_id, approval_id) =
            held_write(&airlock, &format!("forgotten-{attempt}.txt")).await;
        let pid = airlock.process("serve orchestrator");
        signal(pid, Signal::STOP);
        let (status, _, _) = stored_approval(&airlock, &approval_id);
        signal(pid, Signal::KILL);
        airlock.wait_ready().await;
        if status == "pending" {
            forgotten = Some((call_id, approval_id));
            break;
        }
        eprintln!("attempt {attempt}: the approval was {status} before the orchestrator stopped");
    }
    let (call_id, approval_id) =
        forgotten.expect("no approval was still pending when its orchestrator was stopped");
    wait_for_audit(
        &airlock,
        "the sweep never expired the forgotten approval",
        1,
        |e| e["kind"] == "expired" && e["data"]["approval_id"] == approval_id.as_str(),
    )
    .await;
    assert_eq!(stored_approval(&airlock, &approval_id).0, "expired");
    assert_undecidable(&airlock, &approval_id).await;
    let (status, call) = airlock.get(&format!("/v1/calls/{call_id}")).await;
    assert_eq!(status, 200, "{call}");
    assert_eq!(call["status"], "denied", "{call}");
    assert_eq!(
        call["tool_result"]["content"][0]["text"], "the call was denied or its approval expired",
        "{call}"
    );
    // Nothing that expired ever ran.
    let dispatched = audit_events(&airlock)
        .await
        .into_iter()
        .filter(|e| e["kind"] == "dispatched")
        .count();
    assert_eq!(dispatched, 0, "an expired call was dispatched");
    assert!(
        std::fs::read_dir(&ws)
            .map(|entries| entries.count() == 0)
            .unwrap_or(true),
        "an expired write happened"
    );
}

/// A decision (or a withdrawal) that arrives after an approval's deadline, before any
/// sweep or waiting task has noticed it, makes the store expire the approval; that
/// expiry is audited like the sweep's — once — or the log would show a call that
/// ended with no word on why.
#[tokio::test]
async fn a_decision_after_the_deadline_audits_the_expiry_it_finds() {
    // Approvals that live an hour: only the test's own edit of the store makes them
    // overdue, so neither the sweep nor a waiting task expires them first.
    let airlock =
        Airlock::start_with("[approvals]\ntools = [\"write_file\"]\ntimeout_seconds = 3600\n")
            .await;
    let ws = airlock.workspace("expiry");
    // Held approvals whose orchestrator is then killed: the one the launcher starts
    // has no task waiting on them, so nothing polls them every 250 ms.
    let late = [
        held_write(&airlock, "late-approve.txt").await,
        held_write(&airlock, "late-deny.txt").await,
    ];
    let pid = airlock.process("serve orchestrator");
    signal(pid, Signal::STOP);
    signal(pid, Signal::KILL);
    airlock.wait_ready().await;
    for (_, approval_id) in &late {
        assert_eq!(stored_approval(&airlock, approval_id).0, "pending");
    }

    for ((call_id, approval_id), decision) in late.iter().zip(["approve", "deny"]) {
        // Overdue by a second, then decided at once: the sweep, every 2 s, has a few
        // milliseconds to get there first (and would audit the expiry itself).
        {
            let db = rusqlite::Connection::open(airlock.data_dir().join("airlock.db"))
                .expect("open the store");
            db.busy_timeout(Duration::from_secs(30))
                .expect("busy timeout");
            let past = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_millis() as i64
                - 1000;
            db.execute(
                "UPDATE approvals SET expires_at = ?1 WHERE approval_id = ?2",
                rusqlite::params![past, approval_id],
            )
            .expect("make the approval overdue");
        }
        let (status, body) = airlock
            .post(
                &format!("/v1/approvals/{approval_id}/{decision}"),
                &json!({"reason": "late"}),
            )
            .await;
        assert_eq!(status, 409, "{decision} after the deadline: {body}");
        assert_eq!(body["error"]["code"], "conflict", "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("expired")),
            "{body}"
        );
        assert_eq!(stored_approval(&airlock, approval_id).0, "expired");
        let found = wait_for_audit(
            &airlock,
            &format!("the expiry a late {decision} found was never audited"),
            1,
            |e| e["kind"] == "expired" && e["data"]["approval_id"] == approval_id.as_str(),
        )
        .await;
        assert_eq!(found[0]["call_id"], call_id.as_str(), "{found:?}");
        assert_eq!(found[0]["session_id"], "expiry", "{found:?}");
    }
    // Once each, also after the sweep has run again (every 2 s), and nothing else
    // was decided: no approval or denial was recorded for either.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let events = audit_events(&airlock).await;
    for (_, approval_id) in &late {
        let about = |kind: &str| {
            events
                .iter()
                .filter(|e| e["kind"] == kind && e["data"]["approval_id"] == approval_id.as_str())
                .count()
        };
        assert_eq!(about("expired"), 1, "{events:?}");
        assert_eq!(
            about("approved") + about("approval_denied"),
            0,
            "{events:?}"
        );
    }
    assert!(
        std::fs::read_dir(&ws)
            .map(|entries| entries.count() == 0)
            .unwrap_or(true),
        "an expired write happened"
    );
}

// ------------------------------------------------------------------ SIGHUP reload

/// The default policy plus one forbid of `write_file` below `dir/`, with that id.
fn policy_forbidding(dir: &str) -> String {
    format!(
        "{}\n@id(\"no-{dir}\")\n@reason(\"{dir}/ is off limits\")\nforbid(principal, action == Airlock::Action::\"write_file\", resource) when {{ context.arguments.path like \"{dir}/*\" }};\n",
        airlock_policy::authz::DEFAULT_POLICY_SOURCE
    )
}

/// `write_file` of `path`; returns (status, result text).
async fn write(airlock: &Airlock, path: &str) -> (String, String) {
    let body = json!({"session_id": "reload", "tool_uses": [
        {"type": "tool_use", "id": "w", "name": "write_file",
         "input": {"path": path, "content": path}}]});
    let (status, answer) = airlock.post("/v1/tool_calls", &body).await;
    assert_eq!(status, 200, "{answer}");
    (
        answer["calls"][0]["status"]
            .as_str()
            .expect("status")
            .to_owned(),
        result_text(&answer),
    )
}

#[tokio::test]
async fn a_sighup_reload_puts_a_changed_policy_in_force() {
    let dir = tempfile::tempdir().expect("dir");
    let policy = dir.path().join("policy.cedar");
    std::fs::write(&policy, policy_forbidding("blocked")).expect("policy");
    let airlock =
        Airlock::start_with(&format!("[policy]\nfile = \"{}\"\n", policy.display())).await;
    let ws = airlock.workspace("reload");

    let (status, text) = write(&airlock, "blocked/a.txt").await;
    assert_eq!(status, "denied", "{text}");
    assert!(text.contains("no-blocked"), "{text}");
    let (status, text) = write(&airlock, "open/a.txt").await;
    assert_eq!(status, "ok", "{text}");

    // The new policy forbids the other directory instead.
    std::fs::write(&policy, policy_forbidding("open")).expect("new policy");
    signal(airlock.process("serve orchestrator"), Signal::HUP);
    let reloaded = wait_for_audit(&airlock, "the reload was never audited", 1, |e| {
        e["kind"] == "policy_reloaded" || e["kind"] == "policy_reload_failed"
    })
    .await;
    assert_eq!(reloaded[0]["kind"], "policy_reloaded", "{reloaded:?}");

    let (status, text) = write(&airlock, "blocked/a.txt").await;
    assert_eq!(status, "ok", "the old forbid is gone: {text}");
    assert_eq!(
        std::fs::read_to_string(ws.join("blocked/a.txt")).expect("written"),
        "blocked/a.txt"
    );
    let (status, text) = write(&airlock, "open/b.txt").await;
    assert_eq!(status, "denied", "the new forbid is in force: {text}");
    assert!(
        text.contains("denied by policy") && text.contains("no-open"),
        "{text}"
    );
    assert!(!ws.join("open/b.txt").exists());
}

// ------------------------------------------------------------------ Ctrl-C

/// The cgroup directories of `pid`, one per hierarchy (from /proc/<pid>/cgroup and this
/// process's mount table).
fn cgroup_dirs(pid: u32) -> Vec<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    // (fstype, root, mount point, super options) of every cgroup mount.
    let mounts: Vec<(String, String, PathBuf, Vec<String>)> = mountinfo
        .lines()
        .filter_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let fields: Vec<&str> = before.split(' ').collect();
            let mut after = after.split(' ');
            let fstype = after.next()?;
            let _source = after.next()?;
            let options = after.next()?;
            (fstype == "cgroup" || fstype == "cgroup2").then(|| {
                (
                    fstype.to_owned(),
                    fields.get(3).copied().unwrap_or("/").to_owned(),
                    PathBuf::from(fields.get(4).copied().unwrap_or("")),
                    options.split(',').map(str::to_owned).collect(),
                )
            })
        })
        .collect();
    let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup file");
    own.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let _id = parts.next()?;
            let controllers = parts.next()?;
            let path = parts.next()?;
            let mount = mounts.iter().find(|(fstype, _, _, options)| {
                if controllers.is_empty() {
                    fstype == "cgroup2"
                } else {
                    fstype == "cgroup"
                        && controllers
                            .split(',')
                            .all(|c| options.iter().any(|o| o == c))
                }
            })?;
            let relative = path.strip_prefix(mount.1.as_str()).unwrap_or(path);
            Some(mount.2.join(relative.trim_start_matches('/')))
        })
        .collect()
}

#[tokio::test]
async fn ctrl_c_stops_airlock_up_and_leaves_nothing_behind() {
    let mut airlock = Airlock::start().await;
    let launcher = airlock.pid();
    let marker = format!("airlock-ctrl-c-{}", std::process::id());
    // A call is running in its sandbox, inside its own call cgroup, when Ctrl-C comes.
    let body = json!({"wait_ms": 0, "tool_uses": [{"type": "tool_use", "id": "s", "name": "execute_shell",
        "input": {"command": format!("sleep 590 # {marker}"), "timeout_seconds": 600}}]});
    let (status, answer) = airlock.post("/v1/tool_calls", &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["calls"][0]["status"], "running", "{answer}");
    airlock.wait_started(&marker, "the sandboxed command").await;

    let processes = descendants(launcher);
    let sandboxed = processes
        .iter()
        .copied()
        .find(|p| cmdline(*p).contains(&marker))
        .expect("the sandboxed command");
    let shell_worker = processes
        .iter()
        .copied()
        .find(|p| cmdline(*p).contains("serve worker shell"))
        .expect("the shell worker");
    let worker_cgroups = cgroup_dirs(shell_worker);
    let call_cgroups: Vec<PathBuf> = cgroup_dirs(sandboxed)
        .into_iter()
        .filter(|dir| !worker_cgroups.contains(dir))
        .collect();
    assert!(
        !call_cgroups.is_empty(),
        "the call has no cgroup of its own: {:?}",
        cgroup_dirs(sandboxed)
    );
    for dir in &call_cgroups {
        assert!(dir.is_dir(), "{}", dir.display());
    }
    let sockets: Vec<PathBuf> = std::fs::read_dir(airlock.data_dir().join("sockets"))
        .expect("socket dir")
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(sockets.len() >= 4, "the workers' sockets: {sockets:?}");

    signal(launcher, Signal::INT);
    let deadline = Instant::now() + Duration::from_secs(120);
    while alive(launcher) {
        assert!(
            Instant::now() < deadline,
            "airlock up did not stop on SIGINT:\n{}",
            airlock.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let exit = airlock
        .stop_after_kill()
        .expect("the launcher's exit status");
    assert!(
        exit.success(),
        "airlock up exited with {exit}:\n{}",
        airlock.log()
    );

    for pid in processes {
        assert!(
            !alive(pid),
            "process {pid} ({}) outlived airlock up",
            cmdline(pid)
        );
    }
    for socket in &sockets {
        assert!(!socket.exists(), "{} was left behind", socket.display());
    }
    for dir in &call_cgroups {
        assert!(
            !dir.exists(),
            "call cgroup {} was left behind",
            dir.display()
        );
    }
    assert!(!airlock.data_dir().join("endpoints.json").exists());
}

// ------------------------------------------------------------------ MCP origins

const TOOLS_LIST: &str = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#;

/// `tools/list` on `/mcp` with an `Origin` header: the status, and whether the answer
/// held the tool list.
async fn mcp_list_from(airlock: &Airlock, origin: &str) -> (u16, bool) {
    let response = airlock
        .http()
        .post(format!("{}/mcp", airlock.url))
        .bearer_auth(&airlock.token)
        .header("Accept", "application/json, text/event-stream")
        .header("Content-Type", "application/json")
        .header("MCP-Protocol-Version", "2025-06-18")
        .header("Origin", origin)
        .body(TOOLS_LIST)
        .send()
        .await
        .expect("send");
    let status = response.status().as_u16();
    let text = response.text().await.expect("body");
    (status, text.contains("execute_shell"))
}

const LISTED: &[&str] = &[
    "https://console.example.com",
    "http://tools.internal",
    "http://tools.internal:8080",
];

#[tokio::test]
async fn mcp_serves_origins_in_the_allow_list_and_refuses_the_rest() {
    let airlock = Airlock::start_with_env(
        "",
        &[(
            "AIRLOCK_MCP_ALLOWED_ORIGINS",
            "https://console.example.com/, http://tools.internal:*",
        )],
    )
    .await;
    for origin in LISTED {
        assert_eq!(
            mcp_list_from(&airlock, origin).await,
            (200, true),
            "listed origin {origin}"
        );
    }
    for origin in [
        "https://console.example.com:8443",
        "http://console.example.com",
        "https://console.example.com.evil.example",
        "https://tools.internal:8080",
        "https://evil.example",
        "null",
    ] {
        assert_eq!(
            mcp_list_from(&airlock, origin).await,
            (403, false),
            "unlisted origin {origin}"
        );
    }

    // The same origins are refused where the list does not name them.
    let plain = Airlock::start().await;
    for origin in LISTED {
        assert_eq!(
            mcp_list_from(&plain, origin).await,
            (403, false),
            "{origin} without the allow-list"
        );
    }
}

// ------------------------------------------------------------------ session wall time

#[tokio::test]
async fn a_session_is_refused_once_its_wall_time_is_spent() {
    let airlock = Airlock::start_with(
        "[budgets]\nsession_wall_time_seconds = 1\nmax_calls_per_session = 1000000\nrate_per_minute = 0\n",
    )
    .await;
    let list = |session: &'static str| {
        let airlock = &airlock;
        async move {
            let body = json!({"session_id": session, "tool_uses": [
                {"type": "tool_use", "id": "l", "name": "list_directory", "input": {"path": "."}}]});
            let (status, answer) = airlock.post("/v1/tool_calls", &body).await;
            assert_eq!(status, 200, "{answer}");
            answer
        }
    };
    // The first call starts the session's clock; calls go on succeeding until its
    // wall time is spent, then the session is refused.
    let first = list("walled").await;
    assert_eq!(first["calls"][0]["status"], "ok", "{first}");
    let deadline = Instant::now() + BOUND;
    let mut succeeded = 1;
    let refusal = loop {
        let answer = list("walled").await;
        if answer["calls"][0]["status"] != "ok" {
            break answer;
        }
        succeeded += 1;
        assert!(
            Instant::now() < deadline,
            "the session was never refused after {succeeded} calls"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("{succeeded} calls succeeded before the wall time was spent");
    assert_eq!(refusal["calls"][0]["status"], "error", "{refusal}");
    assert_eq!(refusal["tool_results"][0]["is_error"], true, "{refusal}");
    let text = result_text(&refusal);
    let elapsed: u64 = text
        .strip_prefix("session wall time exhausted: the session started ")
        .and_then(|rest| rest.strip_suffix(" s ago and may last 1 s; start a new session"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not the wall-time refusal: {text}"));
    assert!(elapsed >= 1, "{text}");
    // It stays refused, and is audited as a budget refusal.
    let again = list("walled").await;
    assert_eq!(again["calls"][0]["status"], "error", "{again}");
    assert!(
        result_text(&again).starts_with("session wall time exhausted"),
        "{again}"
    );
    let refused = wait_for_audit(&airlock, "the refusal was never audited", 2, |e| {
        e["kind"] == "budget_exceeded"
            && e["data"]["reason"]
                .as_str()
                .is_some_and(|r| r.starts_with("session wall time exhausted"))
    })
    .await;
    assert_eq!(refused.len(), 2, "{refused:?}");
    // Another session has a clock of its own.
    let fresh = list("fresh").await;
    assert_eq!(fresh["calls"][0]["status"], "ok", "{fresh}");
}
