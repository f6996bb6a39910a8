//! cgroup v1: one hierarchy per controller (memory, pids, cpu; cpuacct and freezer when
//! mounted). Each call gets a directory in every one of them and joins them all.
//!
//! Killing: a v1 hierarchy has no `cgroup.kill`. On hybrid hosts a controller-less
//! cgroup2 tree is mounted as well (usually `/sys/fs/cgroup/unified`); the call joins a
//! cgroup there too and is killed through its `cgroup.kill`. Otherwise the freezer
//! stops forks while every listed process is SIGKILLed, or, without a freezer, the
//! processes are SIGKILLed round after round until the pids hierarchy lists none.

use std::os::fd::RawFd;
use std::path::PathBuf;

use super::v2::CallV2;
use super::{
    CPU_PERIOD_US, CallCgroup, CgroupBackend, CgroupError, CgroupLimits, CgroupMount,
    CgroupVersion, OwnCgroup,
};

#[derive(Debug)]
pub struct V1 {
    memory: PathBuf,
    pids: PathBuf,
    cpu: PathBuf,
    cpuacct: Option<PathBuf>,
    freezer: Option<PathBuf>,
    /// Parent cgroup in the unified tree of a hybrid host, if it offers `cgroup.kill`.
    unified: Option<PathBuf>,
    memsw: bool,
}

impl V1 {
    /// `unified`: whether an earlier proof in this process found the unified tree
    /// usable for killing (`None`: find out now, by moving a throwaway process there).
    pub(crate) fn detect(
        mounts: &[CgroupMount],
        own: &[OwnCgroup],
        parent_name: &str,
        unified: Option<bool>,
    ) -> Result<Self, CgroupError> {
        let parent_of = |controller: &str| -> Option<PathBuf> {
            let mount = mounts
                .iter()
                .find(|m| m.fstype == "cgroup" && m.controllers.iter().any(|c| c == controller))?;
            let own = own
                .iter()
                .find(|o| o.controllers.iter().any(|c| c == controller))?;
            Some(super::parent_dir(mount, &own.path, parent_name))
        };
        let required = |controller: &str| {
            parent_of(controller).ok_or_else(|| {
                CgroupError::Unsuitable(format!("the {controller} controller is not mounted"))
            })
        };
        let memory = required("memory")?;
        let pids = required("pids")?;
        let cpu = required("cpu")?;
        // Unless an earlier proof said otherwise, the unified tree is tried: the proof
        // that follows (`super::verified`) joins it too, and `super::v1_verified` tries
        // again without it when that fails.
        let unified = match unified {
            Some(false) => None,
            None | Some(true) => unified_parent_dir(mounts, own, parent_name),
        };
        // Every extra hierarchy costs a mkdir, a write and an rmdir per call: cpuacct is
        // used only when it shares the cpu hierarchy (wait4 accounts CPU otherwise), the
        // freezer only when the unified tree cannot kill.
        let cpuacct = parent_of("cpuacct").filter(|dir| *dir == cpu);
        let freezer = parent_of("freezer").filter(|_| unified.is_none());
        for dir in [
            Some(&memory),
            Some(&pids),
            Some(&cpu),
            cpuacct.as_ref(),
            freezer.as_ref(),
        ]
        .into_iter()
        .flatten()
        {
            super::mkdir(dir)?;
        }
        // This factory's pool in every hierarchy (see `super::pool_name`).
        let name = super::pool_name();
        let pool = |dir: &PathBuf| super::create_pool(dir, &name);
        let memsw = memory.join("memory.memsw.limit_in_bytes").exists();
        let mut v1 = V1 {
            memory: pool(&memory)?,
            pids: PathBuf::new(),
            cpu: PathBuf::new(),
            cpuacct: None,
            freezer: None,
            unified: None,
            memsw,
        };
        // Filled in one by one so that Drop removes whatever was created so far.
        v1.pids = pool(&pids)?;
        v1.cpu = pool(&cpu)?;
        v1.cpuacct = cpuacct.as_ref().map(pool).transpose()?;
        v1.freezer = freezer.as_ref().map(pool).transpose()?;
        v1.unified = unified.as_ref().map(pool).transpose()?;
        Ok(v1)
    }
}

