//! `edit_file`: exact-text replacements, all or nothing, answered with a unified diff.

use std::time::Duration;

use rustix::fs::{AtFlags, FileType, OFlags};

use crate::atomic::{AtomicError, write_atomic};
use crate::resolve::{ResolveError, Workspace, open_beneath};
use crate::text::{FileError, escape_name, kind_name, looks_binary, read_capped};

/// The most edits one call applies (the schema's `maxItems` of `edits`). Every edit scans
/// the whole text, up to `[fs] max_write_bytes`, and replaces every match: a call of tens
/// of thousands of `replace_all` edits of a 4 MiB file was most of an hour of CPU. An
/// agent's edit is a handful of replacements, a mechanical change across a file a few
/// hundred; past a thousand, several calls or one write_file do the same, and each call
/// also stops at its deadline.
pub const MAX_EDITS: usize = 1000;

#[derive(Debug, thiserror::Error)]
pub enum EditError {
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error(transparent)]
    File(#[from] FileError),
    #[error(transparent)]
    Atomic(#[from] AtomicError),
    #[error(
        "{path:?} is a symbolic link to {target:?}; edit_file does not edit through links, call \
         it with the link's target path instead"
    )]
    Symlink { path: String, target: String },
    #[error("{path:?} is larger than the {max} bytes edit_file handles; use write_file instead")]
    TooLarge { path: String, max: u64 },
    #[error("{path:?} is not UTF-8 text; edit_file edits text files only")]
    NotText { path: String },
    #[error("edits must hold at least one edit")]
    NoEdits,
    #[error(
        "edits holds {count} edits; edit_file applies at most {MAX_EDITS} in one call and \
         nothing was changed. Split them over several edit_file calls, or write the whole \
         file with write_file"
    )]
    TooManyEdits { count: usize },
    #[error(
        "edit_file stopped before edit {index} of {count}: the call was cancelled or reached \
         its deadline; nothing was changed. Send fewer edits in one call (fewer replace_all \
         edits of a large file), or write the whole file with write_file"
    )]
    Stopped { index: usize, count: usize },
    #[error(
        "edit_file stopped before writing {path:?}: the call was cancelled or reached its \
         deadline; nothing was changed. Call it again, with fewer edits or a smaller file"
    )]
    StoppedBeforeWrite { path: String },
    #[error("edit {index}: old_text is empty; give the exact text to replace")]
    EmptyOldText { index: usize },
    #[error(
        "edit {index}: old_text was not found in {path:?} (after the edits before it were \
         applied); nothing was changed. Call read_file to see the current text and copy \
         old_text exactly, including whitespace and indentation"
    )]
    NotFound { index: usize, path: String },
    #[error(
        "edit {index}: old_text matches {count} places in {path:?}; nothing was changed. Include \
         more surrounding lines in old_text so it matches exactly once, or set replace_all to \
         true to replace every match"
    )]
    Ambiguous {
        index: usize,
        path: String,
        count: usize,
    },
    #[error(
        "edit {index}: the edited text would be {size} bytes, more than the {max} bytes \
         edit_file handles; nothing was changed. Replace fewer matches (fewer replace_all \
         edits, a shorter new_text) or write the file with write_file"
    )]
    ResultTooLarge { index: usize, size: u64, max: u64 },
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Edit {
    pub old_text: String,
    pub new_text: String,
    #[serde(default)]
    pub replace_all: bool,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EditArgs {
    pub path: String,
    pub edits: Vec<Edit>,
    #[serde(default)]
    pub dry_run: bool,
}

/// Refuses an empty list of edits and one longer than [`MAX_EDITS`].
fn check_count(edits: &[Edit]) -> Result<(), EditError> {
    match edits.len() {
        0 => Err(EditError::NoEdits),
        count if count > MAX_EDITS => Err(EditError::TooManyEdits { count }),
        _ => Ok(()),
    }
}

/// Applies `edits` in order to `text`, never building a text longer than `max_bytes`.
/// Edit numbers in errors are 1-based.
///
/// The size each edit would give is computed from its match count before anything is
/// allocated: chained `replace_all` edits double the text each time, so checking only the
/// final result would let a dry run of a few edits allocate gigabytes first.
///
/// `stop` (the call's cancellation or deadline) is asked before every edit: one edit of
/// a text within `max_bytes` is bounded, their number times the text is what takes long.
pub fn apply_edits(
    text: &str,
    edits: &[Edit],
    path: &str,
    max_bytes: u64,
    stop: &dyn Fn() -> bool,
) -> Result<(String, usize), EditError> {
    check_count(edits)?;
    let mut current = text.to_owned();
    let mut replacements = 0;
    for (i, edit) in edits.iter().enumerate() {
        let index = i + 1;
        if stop() {
            return Err(EditError::Stopped {
                index,
                count: edits.len(),
            });
        }
        if edit.old_text.is_empty() {
            return Err(EditError::EmptyOldText { index });
        }
        let count = current.matches(edit.old_text.as_str()).count();
        match count {
            0 => {
                return Err(EditError::NotFound {
                    index,
                    path: path.to_owned(),
                });
            }
            1 => {}
            _ if edit.replace_all => {}
            _ => {
                return Err(EditError::Ambiguous {
                    index,
                    path: path.to_owned(),
                    count,
                });
            }
        }
        let size = projected_len(current.len(), count, edit);
        if size > max_bytes {
            return Err(EditError::ResultTooLarge {
                index,
                size,
                max: max_bytes,
            });
        }
        current = replace_exact(&current, &edit.old_text, &edit.new_text, size);
        replacements += count;
    }
    Ok((current, replacements))
}

/// The length of a text of `len` bytes after `count` matches of `edit` are replaced, in
/// u128 so that no count of matches times a long `new_text` can overflow.
fn projected_len(len: usize, count: usize, edit: &Edit) -> u64 {
    let removed = count as u128 * edit.old_text.len() as u128;
    let added = count as u128 * edit.new_text.len() as u128;
    let size = (len as u128).saturating_sub(removed) + added;
    u64::try_from(size).unwrap_or(u64::MAX)
}

/// Replaces every match of `old` in `text` into a string allocated once at `size` bytes
/// (the checked projection), so the replacement never grows past what was checked.
fn replace_exact(text: &str, old: &str, new: &str, size: u64) -> String {
    let mut out = String::with_capacity(usize::try_from(size).unwrap_or(0));
    let mut rest = 0;
    for (at, _) in text.match_indices(old) {
        out.push_str(&text[rest..at]);
        out.push_str(new);
        rest = at + old.len();
    }
    out.push_str(&text[rest..]);
    out
}

pub fn unified_diff(old: &str, new: &str, path: &str) -> String {
    let clean = escape_name(path.trim_start_matches("./"));
    similar::TextDiff::configure()
        .timeout(Duration::from_secs(2))
        .diff_lines(old, new)
        .unified_diff()
        .context_radius(3)
        .header(&format!("a/{clean}"), &format!("b/{clean}"))
        .to_string()
}

/// The diff cut at a line boundary to at most `max` bytes, with a note when it was cut:
/// a diff holds the old and the new text of every changed line, so an edit of a file
/// within `max_bytes` can have a diff several times larger.
fn bounded_diff(mut diff: String, max: u64) -> String {
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    if diff.len() <= max {
        return diff;
    }
    let mut end = max;
    while !diff.is_char_boundary(end) {
        end -= 1;
    }
    let end = diff[..end].rfind('\n').map_or(0, |at| at + 1);
    let total = diff.len();
    diff.truncate(end);
    diff.push_str(&format!(
        "[diff truncated: {total} bytes, of which the first {end} are shown ([fs] max_read_bytes); read the file to see the rest]"
    ));
    diff
}

/// Applies `args.edits` to a file of at most `max_bytes`; the answer's diff is at most
/// `max_answer_bytes`. `stop` ends the call, with nothing written, when it is cancelled
/// or reaches its deadline.
pub fn edit_file(
    ws: &Workspace,
    args: &EditArgs,
    max_bytes: u64,
    max_answer_bytes: u64,
    stop: &dyn Fn() -> bool,
) -> Result<String, EditError> {
    // Before the file is opened: the worker refuses what its schema refuses, whatever
    // validated the arguments on the way.
    check_count(&args.edits)?;
    let display = args.path.as_str();
    let (dir, name) = ws.parent_and_name(display, "edit_file needs a file path")?;

    // The final component itself, without following it.
    let st = rustix::fs::statat(&dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| crate::resolve::map_errno(e, display))?;
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => {}
        FileType::Symlink => {
            let target = rustix::fs::readlinkat(&dir, name.as_str(), Vec::new())
                .map(|t| t.to_string_lossy().into_owned())
                .unwrap_or_default();
            return Err(EditError::Symlink {
                path: display.to_owned(),
                target,
            });
        }
        FileType::Directory => {
            return Err(FileError::IsDirectory {
                path: display.to_owned(),
            }
            .into());
        }
        other => {
            return Err(FileError::NotRegular {
                path: display.to_owned(),
                kind: kind_name(other),
            }
            .into());
        }
    }

    let fd = open_beneath(
        &dir,
        name.as_str(),
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| crate::resolve::map_errno(e, display))?;
    let mut file = std::fs::File::from(fd);
    let bytes = read_capped(&mut file, max_bytes)
        .map_err(|e| FileError::io(display, &e))?
        .ok_or_else(|| EditError::TooLarge {
            path: display.to_owned(),
            max: max_bytes,
        })?;
    if looks_binary(&bytes[..bytes.len().min(crate::text::SNIFF_BYTES)]) {
        return Err(EditError::NotText {
            path: display.to_owned(),
        });
    }
    let old = String::from_utf8(bytes).map_err(|_| EditError::NotText {
        path: display.to_owned(),
    })?;

    let (new, replacements) = apply_edits(&old, &args.edits, display, max_bytes, stop)?;
    let diff = bounded_diff(unified_diff(&old, &new, display), max_answer_bytes);
    let shown = escape_name(display);
    let edits = args.edits.len();
    let plural = |n: usize, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
    let summary = format!(
        "{} ({})",
        plural(edits, "edit"),
        plural(replacements, "replacement")
    );
    if old == new {
        let what = if args.dry_run { "dry run: " } else { "" };
        return Ok(format!(
            "{what}{summary} leave {shown} unchanged; nothing was written"
        ));
    }
    if args.dry_run {
        return Ok(format!(
            "dry run: {summary} would change {shown}; nothing was written\n{diff}"
        ));
    }
    // The diff of two large texts takes time too: a caller that has given up on the call
    // by now is not told of a change it did not see made.
    if stop() {
        return Err(EditError::StoppedBeforeWrite {
            path: display.to_owned(),
        });
    }
    write_atomic(&dir, &name, new.as_bytes(), display)?;
    Ok(format!("applied {summary} to {shown}\n{diff}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edit(old: &str, new: &str, all: bool) -> Edit {
        Edit {
            old_text: old.into(),
            new_text: new.into(),
            replace_all: all,
        }
    }

    const MAX: u64 = 1 << 20;

    #[test]
    fn sequential_and_all_or_nothing() {
        let text = "a b a\nc\n";
        let (out, n) = apply_edits(
            text,
            &[edit("c", "d", false), edit("d", "e", false)],
            "f",
            MAX,
            &|| false,
        )
        .unwrap();
        assert_eq!(out, "a b a\ne\n");
        assert_eq!(n, 2);
        let err = apply_edits(text, &[edit("a", "x", false)], "f", MAX, &|| false).unwrap_err();
        assert!(
            matches!(
                err,
                EditError::Ambiguous {
                    index: 1,
                    count: 2,
                    ..
                }
            ),
            "{err}"
        );
        let (out, n) = apply_edits(text, &[edit("a", "x", true)], "f", MAX, &|| false).unwrap();
        assert_eq!((out.as_str(), n), ("x b x\nc\n", 2));
        let err = apply_edits(
            text,
            &[edit("c", "d", false), edit("zz", "y", false)],
            "f",
            MAX,
            &|| false,
        )
        .unwrap_err();
        assert!(matches!(err, EditError::NotFound { index: 2, .. }), "{err}");
        assert!(matches!(
            apply_edits(text, &[], "f", MAX, &|| false),
            Err(EditError::NoEdits)
        ));
        assert!(matches!(
            apply_edits(text, &[edit("", "x", false)], "f", MAX, &|| false),
            Err(EditError::EmptyOldText { index: 1 })
        ));
    }

    #[test]
    fn growth_is_refused_before_it_is_built() {
        // Each edit doubles the text: the fourth would pass 64 bytes.
        let doubling: Vec<Edit> = (0..20).map(|_| edit("a", "aa", true)).collect();
        let err = apply_edits(&"a".repeat(8), &doubling, "f", 64, &|| false).unwrap_err();
        assert!(
            matches!(
                err,
                EditError::ResultTooLarge {
                    index: 4,
                    size: 128,
                    max: 64
                }
            ),
            "{err}"
        );
        // Exactly at the cap is allowed, and the text is what str::replace gives.
        let (out, n) = apply_edits("xaxa", &[edit("a", "bbb", true)], "f", 8, &|| false).unwrap();
        assert_eq!((out.as_str(), n), ("xbbbxbbb", 2));
        // A huge count times a huge new_text does not overflow the projection.
        let e = edit("a", "b", true);
        assert_eq!(projected_len(usize::MAX, usize::MAX, &e), u64::MAX);
        // Shrinking edits project below the original length.
        assert_eq!(projected_len(10, 2, &edit("abc", "", true)), 4);
    }

    #[test]
    fn edits_are_counted_and_stop_between_them() {
        let many: Vec<Edit> = (0..=MAX_EDITS).map(|_| edit("a", "a", true)).collect();
        assert!(matches!(
            apply_edits("a", &many, "f", MAX, &|| false),
            Err(EditError::TooManyEdits { count }) if count == MAX_EDITS + 1
        ));
        let (out, n) = apply_edits("a", &many[..MAX_EDITS], "f", MAX, &|| false).unwrap();
        assert_eq!((out.as_str(), n), ("a", MAX_EDITS));
        // The third question is answered "stop": two edits were applied, none returned.
        let asked = std::cell::Cell::new(0);
        let stop = || {
            asked.set(asked.get() + 1);
            asked.get() > 2
        };
        let err = apply_edits("a", &many[..5], "f", MAX, &stop).unwrap_err();
        assert!(
            matches!(err, EditError::Stopped { index: 3, count: 5 }),
            "{err}"
        );
    }

    #[test]
    fn diff_has_headers() {
        let d = unified_diff("a\nb\n", "a\nc\n", "dir/f.txt");
        assert!(d.starts_with("--- a/dir/f.txt\n+++ b/dir/f.txt\n"), "{d}");
        assert!(d.contains("-b\n+c\n"), "{d}");
    }
}
