//! Landlock: the sandbox may read and execute the system directories, read the rest of
//! its (minimal) root, read and write the workspace, `/tmp`, `/dev/shm` and a few device
//! nodes — nothing else. The best ABI the kernel offers is used and reported:
//! ABI 2 adds the `REFER` right, 3 `TRUNCATE`, 4 TCP bind/connect (denied entirely when
//! the network is off; with `network = "proxy"`, connect to the proxy's port only and no
//! bind), 5 device ioctls, 6 scoping (no signals to, and no abstract unix
//! sockets of, processes outside the sandbox).
//!
//! The interface is used through raw system calls so that the child can apply a plan
//! prepared before `clone` without allocating; rules naming paths that are created in
//! the child (its `/tmp`, `/dev`) can only be opened there.

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;
use std::path::Path;

use crate::sandbox::{Network, PROXY_PORT};
use crate::step::{AtStep, Failure, Step};
use crate::sys;

/// One `thiserror` enum per module: Landlock failures outside the child.
#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    #[error(
        "landlock is not available (kernel without CONFIG_SECURITY_LANDLOCK or not in the lsm= boot list)"
    )]
    Unavailable,
    #[error("invalid landlock path: {0}")]
    Path(#[source] io::Error),
    #[error("landlock ruleset failed: {0}")]
    Apply(#[source] io::Error),
}

const CREATE_RULESET_VERSION: u32 = 1;
const RULE_PATH_BENEATH: libc::c_int = 1;
const RULE_NET_PORT: libc::c_int = 2;

pub(crate) mod access {
    pub const EXECUTE: u64 = 1 << 0;
    pub const WRITE_FILE: u64 = 1 << 1;
    pub const READ_FILE: u64 = 1 << 2;
    pub const READ_DIR: u64 = 1 << 3;
    pub const TRUNCATE: u64 = 1 << 14;
    pub const IOCTL_DEV: u64 = 1 << 15;
    /// Rights that apply to a file (as opposed to a directory) in a rule.
    pub const FILE_RIGHTS: u64 = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV;
    pub const READ: u64 = READ_FILE | READ_DIR;
    pub const READ_EXEC: u64 = READ | EXECUTE;
    pub const DEVICE: u64 = READ_FILE | WRITE_FILE | TRUNCATE | IOCTL_DEV;
    /// Everything (masked down to what the ABI handles).
    pub const ALL: u64 = u64::MAX;
}

const NET_BIND_TCP: u64 = 1 << 0;
const NET_CONNECT_TCP: u64 = 1 << 1;
const SCOPE_ABSTRACT_UNIX_SOCKET: u64 = 1 << 0;
const SCOPE_SIGNAL: u64 = 1 << 1;

#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

#[repr(C)]
struct NetPortAttr {
    allowed_access: u64,
    port: u64,
}

/// The Landlock ABI version of the running kernel, `None` when unavailable.
pub fn abi_version() -> Option<u32> {
    // SAFETY: with a null attribute and size 0 and the VERSION flag, the call only
    // returns the ABI version.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<RulesetAttr>(),
            0usize,
            CREATE_RULESET_VERSION,
        )
    };
    u32::try_from(ret).ok().filter(|abi| *abi > 0)
}

/// Child side (async-signal-safe): puts the calling process in a Landlock domain nested
/// in its own, which handles no access right but scopes signals and abstract unix
/// sockets (ABI 6): from then on it and what it starts cannot signal, or connect to an
/// abstract socket of, any process of the enclosing domain — a standard sandbox's init.
/// `no_new_privs` must already be set.
pub(crate) fn enter_scoped_domain() -> Result<(), i32> {
    let attr = RulesetAttr {
        handled_access_fs: 0,
        handled_access_net: 0,
        scoped: SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL,
    };
    // SAFETY: `attr` is valid for its size (the ABI 6 layout).
    let ruleset = sys::check(unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            &attr,
            std::mem::size_of::<RulesetAttr>(),
            0u32,
        )
    })?;
    let ruleset = libc::c_int::try_from(ruleset).map_err(|_| libc::EBADF)?;
    // SAFETY: `ruleset` is a Landlock ruleset descriptor; no pointers.
    let restricted =
        sys::check(unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset, 0u32) });
    // SAFETY: closing the ruleset's descriptor, once.
    unsafe { libc::close(ruleset) };
    restricted.map(drop)
}

