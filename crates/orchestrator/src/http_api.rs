//! The HTTP front door: `/v1`, health, readiness and the OpenAPI document.
//!
//! Every failure is JSON `{"error": {"code", "message"}}` with a 4xx (or 503 when a
//! dependency is down); bad input never reaches a 500.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use crate::auth::{Principal, Principals, Role, bearer_token};
use crate::calls::wait_final;
use crate::gate::Gate;
use crate::wire::{self, BadRequest, CatalogFormat};

#[derive(Clone)]
pub struct HttpState {
    pub gate: Arc<Gate>,
    pub principals: Arc<Principals>,
}

/// An error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
    fn bad_request(message: impl Into<String>) -> Self {
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
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

pub fn router(state: HttpState) -> Router {
    let authenticated = Router::new()
        .route("/v1/tools", get(list_tools))
        .route("/v1/tool_calls", post(tool_calls))
        .route("/v1/calls/{call_id}", get(get_call))
        .route("/v1/calls/{call_id}/cancel", post(cancel_call))
        .route("/openapi.json", get(openapi))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .merge(authenticated)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Bodies are read with an explicit cap in the handlers, answering 413 as JSON.
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

async fn authenticate(
    State(state): State<HttpState>,
    mut request: Request,
    next: Next,
) -> Response {
    let header = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let Some(header) = header else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing Authorization: Bearer <token> header (airlock up writes the token to <data_dir>/token)",
        )
        .into_response();
    };
    let principal = bearer_token(header)
        .and_then(|t| state.principals.authenticate(t))
        .cloned();
    let Some(principal) = principal else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "the bearer token is not valid",
        )
        .into_response();
    };
    request.extensions_mut().insert(principal);
    next.run(request).await
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
    let groups: serde_json::Map<String, Value> = state
        .gate
        .catalog
        .groups()
        .iter()
        .map(|g| {
            (
                g.name.clone(),
                json!(if g.is_live() { "live" } else { "down" }),
            )
        })
        .collect();
    let ready = state.gate.catalog.groups().iter().all(|g| g.is_live());
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({"status": if ready { "ready" } else { "not_ready" }, "workers": groups});
    (status, axum::Json(body)).into_response()
}

async fn openapi() -> axum::Json<Value> {
    axum::Json(crate::openapi::document())
}

fn query(
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Result<HashMap<String, String>, ApiError> {
    q.map(|Query(q)| q)
        .map_err(|e| ApiError::bad_request(format!("malformed query string: {e}")))
}

async fn list_tools(
    State(state): State<HttpState>,
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let q = query(q)?;
    let format = CatalogFormat::parse(q.get("format").map(String::as_str))?;
    let tools: Vec<Value> = state
        .gate
        .catalog
        .tools()
        .iter()
        .map(|t| wire::catalog_entry(t, format))
        .collect();
    Ok(axum::Json(json!({"tools": tools})))
}

/// Reads the body with the configured cap.
async fn read_json(headers: &HeaderMap, body: Body, limit: u64) -> Result<Value, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!(
                "request body is over the limit of {limit} bytes; send fewer or smaller tool calls"
            ),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let bytes = axum::body::to_bytes(body, limit as usize)
        .await
        .map_err(|e| {
            let over = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
                || e.to_string().contains("length limit");
            if over {
                too_large()
            } else {
                ApiError::bad_request(format!("cannot read the request body: {e}"))
            }
        })?;
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
    headers: HeaderMap,
    body: Body,
) -> Result<axum::Json<Value>, ApiError> {
    require_role(&principal, Role::Agent)?;
    let gate = &state.gate;
    let body = read_json(&headers, body, gate.limits.max_request_bytes).await?;
    let request = wire::parse_tool_calls(&body, gate.limits.max_tool_uses_per_request)?;
    let session = request
        .session_id
        .clone()
        .unwrap_or_else(airlock_policy::SessionId::default_session);
    let wait = request
        .wait_ms
        .map(Duration::from_millis)
        .unwrap_or_else(|| gate.default_wait());

    let receivers: Vec<_> = request
        .calls
        .into_iter()
        .map(|call| match call.into_tool_use() {
            Ok(tool_use) => gate.submit(&principal, &session, tool_use, None),
            Err((id, name, message)) => gate.reject(&principal, id, name, message),
        })
        .collect();
    let records =
        futures::future::join_all(receivers.into_iter().map(|rx| wait_final(rx, wait))).await;
    Ok(axum::Json(wire::tool_calls_response(
        request.shape,
        &records,
    )))
}

fn require_role(principal: &Principal, role: Role) -> Result<(), ApiError> {
    if principal.has(role) {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::FORBIDDEN,
        "forbidden",
        format!("principal {:?} lacks the {role:?} role", principal.name).to_lowercase(),
    ))
}

async fn get_call(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
    Path(call_id): Path<String>,
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let q = query(q)?;
    let wait_ms = match q.get("wait_ms") {
        None => 0,
        Some(v) => v.parse::<u64>().map_err(|_| {
            ApiError::bad_request("wait_ms must be a non-negative integer (milliseconds)")
        })?,
    }
    .min(wire::MAX_WAIT_MS);
    let rx = visible_call(&state, &principal, &call_id)?;
    let record = wait_final(rx, Duration::from_millis(wait_ms)).await;
    Ok(axum::Json(wire::call_detail(&record)))
}

async fn cancel_call(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
    Path(call_id): Path<String>,
) -> Result<axum::Json<Value>, ApiError> {
    let rx = visible_call(&state, &principal, &call_id)?;
    state.gate.calls.cancel(&call_id);
    let record = wait_final(rx, Duration::from_secs(5)).await;
    Ok(axum::Json(wire::call_detail(&record)))
}

/// A call is visible to the principal that made it and to admins; to anyone else it does
/// not exist.
fn visible_call(
    state: &HttpState,
    principal: &Principal,
    call_id: &str,
) -> Result<tokio::sync::watch::Receiver<crate::calls::CallRecord>, ApiError> {
    let unknown = || ApiError::not_found(format!("no call {call_id:?}"));
    let rx = state.gate.calls.watch(call_id).ok_or_else(unknown)?;
    let owner = rx.borrow().principal.clone();
    if owner != principal.name && !principal.roles.contains(&Role::Admin) {
        return Err(unknown());
    }
    Ok(rx)
}
