//! The gate: principals and roles, Cedar policy, durable approvals, the audit chain,
//! budgets, the rate limit and the result cache.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::{AIRLOCK, Airlock, principals_config, send_as as send, signal};

/// An agent, an approver, one who is both and an admin with known tokens; `extra` is appended.
fn principals(extra: &str) -> String {
    principals_config(
        &[
            ("alice", &["agent"]),
            ("bob", &["approver"]),
            ("carol", &["agent", "approver"]),
            ("root", &["admin"]),
        ],
        extra,
    )
}

fn one_use(tool: &str, input: Value) -> Value {
    json!({"type": "tool_use", "id": "t1", "name": tool, "input": input})
}

async fn call_as(
    airlock: &Airlock,
    token: &str,
    session: &str,
    tool: &str,
    input: Value,
    wait_ms: u64,
) -> Value {
    let body =
        json!({"session_id": session, "wait_ms": wait_ms, "tool_uses": [one_use(tool, input)]});
    let (status, body, _) = send(
        airlock,
        token,
        reqwest::Method::POST,
        "/v1/tool_calls",
        Some(body),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body
}

async fn wait_call(airlock: &Airlock, token: &str, call_id: &str) -> Value {
    let (status, body, _) = send(
        airlock,
        token,
        reqwest::Method::GET,
        &format!("/v1/calls/{call_id}?wait_ms=30000"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body
}

async fn decide(airlock: &Airlock, token: &str, approval_id: &str, verb: &str) -> (u16, Value) {
    let (status, body, _) = send(
        airlock,
        token,
        reqwest::Method::POST,
        &format!("/v1/approvals/{approval_id}/{verb}"),
        Some(json!({"reason": "checked"})),
    )
    .await;
    (status, body)
}

#[tokio::test]
async fn irreversible_calls_wait_for_a_distinct_approver_and_run_once() {
    let airlock = Airlock::start_with(&principals("[approvals]\ndistinct_approver = true\n")).await;
    let ws = airlock.data_dir().join("workspaces/alice/s1");

    // Reads run at once; writes wait.
    let read = call_as(
        &airlock,
        "alice-token",
        "s1",
        "list_directory",
        json!({"path": "."}),
        10_000,
    )
    .await;
    assert_eq!(read["calls"][0]["status"], "ok", "{read}");
    let pending = call_as(
        &airlock,
        "alice-token",
        "s1",
        "write_file",
        json!({"path": "a.txt", "content": "approved"}),
        300,
    )
    .await;
    assert_eq!(
        pending["calls"][0]["status"], "pending_approval",
        "{pending}"
    );
    assert!(
        pending["tool_results"]
            .as_array()
            .expect("array")
            .is_empty()
    );
    let call_id = pending["calls"][0]["call_id"]
        .as_str()
        .expect("call id")
        .to_owned();
    let approval_id = pending["calls"][0]["approval_id"]
        .as_str()
        .expect("approval id")
        .to_owned();
    assert!(!ws.join("a.txt").exists(), "nothing runs before approval");

    // Listing needs the approver role; the listing shows the pending call.
    let (status, _, _) = send(
        &airlock,
        "alice-token",
        reqwest::Method::GET,
        "/v1/approvals",
        None,
    )
    .await;
    assert_eq!(status, 403);
    let (status, list, _) = send(
        &airlock,
        "bob-token",
        reqwest::Method::GET,
        "/v1/approvals?status=pending",
        None,
    )
    .await;
    assert_eq!(status, 200);
    let item = list["approvals"]
        .as_array()
        .expect("approvals")
        .iter()
        .find(|a| a["approval_id"] == approval_id.as_str())
        .expect("listed")
        .clone();
    for key in [
        "approval_id",
        "call_id",
        "tool",
        "input",
        "principal",
        "session_id",
        "status",
        "created_at",
        "expires_at",
    ] {
        assert!(item.get(key).is_some(), "{key} missing in {item}");
    }
    assert_eq!(item["principal"], "alice");
    assert_eq!(item["status"], "pending");
    let (status, _, _) = send(
        &airlock,
        "bob-token",
        reqwest::Method::GET,
        "/v1/approvals?status=maybe",
        None,
    )
    .await;
    assert_eq!(status, 400);

    // Only approvers decide; unknown ids are 404; malformed bodies 400.
    assert_eq!(
        decide(&airlock, "alice-token", &approval_id, "approve")
            .await
            .0,
        403
    );
    assert_eq!(
        decide(&airlock, "bob-token", "apr_nope", "approve").await.0,
        404
    );
    let (status, _, _) = send(
        &airlock,
        "bob-token",
        reqwest::Method::POST,
        &format!("/v1/approvals/{approval_id}/approve"),
        Some(json!({"reason": 5})),
    )
    .await;
    assert_eq!(status, 400);
    let (status, _, _) = send(
        &airlock,
        "bob-token",
        reqwest::Method::POST,
        &format!("/v1/approvals/{approval_id}/maybe"),
        None,
    )
    .await;
    assert_eq!(status, 404);

    let (status, decided) = decide(&airlock, "bob-token", &approval_id, "approve").await;
    assert_eq!(status, 200, "{decided}");
    assert_eq!(decided["status"], "approved");
    assert_eq!(decided["decided_by"], "bob");
    let done = wait_call(&airlock, "alice-token", &call_id).await;
    assert_eq!(done["status"], "ok", "{done}");
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).expect("written"),
        "approved"
    );
    assert_eq!(
        decide(&airlock, "bob-token", &approval_id, "deny").await.0,
        409,
        "decided once"
    );

    // distinct_approver: carol may not approve her own request, bob may deny it.
    let mine = call_as(
        &airlock,
        "carol-token",
        "s2",
        "delete_path",
        json!({"path": "x"}),
        300,
    )
    .await;
    let mine_approval = mine["calls"][0]["approval_id"]
        .as_str()
        .expect("approval")
        .to_owned();
    let (status, body) = decide(&airlock, "carol-token", &mine_approval, "approve").await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .expect("message")
            .contains("distinct_approver")
    );
    assert_eq!(
        decide(&airlock, "bob-token", &mine_approval, "deny")
            .await
            .0,
        200
    );
    let denied = wait_call(
        &airlock,
        "carol-token",
        mine["calls"][0]["call_id"].as_str().expect("id"),
    )
    .await;
    assert_eq!(denied["status"], "denied", "{denied}");
    assert_eq!(denied["tool_result"]["is_error"], true);
    assert!(
        denied["tool_result"]["content"][0]["text"]
            .as_str()
            .expect("text")
            .contains("bob")
    );

    // The audit log holds every step, and only the admin reads it.
    let (status, _, _) = send(
        &airlock,
        "bob-token",
        reqwest::Method::GET,
        "/v1/audit",
        None,
    )
    .await;
    assert_eq!(status, 403);
    let (status, audit, _) = send(
        &airlock,
        "root-token",
        reqwest::Method::GET,
        "/v1/audit?limit=1000",
        None,
    )
    .await;
    assert_eq!(status, 200);
    let kinds: Vec<&str> = audit["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["call_id"] == call_id.as_str())
        .map(|e| e["kind"].as_str().expect("kind"))
        .collect();
    assert_eq!(
        kinds,
        [
            "requested",
            "pending_approval",
            "approved",
            "dispatched",
            "completed"
        ],
        "{kinds:?}"
    );
    let text = audit.to_string();
    for token in ["alice-token", "bob-token", "carol-token", "root-token"] {
        assert!(!text.contains(token), "a token reached the audit log");
    }
    let (_, verify, _) = send(
        &airlock,
        "root-token",
        reqwest::Method::GET,
        "/v1/audit/verify",
        None,
    )
    .await;
    assert_eq!(verify["ok"], true, "{verify}");
}

#[tokio::test]
async fn policy_hides_and_denies_and_a_broken_policy_is_refused() {
    let dir = tempfile::tempdir().expect("dir");
    let policy = dir.path().join("policy.cedar");
    std::fs::write(
        &policy,
        format!(
            "{}\n@id(\"no-delete-for-alice\")\nforbid(principal == Airlock::Principal::\"alice\", action == Airlock::Action::\"delete_path\", resource);\n@id(\"no-secrets\")\n@reason(\"secret/ is off limits\")\nforbid(principal, action == Airlock::Action::\"write_file\", resource) when {{ context.arguments.path like \"secret/*\" }};\n",
            airlock_policy_default()
        ),
    )
    .expect("policy");
    let airlock = Airlock::start_with(&principals(&format!(
        "[policy]\nfile = \"{}\"\n",
        policy.display()
    )))
    .await;

    // Hidden exactly like an unknown tool.
    let (_, tools, _) = send(
        &airlock,
        "alice-token",
        reqwest::Method::GET,
        "/v1/tools",
        None,
    )
    .await;
    let names: Vec<&str> = tools["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .map(|t| t["name"].as_str().expect("name"))
        .collect();
    assert!(
        !names.contains(&"delete_path") && names.contains(&"write_file"),
        "{names:?}"
    );
    let (_, tools, _) = send(
        &airlock,
        "carol-token",
        reqwest::Method::GET,
        "/v1/tools",
        None,
    )
    .await;
    assert!(
        tools["tools"]
            .as_array()
            .expect("tools")
            .iter()
            .any(|t| t["name"] == "delete_path")
    );
    let hidden = call_as(
        &airlock,
        "alice-token",
        "p",
        "delete_path",
        json!({"path": "x"}),
        5000,
    )
    .await;
    let unknown = call_as(
        &airlock,
        "alice-token",
        "p",
        "no_such_tool",
        json!({"path": "x"}),
        5000,
    )
    .await;
    let text = |b: &Value| {
        b["tool_results"][0]["content"][0]["text"]
            .as_str()
            .expect("text")
            .replace("no_such_tool", "X")
            .replace("delete_path", "X")
    };
    assert_eq!(
        text(&hidden),
        text(&unknown),
        "a hidden tool answers like an unknown one"
    );

    // Denied by an argument rule, with the policy's reason; nothing written.
    let denied = call_as(
        &airlock,
        "alice-token",
        "p",
        "write_file",
        json!({"path": "secret/key", "content": "x"}),
        5000,
    )
    .await;
    assert_eq!(denied["calls"][0]["status"], "denied", "{denied}");
    let message = denied["tool_results"][0]["content"][0]["text"]
        .as_str()
        .expect("text");
    assert!(
        message.contains("denied by policy") && message.contains("no-secrets"),
        "{message}"
    );
    assert!(
        !airlock
            .data_dir()
            .join("workspaces/alice/p/secret")
            .exists()
    );

    // A broken policy keeps the old one in force on SIGHUP.
    std::fs::write(&policy, "permit(principal, action, resource) when { oops ").expect("break it");
    let orchestrator = airlock.process("serve orchestrator");
    signal(orchestrator, rustix::process::Signal::HUP);
    // The reload has been tried (and failed) once its audit event is there.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, audit, _) = send(
            &airlock,
            "root-token",
            reqwest::Method::GET,
            "/v1/audit?latest=true&limit=50",
            None,
        )
        .await;
        if audit["events"]
            .as_array()
            .is_some_and(|events| events.iter().any(|e| e["kind"] == "policy_reload_failed"))
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the failed reload was never audited: {audit}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let still = call_as(
        &airlock,
        "alice-token",
        "p",
        "write_file",
        json!({"path": "secret/key", "content": "x"}),
        5000,
    )
    .await;
    assert_eq!(
        still["calls"][0]["status"], "denied",
        "the old policy stays in force"
    );
    let (_, audit, _) = send(
        &airlock,
        "root-token",
        reqwest::Method::GET,
        "/v1/audit?latest=true&limit=50",
        None,
    )
    .await;
    assert!(
        audit.to_string().contains("policy_reload_failed"),
        "the failed reload is audited"
    );

    // A broken policy at start-up refuses to start, naming file and line.
    let output = std::process::Command::new(AIRLOCK)
        .args(["serve", "orchestrator", "--data-dir"])
        .arg(dir.path().join("data"))
        .arg("--config")
        .arg({
            let config = dir.path().join("broken.toml");
            std::fs::write(&config, format!("[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n[policy]\nfile = \"{}\"\n", policy.display())).expect("config");
            config
        })
        .output()
        .expect("run");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("policy.cedar:1:"),
        "names the file and line: {stderr}"
    );
}

