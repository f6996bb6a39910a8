//! `create_directory`, `move_path` and `delete_path`: changes to the tree, each done with
//! an `*at` system call on a final plain name inside a parent opened beneath the workspace.

use std::os::fd::OwnedFd;

use rustix::fs::{AtFlags, FileType, RenameFlags};
use rustix::io::Errno;

use crate::resolve::{ResolveError, Workspace, map_errno, open_child_dir};
use crate::text::escape_name;
use crate::walk::{Visit, read_entries};

/// Deepest nesting `delete_path` removes recursively.
const MAX_DELETE_DEPTH: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum MutateError {
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error("source {path:?} does not exist; use list_directory or search_files to find it")]
    SourceMissing { path: String },
    #[error(
        "the parent directory of destination {path:?} does not exist; create it with \
         create_directory first"
    )]
    DestinationParentMissing { path: String },
    #[error(
        "destination {path:?} already exists; move_path never overwrites, so delete it with \
         delete_path first or choose another destination"
    )]
    DestinationExists { path: String },
    #[error(
        "cannot move {source_path:?} into itself or one of its own subdirectories (or this \
         filesystem cannot rename without overwriting); choose another destination"
    )]
    IntoItself { source_path: String },
    #[error("cannot move {source_path:?} to {destination:?}: {errno}")]
    Move {
        source_path: String,
        destination: String,
        errno: Errno,
    },
    #[error(
        "directory {path:?} is not empty; pass recursive=true to delete it with everything in it"
    )]
    NotEmpty { path: String },
    #[error(
        "{path:?} is nested more than {MAX_DELETE_DEPTH} levels deep; delete its deepest parts first"
    )]
    TooDeep { path: String },
    #[error(
        "delete_path stopped after deleting {deleted} entries: the call was cancelled or reached its deadline; call it again to finish"
    )]
    Stopped { deleted: u64 },
    #[error("cannot delete {path:?}: {errno}")]
    Delete { path: String, errno: Errno },
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateDirArgs {
    pub path: String,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoveArgs {
    pub source: String,
    pub destination: String,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteArgs {
    pub path: String,
    #[serde(default)]
    pub recursive: bool,
}

pub fn create_directory(ws: &Workspace, args: &CreateDirArgs) -> Result<String, MutateError> {
    let display = args.path.as_str();
    let rel = ws.relative(display)?;
    // `new/..` too names the root: resolved lexically, as `make_dirs` resolves it.
    if crate::resolve::lexical_components(&rel, display)?.is_empty() {
        return Ok(format!(
            "{display:?} is the workspace root, which already exists"
        ));
    }
    let (_, created) = ws.make_dirs(&rel, display)?;
    Ok(if created {
        format!("created directory {}", escape_name(display))
    } else {
        format!("directory {} already exists", escape_name(display))
    })
}

pub fn move_path(ws: &Workspace, args: &MoveArgs) -> Result<String, MutateError> {
    let (src, dst) = (args.source.as_str(), args.destination.as_str());
    let (sdir, sname) = ws
        .parent_and_name(src, "the workspace root cannot be moved")
        .map_err(|e| match e {
            ResolveError::NotFound { .. } => MutateError::SourceMissing {
                path: src.to_owned(),
            },
            e => e.into(),
        })?;
    let (ddir, dname) = ws
        .parent_and_name(dst, "nothing can be moved onto the workspace root")
        .map_err(|e| match e {
            ResolveError::NotFound { .. } => MutateError::DestinationParentMissing {
                path: dst.to_owned(),
            },
            e => e.into(),
        })?;
    let st =
        rustix::fs::statat(&sdir, sname.as_str(), AtFlags::SYMLINK_NOFOLLOW).map_err(
            |e| match e {
                Errno::NOENT => MutateError::SourceMissing {
                    path: src.to_owned(),
                },
                e => map_errno(e, src).into(),
            },
        )?;
    // Moving a directory would carry a hidden entry to a name that may not be hidden.
    if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
        refuse_hidden_inside(ws, &sdir, &sname, src)?;
    }
    rustix::fs::renameat_with(
        &sdir,
        sname.as_str(),
        &ddir,
        dname.as_str(),
        RenameFlags::NOREPLACE,
    )
    .map_err(|errno| match errno {
        Errno::EXIST | Errno::NOTEMPTY => MutateError::DestinationExists {
            path: dst.to_owned(),
        },
        Errno::INVAL => MutateError::IntoItself {
            source_path: src.to_owned(),
        },
        Errno::NOENT => MutateError::SourceMissing {
            path: src.to_owned(),
        },
        errno => MutateError::Move {
            source_path: src.to_owned(),
            destination: dst.to_owned(),
            errno,
        },
    })?;
    let _ = rustix::fs::fsync(&ddir);
    let kind = crate::text::kind_name(FileType::from_raw_mode(st.st_mode));
    Ok(format!(
        "moved {kind} {} to {}",
        escape_name(src),
        escape_name(dst)
    ))
}

pub fn delete_path(
    ws: &Workspace,
    args: &DeleteArgs,
    stop: &dyn Fn() -> bool,
) -> Result<String, MutateError> {
    let display = args.path.as_str();
    let (dir, name) = ws.parent_and_name(
        display,
        "the workspace root cannot be deleted; delete the entries inside it instead",
    )?;
    let name = name.as_str();
    let st = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| map_errno(e, display))?;
    let del = |errno| MutateError::Delete {
        path: display.to_owned(),
        errno,
    };
    match FileType::from_raw_mode(st.st_mode) {
        FileType::Directory if !args.recursive => {
            rustix::fs::unlinkat(&dir, name, AtFlags::REMOVEDIR).map_err(|e| match e {
                Errno::NOTEMPTY | Errno::EXIST => MutateError::NotEmpty {
                    path: display.to_owned(),
                },
                e => del(e),
            })?;
            Ok(format!("deleted empty directory {}", escape_name(display)))
        }
        FileType::Directory => {
            refuse_hidden_inside(ws, &dir, name, display)?;
            let child = open_child_dir(&dir, name).map_err(del)?;
            let mut deleted = 0;
            remove_contents(&child, display, 0, &mut deleted, stop)?;
            drop(child);
            rustix::fs::unlinkat(&dir, name, AtFlags::REMOVEDIR).map_err(del)?;
            Ok(format!(
                "deleted directory {} and the {deleted} entries inside it",
                escape_name(display)
            ))
        }
        FileType::Symlink => {
            rustix::fs::unlinkat(&dir, name, AtFlags::empty()).map_err(del)?;
            Ok(format!(
                "deleted symbolic link {} (its target was not touched)",
                escape_name(display)
            ))
        }
        kind => {
            rustix::fs::unlinkat(&dir, name, AtFlags::empty()).map_err(del)?;
            Ok(format!(
                "deleted {} {}",
                crate::text::kind_name(kind),
                escape_name(display)
            ))
        }
    }
}

