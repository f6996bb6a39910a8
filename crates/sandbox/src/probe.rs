//! Host probe and the isolation report.
//!
//! [`probe`] finds out what this host lets us enforce — by trying, not by reading
//! version numbers: it creates a user namespace (with the other namespaces of a strict
//! sandbox) in a throwaway child, asks Landlock for its ABI, asks seccomp whether
//! filters are available, and prepares the cgroup parent in every hierarchy it finds.
//! The [`IsolationReport`] states the layers actually in force; every run result
//! carries one.

use std::fmt;
use std::sync::Arc;

use airlock_policy::IsolationLevel;
use serde::Serialize;

use crate::cgroup::{self, CgroupBackend, CgroupVersion};
use crate::landlock_rules;
use crate::namespaces;
use crate::rlimits::RlimitReport;
use crate::seccomp;

/// One `thiserror` enum per module: a layer the host does not offer, with the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{feature} {problem}: {fix}")]
pub struct Missing {
    /// The layer, e.g. "user namespaces".
    pub feature: &'static str,
    /// What is wrong, with the likely cause.
    pub problem: String,
    /// How to fix the host or the configuration.
    pub fix: std::borrow::Cow<'static, str>,
}

/// What the host offers.
#[derive(Clone)]
pub struct HostProbe {
    /// User (and pid, mount, net, ipc, uts, cgroup) namespaces can be created.
    pub user_namespaces: Result<(), Missing>,
    /// Landlock ABI version.
    pub landlock_abi: Result<u32, Missing>,
    /// seccomp filters can be installed.
    pub seccomp: Result<(), Missing>,
    /// A cgroup backend with writable memory, pids and cpu controllers.
    pub cgroup: Result<Arc<dyn CgroupBackend>, Missing>,
}

impl fmt::Debug for HostProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostProbe")
            .field("user_namespaces", &self.user_namespaces)
            .field("landlock_abi", &self.landlock_abi)
            .field("seccomp", &self.seccomp)
            .field("cgroup", &self.cgroup.as_ref().map(|c| c.version()))
            .finish()
    }
}

impl HostProbe {
    /// The layers required by `level` that are missing.
    pub fn missing_for(&self, level: IsolationLevel) -> Vec<Missing> {
        let mut missing = Vec::new();
        if let Err(m) = &self.landlock_abi {
            missing.push(m.clone());
        }
        if let Err(m) = &self.seccomp {
            missing.push(m.clone());
        }
        if level == IsolationLevel::Strict {
            if let Err(m) = &self.user_namespaces {
                missing.push(m.clone());
            }
            if let Err(m) = &self.cgroup {
                missing.push(m.clone());
            }
        }
        missing
    }

    /// The strongest level this host supports, if any.
    pub fn best_level(&self) -> Option<IsolationLevel> {
        [IsolationLevel::Strict, IsolationLevel::Standard]
            .into_iter()
            .find(|l| self.missing_for(*l).is_empty())
    }
}

/// Probes the host. `cgroup_parent` is the name of the parent cgroup for calls (it is
/// created under the worker's own cgroup in every hierarchy).
pub fn probe(cgroup_parent: &str) -> HostProbe {
    HostProbe {
        user_namespaces: probe_user_namespaces(),
        landlock_abi: landlock_rules::abi_version().ok_or(Missing {
            feature: "landlock",
            problem: "is not available (kernel older than 5.13, built without \
                      CONFIG_SECURITY_LANDLOCK, or landlock missing from the lsm= boot list)"
                .into(),
            fix:
                "boot a kernel with landlock enabled (e.g. lsm=landlock,lockdown,yama,apparmor,bpf)"
                    .into(),
        }),
        seccomp: if seccomp::filter_available() {
            Ok(())
        } else {
            Err(Missing {
                feature: "seccomp",
                problem: "filters are not available (kernel without CONFIG_SECCOMP_FILTER)".into(),
                fix: "use a kernel built with CONFIG_SECCOMP_FILTER".into(),
            })
        },
        cgroup: cgroup::detect(cgroup_parent)
            .map(Arc::from)
            .map_err(|e| Missing {
                feature: "cgroups",
                problem: format!("are not usable ({e})"),
                fix: cgroup_fix().into(),
            }),
    }
}