fn airlock_policy_default() -> &'static str {
    airlock_policy::authz::DEFAULT_POLICY_SOURCE
}

#[tokio::test]
async fn an_approved_call_survives_an_orchestrator_crash_and_runs_once() {
    let airlock = Airlock::start_with("[approvals]\ntools = [\"execute_shell\"]\n").await;
    let orchestrator = || airlock.process("serve orchestrator");
    let ws = airlock.workspace("crash");
    let marker = format!("airlock-crash-{}", std::process::id());

    // 1. Pending, then the orchestrator dies; the approval survives the restart.
    let body = json!({"session_id": "crash", "wait_ms": 300, "tool_uses": [one_use("execute_shell", json!({"command": "echo ran >> count.txt"}))]});
    let (_, pending) = airlock.post("/v1/tool_calls", &body).await;
    let first_call = pending["calls"][0]["call_id"]
        .as_str()
        .expect("id")
        .to_owned();
    let first_approval = pending["calls"][0]["approval_id"]
        .as_str()
        .expect("approval")
        .to_owned();
    signal(orchestrator(), rustix::process::Signal::KILL);
    airlock.wait_ready().await;
    let (status, _) = airlock
        .post(
            &format!("/v1/approvals/{first_approval}/approve"),
            &json!({}),
        )
        .await;
    assert_eq!(status, 200);
    let (_, done) = airlock
        .get(&format!("/v1/calls/{first_call}?wait_ms=30000"))
        .await;
    assert_eq!(done["status"], "ok", "{done}");

    // 2. Approved and running when the orchestrator is killed: finished once, not lost.
    let command = format!("sleep 3 # {marker}\necho ran >> count.txt");
    let body = json!({"session_id": "crash", "wait_ms": 300, "tool_uses": [one_use("execute_shell", json!({"command": command}))]});
    let (_, pending) = airlock.post("/v1/tool_calls", &body).await;
    let second_call = pending["calls"][0]["call_id"]
        .as_str()
        .expect("id")
        .to_owned();
    let second_approval = pending["calls"][0]["approval_id"]
        .as_str()
        .expect("approval")
        .to_owned();
    let (status, _) = airlock
        .post(
            &format!("/v1/approvals/{second_approval}/approve"),
            &json!({}),
        )
        .await;
    assert_eq!(status, 200);
    airlock.wait_started(&marker, "the approved command").await;
    signal(orchestrator(), rustix::process::Signal::KILL);
    airlock.wait_ready().await;
    let (status, done) = airlock
        .get(&format!("/v1/calls/{second_call}?wait_ms=60000"))
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        done["status"], "ok",
        "the call was resumed and finished: {done}"
    );
    // The store holds the call's final outcome, so no replica claims it again; once no
    // sandbox of it runs any more, every run there was has written its line.
    airlock
        .wait_gone(&marker, "the resumed command kept running")
        .await;
    let lines = std::fs::read_to_string(ws.join("count.txt")).expect("count");
    assert_eq!(lines, "ran\nran\n", "each approved call ran exactly once");
}

