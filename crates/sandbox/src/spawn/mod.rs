//! Spawning one sandboxed command, split the youki way: [`plan`] (everything prepared
//! before `clone`), [`child`] (the straight sequence between `clone` and `execve`),
//! [`parent`] (wall clock, output capture, kill, reap, cleanup) and [`handshake`] (the
//! three pipes between them). This module puts them in order.
//!
//! Everything the child needs (strings, argument vectors, the compiled seccomp program,
//! the Landlock rules, the mount plan) is prepared before `clone`: the caller is a
//! multithreaded tokio process, so between `clone` and `execve` the child performs only
//! async-signal-safe system calls — no allocation, no locks.
//!
//! Handshake: the child blocks on a sync pipe until the parent has written its uid/gid
//! maps and moved it into the call's cgroup, so it never runs unconfined. A failing
//! step writes (step, errno) to a close-on-exec error pipe and exits; the parent turns
//! that into [`SandboxError::Setup`] naming the step. End-of-file on the error pipe
//! means `execve` succeeded.
//!
//! In strict mode the first process is pid 1 of a new pid namespace. It stays a tiny
//! init (still our code, fully confined, doing only `clone`/`wait4`/`write`/`_exit`):
//! it forks the command as pid 2, reaps orphans, and when the command exits writes its
//! wait status to a status pipe and exits — which makes the kernel kill everything left
//! in the namespace. The command thus gets normal signal semantics (pid 1 of a
//! namespace ignores signals it has no handler for, even `kill -KILL $$`).

use std::io;
use std::os::fd::AsRawFd;
use std::time::Instant;

use crate::Cancel;
use crate::cgroup::CgroupLimits;
use crate::fds::{self, ChildFds};
use crate::loopback;
use crate::namespaces;
use crate::rlimits::{RlimitPlan, Rlimits};
use crate::rootfs::RootfsPlan;
use crate::sandbox::{
    AttachedStdio, CommandSpec, Network, OutputSink, RunOutcome, Sandbox, SandboxError,
};
use crate::sys;

mod child;
mod handshake;
mod parent;
mod plan;

use parent::{Child, Supervision};
use plan::{
    CallTmp, ChildPlan, ExecPlan, inherited_string_regions, relative_cwd, standard_landlock,
    strict_landlock,
};

/// `PATH` when the call names none.
pub(crate) const DEFAULT_PATH: &str =
    "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin";