/// Filesystem rights handled by an ABI version.
fn handled_fs(abi: u32) -> u64 {
    match abi {
        0 => 0,
        1 => (1 << 13) - 1,
        2 => (1 << 14) - 1,
        3 | 4 => (1 << 15) - 1,
        _ => (1 << 16) - 1,
    }
}

/// A ruleset ready to apply: built before `clone`, applied in the child.
pub(crate) struct LandlockPlan {
    abi: u32,
    handled_fs: u64,
    handled_net: u64,
    scoped: u64,
    rules: Vec<(CString, u64)>,
    /// Rules for paths that exist only once the call's own part of the sandbox is in
    /// place (the workspace): added when the ruleset is applied, not when prepared.
    call_rules: Vec<(CString, u64)>,
    /// TCP ports that may be connected to, when TCP is handled.
    connect_ports: Vec<u16>,
}

impl LandlockPlan {
    /// An empty plan for `abi`. TCP bind and connect are handled (so denied) unless the
    /// network is the host's; a proxy sandbox may connect to the proxy's port alone.
    pub(crate) fn new(abi: u32, network: Network) -> Self {
        LandlockPlan {
            abi,
            handled_fs: handled_fs(abi),
            handled_net: if abi >= 4 && network.own_namespace() {
                NET_BIND_TCP | NET_CONNECT_TCP
            } else {
                0
            },
            connect_ports: if abi >= 4 && network == Network::Proxy {
                vec![PROXY_PORT]
            } else {
                Vec::new()
            },
            scoped: if abi >= 6 {
                SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
            } else {
                0
            },
            rules: Vec::new(),
            call_rules: Vec::new(),
        }
    }

    /// Allows `rights` beneath `path` (missing paths are skipped when applying).
    pub(crate) fn allow(&mut self, path: &Path, rights: u64) -> Result<(), LandlockError> {
        let path = sys::path_cstring(path).map_err(LandlockError::Path)?;
        self.rules.push((path, rights & self.handled_fs));
        Ok(())
    }

    /// Allows `rights` beneath `path`, a path that exists only once the call is in the
    /// sandbox (the workspace): see [`Self::prepare`].
    pub(crate) fn allow_at_call(&mut self, path: &Path, rights: u64) -> Result<(), LandlockError> {
        let path = sys::path_cstring(path).map_err(LandlockError::Path)?;
        self.call_rules.push((path, rights & self.handled_fs));
        Ok(())
    }

    pub(crate) fn abi(&self) -> u32 {
        self.abi
    }

    /// Whether this plan's domain scopes signals (ABI 6): then a domain nested in it
    /// ([`enter_scoped_domain`]) cannot signal its processes.
    pub(crate) fn scopes_signals(&self) -> bool {
        self.scoped & SCOPE_SIGNAL != 0
    }

    /// Builds the whole ruleset and restricts the calling thread, for callers outside
    /// the child (a process confining itself).
    pub(crate) fn apply_checked(&self) -> Result<(), LandlockError> {
        self.apply_raw()
            .map_err(|e| LandlockError::Apply(io::Error::from_raw_os_error(e)))
    }

    /// Child side (async-signal-safe): builds the ruleset with every rule but the
    /// call's ([`Self::allow_at_call`]) and returns its descriptor, close-on-exec and
    /// numbered above [`crate::fds::LANDLOCK_FD`] (so that installing the standard
    /// streams cannot overwrite it). A pre-built sandbox does this before its call;
    /// [`Self::apply_prepared`] finishes it.
    pub(crate) fn prepare(&self) -> Result<RawFd, Failure> {
        self.prepare_raw().at(Step::Landlock)
    }

    fn prepare_raw(&self) -> Result<RawFd, i32> {
        let ruleset = self.create()?;
        let prepared = self
            .add_rules(ruleset, &self.rules)
            .and_then(|()| self.add_port_rules(ruleset))
            .and_then(|()| {
                // SAFETY: fcntl with integer arguments only.
                sys::check_int(unsafe {
                    libc::fcntl(ruleset, libc::F_DUPFD_CLOEXEC, crate::fds::LANDLOCK_FD + 1)
                })
            });
        // SAFETY: closing the descriptor created above, once (its copy, if any, stays).
        unsafe { libc::close(ruleset) };
        prepared
    }

