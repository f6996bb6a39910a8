//! `airlock.toml`: one file for every component; each reads its own sections.
//!
//! Every key has a working default, so `airlock up` runs with no file at all. Unknown
//! keys are errors: a misspelt security setting must not be silently ignored.

use std::path::{Path, PathBuf};

use airlock_orchestrator::{
    AgentConfig, ApprovalsConfig, AuditConfig, BudgetConfig, CacheConfig, OrchestratorConfig,
    PrincipalConfig, WorkerGroupConfig,
};
use airlock_policy::Limits;
use airlock_policy::authz::ToolExtension;
use airlock_sandbox::Network;
use airlock_worker::declared::{ToolEntry, ToolNetwork};
use airlock_worker::volumes::WorkspaceQuota;
use airlock_worker_db::DatabaseConfig;
use airlock_worker_fs::FsConfig;
use airlock_worker_http::HttpConfig;
use airlock_worker_http::declared::HttpTemplate;
use airlock_worker_http::mcp::McpHttpServer;
use airlock_worker_shell::ShellConfig;
use airlock_worker_shell::declared::CommandTemplate;
use anyhow::{Context, bail};
use serde::Deserialize;

/// The tool groups `airlock up` starts, in start order.
pub const LOCAL_GROUPS: &[&str] = &["fs", "shell", "http", "db"];

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AirlockConfig {
    pub orchestrator: OrchestratorSection,
    pub workers: Vec<WorkerGroupConfig>,
    pub principals: Vec<PrincipalConfig>,
    pub limits: Limits,
    pub policy: PolicySection,
    pub approvals: ApprovalsConfig,
    pub budgets: BudgetConfig,
    pub audit: AuditConfig,
    pub cache: CacheConfig,
    pub fs: FsConfig,
    /// The shell sandbox: isolation level, limits, timeouts, network.
    pub sandbox: ShellConfig,
    /// Egress policy and limits of the http tools.
    pub http: HttpConfig,
    /// Databases of the db tools; without any, `airlock up` serves a demo SQLite database.
    pub databases: Vec<DatabaseConfig>,
    /// Root of the per-principal, per-session workspaces; `<data_dir>/workspaces` by
    /// default. In Kubernetes, a volume the shell and fs workers both mount.
    pub workspaces_root: Option<PathBuf>,
    /// The agent loop's model provider and limits (`airlock agent`, `POST /v1/agent/runs`).
    pub agent: AgentConfig,
    /// Mutual TLS between components on TCP (DESIGN §9).
    pub tls: airlock_tls::TlsConfig,
    /// How the orchestrator finds the replicas behind a `dns:///` endpoint.
    pub dispatch: airlock_orchestrator::DispatchConfig,
    /// How a worker stops.
    pub worker: WorkerSection,
    /// What the store keeps of results, and for how long (DESIGN §15).
    pub store: airlock_orchestrator::StoreRetention,
    /// The operator's own tools (DESIGN §11): `command` ones run by the shell worker,
    /// `http` ones sent by the http worker. Read by the orchestrator (each becomes a
    /// Cedar action) and by the worker that serves it, so both need the same entries.
    pub tools: Vec<ToolEntry>,
    /// Shipped packs of declared tools: `["dev"]`.
    pub tool_packs: Vec<String>,
    /// MCP servers behind the gate (DESIGN §11): stdio ones run by the shell worker in
    /// its sandbox; their tools are `<name>__<tool>`.
    pub mcp_servers: Vec<airlock_worker::mcp::McpServerEntry>,
    /// Prometheus metrics of the workers (the orchestrator serves `/metrics` on its
    /// HTTP port).
    pub metrics: MetricsSection,
}

/// `[metrics]`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSection {
    /// Where a worker serves `GET /metrics` (`host:port`; `--metrics-listen` overrides).
    /// Under `airlock up`, each worker gets its own port: a free one for port 0, else
    /// this port for the fs worker and the next ones for shell, http and db.
    pub listen: Option<String>,
}

/// `[worker]`.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerSection {
    /// How long calls in flight may run on after SIGTERM (DESIGN §9); new calls are
    /// refused from the first moment.
    pub drain_seconds: u64,
}

