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
//! The first process stays a tiny init ([`init`]: still our code, fully confined): it
//! starts the command as its child, reaps orphans, and when the command exits writes
//! its wait status and resource use to a status pipe and exits. In strict mode it is
//! pid 1 of a new pid namespace, and its exit makes the kernel kill everything left in
//! the namespace; a call whose command left nothing behind is answered from that
//! report, and the sandbox's teardown finishes on the factory's reaper ([`reaper`]).
//! The command thus gets normal signal semantics (pid 1 of a namespace ignores signals
//! it has no handler for, even `kill -KILL $$`). At the standard level, which has no
//! pid namespace, init is the subreaper of everything the command starts and kills it
//! all before it reports: a process that left the command's session or process group
//! is still init's descendant.
//!
//! A strict sandbox may also come pre-built from a [`Pool`] (`prebuilt` in the
//! configuration): the same child runs the same sequence, but stops after the steps
//! that do not depend on the call and waits for it (see [`pool`]).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::time::Instant;

use crate::Cancel;
use crate::cgroup::{CallCgroup, CgroupLimits};
use crate::fds::{self, ChildFds};
use crate::landlock_rules::LandlockPlan;
use crate::loopback;
use crate::namespaces;
use crate::probe::IsolationReport;
use crate::rlimits::{RlimitPlan, Rlimits};
use crate::rootfs::RootfsPlan;
use crate::sandbox::{
    AttachedStdio, CommandSpec, Factory, Network, OutputSink, RunOutcome, SandboxError,
};
use crate::sys;

mod child;
mod handshake;
mod init;
mod parent;
mod plan;
mod pool;
mod reaper;
mod wire;

pub(crate) use pool::Pool;
pub(crate) use reaper::Reaper;

use parent::{Child, Origin, Request, Supervision, Timing};
use plan::{
    CallTmp, CallView, ChildPlan, ExecPlan, inherited_string_regions, relative_cwd,
    standard_landlock, strict_landlock,
};

/// `PATH` when the call names none.
pub(crate) const DEFAULT_PATH: &str =
    "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin";

/// Runs one command in a sandbox: a pre-built one from `pool` when there is one for
/// it, else a fresh one. With `attached`, the command's stdin and stdout are the
/// caller's descriptors (a long-running server that talks over them) and only stderr
/// is captured; otherwise all three are pipes of ours.
pub(crate) fn run(
    sandbox: &Factory,
    pool: Option<&Pool>,
    spec: &CommandSpec,
    attached: Option<AttachedStdio>,
    sink: &mut dyn OutputSink,
    cancel: &Cancel,
) -> Result<RunOutcome, SandboxError> {
    let requested = Instant::now();
    // Prepare everything the child needs (allocation happens here, never after clone).
    let call = Call::prepare(sandbox, spec)?;
    let mut fallback = None;
    if attached.is_none()
        && let Some(pool) = pool
    {
        match pool.run(sandbox, &call, spec, sink, cancel, requested) {
            Ok(outcome) => return outcome,
            Err(why) => fallback = Some(why),
        }
    }
    let started = Started {
        requested,
        fallback,
    };
    fresh(sandbox, call, spec, attached, sink, cancel, started)
}

/// When the call came, and why it did not run in a pre-built sandbox.
struct Started {
    requested: Instant,
    fallback: Option<String>,
}

/// One call, prepared before a sandbox is cloned for it or taken from the pool:
/// everything the child needs of its call, allocated here and never after `clone`.
struct Call {
    /// The canonical host workspace.
    workspace: PathBuf,
    exec: ExecPlan,
    /// Strict: the workspace's source under the old root and the working directory.
    rootfs: Option<RootfsPlan>,
    /// Standard: the working directory on the host.
    host_cwd: CString,
    rlimits: RlimitPlan,
    /// Standard: the call's own `/tmp`, removed when the run ends.
    call_tmp: Option<CallTmp>,
    report: IsolationReport,
}

