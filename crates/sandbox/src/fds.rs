//! File descriptors: the sandbox sees exactly stdin, stdout and stderr (pipes to the
//! worker). Everything else the worker had open — sockets, database files, the gRPC
//! listener — is closed before `execve`, so no descriptor leaks a capability.
//!
//! The one exception until `execve` is the error pipe, moved to descriptor 3 and
//! close-on-exec: it closes by itself when the exec succeeds.

use std::os::fd::RawFd;

use crate::step::{AtStep, Failure, Step};
use crate::sys;

/// One `thiserror` enum per module (only child-side failures exist here, and those
/// travel as [`Failure`]s); kept for symmetry with the other barriers.
#[derive(Debug, thiserror::Error)]
pub enum FdError {
    #[error("cannot create a pipe: {0}")]
    Pipe(#[source] std::io::Error),
}

/// Where the error pipe lives after [`install`].
pub(crate) const ERROR_FD: RawFd = 3;
/// Where the status pipe lives after [`install`].
pub(crate) const STATUS_FD: RawFd = 4;

/// The child's ends of the pipes, as raw numbers (all ≥ 3, close-on-exec).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChildFds {
    pub stdin: RawFd,
    pub stdout: RawFd,
    pub stderr: RawFd,
    pub error: RawFd,
    pub status: RawFd,
}

/// Child side: pipes onto 0, 1, 2; the error pipe onto 3, the status pipe onto 4;
/// everything above closed (async-signal-safe).
pub(crate) fn install(fds: ChildFds) -> Result<(), Failure> {
    // First park the two pipes above every descriptor we are about to overwrite.
    let error = dup_high(fds.error).at(Step::StandardStreams)?;
    let status = dup_high(fds.status).at(Step::StandardStreams)?;
    // The sources are all ≥ 3, so these cannot clobber one another; dup2 clears
    // close-on-exec on the new descriptors, as wanted.
    for (source, target) in [(fds.stdin, 0), (fds.stdout, 1), (fds.stderr, 2)] {
        // SAFETY: dup2 takes no pointers.
        sys::check_int(unsafe { libc::dup2(source, target) }).at(Step::StandardStreams)?;
    }
    for (source, target) in [(error, ERROR_FD), (status, STATUS_FD)] {
        // SAFETY: dup3 takes no pointers; the new descriptor stays close-on-exec.
        sys::check_int(unsafe { libc::dup3(source, target, libc::O_CLOEXEC) })
            .at(Step::StandardStreams)?;
    }
    close_from(STATUS_FD + 1).at(Step::CloseFds)
}

/// A close-on-exec copy of `fd` numbered 5 or higher.
fn dup_high(fd: RawFd) -> Result<RawFd, i32> {
    // SAFETY: fcntl with integer arguments only.
    sys::check_int(unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, STATUS_FD + 1) })
}

/// Closes every descriptor from `first` up.
fn close_from(first: RawFd) -> Result<(), i32> {
    // SAFETY: close_range takes no pointers.
    let ret =
        unsafe { libc::syscall(libc::SYS_close_range, first.cast_unsigned(), u32::MAX, 0u32) };
    match sys::check(ret) {
        Ok(_) => Ok(()),
        // Before Linux 5.9: close them one by one up to the descriptor limit.
        Err(libc::ENOSYS) => {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: `limit` is a valid out-pointer.
            sys::check_int(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) })?;
            let last = limit.rlim_cur.min(1 << 20) as RawFd;
            for fd in first..last {
                // SAFETY: closing a descriptor number; EBADF for unused ones is ignored.
                unsafe { libc::close(fd) };
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}
