//! The HTTP front door: shapes, authentication, and bad input of every kind.

use serde_json::{Value, json};

use crate::support::Airlock;

const FS_TOOLS: &[&str] = &[
    "read_file",
    "write_file",
    "edit_file",
    "list_directory",
    "search_files",
    "get_file_info",
    "create_directory",
    "move_path",
    "delete_path",
];

#[tokio::test]
async fn catalog_lists_every_fs_tool_in_three_shapes() {
    let airlock = Airlock::start().await;
    let (status, body) = airlock.get("/v1/tools").await;
    assert_eq!(status, 200);
    let tools = body["tools"].as_array().expect("tools array");
    let names: Vec<&str> = tools
        .iter()
        .map(|t| t["name"].as_str().expect("name"))
        .collect();
    for tool in FS_TOOLS {
        assert!(names.contains(tool), "{tool} missing from {names:?}");
    }
    let name_rule = regex_lite_name_rule();
    for tool in tools {
        let name = tool["name"].as_str().expect("name");
        assert!(name_rule(name), "{name} breaks ^[a-zA-Z0-9_-]{{1,64}}$");
        assert!(tool["description"].as_str().is_some_and(|d| !d.is_empty()));
        assert_eq!(tool["input_schema"]["type"], "object", "{name}");
        assert_eq!(
            tool.as_object().expect("object").len(),
            3,
            "anthropic shape only: {tool}"
        );
    }

    let (_, openai) = airlock.get("/v1/tools?format=openai").await;
    assert_eq!(openai["tools"][0]["type"], "function");
    assert!(openai["tools"][0]["function"]["parameters"].is_object());

    let (_, mcp) = airlock.get("/v1/tools?format=mcp").await;
    let read = mcp["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .find(|t| t["name"] == "read_file")
        .expect("read_file");
    assert_eq!(read["annotations"]["readOnlyHint"], true);
    let delete = mcp["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .find(|t| t["name"] == "delete_path")
        .expect("delete_path");
    assert_eq!(delete["annotations"]["destructiveHint"], true);
    assert!(read["inputSchema"].is_object());

    let (status, body) = airlock.get("/v1/tools?format=xml").await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "invalid_request");
}

fn regex_lite_name_rule() -> impl Fn(&str) -> bool {
    |name: &str| {
        !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    }
}

#[tokio::test]
async fn authentication_is_required_everywhere_but_health() {
    let airlock = Airlock::start().await;
    let client = airlock.http();
    for (method, path) in [
        ("GET", "/v1/tools"),
        ("POST", "/v1/tool_calls"),
        ("GET", "/v1/calls/call_x"),
        ("POST", "/v1/calls/call_x/cancel"),
        ("GET", "/openapi.json"),
    ] {
        let method: reqwest::Method = method.parse().expect("method");
        let url = format!("{}{path}", airlock.url);
        let none = client
            .request(method.clone(), &url)
            .send()
            .await
            .expect("send");
        assert_eq!(none.status(), 401, "{path} without a token");
        let challenge = none.headers()["www-authenticate"].to_str().expect("ASCII");
        assert!(
            challenge.starts_with("Bearer realm=\"airlock\""),
            "{challenge}"
        );
        let body: Value = none.json().await.expect("json");
        assert_eq!(body["error"]["code"], "unauthorized");
        let wrong = client
            .request(method.clone(), &url)
            .bearer_auth("alk_wrong")
            .send()
            .await
            .expect("send");
        assert_eq!(wrong.status(), 401, "{path} with a wrong token");
        let basic = client
            .request(method, &url)
            .header("authorization", format!("Basic {}", airlock.token))
            .send()
            .await
            .expect("send");
        assert_eq!(
            basic.status(),
            401,
            "{path} with the token under another scheme"
        );
    }
    for path in ["/healthz", "/readyz"] {
        let r = client
            .get(format!("{}{path}", airlock.url))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 200, "{path}");
    }
    // The token file is readable by its owner only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(airlock.data_dir().join("token"))
        .expect("token")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[tokio::test]
async fn bad_input_gets_a_json_4xx_never_a_500() {
    let airlock = Airlock::start().await;
    let use_ =
        |input: Value| json!({"type": "tool_use", "id": "a", "name": "read_file", "input": input});
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("not json", b"{nope".to_vec(), 400),
        ("empty body", Vec::new(), 400),
        ("array body", b"[]".to_vec(), 400),
        ("no tool_uses", b"{}".to_vec(), 400),
        ("tool_uses not array", br#"{"tool_uses": 3}"#.to_vec(), 400),
        ("empty tool_uses", br#"{"tool_uses": []}"#.to_vec(), 400),
        (
            "input not object",
            json!({"tool_uses": [use_(json!("x"))]})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            "missing id",
            br#"{"tool_uses": [{"name": "read_file", "input": {}}]}"#.to_vec(),
            400,
        ),
        (
            "duplicate ids",
            json!({"tool_uses": [use_(json!({})), use_(json!({}))]})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            "bad session",
            json!({"session_id": "../../etc", "tool_uses": [use_(json!({}))]})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            "bad wait_ms",
            json!({"wait_ms": "soon", "tool_uses": [use_(json!({}))]})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            "deep nesting",
            format!(
                "{{\"tool_uses\": {}{}}}",
                "[".repeat(100_000),
                "]".repeat(100_000)
            )
            .into_bytes(),
            400,
        ),
        (
            "invalid utf-8",
            b"{\"tool_uses\": \"\xff\xfe\"}".to_vec(),
            400,
        ),
        ("oversized", vec![b' '; 11 * 1024 * 1024], 413),
    ];
    for (what, body, expected) in cases {
        let response = airlock
            .request(reqwest::Method::POST, "/v1/tool_calls")
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{what}: connection failed: {e}"));
        let status = response.status().as_u16();
        let body: Value = response
            .json()
            .await
            .unwrap_or_else(|e| panic!("{what}: body not JSON: {e}"));
        assert_eq!(status, expected, "{what}: {body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{what}: {body}"
        );
    }
    // Unknown endpoints and wrong methods are JSON too.
    let (status, body) = airlock.get("/v1/nope").await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("not_found"))
    );
    let r = airlock
        .request(reqwest::Method::DELETE, "/v1/tools")
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 405);
    let (status, _) = airlock.get("/v1/calls/call_unknown").await;
    assert_eq!(status, 404);
    let (status, _) = airlock.get("/v1/calls/call_unknown?wait_ms=abc").await;
    assert_eq!(status, 400);
    // The service is still healthy after all of that.
    let (is_error, _, _) = airlock.call("list_directory", json!({"path": "."})).await;
    assert!(!is_error);
}

