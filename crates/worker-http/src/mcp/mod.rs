//! Streamable HTTP MCP servers behind the gate (DESIGN §11): each `[[mcp_servers]]`
//! entry with a `url` is reached by the http worker, through its own client, so under
//! the same egress rules as `http_request` (host `allow`/`deny`, special-purpose
//! addresses refused, every resolved address checked before the connection, one
//! connection per request to a checked address). Redirects are not followed.
//!
//! The protocol is spoken by hand, over that client: `initialize` (protocol version
//! 2025-06-18 asked for; the server's `Mcp-Session-Id` kept and sent back with
//! `MCP-Protocol-Version` on every later request), `notifications/initialized`,
//! `tools/list` (following `nextCursor`), and one `tools/call` per call with a
//! `progressToken` whose `notifications/progress` become the call's progress; the
//! call's cancellation or deadline sends `notifications/cancelled`. An answer may be
//! one JSON message or an event stream; see [`wire`] for the bounds.
//!
//! Sessions: one per (principal, session) with `per_session = true` (the default),
//! else one for every call; a session unused for `idle_seconds` is closed (`DELETE`),
//! at most `max_sessions` are open, and one the server forgot (404) is started again.
//! The server is a stranger: its failure, hang or garbage is an `is_error` result for
//! the call at hand, naming the server and the cause, never a crash of the worker.
//! Header secrets (`${env:NAME}`, `${file:/path}`) are read by the http worker alone
//! and redacted from everything the server sends back.

mod wire;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_worker::mcp::{
    IdleSince, ListedTools, McpServerEntry, SessionKey, SessionSlot, evict_idle, session_key,
};
use airlock_worker::{CallContext, Tool, ToolDefinition, ToolOutcome};
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use serde_json::{Value, json};
use url::Url;

use crate::client::Client;
use crate::declared::SecretHeaders;
use wire::{Endpoint, SessionHeaders, WireError};

pub use airlock_worker::mcp::McpEntryError;
use airlock_worker::mcp::{MAX_PAGES, MAX_TOOLS};

/// The protocol version asked for in `initialize`.
const PROTOCOL_VERSION: &str = "2025-06-18";
/// The versions whose Streamable HTTP transport this client speaks.
const KNOWN_VERSIONS: [&str; 4] = ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"];
/// Calls give up this long before the call's deadline so their own answer gets back.
const DEADLINE_MARGIN: Duration = Duration::from_millis(200);
/// How long a notification (cancelled, a session's DELETE) may take.
const NOTICE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a Streamable HTTP server cannot be served: the http worker refuses to start.
#[derive(Debug, thiserror::Error)]
pub enum McpStartError {
    #[error("the MCP server {server} could not be started: {reason}")]
    Start { server: String, reason: String },
}

/// A checked `[[mcp_servers]]` entry with a `url`: everything but its secrets. Every
/// component compiles it at load, so a bad entry stops them all at start.
#[derive(Debug, Clone)]
pub struct McpHttpServer {
    entry: McpServerEntry,
    url: Url,
    headers: SecretHeaders,
}

/// Headers the MCP client sets itself.
fn reserved(name: &HeaderName) -> Option<&'static str> {
    matches!(
        name.as_str(),
        "accept" | "content-type" | "mcp-session-id" | "mcp-protocol-version" | "last-event-id"
    )
    .then_some("the MCP client sets this header itself")
}

impl McpHttpServer {
    /// Checks the entry ([`McpServerEntry::check`]), its URL and its headers; no secret
    /// is read here. Errors name the entry.
    pub fn compile(entry: &McpServerEntry) -> Result<Self, McpEntryError> {
        entry.check()?;
        let invalid = |reason: String| McpEntryError::Invalid {
            server: entry.name.clone(),
            reason,
        };
        let raw = entry
            .url
            .as_deref()
            .filter(|_| entry.is_http())
            .ok_or_else(|| invalid("no url: this entry is the shell worker's".into()))?;
        let url = crate::resolve::parse_url(raw).map_err(|e| invalid(e.to_string()))?;
        let headers =
            SecretHeaders::compile(&entry.headers, "headers", reserved).map_err(invalid)?;
        Ok(Self {
            entry: entry.clone(),
            url,
            headers,
        })
    }

