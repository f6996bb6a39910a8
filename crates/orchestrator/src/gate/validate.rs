//! Stage 2, validation (DESIGN §3 step 3): the arguments against the tool's JSON Schema.

use serde_json::Value;

use super::ending::Rejection;
use crate::catalog::CatalogTool;

/// How many schema violations are listed in one error result.
const MAX_REPORTED_VIOLATIONS: usize = 5;

/// The longest a violation's message is told, in bytes. A validator's message quotes the
/// value it judged, and for a rule on the whole input (`oneOf` at the root) that value is
/// every argument: without a bound a 4 MiB call would come back, and be stored, five
/// times over.
const MAX_MESSAGE_BYTES: usize = 512;
/// The longest a violation's field (a path of the caller's keys) or rule is told.
const MAX_FIELD_BYTES: usize = 256;

/// Checks `input` against the tool's schema; each violation names the field and rule so
/// the model can correct itself.
pub(super) fn validate(tool: &CatalogTool, input: &Value) -> Result<(), Rejection> {
    let rejected = |violations, audited| Rejection::InvalidArguments {
        tool: tool.definition.name.clone(),
        violations,
        audited,
    };
    if !input.is_object() {
        let violation = format!("input of {} must be a JSON object", tool.definition.name);
        return Err(rejected(vec![violation.clone()], vec![violation]));
    }
    let mut violations = Vec::new();
    let mut audited = Vec::new();
    for e in tool
        .validator
        .iter_errors(input)
        .take(MAX_REPORTED_VIOLATIONS)
    {
        let at = e.instance_path().to_string();
        let field = if at.is_empty() {
            "(arguments)".to_owned()
        } else {
            clipped(at, MAX_FIELD_BYTES)
        };
        let schema_path = e.schema_path().to_string();
        let rule = schema_path.rsplit('/').next().unwrap_or_default();
        let rule = clipped(rule.to_owned(), MAX_FIELD_BYTES);
        let told = clipped(e.to_string(), MAX_MESSAGE_BYTES);
        violations.push(format!("{field}: {told} (rule: {rule})"));
        // The audit log is append-only and read by people the caller's secrets were never
        // meant for: its copy names the field and the rule, never the value.
        let masked = clipped(e.masked().to_string(), MAX_MESSAGE_BYTES);
        audited.push(format!("{field}: {masked} (rule: {rule})"));
    }
    if violations.is_empty() {
        Ok(())
    } else {
        Err(rejected(violations, audited))
    }
}

/// `text` cut to `max` bytes at a character boundary, marked where it was cut.
fn clipped(mut text: String, max: usize) -> String {
    crate::wire::ellipsize(&mut text, max);
    text
}