impl Default for WorkerSection {
    fn default() -> Self {
        Self { drain_seconds: 30 }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OrchestratorSection {
    pub http_listen: String,
    pub grpc_listen: String,
    pub data_dir: Option<PathBuf>,
    /// `sqlite` (`<data_dir>/airlock.db`) or `postgres://user@host:port/db`.
    pub store: String,
    /// Where the PostgreSQL password comes from (never in the URL of a shared config).
    pub store_password_env: Option<String>,
    pub store_password_file: Option<PathBuf>,
    /// Serve the gRPC front door over TLS with `[tls]` cert_file/key_file (callers still
    /// authenticate with their bearer token; no client certificate is asked for).
    pub grpc_tls: bool,
    /// Threads that run the front doors and the gate (1 to 256); unset: one per CPU this
    /// process may use (docs/decisions.md, "The orchestrator's async threads").
    pub async_threads: Option<usize>,
}

impl Default for OrchestratorSection {
    fn default() -> Self {
        Self {
            http_listen: "127.0.0.1:7070".to_owned(),
            grpc_listen: "127.0.0.1:7071".to_owned(),
            data_dir: None,
            store: "sqlite".to_owned(),
            store_password_env: None,
            store_password_file: None,
            grpc_tls: false,
            async_threads: None,
        }
    }
}

/// `[policy]`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicySection {
    /// Cedar policy file (relative to the config file); the embedded default when unset.
    pub file: Option<PathBuf>,
}

/// The configuration a command runs with: the file (if any) and the data dir.
#[derive(Debug)]
pub struct Loaded {
    pub file: Option<PathBuf>,
    pub config: AirlockConfig,
    pub data_dir: PathBuf,
    /// `workspaces_root` (or `<data_dir>/workspaces`) with symlinks resolved.
    workspaces_root: PathBuf,
    /// `tool_packs` and `[[tools]]`, checked at load.
    declared: Vec<ToolEntry>,
}

impl Loaded {
    /// Reads `--config` (or `AIRLOCK_CONFIG`) and settles the data dir: `--data-dir`, then
    /// `AIRLOCK_DATA_DIR`, then `[orchestrator] data_dir`, then `~/.airlock`.
    pub fn load(config: Option<&Path>, data_dir: Option<&Path>) -> anyhow::Result<Self> {
        let file = config.map(Path::to_path_buf);
        let parsed = match &file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read config file {}", path.display()))?;
                toml::from_str::<AirlockConfig>(&text)
                    .with_context(|| format!("invalid config file {}", path.display()))?
            }
            None => AirlockConfig::default(),
        };
        let data_dir = match data_dir {
            Some(d) => d.to_path_buf(),
            None => match &parsed.orchestrator.data_dir {
                Some(d) => d.clone(),
                None => default_data_dir()?,
            },
        };
        let data_dir = absolute(&data_dir)?;
        check_worker_memory(parsed.limits.worker_memory_bytes)?;
        check_workspace_quota(&parsed.sandbox)?;
        check_dispatch(&parsed)?;
        check_async_threads(&parsed)?;
        check_agent(&parsed)?;
        airlock_worker_fs::Hidden::new(&parsed.fs.hidden).context("invalid [fs] hidden")?;
        let declared = declared_entries(&parsed).map_err(|e| match &file {
            Some(path) => anyhow::anyhow!("invalid config file {}: {e:#}", path.display()),
            None => e,
        })?;
        let configured = match &parsed.workspaces_root {
            Some(root) => absolute(root)?,
            None => data_dir.join("workspaces"),
        };
        // Resolved once, here, and handed to the policy and the workers alike: the fs
        // worker accepts an absolute path only under this spelling (or /workspace), and
        // the policy makes exactly those relative, so a path rule cannot be dodged by
        // spelling the workspace another way.
        let workspaces_root = canonical_prefix(&configured)?;
        Ok(Self {
            file,
            config: parsed,
            data_dir,
            workspaces_root,
            declared,
        })
    }

    /// The declared tools (`tool_packs` first, then `[[tools]]`), every one checked.
    pub fn declared_tools(&self) -> &[ToolEntry] {
        &self.declared
    }

    /// The declared command tools, compiled for the shell worker.
    pub fn command_tools(&self) -> anyhow::Result<Vec<CommandTemplate>> {
        compile_commands(&self.declared).map_err(|e| self.declared_error(e))
    }

    /// The declared http tools, compiled (their secrets not read: only the http worker
    /// reads them, at its start).
    pub fn http_tools(&self) -> anyhow::Result<Vec<HttpTemplate>> {
        compile_http(self.declared_tools()).map_err(|e| self.declared_error(e))
    }

    /// The Streamable HTTP MCP servers (`[[mcp_servers]]` with `url`), compiled (their
    /// secrets not read: only the http worker reads them, at its start).
    pub fn mcp_http_servers(&self) -> anyhow::Result<Vec<McpHttpServer>> {
        airlock_worker_http::mcp::compile_all(&self.config.mcp_servers)
            .map_err(|e| self.declared_error(e))
    }

    /// `error` naming the config file it comes from.
    pub fn declared_error(&self, error: impl std::fmt::Display) -> anyhow::Error {
        match &self.file {
            Some(file) => anyhow::anyhow!("invalid config file {}: {error}", file.display()),
            None => anyhow::anyhow!("{error}"),
        }
    }

    /// The declared tools as the policy sees them: each one's definition, worker group,
    /// and whether its calls need approval.
    pub fn tool_extensions(&self) -> anyhow::Result<Vec<ToolExtension>> {
        extensions_of(&self.declared, self.config.sandbox.network)
            .map_err(|e| self.declared_error(e))
    }

    pub fn workspaces_root(&self) -> PathBuf {
        self.workspaces_root.clone()
    }

    pub fn socket_path(&self, group: &str) -> PathBuf {
        self.data_dir.join("sockets").join(format!("{group}.sock"))
    }

    /// The orchestrator's view; with no `[[workers]]`, the local Unix sockets of
    /// `airlock up`.
    /// A path from the config file, relative to the file's directory.
    pub fn relative(&self, path: &Path) -> PathBuf {
        match (path.is_absolute(), self.config_dir()) {
            (false, Some(dir)) => dir.join(path),
            _ => path.to_path_buf(),
        }
    }

    pub fn policy_file(&self) -> Option<PathBuf> {
        self.config.policy.file.as_deref().map(|p| self.relative(p))
    }

    fn store_password(&self) -> anyhow::Result<Option<String>> {
        let section = &self.config.orchestrator;
        if let Some(var) = &section.store_password_env {
            let value = std::env::var(var).with_context(|| {
                format!("[orchestrator] store_password_env names {var}, which is not set")
            })?;
            return Ok(Some(value));
        }
        if let Some(file) = &section.store_password_file {
            let file = self.relative(file);
            let value = std::fs::read_to_string(&file).with_context(|| {
                format!(
                    "cannot read [orchestrator] store_password_file {}",
                    file.display()
                )
            })?;
            return Ok(Some(value.trim_end_matches(['\n', '\r']).to_owned()));
        }
        Ok(None)
    }

    pub fn orchestrator(&self) -> anyhow::Result<OrchestratorConfig> {
        // Without a built-in group in [[workers]] (none at all, or only external workers
        // such as a team's own in Python), the built-in groups are the local sockets of
        // `airlock up`, and the listed groups join them.
        let names_built_in = self
            .config
            .workers
            .iter()
            .any(|w| LOCAL_GROUPS.contains(&w.group.as_str()));
        let mut workers: Vec<WorkerGroupConfig> = if names_built_in {
            Vec::new()
        } else {
            LOCAL_GROUPS
                .iter()
                .map(|g| WorkerGroupConfig {
                    group: (*g).to_owned(),
                    endpoints: vec![format!("unix:{}", self.socket_path(g).display())],
                    server_name: None,
                })
                .collect()
        };
        workers.extend(self.config.workers.iter().cloned());
        let worker_tls = self.worker_tls()?;
        Ok(OrchestratorConfig {
            http_listen: self.config.orchestrator.http_listen.clone(),
            grpc_listen: self.config.orchestrator.grpc_listen.clone(),
            data_dir: self.data_dir.clone(),
            workspaces_root: Some(self.workspaces_root()),
            store: self.config.orchestrator.store.clone(),
            store_password: self.store_password()?,
            workers,
            principals: self.config.principals.clone(),
            limits: self.config.limits.clone(),
            policy_file: self.policy_file(),
            approvals: self.config.approvals.clone(),
            budgets: self.config.budgets.clone(),
            audit: self.config.audit.clone(),
            cache: self.config.cache.clone(),
            agent: self.config.agent.clone(),
            grpc_tls: worker_tls
                .mtls
                .clone()
                .filter(|_| self.config.orchestrator.grpc_tls),
            worker_tls,
            dispatch: self.config.dispatch.clone(),
            retention: self.config.store.clone(),
            tool_extensions: self.tool_extensions()?,
            shell_network: self.config.sandbox.network.as_str().to_owned(),
            mcp_servers: self
                .config
                .mcp_servers
                .iter()
                .map(airlock_worker::mcp::McpServerEntry::policy)
                .collect(),
        })
    }

    /// `[tls]` for dialing workers: the files loaded and checked now (before the
    /// orchestrator confines itself), or the lab switch, or nothing (Unix sockets only).
    /// With `[orchestrator] grpc_tls`, the same identity serves the gRPC front door, so
    /// cert_file and key_file are required.
    pub fn worker_tls(&self) -> anyhow::Result<airlock_orchestrator::WorkerTls> {
        let tls = &self.config.tls;
        if self.config.orchestrator.grpc_tls {
            for (key, value) in [("cert_file", &tls.cert_file), ("key_file", &tls.key_file)] {
                if value.is_none() {
                    bail!(
                        "[orchestrator] grpc_tls = true needs [tls] {key}: the gRPC front door serves the certificate in [tls] cert_file with the key in key_file (airlock certs init writes a development set); refusing to start"
                    );
                }
            }
        }
        let mtls = if tls.has_files() {
            let identity = airlock_tls::mtls::Reloading::new(tls, &[])
                .context("the orchestrator cannot use [tls]; refusing to start")?;
            Some(identity)
        } else {
            None
        };
        if tls.insecure_plaintext {
            tracing::warn!(
                "[tls] insecure_plaintext = true: http:// and dns:/// worker endpoints are dialed in plaintext"
            );
        }
        Ok(airlock_orchestrator::WorkerTls {
            mtls,
            insecure_plaintext: tls.insecure_plaintext,
        })
    }

    /// `[sandbox] workspace_bytes` and `workspace_inodes`; `None` when both are 0.
    pub fn workspace_quota(&self) -> Option<WorkspaceQuota> {
        let sandbox = &self.config.sandbox;
        (sandbox.workspace_bytes != 0).then_some(WorkspaceQuota {
            bytes: sandbox.workspace_bytes,
            inodes: sandbox.workspace_inodes,
        })
    }

    /// Where the workspace volumes' images are kept: in the data dir, beside (not in)
    /// the workspaces, so no workspace can reach its own image.
    pub fn volumes_dir(&self) -> PathBuf {
        self.data_dir.join("volumes")
    }

    pub fn shell(&self) -> ShellConfig {
        let mut shell = self.config.sandbox.clone();
        shell.workspaces_root = self.workspaces_root();
        shell
    }

    /// The directory of the config file, which confined components may still read.
    pub fn config_dir(&self) -> Option<PathBuf> {
        self.file
            .as_ref()
            .and_then(|f| f.parent().map(Path::to_path_buf))
    }

    /// `[[databases]]` with relative paths resolved; the demo database when none.
    pub fn databases(&self) -> Vec<DatabaseConfig> {
        if self.config.databases.is_empty() {
            let path = self.demo_database_path();
            let mut demo = DatabaseConfig::new("demo", format!("sqlite://{}", path.display()));
            // Writable, so execute_sql (behind an approval) can be tried out.
            demo.read_only = false;
            return vec![demo];
        }
        let base = self.config_dir().unwrap_or_else(|| PathBuf::from("."));
        self.config
            .databases
            .iter()
            .cloned()
            .map(|mut db| {
                db.resolve_relative(&base);
                db
            })
            .collect()
    }

    pub fn demo_database_path(&self) -> PathBuf {
        self.data_dir.join("demo").join("demo.db")
    }

    pub fn fs(&self) -> FsConfig {
        let mut fs = self.config.fs.clone();
        fs.workspaces_root = self.workspaces_root();
        fs
    }
}

