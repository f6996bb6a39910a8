//! Listening sockets handed from a process to one child across `execve`, the way systemd
//! passes sockets (`LISTEN_FDS`): `airlock up` binds the orchestrator's front doors once
//! and every orchestrator process it starts serves on them.
//!
//! The parent names the descriptors in [`LISTEN_FDS_ENV`] (`<name>=<fd>,…`) and clears
//! their close-on-exec flag in that child alone. The child takes them once, and only
//! after the kernel confirms that each is an open, listening TCP socket.

use std::io;
use std::net::TcpListener;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

/// Names the inherited listeners: `<name>=<fd>,…`.
pub const LISTEN_FDS_ENV: &str = "AIRLOCK_LISTEN_FDS";

/// Whether this process has taken its inherited listeners (they are taken once).
static TAKEN: AtomicBool = AtomicBool::new(false);

#[derive(Debug, thiserror::Error)]
pub enum InheritError {
    #[error("{LISTEN_FDS_ENV} is not UTF-8")]
    NotUtf8,
    #[error("{LISTEN_FDS_ENV}: {0:?} is not <name>=<descriptor>")]
    Malformed(String),
    #[error("{LISTEN_FDS_ENV}: {0:?} is named twice")]
    NamedTwice(String),
    #[error("{LISTEN_FDS_ENV}: descriptor {0} is named twice")]
    DescriptorTwice(RawFd),
    #[error("{LISTEN_FDS_ENV}: descriptor {fd} ({name}) is a standard stream")]
    StandardStream { name: String, fd: RawFd },
    #[error("{LISTEN_FDS_ENV}: descriptor {fd} ({name}) is not a socket: {source}")]
    NotASocket {
        name: String,
        fd: RawFd,
        source: io::Error,
    },
    #[error("{LISTEN_FDS_ENV}: descriptor {fd} ({name}) is not {what}")]
    NotAListener {
        name: String,
        fd: RawFd,
        what: &'static str,
    },
    #[error("{LISTEN_FDS_ENV}: descriptor {fd} ({name}): {source}")]
    Flags {
        name: String,
        fd: RawFd,
        source: io::Error,
    },
    #[error("{LISTEN_FDS_ENV}: the inherited listeners were taken already")]
    TakenAlready,
}

