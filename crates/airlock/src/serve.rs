//! `airlock serve orchestrator|worker <group>`: one component in the foreground.
//!
//! Every component starts the same way: bind its sockets and open what it needs from
//! outside its own directories, take its memory ceiling (the fs, http and db workers),
//! confine itself (no_new_privs, Landlock, capabilities, a seccomp filter without exec
//! for all but the shell worker) while the process still has one thread, and only then
//! start the async runtime and serve.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use airlock_metrics::MetricsListener;

use airlock_orchestrator::{BoundListeners, Orchestrator, Reload};
use airlock_sandbox::{SelfConfinement, confine_self};
use airlock_worker::volumes::{BROKER_SOCKET, VolumeClient};
use airlock_worker::{
    BoundListener, ListenAddr, ToolSet, WorkerMetrics, WorkerServer, WorkerSettings,
};
use anyhow::Context;

use crate::Location;
use crate::config::Loaded;
use crate::listen_fds;
use crate::signals;

#[derive(Debug, clap::Subcommand)]
pub enum Component {
    /// The orchestrator: front doors and the gate.
    Orchestrator {
        /// Overrides [orchestrator] http_listen.
        #[arg(long, env = "AIRLOCK_HTTP_LISTEN")]
        http_listen: Option<String>,
        /// Overrides [orchestrator] grpc_listen.
        #[arg(long, env = "AIRLOCK_GRPC_LISTEN")]
        grpc_listen: Option<String>,
    },
    /// A tool worker.
    Worker {
        #[command(subcommand)]
        group: WorkerGroup,
    },
}

#[derive(Debug, clap::Subcommand)]
pub enum WorkerGroup {
    /// File tools confined to the workspace.
    Fs {
        /// Listen address: unix:/path.sock or host:port (default: <data_dir>/sockets/fs.sock).
        #[arg(long, env = "AIRLOCK_LISTEN")]
        listen: Option<String>,
        /// Serve Prometheus metrics on host:port (overrides [metrics] listen).
        #[arg(long, env = "AIRLOCK_METRICS_LISTEN")]
        metrics_listen: Option<String>,
    },
    /// execute_shell, one sandbox per call.
    Shell {
        /// Listen address: unix:/path.sock or host:port (default: <data_dir>/sockets/shell.sock).
        #[arg(long, env = "AIRLOCK_LISTEN")]
        listen: Option<String>,
        /// Serve Prometheus metrics on host:port (overrides [metrics] listen).
        #[arg(long, env = "AIRLOCK_METRICS_LISTEN")]
        metrics_listen: Option<String>,
    },
    /// http_request and fetch_url under the egress policy.
    Http {
        /// Listen address: unix:/path.sock or host:port (default: <data_dir>/sockets/http.sock).
        #[arg(long, env = "AIRLOCK_LISTEN")]
        listen: Option<String>,
        /// Serve Prometheus metrics on host:port (overrides [metrics] listen).
        #[arg(long, env = "AIRLOCK_METRICS_LISTEN")]
        metrics_listen: Option<String>,
    },
    /// Database tools over SQLite and PostgreSQL.
    Db {
        /// Listen address: unix:/path.sock or host:port (default: <data_dir>/sockets/db.sock).
        #[arg(long, env = "AIRLOCK_LISTEN")]
        listen: Option<String>,
        /// Serve Prometheus metrics on host:port (overrides [metrics] listen).
        #[arg(long, env = "AIRLOCK_METRICS_LISTEN")]
        metrics_listen: Option<String>,
    },
}

/// The service a command runs as, for its traces: only the components export any.
pub fn service(command: &crate::Command) -> Option<airlock_telemetry::Service> {
    use airlock_telemetry::Service;
    let crate::Command::Serve { component, .. } = command else {
        return None;
    };
    Some(match component {
        Component::Orchestrator { .. } => Service::Orchestrator,
        Component::Worker { group } => Service::Worker(
            match group {
                WorkerGroup::Fs { .. } => "fs",
                WorkerGroup::Shell { .. } => "shell",
                WorkerGroup::Http { .. } => "http",
                WorkerGroup::Db { .. } => "db",
            }
            .to_owned(),
        ),
    })
}