    pub fn name(&self) -> &str {
        &self.entry.name
    }

    /// The environment variables its headers read (the launcher passes exactly these
    /// to the http worker).
    pub fn env_names(&self) -> Vec<String> {
        self.headers.env_names()
    }

    /// Reads the secrets its headers name, now (the http worker does this once at
    /// start, before it gives up file access). Errors name the variable or file.
    pub fn resolve(self) -> Result<ResolvedMcpServer, McpEntryError> {
        let (headers, redactor) =
            self.headers
                .resolve("headers")
                .map_err(|reason| McpEntryError::Invalid {
                    server: self.entry.name.clone(),
                    reason,
                })?;
        Ok(ResolvedMcpServer {
            entry: self.entry,
            url: self.url,
            headers,
            redactor,
        })
    }
}

/// The entries with a `url`, compiled.
pub fn compile_all(entries: &[McpServerEntry]) -> Result<Vec<McpHttpServer>, McpEntryError> {
    entries
        .iter()
        .filter(|e| e.is_http())
        .map(McpHttpServer::compile)
        .collect()
}

/// An [`McpHttpServer`] with its secrets read: only the http worker holds one.
pub struct ResolvedMcpServer {
    entry: McpServerEntry,
    url: Url,
    headers: http::HeaderMap,
    redactor: crate::declared::Redactor,
}

impl std::fmt::Debug for ResolvedMcpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResolvedMcpServer")
            .field("name", &self.entry.name)
            .field("url", &self.url.as_str())
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// Opens a session with each server to learn its tools; returns the tools to serve.
/// A server that cannot be reached, that the egress policy refuses, or that does not
/// answer `initialize` and `tools/list` within `start_timeout_seconds` is an error
/// naming it: the worker refuses to start rather than serve without its tools.
pub(crate) async fn start(
    servers: Vec<ResolvedMcpServer>,
    client: &Client,
) -> Result<Vec<McpHttpTool>, McpStartError> {
    let mut tools = Vec::new();
    for server in servers {
        let pool = Pool::start(server, client.clone()).await?;
        let names = pool.tool_names();
        tracing::info!(server = %pool.entry.name, tools = names.len(), "MCP server (Streamable HTTP) listed");
        tools.extend(names.into_iter().map(|mcp_name| McpHttpTool {
            pool: pool.clone(),
            mcp_name,
        }));
    }
    Ok(tools)
}

/// One key's session, or none yet; locked while it starts.
type Slot = SessionSlot<Session>;

/// One entry: where it is, its sessions, and its tools.
struct Pool {
    entry: McpServerEntry,
    endpoint: Endpoint,
    slots: Mutex<HashMap<SessionKey, Slot>>,
    /// The server's tools, as last listed.
    tools: ListedTools,
}

/// One MCP session with the server.
struct Session {
    headers: SessionHeaders,
    next_id: AtomicU64,
    /// When the last call ended (or the session started), and calls running now.
    usage: Mutex<(Instant, usize)>,
}

impl Session {
    fn id(&self) -> Value {
        json!(self.next_id.fetch_add(1, Ordering::Relaxed))
    }
}

impl IdleSince for Session {
    fn idle_since(&self) -> Option<Instant> {
        let (since, running) = *lock(&self.usage);
        (running == 0).then_some(since)
    }
}

impl Pool {
    async fn start(server: ResolvedMcpServer, client: Client) -> Result<Arc<Self>, McpStartError> {
        let pool = Arc::new(Pool {
            endpoint: Endpoint {
                url: server.url,
                headers: server.headers,
                redactor: server.redactor,
                client,
            },
            entry: server.entry,
            slots: Mutex::new(HashMap::new()),
            tools: ListedTools::default(),
        });
        let session = pool
            .open_session()
            .await
            .map_err(|reason| McpStartError::Start {
                server: pool.entry.name.clone(),
                reason,
            })?;
        if pool.entry.per_session {
            pool.close(session);
        } else {
            let slot = Arc::new(tokio::sync::Mutex::new(Some(session)));
            lock(&pool.slots).insert(None, slot);
        }
        Ok(pool)
    }

    fn tool_names(&self) -> Vec<String> {
        self.tools.names()
    }

