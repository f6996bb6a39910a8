//! The MCP front door: `/mcp`, Model Context Protocol over Streamable HTTP (`rmcp`).
//!
//! `tools/list` answers the principal's visible catalog (names, titles, schemas and the
//! `readOnlyHint`/`destructiveHint`/`idempotentHint`/`openWorldHint` annotations);
//! `tools/call` goes through the same gate as `POST /v1/tool_calls`: schema errors,
//! policy denials, budget refusals and tool failures come back as `isError: true`
//! results whose text the model can act on.
//!
//! Decisions:
//! - **Stateless transport.** rmcp serves every POST on its own (no `Mcp-Session-Id`,
//!   nothing kept in memory between requests). Any orchestrator replica can answer any
//!   request (no sticky sessions behind a Kubernetes Service), it is the only mode of
//!   the 2026-07-28 protocol revision, and a request's response stream *is* the call:
//!   when the client closes it, rmcp cancels the request and the gate call is cancelled
//!   (its sandbox killed, a pending approval withdrawn). Each `tools/call` response is an
//!   SSE stream (keep-alive comments every few seconds, so a vanished client is noticed).
//! - **Cancellation notices.** Stateless rmcp drops notifications, so this module reads
//!   `notifications/cancelled` itself before handing the request on: it cancels the
//!   caller's in-flight call with that JSON-RPC `requestId` (calls are matched by
//!   principal and request id; an ambiguous match cancels nothing).
//! - **Airlock session.** A client picks its session (and so its workspace,
//!   `<workspaces_root>/<principal>/<session>`) with `?session_id=` on the URL, e.g.
//!   `http://127.0.0.1:7070/mcp?session_id=refactor-42`; such calls count against the
//!   session budgets like `/v1` calls that name a `session_id`. Without it calls use the
//!   session `default`. The MCP session id is not used: it is a transport detail that
//!   changes on every reconnect (and is gone in the 2026-07-28 revision), which would
//!   scatter one user's files over throwaway workspaces.
//! - **Pending approvals.** A call that needs approval waits while its request is open,
//!   with a progress notification naming the approval sent as soon as it is held. After
//!   `[limits] mcp_wait_ms` (3 s by default — its own key, not `default_wait_ms`: MCP
//!   clients time requests out themselves, openai-agents after 5 s and MCP Inspector
//!   after 60 s, and a client that times out first never sees how to approve) the
//!   request answers an `isError` result naming the approval id and `airlock approvals
//!   approve <id>`; the call keeps waiting for the decision and its result is then at
//!   `GET /v1/calls/{call_id}`. A request that ends *before* that answer — cancelled
//!   with `notifications/cancelled`, or its connection dropped — was the call's only
//!   waiter, so the call is cancelled and its approval withdrawn (decided by
//!   `system:cancelled`) rather than left pending for nobody.
//! - **Progress.** When the request carries `_meta.progressToken`, every worker event is
//!   forwarded as `notifications/progress`: worker progress as is, and each chunk of
//!   output (`execute_shell`'s stdout/stderr while it runs) as a notification whose
//!   `message` is `[stdout] <text>`.
//! - **Authentication and DNS rebinding.** The same bearer tokens as `/v1` (401 JSON
//!   error without a valid one). A request that carries an `Origin` header must come
//!   from a loopback origin (`http(s)://localhost`, `127.0.0.1`, `[::1]`, any port) or
//!   from one listed in `AIRLOCK_MCP_ALLOWED_ORIGINS` (comma-separated, e.g.
//!   `https://console.example.com,http://tools.internal:*`); any other `Origin` gets
//!   403. Requests without `Origin` (every non-browser client) pass. rmcp's own `Host`
//!   allow-list is off: in Kubernetes the orchestrator is reached by service names, and
//!   the bearer token plus the `Origin` check are what keep browsers out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_policy::{CallStatus, SessionId};
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use rmcp::model::{
    CacheScope, CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock,
    Implementation, ListToolsResult, PaginatedRequestParams, ProgressNotificationParam,
    ProgressToken, RequestId, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde_json::{Value, json};

use crate::auth::Principal;
use crate::authn::{AuthLayer, JsonRefusal};
use crate::calls::CallRecord;
use crate::dispatch::WorkerEvent;
use crate::gate::ToolUse;
use crate::http_api::{ApiError, HttpState};
use crate::service::{AdmitError, Batch, OnDrop, Update};
use crate::wire::{self, CatalogFormat};

/// The path of the MCP endpoint.
pub const PATH: &str = "/mcp";
/// Extra origins allowed besides the loopback ones (comma-separated).
pub const ALLOWED_ORIGINS_ENV: &str = "AIRLOCK_MCP_ALLOWED_ORIGINS";
/// How often an open response stream carries a keep-alive (and notices a gone client).
const KEEP_ALIVE: Duration = Duration::from_secs(5);
/// Longest text of one progress notification.
const MAX_PROGRESS_MESSAGE: usize = 8 * 1024;

/// The `/mcp` routes, with their own Origin check and authentication.
pub fn router<S>(state: HttpState) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    let inflight = Arc::new(Inflight::default());
    let origins = Arc::new(AllowedOrigins::from_env());
    let max_body = usize::try_from(state.gate.limits().max_request_bytes).unwrap_or(usize::MAX);
    let handler = AirlockMcp {
        state: state.clone(),
        inflight: inflight.clone(),
    };
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(false)
        .with_sse_keep_alive(Some(KEEP_ALIVE))
        .with_max_request_body_bytes(max_body)
        .disable_allowed_hosts()
        .disable_allowed_origins();
    let service = StreamableHttpService::new(
        move || Ok(handler.clone()),
        Arc::new(NeverSessionManager::default()),
        config,
    );
    let guard = Guard {
        state,
        inflight,
        origins,
        max_body,
    };
    let principals = guard.state.principals.clone();
    let origins = guard.origins.clone();
    // Outermost first: the front-door span, the origin check, authentication, then the
    // session and `notifications/cancelled`.
    Router::new()
        .route_service(PATH, service)
        .layer(middleware::from_fn_with_state(guard, check_request))
        .layer(AuthLayer::new(principals, JsonRefusal))
        .layer(middleware::from_fn_with_state(origins, check_origin))
        .layer(crate::traces::FrontDoorLayer(crate::traces::Door::Http))
}

