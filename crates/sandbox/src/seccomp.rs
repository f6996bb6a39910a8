//! seccomp: the last barrier installed before `execve`. Default allow; the system calls
//! that reach past the other layers fail with `EPERM`:
//! ptrace and cross-process memory access, the whole mount API, new namespaces
//! (`unshare`, `setns`, `clone` with a namespace flag), the kernel keyring, bpf,
//! perf, io_uring (which would bypass this filter), userfaultfd, kexec, kernel modules,
//! file handles (`open_by_handle_at` escapes mount namespaces), and — when the network
//! is off — `socket` for any family but `AF_UNIX`.
//!
//! `clone3` fails with `ENOSYS` instead: its flags live in memory that seccomp cannot
//! inspect, and `ENOSYS` makes the C library fall back to `clone`, which is filtered by
//! its flags. x32 system calls (numbers with bit 30 set) also fail with `ENOSYS`, since
//! they would otherwise bypass rules keyed on x86-64 numbers.
//!
//! The filters are compiled with `seccompiler` before `clone`; the child installs them
//! with one raw `seccomp` call each (later filters run first; the kernel applies the
//! most restrictive answer).

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch, sock_filter,
};

use crate::sandbox::Network;
use crate::step::{AtStep, Failure, Step};
use crate::sys;

/// One `thiserror` enum per module: filter compilation and installation failures.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("unsupported architecture for seccomp: {0}")]
    Arch(String),
    #[error("cannot compile the seccomp filter: {0}")]
    Compile(String),
    #[error("cannot install the seccomp filter: {0}")]
    Install(#[source] std::io::Error),
}

/// Which system calls a profile lets through.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Profile {
    /// Which sockets: `AF_UNIX` only (none), also IPv4 TCP (proxy), any (host).
    pub network: Network,
    /// `execve`/`execveat`.
    pub exec: bool,
    /// New namespaces and the mount API (needed by a worker that creates sandboxes;
    /// never by a sandbox).
    pub namespaces: bool,
    /// Refuse to create set-user-ID or set-group-ID files: harmless inside a sandbox
    /// (nosuid, no_new_privs), but such a file left in a workspace is owned by the
    /// worker's uid on the host, where anyone who can reach it gains that uid.
    pub no_setid_files: bool,
}

impl Profile {
    /// The profile of a sandboxed command.
    pub(crate) fn sandbox(network: Network) -> Self {
        Profile {
            network,
            exec: true,
            namespaces: false,
            no_setid_files: true,
        }
    }
}

/// `fchmodat2` (Linux 6.6), which the libc crate may not name yet; new system calls
/// have one number on every architecture.
const FCHMODAT2: libc::c_long = 452;

/// Compiled filters, in installation order.
#[derive(Debug)]
pub(crate) struct SeccompPlan {
    programs: Vec<BpfProgram>,
}

const NAMESPACE_FLAGS: [libc::c_int; 8] = [
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWNS,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWCGROUP,
    0x80, // CLONE_NEWTIME
];

