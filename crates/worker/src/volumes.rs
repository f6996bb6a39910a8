//! Workspace volumes: the kernel-enforced quota of every workspace (`[sandbox]
//! workspace_bytes` and `workspace_inodes`, DESIGN §16).
//!
//! Each workspace `<root>/<principal>/<session>` is the mount point of its own ext4 file
//! system, sized to the quota, so the kernel refuses the write or the file that would
//! exceed it (`ENOSPC`) — for the shell's sandboxes and the fs tools alike, whatever
//! they do. Mounting needs privileges no worker keeps, so the workers ask the launcher's
//! volume broker over a Unix socket; this module is their side of it and the wire format
//! both sides use. The worker does not take the broker's word: it checks that the
//! workspace is a file system of its own no larger than the quota before using it.
//!
//! That check is what a call relies on, so a workspace the broker has answered for once
//! is not asked about again while the check still passes: a call then costs three
//! `stat`s instead of a round trip to the launcher (a connection accepted, its peer
//! checked, a line each way), which was most of the launcher's CPU per call. A
//! workspace that stops passing (unmounted behind the worker's back) is asked for again.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// The broker's socket, relative to the data dir.
pub const BROKER_SOCKET: &str = "run/volumes.sock";
/// Longest request or reply line either side reads.
pub const MAX_LINE: usize = 1024;
/// How long a worker waits for a volume to be created and mounted.
const ENSURE_TIMEOUT: Duration = Duration::from_secs(30);

/// `errno` values of a full workspace: no blocks or no inodes left (`ENOSPC`), or a
/// quota reached (`EDQUOT`).
const ENOSPC: i32 = 28;
const EDQUOT: i32 = 122;

/// `[sandbox] workspace_bytes` and `workspace_inodes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkspaceQuota {
    pub bytes: u64,
    pub inodes: u64,
}

/// What a call that found its workspace full is told: the kernel refused the blocks or
/// the inode, and what to do about it.
pub const WORKSPACE_FULL: &str = "the workspace is full (no space or no file entries left \
     under its quota, [sandbox] workspace_bytes and workspace_inodes); delete files in it to \
     make room, or ask an operator to raise the quota";

/// One `thiserror` enum per module: why a workspace volume is not available.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error(
        "cannot reach the workspace volume broker at {socket}: {source}; [sandbox] \
         workspace_bytes needs `airlock up` run as root (which mounts one file system per \
         workspace), or set [sandbox] workspace_bytes = 0 and workspace_inodes = 0 to run \
         without a per-workspace quota"
    )]
    Unreachable {
        socket: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the workspace volume broker failed: {0}")]
    Broker(String),
    #[error("the workspace volume broker answered something unexpected: {0:?}")]
    Protocol(String),
    #[error("workspace {path} is not a quota-limited file system of its own: {reason}")]
    NotAVolume { path: String, reason: String },
}

/// A request to the broker, one line on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Liveness, at worker start.
    Ping,
    /// Create (when missing) and mount the volume of `<principal>/<session>`.
    Ensure { principal: String, session: String },
}

impl Request {
    pub fn to_line(&self) -> String {
        match self {
            Request::Ping => "ping\n".to_owned(),
            Request::Ensure { principal, session } => format!("ensure {principal} {session}\n"),
        }
    }

    /// Parses one line (without its newline). The names are checked by the broker with
    /// [`is_plain_segment`].
    pub fn parse(line: &str) -> Option<Request> {
        let mut words = line.split(' ');
        let request = match (words.next(), words.next(), words.next()) {
            (Some("ping"), None, None) => Request::Ping,
            (Some("ensure"), Some(principal), Some(session)) => Request::Ensure {
                principal: principal.to_owned(),
                session: session.to_owned(),
            },
            _ => return None,
        };
        words.next().is_none().then_some(request)
    }
}

/// A workspace path segment as the workers accept it: not empty, not `.` or `..`, no
/// `/`, NUL, whitespace or control character, at most 255 bytes.
pub fn is_plain_segment(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name != "."
        && name != ".."
        && !name
            .chars()
            .any(|c| c == '/' || c.is_whitespace() || c.is_control())
}

/// Whether an I/O error means the workspace is full.
pub fn is_full(error: &std::io::Error) -> bool {
    matches!(error.raw_os_error(), Some(ENOSPC | EDQUOT))
}

/// How many workspaces a worker remembers the broker answered for. Past it the set
/// starts again (those workspaces are asked for once more): what a worker holds does
/// not grow with the sessions callers make up.
const KNOWN_MAX: usize = 4096;

/// The worker's side of the broker.
#[derive(Debug, Clone)]
pub struct VolumeClient {
    socket: PathBuf,
    quota: WorkspaceQuota,
    /// `<principal>/<session>` of the workspaces the broker answered for, shared by the
    /// clones of this client in one worker.
    known: Arc<Mutex<HashSet<String>>>,
}

/// Two clients are the same when they ask the same broker for the same quota; what
/// each has learnt since is not configuration.
impl PartialEq for VolumeClient {
    fn eq(&self, other: &Self) -> bool {
        self.socket == other.socket && self.quota == other.quota
    }
}

