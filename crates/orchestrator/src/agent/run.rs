//! The loop itself: ask the model, pass each proposed call through the gate, answer every
//! `tool_use` with exactly one `tool_result`, repeat until the model stops or a limit
//! ends the run.
//!
//! How each stop reason is handled (both providers):
//! - tool calls present (whatever the stop reason, except a refusal): run them
//!   concurrently, answer each one in order in the next message, ask again. That covers
//!   `tool_use` / `tool_calls`, servers that say `stop` with tool calls, and `max_tokens`
//!   with a cut-off call (that call's arguments do not parse: an error result tells the
//!   model to send it again).
//! - `pause_turn`: the assistant content goes back as it is and the model is asked to go
//!   on (no new user message).
//! - `end_turn`, `stop_sequence`, `stop`: `run.completed`.
//! - `max_tokens` / `length` without tool calls: `run.completed` with `truncated: true`
//!   (continuing a cut-off text is the caller's choice: raise `[agent] max_tokens`).
//! - `refusal` / `content_filter`: `run.completed` with that stop reason; no call runs.
//! - Limits (`max_turns`, `max_tool_calls`, `max_seconds`): `run.failed` naming the limit.
//!   A turn that asks for more calls than remain runs none of them.
//!
//! A run ends early when its event receiver goes away (the client closed the stream): the
//! model request is dropped and every call in flight is cancelled through the gate.

use std::sync::Arc;
use std::time::Duration;

use airlock_policy::{CallStatus, SessionId};
use http::header::{HeaderName, HeaderValue};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::Instrument as _;

use super::client::{ClientError, HttpClient};
use super::sse::SseParser;
use super::{
    AgentConfig, AgentError, AgentEvent, ProposedUse, ProviderKind, Resolved, Stop, Turn, Usage,
    anthropic, openai,
};
use crate::audit::{AuditKind, NewAuditEvent};
use crate::auth::Principal;
use crate::gate::{Gate, ToolUse};
use crate::service::{Batch, CallHandle, CallService, OnDrop, Refused, Update};

/// Largest model request: the run's whole conversation, which grows with every turn and
/// tool result, may take no more (the hosted APIs refuse larger bodies too; Anthropic's
/// limit is 32 MB). What a run holds in memory is bounded by it.
const MAX_REQUEST_BYTES: usize = 32 * 1024 * 1024;
/// Largest response (streamed or not) read from the provider.
const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;
/// Largest error body read.
const MAX_ERROR_BYTES: usize = 64 * 1024;
/// Attempts per model request when the provider is overloaded or unreachable.
const ATTEMPTS: u32 = 3;
/// How long a withdrawn call may take to settle.
const SETTLE: Duration = Duration::from_secs(10);

/// What the caller asked for.
#[derive(Debug, Clone)]
pub struct RunRequest {
    pub prompt: String,
    /// The caller's session; the session `default` when absent, like `airlock call`.
    pub session_id: Option<SessionId>,
    /// At most the configured `max_turns`.
    pub max_turns: Option<u32>,
}

