//! The JSON shapes of `/v1`, converted to and from domain types here and nowhere else.
//!
//! `POST /v1/tool_calls` accepts three shapes of the same idea — Anthropic `tool_uses`,
//! OpenAI Chat `tool_calls` and OpenAI Responses `function_calls` — and answers in the
//! shape it was asked in.

use airlock_policy::{SessionId, ToolOutcome};
use serde_json::{Map, Value, json};

use crate::calls::CallRecord;
use crate::catalog::CatalogTool;
use crate::gate::ToolUse;
use crate::json_text::{JsonOut, write_lines, write_str, write_value};

/// Longest `wait_ms` honoured.
pub const MAX_WAIT_MS: u64 = 600_000;

/// Cuts `text` to at most `max_bytes` (and the mark) at a character boundary, marked
/// with `…` where it was cut: a message told to a caller that quotes what the caller
/// sent, or a tool, keeps a bounded size.
/// Whether a caller's id, name or filter holds a control character. Such text names
/// nothing that could exist, and is never sent to the store: PostgreSQL refuses a NUL as
/// text, failing as if it were down. One rule for every door and the gate.
pub fn has_control(text: &str) -> bool {
    text.chars().any(char::is_control)
}

pub fn ellipsize(text: &mut String, max_bytes: usize) {
    if text.len() > max_bytes {
        let mut end = max_bytes;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
}

/// How long `POST /v1/tool_calls` (and gRPC `CallTools`) wait for the calls: `wait_ms`
/// when given, else `default`. `0` is a real value on both doors: answer as soon as the
/// gate's checks are done, with `pending_approval` and the approval id for a held call
/// and `running` for one on its worker.
pub fn wait_for(wait_ms: Option<u64>, default: std::time::Duration) -> std::time::Duration {
    wait_ms
        .map(|ms| std::time::Duration::from_millis(ms.min(MAX_WAIT_MS)))
        .unwrap_or(default)
}

/// A request-level error: a 4xx with `{"error": {"code", "message"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRequest(pub String);

/// Which shape a `POST /v1/tool_calls` body used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Anthropic,
    OpenAiChat,
    OpenAiResponses,
}

/// One proposed call; `input` is an error when the caller sent arguments that are not a
/// JSON object (OpenAI arguments arrive as a string that may not parse).
#[derive(Debug, Clone)]
pub struct ProposedCall {
    pub id: String,
    pub name: String,
    pub input: Result<Value, String>,
}

#[derive(Debug, Clone)]
pub struct ToolCallsRequest {
    pub shape: Shape,
    pub session_id: Option<SessionId>,
    pub wait_ms: Option<u64>,
    pub calls: Vec<ProposedCall>,
}

impl ProposedCall {
    pub fn into_tool_use(self) -> Result<ToolUse, (String, String, String)> {
        match self.input {
            Ok(input) => Ok(ToolUse {
                id: self.id,
                name: self.name,
                input,
            }),
            Err(message) => Err((self.id, self.name, message)),
        }
    }
}

