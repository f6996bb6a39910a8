//! The orchestrator's part of `airlock.toml`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use airlock_policy::Limits;
use airlock_policy::authz::ApprovalKnob;
use serde::Deserialize;

/// `[orchestrator]` plus the sections the orchestrator reads (`[[workers]]`,
/// `[[principals]]`, `[limits]`, `[policy]`, `[approvals]`, `[budgets]`, `[audit]`,
/// `[cache]`), assembled by the binary.
#[derive(Debug, Clone)]
pub struct OrchestratorConfig {
    /// HTTP listen address (`/v1`, `/healthz`, `/readyz`, `/openapi.json`).
    pub http_listen: String,
    /// gRPC listen address (`airlock.v1.Orchestrator`, health, reflection).
    pub grpc_listen: String,
    pub data_dir: PathBuf,
    /// Where the workers keep workspaces, when this host knows it (`airlock up`): lets
    /// policies see host-absolute paths as workspace-relative ones.
    pub workspaces_root: Option<PathBuf>,
    /// `sqlite` (the file `<data_dir>/airlock.db`) or a `postgres://` URL.
    pub store: String,
    /// The PostgreSQL password (from `store_password_env`/`store_password_file`).
    pub store_password: Option<String>,
    pub workers: Vec<WorkerGroupConfig>,
    pub principals: Vec<PrincipalConfig>,
    pub limits: Limits,
    /// Cedar policy file; the embedded default policy when absent.
    pub policy_file: Option<PathBuf>,
    pub approvals: ApprovalsConfig,
    pub budgets: BudgetConfig,
    pub audit: AuditConfig,
    pub cache: CacheConfig,
    /// `[agent]`: the model provider of the agent loop and its limits.
    pub agent: crate::agent::AgentConfig,
    /// How TCP worker endpoints are dialed (`[tls]`, loaded before confinement).
    pub worker_tls: WorkerTls,
    /// `[dispatch]`: how replicas behind a name are found.
    pub dispatch: DispatchConfig,
    /// `[store]`: what the store keeps of results, and for how long.
    pub retention: StoreRetention,
    /// `[orchestrator] grpc_tls = true`: the gRPC front door serves TLS with this
    /// identity (`[tls]` cert_file/key_file, the same one that dials workers); no client
    /// certificate is asked for. `None`: plaintext, as before.
    pub grpc_tls: Option<std::sync::Arc<airlock_tls::mtls::Reloading>>,
    /// The tools that are not built in (`[[tools]]`, `tool_packs`): each is a Cedar
    /// action that policies can name, and the catalog serves it only as declared.
    pub tool_extensions: Vec<airlock_policy::authz::ToolExtension>,
    /// `[sandbox] network` (`"none"`, `"proxy"`, `"host"`): what execute_shell's policies
    /// see as `context.network`.
    pub shell_network: String,
    /// `[[mcp_servers]]`: their tools (`<name>__<tool>`) are discovered from the worker
    /// that runs each server, like an external worker's.
    pub mcp_servers: Vec<airlock_policy::McpServerPolicy>,
}

/// `[store]` (DESIGN §15): what the store keeps of results, and for how long.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreRetention {
    /// Results of calls finished longer ago are dropped (the calls, their statuses and
    /// the audit chain stay); 0 keeps them for ever.
    pub retention_days: u64,
    /// The most the store keeps of one result; a longer one is cut, and says so. The
    /// audit's `completed` event holds the digest of the whole.
    pub max_result_bytes: u64,
}

impl Default for StoreRetention {
    fn default() -> Self {
        Self {
            retention_days: 30,
            max_result_bytes: 65_536,
        }
    }
}

/// `[dispatch]` (DESIGN §9).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DispatchConfig {
    /// How often a `dns:///` endpoint is resolved again (it also is at once when a
    /// replica fails).
    pub resolve_interval_ms: u64,
}

impl Default for DispatchConfig {
    fn default() -> Self {
        Self {
            resolve_interval_ms: 5000,
        }
    }
}

/// `[tls]` as the orchestrator dials its workers with it.
#[derive(Debug, Clone, Default)]
pub struct WorkerTls {
    /// The orchestrator's identity and the workers' trust anchor.
    pub mtls: Option<std::sync::Arc<airlock_tls::mtls::Reloading>>,
    /// `insecure_plaintext = true`: `http://` and `dns:///` endpoints dial plaintext.
    pub insecure_plaintext: bool,
}

