//! The sandbox's filesystem: a new root on a small tmpfs, holding read-only binds of the
//! system directories, a minimal `/etc` without host secrets, the workspace read-write at
//! `/workspace`, a size-limited `/tmp`, a fresh `/proc` and a minimal `/dev`; then
//! `pivot_root` and the old root detached.
//!
//! The plan (every path as a `CString`) is built in the parent by [`RootfsPlan::prepare`];
//! the child only replays it with raw system calls ([`RootfsPlan::enter`]). Sources are
//! read through `/oldroot`, where `pivot_root` puts the host's root, exactly like
//! bubblewrap does. All mounts live in the child's private mount namespace, so they vanish
//! with it and nothing propagates to the host.

use std::ffi::{CStr, CString};
use std::io;
use std::path::{Path, PathBuf};

use crate::sandbox::Network;
use crate::step::{AtStep, Failure, Step};
use crate::sys;

/// One `thiserror` enum per module: failures while planning the new root.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    #[error("the workspace {0} is not an absolute path to a directory")]
    Workspace(PathBuf),
    #[error("cannot inspect {path}: {source}")]
    Inspect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// System directories bound read-only when they exist; merged-usr symlinks are copied.
pub(crate) const SYSTEM_DIRS: [&str; 7] = ["usr", "bin", "sbin", "lib", "lib64", "lib32", "libx32"];

/// Host `/etc` entries that hold no secrets and that programs expect: the dynamic
/// loader's cache, Debian's alternatives (`awk`, `editor`, …) and the timezone.
const ETC_FROM_HOST: [&str; 3] = ["ld.so.cache", "alternatives", "localtime"];

/// Extra `/etc` entries with the host's network: DNS and the CA bundle for TLS.
const ETC_FROM_HOST_NETWORK: [&str; 2] = ["resolv.conf", "ssl/certs"];

/// Extra `/etc` entries behind the egress proxy: the CA bundle, since a client checks
/// the certificate of the server it tunnels to; no DNS, since the proxy resolves names.
const ETC_FROM_HOST_PROXY: [&str; 1] = ["ssl/certs"];

