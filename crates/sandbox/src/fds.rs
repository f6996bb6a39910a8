//! File descriptors: the sandbox sees exactly stdin, stdout and stderr (pipes to the
//! worker). Everything else the worker had open — sockets, database files, the gRPC
//! listener — is closed before `execve`, so no descriptor leaks a capability.
//!
//! The exceptions until `execve` are close-on-exec and close by themselves when the exec
//! succeeds: the error pipe on descriptor 3, the status pipe on 4, and the Landlock
//! ruleset the child prepared before its call on 5 until it is applied.

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
/// Where a prepared Landlock ruleset lives after [`install`].
pub(crate) const LANDLOCK_FD: RawFd = 5;

/// The child's ends of the pipes, as raw numbers (all ≥ 3, close-on-exec).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChildFds {
    pub stdin: RawFd,
    pub stdout: RawFd,
    pub stderr: RawFd,
    pub error: RawFd,
    pub status: RawFd,
}

/// Child side: pipes onto 0, 1, 2; the error pipe onto 3, the status pipe onto 4; the
/// prepared Landlock ruleset `landlock` (numbered above 5) onto 5; everything above
/// closed (async-signal-safe).
pub(crate) fn install(fds: ChildFds, landlock: RawFd) -> Result<(), Failure> {
    // First park the two pipes above every descriptor we are about to overwrite.
    let error = dup_high(fds.error).at(Step::StandardStreams)?;
    let status = dup_high(fds.status).at(Step::StandardStreams)?;
    // The sources are all ≥ 3, so these cannot clobber one another; dup2 clears
    // close-on-exec on the new descriptors, as wanted.
    for (source, target) in [(fds.stdin, 0), (fds.stdout, 1), (fds.stderr, 2)] {
        // SAFETY: dup2 takes no pointers.
        sys::check_int(unsafe { libc::dup2(source, target) }).at(Step::StandardStreams)?;
    }
    // The ruleset last: a pipe parked on 5 above is no longer needed once it is on 3
    // or 4.
    for (source, target) in [
        (error, ERROR_FD),
        (status, STATUS_FD),
        (landlock, LANDLOCK_FD),
    ] {
        // SAFETY: dup3 takes no pointers; the new descriptor stays close-on-exec.
        sys::check_int(unsafe { libc::dup3(source, target, libc::O_CLOEXEC) })
            .at(Step::StandardStreams)?;
    }
    close_from(LANDLOCK_FD + 1).at(Step::CloseFds)
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