/// Parses and checks a `POST /v1/tool_calls` body.
pub fn parse_tool_calls(body: &Value, max_uses: usize) -> Result<ToolCallsRequest, BadRequest> {
    let Some(object) = body.as_object() else {
        return Err(BadRequest("the request body must be a JSON object".into()));
    };
    let session_id = match object.get("session_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => {
            Some(SessionId::parse(s).map_err(|e| BadRequest(format!("session_id: {e}")))?)
        }
        Some(_) => return Err(BadRequest("session_id must be a string".into())),
    };
    let wait_ms = match object.get("wait_ms") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            BadRequest("wait_ms must be a non-negative integer (milliseconds)".into())
        })?),
    }
    .map(|ms| ms.min(MAX_WAIT_MS));

    let shapes = [
        ("tool_uses", Shape::Anthropic),
        ("tool_calls", Shape::OpenAiChat),
        ("function_calls", Shape::OpenAiResponses),
    ];
    let present: Vec<_> = shapes
        .iter()
        .filter(|(key, _)| object.contains_key(*key))
        .collect();
    let (key, shape) = match present.as_slice() {
        [one] => **one,
        [] => {
            return Err(BadRequest(
                "the body needs \"tool_uses\" (Anthropic), \"tool_calls\" (OpenAI Chat) or \"function_calls\" (OpenAI Responses)".into(),
            ));
        }
        _ => {
            return Err(BadRequest(
                "send only one of tool_uses, tool_calls, function_calls".into(),
            ));
        }
    };
    let Some(items) = object.get(key).and_then(Value::as_array) else {
        return Err(BadRequest(format!("{key} must be an array")));
    };
    if items.is_empty() {
        return Err(BadRequest(format!("{key} must not be empty")));
    }
    if items.len() > max_uses {
        return Err(BadRequest(format!(
            "{key} has {} entries; at most {max_uses} per request",
            items.len()
        )));
    }
    let mut calls = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let at = |field: &str| format!("{key}[{index}].{field}");
        let Some(item) = item.as_object() else {
            return Err(BadRequest(format!("{key}[{index}] must be an object")));
        };
        let call = match shape {
            Shape::Anthropic => {
                expect_type(item, "tool_use", &at("type"))?;
                let input = match item.get("input") {
                    Some(v @ Value::Object(_)) => Ok(v.clone()),
                    Some(_) => {
                        return Err(BadRequest(format!("{} must be a JSON object", at("input"))));
                    }
                    None => return Err(BadRequest(format!("{} is required", at("input")))),
                };
                ProposedCall {
                    id: string(item, "id", &at("id"))?,
                    name: string(item, "name", &at("name"))?,
                    input,
                }
            }
            Shape::OpenAiChat => {
                expect_type(item, "function", &at("type"))?;
                let Some(function) = item.get("function").and_then(Value::as_object) else {
                    return Err(BadRequest(format!("{} must be an object", at("function"))));
                };
                ProposedCall {
                    id: string(item, "id", &at("id"))?,
                    name: string(function, "name", &at("function.name"))?,
                    input: arguments(function.get("arguments"), &at("function.arguments"))?,
                }
            }
            Shape::OpenAiResponses => {
                expect_type(item, "function_call", &at("type"))?;
                ProposedCall {
                    id: string(item, "call_id", &at("call_id"))?,
                    name: string(item, "name", &at("name"))?,
                    input: arguments(item.get("arguments"), &at("arguments"))?,
                }
            }
        };
        if calls.iter().any(|c: &ProposedCall| c.id == call.id) {
            return Err(BadRequest(format!(
                "{} {:?} is used twice; ids must be unique",
                at("id"),
                call.id
            )));
        }
        calls.push(call);
    }
    Ok(ToolCallsRequest {
        shape,
        session_id,
        wait_ms,
        calls,
    })
}

fn expect_type(item: &Map<String, Value>, expected: &str, at: &str) -> Result<(), BadRequest> {
    match item.get("type") {
        None => Ok(()),
        Some(Value::String(t)) if t == expected => Ok(()),
        Some(_) => Err(BadRequest(format!("{at} must be {expected:?}"))),
    }
}

fn string(item: &Map<String, Value>, field: &str, at: &str) -> Result<String, BadRequest> {
    match item.get(field) {
        Some(Value::String(s)) if has_control(s) => Err(BadRequest(format!(
            "{at} must not contain control characters"
        ))),
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 256 => Ok(s.clone()),
        Some(Value::String(_)) => Err(BadRequest(format!("{at} must be 1 to 256 characters"))),
        Some(_) => Err(BadRequest(format!("{at} must be a string"))),
        None => Err(BadRequest(format!("{at} is required"))),
    }
}

/// OpenAI sends arguments as a JSON string that the model wrote and that may not parse:
/// that is the model's mistake, answered with an error result, not a 400.
fn arguments(value: Option<&Value>, at: &str) -> Result<Result<Value, String>, BadRequest> {
    match value {
        None => Ok(Ok(Value::Object(Map::new()))),
        Some(Value::String(text)) => Ok(match serde_json::from_str::<Value>(text) {
            Ok(v @ Value::Object(_)) => Ok(v),
            Ok(_) => Err("arguments must be a JSON object; send the arguments as an object encoded as a JSON string".into()),
            Err(e) => Err(format!("arguments are not valid JSON ({e}); send the arguments as a JSON object encoded as a string")),
        }),
        Some(v @ Value::Object(_)) => Ok(Ok(v.clone())),
        Some(_) => Err(BadRequest(format!("{at} must be a JSON string"))),
    }
}