/// Bounds of `[dispatch] resolve_interval_ms` and `[worker] drain_seconds`.
const MIN_RESOLVE_INTERVAL_MS: u64 = 100;
const MAX_DRAIN_SECONDS: u64 = 3600;
/// The most `[orchestrator] async_threads` that is taken as meant.
const MAX_ASYNC_THREADS: usize = 256;

/// Refuses a resolve interval that would hammer the resolver and a drain that would
/// outlast any orchestrator's patience, at load time.
fn check_dispatch(config: &AirlockConfig) -> anyhow::Result<()> {
    let interval = config.dispatch.resolve_interval_ms;
    if interval < MIN_RESOLVE_INTERVAL_MS {
        bail!(
            "[dispatch] resolve_interval_ms = {interval} is below {MIN_RESOLVE_INTERVAL_MS}; \
             raise it (the default is 5000)"
        );
    }
    let drain = config.worker.drain_seconds;
    if drain > MAX_DRAIN_SECONDS {
        bail!(
            "[worker] drain_seconds = {drain} is above {MAX_DRAIN_SECONDS}; lower it (the \
             default is 30)"
        );
    }
    Ok(())
}

/// The longest `[agent] max_seconds` and `tool_wait_seconds`: a day. A run's deadline is
/// computed from them, and a value near `u64::MAX` would overflow it.
const MAX_AGENT_SECONDS: u64 = 86_400;

