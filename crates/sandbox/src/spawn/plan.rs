//! The plan: everything a sandboxed command needs, prepared before `clone` — the
//! `execve` candidates and vectors, the child's whole plan, the working directory, the
//! Landlock rules of each level, the per-call temporary directory of standard mode.
//! Allocation happens here and never after `clone`.

use std::ffi::{CStr, CString};
use std::os::fd::RawFd;
use std::path::{Component, Path, PathBuf};

use super::DEFAULT_PATH;
use crate::fds::ChildFds;
use crate::landlock_rules::{LandlockPlan, access};
use crate::rlimits::RlimitValues;
use crate::rootfs::{DEVICES, RootfsTemplate, SYSTEM_DIRS};
use crate::sandbox::{Factory, SandboxError};
use crate::seccomp::SeccompPlan;
use crate::step::{Failure, Step};
use crate::sys;

/// The prepared `execve`: candidate paths (from `PATH`), argv and envp.
pub(super) struct ExecPlan {
    pub(super) candidates: Vec<CString>,
    pub(super) argv: Vec<CString>,
    pub(super) envp: Vec<CString>,
    candidate_ptrs: Vec<*const libc::c_char>,
    argv_ptrs: Vec<*const libc::c_char>,
    envp_ptrs: Vec<*const libc::c_char>,
}

/// The `execve` as the child runs it: raw pointers to NUL-terminated strings, from an
/// [`ExecPlan`] (a fresh sandbox) or from the call a pre-built sandbox received.
#[derive(Clone, Copy)]
pub(super) struct ExecView<'a> {
    pub(super) candidates: &'a [*const libc::c_char],
    /// NULL-terminated.
    pub(super) argv: *const *const libc::c_char,
    /// NULL-terminated.
    pub(super) envp: *const *const libc::c_char,
}