/// A call policy allowed is sent to its worker attached: when the orchestrator dies
/// while it runs, the worker stops it and keeps no record of it. The resume loop must
/// not send it again (it would run twice); the call ends as an error saying that it
/// may have run.
#[tokio::test]
async fn an_allowed_call_whose_orchestrator_died_is_not_run_again() {
    let airlock = Airlock::start_with("[approvals]\ntools = []\n").await;
    let ws = airlock.workspace("lost");
    let marker = format!("airlock-lost-{}", std::process::id());
    let command = format!("echo ran >> lost.txt\nsleep 5 # {marker}");
    let body = json!({"session_id": "lost", "wait_ms": 300, "tool_uses": [one_use("execute_shell", json!({"command": command}))]});
    let (status, running) = airlock.post("/v1/tool_calls", &body).await;
    assert_eq!(status, 200, "{running}");
    let call_id = running["calls"][0]["call_id"]
        .as_str()
        .expect("id")
        .to_owned();
    airlock.wait_started(&marker, "the allowed command").await;
    signal(
        airlock.process("serve orchestrator"),
        rustix::process::Signal::KILL,
    );
    airlock.wait_ready().await;
    // The new orchestrator's resume loop finds the call's lapsed claim (15 s).
    let (status, done) = airlock
        .get(&format!("/v1/calls/{call_id}?wait_ms=60000"))
        .await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["status"], "error", "{done}");
    let text = done["tool_result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert!(text.contains("may have run"), "{done}");
    airlock
        .wait_gone(&marker, "the allowed command kept running")
        .await;
    let lines = std::fs::read_to_string(ws.join("lost.txt")).expect("lost.txt");
    assert_eq!(
        lines, "ran\n",
        "the call ran again after its orchestrator died"
    );
}

