//! Self-confinement of long-running Airlock processes (orchestrator and workers), as
//! one straight sequence: `no_new_privs`, Landlock, capabilities dropped, seccomp.
//!
//! # Call it while the process has one thread
//!
//! Landlock's `restrict_self` confines only the calling thread (kernels up to Landlock
//! ABI 7 have no thread-synchronising flag), and threads created *afterwards* inherit
//! it. [`confine_self`] therefore refuses to run when the process already has more than
//! one thread: call it from `main` before building the tokio runtime (after binding
//! sockets and opening files, which stay usable). The seccomp filter is installed with
//! `SECCOMP_FILTER_FLAG_TSYNC` regardless, so it covers every thread.
//!
//! # The shell worker
//!
//! The shell worker creates a sandbox per call, and needs (almost) none of its
//! capabilities for that: `clone(CLONE_NEWUSER)` gives the child a full capability set
//! *inside* its new user namespace whatever the parent holds, the kernel lets an
//! unprivileged parent write a single-id uid/gid map of its own ids, and cgroup files
//! owned by the worker's uid are writable by plain file permissions (create the
//! [`Sandbox`](crate::Sandbox) before confining: it creates the parent cgroups, whose
//! v1 hierarchy roots are read-only without `CAP_DAC_OVERRIDE`). The one exception is
//! a worker running as host root: since Linux 5.12, mapping host uid 0 into a user
//! namespace requires `CAP_SETFCAP` (a namespace root mapped to host root could
//! otherwise write file capabilities the host honours). Such a worker keeps exactly
//! `CAP_SETFCAP` in its effective and permitted sets — the bounding set is still
//! emptied, `no_new_privs` forbids regaining anything through exec, and every sandbox
//! drops all capabilities before running a command. A non-root worker (the Kubernetes
//! deployment, `runAsNonRoot`) keeps nothing. What it does need is `allow_exec` and
//! `allow_namespaces`: the filter then lets
//! `execve`, namespace creation and the mount API through (the sandbox installs its
//! own, stricter filter before running anything). And because Landlock forbids
//! `mount(2)` to any process whose domain restricts the filesystem — a domain the
//! sandbox child would inherit — a worker with `allow_namespaces` gets Landlock's
//! scoping (signals, abstract unix sockets) but no filesystem rules; each sandbox
//! applies its own filesystem ruleset after building its root.

use std::io;
use std::path::PathBuf;

use serde::Serialize;

use crate::landlock_rules::{self, LandlockPlan, access};
use crate::seccomp::{Profile, SeccompPlan};

/// One `thiserror` enum per module: self-confinement failures.
#[derive(Debug, thiserror::Error)]
pub enum SelfConfineError {
    #[error(
        "confine_self must run while the process has a single thread (found {0}): call it before starting the async runtime"
    )]
    Multithreaded(usize),
    #[error("cannot count the threads of this process: {0}")]
    Threads(#[source] io::Error),
    #[error("cannot set no_new_privs: {0}")]
    NoNewPrivs(#[source] io::Error),
}

/// What a process may still do after confining itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SelfConfinement {
    /// Readable (and, with `allow_exec`, executable) beneath these paths.
    pub read_paths: Vec<PathBuf>,
    /// Readable and writable beneath these paths.
    pub write_paths: Vec<PathBuf>,
    /// Keep `execve` (the shell worker, which starts sandboxes).
    pub allow_exec: bool,
    /// Keep namespace creation and the mount API (the shell worker in strict mode).
    pub allow_namespaces: bool,
}

/// The layers now in force on this process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SelfConfinementReport {
    pub no_new_privs: bool,
    /// Landlock ABI in force (`None` for a process that builds sandboxes).
    pub landlock_abi: Option<u32>,
    pub landlock_filesystem: bool,
    pub seccomp: &'static str,
    /// Effective, permitted, inheritable and ambient sets empty (but for
    /// `capabilities_kept`).
    pub capabilities_dropped: bool,
    /// The bounding set is empty too. False for a process without `CAP_SETPCAP` (an
    /// ordinary user's): its bounding set stays, and grants nothing under
    /// `no_new_privs` with an empty permitted set (see `caps`).
    pub bounding_set_dropped: bool,
    /// Capabilities deliberately kept (only `CAP_SETFCAP`, by a root shell worker).
    pub capabilities_kept: Vec<&'static str>,
    pub exec_allowed: bool,
    pub namespaces_allowed: bool,
}

/// System paths a confined process may read: shared libraries, name service and TLS
/// configuration, time zones, its own /proc entries.
const SYSTEM_READ: [&str; 19] = [
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/lib32",
    "/etc/ld.so.cache",
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/host.conf",
    "/etc/gai.conf",
    "/etc/services",
    "/etc/ssl",
    "/etc/pki",
    "/etc/ca-certificates",
    "/etc/localtime",
    "/run/systemd/resolve",
    "/proc",
];

/// Device nodes a confined process may read and write.
const DEVICES: [&str; 3] = ["/dev/null", "/dev/urandom", "/dev/random"];

