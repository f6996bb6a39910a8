//! The agent loop against a scripted model provider: a loopback HTTP server started by
//! the test that replays canned Anthropic and OpenAI responses (plain JSON and streamed)
//! and records every request body, so the tests can check what the loop sent back —
//! one `tool_result` per `tool_use`, in the next message, with the right ids, in order.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::support::{AIRLOCK, Airlock};

/// A key nobody would write by accident: it must not show up anywhere.
const KEY: &str = "sk-test-airlock-9f8e7d6c5b4a-DO-NOT-LEAK";
const KEY_VAR: &str = "AIRLOCK_E2E_MODEL_KEY";

/// One canned answer.
enum Reply {
    /// 200 `application/json`.
    Json(Value),
    /// 200 `text/event-stream`, written in small pieces so events split across reads.
    Sse(String),
    /// An error status with a JSON body.
    Status(u16, Value),
}

/// One request the provider received.
#[derive(Debug, Clone)]
struct Recorded {
    path: String,
    headers: Vec<(String, String)>,
    body: Value,
    /// When the request arrived (for figures the test prints, never for assertions).
    at: Instant,
}

impl Recorded {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

struct ScriptedProvider {
    port: u16,
    requests: Arc<Mutex<Vec<Recorded>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedProvider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ScriptedProvider {
    async fn start(replies: Vec<Reply>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let replies = Arc::new(Mutex::new(std::collections::VecDeque::from(replies)));
        let recorded = requests.clone();
        let task = tokio::spawn(async move {
            // Bounded: a script never needs more than a few dozen connections.
            for _ in 0..64 {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let recorded = recorded.clone();
                let replies = replies.clone();
                tokio::spawn(async move {
                    let _ = serve_one(stream, recorded, replies).await;
                });
            }
        });
        Self {
            port,
            requests,
            task,
        }
    }

    /// Base URL for `[agent] base_url` (Anthropic style, no `/v1`).
    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().expect("lock").clone()
    }
}

async fn serve_one(
    mut stream: tokio::net::TcpStream,
    recorded: Arc<Mutex<Vec<Recorded>>>,
    replies: Arc<Mutex<std::collections::VecDeque<Reply>>>,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let head_end = loop {
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        assert!(buf.len() < 64 * 1024, "request head too large");
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let path = request_line
        .split(' ')
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let length: usize = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .expect("the loop sends a content-length");
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < length {
        let mut chunk = vec![0u8; 64 * 1024];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
        // The loop sends at most 32 MiB (its MAX_REQUEST_BYTES).
        assert!(body.len() <= 32 * 1024 * 1024, "request body too large");
    }
    let body: Value = serde_json::from_slice(&body).expect("the loop sends JSON");
    recorded.lock().expect("lock").push(Recorded {
        path,
        headers,
        body,
        at: Instant::now(),
    });
    let reply = replies.lock().expect("lock").pop_front();
    let reply = reply.unwrap_or_else(|| {
        Reply::Status(
            500,
            json!({"type": "error", "error": {"type": "api_error", "message": "the script has no more replies"}}),
        )
    });
    match reply {
        Reply::Json(v) => write_plain(&mut stream, 200, &v).await,
        Reply::Status(code, v) => write_plain(&mut stream, code, &v).await,
        Reply::Sse(text) => {
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n")
                .await?;
            for piece in text.as_bytes().chunks(23) {
                stream.write_all(piece).await?;
                stream.flush().await?;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            stream.shutdown().await
        }
    }
}

async fn write_plain(
    stream: &mut tokio::net::TcpStream,
    code: u16,
    body: &Value,
) -> std::io::Result<()> {
    let body = body.to_string();
    let head = format!(
        "HTTP/1.1 {code} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}

// ---- canned Anthropic responses ----

/// A streamed message: optional text, then tool_use blocks whose input arrives in the
/// given `input_json_delta` fragments (split wherever the test likes).
fn anthropic_stream(text: &str, tools: &[(&str, &str, &[&str])], stop_reason: &str) -> Reply {
    let mut events = vec![
        json!({"type": "message_start", "message": {"id": "msg_x", "type": "message", "role": "assistant", "content": [], "model": "claude-test", "stop_reason": null, "usage": {"input_tokens": 10, "output_tokens": 1}}}),
        json!({"type": "ping"}),
    ];
    let mut index = 0;
    if !text.is_empty() {
        events.push(json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}));
        let (a, b) = text.split_at(text.len() / 2);
        for piece in [a, b] {
            events.push(json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": piece}}));
        }
        events.push(json!({"type": "content_block_stop", "index": index}));
        index += 1;
    }
    for (id, name, fragments) in tools {
        events.push(json!({"type": "content_block_start", "index": index, "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}));
        for fragment in *fragments {
            events.push(json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": fragment}}));
        }
        events.push(json!({"type": "content_block_stop", "index": index}));
        index += 1;
    }
    events.push(json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null}, "usage": {"output_tokens": 20}}));
    events.push(json!({"type": "message_stop"}));
    Reply::Sse(
        events
            .iter()
            .map(|e| {
                format!(
                    "event: {}\ndata: {e}\n\n",
                    e["type"].as_str().expect("type")
                )
            })
            .collect(),
    )
}

fn anthropic_message(content: Value, stop_reason: &str) -> Reply {
    Reply::Json(json!({
        "id": "msg_y", "type": "message", "role": "assistant", "model": "claude-test",
        "content": content, "stop_reason": stop_reason, "stop_sequence": null,
        "usage": {"input_tokens": 5, "output_tokens": 7},
    }))
}

// ---- canned OpenAI responses ----

fn openai_stream(chunks: &[Value]) -> Reply {
    let mut text: String = chunks
        .iter()
        .map(|c| format!("data: {}\n\n", json!({"id": "chatcmpl-x", "object": "chat.completion.chunk", "model": "local", "choices": [c]})))
        .collect();
    text.push_str(&format!(
        "data: {}\n\n",
        json!({"id": "chatcmpl-x", "object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}})
    ));
    text.push_str("data: [DONE]\n\n");
    Reply::Sse(text)
}

fn openai_message(content: Option<&str>, tool_calls: Value, finish: &str) -> Reply {
    let mut message = json!({"role": "assistant", "content": content});
    if tool_calls.as_array().is_some_and(|a| !a.is_empty()) {
        message["tool_calls"] = tool_calls;
    }
    Reply::Json(json!({
        "id": "chatcmpl-y", "object": "chat.completion", "model": "local",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
    }))
}

// ---- driving runs ----

/// Parses a whole SSE body into (kind, data) pairs.
fn parse_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter_map(|frame| {
            let mut kind = None;
            let mut data = None;
            for line in frame.lines() {
                if let Some(k) = line.strip_prefix("event: ") {
                    kind = Some(k.to_owned());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = Some(serde_json::from_str::<Value>(d).expect("event data is JSON"));
                }
            }
            Some((kind?, data?))
        })
        .collect()
}

/// POST /v1/agent/runs; returns the status and the raw body.
async fn run_raw(airlock: &Airlock, body: Value) -> (u16, String, Option<String>) {
    let response = airlock
        .request(reqwest::Method::POST, "/v1/agent/runs")
        .json(&body)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("send");
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    (status, response.text().await.expect("body"), content_type)
}

/// A run that must start; returns its events and the raw stream.
async fn run(airlock: &Airlock, body: Value) -> (Vec<(String, Value)>, String) {
    let (status, text, content_type) = run_raw(airlock, body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(content_type.as_deref(), Some("text/event-stream"));
    let events = parse_events(&text);
    assert_eq!(
        events.first().map(|e| e.0.as_str()),
        Some("run.started"),
        "{text}"
    );
    let last = events.last().map(|e| e.0.as_str());
    assert!(
        matches!(last, Some("run.completed" | "run.failed")),
        "the stream ends with the run's outcome: {text}"
    );
    (events, text)
}

fn of_kind<'a>(events: &'a [(String, Value)], kind: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|(k, _)| k == kind)
        .map(|(_, d)| d)
        .collect()
}

fn streamed_text(events: &[(String, Value)]) -> String {
    of_kind(events, "model.text")
        .iter()
        .map(|d| d["text"].as_str().expect("text"))
        .collect()
}

/// Checks the invariant: the message after an assistant turn answers each of its
/// tool_use blocks exactly once, in order.
fn assert_one_result_per_use(assistant: &Value, next_user: &Value) {
    assert_eq!(assistant["role"], "assistant");
    assert_eq!(next_user["role"], "user");
    let uses: Vec<&str> = assistant["content"]
        .as_array()
        .expect("content")
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .map(|b| b["id"].as_str().expect("id"))
        .collect();
    let results: Vec<&str> = next_user["content"]
        .as_array()
        .expect("content")
        .iter()
        .map(|b| {
            assert_eq!(b["type"], "tool_result", "{b}");
            assert!(b["is_error"].is_boolean(), "{b}");
            let content = b["content"].as_array().expect("content blocks");
            assert!(!content.is_empty());
            for c in content {
                assert_eq!(c["type"], "text");
                assert!(!c["text"].as_str().expect("text").is_empty());
            }
            b["tool_use_id"].as_str().expect("tool_use_id")
        })
        .collect();
    assert_eq!(uses, results, "one tool_result per tool_use, in order");
}

fn agent_config(provider: &ScriptedProvider, extra: &str) -> String {
    format!(
        "[agent]\nprovider = \"anthropic\"\nmodel = \"claude-test\"\nbase_url = \"{}\"\napi_key_env = \"{KEY_VAR}\"\n{extra}\n",
        provider.url()
    )
}

async fn audit_text(airlock: &Airlock) -> String {
    let (status, body) = airlock.get("/v1/audit?limit=10000").await;
    assert_eq!(status, 200, "{body}");
    body.to_string()
}

#[tokio::test]
async fn anthropic_streaming_round_trip_answers_every_tool_use_in_order() {
    let provider = ScriptedProvider::start(vec![
        anthropic_stream(
            "I'll look at the files.",
            &[
                // Fragments split mid-key, mid-string and mid-literal.
                (
                    "toolu_A",
                    "read_file",
                    &["{\"pa", "th\": \"not", "es.t", "xt\"}"],
                ),
                (
                    "toolu_B",
                    "read_file",
                    &["", "{\"path\"", ": \"missing.txt\"}"],
                ),
                (
                    "toolu_C",
                    "list_directory",
                    &["{\"path\": \".\", \"recursive\": tr", "ue}"],
                ),
            ],
            "tool_use",
        ),
        anthropic_stream("Still working.", &[], "pause_turn"),
        anthropic_stream("notes.txt says hello.", &[], "end_turn"),
    ])
    .await;
    let airlock = Airlock::start_with_env(
        &agent_config(&provider, "system = \"You are a test.\""),
        &[(KEY_VAR, KEY)],
    )
    .await;
    let (is_error, _, _) = airlock
        .call_in(
            "agent1",
            "write_file",
            json!({"path": "notes.txt", "content": "hello from the workspace"}),
        )
        .await;
    assert!(!is_error);

    let (events, raw) = run(
        &airlock,
        json!({"prompt": "What does notes.txt say?", "session_id": "agent1"}),
    )
    .await;

    // Events.
    let started = of_kind(&events, "run.started")[0];
    assert_eq!(started["session_id"], "agent1");
    assert_eq!(started["provider"], "anthropic");
    assert_eq!(started["model"], "claude-test");
    let text = streamed_text(&events);
    assert!(text.contains("I'll look at the files."), "{text}");
    assert!(text.contains("notes.txt says hello."), "{text}");
    let calls = of_kind(&events, "tool.call");
    assert_eq!(calls.len(), 3, "{raw}");
    assert_eq!(calls[0]["id"], "toolu_A");
    assert_eq!(calls[0]["input"], json!({"path": "notes.txt"}));
    assert_eq!(calls[2]["input"], json!({"path": ".", "recursive": true}));
    let results = of_kind(&events, "tool.result");
    assert_eq!(results.len(), 3, "{raw}");
    let by_id = |id: &str| {
        *results
            .iter()
            .find(|r| r["id"] == id)
            .expect("a result for every call")
    };
    assert_eq!(by_id("toolu_A")["is_error"], false);
    assert_eq!(by_id("toolu_A")["status"], "ok");
    assert!(
        by_id("toolu_A")["text"]
            .as_str()
            .unwrap()
            .contains("hello from the workspace")
    );
    assert!(
        by_id("toolu_A")["call_id"]
            .as_str()
            .unwrap()
            .starts_with("call_")
    );
    assert_eq!(by_id("toolu_B")["is_error"], true);
    assert_eq!(by_id("toolu_C")["is_error"], false);
    assert!(
        by_id("toolu_C")["text"]
            .as_str()
            .unwrap()
            .contains("notes.txt")
    );
    let done = of_kind(&events, "run.completed")[0];
    assert_eq!(done["stop_reason"], "end_turn");
    assert_eq!(done["turns"], 3);
    assert_eq!(done["tool_calls"], 3);
    assert_eq!(done["truncated"], false);
    assert_eq!(done["usage"]["input_tokens"], 30);
    assert_eq!(done["usage"]["output_tokens"], 60);

    // What the loop sent.
    let requests = provider.requests();
    assert_eq!(requests.len(), 3);
    for r in &requests {
        assert_eq!(r.path, "/v1/messages");
        assert_eq!(r.header("x-api-key"), Some(KEY));
        assert_eq!(r.header("anthropic-version"), Some("2023-06-01"));
        assert_eq!(r.body["model"], "claude-test");
        assert_eq!(r.body["stream"], true);
        assert_eq!(r.body["max_tokens"], 4096);
        assert_eq!(r.body["system"], "You are a test.");
        let tools = r.body["tools"].as_array().expect("tools");
        let read = tools
            .iter()
            .find(|t| t["name"] == "read_file")
            .expect("read_file offered");
        assert!(read["input_schema"]["properties"]["path"].is_object());
        assert!(read["description"].is_string());
    }
    let first = requests[0].body["messages"].as_array().unwrap();
    assert_eq!(
        first,
        &vec![json!({"role": "user", "content": "What does notes.txt say?"})]
    );

    let second = requests[1].body["messages"].as_array().unwrap();
    assert_eq!(second.len(), 3);
    let assistant = &second[1];
    let content = assistant["content"].as_array().unwrap();
    assert_eq!(
        content[0],
        json!({"type": "text", "text": "I'll look at the files."})
    );
    assert_eq!(
        content[1],
        json!({"type": "tool_use", "id": "toolu_A", "name": "read_file", "input": {"path": "notes.txt"}})
    );
    assert_eq!(content[2]["input"], json!({"path": "missing.txt"}));
    assert_one_result_per_use(assistant, &second[2]);
    let flags: Vec<bool> = second[2]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["is_error"].as_bool().unwrap())
        .collect();
    assert_eq!(flags, vec![false, true, false]);
    assert!(
        second[2]["content"][0]["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("hello from the workspace")
    );

    // pause_turn: the assistant content goes back as it was, with no new user message.
    let third = requests[2].body["messages"].as_array().unwrap();
    assert_eq!(third.len(), 4);
    assert_eq!(&third[..3], &second[..]);
    assert_eq!(
        third[3],
        json!({"role": "assistant", "content": [{"type": "text", "text": "Still working."}]})
    );

    // The calls went through the gate, in the run's session, and are audited.
    let audit = audit_text(&airlock).await;
    assert!(audit.contains("agent_run_started"), "{audit}");
    assert!(audit.contains("agent_run_finished"));
    let (_, session_audit) = airlock.get("/v1/audit?session_id=agent1&limit=1000").await;
    let requested = session_audit["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "requested" && e["data"]["tool_use_id"] == "toolu_A")
        .count();
    assert_eq!(requested, 1);

    // The key never leaves the orchestrator's request header.
    assert!(!raw.contains(KEY), "the key is in the event stream");
    assert!(!audit.contains(KEY), "the key is in the audit log");
    let log = airlock.log();
    assert!(
        log.contains("agent run started"),
        "the orchestrator's log is checked"
    );
    assert!(!log.contains(KEY), "the key is in the log");
    let (status, verify) = airlock.get("/v1/audit/verify").await;
    assert_eq!(status, 200);
    assert_eq!(verify["ok"], true);
}

#[tokio::test]
async fn anthropic_plain_responses_max_tokens_refusal_and_provider_errors() {
    let provider = ScriptedProvider::start(vec![
        // Run 1: one call, then a text cut off at max_tokens.
        anthropic_message(
            json!([
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_1", "name": "list_directory", "input": {"path": "."}},
            ]),
            "tool_use",
        ),
        anthropic_message(json!([{"type": "text", "text": "The directory is emp"}]), "max_tokens"),
        // Run 2: a refusal.
        anthropic_message(json!([{"type": "text", "text": "I can't help with that."}]), "refusal"),
        // Run 3: overloaded (retried), then an error that echoes the key.
        Reply::Status(
            529,
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        ),
        Reply::Status(
            401,
            json!({"type": "error", "error": {"type": "authentication_error", "message": format!("invalid x-api-key {KEY}")}}),
        ),
        // Run 4: stop_sequence.
        anthropic_message(json!([{"type": "text", "text": "END"}]), "stop_sequence"),
    ])
    .await;
    let airlock = Airlock::start_with_env(
        &agent_config(&provider, "stream = false"),
        &[(KEY_VAR, KEY)],
    )
    .await;

    let (events, _) = run(&airlock, json!({"prompt": "list", "session_id": "plain"})).await;
    let done = of_kind(&events, "run.completed")[0];
    assert_eq!(done["stop_reason"], "max_tokens");
    assert_eq!(done["truncated"], true);
    assert_eq!(done["text"], "The directory is emp");
    assert_eq!(streamed_text(&events), "Listing.The directory is emp");
    let requests = provider.requests();
    assert_eq!(requests[0].body["stream"], false);
    assert!(requests[0].body.get("system").is_none());
    let messages = requests[1].body["messages"].as_array().unwrap();
    assert_one_result_per_use(&messages[1], &messages[2]);
    assert_eq!(messages[2]["content"][0]["is_error"], false);

    let (events, _) = run(&airlock, json!({"prompt": "do something bad"})).await;
    let done = of_kind(&events, "run.completed")[0];
    assert_eq!(done["stop_reason"], "refusal");
    let session = of_kind(&events, "run.started")[0]["session_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // Without a session the run works in `default`, like `airlock call` (DESIGN §16).
    assert_eq!(session, "default");

    let (events, raw) = run(&airlock, json!({"prompt": "hello"})).await;
    let failed = of_kind(&events, "run.failed")[0];
    assert_eq!(failed["reason"], "provider_error");
    let message = failed["message"].as_str().unwrap();
    assert!(message.contains("401"), "{message}");
    assert!(message.contains("authentication_error"), "{message}");
    assert!(message.contains("[redacted]"), "{message}");
    assert!(
        !raw.contains(KEY),
        "the key echoed by the provider reached the stream"
    );
    let requests = provider.requests();
    assert_eq!(requests.len(), 5, "one retry after the 529");
    // The retry repeats the overloaded request.
    assert_eq!(requests[4].body, requests[3].body);
    assert!(
        airlock.log().contains("model provider busy; retrying"),
        "the 529 was retried as busy: {}",
        airlock.log()
    );
    eprintln!(
        "the 529 was retried {:?} after it (backoff 1 s; measured, not asserted)",
        requests[4].at - requests[3].at
    );

    let (events, _) = run(&airlock, json!({"prompt": "stop"})).await;
    assert_eq!(
        of_kind(&events, "run.completed")[0]["stop_reason"],
        "stop_sequence"
    );

    let audit = audit_text(&airlock).await;
    assert!(!audit.contains(KEY), "the key is in the audit log");
    assert!(!airlock.log().contains(KEY), "the key is in the log");
}

#[tokio::test]
async fn openai_streaming_assembles_fragments_and_answers_invalid_arguments() {
    let provider = ScriptedProvider::start(vec![
        openai_stream(&[
            json!({"index": 0, "delta": {"role": "assistant", "content": "Look"}, "finish_reason": null}),
            json!({"index": 0, "delta": {"content": "ing."}, "finish_reason": null}),
            json!({"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "list_directory", "arguments": ""}}]}, "finish_reason": null}),
            json!({"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "call_2", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": "}}]}, "finish_reason": null}),
            json!({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"pa"}}]}, "finish_reason": null}),
            json!({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "th\": \".\"}"}}]}, "finish_reason": null}),
            json!({"index": 0, "delta": {}, "finish_reason": "tool_calls"}),
        ]),
        openai_stream(&[
            json!({"index": 0, "delta": {"role": "assistant", "content": "Done."}, "finish_reason": null}),
            json!({"index": 0, "delta": {}, "finish_reason": "stop"}),
        ]),
        // Over gRPC.
        openai_stream(&[
            json!({"index": 0, "delta": {"role": "assistant", "content": "via grpc"}, "finish_reason": "stop"}),
        ]),
    ])
    .await;
    let config = format!(
        "[agent]\nprovider = \"openai\"\nmodel = \"local-model\"\nbase_url = \"{}/v1\"\napi_key_env = \"{KEY_VAR}\"\nsystem = \"Be brief.\"\n",
        provider.url()
    );
    let airlock = Airlock::start_with_env(&config, &[(KEY_VAR, KEY)]).await;
    let (events, raw) = run(&airlock, json!({"prompt": "list", "session_id": "oa"})).await;
    assert_eq!(streamed_text(&events), "Looking.Done.");
    let calls = of_kind(&events, "tool.call");
    assert_eq!(calls[0]["input"], json!({"path": "."}));
    assert!(calls[1]["input"].is_null());
    assert!(
        calls[1]["input_error"]
            .as_str()
            .unwrap()
            .contains("not valid JSON")
    );
    let results = of_kind(&events, "tool.result");
    assert_eq!(results.len(), 2);
    let bad = results.iter().find(|r| r["id"] == "call_2").unwrap();
    assert_eq!(bad["is_error"], true);
    assert_eq!(bad["status"], "error");
    let done = of_kind(&events, "run.completed")[0];
    assert_eq!(done["stop_reason"], "stop");
    assert_eq!(done["usage"]["input_tokens"], 24);

    let requests = provider.requests();
    for r in &requests {
        assert_eq!(r.path, "/v1/chat/completions");
        assert_eq!(
            r.header("authorization"),
            Some(format!("Bearer {KEY}").as_str())
        );
        assert_eq!(r.body["model"], "local-model");
        assert_eq!(r.body["stream"], true);
        assert_eq!(r.body["max_tokens"], 4096);
        let tool = r.body["tools"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["function"]["name"] == "read_file")
            .expect("read_file offered")
            .clone();
        assert_eq!(tool["type"], "function");
        assert!(tool["function"]["parameters"]["properties"]["path"].is_object());
    }
    let messages = requests[1].body["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 5, "{}", requests[1].body);
    assert_eq!(
        messages[0],
        json!({"role": "system", "content": "Be brief."})
    );
    assert_eq!(messages[1], json!({"role": "user", "content": "list"}));
    assert_eq!(
        messages[2],
        json!({"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "list_directory", "arguments": "{\"path\": \".\"}"}},
            {"id": "call_2", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": "}},
        ]})
    );
    assert_eq!(messages[3]["role"], "tool");
    assert_eq!(messages[3]["tool_call_id"], "call_1");
    assert_eq!(messages[4]["role"], "tool");
    assert_eq!(messages[4]["tool_call_id"], "call_2");
    assert!(
        messages[4]["content"]
            .as_str()
            .unwrap()
            .contains("not valid JSON")
    );
    assert!(!raw.contains(KEY));

    // gRPC RunAgent streams the same events.
    use airlock_proto::v1 as pb;
    let mut client = airlock.grpc_client().await;
    let mut request = tonic::Request::new(pb::RunAgentRequest {
        prompt: "hi".into(),
        session_id: "grpc-run".into(),
        max_turns: 0,
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", airlock.token).parse().unwrap(),
    );
    let mut stream = client.run_agent(request).await.unwrap().into_inner();
    let mut kinds = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        let data: Value = serde_json::from_str(&event.data).unwrap();
        if event.kind == "run.completed" {
            assert_eq!(data["text"], "via grpc");
        }
        kinds.push(event.kind);
    }
    assert_eq!(kinds.first().map(String::as_str), Some("run.started"));
    assert_eq!(kinds.last().map(String::as_str), Some("run.completed"));
    let mut bad = tonic::Request::new(pb::RunAgentRequest {
        prompt: String::new(),
        session_id: String::new(),
        max_turns: 0,
    });
    bad.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", airlock.token).parse().unwrap(),
    );
    let status = client.run_agent(bad).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
}