/// Starts exporting traces (when `OTEL_*` ask for it) and runs `serve`, then exports
/// the spans still waiting. Called once the component is confined, inside its runtime:
/// the exporter's thread and connections are the confined process's.
async fn traced<T>(serve: impl Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    airlock_telemetry::start().context("cannot export traces; refusing to start")?;
    let served = serve.await;
    airlock_telemetry::shutdown().await;
    served
}

pub fn run(component: Component, location: &Location) -> anyhow::Result<ExitCode> {
    signals::follow_launcher()?;
    let loaded = Loaded::load(location.config.as_deref(), location.data_dir.as_deref())?;
    match component {
        Component::Orchestrator {
            http_listen,
            grpc_listen,
        } => {
            let mut loaded = loaded;
            if let Some(addr) = http_listen {
                loaded.config.orchestrator.http_listen = addr;
            }
            if let Some(addr) = grpc_listen {
                loaded.config.orchestrator.grpc_listen = addr;
            }
            orchestrator(&loaded)
        }
        Component::Worker {
            group:
                WorkerGroup::Fs {
                    listen,
                    metrics_listen,
                },
        } => fs_worker(&loaded, Listen::new(&loaded, listen, metrics_listen)?),
        Component::Worker {
            group:
                WorkerGroup::Shell {
                    listen,
                    metrics_listen,
                },
        } => shell_worker(&loaded, Listen::new(&loaded, listen, metrics_listen)?),
        Component::Worker {
            group:
                WorkerGroup::Http {
                    listen,
                    metrics_listen,
                },
        } => http_worker(&loaded, Listen::new(&loaded, listen, metrics_listen)?),
        Component::Worker {
            group:
                WorkerGroup::Db {
                    listen,
                    metrics_listen,
                },
        } => db_worker(&loaded, Listen::new(&loaded, listen, metrics_listen)?),
    }
}

/// The CPUs this process may use: its affinity and its cgroup's CPU quota (a pod's CPU
/// limit). Read before the process confines itself: the quota is read from /proc and
/// /sys, which confinement takes out of reach. (A runtime built with tokio's default,
/// after confinement, counted the host's CPUs under any quota.)
fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// A runtime with `threads` async threads, for the components whose async side does
/// real work: the orchestrator (front doors, authentication, schema validation, policy,
/// answers; `[orchestrator] async_threads`, [`crate::config::async_threads`]) and the
/// http worker (TLS, converting pages; one per CPU). Logs what it got.
fn multi_thread_runtime(
    component: &'static str,
    threads: usize,
    cpus: usize,
) -> anyhow::Result<tokio::runtime::Runtime> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    tracing::info!(
        component,
        async_threads = runtime.metrics().num_workers(),
        cpus,
        "async runtime started"
    );
    Ok(runtime)
}

/// The name of the blocking pool's threads in a worker on [`one_thread_runtime`] (what
/// `ps -L` and `/proc/<pid>/task/*/comm` show: the kernel keeps 15 bytes of it).
const BLOCKING_THREAD_NAME: &str = "airlock-pool";

/// The runtime of a worker whose tools do their work on the blocking pool (the fs
/// worker's file system calls, the shell worker's sandboxes, the db worker's SQLite):
/// its async side only moves requests and answers, and runs on the process's main
/// thread. With an async thread per CPU, every call woke a second one (a spawned task
/// is offered to an idle sibling), and switching between them was a large share of the
/// worker's CPU (docs/decisions.md, "A worker drives its calls on one thread").
fn one_thread_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_name(BLOCKING_THREAD_NAME)
        .build()
        .context("cannot start the async runtime")
}

/// Which of the two `RLIMIT_DATA` values a worker's memory ceiling sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ceiling {
    /// Soft and hard: the worker cannot raise it again.
    Fixed,
    /// The soft limit only (the shell worker): its sandboxes inherit its rlimits and
    /// raise the soft limit back to the hard one before their command runs, since each
    /// sandbox's cgroup bounds its memory; a hard limit here would cap every command
    /// below its own `[sandbox] memory_bytes`.
    SoftOnly,
}