/// Confines the calling process for the rest of its life. See the module docs for when
/// to call it; afterwards `/proc/self/status` shows `NoNewPrivs: 1`, `Seccomp: 2` and
/// `CapEff: 0000000000000000`.
pub fn confine_self(spec: &SelfConfinement) -> Result<SelfConfinementReport, crate::SandboxError> {
    // 0. Prepare everything: paths, the seccomp program.
    let threads = thread_count()?;
    if threads != 1 {
        return Err(SelfConfineError::Multithreaded(threads).into());
    }
    let abi = landlock_rules::abi_version();
    let seccomp = SeccompPlan::compile(Profile {
        network: crate::sandbox::Network::Host,
        exec: spec.allow_exec,
        namespaces: spec.allow_namespaces,
        // A worker speaks gRPC and reaches its broker over Unix sockets.
        unix_sockets: true,
        no_setid_files: false,
        own_process_only: false,
        ipc: true,
        protected_pids: [0; 3],
    })?;
    let landlock = match abi {
        None => None,
        Some(abi) => {
            let mut plan = LandlockPlan::new(abi, crate::sandbox::Network::Host);
            let system = if spec.allow_exec {
                access::READ_EXEC
            } else {
                access::READ
            };
            for path in SYSTEM_READ {
                plan.allow(std::path::Path::new(path), system)?;
            }
            for path in &spec.read_paths {
                plan.allow(path, system)?;
            }
            for path in DEVICES {
                plan.allow(std::path::Path::new(path), access::DEVICE)?;
            }
            for path in &spec.write_paths {
                plan.allow(path, access::ALL)?;
            }
            // A process that builds sandboxes gets no Landlock layer at all. One that
            // handles file rights would forbid it the mount API; and a scoping-only
            // one is not inert either: Landlock refuses moving a file to another
            // directory (REFER) in every layer of a domain that any layer gives file
            // rules, so it would make each cross-directory rename(2) inside the
            // sandboxes fail with EXDEV (Python's os.rename, git's and pip's stores).
            // Each sandbox applies its own rules and scoping.
            (!spec.allow_namespaces).then_some(plan)
        }
    };

    // From here on the process may do less: answers probed before no longer hold.
    crate::probe::forget();

    // 1. no_new_privs: required by Landlock and seccomp; nothing regains privileges.
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } == -1 {
        return Err(SelfConfineError::NoNewPrivs(io::Error::last_os_error()).into());
    }

    // 2. Landlock (this thread, which is the only one).
    if let Some(plan) = &landlock {
        plan.apply_checked()?;
    }

    // 3. Capabilities: every set empty, the bounding set included where we hold
    //    CAP_SETPCAP (an ordinary user does not; see `caps`). A root worker that creates
    //    namespace sandboxes keeps CAP_SETFCAP, see the module docs.
    // SAFETY: geteuid cannot fail and touches no memory.
    let keep_setfcap = spec.allow_namespaces && unsafe { libc::geteuid() } == 0;
    let keep = if keep_setfcap {
        crate::caps::SETFCAP_MASK
    } else {
        0
    };
    let dropped = crate::caps::drop_all_but(keep)?;

    // 4. seccomp on every thread, last.
    seccomp.install_all_threads()?;

    Ok(SelfConfinementReport {
        no_new_privs: true,
        landlock_abi: landlock.as_ref().map(LandlockPlan::abi),
        landlock_filesystem: landlock.is_some(),
        seccomp: "filter",
        capabilities_dropped: true,
        bounding_set_dropped: dropped.bounding_set,
        capabilities_kept: if dropped.kept & crate::caps::SETFCAP_MASK != 0 {
            vec!["CAP_SETFCAP"]
        } else {
            Vec::new()
        },
        exec_allowed: spec.allow_exec,
        namespaces_allowed: spec.allow_namespaces,
    })
}

impl std::fmt::Display for SelfConfinementReport {
    /// The layers in force, in words, for the start-up log: nothing claimed that is
    /// not in force.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.no_new_privs {
            f.write_str("no_new_privs, ")?;
        }
        match (self.landlock_abi, self.landlock_filesystem) {
            (Some(abi), true) => write!(f, "landlock ABI {abi} (filesystem rules), ")?,
            (Some(abi), false) => write!(f, "landlock ABI {abi} (scoping only), ")?,
            (None, _) => f.write_str("no landlock, ")?,
        }
        if self.capabilities_dropped {
            f.write_str("capabilities dropped")?;
            if !self.capabilities_kept.is_empty() {
                write!(f, " but {}", self.capabilities_kept.join(", "))?;
            }
            if self.bounding_set_dropped {
                f.write_str(" (bounding set included), ")?;
            } else {
                f.write_str(" (bounding set kept: no CAP_SETPCAP; inert under no_new_privs), ")?;
            }
        }
        write!(f, "seccomp {}", self.seccomp)?;
        if self.exec_allowed {
            f.write_str(" (exec allowed)")?;
        }
        if self.namespaces_allowed {
            f.write_str(" (namespaces allowed)")?;
        }
        Ok(())
    }
}

fn thread_count() -> Result<usize, SelfConfineError> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(SelfConfineError::Threads)?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:")?.trim().parse().ok())
        .ok_or_else(|| SelfConfineError::Threads(io::Error::other("no Threads: line")))
}
