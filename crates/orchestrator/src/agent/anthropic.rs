//! Anthropic Messages: request bodies, the streamed response assembled block by block,
//! the non-streamed response, and the `tool_result` message.
//!
//! Every content block is kept as the provider sent it (text, `tool_use`, thinking with
//! its signature, server tool blocks), so a `pause_turn` or a tool round trip sends the
//! assistant content back exactly. A `tool_use` block's `input_json_delta` fragments are
//! concatenated per block index and parsed only at `content_block_stop`; arguments that
//! do not parse (or were cut off by `max_tokens`) become an error result for that call.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::sse::SseEvent;
use super::{AgentError, ProposedUse, Resolved, Stop, Turn, Usage, parse_arguments};

pub const VERSION: &str = "2023-06-01";

/// `POST {base_url}/v1/messages`.
pub fn endpoint(base_url: &str) -> String {
    format!("{base_url}/v1/messages")
}

/// The catalog in Anthropic's tool shape.
pub fn tools(catalog: &[std::sync::Arc<crate::catalog::CatalogTool>]) -> Vec<Value> {
    catalog
        .iter()
        .map(|t| crate::wire::catalog_entry(t, crate::wire::CatalogFormat::Anthropic))
        .collect()
}

pub fn first_messages(prompt: &str) -> Vec<Value> {
    vec![json!({"role": "user", "content": prompt})]
}

pub fn request_body(resolved: &Resolved, messages: &[Value], tools: &[Value]) -> Value {
    let mut body = json!({
        "model": resolved.model,
        "max_tokens": resolved.config.max_tokens,
        "messages": messages,
        "stream": resolved.config.stream,
    });
    if !tools.is_empty() {
        body["tools"] = json!(tools);
    }
    if let Some(system) = &resolved.config.system {
        body["system"] = json!(system);
    }
    body
}

/// The next user message: one `tool_result` per `tool_use`, in order.
pub fn results_message(results: &[(String, bool, Vec<String>)]) -> Value {
    let blocks: Vec<Value> = results
        .iter()
        .map(|(id, is_error, texts)| {
            // Empty text blocks are refused by the API.
            let content: Vec<Value> = texts
                .iter()
                .map(|t| if t.is_empty() { "(no output)" } else { t.as_str() })
                .map(|t| json!({"type": "text", "text": t}))
                .collect();
            json!({"type": "tool_result", "tool_use_id": id, "content": content, "is_error": is_error})
        })
        .collect();
    json!({"role": "user", "content": blocks})
}

/// One content block while it streams.
#[derive(Debug)]
struct Block {
    value: Value,
    json: String,
    has_json: bool,
    input: Option<Result<Value, String>>,
}

/// Assembles a streamed response.
#[derive(Debug, Default)]
pub struct Stream {
    blocks: BTreeMap<u64, Block>,
    stop_reason: Option<String>,
    usage: Usage,
    started: bool,
    stopped: bool,
}

fn field<'a>(value: &'a Value, name: &str) -> Result<&'a Value, AgentError> {
    value
        .get(name)
        .ok_or_else(|| AgentError::Protocol(format!("an event lacks {name:?}")))
}

fn index(value: &Value) -> Result<u64, AgentError> {
    field(value, "index")?
        .as_u64()
        .ok_or_else(|| AgentError::Protocol("a block index is not a number".into()))
}

fn read_usage(usage: &Value, into: &mut Usage) {
    let n = |k: &str| usage.get(k).and_then(Value::as_u64);
    let input = [
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    ]
    .iter()
    .filter_map(|k| n(k))
    // The provider's numbers: a sum that overflows is clamped, never a panic that
    // would end the run without its `run.failed` and audit record.
    .reduce(u64::saturating_add);
    if let Some(input) = input.filter(|i| *i > 0) {
        into.input_tokens = input;
    }
    if let Some(output) = n("output_tokens") {
        into.output_tokens = output;
    }
}

/// Finishes a `tool_use` (or server tool) block: its JSON fragments become `input`.
fn close_block(block: &mut Block) {
    if block.input.is_some() {
        return;
    }
    let kind = block.value["type"].as_str().unwrap_or_default();
    if kind != "tool_use" && kind != "server_tool_use" && !block.has_json {
        return;
    }
    let parsed = if block.has_json && !block.json.trim().is_empty() {
        parse_arguments(&block.json)
    } else {
        match block.value.get("input") {
            Some(v @ Value::Object(_)) => Ok(v.clone()),
            _ => Ok(json!({})),
        }
    };
    // The history must hold an object; a broken one is answered with an error result.
    block.value["input"] = parsed.clone().unwrap_or_else(|_| json!({}));
    block.input = Some(parsed);
}

