//! Control groups: one per call, with memory (no swap), pids and CPU limits, joined by
//! the parent before the child may continue, killed as a whole on timeout or cancel,
//! and removed after every call.
//!
//! Two implementations sit behind [`CgroupBackend`], chosen by [`detect`]:
//! - [`v2::V2`], the unified hierarchy with the memory, pids and cpu controllers
//!   (Kubernetes nodes, current distributions); calls are children of a parent cgroup
//!   whose `cgroup.subtree_control` delegates the three controllers.
//! - [`v1::V1`], the legacy per-controller hierarchies. On a hybrid host, where a
//!   controller-less cgroup2 tree is mounted too (usually at `/sys/fs/cgroup/unified`),
//!   the call also joins a cgroup there only to use `cgroup.kill`.
//!
//! Per-call cgroups live under `<the worker's own cgroup>/<cgroup_parent>` in every
//! hierarchy, so they stay inside whatever limits the worker itself runs under — or,
//! when `cgroup_parent` starts with `/`, under that path from the root of each
//! hierarchy: a subtree that root (or systemd, `Delegate=yes`) delegated to the
//! worker's user.
//!
//! # Probing by doing
//!
//! A parent that exists is no proof that we may use it (root may have created it, or
//! a previous run as another user). [`detect`] therefore creates a real call cgroup
//! with limits, moves a throwaway process into it and removes it again, exactly as a
//! call would; only a backend that passed is used.

pub mod v1;
pub mod v2;

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;

/// One `thiserror` enum per module: cgroup failures.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot create cgroup {path}: {source}")]
    Create {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot remove cgroup {path}: {source}")]
    Remove {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("no usable cgroup hierarchy: {0}")]
    Unavailable(String),
    /// One hierarchy (or the probe) does not qualify; [`detect`] collects these into
    /// [`CgroupError::Unavailable`].
    #[error("{0}")]
    Unsuitable(String),
}

/// Which cgroup interface enforces the limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupVersion {
    V1,
    V2,
}

impl fmt::Display for CgroupVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        })
    }
}

/// The limits written into each call's cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CgroupLimits {
    pub memory_bytes: u64,
    pub pids: u64,
    /// CPU bandwidth in thousandths of a CPU (1000 = one CPU).
    pub cpu_millis: u64,
}

/// CPU period for the bandwidth limit: 100 ms, the kernel's default.
pub(crate) const CPU_PERIOD_US: u64 = 100_000;

impl CgroupLimits {
    pub(crate) fn cpu_quota_us(&self) -> u64 {
        (self.cpu_millis.saturating_mul(CPU_PERIOD_US) / 1000).max(1000)
    }
}

/// A cgroup implementation: creates the per-call cgroups.
pub trait CgroupBackend: Send + Sync + fmt::Debug {
    fn version(&self) -> CgroupVersion;
    /// Whether the per-call cgroup limits swap to zero (memory.swap.max or memsw).
    fn limits_swap(&self) -> bool;
    /// Creates the cgroup of one call, with its limits written.
    fn create(&self, limits: &CgroupLimits) -> Result<Box<dyn CallCgroup>, CgroupError>;
    /// Limits the parent of the calls, so that all calls together stay within `total`
    /// (memory and pids; CPU is shared by the calls' own bandwidth limits).
    fn limit_parent(&self, total: &CgroupLimits) -> Result<(), CgroupError>;
}

/// The cgroup of one call.
pub trait CallCgroup: Send {
    /// The cgroup v2 directory for `clone3(CLONE_INTO_CGROUP)`, if any: the child starts
    /// inside it.
    fn clone_into_fd(&self) -> Option<RawFd>;
    /// v1 `tasks` files the child writes `0` to, joining by itself before it does
    /// anything else. Moving the calling thread skips the global threadgroup lock, whose
    /// RCU grace period makes a `cgroup.procs` write from outside cost ~0.25 ms per
    /// hierarchy.
    fn self_join_files(&self) -> Vec<PathBuf>;
    /// Moves `pid` (the sandbox's first process, still waiting) into the cgroup: the
    /// fallback when `clone3(CLONE_INTO_CGROUP)` is unavailable.
    fn join(&self, pid: libc::pid_t) -> Result<(), CgroupError>;
    /// Kills every process in the cgroup, including any that forked or `setsid`ed away.
    fn kill(&self) -> Result<(), CgroupError>;
    /// The processes in the cgroup now (host pids).
    fn processes(&self) -> Result<Vec<libc::pid_t>, CgroupError>;
    /// The peak memory use, when the kernel records it.
    fn peak_memory_bytes(&self) -> Option<u64>;
    /// (user, system) CPU time in microseconds of every process that ran in the cgroup.
    fn cpu_usage_us(&self) -> Option<(u64, u64)>;
    /// Kills what is left, waits for the cgroup to empty, and removes its directories.
    fn remove(&mut self) -> Result<(), CgroupError>;
}

