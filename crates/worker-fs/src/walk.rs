//! Directory walking on dirfds: sorted, bounded, never following symlinks.

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::resolve::{ResolveError, Workspace, open_beneath, open_child_dir};
use crate::text::kind_name;

/// Deepest directory level a recursive walk descends to.
pub const MAX_DEPTH: usize = 64;

/// Entries read from one directory at most; the rest are reported as cut.
const MAX_DIR_ENTRIES: usize = 100_000;

#[derive(Debug, thiserror::Error)]
pub enum WalkError {
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error("{path:?} is a {kind}, not a directory; {hint}")]
    NotADirectory {
        path: String,
        kind: &'static str,
        hint: &'static str,
    },
    #[error("cannot read directory {path:?}: {errno}")]
    Io { path: String, errno: Errno },
}

/// One directory entry as the walk reports it. Names are the bytes on disk, which need
/// not be UTF-8 (a file made by the shell, or cloned): they are used as they are to open
/// the entry, and escaped only where they are printed ([`crate::text::escape_os`]).
#[derive(Debug)]
pub struct Entry<'a> {
    /// Path relative to the directory the walk started in.
    pub rel: &'a OsStr,
    pub name: &'a OsStr,
    pub kind: FileType,
    /// The directory holding the entry.
    pub dir: BorrowedFd<'a>,
}

#[derive(Debug, Default)]
pub struct WalkEnd {
    /// Directories deeper than [`MAX_DEPTH`] were not entered.
    pub depth_limited: bool,
    /// A directory had more entries than one walk reads from it.
    pub dir_cut: bool,
    /// The stop callback ended the walk (deadline or cancellation).
    pub stopped: bool,
    /// The visitor ended the walk.
    pub visitor_stopped: bool,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Visit {
    Continue,
    Stop,
}

/// Opens `rel` as a directory; a file there gives an error with `hint`.
pub fn open_directory(
    ws: &Workspace,
    rel: &str,
    display: &str,
    hint: &'static str,
) -> Result<OwnedFd, WalkError> {
    let fd = ws.open(rel, OFlags::PATH, display)?;
    let st = rustix::fs::fstat(&fd).map_err(|errno| WalkError::Io {
        path: display.to_owned(),
        errno,
    })?;
    let kind = FileType::from_raw_mode(st.st_mode);
    if kind != FileType::Directory {
        return Err(WalkError::NotADirectory {
            path: display.to_owned(),
            kind: kind_name(kind),
            hint,
        });
    }
    open_beneath(&fd, ".", OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())
        .map_err(|e| crate::resolve::map_errno(e, display).into())
}

/// The entries of `dir`, sorted by name (byte order), without `.` and `..`. Names are
/// kept as the bytes on disk: a name made UTF-8 by replacing its other bytes names
/// nothing, so what is opened or deleted by it would be missed. The bool is true when
/// the directory had more than [`MAX_DIR_ENTRIES`].
pub fn read_entries(dir: impl AsFd) -> Result<(Vec<(OsString, FileType)>, bool), Errno> {
    let dir = dir.as_fd();
    let mut stream = Dir::read_from(dir)?;
    let mut entries = Vec::new();
    let mut cut = false;
    while let Some(entry) = stream.read() {
        let entry = entry?;
        let name = entry.file_name();
        if matches!(name.to_bytes(), b"." | b"..") {
            continue;
        }
        if entries.len() >= MAX_DIR_ENTRIES {
            cut = true;
            break;
        }
        let mut kind = entry.file_type();
        if kind == FileType::Unknown
            && let Ok(st) = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
        {
            kind = FileType::from_raw_mode(st.st_mode);
        }
        entries.push((OsStr::from_bytes(name.to_bytes()).to_owned(), kind));
    }
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((entries, cut))
}

/// Walks `dir` depth-first in name order, calling `visit` for every entry. Symlinks are
/// reported, never followed; subdirectories are opened by name with `O_NOFOLLOW` and
/// `RESOLVE_NO_SYMLINKS`, so a directory swapped for a link is skipped, not entered.
/// Entries for which `hidden` holds (by their path relative to `dir`) are neither
/// visited nor entered: `[fs] hidden` subtrees stay out of listings and searches. The
/// patterns are UTF-8, and a path is matched with its other bytes read as U+FFFD,
/// which a wildcard matches as it matches any character.
pub fn walk(
    dir: &OwnedFd,
    recursive: bool,
    visit: &mut dyn FnMut(&Entry<'_>) -> Visit,
    stop: &dyn Fn() -> bool,
    hidden: &dyn Fn(&str) -> bool,
) -> Result<WalkEnd, Errno> {
    let mut end = WalkEnd::default();
    let mut walker = Walker {
        recursive,
        visit,
        stop,
        hidden,
        end: &mut end,
    };
    walker.walk_dir(dir, OsStr::new(""), 0)?;
    Ok(end)
}

struct Walker<'a, 'b> {
    recursive: bool,
    visit: &'a mut dyn FnMut(&Entry<'_>) -> Visit,
    stop: &'a dyn Fn() -> bool,
    hidden: &'a dyn Fn(&str) -> bool,
    end: &'b mut WalkEnd,
}

impl Walker<'_, '_> {
    fn walk_dir(&mut self, dir: &OwnedFd, prefix: &OsStr, depth: usize) -> Result<bool, Errno> {
        let (recursive, stop, hidden) = (self.recursive, self.stop, self.hidden);
        let (entries, cut) = match read_entries(dir) {
            Ok(read) => read,
            // Only the starting directory's errors are the caller's; deeper ones are skipped.
            Err(e) if depth == 0 => return Err(e),
            Err(_) => return Ok(true),
        };
        self.end.dir_cut |= cut;
        for (name, kind) in entries {
            if stop() {
                self.end.stopped = true;
                return Ok(false);
            }
            let rel = if prefix.is_empty() {
                name.clone()
            } else {
                let mut rel = prefix.to_owned();
                rel.push("/");
                rel.push(&name);
                rel
            };
            if hidden(&rel.to_string_lossy()) {
                continue;
            }
            let entry = Entry {
                rel: &rel,
                name: &name,
                kind,
                dir: dir.as_fd(),
            };
            if (self.visit)(&entry) == Visit::Stop {
                self.end.visitor_stopped = true;
                return Ok(false);
            }
            if recursive && kind == FileType::Directory {
                if depth + 1 >= MAX_DEPTH {
                    self.end.depth_limited = true;
                    continue;
                }
                let Ok(child) = open_child_dir(dir, name.as_os_str()) else {
                    continue;
                };
                if !self.walk_dir(&child, &rel, depth + 1)? {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }
}