/// Refuses a browser request from an origin that is not allowed, before anything else.
async fn check_origin(
    State(origins): State<Arc<AllowedOrigins>>,
    request: Request,
    next: Next,
) -> Response {
    if let Err(e) = origins.check(request.headers()) {
        return e.into_response();
    }
    next.run(request).await
}

/// What the request guard needs.
#[derive(Clone)]
struct Guard {
    state: HttpState,
    inflight: Arc<Inflight>,
    origins: Arc<AllowedOrigins>,
    max_body: usize,
}

/// The Airlock session a request chose with `?session_id=`.
#[derive(Debug, Clone)]
struct ChosenSession {
    session: SessionId,
    named: bool,
}

/// Session choice and `notifications/cancelled`, for an authenticated request.
async fn check_request(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    let Some(principal) = request.extensions().get::<Principal>().cloned() else {
        // Fail closed: the route is always wrapped in the authentication layer.
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "the request reached /mcp without authentication",
        )
        .into_response();
    };
    let chosen = match session_from_query(request.uri()) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let session = chosen.session.clone();
    let (mut parts, body) = request.into_parts();
    parts.extensions.insert(principal.clone());
    parts.extensions.insert(chosen);
    let body = if parts.method == Method::POST {
        let limit = u64::try_from(guard.max_body).unwrap_or(u64::MAX);
        let read = crate::body::read_capped(&parts.headers, body, limit, "send smaller arguments");
        let bytes = match read.await {
            Ok(b) => b,
            Err(e) => return e.into_response(),
        };
        for request_id in cancelled_request_ids(&bytes) {
            guard
                .inflight
                .cancel(&guard.state, &principal.name, &session, &request_id);
        }
        Body::from(bytes)
    } else {
        body
    };
    next.run(Request::from_parts(parts, body)).await
}

/// `/mcp?session_id=`.
#[derive(Debug, Default, serde::Deserialize)]
struct SessionQuery {
    session_id: Option<String>,
}

fn session_from_query(uri: &axum::http::Uri) -> Result<ChosenSession, ApiError> {
    let query = axum::extract::Query::<SessionQuery>::try_from_uri(uri)
        .map(|q| q.0)
        .map_err(|e| ApiError::bad_request(format!("malformed query string: {e}")))?;
    match query.session_id.filter(|s| !s.is_empty()) {
        None => Ok(ChosenSession {
            session: SessionId::default_session(),
            named: false,
        }),
        Some(s) => SessionId::parse(&s)
            .map(|session| ChosenSession {
                session,
                named: true,
            })
            .map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    format!("session_id: {e}"),
                )
            }),
    }
}

