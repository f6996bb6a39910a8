//! The approvals console, `/ui` (DESIGN §14), served on the orchestrator's HTTP port.
//!
//! Pages are rendered here from compile-time templates ([`pages`], maud, which escapes
//! every value it is given), with one small script of our own (`console.js`, served
//! below) that updates the pending approvals live and nothing else. No inline script
//! and no third-party origin: every response carries a Content-Security-Policy that
//! forbids both.
//!
//! Signing in posts a token once (`name="token"`); it is then kept in an `HttpOnly`,
//! `SameSite=Strict` cookie scoped to `/ui` (hex-encoded, never in a URL or a page) and
//! checked against the principals in force on every request, so a token removed by a
//! reload stops working here at once too. Every form that changes something carries a
//! CSRF token derived from the session's token and is refused from another origin. The
//! live list is Server-Sent Events at `/ui/events`, authenticated by the same cookie
//! (EventSource sends it; no token in its URL).

mod pages;
mod preview;

use std::convert::Infallible;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt as _;
use maud::Markup;
use sha2::{Digest, Sha256};

use crate::audit::AuditQuery;
use crate::auth::Role;
use crate::gate::decisions::{self as approvals, DecideError};
use crate::http_api::HttpState;
use crate::store::{Approval, ApprovalQuery, ApprovalStatus, CallListFilter};

pub use pages::Viewer;

/// The session cookie: the token, hex-encoded (any byte a token holds stays a valid
/// cookie value).
const COOKIE: &str = "airlock_console";
/// Domain separation of the CSRF token from anything else derived from a token (the
/// configured `token_sha256` is the plain digest).
const CSRF_CONTEXT: &[u8] = b"airlock console csrf v1\0";
/// Largest form body accepted (a reason is at most 4096 bytes).
const MAX_FORM_BYTES: u64 = 16 * 1024;
/// Pending approvals shown at once.
const PENDING_PAGE: usize = 100;
/// Previews computed at once (each is one or two reads on a worker).
const PREVIEW_CONCURRENCY: usize = 8;
/// How often the live list looks at the store (decisions and new approvals on any
/// replica); a decision through this replica wakes it at once.
const LIVE_POLL: Duration = Duration::from_secs(1);
/// Audit records the audit page reads (the latest ones) before filtering.
const AUDIT_WINDOW: usize = 1000;
/// Rows shown at most on the calls and audit pages.
const ROWS_SHOWN: usize = 200;

/// The console's Content-Security-Policy: our own script, style, images and
/// connections only; no inline script or style, no frames, no `<base>`, forms only to
/// this origin.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'";

const SCRIPT: &str = include_str!("console.js");
const STYLE: &str = include_str!("console.css");

/// Why a console request was refused; each renders as a page with its status.
#[derive(Debug, thiserror::Error)]
pub enum UiError {
    #[error("sign in first: paste your token on the sign-in page")]
    SignedOut,
    #[error(
        "this form came from another site, or its CSRF token is missing or stale: reload the console and try again"
    )]
    Forgery,
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Conflict(String),
    #[error("the store is unavailable: {0}; try again shortly")]
    Unavailable(String),
    #[error("{0}")]
    TooMany(String),
}

impl UiError {
    fn status(&self) -> StatusCode {
        match self {
            UiError::SignedOut => StatusCode::UNAUTHORIZED,
            UiError::Forgery | UiError::Forbidden(_) => StatusCode::FORBIDDEN,
            UiError::NotFound(_) => StatusCode::NOT_FOUND,
            UiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            UiError::TooMany(_) => StatusCode::TOO_MANY_REQUESTS,
            UiError::Conflict(_) => StatusCode::CONFLICT,
            UiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

impl From<crate::store::StoreError> for UiError {
    fn from(e: crate::store::StoreError) -> Self {
        UiError::Unavailable(e.to_string())
    }
}

/// A refusal, rendered for whoever asked (signed in or not).
struct Refused {
    error: UiError,
    viewer: Option<Viewer>,
}

impl From<UiError> for Refused {
    fn from(error: UiError) -> Self {
        Refused {
            error,
            viewer: None,
        }
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        let status = self.error.status();
        let body = match self.error {
            UiError::SignedOut => pages::sign_in(Some(&self.error.to_string())),
            _ => pages::error_page(self.viewer.as_ref(), status, &self.error.to_string()),
        };
        html(status, body)
    }
}

fn html(status: StatusCode, markup: Markup) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        markup.into_string(),
    )
        .into_response()
}

/// Most live views (`/ui/events` streams) one principal may hold open at once.
pub const MAX_LIVE_STREAMS: usize = 8;

/// The live views open, by principal.
#[derive(Debug, Default)]
pub struct LiveStreams(std::sync::Mutex<std::collections::HashMap<String, usize>>);

impl LiveStreams {
    /// A slot for one more of `principal`'s streams, held until dropped; `None` at
    /// [`MAX_LIVE_STREAMS`].
    fn open(self: &std::sync::Arc<Self>, principal: &str) -> Option<LiveSlot> {
        let mut open = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(principal.to_owned()).or_default();
        if *count >= MAX_LIVE_STREAMS {
            return None;
        }
        *count += 1;
        Some(LiveSlot {
            streams: std::sync::Arc::clone(self),
            principal: principal.to_owned(),
        })
    }
}

/// One open live view.
struct LiveSlot {
    streams: std::sync::Arc<LiveStreams>,
    principal: String,
}

impl Drop for LiveSlot {
    fn drop(&mut self) {
        let mut open = self.streams.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = open.get_mut(&self.principal) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.remove(&self.principal);
            }
        }
    }
}