    fn definition(&self, mcp_name: &str) -> Option<ToolDefinition> {
        self.tools.definition(mcp_name)
    }

    /// `initialize`, `notifications/initialized` and `tools/list`, within
    /// `start_timeout_seconds`; the listing updates the tools' definitions.
    async fn open_session(&self) -> Result<Arc<Session>, String> {
        let limit = Duration::from_secs(self.entry.start_timeout_seconds);
        match tokio::time::timeout(limit, self.handshake()).await {
            Ok(result) => result,
            Err(_) => Err(format!(
                "it did not answer initialize and tools/list within {}s (start_timeout_seconds)",
                limit.as_secs()
            )),
        }
    }

    async fn handshake(&self) -> Result<Arc<Session>, String> {
        let mut session = Session {
            headers: SessionHeaders::default(),
            next_id: AtomicU64::new(0),
            usage: Mutex::new((Instant::now(), 0)),
        };
        let id = session.id();
        let initialize = json!({"jsonrpc": "2.0", "id": id, "method": "initialize", "params": {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "airlock", "version": env!("CARGO_PKG_VERSION")},
        }});
        let answer = self
            .endpoint
            .post(&session.headers, &initialize, Some(&id), &mut |_| {})
            .await
            .map_err(|e| format!("initialize failed: {e}"))?;
        let result = answer.result.unwrap_or_default();
        let version = result
            .get("protocolVersion")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !KNOWN_VERSIONS.contains(&version) {
            return Err(format!(
                "it answered initialize with protocol version {version:?}; Airlock speaks {}",
                KNOWN_VERSIONS.join(", ")
            ));
        }
        session.headers = SessionHeaders {
            id: answer.session_id,
            version: Some(HeaderValue::from_static(
                KNOWN_VERSIONS
                    .iter()
                    .find(|v| **v == version)
                    .copied()
                    .unwrap_or(PROTOCOL_VERSION),
            )),
        };
        let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        self.endpoint
            .post(&session.headers, &initialized, None, &mut |_| {})
            .await
            .map_err(|e| format!("notifications/initialized failed: {e}"))?;
        let tools = self.list_tools(&session).await?;
        self.learn(&tools);
        Ok(Arc::new(session))
    }

    /// Every page of `tools/list`, at most [`MAX_TOOLS`] tools.
    async fn list_tools(&self, session: &Session) -> Result<Vec<Value>, String> {
        let mut tools = Vec::new();
        let mut cursor: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let id = session.id();
            let params = match &cursor {
                Some(cursor) => json!({"cursor": cursor}),
                None => json!({}),
            };
            let request =
                json!({"jsonrpc": "2.0", "id": id, "method": "tools/list", "params": params});
            let result = self
                .endpoint
                .post(&session.headers, &request, Some(&id), &mut |_| {})
                .await
                .map_err(|e| format!("tools/list failed: {e}"))?
                .result
                .unwrap_or_default();
            let page = result
                .get("tools")
                .and_then(Value::as_array)
                .ok_or("tools/list failed: its result has no tools array")?;
            tools.extend(page.iter().cloned());
            if tools.len() > MAX_TOOLS {
                return Err(format!(
                    "it lists more than {MAX_TOOLS} tools, the most served of one server"
                ));
            }
            cursor = result
                .get("nextCursor")
                .and_then(Value::as_str)
                .map(str::to_owned);
            if cursor.is_none() {
                return Ok(tools);
            }
        }
        Err(format!(
            "tools/list goes on past {MAX_PAGES} pages (nextCursor)"
        ))
    }

    /// Takes in a `tools/list` (see [`ListedTools::learn`]).
    fn learn(&self, tools: &[Value]) {
        self.tools.learn(&self.entry, tools, "http");
    }

    /// Ends a session the pool no longer uses: `DELETE` with its id, in the background.
    fn close(&self, session: Arc<Session>) {
        let Some(id) = session.headers.id.clone() else {
            return;
        };
        let mut headers = self.endpoint.headers.clone();
        headers.insert(wire::SESSION_ID, id);
        if let Some(version) = &session.headers.version {
            headers.insert(wire::PROTOCOL_VERSION, version.clone());
        }
        let client = self.endpoint.client.clone();
        let url = self.endpoint.url.clone();
        tokio::spawn(async move {
            let delete = client.open(http::Method::DELETE, &url, &headers, Bytes::new());
            let _ = tokio::time::timeout(NOTICE_TIMEOUT, delete).await;
        });
    }

    /// The call's session, opened when it has none.
    async fn session(&self, ctx: &CallContext) -> Result<(Slot, Arc<Session>), String> {
        let key = session_key(&self.entry, ctx);
        let slot = {
            let mut slots = lock(&self.slots);
            self.reap_idle(&mut slots);
            if !slots.contains_key(&key)
                && slots.len() >= self.entry.max_sessions
                && let Some(session) = evict_idle(&mut slots, &self.entry)?
            {
                self.close(session);
            }
            slots.entry(key).or_default().clone()
        };
        let mut held = slot.lock().await;
        if let Some(session) = held.as_ref() {
            return Ok((slot.clone(), session.clone()));
        }
        let session = self.open_session().await?;
        *held = Some(session.clone());
        drop(held);
        Ok((slot, session))
    }

    /// Closes the sessions (of a key of their own) idle longer than `idle_seconds`.
    fn reap_idle(&self, slots: &mut HashMap<SessionKey, Slot>) {
        let limit = Duration::from_secs(self.entry.idle_seconds);
        slots.retain(|key, slot| {
            let Ok(mut held) = slot.try_lock() else {
                return true;
            };
            let idle = held
                .as_ref()
                .and_then(|s| s.idle_since())
                .is_some_and(|since| since.elapsed() >= limit);
            if key.is_some() && idle {
                if let Some(session) = held.take() {
                    self.close(session);
                }
                return false;
            }
            true
        });
    }

    /// Forgets `session` if it is still the slot's: the next call opens a new one.
    async fn forget(&self, slot: &Slot, session: &Arc<Session>) {
        let mut held = slot.lock().await;
        if held.as_ref().is_some_and(|s| Arc::ptr_eq(s, session)) {
            *held = None;
        }
    }

    /// One call of the server's tool `mcp_name`: on the call's session, opened again
    /// (and the call sent once more) when the server no longer knows it.
    async fn call(&self, mcp_name: &str, arguments: Value, ctx: &CallContext) -> ToolOutcome {
        let server = &self.entry.name;
        for attempt in 0..2 {
            let (slot, session) = match self.session(ctx).await {
                Ok(found) => found,
                Err(reason) => {
                    return ToolOutcome::error(format!(
                        "the MCP server {server} could not be reached: {reason}"
                    ));
                }
            };
            match self.call_on(&session, mcp_name, &arguments, ctx).await {
                Ok(outcome) => return outcome,
                Err(WireError::SessionExpired) if attempt == 0 => {
                    self.forget(&slot, &session).await;
                }
                Err(WireError::Rpc { code, message }) => {
                    return ToolOutcome::error(format!(
                        "the MCP server {server} refused the call of {mcp_name} (error {code}): {message}"
                    ));
                }
                Err(e) => {
                    // No answer: the next call starts with a new session, which also
                    // finds out whether the server is back.
                    self.forget(&slot, &session).await;
                    return ToolOutcome::error(format!(
                        "the MCP server {server} did not answer the call of {mcp_name}: {e}"
                    ));
                }
            }
        }
        ToolOutcome::error(format!(
            "the MCP server {server} forgot its session twice in a row; try again"
        ))
    }

    /// `tools/call` on `session`, with progress relayed and the call's cancellation or
    /// deadline passed on as `notifications/cancelled`.
    async fn call_on(
        &self,
        session: &Arc<Session>,
        mcp_name: &str,
        arguments: &Value,
        ctx: &CallContext,
    ) -> Result<ToolOutcome, WireError> {
        let _running = Running::new(session);
        let id = session.id();
        let token = id.clone();
        let request = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
            "name": mcp_name,
            "arguments": arguments,
            "_meta": {"progressToken": token},
        }});
        let progress_ctx = ctx.clone();
        let mut on_message = move |message: Value| {
            if message.get("method").and_then(Value::as_str) != Some("notifications/progress") {
                return;
            }
            let params = message.get("params").cloned().unwrap_or_default();
            if params.get("progressToken") != Some(&token) {
                return;
            }
            let Some(progress) = params.get("progress").and_then(Value::as_f64) else {
                return;
            };
            let total = params.get("total").and_then(Value::as_f64);
            let text = params
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or_default();
            // Cut to a status line's length by `progress` itself.
            progress_ctx.progress(progress, total, text);
        };
        let deadline = tokio::time::Instant::from_std(ctx.deadline)
            .checked_sub(DEADLINE_MARGIN)
            .unwrap_or_else(tokio::time::Instant::now);
        let why = tokio::select! {
            answer = self.endpoint.post(&session.headers, &request, Some(&id), &mut on_message) => {
                let result = answer?.result.unwrap_or_default();
                let mut outcome = airlock_worker::mcp::outcome(&result);
                // The answer was read redacted; a tool's own text is too.
                for text in &mut outcome.content {
                    *text = self.endpoint.redactor.text(text);
                }
                return Ok(outcome);
            }
            () = ctx.cancel.cancelled() => "was cancelled",
            () = tokio::time::sleep_until(deadline) => "ran out of time (the call's deadline)",
        };
        self.cancelled(session, id, why);
        Ok(ToolOutcome::error(format!(
            "the call of {mcp_name} on the MCP server {} {why}",
            self.entry.name
        )))
    }

    /// Tells the server, in the background, that it may stop working on request `id`.
    fn cancelled(&self, session: &Arc<Session>, id: Value, why: &str) {
        let notice = json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {
            "requestId": id,
            "reason": format!("the call {why}"),
        }});
        let headers = session.headers.clone();
        let endpoint = Endpoint {
            url: self.endpoint.url.clone(),
            headers: self.endpoint.headers.clone(),
            redactor: self.endpoint.redactor.clone(),
            client: self.endpoint.client.clone(),
        };
        tokio::spawn(async move {
            let mut ignore = |_: Value| {};
            let send = endpoint.post(&headers, &notice, None, &mut ignore);
            let _ = tokio::time::timeout(NOTICE_TIMEOUT, send).await;
        });
    }
}

