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
//! The filter is one program, compiled by [`bpf`] before `clone` (a binary search over
//! the system call numbers that have rules); the child installs it with one raw
//! `seccomp` call.

use std::collections::BTreeMap;

use seccompiler::sock_filter;

use self::bpf::{Cmp, Cond, Width};

use crate::sandbox::Network;
use crate::step::{AtStep, Failure, Step};
use crate::sys;

mod bpf;

pub use bpf::BpfError;

/// x32 system calls are the x86-64 ones with this bit set.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// One `thiserror` enum per module: filter compilation and installation failures.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("unsupported architecture for seccomp: {0}")]
    Arch(String),
    #[error("cannot compile the seccomp filter: {0}")]
    Compile(#[from] BpfError),
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
    /// `socket(AF_UNIX, …)` (`socketpair` always stays). A strict sandbox keeps it: the
    /// host's named sockets are outside its mount namespace and its abstract ones
    /// outside its network namespace. A standard one has neither, and Landlock does not
    /// judge `connect` on a named socket: the other components' gRPC sockets (a worker
    /// trusts whoever reaches its socket) would be one `connect` away.
    pub unix_sockets: bool,
    /// Refuse to create set-user-ID or set-group-ID files: harmless inside a sandbox
    /// (nosuid, no_new_privs), but such a file left in a workspace is owned by the
    /// worker's uid on the host, where anyone who can reach it gains that uid.
    pub no_setid_files: bool,
    /// Refuse to change another process's limits, priority, scheduling or memory
    /// placement (`prlimit64`, `setpriority`, `ioprio_set`, `sched_set*`,
    /// `migrate_pages`, `move_pages` naming anything but the caller): a standard
    /// sandbox has the worker's uid, which is all the kernel asks of these, and sees
    /// every process. A strict one sees its own pid namespace only, and its filter is
    /// kept short.
    pub own_process_only: bool,
    /// SysV IPC and POSIX message queues. A strict sandbox has an IPC namespace of its
    /// own; a standard one shares the host's, where a segment or queue outlives the
    /// call and is open to the next call of any principal.
    pub ipc: bool,
    /// `[pid, parent, group]`: a process and its parent that no signal may reach, and a
    /// process group that no signal may be sent to (`kill`, `tgkill`, `rt_sigqueueinfo`,
    /// `rt_tgsigqueueinfo` and `pidfd_open` naming them), with no broadcast
    /// (`kill(-1, …)`) and no `tkill` either: the worker, its parent and its group, for
    /// a standard sandbox, which shares their pid namespace and uid. 0 is no entry.
    /// Landlock's signal scoping (ABI 6) refuses these too; on an older kernel this is
    /// what keeps a command from killing the worker or the orchestrator.
    pub protected_pids: [u32; 3],
}

impl Profile {
    /// The profile of a sandboxed command; `strict` when it has mount and network
    /// namespaces of its own.
    pub(crate) fn sandbox(network: Network, strict: bool) -> Self {
        Profile {
            network,
            exec: true,
            namespaces: false,
            unix_sockets: strict,
            no_setid_files: true,
            own_process_only: !strict,
            ipc: strict,
            protected_pids: if strict { [0; 3] } else { workers_processes() },
        }
    }
}

/// What a standard sandbox's command must not signal ([`Profile::protected_pids`]): this
/// process (the worker), its parent (the orchestrator under `airlock up`) unless that
/// is the pid namespace's init, which the kernel already shields, and its process group
/// (shared with the orchestrator under `airlock up`).
fn workers_processes() -> [u32; 3] {
    let pid = std::process::id();
    let parent = Some(std::os::unix::process::parent_id())
        .filter(|&p| p > 1)
        .unwrap_or(0);
    // SAFETY: getpgrp takes no arguments and cannot fail.
    let group = unsafe { libc::getpgrp() }.cast_unsigned();
    [pid, parent, group]
}

/// `fchmodat2` (Linux 6.6), which the libc crate may not name yet; new system calls
/// have one number on every architecture.
const FCHMODAT2: libc::c_long = 452;

/// The compiled filter: one program.
#[derive(Debug)]
pub(crate) struct SeccompPlan {
    program: Vec<sock_filter>,
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
        Ok(SeccompPlan {
            program: bpf::compile(&filter(profile)?)?,
        })
    }

    /// Child side (async-signal-safe): installs the filter on the calling thread with
    /// one raw `seccomp` call. `no_new_privs` must already be set.
    pub(crate) fn install(&self) -> Result<(), Failure> {
        install_raw(&self.program).at(Step::Seccomp)
    }

    /// Installs the filter on every thread of the process (`SECCOMP_FILTER_FLAG_TSYNC`).
    pub(crate) fn install_all_threads(&self) -> Result<(), SeccompError> {
        seccompiler::apply_filter_all_threads(&self.program)
            .map_err(|e| SeccompError::Install(std::io::Error::other(e.to_string())))
    }
}

