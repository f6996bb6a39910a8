//! Bound approvals (DESIGN §14): an approval names the digest of the input it holds, a
//! decision quoting another digest is refused, and the audit records the digest and
//! the policy the decision was taken under.

use serde_json::{Value, json};

use std::time::{Duration, Instant};

use crate::support::{
    AIRLOCK, Airlock, listed_approval, principals_config, send_as as send, token_digest,
};

/// An agent, two approvers and an admin with known tokens; `extra` is appended.
fn principals(extra: &str) -> String {
    principals_config(
        &[
            ("alice", &["agent"]),
            ("bob", &["approver"]),
            ("dave", &["approver"]),
            ("root", &["admin"]),
        ],
        extra,
    )
}

fn sha256_hex(text: &str) -> String {
    token_digest(text)
}

/// Proposes one call as alice (`wait_ms: 0`): its `calls[]` entry.
async fn propose(airlock: &Airlock, session: &str, tool: &str, input: Value) -> Value {
    let body = json!({"session_id": session, "wait_ms": 0,
        "tool_uses": [{"type": "tool_use", "id": "t1", "name": tool, "input": input}]});
    let (status, body, _) = send(
        airlock,
        "alice-token",
        reqwest::Method::POST,
        "/v1/tool_calls",
        Some(body),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body["calls"][0].clone()
}

async fn decide(
    airlock: &Airlock,
    token: &str,
    approval_id: &str,
    verb: &str,
    body: Value,
) -> (u16, Value) {
    let (status, body, _) = send(
        airlock,
        token,
        reqwest::Method::POST,
        &format!("/v1/approvals/{approval_id}/{verb}"),
        Some(body),
    )
    .await;
    (status, body)
}

async fn approval(airlock: &Airlock, approval_id: &str) -> Value {
    listed_approval(airlock, "bob-token", approval_id).await
}

async fn call_detail(airlock: &Airlock, call_id: &str, wait_ms: u64) -> Value {
    let (status, body, _) = send(
        airlock,
        "alice-token",
        reqwest::Method::GET,
        &format!("/v1/calls/{call_id}?wait_ms={wait_ms}"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body
}

async fn audit_of(airlock: &Airlock, call_id: &str) -> Vec<Value> {
    let (status, audit, _) = send(
        airlock,
        "root-token",
        reqwest::Method::GET,
        &format!("/v1/audit?call_id={call_id}&limit=1000"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{audit}");
    audit["events"].as_array().expect("events").clone()
}

#[tokio::test]
async fn a_decision_quoting_another_input_is_refused_and_the_digest_is_audited() {
    let airlock = Airlock::start_with(&principals("[approvals]\ntools = [\"write_file\"]\n")).await;
    let ws = airlock.data_dir().join("workspaces/alice/s1");
    let held = propose(
        &airlock,
        "s1",
        "write_file",
        json!({"path": "a.txt", "content": "approved"}),
    )
    .await;
    assert_eq!(held["status"], "pending_approval", "{held}");
    let approval_id = held["approval_id"].as_str().expect("approval id");
    let call_id = held["call_id"].as_str().expect("call id");

    // The digest of the canonical JSON (keys sorted, no spaces) of the input as sent.
    let digest = sha256_hex(r#"{"content":"approved","path":"a.txt"}"#);
    let listed = approval(&airlock, approval_id).await;
    assert_eq!(listed["input_sha256"], digest.as_str(), "{listed}");

    // Another digest: 409 for approve and deny alike, and the call stays held.
    let other = sha256_hex(r#"{"content":"something else","path":"a.txt"}"#);
    for verb in ["approve", "deny"] {
        let (status, body) = decide(
            &airlock,
            "bob-token",
            approval_id,
            verb,
            json!({"input_sha256": other}),
        )
        .await;
        assert_eq!(status, 409, "{verb}: {body}");
        assert_eq!(body["error"]["code"], "input_changed", "{body}");
    }
    let (status, body) = decide(
        &airlock,
        "bob-token",
        approval_id,
        "approve",
        json!({"input_sha256": "not hex"}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(approval(&airlock, approval_id).await["status"], "pending");
    let detail = call_detail(&airlock, call_id, 0).await;
    assert_eq!(detail["status"], "pending_approval", "{detail}");
    assert!(
        !ws.join("a.txt").exists(),
        "a refused decision runs nothing"
    );

    // The right digest approves, and the call runs.
    let (status, body) = decide(
        &airlock,
        "bob-token",
        approval_id,
        "approve",
        json!({"input_sha256": digest, "reason": "read it"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["input_sha256"], digest.as_str(), "{body}");
    let detail = call_detail(&airlock, call_id, 30_000).await;
    assert_eq!(detail["status"], "ok", "{detail}");
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).expect("written"),
        "approved"
    );

    // The decision's record names the input and the policy it was taken under (the
    // embedded default policy: no [policy] file is configured).
    let events = audit_of(&airlock, call_id).await;
    let approved: Vec<&Value> = events.iter().filter(|e| e["kind"] == "approved").collect();
    assert_eq!(approved.len(), 1, "{events:?}");
    let data = &approved[0]["data"];
    assert_eq!(data["input_sha256"], digest.as_str(), "{data}");
    assert_eq!(
        data["policy_sha256"],
        sha256_hex(airlock_policy::authz::DEFAULT_POLICY_SOURCE).as_str(),
        "{data}"
    );
    assert_eq!(data["decided_by"], "bob", "{data}");
}

#[tokio::test]
async fn a_quorum_call_runs_once_its_second_distinct_approver_approves() {
    let airlock = Airlock::start_with(&principals(
        "[approvals]\ntools = []\nquorum = { write_file = 2 }\n",
    ))
    .await;
    let ws = airlock.data_dir().join("workspaces/alice/q1");
    let held = propose(
        &airlock,
        "q1",
        "write_file",
        json!({"path": "q.txt", "content": "two said yes"}),
    )
    .await;
    assert_eq!(held["status"], "pending_approval", "{held}");
    let approval_id = held["approval_id"].as_str().expect("approval id");
    let call_id = held["call_id"].as_str().expect("call id");

    // The first approval leaves it pending and lists its approver.
    let (status, first) = decide(&airlock, "bob-token", approval_id, "approve", json!({})).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["status"], "pending", "{first}");
    assert_eq!(first["approved_by"], json!(["bob"]), "{first}");
    let listed = approval(&airlock, approval_id).await;
    assert_eq!(listed["status"], "pending", "{listed}");
    assert_eq!(listed["approved_by"], json!(["bob"]), "{listed}");
    let detail = call_detail(&airlock, call_id, 500).await;
    assert_eq!(detail["status"], "pending_approval", "{detail}");
    assert!(!ws.join("q.txt").exists(), "one approver is not enough");

    // The same approver again is refused and counts for nothing.
    let (status, again) = decide(&airlock, "bob-token", approval_id, "approve", json!({})).await;
    assert_eq!(status, 409, "{again}");
    assert_eq!(again["error"]["code"], "already_approved", "{again}");
    assert_eq!(
        approval(&airlock, approval_id).await["approved_by"],
        json!(["bob"])
    );
    assert!(!ws.join("q.txt").exists());

    // An approval that needs two cannot be remembered: one approver would then approve
    // the later calls alone.
    let (status, remembered) = decide(
        &airlock,
        "dave-token",
        approval_id,
        "approve",
        json!({"remember": "session"}),
    )
    .await;
    assert_eq!(status, 409, "{remembered}");
    assert_eq!(
        remembered["error"]["code"], "cannot_remember",
        "{remembered}"
    );
    assert_eq!(
        approval(&airlock, approval_id).await["approved_by"],
        json!(["bob"])
    );

    // A second, distinct approver completes the quorum: the call runs, once.
    let (status, second) = decide(&airlock, "dave-token", approval_id, "approve", json!({})).await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["status"], "approved", "{second}");
    assert_eq!(second["approved_by"], json!(["bob", "dave"]), "{second}");
    let detail = call_detail(&airlock, call_id, 30_000).await;
    assert_eq!(detail["status"], "ok", "{detail}");
    assert_eq!(
        std::fs::read_to_string(ws.join("q.txt")).expect("written"),
        "two said yes"
    );
    let (status, late) = decide(&airlock, "bob-token", approval_id, "approve", json!({})).await;
    assert_eq!(status, 409, "{late}");

    let events = audit_of(&airlock, call_id).await;
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["kind"].as_str().expect("kind"))
        .collect();
    let count = |kind: &str| kinds.iter().filter(|k| **k == kind).count();
    assert_eq!(count("pending_approval"), 1, "{kinds:?}");
    assert_eq!(count("partially_approved"), 1, "{kinds:?}");
    assert_eq!(count("approved"), 1, "{kinds:?}");
    assert_eq!(count("dispatched"), 1, "ran once: {kinds:?}");
    assert_eq!(count("completed"), 1, "ran once: {kinds:?}");
    let pending = events
        .iter()
        .find(|e| e["kind"] == "pending_approval")
        .expect("pending");
    assert_eq!(pending["data"]["quorum"], 2, "{pending}");
    let approved = events
        .iter()
        .find(|e| e["kind"] == "approved")
        .expect("approved");
    assert_eq!(approved["data"]["approved_by"], json!(["bob", "dave"]));
    assert_eq!(approved["data"]["quorum"], 2);
}

#[tokio::test]
async fn a_quorum_annotation_holds_the_call_for_that_many_approvers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let policy = dir.path().join("policy.cedar");
    std::fs::write(
        &policy,
        format!(
            "{}\n@id(\"two-for-writes\") @quorum(\"2\")\npermit (principal, action == Airlock::Action::\"write_file\", resource);\n",
            airlock_policy::authz::DEFAULT_POLICY_SOURCE
        ),
    )
    .expect("policy");
    let airlock = Airlock::start_with(&principals(&format!(
        "[approvals]\ntools = []\n[policy]\nfile = \"{}\"\n",
        policy.display()
    )))
    .await;
    let held = propose(
        &airlock,
        "q2",
        "write_file",
        json!({"path": "p.txt", "content": "x"}),
    )
    .await;
    assert_eq!(held["status"], "pending_approval", "{held}");
    let approval_id = held["approval_id"].as_str().expect("approval id");
    let (status, first) = decide(&airlock, "bob-token", approval_id, "approve", json!({})).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["status"], "pending", "{first}");
    let (status, second) = decide(&airlock, "dave-token", approval_id, "approve", json!({})).await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["status"], "approved", "{second}");
}

/// Calls as alice and waits up to 10 s for the answer: the call's `calls[]` entry.
async fn call(airlock: &Airlock, session: &str, input: Value) -> Value {
    let body = json!({"session_id": session, "wait_ms": 10_000,
        "tool_uses": [{"type": "tool_use", "id": "t1", "name": "write_file", "input": input}]});
    let (status, body, _) = send(
        airlock,
        "alice-token",
        reqwest::Method::POST,
        "/v1/tool_calls",
        Some(body),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body["calls"][0].clone()
}

#[tokio::test]
async fn an_approval_remembered_for_a_session_covers_the_same_call_there_until_it_expires() {
    // Approvals expire 10 s after they are asked for; the remembered one with them.
    let airlock = Airlock::start_with(&principals(
        "[approvals]\ntools = [\"write_file\"]\ntimeout_seconds = 10\n",
    ))
    .await;
    let ws = airlock.data_dir().join("workspaces/alice/r1");
    let input = json!({"path": "r.txt", "content": "same"});
    let held = propose(&airlock, "r1", "write_file", input.clone()).await;
    assert_eq!(held["status"], "pending_approval", "{held}");
    let asked_at = Instant::now();
    let approval_id = held["approval_id"].as_str().expect("approval id");
    let first_call = held["call_id"].as_str().expect("call id");

    // Deny takes no remember; remember takes only "session".
    for (verb, remember) in [("deny", "session"), ("approve", "forever")] {
        let (status, body) = decide(
            &airlock,
            "bob-token",
            approval_id,
            verb,
            json!({"remember": remember}),
        )
        .await;
        assert_eq!(status, 400, "{verb} {remember}: {body}");
    }
    // Approved from the CLI, bound to the input and remembered for the session.
    let digest = approval(&airlock, approval_id).await["input_sha256"]
        .as_str()
        .expect("digest")
        .to_owned();
    let approve = std::process::Command::new(AIRLOCK)
        .args([
            "approvals",
            "approve",
            approval_id,
            "--input-sha256",
            &digest,
            "--remember",
            "session",
        ])
        .env("AIRLOCK_URL", &airlock.url)
        .env("AIRLOCK_TOKEN", "bob-token")
        .output()
        .expect("run the CLI");
    assert!(
        approve.status.success(),
        "{}",
        String::from_utf8_lossy(&approve.stderr)
    );
    assert_eq!(
        call_detail(&airlock, first_call, 30_000).await["status"],
        "ok"
    );
    std::fs::remove_file(ws.join("r.txt")).expect("written once");

    // The identical call in the same session runs at once, audited as covered.
    let again = call(&airlock, "r1", input.clone()).await;
    assert_eq!(
        again["status"],
        "ok",
        "{again} {}",
        call_detail(&airlock, again["call_id"].as_str().unwrap_or_default(), 0).await
    );
    assert!(
        again.get("approval_id").is_none_or(Value::is_null),
        "{again}"
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("r.txt")).expect("written again"),
        "same"
    );
    let events = audit_of(&airlock, again["call_id"].as_str().expect("id")).await;
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["kind"].as_str().expect("kind"))
        .collect();
    assert!(!kinds.contains(&"pending_approval"), "{kinds:?}");
    let covered = events
        .iter()
        .find(|e| e["kind"] == "approval_remembered")
        .unwrap_or_else(|| panic!("no approval_remembered: {kinds:?}"));
    assert_eq!(covered["data"]["approval_id"], approval_id, "{covered}");
    assert_eq!(
        covered["data"]["input_sha256"],
        digest.as_str(),
        "{covered}"
    );
    let approved = audit_of(&airlock, first_call)
        .await
        .into_iter()
        .find(|e| e["kind"] == "approved")
        .expect("approved");
    assert_eq!(approved["data"]["remember"], "session", "{approved}");

    // Another input in that session, or the same input in another session: held.
    let other_input = propose(
        &airlock,
        "r1",
        "write_file",
        json!({"path": "r.txt", "content": "different"}),
    )
    .await;
    assert_eq!(other_input["status"], "pending_approval", "{other_input}");
    let other_session = propose(&airlock, "r2", "write_file", input.clone()).await;
    assert_eq!(
        other_session["status"], "pending_approval",
        "{other_session}"
    );

    // Once the approval has expired, the same call in the same session is held again.
    let expiry = Duration::from_secs(10) + Duration::from_millis(500);
    if let Some(left) = expiry.checked_sub(asked_at.elapsed()) {
        tokio::time::sleep(left).await;
    }
    let after = propose(&airlock, "r1", "write_file", input).await;
    assert_eq!(after["status"], "pending_approval", "{after}");
}

#[tokio::test]
async fn a_remembered_approval_ends_with_its_session() {
    // The session ends 30 s after its first call; approvals would last an hour.
    let airlock = Airlock::start_with(&principals(
        "[approvals]\ntools = [\"write_file\"]\n[budgets]\nsession_wall_time_seconds = 30\n",
    ))
    .await;
    let held = propose(
        &airlock,
        "e1",
        "write_file",
        json!({"path": "e.txt", "content": "x"}),
    )
    .await;
    let approval_id = held["approval_id"].as_str().expect("approval id");
    let (status, decided) = decide(
        &airlock,
        "bob-token",
        approval_id,
        "approve",
        json!({"remember": "session"}),
    )
    .await;
    assert_eq!(status, 200, "{decided}");
    let call_id = held["call_id"].as_str().expect("call id");
    assert_eq!(call_detail(&airlock, call_id, 30_000).await["status"], "ok");
    let approved = audit_of(&airlock, call_id)
        .await
        .into_iter()
        .find(|e| e["kind"] == "approved")
        .expect("approved");
    let until = approved["data"]["remembered_until"]
        .as_str()
        .expect("remembered_until")
        .to_owned();
    let expires = decided["expires_at"].as_str().expect("expires_at");
    // Both are RFC 3339 in UTC with the same precision: they sort as text.
    assert!(
        until.as_str() < expires,
        "the session's end ({until}) comes before the approval's expiry ({expires})"
    );
    assert!(
        until.as_str() > decided["created_at"].as_str().expect("created_at"),
        "{until}"
    );

    // A call that names no session runs in "default", which never ends: remembering its
    // approval is refused (409) and the approval is left undecided.
    let body = json!({"wait_ms": 0, "tool_uses": [{"type": "tool_use", "id": "t1",
        "name": "write_file", "input": {"path": "d.txt", "content": "x"}}]});
    let (status, body, _) = send(
        &airlock,
        "alice-token",
        reqwest::Method::POST,
        "/v1/tool_calls",
        Some(body),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let unnamed = body["calls"][0]["approval_id"]
        .as_str()
        .expect("approval id");
    let (status, refused) = decide(
        &airlock,
        "bob-token",
        unnamed,
        "approve",
        json!({"remember": "session"}),
    )
    .await;
    assert_eq!(status, 409, "{refused}");
    assert_eq!(refused["error"]["code"], "cannot_remember", "{refused}");
    assert!(
        refused.to_string().contains("named no session"),
        "{refused}"
    );
    let listed = approval(&airlock, unnamed).await;
    assert_eq!(listed["status"], "pending", "{listed}");
}