/// Files of the minimal `/etc`: root and nobody only, no `shadow`, no keys.
const ETC_FILES: [(&CStr, &[u8]); 5] = [
    (
        c"/etc/passwd",
        b"root:x:0:0:root:/workspace:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    ),
    (c"/etc/group", b"root:x:0:\nnogroup:x:65534:\n"),
    (c"/etc/hosts", b"127.0.0.1\tlocalhost airlock\n::1\tlocalhost ip6-localhost ip6-loopback\n"),
    (c"/etc/nsswitch.conf", b"passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n"),
    (c"/etc/hostname", b"airlock\n"),
];

/// Device nodes bound from the host's `/dev`.
pub(crate) const DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

/// `/dev` symlinks into the sandbox's own `/proc`.
const DEV_SYMLINKS: [(&CStr, &CStr); 4] = [
    (c"/proc/self/fd", c"/dev/fd"),
    (c"/proc/self/fd/0", c"/dev/stdin"),
    (c"/proc/self/fd/1", c"/dev/stdout"),
    (c"/proc/self/fd/2", c"/dev/stderr"),
];

/// `/proc` entries made read-only (bind over themselves): kernel knobs that the
/// sandbox's root, which is the worker's uid on the host, must not reach even if
/// another layer failed.
const PROC_READ_ONLY: [&CStr; 6] = [
    c"/proc/sys",
    c"/proc/sysrq-trigger",
    c"/proc/irq",
    c"/proc/bus",
    c"/proc/fs",
    c"/proc/kcore",
];

/// Where the root tmpfs is first mounted (any directory of the host view works: the
/// mount is private to the child and moves to `/` with `pivot_root`).
const SCRATCH: &CStr = c"/tmp";
const OLD_ROOT: &CStr = c"oldroot";
const OLD_ROOT_ABS: &CStr = c"/oldroot";

/// How a system directory appears in the new root.
#[derive(Debug)]
enum SystemEntry {
    Bind { source: CString, target: CString },
    Symlink { target: CString, link: CString },
}

/// A host `/etc` entry bound read-only (or copied as a symlink).
#[derive(Debug)]
enum EtcEntry {
    Bind {
        source: CString,
        target: CString,
        is_dir: bool,
    },
    Symlink {
        target: CString,
        link: CString,
    },
}

/// The part of the new root that is the same for every call of a sandbox factory —
/// which system directories are directories or merged-usr symlinks, which harmless
/// `/etc` entries the host has and where they lead, the device nodes, the tmpfs
/// options — found once, when the factory is made, instead of by a dozen `stat`s and
/// `readlink`s per call. Only paths are kept: every call's child mounts what those
/// paths hold at that moment.
#[derive(Debug)]
pub(crate) struct RootfsTemplate {
    root_data: CString,
    system: Vec<SystemEntry>,
    etc_dirs: Vec<CString>,
    etc: Vec<EtcEntry>,
    tmp_data: CString,
    shm_data: CString,
    devices: Vec<(CString, CString)>,
}

/// The call's part of the new root, prepared before `clone` (or before a pre-built
/// sandbox is handed its call): where the workspace is seen from inside the new
/// mount namespace before the old root is detached, and the working directory.
pub(crate) struct RootfsPlan {
    pub(crate) workspace_source: CString,
    pub(crate) cwd: CString,
}

fn cstring(p: &Path) -> Result<CString, RootfsError> {
    sys::path_cstring(p).map_err(|source| RootfsError::Inspect {
        path: p.to_path_buf(),
        source,
    })
}

impl RootfsPlan {
    /// Plans the call's part of the new root for `workspace` (a host directory),
    /// starting in `/workspace/<cwd>`.
    pub(crate) fn prepare(workspace: &Path, cwd: &Path) -> Result<Self, RootfsError> {
        if !workspace.is_absolute() || !workspace.is_dir() {
            return Err(RootfsError::Workspace(workspace.to_path_buf()));
        }
        let workspace_rel = workspace.strip_prefix("/").unwrap_or(workspace);
        Ok(RootfsPlan {
            workspace_source: cstring(&Path::new("/oldroot").join(workspace_rel))?,
            cwd: cstring(&Path::new("/workspace").join(cwd))?,
        })
    }
}

impl RootfsTemplate {
    /// Finds the host's side of the new root, with a `/tmp` of `tmp_bytes` and, when
    /// the network is the host's, DNS and the CA bundle (behind the proxy, the bundle).
    pub(crate) fn prepare(tmp_bytes: u64, network: Network) -> Result<Self, RootfsError> {
        let c = cstring;
        let old = Path::new("/oldroot");

        let mut system = Vec::new();
        for name in SYSTEM_DIRS {
            let host = Path::new("/").join(name);
            let Ok(meta) = std::fs::symlink_metadata(&host) else {
                continue;
            };
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&host).map_err(|source| RootfsError::Inspect {
                    path: host.clone(),
                    source,
                })?;
                system.push(SystemEntry::Symlink {
                    target: c(&target)?,
                    link: c(&host)?,
                });
            } else if meta.is_dir() {
                system.push(SystemEntry::Bind {
                    source: c(&old.join(name))?,
                    target: c(&host)?,
                });
            }
        }

        let mut etc_dirs = vec![c(Path::new("/etc"))?];
        let mut etc = Vec::new();
        let from_host = ETC_FROM_HOST.iter().chain(match network {
            Network::Host => ETC_FROM_HOST_NETWORK.iter(),
            Network::Proxy => ETC_FROM_HOST_PROXY.iter(),
            Network::None => [].iter(),
        });
        for name in from_host {
            let host = Path::new("/etc").join(name);
            let Ok(meta) = std::fs::symlink_metadata(&host) else {
                continue;
            };
            if let Some(parent) = host.parent().filter(|p| *p != Path::new("/etc")) {
                etc_dirs.push(c(parent)?);
            }
            // resolv.conf is often a symlink into /run: bind the file it points to.
            let follow = *name == "resolv.conf";
            if meta.file_type().is_symlink() && !follow {
                let target = std::fs::read_link(&host).map_err(|source| RootfsError::Inspect {
                    path: host.clone(),
                    source,
                })?;
                etc.push(EtcEntry::Symlink {
                    target: c(&target)?,
                    link: c(&host)?,
                });
            } else {
                let real = std::fs::canonicalize(&host).map_err(|source| RootfsError::Inspect {
                    path: host.clone(),
                    source,
                })?;
                let meta = std::fs::metadata(&real).map_err(|source| RootfsError::Inspect {
                    path: real.clone(),
                    source,
                })?;
                let source = old.join(real.strip_prefix("/").unwrap_or(&real));
                etc.push(EtcEntry::Bind {
                    source: c(&source)?,
                    target: c(&host)?,
                    is_dir: meta.is_dir(),
                });
            }
        }

        let devices = DEVICES
            .iter()
            .map(|d| Ok((c(&old.join("dev").join(d))?, c(&Path::new("/dev").join(d))?)))
            .collect::<Result<Vec<_>, RootfsError>>()?;

        let shm_bytes = tmp_bytes.min(16 << 20);
        Ok(RootfsTemplate {
            root_data: c(Path::new("size=4m,nr_inodes=4096,mode=0755"))?,
            system,
            etc_dirs,
            etc,
            tmp_data: c(Path::new(&format!("size={tmp_bytes},mode=1777")))?,
            shm_data: c(Path::new(&format!("size={shm_bytes},mode=1777")))?,
            devices,
        })
    }
}

