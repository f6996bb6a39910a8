//! Spawning one sandboxed command: the child's straight sequence between `clone` and
//! `execve`, and the parent's side — handshake, wall clock, output capture, kill, reap,
//! cleanup.
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

use std::convert::Infallible;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use crate::Cancel;
use crate::cgroup::{CallCgroup, CgroupLimits};
use crate::fds::{self, ChildFds, ERROR_FD, STATUS_FD};
use crate::landlock_rules::{LandlockPlan, access};
use crate::namespaces;
use crate::rlimits::{RlimitPlan, Rlimits};
use crate::rootfs::RootfsPlan;
use crate::sandbox::{CommandSpec, OutputSink, RunOutcome, Sandbox, SandboxError, Stream, Usage};
use crate::seccomp::SeccompPlan;
use crate::step::{AtStep, Failure, Step};
use crate::sys;

/// `PATH` when the call names none.
pub(crate) const DEFAULT_PATH: &str =
    "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin";

/// How long output is still drained after the command exited, for descendants that
/// escaped the kill (only possible in standard mode without a cgroup).
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// How often the parent checks for cancellation while nothing else happens.
const POLL_TICK: Duration = Duration::from_millis(20);

/// The prepared `execve`: candidate paths (from `PATH`), argv and envp.
struct ExecPlan {
    candidates: Vec<CString>,
    _argv: Vec<CString>,
    _envp: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    envp_ptrs: Vec<*const libc::c_char>,
}