impl Call {
    fn prepare(sandbox: &Factory, spec: &CommandSpec) -> Result<Self, SandboxError> {
        let cfg = sandbox.config();
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
        let call_tmp = if sandbox.is_strict() {
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
            Some(_) => Some(RootfsPlan::prepare(&workspace, &cwd)?),
            None => None,
        };
        let host_cwd = sys::path_cstring(&workspace.join(&cwd)).map_err(SandboxError::Io)?;
        let rlimits = RlimitPlan::prepare(Rlimits {
            nofile: cfg.nofile,
            fsize_bytes: cfg.fsize_bytes,
            timeout: spec.timeout,
        })?;
        let mut report = sandbox.report().clone();
        report.rlimits = rlimits.report();
        report.limits.timeout_ms =
            Some(u64::try_from(spec.timeout.as_millis()).unwrap_or(u64::MAX));
        Ok(Call {
            workspace,
            exec,
            rootfs,
            host_cwd,
            rlimits,
            call_tmp,
            report,
        })
    }

    /// What the child reads of its call.
    fn view(&self) -> CallView<'_> {
        CallView {
            workspace_source: self
                .rootfs
                .as_ref()
                .map_or(c"", |r| r.workspace_source.as_c_str()),
            cwd: match &self.rootfs {
                Some(r) => &r.cwd,
                None => &self.host_cwd,
            },
            rlimits: self.rlimits.values(),
            exec: self.exec.view(),
        }
    }
}

/// A fresh sandbox: cloned for this call, confined, and its command run.
fn fresh(
    sandbox: &Factory,
    mut call: Call,
    spec: &CommandSpec,
    attached: Option<AttachedStdio>,
    sink: &mut dyn OutputSink,
    cancel: &Cancel,
    Started {
        requested,
        fallback,
    }: Started,
) -> Result<RunOutcome, SandboxError> {
    let landlock = match &call.call_tmp {
        None => strict_landlock(sandbox)?,
        Some(tmp) => standard_landlock(sandbox, &call.workspace, tmp.path())?,
    };
    let cgroup = create_cgroup(sandbox)?;
    let (ours, sync_w, theirs) = pipes(attached)?;
    let proxy_channel = proxy_channel(sandbox)?;
    let plan = child_plan(
        sandbox,
        &theirs,
        cgroup.as_deref(),
        proxy_channel.as_ref().map(|(_, child)| child.as_raw_fd()),
        landlock,
    )?;
    let view = call.view();
    let started = Instant::now();
    let mut child = start(sandbox, cgroup, sync_w, || child::child_main(&plan, &view))?;
    drop(theirs);
    drop(plan);
    let proxy_channel = proxy_channel.map(|(ours, _child)| ours);

    // Setup result: end-of-file = exec succeeded; 8 bytes = the failed step.
    setup_result(&mut child, &ours.error_r)?;
    let spawn = requested.elapsed();
    if let Some(channel) = &proxy_channel {
        match loopback::receive_listener(channel) {
            Ok(listener) => sink.proxy_listener(listener),
            Err(e) => {
                child.kill_now();
                let _ = child.reap();
                return Err(e);
            }
        }
    }

    let timing = Timing { started, spawn };
    let origin = Origin::Fresh {
        call_tmp: call.call_tmp.take(),
        fallback,
    };
    let request = Request {
        sandbox,
        spec,
        cancel,
    };
    let run = Supervision::new(request, child, ours, call.report.clone(), timing, origin);
    parent::supervise(run, sink)
}

/// The parent's ends of a sandbox's pipes (the sync pipe's apart: [`start`] uses it).
struct ParentEnds {
    /// `None` when the caller holds the command's stdin (attached).
    stdin_w: Option<OwnedFd>,
    /// `None` when the caller holds the command's stdout (attached).
    stdout_r: Option<OwnedFd>,
    stderr_r: OwnedFd,
    error_r: OwnedFd,
    status_r: OwnedFd,
}

/// The child's ends, closed in the parent once the child is cloned.
struct ChildEnds {
    stdin_r: OwnedFd,
    stdout_w: OwnedFd,
    stderr_w: OwnedFd,
    sync_r: OwnedFd,
    error_w: OwnedFd,
    status_w: OwnedFd,
}

impl ChildEnds {
    fn fds(&self) -> ChildFds {
        ChildFds {
            stdin: self.stdin_r.as_raw_fd(),
            stdout: self.stdout_w.as_raw_fd(),
            stderr: self.stderr_w.as_raw_fd(),
            error: self.error_w.as_raw_fd(),
            status: self.status_w.as_raw_fd(),
        }
    }
}

