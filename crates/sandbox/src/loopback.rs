//! The sandbox's side of the egress proxy (`network = "proxy"`, DESIGN §12).
//!
//! A proxy sandbox has a network namespace of its own, like one without network, but
//! its loopback interface is up and one TCP socket listens in it, on
//! `127.0.0.1:`[`PROXY_PORT`]. The child opens that listener (only a process inside the
//! namespace can) and hands it to the worker over a `SOCK_SEQPACKET` socket pair with
//! `SCM_RIGHTS`, then closes its own copy: the command never holds it. The worker
//! accepts on it from outside and decides, per connection, what the sandbox may reach.
//! With no route and no other interface, that listener is the only thing a socket of
//! the sandbox can reach; seccomp allows only IPv4 TCP sockets besides `AF_UNIX`, and
//! Landlock (ABI 4+) lets them connect to the proxy's port alone and bind none.
//!
//! The child side runs between `clone` and `execve`: single system calls on stack
//! values, no allocation.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::sandbox::{PROXY_PORT, SandboxError};
use crate::step::{AtStep, Failure, Step};
use crate::sys;

/// A socket pair for the hand-over: the worker's end and the child's, both
/// close-on-exec (the child's closes with the command's `execve` at the latest).
pub(crate) fn channel() -> Result<(OwnedFd, OwnedFd), SandboxError> {
    sys::seqpacket_pair().map_err(SandboxError::Io)
}

/// Child: brings `lo` up (the namespace's only interface; it starts down).
pub(crate) fn bring_up() -> Result<(), Failure> {
    // SAFETY: socket takes no pointers.
    let fd = sys::check_int(unsafe {
        libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0)
    })
    .at(Step::LoopbackUp)?;
    let result = set_up(fd);
    // SAFETY: closing the descriptor opened above, once.
    unsafe { libc::close(fd) };
    result.at(Step::LoopbackUp)
}

fn set_up(fd: RawFd) -> Result<(), i32> {
    // SAFETY: an all-zero ifreq is a valid value (an empty name, zeroed union).
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in request.ifr_name.iter_mut().zip(b"lo\0") {
        *slot = byte.cast_signed();
    }
    // SAFETY: `request` is a valid ifreq naming "lo"; the kernel fills the flags.
    sys::check_int(unsafe { libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut request) })?;
    // SAFETY: SIOCGIFFLAGS filled the union's flags member, which is read here.
    let flags = unsafe { request.ifr_ifru.ifru_flags };
    // IFF_UP and IFF_RUNNING are bits 0 and 6: they fit the interface's 16-bit flags.
    let up = libc::c_short::try_from(libc::IFF_UP | libc::IFF_RUNNING).map_err(|_| libc::EINVAL)?;
    request.ifr_ifru.ifru_flags = flags | up;
    // SAFETY: `request` is a valid ifreq with the new flags.
    sys::check_int(unsafe { libc::ioctl(fd, libc::SIOCSIFFLAGS, &request) })?;
    Ok(())
}

/// Child: opens the listener on `127.0.0.1:PROXY_PORT`, sends it over `channel` and
/// closes every copy of ours.
pub(crate) fn hand_over_listener(channel: RawFd) -> Result<(), Failure> {
    // SAFETY: socket takes no pointers.
    let listener = sys::check_int(unsafe {
        libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0)
    })
    .at(Step::ProxyListener)?;
    let result = listen(listener).and_then(|()| send_fd(channel, listener));
    // SAFETY: closing our copies, once each: the worker holds the listener now.
    unsafe {
        libc::close(listener);
        libc::close(channel);
    }
    result.at(Step::ProxyListener)
}

