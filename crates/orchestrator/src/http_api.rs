//! The HTTP front door: `/v1`, health, readiness and the OpenAPI document.
//!
//! Every failure is JSON `{"error": {"code", "message"}}` with a 4xx (or 503 when a
//! dependency is down); bad input never reaches a 500.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use serde_json::{Value, json};

use crate::audit::AuditQuery;
use crate::auth::{Principal, Principals, Role, Unauthenticated};
use crate::authn::{AuthLayer, JsonRefusal};
use crate::budget::BudgetError;
use crate::calls::wait_final;
use crate::gate::Gate;
use crate::gate::decisions::{self as approvals, DecideError};
use crate::service::{AdmitError, Batch, CallService, OnDrop, Refused};
use crate::store::{ApprovalQuery, ApprovalStatus, MAX_APPROVAL_PAGE, StoreError};
use crate::wire::{self, BadRequest, CatalogFormat};

#[derive(Clone)]
pub struct HttpState {
    pub gate: Arc<Gate>,
    /// Admission and following of calls, shared with every front door.
    pub calls: CallService,
    pub principals: Arc<Principals>,
    /// `[agent]`, for `POST /v1/agent/runs`.
    pub agent: Arc<crate::agent::AgentConfig>,
    /// Fires when the front door stops serving.
    pub stopping: tokio_util::sync::CancellationToken,
    /// The approvals console's live views open, by principal.
    pub live_streams: Arc<crate::ui::LiveStreams>,
}

/// An error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    /// The `WWW-Authenticate` challenge of a 401.
    challenge: Option<HeaderValue>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            challenge: None,
        }
    }

    /// A 401 whose `WWW-Authenticate` says where the token comes from. Without it, MCP
    /// hosts read a bare `Bearer` challenge as "OAuth protected" and start a discovery
    /// that cannot succeed: Airlock has no OAuth flow, only configured bearer tokens.
    /// Following RFC 6750 §3.1, `error="invalid_token"` is sent only when a credential
    /// was; the description (where the token is) is always there, for the operator
    /// reading a client's log.
    pub(crate) fn unauthenticated(why: Unauthenticated, hint: &'static str) -> Self {
        let message = crate::authn::message(why, hint);
        let error = match why {
            Unauthenticated::Missing => "",
            Unauthenticated::NotBearer | Unauthenticated::InvalidToken => {
                "error=\"invalid_token\", "
            }
        };
        // The hint is a fixed ASCII text without quotes, as a quoted-string needs.
        let challenge = HeaderValue::from_str(&format!(
            "Bearer realm=\"airlock\", {error}error_description=\"{hint}\""
        ))
        .unwrap_or_else(|_| HeaderValue::from_static("Bearer realm=\"airlock\""));
        Self {
            challenge: Some(challenge),
            ..Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }
    fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }
}

impl From<BadRequest> for ApiError {
    fn from(e: BadRequest) -> Self {
        ApiError::bad_request(e.0)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"code": self.code, "message": self.message}});
        let mut response = (self.status, axum::Json(body)).into_response();
        let challenge = match self.challenge {
            Some(challenge) => Some(challenge),
            None if self.status == StatusCode::UNAUTHORIZED => {
                Some(HeaderValue::from_static("Bearer realm=\"airlock\""))
            }
            None => None,
        };
        if let Some(challenge) = challenge {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, challenge);
        }
        response
    }
}

/// Every authenticated route, as (method, path, handler). The router is built from this
/// table and `/openapi.json` is checked against it, so a route cannot go undocumented.
/// Paths use `{name}` for parameters, as axum and OpenAPI both do.
fn routes() -> Vec<(Method, &'static str, MethodRouter<HttpState>)> {
    vec![
        (Method::GET, "/v1/tools", get(list_tools)),
        (Method::GET, "/v1/tools/pins", get(list_tool_pins)),
        (Method::POST, "/v1/tools/{name}/accept", post(accept_tool)),
        (Method::POST, "/v1/tool_calls", post(tool_calls)),
        (Method::GET, "/v1/calls/{call_id}", get(get_call)),
        (
            Method::POST,
            "/v1/calls/{call_id}/cancel",
            post(cancel_call),
        ),
        (Method::GET, "/v1/approvals", get(list_approvals)),
        (
            Method::POST,
            "/v1/approvals/{approval_id}/approve",
            post(approve_approval),
        ),
        (
            Method::POST,
            "/v1/approvals/{approval_id}/deny",
            post(deny_approval),
        ),
        (Method::GET, "/v1/audit", get(read_audit)),
        (Method::GET, "/v1/audit/verify", get(verify_audit)),
        (
            Method::POST,
            "/v1/agent/runs",
            post(crate::agent::http::start_run),
        ),
        (Method::GET, "/openapi.json", get(openapi)),
    ]
}

