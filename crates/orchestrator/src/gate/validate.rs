//! Stage 2, validation (DESIGN §3 step 3): the arguments against the tool's JSON Schema.

use serde_json::Value;

use super::ending::Rejection;
use crate::catalog::CatalogTool;

/// How many schema violations are listed in one error result.
const MAX_REPORTED_VIOLATIONS: usize = 5;

/// Checks `input` against the tool's schema; each violation names the field and rule so
/// the model can correct itself.
pub(super) fn validate(tool: &CatalogTool, input: &Value) -> Result<(), Rejection> {
    let rejected = |violations| Rejection::InvalidArguments {
        tool: tool.definition.name.clone(),
        violations,
    };
    if !input.is_object() {
        return Err(rejected(vec![format!(
            "input of {} must be a JSON object",
            tool.definition.name
        )]));
    }
    let violations: Vec<String> = tool
        .validator
        .iter_errors(input)
        .take(MAX_REPORTED_VIOLATIONS)
        .map(|e| {
            let at = e.instance_path().to_string();
            let field = if at.is_empty() {
                "(arguments)".to_owned()
            } else {
                at
            };
            let schema_path = e.schema_path().to_string();
            let rule = schema_path
                .rsplit('/')
                .next()
                .unwrap_or_default()
                .to_owned();
            format!("{field}: {e} (rule: {rule})")
        })
        .collect();
    if violations.is_empty() {
        Ok(())
    } else {
        Err(rejected(violations))
    }
}
