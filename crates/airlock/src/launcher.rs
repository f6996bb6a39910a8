//! `airlock up`: starts the orchestrator and every worker as child processes, supervises
//! them, and stops them all on Ctrl-C.
//!
//! The launcher parses no model input and holds no tool power: it only starts, restarts
//! and stops its children, and mounts each workspace's volume when a worker asks
//! ([`crate::volumes`]). Children get SIGTERM from the kernel if the launcher dies.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_worker::volumes::BROKER_SOCKET;
use anyhow::{Context, bail};
use serde_json::json;
use tokio::process::{Child, Command};

use crate::Location;
use crate::config::{LOCAL_GROUPS, Loaded};
use crate::listen_fds::FrontDoors;
use crate::signals;
use crate::volumes::Volumes;

/// How long the orchestrator may take to come up.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long children get beyond `[worker] drain_seconds` after SIGTERM before SIGKILL:
/// a worker cancels what is still running when its drain ends and waits for that (5 s),
/// then closes its connections (5 s).
const STOP_SLACK: Duration = Duration::from_secs(10);
/// A child that ran this long before crashing restarts without delay.
const HEALTHY_RUN: Duration = Duration::from_secs(30);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// In the data dir; `airlock up` holds an exclusive `flock` on it while it runs.
const LOCK_FILE: &str = "airlock.lock";

/// Variables a worker may inherit; everything else (API keys, tokens) stays out.
const WORKER_ENV_ALLOWLIST: &[&str] = &[
    "PATH",
    "RUST_LOG",
    "RUST_BACKTRACE",
    "AIRLOCK_LOG_FORMAT",
    "NO_COLOR",
    "TZ",
    "LANG",
];

/// Variables a worker inherits by prefix: `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_TRACES_SAMPLER`…
const WORKER_ENV_PREFIX: &str = "OTEL_";

/// One supervised component.
struct Component {
    name: String,
    args: Vec<String>,
    /// Whether it may see the launcher's whole environment (the orchestrator reads
    /// `token_env` variables); workers get an allowlist.
    full_env: bool,
    /// Variables passed beside the allowlist: those the http worker's declared tools
    /// name in `${env:NAME}` (and no other worker gets them).
    extra_env: Vec<String>,
    /// The orchestrator's listeners, which its process inherits (no other's does).
    front_doors: Option<FrontDoors>,
    child: Option<Child>,
    started: Instant,
    restarts: u32,
}

/// `--http-listen` / `--grpc-listen` of `airlock up`, over `[orchestrator]`.
#[derive(Debug, Default)]
pub struct Listen {
    pub http: Option<String>,
    pub grpc: Option<String>,
}

pub fn up(location: &Location, listen: Listen) -> anyhow::Result<ExitCode> {
    let mut loaded = Loaded::load(location.config.as_deref(), location.data_dir.as_deref())?;
    if let Some(addr) = listen.http {
        loaded.config.orchestrator.http_listen = addr;
    }
    if let Some(addr) = listen.grpc {
        loaded.config.orchestrator.grpc_listen = addr;
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&loaded.data_dir)
        .with_context(|| format!("cannot create data dir {}", loaded.data_dir.display()))?;
    check_data_dir_owner(&loaded.data_dir)?;
    // Taken before anything in the data dir is touched, so a second launcher on the same
    // dir changes nothing of the first's (its endpoints.json, sockets, token); held until
    // this function returns, after the children have stopped.
    let _lock = lock_data_dir(&loaded.data_dir)?;
    prepare_data_dir(&loaded)?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(with_volumes(loaded))
}