/// The (method, path) of every authenticated HTTP route.
pub fn route_table() -> Vec<(Method, &'static str)> {
    routes()
        .into_iter()
        .map(|(method, path, _)| (method, path))
        .collect()
}

pub fn router(state: HttpState) -> Router {
    // Two methods on one path share one axum route.
    let mut by_path: Vec<(&'static str, MethodRouter<HttpState>)> = Vec::new();
    for (_, path, handler) in routes() {
        match by_path.iter_mut().find(|(p, _)| *p == path) {
            Some((_, existing)) => *existing = std::mem::take(existing).merge(handler),
            None => by_path.push((path, handler)),
        }
    }
    let authenticated = by_path
        .into_iter()
        .fold(Router::new(), |router, (path, handler)| {
            router.route(path, handler)
        })
        .route_layer(AuthLayer::new(state.principals.clone(), JsonRefusal))
        // Outside authentication, so that its span covers it.
        .route_layer(crate::traces::FrontDoorLayer(crate::traces::Door::Http));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        // Unauthenticated like the health checks: Prometheus scrapes without a bearer
        // token, and nothing in it names a call, principal, session, path or argument
        // (docs/decisions.md, "Metrics").
        .route("/metrics", get(metrics))
        .merge(authenticated)
        .merge(crate::mcp::router(state.clone()))
        // The approvals console: its own sign-in (a cookie, not a bearer header).
        .merge(crate::ui::router())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Bodies are read with an explicit cap in the handlers, answering 413 as JSON.
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such endpoint; see /openapi.json")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this endpoint does not accept that method; see /openapi.json",
    )
}

async fn healthz() -> axum::Json<Value> {
    axum::Json(json!({"status": "ok"}))
}

async fn readyz(State(state): State<HttpState>) -> Response {
    let health = state.gate.worker_health();
    let ready = health.iter().all(|g| g.live);
    let groups: serde_json::Map<String, Value> = health
        .iter()
        .map(|g| (g.name.clone(), json!(if g.live { "live" } else { "down" })))
        .collect();
    let replicas: serde_json::Map<String, Value> = health
        .iter()
        .map(|g| {
            let each: Vec<Value> = g
                .replicas
                .iter()
                .map(
                    |r| json!({"endpoint": r.endpoint, "state": r.state, "in_flight": r.in_flight}),
                )
                .collect();
            (g.name.clone(), Value::Array(each))
        })
        .collect();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if ready { "ready" } else { "not_ready" },
        "workers": groups,
        "replicas": replicas,
        // Counted since start, for benchmarks and tests that count a call's durable
        // writes (docs/decisions.md, "One durable write per call").
        "store": {"kind": state.gate.store_kind(), "commits": state.gate.store_commits()},
    });
    (status, axum::Json(body)).into_response()
}

async fn metrics(State(state): State<HttpState>) -> Response {
    (
        [(http::header::CONTENT_TYPE, airlock_metrics::CONTENT_TYPE)],
        state.gate.scrape().await,
    )
        .into_response()
}

async fn openapi() -> axum::Json<Value> {
    axum::Json(crate::openapi::document())
}

/// A route's query string, as the struct that names its keys.
fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    q.map(|Query(q)| q)
        .map_err(|e| ApiError::bad_request(format!("malformed query string: {e}")))
}

/// `GET /v1/tools`.
#[derive(Debug, Default, serde::Deserialize)]
struct ToolsQuery {
    format: Option<String>,
    strict: Option<String>,
}

/// `POST /v1/tool_calls`.
#[derive(Debug, Default, serde::Deserialize)]
struct ToolCallsQuery {
    stream: Option<String>,
}

impl ToolCallsQuery {
    fn stream(&self) -> Result<bool, ApiError> {
        match self.stream.as_deref() {
            None | Some("false") | Some("0") => Ok(false),
            Some("true") | Some("1") => Ok(true),
            Some(_) => Err(ApiError::bad_request("stream must be true or false")),
        }
    }
}

/// `GET /v1/calls/{call_id}`.
#[derive(Debug, Default, serde::Deserialize)]
struct CallQuery {
    wait_ms: Option<String>,
}