/// Starts a run; its events arrive on the returned receiver, the last one
/// `run.completed` or `run.failed`. Dropping the receiver cancels the run. Fails at once
/// (nothing started) when the provider is not usable, e.g. its API key is unset.
pub fn start(
    gate: Arc<Gate>,
    config: &AgentConfig,
    principal: Principal,
    request: RunRequest,
) -> Result<mpsc::Receiver<AgentEvent>, AgentError> {
    let resolved = config.resolve(|name| std::env::var(name).ok())?;
    // Held by the run's task until it ends, however it ends (the stream closed, a limit,
    // the provider's error).
    let slot = gate
        .agent_runs
        .take(&principal.name, config.max_runs_per_principal)?;
    // Without a session the run works where `airlock call` does (DESIGN §16), so the
    // model sees the user's files. Its calls then count like any call that names no
    // session: not against the session budgets, which would otherwise soon refuse every
    // run in the long-lived `default` (its calls and age accumulate across all use);
    // the run's own `max_tool_calls` and `max_seconds` bound it instead.
    let session_named = request.session_id.is_some();
    let session = request
        .session_id
        .unwrap_or_else(SessionId::default_session);
    let max_turns = request
        .max_turns
        .filter(|n| *n > 0)
        .map_or(config.max_turns, |n| n.min(config.max_turns));
    let (events, rx) = mpsc::channel(256);
    let run = Run {
        gate,
        deadline: Instant::now() + Duration::from_secs(config.max_seconds),
        resolved,
        principal,
        session,
        session_named,
        run_id: format!("run_{}", uuid::Uuid::new_v4().simple()),
        max_turns,
        client: HttpClient::default(),
        events,
        turns: 0,
        tool_calls: 0,
        usage: Usage::default(),
    };
    // The run's span, a child of the front door's, with each model request and each
    // tool call in it.
    let span = tracing::span!(
        target: airlock_telemetry::TARGET,
        tracing::Level::TRACE,
        "invoke_agent",
        otel.name = "invoke_agent airlock",
        gen_ai.operation.name = "invoke_agent",
        gen_ai.provider.name = run.resolved.kind.as_str(),
        gen_ai.request.model = %run.resolved.model,
        airlock.run_id = %run.run_id,
    );
    tokio::spawn(
        async move {
            let _slot = slot;
            run.drive(request.prompt).await;
        }
        .instrument(span),
    );
    Ok(rx)
}

struct Run {
    gate: Arc<Gate>,
    resolved: Resolved,
    principal: Principal,
    session: SessionId,
    /// The request named the session (only then do session budgets apply).
    session_named: bool,
    run_id: String,
    max_turns: u32,
    client: HttpClient,
    events: mpsc::Sender<AgentEvent>,
    deadline: Instant,
    turns: u32,
    tool_calls: u32,
    usage: Usage,
}

enum Ending {
    Completed {
        stop_reason: String,
        text: String,
        truncated: bool,
    },
    Failed {
        reason: &'static str,
        message: String,
    },
    Cancelled,
}

enum Accumulator {
    Anthropic(anthropic::Stream),
    OpenAi(openai::Stream),
}

impl Run {
    async fn emit(&self, kind: &'static str, data: Value) {
        // A closed receiver is noticed by the loop's next `select!`.
        let _ = self.events.send(AgentEvent::new(kind, data)).await;
    }

    fn audit_event(&self, kind: AuditKind, data: Value) -> NewAuditEvent {
        NewAuditEvent::new(kind, data)
            .principal(&self.principal.name)
            .session_id(Some(self.session.as_str().to_owned()))
    }

    async fn drive(mut self, prompt: String) {
        let provider = self.resolved.kind.as_str();
        self.emit(
            "run.started",
            json!({"run_id": self.run_id, "session_id": self.session.as_str(), "provider": provider, "model": self.resolved.model}),
        )
        .await;
        self.gate
            .audit(self.audit_event(
                AuditKind::AgentRunStarted,
                json!({
                    "run_id": self.run_id,
                    "provider": provider,
                    "model": self.resolved.model,
                    "base_url": self.resolved.base_url,
                    "prompt_sha256": hex::encode(Sha256::digest(prompt.as_bytes())),
                }),
            ))
            .await;
        tracing::info!(run_id = %self.run_id, principal = %self.principal.name, session = %self.session.as_str(), provider, model = %self.resolved.model, "agent run started");
        let ending = self.main_loop(&prompt).await;
        let common = json!({
            "run_id": self.run_id,
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "usage": self.usage.json(),
        });
        let (kind, mut data, outcome) = match ending {
            Ending::Completed {
                stop_reason,
                text,
                truncated,
            } => (
                Some("run.completed"),
                json!({"stop_reason": stop_reason, "text": text, "truncated": truncated}),
                json!({"outcome": "completed", "stop_reason": stop_reason, "truncated": truncated}),
            ),
            Ending::Failed { reason, message } => (
                Some("run.failed"),
                json!({"reason": reason, "message": message}),
                json!({"outcome": "failed", "reason": reason, "message": message}),
            ),
            Ending::Cancelled => (None, json!({}), json!({"outcome": "cancelled"})),
        };
        merge(&mut data, &common);
        let mut audited = outcome.clone();
        merge(&mut audited, &common);
        tracing::info!(run_id = %self.run_id, outcome = %outcome, turns = self.turns, tool_calls = self.tool_calls, "agent run finished");
        self.gate
            .audit(self.audit_event(AuditKind::AgentRunFinished, audited))
            .await;
        if let Some(kind) = kind {
            self.emit(kind, data).await;
        }
    }