/// Refuses to move or delete the directory `name` in `parent` (`display` as the model
/// named it) when it holds a `[fs] hidden` entry: the fs tools do not change those.
fn refuse_hidden_inside(
    ws: &Workspace,
    parent: &OwnedFd,
    name: &str,
    display: &str,
) -> Result<(), MutateError> {
    if !ws.hides_anything() {
        return Ok(());
    }
    let rel = ws.relative(display)?;
    let hidden = ws.hidden_beneath(&rel);
    let mut found = None;
    let mut visit = |entry: &crate::walk::Entry<'_>| {
        let rel = entry.rel.to_string_lossy();
        if hidden(&rel) {
            found = Some(rel.into_owned());
            return Visit::Stop;
        }
        Visit::Continue
    };
    let child = open_child_dir(parent, name).map_err(|e| map_errno(e, display))?;
    let end =
        crate::walk::walk(&child, true, &mut visit, &|| false, &|_| false).map_err(|errno| {
            MutateError::Delete {
                path: display.to_owned(),
                errno,
            }
        })?;
    // Parts the walk did not see might hold hidden entries: refuse (fail closed).
    if found.is_none() && (end.depth_limited || end.dir_cut) {
        found = Some("(too deep or too large to check)".to_owned());
    }
    match found {
        Some(entry) => Err(ResolveError::Hidden {
            path: display.to_owned(),
            hidden: format!("{}/{entry}", display.trim_end_matches('/')),
        }
        .into()),
        None => Ok(()),
    }
}

/// Removes everything inside `dir`, depth-first, never following a symlink.
fn remove_contents(
    dir: &OwnedFd,
    path: &str,
    depth: usize,
    deleted: &mut u64,
    stop: &dyn Fn() -> bool,
) -> Result<(), MutateError> {
    if depth >= MAX_DELETE_DEPTH {
        return Err(MutateError::TooDeep {
            path: path.to_owned(),
        });
    }
    loop {
        let (entries, cut) = read_entries(dir).map_err(|errno| MutateError::Delete {
            path: path.to_owned(),
            errno,
        })?;
        for (name, kind) in entries {
            if stop() {
                return Err(MutateError::Stopped { deleted: *deleted });
            }
            // Entries are unlinked by the bytes of their names; only the path in an error
            // is text (quoted with its other bytes as U+FFFD).
            let name = name.as_os_str();
            let child_path = format!("{path}/{}", name.to_string_lossy());
            let del = |errno| MutateError::Delete {
                path: child_path.clone(),
                errno,
            };
            if kind == FileType::Directory {
                match open_child_dir(dir, name) {
                    Ok(child) => {
                        remove_contents(&child, &child_path, depth + 1, deleted, stop)?;
                        rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR).map_err(del)?;
                    }
                    // Swapped for a link or a file since it was listed: remove the entry itself.
                    Err(Errno::LOOP | Errno::NOTDIR) => {
                        rustix::fs::unlinkat(dir, name, AtFlags::empty()).map_err(del)?;
                    }
                    Err(Errno::NOENT) => continue,
                    Err(e) => return Err(del(e)),
                }
            } else {
                match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
                    Ok(()) => {}
                    // Removed by someone else since it was listed: not counted.
                    Err(Errno::NOENT) => continue,
                    Err(e) => return Err(del(e)),
                }
            }
            *deleted += 1;
        }
        if !cut {
            return Ok(());
        }
    }
}