async fn cli(airlock: &Airlock, args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(AIRLOCK)
        .arg("agent")
        .args(args)
        .env("AIRLOCK_URL", &airlock.url)
        .env("AIRLOCK_TOKEN", &airlock.token)
        .env_remove("AIRLOCK_DATA_DIR")
        .env_remove("AIRLOCK_CONFIG")
        .output()
        .await
        .expect("run airlock agent")
}

#[tokio::test]
async fn limits_end_runs_and_the_cli_prints_the_run() {
    let list = |id: &str| {
        openai_message(
            None,
            json!([{"id": id, "type": "function", "function": {"name": "list_directory", "arguments": "{\"path\": \".\"}"}}]),
            "tool_calls",
        )
    };
    let many: Vec<Value> = (0..4)
        .map(|i| json!({"id": format!("m{i}"), "type": "function", "function": {"name": "list_directory", "arguments": "{\"path\": \".\"}"}}))
        .collect();
    let provider = ScriptedProvider::start(vec![
        // CLI run 1: the model never stops calling tools → max_turns (2).
        list("c1"),
        list("c2"),
        // HTTP run 2: max_turns 1 from the request.
        list("c3"),
        // HTTP run 3: four calls at once, over max_tool_calls (3): none runs.
        openai_message(Some("lots"), json!(many), "tool_calls"),
        // CLI run 4: a good one.
        openai_message(Some("All good."), json!([]), "stop"),
    ])
    .await;
    let config = format!(
        "[agent]\nprovider = \"openai\"\nbase_url = \"{}/v1\"\napi_key_env = \"{KEY_VAR}\"\nstream = false\nmax_turns = 2\nmax_tool_calls = 3\n",
        provider.url()
    );
    let airlock = Airlock::start_with_env(&config, &[(KEY_VAR, KEY)]).await;

    let out = cli(&airlock, &["loop forever", "--session", "cli1"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("max_turns"), "{stderr}");
    assert_eq!(stdout.matches("→ list_directory").count(), 2, "{stdout}");
    assert_eq!(stdout.matches("✓ list_directory ok").count(), 2, "{stdout}");
    assert_eq!(provider.requests().len(), 2);
    assert!(provider.requests()[0].body.get("stream_options").is_none());
    assert_eq!(provider.requests()[0].body["stream"], false);

    let (events, _) = run(&airlock, json!({"prompt": "once", "max_turns": 1})).await;
    let failed = of_kind(&events, "run.failed")[0];
    assert_eq!(failed["reason"], "max_turns");
    assert_eq!(failed["turns"], 1);
    assert_eq!(of_kind(&events, "tool.result").len(), 1);

    let (events, _) = run(&airlock, json!({"prompt": "many"})).await;
    let failed = of_kind(&events, "run.failed")[0];
    assert_eq!(failed["reason"], "max_tool_calls");
    assert!(
        of_kind(&events, "tool.call").is_empty(),
        "no call of that turn runs"
    );

    let out = cli(&airlock, &["say something"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("All good."), "{stdout}");
    assert!(stderr.contains("completed: stop"), "{stderr}");
    assert!(!stdout.contains(KEY) && !stderr.contains(KEY));
}

/// A run's conversation is bounded by what one model request may carry (32 MiB): a
/// provider whose every turn adds 20 MiB ends the run at its third request, which is
/// never sent, instead of growing the orchestrator with it.
#[tokio::test]
async fn a_run_whose_conversation_outgrows_a_request_ends() {
    let big = |id: &str| {
        openai_message(
            Some(&"w".repeat(20 << 20)),
            json!([{"id": id, "type": "function", "function": {"name": "list_directory", "arguments": "{\"path\": \".\"}"}}]),
            "tool_calls",
        )
    };
    let provider = ScriptedProvider::start(vec![big("b1"), big("b2"), big("b3")]).await;
    let config = format!(
        "[agent]\nprovider = \"openai\"\nbase_url = \"{}/v1\"\napi_key_env = \"{KEY_VAR}\"\nstream = false\nmax_turns = 5\n",
        provider.url()
    );
    let airlock = Airlock::start_with_env(&config, &[(KEY_VAR, KEY)]).await;
    let (events, _) = run(&airlock, json!({"prompt": "grow"})).await;
    let failed = of_kind(&events, "run.failed");
    assert_eq!(failed.len(), 1, "{:?}", of_kind(&events, "run.completed"));
    assert_eq!(failed[0]["reason"], "max_request_bytes", "{}", failed[0]);
    assert!(
        failed[0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("33554432")),
        "{}",
        failed[0]
    );
    assert_eq!(
        provider.requests().len(),
        2,
        "the third request was not sent"
    );
}

#[tokio::test]
async fn a_call_that_waits_for_approval_still_gets_exactly_one_result() {
    let provider = ScriptedProvider::start(vec![
        anthropic_stream(
            "",
            &[
                (
                    "toolu_w",
                    "write_file",
                    &["{\"path\": \"x.txt\", \"content\": \"x\"}"],
                ),
                ("toolu_l", "list_directory", &["{\"path\": \".\"}"]),
            ],
            "tool_use",
        ),
        anthropic_stream("Could not write.", &[], "end_turn"),
    ])
    .await;
    // Nobody approves: the loop withdraws the call after tool_wait_seconds.
    let config = format!(
        "{}\n[approvals]\ntools = [\"write_file\"]\n",
        agent_config(&provider, "tool_wait_seconds = 2")
    );
    let airlock = Airlock::start_with_env(&config, &[(KEY_VAR, KEY)]).await;
    let (events, raw) = run(&airlock, json!({"prompt": "write", "session_id": "appr"})).await;
    let pending = of_kind(&events, "tool.pending_approval");
    assert_eq!(pending.len(), 1, "{raw}");
    assert_eq!(pending[0]["id"], "toolu_w");
    assert!(pending[0]["approval_id"].is_string());
    let results = of_kind(&events, "tool.result");
    assert_eq!(results.len(), 2, "{raw}");
    let write = results.iter().find(|r| r["id"] == "toolu_w").unwrap();
    assert_eq!(write["is_error"], true);
    assert_eq!(write["status"], "cancelled");
    assert!(
        write["text"].as_str().unwrap().contains("withdrawn"),
        "{write}"
    );
    assert_eq!(
        of_kind(&events, "run.completed")[0]["stop_reason"],
        "end_turn"
    );

    let requests = provider.requests();
    assert_eq!(requests.len(), 2);
    let messages = requests[1].body["messages"].as_array().unwrap();
    assert_one_result_per_use(&messages[1], &messages[2]);
    assert_eq!(messages[2]["content"][0]["is_error"], true);
    assert_eq!(messages[2]["content"][1]["is_error"], false);
    assert!(!airlock.workspace("appr").join("x.txt").exists());
    // The withdrawn approval cannot be approved later.
    let (_, approvals) = airlock.get("/v1/approvals?status=pending").await;
    assert_eq!(
        approvals["approvals"].as_array().unwrap().len(),
        0,
        "{approvals}"
    );
}

#[tokio::test]
async fn closing_the_stream_cancels_the_run_and_its_calls() {
    let marker = format!("airlock-agent-cancel-{}", std::process::id());
    let command = json!({"command": format!("sleep 30 # {marker}")}).to_string();
    let provider = ScriptedProvider::start(vec![anthropic_stream(
        "",
        &[("toolu_s", "execute_shell", &[command.as_str()])],
        "tool_use",
    )])
    .await;
    let airlock = Airlock::start_with_env(&agent_config(&provider, ""), &[(KEY_VAR, KEY)]).await;
    let mut response = airlock
        .request(reqwest::Method::POST, "/v1/agent/runs")
        .json(&json!({"prompt": "sleep", "session_id": "cancel1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut seen = String::new();
    while !seen.contains("event: tool.call") {
        let chunk = tokio::time::timeout(Duration::from_secs(30), response.chunk())
            .await
            .expect("events arrive")
            .unwrap()
            .expect("the stream goes on");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    // The sandboxed command runs; then the client goes away.
    airlock.wait_started(&marker, "the agent's command").await;
    drop(response);
    airlock
        .wait_gone(&marker, "closing the run did not kill the sandbox")
        .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, audit) = airlock.get("/v1/audit?session_id=cancel1&limit=1000").await;
        let events = audit["events"].as_array().unwrap();
        let cancelled = events
            .iter()
            .any(|e| e["kind"] == "completed" && e["data"]["status"] == "cancelled");
        let finished = events
            .iter()
            .any(|e| e["kind"] == "agent_run_finished" && e["data"]["outcome"] == "cancelled");
        if cancelled && finished {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the call was not cancelled: {audit}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        provider.requests().len(),
        1,
        "no model request after the cancel"
    );
}

#[tokio::test]
async fn runs_fail_cleanly_without_a_key_and_bad_requests_are_400() {
    // The variable is unset: airlock still starts; only runs fail, naming the variable.
    let airlock = Airlock::start_with(
        "[agent]\nprovider = \"anthropic\"\nbase_url = \"http://127.0.0.1:9\"\napi_key_env = \"AIRLOCK_E2E_UNSET_KEY\"\n",
    )
    .await;
    let (status, text, _) = run_raw(&airlock, json!({"prompt": "hi"})).await;
    assert_eq!(status, 503, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["code"], "agent_unavailable");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("AIRLOCK_E2E_UNSET_KEY")
    );

    let out = cli(&airlock, &["hi"]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("AIRLOCK_E2E_UNSET_KEY"));

    for (body, needle) in [
        (json!({}), "prompt is required"),
        (json!({"prompt": ""}), "must not be empty"),
        (json!({"prompt": "x", "session_id": "../etc"}), "session_id"),
        (json!({"prompt": "x", "max_turns": -1}), "max_turns"),
        (json!(["x"]), "JSON object"),
    ] {
        let (status, text, _) = run_raw(&airlock, body.clone()).await;
        assert_eq!(status, 400, "{body}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["code"], "invalid_request");
        assert!(text.contains(needle), "{body}: {text}");
    }
    let response = airlock
        .http()
        .post(format!("{}/v1/agent/runs", airlock.url))
        .json(&json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);

    let (status, doc) = airlock.get("/openapi.json").await;
    assert_eq!(status, 200);
    assert!(doc["paths"]["/v1/agent/runs"]["post"].is_object());
    assert!(doc["components"]["schemas"]["AgentRunRequest"].is_object());
}

/// An agent run is one trace (exported over OTLP to the test's receiver): the front
/// door, the run's `invoke_agent` span, a `chat` span per model request with the
/// provider, the model and the token counts, and the run's tool calls, down to the fs
/// worker; neither the prompt nor the API key is in any exported byte.
#[tokio::test]
async fn a_run_is_one_trace_with_a_chat_span_per_model_request() {
    use crate::traces::{Receiver, find, has, hex, int_attribute, text_attribute, traceparent};
    let receiver = Receiver::start().await;
    let provider = ScriptedProvider::start(vec![
        anthropic_message(
            json!([{"type": "tool_use", "id": "toolu_traced", "name": "list_directory", "input": {"path": "."}}]),
            "tool_use",
        ),
        anthropic_message(json!([{"type": "text", "text": "Done."}]), "end_turn"),
    ])
    .await;
    let airlock = Airlock::start_with_env(
        &agent_config(&provider, "stream = false"),
        &[
            (KEY_VAR, KEY),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.http.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    )
    .await;
    let (trace_id, parent_id, header) = traceparent();
    let prompt = "prompt-text-that-stays-out-of-traces";
    let response = airlock
        .request(reqwest::Method::POST, "/v1/agent/runs")
        .header("traceparent", &header)
        .json(&json!({"prompt": prompt, "session_id": "traced"}))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    let text = response.text().await.expect("body");
    assert!(text.contains("run.completed"), "{text}");

    let orchestrator = "airlock-orchestrator";
    let spans = receiver
        .wait_for_trace(&trace_id, "the run's spans", |spans| {
            spans
                .iter()
                .filter(|(_, s)| s.name == "chat claude-test")
                .count()
                == 2
                && has(spans, orchestrator, "invoke_agent airlock")
                && has(spans, orchestrator, "execute_tool list_directory")
                && has(spans, "airlock-worker-fs", "execute_tool list_directory")
        })
        .await;
    let door = find(&spans, orchestrator, "POST /v1/agent/runs");
    assert_eq!(hex(&door.parent_span_id), parent_id);
    let run = find(&spans, orchestrator, "invoke_agent airlock");
    assert_eq!(run.parent_span_id, door.span_id);
    for (_, chat) in spans.iter().filter(|(_, s)| s.name == "chat claude-test") {
        assert_eq!(chat.parent_span_id, run.span_id);
        assert_eq!(
            text_attribute(&chat.attributes, "gen_ai.provider.name").as_deref(),
            Some("anthropic")
        );
        assert_eq!(
            text_attribute(&chat.attributes, "gen_ai.request.model").as_deref(),
            Some("claude-test")
        );
        assert_eq!(
            int_attribute(&chat.attributes, "gen_ai.usage.input_tokens"),
            Some(5)
        );
        assert_eq!(
            int_attribute(&chat.attributes, "gen_ai.usage.output_tokens"),
            Some(7)
        );
    }
    let call = find(&spans, orchestrator, "execute_tool list_directory");
    assert_eq!(call.parent_span_id, run.span_id);
    assert_eq!(
        text_attribute(&call.attributes, "gen_ai.tool.call.id").as_deref(),
        Some("toolu_traced")
    );
    let raw = receiver.raw();
    for secret in [prompt, KEY] {
        assert!(
            !raw.windows(secret.len()).any(|w| w == secret.as_bytes()),
            "{secret} was exported in a span"
        );
    }
}

/// Runs a principal may have going at once are bounded (`[agent]
/// max_runs_per_principal`): each holds a conversation and spends the operator's key,
/// and tool calls are rate-limited while runs otherwise were not. A slot comes back
/// when its run ends — here, when its client closes the stream.
#[tokio::test]
async fn runs_going_at_once_are_bounded_per_principal() {
    // A provider that takes every request and never answers: runs stay going.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        for _ in 0..16 {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            held.push(stream);
        }
    });
    let airlock = Airlock::start_with_env(
        &format!(
            "[agent]\nprovider = \"anthropic\"\nmodel = \"claude-test\"\nbase_url = \"http://127.0.0.1:{port}\"\napi_key_env = \"{KEY_VAR}\"\nmax_runs_per_principal = 2\n"
        ),
        &[(KEY_VAR, KEY)],
    )
    .await;
    // Two runs, each read up to its first event: they are going.
    let mut going = Vec::new();
    for n in 0..2 {
        let mut response = airlock
            .request(reqwest::Method::POST, "/v1/agent/runs")
            .json(&json!({"prompt": format!("run {n}")}))
            .send()
            .await
            .expect("send");
        assert_eq!(response.status().as_u16(), 200);
        let first = tokio::time::timeout(Duration::from_secs(30), response.chunk())
            .await
            .expect("the run's first event within 30 s")
            .expect("read");
        let first = String::from_utf8_lossy(&first.unwrap_or_default()).into_owned();
        assert!(first.contains("run.started"), "{first}");
        going.push(response);
    }
    let (status, text, _) = run_raw(&airlock, json!({"prompt": "a third"})).await;
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("max_runs_per_principal"), "{text}");
    assert!(!text.contains(KEY), "{text}");

    // One stream closed: its run is cancelled and its slot given back.
    drop(going.pop());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let response = airlock
            .request(reqwest::Method::POST, "/v1/agent/runs")
            .json(&json!({"prompt": "after one ended"}))
            .send()
            .await
            .expect("send");
        if response.status().as_u16() == 200 {
            break;
        }
        assert_eq!(response.status().as_u16(), 429);
        assert!(
            Instant::now() < deadline,
            "the closed run's slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    silent.abort();
}