impl ExecPlan {
    fn prepare(argv: &[String], env: &[(String, String)]) -> Result<Self, SandboxError> {
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
            argv_ptrs: nul_terminated(&argv_c),
            envp_ptrs: nul_terminated(&envp_c),
            candidates,
            _argv: argv_c,
            _envp: envp_c,
        })
    }

    /// Tries every candidate; returns only on failure (async-signal-safe).
    fn exec(&self) -> Failure {
        let mut error = libc::ENOENT;
        for path in &self.candidates {
            // SAFETY: path, argv and envp are NUL-terminated strings/arrays kept alive
            // by `self`.
            unsafe {
                libc::execve(
                    path.as_ptr(),
                    self.argv_ptrs.as_ptr(),
                    self.envp_ptrs.as_ptr(),
                )
            };
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

/// Everything the child needs, prepared before `clone`.
struct ChildPlan<'a> {
    strict: bool,
    /// The isolation report promised an empty bounding set: failing to empty it is a
    /// setup error, never a silent weaker sandbox.
    require_empty_bounding_set: bool,
    /// v1 `tasks` files to write `0` to (join our own cgroups).
    cgroup_tasks: Vec<CString>,
    fds: ChildFds,
    sync: RawFd,
    rootfs: Option<RootfsPlan>,
    host_cwd: CString,
    rlimits: RlimitPlan,
    landlock: LandlockPlan,
    seccomp: &'a SeccompPlan,
    exec: ExecPlan,
    /// The worker's own argument and environment strings, which the child inherits in
    /// its copy of the memory and which `/proc/<pid>/{cmdline,environ}` would show.
    inherited_strings: [(usize, usize); 2],
}

/// Address ranges of this process's original argument and environment strings
/// (`arg_start..arg_end`, `env_start..env_end` of proc(5) `stat`), read before fork.
fn inherited_string_regions() -> [(usize, usize); 2] {
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

/// The child: one straight sequence of confinement steps, then `execve`.
///
/// Never returns. Any failing step is reported through the error pipe and ends the
/// child with status 127: the command never runs with a layer missing.
fn child_main(plan: &ChildPlan<'_>) -> ! {
    let mut report_fd = plan.fds.error;
    let failure = match confine_and_exec(plan, &mut report_fd) {
        Err(failure) => failure,
        Ok(never) => match never {},
    };
    let _ = sys::write_all_raw(report_fd, &failure.encode());
    // SAFETY: _exit is async-signal-safe and ends this process only.
    unsafe { libc::_exit(127) }
}

fn confine_and_exec(plan: &ChildPlan<'_>, report_fd: &mut RawFd) -> Result<Infallible, Failure> {
    // 1. Die with the worker: a sandbox must never outlive the process that enforces
    //    its wall clock (in strict mode, pid 1 dying takes the whole namespace along).
    // SAFETY: prctl with integer arguments only.
    sys::check_int(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) })
        .at(Step::ParentDeathSignal)?;

    // 1b. Scrub the worker's argument and environment strings from our copy of its
    //     memory: the sandbox must not read the worker's configuration (or anything in
    //     its environment) through /proc/1/cmdline or /proc/1/environ.
    for &(start, end) in &plan.inherited_strings {
        if start != 0 && end > start {
            // SAFETY: the range is this process's own argument/environment block
            // (from /proc/self/stat before fork), mapped read-write on the initial
            // stack; after fork it is our private copy, and nothing in the child
            // reads it again (exec gets an explicit envp).
            unsafe { std::ptr::write_bytes(start as *mut u8, 0, end - start) };
        }
    }

    // 2. Wait until the parent has written our id maps and moved us into the call's
    //    cgroup; end-of-file means the parent gave up, so we stop here.
    let mut go = [0u8; 1];
    // SAFETY: `go` is a valid one-byte buffer.
    let n = unsafe { libc::read(plan.sync, go.as_mut_ptr().cast(), 1) };
    if n != 1 {
        return Err(Failure::new(
            Step::WaitForParent,
            if n == 0 { libc::EPIPE } else { sys::errno() },
        ));
    }

    // 2b. Join the call's v1 cgroups ourselves (v2: clone3 already started us inside),
    //     before anything else runs: pids, memory and CPU limits apply from here on.
    for tasks in &plan.cgroup_tasks {
        join_own_cgroup(tasks).at(Step::JoinCgroup)?;
    }

    if plan.strict {
        // 3s. A cgroup namespace rooted at the call's cgroup (joined by now), and a
        //     hostname of our own.
        namespaces::enter_cgroup_namespace()?;
        namespaces::set_hostname(b"airlock")?;
        // 4s. The new root: system dirs read-only, minimal /etc and /dev, workspace,
        //     /tmp, fresh /proc; pivot_root; old root detached; cwd under /workspace.
        if let Some(rootfs) = &plan.rootfs {
            rootfs.enter()?;
        }
    } else {
        // 3n. Standard mode: a session and process group of our own (the parent kills
        //     the group), and the workspace as working directory.
        // SAFETY: setsid takes no arguments.
        sys::check_int(unsafe { libc::setsid() }).at(Step::NewSession)?;
        // SAFETY: `host_cwd` is NUL-terminated.
        sys::check_int(unsafe { libc::chdir(plan.host_cwd.as_ptr()) }).at(Step::ChangeDirectory)?;
    }

    // 5. rlimits: open files, file size, no core dumps, CPU seconds.
    plan.rlimits.apply()?;

    // 6. Only stdin/stdout/stderr stay open across exec (plus our two close-on-exec
    //    pipes: errors on 3, the command's status on 4).
    fds::install(plan.fds)?;
    *report_fd = ERROR_FD;

    // 7. no_new_privs: exec can never grant privileges again (setuid bits, file caps);
    //    also required by Landlock and seccomp without CAP_SYS_ADMIN.
    // SAFETY: prctl with integer arguments only.
    sys::check_int(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })
        .at(Step::NoNewPrivs)?;
    // 7b. Not dumpable (after the handshake: the parent no longer opens our /proc
    //     files). In strict mode this process stays as pid 1, a fork of the worker
    //     holding a copy of its memory and the status pipe; same uid and empty
    //     capabilities would otherwise let the command read /proc/1/mem and write a
    //     forged exit status to /proc/1/fd/4. The command's own exec makes it dumpable
    //     again (its credentials do not change).
    // SAFETY: prctl with integer arguments only.
    sys::check_int(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) })
        .at(Step::NoNewPrivs)?;

    // 8. Capabilities: bounding, ambient, inheritable, permitted, effective — all empty
    //    (the bounding set only where we hold CAP_SETPCAP, as the report says).
    crate::caps::drop_all(plan.require_empty_bounding_set)?;

    // 9. Landlock: read+exec system dirs, read-write workspace and /tmp, nothing else.
    plan.landlock.apply()?;

    // 10. seccomp, last: from here on the blocked system calls fail.
    plan.seccomp.install()?;

    // 11. Strict mode: stay as a minimal init and run the command as pid 2.
    if plan.strict {
        run_as_init(plan);
    }

    // 12. execve the command (searching PATH ourselves: execvp may allocate).
    Err(plan.exec.exec())
}

