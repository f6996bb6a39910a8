//! The Airlock orchestrator: the front doors (HTTP `/v1`, gRPC `airlock.v1.Orchestrator`),
//! the gate every tool call passes, and dispatch to the per-tool worker services.
//!
//! The orchestrator never executes anything itself: every side effect happens in a
//! worker that it reaches over gRPC.
#![forbid(unsafe_code)]

pub mod agent;
pub mod audit;
mod audit_export;
pub mod auth;
mod authn;
pub(crate) mod body;
mod budget;
mod cache;
mod calls;
pub mod catalog;
pub mod config;
mod connections;
mod dispatch;
mod endpoints;
mod execute_stream;
mod gate;
mod grpc_api;
pub mod harness;
mod http_api;
mod json_text;
mod mcp;
pub mod metrics;
mod openapi;
mod replicas;
mod server;
mod service;
pub mod store;
mod streaming;
mod strict;
mod traces;
mod ui;
mod wire;
mod worker_channel;
pub mod worker_check;

pub use agent::{AgentConfig, ProviderKind};
pub use auth::{AuthError, Principal, Principals, Role};
pub use config::{
    ApprovalsConfig, AuditConfig, AuditExportConfig, BudgetConfig, CacheConfig, DispatchConfig,
    OrchestratorConfig, PrincipalConfig, StoreRetention, WorkerGroupConfig, WorkerTls,
};
/// The (method, path) of every authenticated HTTP route, as the router serves them.
pub use http_api::route_table as http_route_table;
pub use server::{BoundListeners, Orchestrator, Prepared, Reload, ServeError};