/// The system calls that signal a process named by their first argument (a negative
/// value: a process group), or open a descriptor to signal it with.
const SIGNALLING_CALLS: [libc::c_long; 5] = [
    libc::SYS_kill,
    libc::SYS_tgkill,
    libc::SYS_rt_sigqueueinfo,
    libc::SYS_rt_tgsigqueueinfo,
    libc::SYS_pidfd_open,
];

/// Where `struct seccomp_data` holds the low half of the first argument (every
/// architecture Airlock builds for is little-endian).
const ARG0_LOW: u32 = 16;

/// Length of [`parent_guard`]'s program.
pub(crate) const PARENT_GUARD_LEN: usize = 12;

/// A second filter, stacked on the sandbox's by a standard sandbox's command before its
/// `execve`: no signal to `parent` (the sandbox's init, whose pid is known only once it
/// runs) or to its process group, by any of [`SIGNALLING_CALLS`]. Built in the command's
/// process without allocating: a fixed program with the pid written in. The sandbox's
/// own filter already checks the architecture (and ends any other), so this one only
/// looks at the number and the argument.
pub(crate) fn parent_guard(parent: u32) -> [sock_filter; PARENT_GUARD_LEN] {
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x15;
    const RET_K: u16 = 0x06;
    let stmt = |code, k| sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    };
    let jeq = |k, jt, jf| sock_filter {
        code: JEQ_K,
        jt,
        jf,
        k,
    };
    let number = |nr: libc::c_long| u32::try_from(nr).unwrap_or(u32::MAX);
    let allow = libc::SECCOMP_RET_ALLOW;
    let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM.cast_unsigned();
    [
        // 0: the system call's number.
        stmt(LD_W_ABS, 0),
        // 1–5: one of the signalling calls goes to 7, anything else to 6.
        jeq(number(SIGNALLING_CALLS[0]), 5, 0),
        jeq(number(SIGNALLING_CALLS[1]), 4, 0),
        jeq(number(SIGNALLING_CALLS[2]), 3, 0),
        jeq(number(SIGNALLING_CALLS[3]), 2, 0),
        jeq(number(SIGNALLING_CALLS[4]), 1, 0),
        // 6
        stmt(RET_K, allow),
        // 7: the pid it names (pid_t: the low half).
        stmt(LD_W_ABS, ARG0_LOW),
        // 8–9: the parent, or its group, to 11.
        jeq(parent, 2, 0),
        jeq(parent.wrapping_neg(), 1, 0),
        // 10
        stmt(RET_K, allow),
        // 11
        stmt(RET_K, eperm),
    ]
}

/// Child side (async-signal-safe): stacks `program` on the calling thread's filters
/// with one raw `seccomp` call. `no_new_privs` must already be set.
pub(crate) fn install_raw(program: &[sock_filter]) -> Result<(), i32> {
    let prog = libc::sock_fprog {
        len: libc::c_ushort::try_from(program.len()).map_err(|_| libc::EINVAL)?,
        // seccompiler's sock_filter has libc's layout (both repr(C) mirrors of the
        // kernel's struct).
        filter: program.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: `prog` points at the program, alive for the duration of the call.
    sys::check(unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0,
            &prog as *const libc::sock_fprog,
        )
    })
    .map(drop)
}

/// `AUDIT_ARCH_*` of the architecture this build runs on (linux/audit.h).
fn audit_arch() -> Result<u32, SeccompError> {
    match std::env::consts::ARCH {
        "x86_64" => Ok(0xC000_003E),
        "aarch64" => Ok(0xC000_00B7),
        "riscv64" => Ok(0xC000_00F3),
        other => Err(SeccompError::Arch(other.to_owned())),
    }
}

