//! cgroup v2: the unified hierarchy with the memory, pids and cpu controllers.
//!
//! Layout: `<own cgroup>/<parent>/call-<pid>-<n>`. `<own cgroup>` delegates the three
//! controllers to `<parent>`, which delegates them to the calls. The kernel's "no
//! internal processes" rule forbids enabling controllers for the children of a cgroup
//! that holds processes (other than the root): when the worker's own cgroup holds
//! processes — typical in a container, whose cgroup is the pod's — they are moved into a
//! leaf `<own cgroup>/<parent>-worker` first, the way container init systems do.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use super::{
    CPU_PERIOD_US, CallCgroup, CgroupBackend, CgroupError, CgroupLimits, CgroupMount,
    CgroupVersion, OwnCgroup,
};

const CONTROLLERS: [&str; 3] = ["memory", "pids", "cpu"];

#[derive(Debug)]
pub struct V2 {
    /// This factory's pool below the shared parent; calls are its children.
    parent: PathBuf,
    has_swap: bool,
}

impl V2 {
    pub(crate) fn detect(
        mounts: &[CgroupMount],
        own: &[OwnCgroup],
        parent_name: &str,
    ) -> Result<Self, CgroupError> {
        let mount = mounts
            .iter()
            .find(|m| m.fstype == "cgroup2")
            .ok_or_else(|| CgroupError::Unsuitable("no cgroup2 mount".into()))?;
        let own_path = own
            .iter()
            .find(|o| o.controllers.is_empty())
            .map(|o| o.path.clone())
            .ok_or_else(|| {
                CgroupError::Unsuitable("no unified entry in /proc/self/cgroup".into())
            })?;
        let parent = super::parent_dir(mount, &own_path, parent_name);
        // A parent given from the root (`[sandbox] cgroup_parent = "/…"`) is a subtree
        // someone delegated to us: its own parent must already hand it the controllers,
        // and we never move other processes around there. A parent under our own cgroup
        // is ours to set up.
        let base = match super::ParentSpec::of(parent_name) {
            super::ParentSpec::FromRoot(_) => parent
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| mount.mount_point.clone()),
            super::ParentSpec::UnderOwn(_) => super::own_dir(mount, &own_path),
        };
        let available = super::read(&base.join("cgroup.controllers"))?;
        let missing: Vec<&str> = CONTROLLERS
            .iter()
            .copied()
            .filter(|c| !available.split_whitespace().any(|a| a == *c))
            .collect();
        if !missing.is_empty() {
            return Err(CgroupError::Unsuitable(format!(
                "controllers {} are not enabled in {}",
                missing.join(", "),
                base.display()
            )));
        }

        super::mkdir(&parent)?;
        if matches!(
            super::ParentSpec::of(parent_name),
            super::ParentSpec::UnderOwn(_)
        ) {
            enable_controllers(&base, parent_name)?;
        }
        super::write(&parent.join("cgroup.subtree_control"), "+memory +pids +cpu")?;
        let pool = super::create_pool(&parent, &super::pool_name())?;
        let v2 = V2 {
            parent: pool,
            has_swap: parent.join("memory.swap.max").exists(),
        };
        super::write(
            &v2.parent.join("cgroup.subtree_control"),
            "+memory +pids +cpu",
        )?;
        Ok(v2)
    }
}

impl Drop for V2 {
    fn drop(&mut self) {
        super::remove_pool(&self.parent);
    }
}

/// Enables the controllers in `base` for its children; moves the processes of `base`
/// into a leaf first when the "no internal processes" rule requires it.
fn enable_controllers(base: &Path, parent_name: &str) -> Result<(), CgroupError> {
    let control = base.join("cgroup.subtree_control");
    let want = "+memory +pids +cpu";
    match super::write(&control, want) {
        Ok(()) => Ok(()),
        Err(CgroupError::Write { source, .. }) if source.raw_os_error() == Some(libc::EBUSY) => {
            let leaf = base.join(format!("{parent_name}-worker"));
            super::mkdir(&leaf)?;
            for pid in super::procs(base)? {
                // A process may exit in between; that is fine.
                let _ = super::write(&leaf.join("cgroup.procs"), &pid.to_string());
            }
            super::write(&control, want)
        }
        Err(e) => Err(e),
    }
}

impl CgroupBackend for V2 {
    fn version(&self) -> CgroupVersion {
        CgroupVersion::V2
    }

    fn limits_swap(&self) -> bool {
        self.has_swap
    }

