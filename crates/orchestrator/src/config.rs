//! The orchestrator's part of `airlock.toml`.

use std::path::PathBuf;

use airlock_policy::Limits;
use serde::Deserialize;

/// `[orchestrator]` plus the sections the orchestrator reads (`[[workers]]`,
/// `[[principals]]`, `[limits]`), assembled by the binary.
#[derive(Debug, Clone)]
pub struct OrchestratorConfig {
    /// HTTP listen address (`/v1`, `/healthz`, `/readyz`, `/openapi.json`).
    pub http_listen: String,
    /// gRPC listen address (`airlock.v1.Orchestrator`, health, reflection).
    pub grpc_listen: String,
    pub data_dir: PathBuf,
    pub workers: Vec<WorkerGroupConfig>,
    pub principals: Vec<PrincipalConfig>,
    pub limits: Limits,
}

/// `[[workers]]`: where the replicas of one tool group listen.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerGroupConfig {
    pub group: String,
    /// `unix:/path.sock`, `http://host:port`, or `dns:///service:port`.
    pub endpoints: Vec<String>,
}

/// `[[principals]]`: a caller identity. The token is never stored in the config in clear:
/// either the name of an environment variable holding it, or its SHA-256 digest.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrincipalConfig {
    pub name: String,
    #[serde(default)]
    pub token_env: Option<String>,
    #[serde(default)]
    pub token_sha256: Option<String>,
    #[serde(default)]
    pub roles: Vec<String>,
}
