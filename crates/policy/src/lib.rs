//! Airlock's domain vocabulary, shared by the orchestrator, the workers and the sandbox.
//!
//! Pure data and pure decisions: no I/O, no async runtime, no `unsafe`. Wire types are
//! converted into these types once, at a process boundary (see the `proto` feature).
#![forbid(unsafe_code)]

pub mod call;
pub mod isolation;
pub mod limits;
pub mod names;
pub mod paths;
pub mod tool;

#[cfg(feature = "cedar")]
pub mod authz;
#[cfg(feature = "url")]
pub mod http_url;
mod mcp;
#[cfg(feature = "proto")]
pub mod wire;

pub use call::{CallStatus, ToolOutcome};
pub use isolation::IsolationLevel;
pub use limits::Limits;
pub use mcp::McpServerPolicy;
pub use names::{NameError, SessionId, validate_segment, validate_tool_name};
pub use tool::{ToolAnnotations, ToolDefinition};