/// Moves the calling (single-threaded) process into the cgroup of a v1 `tasks` file
/// (async-signal-safe).
fn join_own_cgroup(tasks: &CStr) -> Result<(), i32> {
    // SAFETY: `tasks` is NUL-terminated.
    let fd =
        sys::check_int(unsafe { libc::open(tasks.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) })?;
    let result = sys::write_all_raw(fd, b"0");
    // SAFETY: closing the descriptor opened above, once.
    unsafe { libc::close(fd) };
    result
}

/// pid 1 of the sandbox's pid namespace: forks the command, reaps every orphan, and
/// when the command exits reports its wait status and exits (async-signal-safe).
fn run_as_init(plan: &ChildPlan<'_>) {
    // SAFETY: a raw clone without CLONE_VM behaves like fork; both sides only make
    // async-signal-safe calls afterwards. (libc's fork would run atfork handlers that
    // take malloc locks possibly held by threads of the original parent.)
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            libc::SIGCHLD as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid == 0 {
        // The command: exec, or report the failure on the error pipe.
        let failure = plan.exec.exec();
        let _ = sys::write_all_raw(ERROR_FD, &failure.encode());
        // SAFETY: _exit ends this process only.
        unsafe { libc::_exit(127) };
    }
    if pid < 0 {
        let _ = sys::write_all_raw(ERROR_FD, &Failure::new(Step::Exec, sys::errno()).encode());
        // SAFETY: _exit ends this process only.
        unsafe { libc::_exit(127) };
    }
    // A recognisable name in `ps` inside the sandbox.
    // SAFETY: prctl with a NUL-terminated string.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"airlock-init".as_ptr(), 0, 0, 0) };
    // Our copy of the error pipe must close so the parent sees end-of-file when the
    // command's exec succeeds.
    // SAFETY: closing our own descriptor.
    unsafe { libc::close(ERROR_FD) };
    loop {
        let mut status = 0;
        // SAFETY: `status` is a valid out-pointer.
        let reaped = unsafe { libc::waitpid(-1, &mut status, 0) };
        if reaped == pid as libc::pid_t || (reaped == -1 && sys::errno() == libc::ECHILD) {
            let _ = sys::write_all_raw(STATUS_FD, &status.to_ne_bytes());
            // SAFETY: _exit ends pid 1, and with it the namespace.
            unsafe { libc::_exit(0) };
        }
    }
}