/// Refuses `[agent]` limits that no run could work with, at load time rather than at
/// each run.
fn check_agent(config: &AirlockConfig) -> anyhow::Result<()> {
    let agent = &config.agent;
    for (key, value) in [
        ("max_turns", u64::from(agent.max_turns)),
        ("max_tokens", u64::from(agent.max_tokens)),
        (
            "max_runs_per_principal",
            u64::from(agent.max_runs_per_principal),
        ),
        ("max_seconds", agent.max_seconds),
        ("tool_wait_seconds", agent.tool_wait_seconds),
    ] {
        if value == 0 {
            bail!("[agent] {key} = 0 leaves a run nothing to do; give a positive value");
        }
    }
    for (key, value) in [
        ("max_seconds", agent.max_seconds),
        ("tool_wait_seconds", agent.tool_wait_seconds),
    ] {
        if value > MAX_AGENT_SECONDS {
            bail!(
                "[agent] {key} = {value} is above {MAX_AGENT_SECONDS} (a day); lower it (the \
                 defaults are 600 and 300)"
            );
        }
    }
    Ok(())
}

/// Refuses an `[orchestrator] async_threads` of 0 (no thread to serve on) or of more
/// than [`MAX_ASYNC_THREADS`], at load time.
fn check_async_threads(config: &AirlockConfig) -> anyhow::Result<()> {
    if let Some(threads) = config.orchestrator.async_threads
        && !(1..=MAX_ASYNC_THREADS).contains(&threads)
    {
        bail!(
            "[orchestrator] async_threads = {threads} is not between 1 and \
             {MAX_ASYNC_THREADS}; give a number in that range, or leave it out for one per \
             CPU this process may use"
        );
    }
    Ok(())
}