#[tokio::test]
async fn schema_violations_and_unknown_tools_are_error_results() {
    let airlock = Airlock::start().await;
    let (is_error, text, call) = airlock.call("read_file", json!({"path": 42})).await;
    assert!(is_error);
    assert_eq!(call["status"], "error");
    assert!(
        text.contains("/path") && text.contains("type"),
        "names field and rule: {text}"
    );

    let (is_error, text, _) = airlock.call("read_file", json!({})).await;
    assert!(is_error);
    assert!(text.contains("path") && text.contains("required"), "{text}");

    let (is_error, text, _) = airlock
        .call(
            "write_file",
            json!({"path": "a", "content": "x", "mode": 7}),
        )
        .await;
    assert!(is_error);
    assert!(
        text.contains("additionalProperties") || text.contains("mode"),
        "{text}"
    );

    let (is_error, text, call) = airlock.call("launch_missiles", json!({})).await;
    assert!(is_error);
    assert_eq!(call["status"], "error");
    assert!(text.contains("unknown tool"), "{text}");
    // Nothing was written by the rejected write.
    assert!(!airlock.workspace("default").join("a").exists());
}

#[tokio::test]
async fn parallel_tool_uses_come_back_in_request_order() {
    let airlock = Airlock::start().await;
    let uses: Vec<Value> = (0..8)
        .map(|i| {
            json!({"type": "tool_use", "id": format!("w{i}"), "name": "write_file",
                        "input": {"path": format!("f{i}.txt"), "content": format!("file {i}")}})
        })
        .collect();
    let (status, body) = airlock
        .post("/v1/tool_calls", &json!({"tool_uses": uses}))
        .await;
    assert_eq!(status, 200);
    let reads: Vec<Value> = (0..8)
        .rev()
        .map(|i| json!({"type": "tool_use", "id": format!("r{i}"), "name": "read_file", "input": {"path": format!("f{i}.txt")}}))
        .collect();
    let (status, body2) = airlock
        .post("/v1/tool_calls", &json!({"tool_uses": reads}))
        .await;
    assert_eq!(status, 200);
    for (j, i) in (0..8).rev().enumerate() {
        assert_eq!(body2["tool_results"][j]["tool_use_id"], format!("r{i}"));
        assert_eq!(body2["calls"][j]["tool_use_id"], format!("r{i}"));
        assert_eq!(
            body2["tool_results"][j]["content"][0]["text"],
            format!("file {i}")
        );
    }
    assert_eq!(body["calls"].as_array().expect("calls").len(), 8);

    // A finished call can be fetched by id, by its owner.
    let call_id = body2["calls"][0]["call_id"].as_str().expect("call_id");
    let (status, detail) = airlock.get(&format!("/v1/calls/{call_id}")).await;
    assert_eq!(status, 200);
    assert_eq!(detail["status"], "ok");
    assert_eq!(detail["tool"], "read_file");
    assert_eq!(detail["tool_result"]["content"][0]["text"], "file 7");
    assert!(detail["duration_ms"].is_u64());
}

