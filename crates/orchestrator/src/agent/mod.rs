//! The agent loop: drives a model (Anthropic Messages or any OpenAI-compatible Chat
//! Completions endpoint) and passes every `tool_use` it proposes through the same gate
//! as `/v1/tool_calls`.
//!
//! Front doors: `POST /v1/agent/runs` ([`http`]), gRPC `RunAgent`, and the CLI `airlock
//! agent`, which posts to the HTTP one. A run is a stream of [`AgentEvent`]s:
//!
//! | kind | data |
//! |---|---|
//! | `run.started` | `run_id`, `session_id`, `provider`, `model` |
//! | `model.text` | `text` (a delta, as the model writes it), `turn` |
//! | `tool.call` | `id`, `name`, `input` (`null` with `input_error` when the model's arguments did not parse) |
//! | `tool.pending_approval` | `id`, `call_id`, `approval_id` |
//! | `tool.result` | `id`, `name`, `is_error`, `status`, `call_id`, `text` |
//! | `run.completed` | `stop_reason`, `turns`, `tool_calls`, `usage`, `text` (the last turn's), `truncated` |
//! | `run.failed` | `reason` (`max_turns`, `max_tool_calls`, `max_seconds`, `max_request_bytes`, `provider_error`), `message`, `turns`, `tool_calls`, `usage` |
//!
//! The API key is read from the environment when a run starts and lives only in a
//! request header marked sensitive; it is scrubbed from any provider error text before
//! that reaches an event, a log line or the audit.

pub mod anthropic;
pub mod client;
pub mod http;
pub mod openai;
pub mod run;
pub mod sse;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

pub use run::{RunRequest, start};

/// Which API the model speaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    /// Anthropic Messages: `POST {base_url}/v1/messages`.
    #[default]
    Anthropic,
    /// OpenAI Chat Completions or a compatible server (vLLM, Ollama, llama.cpp):
    /// `POST {base_url}/chat/completions`, `base_url` like `http://host:port/v1`.
    #[serde(rename = "openai")]
    OpenAi,
}

impl ProviderKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Anthropic => "anthropic",
            ProviderKind::OpenAi => "openai",
        }
    }

    fn default_key_env(self) -> &'static str {
        match self {
            ProviderKind::Anthropic => "ANTHROPIC_API_KEY",
            ProviderKind::OpenAi => "OPENAI_API_KEY",
        }
    }

    fn base_url_env(self) -> &'static str {
        match self {
            ProviderKind::Anthropic => "ANTHROPIC_BASE_URL",
            ProviderKind::OpenAi => "OPENAI_BASE_URL",
        }
    }

    fn default_base_url(self) -> &'static str {
        match self {
            ProviderKind::Anthropic => "https://api.anthropic.com",
            ProviderKind::OpenAi => "https://api.openai.com/v1",
        }
    }

    fn default_model(self) -> &'static str {
        match self {
            ProviderKind::Anthropic => "claude-sonnet-4-5",
            ProviderKind::OpenAi => "gpt-4.1",
        }
    }
}

/// `[agent]`: the model provider and the limits of one run.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    pub provider: ProviderKind,
    /// Default: `claude-sonnet-4-5` (anthropic), `gpt-4.1` (openai).
    pub model: Option<String>,
    /// Default: `ANTHROPIC_BASE_URL` / `OPENAI_BASE_URL`, else the public endpoint.
    pub base_url: Option<String>,
    /// The variable holding the API key (default `ANTHROPIC_API_KEY` / `OPENAI_API_KEY`),
    /// read when a run starts. `""` sends no key (local OpenAI-compatible servers).
    pub api_key_env: Option<String>,
    /// `max_tokens` of each model request.
    pub max_tokens: u32,
    /// System prompt.
    pub system: Option<String>,
    /// Stream model responses (text arrives as it is written).
    pub stream: bool,
    /// Model requests per run.
    pub max_turns: u32,
    /// Tool calls per run.
    pub max_tool_calls: u32,
    /// Wall time of a run.
    pub max_seconds: u64,
    /// How long one tool call may take, approval included, before the loop withdraws it
    /// and answers the model with an error result.
    pub tool_wait_seconds: u64,
    /// Runs one principal may have going at once on this orchestrator. Each holds a
    /// conversation of up to 32 MiB and spends the operator's API key; tool calls are
    /// rate-limited, runs otherwise would not be.
    pub max_runs_per_principal: u32,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            provider: ProviderKind::Anthropic,
            model: None,
            base_url: None,
            api_key_env: None,
            max_tokens: 4096,
            system: None,
            stream: true,
            max_turns: 20,
            max_tool_calls: 100,
            max_seconds: 600,
            tool_wait_seconds: 300,
            max_runs_per_principal: 4,
        }
    }
}