/// The text of an outcome as one string (OpenAI shapes carry a single string).
#[cfg(test)]
fn joined_text(outcome: &ToolOutcome) -> String {
    outcome.content.join("\n")
}

/// `calls[]` entry.
pub fn call_summary(record: &CallRecord) -> Value {
    let mut entry = json!({
        "tool_use_id": record.tool_use_id,
        "call_id": record.call_id,
        "status": record.status.as_str(),
    });
    if let Some(approval) = &record.approval_id {
        entry["approval_id"] = json!(approval);
    }
    if let Some(ms) = record.duration_ms {
        entry["duration_ms"] = json!(ms);
    }
    if let Some(ms) = record.approval_wait_ms {
        entry["approval_wait_ms"] = json!(ms);
    }
    if let Some(replica) = &record.replica {
        // Which worker replica ran it (DESIGN §9): where to look when one misbehaves.
        entry["replica"] = json!(replica);
    }
    if let Some(isolation) = record.isolation() {
        entry["isolation"] = isolation.clone();
    }
    entry
}

/// An Anthropic `tool_result` block.
pub fn anthropic_result(tool_use_id: &str, outcome: &ToolOutcome) -> Value {
    let content: Vec<Value> = outcome
        .content
        .iter()
        .map(|text| json!({"type": "text", "text": text}))
        .collect();
    json!({
        "type": "tool_result",
        "tool_use_id": tool_use_id,
        "content": content,
        "is_error": outcome.is_error,
    })
}

/// [`anthropic_result`]'s bytes, written without building the `Value`.
fn write_anthropic_result(tool_use_id: &str, outcome: &ToolOutcome, out: &mut impl JsonOut) {
    out.put(b"{\"type\":\"tool_result\",\"tool_use_id\":");
    write_str(tool_use_id, out);
    out.put(b",\"content\":[");
    for (j, text) in outcome.content.iter().enumerate() {
        if j > 0 {
            out.put_byte(b',');
        }
        out.put(b"{\"type\":\"text\",\"text\":");
        write_str(text, out);
        out.put_byte(b'}');
    }
    out.put(b"],\"is_error\":");
    out.put(if outcome.is_error { b"true" } else { b"false" });
    out.put_byte(b'}');
}

/// The response body of `POST /v1/tool_calls`, in the request's shape, written straight
/// to JSON bytes: what `serde_json::to_vec` writes of the same answer built as a `Value`
/// (`tool_calls_response`, the reference it is tested against), without copying each
/// result's text into that `Value` first (a 1 MiB result was copied once more for that).
/// Calls that are not final yet have a `calls` entry but no result.
pub fn write_tool_calls_response(shape: Shape, records: &[CallRecord], out: &mut impl JsonOut) {
    let key: &[u8] = match shape {
        Shape::Anthropic => b"{\"tool_results\":[",
        Shape::OpenAiChat => b"{\"messages\":[",
        Shape::OpenAiResponses => b"{\"outputs\":[",
    };
    out.put(key);
    let finished = records
        .iter()
        .filter(|r| r.status.is_final())
        .filter_map(|r| r.result.as_deref().map(|outcome| (r, outcome)));
    for (i, (record, outcome)) in finished.enumerate() {
        if i > 0 {
            out.put_byte(b',');
        }
        match shape {
            Shape::Anthropic => write_anthropic_result(&record.tool_use_id, outcome, out),
            Shape::OpenAiChat => {
                out.put(b"{\"role\":\"tool\",\"tool_call_id\":");
                write_str(&record.tool_use_id, out);
                out.put(b",\"content\":");
                write_lines(&outcome.content, out);
                out.put_byte(b'}');
            }
            Shape::OpenAiResponses => {
                out.put(b"{\"type\":\"function_call_output\",\"call_id\":");
                write_str(&record.tool_use_id, out);
                out.put(b",\"output\":");
                write_lines(&outcome.content, out);
                out.put_byte(b'}');
            }
        }
    }
    out.put(b"],\"calls\":[");
    for (i, record) in records.iter().enumerate() {
        if i > 0 {
            out.put_byte(b',');
        }
        write_value(&call_summary(record), out);
    }
    out.put(b"]}");
}