impl Eq for VolumeClient {}

impl VolumeClient {
    pub fn new(socket: PathBuf, quota: WorkspaceQuota) -> Self {
        Self {
            socket,
            quota,
            known: Arc::default(),
        }
    }

    pub fn quota(&self) -> WorkspaceQuota {
        self.quota
    }

    /// At start: is the broker there? A worker whose workspaces cannot get a quota
    /// refuses to start rather than run without one.
    pub fn ping(&self) -> Result<(), VolumeError> {
        self.ask(&Request::Ping)
    }

    /// Makes `<root>/<principal>/<session>` a mounted volume (blocking; creating one takes
    /// tens of milliseconds) and checks that it is one. A workspace the broker answered
    /// for before is only checked ([`VolumeClient::ready`]).
    pub fn ensure(&self, root: &Path, principal: &str, session: &str) -> Result<(), VolumeError> {
        let workspace = Workspace::new(root, principal, session);
        if self.ready_at(&workspace) {
            return Ok(());
        }
        self.ask(&Request::Ensure {
            principal: principal.to_owned(),
            session: session.to_owned(),
        })?;
        workspace.check(self.quota)?;
        let mut known = self.known();
        if known.len() >= KNOWN_MAX {
            known.clear();
        }
        known.insert(workspace.key);
        Ok(())
    }

    /// Whether the workspace needs nothing from the broker: it answered for it before,
    /// and it still passes the worker's own check. One that no longer does is forgotten,
    /// so that the next [`VolumeClient::ensure`] asks for it again.
    pub fn ready(&self, root: &Path, principal: &str, session: &str) -> bool {
        self.ready_at(&Workspace::new(root, principal, session))
    }

    fn ready_at(&self, workspace: &Workspace) -> bool {
        if !self.known().contains(&workspace.key) {
            return false;
        }
        if workspace.check(self.quota).is_ok() {
            return true;
        }
        self.known().remove(&workspace.key);
        false
    }

    fn known(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.known.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn ask(&self, request: &Request) -> Result<(), VolumeError> {
        let unreachable = |source| VolumeError::Unreachable {
            socket: self.socket.display().to_string(),
            source,
        };
        let mut stream = UnixStream::connect(&self.socket).map_err(unreachable)?;
        stream
            .set_read_timeout(Some(ENSURE_TIMEOUT))
            .and_then(|()| stream.set_write_timeout(Some(ENSURE_TIMEOUT)))
            .and_then(|()| stream.write_all(request.to_line().as_bytes()))
            .map_err(unreachable)?;
        let mut reply = String::new();
        BufReader::new(stream.take_bounded())
            .read_line(&mut reply)
            .map_err(unreachable)?;
        let reply = reply.trim_end_matches('\n');
        match reply.split_once(' ') {
            _ if reply == "ok" => Ok(()),
            Some(("error", message)) => Err(VolumeError::Broker(message.to_owned())),
            _ => Err(VolumeError::Protocol(reply.to_owned())),
        }
    }
}

/// One workspace as the client checks and remembers it.
struct Workspace {
    /// `<root>/<principal>`, whose device the workspace's must differ from.
    parent: PathBuf,
    /// `<root>/<principal>/<session>`.
    path: PathBuf,
    /// `<principal>/<session>`: how the client remembers it.
    key: String,
}

impl Workspace {
    fn new(root: &Path, principal: &str, session: &str) -> Self {
        let parent = root.join(principal);
        Self {
            path: parent.join(session),
            parent,
            key: format!("{principal}/{session}"),
        }
    }