/// Whether a hybrid host's unified tree is there for calls to join (for `cgroup.kill`).
pub(crate) fn unified_tree_offered(mounts: &[CgroupMount], own: &[OwnCgroup]) -> bool {
    mounts.iter().any(|m| m.fstype == "cgroup2") && own.iter().any(|o| o.controllers.is_empty())
}

/// The parent cgroup in the unified tree of a hybrid host, created, when it offers
/// `cgroup.kill`. Whether a process can really be moved into a child of it (an ordinary
/// user may be able to create the directory but not to move processes there: the
/// kernel also asks for write access to the common ancestor's `cgroup.procs`) is proved
/// with the rest of the backend; without it the freezer or round-after-round SIGKILL
/// does the killing.
fn unified_parent_dir(
    mounts: &[CgroupMount],
    own: &[OwnCgroup],
    parent_name: &str,
) -> Option<PathBuf> {
    let mount = mounts.iter().find(|m| m.fstype == "cgroup2")?;
    let own = own.iter().find(|o| o.controllers.is_empty())?;
    let parent = super::parent_dir(mount, &own.path, parent_name);
    super::mkdir(&parent).ok()?;
    // Every non-root cgroup has cgroup.kill on Linux 5.14+.
    parent.join("cgroup.kill").exists().then_some(parent)
}

impl V1 {
    /// Whether calls also join the unified tree of a hybrid host (to be killed there).
    pub(crate) fn has_unified(&self) -> bool {
        self.unified.is_some()
    }
}

impl Drop for V1 {
    fn drop(&mut self) {
        let mut dirs = vec![&self.memory, &self.pids, &self.cpu];
        dirs.extend(self.cpuacct.iter());
        dirs.extend(self.freezer.iter());
        dirs.extend(self.unified.iter());
        for dir in dirs {
            // The cpuacct pool may be the cpu pool (a shared hierarchy): removed once.
            if !dir.as_os_str().is_empty() {
                super::remove_pool(dir);
            }
        }
    }
}

impl CgroupBackend for V1 {
    fn version(&self) -> CgroupVersion {
        CgroupVersion::V1
    }

    fn limits_swap(&self) -> bool {
        self.memsw
    }

    fn limit_parent(&self, total: &CgroupLimits) -> Result<(), CgroupError> {
        let bytes = total.memory_bytes.to_string();
        super::write(&self.memory.join("memory.limit_in_bytes"), &bytes)?;
        if self.memsw {
            super::write(&self.memory.join("memory.memsw.limit_in_bytes"), &bytes)?;
        }
        super::write(&self.pids.join("pids.max"), &total.pids.to_string())
    }

    fn create(&self, limits: &CgroupLimits) -> Result<Box<dyn CallCgroup>, CgroupError> {
        let name = super::call_name();
        let mut call = CallV1 {
            memory: self.memory.join(&name),
            pids: self.pids.join(&name),
            cpu: self.cpu.join(&name),
            cpuacct: self.cpuacct.as_ref().map(|d| d.join(&name)),
            freezer: self.freezer.as_ref().map(|d| d.join(&name)),
            unified: None,
            removed: false,
        };
        let result = (|| {
            for dir in call.dirs() {
                super::mkdir(dir)?;
            }
            call.unified = match &self.unified {
                Some(parent) => Some(CallV2::create_plain(parent)?),
                None => None,
            };
            let bytes = limits.memory_bytes.to_string();
            super::write(&call.memory.join("memory.limit_in_bytes"), &bytes)?;
            if self.memsw {
                // memory+swap equal to memory: no swap.
                super::write(&call.memory.join("memory.memsw.limit_in_bytes"), &bytes)?;
            }
            super::write(&call.pids.join("pids.max"), &limits.pids.to_string())?;
            super::write(
                &call.cpu.join("cpu.cfs_period_us"),
                &CPU_PERIOD_US.to_string(),
            )?;
            super::write(
                &call.cpu.join("cpu.cfs_quota_us"),
                &limits.cpu_quota_us().to_string(),
            )
        })();
        match result {
            Ok(()) => Ok(Box::new(call)),
            Err(e) => {
                let _ = call.remove();
                Err(e)
            }
        }
    }
}

