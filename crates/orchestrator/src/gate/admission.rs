//! Stage 1, admission (DESIGN §3 steps 2 and 3's size cap): resolve the tool, cap the
//! arguments' size, and record the request.
//!
//! Both happen before the first audit event (DESIGN §16), so that what the append-only
//! log keeps of a call does not grow with what the caller sends: arguments over the cap,
//! and any sent to a tool that does not exist (they never run, and no schema says which
//! of them are secret), are recorded as their digest and size.

use std::sync::Arc;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::Gate;
use super::ctx::{CallCtx, ToolUse};
use super::ending::Rejection;
use crate::audit::{AuditKind, canonical_json};
use crate::catalog::CatalogTool;

impl Gate {
    /// The tool the call is for, with `ctx`'s input in the tool's own spelling.
    pub(super) fn admit(&self, ctx: &mut CallCtx) -> Result<Arc<CatalogTool>, Rejection> {
        let size = json_size(&ctx.tool_use.input);
        // An id or a name that a front door with no checks of its own passed on (an MCP
        // request id, a model's call in the agent loop): one with a NUL cannot be stored
        // as text by PostgreSQL, so the call's records would be lost, and other control
        // characters make log lines and the console lie. Refused, and recorded in an
        // escaped spelling, so that the refusal is audited like any other.
        if let Some(what) = malformed(&ctx.tool_use) {
            ctx.tool_use.id = escaped(&ctx.tool_use.id);
            ctx.tool_use.name = escaped(&ctx.tool_use.name);
            let requested = self.requested(None, &ctx.tool_use, true, size);
            ctx.note(AuditKind::Requested, requested);
            return Err(Rejection::MalformedToolUse { what });
        }
        // Unknown and hidden tools get the same answer (no catalog probing).
        let tool = self.visible_tool(&ctx.principal, &ctx.tool_use.name);
        let depth = json_depth(&ctx.tool_use.input);
        // Too deep is refused like too large, and recorded the same way (digest and
        // size): the audit log wraps the arguments in its own objects, and a record
        // nested past what the JSON reader accepts (128) would make the log unreadable
        // from that record on — `audit verify` would call it tampered.
        let oversized = size > self.limits.max_argument_bytes || depth > MAX_ARGUMENT_DEPTH;
        // From here on (audit redaction, schema, policy, worker) the tool's own spelling
        // of the arguments is used.
        if let Some(input) = tool
            .as_deref()
            .filter(|_| !oversized)
            .and_then(|t| t.normalized_input(&ctx.tool_use.input))
        {
            ctx.tool_use.input = input;
        }
        let requested = self.requested(tool.as_deref(), &ctx.tool_use, oversized, size);
        ctx.note(AuditKind::Requested, requested);
        let Some(tool) = tool else {
            return Err(Rejection::UnknownTool {
                name: bounded(&ctx.tool_use.name),
            });
        };
        if depth > MAX_ARGUMENT_DEPTH {
            return Err(Rejection::ArgumentsTooDeep {
                tool: ctx.tool_use.name.clone(),
                depth,
                limit: MAX_ARGUMENT_DEPTH,
            });
        }
        // Size cap before the schema, so a huge argument is never walked.
        if oversized {
            return Err(Rejection::ArgumentsTooLarge {
                tool: ctx.tool_use.name.clone(),
                bytes: size,
                limit: self.limits.max_argument_bytes,
            });
        }
        Ok(tool)
    }

    /// The `requested` event's data: the arguments redacted, or only their digest and
    /// size when they are over the cap or for no known tool.
    fn requested(
        &self,
        tool: Option<&CatalogTool>,
        tool_use: &ToolUse,
        oversized: bool,
        size: u64,
    ) -> Value {
        let mut requested =
            json!({"tool": bounded(&tool_use.name), "tool_use_id": bounded(&tool_use.id)});
        match tool {
            Some(tool) if !oversized => {
                requested["arguments"] = self.redacted(Some(tool), &tool_use.input);
            }
            _ => {
                requested["arguments_sha256"] = json!(hex::encode(Sha256::digest(
                    canonical_json(&tool_use.input).as_bytes()
                )));
                requested["arguments_bytes"] = json!(size);
            }
        }
        requested
    }
}

/// How deep a call's arguments may nest (objects and arrays). Tool schemas nest a few
/// levels; the audit log adds its own around them and must stay well under the 128
/// levels its JSON reader accepts.
pub(super) const MAX_ARGUMENT_DEPTH: usize = 64;

/// How deep `value` nests (a scalar is 0, `{}` or `[]` is 1), walked without recursion
/// so that no input can exhaust the stack.
fn json_depth(value: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((value, depth)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match value {
            Value::Array(items) => Box::new(items.iter()),
            Value::Object(fields) => Box::new(fields.values()),
            _ => continue,
        };
        deepest = deepest.max(depth + 1);
        stack.extend(children.map(|child| (child, depth + 1)));
    }
    deepest
}

/// The length of `value`'s compact JSON text, counted without building the text.
fn json_size(value: &Value) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    match serde_json::to_writer(&mut count, value) {
        Ok(()) => count.0,
        Err(_) => u64::MAX,
    }
}

/// Which of the call's id and tool name is not 1 to 256 characters free of control
/// characters (what `/v1` and gRPC accept), if any.
fn malformed(tool_use: &ToolUse) -> Option<&'static str> {
    let bad = |text: &str| {
        text.is_empty() || text.chars().count() > 256 || crate::wire::has_control(text)
    };
    if bad(&tool_use.id) {
        Some("id")
    } else if bad(&tool_use.name) {
        Some("name")
    } else {
        None
    }
}

/// A malformed id or name as it is recorded: control characters escaped (`\0`,
/// `\u{1b}`), at most 256 characters.
fn escaped(text: &str) -> String {
    bounded(
        &text
            .chars()
            .take(256)
            .flat_map(char::escape_debug)
            .collect::<String>(),
    )
}

/// A caller-chosen name or id as the audit log records it: at most 256 characters (what
/// HTTP and gRPC accept), so no front door can make one event large.
fn bounded(text: &str) -> String {
    text.chars().take(256).collect()
}
