//! The sandbox's init: once confined, the sandbox's first process stays and runs the
//! command as its child, so that something of ours outlives the command and can account
//! for what it left behind.
//!
//! - **Strict**: pid 1 of the sandbox's pid namespace. When the command exits it reports
//!   and exits, and the kernel kills whatever is left in the namespace.
//! - **Standard** (no pid namespace): a child subreaper. Whatever a process of the
//!   command does — `setsid`, `setpgid`, a double fork — it stays init's descendant: an
//!   orphan is reparented to its nearest subreaper, and nothing moves a process out from
//!   under one. When the command exits, or the parent asks with `SIGTERM` (a timeout, a
//!   cancel), init kills its children a generation at a time until none is left, then
//!   reports. It signals its own children only, whose pids cannot be recycled before it
//!   reaps them, so nothing outside the sandbox is ever signalled. The command cannot
//!   signal init: it runs in a process group of its own under a seccomp filter that
//!   refuses signals naming init or init's group, and, with Landlock's signal scoping
//!   (ABI 6), in a Landlock domain nested in init's as well.
//!
//! Everything here runs in a fork of a multithreaded process: async-signal-safe system
//! calls only, no allocation, no locks.

use std::os::fd::RawFd;

use super::handshake;
use super::plan::ExecView;
use crate::fds::ERROR_FD;
use crate::step::{AtStep, Failure, Step};
use crate::sys;

/// The stack the command's process runs on between its `clone` and its `execve`.
const COMMAND_STACK_BYTES: usize = 64 * 1024;

/// Where the standard init reads the pids of its children (`CONFIG_PROC_CHILDREN`).
const CHILDREN_LIST: &std::ffi::CStr = c"/proc/thread-self/children";

/// How the command's process starts, between its `clone` and its `execve`.
struct CommandStart<'a> {
    exec: &'a ExecView<'a>,
    /// Standard: die with init, take an empty signal mask (init blocks two signals),
    /// and, when `Some(true)`, enter a Landlock domain nested in init's.
    standard: Option<bool>,
}

/// pid 1 of a strict sandbox's pid namespace: starts the command, reaps every orphan,
/// and when the command exits reports its wait status and what the reaped processes
/// used, and exits — taking the namespace, and everything left in it, along.
pub(super) fn run_strict(exec: &ExecView<'_>) -> ! {
    let pid = start_command(&CommandStart {
        exec,
        standard: None,
    });
    loop {
        let mut status = 0;
        // SAFETY: `status` is a valid out-pointer.
        let reaped = unsafe { libc::waitpid(-1, &mut status, 0) };
        if reaped == pid || (reaped == -1 && sys::errno() == libc::ECHILD) {
            handshake::report_status(&handshake::InitReport::now(status));
            // SAFETY: _exit ends pid 1, and with it the namespace.
            unsafe { libc::_exit(0) };
        }
    }
}

/// The init of a standard sandbox: a subreaper that, when the command has exited or the
/// parent sends `SIGTERM`, kills everything the command left behind before it reports.
/// `scope_signals`: Landlock can scope signals (ABI 6), and the command is put in a
/// domain of its own.
pub(super) fn run_standard(exec: &ExecView<'_>, scope_signals: bool) -> ! {
    let children = match become_subreaper() {
        Ok(fd) => fd,
        Err(failure) => fail(failure),
    };
    // Blocked before the command exists, so neither is lost before init waits for them:
    // SIGCHLD says a child ended, SIGTERM is the parent's request to end the sandbox.
    let waited = signal_bit(libc::SIGCHLD) | signal_bit(libc::SIGTERM);
    if let Err(errno) = sys::set_signal_mask(libc::SIG_BLOCK, waited) {
        fail(Failure::new(Step::SignalDefaults, errno));
    }
    let command = start_command(&CommandStart {
        exec,
        standard: Some(scope_signals),
    });
    let mut status = None;
    'wait: loop {
        // SAFETY: `waited` is a valid kernel sigset for the call; no siginfo or timeout.
        let signal = unsafe {
            libc::syscall(
                libc::SYS_rt_sigtimedwait,
                &waited as *const u64,
                std::ptr::null_mut::<libc::siginfo_t>(),
                std::ptr::null::<libc::timespec>(),
                8usize,
            )
        };
        if signal == libc::c_long::from(libc::SIGTERM) {
            break;
        }
        // SIGCHLD (or an interruption): reap what has ended, without blocking.
        loop {
            let mut wait_status = 0;
            // SAFETY: `wait_status` is a valid out-pointer.
            let reaped =
                unsafe { libc::waitpid(-1, &mut wait_status, libc::WNOHANG | libc::__WALL) };
            if reaped == command {
                status = Some(wait_status);
                break 'wait;
            }
            if reaped == 0 {
                break;
            }
            if reaped == -1 && sys::errno() != libc::EINTR {
                break 'wait;
            }
        }
    }
    kill_descendants(children, command, &mut status);
    // A command killed here before it was reaped ended by SIGKILL.
    handshake::report_status(&handshake::InitReport::now(status.unwrap_or(libc::SIGKILL)));
    // SAFETY: _exit ends this process only; it has no child left.
    unsafe { libc::_exit(0) }
}