    fn check(&self, quota: WorkspaceQuota) -> Result<(), VolumeError> {
        check_volume(&self.parent, &self.path, quota)
    }
}

/// A stream read no further than one line's worth.
trait TakeBounded {
    fn take_bounded(self) -> std::io::Take<UnixStream>;
}

impl TakeBounded for UnixStream {
    fn take_bounded(self) -> std::io::Take<UnixStream> {
        std::io::Read::take(self, MAX_LINE as u64)
    }
}

/// The check a worker makes itself: the workspace is a file system of its own (another
/// device than its parent) whose size is within the quota.
pub fn check_volume(parent: &Path, path: &Path, quota: WorkspaceQuota) -> Result<(), VolumeError> {
    let fail = |reason: String| VolumeError::NotAVolume {
        path: path.display().to_string(),
        reason,
    };
    let own = std::fs::symlink_metadata(path).map_err(|e| fail(e.to_string()))?;
    let above = std::fs::symlink_metadata(parent).map_err(|e| fail(e.to_string()))?;
    if !own.file_type().is_dir() {
        return Err(fail("not a directory".into()));
    }
    if own.dev() == above.dev() {
        return Err(fail("it is on the same file system as its parent".into()));
    }
    let stat = rustix::fs::statvfs(path).map_err(|e| fail(e.to_string()))?;
    let size = stat.f_blocks.saturating_mul(stat.f_frsize);
    if size > quota.bytes {
        return Err(fail(format!(
            "it holds {size} bytes, more than [sandbox] workspace_bytes = {}",
            quota.bytes
        )));
    }
    Ok(())
}

/// Room below which a workspace counts as full: less than one small file's worth.
const FULL_BELOW_BYTES: u64 = 64 * 1024;

/// Whether the workspace at `path` has (next to) no room left, in bytes or in inodes.
pub fn is_exhausted(path: &Path) -> bool {
    rustix::fs::statvfs(path)
        .is_ok_and(|s| s.f_bavail.saturating_mul(s.f_frsize) < FULL_BELOW_BYTES || s.f_favail == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        for request in [
            Request::Ping,
            Request::Ensure {
                principal: "alice".into(),
                session: "s-1".into(),
            },
        ] {
            let line = request.to_line();
            assert_eq!(Request::parse(line.trim_end_matches('\n')), Some(request));
        }
        assert_eq!(Request::parse("ensure a"), None);
        assert_eq!(Request::parse("ensure a b c"), None);
        assert_eq!(Request::parse("mount /dev/sda /"), None);
    }

    #[test]
    fn segments_are_plain() {
        for good in ["alice", "s-1", "default", "a.b"] {
            assert!(is_plain_segment(good), "{good}");
        }
        let long = "x".repeat(256);
        for bad in ["", ".", "..", "a/b", "a b", "a\nb", "a\0b", long.as_str()] {
            assert!(!is_plain_segment(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_plain_directory_is_not_a_volume() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("ws")).unwrap();
        let quota = WorkspaceQuota {
            bytes: 1 << 30,
            inodes: 1000,
        };
        let err = check_volume(dir.path(), &dir.path().join("ws"), quota).unwrap_err();
        assert!(err.to_string().contains("same file system"), "{err}");
    }

    /// A broker on a Unix socket that answers `ok` to every request and counts them.
    fn counting_broker(socket: &Path) -> Arc<std::sync::atomic::AtomicUsize> {
        let listener = std::os::unix::net::UnixListener::bind(socket).unwrap();
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = asked.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut line = String::new();
                let _ = BufReader::new(&stream).read_line(&mut line);
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = stream.write_all(b"ok\n");
            }
        });
        asked
    }

    #[test]
    fn the_broker_is_asked_once_per_workspace_while_it_stays_a_volume() {
        // /dev/shm is a file system of its own under /dev: a workspace `shm` of a
        // principal `dev` under `/`, as a mounted volume looks, without mounting one.
        let (above, own) = (
            std::fs::metadata("/dev").expect("this test needs /dev"),
            std::fs::metadata("/dev/shm").expect("this test needs /dev/shm"),
        );
        assert_ne!(
            above.dev(),
            own.dev(),
            "this test needs /dev/shm mounted on its own (a tmpfs), as Linux hosts have it"
        );
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("volumes.sock");
        let asked = counting_broker(&socket);
        let unlimited = WorkspaceQuota {
            bytes: u64::MAX,
            inodes: u64::MAX,
        };
        let client = VolumeClient::new(socket.clone(), unlimited);
        let count = || asked.load(std::sync::atomic::Ordering::SeqCst);
        assert!(!client.ready(Path::new("/"), "dev", "shm"));
        client.ensure(Path::new("/"), "dev", "shm").unwrap();
        assert_eq!(count(), 1);
        // A clone (another call's copy of the configuration) knows it too.
        let other_call = client.clone();
        for _ in 0..3 {
            other_call.ensure(Path::new("/"), "dev", "shm").unwrap();
        }
        assert_eq!(count(), 1, "a known volume is checked, not asked for again");
        assert!(client.ready(Path::new("/"), "dev", "shm"));

        // A workspace that the broker says ok for but is no volume is refused every
        // time, and asked for every time: nothing is remembered of a failed check.
        std::fs::create_dir_all(dir.path().join("alice/s-1")).unwrap();
        for expected in [2, 3] {
            let err = client.ensure(dir.path(), "alice", "s-1").unwrap_err();
            assert!(err.to_string().contains("same file system"), "{err}");
            assert_eq!(count(), expected);
        }
        assert!(!client.ready(dir.path(), "alice", "s-1"));

        // A known workspace that stops passing the check (a volume unmounted behind
        // the worker's back; here, a quota lowered below its size) is refused, and
        // asked for again.
        let small = VolumeClient {
            quota: WorkspaceQuota {
                bytes: 1,
                inodes: 1,
            },
            ..client.clone()
        };
        let err = small.ensure(Path::new("/"), "dev", "shm").unwrap_err();
        assert!(err.to_string().contains("more than"), "{err}");
        assert_eq!(
            count(),
            4,
            "a known workspace that fails its check is asked for"
        );
        assert!(!client.ready(Path::new("/"), "dev", "shm"), "and forgotten");
    }

    #[test]
    fn full_errors_are_recognised() {
        assert!(is_full(&std::io::Error::from_raw_os_error(ENOSPC)));
        assert!(is_full(&std::io::Error::from_raw_os_error(EDQUOT)));
        assert!(!is_full(&std::io::Error::from_raw_os_error(13)));
    }
}
