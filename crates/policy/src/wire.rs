//! Conversions between `airlock.v1` wire types and domain types.

use airlock_proto::v1 as pb;

use crate::{ToolAnnotations, ToolDefinition, ToolOutcome};

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("tool {tool} has an input schema that is not valid JSON: {source}")]
    BadSchema {
        tool: String,
        source: serde_json::Error,
    },
    #[error("isolation report is not valid JSON: {0}")]
    BadIsolation(serde_json::Error),
}

impl From<&ToolAnnotations> for pb::ToolAnnotations {
    fn from(a: &ToolAnnotations) -> Self {
        pb::ToolAnnotations {
            read_only: a.read_only,
            destructive: a.destructive,
            idempotent: a.idempotent,
            open_world: a.open_world,
        }
    }
}

impl From<pb::ToolAnnotations> for ToolAnnotations {
    fn from(a: pb::ToolAnnotations) -> Self {
        ToolAnnotations {
            read_only: a.read_only,
            destructive: a.destructive,
            idempotent: a.idempotent,
            open_world: a.open_world,
        }
    }
}

impl From<&ToolDefinition> for pb::ToolDefinition {
    fn from(d: &ToolDefinition) -> Self {
        pb::ToolDefinition {
            name: d.name.clone(),
            title: d.title.clone(),
            description: d.description.clone(),
            input_schema_json: d.input_schema.to_string(),
            annotations: Some((&d.annotations).into()),
        }
    }
}

impl TryFrom<pb::ToolDefinition> for ToolDefinition {
    type Error = WireError;
    fn try_from(d: pb::ToolDefinition) -> Result<Self, Self::Error> {
        let input_schema =
            serde_json::from_str(&d.input_schema_json).map_err(|source| WireError::BadSchema {
                tool: d.name.clone(),
                source,
            })?;
        Ok(ToolDefinition {
            name: d.name,
            title: d.title,
            description: d.description,
            input_schema,
            annotations: d.annotations.map(Into::into).unwrap_or_default(),
        })
    }
}

/// By value: the text moves into the message (a worker's 1 MiB result was copied here
/// once more when this borrowed it).
impl From<ToolOutcome> for pb::ToolResult {
    fn from(o: ToolOutcome) -> Self {
        pb::ToolResult {
            is_error: o.is_error,
            content: o.content,
            isolation_json: o
                .isolation
                .as_ref()
                .map(|v| v.to_string())
                .unwrap_or_default(),
            timed_out: o.timed_out,
        }
    }
}

impl TryFrom<pb::ToolResult> for ToolOutcome {
    type Error = WireError;
    fn try_from(r: pb::ToolResult) -> Result<Self, Self::Error> {
        let isolation = if r.isolation_json.is_empty() {
            None
        } else {
            Some(serde_json::from_str(&r.isolation_json).map_err(WireError::BadIsolation)?)
        };
        Ok(ToolOutcome {
            is_error: r.is_error,
            content: r.content,
            isolation,
            timed_out: r.timed_out,
        })
    }
}