    async fn main_loop(&mut self, prompt: &str) -> Ending {
        let catalog = self.gate.visible_tools(&self.principal);
        let (tools, mut history) = match self.resolved.kind {
            ProviderKind::Anthropic => (
                anthropic::tools(&catalog),
                anthropic::first_messages(prompt),
            ),
            ProviderKind::OpenAi => (
                openai::tools(&catalog),
                openai::first_messages(self.resolved.config.system.as_deref(), prompt),
            ),
        };
        loop {
            if self.turns >= self.max_turns {
                return Ending::Failed {
                    reason: "max_turns",
                    message: format!(
                        "the run reached its limit of {} model turns before the model finished",
                        self.max_turns
                    ),
                };
            }
            self.turns += 1;
            // Built and serialised here, the built copy dropped at once: the run keeps
            // its whole conversation, and what it may grow to is bounded by what one
            // request may carry.
            let encoded = serde_json::to_vec(&match self.resolved.kind {
                ProviderKind::Anthropic => {
                    anthropic::request_body(&self.resolved, &history, &tools)
                }
                ProviderKind::OpenAi => openai::request_body(&self.resolved, &history, &tools),
            });
            let body = match encoded {
                Ok(bytes) if bytes.len() <= MAX_REQUEST_BYTES => bytes,
                Ok(bytes) => {
                    return Ending::Failed {
                        reason: "max_request_bytes",
                        message: format!(
                            "the conversation has grown to {} bytes, more than the {MAX_REQUEST_BYTES} one model request may carry; start a new run with a narrower task",
                            bytes.len()
                        ),
                    };
                }
                Err(e) => {
                    return Ending::Failed {
                        reason: "provider_error",
                        message: format!("cannot encode the model request: {e}"),
                    };
                }
            };
            let result = tokio::select! {
                biased;
                _ = self.events.closed() => return Ending::Cancelled,
                _ = tokio::time::sleep_until(self.deadline) => return self.out_of_time(),
                r = self.model_turn(&body) => r,
            };
            let turn = match result {
                Ok(turn) => turn,
                Err(message) => {
                    return Ending::Failed {
                        reason: "provider_error",
                        message,
                    };
                }
            };
            self.usage.add(turn.usage);
            if turn.stop == Stop::Refusal {
                return Ending::Completed {
                    stop_reason: turn.stop_reason,
                    text: turn.text,
                    truncated: false,
                };
            }
            if !turn.tool_uses.is_empty() {
                let wanted = u32::try_from(turn.tool_uses.len()).unwrap_or(u32::MAX);
                let limit = self.resolved.config.max_tool_calls;
                if self.tool_calls.saturating_add(wanted) > limit {
                    return Ending::Failed {
                        reason: "max_tool_calls",
                        message: format!(
                            "the model asked for {wanted} more tool calls; the run's limit is {limit} and {} were made",
                            self.tool_calls
                        ),
                    };
                }
                self.tool_calls += wanted;
                history.push(turn.assistant.clone());
                let results = match self.run_tools(turn.tool_uses).await {
                    Ok(results) => results,
                    Err(ending) => return ending,
                };
                match self.resolved.kind {
                    ProviderKind::Anthropic => history.push(anthropic::results_message(&results)),
                    ProviderKind::OpenAi => history.extend(openai::results_messages(&results)),
                }
                continue;
            }
            match turn.stop {
                Stop::PauseTurn => {
                    let empty = turn.assistant["content"]
                        .as_array()
                        .is_some_and(Vec::is_empty);
                    if !empty {
                        history.push(turn.assistant);
                    }
                }
                Stop::MaxTokens => {
                    return Ending::Completed {
                        stop_reason: turn.stop_reason,
                        text: turn.text,
                        truncated: true,
                    };
                }
                _ => {
                    return Ending::Completed {
                        stop_reason: turn.stop_reason,
                        text: turn.text,
                        truncated: false,
                    };
                }
            }
        }
    }