#[derive(Debug)]
struct CallV1 {
    memory: PathBuf,
    pids: PathBuf,
    cpu: PathBuf,
    cpuacct: Option<PathBuf>,
    freezer: Option<PathBuf>,
    unified: Option<CallV2>,
    removed: bool,
}

impl CallV1 {
    fn dirs(&self) -> impl Iterator<Item = &PathBuf> {
        [Some(&self.memory), Some(&self.pids), Some(&self.cpu)]
            .into_iter()
            .chain([
                self.cpuacct.as_ref().filter(|d| **d != self.cpu),
                self.freezer.as_ref(),
            ])
            .flatten()
    }

    fn freeze(&self, state: &str) {
        if let Some(freezer) = &self.freezer {
            let _ = super::write(&freezer.join("freezer.state"), state);
        }
    }
}

impl CallCgroup for CallV1 {
    fn clone_into_fd(&self) -> Option<RawFd> {
        self.unified.as_ref().and_then(CallV2::clone_into_fd)
    }

    fn self_join_files(&self) -> Vec<PathBuf> {
        self.dirs().map(|d| d.join("tasks")).collect()
    }

    fn join(&self, pid: libc::pid_t) -> Result<(), CgroupError> {
        // The v1 hierarchies are joined by the child itself (see `self_join_files`).
        match &self.unified {
            Some(unified) => unified.join(pid),
            None => Ok(()),
        }
    }

    fn kill(&self) -> Result<(), CgroupError> {
        if let Some(unified) = &self.unified {
            // Hybrid host: the kernel kills the whole cgroup, forks in flight included.
            unified.kill()?;
        } else if self.freezer.is_some() {
            // Frozen tasks cannot fork; SIGKILL them all, then thaw so they die.
            self.freeze("FROZEN");
            for pid in super::procs(&self.pids).unwrap_or_default() {
                // SAFETY: kill takes no pointers; a stale pid yields ESRCH.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            self.freeze("THAWED");
        }
        // Whatever is left (or everything, without a freezer): round after round.
        super::kill_until_empty(&self.pids)
    }

    fn processes(&self) -> Result<Vec<libc::pid_t>, CgroupError> {
        // Every process of the call is in each hierarchy; the pids one is what
        // `kill_until_empty` watches too.
        super::procs(&self.pids)
    }

    fn peak_memory_bytes(&self) -> Option<u64> {
        super::read_u64(&self.memory.join("memory.max_usage_in_bytes"))
    }

    fn cpu_usage_us(&self) -> Option<(u64, u64)> {
        let dir = self.cpuacct.as_ref()?;
        let user = super::read_u64(&dir.join("cpuacct.usage_user"))?;
        let system = super::read_u64(&dir.join("cpuacct.usage_sys"))?;
        Some((user / 1000, system / 1000))
    }

    fn remove(&mut self) -> Result<(), CgroupError> {
        if self.removed {
            return Ok(());
        }
        let _ = self.kill();
        let mut first_error = None;
        for dir in self.dirs() {
            if let Err(e) = super::rmdir_when_empty(dir) {
                first_error.get_or_insert(e);
            }
        }
        if let Some(Err(e)) = self.unified.as_mut().map(|u| u.remove()) {
            first_error.get_or_insert(e);
        }
        match first_error {
            Some(e) => Err(e),
            None => {
                self.removed = true;
                Ok(())
            }
        }
    }
}

impl Drop for CallV1 {
    fn drop(&mut self) {
        let _ = self.remove();
    }
}