/// Runs the components with the workspace volume broker beside them when `[sandbox]
/// workspace_bytes` is on (proved to work before any worker starts), and unmounts the
/// volumes once they have stopped.
async fn with_volumes(loaded: Loaded) -> anyhow::Result<ExitCode> {
    let Some(volumes) = Volumes::new(&loaded).map(Arc::new) else {
        return supervise(loaded).await;
    };
    let data_dir = loaded.data_dir.clone();
    volumes.probe().await?;
    let broker = volumes.listen(&data_dir)?;
    let result = supervise(loaded).await;
    broker.abort();
    volumes.unmount_all().await;
    let _ = std::fs::remove_file(data_dir.join(BROKER_SOCKET));
    result
}

/// Refuses a data dir that is not the running user's own or that others may write to.
/// The launcher often runs as root (the workspace volumes need it) and writes its lock,
/// token and run files there: whoever owns the directory, or may write to it, could
/// plant a symbolic link by one of those names and have root truncate or overwrite the
/// file it points to. (A data dir reached through a symbolic link is fine: what is
/// checked is the directory itself.)
fn check_data_dir_owner(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(dir)
        .with_context(|| format!("cannot read data dir {}", dir.display()))?;
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me {
        bail!(
            "data dir {} belongs to uid {}, not to this user (uid {me}): another user could plant links in it that this launcher would follow; give this launcher a data dir of its own (--data-dir), or chown it",
            dir.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o022 != 0 {
        bail!(
            "data dir {} may be written by others (mode {:o}); `chmod 700` it or choose another --data-dir",
            dir.display(),
            meta.mode() & 0o777
        );
    }
    Ok(())
}

/// Takes the exclusive lock of the data dir, or says which launcher holds it.
///
/// An advisory `flock`, not a pid file: the kernel drops it when the launcher dies, even
/// by SIGKILL, so a crash never leaves a stale lock to clean up by hand. The file itself
/// stays (removing it would let two launchers lock two different inodes); it holds the
/// holder's pid, for the message only.
fn lock_data_dir(dir: &Path) -> anyhow::Result<File> {
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        // Never through a link: the file is truncated below.
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits().cast_signed())
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = match holder.trim().parse::<u32>() {
                Ok(pid) => format!(" (pid {pid})"),
                // The holder is between taking the lock and writing its pid.
                Err(_) => String::new(),
            };
            bail!(
                "another airlock up{holder} is already running on data dir {}; stop it \
                 first, or give this one its own --data-dir",
                dir.display()
            );
        }
        Err(e) => {
            return Err(std::io::Error::from(e))
                .with_context(|| format!("cannot lock {}", path.display()));
        }
    }
    file.set_len(0)
        .and_then(|()| writeln!(file, "{}", std::process::id()))
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(file)
}

fn prepare_data_dir(loaded: &Loaded) -> anyhow::Result<()> {
    let dir = &loaded.data_dir;
    for sub in ["sockets", "run"] {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir.join(sub))?;
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(loaded.workspaces_root())?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    if loaded.config.principals.is_empty() {
        airlock_orchestrator::auth::ensure_token_file(
            &airlock_orchestrator::auth::token_file_path(dir),
        )?;
    }
    for stale in [
        dir.join("run/orchestrator.json"),
        dir.join("endpoints.json"),
    ] {
        match std::fs::remove_file(&stale) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("cannot remove {}", stale.display()));
            }
            _ => {}
        }
    }
    Ok(())
}

fn component_args(loaded: &Loaded, serve_args: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = vec!["serve".into()];
    args.extend(serve_args.iter().map(|s| (*s).to_owned()));
    args.push("--data-dir".into());
    args.push(loaded.data_dir.display().to_string());
    if let Some(file) = &loaded.file {
        args.push("--config".into());
        args.push(file.display().to_string());
    }
    args
}