impl CallQuery {
    /// How long to wait for the call to end, capped like every wait.
    fn wait(&self) -> Result<Duration, ApiError> {
        let ms = match self.wait_ms.as_deref() {
            None => 0,
            Some(v) => v.parse::<u64>().map_err(|_| {
                ApiError::bad_request("wait_ms must be a non-negative integer (milliseconds)")
            })?,
        };
        Ok(Duration::from_millis(ms.min(wire::MAX_WAIT_MS)))
    }
}

/// `GET /v1/approvals`.
#[derive(Debug, Default, serde::Deserialize)]
struct ApprovalsQuery {
    status: Option<String>,
    limit: Option<String>,
    after: Option<String>,
}

impl ApprovalsQuery {
    fn into_store_query(self) -> Result<ApprovalQuery, ApiError> {
        let status = match self.status.as_deref() {
            None | Some("") | Some("all") => None,
            Some(s) => Some(s.parse::<ApprovalStatus>().map_err(|_| {
                ApiError::bad_request("status must be one of pending, approved, denied, expired")
            })?),
        };
        let limit = match self.limit.as_deref() {
            None | Some("") => 0,
            Some(v) => v.parse::<usize>().map_err(|_| {
                ApiError::bad_request(format!(
                    "limit must be a non-negative integer (at most {MAX_APPROVAL_PAGE} are listed per page)"
                ))
            })?,
        };
        let after = match self.after.as_deref() {
            None | Some("") => None,
            Some(cursor) => Some(approval_cursor(cursor)?),
        };
        Ok(ApprovalQuery {
            status,
            after,
            limit,
            ..ApprovalQuery::default()
        })
    }
}

/// `GET /v1/audit`.
#[derive(Debug, Default, serde::Deserialize)]
struct AuditParams {
    session_id: Option<String>,
    call_id: Option<String>,
    after: Option<String>,
    limit: Option<String>,
    latest: Option<String>,
}

impl AuditParams {
    fn into_store_query(self) -> Result<AuditQuery, ApiError> {
        let number = |key: &str, value: Option<&str>| -> Result<Option<u64>, ApiError> {
            value
                .map(|v| {
                    v.parse::<u64>().map_err(|_| {
                        ApiError::bad_request(format!("{key} must be a non-negative integer"))
                    })
                })
                .transpose()
        };
        for (key, value) in [("session_id", &self.session_id), ("call_id", &self.call_id)] {
            if value.as_deref().is_some_and(wire::has_control) {
                return Err(ApiError::bad_request(format!(
                    "{key} must not contain control characters"
                )));
            }
        }
        Ok(AuditQuery {
            after: number("after", self.after.as_deref())?,
            limit: number("limit", self.limit.as_deref())?.unwrap_or(0) as usize,
            latest: self
                .latest
                .as_deref()
                .is_some_and(|v| v == "true" || v == "1"),
            session_id: self.session_id,
            call_id: self.call_id,
        })
    }
}

async fn list_tools(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
    q: Result<Query<ToolsQuery>, QueryRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let q = query(q)?;
    let format = CatalogFormat::from_query(q.format.as_deref(), q.strict.as_deref())?;
    let tools: Vec<Value> = state
        .gate
        .visible_tools(&principal)
        .iter()
        .map(|t| wire::catalog_entry(t, format))
        .collect();
    Ok(axum::Json(json!({"tools": tools})))
}

/// Reads a JSON request body under the configured cap (see [`crate::body`]).
pub(crate) async fn read_json(
    headers: &HeaderMap,
    body: Body,
    limit: u64,
) -> Result<Value, ApiError> {
    let bytes =
        crate::body::read_capped(headers, body, limit, "send fewer or smaller tool calls").await?;
    if bytes.is_empty() {
        return Err(ApiError::bad_request(
            "the request body is empty; send a JSON object",
        ));
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))
}