/// `GET /v1/audit` pages say where to read on: `next_after` is the page's last `seq`
/// while more events follow, and `null` on the last page and on a `latest` page (which
/// ends at the newest event). Following it alone gives every event once, in order.
#[tokio::test]
async fn audit_pages_over_http_say_where_to_read_on() {
    let airlock = Airlock::start().await;
    for i in 0..3 {
        airlock
            .call(
                "write_file",
                json!({"path": format!("p{i}"), "content": "x"}),
            )
            .await;
    }
    let (_, report) = airlock.get("/v1/audit/verify").await;
    let records = report["records"].as_u64().expect("records");
    assert!(records >= 9, "three events a call: {report}");
    let mut after = 0;
    let mut seqs = Vec::new();
    let mut pages = 0;
    loop {
        pages += 1;
        assert!(pages <= records + 1, "next_after never became null");
        let (status, page) = airlock
            .get(&format!("/v1/audit?after={after}&limit=4"))
            .await;
        assert_eq!(status, 200, "{page}");
        let events = page["events"].as_array().expect("events");
        seqs.extend(events.iter().map(|e| e["seq"].as_u64().expect("seq")));
        if page["next_after"].is_null() {
            assert!(events.len() <= 4, "{page}");
            break;
        }
        let next = page["next_after"]
            .as_u64()
            .expect("next_after is a seq or null");
        assert_eq!(events.len(), 4, "a page with more after it is full: {page}");
        assert_eq!(Some(next), seqs.last().copied(), "{page}");
        after = next;
    }
    let read = u64::try_from(seqs.len()).expect("count");
    assert!(read >= records, "read {read} of {records} events");
    assert_eq!(
        seqs,
        (1..=read).collect::<Vec<_>>(),
        "every event once, in order"
    );
    let (_, latest) = airlock.get("/v1/audit?latest=true&limit=2").await;
    assert_eq!(
        latest["events"].as_array().map(Vec::len),
        Some(2),
        "{latest}"
    );
    assert!(latest["next_after"].is_null(), "{latest}");
}

#[tokio::test]
async fn the_audit_log_detects_edits_to_the_store() {
    let airlock = Airlock::start().await;
    for i in 0..3 {
        airlock
            .call(
                "write_file",
                json!({"path": format!("f{i}"), "content": "x"}),
            )
            .await;
    }
    let (_, report) = airlock.get("/v1/audit/verify").await;
    assert_eq!(report["ok"], true, "{report}");
    let records = report["records"].as_u64().expect("records");
    assert!(
        records >= 9,
        "requested, dispatched and completed for each call: {records}"
    );
    let db = rusqlite::Connection::open(airlock.data_dir().join("airlock.db")).expect("open store");
    db.busy_timeout(Duration::from_secs(10))
        .expect("busy timeout");

    db.execute(
        "UPDATE audit_events SET data = '{\"forged\":true}' WHERE seq = 3",
        [],
    )
    .expect("edit");
    let (_, report) = airlock.get("/v1/audit/verify").await;
    assert_eq!(
        (report["ok"].clone(), report["first_bad_seq"].clone()),
        (json!(false), json!(3)),
        "{report}"
    );
    let cli = std::process::Command::new(AIRLOCK)
        .args([
            "audit",
            "verify",
            "--url",
            &airlock.url,
            "--token",
            &airlock.token,
        ])
        .output()
        .expect("cli");
    assert!(
        !cli.status.success(),
        "airlock audit verify fails on a tampered log"
    );
    assert!(
        String::from_utf8_lossy(&cli.stdout).contains("TAMPERED"),
        "{}{}",
        String::from_utf8_lossy(&cli.stdout),
        String::from_utf8_lossy(&cli.stderr)
    );

    // Deleting a record is detected too (the earlier edit is found first).
    db.execute("DELETE FROM audit_events WHERE seq = 2", [])
        .expect("delete");
    let (_, report) = airlock.get("/v1/audit/verify").await;
    assert_eq!(report["ok"], false);
    assert_eq!(report["first_bad_seq"], 2, "{report}");
}

