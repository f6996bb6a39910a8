//! OpenAI Chat Completions and compatible servers (vLLM, Ollama, llama.cpp): request
//! bodies, the streamed response (`choices[].delta.tool_calls[]` fragments assembled by
//! index), the non-streamed response, and the `role: "tool"` result messages.
//!
//! Arguments arrive as a JSON string the model wrote; one that does not parse becomes an
//! error result for that call (the string goes back in the history as the model sent it).

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::sse::SseEvent;
use super::{AgentError, ProposedUse, Resolved, Stop, Turn, Usage, parse_arguments};

/// `POST {base_url}/chat/completions`.
pub fn endpoint(base_url: &str) -> String {
    format!("{base_url}/chat/completions")
}

/// The catalog in OpenAI's function-tool shape.
pub fn tools(catalog: &[std::sync::Arc<crate::catalog::CatalogTool>]) -> Vec<Value> {
    catalog
        .iter()
        .map(|t| crate::wire::catalog_entry(t, crate::wire::CatalogFormat::OpenAi))
        .collect()
}

pub fn first_messages(system: Option<&str>, prompt: &str) -> Vec<Value> {
    let mut messages = Vec::new();
    if let Some(system) = system {
        messages.push(json!({"role": "system", "content": system}));
    }
    messages.push(json!({"role": "user", "content": prompt}));
    messages
}

pub fn request_body(resolved: &Resolved, messages: &[Value], tools: &[Value]) -> Value {
    let stream = resolved.config.stream;
    let mut body = json!({
        "model": resolved.model,
        "messages": messages,
        "stream": stream,
    });
    // OpenAI's own API has renamed the field (its reasoning models refuse the old one);
    // compatible servers know `max_tokens`.
    let limit_field = if resolved.base_url.contains("://api.openai.com") {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    body[limit_field] = json!(resolved.config.max_tokens);
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    if !tools.is_empty() {
        body["tools"] = json!(tools);
    }
    body
}

/// One `role: "tool"` message per call, in order.
pub fn results_messages(results: &[(String, bool, Vec<String>)]) -> Vec<Value> {
    results
        .iter()
        .map(|(id, _, texts)| json!({"role": "tool", "tool_call_id": id, "content": texts.join("\n")}))
        .collect()
}

#[derive(Debug, Default)]
struct Call {
    id: String,
    name: String,
    arguments: String,
}

/// Assembles a streamed response.
#[derive(Debug, Default)]
pub struct Stream {
    text: String,
    calls: BTreeMap<u64, Call>,
    finish_reason: Option<String>,
    usage: Usage,
    done: bool,
    any: bool,
}

fn read_usage(usage: &Value, into: &mut Usage) {
    if let Some(n) = usage.get("prompt_tokens").and_then(Value::as_u64) {
        into.input_tokens = n;
    }
    if let Some(n) = usage.get("completion_tokens").and_then(Value::as_u64) {
        into.output_tokens = n;
    }
}

fn error_of(body: &Value) -> Option<String> {
    let error = body.get("error")?;
    Some(match error {
        Value::String(s) => s.clone(),
        other => other
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| other.to_string()),
    })
}

/// Arguments as text: a string as sent, an object (some servers) re-encoded.
fn arguments_text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