/// Counts a call as running on its session while it lives.
struct Running<'a>(&'a Session);

impl<'a> Running<'a> {
    fn new(session: &'a Session) -> Self {
        lock(&session.usage).1 += 1;
        Running(session)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut usage = lock(&self.0.usage);
        usage.0 = Instant::now();
        usage.1 = usage.1.saturating_sub(1);
    }
}

/// `<server>__<tool>` of a Streamable HTTP server.
pub(crate) struct McpHttpTool {
    pool: Arc<Pool>,
    mcp_name: String,
}

#[airlock_worker::async_trait]
impl Tool for McpHttpTool {
    /// The definition as the server last listed it: a server that changes it later is
    /// seen changed by the orchestrator, which pinned the first one.
    fn definition(&self) -> ToolDefinition {
        self.pool.definition(&self.mcp_name).unwrap_or_else(|| {
            // Unreachable in practice: a pool's tools are only ever replaced, never
            // removed. A definition that says so is still better than a panic.
            ToolDefinition {
                name: self
                    .pool
                    .entry
                    .tool_name(&self.mcp_name)
                    .unwrap_or_else(|_| self.mcp_name.clone()),
                title: String::new(),
                description: "This MCP tool is unavailable.".into(),
                input_schema: json!({"type": "object"}),
                annotations: Default::default(),
            }
        })
    }

    async fn execute(&self, arguments: Value, ctx: CallContext) -> ToolOutcome {
        if !arguments.is_object() {
            return ToolOutcome::error("the arguments must be a JSON object");
        }
        let started = Instant::now();
        let outcome = self.pool.call(&self.mcp_name, arguments, &ctx).await;
        tracing::debug!(
            server = %self.pool.entry.name,
            tool = %self.mcp_name,
            call_id = %ctx.call_id,
            is_error = outcome.is_error,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "MCP call (Streamable HTTP) finished"
        );
        outcome
    }
}

// A panic while holding one of the pool's locks leaves the data as it was (each holder
// only inserts, removes or replaces whole values), so a poisoned lock is used as is.

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests;
