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

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
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

/// The worker's side of the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeClient {
    socket: PathBuf,
    quota: WorkspaceQuota,
}

impl VolumeClient {
    pub fn new(socket: PathBuf, quota: WorkspaceQuota) -> Self {
        Self { socket, quota }
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
    /// tens of milliseconds) and checks that it is one.
    pub fn ensure(&self, root: &Path, principal: &str, session: &str) -> Result<(), VolumeError> {
        self.ask(&Request::Ensure {
            principal: principal.to_owned(),
            session: session.to_owned(),
        })?;
        check_volume(
            &root.join(principal),
            &root.join(principal).join(session),
            self.quota,
        )
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

    #[test]
    fn full_errors_are_recognised() {
        assert!(is_full(&std::io::Error::from_raw_os_error(ENOSPC)));
        assert!(is_full(&std::io::Error::from_raw_os_error(EDQUOT)));
        assert!(!is_full(&std::io::Error::from_raw_os_error(13)));
    }
}