#[tokio::test]
async fn openai_shapes_are_answered_in_kind() {
    let airlock = Airlock::start().await;
    std::fs::create_dir_all(airlock.workspace("default")).expect("workspace");
    std::fs::write(airlock.workspace("default").join("n.txt"), "hi").expect("write");
    let chat = json!({"tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"n.txt\"}"}},
        {"id": "c2", "type": "function", "function": {"name": "read_file", "arguments": "{not json"}},
    ]});
    let (status, body) = airlock.post("/v1/tool_calls", &chat).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["messages"][0],
        json!({"role": "tool", "tool_call_id": "c1", "content": "hi"})
    );
    assert_eq!(body["messages"][1]["tool_call_id"], "c2");
    assert!(
        body["messages"][1]["content"]
            .as_str()
            .expect("content")
            .contains("not valid JSON")
    );
    assert_eq!(body["calls"][1]["status"], "error");

    let responses = json!({"function_calls": [
        {"type": "function_call", "call_id": "fc1", "name": "read_file", "arguments": "{\"path\": \"n.txt\"}"},
    ]});
    let (status, body) = airlock.post("/v1/tool_calls", &responses).await;
    assert_eq!(status, 200);
    assert_eq!(
        body["outputs"][0],
        json!({"type": "function_call_output", "call_id": "fc1", "output": "hi"})
    );
}

#[tokio::test]
async fn openapi_document_describes_v1() {
    let airlock = Airlock::start().await;
    let (status, doc) = airlock.get("/openapi.json").await;
    assert_eq!(status, 200);
    assert_eq!(doc["openapi"], "3.1.0");
    for path in [
        "/v1/tools",
        "/v1/tool_calls",
        "/v1/calls/{call_id}",
        "/v1/calls/{call_id}/cancel",
    ] {
        assert!(doc["paths"][path].is_object(), "{path} missing");
    }
    // Every $ref resolves.
    let text = doc.to_string();
    for reference in text.split("\"$ref\":\"").skip(1) {
        let target = reference.split('"').next().expect("ref");
        let pointer = target.trim_start_matches('#');
        assert!(doc.pointer(pointer).is_some(), "dangling $ref {target}");
    }
}
