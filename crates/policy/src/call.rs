//! The outcome of one tool call.

use serde::{Deserialize, Serialize};

/// Final or intermediate status of a call, as reported in `calls[].status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallStatus {
    Running,
    Ok,
    Error,
    Denied,
    PendingApproval,
    Timeout,
    Cancelled,
}

impl CallStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            CallStatus::Running => "running",
            CallStatus::Ok => "ok",
            CallStatus::Error => "error",
            CallStatus::Denied => "denied",
            CallStatus::PendingApproval => "pending_approval",
            CallStatus::Timeout => "timeout",
            CallStatus::Cancelled => "cancelled",
        }
    }

    /// Every status.
    pub const ALL: [CallStatus; 7] = [
        CallStatus::Running,
        CallStatus::Ok,
        CallStatus::Error,
        CallStatus::Denied,
        CallStatus::PendingApproval,
        CallStatus::Timeout,
        CallStatus::Cancelled,
    ];

    /// The status `as_str` names, or `None` for any other text.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|status| status.as_str() == text)
    }

    /// Whether the call has reached its final state and carries a result.
    pub fn is_final(self) -> bool {
        !matches!(self, CallStatus::Running | CallStatus::PendingApproval)
    }
}

/// What a tool produced: text blocks for the model and, for sandboxed tools, the
/// isolation report of the layers that were in force.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolOutcome {
    pub is_error: bool,
    pub content: Vec<String>,
    pub isolation: Option<serde_json::Value>,
    /// The tool's own time limit ended the call (reported as status `timeout`).
    #[serde(default)]
    pub timed_out: bool,
}

impl ToolOutcome {
    pub fn text(text: impl Into<String>) -> Self {
        Self {
            is_error: false,
            content: vec![text.into()],
            isolation: None,
            timed_out: false,
        }
    }

    pub fn error(text: impl Into<String>) -> Self {
        Self {
            is_error: true,
            content: vec![text.into()],
            isolation: None,
            timed_out: false,
        }
    }

    /// One text block holding a JSON document (shell, http and db tools answer so).
    pub fn json(value: &serde_json::Value) -> Self {
        Self::text(value.to_string())
    }
}