#[tokio::test]
async fn budgets_rate_limits_and_the_cache() {
    let airlock = Airlock::start_with(
        "[budgets]\nmax_calls_per_session = 3\nmax_repeated_failures = 2\nrate_per_minute = 12\n[cache]\nttl_seconds = { read_file = 600 }\n",
    )
    .await;
    std::fs::create_dir_all(airlock.workspace("b")).expect("ws");
    std::fs::write(airlock.workspace("b").join("c.txt"), "first").expect("file");

    // The cache answers the second identical read from memory.
    let (_, text, _) = airlock
        .call_in("b", "read_file", json!({"path": "c.txt"}))
        .await;
    assert_eq!(text, "first");
    std::fs::write(airlock.workspace("b").join("c.txt"), "second").expect("file");
    let (_, text, _) = airlock
        .call_in("b", "read_file", json!({"path": "c.txt"}))
        .await;
    assert_eq!(text, "first", "cached");
    // The session budget: the third call is the last one allowed.
    let (err, _, _) = airlock
        .call_in("b", "list_directory", json!({"path": "."}))
        .await;
    assert!(!err);
    let (err, text, _) = airlock
        .call_in("b", "list_directory", json!({"path": "."}))
        .await;
    assert!(err && text.contains("session budget"), "{text}");

    // The same failing call, repeated.
    for _ in 0..2 {
        let (err, text, _) = airlock
            .call_in("r", "read_file", json!({"path": "missing.txt"}))
            .await;
        assert!(err && !text.contains("in a row"), "{text}");
    }
    let (err, text, _) = airlock
        .call_in("r", "read_file", json!({"path": "missing.txt"}))
        .await;
    assert!(err && text.contains("2 times in a row"), "{text}");

    // The per-principal rate limit: 429 with Retry-After.
    let mut limited = None;
    for _ in 0..20 {
        let response = airlock
            .request(reqwest::Method::POST, "/v1/tool_calls")
            .json(&json!({"tool_uses": [one_use("list_directory", json!({"path": "."}))]}))
            .send()
            .await
            .expect("send");
        if response.status() == 429 {
            limited = Some(response);
            break;
        }
    }
    let limited = limited.expect("the rate limit answered 429");
    let retry: u64 = limited.headers()["retry-after"]
        .to_str()
        .expect("header")
        .parse()
        .expect("seconds");
    assert!(retry >= 1);
    let body: Value = limited.json().await.expect("json");
    assert_eq!(body["error"]["code"], "rate_limited");
}