    fn out_of_time(&self) -> Ending {
        Ending::Failed {
            reason: "max_seconds",
            message: format!(
                "the run reached its wall-time limit of {} s",
                self.resolved.config.max_seconds
            ),
        }
    }

    fn headers(&self) -> Vec<(HeaderName, HeaderValue)> {
        let mut headers = Vec::new();
        let stream = self.resolved.config.stream;
        headers.push((
            http::header::ACCEPT,
            HeaderValue::from_static(if stream {
                "text/event-stream"
            } else {
                "application/json"
            }),
        ));
        let secret = |value: String| {
            HeaderValue::from_str(&value).ok().map(|mut v| {
                v.set_sensitive(true);
                v
            })
        };
        match self.resolved.kind {
            ProviderKind::Anthropic => {
                headers.push((
                    HeaderName::from_static("anthropic-version"),
                    HeaderValue::from_static(anthropic::VERSION),
                ));
                if let Some(v) = self
                    .resolved
                    .key
                    .as_ref()
                    .and_then(|k| secret(k.expose().to_owned()))
                {
                    headers.push((HeaderName::from_static("x-api-key"), v));
                }
            }
            ProviderKind::OpenAi => {
                if let Some(v) = self
                    .resolved
                    .key
                    .as_ref()
                    .and_then(|k| secret(format!("Bearer {}", k.expose())))
                {
                    headers.push((http::header::AUTHORIZATION, v));
                }
            }
        }
        headers
    }

    /// One model request in its span (OpenTelemetry's GenAI `chat`: provider, model and
    /// token counts; never the prompt or the answer).
    async fn model_turn(&self, body: &[u8]) -> Result<Turn, String> {
        let span = tracing::span!(
            target: airlock_telemetry::TARGET,
            tracing::Level::TRACE,
            "chat",
            otel.name = %format_args!("chat {}", self.resolved.model),
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            gen_ai.operation.name = "chat",
            gen_ai.provider.name = self.resolved.kind.as_str(),
            gen_ai.request.model = %self.resolved.model,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            gen_ai.response.finish_reasons = tracing::field::Empty,
        );
        let turn = self.request_turn(body).instrument(span.clone()).await;
        match &turn {
            Ok(turn) => {
                // As integers: tracing-opentelemetry records unsigned values as text.
                let tokens = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
                span.record("gen_ai.usage.input_tokens", tokens(turn.usage.input_tokens));
                span.record(
                    "gen_ai.usage.output_tokens",
                    tokens(turn.usage.output_tokens),
                );
                span.record("gen_ai.response.finish_reasons", turn.stop_reason.as_str());
            }
            Err(_) => {
                span.record("otel.status_code", "ERROR");
            }
        }
        turn
    }