/// The whole filter of a profile: which system calls fail, and how.
fn filter(profile: Profile) -> Result<bpf::Filter, SeccompError> {
    let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM.cast_unsigned();
    let enosys = libc::SECCOMP_RET_ERRNO | libc::ENOSYS.cast_unsigned();
    let mut entries: BTreeMap<u32, bpf::Entry> = BTreeMap::new();
    let mut add = |nr: libc::c_long, rules: Vec<Vec<Cond>>, action: u32| {
        // System call numbers are small and non-negative on every architecture.
        let nr = u32::try_from(nr).unwrap_or(u32::MAX);
        entries.insert(nr, bpf::Entry { rules, action });
    };
    let dword = |arg, cmp| Cond {
        arg,
        width: Width::Dword,
        cmp,
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
        add(nr, Vec::new(), eperm);
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
            add(nr, Vec::new(), eperm);
        }
        // clone(flags, ...): refused when any namespace flag is set.
        let namespace_flags = NAMESPACE_FLAGS
            .iter()
            .fold(0u64, |all, flag| all | u64::from(flag.cast_unsigned()));
        let rules = vec![vec![Cond {
            arg: 0,
            width: Width::Qword,
            cmp: Cmp::AnyBit(namespace_flags),
        }]];
        add(libc::SYS_clone, rules, eperm);
        // clone3 keeps its flags in memory seccomp cannot read: ENOSYS makes the C
        // library fall back to clone, checked above.
        add(libc::SYS_clone3, Vec::new(), enosys);
    }
    if !profile.exec {
        add(libc::SYS_execve, Vec::new(), eperm);
        add(libc::SYS_execveat, Vec::new(), eperm);
    }
    if !profile.unix_sockets {
        // socketpair(domain, type, …): a connected stream or seqpacket pair stays (pipes
        // of the command's own, asyncio's self-pipe); a datagram pair is refused, since
        // an unconnected datagram socket can `sendto` any named socket of the host
        // (`/dev/log`, the journal, a notify socket).
        const SOCK_TYPE_MASK: u64 = 0xf;
        let datagram = vec![
            dword(
                1,
                Cmp::MaskedNe {
                    mask: SOCK_TYPE_MASK,
                    value: libc::SOCK_STREAM as u64,
                },
            ),
            dword(
                1,
                Cmp::MaskedNe {
                    mask: SOCK_TYPE_MASK,
                    value: libc::SOCK_SEQPACKET as u64,
                },
            ),
        ];
        add(libc::SYS_socketpair, vec![datagram], eperm);
    }
    match profile.network {
        Network::Host if profile.unix_sockets => {}
        Network::Host => {
            let unix = vec![dword(0, Cmp::Eq(libc::AF_UNIX as u64))];
            add(libc::SYS_socket, vec![unix], eperm);
        }
        Network::None if profile.unix_sockets => {
            let not_unix = vec![dword(0, Cmp::Ne(libc::AF_UNIX as u64))];
            add(libc::SYS_socket, vec![not_unix], eperm);
        }
        // No socket at all (`socketpair` is another system call).
        Network::None => add(libc::SYS_socket, Vec::new(), eperm),
        Network::Proxy => {
            // socket(family, type, …): refused for a family other than AF_UNIX and
            // AF_INET, and for AF_INET of any type but SOCK_STREAM (the low four bits;
            // the rest are SOCK_NONBLOCK/SOCK_CLOEXEC): no UDP, no raw sockets, no
            // IPv6. What a TCP socket may connect to, Landlock and the namespace say.
            const SOCK_TYPE_MASK: u64 = 0xf;
            let rules = vec![
                vec![
                    dword(0, Cmp::Ne(libc::AF_UNIX as u64)),
                    dword(0, Cmp::Ne(libc::AF_INET as u64)),
                ],
                vec![
                    dword(0, Cmp::Eq(libc::AF_INET as u64)),
                    dword(
                        1,
                        Cmp::MaskedNe {
                            mask: SOCK_TYPE_MASK,
                            value: libc::SOCK_STREAM as u64,
                        },
                    ),
                ],
            ];
            add(libc::SYS_socket, rules, eperm);
        }
    }

    if profile.own_process_only {
        // The calls that act on a process named by its pid (or a group, or a user's
        // processes): only the caller itself (pid 0) may be named; glibc's
        // getrlimit/setrlimit, `ulimit`, `nice` and `prlimit` without `--pid` pass 0.
        // pid_t is 32 bits: the kernel reads the low half only. `sched_setaffinity` is
        // left out: glibc's `pthread_setaffinity_np` (and `pthread_create` with an
        // affinity, as OpenMP's thread pinning does) names the thread by its id, and a
        // pinned worker still runs; a scheduling policy (SCHED_IDLE) would starve it.
        let other_pid = |arg| vec![vec![dword(arg, Cmp::Ne(0))]];
        for nr in [
            libc::SYS_prlimit64,
            libc::SYS_sched_setscheduler,
            libc::SYS_sched_setparam,
            libc::SYS_sched_setattr,
            libc::SYS_migrate_pages,
            libc::SYS_move_pages,
        ] {
            add(nr, other_pid(0), eperm);
        }
        // setpriority(which, who, prio) and ioprio_set(which, who, ioprio): the calling
        // process only (a process group or a user with `who` 0 means the caller's, which
        // holds other processes).
        const PRIO_PROCESS: u64 = 0;
        const IOPRIO_WHO_PROCESS: u64 = 1;
        for (nr, process) in [
            (libc::SYS_setpriority, PRIO_PROCESS),
            (libc::SYS_ioprio_set, IOPRIO_WHO_PROCESS),
        ] {
            let rules = vec![vec![dword(0, Cmp::Ne(process))], vec![dword(1, Cmp::Ne(0))]];
            add(nr, rules, eperm);
        }
    }
    if profile.protected_pids.iter().any(|&pid| pid != 0) {
        // kill(pid, …) and the others name a process by arg 0 (pid_t: the low half);
        // a negative pid is a process group, -1 every process the caller may signal.
        let [pid, parent, group] = profile.protected_pids;
        let mut values = vec![u32::MAX, pid, parent, group.wrapping_neg()];
        values.retain(|&v| v != 0);
        values.sort_unstable();
        values.dedup();
        let named: Vec<Vec<Cond>> = values
            .into_iter()
            .map(|v| vec![dword(0, Cmp::Eq(u64::from(v)))])
            .collect();
        for nr in SIGNALLING_CALLS {
            add(nr, named.clone(), eperm);
        }
        // tkill names a thread by its id alone, and any thread of the worker stands
        // for all of it; the C library signals threads with tgkill.
        add(libc::SYS_tkill, Vec::new(), eperm);
    }
    if !profile.ipc {
        // ENOSYS, as on a kernel built without them: programs that can do without fall
        // back (Python's multiprocessing uses /dev/shm); those that cannot — a
        // PostgreSQL server, Debian's fakeroot — need the strict level, which has an
        // IPC namespace of its own.
        for nr in [
            libc::SYS_shmget,
            libc::SYS_shmat,
            libc::SYS_shmctl,
            libc::SYS_shmdt,
            libc::SYS_msgget,
            libc::SYS_msgsnd,
            libc::SYS_msgrcv,
            libc::SYS_msgctl,
            libc::SYS_semget,
            libc::SYS_semop,
            libc::SYS_semtimedop,
            libc::SYS_semctl,
            libc::SYS_mq_open,
            libc::SYS_mq_unlink,
            libc::SYS_mq_timedsend,
            libc::SYS_mq_timedreceive,
            libc::SYS_mq_notify,
            libc::SYS_mq_getsetattr,
        ] {
            add(nr, Vec::new(), enosys);
        }
    }

    if profile.no_setid_files {
        /// `__O_TMPFILE` (asm-generic fcntl.h), the bit that makes open create an
        /// unnamed file.
        const O_TMPFILE_BIT: u64 = 0o20_000_000;
        // (syscall, index of the mode argument, index of the flags argument when the
        // mode only matters with O_CREAT)
        let setid_bits = (libc::S_ISUID | libc::S_ISGID) as u64;
        let calls: [(libc::c_long, u8, Option<u8>); 9] = [
            (libc::SYS_chmod, 1, None),
            (libc::SYS_fchmod, 1, None),
            (libc::SYS_fchmodat, 2, None),
            (FCHMODAT2, 2, None),
            (libc::SYS_mknod, 1, None),
            (libc::SYS_mknodat, 2, None),
            (libc::SYS_creat, 1, None),
            (libc::SYS_open, 2, Some(1)),
            (libc::SYS_openat, 3, Some(2)),
        ];
        // The mode matters when open creates a file: with O_CREAT, and with O_TMPFILE,
        // whose unnamed file `linkat` can later give a name (the kernel checks
        // __O_TMPFILE alone; O_TMPFILE also carries O_DIRECTORY).
        let creating = libc::O_CREAT as u64 | O_TMPFILE_BIT;
        for (nr, mode_arg, flags_arg) in calls {
            let mut rule = vec![dword(mode_arg, Cmp::AnyBit(setid_bits))];
            if let Some(flags) = flags_arg {
                rule.push(dword(flags, Cmp::AnyBit(creating)));
            }
            add(nr, vec![rule], eperm);
        }
        // openat2 keeps its mode in memory seccomp cannot read; ENOSYS makes callers
        // fall back to openat, which is checked above.
        add(libc::SYS_openat2, Vec::new(), enosys);
    }

    Ok(bpf::Filter {
        arch: audit_arch()?,
        entries,
        // x32 system calls (numbers with bit 30 set and above) fail with ENOSYS: they
        // would otherwise bypass rules keyed on x86-64 numbers.
        high_from: Some((X32_SYSCALL_BIT, enosys)),
        default: libc::SECCOMP_RET_ALLOW,
    })
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

