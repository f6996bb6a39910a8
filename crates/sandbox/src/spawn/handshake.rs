//! The parent/child handshake, typed: three pipes, one meaning each.
//!
//! - **sync** (parent → child): one byte releases the child once the parent has written
//!   its id maps and moved it into the call's cgroup; end-of-file means the parent gave
//!   up, and the child stops.
//! - **error** (child → parent, close-on-exec): a failed step as a [`Failure`] (step and
//!   errno, eight bytes); end-of-file means `execve` succeeded.
//! - **status** (init → parent): in strict mode pid 1 reports the command's wait status
//!   (four bytes) before it exits, since the parent only sees init's own.
//!
//! The child side runs between `clone` and `execve`: async-signal-safe calls only.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crate::fds::{ERROR_FD, STATUS_FD};
use crate::sandbox::SandboxError;
use crate::step::{Failure, Step};
use crate::sys;

/// Parent: lets the child go on past [`wait_for_release`].
pub(super) fn release(sync_w: OwnedFd) -> Result<(), SandboxError> {
    sys::write_all_raw(sync_w.as_raw_fd(), &[1])
        .map_err(|e| SandboxError::Io(io::Error::from_raw_os_error(e)))
}

/// Child: blocks until the parent releases it.
pub(super) fn wait_for_release(sync_r: RawFd) -> Result<(), Failure> {
    let mut go = [0u8; 1];
    // SAFETY: `go` is a valid one-byte buffer.
    let n = unsafe { libc::read(sync_r, go.as_mut_ptr().cast(), 1) };
    match n {
        1 => Ok(()),
        0 => Err(Failure::new(Step::WaitForParent, libc::EPIPE)),
        _ => Err(Failure::new(Step::WaitForParent, sys::errno())),
    }
}

/// Child: reports a failed step on `fd` (the error pipe, wherever it is at the time).
pub(super) fn report_failure(fd: RawFd, failure: Failure) {
    let _ = sys::write_all_raw(fd, &failure.encode());
}

/// Init: the command's wait status, on the status pipe.
pub(super) fn report_status(status: libc::c_int) {
    let _ = sys::write_all_raw(STATUS_FD, &status.to_ne_bytes());
}

/// Init: closes its copy of the error pipe, so that the parent sees end-of-file when
/// the command's `execve` succeeds.
pub(super) fn close_error_pipe() {
    // SAFETY: closing our own descriptor, once.
    unsafe { libc::close(ERROR_FD) };
}

/// Parent: reads the error pipe to end-of-file — `None` when `execve` succeeded.
pub(super) fn read_failure(error_r: &OwnedFd) -> Result<Option<Failure>, SandboxError> {
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
        match usize::try_from(n) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(_) if sys::errno() == libc::EINTR => {}
            Err(_) => return Err(SandboxError::Io(io::Error::last_os_error())),
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

/// Parent: the command's wait status as init reported it, if it did.
pub(super) fn read_status(status_r: &OwnedFd) -> Option<libc::c_int> {
    let mut buf = [0u8; 4];
    // SAFETY: reading into a valid 4-byte buffer.
    let n = unsafe { libc::read(status_r.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    (n == 4).then(|| libc::c_int::from_ne_bytes(buf))
}