/// The response body of `POST /v1/tool_calls` as a `Value`, in the request's shape:
/// the reference [`write_tool_calls_response`] is tested against.
#[cfg(test)]
pub fn tool_calls_response(shape: Shape, records: &[CallRecord]) -> Value {
    let calls: Vec<Value> = records.iter().map(call_summary).collect();
    let finished = records
        .iter()
        .filter(|r| r.status.is_final())
        .filter_map(|r| r.result.as_ref().map(|outcome| (r, outcome)));
    match shape {
        Shape::Anthropic => {
            let results: Vec<Value> = finished
                .map(|(r, o)| anthropic_result(&r.tool_use_id, o))
                .collect();
            json!({"tool_results": results, "calls": calls})
        }
        Shape::OpenAiChat => {
            let messages: Vec<Value> = finished
                .map(|(r, o)| json!({"role": "tool", "tool_call_id": r.tool_use_id, "content": joined_text(o)}))
                .collect();
            json!({"messages": messages, "calls": calls})
        }
        Shape::OpenAiResponses => {
            let outputs: Vec<Value> = finished
                .map(|(r, o)| json!({"type": "function_call_output", "call_id": r.tool_use_id, "output": joined_text(o)}))
                .collect();
            json!({"outputs": outputs, "calls": calls})
        }
    }
}

/// `GET /v1/calls/{id}` as a `Value` (the console's call page; the reference
/// [`write_call_detail`] is tested against).
pub fn call_detail(record: &CallRecord) -> Value {
    let mut body = call_detail_head(record);
    if let Some(outcome) = final_result(record) {
        body["tool_result"] = anthropic_result(&record.tool_use_id, outcome);
    }
    body
}

/// [`call_detail`] without its result, which is its last member.
fn call_detail_head(record: &CallRecord) -> Value {
    let mut body = call_summary(record);
    body["tool"] = json!(record.tool);
    body
}

/// The result a call's detail shows: only a final call's.
fn final_result(record: &CallRecord) -> Option<&ToolOutcome> {
    record
        .result
        .as_deref()
        .filter(|_| record.status.is_final())
}

/// The data of a `call.completed` event (`POST /v1/tool_calls?stream=true`),
/// `{"call": <calls[] entry>, "tool_result": <block or null>}`, written straight from the
/// record like [`write_call_detail`].
pub fn write_call_completed(record: &CallRecord, out: &mut impl JsonOut) {
    out.put(b"{\"call\":");
    write_value(&call_summary(record), out);
    out.put(b",\"tool_result\":");
    match record.result.as_deref() {
        Some(outcome) => write_anthropic_result(&record.tool_use_id, outcome, out),
        None => out.put(b"null"),
    }
    out.put_byte(b'}');
}

/// The body of `GET /v1/calls/{id}` written straight to JSON bytes: what serde_json
/// writes of [`call_detail`], without copying the result's text into a `Value` first.
pub fn write_call_detail(record: &CallRecord, out: &mut impl JsonOut) {
    let mut head = Vec::with_capacity(256);
    write_value(&call_detail_head(record), &mut head);
    // The head is an object: all of it but its closing brace, then the result.
    head.pop();
    out.put(&head);
    if let Some(outcome) = final_result(record) {
        out.put(b",\"tool_result\":");
        write_anthropic_result(&record.tool_use_id, outcome, out);
    }
    out.put_byte(b'}');
}

/// The catalog in one of the shapes `GET /v1/tools?format=` offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CatalogFormat {
    Anthropic,
    OpenAi,
    /// `?format=openai&strict=true`: OpenAI Chat functions with `"strict": true` and the
    /// strict-mode variant of each schema (see [`crate::strict`]).
    OpenAiStrict,
    Mcp,
}

impl CatalogFormat {
    pub fn parse(value: Option<&str>) -> Result<Self, BadRequest> {
        match value {
            None | Some("anthropic") => Ok(CatalogFormat::Anthropic),
            Some("openai") => Ok(CatalogFormat::OpenAi),
            Some("mcp") => Ok(CatalogFormat::Mcp),
            Some(other) => Err(BadRequest(format!(
                "format {other:?} is not one of anthropic, openai, mcp"
            ))),
        }
    }