impl RootfsTemplate {
    /// Child side, the part of the new root that is the same for every call: pivots
    /// into a fresh root with the system directories, `/etc`, `/tmp`, `/proc` and
    /// `/dev`, the host's root still at `/oldroot` (async-signal-safe: only system
    /// calls on prepared strings). [`finish_root`] follows, with the call's workspace;
    /// a fresh sandbox runs the two back to back, a pre-built one (`spawn::pool`) runs
    /// this before its call and [`finish_root`] once the call is known.
    pub(crate) fn build_root(&self) -> Result<(), Failure> {
        let template = self;
        // 1. Nothing we mount may propagate back to the host's mount namespace.
        sys::mount(None, c"/", None, libc::MS_REC | libc::MS_PRIVATE, None)
            .at(Step::MakeMountsPrivate)?;

        // 2. The new root: a small tmpfs, entered with pivot_root; the host's root moves
        //    to /oldroot, from where the binds below take their sources.
        sys::mount(
            Some(c"airlock-root"),
            SCRATCH,
            Some(c"tmpfs"),
            libc::MS_NOSUID | libc::MS_NODEV,
            Some(&template.root_data),
        )
        .at(Step::MountRootTmpfs)?;
        chdir(SCRATCH).at(Step::PivotRoot)?;
        mkdir(OLD_ROOT, 0o700).at(Step::PivotRoot)?;
        // SAFETY: both arguments are NUL-terminated strings.
        sys::check(unsafe {
            libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), OLD_ROOT.as_ptr())
        })
        .at(Step::PivotRoot)?;
        chdir(c"/").at(Step::PivotRoot)?;

        // 3. System directories read-only; merged-usr symlinks (/bin -> usr/bin) as is.
        for entry in &template.system {
            match entry {
                SystemEntry::Bind { source, target } => {
                    mkdir(target, 0o755).at(Step::BindSystemDir)?;
                    bind_read_only(source, target, libc::MS_NOSUID | libc::MS_NODEV)
                        .at(Step::BindSystemDir)?;
                }
                SystemEntry::Symlink { target, link } => {
                    symlink(target, link).at(Step::SystemSymlink)?;
                }
            }
        }

        // 4. A minimal /etc: written files for users, hosts and name service, plus a few
        //    harmless host entries. No shadow, no ssh keys, no host resolv.conf unless
        //    the network is on.
        for dir in &template.etc_dirs {
            mkdir(dir, 0o755).at(Step::MinimalEtc)?;
        }
        for (path, contents) in ETC_FILES {
            write_new_file(path, contents).at(Step::MinimalEtc)?;
        }
        // Empty unless the network is on, in which case the host's is bound over it.
        write_new_file(c"/etc/resolv.conf", b"").at(Step::MinimalEtc)?;
        for entry in &template.etc {
            match entry {
                EtcEntry::Bind {
                    source,
                    target,
                    is_dir,
                } => {
                    if *is_dir {
                        mkdir(target, 0o755).at(Step::MinimalEtc)?;
                    } else {
                        write_new_file(target, b"").at(Step::MinimalEtc)?;
                    }
                    bind_read_only(source, target, libc::MS_NODEV | libc::MS_NOSUID)
                        .at(Step::MinimalEtc)?;
                }
                EtcEntry::Symlink { target, link } => symlink(target, link).at(Step::MinimalEtc)?,
            }
        }

        // 5. /tmp: a tmpfs with a size limit (its pages are also charged to the cgroup).
        mkdir(c"/tmp", 0o1777).at(Step::MountTmp)?;
        sys::mount(
            Some(c"tmpfs"),
            c"/tmp",
            Some(c"tmpfs"),
            libc::MS_NOSUID | libc::MS_NODEV,
            Some(&template.tmp_data),
        )
        .at(Step::MountTmp)?;

        // 6. A fresh /proc of the new pid namespace; kernel knobs read-only.
        mkdir(c"/proc", 0o555).at(Step::MountProc)?;
        sys::mount(
            Some(c"proc"),
            c"/proc",
            Some(c"proc"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            None,
        )
        .at(Step::MountProc)?;
        for path in PROC_READ_ONLY {
            match bind_read_only(
                path,
                path,
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            ) {
                Err(libc::ENOENT) => {}
                other => other.at(Step::ProcSysReadOnly)?,
            }
        }

        // 7. A minimal /dev: a few host device nodes, /dev/shm, and /proc symlinks.
        mkdir(c"/dev", 0o755).at(Step::MinimalDev)?;
        sys::mount(
            Some(c"tmpfs"),
            c"/dev",
            Some(c"tmpfs"),
            libc::MS_NOSUID | libc::MS_NOEXEC,
            Some(c"size=64k,nr_inodes=64,mode=0755"),
        )
        .at(Step::MinimalDev)?;
        for (source, target) in &template.devices {
            write_new_file(target, b"").at(Step::MinimalDev)?;
            sys::mount(Some(source), target, None, libc::MS_BIND, None).at(Step::MinimalDev)?;
        }
        for (target, link) in DEV_SYMLINKS {
            symlink(target, link).at(Step::MinimalDev)?;
        }
        mkdir(c"/dev/shm", 0o1777).at(Step::MinimalDev)?;
        sys::mount(
            Some(c"tmpfs"),
            c"/dev/shm",
            Some(c"tmpfs"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            Some(&template.shm_data),
        )
        .at(Step::MinimalDev)?;
        remount_bind(c"/dev", libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NOEXEC)
            .at(Step::MinimalDev)?;
        Ok(())
    }
}

