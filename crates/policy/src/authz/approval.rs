//! The `[approvals] tools` knob: the simple list of tools whose calls wait for a human,
//! and `[approvals] quorum`: how many distinct humans some of them wait for.

use std::collections::BTreeMap;

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

/// Request headers that ask a server (or a framework in front of it) to treat the
/// request as another method: with one, a GET can act as a DELETE. Compared
/// case-insensitively, the name trimmed as the http worker trims it.
pub const METHOD_OVERRIDE_HEADERS: [&str; 3] = [
    "X-HTTP-Method-Override",
    "X-HTTP-Method",
    "X-Method-Override",
];

/// `[approvals] tools`: the tools whose calls need approval, whatever the Cedar policy
/// says (the policy may require approval for more calls, never for fewer).
///
/// `http_request` in the list stands for its calls that may write: a `method` other
/// than GET, HEAD or OPTIONS (case-insensitive; a missing or non-string method needs
/// approval), a non-empty `body` whatever the method (servers act on the body of a
/// "safe" method too), or a method-override header ([`METHOD_OVERRIDE_HEADERS`]). An
/// empty list turns the knob off.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalKnob {
    pub tools: Vec<String>,
    /// `[approvals] quorum = { tool = N }`: a held call of the tool runs once N distinct
    /// approvers approved it. A tool named here needs approval as if it were in `tools`.
    #[serde(default)]
    pub quorum: BTreeMap<String, u32>,
}

impl Default for ApprovalKnob {
    fn default() -> Self {
        Self {
            tools: DEFAULT_APPROVAL_TOOLS
                .iter()
                .map(|&t| t.to_owned())
                .collect(),
            quorum: BTreeMap::new(),
        }
    }
}

impl ApprovalKnob {
    /// The knob turned off (`tools = []`).
    pub fn off() -> Self {
        Self {
            tools: Vec::new(),
            quorum: BTreeMap::new(),
        }
    }

    /// How many distinct approvers the knob asks for a held call of `tool` (at least 1).
    pub fn quorum(&self, tool: &str) -> u32 {
        self.quorum.get(tool).copied().unwrap_or(1).max(1)
    }

    /// Whether the knob alone requires approval for this call; `Some(reason)` if so.
    pub fn requires(&self, tool: &str, arguments: &Value) -> Option<String> {
        if !self.tools.iter().any(|listed| listed == tool) && !self.quorum.contains_key(tool) {
            return None;
        }
        if tool == "http_request" {
            return http_request_write(arguments)
                .map(|why| format!("[approvals] tools lists `http_request` and {why}"));
        }
        if !self.tools.iter().any(|listed| listed == tool) {
            return Some(format!(
                "[approvals] quorum asks {} approvers for `{tool}`",
                self.quorum(tool)
            ));
        }
        Some(format!("[approvals] tools lists `{tool}`"))
    }
}

/// Why an `http_request` call may change something on the server, or `None` for a
/// plain read. The method alone is not enough: a GET with a body, or with
/// `X-HTTP-Method-Override: DELETE`, is a write to many servers.
fn http_request_write(arguments: &Value) -> Option<String> {
    let method = match arguments.get("method").and_then(Value::as_str) {
        None => return Some("the call names no method".to_owned()),
        Some(method) => method.trim(),
    };
    if !SAFE_HTTP_METHODS
        .iter()
        .any(|safe| safe.eq_ignore_ascii_case(method))
    {
        return Some(format!("the method is {}", method.to_ascii_uppercase()));
    }
    let method = method.to_ascii_uppercase();
    if let Some(name) = method_override(arguments.get("headers")) {
        return Some(format!(
            "the {method} request carries {name}, which asks the server for another method"
        ));
    }
    // An empty body is no body (the worker sends none); anything else, even `null` or a
    // non-string the schema will refuse, counts as one.
    match arguments.get("body") {
        None => None,
        Some(Value::String(body)) if body.is_empty() => None,
        Some(_) => Some(format!(
            "the {method} request has a body, which makes it a write"
        )),
    }
}

/// The first method-override header among `headers` (a map, or `[{"name", "value"}]` /
/// `[[name, value]]` pairs as strict clients send them).
fn method_override(headers: Option<&Value>) -> Option<String> {
    let is_override = |name: &str| {
        METHOD_OVERRIDE_HEADERS
            .iter()
            .any(|h| h.eq_ignore_ascii_case(name.trim()))
    };
    match headers? {
        Value::Object(map) => map.keys().find(|k| is_override(k)).cloned(),
        Value::Array(items) => items
            .iter()
            .filter_map(|item| match item {
                Value::Object(pair) => pair.get("name").and_then(Value::as_str),
                Value::Array(pair) => pair.first().and_then(Value::as_str),
                _ => None,
            })
            .find(|name| is_override(name))
            .map(str::to_owned),
        _ => None,
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

    #[test]
    fn a_safe_method_with_a_body_or_an_override_header_needs_approval() {
        let knob = ApprovalKnob::default();
        let url = "https://x.test/items/1";
        for args in [
            json!({"method": "GET", "url": url, "body": "{}"}),
            json!({"method": "get", "url": url, "body": " "}),
            json!({"method": "HEAD", "url": url, "body": "x"}),
            json!({"method": " OPTIONS ", "url": url, "body": "x"}),
            json!({"method": "GET", "url": url, "body": null}),
            json!({"method": "GET", "url": url, "body": {"id": 1}}),
            json!({"method": "GET", "url": url, "headers": {"X-HTTP-Method-Override": "DELETE"}}),
            json!({"method": "GET", "url": url, "headers": {"x-http-method": "PUT"}}),
            json!({"method": "GET", "url": url, "headers": {" X-METHOD-OVERRIDE ": "PATCH"}}),
            json!({"method": "HEAD", "url": url, "headers": {"Accept": "*/*", "X-Http-Method-Override": ""}}),
            json!({"method": "GET", "url": url, "headers": [{"name": "x-http-method-override", "value": "DELETE"}]}),
            json!({"method": "GET", "url": url, "headers": [["X-HTTP-Method", "DELETE"]]}),
        ] {
            let reason = knob.requires("http_request", &args);
            assert!(reason.is_some(), "{args}");
        }
        let reason = knob
            .requires(
                "http_request",
                &json!({"method": "GET", "url": url, "body": "x", "headers": {"X-HTTP-Method-Override": "DELETE"}}),
            )
            .unwrap();
        assert!(reason.contains("X-HTTP-Method-Override"), "{reason}");
        let reason = knob
            .requires(
                "http_request",
                &json!({"method": "get", "url": url, "body": "x"}),
            )
            .unwrap();
        assert!(reason.contains("GET request has a body"), "{reason}");

        // Plain reads stay free: no body, an empty one, ordinary headers.
        for args in [
            json!({"method": "GET", "url": url}),
            json!({"method": "GET", "url": url, "body": ""}),
            json!({"method": "HEAD", "url": url, "headers": {"Accept": "text/html", "X-Method": "DELETE"}}),
            json!({"method": "OPTIONS", "url": url, "headers": [{"name": "Accept", "value": "*/*"}]}),
        ] {
            assert!(knob.requires("http_request", &args).is_none(), "{args}");
        }
        // Off is off.
        assert!(
            ApprovalKnob::off()
                .requires(
                    "http_request",
                    &json!({"method": "GET", "url": url, "body": "x"})
                )
                .is_none()
        );
    }
}