/// The `requestId`s of the `notifications/cancelled` messages in a POST body (one
/// message or a batch), as canonical JSON text.
fn cancelled_request_ids(body: &[u8]) -> Vec<String> {
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return Vec::new();
    };
    let messages = match value {
        Value::Array(items) => items,
        other => vec![other],
    };
    messages
        .iter()
        .filter(|m| m.get("method").and_then(Value::as_str) == Some("notifications/cancelled"))
        .filter(|m| m.get("id").is_none())
        .filter_map(|m| m.pointer("/params/requestId"))
        .filter(|id| id.is_string() || id.is_number())
        .map(Value::to_string)
        .collect()
}

/// Browser origins allowed to call `/mcp`.
#[derive(Debug, Default)]
struct AllowedOrigins {
    /// Normalised `scheme://host[:port]`, or `scheme://host:*` for any port.
    extra: Vec<String>,
}

impl AllowedOrigins {
    fn from_env() -> Self {
        let extra = std::env::var(ALLOWED_ORIGINS_ENV)
            .unwrap_or_default()
            .split(',')
            .map(|s| s.trim().trim_end_matches('/').to_ascii_lowercase())
            .filter(|s| !s.is_empty())
            .collect();
        Self { extra }
    }

    fn check(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let values: Vec<_> = headers.get_all(header::ORIGIN).iter().collect();
        if values.is_empty() {
            return Ok(());
        }
        let forbidden = |shown: &str| {
            ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!(
                    "Origin {shown:?} may not use /mcp (DNS-rebinding protection); only loopback origins and those listed in {ALLOWED_ORIGINS_ENV} are allowed"
                ),
            )
        };
        for value in values {
            let Ok(text) = value.to_str() else {
                return Err(forbidden("(not text)"));
            };
            if !self.allows(text) {
                return Err(forbidden(text));
            }
        }
        Ok(())
    }

    fn allows(&self, origin: &str) -> bool {
        let origin = origin.trim().to_ascii_lowercase();
        let Some((scheme, host, _port)) = split_origin(&origin) else {
            return false;
        };
        if matches!(scheme, "http" | "https") && matches!(host, "localhost" | "127.0.0.1" | "[::1]")
        {
            return true;
        }
        self.extra.iter().any(|entry| {
            if let Some(prefix) = entry.strip_suffix(":*") {
                split_origin(prefix)
                    .is_some_and(|(s, h, p)| s == scheme && h == host && p.is_none())
            } else {
                *entry == origin
            }
        })
    }
}

/// `scheme://host[:port]` → parts; `None` for anything else (paths, user info, `null`).
fn split_origin(origin: &str) -> Option<(&str, &str, Option<&str>)> {
    let (scheme, rest) = origin.split_once("://")?;
    if scheme.is_empty() || rest.is_empty() || rest.contains(['/', '@', '?', '#']) {
        return None;
    }
    let (host, port) = if rest.starts_with('[') {
        let end = rest.find(']')?;
        let (host, after) = rest.split_at(end + 1);
        match after {
            "" => (host, None),
            p => (host, Some(p.strip_prefix(':')?)),
        }
    } else {
        match rest.split_once(':') {
            None => (rest, None),
            Some((h, p)) => (h, Some(p)),
        }
    };
    if host.is_empty()
        || port.is_some_and(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()))
    {
        return None;
    }
    Some((scheme, host, port))
}

/// Who sent a JSON-RPC request on `/mcp`: the principal, the Airlock session it chose
/// (`?session_id=`) and the request's id. Clients number their requests from 0 or 1, so
/// two clients of one principal in different sessions reuse ids all the time: a
/// `notifications/cancelled` stops only a call of the session it was sent in.
type InflightKey = (String, String, String);

/// Calls in flight on `/mcp`, by [`InflightKey`], for `notifications/cancelled`.
#[derive(Default)]
struct Inflight {
    calls: Mutex<HashMap<InflightKey, Vec<String>>>,
}