/// Finds a usable cgroup hierarchy and prepares the `parent` cgroup under the worker's
/// own cgroup. Pure v2 with memory, pids and cpu is preferred; then v1.
///
/// The proof by doing (a call cgroup created, joined by a throwaway process and removed,
/// and on a hybrid host the same in the unified tree) runs once per process for each
/// parent and cgroup of our own: a later factory with the same parent only prepares its
/// pool. Every call still creates and joins its own cgroup, and a call whose cgroup
/// cannot be made or joined fails before its command runs, so a verdict that went stale
/// costs that call, never a limit.
pub fn detect(parent: &str) -> Result<Box<dyn CgroupBackend>, CgroupError> {
    let mounts = read_mounts()?;
    let (own_text, own) = read_own_cgroups()?;
    let key = (parent.to_owned(), own_text);
    let known = lock_verdicts()
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| *v);
    // A known verdict prepares the pool only; should that fail (the parent was removed
    // meanwhile, say), the whole proof runs again.
    let prepared: Option<Box<dyn CgroupBackend>> = match known {
        Some(Verdict::V2) => v2::V2::detect(&mounts, &own, parent)
            .ok()
            .map(|b| Box::new(b) as Box<dyn CgroupBackend>),
        Some(Verdict::V1 { unified }) => v1::V1::detect(&mounts, &own, parent, Some(unified))
            .ok()
            .map(|b| Box::new(b) as Box<dyn CgroupBackend>),
        None => None,
    };
    if let Some(backend) = prepared {
        return Ok(backend);
    }
    VERIFICATIONS.fetch_add(1, Ordering::Relaxed);
    let (backend, verdict): (Box<dyn CgroupBackend>, Verdict) =
        match v2::V2::detect(&mounts, &own, parent).and_then(verified) {
            Ok(v2) => (Box::new(v2), Verdict::V2),
            Err(v2_error) => match v1_verified(&mounts, &own, parent) {
                Ok(v1) => {
                    let unified = v1.has_unified();
                    (Box::new(v1), Verdict::V1 { unified })
                }
                Err(v1_error) => {
                    return Err(CgroupError::Unavailable(format!(
                        "cgroup v2: {v2_error}; cgroup v1: {v1_error}"
                    )));
                }
            },
        };
    let mut verdicts = lock_verdicts();
    verdicts.retain(|(k, _)| *k != key);
    verdicts.push((key, verdict));
    Ok(backend)
}

/// The v1 backend, proved: first with the unified tree of a hybrid host joined too (for
/// `cgroup.kill`), in one probe process; if that fails, without it (the freezer kills).
fn v1_verified(
    mounts: &[CgroupMount],
    own: &[OwnCgroup],
    parent: &str,
) -> Result<v1::V1, CgroupError> {
    let with_unified = v1::V1::detect(mounts, own, parent, None).and_then(verified);
    match with_unified {
        Ok(v1) => Ok(v1),
        Err(e) if !v1::unified_tree_offered(mounts, own) => Err(e),
        Err(_) => v1::V1::detect(mounts, own, parent, Some(false)).and_then(verified),
    }
}

/// Which backend passed the proof for one parent (v1: whether the unified tree of a
/// hybrid host could join and kill too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    V2,
    V1 { unified: bool },
}

/// Verdicts by (`cgroup_parent`, the text of `/proc/self/cgroup`): a process moved to
/// another cgroup has other parents and is proved again.
type Verdicts = Vec<((String, String), Verdict)>;

static VERDICTS: Mutex<Verdicts> = Mutex::new(Vec::new());

