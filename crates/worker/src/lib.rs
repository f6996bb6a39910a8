//! The Airlock worker runtime.
//!
//! A worker is a process that serves one tool group (`fs`, `shell`, ...) over the
//! internal `airlock.v1.ToolWorker` gRPC service. This crate holds what every worker
//! shares: the [`Tool`] trait, the server with its own deadline timer, cancellation when
//! the caller goes away, health, reflection and a graceful drain on shutdown.
#![forbid(unsafe_code)]

mod context;
pub mod declared;
mod endpoint;
mod health;
mod idle;
pub mod mcp;
mod metrics;
mod server;
mod tls;
mod tool;
pub mod volumes;

pub use context::{CallContext, OutputStream, ToolEvent};
pub use endpoint::{ListenAddr, ListenAddrError};
pub use metrics::WorkerMetrics;
pub use server::{
    BoundListener, INSECURE_PLAINTEXT_SERVICE, ServeError, WorkerServer, WorkerSettings,
};
pub use tool::{Tool, ToolSet};

pub use airlock_policy::{SessionId, ToolAnnotations, ToolDefinition, ToolOutcome};
pub use async_trait::async_trait;
pub use tokio_util::sync::CancellationToken;