async fn tool_calls(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
    q: Result<Query<ToolCallsQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Rejection> {
    require_role(&principal, Role::Agent)?;
    let stream = query(q)?.stream()?;
    let gate = &state.gate;
    // The parsed body goes once the calls are taken out of it: a held call's arguments
    // must not wait in this handler for `wait_ms` (they wait in the store).
    let request = {
        let body = read_json(&headers, body, gate.limits().max_request_bytes).await?;
        wire::parse_tool_calls(&body, gate.limits().max_tool_uses_per_request)?
    };
    let wait = wire::wait_for(request.wait_ms, gate.default_wait());
    let shape = request.shape;
    let batch = Batch {
        session: request.session_id,
        calls: request
            .calls
            .into_iter()
            .map(|call| call.into_tool_use().map_err(Refused::from))
            .collect(),
        with_events: stream,
        // A streamed call ends with its stream; an answered one keeps running after
        // `wait_ms`, its result at GET /v1/calls/{id}.
        on_drop: if stream {
            OnDrop::Cancel
        } else {
            OnDrop::KeepRunning
        },
    };
    let handles = state
        .calls
        .admit(&principal, batch)
        .map_err(admit_rejection)?;
    if stream {
        return Ok(crate::streaming::tool_calls(handles).into_response());
    }
    let records = futures::future::join_all(handles.iter().map(|h| h.wait_final(wait))).await;
    Ok(crate::json_text::json_response(|body| {
        wire::write_tool_calls_response(shape, &records, body)
    }))
}

/// A batch the call service did not admit, as HTTP says it: 403, or 429 with
/// `Retry-After`.
fn admit_rejection(error: AdmitError) -> Rejection {
    match error {
        AdmitError::NotAnAgent { principal } => Rejection::Api(forbidden(&principal, Role::Agent)),
        AdmitError::RateLimited(e) => {
            let retry_after_s = match e {
                BudgetError::RateLimited { retry_after_s, .. } => Some(retry_after_s),
                _ => None,
            };
            let mut response =
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", e.to_string())
                    .into_response();
            if let Some(value) =
                retry_after_s.and_then(|s| HeaderValue::from_str(&s.to_string()).ok())
            {
                response.headers_mut().insert(header::RETRY_AFTER, value);
            }
            Rejection::Response(response)
        }
    }
}

/// An error that is either the usual JSON error or a prepared response (429 with
/// `Retry-After`).
pub enum Rejection {
    Api(ApiError),
    Response(Response),
}

impl From<ApiError> for Rejection {
    fn from(e: ApiError) -> Self {
        Rejection::Api(e)
    }
}

impl From<BadRequest> for Rejection {
    fn from(e: BadRequest) -> Self {
        Rejection::Api(e.into())
    }
}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        match self {
            Rejection::Api(e) => e.into_response(),
            Rejection::Response(r) => r,
        }
    }
}

pub(crate) fn require_role(principal: &Principal, role: Role) -> Result<(), ApiError> {
    if principal.has(role) {
        return Ok(());
    }
    Err(forbidden(&principal.name, role))
}

fn forbidden(principal: &str, role: Role) -> ApiError {
    ApiError::new(
        StatusCode::FORBIDDEN,
        "forbidden",
        format!("principal {principal:?} lacks the {role:?} role").to_lowercase(),
    )
}