/// The calls of one request are checked together: each counts those checked before it,
/// so a request of eight calls in a session with room for three runs exactly three
/// (before, all eight passed a count read before any of them was counted); a later
/// request finds the session full.
#[tokio::test]
async fn one_requests_calls_cannot_overshoot_the_session_budget() {
    let airlock =
        Airlock::start_with("[budgets]\nmax_calls_per_session = 3\nrate_per_minute = 0\n").await;
    std::fs::create_dir_all(airlock.workspace("burst")).expect("ws");
    for round in 0..2 {
        let uses: Vec<Value> = (0..8)
            .map(|i| {
                json!({"type": "tool_use", "id": format!("t{i}"), "name": "list_directory",
                    "input": {"path": "."}})
            })
            .collect();
        let (status, body) = airlock
            .post(
                "/v1/tool_calls",
                &json!({"session_id": "burst", "tool_uses": uses}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let results = body["tool_results"].as_array().expect("results");
        assert_eq!(results.len(), 8, "{body}");
        let ran = results.iter().filter(|r| r["is_error"] == false).count();
        let refused = results
            .iter()
            .filter(|r| r["is_error"] == true && r.to_string().contains("session budget"))
            .count();
        let expected_ran = if round == 0 { 3 } else { 0 };
        assert_eq!(ran, expected_ran, "round {round}: {body}");
        assert_eq!(refused, 8 - expected_ran, "round {round}: {body}");
    }
}

/// A burst of held calls exactly the size of the session's budget is held whole. Each
/// call counts the calls ahead of it that the store does not hold yet; one stored and
/// not yet let go by its task was counted twice, so in a burst (many stored in one
/// commit, their tasks still to run) a call the session had room for was refused (one
/// of 64 calls under load, with a budget of 100). The next call finds the session full.
#[tokio::test]
async fn a_burst_as_large_as_the_session_budget_is_held_whole() {
    const BURST: usize = 64;
    let airlock = Airlock::start_with(&format!(
        "[approvals]\ntools = [\"write_file\"]\n[budgets]\nmax_calls_per_session = {BURST}\nrate_per_minute = 0\n"
    ))
    .await;
    for round in 0..3 {
        let session = format!("burst-{round}");
        let uses: Vec<Value> = (0..BURST)
            .map(|i| {
                json!({"type": "tool_use", "id": format!("t{i}"), "name": "write_file",
                    "input": {"path": format!("f{i}.txt"), "content": "x"}})
            })
            .collect();
        let (status, body) = airlock
            .post(
                "/v1/tool_calls",
                &json!({"session_id": session, "wait_ms": 0, "tool_uses": uses}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let calls = body["calls"].as_array().expect("calls");
        assert_eq!(calls.len(), BURST, "{body}");
        for call in calls {
            let call_id = call["call_id"].as_str().expect("call id");
            let mut now = call.clone();
            // `wait_ms: 0` answers once the gate has checked each call, but waits for
            // that at most some seconds: a call may still be on its way to being held.
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            while now["status"] == "running" && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
                now = airlock
                    .get(&format!("/v1/calls/{call_id}?wait_ms=0"))
                    .await
                    .1;
            }
            assert_eq!(now["status"], "pending_approval", "round {round}: {now}");
        }
        let (_, body) = airlock
            .post(
                "/v1/tool_calls",
                &json!({"session_id": session, "wait_ms": 0,
                    "tool_uses": [one_use("write_file", json!({"path": "more.txt", "content": "x"}))]}),
            )
            .await;
        assert_eq!(body["calls"][0]["status"], "error", "round {round}: {body}");
        assert!(
            body.to_string().contains("session budget"),
            "round {round}: {body}"
        );
    }
}

#[tokio::test]
async fn approvals_are_decided_over_grpc_and_the_cli_too() {
    use airlock_proto::v1 as pb;
    let airlock = Airlock::start_with("[approvals]\ntools = [\"write_file\"]\n").await;
    let pending = |path: &str| json!({"wait_ms": 200, "tool_uses": [one_use("write_file", json!({"path": path, "content": "x"}))]});

    // gRPC: list, then approve; an unknown id is NOT_FOUND, a bad status INVALID_ARGUMENT.
    let (_, first) = airlock.post("/v1/tool_calls", &pending("grpc.txt")).await;
    let first_approval = first["calls"][0]["approval_id"]
        .as_str()
        .expect("approval")
        .to_owned();
    let mut client = airlock.grpc_client().await;
    let listed = client
        .list_approvals(authed_request(
            &airlock.token,
            pb::ListApprovalsRequest {
                status: "pending".into(),
                ..Default::default()
            },
        ))
        .await
        .expect("list")
        .into_inner();
    assert!(
        listed
            .approvals
            .iter()
            .any(|a| a.approval_id == first_approval && a.tool == "write_file")
    );
    let bad = client
        .list_approvals(authed_request(
            &airlock.token,
            pb::ListApprovalsRequest {
                status: "maybe".into(),
                ..Default::default()
            },
        ))
        .await
        .expect_err("bad status");
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    let unknown = client
        .decide_approval(authed_request(
            &airlock.token,
            pb::DecideApprovalRequest {
                approval_id: "apr_x".into(),
                approve: true,
                reason: String::new(),
                ..Default::default()
            },
        ))
        .await
        .expect_err("unknown");
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    // A reason is bounded on this door as on the others (4096 bytes).
    let long = client
        .decide_approval(authed_request(
            &airlock.token,
            pb::DecideApprovalRequest {
                approval_id: first_approval.clone(),
                approve: false,
                reason: "r".repeat(4097),
                ..Default::default()
            },
        ))
        .await
        .expect_err("a reason over 4096 bytes");
    assert_eq!(long.code(), tonic::Code::InvalidArgument, "{long:?}");
    assert!(long.message().contains("4096"), "{long:?}");
    // And free of control characters (PostgreSQL cannot store a NUL as text), on gRPC
    // and on HTTP: a 4xx that says so, the approval still pending.
    for reason in ["no\u{0}pe", "no\u{1b}[2Jpe"] {
        let control = client
            .decide_approval(authed_request(
                &airlock.token,
                pb::DecideApprovalRequest {
                    approval_id: first_approval.clone(),
                    approve: false,
                    reason: reason.into(),
                    ..Default::default()
                },
            ))
            .await
            .expect_err("a reason with a control character");
        assert_eq!(control.code(), tonic::Code::InvalidArgument, "{control:?}");
        assert!(
            control.message().contains("control characters"),
            "{control:?}"
        );
        let (status, body) = airlock
            .post(
                &format!("/v1/approvals/{first_approval}/deny"),
                &json!({"reason": reason}),
            )
            .await;
        assert_eq!(status, 400, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("control characters")),
            "{body}"
        );
    }
    let decided = client
        .decide_approval(authed_request(
            &airlock.token,
            pb::DecideApprovalRequest {
                approval_id: first_approval.clone(),
                approve: true,
                reason: "ok".into(),
                input_sha256: "0".repeat(64),
                ..Default::default()
            },
        ))
        .await
        .expect_err("another input's digest");
    assert_eq!(
        decided.code(),
        tonic::Code::FailedPrecondition,
        "{decided:?}"
    );
    assert!(decided.message().contains("input_sha256"), "{decided:?}");
    let listed = client
        .list_approvals(authed_request(
            &airlock.token,
            pb::ListApprovalsRequest {
                status: "pending".into(),
                ..Default::default()
            },
        ))
        .await
        .expect("list")
        .into_inner()
        .approvals
        .into_iter()
        .find(|a| a.approval_id == first_approval)
        .expect("still pending");
    assert_eq!(listed.input_sha256.len(), 64, "{listed:?}");
    let decided = client
        .decide_approval(authed_request(
            &airlock.token,
            pb::DecideApprovalRequest {
                approval_id: first_approval.clone(),
                approve: true,
                reason: "ok".into(),
                input_sha256: listed.input_sha256.clone(),
                ..Default::default()
            },
        ))
        .await
        .expect("decide")
        .into_inner();
    assert_eq!(decided.status, "approved");
    assert_eq!(decided.input_sha256, listed.input_sha256);
    assert_eq!(decided.approved_by.len(), 1, "{decided:?}");
    let (_, done) = airlock
        .get(&format!(
            "/v1/calls/{}?wait_ms=20000",
            first["calls"][0]["call_id"].as_str().expect("id")
        ))
        .await;
    assert_eq!(done["status"], "ok");

    // CLI: list shows it, deny refuses it.
    let (_, second) = airlock.post("/v1/tool_calls", &pending("cli.txt")).await;
    let second_approval = second["calls"][0]["approval_id"]
        .as_str()
        .expect("approval")
        .to_owned();
    let cli = |args: &[&str]| {
        std::process::Command::new(AIRLOCK)
            .args(args)
            .env("AIRLOCK_URL", &airlock.url)
            .env("AIRLOCK_TOKEN", &airlock.token)
            .output()
            .expect("run the CLI")
    };
    let list = cli(&["approvals", "list"]);
    assert!(list.status.success());
    assert!(String::from_utf8_lossy(&list.stdout).contains(&second_approval));
    // An id is one path segment: a `deny` whose id carries `/approve?` must not become
    // an approval (the CLI percent-encodes it; the server finds no such approval).
    let smuggled = format!("{second_approval}/approve?");
    let deny = cli(&["approvals", "deny", &smuggled]);
    assert!(
        !deny.status.success(),
        "{}",
        String::from_utf8_lossy(&deny.stdout)
    );
    let (_, still) = airlock.get("/v1/approvals?status=pending").await;
    assert!(
        still["approvals"]
            .as_array()
            .expect("approvals")
            .iter()
            .any(|a| a["approval_id"] == second_approval.as_str()),
        "the smuggled id decided the approval: {still}"
    );
    let deny = cli(&[
        "approvals",
        "deny",
        &second_approval,
        "--reason",
        "not today",
    ]);
    assert!(
        deny.status.success(),
        "{}",
        String::from_utf8_lossy(&deny.stderr)
    );
    assert!(String::from_utf8_lossy(&deny.stdout).contains("denied"));
    let (_, done) = airlock
        .get(&format!(
            "/v1/calls/{}?wait_ms=20000",
            second["calls"][0]["call_id"].as_str().expect("id")
        ))
        .await;
    assert_eq!(done["status"], "denied");
    assert!(!airlock.workspace("default").join("cli.txt").exists());
    let again = cli(&["approvals", "approve", &second_approval]);
    assert!(
        !again.status.success(),
        "a decided approval cannot be decided again"
    );

    // Malformed queries on the audit endpoints are 400s.
    for path in ["/v1/audit?after=abc", "/v1/audit?limit=-1"] {
        let (status, body) = airlock.get(path).await;
        assert_eq!(status, 400, "{path}: {body}");
    }
}

fn authed_request<T>(token: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("metadata"),
    );
    request
}

/// DESIGN §15: a result is answered whole, memory keeps finished calls by bytes
/// (`[limits] result_memory_bytes = 0`: none), and the store keeps at most
/// `[store] max_result_bytes` of one result, saying where it was cut, while the audit
/// holds the digest of the whole.
#[tokio::test]
async fn results_are_answered_whole_and_stored_cut_to_the_store_limit() {
    use sha2::Digest as _;
    let airlock = Airlock::start_with(
        "[limits]\nresult_memory_bytes = 0\n\n[store]\nmax_result_bytes = 4096\n",
    )
    .await;
    let text: String = (0..2000).map(|i| format!("line {i:05}\n")).collect();
    let (is_error, _, _) = airlock
        .call("write_file", json!({"path": "big.txt", "content": text}))
        .await;
    assert!(!is_error);
    let (is_error, answered, call) = airlock.call("read_file", json!({"path": "big.txt"})).await;
    assert!(!is_error, "{answered}");
    assert_eq!(answered, text, "the caller gets the whole result");
    let call_id = call["call_id"].as_str().expect("call_id").to_owned();

    // Not kept in memory: answered from the store, cut, and saying so.
    let (status, detail) = airlock.get(&format!("/v1/calls/{call_id}")).await;
    assert_eq!(status, 200, "{detail}");
    assert_eq!(detail["status"], "ok", "{detail}");
    let blocks: Vec<String> = detail["tool_result"]["content"]
        .as_array()
        .expect("content")
        .iter()
        .map(|b| b["text"].as_str().unwrap_or_default().to_owned())
        .collect();
    let stored: usize = blocks.iter().map(String::len).sum();
    assert!(stored <= 4096 + 200, "{stored} bytes stored");
    let note = blocks.last().expect("a note");
    let digest = hex::encode(sha2::Sha256::digest(text.as_bytes()));
    assert!(
        note.contains("max_result_bytes") && note.contains(&digest),
        "{note}"
    );
    assert!(
        text.starts_with(&blocks[0]),
        "the kept part is the start of the result"
    );

    // On disk too, and the audit's completed event holds the digest of the whole.
    let db = rusqlite::Connection::open(airlock.data_dir().join("airlock.db")).expect("open");
    db.busy_timeout(Duration::from_secs(10))
        .expect("busy timeout");
    let bytes: i64 = db
        .query_row(
            "SELECT length(result) FROM calls WHERE call_id = ?1",
            [&call_id],
            |row| row.get(0),
        )
        .expect("stored call");
    assert!(
        bytes < 6000,
        "{bytes} bytes in the store for a {} byte result",
        text.len()
    );
    let (_, audit) = airlock.get("/v1/audit?limit=1000").await;
    let completed = audit["events"]
        .as_array()
        .or_else(|| audit["records"].as_array())
        .expect("events")
        .iter()
        .find(|e| e["call_id"] == call_id.as_str() && e["kind"] == "completed")
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(completed["data"]["result_sha256"], digest, "{completed}");
    let (_, report) = airlock.get("/v1/audit/verify").await;
    assert_eq!(report["ok"], true, "{report}");
}

/// Write transactions the orchestrator's store committed since it started (`/readyz`).
async fn store_commits(airlock: &Airlock) -> u64 {
    let (status, ready) = airlock.get("/readyz").await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["store"]["kind"], "sqlite", "{ready}");
    ready["store"]["commits"].as_u64().expect("store.commits")
}

