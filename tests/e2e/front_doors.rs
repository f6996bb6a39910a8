//! The front doors share one authentication layer and one call service: a caller gets
//! the same answer about its token, and the same rate limit, whichever door it uses.

use airlock_proto::v1 as pb;
use serde_json::{Value, json};
use tonic::Request;

use crate::support::Airlock;

fn with_authorization<T>(message: T, value: Option<&str>) -> Request<T> {
    let mut request = Request::new(message);
    if let Some(value) = value {
        request
            .metadata_mut()
            .insert("authorization", value.parse().expect("metadata"));
    }
    request
}

fn mcp_call(id: u64, tool: &str, arguments: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": {"name": tool, "arguments": arguments}})
}

async fn post_mcp(
    airlock: &Airlock,
    path: &str,
    authorization: Option<&str>,
    body: &Value,
) -> reqwest::Response {
    let mut request = airlock
        .http()
        .post(format!("{}{path}", airlock.url))
        .header("Accept", "application/json, text/event-stream")
        .header("MCP-Protocol-Version", "2025-06-18")
        .json(body);
    if let Some(value) = authorization {
        request = request.header("Authorization", value);
    }
    request.send().await.expect("send")
}

/// The JSON-RPC result of an SSE-framed `/mcp` answer.
fn mcp_result(text: &str, id: u64) -> Value {
    text.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .find(|m| m["id"] == id)
        .map(|m| m["result"].clone())
        .unwrap_or_else(|| panic!("no answer to request {id} in {text}"))
}

/// Missing, foreign-scheme, wrong, and repeated credentials, on `/v1`, `/mcp` and gRPC
/// (unary and streaming): refused at every door with the same words, before any
/// handler runs; probes stay open.
#[tokio::test]
async fn every_door_refuses_a_bad_token_with_the_same_words() {
    let airlock = Airlock::start().await;
    let mut client = airlock.grpc_client().await;
    let wrong = "Bearer alk_not_a_token".to_owned();
    let cases: [(&str, Option<&str>); 3] = [
        ("missing", None),
        ("basic", Some("Basic dXNlcjpwYXNz")),
        ("wrong", Some(&wrong)),
    ];
    for (what, authorization) in cases {
        let mut request = airlock.http().get(format!("{}/v1/tools", airlock.url));
        if let Some(value) = authorization {
            request = request.header("Authorization", value);
        }
        let response = request.send().await.expect("send");
        assert_eq!(response.status(), 401, "{what}");
        let http: Value = response.json().await.expect("JSON error");
        let words = http["error"]["message"]
            .as_str()
            .expect("message")
            .to_owned();
        assert!(
            words.contains("AIRLOCK_TOKEN"),
            "{what}: the fix is named: {words}"
        );

        let response = post_mcp(
            &airlock,
            "/mcp",
            authorization,
            &json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
        )
        .await;
        assert_eq!(response.status(), 401, "{what} (mcp)");
        let mcp: Value = response.json().await.expect("JSON error");
        assert_eq!(mcp["error"]["message"], words.as_str(), "{what} (mcp)");

        let unary = client
            .list_tools(with_authorization(
                pb::OrchestratorListToolsRequest {},
                authorization,
            ))
            .await
            .expect_err("refused");
        assert_eq!(unary.code(), tonic::Code::Unauthenticated, "{what} (grpc)");
        assert_eq!(unary.message(), words, "{what} (grpc)");

        let stream = client
            .call_tool_stream(with_authorization(
                pb::CallToolStreamRequest {
                    session_id: "doors".into(),
                    tool_use: Some(pb::ToolUse {
                        id: "t1".into(),
                        name: "execute_shell".into(),
                        input_json: r#"{"command": "touch /workspace/ran"}"#.into(),
                    }),
                },
                authorization,
            ))
            .await
            .expect_err("refused");
        assert_eq!(
            stream.code(),
            tonic::Code::Unauthenticated,
            "{what} (stream)"
        );
    }
    // A repeated header is a credential that cannot be right, even if one copy is.
    let response = airlock
        .http()
        .get(format!("{}/v1/tools", airlock.url))
        .header("Authorization", format!("Bearer {}", airlock.token))
        .header("Authorization", format!("Bearer {}", airlock.token))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 401, "repeated header");
    // Nothing ran, and the probes need no token.
    assert!(!airlock.workspace("doors").join("ran").exists());
    let (status, _) = airlock.get("/healthz").await;
    assert_eq!(status, 200);
    let good = format!("Bearer {}", airlock.token);
    client
        .list_tools(with_authorization(
            pb::OrchestratorListToolsRequest {},
            Some(&good),
        ))
        .await
        .expect("a valid token is served");
}

