//! Namespaces: user, pid, mount, net, ipc, uts at `clone` time; cgroup after the parent
//! has moved the child into its cgroup (so that the namespace's root is the call's own
//! cgroup, not the worker's).
//!
//! # Identity mapping
//!
//! The sandbox's uid 0 and gid 0 map to the worker's own effective uid and gid — a
//! single-id map. This is the only map the kernel lets the worker write without
//! `CAP_SETUID`/`CAP_SETGID` in its own namespace and without the setuid `newuidmap`
//! helper, which matters because a confined worker has dropped its capabilities (see
//! `self_confine`; a worker running as host root keeps `CAP_SETFCAP` alone, which
//! Linux 5.12+ requires to map host uid 0 into a namespace). It also keeps the
//! workspace usable: files the fs worker wrote belong to the same host uid, so the
//! sandbox can edit them without anyone `chown`ing user files. In the Kubernetes
//! deployment the worker runs as a non-root uid, so the sandbox's root is that
//! unprivileged uid on the node. For a root worker, mapping to an unprivileged host uid
//! (say 100000) would need `CAP_SETUID` plus an idmapped bind of the workspace; that is
//! the natural next hardening step, not needed for the layers below to hold.
//!
//! Why a root worker mapping 0→0 is still contained: the sandbox's capabilities live in
//! its own user namespace and are all dropped (bounding set included) before `execve`;
//! `no_new_privs` is set; the mount namespace shows only read-only system directories,
//! the workspace and fresh tmpfs; `/proc` is the sandbox's own pid namespace with
//! `/proc/sys` read-only; Landlock allows writes only to the workspace, `/tmp` and a few
//! device nodes; and seccomp blocks the calls that reach past these (mount, namespaces,
//! ptrace, bpf, keyctl, io_uring, modules, …). `setgroups` is denied in the namespace, so
//! the sandbox cannot shed or gain supplementary groups.
//!
//! # Network
//!
//! With the network off (the default) the sandbox gets its own network namespace, in
//! which only a loopback interface exists; it is left down, and seccomp refuses every
//! socket family but `AF_UNIX` anyway. With `network = "proxy"` it gets its own
//! namespace too, with the loopback up and one listener in it that the worker holds
//! (see [`crate::loopback`]). With `network = "host"`, the sandbox shares the worker's
//! network namespace.

use std::io;
use std::os::fd::RawFd;
use std::path::PathBuf;

use crate::sandbox::Network;
use crate::step::{AtStep, Failure, Step};
use crate::sys;

