//! One running stdio MCP server: a process in the sandbox whose stdin and stdout are
//! pipes of ours, and the MCP client session over them.
//!
//! The process is confined exactly like a call of `execute_shell` (it is started by
//! [`Sandbox::run_attached`] on a blocking thread, which supervises it until it exits);
//! only its lifetime differs. Everything it sends is untrusted: one message is at most
//! [`MAX_MESSAGE_BYTES`] (a longer line is dropped, the call it should answer runs into
//! its deadline), unparsable lines are ignored, and its stderr is kept only as a short
//! tail for the error a crash gives. What it is sent is bounded too: a server that
//! stops reading its stdin is held back, then stopped (see `outbound.rs`).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_policy::ToolOutcome;
use airlock_sandbox::{AttachedStdio, Cancel, CommandSpec, Sandbox, Stream};
use airlock_worker::CallContext;
use airlock_worker::mcp::{IdleSince, MAX_PAGES, MAX_TOOLS, McpServerEntry};
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CancelledNotificationParam, ClientCapabilities,
    ClientConfig, ClientRequest, Implementation, PaginatedRequestParams, ProgressNotificationParam,
    ProgressToken, ServerResult,
};
use rmcp::service::{NotificationContext, PeerRequestOptions, RunningService, ServiceError};
use rmcp::transport::async_rw::AsyncRwTransport;
use rmcp::{ClientHandler, Peer, RoleClient, ServiceExt};
use serde_json::Value;
use tokio::sync::{Notify, watch};

use super::lock;
use super::outbound::Outbound;

/// Longest message a server may send (one JSON-RPC line).
pub(super) const MAX_MESSAGE_BYTES: usize = 4 << 20;
/// How much of a server's stderr a crash report quotes.
const STDERR_TAIL_BYTES: usize = 2048;
/// How long a failed call waits for the process's exit report.
const EXIT_REPORT_WAIT: Duration = Duration::from_secs(2);
/// A server's process lives at most this long; idle ones are stopped long before.
const MAX_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// How long a listing the server asked for (`notifications/tools/list_changed`) may
/// take, all its pages together.
const RELIST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a cancelled call waits to queue its `notifications/cancelled`.
const CANCEL_NOTICE_WAIT: Duration = Duration::from_secs(1);
/// A server's stdin full for this long is named in a cancelled call's error.
const STALL_WORTH_SAYING: Duration = Duration::from_secs(1);

/// Why a server could not be started or answered.
#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    #[error("the MCP server {server} could not be started: {reason}")]
    Start { server: String, reason: String },
}

/// The MCP client's side of the session: relays progress to the call that asked for
/// it, and says when the server's tool list changed.
#[derive(Clone, Default)]
struct Bridge {
    progress: Arc<Mutex<HashMap<ProgressToken, CallContext>>>,
    tools_changed: Arc<Notify>,
}

impl ClientHandler for Bridge {
    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        let ctx = lock(&self.progress).get(&params.progress_token).cloned();
        if let Some(ctx) = ctx {
            ctx.progress(
                params.progress,
                params.total,
                params.message.unwrap_or_default(),
            );
        }
    }

    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.tools_changed.notify_one();
    }

    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("airlock", env!("CARGO_PKG_VERSION")),
        )
    }
}

/// One running server.
pub(super) struct Instance {
    server: String,
    peer: Peer<RoleClient>,
    bridge: Bridge,
    /// Kept for as long as the instance lives: dropping it ends the session.
    _service: RunningService<RoleClient, Bridge>,
    /// Kills the sandbox (on drop, too).
    cancel: Cancel,
    /// `Some(how)` once the process is gone.
    exited: watch::Receiver<Option<String>>,
    /// What is written to the server: bounded, and given up when it stops reading.
    outbound: Arc<Outbound>,
    /// When the last call ended (or the instance started), and calls running now.
    usage: Mutex<(Instant, usize)>,
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Where and how one instance runs.
pub(super) struct Launch<'a> {
    pub entry: &'a McpServerEntry,
    pub sandbox: &'a Arc<Sandbox>,
    /// Mounted at `/workspace`, the server's working directory.
    pub workspace: PathBuf,
}