/// How to get per-call cgroups on this host, as the user we run as: the exact
/// commands, since the fix differs between root and an ordinary user and between
/// cgroup v2 and v1.
fn cgroup_fix() -> String {
    // SAFETY: geteuid cannot fail and touches no memory.
    let uid = unsafe { libc::geteuid() };
    let user = std::env::var("USER")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| uid.to_string());
    let standard =
        "or set [sandbox] min_isolation = \"standard\" (no namespaces, no cgroup limits)";
    if uid == 0 {
        return format!(
            "give the worker a writable cgroup with the memory, pids and cpu controllers \
             (cgroup v2 with them enabled in cgroup.subtree_control, or the v1 hierarchies \
             mounted read-write), {standard}"
        );
    }
    if cgroup::host_has_v2_controllers() {
        format!(
            "start Airlock in a cgroup delegated to you: `systemd-run --user --scope -p \
             Delegate=yes airlock up` (systemd gives the scope to user {user} with the memory, \
             pids and cpu controllers), or set [sandbox] cgroup_parent = \"/path\" to a subtree \
             that root delegated to {user} and that Airlock itself was started inside; {standard}"
        )
    } else {
        format!(
            "this host has cgroup v1 controllers, which an ordinary user cannot use without \
             root's help: have root delegate a parent in each hierarchy (`for c in memory pids \
             cpu freezer; do mkdir -p /sys/fs/cgroup/$c/airlock-{user} && chown {user} \
             /sys/fs/cgroup/$c/airlock-{user}; done`) and set [sandbox] cgroup_parent = \
             \"/airlock-{user}\"; or boot with systemd.unified_cgroup_hierarchy=1 and start \
             Airlock with `systemd-run --user --scope -p Delegate=yes airlock up`; {standard}"
        )
    }
}

/// Tries to create the namespaces of a strict sandbox in a child that exits at once.
fn probe_user_namespaces() -> Result<(), Missing> {
    let missing = |problem: String| Missing {
        feature: "user namespaces",
        problem,
        fix: "enable them (sysctl user.max_user_namespaces > 0, \
              kernel.unprivileged_userns_clone=1, kernel.apparmor_restrict_unprivileged_userns=0 \
              or an AppArmor profile allowing userns), run the pod with hostUsers: false, \
              in Docker give the container --security-opt seccomp=<a profile allowing \
              clone and unshare with CLONE_NEWUSER> (the default profile refuses them), or \
              set [sandbox] min_isolation = \"standard\""
            .into(),
    };
    let flags = namespaces::clone_flags(false);
    // SAFETY: the child only calls unshare and _exit, both async-signal-safe.
    let pid = match unsafe { namespaces::clone_process(flags) } {
        Ok(pid) => pid,
        Err(e) => {
            return Err(missing(format!(
                "are not available ({e}; kernel.unprivileged_userns_clone=0 or a container \
                 without CLONE_NEWUSER)"
            )));
        }
    };
    if pid == 0 {
        // SAFETY: unshare takes no pointers; _exit ends the child.
        unsafe {
            let ok = libc::unshare(libc::CLONE_NEWCGROUP) == 0;
            libc::_exit(if ok { 0 } else { 1 });
        }
    }
    let mut status = 0;
    // SAFETY: `status` is a valid out-pointer; waits for our own child.
    while unsafe { libc::waitpid(pid, &mut status, 0) } == -1 {
        if crate::sys::errno() != libc::EINTR {
            return Err(missing("probe child could not be reaped".into()));
        }
    }
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        Ok(())
    } else {
        Err(missing(
            "work but a cgroup namespace cannot be created inside one".into(),
        ))
    }
}