/// Makes the process `command` starts inherit `listeners` under their names, named in
/// [`LISTEN_FDS_ENV`]; no other child of this process inherits them (they stay
/// close-on-exec here). They must stay open until `command` has been spawned.
pub fn pass_listeners(command: &mut Command, listeners: &[(&str, &TcpListener)]) {
    let fds: Vec<RawFd> = listeners.iter().map(|(_, l)| l.as_raw_fd()).collect();
    let named: Vec<String> = listeners
        .iter()
        .map(|(name, l)| format!("{name}={}", l.as_raw_fd()))
        .collect();
    command.env(LISTEN_FDS_ENV, named.join(","));
    // SAFETY: the closure runs in the forked child before `execve`: it reads `fds`
    // (allocated before the fork, never freed in the child) and makes only `fcntl` calls,
    // which are async-signal-safe; it allocates nothing and takes no lock. The
    // descriptors are open in the parent while it spawns, so in the child with the same
    // numbers.
    unsafe {
        command.pre_exec(move || {
            for &fd in &fds {
                // Clear close-on-exec: this child alone keeps them across `execve`.
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// The listeners this process inherited, by name, in the order named; `None` when
/// [`LISTEN_FDS_ENV`] is not set. Taken once: a second call fails, so that no descriptor
/// ever has two owners. Call it before the process opens any socket of its own.
pub fn inherited_listeners() -> Result<Option<Vec<(String, TcpListener)>>, InheritError> {
    let Some(value) = std::env::var_os(LISTEN_FDS_ENV) else {
        return Ok(None);
    };
    let value = value.to_str().ok_or(InheritError::NotUtf8)?;
    if TAKEN.swap(true, Ordering::SeqCst) {
        return Err(InheritError::TakenAlready);
    }
    take(value).map(Some)
}

/// Parses `<name>=<fd>,…`, checks every descriptor, then takes them all.
fn take(value: &str) -> Result<Vec<(String, TcpListener)>, InheritError> {
    let mut named: Vec<(String, RawFd)> = Vec::new();
    for part in value.split(',') {
        let (name, fd) = part
            .split_once('=')
            .filter(|(name, _)| !name.is_empty())
            .ok_or_else(|| InheritError::Malformed(part.to_owned()))?;
        let fd: RawFd = fd
            .parse()
            .map_err(|_| InheritError::Malformed(part.to_owned()))?;
        if named.iter().any(|(n, _)| n == name) {
            return Err(InheritError::NamedTwice(name.to_owned()));
        }
        if named.iter().any(|(_, f)| *f == fd) {
            return Err(InheritError::DescriptorTwice(fd));
        }
        named.push((name.to_owned(), fd));
    }
    // All checked before any is taken: a refusal closes nothing.
    for (name, fd) in &named {
        check_listening(name, *fd)?;
    }
    named
        .into_iter()
        .map(|(name, fd)| {
            // SAFETY: `fd` is open and a listening TCP socket (`check_listening`), named
            // by the parent for this process, and taken once per process (`TAKEN`), before
            // the process opens a socket of its own: nothing else here owns it.
            let listener = TcpListener::from(unsafe { OwnedFd::from_raw_fd(fd) });
            // Back to close-on-exec: a process this one starts must not inherit it.
            // SAFETY: a flag change on a descriptor `listener` owns.
            if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } == -1 {
                let source = io::Error::last_os_error();
                return Err(InheritError::Flags { name, fd, source });
            }
            Ok((name, listener))
        })
        .collect()
}

/// Whether `fd` is open and a listening TCP socket, asked of the kernel without taking
/// the descriptor (it may be something else of this process's).
fn check_listening(name: &str, fd: RawFd) -> Result<(), InheritError> {
    if (0..=2).contains(&fd) {
        return Err(InheritError::StandardStream {
            name: name.to_owned(),
            fd,
        });
    }
    let option = |option: libc::c_int| -> Result<libc::c_int, InheritError> {
        let mut value: libc::c_int = 0;
        let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>())
            .unwrap_or(libc::socklen_t::MAX);
        // SAFETY: `value` and `len` are valid out-pointers of the sizes given; on a
        // descriptor that is not open or not a socket the call fails and writes nothing.
        let ret = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                option,
                std::ptr::from_mut(&mut value).cast(),
                &mut len,
            )
        };
        if ret == -1 {
            return Err(InheritError::NotASocket {
                name: name.to_owned(),
                fd,
                source: io::Error::last_os_error(),
            });
        }
        Ok(value)
    };
    let refuse = |what| InheritError::NotAListener {
        name: name.to_owned(),
        fd,
        what,
    };
    let domain = option(libc::SO_DOMAIN)?;
    if domain != libc::AF_INET && domain != libc::AF_INET6 {
        return Err(refuse("an IP socket"));
    }
    if option(libc::SO_TYPE)? != libc::SOCK_STREAM {
        return Err(refuse("a TCP socket"));
    }
    if option(libc::SO_ACCEPTCONN)? != 1 {
        return Err(refuse("listening"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::IntoRawFd;

    fn listener() -> (RawFd, String) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        (listener.into_raw_fd(), addr)
    }

    #[test]
    fn named_listeners_are_taken_as_they_are() {
        let (http_fd, http) = listener();
        let (grpc_fd, grpc) = listener();
        let taken = take(&format!("http={http_fd},grpc={grpc_fd}")).expect("taken");
        let names: Vec<&str> = taken.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["http", "grpc"]);
        assert_eq!(
            taken[0].1.as_raw_fd(),
            http_fd,
            "the very socket, not a new one"
        );
        assert_eq!(taken[0].1.local_addr().expect("addr").to_string(), http);
        assert_eq!(taken[1].1.local_addr().expect("addr").to_string(), grpc);
        // SAFETY: reads the flags of a descriptor `taken` owns.
        let flags = unsafe { libc::fcntl(http_fd, libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        // A client reaches the taken socket itself.
        let _client = std::net::TcpStream::connect(&http).expect("connect");
        taken[0].1.accept().expect("accept");
    }

    #[test]
    fn anything_but_listening_tcp_sockets_is_refused() {
        let (listening, addr) = listener();
        let file = std::fs::File::open("/proc/self/status").expect("a file");
        let connected = std::net::TcpStream::connect(&addr).expect("a connected socket");
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("a udp socket");
        let unix = std::os::unix::net::UnixListener::bind(
            tempfile::tempdir().expect("dir").path().join("s"),
        )
        .expect("a unix listener");
        for (value, why) in [
            (format!("http{listening}"), "not <name>=<descriptor>"),
            (format!("={listening}"), "not <name>=<descriptor>"),
            ("http=x".to_owned(), "not <name>=<descriptor>"),
            (format!("http={listening},http=9"), "named twice"),
            (format!("http={listening},grpc={listening}"), "named twice"),
            (format!("http={listening},grpc=1"), "standard stream"),
            (
                format!("http={listening},grpc={}", file.as_raw_fd()),
                "not a socket",
            ),
            (
                format!("http={listening},grpc={}", connected.as_raw_fd()),
                "not listening",
            ),
            (
                format!("http={listening},grpc={}", udp.as_raw_fd()),
                "not a TCP socket",
            ),
            (
                format!("http={listening},grpc={}", unix.as_raw_fd()),
                "not an IP socket",
            ),
        ] {
            let err = take(&value).expect_err(&value).to_string();
            assert!(err.contains(why), "{value}: {err}");
        }
        // Every refusal came before anything was taken: the listener is still open.
        // SAFETY: reads the flags of a descriptor this test holds.
        assert_ne!(unsafe { libc::fcntl(listening, libc::F_GETFD) }, -1);
    }
}
