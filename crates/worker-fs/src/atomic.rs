//! Atomic replacement of a file: temporary file in the same directory, `fsync`,
//! `renameat` over the target, `fsync` of the directory. No half-written file is ever
//! visible and nothing is left behind on failure. Because the target's directory entry
//! is replaced rather than its inode rewritten, a hard link that the target shares with
//! a path outside the workspace keeps its old content.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

/// Prefix of temporary files; they live only for the duration of one write.
pub const TEMP_PREFIX: &str = ".airlock-tmp-";

const DEFAULT_MODE: u32 = 0o644;

#[derive(Debug, thiserror::Error)]
pub enum AtomicError {
    #[error("{path:?} is a directory; write_file and edit_file write regular files only")]
    IsDirectory { path: String },
    #[error("cannot write {path:?}: {errno}")]
    Io { path: String, errno: Errno },
    #[error("cannot write {path:?}: {}", airlock_worker::volumes::WORKSPACE_FULL)]
    Full { path: String },
}

fn temp_name() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.write_u32(std::process::id());
    if let Ok(elapsed) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        hasher.write_u128(elapsed.as_nanos());
    }
    format!("{TEMP_PREFIX}{:016x}", hasher.finish())
}

/// The permission bits to give the new file: those of the regular file it replaces, or
/// 0644. Set-id bits are never carried over.
fn target_mode(dir: &OwnedFd, name: &str) -> u32 {
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::RegularFile => {
            st.st_mode & 0o777
        }
        _ => DEFAULT_MODE,
    }
}

/// Writes `content` to `dir/name` atomically. `name` must be a single plain component;
/// `display` names the target in errors. Returns whether the target existed before.
pub fn write_atomic(
    dir: &OwnedFd,
    name: &str,
    content: &[u8],
    display: &str,
) -> Result<bool, AtomicError> {
    let io = |errno: Errno| match errno {
        Errno::NOSPC | Errno::DQUOT => AtomicError::Full {
            path: display.to_owned(),
        },
        errno => AtomicError::Io {
            path: display.to_owned(),
            errno,
        },
    };
    let existed = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).is_ok();
    let mode = target_mode(dir, name);

    let (tmp_name, fd) = create_temp(dir).map_err(io)?;
    let result = fill_and_rename(dir, fd, &tmp_name, name, content, mode);
    match result {
        Ok(()) => {
            // The rename is done; a failing directory fsync does not undo it.
            if let Err(e) = rustix::fs::fsync(dir.as_fd()) {
                tracing::warn!(error = %e, "fsync of the parent directory failed");
            }
            Ok(existed)
        }
        Err(errno) => {
            let _ = rustix::fs::unlinkat(dir, tmp_name.as_str(), AtFlags::empty());
            Err(match errno {
                Errno::ISDIR | Errno::NOTEMPTY | Errno::EXIST => AtomicError::IsDirectory {
                    path: display.to_owned(),
                },
                errno => io(errno),
            })
        }
    }
}

fn create_temp(dir: &OwnedFd) -> Result<(String, OwnedFd), Errno> {
    let mut attempt = 0;
    loop {
        let name = temp_name();
        match rustix::fs::openat(
            dir,
            name.as_str(),
            OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::from_raw_mode(DEFAULT_MODE),
        ) {
            Ok(fd) => return Ok((name, fd)),
            Err(Errno::EXIST) if attempt < 8 => attempt += 1,
            Err(e) => return Err(e),
        }
    }
}

fn fill_and_rename(
    dir: &OwnedFd,
    fd: OwnedFd,
    tmp_name: &str,
    name: &str,
    content: &[u8],
    mode: u32,
) -> Result<(), Errno> {
    let mut file = std::fs::File::from(fd);
    file.write_all(content)
        .map_err(|e| Errno::from_io_error(&e).unwrap_or(Errno::IO))?;
    rustix::fs::fchmod(&file, Mode::from_raw_mode(mode))?;
    rustix::fs::fsync(&file)?;
    drop(file);
    rustix::fs::renameat(dir, tmp_name, dir, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_dir(path: &std::path::Path) -> OwnedFd {
        rustix::fs::open(path, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap()
    }

    fn leftovers(path: &std::path::Path) -> Vec<String> {
        std::fs::read_dir(path)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(TEMP_PREFIX))
            .collect()
    }

    #[test]
    fn writes_and_preserves_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let fd = open_dir(dir.path());
        assert!(!write_atomic(&fd, "a.txt", b"one", "a.txt").unwrap());
        assert_eq!(std::fs::read(dir.path().join("a.txt")).unwrap(), b"one");
        std::fs::set_permissions(
            dir.path().join("a.txt"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        assert!(write_atomic(&fd, "a.txt", b"two", "a.txt").unwrap());
        let meta = std::fs::metadata(dir.path().join("a.txt")).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read(dir.path().join("a.txt")).unwrap(), b"two");
        assert!(leftovers(dir.path()).is_empty());
    }

    #[test]
    fn failure_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        std::fs::write(dir.path().join("d/inner"), "x").unwrap();
        let fd = open_dir(dir.path());
        let err = write_atomic(&fd, "d", b"content", "d").unwrap_err();
        assert!(matches!(err, AtomicError::IsDirectory { .. }), "{err}");
        assert!(leftovers(dir.path()).is_empty());
        assert!(dir.path().join("d/inner").exists());
    }

    #[test]
    fn temp_names_differ() {
        assert_ne!(temp_name(), temp_name());
    }
}