/// Child side, the call's part of the new root after [`RootfsTemplate::build_root`]:
/// the workspace bound from the host's root, that root detached, the new root made
/// read-only, and the working directory (async-signal-safe).
pub(crate) fn finish_root(workspace_source: &CStr, cwd: &CStr) -> Result<(), Failure> {
    // 8. The workspace, read-write, without setuid or devices.
    mkdir(c"/workspace", 0o755).at(Step::BindWorkspace)?;
    sys::mount(
        Some(workspace_source),
        c"/workspace",
        None,
        libc::MS_BIND,
        None,
    )
    .at(Step::BindWorkspace)?;
    remount_bind(c"/workspace", libc::MS_NOSUID | libc::MS_NODEV).at(Step::BindWorkspace)?;

    // 9. Detach the host's root: from here on, nothing of it is reachable.
    // SAFETY: the argument is a NUL-terminated string.
    sys::check_int(unsafe { libc::umount2(OLD_ROOT_ABS.as_ptr(), libc::MNT_DETACH) })
        .at(Step::DetachOldRoot)?;
    // SAFETY: the argument is a NUL-terminated string.
    sys::check_int(unsafe { libc::rmdir(OLD_ROOT_ABS.as_ptr()) }).at(Step::DetachOldRoot)?;

    // 10. The root tmpfs itself becomes read-only.
    remount_bind(c"/", libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV)
        .at(Step::RootReadOnly)?;

    // 11. Start in the requested directory under /workspace.
    chdir(cwd).at(Step::ChangeDirectory)
}