fn listen(fd: RawFd) -> Result<(), i32> {
    let address = libc::sockaddr_in {
        // AF_INET is 2: it fits the 16-bit family field.
        sin_family: libc::sa_family_t::try_from(libc::AF_INET).map_err(|_| libc::EINVAL)?,
        sin_port: PROXY_PORT.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
        },
        sin_zero: [0; 8],
    };
    let size = libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_in>())
        .map_err(|_| libc::EINVAL)?;
    // SAFETY: `address` is a valid sockaddr_in of `size` bytes.
    sys::check_int(unsafe {
        libc::bind(
            fd,
            (&address as *const libc::sockaddr_in).cast::<libc::sockaddr>(),
            size,
        )
    })?;
    // SAFETY: listen takes no pointers.
    sys::check_int(unsafe { libc::listen(fd, 128) })?;
    Ok(())
}

/// Room for one `SCM_RIGHTS` message carrying one descriptor, aligned for `cmsghdr`.
#[repr(C)]
union ControlBuffer {
    bytes: [u8; 64],
    _align: libc::cmsghdr,
}

fn send_fd(channel: RawFd, fd: RawFd) -> Result<(), i32> {
    let mut payload = [1u8];
    let mut iov = libc::iovec {
        iov_base: payload.as_mut_ptr().cast(),
        iov_len: payload.len(),
    };
    let mut control = ControlBuffer { bytes: [0; 64] };
    // SAFETY: an all-zero msghdr is valid; the fields are set below.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &mut iov;
    message.msg_iovlen = 1;
    // A descriptor is four bytes.
    let fd_size = u32::try_from(std::mem::size_of::<RawFd>()).map_err(|_| libc::EINVAL)?;
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    let space = unsafe { libc::CMSG_SPACE(fd_size) };
    // SAFETY: reading the bytes member of a union whose every bit pattern is valid.
    message.msg_control = unsafe { control.bytes.as_mut_ptr() }.cast();
    message.msg_controllen = space as usize;
    // SAFETY: msg_control points at `space` (≤ 64) writable, aligned bytes, so the first
    // header exists and its data has room for one descriptor.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&message);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(fd_size) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(header).cast::<RawFd>(), fd);
    }
    // SAFETY: `message` and everything it points at live until the call returns.
    sys::check(unsafe { libc::sendmsg(channel, &message, libc::MSG_NOSIGNAL) } as libc::c_long)?;
    Ok(())
}

/// Worker: the listener the child sent, which is there once the child has reached its
/// `execve` (the hand-over comes before it in the sequence).
pub(crate) fn receive_listener(channel: &OwnedFd) -> Result<std::net::TcpListener, SandboxError> {
    let mut payload = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: payload.as_mut_ptr().cast(),
        iov_len: payload.len(),
    };
    let mut control = ControlBuffer { bytes: [0; 64] };
    // SAFETY: an all-zero msghdr is valid; the fields are set below.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &mut iov;
    message.msg_iovlen = 1;
    // SAFETY: reading the bytes member of a union whose every bit pattern is valid.
    message.msg_control = unsafe { control.bytes.as_mut_ptr() }.cast();
    message.msg_controllen = 64;
    // SAFETY: `message` points at valid buffers for the call's duration.
    let got = unsafe {
        libc::recvmsg(
            channel.as_raw_fd(),
            &mut message,
            libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
        )
    };
    let missing = |why: String| {
        SandboxError::Io(io::Error::other(format!(
            "the sandbox did not hand over the egress proxy's listener: {why}"
        )))
    };
    if got < 1 {
        return Err(missing(io::Error::last_os_error().to_string()));
    }
    // SAFETY: recvmsg filled `message`; CMSG_FIRSTHDR checks msg_controllen itself.
    let header = unsafe { libc::CMSG_FIRSTHDR(&message) };
    // SAFETY: a non-null header lies within the control buffer recvmsg filled.
    let ok = !header.is_null()
        && unsafe {
            (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS
        };
    if !ok {
        return Err(missing("no descriptor came with the message".into()));
    }
    // SAFETY: the header is an SCM_RIGHTS message carrying at least one descriptor.
    let fd = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(header).cast::<RawFd>()) };
    // SAFETY: the kernel installed `fd` in this process for us alone (close-on-exec).
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(std::net::TcpListener::from(owned))
}