/// How many threads run the orchestrator's front doors and gate: `[orchestrator]
/// async_threads`, else one per CPU this process may use (`cpus`: its affinity and its
/// cgroup's quota), tokio's default.
///
/// Fewer threads than CPUs trade throughput under concurrency for latency at low load:
/// the gate's work is short steps between waits (the store's writer, the worker's
/// answer), and an idle second async thread is woken to look for work at nearly every
/// step, a cross-CPU wake-up that on a virtual machine costs more than the step
/// (measured: docs/decisions.md, "The orchestrator's async threads").
pub fn async_threads(configured: Option<usize>, cpus: usize) -> usize {
    configured.unwrap_or(cpus).max(1)
}

/// The smallest workspace file system worth mounting: ext4 keeps a few MiB for its
/// journal and metadata.
const MIN_WORKSPACE_BYTES: u64 = 16 * 1024 * 1024;
const MIN_WORKSPACE_INODES: u64 = 64;

/// Refuses a quota that is half off (`0` for one of the two keys) or too small to hold a
/// file system, at load time.
/// `[sandbox.egress]` compiles (patterns, pinned hosts), and each declared tool's
/// `egress_allow` narrows it, so that a mistake stops every component at start.
fn check_egress(config: &AirlockConfig, entries: &[ToolEntry]) -> anyhow::Result<()> {
    let rules = config
        .sandbox
        .egress
        .check()
        .context("invalid [sandbox.egress]")?;
    for entry in entries {
        if let Some(allow) = &entry.egress_allow {
            rules
                .narrowed(allow)
                .with_context(|| format!("[[tools]] {}: invalid egress_allow", entry.name))?;
        }
    }
    Ok(())
}