/// The pipes of one sandbox: stdin, stdout (unless attached), stderr, sync, error and
/// status.
fn pipes(
    attached: Option<AttachedStdio>,
) -> Result<(ParentEnds, OwnedFd, ChildEnds), SandboxError> {
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
    Ok((
        ParentEnds {
            stdin_w,
            stdout_r,
            stderr_r,
            error_r,
            status_r,
        },
        sync_w,
        ChildEnds {
            stdin_r,
            stdout_w,
            stderr_w,
            sync_r,
            error_w,
            status_w,
        },
    ))
}

/// `network = "proxy"`: the socket pair over which the child hands over its listener.
fn proxy_channel(sandbox: &Factory) -> Result<Option<(OwnedFd, OwnedFd)>, SandboxError> {
    match sandbox.config().network {
        Network::Proxy => Ok(Some(loopback::channel()?)),
        Network::None | Network::Host => Ok(None),
    }
}

/// The cgroup of one sandbox, with the configured limits.
fn create_cgroup(sandbox: &Factory) -> Result<Option<Box<dyn CallCgroup>>, SandboxError> {
    let cfg = sandbox.config();
    match sandbox.cgroup_backend() {
        Some(backend) => Ok(Some(backend.create(&CgroupLimits {
            memory_bytes: cfg.memory_bytes,
            pids: cfg.pids,
            cpu_millis: cfg.cpu_millis,
        })?)),
        None => Ok(None),
    }
}

/// The child's plan besides its call.
fn child_plan<'a>(
    sandbox: &'a Factory,
    theirs: &ChildEnds,
    cgroup: Option<&dyn CallCgroup>,
    proxy_channel: Option<RawFd>,
    landlock: LandlockPlan,
) -> Result<ChildPlan<'a>, SandboxError> {
    let cgroup_tasks = match cgroup {
        Some(cg) => cg
            .self_join_files()
            .iter()
            .map(|p| sys::path_cstring(p))
            .collect::<Result<Vec<_>, _>>()
            .map_err(SandboxError::Io)?,
        None => Vec::new(),
    };
    Ok(ChildPlan {
        strict: sandbox.is_strict(),
        require_empty_bounding_set: sandbox.report().bounding_set_dropped,
        cgroup_tasks,
        fds: theirs.fds(),
        sync: theirs.sync_r.as_raw_fd(),
        proxy_channel,
        rootfs: sandbox.rootfs_template(),
        landlock,
        seccomp: sandbox.seccomp(),
        inherited_strings: inherited_string_regions(),
    })
}

/// Clones a sandbox's first process — into its cgroup where the kernel can — and lets
/// it go once its id maps are written and it is in its cgroup. `body` runs in the
/// child: async-signal-safe calls on a plan prepared before this call, never returning.
fn start(
    sandbox: &Factory,
    cgroup: Option<Box<dyn CallCgroup>>,
    sync_w: OwnedFd,
    body: impl FnOnce() -> std::convert::Infallible,
) -> Result<Child, SandboxError> {
    let strict = sandbox.is_strict();
    let flags = if strict {
        namespaces::clone_flags(sandbox.config().network)
    } else {
        0
    };
    let cloned_into = match cgroup.as_ref().and_then(|c| c.clone_into_fd()) {
        // SAFETY: the child runs only `body`, which makes async-signal-safe calls on
        // the prepared plan and never returns.
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
        body();
    }
    let child = Child {
        pid,
        strict,
        cgroup,
        reaped: false,
    };

    // Handshake: id maps, cgroup, then let the child go.
    if strict {
        namespaces::write_id_maps(pid)?;
    }
    if let Some(cgroup) = child.cgroup.as_ref().filter(|_| !joined) {
        cgroup.join(pid)?;
    }
    handshake::release(sync_w)?;
    Ok(child)
}

/// Reads the error pipe to its end: end-of-file means the command's `execve`
/// succeeded; a failure kills the sandbox and names the step.
fn setup_result(child: &mut Child, error_r: &OwnedFd) -> Result<(), SandboxError> {
    if let Some(failure) = handshake::read_failure(error_r)? {
        child.kill_now();
        let _ = child.reap();
        return Err(SandboxError::Setup {
            step: failure.step.describe(),
            source: io::Error::from_raw_os_error(failure.errno),
        });
    }
    Ok(())
}
