//! An outside attack pass on the gate's policy edges, each finding replayed as an
//! attacker would try it (with a variation or two):
//!
//! - revoked rights reach pending approvals: a policy reload or a principal removed
//!   (or stripped of its role) after a call was held means approving it denies it — at
//!   the decision, at dispatch after a decision recorded elsewhere, and at resume;
//! - cancelling an approved (detached) running call kills its sandbox, and `cancelled`
//!   is never reported while the command still runs;
//! - a GET/HEAD/OPTIONS with a body or a method-override header is a write;
//! - secrets in header names, URL query values, URL user-info and command lines never
//!   reach the audit, the approvals listing or the log;
//! - `airlock agent` without `--session` works in the session `default`, and that
//!   session's call count does not refuse the run.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::{AIRLOCK, Airlock, send_as, signal, token_digest};

fn principal_block(name: &str, token: &str, roles: &str) -> String {
    format!(
        "[[principals]]\nname = \"{name}\"\ntoken_sha256 = \"{}\"\nroles = {roles}\n",
        token_digest(token)
    )
}

async fn send(
    airlock: &Airlock,
    token: &str,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let (status, body, _) = send_as(airlock, token, method, path, body).await;
    (status, body)
}

/// Proposes one call as `token` with `wait_ms: 0`; returns `calls[0]`.
async fn propose(airlock: &Airlock, token: &str, session: &str, tool: &str, input: Value) -> Value {
    let body = json!({"session_id": session, "wait_ms": 0,
        "tool_uses": [{"type": "tool_use", "id": "t1", "name": tool, "input": input}]});
    let (status, body) = send(
        airlock,
        token,
        reqwest::Method::POST,
        "/v1/tool_calls",
        Some(body),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let mut call = body["calls"][0].clone();
    // A call that ended at once says why, for the assertion messages.
    if let Some(text) = body["tool_results"][0]["content"][0]["text"].as_str() {
        call["text"] = json!(text);
    }
    call
}

fn held(call: &Value) -> (String, String) {
    assert_eq!(call["status"], "pending_approval", "{call}");
    (
        call["call_id"].as_str().expect("call id").to_owned(),
        call["approval_id"]
            .as_str()
            .expect("approval id")
            .to_owned(),
    )
}

/// The call once final (bounded), read as `token`.
async fn final_call(airlock: &Airlock, token: &str, call_id: &str) -> Value {
    let (status, call) = send(
        airlock,
        token,
        reqwest::Method::GET,
        &format!("/v1/calls/{call_id}?wait_ms=60000"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{call}");
    assert_ne!(call["status"], "running", "not final within 60 s: {call}");
    assert_ne!(call["status"], "pending_approval", "{call}");
    call
}

fn result_text(call: &Value) -> String {
    call["tool_result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Waits (bounded) until the audit log, read as `admin_token`, holds an event of `kind`
/// for which `matches` holds; returns it.
async fn wait_audit(
    airlock: &Airlock,
    admin_token: &str,
    kind: &str,
    matches: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, audit) = send(
            airlock,
            admin_token,
            reqwest::Method::GET,
            "/v1/audit?latest=true&limit=500",
            None,
        )
        .await;
        assert_eq!(status, 200, "{audit}");
        if let Some(event) = audit["events"]
            .as_array()
            .expect("events")
            .iter()
            .find(|e| e["kind"] == kind && matches(e))
        {
            return event.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no {kind:?} event in the audit log within 30 s:\n{}",
            airlock.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends SIGHUP to the orchestrator and waits for the reload's audit event `kind`
/// (`policy_reloaded`, `principals_reloaded`) that satisfies `matches`.
async fn reload(
    airlock: &Airlock,
    admin_token: &str,
    kind: &str,
    matches: impl Fn(&Value) -> bool,
) {
    signal(
        airlock.process("serve orchestrator"),
        rustix::process::Signal::HUP,
    );
    wait_audit(airlock, admin_token, kind, matches).await;
}

fn config_path(airlock: &Airlock) -> std::path::PathBuf {
    airlock.dir.path().join("airlock.toml")
}

/// Records an approval in the store the way another orchestrator replica (one that
/// still runs the old configuration) would, without this replica's re-check.
fn approve_behind_the_gate(airlock: &Airlock, approval_id: &str, call_id: &str) {
    let db = rusqlite::Connection::open(airlock.data_dir().join("airlock.db")).expect("store");
    db.busy_timeout(Duration::from_secs(10)).expect("timeout");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64;
    let changed = db
        .execute(
            "UPDATE approvals SET status = 'approved', decided_by = 'bob', decided_at = ?2 \
             WHERE approval_id = ?1 AND status = 'pending'",
            rusqlite::params![approval_id, now],
        )
        .expect("approve");
    assert_eq!(changed, 1, "the approval was pending");
    db.execute(
        "UPDATE calls SET state = 'approved' WHERE call_id = ?1 AND state = 'pending_approval'",
        [call_id],
    )
    .expect("call approved");
}

// ---- 9. revocation reaches pending approvals ----

#[tokio::test]
async fn a_policy_reload_that_forbids_the_requester_denies_its_pending_calls() {
    let dir = tempfile::tempdir().expect("dir");
    let policy = dir.path().join("policy.cedar");
    let base = airlock_policy::authz::DEFAULT_POLICY_SOURCE;
    std::fs::write(&policy, base).expect("policy");
    let config = format!(
        "{}{}{}[policy]\nfile = \"{}\"\n[approvals]\ntools = [\"write_file\", \"execute_shell\"]\n",
        principal_block("alice", "alice-token", "[\"agent\"]"),
        principal_block("bob", "bob-token", "[\"approver\"]"),
        principal_block("root", "root-token", "[\"admin\"]"),
        policy.display()
    );
    let airlock = Airlock::start_with(&config).await;
    let ws = airlock.data_dir().join("workspaces/alice/rev");

    // Held while alice may still write anywhere.
    let secret = held(
        &propose(
            &airlock,
            "alice-token",
            "rev",
            "write_file",
            json!({"path": "secret/key.txt", "content": "planted"}),
        )
        .await,
    );
    let harmless = held(
        &propose(
            &airlock,
            "alice-token",
            "rev",
            "write_file",
            json!({"path": "notes.txt", "content": "fine"}),
        )
        .await,
    );
    let shell = held(
        &propose(
            &airlock,
            "alice-token",
            "rev",
            "execute_shell",
            json!({"command": "echo pwned > pwned.txt"}),
        )
        .await,
    );

    // The operator forbids alice's writes under secret/ and her shell outright.
    std::fs::write(
        &policy,
        format!(
            "{base}\n@id(\"no-secret-writes\")\nforbid(principal == Airlock::Principal::\"alice\", action == Airlock::Action::\"write_file\", resource) when {{ context.arguments.path like \"secret/*\" }};\n@id(\"no-shell-for-alice\")\nforbid(principal == Airlock::Principal::\"alice\", action == Airlock::Action::\"execute_shell\", resource);\n"
        ),
    )
    .expect("new policy");
    reload(&airlock, "root-token", "policy_reloaded", |_| true).await;

    // Approving the calls the new policy forbids denies them instead.
    for (call_id, approval_id, rule) in [
        (&secret.0, &secret.1, "no-secret-writes"),
        (&shell.0, &shell.1, "no-shell-for-alice"),
    ] {
        let (status, body) = send(
            &airlock,
            "bob-token",
            reqwest::Method::POST,
            &format!("/v1/approvals/{approval_id}/approve"),
            Some(json!({"reason": "looks fine"})),
        )
        .await;
        assert_eq!(status, 409, "{body}");
        assert_eq!(body["error"]["code"], "revoked", "{body}");
        assert!(body.to_string().contains(rule), "{body}");
        let call = final_call(&airlock, "alice-token", call_id).await;
        assert_eq!(call["status"], "denied", "{call}");
        let text = result_text(&call);
        assert!(
            text.contains("system:revoked") && text.contains(rule),
            "{text}"
        );
        let event = wait_audit(&airlock, "root-token", "revoked", |e| {
            e["call_id"] == call_id.as_str()
        })
        .await;
        assert_eq!(event["data"]["stage"], "decision", "{event}");
        assert_eq!(event["data"]["attempted_by"], "bob", "{event}");
        // Deciding again is a conflict: the denial stands.
        let (status, _) = send(
            &airlock,
            "bob-token",
            reqwest::Method::POST,
            &format!("/v1/approvals/{approval_id}/approve"),
            Some(json!({})),
        )
        .await;
        assert_eq!(status, 409);
    }
    assert!(
        !ws.join("secret/key.txt").exists(),
        "the forbidden write ran"
    );
    assert!(!ws.join("pwned.txt").exists(), "the forbidden command ran");
    let (_, approvals) = send(
        &airlock,
        "bob-token",
        reqwest::Method::GET,
        "/v1/approvals",
        None,
    )
    .await;
    let listed = approvals["approvals"]
        .as_array()
        .expect("approvals")
        .iter()
        .find(|a| a["approval_id"] == secret.1.as_str())
        .expect("listed");
    assert_eq!(listed["status"], "denied", "{listed}");
    assert_eq!(listed["decided_by"], "system:revoked", "{listed}");

    // What the new policy still allows is approved and runs as before.
    let (status, body) = send(
        &airlock,
        "bob-token",
        reqwest::Method::POST,
        &format!("/v1/approvals/{}/approve", harmless.1),
        Some(json!({})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let call = final_call(&airlock, "alice-token", &harmless.0).await;
    assert_eq!(call["status"], "ok", "{call}");
    assert_eq!(
        std::fs::read_to_string(ws.join("notes.txt")).expect("written"),
        "fine"
    );
}

/// An approver removed by a reload takes back what they set up: their vote no longer
/// counts toward a quorum (another approver's vote leaves the call pending), and an
/// approval they remembered for the session no longer lets its calls through.
#[tokio::test]
async fn a_removed_approvers_votes_and_remembered_approvals_no_longer_count() {
    let mallory = principal_block("mallory", "mallory-token", "[\"approver\"]");
    let config = format!(
        "{}{mallory}{}{}[approvals]\ntools = [\"execute_shell\", \"write_file\"]\nquorum = {{ write_file = 2 }}\n",
        principal_block("alice", "alice-token", "[\"agent\"]"),
        principal_block("bob", "bob-token", "[\"approver\"]"),
        principal_block("root", "root-token", "[\"admin\"]"),
    );
    let airlock = Airlock::start_with(&config).await;
    let ws = airlock.data_dir().join("workspaces/alice/revoked");
    let approve = async |token: &str, approval_id: &str, body: Value| {
        send(
            &airlock,
            token,
            reqwest::Method::POST,
            &format!("/v1/approvals/{approval_id}/approve"),
            Some(body),
        )
        .await
    };

    // mallory casts the first of two votes; and approves a command for the session.
    let quorum = held(
        &propose(
            &airlock,
            "alice-token",
            "revoked",
            "write_file",
            json!({"path": "q.txt", "content": "two said yes"}),
        )
        .await,
    );
    let (status, body) = approve("mallory-token", &quorum.1, json!({})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "pending", "{body}");
    let command = json!({"command": "echo hi >> remembered.txt"});
    let first = held(
        &propose(
            &airlock,
            "alice-token",
            "revoked",
            "execute_shell",
            command.clone(),
        )
        .await,
    );
    let (status, body) = approve("mallory-token", &first.1, json!({"remember": "session"})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        final_call(&airlock, "alice-token", &first.0).await["status"],
        "ok"
    );
    // While mallory is an approver, the same command runs without asking again.
    let again = propose(
        &airlock,
        "alice-token",
        "revoked",
        "execute_shell",
        command.clone(),
    )
    .await;
    assert_ne!(again["status"], "pending_approval", "{again}");

    // mallory is removed.
    let path = config_path(&airlock);
    let text = std::fs::read_to_string(&path).expect("config");
    std::fs::write(&path, text.replace(&mallory, "")).expect("new config");
    reload(&airlock, "root-token", "principals_reloaded", |e| {
        e["data"]["principals"] == json!(["alice", "bob", "root"])
    })
    .await;

    // bob's vote is now the only one: the call still waits for a second approver.
    let (status, body) = approve("bob-token", &quorum.1, json!({})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["status"], "pending",
        "mallory's vote still counted: {body}"
    );
    assert_eq!(body["approved_by"], json!(["bob"]), "{body}");
    assert!(!ws.join("q.txt").exists(), "the quorum was not reached");
    let event = wait_audit(&airlock, "root-token", "partially_approved", |e| {
        e["data"]["votes_withdrawn"] == json!(["mallory"])
    })
    .await;
    assert_eq!(event["data"]["decided_by"], "bob", "{event}");

    // The remembered approval no longer covers the command: it waits for a human.
    let after = propose(&airlock, "alice-token", "revoked", "execute_shell", command).await;
    assert_eq!(
        after["status"], "pending_approval",
        "mallory's remembered approval still counted: {after}"
    );
    let runs = std::fs::read_to_string(ws.join("remembered.txt")).unwrap_or_default();
    assert_eq!(runs.lines().count(), 2, "{runs:?}");
}

#[tokio::test]
async fn removing_a_principal_or_its_role_denies_its_pending_calls_wherever_they_are_decided() {
    let alice = principal_block("alice", "alice-token", "[\"agent\"]");
    let carol = principal_block("carol", "carol-token", "[\"agent\", \"approver\"]");
    let carol_demoted = principal_block("carol", "carol-token", "[\"approver\"]");
    let config = format!(
        "{alice}{carol}{}{}[approvals]\ntools = [\"execute_shell\", \"write_file\"]\n",
        principal_block("bob", "bob-token", "[\"approver\"]"),
        principal_block("root", "root-token", "[\"admin\"]"),
    );
    let airlock = Airlock::start_with(&config).await;
    let ws = |who: &str| airlock.data_dir().join("workspaces").join(who).join("gone");

    let by_api = held(
        &propose(
            &airlock,
            "alice-token",
            "gone",
            "execute_shell",
            json!({"command": "echo one > one.txt"}),
        )
        .await,
    );
    let behind = held(
        &propose(
            &airlock,
            "alice-token",
            "gone",
            "write_file",
            json!({"path": "two.txt", "content": "two"}),
        )
        .await,
    );
    let demoted = held(
        &propose(
            &airlock,
            "carol-token",
            "gone",
            "execute_shell",
            json!({"command": "echo three > three.txt"}),
        )
        .await,
    );

    // alice leaves the config and carol keeps only the approver role.
    let path = config_path(&airlock);
    let text = std::fs::read_to_string(&path).expect("config");
    assert!(text.contains(&alice) && text.contains(&carol));
    std::fs::write(
        &path,
        text.replace(&alice, "").replace(&carol, &carol_demoted),
    )
    .expect("new config");
    reload(&airlock, "root-token", "principals_reloaded", |e| {
        e["data"]["principals"] == json!(["bob", "carol", "root"])
    })
    .await;
    let (status, _) = send(
        &airlock,
        "alice-token",
        reqwest::Method::GET,
        "/v1/tools",
        None,
    )
    .await;
    assert_eq!(status, 401, "a removed principal's token stops working");

    // Approved through the API: denied at the decision.
    for ((call_id, approval_id), owner, reason) in [
        (&by_api, "alice", "no longer configured"),
        (&demoted, "carol", "no longer has the agent role"),
    ] {
        let (status, body) = send(
            &airlock,
            "bob-token",
            reqwest::Method::POST,
            &format!("/v1/approvals/{approval_id}/approve"),
            Some(json!({})),
        )
        .await;
        assert_eq!(status, 409, "{body}");
        assert!(body.to_string().contains(reason), "{body}");
        let call = final_call(&airlock, "root-token", call_id).await;
        assert_eq!(call["status"], "denied", "{owner}: {call}");
        assert!(result_text(&call).contains(reason), "{call}");
    }

    // Approved behind this replica's back (another replica, old config): the waiting
    // call is checked again before it is dispatched.
    approve_behind_the_gate(&airlock, &behind.1, &behind.0);
    let call = final_call(&airlock, "root-token", &behind.0).await;
    assert_eq!(call["status"], "denied", "{call}");
    assert!(
        result_text(&call).contains("no longer configured"),
        "{call}"
    );
    let event = wait_audit(&airlock, "root-token", "revoked", |e| {
        e["call_id"] == behind.0.as_str()
    })
    .await;
    assert_eq!(event["data"]["stage"], "dispatch", "{event}");
    assert!(
        !ws("alice").join("one.txt").exists()
            && !ws("alice").join("two.txt").exists()
            && !ws("carol").join("three.txt").exists(),
        "a revoked call ran"
    );
    let (_, audit) = send(
        &airlock,
        "root-token",
        reqwest::Method::GET,
        &format!("/v1/audit?call_id={}", behind.0),
        None,
    )
    .await;
    assert!(
        !audit.to_string().contains("\"dispatched\""),
        "a revoked call was dispatched: {audit}"
    );
}

#[tokio::test]
async fn a_replica_resuming_an_approved_call_checks_the_principal_again() {
    let alice = principal_block("alice", "alice-token", "[\"agent\"]");
    let config = format!(
        "{alice}{}[approvals]\ntools = [\"execute_shell\"]\n",
        principal_block("root", "root-token", "[\"admin\", \"approver\"]"),
    );
    let airlock = Airlock::start_with(&config).await;
    let (call_id, approval_id) = held(
        &propose(
            &airlock,
            "alice-token",
            "resume",
            "execute_shell",
            json!({"command": "echo resumed > resumed.txt"}),
        )
        .await,
    );

    // The orchestrator dies with the call held; it comes back without alice, and the
    // approval arrives from a replica that still knew her.
    let path = config_path(&airlock);
    let text = std::fs::read_to_string(&path).expect("config");
    std::fs::write(&path, text.replace(&alice, "")).expect("new config");
    signal(
        airlock.process("serve orchestrator"),
        rustix::process::Signal::KILL,
    );
    airlock.wait_ready().await;
    approve_behind_the_gate(&airlock, &approval_id, &call_id);

    let call = final_call(&airlock, "root-token", &call_id).await;
    assert_eq!(call["status"], "denied", "{call}");
    assert!(
        result_text(&call).contains("no longer configured"),
        "{call}"
    );
    assert!(
        !airlock
            .data_dir()
            .join("workspaces/alice/resume/resumed.txt")
            .exists(),
        "the resumed call ran for a removed principal"
    );
    let event = wait_audit(&airlock, "root-token", "revoked", |e| {
        e["call_id"] == call_id.as_str()
    })
    .await;
    assert_eq!(event["data"]["stage"], "resume", "{event}");
}

// ---- 10. cancelling an approved, running call ----

/// Cancels `call_id` and checks the promise: whatever the answer says, `cancelled`
/// only once no process of the call is left; then waits for the final status.
async fn cancel_and_check(airlock: &Airlock, call_id: &str, marker: &str) -> Value {
    let (status, answer) = airlock
        .post(&format!("/v1/calls/{call_id}/cancel"), &json!({}))
        .await;
    assert_eq!(status, 200, "{answer}");
    if answer["status"] == "cancelled" {
        assert!(
            !airlock.runs(marker),
            "reported cancelled while the command still runs: {answer}"
        );
    }
    let (_, call) = airlock
        .get(&format!("/v1/calls/{call_id}?wait_ms=60000"))
        .await;
    assert_eq!(call["status"], "cancelled", "{call}");
    assert!(
        !airlock.runs(marker),
        "the call reads cancelled but its command still runs: {call}"
    );
    call
}

/// A cancel that reaches a held call after its approval was recorded — by another
/// replica, or before this one polled the store — cannot withdraw it: the approval
/// stands, and the call ends as a cancelled approved call (stopped before or while it
/// runs), never as `approval_withdrawn` over an approval the store holds as approved.
/// (With two replicas the withdrawal that failed used to overwrite the record of a call
/// that the other replica was running.)
#[tokio::test]
async fn a_cancel_after_the_approval_was_recorded_does_not_withdraw_it() {
    let airlock = Airlock::start_with("[approvals]\ntools = [\"execute_shell\"]\n").await;
    let pid = std::process::id();
    for round in 0..3 {
        let marker = format!("airlock-late-cancel-{round}-{pid}");
        let call = propose(
            &airlock,
            &airlock.token,
            "late-cancel",
            "execute_shell",
            json!({"command": format!("sleep 300; echo {marker}")}),
        )
        .await;
        let (call_id, approval_id) = held(&call);
        approve_behind_the_gate(&airlock, &approval_id, &call_id);
        let call = cancel_and_check(&airlock, &call_id, &marker).await;
        assert!(call["approval_wait_ms"].is_u64(), "{call}");
        let (_, approvals) = airlock.get("/v1/approvals?status=approved").await;
        assert!(
            approvals["approvals"]
                .as_array()
                .expect("approvals")
                .iter()
                .any(|a| a["approval_id"] == approval_id.as_str() && a["status"] == "approved"),
            "the approval no longer reads approved: {approvals}"
        );
        let kinds = airlock.audit_kinds(&call_id).await;
        assert!(
            !kinds.iter().any(|k| k == "approval_withdrawn"),
            "an approved approval was reported withdrawn: {kinds:?}"
        );
        assert_eq!(
            kinds.last().map(String::as_str),
            Some("completed"),
            "{kinds:?}"
        );
    }
}

#[tokio::test]
async fn cancelling_an_approved_running_call_kills_its_sandbox() {
    let airlock = Airlock::start_with("[approvals]\ntools = [\"execute_shell\"]\n").await;
    let pid = std::process::id();

    // An approved call runs detached from its requester; cancel must still reach it.
    // (Each marked shell has work left after its sleep, so it stays the process that
    // carries the marker.)
    for (round, command) in [
        ("sleep", "sleep 300; echo {marker}"),
        // A child shell that ignores the polite signals, in the background: nothing
        // of the call may survive.
        (
            "trap",
            "trap '' TERM HUP INT; sh -c \"trap '' TERM HUP INT; sleep 300; echo child\" {marker}-child & sleep 300; echo {marker}",
        ),
    ] {
        let marker = format!("airlock-cancel-{round}-{pid}");
        let command = command.replace("{marker}", &marker);
        let call = airlock
            .post(
                "/v1/tool_calls",
                &json!({"session_id": "cancel", "wait_ms": 0, "tool_uses": [{"type": "tool_use", "id": "c", "name": "execute_shell", "input": {"command": command}}]}),
            )
            .await
            .1["calls"][0]
            .clone();
        let (call_id, approval_id) = held(&call);
        let (status, _) = airlock
            .post(&format!("/v1/approvals/{approval_id}/approve"), &json!({}))
            .await;
        assert_eq!(status, 200);
        airlock.wait_started(&marker, "the approved command").await;
        let call = cancel_and_check(&airlock, &call_id, &marker).await;
        assert!(call["approval_wait_ms"].is_u64(), "{call}");
        let (_, audit) = airlock.get(&format!("/v1/audit?call_id={call_id}")).await;
        let completed = audit["events"]
            .as_array()
            .expect("events")
            .iter()
            .find(|e| e["kind"] == "completed")
            .cloned()
            .expect("completed");
        assert_eq!(completed["data"]["status"], "cancelled", "{completed}");
    }

    // Approved and running when the orchestrator dies: the call is resumed (or only in
    // the store) on the restarted orchestrator, and a cancel there still kills it.
    let marker = format!("airlock-cancel-resumed-{pid}");
    let call = airlock
        .post(
            "/v1/tool_calls",
            &json!({"session_id": "cancel", "wait_ms": 0, "tool_uses": [{"type": "tool_use", "id": "c", "name": "execute_shell", "input": {"command": format!("sleep 300; echo {marker}")}}]}),
        )
        .await
        .1["calls"][0]
        .clone();
    let (call_id, approval_id) = held(&call);
    airlock
        .post(&format!("/v1/approvals/{approval_id}/approve"), &json!({}))
        .await;
    airlock.wait_started(&marker, "the approved command").await;
    signal(
        airlock.process("serve orchestrator"),
        rustix::process::Signal::KILL,
    );
    airlock.wait_ready().await;
    assert!(
        airlock.runs(&marker),
        "the detached call outlives its orchestrator"
    );
    cancel_and_check(&airlock, &call_id, &marker).await;

    // The same promise for a call that needed no approval (attached to its request).
    let plain = Airlock::start().await;
    let marker = format!("airlock-cancel-plain-{pid}");
    let (_, body) = plain
        .post(
            "/v1/tool_calls",
            &json!({"session_id": "plain", "wait_ms": 0, "tool_uses": [{"type": "tool_use", "id": "c", "name": "execute_shell", "input": {"argv": ["sh", "-c", "sleep 300; echo done", &marker]}}]}),
        )
        .await;
    let call_id = body["calls"][0]["call_id"]
        .as_str()
        .expect("call id")
        .to_owned();
    plain.wait_started(&marker, "the command").await;
    cancel_and_check(&plain, &call_id, &marker).await;
}

// ---- 11. method override and bodies on safe methods ----

/// A loopback HTTP server that records each request's head; answers 200.
fn recording_server() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(64) {
            let Ok(mut stream) = stream else { continue };
            let mut buf = [0u8; 8192];
            let n = stream.read(&mut buf).unwrap_or(0);
            record
                .lock()
                .expect("lock")
                .push(String::from_utf8_lossy(&buf[..n]).into_owned());
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
            );
        }
    });
    (port, seen)
}

#[tokio::test]
async fn a_safe_method_with_a_body_or_a_method_override_needs_approval_and_never_goes_out() {
    let (port, seen) = recording_server();
    let airlock = Airlock::start_with(&format!(
        "[http]\nallow = [\"127.0.0.1:{port}\"]\n[approvals]\ntools = [\"http_request\"]\n"
    ))
    .await;
    let url = format!("http://127.0.0.1:{port}/items/1");
    let local = airlock.token.clone();

    let attempts = [
        json!({"method": "GET", "url": url, "body": "{\"confirm\": true}", "headers": {"X-HTTP-Method-Override": "DELETE"}}),
        json!({"method": "GET", "url": url, "body": "id=1"}),
        json!({"method": "HEAD", "url": url, "body": "x"}),
        json!({"method": "OPTIONS", "url": url, "headers": {"x-http-method": "PUT"}}),
        json!({"method": "GET", "url": url, "headers": {"X-Method-Override": "PATCH", "Accept": "*/*"}}),
        // Strict-mode clients send headers as name/value pairs.
        json!({"method": "GET", "url": url, "headers": [{"name": "X-Http-Method-Override", "value": "DELETE"}]}),
    ];
    let mut approvals = Vec::new();
    for input in &attempts {
        let call = propose(&airlock, &local, "override", "http_request", input.clone()).await;
        approvals.push((held(&call), input.clone()));
    }
    assert!(
        seen.lock().expect("lock").is_empty(),
        "a held request went out"
    );
    let (_, audit) = airlock
        .get("/v1/audit?session_id=override&limit=1000")
        .await;
    let reasons: Vec<String> = audit["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["kind"] == "pending_approval")
        .map(|e| e["data"]["reasons"].to_string())
        .collect();
    assert_eq!(reasons.len(), attempts.len(), "{reasons:?}");
    assert!(
        reasons.iter().any(|r| r.contains("GET request has a body"))
            && reasons
                .iter()
                .any(|r| r.contains("HEAD request has a body"))
            && reasons.iter().any(|r| r.contains("X-Method-Override")),
        "the reasons say why: {reasons:?}"
    );

    // A plain GET, even with an empty body, is still a read.
    let (err, text, call) = airlock
        .call_in(
            "override",
            "http_request",
            json!({"method": "GET", "url": url, "body": "", "headers": {"Accept": "text/plain"}}),
        )
        .await;
    assert!(!err && call["status"] == "ok", "{text}");
    assert_eq!(seen.lock().expect("lock").len(), 1);

    // Approved anyway, a request with an override header is refused by the worker: the
    // method that goes out is the one the approver saw.
    for ((call_id, approval_id), input) in &approvals {
        if input["headers"].is_null() {
            continue;
        }
        let (status, _) = airlock
            .post(&format!("/v1/approvals/{approval_id}/approve"), &json!({}))
            .await;
        assert_eq!(status, 200);
        let call = final_call(&airlock, &local, call_id).await;
        assert_eq!(call["status"], "error", "{input}: {call}");
        assert!(result_text(&call).contains("another method"), "{call}");
    }
    let heads = seen.lock().expect("lock").clone();
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert!(
        !heads
            .iter()
            .any(|h| h.to_ascii_lowercase().contains("override")),
        "{heads:?}"
    );
}

// ---- 12. redaction beyond key names ----

#[tokio::test]
async fn secrets_in_headers_urls_and_commands_never_reach_the_audit_or_approvers() {
    let airlock = Airlock::start_with(
        "[approvals]\ntools = [\"execute_shell\", \"http_request\", \"write_file\", \"execute_sql\"]\n",
    )
    .await;
    let pid = std::process::id();
    let secret = |n: u32| format!("Zq{n}x{pid}sEcReT");
    let token = airlock.token.clone();
    let calls = [
        (
            "http_request",
            json!({
                "method": "POST",
                "url": format!("https://api.example.test/v1/items?page=2&access_token={}&api_key={}", secret(1), secret(2)),
                "headers": {"Ocp-Apim-Subscription-Key": secret(3), "X-Secret-Key": secret(4), "Cookie": format!("sid={}", secret(5)), "Accept": "application/json"},
                "body": format!("{{\"user\": \"ann\", \"password\": \"{}\"}}", secret(6)),
            }),
        ),
        (
            "execute_shell",
            json!({"command": format!(
                "PGPASSWORD={} psql -h db -c 'select 1' && curl -H 'Authorization: Bearer {}' https://deploy:{}@registry.example.test/ && mysql --password={} -u root && tool --api-key {}",
                secret(7), secret(8), secret(9), secret(10), secret(11)
            )}),
        ),
        (
            "write_file",
            json!({"path": ".env", "content": format!("API_KEY={}\nAWS_SECRET_ACCESS_KEY={}\nDEBUG=1\n", secret(12), secret(13))}),
        ),
        (
            "execute_sql",
            json!({"database": "demo", "sql": format!("ALTER USER app WITH PASSWORD '{}'", secret(14))}),
        ),
        (
            "http_request",
            json!({"method": "GET", "url": format!("https://{}@github.example.test/o/r.git?sig={}", secret(15), secret(16)),
                   "headers": [{"name": "X-Amz-Security-Token", "value": secret(17)}]}),
        ),
    ];
    let mut ids = Vec::new();
    for (tool, input) in &calls {
        let call = propose(&airlock, &token, "secrets", tool, input.clone()).await;
        ids.push(call["call_id"].as_str().expect("call id").to_owned());
    }
    // The last one needs no approval: it is tried (and fails: no such host) first.
    final_call(&airlock, &token, &ids[4]).await;
    let leaks = |what: &str, text: &str| {
        for n in 1..=17 {
            assert!(
                !text.contains(&secret(n)),
                "secret {n} reached {what}: {text}"
            );
        }
    };
    let (_, approvals) = airlock.get("/v1/approvals?status=pending").await;
    let listed = approvals.to_string();
    leaks("the approvals listing", &listed);
    // What an approver needs stays visible.
    for visible in [
        "Ocp-Apim-Subscription-Key",
        "psql -h db",
        "registry.example.test",
        "DEBUG=1",
        "ALTER USER app",
        "page=2",
        "[redacted]",
    ] {
        assert!(listed.contains(visible), "{visible} hidden: {listed}");
    }
    let (_, audit) = airlock.get("/v1/audit?limit=1000").await;
    leaks("GET /v1/audit", &audit.to_string());
    let db = rusqlite::Connection::open(airlock.data_dir().join("airlock.db")).expect("store");
    db.busy_timeout(Duration::from_secs(10)).expect("timeout");
    let mut rows = db
        .prepare("SELECT data FROM audit_events")
        .expect("prepare");
    let stored: Vec<String> = rows
        .query_map([], |row| row.get::<_, String>(0))
        .expect("query")
        .map(|r| r.expect("row"))
        .collect();
    leaks("the stored audit log", &stored.join("\n"));
    leaks("the log", &airlock.log());
    let cli = std::process::Command::new(AIRLOCK)
        .args([
            "approvals",
            "list",
            "--url",
            &airlock.url,
            "--token",
            &token,
        ])
        .output()
        .expect("cli");
    leaks(
        "airlock approvals list",
        &String::from_utf8_lossy(&cli.stdout),
    );
}

/// A call its tool's schema refuses is audited as `rejected_schema` with the rule and the
/// field it broke. The validator's message quotes the value it judged — for a rule on the
/// whole input (`oneOf` at the root) every argument — so the audit's copy of each
/// violation is masked, and both copies are bounded in length.
#[tokio::test]
async fn secrets_in_arguments_the_schema_refuses_never_reach_the_audit() {
    let airlock = Airlock::start().await;
    let pid = std::process::id();
    let secret = |n: u32| format!("Zq{n}x{pid}sChEmA");
    let token = airlock.token.clone();
    let huge = format!("{}{}", secret(5), "x".repeat(1 << 20));
    // Each secret is where the `requested` event redacts it (a secret's name): only the
    // violations could carry it into the log.
    let calls = [
        // Both forms at once: the root's `oneOf` fails and quotes the whole input.
        json!({"command": "true", "argv": ["true"], "env": {"API_TOKEN": secret(1), "GITHUB_TOKEN": secret(2)}}),
        // A value of the wrong type is quoted by `type`.
        json!({"command": "true", "env": {"DB_PASSWORD": {"value": secret(3)}}}),
        // Over `maxLength`: the value is quoted whole by the validator.
        json!({"command": "true", "env": {"AWS_SECRET_ACCESS_KEY": format!("{}{}", secret(4), "y".repeat(5000))}}),
        // A megabyte over `maxLength`, beside a broken `oneOf` and a wrong type.
        json!({"stdin": "ok", "cwd": 7, "env": {"PRIVATE_KEY": huge}}),
    ];
    let mut ids = Vec::new();
    for input in &calls {
        let call = propose(&airlock, &token, "schema", "execute_shell", input.clone()).await;
        assert_eq!(call["status"], "error", "{call}");
        let text = call["text"].as_str().unwrap_or_default();
        let head: String = text.chars().take(512).collect();
        // The caller is told what to fix, in a bounded answer.
        assert!(text.contains("rule: "), "{head}");
        assert!(text.len() < 8 * 1024, "{} bytes: {head}", text.len());
        ids.push(call["call_id"].as_str().expect("call id").to_owned());
    }
    let leaks = |what: &str, text: &str| {
        for n in 1..=5 {
            assert!(
                !text.contains(&secret(n)),
                "secret {n} reached {what}: {}",
                text.chars().take(2048).collect::<String>()
            );
        }
    };
    for call_id in &ids {
        let (_, audit) = airlock.get(&format!("/v1/audit?call_id={call_id}")).await;
        let events = audit["events"].as_array().expect("events");
        let rejected = events
            .iter()
            .find(|e| e["kind"] == "rejected_schema")
            .unwrap_or_else(|| panic!("no rejected_schema event for {call_id}: {audit}"));
        let violations = rejected["data"]["violations"]
            .as_array()
            .expect("violations");
        assert!(!violations.is_empty(), "{rejected}");
        for v in violations {
            let v = v.as_str().expect("a violation is text");
            // Field and rule stay: that is what an auditor reads.
            assert!(v.contains("rule: "), "{v}");
            assert!(v.len() <= 1024, "{} bytes: {v}", v.len());
        }
    }
    let (_, audit) = airlock.get("/v1/audit?limit=1000").await;
    leaks("GET /v1/audit", &audit.to_string());
    let db = rusqlite::Connection::open(airlock.data_dir().join("airlock.db")).expect("store");
    db.busy_timeout(Duration::from_secs(10)).expect("timeout");
    let stored: Vec<String> = db
        .prepare("SELECT data FROM audit_events")
        .expect("prepare")
        .query_map([], |row| row.get::<_, String>(0))
        .expect("query")
        .map(|r| r.expect("row"))
        .collect();
    let stored = stored.join("\n");
    leaks("the stored audit log", &stored);
    assert!(
        stored.len() < 256 * 1024,
        "the audit log took {} bytes for four refused calls",
        stored.len()
    );
    leaks("the log", &airlock.log());
}

// ---- 15. the agent works in the session `default` ----

/// An OpenAI-compatible provider that answers each request with the next canned body
/// and records the request bodies.
fn scripted_openai(replies: Vec<Value>) -> (String, Arc<Mutex<Vec<Value>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!(
        "http://127.0.0.1:{}/v1",
        listener.local_addr().expect("addr").port()
    );
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let record = bodies.clone();
    std::thread::spawn(move || {
        let mut replies = replies.into_iter();
        for stream in listener.incoming().take(32) {
            let Ok(mut stream) = stream else { continue };
            let mut buf = Vec::new();
            let mut chunk = [0u8; 65536];
            let body = loop {
                let n = stream.read(&mut chunk).unwrap_or(0);
                if n == 0 {
                    break None;
                }
                buf.extend_from_slice(&chunk[..n]);
                let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                    continue;
                };
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if buf.len() >= end + 4 + length {
                    break Some(buf[end + 4..end + 4 + length].to_vec());
                }
            };
            let Some(body) = body else { continue };
            record
                .lock()
                .expect("lock")
                .push(serde_json::from_slice(&body).unwrap_or(Value::Null));
            let reply = replies
                .next()
                .unwrap_or_else(|| json!({"error": "no more replies"}));
            let text = reply.to_string();
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                text.len()
            );
        }
    });
    (url, bodies)
}

fn openai_reply(content: Option<&str>, tool_calls: Value) -> Value {
    let finish = if tool_calls.as_array().is_some_and(|a| !a.is_empty()) {
        "tool_calls"
    } else {
        "stop"
    };
    let mut message = json!({"role": "assistant", "content": content});
    if finish == "tool_calls" {
        message["tool_calls"] = tool_calls;
    }
    json!({"id": "chatcmpl-x", "object": "chat.completion", "model": "local",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
}

#[tokio::test]
async fn the_agent_without_a_session_sees_the_users_default_workspace() {
    let list = |id: &str, path: &str| {
        openai_reply(
            None,
            json!([{"id": id, "type": "function", "function": {"name": "list_directory", "arguments": json!({"path": path}).to_string()}}]),
        )
    };
    let (url, bodies) = scripted_openai(vec![
        list("l1", "."),
        openai_reply(Some("Listed."), json!([])),
        list("l2", "."),
        openai_reply(Some("Listed again."), json!([])),
    ]);
    let key_var = "AIRLOCK_E2E_POLICY_MODEL_KEY";
    let airlock = Airlock::start_with_env(
        &format!(
            "[agent]\nprovider = \"openai\"\nbase_url = \"{url}\"\napi_key_env = \"{key_var}\"\nstream = false\n[budgets]\nrate_per_minute = 0\nmax_calls_per_session = 2\n"
        ),
        &[(key_var, "sk-test-policy")],
    )
    .await;

    // The user works with `airlock call` (no session): more calls than a session's
    // budget, which calls that name no session do not count against.
    for i in 0..3 {
        let out = tokio::process::Command::new(AIRLOCK)
            .args([
                "call",
                "write_file",
                &json!({"path": format!("user-note-{i}.txt"), "content": "mine"}).to_string(),
            ])
            .env("AIRLOCK_URL", &airlock.url)
            .env("AIRLOCK_TOKEN", &airlock.token)
            .env_remove("AIRLOCK_DATA_DIR")
            .env_remove("AIRLOCK_CONFIG")
            .output()
            .await
            .expect("airlock call");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(
        airlock
            .workspace("default")
            .join("user-note-2.txt")
            .exists()
    );

    // `airlock agent` without --session: the model lists the same workspace.
    let out = tokio::process::Command::new(AIRLOCK)
        .args(["agent", "list the files in my workspace"])
        .env("AIRLOCK_URL", &airlock.url)
        .env("AIRLOCK_TOKEN", &airlock.token)
        .env_remove("AIRLOCK_DATA_DIR")
        .env_remove("AIRLOCK_CONFIG")
        .output()
        .await
        .expect("airlock agent");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stderr.contains("session default"), "{stdout}\n{stderr}");
    assert!(stdout.contains("✓ list_directory"), "{stdout}\n{stderr}");

    // POST /v1/agent/runs without a session, too.
    let response = airlock
        .request(reqwest::Method::POST, "/v1/agent/runs")
        .json(&json!({"prompt": "list them again"}))
        .send()
        .await
        .expect("run");
    assert_eq!(response.status(), 200);
    let events = response.text().await.expect("events");
    assert!(events.contains("\"session_id\":\"default\""), "{events}");

    // Each run's tool result, sent back to the model, lists the user's files, and no
    // session budget refused it.
    let bodies = bodies.lock().expect("lock").clone();
    assert_eq!(bodies.len(), 4, "{bodies:?}");
    for turn in [&bodies[1], &bodies[3]] {
        let messages = turn["messages"].as_array().expect("messages");
        let result = messages
            .iter()
            .find(|m| m["role"] == "tool")
            .expect("a tool result");
        let text = result["content"].to_string();
        for i in 0..3 {
            assert!(text.contains(&format!("user-note-{i}.txt")), "{text}");
        }
        assert!(!text.contains("budget"), "{text}");
    }
}

/// The policies see each served tool as its worker defines it: every argument of the
/// worker's schema is in the Cedar schema's `context.arguments` with the same type and
/// required flag (or in the policy crate's `NOT_IN_CONTEXT` with its reason), every
/// argument policies read is in the worker's schema, and the worker's annotations are
/// the action's groups. A new argument a worker adds without the Cedar schema —
/// silently invisible to every rule — fails here, and the orchestrator refuses to serve
/// such a tool.
#[tokio::test]
async fn every_schema_argument_is_seen_by_policy_or_left_out_on_purpose() {
    use airlock_policy::authz::check_tool;
    use airlock_policy::{ToolAnnotations, ToolDefinition};
    let airlock = Airlock::start().await;
    let (status, body) = airlock.get("/v1/tools?format=mcp").await;
    assert_eq!(status, 200, "{body}");
    let tools = body["tools"].as_array().expect("tools");
    assert!(tools.len() >= 17, "every built-in tool is served: {body}");
    let hint = |tool: &Value, name: &str| tool["annotations"][name].as_bool().expect(name);
    let problems: Vec<String> = tools
        .iter()
        .flat_map(|tool| {
            check_tool(&ToolDefinition {
                name: tool["name"].as_str().expect("name").to_owned(),
                title: String::new(),
                description: String::new(),
                input_schema: tool["inputSchema"].clone(),
                annotations: ToolAnnotations {
                    read_only: hint(tool, "readOnlyHint"),
                    destructive: hint(tool, "destructiveHint"),
                    idempotent: hint(tool, "idempotentHint"),
                    open_world: hint(tool, "openWorldHint"),
                },
            })
        })
        .collect();
    assert!(
        problems.is_empty(),
        "the workers' schemas and the policy disagree:\n{}",
        problems.join("\n")
    );
}