impl Stream {
    /// Handles one event; returns a text delta to show, if any.
    pub fn on_event(&mut self, event: &SseEvent) -> Result<Option<String>, AgentError> {
        let data: Value = serde_json::from_str(&event.data)
            .map_err(|e| AgentError::Protocol(format!("an event's data is not JSON ({e})")))?;
        let kind = data
            .get("type")
            .and_then(Value::as_str)
            .or(event.event.as_deref())
            .unwrap_or_default()
            .to_owned();
        match kind.as_str() {
            "message_start" => {
                self.started = true;
                if let Some(usage) = data.pointer("/message/usage") {
                    read_usage(usage, &mut self.usage);
                }
            }
            "content_block_start" => {
                let at = index(&data)?;
                let value = field(&data, "content_block")?.clone();
                // Deltas write into the block: anything but an object is a broken stream.
                if !value.is_object() {
                    return Err(AgentError::Protocol(format!(
                        "block {at}'s content_block is not an object"
                    )));
                }
                self.blocks.insert(
                    at,
                    Block {
                        value,
                        json: String::new(),
                        has_json: false,
                        input: None,
                    },
                );
            }
            "content_block_delta" => {
                let at = index(&data)?;
                let block = self.blocks.get_mut(&at).ok_or_else(|| {
                    AgentError::Protocol(format!("a delta for block {at}, which never started"))
                })?;
                let delta = field(&data, "delta")?;
                let text = |k: &str| delta.get(k).and_then(Value::as_str).unwrap_or_default();
                match delta["type"].as_str().unwrap_or_default() {
                    "text_delta" => {
                        let piece = text("text");
                        append(&mut block.value, "text", piece);
                        return Ok(Some(piece.to_owned()).filter(|p| !p.is_empty()));
                    }
                    "input_json_delta" => {
                        block.json.push_str(text("partial_json"));
                        block.has_json = true;
                    }
                    "thinking_delta" => append(&mut block.value, "thinking", text("thinking")),
                    "signature_delta" => append(&mut block.value, "signature", text("signature")),
                    "citations_delta" => {
                        if let Some(citation) = delta.get("citation") {
                            match block
                                .value
                                .get_mut("citations")
                                .and_then(Value::as_array_mut)
                            {
                                Some(list) => list.push(citation.clone()),
                                None => block.value["citations"] = json!([citation]),
                            }
                        }
                    }
                    // Unknown deltas are new API features this loop does not use.
                    _ => {}
                }
            }
            "content_block_stop" => {
                let at = index(&data)?;
                if let Some(block) = self.blocks.get_mut(&at) {
                    close_block(block);
                }
            }
            "message_delta" => {
                if let Some(reason) = data.pointer("/delta/stop_reason").and_then(Value::as_str) {
                    self.stop_reason = Some(reason.to_owned());
                }
                if let Some(usage) = data.get("usage") {
                    read_usage(usage, &mut self.usage);
                }
            }
            "message_stop" => self.stopped = true,
            "error" => {
                let kind = data
                    .pointer("/error/type")
                    .and_then(Value::as_str)
                    .unwrap_or("error");
                let message = data
                    .pointer("/error/message")
                    .and_then(Value::as_str)
                    .unwrap_or("no message");
                return Err(AgentError::Provider(format!("{kind}: {message}")));
            }
            // `ping` and event types added later.
            _ => {}
        }
        Ok(None)
    }

    /// The assembled turn, once the stream has ended.
    pub fn finish(mut self) -> Result<Turn, AgentError> {
        if !self.started || !self.stopped {
            return Err(AgentError::Protocol(
                "the stream ended before message_stop".into(),
            ));
        }
        for block in self.blocks.values_mut() {
            close_block(block);
        }
        let content: Vec<Value> = self.blocks.values().map(|b| b.value.clone()).collect();
        let mut tool_uses = Vec::new();
        for block in self.blocks.into_values() {
            if block.value["type"] == "tool_use" {
                tool_uses.push(ProposedUse {
                    id: block.value["id"].as_str().unwrap_or_default().to_owned(),
                    name: block.value["name"].as_str().unwrap_or_default().to_owned(),
                    input: block.input.unwrap_or_else(|| Ok(json!({}))),
                });
            }
        }
        let stop_reason = self.stop_reason.unwrap_or_else(|| "end_turn".to_owned());
        Ok(turn(content, tool_uses, stop_reason, self.usage))
    }
}

fn append(value: &mut Value, key: &str, piece: &str) {
    match value.get_mut(key) {
        Some(Value::String(s)) => s.push_str(piece),
        _ => value[key] = json!(piece),
    }
}