impl Instance {
    /// Starts the server and runs MCP's `initialize`; returns the instance and the
    /// server's `tools/list` (as JSON `Tool` objects).
    pub(super) async fn start(
        launch: Launch<'_>,
    ) -> Result<(Arc<Self>, Vec<Value>), InstanceError> {
        let server = launch.entry.name.clone();
        let fail = |reason: String| InstanceError::Start {
            server: server.clone(),
            reason,
        };
        let command = launch.entry.command.clone().unwrap_or_default();
        let (child_stdin, our_stdin) = std::io::pipe().map_err(|e| fail(format!("pipe: {e}")))?;
        let (our_stdout, child_stdout) = std::io::pipe().map_err(|e| fail(format!("pipe: {e}")))?;
        let writer = tokio::net::unix::pipe::Sender::from_owned_fd(OwnedFd::from(our_stdin))
            .map_err(|e| fail(format!("pipe: {e}")))?;
        let reader = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(our_stdout))
            .map_err(|e| fail(format!("pipe: {e}")))?;
        let spec = CommandSpec {
            argv: command,
            workspace: launch.workspace,
            cwd: None,
            stdin: Vec::new(),
            env: launch.entry.env.clone().into_iter().collect(),
            timeout: MAX_LIFETIME,
        };
        let cancel = Cancel::new();
        // Until the instance owns it: a start abandoned half way (the call that started
        // it dropped at its deadline) kills the process instead of leaving it running.
        let mut abandoned = CancelOnDrop(Some(cancel.clone()));
        let outbound = Outbound::new(server.clone(), cancel.clone());
        let (exit_tx, exited) = watch::channel(None);
        let stdio = AttachedStdio {
            stdin: OwnedFd::from(child_stdin),
            stdout: OwnedFd::from(child_stdout),
        };
        let sandbox = launch.sandbox.clone();
        let run_cancel = cancel.clone();
        let name = server.clone();
        let given_up = outbound.clone();
        tokio::task::spawn_blocking(move || {
            let mut tail = Vec::new();
            let mut sink = |_: Stream, data: &[u8]| keep_tail(&mut tail, data);
            let how = match sandbox.run_attached(&spec, stdio, &mut sink, &run_cancel) {
                Ok(outcome) => {
                    let status = match (outcome.exit_code, outcome.signal) {
                        (Some(code), _) => format!("exited with status {code}"),
                        (None, Some(signal)) => format!("was killed by signal {signal}"),
                        (None, None) => "stopped".to_owned(),
                    };
                    let stderr = String::from_utf8_lossy(&tail).trim().to_owned();
                    if stderr.is_empty() {
                        status
                    } else {
                        format!("{status}; its stderr ended with: {stderr}")
                    }
                }
                Err(e) => format!("could not run in the sandbox: {e}"),
            };
            let how = match given_up.cause() {
                Some(cause) => format!("{cause} and was stopped (the process then {how})"),
                None => how,
            };
            tracing::info!(server = %name, how = %how, "MCP server process ended");
            let _ = exit_tx.send(Some(how));
        });