/// Standard: makes init the subreaper of everything the command starts and opens the
/// list of its children (close-on-exec), before any of them exists.
fn become_subreaper() -> Result<RawFd, Failure> {
    // SAFETY: prctl with integer arguments only.
    sys::check_int(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) })
        .at(Step::Subreaper)?;
    // SAFETY: a NUL-terminated path; the descriptor is init's alone (close-on-exec).
    sys::check_int(unsafe { libc::open(CHILDREN_LIST.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) })
        .at(Step::Subreaper)
}

/// Kills init's children until it has none left. Each round kills every child the list
/// names — pids that cannot be recycled, since init alone reaps them — and reaps those
/// that have ended; the orphans of the killed come to init, their subreaper, and are
/// killed in the next round. Records the command's status if it is reaped here.
fn kill_descendants(children: RawFd, command: libc::pid_t, status: &mut Option<libc::c_int>) {
    let mut list = [0u8; 4096];
    loop {
        // SAFETY: reading into a valid buffer of its length; `children` is open.
        let read = unsafe { libc::pread(children, list.as_mut_ptr().cast(), list.len(), 0) };
        if let Ok(len) = usize::try_from(read) {
            for_each_pid(&list[..len], |pid| {
                // SAFETY: kill takes no pointers; `pid` is init's unreaped child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            });
        }
        // Block for the first child to end, then take whatever else has ended.
        let mut flags = libc::__WALL;
        loop {
            let mut wait_status = 0;
            // SAFETY: `wait_status` is a valid out-pointer.
            let reaped = unsafe { libc::waitpid(-1, &mut wait_status, flags) };
            if reaped > 0 {
                if reaped == command && status.is_none() {
                    *status = Some(wait_status);
                }
                flags = libc::__WALL | libc::WNOHANG;
            } else if reaped == 0 {
                break;
            } else if sys::errno() != libc::EINTR {
                // ECHILD: nothing is left.
                return;
            }
        }
    }
}

/// Calls `kill` with each pid of a children list (`"12 345 "`: each pid followed by a
/// space); a pid cut off at the end of a full buffer is skipped, read again next round.
fn for_each_pid(list: &[u8], mut kill: impl FnMut(libc::pid_t)) {
    // `None` once the digits overflow: not a pid the kernel writes, and never signalled.
    let mut pid: Option<libc::pid_t> = Some(0);
    let mut digits = false;
    for &byte in list {
        if byte.is_ascii_digit() {
            pid = pid
                .and_then(|p| p.checked_mul(10))
                .and_then(|p| p.checked_add(libc::pid_t::from(byte - b'0')));
            digits = true;
        } else {
            if let Some(found @ 1..) = pid.filter(|_| digits) {
                kill(found);
            }
            pid = Some(0);
            digits = false;
        }
    }
}

/// The bit of `signal` in a kernel signal set.
fn signal_bit(signal: libc::c_int) -> u64 {
    1u64 << (signal - 1)
}

/// Reports `failure` on the error pipe and ends init: the command never ran.
fn fail(failure: Failure) -> ! {
    handshake::report_failure(ERROR_FD, failure);
    // SAFETY: _exit ends this process only.
    unsafe { libc::_exit(127) }
}

/// Starts the command (see [`spawn_command`]), then makes init what it is from then on:
/// named, without the error pipe (end-of-file there tells the parent the command's
/// `execve` succeeded) and without the command's standard streams.
fn start_command(start: &CommandStart<'_>) -> libc::pid_t {
    let pid = match spawn_command(start) {
        Ok(pid) => pid,
        Err(errno) => fail(Failure::new(Step::Exec, errno)),
    };
    // A recognisable name in `ps`.
    // SAFETY: prctl with a NUL-terminated string.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"airlock-init".as_ptr(), 0, 0, 0) };
    handshake::close_error_pipe();
    // Init has no use for the command's stdin, stdout and stderr: without its copies,
    // the parent sees end-of-file on the output as soon as the command and whatever it
    // started are gone, and (strict) can answer the call before init's own exit (the
    // namespaces' teardown) is over.
    for fd in 0..=2 {
        // SAFETY: closing our own descriptors, once each.
        unsafe { libc::close(fd) };
    }
    pid
}

/// Starts the command as init's child the way `posix_spawn` does: `CLONE_VM |
/// CLONE_VFORK` on a stack of its own, so that init — a copy of the worker's address
/// space — is not copied again for a process that replaces it at once; init waits,
/// suspended, until the command's `execve` succeeds or its process exits. Returns the
/// command's pid, or the `errno` of the step that failed.
fn spawn_command(start: &CommandStart<'_>) -> Result<libc::pid_t, i32> {
    // SAFETY: an anonymous private mapping; no pointer is passed in.
    let stack = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            COMMAND_STACK_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
            -1,
            0,
        )
    };
    if stack == libc::MAP_FAILED {
        return Err(sys::errno());
    }
    // SAFETY: the stack grows down from the end of the mapping made above; `start`
    // outlives the call, since init is suspended until the child has exec'd or exited.
    // The child runs `command_main` only: async-signal-safe calls on memory it shares
    // with init, which does nothing meanwhile.
    let pid = unsafe {
        libc::clone(
            command_main,
            stack.cast::<u8>().add(COMMAND_STACK_BYTES).cast(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            std::ptr::from_ref(start).cast_mut().cast(),
        )
    };
    let spawned = if pid < 0 { Err(sys::errno()) } else { Ok(pid) };
    // SAFETY: unmapping the stack mapped above, which the child no longer uses: it has
    // exec'd (its own address space now) or exited.
    unsafe { libc::munmap(stack, COMMAND_STACK_BYTES) };
    spawned
}

/// The command's process until its `execve`: the standard level's last steps, then exec;
/// or report the failure on the error pipe and exit.
extern "C" fn command_main(start: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `spawn_command` passes a pointer to a `CommandStart` that outlives this
    // process's use of init's memory.
    let start = unsafe { &*start.cast::<CommandStart<'_>>() };
    let failure = match start.standard.map_or(Ok(()), standard_command_steps) {
        Ok(()) => start.exec.exec(),
        Err(failure) => failure,
    };
    handshake::report_failure(ERROR_FD, failure);
    // SAFETY: _exit ends this process only (it is not in init's thread group).
    unsafe { libc::_exit(127) }
}

/// Standard: the command cannot signal init, which cleans up after it — a process
/// group of its own (so that `kill 0` means the command's processes), a seccomp filter
/// stacked on the sandbox's that refuses signals naming init or its group, and, when
/// Landlock scopes signals, a Landlock domain nested in init's (which also keeps it
/// from everything else outside the sandbox) —; it dies with init should init die
/// anyway; and it starts with the empty signal mask init gave up.
fn standard_command_steps(scope_signals: bool) -> Result<(), Failure> {
    // SAFETY: prctl with integer arguments only.
    sys::check_int(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) })
        .at(Step::ParentDeathSignal)?;
    // SAFETY: setpgid with integer arguments only.
    sys::check_int(unsafe { libc::setpgid(0, 0) }).at(Step::CommandGroup)?;
    // SAFETY: getppid takes no arguments; the parent is init (suspended in its vfork).
    let init = unsafe { libc::getppid() }.cast_unsigned();
    crate::seccomp::install_raw(&crate::seccomp::parent_guard(init)).at(Step::Seccomp)?;
    if scope_signals {
        crate::landlock_rules::enter_scoped_domain().at(Step::Landlock)?;
    }
    sys::set_signal_mask(libc::SIG_SETMASK, 0).at(Step::SignalDefaults)
}

#[cfg(test)]
mod tests {
    use super::for_each_pid;

    fn pids(list: &[u8]) -> Vec<libc::pid_t> {
        let mut out = Vec::new();
        for_each_pid(list, |pid| out.push(pid));
        out
    }

    #[test]
    fn a_children_list_reads_as_its_pids() {
        assert_eq!(pids(b""), Vec::<libc::pid_t>::new());
        assert_eq!(pids(b"12 "), vec![12]);
        assert_eq!(pids(b"12 345 6789 "), vec![12, 345, 6789]);
        // A pid cut off at the end of a full buffer waits for the next read.
        assert_eq!(pids(b"12 34"), vec![12]);
        // Never 0 (the caller's own group) nor anything that overflowed.
        assert_eq!(pids(b"0 99999999999999999999 7 "), vec![7]);
    }
}
