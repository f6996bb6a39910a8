//! The child: the one straight sequence of confinement steps between `clone` and
//! `execve`; the sandbox's init, which then runs the command, is [`init`](super::init).
//!
//! Everything here runs in a fork of a multithreaded process: async-signal-safe system
//! calls on the plan prepared before `clone`, no allocation, no locks.

use std::convert::Infallible;
use std::ffi::CStr;
use std::os::fd::RawFd;

use super::handshake;
use super::init;
use super::plan::{CallView, ChildPlan};
use super::pool::EntrySide;
use crate::fds::{self, ERROR_FD};
use crate::loopback;
use crate::namespaces;
use crate::rootfs;
use crate::step::{AtStep, Failure, Step};
use crate::sys;

/// A fresh sandbox's child: one straight sequence of confinement steps, then `execve`.
///
/// Never returns. Any failing step is reported through the error pipe and ends the
/// child with status 127: the command never runs with a layer missing.
pub(super) fn child_main(plan: &ChildPlan<'_>, call: &CallView<'_>) -> ! {
    let mut report_fd = plan.fds.error;
    let result =
        before_call(plan).and_then(|landlock| after_call(plan, call, landlock, &mut report_fd));
    fail(report_fd, result)
}

/// A pre-built sandbox's child (`spawn::pool`): the same sequence as [`child_main`],
/// waiting between [`before_call`] and [`after_call`] until its call arrives.
pub(super) fn prebuilt_main(plan: &ChildPlan<'_>, entry: &mut EntrySide) -> ! {
    let mut report_fd = plan.fds.error;
    let result = match before_call(plan) {
        Err(failure) => Err(failure),
        Ok(landlock) => match entry.wait_for_call(plan, landlock) {
            Err(failure) => Err(failure),
            Ok(call) => after_call(plan, &call, landlock, &mut report_fd),
        },
    };
    fail(report_fd, result)
}

fn fail(report_fd: RawFd, result: Result<Infallible, Failure>) -> ! {
    let failure = match result {
        Err(failure) => failure,
        Ok(never) => match never {},
    };
    handshake::report_failure(report_fd, failure);
    // SAFETY: _exit is async-signal-safe and ends this process only.
    unsafe { libc::_exit(127) }
}

/// The steps that do not depend on the call: parent-death signal, the handshake, the
/// cgroup, the bounding set, in strict mode the cgroup namespace, the hostname, the
/// proxy's listener and the part of the new root every call shares, and the Landlock
/// ruleset but for the call's own rules. Returns the ruleset's descriptor.
fn before_call(plan: &ChildPlan<'_>) -> Result<RawFd, Failure> {
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

    // 1c. A session and process group of our own, at every level, pre-built or not: no
    //     controlling terminal, so a command cannot open the worker's terminal
    //     (`/dev/tty`: ENXIO) to push input into it (TIOCSTI) or read what is typed
    //     there. (At the standard level the command then takes a process group of its
    //     own, so that its `kill 0` does not reach init: `init`.)
    // SAFETY: setsid takes no arguments.
    sys::check_int(unsafe { libc::setsid() }).at(Step::NewSession)?;

    // 2. Wait until the parent has written our id maps and moved us into the call's
    //    cgroup; end-of-file means the parent gave up, so we stop here.
    handshake::wait_for_release(plan.sync)?;

    // 2b. Join the call's v1 cgroups ourselves (v2: clone3 already started us inside),
    //     before anything else runs: pids, memory and CPU limits apply from here on.
    for tasks in &plan.cgroup_tasks {
        join_own_cgroup(tasks).at(Step::JoinCgroup)?;
    }

    // 2c. Empty the bounding set (where we hold CAP_SETPCAP): what any later execve
    //     may grant. The capabilities the setup still uses stay effective until step 8;
    //     a pre-built sandbox does this before its call instead of on its path.
    crate::caps::empty_bounding_set(plan.require_empty_bounding_set)?;

    if plan.strict {
        // 3s. A cgroup namespace rooted at the call's cgroup (joined by now), and a
        //     hostname of our own.
        namespaces::enter_cgroup_namespace()?;
        namespaces::set_hostname(b"airlock")?;
        // 3p. Behind the egress proxy: the namespace's loopback up, and a listener on
        //     127.0.0.1:3128 in it handed to the worker, which serves the proxy on it.
        //     Our copies are closed here; the command never holds it.
        if let Some(channel) = plan.proxy_channel {
            loopback::bring_up()?;
            loopback::hand_over_listener(channel)?;
        }
        // 4s. The new root, the part every call shares: system dirs read-only,
        //     minimal /etc, /tmp, fresh /proc, minimal /dev; pivot_root, with the
        //     host's root still at /oldroot.
        if let Some(template) = plan.rootfs {
            template.build_root()?;
        }
    }

    // 4l. The Landlock ruleset, built now for every path that already exists (system
    //     dirs, /tmp); the workspace's rule is added in step 9, once it is mounted.
    //     Nothing is restricted yet.
    plan.landlock.prepare()
}