/// How many times this process has run the full proof.
pub(crate) static VERIFICATIONS: AtomicU64 = AtomicU64::new(0);

fn lock_verdicts() -> std::sync::MutexGuard<'static, Verdicts> {
    // A poisoned lock only means a detection panicked; the list is still consistent.
    VERDICTS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Forgets every verdict (the process confined itself: see [`crate::probe`]).
pub(crate) fn forget_verdicts() {
    lock_verdicts().clear();
}

/// Whether a cgroup v2 tree with the memory, pids and cpu controllers is mounted (for
/// choosing which fix to name when none is usable).
pub fn host_has_v2_controllers() -> bool {
    let Ok(mounts) = read_mounts() else {
        return false;
    };
    mounts.iter().filter(|m| m.fstype == "cgroup2").any(|m| {
        read(&m.mount_point.join("cgroup.controllers")).is_ok_and(|c| {
            ["memory", "pids", "cpu"]
                .iter()
                .all(|want| c.split_whitespace().any(|have| have == *want))
        })
    })
}

/// `cgroup_parent` as configured: a name under our own cgroup, or a path from the
/// root of each hierarchy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ParentSpec<'a> {
    UnderOwn(&'a str),
    FromRoot(&'a str),
}

impl<'a> ParentSpec<'a> {
    pub(crate) fn of(parent: &'a str) -> Self {
        match parent.strip_prefix('/') {
            Some(rest) => ParentSpec::FromRoot(rest),
            None => ParentSpec::UnderOwn(parent),
        }
    }
}

/// Whether `parent` is a valid `cgroup_parent`: a plain name, or `/`-separated plain
/// names after a leading `/` (no `.`, `..`, empty or `cgroup.*` components).
pub fn valid_parent(parent: &str) -> bool {
    let plain =
        |name: &str| !name.is_empty() && !name.starts_with('.') && !name.starts_with("cgroup.");
    match ParentSpec::of(parent) {
        ParentSpec::UnderOwn(name) => plain(name) && !name.contains('/'),
        ParentSpec::FromRoot(path) => path.split('/').all(plain),
    }
}

/// The parent cgroup's directory in `mount`, given our own cgroup path there.
pub(crate) fn parent_dir(mount: &CgroupMount, own_path: &str, parent: &str) -> PathBuf {
    match ParentSpec::of(parent) {
        ParentSpec::FromRoot(path) => mount.mount_point.join(path),
        ParentSpec::UnderOwn(name) => own_dir(mount, own_path).join(name),
    }
}

/// Creates one call cgroup with limits, moves a throwaway process into it and removes
/// it: the whole life of a call's cgroup, so that a backend that passes works for calls.
fn verified<B: CgroupBackend>(backend: B) -> Result<B, CgroupError> {
    let limits = CgroupLimits {
        memory_bytes: 64 << 20,
        pids: 8,
        cpu_millis: 100,
    };
    let mut call = backend.create(&limits)?;
    let joined = join_probe_process(call.as_ref());
    let removed = call.remove();
    joined.and(removed).map(|()| backend)
}

/// Moves a short-lived child into `call` the way a sandbox joins it — started inside
/// the unified cgroup by `clone3(CLONE_INTO_CGROUP)` where the call has one (else moved
/// there through `cgroup.procs`, the fallback calls use too), writing its v1 `tasks`
/// files itself — then lets it exit and reaps it. Starting it inside also spares the
/// probe the RCU grace period that moving a process from outside costs.
pub(crate) fn join_probe_process(call: &dyn CallCgroup) -> Result<(), CgroupError> {
    let unsuitable = |what: &str, e: io::Error| CgroupError::Unsuitable(format!("{what}: {e}"));
    let tasks = call
        .self_join_files()
        .iter()
        .map(|p| crate::sys::path_cstring(p))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| unsuitable("a cgroup path is not a C string", e))?;
    let pipe = || crate::sys::pipe().map_err(|e| unsuitable("cannot create a pipe", e));
    let (release_r, release_w) = pipe()?;
    let (report_r, report_w) = pipe()?;
    let start = || {
        let cloned = match call.clone_into_fd() {
            // SAFETY: the child only calls open, write, read, close and _exit (see
            // below), all async-signal-safe, on strings prepared before.
            Some(fd) => unsafe { crate::namespaces::clone_into_cgroup(0, fd) },
            None => Ok(None),
        };
        match cloned {
            Ok(Some(pid)) => Ok((pid, true)),
            // SAFETY: as above.
            Ok(None) => unsafe { crate::namespaces::clone_process(0) }.map(|pid| (pid, false)),
            Err(e) => Err(e),
        }
    };
    let (pid, inside) = start().map_err(|e| {
        CgroupError::Unsuitable(format!("cannot start the cgroup probe process: {e}"))
    })?;
    if pid == 0 {
        // The child: wait for the release (the parent joins us first when the clone
        // could not), join the v1 hierarchies, report 0 or the errno, exit without
        // running any destructor.
        let mut byte = 0u8;
        // SAFETY: reading one byte into a valid buffer from our copy of the pipe.
        unsafe { libc::read(release_r.as_raw_fd(), (&raw mut byte).cast(), 1) };
        let mut errno = 0i32;
        for path in &tasks {
            // SAFETY: `path` is NUL-terminated.
            let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
            if fd == -1 || crate::sys::write_all_raw(fd, b"0").is_err() {
                errno = crate::sys::errno();
            }
            if fd != -1 {
                // SAFETY: closing the descriptor opened above, once.
                unsafe { libc::close(fd) };
            }
            if errno != 0 {
                break;
            }
        }
        let report = errno.to_ne_bytes();
        // SAFETY: writing four bytes from a valid buffer, then ending the child.
        unsafe {
            libc::write(report_w.as_raw_fd(), report.as_ptr().cast(), report.len());
            libc::_exit(0);
        }
    }
    drop((release_r, report_w));
    let joined = if inside { Ok(()) } else { call.join(pid) };
    // A byte, not only end-of-file, releases the child: a probe or sandbox child that
    // another thread forked meanwhile holds a copy of our write end until it execs or
    // exits, and end-of-file alone would wait for it — two probes forked at once then
    // wait for each other for ever.
    let release = 1u8;
    // SAFETY: writing one byte from a valid buffer to our own pipe.
    unsafe { libc::write(release_w.as_raw_fd(), (&raw const release).cast(), 1) };
    drop(release_w);
    let mut report = [0u8; 4];
    // SAFETY: reading up to four bytes into a valid buffer from our own pipe.
    let n = unsafe { libc::read(report_r.as_raw_fd(), report.as_mut_ptr().cast(), 4) };
    let mut status = 0;
    // SAFETY: `status` is a valid out-pointer; waits for our own child.
    while unsafe { libc::waitpid(pid, &mut status, 0) } == -1 {
        if crate::sys::errno() != libc::EINTR {
            break;
        }
    }
    joined?;
    match (n, i32::from_ne_bytes(report)) {
        (4, 0) => Ok(()),
        (4, errno) => Err(CgroupError::Unsuitable(format!(
            "a process cannot join its v1 cgroups: {}",
            io::Error::from_raw_os_error(errno)
        ))),
        _ => Err(CgroupError::Unsuitable(
            "the cgroup probe process ended without an answer".into(),
        )),
    }
}