    fn limit_parent(&self, total: &CgroupLimits) -> Result<(), CgroupError> {
        super::write(
            &self.parent.join("memory.max"),
            &total.memory_bytes.to_string(),
        )?;
        if self.has_swap {
            super::write(&self.parent.join("memory.swap.max"), "0")?;
        }
        super::write(&self.parent.join("pids.max"), &total.pids.to_string())
    }

    fn create(&self, limits: &CgroupLimits) -> Result<Box<dyn CallCgroup>, CgroupError> {
        let dir = self.parent.join(super::call_name());
        super::mkdir(&dir)?;
        let fd = open_dir(&dir);
        let mut call = CallV2 {
            dir,
            fd,
            removed: false,
        };
        call.limit(limits, self.has_swap)?;
        Ok(Box::new(call))
    }
}

/// A per-call cgroup in the unified hierarchy (also used by v1 hosts for killing).
#[derive(Debug)]
pub(crate) struct CallV2 {
    dir: PathBuf,
    /// O_PATH descriptor of `dir`, for `CLONE_INTO_CGROUP`.
    fd: Option<OwnedFd>,
    removed: bool,
}

impl CallV2 {
    /// A controller-less call cgroup under `parent`, used only to join and kill.
    pub(crate) fn create_plain(parent: &Path) -> Result<Self, CgroupError> {
        let dir = parent.join(super::call_name());
        super::mkdir(&dir)?;
        let fd = open_dir(&dir);
        Ok(CallV2 {
            dir,
            fd,
            removed: false,
        })
    }

    fn limit(&mut self, limits: &CgroupLimits, swap: bool) -> Result<(), CgroupError> {
        let result = (|| {
            super::write(
                &self.dir.join("memory.max"),
                &limits.memory_bytes.to_string(),
            )?;
            if swap {
                super::write(&self.dir.join("memory.swap.max"), "0")?;
            }
            super::write(&self.dir.join("pids.max"), &limits.pids.to_string())?;
            super::write(
                &self.dir.join("cpu.max"),
                &format!("{} {CPU_PERIOD_US}", limits.cpu_quota_us()),
            )
        })();
        if result.is_err() {
            let _ = self.remove();
        }
        result
    }
}

/// An O_PATH descriptor of a cgroup directory (`None` if it cannot be opened: the
/// parent then joins the child the classic way).
fn open_dir(dir: &Path) -> Option<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(dir)
        .ok()
        .map(OwnedFd::from)
}

impl CallCgroup for CallV2 {
    fn clone_into_fd(&self) -> Option<RawFd> {
        self.fd.as_ref().map(AsRawFd::as_raw_fd)
    }

    fn self_join_files(&self) -> Vec<PathBuf> {
        Vec::new()
    }

    fn join(&self, pid: libc::pid_t) -> Result<(), CgroupError> {
        super::write(&self.dir.join("cgroup.procs"), &pid.to_string())
    }

    fn kill(&self) -> Result<(), CgroupError> {
        let kill = self.dir.join("cgroup.kill");
        if kill.exists() {
            // Linux 5.14+: the kernel kills every process, including ones being forked.
            return super::write(&kill, "1");
        }
        // Older kernels: freeze so nothing can fork, SIGKILL everyone, thaw, then kill
        // round after round until the cgroup is empty.
        let freeze = self.dir.join("cgroup.freeze");
        let _ = super::write(&freeze, "1");
        for pid in super::procs(&self.dir).unwrap_or_default() {
            // SAFETY: kill takes no pointers; a stale pid yields ESRCH.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = super::write(&freeze, "0");
        super::kill_until_empty(&self.dir)
    }

    fn processes(&self) -> Result<Vec<libc::pid_t>, CgroupError> {
        super::procs(&self.dir)
    }

    fn peak_memory_bytes(&self) -> Option<u64> {
        super::read_u64(&self.dir.join("memory.peak"))
    }

    fn cpu_usage_us(&self) -> Option<(u64, u64)> {
        let stat = super::read(&self.dir.join("cpu.stat")).ok()?;
        let field = |name: &str| {
            stat.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<u64>().ok())
        };
        Some((field("user_usec ")?, field("system_usec ")?))
    }

    fn remove(&mut self) -> Result<(), CgroupError> {
        if self.removed {
            return Ok(());
        }
        let _ = self.kill();
        super::rmdir_when_empty(&self.dir)?;
        self.removed = true;
        Ok(())
    }
}

impl Drop for CallV2 {
    fn drop(&mut self) {
        // Every exit path removes the cgroup; this only catches an early return.
        let _ = self.remove();
    }
}
