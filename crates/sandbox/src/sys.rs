//! Thin wrappers over the raw system calls that every barrier uses.
//!
//! Everything marked "async-signal-safe" here is a single system call with no allocation,
//! so it may run in the child between `clone` and `execve` while other threads of the
//! parent held locks at the moment of the fork.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The errno of the last failed call (async-signal-safe).
pub(crate) fn errno() -> i32 {
    // SAFETY: `__errno_location` returns a valid pointer to the calling thread's errno.
    unsafe { *libc::__errno_location() }
}

/// Turns a `-1` return into `Err(errno)` (async-signal-safe).
pub(crate) fn check(ret: libc::c_long) -> Result<libc::c_long, i32> {
    if ret == -1 { Err(errno()) } else { Ok(ret) }
}

/// Same as [`check`] for calls returning `c_int`.
pub(crate) fn check_int(ret: libc::c_int) -> Result<libc::c_int, i32> {
    if ret == -1 { Err(errno()) } else { Ok(ret) }
}

/// `rt_sigprocmask(how, set)` on a kernel signal set (bit `n - 1` for signal `n`), raw:
/// glibc's wrapper refuses the signals it reserves for itself (async-signal-safe).
pub(crate) fn set_signal_mask(how: libc::c_int, set: u64) -> Result<(), i32> {
    // SAFETY: `set` is a valid kernel sigset for the call; no old mask is asked for.
    check(unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            how,
            &set as *const u64,
            std::ptr::null_mut::<u64>(),
            8usize,
        )
    })
    .map(drop)
}

/// A `CString` from a path; paths with an interior NUL are rejected.
pub(crate) fn path_cstring(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// A pipe whose both ends are close-on-exec and numbered 3 or higher, so that they can
/// never collide with the standard descriptors the child sets up.
pub(crate) fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    Ok((above_stdio(r)?, above_stdio(w)?))
}

/// A pair of connected `SOCK_SEQPACKET` Unix sockets (one message per send, so a
/// message is never split or merged), both close-on-exec and numbered 3 or higher like
/// [`pipe`]'s ends.
pub(crate) fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid array of two ints for socketpair to fill.
    let ret = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if ret == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair succeeded: both descriptors are open and owned by nobody else.
    let (a, b) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    Ok((above_stdio(a)?, above_stdio(b)?))
}