/// The console's routes, merged into the HTTP front door's router.
pub fn router() -> Router<HttpState> {
    Router::new()
        .route("/ui", get(home))
        .route("/ui/", get(home))
        .route("/ui/login", post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/events", get(events))
        .route("/ui/approvals/{approval_id}/decide", post(decide))
        .route("/ui/calls", get(calls))
        .route("/ui/calls/{call_id}", get(call))
        .route("/ui/audit", get(audit))
        .route("/ui/static/console.js", get(script))
        .route("/ui/static/console.css", get(style))
        .route("/ui/{*rest}", get(missing))
        .layer(axum::middleware::map_response(security_headers))
}

/// The headers every console response carries: the CSP, no framing, no MIME sniffing,
/// no referrer, and no caching (pages hold approvals, arguments and results).
async fn security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    headers.insert(
        header::HeaderName::from_static("cross-origin-opener-policy"),
        HeaderValue::from_static("same-origin"),
    );
    response
}

/// The signed-in caller: its principal and the CSRF token its forms carry.
fn session(state: &HttpState, headers: &HeaderMap) -> Option<Viewer> {
    let token = cookie_token(headers)?;
    let principal = state.principals.authenticate(&token)?;
    Some(Viewer::new(
        principal,
        csrf_for(&token),
        state.gate.distinct_approver(),
    ))
}

fn signed_in(state: &HttpState, headers: &HeaderMap) -> Result<Viewer, Refused> {
    session(state, headers).ok_or_else(|| UiError::SignedOut.into())
}

/// The token in the console's cookie, if the request carries exactly one.
fn cookie_token(headers: &HeaderMap) -> Option<String> {
    let mut found = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .filter(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value);
    let value = found.next()?;
    if found.next().is_some() {
        return None;
    }
    String::from_utf8(hex::decode(value).ok()?).ok()
}

fn csrf_for(token: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(CSRF_CONTEXT);
    hasher.update(token.as_bytes());
    hex::encode(hasher.finalize())
}

/// Equal without saying where they differ.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Whether a POST comes from a page of this origin. A browser's `Sec-Fetch-Site` says
/// so when it is sent (every current browser does); else an `Origin` must name this
/// host. `Origin: null` proves nothing either way (browsers send it for a form posted
/// under `Referrer-Policy: no-referrer`, as the console's are): then, as for a client
/// that sends neither, such as curl, the CSRF token decides.
fn same_origin(headers: &HeaderMap) -> bool {
    if let Some(site) = headers.get("sec-fetch-site") {
        return matches!(site.to_str(), Ok("same-origin" | "none"));
    }
    match headers.get(header::ORIGIN).map(HeaderValue::to_str) {
        None | Some(Ok("null")) => true,
        Some(Ok(origin)) => headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .is_some_and(|host| {
                origin == format!("http://{host}") || origin == format!("https://{host}")
            }),
        Some(Err(_)) => false,
    }
}

/// A form's fields, read under a cap.
async fn read_form<T: serde::de::DeserializeOwned>(
    headers: &HeaderMap,
    body: Body,
) -> Result<T, UiError> {
    let bytes = crate::body::read_capped(headers, body, MAX_FORM_BYTES, "send a shorter form")
        .await
        .map_err(|_| {
            UiError::BadRequest(format!(
                "the form could not be read, or is larger than {MAX_FORM_BYTES} bytes"
            ))
        })?;
    serde_urlencoded::from_bytes(&bytes)
        .map_err(|e| UiError::BadRequest(format!("the form is malformed: {e}")))
}

fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, UiError> {
    q.map(|Query(q)| q)
        .map_err(|e| UiError::BadRequest(format!("malformed query string: {e}")))
}

/// Filters as typed: an empty field is no filter.
fn filter(value: Option<String>) -> Option<String> {
    value.map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

fn see_other(location: &str) -> Response {
    (
        StatusCode::SEE_OTHER,
        [(header::LOCATION, location.to_owned())],
    )
        .into_response()
}

async fn script() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        SCRIPT,
    )
        .into_response()
}

async fn style() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE).into_response()
}

async fn missing(State(state): State<HttpState>, headers: HeaderMap) -> Response {
    let viewer = session(&state, &headers);
    html(
        StatusCode::NOT_FOUND,
        pages::error_page(
            viewer.as_ref(),
            StatusCode::NOT_FOUND,
            "no such page in the console; start from /ui",
        ),
    )
}

#[derive(Debug, Default, serde::Deserialize)]
struct HomeQuery {
    decided: Option<String>,
}

/// `/ui`: the sign-in page, or the pending approvals.
async fn home(
    State(state): State<HttpState>,
    headers: HeaderMap,
    q: Result<Query<HomeQuery>, QueryRejection>,
) -> Result<Response, Refused> {
    let Some(viewer) = session(&state, &headers) else {
        return Ok(html(StatusCode::OK, pages::sign_in(None)));
    };
    let q = query(q).map_err(|error| Refused {
        error,
        viewer: Some(viewer.clone()),
    })?;
    let decided = match q
        .decided
        .as_deref()
        .and_then(|id| crate::http_api::approval_cursor(id).ok())
    {
        Some(id) => state.gate.approval(&id).await.ok().flatten(),
        None => None,
    }
    .filter(|a| viewer.may_see_approval(a));
    let (approvals, more) = visible_pending(&state, &viewer)
        .await
        .map_err(|error| Refused {
            error,
            viewer: Some(viewer.clone()),
        })?;
    let pending = with_previews(&state, &viewer, approvals).await;
    Ok(html(
        StatusCode::OK,
        pages::console(&viewer, &pending, more, decided.as_ref()),
    ))
}

/// The pending approvals `viewer` may see, as stored (inputs not yet redacted), oldest
/// first, and whether more wait than the page holds ([`PENDING_PAGE`], or the store's
/// byte budget for the arguments a page carries): the page says so, rather than let a
/// few large approvals hide every later one.
async fn visible_pending(
    state: &HttpState,
    viewer: &Viewer,
) -> Result<(Vec<Approval>, bool), UiError> {
    let page = state
        .gate
        .approvals_page(&ApprovalQuery {
            status: Some(ApprovalStatus::Pending),
            limit: PENDING_PAGE,
            ..ApprovalQuery::default()
        })
        .await?;
    let more = page.next_cursor.is_some();
    let visible = page
        .approvals
        .into_iter()
        .filter(|a| viewer.may_see_approval(a))
        .collect();
    Ok((visible, more))
}

/// Each approval with why it was held and what it would do, its input redacted.
/// Previews only for a viewer who may decide the approval: a preview reads the file as it
/// is now, with no policy check of the viewer's own (a requester may be allowed to write
/// a file that policy forbids it to read), and costs reads on workers.
async fn with_previews(
    state: &HttpState,
    viewer: &Viewer,
    approvals: Vec<Approval>,
) -> Vec<pages::Pending> {
    let gate = &state.gate;
    futures::stream::iter(approvals)
        .map(|approval| async move {
            let hold = gate.hold_reasons(&approval).await.unwrap_or_default();
            let preview = if viewer.may_decide(&approval) {
                preview::preview(gate, &approval).await
            } else {
                preview::Preview::Unavailable(
                    "the preview reads the files as they are now and is shown only to those who may decide the call"
                        .to_owned(),
                )
            };
            let mut shown = approval;
            shown.input = gate.redact_input(&shown.tool, &shown.input);
            pages::Pending {
                approval: shown,
                hold,
                preview,
            }
        })
        .buffered(PREVIEW_CONCURRENCY)
        .collect()
        .await
}