async fn get_call(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
    Path(call_id): Path<String>,
    q: Result<Query<CallQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let wait = query(q)?.wait()?;
    if let Some(rx) = visible_call(&state, &principal, &call_id)? {
        let record = wait_final(rx, wait).await;
        return Ok(call_detail_answer(&record));
    }
    // Not in this replica's memory: another replica's call, or one from before a restart.
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let record = stored_call(&state, &principal, &call_id).await?;
        if record.status.is_final() || tokio::time::Instant::now() >= deadline {
            return Ok(call_detail_answer(&record));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `GET /v1/calls/{id}`'s answer (and `POST …/cancel`'s): the call, its result written
/// straight from the record.
fn call_detail_answer(record: &crate::calls::CallRecord) -> Response {
    crate::json_text::json_response(|body| wire::write_call_detail(record, body))
}

async fn stored_call(
    state: &HttpState,
    principal: &Principal,
    call_id: &str,
) -> Result<crate::calls::CallRecord, ApiError> {
    // A store that cannot answer is a 503, never "no such call": a client following
    // its call would give up on one that goes on.
    let record = state
        .gate
        .stored_record(call_id)
        .await
        .map_err(store_error)?
        .ok_or_else(|| ApiError::not_found(format!("no call {call_id:?}")))?;
    if record.principal != principal.name && !principal.roles.contains(&Role::Admin) {
        return Err(ApiError::not_found(format!("no call {call_id:?}")));
    }
    Ok(record)
}

async fn cancel_call(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
    Path(call_id): Path<String>,
) -> Result<Response, ApiError> {
    // The answer is the call as it is after a short wait: `cancelled` only once its
    // worker has stopped it, else still `running` (`GET /v1/calls/{id}` follows it).
    let Some(rx) = visible_call(&state, &principal, &call_id)? else {
        // Another replica's call, or one only the store knows.
        let record = stored_call(&state, &principal, &call_id).await?;
        if record.status.is_final() {
            return Ok(call_detail_answer(&record));
        }
        state.gate.cancel_elsewhere(&call_id).await;
        let record = stored_call(&state, &principal, &call_id).await?;
        return Ok(call_detail_answer(&record));
    };
    state.gate.cancel(&call_id);
    let record = wait_final(rx, Duration::from_secs(5)).await;
    Ok(call_detail_answer(&record))
}

/// A call is visible to the principal that made it and to admins; to anyone else it does
/// not exist.
fn visible_call(
    state: &HttpState,
    principal: &Principal,
    call_id: &str,
) -> Result<Option<tokio::sync::watch::Receiver<crate::calls::CallRecord>>, ApiError> {
    let Some(rx) = state.gate.watch(call_id) else {
        return Ok(None);
    };
    let owner = rx.borrow().principal.clone();
    if owner != principal.name && !principal.roles.contains(&Role::Admin) {
        return Err(ApiError::not_found(format!("no call {call_id:?}")));
    }
    Ok(Some(rx))
}

async fn list_approvals(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
    q: Result<Query<ApprovalsQuery>, QueryRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    require_role(&principal, Role::Approver)?;
    let query = query(q)?.into_store_query()?;
    let page = approvals::list(&state.gate, &query)
        .await
        .map_err(|e| match e {
            StoreError::NotFound { id, .. } => ApiError::bad_request(format!(
                "after: no approval {id:?}; pass the next_cursor of the previous page"
            )),
            e => store_error(e),
        })?;
    Ok(axum::Json(
        json!({"approvals": page.approvals, "next_cursor": page.next_cursor}),
    ))
}

/// A paging cursor as sent: an approval id, checked before it reaches the store.
pub(crate) fn approval_cursor(cursor: &str) -> Result<String, BadRequest> {
    if cursor.len() > 128
        || !cursor
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Err(BadRequest(
            "after must be the next_cursor of the previous page (an approval id)".into(),
        ));
    }
    Ok(cursor.to_owned())
}

async fn approve_approval(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
    Path(approval_id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<axum::Json<Value>, ApiError> {
    decide_approval(&state, &principal, &approval_id, true, &headers, body).await
}

async fn deny_approval(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
    Path(approval_id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<axum::Json<Value>, ApiError> {
    decide_approval(&state, &principal, &approval_id, false, &headers, body).await
}

async fn decide_approval(
    state: &HttpState,
    principal: &Principal,
    approval_id: &str,
    approve: bool,
    headers: &HeaderMap,
    body: Body,
) -> Result<axum::Json<Value>, ApiError> {
    require_role(principal, Role::Approver)?;
    // The body is optional: `{"reason": "..."}`.
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("0")
        != "0";
    let body = if declared || headers.contains_key(header::TRANSFER_ENCODING) {
        read_json(headers, body, 64 * 1024).await?
    } else {
        Value::Null
    };
    let reason = match body.get("reason") {
        None | Some(Value::Null) => None,
        Some(Value::String(r)) => {
            approvals::check_reason(r).map_err(ApiError::bad_request)?;
            Some(r.clone())
        }
        Some(_) => return Err(ApiError::bad_request("reason must be a string")),
    };
    let input_sha256 = match body.get("input_sha256") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) if d.len() == 64 && d.chars().all(|c| c.is_ascii_hexdigit()) => {
            Some(d.clone())
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                "input_sha256 must be the 64 hex digits of the approval's input_sha256",
            ));
        }
    };
    let remember = match body.get("remember") {
        None | Some(Value::Null) => false,
        Some(Value::String(r)) if r == "session" && approve => true,
        Some(_) if !approve => {
            return Err(ApiError::bad_request(
                "remember applies to an approval, not a denial",
            ));
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                "remember must be \"session\" (or absent)",
            ));
        }
    };
    let approval = approvals::decide(
        &state.gate,
        principal,
        approval_id,
        approve,
        reason.as_deref(),
        input_sha256.as_deref(),
        remember,
    )
    .await
    .map_err(|e| match e {
        DecideError::NotFound => ApiError::not_found(format!("no approval {approval_id:?}")),
        DecideError::SelfApproval => {
            ApiError::new(StatusCode::FORBIDDEN, "forbidden", e.to_string())
        }
        DecideError::InputChanged { .. } => {
            ApiError::new(StatusCode::CONFLICT, "input_changed", e.to_string())
        }
        DecideError::AlreadyApproved(_) => {
            ApiError::new(StatusCode::CONFLICT, "already_approved", e.to_string())
        }
        DecideError::CannotRemember(_) => {
            ApiError::new(StatusCode::CONFLICT, "cannot_remember", e.to_string())
        }
        DecideError::Conflict(_) => ApiError::new(StatusCode::CONFLICT, "conflict", e.to_string()),
        DecideError::Revoked(_) => ApiError::new(StatusCode::CONFLICT, "revoked", e.to_string()),
        DecideError::Store(_) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            e.to_string(),
        ),
    })?;
    Ok(axum::Json(
        serde_json::to_value(approval).unwrap_or(Value::Null),
    ))
}