/// Moves a descriptor numbered 0–2 (possible when the caller closed its stdio) above 2.
pub(crate) fn above_stdio(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC on an open descriptor returns a new open descriptor or -1.
    let new = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if new == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `new` was just returned by fcntl and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// Sets `O_NONBLOCK` on a descriptor.
pub(crate) fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own have no memory effects.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags == -1 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == -1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Writes all of `buf` (async-signal-safe); gives up on the first error.
pub(crate) fn write_all_raw(fd: RawFd, mut buf: &[u8]) -> Result<(), i32> {
    while !buf.is_empty() {
        // SAFETY: `buf` is a valid readable slice of `buf.len()` bytes.
        let n = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
        if n == -1 {
            let e = errno();
            if e == libc::EINTR {
                continue;
            }
            return Err(e);
        }
        buf = &buf[n.unsigned_abs()..];
    }
    Ok(())
}

/// Writes a whole small file by path (used for cgroup and /proc knobs).
pub(crate) fn write_file(path: &Path, contents: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().write(true).open(path)?;
    f.write_all(contents)
}

/// `mount(2)` with optional arguments (async-signal-safe).
pub(crate) fn mount(
    source: Option<&CStr>,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> Result<(), i32> {
    let ptr = |s: Option<&CStr>| s.map_or(std::ptr::null(), CStr::as_ptr);
    // SAFETY: every pointer is either null or a NUL-terminated string that outlives the call.
    let ret = unsafe {
        libc::mount(
            ptr(source),
            target.as_ptr(),
            ptr(fstype),
            flags,
            ptr(data).cast(),
        )
    };
    check_int(ret).map(drop)
}

/// A type whose all-zero bit pattern is a valid value, so that fresh anonymous pages
/// (which the kernel fills with zeros) can be used as a slice of it.
///
/// # Safety
/// Implement it only for types that are valid when every byte is zero.
pub(crate) unsafe trait ZeroIsValid: Copy {}

// SAFETY: every bit pattern is a valid `u8`.
unsafe impl ZeroIsValid for u8 {}
// SAFETY: a raw pointer of all-zero bits is the null pointer, a valid value.
unsafe impl ZeroIsValid for *const libc::c_char {}

/// `len` values of `T` in an anonymous private mapping of their own, zero as mapped and
/// unmapped when dropped.
///
/// Why not a `Vec`: a buffer handed to a child before `clone` that the parent zeroes is
/// written, page by page, into memory the previous `clone` left shared copy-on-write, so
/// the parent takes a fault and a page copy for each of its pages, and the child another
/// when it writes its own copy. Fresh pages are never touched by the parent: the child's
/// first write to each gets a zero page, and unmapping them afterwards in the parent
/// leaves the child's copy of the mapping as it is.
pub(crate) struct ZeroedPages<T: ZeroIsValid> {
    start: std::ptr::NonNull<T>,
    len: usize,
}

impl<T: ZeroIsValid> ZeroedPages<T> {
    pub(crate) fn new(len: usize) -> io::Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&bytes| bytes > 0)
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: an anonymous private mapping; no pointer of ours is passed in.
        let start = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if start == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let start = std::ptr::NonNull::new(start.cast::<T>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(Self { start, len })
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: the mapping holds `len` values of `T`, page-aligned (so aligned for any
        // `T`), zero-filled by the kernel (a valid `T` by `ZeroIsValid`) or written since
        // through this same slice; it lives as long as `self`, which the borrow ties the
        // slice to.
        unsafe { std::slice::from_raw_parts_mut(self.start.as_ptr(), self.len) }
    }
}

impl<T: ZeroIsValid> Drop for ZeroedPages<T> {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `new`, once; no slice of it
        // outlives `self`.
        unsafe {
            libc::munmap(
                self.start.as_ptr().cast(),
                self.len * std::mem::size_of::<T>(),
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many of the mapping's pages are resident (`mincore`).
    fn resident_pages(pages: &mut ZeroedPages<u8>) -> usize {
        let slice = pages.as_mut_slice();
        let page = 4096;
        let mut vec = vec![0u8; slice.len().div_ceil(page)];
        // SAFETY: the range is one mapping of `slice.len()` bytes, page-aligned; `vec`
        // holds a byte per page of it.
        let ret =
            unsafe { libc::mincore(slice.as_mut_ptr().cast(), slice.len(), vec.as_mut_ptr()) };
        assert_eq!(ret, 0, "mincore: {}", io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    fn zeroed_pages_read_as_zero_and_are_not_touched_until_written() {
        let mut pages = ZeroedPages::<u8>::new(64 << 10).unwrap();
        // Never written: no page of it is resident (a zeroed `Vec` of this size has
        // every page written).
        assert_eq!(resident_pages(&mut pages), 0);
        pages.as_mut_slice()[5000] = 7;
        assert_eq!(resident_pages(&mut pages), 1, "only the page written");
        // Read last: reading maps the zero page, which `mincore` counts as resident.
        let slice = pages.as_mut_slice();
        assert_eq!(slice[5000], 7);
        assert!(slice.iter().enumerate().all(|(i, &b)| b == 0 || i == 5000));

        let mut pointers = ZeroedPages::<*const libc::c_char>::new(2048).unwrap();
        assert_eq!(pointers.as_mut_slice().len(), 2048);
        assert!(pointers.as_mut_slice().iter().all(|p| p.is_null()));
        assert!(
            ZeroedPages::<u8>::new(0).is_err(),
            "an empty mapping is refused"
        );
    }
}