fn check_workspace_quota(sandbox: &ShellConfig) -> anyhow::Result<()> {
    let (bytes, inodes) = (sandbox.workspace_bytes, sandbox.workspace_inodes);
    if (bytes == 0) != (inodes == 0) {
        bail!(
            "[sandbox] workspace_bytes = {bytes} and workspace_inodes = {inodes}: set both to \
             0 (no per-workspace quota) or both above 0; a file system always has both limits"
        );
    }
    if bytes != 0 && bytes < MIN_WORKSPACE_BYTES {
        bail!(
            "[sandbox] workspace_bytes = {bytes} is below the {MIN_WORKSPACE_BYTES} bytes \
             (16 MiB) a workspace file system needs; raise it (the default is 1073741824, 1 GiB)"
        );
    }
    if inodes != 0 && inodes < MIN_WORKSPACE_INODES {
        bail!(
            "[sandbox] workspace_inodes = {inodes} is below {MIN_WORKSPACE_INODES}; raise it \
             (the default is 100000)"
        );
    }
    Ok(())
}

/// The smallest `[limits] worker_memory_bytes` a worker starts with: its runtime, thread
/// stacks and buffers take tens of MiB before the first call.
const MIN_WORKER_MEMORY: u64 = 64 * 1024 * 1024;

/// Refuses a worker memory ceiling under which no worker could run, at load time, so
/// `airlock up` says what to change instead of restarting workers that die at start.
fn check_worker_memory(bytes: u64) -> anyhow::Result<()> {
    if bytes != 0 && bytes < MIN_WORKER_MEMORY {
        anyhow::bail!(
            "[limits] worker_memory_bytes = {bytes} is below the {MIN_WORKER_MEMORY} bytes \
             (64 MiB) a worker needs to start; raise it (the default is 1073741824, 1 GiB), \
             or set 0 for no ceiling"
        );
    }
    Ok(())
}

fn default_data_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("AIRLOCK_DATA_DIR").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .context("neither --data-dir, AIRLOCK_DATA_DIR nor HOME is set; pass --data-dir")?;
    Ok(PathBuf::from(home).join(".airlock"))
}

/// `path` with symlinks resolved: its longest existing ancestor canonicalised, the
/// components that do not exist yet (created later as plain directories) appended.
fn canonical_prefix(path: &Path) -> anyhow::Result<PathBuf> {
    let mut missing = Vec::new();
    let mut existing = path;
    loop {
        match std::fs::canonicalize(existing) {
            Ok(canonical) => {
                return Ok(missing
                    .iter()
                    .rev()
                    .fold(canonical, |dir, name| dir.join(name)));
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                match (existing.parent(), existing.file_name()) {
                    (Some(parent), Some(name)) => {
                        missing.push(name.to_owned());
                        existing = parent;
                    }
                    _ => anyhow::bail!("cannot resolve {}: {error}", path.display()),
                }
            }
            Err(error) => {
                return Err(error)
                    .with_context(|| format!("cannot resolve {}", existing.display()));
            }
        }
    }
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    if path.is_absolute() {
        return Ok(path.to_path_buf());
    }
    Ok(std::env::current_dir()
        .context("cannot read the current directory")?
        .join(path))
}

/// `tool_packs` then `[[tools]]`, every entry checked now so that a bad one stops every
/// component at start, naming the file, the tool and the reason.
fn declared_entries(config: &AirlockConfig) -> anyhow::Result<Vec<ToolEntry>> {
    let mut entries = airlock_worker_shell::declared::pack_entries(&config.tool_packs)?;
    entries.extend(config.tools.iter().cloned());
    airlock_worker::declared::check_unique(&entries)?;
    airlock_worker::mcp::check_entries(&config.mcp_servers)?;
    airlock_worker_http::mcp::compile_all(&config.mcp_servers)?;
    for entry in &entries {
        if let Some(server) = config
            .mcp_servers
            .iter()
            .find(|server| server.policy().owns(&entry.name))
        {
            anyhow::bail!(
                "[[tools]] {}: the name is in the namespace of the MCP server {} ({}__…); rename the tool",
                entry.name,
                server.name,
                server.name
            );
        }
    }
    compile_commands(&entries)?;
    compile_http(&entries)?;
    check_egress(config, &entries)?;
    airlock_policy::authz::ToolExtensions::new(&extensions_of(&entries, config.sandbox.network)?)?;
    Ok(entries)
}

