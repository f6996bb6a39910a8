//! Bound approvals (DESIGN §14): an approval names the digest of the input it holds, a
//! decision quoting another digest is refused, and the audit records the digest and
//! the policy the decision was taken under.

use serde_json::{Value, json};

use crate::support::{Airlock, send_as as send, token_digest};

/// An agent, two approvers and an admin with known tokens; `extra` is appended.
fn principals(extra: &str) -> String {
    format!(
        r#"
[[principals]]
name = "alice"
token_sha256 = "{}"
roles = ["agent"]
[[principals]]
name = "bob"
token_sha256 = "{}"
roles = ["approver"]
[[principals]]
name = "dave"
token_sha256 = "{}"
roles = ["approver"]
[[principals]]
name = "root"
token_sha256 = "{}"
roles = ["admin"]
{extra}"#,
        token_digest("alice-token"),
        token_digest("bob-token"),
        token_digest("dave-token"),
        token_digest("root-token"),
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
    let (status, list, _) = send(
        airlock,
        "bob-token",
        reqwest::Method::GET,
        "/v1/approvals?limit=100",
        None,
    )
    .await;
    assert_eq!(status, 200, "{list}");
    list["approvals"]
        .as_array()
        .expect("approvals")
        .iter()
        .find(|a| a["approval_id"] == approval_id)
        .cloned()
        .expect("the approval is listed")
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