/// A cgroup mount from /proc/self/mountinfo.
#[derive(Debug, Clone)]
pub(crate) struct CgroupMount {
    /// The cgroup path that the mount shows at its mount point.
    root: String,
    mount_point: PathBuf,
    /// `cgroup2`, or `cgroup` for v1.
    fstype: String,
    /// v1 controllers of the hierarchy (from the super options).
    controllers: Vec<String>,
}

/// The calling process's cgroup in one hierarchy, from /proc/self/cgroup.
#[derive(Debug, Clone)]
pub(crate) struct OwnCgroup {
    /// Empty for the unified hierarchy.
    controllers: Vec<String>,
    path: String,
}

fn read_mounts() -> Result<Vec<CgroupMount>, CgroupError> {
    let path = Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.into(),
        source,
    })?;
    Ok(parse_mountinfo(&text))
}

/// The cgroup mounts of a mountinfo(5) text.
fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    let mut mounts = Vec::new();
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let left: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        let (Some(root), Some(mount_point), Some(fstype), Some(options)) =
            (left.get(3), left.get(4), right.first(), right.get(2))
        else {
            continue;
        };
        if *fstype != "cgroup" && *fstype != "cgroup2" {
            continue;
        }
        mounts.push(CgroupMount {
            root: (*root).to_owned(),
            mount_point: PathBuf::from(mount_point.replace("\\040", " ")),
            fstype: (*fstype).to_owned(),
            controllers: options.split(',').map(str::to_owned).collect(),
        });
    }
    mounts
}

