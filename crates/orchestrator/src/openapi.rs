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

fn path_parameter(name: &str) -> Value {
    json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}})
}

fn query_parameter(name: &str, schema: Value, description: &str) -> Value {
    json!({"name": name, "in": "query", "required": false, "schema": schema, "description": description})
}

/// `POST /v1/approvals/{approval_id}/approve` and `.../deny`.
fn decision(approve: bool) -> Value {
    let (verb, id) = if approve {
        ("Approve", "approveApproval")
    } else {
        ("Deny", "denyApproval")
    };
    json!({"post": {
        "operationId": id,
        "summary": format!("{verb} a pending approval (approver role)"),
        "description": "The body is optional. With [approvals] distinct_approver set, the requester cannot decide their own call (403).",
        "parameters": [path_parameter("approval_id")],
        "requestBody": {"required": false, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/DecisionRequest"}}}},
        "responses": with_errors(json!({
            "200": json_response("The decided approval", json!({"$ref": "#/components/schemas/Approval"})),
            "409": error_response("Already decided, or expired"),
        })),
    }})
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
                "operationId": "listTools",
                "summary": "List the tools visible to the caller",
                "parameters": [
                    {"name": "format", "in": "query", "required": false,
                        "schema": {"type": "string", "enum": ["anthropic", "openai", "mcp"], "default": "anthropic"}},
                    query_parameter("strict", json!({"type": "boolean", "default": false}),
                        "With format=openai: OpenAI strict-mode functions (\"strict\": true; every property required, optional ones nullable, maps as lists of {name, value} pairs). Calls may send null for an optional field: it means absent."),
                ],
                "responses": with_errors(json!({"200": json_response("The catalog", json!({
                    "type": "object", "required": ["tools"],
                    "properties": {"tools": {"type": "array", "items": {"type": "object"}}}}))})),
            }},
            "/v1/tool_calls": {"post": {
                "operationId": "callTools",
                "summary": "Run tool calls (Anthropic tool_use blocks, OpenAI Chat tool_calls or Responses function_call items)",
                "description": "Calls run concurrently; results come back in request order. A well-formed request answers 200 even when calls fail; each call's outcome is in calls[].status. Calls still running when wait_ms runs out have a calls[] entry with status \"running\" and no result yet: fetch them with GET /v1/calls/{call_id}.",
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ToolCallsRequest"}}}},
                "responses": with_errors(json!({"200": json_response("Results and per-call metadata", json!({"$ref": "#/components/schemas/ToolCallsResponse"}))})),
            }},
            "/v1/calls/{call_id}": {"get": {
                "operationId": "getCall",
                "summary": "A call's status and, once final, its tool_result",
                "parameters": [
                    {"name": "call_id", "in": "path", "required": true, "schema": {"type": "string"}},
                    {"name": "wait_ms", "in": "query", "required": false, "schema": {"type": "integer", "minimum": 0, "maximum": 600000}}
                ],
                "responses": with_errors(json!({"200": json_response("The call", json!({"$ref": "#/components/schemas/Call"}))})),
            }},
            "/v1/tools/pins": {"get": {
                "operationId": "listToolPins",
                "summary": "Pinned definitions of discovered tools (admin role)",
                "description": "Each tool an external worker or an MCP server lists is pinned by the SHA-256 of its definition when first seen. A later definition that differs is listed as pending and the tool is hidden until an admin accepts it.",
                "responses": with_errors(json!({"200": json_response("The pins", json!({"$ref": "#/components/schemas/ToolPins"}))})),
            }},
            "/v1/tools/{name}/accept": {"post": {
                "operationId": "acceptTool",
                "summary": "Serve a discovered tool's changed definition from now on (admin role)",
                "description": "Pins the pending definition (audited as tool_accepted) and asks the tool's worker group again. 404 when the tool has no pin, 409 when nothing is pending.",
                "parameters": [{"name": "name", "in": "path", "required": true, "schema": {"type": "string"}}],
                "responses": with_errors(json!({"200": json_response("The new pin", json!({"type": "object", "required": ["pin"], "properties": {"pin": {"$ref": "#/components/schemas/ToolPin"}}}))})),
            }},
            "/v1/calls/{call_id}/cancel": {"post": {
                "operationId": "cancelCall",
                "summary": "Cancel a running call (its sandbox is killed)",
                "parameters": [{"name": "call_id", "in": "path", "required": true, "schema": {"type": "string"}}],
                "responses": with_errors(json!({"200": json_response("The call after cancellation", json!({"$ref": "#/components/schemas/Call"}))})),
            }},
            "/v1/approvals": {"get": {
                "operationId": "listApprovals",
                "summary": "Approvals (approver role), oldest first, a page at a time; inputs redacted like audit records",
                "description": "A page holds at most limit approvals and stops early once their inputs add up to 8 MiB. While next_cursor is a string, more follow: pass it as after.",
                "parameters": [
                    query_parameter("status",
                        json!({"type": "string", "enum": ["pending", "approved", "denied", "expired", "all"], "default": "all"}),
                        "Only approvals with this status"),
                    query_parameter("limit", json!({"type": "integer", "minimum": 0, "maximum": 1000, "default": 100}),
                        "At most this many approvals (0: the default; more than 1000: 1000)"),
                    query_parameter("after", json!({"type": "string"}),
                        "The next_cursor of the previous page"),
                ],
                "responses": with_errors(json!({"200": json_response("The approvals", json!({"$ref": "#/components/schemas/ApprovalList"}))})),
            }},
            "/v1/approvals/{approval_id}/approve": decision(true),
            "/v1/approvals/{approval_id}/deny": decision(false),
            "/v1/audit": {"get": {
                "operationId": "readAudit",
                "summary": "Audit events in ascending seq (admin role)",
                "description": "A page holds at most limit events and stops early once their data adds up to 8 MiB (a single larger event comes alone). While next_after is a number, more events follow: pass it as after. With latest=true, next_after is null: the page ends at the newest event.",
                "parameters": [
                    query_parameter("session_id", json!({"type": "string"}), "Only events of this session"),
                    query_parameter("call_id", json!({"type": "string"}), "Only events of this call"),
                    query_parameter("after", json!({"type": "integer", "minimum": 0}), "Only events with seq greater than this"),
                    query_parameter("limit", json!({"type": "integer", "minimum": 0}), "At most this many events (0: the default page size)"),
                    query_parameter("latest", json!({"type": "boolean", "default": false}), "The last limit events instead of the first after `after` (still ascending)"),
                ],
                "responses": with_errors(json!({"200": json_response("The events", json!({"$ref": "#/components/schemas/AuditEvents"}))})),
            }},
            "/v1/audit/verify": {"get": {
                "operationId": "verifyAudit",
                "summary": "Check the audit log's hash chain (admin role)",
                "responses": with_errors(json!({"200": json_response("The verdict", json!({"$ref": "#/components/schemas/AuditVerify"}))})),
            }},
            "/v1/agent/runs": {"post": {
                "operationId": "runAgent",
                "summary": "Run the agent loop with the configured model provider",
                "description": "Streams Server-Sent Events (event: <kind>, data: <JSON object>): run.started, model.text (text deltas), tool.call, tool.pending_approval, tool.result, then run.completed or run.failed (reason max_turns, max_tool_calls, max_seconds or provider_error). Every tool call passes the same gate as /v1/tool_calls. Closing the stream cancels the run and its calls in flight. 503 when the provider cannot be used (e.g. its API key variable is unset). Needs the agent role.",
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/AgentRunRequest"}}}},
                "responses": with_errors(json!({"200": {"description": "The run's events", "content": {"text/event-stream": {"schema": {"type": "string"}}}}})),
            }},
            "/openapi.json": {"get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": with_errors(json!({"200": json_response("OpenAPI 3.1", json!({"type": "object"}))})),
            }},
            "/healthz": {"get": {"operationId": "healthz", "summary": "Process is up", "security": [],
                "responses": {"200": json_response("Up", json!({"type": "object"}))}}},
            "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics (text format 0.0.4)", "security": [],
                "description": "Calls by tool and status, latencies, gate stages, approval wait, store latency, calls in flight, cache hits, refusals, pending approvals, worker replicas by state, and process metrics. Labels name tools, statuses, stages, groups and states only: never a call, principal, session, path or argument.",
                "responses": {"200": {"description": "The metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/readyz": {"get": {"operationId": "readyz", "summary": "Every tool group has a live worker", "security": [],
                "responses": {"200": json_response("Ready", json!({"type": "object"})),
                              "503": json_response("Not ready; workers lists each group's state, replicas each replica's, store the store's kind and the write transactions it committed since start", json!({"type": "object"}))}}},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                "description": "A token from configuration; there is no OAuth flow. airlock up writes its generated token to <data_dir>/token; CLI clients also read AIRLOCK_TOKEN. A 401 carries WWW-Authenticate: Bearer realm=\"airlock\" with error=\"invalid_token\" when a token was sent, and an error_description saying where the token is."}},
            "schemas": {
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                    "type": "object", "required": ["code", "message"],
                    "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}}},
                "ToolUse": {"type": "object", "required": ["id", "name", "input"], "properties": {
                    "type": {"const": "tool_use"}, "id": {"type": "string"}, "name": {"type": "string"},
                    "input": {"type": "object"}}},
                "ToolCallsRequest": {"type": "object", "properties": {
                    "session_id": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                    "wait_ms": {"type": "integer", "minimum": 0, "description": "How long to wait for results (default [limits] default_wait_ms); 0 answers as soon as the gate has checked the calls: pending_approval with approval_id for a held call, running for one on its worker"},
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
                    "approval_id": {"type": "string"}, "duration_ms": {"type": "integer", "description": "Run time (the gate's checks and the worker), without any approval wait"}, "approval_wait_ms": {"type": "integer", "description": "How long the call was held for approval, to the decision"}, "replica": {"type": "string", "description": "The worker replica that ran the call"}, "isolation": {"type": "object"}}},
                "ToolCallsResponse": {"type": "object", "required": ["calls"], "properties": {
                    "tool_results": {"type": "array", "items": {"$ref": "#/components/schemas/ToolResult"}},
                    "messages": {"type": "array", "items": {"type": "object"}},
                    "outputs": {"type": "array", "items": {"type": "object"}},
                    "calls": {"type": "array", "items": {"$ref": "#/components/schemas/CallSummary"}}}},
                "AgentRunRequest": {"type": "object", "required": ["prompt"], "additionalProperties": false, "properties": {
                    "prompt": {"type": "string", "minLength": 1},
                    "session_id": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$", "description": "Default: the session default, as for POST /v1/tool_calls"},
                    "max_turns": {"type": "integer", "minimum": 1, "description": "At most [agent] max_turns"}}},
                "Approval": {"type": "object",
                    "required": ["approval_id", "call_id", "tool", "input", "principal", "session_id", "status", "created_at", "expires_at"],
                    "properties": {
                        "approval_id": {"type": "string"}, "call_id": {"type": "string"}, "tool": {"type": "string"},
                        "input": {"type": "object", "description": "The call's arguments, secrets redacted"},
                        "principal": {"type": "string", "description": "Who made the call"},
                        "session_id": {"type": ["string", "null"]},
                        "status": {"type": "string", "enum": ["pending", "approved", "denied", "expired"]},
                        "created_at": {"type": "string", "format": "date-time"},
                        "expires_at": {"type": "string", "format": "date-time"},
                        "decided_by": {"type": "string"}, "reason": {"type": "string"},
                        "decided_at": {"type": "string", "format": "date-time"}}},
                "ApprovalList": {"type": "object", "required": ["approvals"], "properties": {
                    "approvals": {"type": "array", "items": {"$ref": "#/components/schemas/Approval"}},
                    "next_cursor": {"type": ["string", "null"], "description": "Pass as after for the next page; null on the last page"}}},
                "DecisionRequest": {"type": "object", "properties": {
                    "reason": {"type": ["string", "null"], "maxLength": 4096}}},
                "AuditEvent": {"type": "object", "required": ["seq", "ts", "kind", "data", "prev_hash", "hash"], "properties": {
                    "seq": {"type": "integer", "minimum": 1, "description": "1, 2, 3, ... without gaps"},
                    "ts": {"type": "string", "format": "date-time"},
                    "kind": {"type": "string", "description": "requested, rejected_schema, denied, pending_approval, approved, approval_denied, expired, dispatched, completed, ..."},
                    "call_id": {"type": "string"}, "principal": {"type": "string"}, "session_id": {"type": "string"},
                    "data": {"description": "Event details; arguments redacted"},
                    "prev_hash": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                    "hash": {"type": "string", "pattern": "^[0-9a-f]{64}$"}}},
                "AuditEvents": {"type": "object", "required": ["events", "next_after"], "properties": {
                    "events": {"type": "array", "items": {"$ref": "#/components/schemas/AuditEvent"}},
                    "next_after": {"type": ["integer", "null"], "minimum": 1, "description": "The seq of this page's last event when more events follow it (pass it as after); null on the last page and with latest=true"}}},
                "AuditVerify": {"type": "object", "required": ["ok", "records"], "properties": {
                    "ok": {"type": "boolean"}, "records": {"type": "integer", "minimum": 0},
                    "first_bad_seq": {"type": "integer", "minimum": 1}, "reason": {"type": "string"}}},
                "PinnedDefinition": {"type": "object", "required": ["group", "digest", "definition"], "properties": {
                    "group": {"type": "string"}, "digest": {"type": "string"}, "definition": {"type": "object"}}},
                "ToolPin": {"type": "object", "required": ["tool", "pinned", "pinned_at"], "properties": {
                    "tool": {"type": "string"}, "pinned": {"$ref": "#/components/schemas/PinnedDefinition"},
                    "pinned_at": {"type": "string"}, "accepted_by": {"type": ["string", "null"]},
                    "pending": {"oneOf": [{"$ref": "#/components/schemas/PinnedDefinition"}, {"type": "null"}]},
                    "pending_since": {"type": ["string", "null"]}}},
                "ToolPins": {"type": "object", "required": ["pins"], "properties": {
                    "pins": {"type": "array", "items": {"$ref": "#/components/schemas/ToolPin"}}}},
                "Call": {"allOf": [{"$ref": "#/components/schemas/CallSummary"}, {"type": "object", "properties": {
                    "tool": {"type": "string"}, "tool_result": {"$ref": "#/components/schemas/ToolResult"}}}]},
            },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The router is built from `http_api::route_table`, so this is every route it serves.
    #[test]
    fn every_route_is_documented_and_every_documented_path_is_served() {
        let doc = document();
        let paths = doc["paths"].as_object().unwrap();
        let table = crate::http_api::route_table();
        for (method, path) in &table {
            let operation = &paths
                .get(*path)
                .unwrap_or_else(|| panic!("{path} is not in /openapi.json"))
                [method.as_str().to_ascii_lowercase()];
            assert!(
                operation.is_object(),
                "{method} {path} is not in /openapi.json"
            );
            assert!(operation["responses"]["200"].is_object(), "{method} {path}");
        }
        for (path, item) in paths {
            for method in item.as_object().unwrap().keys() {
                let served = table
                    .iter()
                    .any(|(m, p)| p == path && m.as_str().eq_ignore_ascii_case(method));
                let unauthenticated = matches!(path.as_str(), "/healthz" | "/readyz" | "/metrics");
                assert!(
                    served || unauthenticated,
                    "{method} {path} is documented but not routed"
                );
            }
        }
    }

    /// Every `$ref` points at a schema that exists.
    #[test]
    fn references_resolve() {
        let doc = document();
        fn walk(v: &Value, doc: &Value) {
            match v {
                Value::Object(o) => {
                    if let Some(Value::String(r)) = o.get("$ref") {
                        let pointer = r.strip_prefix('#').unwrap();
                        assert!(doc.pointer(pointer).is_some(), "dangling {r}");
                    }
                    o.values().for_each(|c| walk(c, doc));
                }
                Value::Array(a) => a.iter().for_each(|c| walk(c, doc)),
                _ => {}
            }
        }
        walk(&doc, &doc);
    }
}