async fn supervise(loaded: Loaded) -> anyhow::Result<ExitCode> {
    let exe = std::env::current_exe().context("cannot find the airlock executable")?;
    // The demo database is made here, not in the db worker: SQLite's memory for
    // building it would stay in the worker's heap for its whole life (1.6 MiB of its
    // idle resident memory, measured).
    if loaded.config.databases.is_empty() {
        crate::demo::ensure_demo_database(&loaded.demo_database_path())?;
    }
    let secret_env: Vec<String> = loaded
        .http_tools()?
        .iter()
        .flat_map(|tool| tool.env_names())
        .chain(
            loaded
                .mcp_http_servers()?
                .iter()
                .flat_map(|server| server.env_names()),
        )
        .collect();
    // The db worker reads each `password_env` of `[[databases]]` at its start; nothing
    // else of the launcher's environment reaches it.
    let db_env: Vec<String> = loaded
        .config
        .databases
        .iter()
        .filter_map(|database| database.password_env.clone())
        .collect();
    let metrics = worker_metrics(&loaded)?;
    let mut components: Vec<Component> = LOCAL_GROUPS
        .iter()
        .map(|group| Component {
            name: format!("{group} worker"),
            args: worker_args(&loaded, group, &metrics),
            full_env: false,
            extra_env: match *group {
                "http" => secret_env.clone(),
                "db" => db_env.clone(),
                _ => Vec::new(),
            },
            front_doors: None,
            child: None,
            started: Instant::now(),
            restarts: 0,
        })
        .collect();
    let drain = Duration::from_secs(loaded.config.worker.drain_seconds);
    // Bound here, once, and inherited by every orchestrator process: a port 0 ("any
    // free port") is held from the moment it is chosen, so no other process can take
    // it before the orchestrator serves on it, and a restarted orchestrator comes back
    // on the same sockets.
    let front_doors = FrontDoors::bind(
        &loaded.config.orchestrator.http_listen,
        &loaded.config.orchestrator.grpc_listen,
    )?;
    let (http, grpc) = front_doors.addrs()?;
    let mut orchestrator_args = component_args(&loaded, &["orchestrator"]);
    orchestrator_args.extend([
        "--http-listen".to_owned(),
        http,
        "--grpc-listen".to_owned(),
        grpc,
    ]);
    components.push(Component {
        name: "orchestrator".into(),
        args: orchestrator_args,
        full_env: true,
        extra_env: Vec::new(),
        front_doors: Some(front_doors),
        child: None,
        started: Instant::now(),
        restarts: 0,
    });
    for component in &mut components {
        spawn(&exe, component)?;
    }

    let shutdown = signals::shutdown();
    tokio::pin!(shutdown);
    let endpoints = tokio::select! {
        e = wait_for_orchestrator(&loaded.data_dir, &mut components) => e,
        _ = &mut shutdown => {
            stop_all(&mut components, drain).await;
            remove_sockets(&loaded.data_dir);
            return Ok(ExitCode::SUCCESS);
        }
    };
    let endpoints = match endpoints {
        Ok(e) => e,
        Err(e) => {
            stop_all(&mut components, drain).await;
            remove_sockets(&loaded.data_dir);
            return Err(e);
        }
    };
    announce(&loaded, &endpoints, &metrics)?;

    loop {
        let exited = tokio::select! {
            _ = &mut shutdown => break,
            index = any_exit(&mut components) => index,
        };
        let component = &mut components[exited];
        let ran = component.started.elapsed();
        if ran >= HEALTHY_RUN {
            component.restarts = 0;
        }
        let backoff = Duration::from_millis(100u64 << component.restarts.min(6)).min(MAX_BACKOFF);
        component.restarts += 1;
        tracing::warn!(component = %component.name, ran_ms = ran.as_millis() as u64, backoff_ms = backoff.as_millis() as u64, "component exited; restarting");
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep(backoff) => {}
        }
        if let Err(e) = spawn(&exe, component) {
            // The binary replaced or gone, or no process to be had: the others stop in
            // order (drained, their sockets removed) rather than killed on the way out.
            let e = e.context(format!("cannot restart the {}", component.name));
            tracing::error!(error = %format!("{e:#}"), "stopping every component");
            stop_all(&mut components, drain).await;
            remove_sockets(&loaded.data_dir);
            let _ = std::fs::remove_file(loaded.data_dir.join("endpoints.json"));
            return Err(e);
        }
    }
    stop_all(&mut components, drain).await;
    remove_sockets(&loaded.data_dir);
    let _ = std::fs::remove_file(loaded.data_dir.join("endpoints.json"));
    Ok(ExitCode::SUCCESS)
}