    /// One model request, retried while the provider is overloaded; the error is a
    /// message fit for an event (the key scrubbed out).
    async fn request_turn(&self, body: &[u8]) -> Result<Turn, String> {
        let url = match self.resolved.kind {
            ProviderKind::Anthropic => anthropic::endpoint(&self.resolved.base_url),
            ProviderKind::OpenAi => openai::endpoint(&self.resolved.base_url),
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            let response = match self
                .client
                .post_json(&url, self.headers(), body.to_vec())
                .await
            {
                Ok(r) => r,
                Err(e @ ClientError::Connect { .. }) if attempt < ATTEMPTS => {
                    tracing::warn!(run_id = %self.run_id, error = %e, "model request failed; retrying");
                    tokio::time::sleep(backoff(attempt, None)).await;
                    continue;
                }
                Err(e) => return Err(self.resolved.scrub(&e.to_string())),
            };
            let status = response.status;
            if status.is_success() {
                return self
                    .read_turn(response)
                    .await
                    .map_err(|e| self.resolved.scrub(&e));
            }
            let retry_after = response
                .headers
                .get(http::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok());
            let raw = response.bytes(MAX_ERROR_BYTES).await.unwrap_or_default();
            let message = match serde_json::from_slice::<Value>(&raw) {
                Ok(v) => match self.resolved.kind {
                    ProviderKind::Anthropic => anthropic::error_text(&v),
                    ProviderKind::OpenAi => openai::error_text(&v).unwrap_or_else(|| v.to_string()),
                },
                Err(_) => String::from_utf8_lossy(&raw).chars().take(500).collect(),
            };
            let retryable = matches!(status.as_u16(), 408 | 429 | 500 | 502 | 503 | 504 | 529);
            if retryable && attempt < ATTEMPTS {
                tracing::warn!(run_id = %self.run_id, status = status.as_u16(), "model provider busy; retrying");
                tokio::time::sleep(backoff(attempt, retry_after)).await;
                continue;
            }
            return Err(self.resolved.scrub(&format!(
                "the model provider answered {status} at {url}: {message}"
            )));
        }
    }

    /// Reads a successful response, streamed or not (a server may ignore `stream`).
    async fn read_turn(&self, mut response: super::client::Response) -> Result<Turn, String> {
        let is_sse = response
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if !is_sse {
            let raw = response
                .bytes(MAX_RESPONSE_BYTES)
                .await
                .map_err(|e| e.to_string())?;
            let body: Value = serde_json::from_slice(&raw)
                .map_err(|e| format!("the provider's response is not JSON ({e})"))?;
            let turn = match self.resolved.kind {
                ProviderKind::Anthropic => anthropic::parse_message(&body),
                ProviderKind::OpenAi => openai::parse_response(&body),
            }
            .map_err(|e| e.to_string())?;
            if !turn.text.is_empty() {
                self.emit("model.text", json!({"text": turn.text, "turn": self.turns}))
                    .await;
            }
            return Ok(turn);
        }
        let mut parser = SseParser::default();
        let mut acc = match self.resolved.kind {
            ProviderKind::Anthropic => Accumulator::Anthropic(anthropic::Stream::default()),
            ProviderKind::OpenAi => Accumulator::OpenAi(openai::Stream::default()),
        };
        let mut total = 0usize;
        let mut ended = false;
        while !ended {
            let chunk = response.chunk().await.map_err(|e| e.to_string())?;
            let events = match chunk {
                Some(chunk) => {
                    total += chunk.len();
                    if total > MAX_RESPONSE_BYTES {
                        return Err(format!(
                            "the provider's stream is over {MAX_RESPONSE_BYTES} bytes"
                        ));
                    }
                    parser.feed(&chunk).map_err(|e| e.to_string())?
                }
                None => {
                    ended = true;
                    parser
                        .finish()
                        .map_err(|e| e.to_string())?
                        .into_iter()
                        .collect()
                }
            };
            for event in events {
                let text = match &mut acc {
                    Accumulator::Anthropic(s) => s.on_event(&event),
                    Accumulator::OpenAi(s) => s.on_event(&event),
                }
                .map_err(|e| e.to_string())?;
                if let Some(text) = text {
                    self.emit("model.text", json!({"text": text, "turn": self.turns}))
                        .await;
                }
            }
        }
        match acc {
            Accumulator::Anthropic(s) => s.finish(),
            Accumulator::OpenAi(s) => s.finish(),
        }
        .map_err(|e| e.to_string())
    }