#[cfg(test)]
mod tests {
    //! The compiled filter against seccompiler's compilation of the same rules — the
    //! filters Airlock installed before it compiled its own: three programs (the x32
    //! guard, the ENOSYS list, the EPERM list) combined as the kernel combines stacked
    //! filters. Both are run by a classic-BPF interpreter over every system call number
    //! up to 600, x32 numbers, another architecture, and thousands of argument vectors
    //! built from the values the rules look at.

    use super::*;
    use seccompiler::{
        SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
        SeccompRule, TargetArch,
    };

    /// Runs a classic-BPF seccomp program on one `struct seccomp_data`.
    fn run(program: &[sock_filter], data: &[u8; 64]) -> u32 {
        run_counted(program, data).0
    }

    /// As [`run`], with the number of instructions it took.
    fn run_counted(program: &[sock_filter], data: &[u8; 64]) -> (u32, usize) {
        let mut a: u32 = 0;
        let mut pc = 0usize;
        for steps in 1.. {
            let ins = &program[pc];
            pc += 1;
            match ins.code {
                0x20 => {
                    let at = ins.k as usize;
                    a = u32::from_le_bytes(data[at..at + 4].try_into().unwrap());
                }
                0x54 => a &= ins.k,
                0x05 => pc += ins.k as usize,
                0x06 => return (ins.k, steps),
                0x15 | 0x25 | 0x35 | 0x45 => {
                    let holds = match ins.code {
                        0x15 => a == ins.k,
                        0x25 => a > ins.k,
                        0x35 => a >= ins.k,
                        _ => a & ins.k != 0,
                    };
                    pc += usize::from(if holds { ins.jt } else { ins.jf });
                }
                code => panic!("instruction {code:#x} not interpreted"),
            }
        }
        unreachable!("more steps than a usize counts")
    }

