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
//! hierarchy, so they stay inside whatever limits the worker itself runs under.

pub mod v1;
pub mod v2;

use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// The peak memory use, when the kernel records it.
    fn peak_memory_bytes(&self) -> Option<u64>;
    /// (user, system) CPU time in microseconds of every process that ran in the cgroup.
    fn cpu_usage_us(&self) -> Option<(u64, u64)>;
    /// Kills what is left, waits for the cgroup to empty, and removes its directories.
    fn remove(&mut self) -> Result<(), CgroupError>;
}

/// Finds a usable cgroup hierarchy and prepares the `parent` cgroup under the worker's
/// own cgroup. Pure v2 with memory, pids and cpu is preferred; then v1.
pub fn detect(parent: &str) -> Result<Box<dyn CgroupBackend>, CgroupError> {
    let mounts = read_mounts()?;
    let own = read_own_cgroups()?;
    let v2_error = match v2::V2::detect(&mounts, &own, parent) {
        Ok(v2) => return Ok(Box::new(v2)),
        Err(e) => e,
    };
    match v1::V1::detect(&mounts, &own, parent) {
        Ok(v1) => Ok(Box::new(v1)),
        Err(v1_error) => Err(CgroupError::Unavailable(format!(
            "cgroup v2: {v2_error}; cgroup v1: {v1_error}"
        ))),
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
    Ok(mounts)
}

fn read_own_cgroups() -> Result<Vec<OwnCgroup>, CgroupError> {
    let path = Path::new("/proc/self/cgroup");
    let text = std::fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.into(),
        source,
    })?;
    Ok(text
        .lines()
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
        .collect())
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
/// how many there can be.
pub(crate) fn kill_until_empty(dir: &Path) -> Result<(), CgroupError> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let pids = procs(dir)?;
        if pids.is_empty() || Instant::now() > deadline {
            return Ok(());
        }
        for pid in pids {
            // SAFETY: kill takes no pointers; a stale pid yields ESRCH, which we ignore.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(1));
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