impl Inflight {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<InflightKey, Vec<String>>> {
        match self.calls.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    fn register(
        self: &Arc<Self>,
        principal: &str,
        session: &SessionId,
        request_id: String,
        call_id: &str,
    ) -> Registered {
        let key = (
            principal.to_owned(),
            session.as_str().to_owned(),
            request_id,
        );
        self.lock()
            .entry(key.clone())
            .or_default()
            .push(call_id.to_owned());
        Registered {
            inflight: self.clone(),
            key,
            call_id: call_id.to_owned(),
        }
    }

    fn cancel(&self, state: &HttpState, principal: &str, session: &SessionId, request_id: &str) {
        let key = (
            principal.to_owned(),
            session.as_str().to_owned(),
            request_id.to_owned(),
        );
        let target = match self.lock().get(&key).map(Vec::as_slice) {
            Some([one]) => one.clone(),
            Some(many) if many.len() > 1 => {
                tracing::warn!(
                    principal,
                    request_id,
                    "notifications/cancelled matches several calls; cancelling none"
                );
                return;
            }
            _ => return,
        };
        tracing::info!(principal, request_id, call_id = %target, "MCP client cancelled the call");
        state.gate.cancel(&target);
    }
}

/// Removes its call from [`Inflight`] when the request ends.
struct Registered {
    inflight: Arc<Inflight>,
    key: InflightKey,
    call_id: String,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut calls = self.inflight.lock();
        if let Some(ids) = calls.get_mut(&self.key) {
            ids.retain(|id| *id != self.call_id);
            if ids.is_empty() {
                calls.remove(&self.key);
            }
        }
    }
}

/// The rmcp server handler: one per request (stateless), cheap to clone.
#[derive(Clone)]
struct AirlockMcp {
    state: HttpState,
    inflight: Arc<Inflight>,
}

impl AirlockMcp {
    fn caller(
        context: &RequestContext<RoleServer>,
    ) -> Result<(Principal, ChosenSession), McpError> {
        let parts = context.extensions.get::<axum::http::request::Parts>();
        let principal = parts.and_then(|p| p.extensions.get::<Principal>()).cloned();
        let session = parts
            .and_then(|p| p.extensions.get::<ChosenSession>())
            .cloned();
        match (principal, session) {
            (Some(p), Some(s)) => Ok((p, s)),
            _ => Err(McpError::internal_error(
                "the request reached the MCP handler without authentication",
                None,
            )),
        }
    }