/// Runs one command in a fresh sandbox. With `attached`, the command's stdin and
/// stdout are the caller's descriptors (a long-running server that talks over them)
/// and only stderr is captured; otherwise all three are pipes of ours.
pub(crate) fn run(
    sandbox: &Sandbox,
    spec: &CommandSpec,
    attached: Option<AttachedStdio>,
    sink: &mut dyn OutputSink,
    cancel: &Cancel,
) -> Result<RunOutcome, SandboxError> {
    let requested = Instant::now();
    let cfg = sandbox.config();
    let strict = sandbox.is_strict();

    // Prepare everything the child needs (allocation happens here, never after clone).
    let workspace = std::fs::canonicalize(&spec.workspace).map_err(|e| {
        SandboxError::InvalidCommand(format!("workspace {}: {e}", spec.workspace.display()))
    })?;
    if !workspace.is_dir() {
        return Err(SandboxError::InvalidCommand(format!(
            "workspace {} is not a directory",
            workspace.display()
        )));
    }
    let cwd = relative_cwd(spec.cwd.as_deref())?;
    if spec.timeout.is_zero() {
        return Err(SandboxError::InvalidCommand(
            "timeout must be positive".into(),
        ));
    }
    let call_tmp = if strict {
        None
    } else {
        Some(CallTmp::create()?)
    };
    let (home, tmpdir) = match &call_tmp {
        None => ("/workspace".to_owned(), "/tmp".to_owned()),
        Some(tmp) => (
            workspace.display().to_string(),
            tmp.path().display().to_string(),
        ),
    };
    let mut env = vec![
        ("PATH".to_owned(), DEFAULT_PATH.to_owned()),
        ("HOME".to_owned(), home),
        ("TMPDIR".to_owned(), tmpdir),
    ];
    for (k, v) in &spec.env {
        env.retain(|(name, _)| name != k);
        env.push((k.clone(), v.clone()));
    }
    let exec = ExecPlan::prepare(&spec.argv, &env)?;
    let rootfs = match sandbox.rootfs_template() {
        Some(template) => Some(RootfsPlan::prepare(template, &workspace, &cwd)?),
        None => None,
    };
    let host_cwd = sys::path_cstring(&workspace.join(&cwd)).map_err(SandboxError::Io)?;
    let rlimits = RlimitPlan::prepare(Rlimits {
        nofile: cfg.nofile,
        fsize_bytes: cfg.fsize_bytes,
        timeout: spec.timeout,
    })?;
    let landlock = match &call_tmp {
        None => strict_landlock(sandbox)?,
        Some(tmp) => standard_landlock(sandbox, &workspace, tmp.path())?,
    };
    let cgroup = match sandbox.cgroup_backend() {
        Some(backend) => Some(backend.create(&CgroupLimits {
            memory_bytes: cfg.memory_bytes,
            pids: cfg.pids,
            cpu_millis: cfg.cpu_millis,
        })?),
        None => None,
    };
    let mut report = sandbox.report().clone();
    report.rlimits = rlimits.report();
    report.limits.timeout_ms = Some(u64::try_from(spec.timeout.as_millis()).unwrap_or(u64::MAX));

    let pipe = || sys::pipe().map_err(|e| SandboxError::Fd(fds::FdError::Pipe(e)));
    let (stdin_r, stdin_w, stdout_r, stdout_w) = match attached {
        Some(stdio) => (stdio.stdin, None, None, stdio.stdout),
        None => {
            let (stdin_r, stdin_w) = pipe()?;
            let (stdout_r, stdout_w) = pipe()?;
            (stdin_r, Some(stdin_w), Some(stdout_r), stdout_w)
        }
    };
    let (stderr_r, stderr_w) = pipe()?;
    let (sync_r, sync_w) = pipe()?;
    let (error_r, error_w) = pipe()?;
    let (status_r, status_w) = pipe()?;
    let proxy_channel = match cfg.network {
        Network::Proxy => Some(loopback::channel()?),
        Network::None | Network::Host => None,
    };
    let cgroup_tasks = match &cgroup {
        Some(cg) => cg
            .self_join_files()
            .iter()
            .map(|p| sys::path_cstring(p))
            .collect::<Result<Vec<_>, _>>()
            .map_err(SandboxError::Io)?,
        None => Vec::new(),
    };
    let plan = ChildPlan {
        strict,
        require_empty_bounding_set: sandbox.report().bounding_set_dropped,
        cgroup_tasks,
        fds: ChildFds {
            stdin: stdin_r.as_raw_fd(),
            stdout: stdout_w.as_raw_fd(),
            stderr: stderr_w.as_raw_fd(),
            error: error_w.as_raw_fd(),
            status: status_w.as_raw_fd(),
        },
        sync: sync_r.as_raw_fd(),
        proxy_channel: proxy_channel.as_ref().map(|(_, child)| child.as_raw_fd()),
        rootfs,
        host_cwd,
        rlimits,
        landlock,
        seccomp: sandbox.seccomp(),
        exec,
        inherited_strings: inherited_string_regions(),
    };

    let flags = if strict {
        namespaces::clone_flags(cfg.network)
    } else {
        0
    };
    let started = Instant::now();
    let cloned_into = match cgroup.as_ref().and_then(|c| c.clone_into_fd()) {
        // SAFETY: the child runs only `child_main`, which makes async-signal-safe calls
        // on the prepared plan and never returns.
        Some(fd) => unsafe { namespaces::clone_into_cgroup(flags, fd) }?,
        None => None,
    };
    let joined = cloned_into.is_some();
    let pid = match cloned_into {
        Some(pid) => pid,
        // SAFETY: as above.
        None => unsafe { namespaces::clone_process(flags) }?,
    };
    if pid == 0 {
        child::child_main(&plan);
    }
    let mut child = Child {
        pid,
        strict,
        cgroup,
        reaped: false,
    };
    drop((stdin_r, stdout_w, stderr_w, sync_r, error_w, status_w));
    drop(plan);
    let proxy_channel = proxy_channel.map(|(ours, _child)| ours);

    // Handshake: id maps, cgroup, then let the child go.
    if strict {
        namespaces::write_id_maps(pid)?;
    }
    if let Some(cgroup) = child.cgroup.as_ref().filter(|_| !joined) {
        cgroup.join(pid)?;
    }
    handshake::release(sync_w)?;

    // Setup result: end-of-file = exec succeeded; 8 bytes = the failed step.
    if let Some(failure) = handshake::read_failure(&error_r)? {
        child.kill();
        let _ = child.reap();
        return Err(SandboxError::Setup {
            step: failure.step.describe(),
            source: io::Error::from_raw_os_error(failure.errno),
        });
    }
    drop(error_r);
    let spawn = requested.elapsed();
    if let Some(channel) = &proxy_channel {
        match loopback::receive_listener(channel) {
            Ok(listener) => sink.proxy_listener(listener),
            Err(e) => {
                child.kill();
                let _ = child.reap();
                return Err(e);
            }
        }
    }

    parent::supervise(
        Supervision {
            sandbox,
            spec,
            cancel,
            child,
            started,
            spawn,
            report,
            stdin_w,
            stdout_r,
            stderr_r,
            status_r,
            call_tmp,
        },
        sink,
    )
}