/// Puts this worker under `[limits] worker_memory_bytes` (DESIGN §16) with `RLIMIT_DATA`.
///
/// `RLIMIT_DATA` (private writable mappings, Linux 4.7 and later) rather than
/// `RLIMIT_AS`: the address-space limit also counts what is only reserved — glibc's
/// 64 MiB malloc arenas per thread, the PROT_NONE guard regions — so a healthy
/// multi-threaded worker can hit it without using the memory. A cgroup would need a
/// delegated subtree per worker that `airlock up` does not have. An allocation past the
/// ceiling fails (SQLite answers it as an error; Rust aborts the worker, which the
/// launcher restarts): it is the backstop behind the result caps, under which a call
/// fails before it allocates.
///
/// Never above a hard limit that is already lower: raising it needs a privilege the
/// worker may not have, and the stricter ceiling wins anyway.
fn limit_memory(component: &str, loaded: &Loaded, ceiling_kind: Ceiling) -> anyhow::Result<()> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let wanted = loaded.config.limits.worker_memory_bytes;
    if wanted == 0 {
        tracing::info!(
            component,
            "no memory ceiling: [limits] worker_memory_bytes = 0"
        );
        return Ok(());
    }
    let hard = getrlimit(Resource::Data).maximum;
    let ceiling = hard.map_or(wanted, |hard| hard.min(wanted));
    let maximum = match ceiling_kind {
        Ceiling::Fixed => Some(ceiling),
        Ceiling::SoftOnly => hard,
    };
    setrlimit(
        Resource::Data,
        Rlimit {
            current: Some(ceiling),
            maximum,
        },
    )
    .with_context(|| {
        format!("the {component} cannot set its memory ceiling (RLIMIT_DATA to {ceiling} bytes)")
    })?;
    tracing::info!(
        component,
        bytes = ceiling,
        soft_only = ceiling_kind == Ceiling::SoftOnly,
        "memory ceiling set (RLIMIT_DATA)"
    );
    Ok(())
}

/// The launcher's workspace volume broker, when `[sandbox] workspace_bytes` is on. A
/// worker that cannot reach it refuses to start: its workspaces would have no quota.
fn workspace_volumes(loaded: &Loaded, component: &str) -> anyhow::Result<Option<VolumeClient>> {
    let Some(quota) = loaded.workspace_quota() else {
        tracing::warn!(
            component,
            "no per-workspace quota: [sandbox] workspace_bytes = 0 and workspace_inodes = 0"
        );
        return Ok(None);
    };
    let client = VolumeClient::new(loaded.data_dir.join(BROKER_SOCKET), quota);
    client.ping().with_context(|| {
        format!("the {component} cannot give workspaces their quota; refusing to start")
    })?;
    Ok(Some(client))
}

/// Confines this process; refuses to go on (fail closed) when it cannot.
fn confine(component: &str, spec: SelfConfinement) -> anyhow::Result<()> {
    let report = confine_self(&spec)
        .with_context(|| format!("the {component} cannot confine itself; refusing to start"))?;
    tracing::info!(
        component,
        landlock_abi = report.landlock_abi,
        landlock_filesystem = report.landlock_filesystem,
        bounding_set_dropped = report.bounding_set_dropped,
        exec_allowed = report.exec_allowed,
        kept = ?report.capabilities_kept,
        "confined: {report}"
    );
    Ok(())
}