#[derive(Debug, serde::Deserialize)]
struct LoginForm {
    #[serde(default)]
    token: String,
}

/// `POST /ui/login`: a valid token sets the session cookie.
async fn login(
    State(state): State<HttpState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refused> {
    if !same_origin(&headers) {
        return Err(UiError::Forgery.into());
    }
    let form: LoginForm = read_form(&headers, body).await?;
    let token = form.token.trim();
    if state.principals.authenticate(token).is_none() {
        return Ok(html(
            StatusCode::UNAUTHORIZED,
            pages::sign_in(Some(
                "that token is not valid: paste the token configured for your principal (airlock up writes its generated one to <data_dir>/token)",
            )),
        ));
    }
    let secure = headers
        .get("x-forwarded-proto")
        .is_some_and(|p| p.as_bytes().eq_ignore_ascii_case(b"https"));
    let cookie = format!(
        "{COOKIE}={}; Path=/ui; HttpOnly; SameSite=Strict{}",
        hex::encode(token.as_bytes()),
        if secure { "; Secure" } else { "" }
    );
    let mut response = see_other("/ui");
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    Ok(response)
}

#[derive(Debug, serde::Deserialize)]
struct LogoutForm {
    #[serde(default)]
    csrf: String,
}

/// `POST /ui/logout`: forgets the session cookie.
async fn logout(
    State(state): State<HttpState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refused> {
    let viewer = signed_in(&state, &headers)?;
    let form: LogoutForm = read_form(&headers, body).await?;
    if !same_origin(&headers) || !same_secret(&form.csrf, viewer.csrf()) {
        return Err(UiError::Forgery.into());
    }
    let mut response = see_other("/ui");
    response.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static(
            "airlock_console=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0",
        ),
    );
    Ok(response)
}

#[derive(Debug, serde::Deserialize)]
struct DecideForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    decision: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    input_sha256: String,
    /// `session` (a checkbox): later identical calls in the session run without a new
    /// approval. It applies to an approval; a denial ignores it.
    #[serde(default)]
    remember: String,
}

/// `POST /ui/approvals/{id}/decide`: approve or deny, as `POST
/// /v1/approvals/{id}/approve|deny` would, bound to the input the page showed.
async fn decide(
    State(state): State<HttpState>,
    headers: HeaderMap,
    Path(approval_id): Path<String>,
    body: Body,
) -> Result<Response, Refused> {
    let viewer = signed_in(&state, &headers)?;
    let refuse = |error: UiError| Refused {
        error,
        viewer: Some(viewer.clone()),
    };
    let form: DecideForm = read_form(&headers, body).await.map_err(refuse)?;
    if !same_origin(&headers) || !same_secret(&form.csrf, viewer.csrf()) {
        return Err(refuse(UiError::Forgery));
    }
    if let Some(why) = viewer.cannot_decide() {
        return Err(refuse(UiError::Forbidden(why)));
    }
    let approve = match form.decision.as_str() {
        "approve" => true,
        "deny" => false,
        _ => {
            return Err(refuse(UiError::BadRequest(
                "decision must be approve or deny".into(),
            )));
        }
    };
    let reason = form.reason.trim();
    if let Err(why) = approvals::check_reason(reason) {
        return Err(refuse(UiError::BadRequest(why)));
    }
    let digest = form.input_sha256.trim();
    let well_formed = digest.len() == 64 && digest.chars().all(|c| c.is_ascii_hexdigit());
    if !digest.is_empty() && !well_formed {
        return Err(refuse(UiError::BadRequest(
            "input_sha256 must be the 64 hex digits of the approval's input_sha256".into(),
        )));
    }
    let decided = approvals::decide(
        &state.gate,
        viewer.principal(),
        &approval_id,
        approve,
        (!reason.is_empty()).then_some(reason),
        (!digest.is_empty()).then_some(digest),
        approve && form.remember == "session",
    )
    .await
    .map_err(|e| {
        refuse(match e {
            DecideError::NotFound => UiError::NotFound(format!("no approval {approval_id:?}")),
            DecideError::SelfApproval => UiError::Forbidden(format!(
                "you ({}) requested this call, and [approvals] distinct_approver is set: another approver must decide it",
                viewer.principal().name
            )),
            DecideError::AlreadyApproved(_) => UiError::Conflict(format!(
                "you approved this call already; it needs more distinct approvers, so someone else must approve it too ({e})"
            )),
            DecideError::InputChanged { .. } => UiError::Conflict(format!(
                "the call's input is not the one this page showed, so nothing was decided: {e}"
            )),
            DecideError::Store(_) => UiError::Unavailable(e.to_string()),
            other => UiError::Conflict(other.to_string()),
        })
    })?;
    Ok(see_other(&format!("/ui?decided={}", decided.approval_id)))
}