/// Our own cgroups, with the text they were parsed from.
fn read_own_cgroups() -> Result<(String, Vec<OwnCgroup>), CgroupError> {
    let path = Path::new("/proc/self/cgroup");
    let text = std::fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.into(),
        source,
    })?;
    let own = parse_own_cgroups(&text);
    Ok((text, own))
}

/// The entries of a /proc/<pid>/cgroup text.
fn parse_own_cgroups(text: &str) -> Vec<OwnCgroup> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let _id = parts.next()?;
            let controllers = parts.next()?;
            let path = parts.next()?;
            Some(OwnCgroup {
                controllers: controllers
                    .split(',')
                    .filter(|c| !c.is_empty())
                    .map(str::to_owned)
                    .collect(),
                path: path.to_owned(),
            })
        })
        .collect()
}

/// The directory of our own cgroup inside `mount`.
pub(crate) fn own_dir(mount: &CgroupMount, own_path: &str) -> PathBuf {
    let rel = own_path
        .strip_prefix(mount.root.as_str())
        .unwrap_or(own_path);
    let rel = rel.trim_start_matches('/');
    if rel.is_empty() {
        mount.mount_point.clone()
    } else {
        mount.mount_point.join(rel)
    }
}

/// The name of one sandbox factory's pool below the shared parent. Several workers (and
/// tests) may share one parent cgroup; each gets a pool of its own, so that the limit on
/// all of its calls together (`max_concurrent` × one call's) is its own, and so that the
/// pool's limit files are created — and owned — by us even in a delegated parent.
pub(crate) fn pool_name() -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    format!("pool-{}-{seq}", std::process::id())
}

/// Creates the pool `name` below `parent`, first removing pools whose process is gone
/// (a worker killed outright leaves its empty pool behind; a pool still holding calls
/// cannot be removed, so a reused pid does no harm).
pub(crate) fn create_pool(parent: &Path, name: &str) -> Result<PathBuf, CgroupError> {
    if let Ok(entries) = std::fs::read_dir(parent) {
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let Some(pid) = file_name
                .to_str()
                .and_then(|n| n.strip_prefix("pool-"))
                .and_then(|rest| rest.split('-').next())
            else {
                continue;
            };
            if !Path::new("/proc").join(pid).exists() {
                let _ = std::fs::remove_dir(entry.path());
            }
        }
    }
    let pool = parent.join(name);
    mkdir(&pool)?;
    Ok(pool)
}

/// The directories of `parent` in every mounted hierarchy (for tests to remove them).
#[cfg(test)]
pub(crate) fn parent_dirs(parent: &str) -> Vec<PathBuf> {
    let (Ok(mounts), Ok((_, own))) = (read_mounts(), read_own_cgroups()) else {
        return Vec::new();
    };
    mounts
        .iter()
        .filter_map(|m| {
            let own = own.iter().find(|o| match m.fstype.as_str() {
                "cgroup2" => o.controllers.is_empty(),
                _ => o.controllers.iter().any(|c| m.controllers.contains(c)),
            })?;
            Some(parent_dir(m, &own.path, parent))
        })
        .collect()
}

/// Removes a pool when its factory goes (its calls are gone by then).
pub(crate) fn remove_pool(pool: &Path) {
    let _ = std::fs::remove_dir(pool);
}

/// A unique name for a call's cgroup.
pub(crate) fn call_name() -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    format!("call-{}-{seq}", std::process::id())
}

pub(crate) fn mkdir(path: &Path) -> Result<(), CgroupError> {
    match std::fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(CgroupError::Create {
            path: path.into(),
            source,
        }),
    }
}

pub(crate) fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    crate::sys::write_file(path, value.as_bytes()).map_err(|source| CgroupError::Write {
        path: path.into(),
        source,
    })
}

pub(crate) fn read(path: &Path) -> Result<String, CgroupError> {
    std::fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.into(),
        source,
    })
}

pub(crate) fn read_u64(path: &Path) -> Option<u64> {
    read(path).ok()?.trim().parse().ok()
}