impl SeccompPlan {
    pub(crate) fn compile(profile: Profile) -> Result<Self, SeccompError> {
        let arch = TargetArch::try_from(std::env::consts::ARCH)
            .map_err(|_| SeccompError::Arch(std::env::consts::ARCH.to_owned()))?;
        let compile = |rules: BTreeMap<i64, Vec<SeccompRule>>, errno: i32| {
            let filter = SeccompFilter::new(
                rules,
                SeccompAction::Allow,
                SeccompAction::Errno(errno.cast_unsigned()),
                arch,
            )
            .map_err(|e| SeccompError::Compile(e.to_string()))?;
            BpfProgram::try_from(filter).map_err(|e| SeccompError::Compile(e.to_string()))
        };
        let cond = |arg, len, op, value| {
            SeccompCondition::new(arg, len, op, value)
                .map_err(|e| SeccompError::Compile(e.to_string()))
        };
        let rule =
            |conds| SeccompRule::new(conds).map_err(|e| SeccompError::Compile(e.to_string()));

        let mut denied: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
        let mut deny = |nr: libc::c_long| {
            denied.insert(nr, Vec::new());
        };
        for nr in [
            libc::SYS_ptrace,
            libc::SYS_process_vm_readv,
            libc::SYS_process_vm_writev,
            libc::SYS_pidfd_getfd,
            libc::SYS_kcmp,
            libc::SYS_keyctl,
            libc::SYS_add_key,
            libc::SYS_request_key,
            libc::SYS_bpf,
            libc::SYS_perf_event_open,
            libc::SYS_io_uring_setup,
            libc::SYS_io_uring_enter,
            libc::SYS_io_uring_register,
            libc::SYS_userfaultfd,
            libc::SYS_kexec_load,
            libc::SYS_kexec_file_load,
            libc::SYS_init_module,
            libc::SYS_finit_module,
            libc::SYS_delete_module,
            libc::SYS_open_by_handle_at,
            libc::SYS_name_to_handle_at,
            libc::SYS_acct,
            libc::SYS_swapon,
            libc::SYS_swapoff,
            libc::SYS_reboot,
            libc::SYS_syslog,
            libc::SYS_quotactl,
            libc::SYS_setns,
        ] {
            deny(nr);
        }
        if !profile.namespaces {
            for nr in [
                libc::SYS_mount,
                libc::SYS_umount2,
                libc::SYS_pivot_root,
                libc::SYS_move_mount,
                libc::SYS_open_tree,
                libc::SYS_fsopen,
                libc::SYS_fsmount,
                libc::SYS_fsconfig,
                libc::SYS_fspick,
                libc::SYS_mount_setattr,
                libc::SYS_unshare,
                libc::SYS_chroot,
            ] {
                deny(nr);
            }
        }
        if !profile.exec {
            deny(libc::SYS_execve);
            deny(libc::SYS_execveat);
        }
        if !profile.namespaces {
            // clone(flags, ...): refused when any namespace flag is set (rules are OR'ed).
            let mut rules = Vec::new();
            for flag in NAMESPACE_FLAGS {
                let flag = u64::from(flag.cast_unsigned());
                rules.push(rule(vec![cond(
                    0,
                    SeccompCmpArgLen::Qword,
                    SeccompCmpOp::MaskedEq(flag),
                    flag,
                )?])?);
            }
            denied.insert(libc::SYS_clone, rules);
        }
        match profile.network {
            Network::Host => {}
            Network::None => {
                denied.insert(
                    libc::SYS_socket,
                    vec![rule(vec![cond(
                        0,
                        SeccompCmpArgLen::Dword,
                        SeccompCmpOp::Ne,
                        libc::AF_UNIX as u64,
                    )?])?],
                );
            }
            Network::Proxy => {
                // socket(family, type, …): refused for a family other than AF_UNIX and
                // AF_INET, and for AF_INET of any type but SOCK_STREAM (the low four bits;
                // the rest are SOCK_NONBLOCK/SOCK_CLOEXEC): no UDP, no raw sockets, no
                // IPv6. What a TCP socket may connect to, Landlock and the namespace say.
                let mut rules = vec![rule(vec![
                    cond(
                        0,
                        SeccompCmpArgLen::Dword,
                        SeccompCmpOp::Ne,
                        libc::AF_UNIX as u64,
                    )?,
                    cond(
                        0,
                        SeccompCmpArgLen::Dword,
                        SeccompCmpOp::Ne,
                        libc::AF_INET as u64,
                    )?,
                ])?];
                const SOCK_TYPE_MASK: u64 = 0xf;
                for kind in (0..=SOCK_TYPE_MASK).filter(|k| *k != libc::SOCK_STREAM as u64) {
                    rules.push(rule(vec![
                        cond(
                            0,
                            SeccompCmpArgLen::Dword,
                            SeccompCmpOp::Eq,
                            libc::AF_INET as u64,
                        )?,
                        cond(
                            1,
                            SeccompCmpArgLen::Dword,
                            SeccompCmpOp::MaskedEq(SOCK_TYPE_MASK),
                            kind,
                        )?,
                    ])?);
                }
                denied.insert(libc::SYS_socket, rules);
            }
        }

        if profile.no_setid_files {
            /// `__O_TMPFILE` (asm-generic fcntl.h), the bit that makes open create an
            /// unnamed file.
            const O_TMPFILE_BIT: u64 = 0o20_000_000;
            // (syscall, index of the mode argument, index of the flags argument when the
            // mode only matters with O_CREAT)
            let setid_bits = [libc::S_ISUID as u64, libc::S_ISGID as u64];
            let calls: [(libc::c_long, u8, Option<u8>); 8] = [
                (libc::SYS_chmod, 1, None),
                (libc::SYS_fchmod, 1, None),
                (libc::SYS_fchmodat, 2, None),
                (FCHMODAT2, 2, None),
                (libc::SYS_mknod, 1, None),
                (libc::SYS_mknodat, 2, None),
                (libc::SYS_creat, 1, None),
                (libc::SYS_open, 2, Some(1)),
            ];
            let with_openat = calls.into_iter().chain([(libc::SYS_openat, 3, Some(2))]);
            // The mode matters when open creates a file: with O_CREAT, and with
            // O_TMPFILE, whose unnamed file `linkat` can later give a name (the kernel
            // checks __O_TMPFILE alone; O_TMPFILE also carries O_DIRECTORY).
            let creating = [libc::O_CREAT as u64, O_TMPFILE_BIT];
            for (nr, mode_arg, flags_arg) in with_openat {
                let mut rules = Vec::new();
                for bit in setid_bits {
                    let has_bit = || {
                        cond(
                            mode_arg,
                            SeccompCmpArgLen::Dword,
                            SeccompCmpOp::MaskedEq(bit),
                            bit,
                        )
                    };
                    match flags_arg {
                        None => rules.push(rule(vec![has_bit()?])?),
                        Some(flags) => {
                            for flag in creating {
                                rules.push(rule(vec![
                                    has_bit()?,
                                    cond(
                                        flags,
                                        SeccompCmpArgLen::Dword,
                                        SeccompCmpOp::MaskedEq(flag),
                                        flag,
                                    )?,
                                ])?);
                            }
                        }
                    }
                }
                denied.insert(nr, rules);
            }
        }

        let mut programs = vec![x32_guard()];
        let mut unsupported = BTreeMap::new();
        if !profile.namespaces {
            unsupported.insert(libc::SYS_clone3, Vec::new());
        }
        if profile.no_setid_files {
            // openat2 keeps its mode in memory seccomp cannot read; ENOSYS makes callers
            // fall back to openat, which is checked above.
            unsupported.insert(libc::SYS_openat2, Vec::new());
        }
        if !unsupported.is_empty() {
            programs.push(compile(unsupported, libc::ENOSYS)?);
        }
        programs.push(compile(denied, libc::EPERM)?);
        Ok(SeccompPlan { programs })
    }