/// Once every component has stopped: removes the Unix sockets they listened on in
/// `<data_dir>/sockets`, so a stopped `airlock up` leaves no socket file behind.
fn remove_sockets(data_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(data_dir.join("sockets")) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_socket())
            && let Err(e) = std::fs::remove_file(entry.path())
        {
            tracing::warn!(socket = %entry.path().display(), error = %e, "cannot remove a socket");
        }
    }
}

/// `host:0` becomes `host:<a free port>`; anything else stays as it is. For the workers'
/// metrics listeners; the orchestrator's are bound here and inherited ([`FrontDoors`]).
///
/// The port is announced now and bound later by the component, so it is chosen outside
/// the kernel's ephemeral range when it can be: inside it, any outgoing connection of
/// the host may take the port as its local port in between (seen under parallel tests).
fn settle_port(addr: &str) -> anyhow::Result<String> {
    let Ok(parsed) = addr.parse::<std::net::SocketAddr>() else {
        return Ok(addr.to_owned());
    };
    if parsed.port() != 0 {
        return Ok(addr.to_owned());
    }
    let (ephemeral_low, _) = ephemeral_ports();
    if ephemeral_low > FIRST_SETTLED_PORT {
        for _ in 0..SETTLE_TRIES {
            let port = FIRST_SETTLED_PORT + random_below(ephemeral_low - FIRST_SETTLED_PORT);
            let candidate = std::net::SocketAddr::new(parsed.ip(), port);
            if let Ok(probe) = std::net::TcpListener::bind(candidate) {
                return Ok(probe.local_addr()?.to_string());
            }
        }
    }
    let probe =
        std::net::TcpListener::bind(parsed).with_context(|| format!("cannot bind {addr}"))?;
    Ok(probe.local_addr()?.to_string())
}

/// Where [`settle_port`] starts looking: above the ports services are usually given.
const FIRST_SETTLED_PORT: u16 = 10_000;

/// How many ports outside the ephemeral range [`settle_port`] tries before it takes one
/// the kernel picks.
const SETTLE_TRIES: usize = 32;

/// The kernel's ephemeral port range (`net.ipv4.ip_local_port_range`), or Linux's
/// default when it cannot be read.
fn ephemeral_ports() -> (u16, u16) {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok();
    let mut bounds = range
        .as_deref()
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|n| n.parse::<u16>().ok());
    match (bounds.next(), bounds.next()) {
        (Some(low), Some(high)) if low <= high => (low, high),
        _ => (32_768, 60_999),
    }
}

/// A number below `bound` (> 0), from the standard library's per-process random keys:
/// spreading the choice is all that is needed, not unpredictability.
fn random_below(bound: u16) -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    u16::try_from(hasher.finish() % u64::from(bound)).unwrap_or(0)
}

fn spawn(exe: &Path, component: &mut Component) -> anyhow::Result<()> {
    let mut command = Command::new(exe);
    command
        .args(&component.args)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    if !component.full_env {
        command.env_clear();
        for key in WORKER_ENV_ALLOWLIST
            .iter()
            .copied()
            .chain(component.extra_env.iter().map(String::as_str))
        {
            if let Some(value) = std::env::var_os(key) {
                command.env(key, value);
            }
        }
        // The standard OpenTelemetry variables: each worker exports its spans to the
        // same collector as the orchestrator (DESIGN §13).
        for (key, value) in std::env::vars_os() {
            if key
                .to_str()
                .is_some_and(|k| k.starts_with(WORKER_ENV_PREFIX))
            {
                command.env(key, value);
            }
        }
    }
    command.env(signals::LAUNCHER_PID_ENV, std::process::id().to_string());
    if let Some(front_doors) = &component.front_doors {
        front_doors.pass_to(&mut command);
    }
    let child = command
        .spawn()
        .with_context(|| format!("cannot start the {}", component.name))?;
    tracing::info!(component = %component.name, pid = child.id().unwrap_or(0), "started");
    component.child = Some(child);
    component.started = Instant::now();
    Ok(())
}