        let bridge = Bridge::default();
        let transport = outbound.transport(
            AsyncRwTransport::<RoleClient, _, _>::new(reader, outbound.writer(writer))
                .with_max_line_length(MAX_MESSAGE_BYTES),
        );
        let limit = Duration::from_secs(launch.entry.start_timeout_seconds);
        let mut exit_watch = exited.clone();
        let started = async {
            let service = bridge
                .clone()
                .serve(transport)
                .await
                .map_err(|e| format!("initialize failed: {e}"))?;
            let tools = list_tools_bounded(service.peer())
                .await
                .map_err(|e| format!("tools/list failed: {e}"))?;
            Ok::<_, String>((service, tools))
        };
        let outcome = tokio::select! {
            outcome = tokio::time::timeout(limit, started) => match outcome {
                Ok(result) => result,
                Err(_) => Err(format!(
                    "it did not answer initialize and tools/list within {}s (start_timeout_seconds)",
                    limit.as_secs()
                )),
            },
            how = wait_exit(&mut exit_watch) => Err(format!("the process {how}")),
        };
        let (service, tools) = match outcome {
            Ok(started) => started,
            Err(reason) => {
                cancel.cancel();
                if let Some(cause) = outbound.cause() {
                    return Err(fail(format!(
                        "it {cause} while starting (a stdio MCP server must keep reading its stdin)"
                    )));
                }
                // The exit report, when the process died first, says more than EOF.
                let how = tokio::time::timeout(EXIT_REPORT_WAIT, wait_exit(&mut exit_watch))
                    .await
                    .ok();
                return Err(fail(match how {
                    Some(how) if !reason.contains(&how) => {
                        format!("{reason} (the process {how})")
                    }
                    _ => reason,
                }));
            }
        };
        abandoned.0 = None;
        let instance = Arc::new(Instance {
            server,
            peer: service.peer().clone(),
            bridge,
            _service: service,
            cancel,
            exited,
            outbound,
            usage: Mutex::new((Instant::now(), 0)),
        });
        Ok((instance, tools))
    }

    /// Whether the process still runs (and was not given up for not reading its stdin).
    pub(super) fn is_alive(&self) -> bool {
        self.exited.borrow().is_none() && self.outbound.failure().is_none()
    }

    /// What a watcher of the tool list needs without keeping the instance alive: the
    /// signal that the list changed, and the process's end.
    pub(super) fn change_signals(&self) -> (Arc<Notify>, watch::Receiver<Option<String>>) {
        (self.bridge.tools_changed.clone(), self.exited.clone())
    }

    /// The server's current `tools/list` (bounded in pages, tools and time).
    pub(super) async fn list_tools(&self) -> Result<Vec<Value>, String> {
        tokio::time::timeout(RELIST_TIMEOUT, list_tools_bounded(&self.peer))
            .await
            .map_err(|_| format!("tools/list took longer than {}s", RELIST_TIMEOUT.as_secs()))?
    }

    /// One `tools/call`, with the call's progress relayed and its cancellation (or
    /// deadline) passed on as `notifications/cancelled`.
    pub(super) async fn call(
        &self,
        tool: &str,
        arguments: serde_json::Map<String, Value>,
        ctx: &CallContext,
    ) -> ToolOutcome {
        let _running = Running::new(self);
        let request = ClientRequest::CallToolRequest(CallToolRequest::new(
            CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments),
        ));
        let handle = match self
            .peer
            .send_cancellable_request(request, PeerRequestOptions::no_options())
            .await
        {
            Ok(handle) => handle,
            Err(e) => return self.failed(&e).await,
        };
        let token = handle.progress_token.clone();
        let id = handle.id.clone();
        lock(&self.bridge.progress).insert(token.clone(), ctx.clone());
        let _forget = Forget(&self.bridge.progress, token);
        let mut exit_watch = self.exited.clone();
        tokio::select! {
            answer = handle.await_response() => match answer {
                Ok(ServerResult::CallToolResult(result)) => match serde_json::to_value(result) {
                    Ok(result) => airlock_worker::mcp::outcome(&result),
                    Err(e) => ToolOutcome::error(format!("the MCP server {}'s answer could not be read: {e}", self.server)),
                },
                Ok(_) => ToolOutcome::error(format!(
                    "the MCP server {} answered tools/call with something other than a tool result",
                    self.server
                )),
                Err(e) => self.failed(&e).await,
            },
            () = ctx.cancel.cancelled() => {
                let notice = CancelledNotificationParam::new(Some(id), Some("the call was cancelled or ran out of time".into()));
                // Not awaited past a moment: with the server's stdin full, the notice
                // waits behind what is already queued.
                let _ = tokio::time::timeout(CANCEL_NOTICE_WAIT, self.peer.notify_cancelled(notice)).await;
                let stalled = match self.outbound.stalled_for() {
                    Some(stalled) if stalled >= STALL_WORTH_SAYING => format!(
                        " (the server has not read its stdin for {} s)",
                        stalled.as_secs()
                    ),
                    _ => String::new(),
                };
                ToolOutcome::error(format!("the call of {tool} on the MCP server {} was cancelled{stalled}", self.server))
            }
            how = wait_exit(&mut exit_watch) => match self.outbound.failure() {
                Some(failure) => ToolOutcome::error(failure),
                None => ToolOutcome::error(format!(
                    "the MCP server {} {how} before answering; the next call starts it again",
                    self.server
                )),
            },
        }
    }

    async fn failed(&self, error: &ServiceError) -> ToolOutcome {
        match error {
            ServiceError::McpError(e) => ToolOutcome::error(format!(
                "the MCP server {} refused the call: {}",
                self.server, e.message
            )),
            _ => {
                // Given up for not reading its stdin: that is why the transport failed.
                if let Some(failure) = self.outbound.failure() {
                    return ToolOutcome::error(failure);
                }
                // A closed transport usually means the process is ending: its exit
                // status and last words say more than the transport does.
                let mut exit_watch = self.exited.clone();
                let how = tokio::time::timeout(EXIT_REPORT_WAIT, wait_exit(&mut exit_watch))
                    .await
                    .map_or_else(|_| error.to_string(), |how| format!("its process {how}"));
                ToolOutcome::error(format!(
                    "the MCP server {} did not answer ({how}); the next call starts it again",
                    self.server
                ))
            }
        }
    }
}