    /// Stacked filters as the kernel runs them: the last installed first, and the most
    /// restrictive action wins (ties keep the one found first).
    fn run_stack(programs: &[Vec<sock_filter>], data: &[u8; 64]) -> u32 {
        let action = |ret: u32| (ret & libc::SECCOMP_RET_ACTION_FULL).cast_signed();
        let mut result = libc::SECCOMP_RET_ALLOW;
        for program in programs.iter().rev() {
            let ret = run(program, data);
            if action(ret) < action(result) {
                result = ret;
            }
        }
        result
    }

    fn data(nr: u32, arch: u32, args: [u64; 6]) -> [u8; 64] {
        let mut d = [0u8; 64];
        d[0..4].copy_from_slice(&nr.to_le_bytes());
        d[4..8].copy_from_slice(&arch.to_le_bytes());
        for (i, arg) in args.iter().enumerate() {
            d[16 + 8 * i..24 + 8 * i].copy_from_slice(&arg.to_le_bytes());
        }
        d
    }

    /// The filters of before, from the same rules: seccompiler's compilation.
    fn reference(filter: &bpf::Filter) -> Vec<Vec<sock_filter>> {
        let arch = TargetArch::try_from(std::env::consts::ARCH).unwrap();
        let x32_guard = vec![
            sock_filter {
                code: 0x20,
                jt: 0,
                jf: 0,
                k: 0,
            },
            sock_filter {
                code: 0x35,
                jt: 0,
                jf: 1,
                k: X32_SYSCALL_BIT,
            },
            sock_filter {
                code: 0x06,
                jt: 0,
                jf: 0,
                k: libc::SECCOMP_RET_ERRNO | libc::ENOSYS.cast_unsigned(),
            },
            sock_filter {
                code: 0x06,
                jt: 0,
                jf: 0,
                k: libc::SECCOMP_RET_ALLOW,
            },
        ];
        let mut programs = vec![x32_guard];
        for errno in [libc::ENOSYS, libc::EPERM] {
            let action = libc::SECCOMP_RET_ERRNO | errno.cast_unsigned();
            let rules: BTreeMap<i64, Vec<SeccompRule>> = filter
                .entries
                .iter()
                .filter(|(_, e)| e.action == action)
                .map(|(nr, e)| {
                    let rules = e
                        .rules
                        .iter()
                        .flat_map(expand)
                        .map(|conds| SeccompRule::new(conds).unwrap())
                        .collect();
                    (i64::from(*nr), rules)
                })
                .collect();
            if rules.is_empty() {
                continue;
            }
            let compiled = SeccompFilter::new(
                rules,
                SeccompAction::Allow,
                SeccompAction::Errno(errno.cast_unsigned()),
                arch,
            )
            .unwrap();
            programs.push(compiled.try_into().unwrap());
        }
        programs
    }