impl ExecPlan {
    pub(super) fn prepare(argv: &[String], env: &[(String, String)]) -> Result<Self, SandboxError> {
        let invalid = |what: String| SandboxError::InvalidCommand(what);
        let program = argv
            .first()
            .ok_or_else(|| invalid("argv is empty".into()))?;
        if program.is_empty() {
            return Err(invalid("argv[0] is empty".into()));
        }
        let argv_c = argv
            .iter()
            .map(|a| CString::new(a.as_str()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| invalid("an argument contains a NUL byte".into()))?;
        let envp_c = env
            .iter()
            .map(|(k, v)| {
                if k.is_empty() || k.contains('=') {
                    return Err(invalid(format!("invalid environment variable name {k:?}")));
                }
                CString::new(format!("{k}={v}"))
                    .map_err(|_| invalid(format!("environment variable {k} contains a NUL byte")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let path = env
            .iter()
            .rev()
            .find(|(k, _)| k == "PATH")
            .map_or(DEFAULT_PATH, |(_, v)| v);
        let candidates = if program.contains('/') {
            vec![argv_c[0].clone()]
        } else {
            path.split(':')
                .filter(|dir| dir.starts_with('/'))
                .map(|dir| CString::new(format!("{dir}/{program}")))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| invalid("PATH contains a NUL byte".into()))?
        };
        let nul_terminated = |v: &[CString]| {
            v.iter()
                .map(|c| c.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect()
        };
        Ok(ExecPlan {
            candidate_ptrs: candidates.iter().map(|c| c.as_ptr()).collect(),
            argv_ptrs: nul_terminated(&argv_c),
            envp_ptrs: nul_terminated(&envp_c),
            candidates,
            argv: argv_c,
            envp: envp_c,
        })
    }

    pub(super) fn view(&self) -> ExecView<'_> {
        ExecView {
            candidates: &self.candidate_ptrs,
            argv: self.argv_ptrs.as_ptr(),
            envp: self.envp_ptrs.as_ptr(),
        }
    }
}

impl ExecView<'_> {
    /// Tries every candidate; returns only on failure (async-signal-safe).
    pub(super) fn exec(&self) -> Failure {
        let mut error = libc::ENOENT;
        for &path in self.candidates {
            // SAFETY: path, argv and envp are NUL-terminated strings and NULL-terminated
            // arrays that outlive the view.
            unsafe { libc::execve(path, self.argv, self.envp) };
            let e = sys::errno();
            // Keep searching past missing entries, but remember a more telling error
            // (EACCES: found but not executable), like execvp does.
            if e != libc::ENOENT && e != libc::ENOTDIR {
                error = e;
            }
        }
        Failure::new(Step::Exec, error)
    }
}

/// What the child needs of its call, after the part that every call shares: the
/// workspace and working directory (a strict root's, or the host's in standard mode),
/// the rlimits (the CPU limit follows the call's timeout), and the `execve`.
#[derive(Clone, Copy)]
pub(super) struct CallView<'a> {
    /// Strict: the workspace seen under `/oldroot`, bound at `/workspace`.
    pub(super) workspace_source: &'a CStr,
    /// Strict: under `/workspace`; standard: the host directory.
    pub(super) cwd: &'a CStr,
    pub(super) rlimits: RlimitValues,
    pub(super) exec: ExecView<'a>,
}

/// Everything the child needs besides its call, prepared before `clone`.
pub(super) struct ChildPlan<'a> {
    pub(super) strict: bool,
    /// The isolation report promised an empty bounding set: failing to empty it is a
    /// setup error, never a silent weaker sandbox.
    pub(super) require_empty_bounding_set: bool,
    /// v1 `tasks` files to write `0` to (join our own cgroups).
    pub(super) cgroup_tasks: Vec<CString>,
    pub(super) fds: ChildFds,
    pub(super) sync: RawFd,
    /// `network = "proxy"`: the child's end of the socket pair over which it hands the
    /// egress proxy's listener to the worker (see `crate::loopback`).
    pub(super) proxy_channel: Option<RawFd>,
    /// Strict: the part of the new root every call shares.
    pub(super) rootfs: Option<&'a RootfsTemplate>,
    pub(super) landlock: LandlockPlan,
    pub(super) seccomp: &'a SeccompPlan,
    /// The worker's own argument and environment strings, which the child inherits in
    /// its copy of the memory and which `/proc/<pid>/{cmdline,environ}` would show.
    pub(super) inherited_strings: [(usize, usize); 2],
}

/// Address ranges of this process's original argument and environment strings
/// (`arg_start..arg_end`, `env_start..env_end` of proc(5) `stat`), read before the
/// first fork. They are fixed when the process starts (the kernel sets them up at
/// `execve`; only `PR_SET_MM`, which needs `CAP_SYS_RESOURCE` and Airlock never calls,
/// moves them), so one read serves every call.
pub(super) fn inherited_string_regions() -> [(usize, usize); 2] {
    static REGIONS: std::sync::OnceLock<[(usize, usize); 2]> = std::sync::OnceLock::new();
    *REGIONS.get_or_init(read_string_regions)
}

fn read_string_regions() -> [(usize, usize); 2] {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return [(0, 0); 2];
    };
    // Fields after the parenthesised command name start at field 3.
    let Some(rest) = stat.rsplit_once(')').map(|(_, rest)| rest) else {
        return [(0, 0); 2];
    };
    let fields: Vec<usize> = rest
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // Fields 48..=51 of the proc(5) list (1-based) are arg_start, arg_end, env_start, env_end.
    let field = |n: usize| fields.get(n - 3).copied().unwrap_or(0);
    [(field(48), field(49)), (field(50), field(51))]
}

/// Checks `cwd` (relative to the workspace, no `..`) and returns it as a relative path.
pub(super) fn relative_cwd(cwd: Option<&str>) -> Result<PathBuf, SandboxError> {
    let Some(cwd) = cwd else {
        return Ok(PathBuf::new());
    };
    let cwd = cwd
        .strip_prefix("/workspace")
        .unwrap_or(cwd)
        .trim_start_matches('/');
    let path = Path::new(cwd);
    if path
        .components()
        .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err(SandboxError::InvalidCommand(format!(
            "cwd {cwd:?} must be a path inside the workspace without '..'"
        )));
    }
    Ok(path.to_path_buf())
}