/// `GET /ui/events`: the pending approvals as Server-Sent Events, a `pending` event
/// with the list's HTML whenever it changes (and once at the start), until the client
/// goes away or its token stops being valid (then `signed_out`).
async fn events(State(state): State<HttpState>, headers: HeaderMap) -> Result<Response, Refused> {
    let viewer = signed_in(&state, &headers)?;
    // Each stream reads the pending approvals every second; a principal gets a few
    // (tabs, a second screen), not as many as it can open.
    let Some(slot) = state.live_streams.open(&viewer.principal().name) else {
        return Err(Refused {
            error: UiError::TooMany(format!(
                "{} live views are open for {} already: close one (each console tab holds one)",
                MAX_LIVE_STREAMS,
                viewer.principal().name
            )),
            viewer: Some(viewer),
        });
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(4);
    tokio::spawn(async move {
        let _slot = slot;
        let mut last: Option<String> = None;
        loop {
            // Checked every round: a token removed by a reload ends the stream.
            let Some(viewer) = session(&state, &headers) else {
                let _ = tx
                    .send(Ok(Event::default().event("signed_out").data("signed out")))
                    .await;
                return;
            };
            // The previews (reads on workers) only when the list changed.
            if let Ok((approvals, more)) = visible_pending(&state, &viewer).await {
                let version = format!("{}{}", pages::list_version(&approvals), u8::from(more));
                if last.as_ref() != Some(&version) {
                    let pending = with_previews(&state, &viewer, approvals).await;
                    // An SSE line ends at a CR too: as a character reference it stays
                    // text (a CRLF file's diff) without breaking the event.
                    let fragment = pages::pending_list(&viewer, &pending, more)
                        .into_string()
                        .replace('\r', "&#13;");
                    if tx
                        .send(Ok(Event::default().event("pending").data(fragment)))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    last = Some(version);
                }
            }
            tokio::select! {
                _ = tx.closed() => return,
                // The stream ends; the browser reconnects to another replica, or to this
                // one once it is back.
                _ = state.stopping.cancelled() => return,
                _ = state.gate.decided_notified() => {}
                _ = tokio::time::sleep(LIVE_POLL) => {}
            }
        }
    });
    Ok(Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response())
}

#[derive(Debug, Default, serde::Deserialize)]
struct CallsQuery {
    tool: Option<String>,
    status: Option<String>,
    principal: Option<String>,
}

/// The statuses the calls page filters by.
pub const CALL_STATUSES: [&str; 8] = [
    "ok",
    "error",
    "denied",
    "timeout",
    "cancelled",
    "pending_approval",
    "running",
    "rejected",
];

/// `GET /ui/calls`: the latest calls, filtered; an admin's of every principal, anyone
/// else's their own.
async fn calls(
    State(state): State<HttpState>,
    headers: HeaderMap,
    q: Result<Query<CallsQuery>, QueryRejection>,
) -> Result<Response, Refused> {
    let viewer = signed_in(&state, &headers)?;
    let refuse = |error: UiError| Refused {
        error,
        viewer: Some(viewer.clone()),
    };
    let q = query(q).map_err(refuse)?;
    let status = filter(q.status);
    if let Some(s) = &status
        && !CALL_STATUSES.contains(&s.as_str())
    {
        return Err(refuse(UiError::BadRequest(format!(
            "status must be one of {}",
            CALL_STATUSES.join(", ")
        ))));
    }
    let asked = pages::CallFilters {
        tool: filter(q.tool),
        status,
        principal: filter(q.principal),
    };
    let principal = if viewer.principal().roles.contains(&Role::Admin) {
        asked.principal.clone()
    } else {
        Some(viewer.principal().name.clone())
    };
    let list = state
        .gate
        .recent_calls(&CallListFilter {
            principal,
            tool: asked.tool.clone(),
            status: asked.status.clone(),
            limit: ROWS_SHOWN,
        })
        .await
        .map_err(|e| refuse(e.into()))?;
    Ok(html(StatusCode::OK, pages::calls(&viewer, &asked, &list)))
}

/// `GET /ui/calls/{id}`: one call, its input and, once final, its result. Visible to
/// the principal that made it, to admins, and to approvers when it was held for
/// approval (they were shown its input already).
async fn call(
    State(state): State<HttpState>,
    headers: HeaderMap,
    Path(call_id): Path<String>,
) -> Result<Response, Refused> {
    let viewer = signed_in(&state, &headers)?;
    let refuse = |error: UiError| Refused {
        error,
        viewer: Some(viewer.clone()),
    };
    let not_found = || refuse(UiError::NotFound(format!("no call {call_id:?}")));
    let stored = state
        .gate
        .stored_call(&call_id)
        .await
        .map_err(|e| refuse(e.into()))?
        .ok_or_else(not_found)?;
    let me = viewer.principal();
    let visible = stored.principal == me.name
        || me.roles.contains(&Role::Admin)
        || (me.has(Role::Approver) && stored.approval_id.is_some());
    if !visible {
        return Err(not_found());
    }
    // This replica's view first (a running call's progress), else the store's.
    let record = match state.gate.watch(&call_id) {
        Some(rx) => Some(rx.borrow().clone()),
        None => state
            .gate
            .stored_record(&call_id)
            .await
            .map_err(|e| refuse(e.into()))?,
    };
    let detail = record.as_ref().map(crate::wire::call_detail);
    let result_text = record
        .as_ref()
        .filter(|r| r.status.is_final())
        .and_then(|r| r.result.as_ref())
        .map(|outcome| {
            (
                outcome.is_error,
                state.gate.redact_text(&outcome.content.join("\n")),
            )
        });
    Ok(html(
        StatusCode::OK,
        pages::call(&viewer, &stored, detail.as_ref(), result_text),
    ))
}

#[derive(Debug, Default, serde::Deserialize)]
struct AuditParams {
    kind: Option<String>,
    principal: Option<String>,
    tool: Option<String>,
    session_id: Option<String>,
    call_id: Option<String>,
}

/// `GET /ui/audit`: the chain's verify result and the latest records, filtered (the
/// admin role, as `GET /v1/audit`).
async fn audit(
    State(state): State<HttpState>,
    headers: HeaderMap,
    q: Result<Query<AuditParams>, QueryRejection>,
) -> Result<Response, Refused> {
    let viewer = signed_in(&state, &headers)?;
    let refuse = |error: UiError| Refused {
        error,
        viewer: Some(viewer.clone()),
    };
    if !viewer.principal().roles.contains(&Role::Admin) {
        return Err(refuse(UiError::Forbidden(format!(
            "the audit log needs the admin role; {} has {}",
            viewer.principal().name,
            viewer.roles_text()
        ))));
    }
    let q = query(q).map_err(refuse)?;
    let asked = pages::AuditFilters {
        kind: filter(q.kind),
        principal: filter(q.principal),
        tool: filter(q.tool),
        session_id: filter(q.session_id),
        call_id: filter(q.call_id),
    };
    let verify = state
        .gate
        .verify_audit()
        .await
        .map_err(|e| refuse(e.into()))?;
    let events = state
        .gate
        .audit_events(AuditQuery {
            session_id: asked.session_id.clone(),
            call_id: asked.call_id.clone(),
            limit: AUDIT_WINDOW,
            latest: true,
            ..AuditQuery::default()
        })
        .await
        .map_err(|e| refuse(e.into()))?;
    // Only `requested` names the tool: its calls are those of the tool.
    let tool_calls: Option<std::collections::HashSet<String>> = asked.tool.as_ref().map(|tool| {
        events
            .iter()
            .filter(|e| {
                e.kind == "requested" && e.data.get("tool").and_then(|t| t.as_str()) == Some(tool)
            })
            .filter_map(|e| e.call_id.clone())
            .collect()
    });
    let shown: Vec<_> = events
        .iter()
        .rev()
        .filter(|e| asked.kind.as_ref().is_none_or(|k| &e.kind == k))
        .filter(|e| {
            asked
                .principal
                .as_ref()
                .is_none_or(|p| e.principal.as_ref() == Some(p))
        })
        .filter(|e| {
            tool_calls
                .as_ref()
                .is_none_or(|calls| e.call_id.as_ref().is_some_and(|c| calls.contains(c)))
        })
        .take(ROWS_SHOWN)
        .collect();
    Ok(html(
        StatusCode::OK,
        pages::audit(&viewer, &asked, &verify, &shown, AUDIT_WINDOW),
    ))
}