    /// Child side (async-signal-safe): adds the call's rules to the ruleset
    /// [`Self::prepare`] built, now at `ruleset`, restricts the calling thread and
    /// closes it. `no_new_privs` must already be set.
    pub(crate) fn apply_prepared(&self, ruleset: RawFd) -> Result<(), Failure> {
        self.restrict(ruleset).at(Step::Landlock)
    }

    /// Both halves at once: prepared, then restricted.
    fn apply_raw(&self) -> Result<(), i32> {
        self.prepare_raw()
            .and_then(|ruleset| self.restrict(ruleset))
    }

    /// Adds the call's rules to `ruleset`, restricts the calling thread with it and
    /// closes it.
    fn restrict(&self, ruleset: RawFd) -> Result<(), i32> {
        let result = self.add_rules(ruleset, &self.call_rules).and_then(|()| {
            // SAFETY: `ruleset` is a Landlock ruleset descriptor; no pointers.
            sys::check(unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset, 0u32) })
                .map(drop)
        });
        // SAFETY: closing the ruleset's descriptor, once.
        unsafe { libc::close(ruleset) };
        result
    }

    /// A new ruleset for this plan's handled accesses.
    fn create(&self) -> Result<libc::c_int, i32> {
        let attr = RulesetAttr {
            handled_access_fs: self.handled_fs,
            handled_access_net: self.handled_net,
            scoped: self.scoped,
        };
        // Older kernels reject a larger struct with non-zero trailing fields.
        let size = match self.abi {
            0..=3 => 8,
            4 | 5 => 16,
            _ => std::mem::size_of::<RulesetAttr>(),
        };
        // SAFETY: `attr` is valid for `size` bytes (size never exceeds the struct).
        let ruleset = sys::check(unsafe {
            libc::syscall(libc::SYS_landlock_create_ruleset, &attr, size, 0u32)
        })?;
        libc::c_int::try_from(ruleset).map_err(|_| libc::EBADF)
    }

    fn add_rules(&self, ruleset: libc::c_int, rules: &[(CString, u64)]) -> Result<(), i32> {
        for (path, rights) in rules {
            // SAFETY: `path` is NUL-terminated; O_PATH opens no file content.
            let fd = match sys::check_int(unsafe {
                libc::open(path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC)
            }) {
                Ok(fd) => fd,
                Err(libc::ENOENT) => continue,
                Err(e) => return Err(e),
            };
            // SAFETY: an all-zero stat is a valid value for fstat to overwrite.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: `fd` is open and `st` a valid out-pointer.
            let stat = sys::check_int(unsafe { libc::fstat(fd, &mut st) });
            let is_dir = stat.is_ok() && st.st_mode & libc::S_IFMT == libc::S_IFDIR;
            let allowed = if is_dir {
                *rights
            } else {
                rights & access::FILE_RIGHTS
            };
            let attr = PathBeneathAttr {
                allowed_access: allowed,
                parent_fd: fd,
            };
            let ret = if stat.is_err() || allowed == 0 {
                stat.map(|_| 0)
            } else {
                // SAFETY: `attr` is a valid path-beneath attribute for the call's duration.
                sys::check(unsafe {
                    libc::syscall(
                        libc::SYS_landlock_add_rule,
                        ruleset,
                        RULE_PATH_BENEATH,
                        &attr as *const PathBeneathAttr,
                        0u32,
                    )
                })
                .map(|_| 0)
            };
            // SAFETY: closing the descriptor opened above, once.
            unsafe { libc::close(fd) };
            ret?;
        }
        Ok(())
    }

    fn add_port_rules(&self, ruleset: libc::c_int) -> Result<(), i32> {
        for &port in &self.connect_ports {
            let attr = NetPortAttr {
                allowed_access: NET_CONNECT_TCP,
                port: u64::from(port),
            };
            // SAFETY: `attr` is a valid net-port attribute for the call's duration.
            sys::check(unsafe {
                libc::syscall(
                    libc::SYS_landlock_add_rule,
                    ruleset,
                    RULE_NET_PORT,
                    &attr as *const NetPortAttr,
                    0u32,
                )
            })?;
        }
        Ok(())
    }
}
