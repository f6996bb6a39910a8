//! Host probe and the isolation report.
//!
//! [`probe`] finds out what this host lets us enforce — by trying, not by reading
//! version numbers: it creates a user namespace (with the other namespaces of a strict
//! sandbox) in a throwaway child, asks Landlock for its ABI, asks seccomp whether
//! filters are available, and prepares the cgroup parent in every hierarchy it finds.
//!
//! The host-wide answers (user namespaces, Landlock, seccomp) are found once per
//! process and reused by every later probe: they are properties of the kernel and of
//! the process's own credentials, which do not change while it runs, and each later
//! sandbox still enters every layer for real — a layer that stopped working makes that
//! sandbox fail at the step, never run without it. The cgroup verdict is cached the
//! same way, per parent (see [`cgroup::detect`]).
//! The [`IsolationReport`] states the layers actually in force; every run result
//! carries one.

use std::fmt;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

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
/// created under the worker's own cgroup in every hierarchy). The host-wide layers are
/// probed by the first call in a process only (see the module documentation).
pub fn probe(cgroup_parent: &str) -> HostProbe {
    probe_for(cgroup_parent, true)
}

/// As [`probe`]; without `user_namespaces` the user-namespace probe (a throwaway child)
/// is skipped unless an earlier probe already answered it, for a sandbox held to the
/// standard level, which enters no namespace. The answer then says it was not probed.
pub(crate) fn probe_for(cgroup_parent: &str, user_namespaces: bool) -> HostProbe {
    let host = host_layers(user_namespaces);
    let cgroup = cgroup::detect(cgroup_parent)
        .map(Arc::from)
        .map_err(|e| Missing {
            feature: "cgroups",
            problem: format!("are not usable ({e})"),
            fix: cgroup_fix().into(),
        });
    // Reaped only now: its namespaces were torn down while the cgroups were probed.
    drop(host.probe_child);
    HostProbe {
        user_namespaces: host.user_namespaces,
        landlock_abi: host.landlock_abi,
        seccomp: host.seccomp,
        cgroup,
    }
}

/// The answers that hold for the whole host and process.
struct HostLayers {
    user_namespaces: Result<(), Missing>,
    landlock_abi: Result<u32, Missing>,
    seccomp: Result<(), Missing>,
    /// The user-namespace probe's child, still tearing its namespaces down.
    probe_child: Option<ProbeChild>,
}

/// How many times this process has forked the user-namespace probe's child.
static USER_NAMESPACE_PROBES: AtomicUsize = AtomicUsize::new(0);

/// What this process found so far; emptied when the process confines itself, since
/// dropping capabilities changes what it may do (a root worker without `CAP_SETFCAP`
/// can no longer map its uid into a user namespace).
#[derive(Default)]
struct Found {
    landlock_and_seccomp: Option<(Result<u32, Missing>, Result<(), Missing>)>,
    user_namespaces: Option<Result<(), Missing>>,
}

static FOUND: Mutex<Found> = Mutex::new(Found {
    landlock_and_seccomp: None,
    user_namespaces: None,
});

/// The host-wide layers, probed once per process; the user-namespace probe only once it
/// is first wanted.
fn host_layers(want_user_namespaces: bool) -> HostLayers {
    // A poisoned lock only means a probe panicked; what it holds is still consistent.
    let mut found = FOUND.lock().unwrap_or_else(PoisonError::into_inner);
    let mut probe_child = None;
    let (landlock_abi, seccomp) = found
        .landlock_and_seccomp
        .get_or_insert_with(|| (probe_landlock(), probe_seccomp()))
        .clone();
    let user_namespaces = match (&found.user_namespaces, want_user_namespaces) {
        (Some(answer), _) => answer.clone(),
        (None, true) => {
            USER_NAMESPACE_PROBES.fetch_add(1, Ordering::Relaxed);
            let (answer, child) = probe_user_namespaces();
            probe_child = child;
            found.user_namespaces.insert(answer).clone()
        }
        (None, false) => Err(Missing {
            feature: "user namespaces",
            problem: "were not probed (the standard level, which enters no namespace, was \
                      asked for)"
                .into(),
            fix: "leave the level to the probe".into(),
        }),
    };
    HostLayers {
        user_namespaces,
        landlock_abi,
        seccomp,
        probe_child,
    }
}