/// A call that needs no approval and changes nothing is recorded in one store
/// transaction, when it ends (docs/decisions.md, "One durable write per call"): N
/// `read_file` calls make N commits, counted by SQLite's commit hook, and every call
/// still leaves `requested`, `dispatched` and `completed` in one dense, valid chain.
/// Before, each such call made six (three appends, the call's insert, its claim, its
/// outcome). A call with side effects is written ahead of its worker and at its end:
/// two.
#[tokio::test]
async fn an_auto_allowed_read_is_one_store_commit() {
    const CALLS: u64 = 40;
    // No approvals (the harness's default), no rate limit.
    let airlock = Airlock::start_with("[budgets]\nrate_per_minute = 0\n").await;
    std::fs::create_dir_all(airlock.workspace("default")).expect("workspace");
    std::fs::write(airlock.workspace("default").join("n.txt"), "hello").expect("file");
    let before = store_commits(&airlock).await;
    for _ in 0..CALLS {
        let (err, text, _) = airlock.call("read_file", json!({"path": "n.txt"})).await;
        assert!(!err, "{text}");
        assert_eq!(text, "hello");
    }
    // Each answer comes after its call's commit, so all of them are counted now.
    let commits = store_commits(&airlock).await - before;
    eprintln!("{CALLS} read_file calls: {commits} store commits (SQLite)");
    assert_eq!(commits, CALLS, "one commit per auto-allowed read");

    let before = store_commits(&airlock).await;
    for i in 0..CALLS {
        let (err, text, _) = airlock
            .call(
                "write_file",
                json!({"path": format!("w{i}.txt"), "content": "x"}),
            )
            .await;
        assert!(!err, "{text}");
    }
    let commits = store_commits(&airlock).await - before;
    eprintln!("{CALLS} write_file calls: {commits} store commits (SQLite)");
    assert_eq!(
        commits,
        2 * CALLS,
        "written ahead of the worker and at the end"
    );

    let (_, audit) = airlock.get("/v1/audit?limit=10000").await;
    let events = audit["events"].as_array().expect("events");
    let seqs: Vec<u64> = events
        .iter()
        .map(|e| e["seq"].as_u64().expect("seq"))
        .collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>(), "dense");
    let mut per_call: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for e in events {
        if let Some(call) = e["call_id"].as_str() {
            per_call
                .entry(call)
                .or_default()
                .push(e["kind"].as_str().expect("kind"));
        }
    }
    assert_eq!(per_call.len() as u64, 2 * CALLS, "{per_call:?}");
    for (call, kinds) in &per_call {
        assert_eq!(kinds, &["requested", "dispatched", "completed"], "{call}");
    }
    let (_, verify) = airlock.get("/v1/audit/verify").await;
    assert_eq!(verify["ok"], true, "{verify}");
    let (status, stored) = airlock
        .get(&format!(
            "/v1/calls/{}",
            per_call.keys().next().expect("a call")
        ))
        .await;
    assert_eq!(status, 200, "{stored}");
    assert_eq!(stored["status"], "ok", "{stored}");
}