fn orchestrator(loaded: &Loaded) -> anyhow::Result<ExitCode> {
    // Before any thread allocates: a result of a megabyte, which the orchestrator may
    // keep for a while among small blocks, is mapped and given back when freed, never
    // left resident in a heap (crates/sandbox/src/heap.rs).
    airlock_sandbox::heap::map_large_buffers()
        .context("cannot set how the allocator serves large buffers")?;
    let mut config = loaded.orchestrator()?;
    fit_descriptors(&mut config.limits);
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("cannot create data dir {}", config.data_dir.display()))?;
    // Under `airlock up`, the launcher's listeners; started alone, its own.
    let listeners = match listen_fds::inherited(&config.http_listen, &config.grpc_listen)? {
        Some(inherited) => inherited,
        None => BoundListeners::bind(&config)?,
    };
    let prepared = Orchestrator::prepare(&config)?;
    let cpus = cpus();
    let threads = crate::config::async_threads(loaded.config.orchestrator.async_threads, cpus);
    confine(
        "orchestrator",
        SelfConfinement {
            // The config's and the policy's directories stay readable for SIGHUP reloads.
            read_paths: loaded
                .config_dir()
                .into_iter()
                .chain(
                    config
                        .policy_file
                        .as_ref()
                        .and_then(|p| p.parent().map(PathBuf::from)),
                )
                // Rotated certificates are re-read.
                .chain(tls_dirs(loaded))
                // The store's CA (`sslrootcert`) is read when it connects.
                .chain(root_cert_dirs([config.store.as_str()]))
                .collect(),
            write_paths: vec![config.data_dir.clone()],
            allow_exec: false,
            allow_namespaces: false,
        },
    )?;
    multi_thread_runtime("orchestrator", threads, cpus)?.block_on(traced(async {
        let reload = config_reloads(loaded);
        Ok(Orchestrator::serve(config, prepared, listeners, signals::shutdown(), reload).await?)
    }))?;
    Ok(ExitCode::SUCCESS)
}

/// Descriptors the orchestrator keeps for itself besides front-door connections: the
/// store, worker channels, log, listeners, and calls in flight.
const RESERVED_DESCRIPTORS: u64 = 256;

/// Raises the soft `NOFILE` limit to the hard one (the default soft limit, often 1024,
/// is what an anonymous flood of connections would exhaust), then lowers `[limits]
/// max_connections` if both front doors at their cap would still not fit.
fn fit_descriptors(limits: &mut airlock_policy::Limits) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut nofile = getrlimit(Resource::Nofile);
    // An unlimited hard limit is refused for NOFILE; the kernel's usual ceiling is asked for.
    let wanted = nofile.maximum.unwrap_or(1 << 20);
    if nofile.current.is_some_and(|soft| soft < wanted) {
        let raised = rustix::process::Rlimit {
            current: Some(wanted),
            maximum: nofile.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => nofile = getrlimit(Resource::Nofile),
            Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit"),
        }
    }
    let Some(soft) = nofile.current else { return };
    let per_door = usize::try_from(soft.saturating_sub(RESERVED_DESCRIPTORS) / 2)
        .unwrap_or(usize::MAX)
        .max(1);
    if limits.max_connections > per_door {
        tracing::warn!(
            configured = limits.max_connections,
            used = per_door,
            open_file_limit = soft,
            "[limits] max_connections does not fit the open-file limit for both front doors; using less"
        );
        limits.max_connections = per_door;
    }
}

/// One [`Reload`] per SIGHUP, with the `[[principals]]` of the config file as it reads
/// then (its directory stays readable after confinement for this).
fn config_reloads(loaded: &Loaded) -> tokio::sync::mpsc::Receiver<Reload> {
    let (file, data_dir) = (loaded.file.clone(), loaded.data_dir.clone());
    let mut hangups = signals::reloads();
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            let principals = Loaded::load(file.as_deref(), Some(&data_dir))
                .map(|reloaded| reloaded.config.principals)
                .map_err(|e| format!("{e:#}"));
            if tx.send(Reload { principals }).await.is_err() {
                return;
            }
        }
    });
    rx
}

/// A worker's `--listen` and its metrics listener (`--metrics-listen`, else `[metrics]
/// listen`), bound here: before the worker confines itself, like its gRPC socket.
struct Listen {
    grpc: Option<String>,
    metrics: Option<MetricsListener>,
}

impl Listen {
    fn new(loaded: &Loaded, grpc: Option<String>, metrics: Option<String>) -> anyhow::Result<Self> {
        let metrics = metrics
            .or_else(|| loaded.config.metrics.listen.clone())
            .map(|addr| {
                let listener = MetricsListener::bind(&addr)?;
                tracing::info!(listen = ?listener.local_addr(), "metrics on /metrics");
                Ok::<_, anyhow::Error>(listener)
            })
            .transpose()?;
        Ok(Self { grpc, metrics })
    }
}

