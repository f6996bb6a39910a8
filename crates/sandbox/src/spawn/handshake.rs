//! The parent/child handshake, typed: three pipes, one meaning each.
//!
//! - **sync** (parent → child): one byte releases the child once the parent has written
//!   its id maps and moved it into the call's cgroup; end-of-file means the parent gave
//!   up, and the child stops.
//! - **error** (child → parent, close-on-exec): a failed step as a [`Failure`] (step and
//!   errno, eight bytes); end-of-file means `execve` succeeded.
//! - **status** (init → parent): in strict mode pid 1 reports the command's wait status
//!   and the resource use of every process it reaped ([`InitReport`], 28 bytes, one
//!   atomic pipe write) before it exits, since the parent only sees init's own.
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

/// What init reports when the command has exited: its wait status, and the CPU time
/// and peak memory of the processes init reaped (the command and any orphans), which
/// the parent would otherwise learn only by reaping init.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct InitReport {
    pub(super) status: libc::c_int,
    pub(super) user_us: u64,
    pub(super) system_us: u64,
    pub(super) max_rss_kib: u64,
}

impl InitReport {
    const BYTES: usize = 28;

    /// Init: the report for `status`, with `getrusage(RUSAGE_CHILDREN)`
    /// (async-signal-safe: one system call into a stack buffer).
    pub(super) fn now(status: libc::c_int) -> Self {
        // SAFETY: an all-zero rusage is valid for the kernel to overwrite.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `usage` is a valid out-pointer.
        unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
        Self::from_rusage(status, &usage)
    }

    pub(super) fn from_rusage(status: libc::c_int, usage: &libc::rusage) -> Self {
        let micros = |tv: libc::timeval| {
            u64::try_from(tv.tv_sec)
                .unwrap_or(0)
                .saturating_mul(1_000_000)
                .saturating_add(u64::try_from(tv.tv_usec).unwrap_or(0))
        };
        Self {
            status,
            user_us: micros(usage.ru_utime),
            system_us: micros(usage.ru_stime),
            max_rss_kib: u64::try_from(usage.ru_maxrss).unwrap_or(0),
        }
    }

    fn encode(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[..4].copy_from_slice(&self.status.to_ne_bytes());
        out[4..12].copy_from_slice(&self.user_us.to_ne_bytes());
        out[12..20].copy_from_slice(&self.system_us.to_ne_bytes());
        out[20..].copy_from_slice(&self.max_rss_kib.to_ne_bytes());
        out
    }

    fn decode(buf: &[u8; Self::BYTES]) -> Self {
        let word = |range: std::ops::Range<usize>| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&buf[range]);
            u64::from_ne_bytes(bytes)
        };
        let mut status = [0u8; 4];
        status.copy_from_slice(&buf[..4]);
        Self {
            status: libc::c_int::from_ne_bytes(status),
            user_us: word(4..12),
            system_us: word(12..20),
            max_rss_kib: word(20..28),
        }
    }
}

/// Init: the command's report, on the status pipe (one write of less than
/// `PIPE_BUF` bytes: the parent reads it whole or not at all).
pub(super) fn report_status(report: &InitReport) {
    let _ = sys::write_all_raw(STATUS_FD, &report.encode());
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

/// Parent: init's report, if it made one (`None` when init died without reporting).
pub(super) fn read_status(status_r: &OwnedFd) -> Option<InitReport> {
    let mut buf = [0u8; InitReport::BYTES];
    // SAFETY: reading into a valid buffer of its length.
    let n = unsafe { libc::read(status_r.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    (usize::try_from(n) == Ok(buf.len())).then(|| InitReport::decode(&buf))
}

#[cfg(test)]
mod tests {
    use super::InitReport;

    #[test]
    fn a_report_reads_back_as_written() {
        let report = InitReport {
            status: 0x0100,
            user_us: 1_234_567,
            system_us: u64::MAX - 1,
            max_rss_kib: 2048,
        };
        assert_eq!(InitReport::decode(&report.encode()), report);
    }
}