fn turn(
    content: Vec<Value>,
    tool_uses: Vec<ProposedUse>,
    stop_reason: String,
    usage: Usage,
) -> Turn {
    let text = content
        .iter()
        .filter(|b| b["type"] == "text")
        .filter_map(|b| b["text"].as_str())
        .collect::<Vec<_>>()
        .join("");
    Turn {
        assistant: json!({"role": "assistant", "content": content}),
        tool_uses,
        text,
        stop: Stop::from_anthropic(&stop_reason),
        stop_reason,
        usage,
    }
}

/// A non-streamed response (`stream: false`).
pub fn parse_message(body: &Value) -> Result<Turn, AgentError> {
    if body.get("type").and_then(Value::as_str) == Some("error") {
        return Err(AgentError::Provider(error_text(body)));
    }
    let content = body
        .get("content")
        .and_then(Value::as_array)
        .ok_or_else(|| AgentError::Protocol("the message has no content array".into()))?
        .clone();
    let tool_uses = content
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .map(|b| ProposedUse {
            id: b["id"].as_str().unwrap_or_default().to_owned(),
            name: b["name"].as_str().unwrap_or_default().to_owned(),
            input: match &b["input"] {
                v @ Value::Object(_) => Ok(v.clone()),
                Value::Null => Ok(json!({})),
                _ => Err("the arguments must be a JSON object; call the tool again with an object that matches its input_schema".into()),
            },
        })
        .collect();
    let mut usage = Usage::default();
    if let Some(u) = body.get("usage") {
        read_usage(u, &mut usage);
    }
    let stop_reason = body["stop_reason"]
        .as_str()
        .unwrap_or("end_turn")
        .to_owned();
    Ok(turn(content, tool_uses, stop_reason, usage))
}