/// `[budgets] rate_per_minute` is one bucket per principal, taken by every door the
/// same way (one token per call): calls on `/v1`, on the SSE stream and on gRPC's
/// stream use it up, and then every door refuses in its own wire format, running
/// nothing.
#[tokio::test]
async fn one_rate_limit_across_every_door() {
    let airlock = Airlock::start_with("[budgets]\nrate_per_minute = 3\n").await;
    let mut client = airlock.grpc_client().await;
    let bearer = format!("Bearer {}", airlock.token);
    let touch = |name: &str| json!({"command": format!("touch /workspace/{name}")});

    // Three calls, one per door kind.
    let (status, body) = airlock
        .post(
            "/v1/tool_calls",
            &json!({"session_id": "rate", "tool_uses": [{"type": "tool_use", "id": "a", "name": "execute_shell", "input": touch("a")}]}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let sse = airlock
        .request(reqwest::Method::POST, "/v1/tool_calls?stream=true")
        .json(&json!({"session_id": "rate", "tool_uses": [{"type": "tool_use", "id": "b", "name": "execute_shell", "input": touch("b")}]}))
        .send()
        .await
        .expect("send");
    assert_eq!(sse.status(), 200);
    let events = sse.text().await.expect("events");
    assert!(events.contains("call.completed"), "{events}");
    let mut stream = client
        .call_tool_stream(with_authorization(
            pb::CallToolStreamRequest {
                session_id: "rate".into(),
                tool_use: Some(pb::ToolUse {
                    id: "c".into(),
                    name: "execute_shell".into(),
                    input_json: touch("c").to_string(),
                }),
            },
            Some(&bearer),
        ))
        .await
        .expect("third call admitted")
        .into_inner();
    while stream.message().await.expect("stream").is_some() {}
    for name in ["a", "b", "c"] {
        assert!(airlock.workspace("rate").join(name).exists(), "{name} ran");
    }

    // The bucket is empty: every door refuses the fourth, and nothing runs.
    let (status, body) = airlock
        .post(
            "/v1/tool_calls",
            &json!({"session_id": "rate", "tool_uses": [{"type": "tool_use", "id": "d", "name": "execute_shell", "input": touch("d")}]}),
        )
        .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "rate_limited", "{body}");
    let refused = client
        .call_tools(with_authorization(
            pb::CallToolsRequest {
                session_id: "rate".into(),
                tool_uses: vec![pb::ToolUse {
                    id: "e".into(),
                    name: "execute_shell".into(),
                    input_json: touch("e").to_string(),
                }],
                ..Default::default()
            },
            Some(&bearer),
        ))
        .await
        .expect_err("rate limited");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    let refused = client
        .call_tool_stream(with_authorization(
            pb::CallToolStreamRequest {
                session_id: "rate".into(),
                tool_use: Some(pb::ToolUse {
                    id: "f".into(),
                    name: "execute_shell".into(),
                    input_json: touch("f").to_string(),
                }),
            },
            Some(&bearer),
        ))
        .await
        .expect_err("the stream is rate limited too");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    let response = post_mcp(
        &airlock,
        "/mcp?session_id=rate",
        Some(&bearer),
        &mcp_call(9, "execute_shell", touch("g")),
    )
    .await;
    assert_eq!(response.status(), 200);
    let result = mcp_result(&response.text().await.expect("body"), 9);
    assert_eq!(result["isError"], true, "{result}");
    assert!(result.to_string().contains("rate limit"), "{result}");
    for name in ["d", "e", "f", "g"] {
        assert!(
            !airlock.workspace("rate").join(name).exists(),
            "{name} did not run"
        );
    }
}