    /// A rule as seccompiler's rules, which hold together exactly when it does:
    /// `AnyBit(mask)` is one rule per bit of the mask, `MaskedNe` one per other value
    /// under the mask (all the mask's subsets but the one compared), and the
    /// conjunction of such alternatives their cross product — the rules as they were
    /// written before these two comparisons.
    fn expand(rule: &Vec<Cond>) -> Vec<Vec<SeccompCondition>> {
        let mut rules: Vec<Vec<SeccompCondition>> = vec![Vec::new()];
        for cond in rule {
            let alternatives: Vec<(SeccompCmpOp, u64)> = match cond.cmp {
                Cmp::Eq(v) => vec![(SeccompCmpOp::Eq, v)],
                Cmp::Ne(v) => vec![(SeccompCmpOp::Ne, v)],
                Cmp::AnyBit(mask) => (0..64)
                    .map(|bit| 1u64 << bit)
                    .filter(|bit| mask & bit != 0)
                    .map(|bit| (SeccompCmpOp::MaskedEq(bit), bit))
                    .collect(),
                Cmp::MaskedNe { mask, value } => {
                    assert!(mask.count_ones() <= 8, "too many values to list");
                    let mut subsets = Vec::new();
                    let mut subset = 0u64;
                    loop {
                        if subset != value & mask {
                            subsets.push((SeccompCmpOp::MaskedEq(mask), subset));
                        }
                        if subset == mask {
                            break;
                        }
                        // The next subset of the mask, in increasing order.
                        subset = subset.wrapping_sub(mask) & mask;
                    }
                    subsets
                }
            };
            let len = match cond.width {
                Width::Dword => SeccompCmpArgLen::Dword,
                Width::Qword => SeccompCmpArgLen::Qword,
            };
            rules = rules
                .iter()
                .flat_map(|prefix| {
                    let len = len.clone();
                    alternatives.iter().map(move |(op, value)| {
                        let mut rule = prefix.clone();
                        rule.push(
                            SeccompCondition::new(cond.arg, len.clone(), op.clone(), *value)
                                .unwrap(),
                        );
                        rule
                    })
                })
                .collect();
        }
        rules
    }

    /// Argument values the rules look at, OR'ed together by a fixed pseudo-random walk.
    fn argument_vectors(count: usize) -> Vec<[u64; 6]> {
        let mut interesting: Vec<u64> = vec![
            0,
            1,
            2,
            3,
            5,
            10,
            0xf,
            libc::S_ISUID as u64,
            libc::S_ISGID as u64,
            0o7777,
            libc::O_CREAT as u64,
            0o20_000_000,
            libc::O_TMPFILE as u64,
            libc::O_RDWR as u64,
            libc::SOCK_NONBLOCK as u64,
            libc::SOCK_CLOEXEC as u64,
            1 << 32,
            1 << 33,
            0xffff_ffff,
            0x1_0000_0001,
            u64::MAX,
            4242,
            u64::from(4242u32.wrapping_neg()),
            77,
            u64::from(77u32.wrapping_neg()),
            (1 << 32) | 4242,
        ];
        interesting.extend(NAMESPACE_FLAGS.iter().map(|f| u64::from(f.cast_unsigned())));
        interesting.extend(
            NAMESPACE_FLAGS
                .iter()
                .map(|f| u64::from(f.cast_unsigned()) << 32),
        );
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut vectors = vec![[0; 6]];
        for &v in &interesting {
            for arg in 0..6 {
                let mut args = [0; 6];
                args[arg] = v;
                vectors.push(args);
            }
        }
        while vectors.len() < count {
            let mut args = [0u64; 6];
            for arg in &mut args {
                for _ in 0..(next() % 4) {
                    let pick = usize::try_from(next() % interesting.len() as u64).unwrap();
                    *arg |= interesting[pick];
                }
            }
            vectors.push(args);
        }
        vectors
    }