fn listen_addr(loaded: &Loaded, group: &str, listen: Option<String>) -> anyhow::Result<ListenAddr> {
    Ok(match listen {
        Some(a) => a.parse()?,
        None => ListenAddr::Unix(loaded.socket_path(group)),
    })
}

/// A worker on TCP serves mutual TLS (`[tls]`: only a peer with a certificate from
/// `ca_file` carrying one of `allowed_peers`, by default the orchestrator, reaches it),
/// or plaintext only with the explicit lab switch; without either it refuses to start.
/// The files are read here, before the worker confines itself.
fn secure(
    loaded: &Loaded,
    listener: BoundListener,
    component: &str,
) -> anyhow::Result<BoundListener> {
    if !listener.is_tcp() {
        return Ok(listener);
    }
    let tls = &loaded.config.tls;
    let listen = listener.local_addr();
    if tls.has_files() {
        let reloading = airlock_tls::mtls::Reloading::new(tls, &["orchestrator"])
            .with_context(|| format!("the {component} cannot use [tls]; refusing to start"))?;
        let allowed_peers = reloading.current().allowed_peers.clone();
        tracing::info!(component, %listen, ?allowed_peers, "mutual TLS on TCP");
        return Ok(listener.with_mutual_tls(reloading));
    }
    if tls.insecure_plaintext {
        tracing::warn!(component, %listen, "[tls] insecure_plaintext = true: plaintext gRPC on TCP, so anyone who reaches this port can run tools past the orchestrator's gate");
        return Ok(listener);
    }
    anyhow::bail!(
        "the {component} listens on TCP ({listen}) without [tls]: set [tls] cert_file, key_file and ca_file (airlock certs init writes a development set) so that only the orchestrator can call it, or [tls] insecure_plaintext = true for a lab; refusing to start"
    )
}

/// The directories of the `sslrootcert` files of PostgreSQL `urls`, readable after
/// confinement (connections are made, and the CA read, after it).
fn root_cert_dirs<'a>(urls: impl IntoIterator<Item = &'a str>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = urls
        .into_iter()
        .filter_map(airlock_tls::postgres::root_cert)
        .filter_map(|path| path.parent().map(PathBuf::from))
        .filter(|dir| !dir.as_os_str().is_empty())
        .collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

/// The directories of the `[tls]` files, readable after confinement so that rotated
/// certificates can be re-read.
fn tls_dirs(loaded: &Loaded) -> Vec<PathBuf> {
    let tls = &loaded.config.tls;
    let mut dirs: Vec<PathBuf> = [&tls.cert_file, &tls.key_file, &tls.ca_file]
        .into_iter()
        .flatten()
        .filter_map(|path| path.parent().map(PathBuf::from))
        .collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

fn serve_worker(
    loaded: &Loaded,
    listener: BoundListener,
    (tools, heap): (ToolSet, Heap),
    metrics: Option<MetricsListener>,
) -> anyhow::Result<ExitCode> {
    let registry = airlock_metrics::registry();
    serve_on(
        &one_thread_runtime()?,
        loaded,
        listener,
        (tools, heap),
        (registry, metrics),
    )
}

/// How a worker's heap holds its large buffers (crates/sandbox/src/heap.rs).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Heap {
    /// glibc's own way. The shell worker's: its pre-built sandboxes are forked from
    /// it, and each page it kept and then wrote again would be copied for them; the
    /// http worker's: its async threads allocate on several arenas at once.
    Default,
    /// Warm between calls, given back once the worker is idle: the fs and db workers,
    /// whose answers are large and whose async side is one thread.
    Warm,
}

/// Keeps this worker's large buffers warm between calls; before any thread allocates.
fn warm_heap(component: &str) -> anyhow::Result<Heap> {
    airlock_sandbox::heap::keep_large_buffers().with_context(|| {
        format!("the {component} cannot set how its allocator keeps large buffers")
    })?;
    Ok(Heap::Warm)
}