fn store_error(e: crate::store::StoreError) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable",
        format!("the store is unavailable: {e}"),
    )
}

async fn read_audit(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
    q: Result<Query<AuditParams>, QueryRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    require_role(&principal, Role::Admin)?;
    let audit_query = query(q)?.into_store_query()?;
    let latest = audit_query.latest;
    let page = state
        .gate
        .audit_page(audit_query)
        .await
        .map_err(store_error)?;
    // Where to read on from, while more follow. A `latest` page ends at the newest
    // record: what it left out is older, and following it is reading after its end.
    let next_after = (page.more && !latest)
        .then(|| page.records.last().map(|r| r.seq))
        .flatten();
    Ok(axum::Json(
        json!({"events": page.records, "next_after": next_after}),
    ))
}

/// The pinned definitions of discovered tools and the changes waiting for an admin.
async fn list_tool_pins(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
) -> Result<axum::Json<Value>, ApiError> {
    require_role(&principal, Role::Admin)?;
    let pins = state.gate.tool_pins().await.map_err(store_error)?;
    Ok(axum::Json(json!({"pins": pins})))
}

/// Serves a discovered tool's changed definition from now on (`airlock tools accept`).
/// `POST /v1/tools/{name}/accept`, with an optional body `{"digest": "<pending
/// digest>"}`: the digest the admin reviewed, so that a definition that changed again
/// since is refused (409) instead of accepted unseen.
async fn accept_tool(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> Result<axum::Json<Value>, ApiError> {
    require_role(&principal, Role::Admin)?;
    let reviewed = accept_digest(&body)?;
    if wire::has_control(&name) {
        return Err(ApiError::not_found(format!(
            "no pinned definition of tool {name:?}"
        )));
    }
    match state
        .gate
        .accept_tool(&name, &principal.name, reviewed.as_deref())
        .await
    {
        Ok(pin) => Ok(axum::Json(json!({"pin": pin}))),
        Err(StoreError::NotFound { .. }) => Err(ApiError::not_found(format!(
            "no pinned definition of tool {name:?}: only tools that external workers or MCP servers list are pinned; see GET /v1/tools/pins"
        ))),
        Err(e @ (StoreError::NothingToAccept { .. } | StoreError::PendingChanged { .. })) => Err(
            ApiError::new(StatusCode::CONFLICT, "conflict", e.to_string()),
        ),
        Err(e) => Err(store_error(e)),
    }
}

/// The `digest` of an accept's body: none for an empty body, else a JSON object whose
/// only field is `digest`, 64 hex characters.
fn accept_digest(body: &[u8]) -> Result<Option<String>, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Accept {
        digest: Option<String>,
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let bad = |why: &str| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            format!(
                "the body is {why}; send nothing, or {{\"digest\": \"<the pending definition's digest from GET /v1/tools/pins>\"}}"
            ),
        )
    };
    let accept: Accept = serde_json::from_slice(body).map_err(|_| bad("not that JSON object"))?;
    match accept.digest {
        Some(d) if d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit()) => Ok(Some(d)),
        Some(_) => Err(bad("a digest that is not 64 hex characters")),
        None => Ok(None),
    }
}

async fn verify_audit(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
) -> Result<axum::Json<Value>, ApiError> {
    require_role(&principal, Role::Admin)?;
    let report = state.gate.verify_audit().await.map_err(store_error)?;
    Ok(axum::Json(
        serde_json::to_value(report).unwrap_or(Value::Null),
    ))
}