/// The steps that depend on the call, then `execve`: the rest of the new root (the
/// workspace, the old root detached, the working directory), rlimits, descriptors,
/// `no_new_privs`, capabilities, Landlock, seccomp.
fn after_call(
    plan: &ChildPlan<'_>,
    call: &CallView<'_>,
    landlock: RawFd,
    report_fd: &mut RawFd,
) -> Result<Infallible, Failure> {
    if plan.strict {
        // 4w. The workspace at /workspace, the host's root detached, the new root
        //     read-only, the working directory under /workspace.
        if plan.rootfs.is_some() {
            rootfs::finish_root(call.workspace_source, call.cwd)?;
        }
    } else {
        // 3n. Standard mode (its own session since step 1c): the workspace as working
        //     directory.
        // SAFETY: `cwd` is NUL-terminated.
        sys::check_int(unsafe { libc::chdir(call.cwd.as_ptr()) }).at(Step::ChangeDirectory)?;
    }

    // 5. rlimits: open files, file size, no core dumps, CPU seconds.
    call.rlimits.apply()?;

    // 6. Only stdin/stdout/stderr stay open across exec (plus our two close-on-exec
    //    pipes: errors on 3, the command's status on 4; and the prepared Landlock
    //    ruleset on 5, close-on-exec, closed in step 9).
    fds::install(plan.fds, landlock)?;
    *report_fd = ERROR_FD;

    // 7. no_new_privs: exec can never grant privileges again (setuid bits, file caps);
    //    also required by Landlock and seccomp without CAP_SYS_ADMIN.
    // SAFETY: prctl with integer arguments only.
    sys::check_int(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })
        .at(Step::NoNewPrivs)?;
    // 7b. Not dumpable (after the handshake: the parent no longer opens our /proc
    //     files). This process stays as the sandbox's init (step 11), a fork of the
    //     worker holding a copy of its memory and the status pipe; same uid and empty
    //     capabilities would otherwise let the command read init's /proc/<pid>/mem and
    //     write a forged exit status to its fd 4. The command's own exec makes it
    //     dumpable again (its credentials do not change).
    // SAFETY: prctl with integer arguments only.
    sys::check_int(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) })
        .at(Step::NotDumpable)?;

    // 8. Capabilities: ambient, inheritable, permitted, effective — all empty (the
    //    bounding set was emptied in step 2c).
    crate::caps::drop_all()?;

    // 9. Landlock: read+exec system dirs, read-write workspace and /tmp, nothing else
    //    (the ruleset prepared in step 4l, with the workspace's rule added now).
    plan.landlock.apply_prepared(fds::LANDLOCK_FD)?;

    // 9b. Every signal's default disposition and an empty signal mask: an ignored
    //     signal or a blocked one survives `execve`, and the worker ignores SIGPIPE
    //     (the Rust runtime does), so a pipeline's writer would see EPIPE instead of
    //     dying of SIGPIPE. The command inherits init's.
    reset_signals().at(Step::SignalDefaults)?;

    // 10. seccomp, last: from here on the blocked system calls fail.
    plan.seccomp.install()?;

    // 11. Stay as the sandbox's init and run the command as its child (`init`): pid 1
    //     of the pid namespace in strict mode; at the standard level the subreaper of
    //     everything the command starts, which kills what it left behind. The command's
    //     process execs, searching PATH itself (execvp may allocate).
    if plan.strict {
        init::run_strict(&call.exec)
    } else {
        init::run_standard(&call.exec, plan.landlock.scopes_signals())
    }
}

/// The kernel's highest signal number (`_NSIG`).
const LAST_SIGNAL: libc::c_int = 64;

/// Sets every catchable signal's disposition to `SIG_DFL` and empties the signal mask,
/// with raw `rt_sigaction` and `rt_sigprocmask` (async-signal-safe; glibc's wrappers
/// refuse the signals it reserves for itself).
fn reset_signals() -> Result<(), i32> {
    // The kernel's `struct sigaction` with every field zero: handler SIG_DFL (0), no
    // flags, an empty mask. At most 32 bytes on every 64-bit architecture, whatever
    // the order of its fields.
    let default = [0u64; 4];
    let set_size: libc::size_t = 8;
    for signal in 1..=LAST_SIGNAL {
        if signal == libc::SIGKILL || signal == libc::SIGSTOP {
            continue;
        }
        // SAFETY: `default` is a valid, zeroed kernel sigaction, alive for the call; no
        // old action is asked for.
        sys::check(unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                signal,
                default.as_ptr(),
                std::ptr::null_mut::<u64>(),
                set_size,
            )
        })?;
    }
    // After the dispositions: a signal pending once unblocked finds its default action.
    sys::set_signal_mask(libc::SIG_SETMASK, 0)
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
