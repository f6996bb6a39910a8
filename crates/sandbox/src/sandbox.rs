//! The public run API: configuration, one command's spec, the outcome, and [`Sandbox`],
//! which probes the host once, fails closed below `min_isolation`, and runs commands.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use airlock_policy::IsolationLevel;
use serde::{Deserialize, Serialize};

use crate::caps::CapsError;
use crate::cgroup::{CgroupBackend, CgroupError, CgroupLimits};
use crate::fds::FdError;
use crate::landlock_rules::LandlockError;
use crate::namespaces::{self, NamespaceError};
use crate::probe::{self, HostProbe, IsolationReport, LimitsReport, Missing};
use crate::rlimits::{RlimitError, RlimitReport};
use crate::rootfs::{RootfsError, RootfsTemplate};
use crate::seccomp::{self, SeccompError, SeccompPlan};
use crate::self_confine::SelfConfineError;
use crate::spawn;

/// Sandbox failures. Setup failures name the step; unavailable layers name the fix.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("{0}")]
    Unavailable(Missing),
    #[error("the host cannot provide {level} isolation: {reasons}")]
    BelowMinimum {
        level: &'static str,
        reasons: String,
    },
    #[error("invalid sandbox configuration: {0}")]
    InvalidConfig(String),
    #[error("invalid command: {0}")]
    InvalidCommand(String),
    #[error("sandbox setup failed at step \"{step}\": {source}")]
    Setup {
        step: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Namespace(#[from] NamespaceError),
    #[error(transparent)]
    Rootfs(#[from] RootfsError),
    #[error(transparent)]
    Rlimit(#[from] RlimitError),
    #[error(transparent)]
    Landlock(#[from] LandlockError),
    #[error(transparent)]
    Seccomp(#[from] SeccompError),
    #[error(transparent)]
    Fd(#[from] FdError),
    #[error(transparent)]
    Caps(#[from] CapsError),
    #[error(transparent)]
    SelfConfine(#[from] SelfConfineError),
    #[error(transparent)]
    Slot(#[from] crate::slots::SlotError),
    #[error("sandbox i/o failed: {0}")]
    Io(#[source] io::Error),
}

/// The port of the egress proxy inside a `network = "proxy"` sandbox: its own network
/// namespace, so every sandbox has its own `127.0.0.1:3128` (DESIGN §12).
pub const PROXY_PORT: u16 = 3128;

/// What network a sandbox has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Network {
    /// Its own network namespace, whose loopback stays down; sockets of `AF_UNIX` only.
    #[default]
    None,
    /// Its own network namespace with a loopback interface, where the only thing to
    /// reach is the worker's egress proxy on `127.0.0.1:`[`PROXY_PORT`]: IPv4 TCP sockets
    /// only, and (Landlock ABI 4+) TCP connect to that port alone and no bind. The
    /// proxy's listener is handed to the caller ([`OutputSink::proxy_listener`]).
    Proxy,
    /// The worker's own network namespace.
    Host,
}

impl Network {
    /// Whether the sandbox gets a network namespace of its own.
    pub fn own_namespace(self) -> bool {
        self != Network::Host
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Network::None => "none",
            Network::Proxy => "proxy",
            Network::Host => "host",
        }
    }
}

/// Sandbox settings (`[sandbox]` in airlock.toml). Defaults follow DESIGN.md.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SandboxConfig {
    /// Refuse to run below this level.
    pub min_isolation: IsolationLevel,
    /// Run at exactly this level instead of the strongest the host supports (must not be
    /// below `min_isolation`); `None` = strongest available.
    pub force_level: Option<IsolationLevel>,
    pub memory_bytes: u64,
    pub pids: u64,
    /// CPU bandwidth in thousandths of a CPU (1000 = one CPU).
    pub cpu_millis: u64,
    pub tmp_bytes: u64,
    pub fsize_bytes: u64,
    pub nofile: u64,
    /// Captured bytes per stream; the rest is drained and dropped, flagged truncated.
    pub output_cap_bytes: usize,
    /// The sandbox's network (default: none).
    pub network: Network,
    /// Parent cgroup of the calls: a name, created under the worker's own cgroup, or a
    /// path starting with `/` from the root of each hierarchy (a delegated subtree).
    pub cgroup_parent: String,
    /// Sandboxes that run at once; more wait inside their deadline.
    pub max_concurrent: usize,
    /// Strict sandboxes kept pre-built (namespaces made, id maps written, the shared
    /// part of the root mounted), each used by one call and then destroyed; `0` (the
    /// library's default) builds every sandbox when its call comes. Ignored at the
    /// standard level, which creates no namespace. See `spawn::pool`.
    pub prebuilt: usize,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            min_isolation: IsolationLevel::Strict,
            force_level: None,
            memory_bytes: 512 << 20,
            pids: 256,
            cpu_millis: 1000,
            tmp_bytes: 64 << 20,
            fsize_bytes: 1 << 30,
            nofile: 1024,
            output_cap_bytes: 1 << 20,
            network: Network::None,
            cgroup_parent: "airlock".to_owned(),
            max_concurrent: crate::slots::default_max_concurrent(),
            prebuilt: 0,
        }
    }
}

/// One command to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandSpec {
    /// Program and arguments; a program without `/` is searched in `PATH`.
    pub argv: Vec<String>,
    /// Host directory mounted read-write at `/workspace` (strict) or used in place
    /// (standard).
    pub workspace: PathBuf,
    /// Working directory relative to the workspace (default: its root).
    pub cwd: Option<String>,
    pub stdin: Vec<u8>,
    /// The only environment variables besides `PATH`, `HOME` and `TMPDIR` (which these
    /// override).
    pub env: Vec<(String, String)>,
    /// Wall-clock limit; the whole sandbox is killed when it runs out.
    pub timeout: Duration,
}

impl CommandSpec {
    /// A spec with no stdin, no extra environment and a 30 s timeout.
    pub fn new(argv: Vec<String>, workspace: impl Into<PathBuf>) -> Self {
        CommandSpec {
            argv,
            workspace: workspace.into(),
            cwd: None,
            stdin: Vec::new(),
            env: Vec::new(),
            timeout: Duration::from_secs(30),
        }
    }
}

/// The child's ends of the stdin and stdout of an attached run
/// ([`Sandbox::run_attached`]): typically the read end of one pipe and the write end of
/// another, whose other ends the caller reads and writes.
#[derive(Debug)]
pub struct AttachedStdio {
    pub stdin: OwnedFd,
    pub stdout: OwnedFd,
}

/// Which output stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Receives output while the command runs, on the calling thread (only the captured
/// part, up to the cap).
pub trait OutputSink {
    fn chunk(&mut self, stream: Stream, data: &[u8]);

    /// A `network = "proxy"` sandbox's listener on its own `127.0.0.1:`[`PROXY_PORT`],
    /// once its command has started: whoever holds it decides what the sandbox reaches.
    /// Dropping it (the default) leaves every connection of the sandbox refused.
    fn proxy_listener(&mut self, listener: std::net::TcpListener) {
        drop(listener);
    }
}

impl<F: FnMut(Stream, &[u8])> OutputSink for F {
    fn chunk(&mut self, stream: Stream, data: &[u8]) {
        self(stream, data)
    }
}

/// A sink that ignores streamed output (the outcome still holds it).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoSink;

impl OutputSink for NoSink {
    fn chunk(&mut self, _: Stream, _: &[u8]) {}
}

/// Cancels a running command from another thread or task: the whole sandbox is killed
/// as soon as the supervising thread wakes, which the cancel itself does (an eventfd in
/// its `poll` set), not a timer.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<CancelState>);

#[derive(Debug)]
struct CancelState {
    cancelled: AtomicBool,
    /// Readable once cancelled. `None` only when the process is out of descriptors;
    /// the supervisor then checks the flag on a short tick instead.
    wake: Option<OwnedFd>,
}

impl Default for CancelState {
    fn default() -> Self {
        // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor
        // that nobody else owns.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        let wake = (fd >= 0).then(|| {
            // SAFETY: as above: the descriptor is ours alone.
            unsafe { OwnedFd::from_raw_fd(fd) }
        });
        Self {
            cancelled: AtomicBool::new(false),
            wake,
        }
    }
}

impl Cancel {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn cancel(&self) {
        self.0.cancelled.store(true, Ordering::SeqCst);
        if let Some(fd) = &self.0.wake {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writing eight bytes from a valid buffer to our own eventfd; a
            // full counter (EAGAIN) still leaves it readable.
            unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.cancelled.load(Ordering::SeqCst)
    }

    /// The descriptor that becomes readable when [`Cancel::cancel`] is called.
    pub(crate) fn wake_fd(&self) -> Option<RawFd> {
        self.0.wake.as_ref().map(AsRawFd::as_raw_fd)
    }
}

/// CPU time and peak memory of a call (cgroup numbers when available, else wait4's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Usage {
    pub cpu_user_ms: u64,
    pub cpu_system_ms: u64,
    pub peak_memory_bytes: u64,
}

/// What happened to a command.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunOutcome {
    /// Exit code when the command exited.
    pub exit_code: Option<i32>,
    /// Signal number when the command was killed by a signal.
    pub signal: Option<i32>,
    #[serde(skip)]
    pub stdout: Vec<u8>,
    #[serde(skip)]
    pub stderr: Vec<u8>,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub timed_out: bool,
    pub cancelled: bool,
    #[serde(serialize_with = "duration_ms")]
    pub duration: Duration,
    /// From the request to the command's `exec` (preparation, clone, id maps, cgroup,
    /// the child's confinement): what a sandbox costs before the command runs.
    #[serde(skip)]
    pub spawn: Duration,
    /// Whether the command ran in a pre-built sandbox ([`SandboxConfig::prebuilt`])
    /// rather than one built for it; the confinement is the same either way.
    #[serde(skip)]
    pub prebuilt: bool,
    /// Why a factory with pre-built sandboxes ran this call in a fresh one (none was
    /// ready, the call did not fit one, ...); `None` otherwise.
    #[serde(skip)]
    pub fallback: Option<String>,
    pub usage: Usage,
    pub isolation: IsolationReport,
}

fn duration_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A sandbox factory for one configuration: probed once, then runs any number of
/// commands (concurrently from several threads, too).
#[derive(Debug)]
pub struct Sandbox {
    factory: Arc<Factory>,
    slots: crate::slots::Slots,
    /// Pre-built strict sandboxes, started by the first [`Sandbox::run`] (so that a
    /// worker confines itself first, and every entry inherits that confinement).
    pool: std::sync::OnceLock<Option<spawn::Pool>>,
}

/// What every sandbox of a factory shares, prepared once: shared with the thread that
/// keeps pre-built sandboxes ready.
#[derive(Debug)]
pub(crate) struct Factory {
    /// Tears down sandboxes whose call has been answered. First, so that it is dropped
    /// first: its drop waits for their teardown, which needs the cgroup backend below.
    reaper: spawn::Reaper,
    config: SandboxConfig,
    level: IsolationLevel,
    landlock_abi: u32,
    cgroup: Option<Arc<dyn CgroupBackend>>,
    seccomp: SeccompPlan,
    /// The host's side of a strict sandbox's new root, found once.
    rootfs: Option<RootfsTemplate>,
    report: IsolationReport,
}

impl Sandbox {
    /// Probes the host and prepares the sandbox; fails, naming the missing layer and
    /// the fix, when the host cannot provide `min_isolation` (or `force_level`).
    pub fn new(config: SandboxConfig) -> Result<Self, SandboxError> {
        validate(&config)?;
        // A sandbox held to the standard level enters no namespace: it needs no
        // user-namespace probe (a forked child).
        let user_namespaces = config.force_level != Some(IsolationLevel::Standard);
        let host = probe::probe_for(&config.cgroup_parent, user_namespaces);
        Self::with_probe(config, host)
    }

    /// As [`Sandbox::new`] with an existing probe.
    pub fn with_probe(config: SandboxConfig, host: HostProbe) -> Result<Self, SandboxError> {
        validate(&config)?;
        let level = match config.force_level {
            Some(level) if level < config.min_isolation => {
                return Err(SandboxError::InvalidConfig(format!(
                    "force_level {} is below min_isolation {}",
                    level.as_str(),
                    config.min_isolation.as_str()
                )));
            }
            Some(level) => level,
            None => host.best_level().unwrap_or(IsolationLevel::Standard),
        };
        let level = level.max(config.min_isolation);
        let mut missing = host.missing_for(level);
        if missing.len() == 1 {
            return Err(SandboxError::Unavailable(missing.remove(0)));
        }
        if !missing.is_empty() {
            return Err(SandboxError::BelowMinimum {
                level: level.as_str(),
                reasons: missing
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
        let landlock_abi = host.landlock_abi.clone().unwrap_or(0);
        let cgroup = host.cgroup.ok();
        // All sandboxes together: max_concurrent times one call's memory and pids.
        let max_concurrent = config.max_concurrent.max(1);
        let multiple = u64::try_from(max_concurrent).unwrap_or(u64::MAX);
        let aggregate = CgroupLimits {
            memory_bytes: config.memory_bytes.saturating_mul(multiple),
            pids: config.pids.saturating_mul(multiple),
            cpu_millis: config.cpu_millis,
        };
        let aggregate_memory_bytes = cgroup
            .as_ref()
            .and_then(|c| c.limit_parent(&aggregate).ok())
            .map(|()| aggregate.memory_bytes);
        let strict = level == IsolationLevel::Strict;
        if config.network == Network::Proxy && !strict {
            return Err(SandboxError::InvalidConfig(format!(
                "network = \"proxy\" needs a network namespace of the sandbox's own, which the {} level does not create; run the shell worker where user namespaces work (strict), or use network = \"none\"",
                level.as_str()
            )));
        }
        let seccomp = SeccompPlan::compile(seccomp::Profile::sandbox(config.network, strict))?;
        let rootfs = if strict {
            Some(RootfsTemplate::prepare(config.tmp_bytes, config.network)?)
        } else {
            None
        };
        let report = IsolationReport {
            level,
            namespaces: if strict {
                namespaces::names(config.network)
            } else {
                Vec::new()
            },
            pivot_root: strict,
            landlock_abi: Some(landlock_abi),
            seccomp: Some("filter"),
            cgroup: cgroup.as_ref().map(|c| c.version()),
            no_new_privs: true,
            capabilities_dropped: true,
            // A strict sandbox is root of its own user namespace and so holds
            // CAP_SETPCAP there; a standard one has what the worker has.
            bounding_set_dropped: strict || crate::caps::bounding_set_can_be_emptied(),
            rlimits: RlimitReport {
                nofile: config.nofile,
                fsize_bytes: config.fsize_bytes,
                core_bytes: 0,
                cpu_seconds: None,
            },
            limits: LimitsReport {
                memory_bytes: cgroup.as_ref().map(|_| config.memory_bytes),
                swap_bytes: cgroup.as_ref().filter(|c| c.limits_swap()).map(|_| 0),
                pids: cgroup.as_ref().map(|_| config.pids),
                cpu: cgroup.as_ref().map(|_| config.cpu_millis as f64 / 1000.0),
                tmp_bytes: strict.then_some(config.tmp_bytes),
                output_bytes: config.output_cap_bytes as u64,
                timeout_ms: None,
                max_concurrent,
                aggregate_memory_bytes,
            },
            network: config.network.as_str(),
        };
        Ok(Sandbox {
            factory: Arc::new(Factory {
                reaper: spawn::Reaper::new(max_concurrent),
                config,
                level,
                landlock_abi,
                cgroup,
                seccomp,
                rootfs,
                report,
            }),
            slots: crate::slots::Slots::new(max_concurrent),
            pool: std::sync::OnceLock::new(),
        })
    }

    /// The layers every run of this sandbox gets (per-call values such as the timeout
    /// are filled in each [`RunOutcome::isolation`]).
    pub fn report(&self) -> &IsolationReport {
        &self.factory.report
    }

    pub fn level(&self) -> IsolationLevel {
        self.factory.level
    }

    pub fn config(&self) -> &SandboxConfig {
        &self.factory.config
    }

    /// Pre-built sandboxes ready for a call right now (`0` without a pool, or before
    /// the first [`Sandbox::run`] started it).
    pub fn prebuilt_ready(&self) -> usize {
        self.pool
            .get()
            .and_then(Option::as_ref)
            .map_or(0, spawn::Pool::ready)
    }

    /// The pool, started by the first call: strict factories with `prebuilt > 0` only.
    fn pool(&self) -> Option<&spawn::Pool> {
        self.pool
            .get_or_init(|| {
                let size = self.factory.config.prebuilt;
                (size > 0 && self.factory.is_strict())
                    .then(|| spawn::Pool::start(self.factory.clone(), size))
            })
            .as_ref()
    }

    /// Runs one command to completion (or timeout, or cancellation). Blocking: call it
    /// from a blocking thread (e.g. `tokio::task::spawn_blocking`). When
    /// `max_concurrent` sandboxes already run, it first waits for one to finish; the
    /// wait counts against `spec.timeout`, and a call whose timeout runs out while it
    /// waits fails with [`SlotError::Busy`](crate::SlotError::Busy) without starting.
    pub fn run(
        &self,
        spec: &CommandSpec,
        sink: &mut dyn OutputSink,
        cancel: &Cancel,
    ) -> Result<RunOutcome, SandboxError> {
        let accepted = std::time::Instant::now();
        let _slot = self.slots.take(accepted + spec.timeout, cancel)?;
        let waited = accepted.elapsed();
        // Taking a free slot costs microseconds; only a real wait shortens the timeout.
        if waited < Duration::from_millis(1) {
            return spawn::run(&self.factory, self.pool(), spec, None, sink, cancel);
        }
        let mut spec = spec.clone();
        spec.timeout = spec
            .timeout
            .saturating_sub(waited)
            .max(Duration::from_millis(1));
        spawn::run(&self.factory, self.pool(), &spec, None, sink, cancel)
    }

    /// Runs a long-lived command that talks over its stdin and stdout (a stdio MCP
    /// server): the same confinement as [`Sandbox::run`], but the command's stdin and
    /// stdout are `stdio`'s descriptors, whose other ends the caller keeps, and only
    /// stderr is captured (and streamed to `stderr_sink`). `spec.stdin` is ignored.
    /// Blocks until the command exits, `spec.timeout` runs out, or `cancel` fires.
    ///
    /// It takes no call slot: such a command lives across many calls, so the caller
    /// bounds how many it runs. Its cgroup sits under the same parent as the calls',
    /// whose aggregate memory and pids limits hold them all.
    pub fn run_attached(
        &self,
        spec: &CommandSpec,
        stdio: AttachedStdio,
        stderr_sink: &mut dyn OutputSink,
        cancel: &Cancel,
    ) -> Result<RunOutcome, SandboxError> {
        // A long-lived command with the caller's descriptors: never from the pool,
        // whose entries hold pipes of their own.
        spawn::run(&self.factory, None, spec, Some(stdio), stderr_sink, cancel)
    }

    /// Sandboxes that may run at once.
    pub fn max_concurrent(&self) -> usize {
        self.slots.max()
    }
}

impl Factory {
    pub(crate) fn config(&self) -> &SandboxConfig {
        &self.config
    }

    pub(crate) fn report(&self) -> &IsolationReport {
        &self.report
    }

    pub(crate) fn is_strict(&self) -> bool {
        self.level == IsolationLevel::Strict
    }

    pub(crate) fn landlock_abi(&self) -> u32 {
        self.landlock_abi
    }

    pub(crate) fn cgroup_backend(&self) -> Option<&dyn CgroupBackend> {
        self.cgroup.as_deref()
    }

    pub(crate) fn seccomp(&self) -> &SeccompPlan {
        &self.seccomp
    }

    pub(crate) fn rootfs_template(&self) -> Option<&RootfsTemplate> {
        self.rootfs.as_ref()
    }

    pub(crate) fn reaper(&self) -> &spawn::Reaper {
        &self.reaper
    }
}

fn validate(config: &SandboxConfig) -> Result<(), SandboxError> {
    let bad = |m: &str| Err(SandboxError::InvalidConfig(m.to_owned()));
    if !crate::cgroup::valid_parent(&config.cgroup_parent) {
        return bad(
            "cgroup_parent must be a plain directory name (created under the worker's own \
             cgroup) or an absolute path of plain names (a delegated subtree, from the root of \
             each cgroup hierarchy)",
        );
    }
    if config.memory_bytes < 1 << 20 {
        return bad("memory_bytes must be at least 1 MiB");
    }
    if config.pids == 0 || config.cpu_millis == 0 || config.nofile < 3 {
        return bad("pids and cpu_millis must be positive and nofile at least 3");
    }
    if config.tmp_bytes == 0 {
        return bad("tmp_bytes must be positive");
    }
    if config.force_level.is_some_and(|l| l < config.min_isolation) {
        return bad("force_level is below min_isolation");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real host, in turn with the other unit tests that use it.
    fn real_host() -> std::sync::MutexGuard<'static, ()> {
        crate::REAL_HOST
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn strict(test: &str) -> Sandbox {
        let config = SandboxConfig {
            min_isolation: IsolationLevel::Strict,
            cgroup_parent: format!("airlock-unit-{test}"),
            ..SandboxConfig::default()
        };
        match Sandbox::new(config) {
            Ok(sandbox) => sandbox,
            Err(e) => panic!("this host cannot run a strict sandbox: {e}"),
        }
    }

    fn sh(script: &str, workspace: &std::path::Path) -> CommandSpec {
        let mut spec = CommandSpec::new(
            vec!["/bin/sh".into(), "-c".into(), script.into()],
            workspace,
        );
        spec.timeout = Duration::from_secs(20);
        spec
    }

    /// Pids of the host's processes whose command line holds `marker`.
    fn processes_with(marker: &str) -> Vec<String> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(marker) {
                found.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
        found
    }

    /// A command that leaves nothing behind is answered from init's report while its
    /// sandbox still waits for its teardown (held here); the teardown happens after,
    /// and the factory's drop waits for it.
    #[test]
    fn a_call_is_answered_before_its_sandbox_is_torn_down() {
        let _host = real_host();
        let ws = tempfile::tempdir().unwrap();
        let sandbox = strict("reaper");
        let held = sandbox.factory.reaper().hold();
        let out = sandbox
            .run(
                &sh("echo out; echo err >&2; exit 3", ws.path()),
                &mut NoSink,
                &Cancel::new(),
            )
            .unwrap();
        assert_eq!(out.exit_code, Some(3));
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");
        assert_eq!(
            sandbox.factory.reaper().pending(),
            1,
            "the sandbox was torn down before the call was answered"
        );
        // A second call while the first still waits: each is answered on its own.
        let out = sandbox
            .run(&sh("exit 0", ws.path()), &mut NoSink, &Cancel::new())
            .unwrap();
        assert_eq!(out.exit_code, Some(0));
        assert_eq!(sandbox.factory.reaper().pending(), 2);
        drop(held);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while sandbox.factory.reaper().pending() > 0 {
            assert!(std::time::Instant::now() < deadline, "teardowns never ran");
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(sandbox);
    }

    /// A command that left a process behind: when the call returns, that process is
    /// gone, with the teardown held. Either the caller found it in the cgroup and
    /// killed and reaped the sandbox before answering, or init, exiting after its
    /// report, had already killed it (a process leaves the cgroup's list only once it
    /// runs no code and holds no file) — which of the two depends on timing (under
    /// load the second is common), so the test asserts what both guarantee, checked at
    /// once, without waiting.
    #[test]
    fn no_process_left_behind_outlives_the_answer() {
        let _host = real_host();
        let ws = tempfile::tempdir().unwrap();
        let sandbox = strict("reaper-orphan");
        let marker = format!("{}", 40_000 + std::process::id() % 10_000);
        let _held = sandbox.factory.reaper().hold();
        for script in [
            // Output closed: the pipes reach their end, the process lives on.
            format!("sleep {marker} >/dev/null 2>&1 </dev/null & exit 0"),
            // Output kept open by the process left behind.
            format!("sleep {marker} & echo started"),
            // In a session of its own.
            format!("setsid sleep {marker} >/dev/null 2>&1 & exit 0"),
        ] {
            let out = sandbox
                .run(&sh(&script, ws.path()), &mut NoSink, &Cancel::new())
                .unwrap();
            assert_eq!(out.exit_code, Some(0), "{script}");
            assert_eq!(
                processes_with(&format!("sleep {marker}")),
                Vec::<String>::new()
            );
        }
    }
}
