//! `list_directory`: the entries of a directory, optionally recursive.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use rustix::fs::FileType;
use rustix::io::Errno;

use crate::resolve::{ResolveError, Workspace};
use crate::text::escape_os;
use crate::walk::{MAX_DEPTH, Visit, WalkError, open_directory, walk};

pub const DEFAULT_MAX_ENTRIES: usize = 1000;

#[derive(Debug, thiserror::Error)]
pub enum ListError {
    #[error(transparent)]
    Walk(#[from] WalkError),
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error("cannot list {path:?}: {errno}")]
    Io { path: String, errno: Errno },
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListArgs {
    pub path: String,
    #[serde(default)]
    pub recursive: bool,
    #[serde(default)]
    pub max_entries: Option<usize>,
}

/// Formats one entry: `dir/`, `link -> target`, a special file with its kind, or a name.
/// Names and link targets are escaped ([`escape_os`]), so each entry is one line.
pub fn describe(entry: &crate::walk::Entry<'_>) -> String {
    let rel = escape_os(entry.rel);
    match entry.kind {
        FileType::Directory => format!("{rel}/"),
        FileType::Symlink => {
            let target = rustix::fs::readlinkat(entry.dir, entry.name, Vec::new())
                .map(|t| escape_os(OsStr::from_bytes(t.as_bytes())).into_owned())
                .unwrap_or_else(|_| "?".to_owned());
            format!("{rel} -> {target}")
        }
        FileType::RegularFile => rel.into_owned(),
        other => format!("{rel} ({})", crate::text::kind_name(other)),
    }
}

/// Lists `args.path`: at most `max_entries` (clamped to `config_max`) entries, and at
/// most `max_bytes` of text — a bound of its own, because one entry's line (an escaped
/// name of a deep path, a link's target) can take tens of kilobytes.
pub fn list_directory(
    ws: &Workspace,
    args: &ListArgs,
    config_max: usize,
    max_bytes: u64,
    stop: &dyn Fn() -> bool,
) -> Result<String, ListError> {
    let display = args.path.as_str();
    let rel = ws.relative(display)?;
    let dir = open_directory(
        ws,
        &rel,
        display,
        "use get_file_info or read_file for files",
    )?;
    let max = args
        .max_entries
        .unwrap_or(DEFAULT_MAX_ENTRIES)
        .clamp(1, config_max.max(1));

    let mut lines: Vec<String> = Vec::new();
    let mut truncated = false;
    let mut bytes = crate::text::LineBudget::new(max_bytes);
    let mut visit = |entry: &crate::walk::Entry<'_>| {
        if lines.len() >= max {
            truncated = true;
            return Visit::Stop;
        }
        let line = describe(entry);
        if !bytes.take(&line) {
            return Visit::Stop;
        }
        lines.push(line);
        Visit::Continue
    };
    let hidden = ws.hidden_beneath(&rel);
    let end =
        walk(&dir, args.recursive, &mut visit, stop, &hidden).map_err(|errno| ListError::Io {
            path: display.to_owned(),
            errno,
        })?;

    let mut notes = Vec::new();
    if truncated {
        notes.push(format!(
            "[truncated: showing the first {max} entries; list a subdirectory{}]",
            if max < config_max {
                format!(" or pass a larger max_entries (up to {config_max})")
            } else {
                String::new()
            }
        ));
    }
    if let Some(note) = bytes.note("list a subdirectory") {
        notes.push(note);
    }
    if end.depth_limited {
        notes.push(format!(
            "[directories deeper than {MAX_DEPTH} levels were not listed; list them directly]"
        ));
    }
    if end.dir_cut {
        notes.push("[a directory has too many entries; only part of it is listed]".to_owned());
    }
    if end.stopped {
        notes.push("[stopped early: the call was cancelled or reached its deadline]".to_owned());
    }
    if lines.is_empty() && notes.is_empty() {
        return Ok(format!("{display:?} is an empty directory"));
    }
    lines.extend(notes);
    Ok(lines.join("\n"))
}