/// Serves a worker's tools, and its metrics when it has a metrics listener. The
/// metrics answer through the drain, until the process exits.
fn serve_on(
    runtime: &tokio::runtime::Runtime,
    loaded: &Loaded,
    listener: BoundListener,
    (tools, heap): (ToolSet, Heap),
    (mut registry, metrics): (airlock_metrics::Registry, Option<MetricsListener>),
) -> anyhow::Result<ExitCode> {
    let counted = WorkerMetrics::register(&mut registry);
    let mut server = WorkerServer::new(tools, worker_settings(loaded)).with_metrics(counted);
    if heap == Heap::Warm {
        server = server.with_idle_release(airlock_sandbox::heap::give_back_free_memory);
    }
    runtime.block_on(traced(async {
        if let Some(metrics) = metrics {
            let registry = Arc::new(registry);
            tokio::spawn(async move {
                if let Err(e) = metrics.serve(registry, std::future::pending()).await {
                    tracing::error!(error = %e, "the metrics listener stopped");
                }
            });
        }
        Ok(server.serve(listener, signals::shutdown()).await?)
    }))?;
    Ok(ExitCode::SUCCESS)
}

fn ensure_dir(path: &PathBuf) -> anyhow::Result<()> {
    std::fs::create_dir_all(path).with_context(|| format!("cannot create {}", path.display()))
}

fn fs_worker(loaded: &Loaded, listen: Listen) -> anyhow::Result<ExitCode> {
    let heap = warm_heap("fs worker")?;
    let mut fs = loaded.fs();
    ensure_dir(&fs.workspaces_root)?;
    fs.volumes = workspace_volumes(loaded, "fs worker")?;
    let listener = BoundListener::bind(&listen_addr(loaded, "fs", listen.grpc)?)?;
    let listener = secure(loaded, listener, "fs worker")?;
    tracing::info!(listen = %listener.local_addr(), root = %fs.workspaces_root.display(), "fs worker starting");
    limit_memory("fs worker", loaded, Ceiling::Fixed)?;
    confine(
        "fs worker",
        SelfConfinement {
            read_paths: tls_dirs(loaded),
            write_paths: vec![fs.workspaces_root.clone()],
            allow_exec: false,
            allow_namespaces: false,
        },
    )?;
    serve_worker(
        loaded,
        listener,
        (airlock_worker_fs::tools(fs), heap),
        listen.metrics,
    )
}

fn shell_worker(loaded: &Loaded, listen: Listen) -> anyhow::Result<ExitCode> {
    let mut shell = loaded.shell();
    let mut registry = airlock_metrics::registry();
    shell.metrics = airlock_worker_shell::SandboxMetrics::register(&mut registry);
    ensure_dir(&shell.workspaces_root)?;
    shell.volumes = workspace_volumes(loaded, "shell worker")?;
    let listener = BoundListener::bind(&listen_addr(loaded, "shell", listen.grpc)?)?;
    let listener = secure(loaded, listener, "shell worker")?;
    // Probing the host and creating the parent cgroups needs the privileges the
    // confinement below gives up, so the sandbox is prepared first.
    let (tools, sandbox) = airlock_worker_shell::tools(shell.clone(), loaded.command_tools()?)
        .context("the shell worker cannot provide the configured isolation; refusing to start")?;
    let report = serde_json::to_string(sandbox.report()).unwrap_or_default();
    tracing::info!(listen = %listener.local_addr(), isolation = %report, "shell worker starting");
    limit_memory("shell worker", loaded, Ceiling::SoftOnly)?;
    // The private workspaces of the MCP servers that are not per session.
    let mcp_dir = loaded.data_dir.join("mcp");
    let mut write_paths = vec![shell.workspaces_root.clone()];
    if loaded.config.mcp_servers.iter().any(|s| s.is_stdio()) {
        ensure_dir(&mcp_dir)?;
        write_paths.push(mcp_dir.clone());
    }
    confine(
        "shell worker",
        SelfConfinement {
            read_paths: tls_dirs(loaded),
            write_paths,
            allow_exec: true,
            allow_namespaces: true,
        },
    )?;
    let runtime = one_thread_runtime()?;
    // MCP servers start confined, in the sandbox, once the worker itself is.
    let mcp_tools = runtime
        .block_on(airlock_worker_shell::mcp::start(
            &loaded.config.mcp_servers,
            &shell,
            &sandbox,
            &mcp_dir,
        ))
        .context("the shell worker cannot serve its MCP servers; refusing to start")?;
    let tools = mcp_tools.into_iter().fold(tools, ToolSet::with);
    serve_on(
        &runtime,
        loaded,
        listener,
        (tools, Heap::Default),
        (registry, listen.metrics),
    )
}