/// Which layers confine a sandbox (or a confined process), as JSON-ready data.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IsolationReport {
    /// `strict` or `standard`.
    pub level: IsolationLevel,
    /// Namespaces entered, e.g. `["user", "pid", "mount", "net", "ipc", "uts", "cgroup"]`.
    pub namespaces: Vec<&'static str>,
    /// Whether the sandbox runs in a new root (pivot_root) instead of the host's.
    pub pivot_root: bool,
    /// Landlock ABI version in force, `None` when Landlock is not applied.
    pub landlock_abi: Option<u32>,
    /// `"filter"` when a seccomp filter is installed.
    pub seccomp: Option<&'static str>,
    /// The cgroup interface enforcing the limits, `None` without cgroups.
    pub cgroup: Option<CgroupVersion>,
    pub no_new_privs: bool,
    /// Effective, permitted, inheritable and ambient sets empty.
    pub capabilities_dropped: bool,
    /// The bounding set is empty too. False only in standard mode under a worker
    /// without `CAP_SETPCAP` (an ordinary user's), where it grants nothing anyway:
    /// `no_new_privs` with an empty permitted set.
    pub bounding_set_dropped: bool,
    pub rlimits: RlimitReport,
    pub limits: LimitsReport,
    /// `"none"` (own network namespace, no sockets but AF_UNIX) or `"host"`.
    pub network: &'static str,
}

/// Resource limits in force (`None`: not enforced on this host at this level).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LimitsReport {
    pub memory_bytes: Option<u64>,
    /// 0 when swap is limited away, `None` when the kernel does not account swap.
    pub swap_bytes: Option<u64>,
    pub pids: Option<u64>,
    /// CPU bandwidth in CPUs (1.0 = one CPU).
    pub cpu: Option<f64>,
    pub tmp_bytes: Option<u64>,
    pub output_bytes: u64,
    /// Set per call.
    pub timeout_ms: Option<u64>,
    /// Sandboxes of this worker that run at once; more wait inside their deadline.
    pub max_concurrent: usize,
    /// Memory all of them together may use (the calls' parent cgroup), `None` when the
    /// parent could not be limited (a delegated parent whose limit files are not ours).
    pub aggregate_memory_bytes: Option<u64>,
}

impl IsolationReport {
    /// The report as a JSON value.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

impl fmt::Display for IsolationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let opt = |v: Option<u64>| v.map_or("none".to_owned(), |v| v.to_string());
        writeln!(f, "isolation level: {}", self.level.as_str())?;
        let ns = if self.namespaces.is_empty() {
            "none".into()
        } else {
            self.namespaces.join(", ")
        };
        writeln!(f, "  namespaces:    {ns}")?;
        writeln!(
            f,
            "  new root:      {}",
            if self.pivot_root {
                "pivot_root"
            } else {
                "no (host root)"
            }
        )?;
        writeln!(
            f,
            "  landlock:      {}",
            self.landlock_abi
                .map_or("off".into(), |a| format!("ABI {a}"))
        )?;
        writeln!(f, "  seccomp:       {}", self.seccomp.unwrap_or("off"))?;
        writeln!(
            f,
            "  cgroup:        {}",
            self.cgroup.map_or("none".into(), |c| c.to_string())
        )?;
        writeln!(f, "  no_new_privs:  {}", self.no_new_privs)?;
        writeln!(
            f,
            "  capabilities:  {}",
            match (self.capabilities_dropped, self.bounding_set_dropped) {
                (true, true) => "all dropped, bounding set included",
                (true, false) =>
                    "all dropped but the bounding set (no CAP_SETPCAP; inert under no_new_privs)",
                (false, _) => "kept",
            }
        )?;
        writeln!(
            f,
            "  rlimits:       nofile={} fsize={} core={} cpu_seconds={}",
            self.rlimits.nofile,
            self.rlimits.fsize_bytes,
            self.rlimits.core_bytes,
            opt(self.rlimits.cpu_seconds)
        )?;
        writeln!(
            f,
            "  limits:        memory={} swap={} pids={} cpu={} tmp={} output={} timeout_ms={}",
            opt(self.limits.memory_bytes),
            opt(self.limits.swap_bytes),
            opt(self.limits.pids),
            self.limits.cpu.map_or("none".into(), |c| format!("{c}")),
            opt(self.limits.tmp_bytes),
            self.limits.output_bytes,
            opt(self.limits.timeout_ms)
        )?;
        write!(f, "  network:       {}", self.network)
    }
}