/// `{"type":"error","error":{"type","message"}}` as one line.
pub fn error_text(body: &Value) -> String {
    let kind = body
        .pointer("/error/type")
        .and_then(Value::as_str)
        .unwrap_or("error");
    match body.pointer("/error/message").and_then(Value::as_str) {
        Some(message) => format!("{kind}: {message}"),
        None => kind.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::sse::SseParser;

    #[test]
    fn token_counts_that_overflow_are_clamped() {
        let mut usage = Usage::default();
        read_usage(
            &json!({"input_tokens": u64::MAX, "cache_read_input_tokens": 1,
                "cache_creation_input_tokens": u64::MAX, "output_tokens": 7}),
            &mut usage,
        );
        assert_eq!(usage.input_tokens, u64::MAX);
        assert_eq!(usage.output_tokens, 7);
    }

    fn sse(events: &[Value]) -> String {
        events
            .iter()
            .map(|e| format!("event: {}\ndata: {}\n\n", e["type"].as_str().unwrap(), e))
            .collect()
    }

    fn script() -> String {
        sse(&[
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m", "stop_reason": null, "usage": {"input_tokens": 25, "output_tokens": 1}}}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "ping"}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Let me "}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "look."}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {}}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": ""}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"pa"}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "th\": \"no"}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "tes.t"}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "xt\", \"limit\": 1"}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "0}"}}),
            json!({"type": "content_block_stop", "index": 1}),
            json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_2", "name": "list_directory", "input": {}}}),
            json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"path\": \"."}}),
            json!({"type": "content_block_stop", "index": 2}),
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 89}}),
            json!({"type": "message_stop"}),
        ])
    }

    fn run(text: &str, chunk: usize) -> Result<(Turn, String), AgentError> {
        let mut parser = SseParser::default();
        let mut stream = Stream::default();
        let mut shown = String::new();
        for piece in text.as_bytes().chunks(chunk) {
            for event in parser.feed(piece).unwrap() {
                if let Some(t) = stream.on_event(&event)? {
                    shown.push_str(&t);
                }
            }
        }
        Ok((stream.finish()?, shown))
    }

    #[test]
    fn a_block_that_is_not_an_object_is_a_protocol_error_not_a_panic() {
        for block in [json!("text"), json!(7), json!([1, 2]), json!(null)] {
            for delta in [
                json!({"type": "text_delta", "text": "x"}),
                json!({"type": "citations_delta", "citation": {"a": 1}}),
                json!({"type": "thinking_delta", "thinking": "x"}),
            ] {
                let text = sse(&[
                    json!({"type": "message_start", "message": {"usage": {"input_tokens": 1, "output_tokens": 1}}}),
                    json!({"type": "content_block_start", "index": 0, "content_block": block}),
                    json!({"type": "content_block_delta", "index": 0, "delta": delta}),
                    json!({"type": "content_block_stop", "index": 0}),
                    json!({"type": "message_stop"}),
                ]);
                let Err(AgentError::Protocol(why)) = run(&text, 1000) else {
                    panic!("{block} then {delta} was accepted");
                };
                assert!(why.contains("not an object"), "{why}");
            }
        }
    }

    #[test]
    fn input_json_deltas_split_mid_token_are_assembled_before_parsing() {
        for chunk in [1, 3, 7, 64, 100_000] {
            let (turn, shown) = run(&script(), chunk).unwrap();
            assert_eq!(shown, "Let me look.");
            assert_eq!(turn.text, "Let me look.");
            assert_eq!(turn.stop, Stop::ToolUse);
            assert_eq!(turn.stop_reason, "tool_use");
            assert_eq!(
                turn.usage,
                Usage {
                    input_tokens: 25,
                    output_tokens: 89
                }
            );
            assert_eq!(turn.tool_uses.len(), 2);
            assert_eq!(turn.tool_uses[0].id, "toolu_1");
            assert_eq!(
                turn.tool_uses[0].input,
                Ok(json!({"path": "notes.txt", "limit": 10}))
            );
            // Cut off: an error for this call, `{}` in the history.
            assert_eq!(turn.tool_uses[1].id, "toolu_2");
            let err = turn.tool_uses[1].input.clone().unwrap_err();
            assert!(err.contains("not valid JSON"), "{err}");
            let content = turn.assistant["content"].as_array().unwrap();
            assert_eq!(content.len(), 3);
            assert_eq!(content[0], json!({"type": "text", "text": "Let me look."}));
            assert_eq!(
                content[1],
                json!({"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "notes.txt", "limit": 10}})
            );
            assert_eq!(content[2]["input"], json!({}));
        }
    }

    #[test]
    fn thinking_and_server_blocks_are_kept_verbatim() {
        let text = sse(&[
            json!({"type": "message_start", "message": {"usage": {"input_tokens": 3}}}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "hmm"}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig"}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"query\":\"x\"}"}}),
            json!({"type": "content_block_stop", "index": 1}),
            json!({"type": "message_delta", "delta": {"stop_reason": "pause_turn"}, "usage": {"output_tokens": 5}}),
            json!({"type": "message_stop"}),
        ]);
        let (turn, shown) = run(&text, 5).unwrap();
        assert_eq!(shown, "");
        assert_eq!(turn.stop, Stop::PauseTurn);
        assert!(turn.tool_uses.is_empty());
        assert_eq!(
            turn.assistant["content"],
            json!([
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
            ])
        );
    }

    #[test]
    fn errors_and_truncated_streams_are_reported() {
        let text = sse(&[
            json!({"type": "message_start", "message": {}}),
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        ]);
        assert_eq!(
            run(&text, 10).unwrap_err(),
            AgentError::Provider("overloaded_error: Overloaded".into())
        );
        let text = sse(&[json!({"type": "message_start", "message": {}})]);
        assert!(matches!(
            run(&text, 10).unwrap_err(),
            AgentError::Protocol(_)
        ));
    }

    #[test]
    fn every_stop_reason_maps() {
        for (reason, stop) in [
            ("end_turn", Stop::EndTurn),
            ("tool_use", Stop::ToolUse),
            ("max_tokens", Stop::MaxTokens),
            ("pause_turn", Stop::PauseTurn),
            ("stop_sequence", Stop::StopSequence),
            ("refusal", Stop::Refusal),
            ("something_new", Stop::Other),
        ] {
            let body = json!({"type": "message", "content": [{"type": "text", "text": "x"}], "stop_reason": reason, "usage": {"input_tokens": 1, "output_tokens": 2}});
            let turn = parse_message(&body).unwrap();
            assert_eq!(turn.stop, stop, "{reason}");
            assert_eq!(turn.stop_reason, reason);
        }
    }

    #[test]
    fn plain_message_and_results() {
        let body = json!({"type": "message", "role": "assistant", "content": [
            {"type": "tool_use", "id": "a", "name": "read_file", "input": {"path": "x"}},
            {"type": "tool_use", "id": "b", "name": "read_file", "input": "oops"},
        ], "stop_reason": "tool_use", "usage": {"input_tokens": 1, "output_tokens": 2}});
        let turn = parse_message(&body).unwrap();
        assert_eq!(turn.tool_uses[0].input, Ok(json!({"path": "x"})));
        assert!(turn.tool_uses[1].input.is_err());
        let message = results_message(&[
            ("a".into(), false, vec!["hello".into()]),
            ("b".into(), true, vec![String::new()]),
        ]);
        assert_eq!(
            message,
            json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "text", "text": "hello"}], "is_error": false},
                {"type": "tool_result", "tool_use_id": "b", "content": [{"type": "text", "text": "(no output)"}], "is_error": true},
            ]})
        );
        let err = parse_message(
            &json!({"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}),
        );
        assert_eq!(
            err.unwrap_err(),
            AgentError::Provider("invalid_request_error: bad".into())
        );
    }
}