    #[test]
    fn the_filter_decides_as_seccompilers_did_for_every_profile() {
        let vectors = argument_vectors(3000);
        let arch = audit_arch().unwrap();
        let mut checked = 0usize;
        for network in [Network::None, Network::Proxy, Network::Host] {
            for (exec, namespaces, unix_sockets, no_setid_files, own_process_only, ipc) in [
                (true, false, true, true, true, true),
                (true, false, false, true, true, false),
                (true, false, true, false, false, true),
                (true, true, true, true, false, true),
                (false, true, false, false, true, false),
                (false, false, true, true, false, false),
            ] {
                let profile = Profile {
                    network,
                    exec,
                    namespaces,
                    unix_sockets,
                    no_setid_files,
                    own_process_only,
                    ipc,
                    protected_pids: if own_process_only {
                        [4242, 77, 0]
                    } else {
                        [0; 3]
                    },
                };
                let table = filter(profile).unwrap();
                let ours = [SeccompPlan::compile(profile).unwrap().program];
                let before = reference(&table);
                let mut numbers: Vec<u32> = (0..600).collect();
                numbers.extend((0..8).map(|n| X32_SYSCALL_BIT + n));
                numbers.extend([X32_SYSCALL_BIT - 1, 0x8000_0000, u32::MAX]);
                for nr in numbers {
                    let ruled = table.entries.get(&nr).is_some_and(|e| !e.rules.is_empty());
                    let args: &[[u64; 6]] = if ruled { &vectors } else { &vectors[..40] };
                    for args in args {
                        for arch in [arch, 0x4000_0003] {
                            let d = data(nr, arch, *args);
                            assert_eq!(
                                run_stack(&ours, &d),
                                run_stack(&before, &d),
                                "{profile:?}: nr {nr}, arch {arch:#x}, args {args:x?}"
                            );
                            checked += 1;
                        }
                    }
                }
                // Far fewer instructions walked than the linear chain: the search
                // reaches an unlisted number's answer (write) within a dozen or so.
                let (_, walked) = run_counted(&ours[0], &data(1, arch, [0; 6]));
                assert!(walked <= 16, "{profile:?}: {walked}");
            }
        }
        assert!(checked > 1_000_000, "{checked}");
    }

    /// The sandbox's filter as the kernel receives it: every instruction is converted
    /// and compiled each time a sandbox attaches it, so the program is kept short —
    /// numbers without rules answered in the search's leaves, bit tests as one test
    /// for all their bits (153, 161 and 148 instructions for `none`, `proxy` and
    /// `host`; with a block per number and a rule per bit, as compiled before, 343, 435
    /// and 337). The standard level's refusals (`AF_UNIX` sockets and datagram pairs,
    /// other processes' limits and scheduling, SysV IPC and message queues) add about
    /// a hundred (263 for `none`, 267 for `host`), and the signals that would reach
    /// the worker, its parent or its group some seventy more (334 for `none`).
    #[test]
    fn the_sandbox_filter_is_short() {
        for (network, strict, most) in [
            (Network::None, true, 160),
            (Network::Proxy, true, 170),
            (Network::Host, true, 170),
            // Proxy needs the strict level's network namespace (refused at standard).
            (Network::None, false, 345),
            (Network::Host, false, 345),
        ] {
            let program = SeccompPlan::compile(Profile::sandbox(network, strict))
                .unwrap()
                .program;
            assert!(
                program.len() <= most,
                "{network:?} (strict {strict}): {} instructions",
                program.len()
            );
        }
    }