/// One `thiserror` enum per module: failures of the parent-side namespace work.
#[derive(Debug, thiserror::Error)]
pub enum NamespaceError {
    #[error("clone with namespaces failed: {0}")]
    Clone(#[source] io::Error),
    #[error("cannot write {path}: {source}")]
    IdMap {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The namespaces a strict sandbox enters, in report order.
pub(crate) fn names(network: Network) -> Vec<&'static str> {
    let mut v = vec!["user", "pid", "mount"];
    if network.own_namespace() {
        v.push("net");
    }
    v.extend(["ipc", "uts", "cgroup"]);
    v
}

/// The `clone` flags of a strict sandbox (the cgroup namespace comes later, see module doc).
pub(crate) fn clone_flags(network: Network) -> libc::c_ulong {
    let mut flags = libc::CLONE_NEWUSER
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS;
    if network.own_namespace() {
        flags |= libc::CLONE_NEWNET;
    }
    libc::c_ulong::from(flags.cast_unsigned())
}

/// `clone(2)` used like `fork(2)` (same stack, copy-on-write) with namespace flags, so
/// the child is pid 1 of its new pid namespace without a second fork.
///
/// Returns `0` in the child and the child's pid in the parent.
///
/// # Safety
/// Same contract as `fork` in a multithreaded process: the child may only perform
/// async-signal-safe operations until it execs or exits.
pub(crate) unsafe fn clone_process(flags: libc::c_ulong) -> Result<libc::pid_t, NamespaceError> {
    let flags = flags | libc::SIGCHLD as libc::c_ulong;
    // SAFETY: a raw clone with a null stack and no CLONE_VM behaves like fork; the
    // caller upholds the post-fork restrictions. x86_64/aarch64 argument order is
    // (flags, stack, parent_tid, child_tid, tls).
    let ret = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
    if ret == -1 {
        return Err(NamespaceError::Clone(io::Error::last_os_error()));
    }
    libc::pid_t::try_from(ret)
        .map_err(|_| NamespaceError::Clone(io::Error::other("clone returned no pid")))
}

/// `clone3(2)` like [`clone_process`], placing the child directly into the cgroup whose
/// directory `cgroup_fd` refers to (`CLONE_INTO_CGROUP`, Linux 5.7+, cgroup v2 only): the
/// child never runs outside it, and no migration (with its RCU grace period) is needed.
///
/// Returns `Ok(None)` when the kernel lacks `clone3` or `CLONE_INTO_CGROUP`.
///
/// # Safety
/// As [`clone_process`].
pub(crate) unsafe fn clone_into_cgroup(
    flags: libc::c_ulong,
    cgroup_fd: RawFd,
) -> Result<Option<libc::pid_t>, NamespaceError> {
    const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;
    #[repr(C)]
    #[derive(Default)]
    struct CloneArgs {
        flags: u64,
        pidfd: u64,
        child_tid: u64,
        parent_tid: u64,
        exit_signal: u64,
        stack: u64,
        stack_size: u64,
        tls: u64,
        set_tid: u64,
        set_tid_size: u64,
        cgroup: u64,
    }
    // c_ulong is 32 bits wide on some targets.
    #[allow(clippy::unnecessary_cast)]
    let args = CloneArgs {
        flags: flags as u64 | CLONE_INTO_CGROUP,
        exit_signal: libc::SIGCHLD as u64,
        cgroup: u64::from(cgroup_fd.cast_unsigned()),
        ..CloneArgs::default()
    };
    // SAFETY: `args` is a valid clone_args of the size passed; without CLONE_VM and with
    // no stack the child continues on a copy of our stack, like fork.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if ret == -1 {
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::ENOSYS | libc::E2BIG) => Ok(None),
            _ => Err(NamespaceError::Clone(err)),
        };
    }
    libc::pid_t::try_from(ret)
        .map(Some)
        .map_err(|_| NamespaceError::Clone(io::Error::other("clone3 returned no pid")))
}

/// Parent side: map the sandbox's root to the worker's own uid and gid, and deny
/// `setgroups` (required for an unprivileged gid map, and wanted anyway).
pub(crate) fn write_id_maps(pid: libc::pid_t) -> Result<(), NamespaceError> {
    // SAFETY: geteuid/getegid cannot fail and touch no memory.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let write = |name: &str, contents: String| {
        let path = proc.join(name);
        sys::write_file(&path, contents.as_bytes())
            .map_err(|source| NamespaceError::IdMap { path, source })
    };
    write("setgroups", "deny".to_owned())?;
    write("uid_map", format!("0 {uid} 1\n"))?;
    write("gid_map", format!("0 {gid} 1\n"))?;
    Ok(())
}

/// Child side: a cgroup namespace rooted at the call's cgroup, which the parent has
/// joined us to by now (async-signal-safe).
pub(crate) fn enter_cgroup_namespace() -> Result<(), Failure> {
    // SAFETY: unshare takes no pointers.
    sys::check_int(unsafe { libc::unshare(libc::CLONE_NEWCGROUP) })
        .map(drop)
        .at(Step::CgroupNamespace)
}

/// Child side: a neutral hostname in the new UTS namespace (async-signal-safe).
pub(crate) fn set_hostname(name: &[u8]) -> Result<(), Failure> {
    // SAFETY: `name` is a valid buffer of `name.len()` bytes.
    sys::check_int(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) })
        .map(drop)
        .at(Step::Hostname)
}
