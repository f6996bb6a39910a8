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