/// An API key; its `Debug` shows nothing.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl ApiKey {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// The provider settings of one run, environment applied.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub kind: ProviderKind,
    pub model: String,
    pub base_url: String,
    pub key: Option<ApiKey>,
    pub config: AgentConfig,
}

impl Resolved {
    /// `text` with the API key replaced, for anything that came from the provider.
    pub fn scrub(&self, text: &str) -> String {
        match &self.key {
            Some(key) if key.0.len() >= 4 => text.replace(&key.0, "[redacted]"),
            _ => text.to_owned(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    #[error(
        "the model provider's API key is not set: set the environment variable {0} for the orchestrator (or name another one with [agent] api_key_env)"
    )]
    MissingKey(String),
    #[error("[agent] {0}")]
    Config(String),
    #[error("the provider's response is malformed: {0}")]
    Protocol(String),
    #[error("the provider reported an error: {0}")]
    Provider(String),
    #[error(
        "{principal} already has {limit} agent runs going on this orchestrator ([agent] max_runs_per_principal): wait for one to end, or close its stream"
    )]
    TooManyRuns { principal: String, limit: u32 },
}

/// The agent runs going per principal, in this process: a slot is taken when a run
/// starts and given back when its task ends, however it ends.
#[derive(Debug, Default)]
pub struct RunSlots {
    going: std::sync::Mutex<std::collections::HashMap<String, u32>>,
}

impl RunSlots {
    /// A slot for `principal`, unless it has `limit` runs going already.
    pub fn take(
        self: &std::sync::Arc<Self>,
        principal: &str,
        limit: u32,
    ) -> Result<RunSlot, AgentError> {
        let mut going = self
            .going
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = going.entry(principal.to_owned()).or_default();
        if *count >= limit {
            return Err(AgentError::TooManyRuns {
                principal: principal.to_owned(),
                limit,
            });
        }
        *count += 1;
        Ok(RunSlot {
            slots: self.clone(),
            principal: principal.to_owned(),
        })
    }
}

/// One run's slot; dropping it gives it back.
#[derive(Debug)]
pub struct RunSlot {
    slots: std::sync::Arc<RunSlots>,
    principal: String,
}

impl Drop for RunSlot {
    fn drop(&mut self) {
        let mut going = self
            .slots
            .going
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(count) = going.get_mut(&self.principal) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                going.remove(&self.principal);
            }
        }
    }
}

impl AgentConfig {
    /// Applies the environment: the base URL fallback and the API key (at run start).
    pub fn resolve(&self, env: impl Fn(&str) -> Option<String>) -> Result<Resolved, AgentError> {
        let kind = self.provider;
        let base_url = self
            .base_url
            .clone()
            .filter(|u| !u.trim().is_empty())
            .or_else(|| env(kind.base_url_env()).filter(|u| !u.trim().is_empty()))
            .unwrap_or_else(|| kind.default_base_url().to_owned());
        let base_url = base_url.trim().trim_end_matches('/').to_owned();
        if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
            return Err(AgentError::Config(format!(
                "base_url {base_url:?} must start with http:// or https://"
            )));
        }
        let model = self
            .model
            .clone()
            .filter(|m| !m.trim().is_empty())
            .unwrap_or_else(|| kind.default_model().to_owned());
        let var = self
            .api_key_env
            .clone()
            .unwrap_or_else(|| kind.default_key_env().to_owned());
        let key = if var.is_empty() {
            None
        } else {
            match env(&var).filter(|k| !k.is_empty()) {
                Some(key) => Some(ApiKey(key)),
                None => return Err(AgentError::MissingKey(var)),
            }
        };
        if self.max_turns == 0 || self.max_seconds == 0 || self.max_tokens == 0 {
            return Err(AgentError::Config(
                "max_turns, max_seconds and max_tokens must be positive".into(),
            ));
        }
        Ok(Resolved {
            kind,
            model,
            base_url,
            key,
            config: self.clone(),
        })
    }
}

/// One event of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AgentEvent {
    pub kind: &'static str,
    pub data: Value,
}

impl AgentEvent {
    pub fn new(kind: &'static str, data: Value) -> Self {
        Self { kind, data }
    }
}

/// Why a model turn ended, across providers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    EndTurn,
    ToolUse,
    MaxTokens,
    PauseTurn,
    StopSequence,
    Refusal,
    Other,
}

impl Stop {
    pub fn from_anthropic(reason: &str) -> Self {
        match reason {
            "end_turn" => Stop::EndTurn,
            "tool_use" => Stop::ToolUse,
            "max_tokens" | "model_context_window_exceeded" => Stop::MaxTokens,
            "pause_turn" => Stop::PauseTurn,
            "stop_sequence" => Stop::StopSequence,
            "refusal" => Stop::Refusal,
            _ => Stop::Other,
        }
    }

