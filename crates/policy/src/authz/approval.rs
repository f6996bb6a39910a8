//! The `[approvals] tools` knob: the simple list of tools whose calls wait for a human.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The irreversible tools of DESIGN §3, which need approval by default.
pub const DEFAULT_APPROVAL_TOOLS: [&str; 7] = [
    "write_file",
    "edit_file",
    "move_path",
    "delete_path",
    "execute_sql",
    "execute_shell",
    "http_request",
];

/// HTTP methods of `http_request` that never need approval through the knob.
pub const SAFE_HTTP_METHODS: [&str; 3] = ["GET", "HEAD", "OPTIONS"];

/// `[approvals] tools`: the tools whose calls need approval, whatever the Cedar policy
/// says (the policy may require approval for more calls, never for fewer).
///
/// `http_request` in the list stands for its calls whose `method` is not GET, HEAD or
/// OPTIONS (case-insensitive; a missing or non-string method needs approval). An empty
/// list turns the knob off.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalKnob {
    pub tools: Vec<String>,
}

impl Default for ApprovalKnob {
    fn default() -> Self {
        Self {
            tools: DEFAULT_APPROVAL_TOOLS
                .iter()
                .map(|&t| t.to_owned())
                .collect(),
        }
    }
}

impl ApprovalKnob {
    /// The knob turned off (`tools = []`).
    pub fn off() -> Self {
        Self { tools: Vec::new() }
    }

    /// Whether the knob alone requires approval for this call; `Some(reason)` if so.
    pub fn requires(&self, tool: &str, arguments: &Value) -> Option<String> {
        if !self.tools.iter().any(|listed| listed == tool) {
            return None;
        }
        if tool == "http_request" {
            let method = arguments.get("method").and_then(Value::as_str);
            return match method {
                Some(method)
                    if SAFE_HTTP_METHODS
                        .iter()
                        .any(|safe| safe.eq_ignore_ascii_case(method)) =>
                {
                    None
                }
                Some(method) => Some(format!(
                    "[approvals] tools lists `http_request` and the method is {}",
                    method.to_ascii_uppercase()
                )),
                None => Some(
                    "[approvals] tools lists `http_request` and the call names no method"
                        .to_owned(),
                ),
            };
        }
        Some(format!("[approvals] tools lists `{tool}`"))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn defaults_cover_the_irreversible_tools() {
        let knob = ApprovalKnob::default();
        for tool in [
            "write_file",
            "edit_file",
            "move_path",
            "delete_path",
            "execute_sql",
            "execute_shell",
        ] {
            assert!(knob.requires(tool, &json!({})).is_some(), "{tool}");
        }
        for tool in [
            "read_file",
            "fetch_url",
            "query_database",
            "create_directory",
        ] {
            assert!(knob.requires(tool, &json!({})).is_none(), "{tool}");
        }
        for method in ["GET", "get", "Head", "OPTIONS"] {
            let args = json!({"method": method, "url": "https://x.test/"});
            assert!(knob.requires("http_request", &args).is_none(), "{method}");
        }
        for method in ["POST", "put", "DELETE", "PATCH"] {
            let args = json!({"method": method, "url": "https://x.test/"});
            assert!(knob.requires("http_request", &args).is_some(), "{method}");
        }
        assert!(knob.requires("http_request", &json!({})).is_some());
        assert!(
            ApprovalKnob::off()
                .requires("write_file", &json!({}))
                .is_none()
        );
    }
}
