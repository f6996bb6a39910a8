//! The OpenAPI 3.1 description of the HTTP API.

use serde_json::{Value, json};

fn error_response(description: &str) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
}

fn json_response(description: &str, schema: Value) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": schema}}})
}

fn standard_errors() -> Value {
    json!({
        "400": error_response("Malformed request; the message says what to change"),
        "401": error_response("Missing or invalid bearer token"),
        "403": error_response("The principal lacks the role this needs"),
        "404": error_response("Unknown resource"),
        "413": error_response("Request body over the size limit"),
        "429": error_response("Rate limited; see Retry-After"),
        "503": error_response("A dependency (store, worker) is unavailable"),
    })
}

fn with_errors(mut responses: Value) -> Value {
    if let (Some(target), Value::Object(errors)) = (responses.as_object_mut(), standard_errors()) {
        for (code, response) in errors {
            target.entry(code).or_insert(response);
        }
    }
    responses
}

pub fn document() -> Value {
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Airlock",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Runs the tool calls of LLM agents: authenticates the caller, validates the arguments against the tool's JSON Schema, dispatches to a sandboxed worker and returns a tool_result.",
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/tools": {"get": {
                "summary": "List the tools visible to the caller",
                "parameters": [{"name": "format", "in": "query", "required": false,
                    "schema": {"type": "string", "enum": ["anthropic", "openai", "mcp"], "default": "anthropic"}}],
                "responses": with_errors(json!({"200": json_response("The catalog", json!({
                    "type": "object", "required": ["tools"],
                    "properties": {"tools": {"type": "array", "items": {"type": "object"}}}}))})),
            }},
            "/v1/tool_calls": {"post": {
                "summary": "Run tool calls (Anthropic tool_use blocks, OpenAI Chat tool_calls or Responses function_call items)",
                "description": "Calls run concurrently; results come back in request order. A well-formed request answers 200 even when calls fail; each call's outcome is in calls[].status. Calls still running when wait_ms runs out have a calls[] entry with status \"running\" and no result yet: fetch them with GET /v1/calls/{call_id}.",
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ToolCallsRequest"}}}},
                "responses": with_errors(json!({"200": json_response("Results and per-call metadata", json!({"$ref": "#/components/schemas/ToolCallsResponse"}))})),
            }},
            "/v1/calls/{call_id}": {"get": {
                "summary": "A call's status and, once final, its tool_result",
                "parameters": [
                    {"name": "call_id", "in": "path", "required": true, "schema": {"type": "string"}},
                    {"name": "wait_ms", "in": "query", "required": false, "schema": {"type": "integer", "minimum": 0, "maximum": 600000}}
                ],
                "responses": with_errors(json!({"200": json_response("The call", json!({"$ref": "#/components/schemas/Call"}))})),
            }},
            "/v1/calls/{call_id}/cancel": {"post": {
                "summary": "Cancel a running call (its sandbox is killed)",
                "parameters": [{"name": "call_id", "in": "path", "required": true, "schema": {"type": "string"}}],
                "responses": with_errors(json!({"200": json_response("The call after cancellation", json!({"$ref": "#/components/schemas/Call"}))})),
            }},
            "/v1/agent/runs": {"post": {
                "summary": "Run the agent loop with the configured model provider",
                "description": "Streams Server-Sent Events (event: <kind>, data: <JSON object>): run.started, model.text (text deltas), tool.call, tool.pending_approval, tool.result, then run.completed or run.failed (reason max_turns, max_tool_calls, max_seconds or provider_error). Every tool call passes the same gate as /v1/tool_calls. Closing the stream cancels the run and its calls in flight. 503 when the provider cannot be used (e.g. its API key variable is unset). Needs the agent role.",
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/AgentRunRequest"}}}},
                "responses": with_errors(json!({"200": {"description": "The run's events", "content": {"text/event-stream": {"schema": {"type": "string"}}}}})),
            }},
            "/healthz": {"get": {"summary": "Process is up", "security": [],
                "responses": {"200": json_response("Up", json!({"type": "object"}))}}},
            "/readyz": {"get": {"summary": "Every tool group has a live worker", "security": [],
                "responses": {"200": json_response("Ready", json!({"type": "object"})),
                              "503": json_response("Not ready; workers lists each group's state", json!({"type": "object"}))}}},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                    "type": "object", "required": ["code", "message"],
                    "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}}},
                "ToolUse": {"type": "object", "required": ["id", "name", "input"], "properties": {
                    "type": {"const": "tool_use"}, "id": {"type": "string"}, "name": {"type": "string"},
                    "input": {"type": "object"}}},
                "ToolCallsRequest": {"type": "object", "properties": {
                    "session_id": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                    "wait_ms": {"type": "integer", "minimum": 0},
                    "tool_uses": {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/ToolUse"}},
                    "tool_calls": {"type": "array", "minItems": 1, "description": "OpenAI Chat Completions tool_calls"},
                    "function_calls": {"type": "array", "minItems": 1, "description": "OpenAI Responses function_call items"}}},
                "ToolResult": {"type": "object", "required": ["type", "tool_use_id", "content", "is_error"], "properties": {
                    "type": {"const": "tool_result"}, "tool_use_id": {"type": "string"},
                    "content": {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}},
                    "is_error": {"type": "boolean"}}},
                "CallSummary": {"type": "object", "required": ["tool_use_id", "call_id", "status"], "properties": {
                    "tool_use_id": {"type": "string"}, "call_id": {"type": "string"},
                    "status": {"type": "string", "enum": ["running", "ok", "error", "denied", "pending_approval", "timeout", "cancelled"]},
                    "approval_id": {"type": "string"}, "duration_ms": {"type": "integer"}, "isolation": {"type": "object"}}},
                "ToolCallsResponse": {"type": "object", "required": ["calls"], "properties": {
                    "tool_results": {"type": "array", "items": {"$ref": "#/components/schemas/ToolResult"}},
                    "messages": {"type": "array", "items": {"type": "object"}},
                    "outputs": {"type": "array", "items": {"type": "object"}},
                    "calls": {"type": "array", "items": {"$ref": "#/components/schemas/CallSummary"}}}},
                "AgentRunRequest": {"type": "object", "required": ["prompt"], "additionalProperties": false, "properties": {
                    "prompt": {"type": "string", "minLength": 1},
                    "session_id": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$", "description": "Default: a fresh session agent-<uuid>"},
                    "max_turns": {"type": "integer", "minimum": 1, "description": "At most [agent] max_turns"}}},
                "Call": {"allOf": [{"$ref": "#/components/schemas/CallSummary"}, {"type": "object", "properties": {
                    "tool": {"type": "string"}, "tool_result": {"$ref": "#/components/schemas/ToolResult"}}}]},
            },
        },
    })
}