    /// Child side (async-signal-safe): installs the filters on the calling thread.
    /// `no_new_privs` must already be set.
    pub(crate) fn install(&self) -> Result<(), Failure> {
        self.install_raw(0).at(Step::Seccomp)
    }

    /// Installs the filters on every thread of the process (`SECCOMP_FILTER_FLAG_TSYNC`).
    pub(crate) fn install_all_threads(&self) -> Result<(), SeccompError> {
        for program in &self.programs {
            seccompiler::apply_filter_all_threads(program)
                .map_err(|e| SeccompError::Install(std::io::Error::other(e.to_string())))?;
        }
        Ok(())
    }

    fn install_raw(&self, flags: libc::c_ulong) -> Result<(), i32> {
        for program in &self.programs {
            let prog = libc::sock_fprog {
                len: libc::c_ushort::try_from(program.len()).map_err(|_| libc::EINVAL)?,
                // seccompiler's sock_filter has libc's layout (both repr(C) mirrors of
                // the kernel's struct).
                filter: program.as_ptr() as *mut libc::sock_filter,
            };
            // SAFETY: `prog` points at `program`, alive for the duration of the call.
            sys::check(unsafe {
                libc::syscall(
                    libc::SYS_seccomp,
                    libc::SECCOMP_SET_MODE_FILTER,
                    flags,
                    &prog as *const libc::sock_fprog,
                )
            })?;
        }
        Ok(())
    }
}

/// A hand-written filter: x32 system call numbers fail with ENOSYS.
fn x32_guard() -> BpfProgram {
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    let ins = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    vec![
        // seccomp_data.nr is at offset 0.
        ins(LD_W_ABS, 0, 0, 0),
        ins(JGE_K, 0, 1, X32_SYSCALL_BIT),
        ins(RET_K, 0, 0, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        ins(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

/// Whether the kernel supports seccomp filters (asks for an action's availability).
pub fn filter_available() -> bool {
    let action: u32 = libc::SECCOMP_RET_ERRNO;
    // SAFETY: the argument points at a valid u32 for the duration of the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_GET_ACTION_AVAIL,
            0u32,
            &action as *const u32,
        )
    };
    ret == 0
}