fn mkdir(path: &CStr, mode: libc::mode_t) -> Result<(), i32> {
    // SAFETY: `path` is NUL-terminated.
    match sys::check_int(unsafe { libc::mkdir(path.as_ptr(), mode) }) {
        Err(libc::EEXIST) | Ok(_) => {}
        Err(e) => return Err(e),
    }
    // The umask would otherwise strip the sticky and world-writable bits of /tmp.
    // SAFETY: `path` is NUL-terminated.
    sys::check_int(unsafe { libc::chmod(path.as_ptr(), mode) }).map(drop)
}

fn chdir(path: &CStr) -> Result<(), i32> {
    // SAFETY: `path` is NUL-terminated.
    sys::check_int(unsafe { libc::chdir(path.as_ptr()) }).map(drop)
}

fn symlink(target: &CStr, link: &CStr) -> Result<(), i32> {
    // SAFETY: both arguments are NUL-terminated.
    sys::check_int(unsafe { libc::symlink(target.as_ptr(), link.as_ptr()) }).map(drop)
}

/// Creates a file with the given contents (async-signal-safe).
fn write_new_file(path: &CStr, contents: &[u8]) -> Result<(), i32> {
    // SAFETY: `path` is NUL-terminated; the flags create a new file.
    let fd = sys::check_int(unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC,
            0o644,
        )
    })?;
    let result = sys::write_all_raw(fd, contents);
    // SAFETY: `fd` was opened above and is closed once.
    unsafe { libc::close(fd) };
    result
}

/// Bind `source` on `target` and make the bind read-only.
fn bind_read_only(source: &CStr, target: &CStr, extra: libc::c_ulong) -> Result<(), i32> {
    sys::mount(Some(source), target, None, libc::MS_BIND, None)?;
    remount_bind(target, libc::MS_RDONLY | extra)
}

/// Changes the per-mount flags of the bind at `target`, keeping the flags the kernel
/// locks in a user namespace (nosuid, nodev, noexec, read-only and atime flags inherited
/// from the source mount), which a remount may not clear.
fn remount_bind(target: &CStr, flags: libc::c_ulong) -> Result<(), i32> {
    // glibc's statvfs is one statfs system call (the kernel reports the mount flags in
    // f_flags since 2.6.36), so it is async-signal-safe here.
    // SAFETY: an all-zero statvfs is a valid value to overwrite.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `target` is NUL-terminated and `st` is a valid out-pointer.
    sys::check_int(unsafe { libc::statvfs(target.as_ptr(), &mut st) })?;
    let have = st.f_flag as libc::c_ulong;
    let mut locked = 0;
    for (st_flag, ms_flag) in [
        (libc::ST_RDONLY, libc::MS_RDONLY),
        (libc::ST_NOSUID, libc::MS_NOSUID),
        (libc::ST_NODEV, libc::MS_NODEV),
        (libc::ST_NOEXEC, libc::MS_NOEXEC),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
    ] {
        if have & st_flag as libc::c_ulong != 0 {
            locked |= ms_flag;
        }
    }
    sys::mount(
        None,
        target,
        None,
        libc::MS_BIND | libc::MS_REMOUNT | flags | locked,
        None,
    )
}