impl WorkerTls {
    pub(crate) fn dialer(&self) -> crate::endpoints::Dialer {
        crate::endpoints::Dialer {
            mtls: self.mtls.clone(),
            insecure_plaintext: self.insecure_plaintext,
        }
    }
}

/// `[[workers]]`: where the replicas of one tool group listen.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerGroupConfig {
    pub group: String,
    /// `unix:/path.sock`, `https://host:port`, `dns:///service:port`, or (with
    /// `[tls] insecure_plaintext`) `http://host:port`.
    pub endpoints: Vec<String>,
    /// The name the workers' certificates carry, when it is not the endpoint's host
    /// (an IP address, or a headless Service name).
    #[serde(default)]
    pub server_name: Option<String>,
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

/// `[approvals]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApprovalsConfig {
    /// Tools whose calls need approval (DESIGN §3 defaults; `[]` turns the knob off).
    pub tools: Vec<String>,
    /// How long a pending approval waits before it expires.
    pub timeout_seconds: u64,
    /// Forbid approving one's own request.
    pub distinct_approver: bool,
    /// `{ tool = N }`: a held call of the tool needs N distinct approvers.
    pub quorum: BTreeMap<String, u32>,
}

impl Default for ApprovalsConfig {
    fn default() -> Self {
        Self {
            tools: ApprovalKnob::default().tools,
            timeout_seconds: 3600,
            distinct_approver: false,
            quorum: BTreeMap::new(),
        }
    }
}

impl ApprovalsConfig {
    pub fn knob(&self) -> ApprovalKnob {
        ApprovalKnob {
            tools: self.tools.clone(),
            quorum: self.quorum.clone(),
        }
    }
}

/// `[budgets]`: per session (calls that name a `session_id`) and per principal.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BudgetConfig {
    /// Calls per session.
    pub max_calls_per_session: u64,
    /// Wall time of a session, from its first call.
    pub session_wall_time_seconds: u64,
    /// The same failing call (tool + arguments) refused after this many failures in a row.
    pub max_repeated_failures: u32,
    /// Calls per principal per minute (every call counts); 0 turns the limit off.
    pub rate_per_minute: u32,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        Self {
            max_calls_per_session: 100,
            session_wall_time_seconds: 3600,
            max_repeated_failures: 5,
            rate_per_minute: 600,
        }
    }
}

/// `[audit]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuditConfig {
    /// Argument names whose values are redacted in audit records (besides the ones the
    /// tool schemas mark `writeOnly` or `x-airlock-secret`).
    pub secret_fields: Vec<String>,
    /// How often the orchestrator checks the whole hash chain by itself, for the
    /// `airlock_audit_verify_ok` series an alert watches; 0: only when asked
    /// (`GET /v1/audit/verify`, `airlock audit verify`).
    pub verify_interval_seconds: u64,
    /// `[audit] export = { endpoint = "http://127.0.0.1:4318" }`: every record appended
    /// to the log, also sent to an OTLP logs endpoint (a collector that forwards to the
    /// SIEM). Off when absent.
    pub export: Option<AuditExportConfig>,
}

impl Default for AuditConfig {
    fn default() -> Self {
        Self {
            secret_fields: ["password", "token", "api_key", "secret", "authorization"]
                .map(String::from)
                .to_vec(),
            verify_interval_seconds: 3600,
            export: None,
        }
    }
}

/// `[audit] export`: where and how the audit records are sent (see
/// `crate::audit_export`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditExportConfig {
    /// The collector's base URL, `http://host:port` (`/v1/logs` is added for
    /// `http/protobuf`).
    pub endpoint: String,
    /// `"http/protobuf"` (default) or `"grpc"`.
    #[serde(default = "default_export_protocol")]
    pub protocol: String,
    /// Records read from the log and not yet accepted by the collector, at most; past
    /// it the exporter stops reading ahead until the collector takes some (the log keeps
    /// them, so nothing is dropped).
    #[serde(default = "default_export_queue")]
    pub max_queue: usize,
    /// How long one send may take.
    #[serde(default = "default_export_timeout_ms")]
    pub timeout_ms: u64,
}

fn default_export_protocol() -> String {
    "http/protobuf".to_owned()
}

fn default_export_queue() -> usize {
    10_000
}

fn default_export_timeout_ms() -> u64 {
    10_000
}

/// `[cache]`: result cache, off by default. `ttl_seconds = { list_tables = 60 }`; only
/// tools annotated read-only and idempotent may be listed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    pub ttl_seconds: BTreeMap<String, u64>,
}