    /// `?format=` together with `?strict=`.
    pub fn from_query(format: Option<&str>, strict: Option<&str>) -> Result<Self, BadRequest> {
        let format = Self::parse(format)?;
        let strict = match strict {
            None | Some("false") | Some("0") => false,
            Some("true") | Some("1") => true,
            Some(_) => return Err(BadRequest("strict must be true or false".into())),
        };
        match (format, strict) {
            (format, false) => Ok(format),
            (CatalogFormat::OpenAi, true) => Ok(CatalogFormat::OpenAiStrict),
            (_, true) => Err(BadRequest(
                "strict=true is offered with format=openai only".into(),
            )),
        }
    }
}

pub fn catalog_entry(tool: &CatalogTool, format: CatalogFormat) -> Value {
    let d = &tool.definition;
    match format {
        CatalogFormat::Anthropic => json!({
            "name": d.name,
            "description": d.description,
            "input_schema": d.input_schema,
        }),
        CatalogFormat::OpenAi => json!({
            "type": "function",
            "function": {"name": d.name, "description": d.description, "parameters": d.input_schema},
        }),
        // A tool whose schema has no strict equivalent is still listed, as a non-strict
        // function: OpenAI takes strict and non-strict functions side by side.
        CatalogFormat::OpenAiStrict => match &tool.strict_schema {
            Ok(schema) => json!({
                "type": "function",
                "function": {"name": d.name, "description": d.description, "parameters": schema, "strict": true},
            }),
            Err(_) => json!({
                "type": "function",
                "function": {"name": d.name, "description": d.description, "parameters": d.input_schema, "strict": false},
            }),
        },
        CatalogFormat::Mcp => json!({
            "name": d.name,
            "title": d.title,
            "description": d.description,
            "inputSchema": d.input_schema,
            "annotations": {
                "title": d.title,
                "readOnlyHint": d.annotations.read_only,
                "destructiveHint": d.annotations.destructive,
                "idempotentHint": d.annotations.idempotent,
                "openWorldHint": d.annotations.open_world,
            },
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anthropic_body_is_checked_field_by_field() {
        let ok = json!({"tool_uses": [{"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "a"}}]});
        let parsed = parse_tool_calls(&ok, 8).unwrap();
        assert_eq!(parsed.shape, Shape::Anthropic);
        assert_eq!(parsed.calls[0].name, "read_file");

        let cases = [
            (json!([]), "JSON object"),
            (json!({}), "tool_uses"),
            (json!({"tool_uses": []}), "must not be empty"),
            (json!({"tool_uses": {}}), "must be an array"),
            (json!({"tool_uses": [1]}), "tool_uses[0] must be an object"),
            (
                json!({"tool_uses": [{"id": "a", "name": "x"}]}),
                "tool_uses[0].input is required",
            ),
            (
                json!({"tool_uses": [{"id": "a", "name": "x", "input": []}]}),
                "must be a JSON object",
            ),
            (
                json!({"tool_uses": [{"id": 1, "name": "x", "input": {}}]}),
                "tool_uses[0].id must be a string",
            ),
            (
                json!({"tool_uses": [{"type": "text", "id": "a", "name": "x", "input": {}}]}),
                "type",
            ),
            (
                json!({"tool_uses": [{"id": "a", "name": "x", "input": {}}, {"id": "a", "name": "x", "input": {}}]}),
                "twice",
            ),
            (
                json!({"session_id": "../x", "tool_uses": [{"id": "a", "name": "x", "input": {}}]}),
                "session_id",
            ),
            (
                json!({"wait_ms": -1, "tool_uses": [{"id": "a", "name": "x", "input": {}}]}),
                "wait_ms",
            ),
        ];
        for (body, needle) in cases {
            let err = parse_tool_calls(&body, 8).unwrap_err();
            assert!(err.0.contains(needle), "{body}: {err:?} lacks {needle:?}");
        }
    }

    #[test]
    fn wait_ms_zero_is_a_real_value_and_absence_is_the_default() {
        use std::time::Duration;
        let default = Duration::from_secs(60);
        assert_eq!(wait_for(None, default), default);
        assert_eq!(wait_for(Some(0), default), Duration::ZERO);
        assert_eq!(wait_for(Some(2_000), default), Duration::from_secs(2));
        assert_eq!(
            wait_for(Some(u64::MAX), default),
            Duration::from_millis(MAX_WAIT_MS)
        );
        let body = json!({"wait_ms": 0, "tool_uses": [{"type": "tool_use", "id": "a", "name": "x", "input": {}}]});
        assert_eq!(parse_tool_calls(&body, 8).unwrap().wait_ms, Some(0));
    }

    #[test]
    fn openai_arguments_that_do_not_parse_become_error_results() {
        let body = json!({"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{not json"}}]});
        let parsed = parse_tool_calls(&body, 8).unwrap();
        assert_eq!(parsed.shape, Shape::OpenAiChat);
        assert!(parsed.calls[0].input.is_err());
        let body = json!({"function_calls": [{"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": "{\"path\":\"a\"}"}]});
        let parsed = parse_tool_calls(&body, 8).unwrap();
        assert_eq!(parsed.calls[0].input.as_ref().unwrap()["path"], "a");
    }

    /// The answer written straight to bytes is the answer built as a `Value` and written
    /// by serde_json, for every shape: finished calls with one, several or no text
    /// blocks, text that needs escapes, errors, a call held for approval (no result), a
    /// call still running whose result is not final, and no call finished at all; and
    /// likewise each call's `GET /v1/calls/{id}` answer and `call.completed` event, and
    /// the chunked answer.
    #[test]
    fn the_written_answer_is_serde_jsons_answer() {
        use airlock_policy::CallStatus;
        use std::sync::Arc;
        let finished = |id: &str, status: CallStatus, outcome: ToolOutcome| {
            let mut r = CallRecord::running(&format!("call_{id}"), id, "read_file", "alice");
            r.status = status;
            r.duration_ms = Some(12);
            r.replica = Some("fs-0".into());
            r.result = Some(Arc::new(outcome));
            r.checked = true;
            r
        };
        let mut held = CallRecord::running("call_h", "t\"h", "execute_shell", "alice");
        held.status = CallStatus::PendingApproval;
        held.approval_id = Some("apr_1".into());
        let mut running = finished("r", CallStatus::Running, ToolOutcome::text("partial"));
        running.status = CallStatus::Running;
        let several = ToolOutcome {
            is_error: false,
            content: vec![
                "line one\nline two".into(),
                String::new(),
                "quote \" backslash \\ tab \t nul \u{0} é 漢".into(),
                "x".repeat(10_000),
            ],
            isolation: Some(json!({"landlock": true, "seccomp": "strict"})),
            timed_out: false,
        };
        let empty = ToolOutcome {
            content: Vec::new(),
            ..ToolOutcome::text("")
        };
        let batches = [
            vec![finished("a", CallStatus::Ok, ToolOutcome::text("hello"))],
            vec![
                finished("b", CallStatus::Ok, several),
                held.clone(),
                finished(
                    "c",
                    CallStatus::Error,
                    ToolOutcome::error("no such file: \"x\""),
                ),
                running,
                finished("d", CallStatus::Ok, empty),
            ],
            vec![held],
        ];
        for shape in [Shape::Anthropic, Shape::OpenAiChat, Shape::OpenAiResponses] {
            for records in &batches {
                let mut written = Vec::new();
                write_tool_calls_response(shape, records, &mut written);
                let reference = serde_json::to_vec(&tool_calls_response(shape, records)).unwrap();
                let mut chunked = crate::json_text::ChunkedBody::default();
                write_tool_calls_response(shape, records, &mut chunked);
                assert_eq!(chunked.chunks().concat(), written, "{shape:?}");
                for record in records {
                    let mut completed = Vec::new();
                    write_call_completed(record, &mut completed);
                    let tool_result = record
                        .result
                        .as_ref()
                        .map(|o| anthropic_result(&record.tool_use_id, o));
                    let reference =
                        json!({"call": call_summary(record), "tool_result": tool_result});
                    assert_eq!(completed, serde_json::to_vec(&reference).unwrap());
                    let mut detail = Vec::new();
                    write_call_detail(record, &mut detail);
                    let reference = serde_json::to_vec(&call_detail(record)).unwrap();
                    assert_eq!(
                        String::from_utf8(detail).unwrap(),
                        String::from_utf8(reference).unwrap()
                    );
                }
                assert_eq!(
                    String::from_utf8(written).unwrap(),
                    String::from_utf8(reference).unwrap(),
                    "{shape:?}"
                );
            }
        }
    }
}