/// Forgets every cached answer, host-wide and per cgroup parent: called once the process
/// has confined itself, so that a sandbox prepared afterwards is judged by what the
/// confined process can do.
pub(crate) fn forget() {
    *FOUND.lock().unwrap_or_else(PoisonError::into_inner) = Found::default();
    cgroup::forget_verdicts();
}

fn probe_landlock() -> Result<u32, Missing> {
    landlock_rules::abi_version().ok_or(Missing {
        feature: "landlock",
        problem: "is not available (kernel older than 5.13, built without \
                      CONFIG_SECURITY_LANDLOCK, or landlock missing from the lsm= boot list)"
            .into(),
        fix: "boot a kernel with landlock enabled (e.g. lsm=landlock,lockdown,yama,apparmor,bpf)"
            .into(),
    })
}

fn probe_seccomp() -> Result<(), Missing> {
    if seccomp::filter_available() {
        Ok(())
    } else {
        Err(Missing {
            feature: "seccomp",
            problem: "filters are not available (kernel without CONFIG_SECCOMP_FILTER)".into(),
            fix: "use a kernel built with CONFIG_SECCOMP_FILTER".into(),
        })
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
///
/// The child reports through a pipe before it exits, and the answer is taken from the
/// pipe: tearing down a process's fresh mount, network and user namespaces takes
/// milliseconds (RCU grace periods), which the caller spends on the cgroup probe instead
/// of waiting. The returned [`ProbeChild`] reaps the child when dropped.
fn probe_user_namespaces() -> (Result<(), Missing>, Option<ProbeChild>) {
    let missing = |problem: String| Missing {
        feature: "user namespaces",
        problem,
        fix: "enable them (sysctl user.max_user_namespaces > 0 and user.max_net_namespaces > 0, \
              kernel.unprivileged_userns_clone=1, kernel.apparmor_restrict_unprivileged_userns=0 \
              or an AppArmor profile allowing userns), run the pod with hostUsers: false, \
              in Docker give the container --security-opt seccomp=<a profile allowing \
              clone and unshare with CLONE_NEWUSER> (the default profile refuses them), or \
              set [sandbox] min_isolation = \"standard\""
            .into(),
    };
    let (read_end, write_end) = match crate::sys::pipe() {
        Ok(ends) => ends,
        Err(e) => return (Err(missing(format!("could not be probed ({e})"))), None),
    };
    // Every namespace of a strict sandbox but the network one, whose creation and
    // teardown (every pernet subsystem set up, then cleaned up) costs more than all the
    // others together. Inside a user namespace of our own nothing but a zero
    // `user.max_net_namespaces` refuses it, and that is read instead. Should a network
    // namespace still be refused, each sandbox's clone fails: no command runs without one.
    if std::fs::read_to_string("/proc/sys/user/max_net_namespaces")
        .is_ok_and(|max| max.trim() == "0")
    {
        return (
            Err(missing(
                "work but network namespaces are not available (user.max_net_namespaces = 0)"
                    .into(),
            )),
            None,
        );
    }
    let flags = namespaces::clone_flags(crate::sandbox::Network::Host);
    // SAFETY: the child only calls unshare, write and _exit, all async-signal-safe.
    let pid = match unsafe { namespaces::clone_process(flags) } {
        Ok(pid) => pid,
        Err(e) => {
            return (
                Err(missing(format!(
                    "are not available ({e}; kernel.unprivileged_userns_clone=0 or a container \
                     without CLONE_NEWUSER)"
                ))),
                None,
            );
        }
    };
    if pid == 0 {
        // SAFETY: unshare takes no pointers; write sends one byte from a valid buffer on
        // our copy of the pipe; _exit ends the child.
        unsafe {
            let answer = u8::from(libc::unshare(libc::CLONE_NEWCGROUP) == 0);
            libc::write(write_end.as_raw_fd(), (&raw const answer).cast(), 1);
            libc::_exit(0);
        }
    }
    drop(write_end);
    let child = ProbeChild(pid);
    let mut answer = 0u8;
    let read = loop {
        // SAFETY: reading one byte into a valid buffer from our own pipe.
        let n = unsafe { libc::read(read_end.as_raw_fd(), (&raw mut answer).cast(), 1) };
        if n != -1 || crate::sys::errno() != libc::EINTR {
            break n;
        }
    };
    let result = match (read, answer) {
        (1, 1) => Ok(()),
        (1, _) => Err(missing(
            "work but a cgroup namespace cannot be created inside one".into(),
        )),
        _ => Err(missing("probe child ended without an answer".into())),
    };
    (result, Some(child))
}

/// The user-namespace probe's child, reaped (waited for) when dropped.
struct ProbeChild(libc::pid_t);

impl Drop for ProbeChild {
    fn drop(&mut self) {
        let mut status = 0;
        // SAFETY: `status` is a valid out-pointer; waits for our own child only.
        while unsafe { libc::waitpid(self.0, &mut status, 0) } == -1 {
            if crate::sys::errno() != libc::EINTR {
                break;
            }
        }
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
    /// `"none"` (own network namespace, no sockets but AF_UNIX), `"proxy"` (own network
    /// namespace; IPv4 TCP to the egress proxy only) or `"host"`.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Holds the real host alone (`REAL_HOST`), so that the counters it reads are moved
    /// by nothing else in this test binary.
    #[test]
    fn the_host_is_probed_once_per_process_until_it_confines_itself() {
        let _alone = crate::REAL_HOST
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        forget();
        let namespace_probes = || USER_NAMESPACE_PROBES.load(Ordering::Relaxed);
        let cgroup_proofs = || cgroup::VERIFICATIONS.load(Ordering::Relaxed);
        let (namespaces_before, cgroups_before) = (namespace_probes(), cgroup_proofs());

        // A standard-level sandbox does not fork the user-namespace probe, and says so.
        let standard = probe_for("airlock-unit-probe", false);
        assert_eq!(namespace_probes(), namespaces_before);
        let not_probed = standard.user_namespaces.as_ref().expect_err("not probed");
        assert!(not_probed.problem.contains("not probed"), "{not_probed}");
        assert_eq!(cgroup_proofs(), cgroups_before + 1, "{standard:?}");

        let first = probe("airlock-unit-probe");
        let second = probe("airlock-unit-probe");
        assert_eq!(namespace_probes(), namespaces_before + 1);
        assert_eq!(
            cgroup_proofs(),
            cgroups_before + 1,
            "the same parent is proved once"
        );
        assert_eq!(first.user_namespaces, second.user_namespaces);
        assert_eq!(first.landlock_abi, second.landlock_abi);
        let version = |p: &HostProbe| p.cgroup.as_ref().map(|c| c.version()).ok();
        assert!(version(&first).is_some(), "{first:?}");
        assert_eq!(version(&first), version(&second));
        assert_eq!(version(&first), version(&standard));
        // Every factory still gets a pool of its own, with its own aggregate limit.
        let limits = cgroup::CgroupLimits {
            memory_bytes: 64 << 20,
            pids: 16,
            cpu_millis: 100,
        };
        for p in [&first, &second] {
            let backend = p.cgroup.as_ref().expect("a cgroup backend");
            backend.limit_parent(&limits).expect("a pool of its own");
        }

        // Another parent is proved on its own; the host-wide answers are not asked again.
        let other = probe("airlock-unit-probe-other");
        assert_eq!(namespace_probes(), namespaces_before + 1);
        assert_eq!(cgroup_proofs(), cgroups_before + 2);

        // Confining itself makes the process forget: the next probe asks the host again.
        forget();
        let after = probe("airlock-unit-probe");
        assert_eq!(namespace_probes(), namespaces_before + 2);
        assert_eq!(cgroup_proofs(), cgroups_before + 3);

        drop((standard, first, second, other, after));
        for parent in ["airlock-unit-probe", "airlock-unit-probe-other"] {
            for dir in cgroup::parent_dirs(parent) {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}