    pub fn from_openai(reason: &str) -> Self {
        match reason {
            "stop" => Stop::EndTurn,
            "tool_calls" | "function_call" => Stop::ToolUse,
            "length" => Stop::MaxTokens,
            "content_filter" => Stop::Refusal,
            _ => Stop::Other,
        }
    }
}

/// Token counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

impl Usage {
    pub fn add(&mut self, other: Usage) {
        // Counts a provider reports: saturating, so a nonsensical one cannot overflow.
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
    }

    pub fn json(&self) -> Value {
        json!({"input_tokens": self.input_tokens, "output_tokens": self.output_tokens})
    }
}

/// A tool call the model proposed; `input` is an error when its arguments did not parse
/// (or were cut off).
#[derive(Debug, Clone, PartialEq)]
pub struct ProposedUse {
    pub id: String,
    pub name: String,
    pub input: Result<Value, String>,
}

/// One model response, assembled.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The assistant message to append to the history, in the provider's own shape.
    pub assistant: Value,
    pub tool_uses: Vec<ProposedUse>,
    pub text: String,
    pub stop: Stop,
    /// The provider's own word for it (`end_turn`, `tool_calls`, …).
    pub stop_reason: String,
    pub usage: Usage,
}

/// Parses a tool's arguments once they are complete: they must be one JSON object.
pub fn parse_arguments(text: &str) -> Result<Value, String> {
    if text.trim().is_empty() {
        return Ok(Value::Object(Default::default()));
    }
    match serde_json::from_str::<Value>(text) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(
            "the arguments must be a JSON object; call the tool again with an object that matches its input_schema".into(),
        ),
        Err(e) => Err(format!(
            "the arguments are not valid JSON ({e}); call the tool again with a JSON object that matches its input_schema"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn defaults_and_environment() {
        let config = AgentConfig::default();
        let err = config.resolve(env(&[])).unwrap_err();
        assert_eq!(err, AgentError::MissingKey("ANTHROPIC_API_KEY".into()));
        assert!(err.to_string().contains("ANTHROPIC_API_KEY"));

        let r = config
            .resolve(env(&[("ANTHROPIC_API_KEY", "sk-test")]))
            .unwrap();
        assert_eq!(r.base_url, "https://api.anthropic.com");
        assert_eq!(r.model, "claude-sonnet-4-5");
        assert!(!format!("{r:?}").contains("sk-test"));

        let r = config
            .resolve(env(&[
                ("ANTHROPIC_API_KEY", "k"),
                ("ANTHROPIC_BASE_URL", "http://127.0.0.1:9/"),
            ]))
            .unwrap();
        assert_eq!(r.base_url, "http://127.0.0.1:9");

        let openai: AgentConfig =
            toml_like(r#"{"provider": "openai", "api_key_env": "", "base_url": "http://h:1/v1"}"#);
        let r = openai
            .resolve(env(&[("OPENAI_BASE_URL", "http://other")]))
            .unwrap();
        assert_eq!(r.base_url, "http://h:1/v1");
        assert!(r.key.is_none());
        assert_eq!(r.kind, ProviderKind::OpenAi);

        let named: AgentConfig = toml_like(r#"{"provider": "openai", "api_key_env": "MY_KEY"}"#);
        let err = named.resolve(env(&[("OPENAI_API_KEY", "x")])).unwrap_err();
        assert!(err.to_string().contains("MY_KEY"), "{err}");
        let r = named
            .resolve(env(&[
                ("MY_KEY", "x"),
                ("OPENAI_BASE_URL", "http://local:8000/v1"),
            ]))
            .unwrap();
        assert_eq!(r.base_url, "http://local:8000/v1");

        let bad: AgentConfig = toml_like(r#"{"base_url": "ftp://x", "api_key_env": ""}"#);
        assert!(matches!(bad.resolve(env(&[])), Err(AgentError::Config(_))));
    }

    fn toml_like(json_text: &str) -> AgentConfig {
        serde_json::from_str(json_text).unwrap()
    }

    #[test]
    fn scrub_removes_the_key() {
        let r = AgentConfig::default()
            .resolve(env(&[("ANTHROPIC_API_KEY", "sk-ant-secret-123")]))
            .unwrap();
        assert_eq!(
            r.scrub("invalid x-api-key sk-ant-secret-123"),
            "invalid x-api-key [redacted]"
        );
    }

    #[test]
    fn arguments_must_be_an_object() {
        assert_eq!(parse_arguments("").unwrap(), json!({}));
        assert_eq!(parse_arguments("{\"a\":1}").unwrap(), json!({"a": 1}));
        assert!(parse_arguments("[1]").unwrap_err().contains("JSON object"));
        assert!(
            parse_arguments("{\"a\":")
                .unwrap_err()
                .contains("not valid JSON")
        );
    }
}