    async fn run_call(
        &self,
        principal: Principal,
        chosen: ChosenSession,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> CallToolResult {
        let gate = &self.state.gate;
        let request_id = request_id_text(&context.id);
        let progress_token = context
            .meta
            .get_progress_token()
            .or_else(|| request.meta.as_ref().and_then(|m| m.get_progress_token()));
        let tool_use = ToolUse {
            id: format!("mcp-{}", request_id.trim_matches('"'))
                .chars()
                .take(256)
                .collect(),
            name: request.name.to_string(),
            input: Value::Object(request.arguments.unwrap_or_default()),
        };
        let session = chosen.session.clone();
        let batch = Batch {
            session: chosen.named.then_some(chosen.session),
            calls: vec![Ok(tool_use)],
            with_events: true,
            // The answer may come before the end (a call held for approval): the call
            // goes on, and only the client's `notifications/cancelled` stops it.
            on_drop: OnDrop::KeepRunning,
        };
        // rmcp runs this handler in a task of its own: the call's span is opened in the
        // front door's explicitly.
        let front_door = context
            .extensions
            .get::<axum::http::request::Parts>()
            .and_then(|p| p.extensions.get::<crate::traces::FrontDoorSpan>())
            .map(|s| s.0.clone())
            .unwrap_or_default();
        let admitted = front_door.in_scope(|| self.state.calls.admit(&principal, batch));
        let mut handle = match admitted {
            Ok(mut handles) => match handles.pop() {
                Some(handle) => handle,
                None => return error_result("the call was not admitted"),
            },
            Err(AdmitError::NotAnAgent { principal }) => {
                return error_result(format!(
                    "principal {principal:?} lacks the agent role and may not call tools"
                ));
            }
            Err(AdmitError::RateLimited(e)) => return error_result(e.to_string()),
        };
        let call_id = handle.call_id().to_owned();
        let _registered = self
            .inflight
            .register(&principal.name, &session, request_id, &call_id);
        let mut progress = Progress {
            token: progress_token,
            context: &context,
            last: 0.0,
        };
        let approval_wait = gate.mcp_wait();
        let hard_limit = tokio::time::Instant::now()
            + Duration::from_millis(wire::MAX_WAIT_MS)
            + Duration::from_millis(gate.limits().max_call_timeout_ms);
        let mut pending_since: Option<tokio::time::Instant> = None;
        loop {
            let deadline = match pending_since {
                Some(since) if handle.record().status == CallStatus::PendingApproval => {
                    (since + approval_wait).min(hard_limit)
                }
                _ => hard_limit,
            };
            let update = tokio::select! {
                update = handle.next() => update,
                () = context.ct.cancelled() => {
                    handle.cancel();
                    return error_result(format!("call {call_id} was cancelled by the client"));
                }
                () = tokio::time::sleep_until(deadline) => {
                    let record = handle.record();
                    return match (record.status, &record.approval_id) {
                        (CallStatus::PendingApproval, Some(approval)) => with_meta(error_result(format!(
                            "call {call_id} is waiting for approval {approval}, which nobody has decided yet. \
                             An approver can run `airlock approvals approve {approval}` (or `airlock approvals deny {approval}`); \
                             the call then runs once and its result is at GET /v1/calls/{call_id}. \
                             Calling the tool again would ask for a second approval."
                        )), &record),
                        _ if record.status.is_final() => final_result(&record),
                        _ => with_meta(error_result(format!(
                            "call {call_id} is still running; its result will be at GET /v1/calls/{call_id}"
                        )), &record),
                    };
                }
            };
            match update {
                Update::Event(event) => progress.worker_event(event).await,
                Update::Changed(record) => {
                    if record.status == CallStatus::PendingApproval && pending_since.is_none() {
                        pending_since = Some(tokio::time::Instant::now());
                        if let Some(approval) = &record.approval_id {
                            progress
                                .send(
                                    None,
                                    format!(
                                        "waiting for approval {approval}; an approver can run `airlock approvals approve {approval}`"
                                    ),
                                )
                                .await;
                        }
                    }
                }
                Update::Final(record) => return final_result(&record),
            }
        }
    }
}

/// Forwards worker events as `notifications/progress` when the client asked for them.
struct Progress<'a> {
    token: Option<ProgressToken>,
    context: &'a RequestContext<RoleServer>,
    last: f64,
}

impl Progress<'_> {
    async fn worker_event(&mut self, event: WorkerEvent) {
        match event {
            WorkerEvent::Progress {
                progress,
                total,
                message,
            } => {
                let value = if progress > self.last {
                    progress
                } else {
                    self.last + 1.0
                };
                let total = total.filter(|t| *t >= value);
                self.send_at(value, total, message).await;
            }
            WorkerEvent::Output { stream, data } => {
                let text = String::from_utf8_lossy(&data);
                self.send(None, format!("[{stream}] {text}")).await;
            }
        }
    }

    async fn send(&mut self, total: Option<f64>, message: String) {
        let value = self.last + 1.0;
        self.send_at(value, total, message).await;
    }

    async fn send_at(&mut self, value: f64, total: Option<f64>, mut message: String) {
        let Some(token) = self.token.clone() else {
            return;
        };
        self.last = value;
        crate::wire::ellipsize(&mut message, MAX_PROGRESS_MESSAGE);
        let mut param = ProgressNotificationParam::new(token, value);
        if let Some(total) = total {
            param = param.with_total(total);
        }
        if !message.is_empty() {
            param = param.with_message(message);
        }
        if let Err(e) = self.context.peer.notify_progress(param).await {
            tracing::debug!(error = %e, "cannot send an MCP progress notification");
        }
    }
}

fn request_id_text(id: &RequestId) -> String {
    serde_json::to_value(id)
        .map(|v| v.to_string())
        .unwrap_or_default()
}

fn error_result(text: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(text.into())])
}

/// The MCP result of a final call: the tool's text blocks and its error flag.
fn final_result(record: &CallRecord) -> CallToolResult {
    let Some(outcome) = &record.result else {
        return error_result(format!(
            "call {} ended ({}) without a result",
            record.call_id,
            record.status.as_str()
        ));
    };
    let content = outcome
        .content
        .iter()
        .map(|t| ContentBlock::text(t.clone()))
        .collect();
    let result = if outcome.is_error {
        CallToolResult::error(content)
    } else {
        CallToolResult::success(content)
    };
    with_meta(result, record)
}