impl Stream {
    /// Handles one event; returns a text delta to show, if any.
    pub fn on_event(&mut self, event: &SseEvent) -> Result<Option<String>, AgentError> {
        let data = event.data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(None);
        }
        if data.is_empty() {
            return Ok(None);
        }
        let chunk: Value = serde_json::from_str(data)
            .map_err(|e| AgentError::Protocol(format!("a chunk is not JSON ({e})")))?;
        if let Some(message) = error_of(&chunk) {
            return Err(AgentError::Provider(message));
        }
        self.any = true;
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            read_usage(usage, &mut self.usage);
        }
        let Some(choice) = chunk
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.iter().find(|c| c["index"].as_u64().unwrap_or(0) == 0))
        else {
            return Ok(None);
        };
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(reason.to_owned());
        }
        let delta = &choice["delta"];
        for fragment in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let at = match fragment.get("index").and_then(Value::as_u64) {
                Some(i) => i,
                // Servers that omit the index: a new id starts a new call.
                None => {
                    let last = self.calls.keys().next_back().copied();
                    match (last, fragment.get("id").and_then(Value::as_str)) {
                        (Some(last), Some(id)) if self.calls[&last].id != id => {
                            last.saturating_add(1)
                        }
                        (Some(last), _) => last,
                        (None, _) => 0,
                    }
                }
            };
            let call = self.calls.entry(at).or_default();
            if let Some(id) = fragment.get("id").and_then(Value::as_str) {
                call.id = id.to_owned();
            }
            if let Some(name) = fragment.pointer("/function/name").and_then(Value::as_str) {
                call.name.push_str(name);
            }
            if let Some(args) = fragment.pointer("/function/arguments") {
                call.arguments.push_str(&arguments_text(args));
            }
        }
        match delta.get("content").and_then(Value::as_str) {
            Some(piece) if !piece.is_empty() => {
                self.text.push_str(piece);
                Ok(Some(piece.to_owned()))
            }
            _ => Ok(None),
        }
    }

    pub fn finish(self) -> Result<Turn, AgentError> {
        if !self.any {
            return Err(AgentError::Protocol("the stream carried no chunk".into()));
        }
        if !self.done && self.finish_reason.is_none() {
            return Err(AgentError::Protocol(
                "the stream ended before a finish_reason or [DONE]".into(),
            ));
        }
        let calls = self
            .calls
            .into_values()
            .map(|c| (c.id, c.name, c.arguments));
        Ok(turn(
            self.text,
            calls.collect(),
            self.finish_reason.unwrap_or_else(|| "stop".to_owned()),
            self.usage,
        ))
    }
}

fn turn(
    text: String,
    calls: Vec<(String, String, String)>,
    finish_reason: String,
    usage: Usage,
) -> Turn {
    let mut tool_uses = Vec::new();
    let mut tool_calls = Vec::new();
    for (index, (id, name, arguments)) in calls.into_iter().enumerate() {
        // Some local servers send no id; the history needs one to pair the result.
        let id = if id.is_empty() {
            format!("call_{index}_{}", uuid::Uuid::new_v4().simple())
        } else {
            id
        };
        tool_calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}));
        tool_uses.push(ProposedUse {
            id,
            name,
            input: parse_arguments(&arguments),
        });
    }
    let mut assistant = json!({"role": "assistant", "content": if text.is_empty() { Value::Null } else { json!(text) }});
    if !tool_calls.is_empty() {
        assistant["tool_calls"] = json!(tool_calls);
    }
    Turn {
        assistant,
        tool_uses,
        text,
        stop: Stop::from_openai(&finish_reason),
        stop_reason: finish_reason,
        usage,
    }
}

/// A non-streamed response.
pub fn parse_response(body: &Value) -> Result<Turn, AgentError> {
    if let Some(message) = error_of(body) {
        return Err(AgentError::Provider(message));
    }
    let choice = body
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .ok_or_else(|| AgentError::Protocol("the response has no choices".into()))?;
    let message = &choice["message"];
    let text = message["content"].as_str().unwrap_or_default().to_owned();
    let calls = message
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|c| {
            (
                c["id"].as_str().unwrap_or_default().to_owned(),
                c.pointer("/function/name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                arguments_text(c.pointer("/function/arguments").unwrap_or(&Value::Null)),
            )
        })
        .collect();
    let mut usage = Usage::default();
    if let Some(u) = body.get("usage") {
        read_usage(u, &mut usage);
    }
    let finish = choice["finish_reason"]
        .as_str()
        .unwrap_or("stop")
        .to_owned();
    Ok(turn(text, calls, finish, usage))
}