/// Landlock rules of a strict sandbox (paths of the new root).
pub(super) fn strict_landlock(sandbox: &Factory) -> Result<LandlockPlan, SandboxError> {
    let mut plan = LandlockPlan::new(sandbox.landlock_abi(), sandbox.config().network);
    plan.allow(Path::new("/"), access::READ)?;
    allow_system(&mut plan)?;
    for dir in ["/tmp", "/dev/shm"] {
        plan.allow(Path::new(dir), access::ALL)?;
    }
    // Mounted when the call arrives, after the ruleset is prepared.
    plan.allow_at_call(Path::new("/workspace"), access::ALL)?;
    Ok(plan)
}

/// Landlock rules of a standard sandbox (host paths: no private root to hide the rest).
pub(super) fn standard_landlock(
    sandbox: &Factory,
    workspace: &Path,
    tmp: &Path,
) -> Result<LandlockPlan, SandboxError> {
    let mut plan = LandlockPlan::new(sandbox.landlock_abi(), sandbox.config().network);
    allow_system(&mut plan)?;
    for file in [
        "passwd",
        "group",
        "hosts",
        "resolv.conf",
        "nsswitch.conf",
        "host.conf",
        "gai.conf",
        "ld.so.cache",
        "ld.so.conf",
        "ld.so.conf.d",
        "alternatives",
        "localtime",
        "ssl/certs",
        "ca-certificates",
    ] {
        plan.allow(&Path::new("/etc").join(file), access::READ)?;
    }
    // Reading /proc is safe here: Landlock forbids ptrace-class access (environ, mem,
    // fd) to processes outside the sandbox.
    plan.allow(Path::new("/proc"), access::READ)?;
    plan.allow(workspace, access::ALL)?;
    plan.allow(tmp, access::ALL)?;
    Ok(plan)
}

/// What both levels allow: the system directories the strict root binds (read and
/// execute) and its minimal devices — one list, shared with [`crate::rootfs`].
fn allow_system(plan: &mut LandlockPlan) -> Result<(), SandboxError> {
    for dir in SYSTEM_DIRS {
        plan.allow(&Path::new("/").join(dir), access::READ_EXEC)?;
    }
    for dev in DEVICES {
        plan.allow(&Path::new("/dev").join(dev), access::DEVICE)?;
    }
    Ok(())
}

/// A per-call temporary directory for standard mode (strict mode has its own tmpfs).
pub(super) struct CallTmp(PathBuf);

impl CallTmp {
    pub(super) fn path(&self) -> &Path {
        &self.0
    }

    pub(super) fn create() -> Result<Self, SandboxError> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = std::env::temp_dir().join(format!("airlock-{}", crate::cgroup::call_name()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(SandboxError::Io)?;
        Ok(CallTmp(dir))
    }
}

impl Drop for CallTmp {
    fn drop(&mut self) {
        if std::fs::remove_dir_all(&self.0).is_ok() {
            return;
        }
        // A command may leave directories it cannot be removed from (`chmod 000`):
        // give every directory back to its owner, then try once more.
        give_back_directories(&self.0);
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            let left = count_entries(&self.0);
            tracing::warn!(
                dir = %self.0.display(),
                error = %e,
                entries_left = left,
                "a call's temporary directory could not be removed"
            );
        }
    }
}

/// Adds `u+rwx` to `dir` and every directory under it, without following symbolic
/// links (best effort: what cannot be changed is left as it is).
fn give_back_directories(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        // `symlink_metadata`: a link is never followed, only a real directory changed.
        let Ok(meta) = std::fs::symlink_metadata(&dir) else {
            continue;
        };
        if !meta.is_dir() {
            continue;
        }
        let mode = meta.permissions().mode();
        if mode & 0o700 != 0o700 {
            let _ = std::fs::set_permissions(
                &dir,
                std::fs::Permissions::from_mode((mode | 0o700) & 0o7777),
            );
        }
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                pending.push(entry.path());
            }
        }
    }
}

/// How many entries are left under `dir` (for the log; links not followed).
fn count_entries(dir: &Path) -> usize {
    let mut count = 0;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            count += 1;
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                pending.push(entry.path());
            }
        }
    }
    count
}