fn http_worker(loaded: &Loaded, listen: Listen) -> anyhow::Result<ExitCode> {
    // Secrets are read here, before the confinement below takes file access away.
    let declared = loaded
        .http_tools()?
        .into_iter()
        .map(|template| template.resolve().map_err(|e| loaded.declared_error(e)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mcp = loaded
        .mcp_http_servers()?
        .into_iter()
        .map(|server| server.resolve().map_err(|e| loaded.declared_error(e)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // The [http] section is checked before anything binds.
    airlock_worker_http::tools(loaded.config.http.clone())
        .context("invalid [http] configuration")?;
    let listener = BoundListener::bind(&listen_addr(loaded, "http", listen.grpc)?)?;
    let listener = secure(loaded, listener, "http worker")?;
    tracing::info!(listen = %listener.local_addr(), "http worker starting");
    limit_memory("http worker", loaded, Ceiling::Fixed)?;
    let cpus = cpus();
    confine(
        "http worker",
        SelfConfinement {
            read_paths: tls_dirs(loaded),
            write_paths: Vec::new(),
            allow_exec: false,
            allow_namespaces: false,
        },
    )?;
    let runtime = multi_thread_runtime("http worker", cpus, cpus)?;
    // The Streamable HTTP MCP servers are asked for their tools once the worker is
    // confined, through its egress-checked client; one that cannot be reached (or that
    // [http] refuses) stops the start, naming it, as a stdio server that does not
    // start stops the shell worker's.
    let tools = runtime
        .block_on(airlock_worker_http::tools_with_mcp(
            loaded.config.http.clone(),
            declared,
            mcp,
        ))
        .context("the http worker cannot serve its MCP servers; refusing to start")?;
    serve_on(
        &runtime,
        loaded,
        listener,
        (tools, Heap::Default),
        (airlock_metrics::registry(), listen.metrics),
    )
}

fn db_worker(loaded: &Loaded, listen: Listen) -> anyhow::Result<ExitCode> {
    let heap = warm_heap("db worker")?;
    let databases = loaded.databases();
    if loaded.config.databases.is_empty() {
        crate::demo::ensure_demo_database(&loaded.demo_database_path())?;
    }
    // SQLite writes journal, WAL and shm files beside each database file.
    let write_paths: Vec<PathBuf> = airlock_worker_db::sqlite_paths(&databases)
        .iter()
        .filter_map(|p| p.parent().map(PathBuf::from))
        .collect();
    let tools =
        airlock_worker_db::tools(databases).context("invalid [[databases]] configuration")?;
    let listener = BoundListener::bind(&listen_addr(loaded, "db", listen.grpc)?)?;
    let listener = secure(loaded, listener, "db worker")?;
    tracing::info!(listen = %listener.local_addr(), "db worker starting");
    limit_memory("db worker", loaded, Ceiling::Fixed)?;
    let mut read_paths = tls_dirs(loaded);
    read_paths.extend(root_cert_dirs(
        loaded.config.databases.iter().map(|d| d.url.as_str()),
    ));
    confine(
        "db worker",
        SelfConfinement {
            read_paths,
            write_paths,
            allow_exec: false,
            allow_namespaces: false,
        },
    )?;
    serve_worker(loaded, listener, (tools, heap), listen.metrics)
}

fn worker_settings(loaded: &Loaded) -> WorkerSettings {
    let limits = &loaded.config.limits;
    WorkerSettings {
        default_timeout: std::time::Duration::from_millis(limits.default_call_timeout_ms),
        max_timeout: std::time::Duration::from_millis(limits.max_call_timeout_ms),
        drain_grace: std::time::Duration::from_secs(loaded.config.worker.drain_seconds),
    }
}