    /// A standard sandbox's command cannot signal the worker, its parent or its group,
    /// nor every process at once, by any of the system calls that name a process;
    /// other processes (its own) and its own group stay in reach. A strict sandbox's
    /// filter, whose pid namespace hides them, has none of these rules.
    #[test]
    fn a_standard_command_cannot_signal_the_worker() {
        let arch = audit_arch().unwrap();
        let refused = libc::SECCOMP_RET_ERRNO | libc::EPERM.cast_unsigned();
        let [worker, parent, group] = [4242u32, 4000, 3999];
        let standard = Profile {
            protected_pids: [worker, parent, group],
            ..Profile::sandbox(Network::None, false)
        };
        let program = SeccompPlan::compile(standard).unwrap().program;
        let strict = SeccompPlan::compile(Profile::sandbox(Network::None, true))
            .unwrap()
            .program;
        let sig = libc::SIGKILL as u64;
        let negative = |pid: u32| u64::from(pid.wrapping_neg());
        // pid_t is 32 bits: whatever the high half holds, the kernel reads the low one.
        let high = |v: u64| v | (0xdead_beef << 32);
        for nr in [
            libc::SYS_kill,
            libc::SYS_tgkill,
            libc::SYS_rt_sigqueueinfo,
            libc::SYS_rt_tgsigqueueinfo,
            libc::SYS_pidfd_open,
        ] {
            let nr = u32::try_from(nr).unwrap();
            for target in [
                u64::from(worker),
                u64::from(parent),
                negative(group),
                u64::from(u32::MAX),
                high(u64::from(worker)),
                high(negative(group)),
            ] {
                let d = data(nr, arch, [target, sig, 0, 0, 0, 0]);
                assert_eq!(run(&program, &d), refused, "nr {nr}, target {target:#x}");
                assert_eq!(run(&strict, &d), libc::SECCOMP_RET_ALLOW, "strict: nr {nr}");
            }
            for target in [0, 4243, negative(4243), u64::from(group)] {
                let d = data(nr, arch, [target, sig, 0, 0, 0, 0]);
                assert_eq!(
                    run(&program, &d),
                    libc::SECCOMP_RET_ALLOW,
                    "nr {nr}, target {target:#x}"
                );
            }
        }
        let tkill = data(
            u32::try_from(libc::SYS_tkill).unwrap(),
            arch,
            [4243, sig, 0, 0, 0, 0],
        );
        assert_eq!(run(&program, &tkill), refused);
        // The real profile names this process, its group and its parent.
        let [pid, parent_pid, own_group] = Profile::sandbox(Network::None, false).protected_pids;
        assert_eq!(pid, std::process::id());
        assert_eq!(parent_pid, std::os::unix::process::parent_id());
        // SAFETY: getpgrp takes no arguments.
        assert_eq!(own_group, unsafe { libc::getpgrp() }.cast_unsigned());
    }

    /// The guard a standard command stacks: every signalling call naming its init or
    /// init's group is refused, whatever the high half of the argument holds; other
    /// targets, other calls and the other arguments pass.
    #[test]
    fn the_parent_guard_refuses_signals_to_init_alone() {
        let arch = audit_arch().unwrap();
        let refused = libc::SECCOMP_RET_ERRNO | libc::EPERM.cast_unsigned();
        let init = 31_337u32;
        let guard = parent_guard(init).to_vec();
        let sig = libc::SIGKILL as u64;
        for nr in SIGNALLING_CALLS {
            let nr = u32::try_from(nr).unwrap();
            for target in [
                u64::from(init),
                u64::from(init.wrapping_neg()),
                u64::from(init) | (7 << 32),
            ] {
                let d = data(nr, arch, [target, sig, 0, 0, 0, 0]);
                assert_eq!(run(&guard, &d), refused, "nr {nr}, target {target:#x}");
            }
            for target in [
                0,
                1,
                u64::from(init + 1),
                u64::from(init.wrapping_neg() - 1),
            ] {
                let d = data(nr, arch, [target, sig, u64::from(init), 0, 0, 0]);
                assert_eq!(run(&guard, &d), libc::SECCOMP_RET_ALLOW, "nr {nr}");
            }
        }
        for nr in 0..600u32 {
            if SIGNALLING_CALLS
                .iter()
                .any(|&s| s == libc::c_long::from(nr))
            {
                continue;
            }
            let d = data(nr, arch, [u64::from(init), sig, 0, 0, 0, 0]);
            assert_eq!(run(&guard, &d), libc::SECCOMP_RET_ALLOW, "nr {nr}");
        }
    }

    /// `AnyBit(0)` has no bit that could be set: it never holds (and loads nothing).
    #[test]
    fn a_bit_test_without_bits_never_holds() {
        let arch = audit_arch().unwrap();
        let refused = libc::SECCOMP_RET_ERRNO | libc::EPERM.cast_unsigned();
        let rule = vec![Cond {
            arg: 0,
            width: Width::Qword,
            cmp: Cmp::AnyBit(0),
        }];
        let filter = bpf::Filter {
            arch,
            entries: BTreeMap::from([(
                7,
                bpf::Entry {
                    rules: vec![rule],
                    action: refused,
                },
            )]),
            high_from: None,
            default: libc::SECCOMP_RET_ALLOW,
        };
        let program = bpf::compile(&filter).unwrap();
        for value in [0, 1, 0xffff_ffff, u64::MAX] {
            assert_eq!(
                run(&program, &data(7, arch, [value; 6])),
                libc::SECCOMP_RET_ALLOW,
                "{value:#x}"
            );
        }
    }
}