    /// Runs one turn's calls concurrently through the gate; answers in order.
    async fn run_tools(
        &self,
        uses: Vec<ProposedUse>,
    ) -> Result<Vec<(String, bool, Vec<String>)>, Ending> {
        for u in &uses {
            let mut data = json!({"id": u.id, "name": u.name});
            match &u.input {
                Ok(input) => data["input"] = input.clone(),
                Err(e) => {
                    data["input"] = Value::Null;
                    data["input_error"] = json!(e);
                }
            }
            self.emit("tool.call", data).await;
        }
        let batch = || Batch {
            session: self.session_named.then(|| self.session.clone()),
            calls: uses
                .iter()
                .map(|u| match &u.input {
                    Ok(input) => Ok(ToolUse {
                        id: u.id.clone(),
                        name: u.name.clone(),
                        input: input.clone(),
                    }),
                    Err(message) => Err(Refused {
                        id: u.id.clone(),
                        name: u.name.clone(),
                        message: message.clone(),
                    }),
                })
                .collect(),
            with_events: false,
            // The run is the calls' only follower: when it stops, they stop.
            on_drop: OnDrop::Cancel,
        };
        let service = CallService::new(self.gate.clone());
        // A refused batch is answered call by call, so that the model reads why.
        let handles = service
            .admit(&self.principal, batch())
            .unwrap_or_else(|e| service.refuse(&self.principal, batch(), &e.to_string()));
        let wait = Duration::from_secs(self.resolved.config.tool_wait_seconds)
            .min(self.deadline.saturating_duration_since(Instant::now()));
        let waits = handles
            .into_iter()
            .zip(&uses)
            .map(|(handle, u)| self.await_call(handle, u, wait));
        tokio::select! {
            biased;
            // Dropping the calls' handles cancels those still running.
            _ = self.events.closed() => Err(Ending::Cancelled),
            results = futures::future::join_all(waits) => Ok(results),
        }
    }

    /// Follows one call to its end (announcing a pending approval); a call still open
    /// after `wait` is withdrawn and answered with an error.
    async fn await_call(
        &self,
        mut handle: CallHandle,
        proposed: &ProposedUse,
        wait: Duration,
    ) -> (String, bool, Vec<String>) {
        let until = Instant::now() + wait;
        let mut announced = false;
        let mut record = loop {
            let update = tokio::select! {
                update = handle.next() => update,
                _ = tokio::time::sleep_until(until) => break handle.record(),
            };
            match update {
                Update::Final(record) => break record,
                Update::Changed(record)
                    if record.status == CallStatus::PendingApproval && !announced =>
                {
                    announced = true;
                    self.emit(
                        "tool.pending_approval",
                        json!({"id": proposed.id, "name": proposed.name, "call_id": record.call_id, "approval_id": record.approval_id}),
                    )
                    .await;
                }
                Update::Changed(_) | Update::Event(_) => {}
            }
        };
        let mut withdrawn = None;
        if !record.status.is_final() {
            withdrawn = Some(record.status);
            handle.cancel();
            record = handle.wait_final(SETTLE).await;
        }
        let (is_error, mut texts) = match (&record.result, record.status.is_final()) {
            (Some(outcome), true) => (outcome.is_error, outcome.content.clone()),
            _ => (true, Vec::new()),
        };
        if let Some(was) = withdrawn {
            let note = format!(
                "the call was still {} after {} s (the agent's tool_wait_seconds) and was withdrawn",
                was.as_str(),
                wait.as_secs()
            );
            texts.insert(0, note);
        }
        if texts.is_empty() {
            texts.push("(no output)".to_owned());
        }
        self.emit(
            "tool.result",
            json!({
                "id": proposed.id,
                "name": proposed.name,
                "is_error": is_error,
                "status": record.status.as_str(),
                "call_id": record.call_id,
                "text": texts.join("\n"),
            }),
        )
        .await;
        (proposed.id.clone(), is_error, texts)
    }
}

fn backoff(attempt: u32, retry_after: Option<u64>) -> Duration {
    match retry_after {
        Some(s) => Duration::from_secs(s.min(10)),
        None => Duration::from_millis(500 * 2u64.pow(attempt.min(4))),
    }
}

fn merge(into: &mut Value, from: &Value) {
    if let (Some(into), Some(from)) = (into.as_object_mut(), from.as_object()) {
        for (k, v) in from {
            into.insert(k.clone(), v.clone());
        }
    }
}