/// The message of an error body, if it has one.
pub fn error_text(body: &Value) -> Option<String> {
    error_of(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::sse::SseParser;

    fn chunks(deltas: &[Value]) -> String {
        let mut out: String = deltas
            .iter()
            .map(|d| {
                format!(
                    "data: {}\n\n",
                    json!({"id": "c", "object": "chat.completion.chunk", "choices": [d]})
                )
            })
            .collect();
        out.push_str(&format!(
            "data: {}\n\n",
            json!({"id": "c", "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7}})
        ));
        out.push_str("data: [DONE]\n\n");
        out
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
        stream.finish().map(|t| (t, shown))
    }

    #[test]
    fn tool_call_fragments_are_assembled_by_index() {
        let text = chunks(&[
            json!({"index": 0, "delta": {"role": "assistant", "content": "Checking"}, "finish_reason": null}),
            json!({"index": 0, "delta": {"content": " now."}, "finish_reason": null}),
            json!({"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "read_file", "arguments": ""}}]}}),
            json!({"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "list_directory", "arguments": "{\"pa"}}]}}),
            json!({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"path\": \"a"}}]}}),
            json!({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ".txt\"}"}}]}}),
            json!({"index": 0, "delta": {"tool_calls": [{"index": 1, "function": {"arguments": "th\": "}}]}}),
            json!({"index": 0, "delta": {}, "finish_reason": "tool_calls"}),
        ]);
        for size in [1, 5, 33, 100_000] {
            let (turn, shown) = run(&text, size).unwrap();
            assert_eq!(shown, "Checking now.");
            assert_eq!(turn.stop, Stop::ToolUse);
            assert_eq!(
                turn.usage,
                Usage {
                    input_tokens: 11,
                    output_tokens: 7
                }
            );
            assert_eq!(turn.tool_uses.len(), 2);
            assert_eq!(turn.tool_uses[0].id, "call_a");
            assert_eq!(turn.tool_uses[0].input, Ok(json!({"path": "a.txt"})));
            assert_eq!(turn.tool_uses[1].id, "call_b");
            assert!(
                turn.tool_uses[1]
                    .input
                    .clone()
                    .unwrap_err()
                    .contains("not valid JSON")
            );
            assert_eq!(
                turn.assistant,
                json!({"role": "assistant", "content": "Checking now.", "tool_calls": [
                    {"id": "call_a", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"a.txt\"}"}},
                    {"id": "call_b", "type": "function", "function": {"name": "list_directory", "arguments": "{\"path\": "}},
                ]})
            );
        }
    }

    #[test]
    fn finish_reasons_errors_and_plain_responses() {
        for (reason, stop) in [
            ("stop", Stop::EndTurn),
            ("tool_calls", Stop::ToolUse),
            ("length", Stop::MaxTokens),
            ("content_filter", Stop::Refusal),
        ] {
            let body = json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": reason}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}});
            let turn = parse_response(&body).unwrap();
            assert_eq!(turn.stop, stop);
            assert_eq!(
                turn.assistant,
                json!({"role": "assistant", "content": "hi"})
            );
        }
        let body = json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\":\"p\"}"}},
            {"type": "function", "function": {"name": "read_file", "arguments": {"path": "q"}}},
        ]}, "finish_reason": "stop"}]});
        let turn = parse_response(&body).unwrap();
        assert_eq!(turn.tool_uses[0].input, Ok(json!({"path": "p"})));
        assert_eq!(turn.tool_uses[1].input, Ok(json!({"path": "q"})));
        assert!(turn.tool_uses[1].id.starts_with("call_1_"));
        assert_eq!(turn.assistant["content"], Value::Null);

        let err = run(
            "data: {\"error\": {\"message\": \"model overloaded\"}}\n\n",
            4,
        );
        assert_eq!(
            err.unwrap_err(),
            AgentError::Provider("model overloaded".into())
        );
        let err = run(
            "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"x\"}}]}\n\n",
            4,
        );
        assert!(matches!(err.unwrap_err(), AgentError::Protocol(_)));
        assert_eq!(
            results_messages(&[("a".into(), true, vec!["x".into(), "y".into()])]),
            vec![json!({"role": "tool", "tool_call_id": "a", "content": "x\ny"})]
        );
    }
}