/// Checks `cwd` (relative to the workspace, no `..`) and returns it as a relative path.
fn relative_cwd(cwd: Option<&str>) -> Result<PathBuf, SandboxError> {
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
fn strict_landlock(sandbox: &Sandbox) -> Result<LandlockPlan, SandboxError> {
    let mut plan = LandlockPlan::new(sandbox.landlock_abi(), !sandbox.config().network);
    plan.allow(Path::new("/"), access::READ)?;
    for dir in [
        "/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32",
    ] {
        plan.allow(Path::new(dir), access::READ_EXEC)?;
    }
    for dir in ["/workspace", "/tmp", "/dev/shm"] {
        plan.allow(Path::new(dir), access::ALL)?;
    }
    for dev in ["null", "zero", "full", "random", "urandom", "tty"] {
        plan.allow(&Path::new("/dev").join(dev), access::DEVICE)?;
    }
    Ok(plan)
}

/// Landlock rules of a standard sandbox (host paths: no private root to hide the rest).
fn standard_landlock(
    sandbox: &Sandbox,
    workspace: &Path,
    tmp: &Path,
) -> Result<LandlockPlan, SandboxError> {
    let mut plan = LandlockPlan::new(sandbox.landlock_abi(), !sandbox.config().network);
    for dir in [
        "/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32",
    ] {
        plan.allow(Path::new(dir), access::READ_EXEC)?;
    }
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
    for dev in ["null", "zero", "full", "random", "urandom", "tty"] {
        plan.allow(&Path::new("/dev").join(dev), access::DEVICE)?;
    }
    plan.allow(workspace, access::ALL)?;
    plan.allow(tmp, access::ALL)?;
    Ok(plan)
}

/// A per-call temporary directory for standard mode (strict mode has its own tmpfs).
struct CallTmp(PathBuf);

impl CallTmp {
    fn create() -> Result<Self, SandboxError> {
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
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The running child, killed and reaped on every exit path.
struct Child {
    pid: libc::pid_t,
    strict: bool,
    cgroup: Option<Box<dyn CallCgroup>>,
    reaped: bool,
}

impl Child {
    /// Kills the whole sandbox: its cgroup, its first process, and (standard mode) its
    /// process group.
    fn kill(&self) {
        if let Some(cgroup) = &self.cgroup {
            let _ = cgroup.kill();
        }
        // SAFETY: kill takes no pointers; the pid is our unreaped child, so it cannot
        // have been recycled.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        if !self.strict {
            // SAFETY: as above; the child made itself a process group leader.
            unsafe { libc::kill(-self.pid, libc::SIGKILL) };
        }
    }

    /// Blocks until the child exits; returns its wait status and resource usage.
    fn reap(&mut self) -> Result<(i32, libc::rusage), SandboxError> {
        let mut status = 0;
        // SAFETY: an all-zero rusage is valid for the kernel to overwrite.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: valid out-pointers; waits for our own child only.
            let ret = unsafe { libc::wait4(self.pid, &mut status, 0, &mut usage) };
            if ret == self.pid {
                self.reaped = true;
                return Ok((status, usage));
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                self.reaped = true;
                return Err(SandboxError::Io(err));
            }
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if !self.reaped {
            self.kill();
            let _ = self.reap();
        }
        if let Some(cgroup) = &mut self.cgroup {
            let _ = cgroup.remove();
        }
    }
}

/// Captured output of one stream.
struct Capture {
    fd: Option<OwnedFd>,
    data: Vec<u8>,
    cap: usize,
    truncated: bool,
    stream: Stream,
}

impl Capture {
    fn new(fd: OwnedFd, cap: usize, stream: Stream) -> Self {
        Capture {
            fd: Some(fd),
            data: Vec::new(),
            cap,
            truncated: false,
            stream,
        }
    }

    /// Reads what is available; keeps draining past the cap so the child never blocks.
    fn read(&mut self, sink: &mut dyn OutputSink) {
        let Some(fd) = &self.fd else { return };
        let mut buf = [0u8; 65536];
        loop {
            // SAFETY: `buf` is a valid writable buffer of its length.
            let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n > 0 {
                let chunk = &buf[..n as usize];
                let room = self.cap.saturating_sub(self.data.len());
                let kept = &chunk[..chunk.len().min(room)];
                if kept.len() < chunk.len() {
                    self.truncated = true;
                }
                if !kept.is_empty() {
                    self.data.extend_from_slice(kept);
                    sink.chunk(self.stream, kept);
                }
                continue;
            }
            if n == 0 || sys::errno() != libc::EINTR {
                if n == 0 {
                    self.fd = None;
                }
                return;
            }
        }
    }
}

/// Runs one command in a fresh sandbox.
pub(crate) fn run(
    sandbox: &Sandbox,
    spec: &CommandSpec,
    sink: &mut dyn OutputSink,
    cancel: &Cancel,
) -> Result<RunOutcome, SandboxError> {
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
        Some(tmp) => (workspace.display().to_string(), tmp.0.display().to_string()),
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
    let rootfs = if strict {
        Some(RootfsPlan::prepare(
            &workspace,
            &cwd,
            cfg.tmp_bytes,
            cfg.network,
        )?)
    } else {
        None
    };
    let host_cwd = sys::path_cstring(&workspace.join(&cwd)).map_err(SandboxError::Io)?;
    let rlimits = RlimitPlan::prepare(Rlimits {
        nofile: cfg.nofile,
        fsize_bytes: cfg.fsize_bytes,
        timeout: spec.timeout,
    })?;
    let landlock = match &call_tmp {
        None => strict_landlock(sandbox)?,
        Some(tmp) => standard_landlock(sandbox, &workspace, &tmp.0)?,
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
    report.limits.timeout_ms = Some(spec.timeout.as_millis() as u64);

    let pipe = || sys::pipe().map_err(|e| SandboxError::Fd(fds::FdError::Pipe(e)));
    let (stdin_r, stdin_w) = pipe()?;
    let (stdout_r, stdout_w) = pipe()?;
    let (stderr_r, stderr_w) = pipe()?;
    let (sync_r, sync_w) = pipe()?;
    let (error_r, error_w) = pipe()?;
    let (status_r, status_w) = pipe()?;
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
    // SAFETY (both clones): the child runs only `child_main`, which makes
    // async-signal-safe calls on the prepared plan and never returns.
    let cloned_into = match cgroup.as_ref().and_then(|c| c.clone_into_fd()) {
        Some(fd) => unsafe { namespaces::clone_into_cgroup(flags, fd) }?,
        None => None,
    };
    let joined = cloned_into.is_some();
    let pid = match cloned_into {
        Some(pid) => pid,
        None => unsafe { namespaces::clone_process(flags) }?,
    };
    if pid == 0 {
        child_main(&plan);
    }
    let mut child = Child {
        pid,
        strict,
        cgroup,
        reaped: false,
    };
    drop((stdin_r, stdout_w, stderr_w, sync_r, error_w, status_w));
    drop(plan);

    // Handshake: id maps, cgroup, then let the child go.
    if strict {
        namespaces::write_id_maps(pid)?;
    }
    if let Some(cgroup) = child.cgroup.as_ref().filter(|_| !joined) {
        cgroup.join(pid)?;
    }
    sys::write_all_raw(sync_w.as_raw_fd(), &[1])
        .map_err(|e| SandboxError::Io(io::Error::from_raw_os_error(e)))?;
    drop(sync_w);

    // Setup result: end-of-file = exec succeeded; 8 bytes = the failed step.
    if let Some(failure) = read_failure(&error_r)? {
        child.kill();
        let _ = child.reap();
        return Err(SandboxError::Setup {
            step: failure.step.describe(),
            source: io::Error::from_raw_os_error(failure.errno),
        });
    }
    drop(error_r);

    supervise(
        sandbox, spec, sink, cancel, child, started, report, stdin_w, stdout_r, stderr_r, status_r,
        call_tmp,
    )
}

/// Reads the error pipe to end-of-file.
fn read_failure(error_r: &OwnedFd) -> Result<Option<Failure>, SandboxError> {
    let mut buf = [0u8; 8];
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: reading into the unfilled tail of `buf`.
        let n = unsafe {
            libc::read(
                error_r.as_raw_fd(),
                buf[got..].as_mut_ptr().cast(),
                buf.len() - got,
            )
        };
        match n {
            0 => break,
            n if n > 0 => got += n as usize,
            _ if sys::errno() == libc::EINTR => {}
            _ => return Err(SandboxError::Io(io::Error::last_os_error())),
        }
    }
    match got {
        0 => Ok(None),
        8 => Ok(Some(
            Failure::decode(buf).unwrap_or(Failure::new(Step::Exec, libc::EIO)),
        )),
        _ => Ok(Some(Failure::new(Step::Exec, libc::EIO))),
    }
}

/// The parent's loop: feeds stdin, captures output, enforces the wall clock and
/// cancellation, reaps, and cleans up.
#[allow(clippy::too_many_arguments)]
fn supervise(
    sandbox: &Sandbox,
    spec: &CommandSpec,
    sink: &mut dyn OutputSink,
    cancel: &Cancel,
    mut child: Child,
    started: Instant,
    report: crate::IsolationReport,
    stdin_w: OwnedFd,
    stdout_r: OwnedFd,
    stderr_r: OwnedFd,
    status_r: OwnedFd,
    call_tmp: Option<CallTmp>,
) -> Result<RunOutcome, SandboxError> {
    let cap = sandbox.config().output_cap_bytes;
    let deadline = started + spec.timeout;
    for fd in [&stdin_w, &stdout_r, &stderr_r, &status_r] {
        sys::set_nonblocking(fd.as_raw_fd()).map_err(SandboxError::Io)?;
    }
    let mut stdout = Capture::new(stdout_r, cap, Stream::Stdout);
    let mut stderr = Capture::new(stderr_r, cap, Stream::Stderr);
    let mut stdin = (!spec.stdin.is_empty()).then_some(stdin_w);
    let mut stdin_pos = 0usize;
    let pidfd = pidfd_open(child.pid);

    let mut timed_out = false;
    let mut cancelled = false;
    let mut exit: Option<(i32, libc::rusage)> = None;
    let mut drain_deadline = None;

    loop {
        let now = Instant::now();
        if exit.is_none() && !timed_out && !cancelled {
            if now >= deadline {
                timed_out = true;
                child.kill();
            } else if cancel.is_cancelled() {
                cancelled = true;
                child.kill();
            }
        }
        if exit.is_some()
            && (stdout.fd.is_none() && stderr.fd.is_none()
                || drain_deadline.is_some_and(|d| now >= d))
        {
            break;
        }

        let mut pfds: Vec<libc::pollfd> = Vec::with_capacity(4);
        let mut push = |fd: RawFd, events: libc::c_short| {
            pfds.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            });
        };
        push(
            stdout.fd.as_ref().map_or(-1, |f| f.as_raw_fd()),
            libc::POLLIN,
        );
        push(
            stderr.fd.as_ref().map_or(-1, |f| f.as_raw_fd()),
            libc::POLLIN,
        );
        push(stdin.as_ref().map_or(-1, |f| f.as_raw_fd()), libc::POLLOUT);
        let watch_exit = exit.is_none();
        push(
            match (&pidfd, watch_exit) {
                (Some(fd), true) => fd.as_raw_fd(),
                _ => -1,
            },
            libc::POLLIN,
        );
        let until = match (exit.is_some(), drain_deadline) {
            (true, Some(d)) => d,
            _ if timed_out || cancelled => now + POLL_TICK,
            _ => deadline.min(now + POLL_TICK),
        };
        let wait_ms = until
            .saturating_duration_since(now)
            .as_millis()
            .clamp(0, 1000) as libc::c_int;
        // SAFETY: `pfds` is a valid array of pollfd of the given length.
        let ready = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, wait_ms) };
        if ready == -1 && sys::errno() != libc::EINTR {
            return Err(SandboxError::Io(io::Error::last_os_error()));
        }

        if pfds[0].revents != 0 {
            stdout.read(sink);
        }
        if pfds[1].revents != 0 {
            stderr.read(sink);
        }
        if pfds[2].revents != 0
            && let Some(fd) = &stdin
        {
            let rest = &spec.stdin[stdin_pos..];
            // SAFETY: `rest` is a valid readable slice.
            let n = unsafe { libc::write(fd.as_raw_fd(), rest.as_ptr().cast(), rest.len()) };
            if n > 0 {
                stdin_pos += n as usize;
            }
            // Done, or the child closed its stdin (EPIPE; Rust ignores SIGPIPE).
            if stdin_pos >= spec.stdin.len()
                || (n == -1 && !matches!(sys::errno(), libc::EAGAIN | libc::EINTR))
            {
                stdin = None;
            }
        }
        let exited = if watch_exit {
            match &pidfd {
                Some(_) => pfds[3].revents != 0,
                None => has_exited(child.pid),
            }
        } else {
            false
        };
        if exited {
            // The command is done: kill whatever it left behind, then reap.
            if let Some(cgroup) = &child.cgroup {
                let _ = cgroup.kill();
            }
            exit = Some(child.reap()?);
            drain_deadline = Some(Instant::now() + DRAIN_GRACE);
            stdin = None;
        }
    }
    let duration = started.elapsed();
    let Some((init_status, rusage)) = exit else {
        return Err(SandboxError::Io(io::Error::other(
            "the sandbox was not reaped",
        )));
    };

    // The command's own status: reported by init in strict mode, else the child's.
    let mut status_buf = [0u8; 4];
    // SAFETY: reading into a valid 4-byte buffer.
    let n = unsafe { libc::read(status_r.as_raw_fd(), status_buf.as_mut_ptr().cast(), 4) };
    let status = if n == 4 {
        i32::from_ne_bytes(status_buf)
    } else {
        init_status
    };
    let (exit_code, signal) = if libc::WIFEXITED(status) {
        (Some(libc::WEXITSTATUS(status)), None)
    } else if libc::WIFSIGNALED(status) {
        (None, Some(libc::WTERMSIG(status)))
    } else {
        (None, None)
    };

    let cg_peak = child.cgroup.as_ref().and_then(|c| c.peak_memory_bytes());
    let cg_cpu = child.cgroup.as_ref().and_then(|c| c.cpu_usage_us());
    if let Some(mut cgroup) = child.cgroup.take() {
        cgroup.remove()?;
    }
    drop(call_tmp);

    let tv_ms = |tv: libc::timeval| tv.tv_sec as u64 * 1000 + tv.tv_usec as u64 / 1000;
    let usage = Usage {
        cpu_user_ms: cg_cpu.map_or(tv_ms(rusage.ru_utime), |(u, _)| u / 1000),
        cpu_system_ms: cg_cpu.map_or(tv_ms(rusage.ru_stime), |(_, s)| s / 1000),
        peak_memory_bytes: cg_peak.unwrap_or(rusage.ru_maxrss as u64 * 1024),
    };
    Ok(RunOutcome {
        exit_code,
        signal,
        stdout: stdout.data,
        stderr: stderr.data,
        stdout_truncated: stdout.truncated,
        stderr_truncated: stderr.truncated,
        timed_out,
        cancelled,
        duration,
        usage,
        isolation: report,
    })
}

/// A pidfd for our child (Linux 5.3+), to poll for its exit.
fn pidfd_open(pid: libc::pid_t) -> Option<OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open takes no pointers.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0u32) };
    // SAFETY: on success the descriptor is new and owned by nobody else.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Without pidfds: whether the child has exited, without reaping it.
fn has_exited(pid: libc::pid_t) -> bool {
    // SAFETY: an all-zero siginfo is valid for the kernel to overwrite.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; WNOWAIT leaves the child reapable.
    let ret = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    // SAFETY: si_pid is valid to read for SIGCHLD-type siginfo (zero when none).
    ret == 0 && unsafe { info.si_pid() } != 0
}