/// Counts a call as running on the instance while it lives.
struct Running<'a>(&'a Instance);

impl<'a> Running<'a> {
    fn new(instance: &'a Instance) -> Self {
        lock(&instance.usage).1 += 1;
        Running(instance)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut usage = lock(&self.0.usage);
        usage.0 = Instant::now();
        usage.1 = usage.1.saturating_sub(1);
    }
}

/// Forgets a call's progress token when the call ends.
struct Forget<'a>(
    &'a Mutex<HashMap<ProgressToken, CallContext>>,
    ProgressToken,
);

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        lock(self.0).remove(&self.1);
    }
}

/// Resolves with how the process ended.
/// Every page of the server's `tools/list`, as JSON `Tool` objects: at most
/// [`MAX_PAGES`] pages and [`MAX_TOOLS`] tools (a server that goes on past either is
/// refused rather than followed: each page is held until the last).
async fn list_tools_bounded(peer: &Peer<RoleClient>) -> Result<Vec<Value>, String> {
    let mut tools = Vec::new();
    let mut cursor = None;
    for _ in 0..MAX_PAGES {
        let page = peer
            .list_tools(Some(PaginatedRequestParams::default().with_cursor(cursor)))
            .await
            .map_err(|e| e.to_string())?;
        tools.extend(
            page.tools
                .into_iter()
                .filter_map(|tool| serde_json::to_value(tool).ok()),
        );
        if tools.len() > MAX_TOOLS {
            return Err(format!(
                "it lists more than {MAX_TOOLS} tools, the most served of one server"
            ));
        }
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => return Ok(tools),
        }
    }
    Err(format!(
        "tools/list goes on past {MAX_PAGES} pages (nextCursor)"
    ))
}

/// Cancels the sandbox when dropped while it still holds it.
struct CancelOnDrop(Option<Cancel>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(cancel) = &self.0 {
            cancel.cancel();
        }
    }
}

pub(super) async fn wait_exit(exited: &mut watch::Receiver<Option<String>>) -> String {
    match exited.wait_for(Option::is_some).await {
        Ok(how) => how.clone().unwrap_or_default(),
        Err(_) => "stopped".to_owned(),
    }
}

/// Keeps the last [`STDERR_TAIL_BYTES`] of what the server wrote to stderr.
fn keep_tail(tail: &mut Vec<u8>, data: &[u8]) {
    tail.extend_from_slice(data);
    if tail.len() > STDERR_TAIL_BYTES {
        let cut = tail.len() - STDERR_TAIL_BYTES;
        tail.drain(..cut);
    }
}

impl IdleSince for Instance {
    /// Since when it has had no call, or `None` while a call runs.
    fn idle_since(&self) -> Option<Instant> {
        let (since, running) = *lock(&self.usage);
        (running == 0).then_some(since)
    }
}