/// Adds Airlock's view of the call as `_meta`: `airlock/call_id`, `airlock/status` and,
/// when there is one, `airlock/approval_id`.
fn with_meta(mut result: CallToolResult, record: &CallRecord) -> CallToolResult {
    let mut meta = rmcp::model::MetaObject::new();
    meta.0
        .insert("airlock/call_id".into(), json!(record.call_id));
    meta.0
        .insert("airlock/status".into(), json!(record.status.as_str()));
    if let Some(approval) = &record.approval_id {
        meta.0.insert("airlock/approval_id".into(), json!(approval));
    }
    result.meta = Some(meta);
    result
}

impl ServerHandler for AirlockMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(
                Implementation::new("airlock", env!("CARGO_PKG_VERSION")).with_title("Airlock"),
            )
            .with_instructions(
                "Airlock runs each tool call in a sandbox after schema validation, policy and \
                 (for irreversible tools) human approval. Paths are relative to the session's \
                 workspace. An error result explains what to change.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let (principal, _) = Self::caller(&context)?;
        let mut tools = Vec::new();
        for tool in self.state.gate.visible_tools(&principal) {
            let entry = wire::catalog_entry(&tool, CatalogFormat::Mcp);
            match serde_json::from_value::<Tool>(entry) {
                Ok(t) => tools.push(t),
                Err(e) => {
                    tracing::warn!(tool = %tool.definition.name, error = %e, "tool cannot be listed over MCP")
                }
            }
        }
        // Visibility depends on the principal and the policy, which may be reloaded.
        Ok(ListToolsResult::with_all_items(tools)
            .with_ttl_ms(0)
            .with_cache_scope(CacheScope::Private))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let (principal, chosen) = Self::caller(&context)?;
        Ok(self
            .run_call(principal, chosen, request, context)
            .await
            .into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_origins_pass_and_lookalikes_do_not() {
        let origins = AllowedOrigins {
            extra: vec![
                "https://console.example.com".into(),
                "http://tools.internal:*".into(),
            ],
        };
        for ok in [
            "http://localhost",
            "http://localhost:3000",
            "http://127.0.0.1:7070",
            "http://[::1]:8080",
            "https://localhost",
            "HTTP://LOCALHOST:1",
            "https://console.example.com",
            "http://tools.internal:9000",
            "http://tools.internal",
        ] {
            assert!(origins.allows(ok), "{ok}");
        }
        for bad in [
            "http://evil.example",
            "http://localhost.evil.example",
            "http://127.0.0.1.nip.io",
            "http://localhost@evil.example",
            "http://localhost:80/path",
            "http://localhost:abc",
            "null",
            "file://",
            "https://console.example.com:8443",
            "https://tools.internal:9000",
            "ws://localhost",
        ] {
            assert!(!origins.allows(bad), "{bad}");
        }
    }

    #[test]
    fn cancellation_notices_are_found_in_single_and_batched_bodies() {
        let one = br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":7,"reason":"user"}}"#;
        assert_eq!(cancelled_request_ids(one), vec!["7".to_owned()]);
        let batch = br#"[{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"a"}},{"jsonrpc":"2.0","id":1,"method":"tools/list"}]"#;
        assert_eq!(cancelled_request_ids(batch), vec!["\"a\"".to_owned()]);
        assert!(cancelled_request_ids(b"{not json").is_empty());
        assert!(
            cancelled_request_ids(br#"{"jsonrpc":"2.0","id":1,"method":"tools/call"}"#).is_empty()
        );
    }

    #[test]
    fn session_comes_from_the_query_string() {
        let uri = |text: &str| text.parse::<axum::http::Uri>().unwrap();
        let c = session_from_query(&uri("/mcp?session_id=work-1")).unwrap();
        assert!(c.named);
        assert_eq!(c.session.as_str(), "work-1");
        let c = session_from_query(&uri("/mcp")).unwrap();
        assert!(!c.named);
        assert_eq!(c.session.as_str(), "default");
        assert!(session_from_query(&uri("/mcp?session_id=..%2Fx")).is_err());
        // Two sessions named at once is a malformed request, not a choice of one.
        assert!(session_from_query(&uri("/mcp?session_id=a&session_id=b")).is_err());
    }

    #[test]
    fn request_ids_match_the_wire_text() {
        assert_eq!(request_id_text(&RequestId::Number(3)), "3");
        assert_eq!(request_id_text(&RequestId::String("x".into())), "\"x\"");
    }
}