/// Resolves with the index of the first component whose process exits.
async fn any_exit(components: &mut [Component]) -> usize {
    let waits = components.iter_mut().enumerate().map(|(index, c)| {
        Box::pin(async move {
            match c.child.as_mut() {
                Some(child) => {
                    let status = child.wait().await;
                    tracing::warn!(component = %c.name, ?status, "exited");
                    c.child = None;
                }
                None => std::future::pending::<()>().await,
            }
            index
        })
    });
    futures::future::select_all(waits).await.0
}

async fn wait_for_orchestrator(
    data_dir: &Path,
    components: &mut [Component],
) -> anyhow::Result<serde_json::Value> {
    let run_file = data_dir.join("run/orchestrator.json");
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Ok(text) = std::fs::read_to_string(&run_file)
            && let Ok(endpoints) = serde_json::from_str::<serde_json::Value>(&text)
            && local_workers_live(&endpoints, components).await
        {
            return Ok(endpoints);
        }
        for component in components.iter_mut() {
            if let Some(child) = component.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                bail!(
                    "the {} exited during start-up ({status}); see its log above",
                    component.name
                );
            }
        }
        if Instant::now() > deadline {
            bail!(
                "the orchestrator did not start within {} s",
                START_TIMEOUT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether the orchestrator sees every worker this launcher started as live: a worker
/// that fails after the orchestrator is up (the shell worker when an MCP server does
/// not start) must still stop `airlock up` with its error, not be restarted for ever
/// behind an "Airlock is up".
async fn local_workers_live(endpoints: &serde_json::Value, components: &[Component]) -> bool {
    let Some(http) = endpoints["http"].as_str() else {
        return false;
    };
    let client = reqwest::Client::new();
    let ready = client
        .get(format!("{http}/readyz"))
        .timeout(Duration::from_secs(2))
        .send()
        .await;
    let Ok(body) = (match ready {
        Ok(response) => response.json::<serde_json::Value>().await,
        Err(e) => Err(e),
    }) else {
        return false;
    };
    components
        .iter()
        .filter_map(|c| c.name.strip_suffix(" worker"))
        .all(|group| body["workers"][group] == "live")
}

/// `[metrics] listen` as one address per worker this launcher starts, settled once so
/// that a restarted worker serves its metrics where Prometheus already looks: a free
/// port each for port 0, else the port for the first worker and the next ones in
/// [`LOCAL_GROUPS`] order.
fn worker_metrics(loaded: &Loaded) -> anyhow::Result<Vec<(&'static str, String)>> {
    let Some(listen) = &loaded.config.metrics.listen else {
        return Ok(Vec::new());
    };
    let base: std::net::SocketAddr = listen
        .parse()
        .with_context(|| format!("[metrics] listen = {listen:?} is not host:port"))?;
    LOCAL_GROUPS
        .iter()
        .zip(0u16..)
        .map(|(group, offset)| {
            let addr = match base.port() {
                0 => settle_port(listen)?,
                port => {
                    let port = port
                        .checked_add(offset)
                        .context("[metrics] listen: no room for a port per worker above it")?;
                    std::net::SocketAddr::new(base.ip(), port).to_string()
                }
            };
            Ok((*group, addr))
        })
        .collect()
}

fn worker_args(loaded: &Loaded, group: &str, metrics: &[(&str, String)]) -> Vec<String> {
    let mut args = component_args(loaded, &["worker", group]);
    if let Some((_, addr)) = metrics.iter().find(|(g, _)| *g == group) {
        args.extend(["--metrics-listen".to_owned(), addr.clone()]);
    }
    args
}

fn announce(
    loaded: &Loaded,
    endpoints: &serde_json::Value,
    workers_metrics: &[(&str, String)],
) -> anyhow::Result<()> {
    let token_file: Option<PathBuf> = loaded
        .config
        .principals
        .is_empty()
        .then(|| airlock_orchestrator::auth::token_file_path(&loaded.data_dir));
    // Where Prometheus scrapes each component.
    let mut metrics = serde_json::Map::new();
    if let Some(http) = endpoints["http"].as_str() {
        metrics.insert("orchestrator".into(), json!(format!("{http}/metrics")));
    }
    for (group, addr) in workers_metrics {
        metrics.insert((*group).to_owned(), json!(format!("http://{addr}/metrics")));
    }
    let document = json!({
        "http": endpoints["http"],
        "grpc": endpoints["grpc"],
        "token_file": token_file.as_ref().map(|p| p.display().to_string()),
        "metrics": metrics,
    });
    let path = loaded.data_dir.join("endpoints.json");
    let tmp = loaded.data_dir.join(".endpoints.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&document)?)?;
    std::fs::rename(&tmp, &path)?;
    let http = endpoints["http"].as_str().unwrap_or_default();
    println!("Airlock is up.");
    println!("  HTTP:  {http}   (OpenAPI: {http}/openapi.json)");
    println!("  Approvals console: {http}/ui   (sign in with the token)");
    println!(
        "  gRPC:  {}",
        endpoints["grpc"].as_str().unwrap_or_default()
    );
    if let Some(token_file) = &token_file {
        println!("  Token: {}", token_file.display());
        println!();
        println!(
            "  export AIRLOCK_URL={http} AIRLOCK_TOKEN=$(cat {})",
            token_file.display()
        );
    }
    println!("  airlock tools --data-dir {}", loaded.data_dir.display());
    println!("Press Ctrl-C to stop.");
    Ok(())
}

/// SIGTERM to every child, SIGKILL to those still running after the grace period.
async fn stop_all(components: &mut [Component], drain: Duration) {
    for component in components.iter() {
        if let Some(pid) = component.child.as_ref().and_then(Child::id)
            && let Some(pid) = rustix::process::Pid::from_raw(pid as i32)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
    }
    for component in components.iter_mut() {
        if let Some(mut child) = component.child.take() {
            match tokio::time::timeout(drain + STOP_SLACK, child.wait()).await {
                Ok(_) => {}
                Err(_) => {
                    tracing::warn!(component = %component.name, "did not stop in time; killing");
                    let _ = child.kill().await;
                }
            }
        }
    }
    tracing::info!("all components stopped");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_settled_port_is_outside_the_ephemeral_range_and_free() {
        let (low, high) = ephemeral_ports();
        assert!(
            low > FIRST_SETTLED_PORT,
            "this host's ephemeral range starts at {low}: nothing to choose below it"
        );
        for _ in 0..20 {
            let settled = settle_port("127.0.0.1:0").expect("a port");
            let port = settled
                .parse::<std::net::SocketAddr>()
                .expect("host:port")
                .port();
            assert!(
                (FIRST_SETTLED_PORT..low).contains(&port),
                "{port} is not below the ephemeral range {low}-{high}"
            );
            std::net::TcpListener::bind(&settled).expect("the settled port is free");
        }
        assert_eq!(
            settle_port("127.0.0.1:7070").expect("kept"),
            "127.0.0.1:7070"
        );
        assert_eq!(
            settle_port("unix:/run/a.sock").expect("kept"),
            "unix:/run/a.sock"
        );
    }
}