/// The pids listed in a `cgroup.procs` file.
pub(crate) fn procs(dir: &Path) -> Result<Vec<libc::pid_t>, CgroupError> {
    Ok(read(&dir.join("cgroup.procs"))?
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect())
}

/// SIGKILLs every process listed in `dir`, again and again until none is left: a
/// process forking while we kill shows up in the next round, and the pids limit bounds
/// how many there can be. The pause between rounds doubles (100 µs up to 20 ms): a
/// killed process leaves the list within a round or two on an idle host, and on a busy
/// one, where dying takes tens of milliseconds, a fixed 1 ms pause woke the supervising
/// thread dozens of times for one kill.
pub(crate) fn kill_until_empty(dir: &Path) -> Result<(), CgroupError> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut pause = Duration::from_micros(100);
    loop {
        let pids = procs(dir)?;
        if pids.is_empty() || Instant::now() > deadline {
            return Ok(());
        }
        for pid in pids {
            // SAFETY: kill takes no pointers; a stale pid yields ESRCH, which we ignore.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// Removes a cgroup directory once its processes are gone (they may still be exiting
/// right after a kill, which makes rmdir answer EBUSY for a moment).
pub(crate) fn rmdir_when_empty(dir: &Path) -> Result<(), CgroupError> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut pause = Duration::from_micros(100);
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                let _ = kill_until_empty(dir);
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(20));
            }
            Err(source) => {
                return Err(CgroupError::Remove {
                    path: dir.into(),
                    source,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hybrid host (this project's CI machines): v1 controllers plus a controller-less
    /// unified tree, the process in a v1 memory cgroup of its own.
    const HYBRID_MOUNTINFO: &str = "\
30 24 0:26 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
33 30 0:29 / /sys/fs/cgroup/memory rw,nosuid shared:14 - cgroup cgroup rw,memory
34 30 0:30 / /sys/fs/cgroup/pids rw,nosuid shared:15 - cgroup cgroup rw,pids
35 30 0:31 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:16 - cgroup cgroup rw,cpu,cpuacct
36 30 0:32 / /sys/fs/cgroup/freezer rw,nosuid shared:17 - cgroup cgroup rw,freezer
40 24 0:5 / /proc rw,nosuid shared:12 - proc proc rw
";
    const HYBRID_CGROUP: &str = "\
5:freezer:/
4:cpu,cpuacct:/user.slice
3:pids:/user.slice/user-1000.slice
2:memory:/process_api/9cdec40d
0::/user.slice/user-1000.slice/session-2.scope
";
    /// A pure v2 container whose cgroup namespace shows its own cgroup as `/`.
    const V2_MOUNTINFO: &str = "\
612 600 0:31 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw,nsdelegate
";
    const V2_CGROUP: &str = "0::/\n";
    /// A v1-only host (no cgroup2 tree at all), the hierarchies mounted from a
    /// sub-cgroup as a container runtime shows them.
    const V1_MOUNTINFO: &str = "\
25 20 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:23 /docker/3f2a /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
27 25 0:24 /docker/3f2a /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids
28 25 0:25 /docker/3f2a /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
29 25 0:26 /docker/3f2a /sys/fs/cgroup/systemd rw,nosuid - cgroup cgroup rw,xattr,name=systemd
";
    const V1_CGROUP: &str = "\
4:cpu,cpuacct:/docker/3f2a/worker
3:pids:/docker/3f2a/worker
2:memory:/docker/3f2a/worker
1:name=systemd:/docker/3f2a
";

    #[test]
    fn hybrid_mountinfo_yields_every_hierarchy_with_its_controllers() {
        let mounts = parse_mountinfo(HYBRID_MOUNTINFO);
        let kinds: Vec<(&str, &str)> = mounts
            .iter()
            .map(|m| (m.fstype.as_str(), m.mount_point.to_str().unwrap_or("")))
            .collect();
        assert_eq!(
            kinds,
            [
                ("cgroup2", "/sys/fs/cgroup/unified"),
                ("cgroup", "/sys/fs/cgroup/memory"),
                ("cgroup", "/sys/fs/cgroup/pids"),
                ("cgroup", "/sys/fs/cgroup/cpu,cpuacct"),
                ("cgroup", "/sys/fs/cgroup/freezer"),
            ]
        );
        assert!(mounts[3].controllers.iter().any(|c| c == "cpuacct"));
    }

    #[test]
    fn own_cgroups_parse_with_and_without_controllers() {
        let own = parse_own_cgroups(HYBRID_CGROUP);
        assert_eq!(own.len(), 5);
        assert_eq!(own[1].controllers, ["cpu", "cpuacct"]);
        assert_eq!(own[3].path, "/process_api/9cdec40d");
        assert!(own[4].controllers.is_empty());
        assert_eq!(own[4].path, "/user.slice/user-1000.slice/session-2.scope");
    }

    #[test]
    fn parents_under_our_own_cgroup_or_from_the_root() {
        let mounts = parse_mountinfo(HYBRID_MOUNTINFO);
        let own = parse_own_cgroups(HYBRID_CGROUP);
        let memory = &mounts[1];
        assert_eq!(
            parent_dir(memory, &own[3].path, "airlock"),
            Path::new("/sys/fs/cgroup/memory/process_api/9cdec40d/airlock")
        );
        assert_eq!(
            parent_dir(memory, &own[3].path, "/airlock-alice"),
            Path::new("/sys/fs/cgroup/memory/airlock-alice")
        );
        assert_eq!(
            parent_dir(memory, &own[3].path, "/delegated/alice"),
            Path::new("/sys/fs/cgroup/memory/delegated/alice")
        );
        let v2 = parse_mountinfo(V2_MOUNTINFO);
        let v2_own = parse_own_cgroups(V2_CGROUP);
        assert_eq!(
            parent_dir(&v2[0], &v2_own[0].path, "airlock"),
            Path::new("/sys/fs/cgroup/airlock")
        );
    }

    #[test]
    fn a_v1_only_host_has_no_unified_tree_and_maps_paths_below_the_mount_root() {
        let mounts = parse_mountinfo(V1_MOUNTINFO);
        let points: Vec<&str> = mounts
            .iter()
            .map(|m| m.mount_point.to_str().unwrap_or(""))
            .collect();
        assert_eq!(
            points,
            [
                "/sys/fs/cgroup/memory",
                "/sys/fs/cgroup/pids",
                "/sys/fs/cgroup/cpu,cpuacct",
                "/sys/fs/cgroup/systemd",
            ]
        );
        assert!(mounts.iter().all(|m| m.fstype == "cgroup"));
        assert_eq!(mounts[0].root, "/docker/3f2a");
        assert!(mounts[3].controllers.iter().any(|c| c == "name=systemd"));
        let own = parse_own_cgroups(V1_CGROUP);
        assert_eq!(own.len(), 4);
        assert!(own.iter().all(|o| !o.controllers.is_empty()), "{own:?}");
        assert_eq!(own[0].controllers, ["cpu", "cpuacct"]);
        // Our cgroup and the parents, below the mount root the container sees.
        let memory = &mounts[0];
        assert_eq!(
            own_dir(memory, &own[2].path),
            Path::new("/sys/fs/cgroup/memory/worker")
        );
        assert_eq!(
            parent_dir(memory, &own[2].path, "airlock"),
            Path::new("/sys/fs/cgroup/memory/worker/airlock")
        );
        assert_eq!(
            parent_dir(memory, &own[2].path, "/airlock-alice"),
            Path::new("/sys/fs/cgroup/memory/airlock-alice")
        );
        // The unified backend declines before touching anything.
        match v2::V2::detect(&mounts, &own, "airlock") {
            Err(CgroupError::Unsuitable(why)) => assert_eq!(why, "no cgroup2 mount"),
            Err(other) => panic!("unexpected error: {other}"),
            Ok(_) => panic!("a v2 backend on a host without cgroup2"),
        }
    }

    #[test]
    fn cgroup_parent_names_are_plain() {
        for good in ["airlock", "/airlock-alice", "/user.slice/airlock"] {
            assert!(valid_parent(good), "{good}");
        }
        for bad in [
            "",
            "a/b",
            ".hidden",
            "cgroup.procs",
            "/",
            "/a//b",
            "/a/../b",
            "/a/./b",
            "/a/",
            "/cgroup.kill",
        ] {
            assert!(!valid_parent(bad), "{bad:?}");
        }
    }
}