/// The declared tools as policies see them. A command tool's `context.network` is the
/// network its sandbox will have: the worker's when that is the host's; the proxy when
/// the tool asks for it and the worker's sandboxes have one; otherwise none.
fn extensions_of(
    entries: &[ToolEntry],
    shell_network: Network,
) -> Result<Vec<ToolExtension>, airlock_worker::declared::DeclaredToolError> {
    entries
        .iter()
        .map(|entry| {
            let network = entry.is_command().then(|| {
                match (shell_network, entry.network) {
                    (Network::Host, _) => "host",
                    (Network::Proxy, ToolNetwork::Proxy) => "proxy",
                    _ => "none",
                }
                .to_owned()
            });
            Ok(ToolExtension {
                group: entry.group().to_owned(),
                definition: entry.definition()?,
                approval: entry.approval_reason(),
                network,
            })
        })
        .collect()
}

fn compile_commands(
    entries: &[ToolEntry],
) -> Result<Vec<CommandTemplate>, airlock_worker::declared::DeclaredToolError> {
    entries
        .iter()
        .filter(|entry| entry.is_command())
        .map(CommandTemplate::compile)
        .collect()
}

fn compile_http(
    entries: &[ToolEntry],
) -> Result<Vec<HttpTemplate>, airlock_worker::declared::DeclaredToolError> {
    entries
        .iter()
        .filter(|entry| entry.is_http())
        .map(HttpTemplate::compile)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_working_defaults() {
        let config: AirlockConfig = toml::from_str("").unwrap();
        assert_eq!(config.orchestrator.http_listen, "127.0.0.1:7070");
        assert_eq!(config.limits.max_request_bytes, 10 * 1024 * 1024);
        assert_eq!(config.fs.max_read_bytes, 262_144);
    }

    #[test]
    fn worker_memory_has_a_default_and_a_floor() {
        let config: AirlockConfig = toml::from_str("").unwrap();
        assert_eq!(config.limits.worker_memory_bytes, 1 << 30);
        let config: AirlockConfig =
            toml::from_str("[limits]\nworker_memory_bytes = 536870912\n").unwrap();
        assert_eq!(config.limits.worker_memory_bytes, 512 << 20);
        assert!(check_worker_memory(0).is_ok());
        assert!(check_worker_memory(MIN_WORKER_MEMORY).is_ok());
        let err = check_worker_memory(1_000_000).unwrap_err().to_string();
        assert!(
            err.contains("worker_memory_bytes = 1000000") && err.contains("raise it"),
            "{err}"
        );
    }

    #[test]
    fn async_threads_default_to_one_per_cpu_and_are_bounded() {
        assert_eq!(async_threads(None, 1), 1);
        assert_eq!(async_threads(None, 2), 2);
        assert_eq!(async_threads(None, 0), 1);
        assert_eq!(async_threads(Some(1), 8), 1);
        assert_eq!(async_threads(Some(3), 2), 3);
        let config: AirlockConfig = toml::from_str("").unwrap();
        assert_eq!(config.orchestrator.async_threads, None);
        assert!(check_async_threads(&config).is_ok());
        for (value, ok) in [(1, true), (256, true), (0, false), (257, false)] {
            let config: AirlockConfig =
                toml::from_str(&format!("[orchestrator]\nasync_threads = {value}\n")).unwrap();
            assert_eq!(config.orchestrator.async_threads, Some(value));
            match check_async_threads(&config) {
                Ok(()) => assert!(ok, "{value} was taken"),
                Err(e) => {
                    assert!(!ok, "{value} was refused: {e}");
                    let e = e.to_string();
                    assert!(
                        e.contains(&format!("async_threads = {value}"))
                            && e.contains("between 1 and 256"),
                        "{e}"
                    );
                }
            }
        }
    }

    /// A bad http entry stops every component at load, naming the file, the tool and
    /// the reason; its secrets are not read there (only the http worker reads them).
    #[test]
    fn a_bad_http_tool_fails_the_load_and_secrets_are_not_read_there() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("airlock.toml");
        let entry = |url: &str| {
            format!(
                "[[tools]]\nname = \"crm\"\ndescription = \"d\"\n\
                 input_schema = {{ type = \"object\", properties = {{ id = {{ type = \"string\" }} }}, required = [\"id\"] }}\n\
                 http = {{ method = \"GET\", url = \"{url}\", headers = {{ Authorization = \"${{env:AIRLOCK_UNIT_UNSET}}\" }} }}\n"
            )
        };
        std::fs::write(&file, entry("http://{id}.example.com/")).unwrap();
        let err = Loaded::load(Some(&file), Some(dir.path()))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.starts_with(&format!(
                "invalid config file {}: [[tools]] crm: http.url:",
                file.display()
            )) && err.contains("cannot choose the host"),
            "{err}"
        );
        std::fs::write(&file, entry("https://crm.example.com/users/{id}")).unwrap();
        let loaded = Loaded::load(Some(&file), Some(dir.path())).unwrap();
        let tools = loaded.http_tools().unwrap();
        assert_eq!(tools.len(), 1);
        assert_eq!(tools[0].env_names(), vec!["AIRLOCK_UNIT_UNSET".to_owned()]);
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err =
            toml::from_str::<AirlockConfig>("[orchestrator]\nhttp_lisen = \"x\"\n").unwrap_err();
        assert!(err.to_string().contains("http_lisen"), "{err}");
    }

    #[test]
    fn principals_and_workers_parse() {
        let text = r#"
            [[workers]]
            group = "fs"
            endpoints = ["dns:///fs.airlock.svc:50051"]
            [[principals]]
            name = "ci"
            token_env = "CI_TOKEN"
            roles = ["agent"]
        "#;
        let config: AirlockConfig = toml::from_str(text).unwrap();
        assert_eq!(config.workers[0].group, "fs");
        assert_eq!(config.principals[0].token_env.as_deref(), Some("CI_TOKEN"));
    }

    #[test]
    fn agent_section_parses_and_is_checked() {
        let config: AirlockConfig = toml::from_str("").unwrap();
        assert_eq!(config.agent.max_turns, 20);
        assert_eq!(config.agent.max_tool_calls, 100);
        assert_eq!(config.agent.max_seconds, 600);
        assert_eq!(config.agent.max_tokens, 4096);
        assert!(config.agent.stream);
        let text = r#"
            [agent]
            provider = "openai"
            model = "llama3.1"
            base_url = "http://127.0.0.1:11434/v1"
            api_key_env = ""
            stream = false
            max_turns = 5
        "#;
        let config: AirlockConfig = toml::from_str(text).unwrap();
        assert_eq!(
            config.agent.provider,
            airlock_orchestrator::ProviderKind::OpenAi
        );
        assert_eq!(config.agent.max_turns, 5);
        assert!(toml::from_str::<AirlockConfig>("[agent]\nprovider = \"gemini\"\n").is_err());
        assert!(toml::from_str::<AirlockConfig>("[agent]\napi_key = \"sk-x\"\n").is_err());
        assert!(check_agent(&config).is_ok());
        for (line, named) in [
            (
                "max_seconds = 18446744073709551615",
                "max_seconds = 18446744073709551615",
            ),
            ("max_seconds = 86401", "above 86400"),
            ("tool_wait_seconds = 100000", "tool_wait_seconds"),
            ("max_seconds = 0", "max_seconds = 0"),
            ("max_turns = 0", "max_turns = 0"),
            ("tool_wait_seconds = 0", "tool_wait_seconds = 0"),
        ] {
            let config: AirlockConfig = toml::from_str(&format!("[agent]\n{line}\n")).unwrap();
            let e = check_agent(&config).expect_err(line).to_string();
            assert!(e.contains(named), "{line}: {e}");
        }
        let config: AirlockConfig = toml::from_str("[agent]\nmax_seconds = 86400\n").unwrap();
        assert!(check_agent(&config).is_ok());
    }
}
