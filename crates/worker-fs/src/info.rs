//! `get_file_info`: type, size, permissions, modification time, link target.

use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Stat};
use rustix::io::Errno;

use crate::resolve::{
    Last, ResolveError, Workspace, lexical_components, map_errno, open_beneath, split_last,
};
use crate::text::{escape_name, escape_os, kind_name, looks_binary};

/// Regular text files up to this size get a line count.
const LINE_COUNT_LIMIT: u64 = 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum InfoError {
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error("cannot inspect {path:?}: {errno}")]
    Io { path: String, errno: Errno },
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InfoArgs {
    pub path: String,
}

/// Formats seconds since the Unix epoch as RFC 3339 UTC (`1970-01-01T00:00:00Z`).
pub fn rfc3339(secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (h, m, s) = (rem / 3600, (rem % 3600) / 60, rem % 60);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}Z")
}

fn stat_lines(path: &str, st: &Stat) -> Vec<String> {
    let kind = FileType::from_raw_mode(st.st_mode);
    let mut lines = vec![
        format!("path: {}", escape_name(path)),
        format!("type: {}", kind_name(kind)),
    ];
    if kind != FileType::Directory {
        lines.push(format!("size: {} bytes", st.st_size));
    }
    lines.push(format!("permissions: {:04o}", st.st_mode & 0o7777));
    #[allow(clippy::useless_conversion)]
    let mtime = i64::from(st.st_mtime);
    lines.push(format!("modified: {}", rfc3339(mtime)));
    lines
}

fn count_lines(dir: impl std::os::fd::AsFd, name: &str) -> Option<u64> {
    let fd = open_beneath(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY,
        Mode::empty(),
    )
    .ok()?;
    let mut bytes = Vec::new();
    std::fs::File::from(fd)
        .take(LINE_COUNT_LIMIT + 1)
        .read_to_end(&mut bytes)
        .ok()?;
    if bytes.len() as u64 > LINE_COUNT_LIMIT || looks_binary(&bytes) {
        return None;
    }
    let newlines = bytes.iter().filter(|&&b| b == b'\n').count() as u64;
    Some(newlines + u64::from(bytes.last().is_some_and(|&b| b != b'\n')))
}

pub fn get_file_info(ws: &Workspace, args: &InfoArgs) -> Result<String, InfoError> {
    let display = args.path.as_str();
    let rel = ws.relative(display)?;
    let io = |errno| InfoError::Io {
        path: display.to_owned(),
        errno,
    };
    let (dir, name) = match split_last(&rel) {
        Last::Root | Last::Dots => {
            // `.` and `..` are never symlinks: stat what they resolve to.
            let fd = ws.open(&rel, OFlags::PATH | OFlags::DIRECTORY, display)?;
            let st = rustix::fs::fstat(&fd).map_err(io)?;
            let mut lines = stat_lines(display, &st);
            if matches!(split_last(&rel), Last::Root) {
                lines.push("note: this is the workspace root".to_owned());
            }
            return Ok(lines.join("\n"));
        }
        Last::Name { parent, name } => (ws.open_dir(parent, display)?, name),
    };
    let st = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| map_errno(e, display))?;
    let mut lines = stat_lines(display, &st);
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => {
            if u64::try_from(st.st_size).is_ok_and(|s| s <= LINE_COUNT_LIMIT)
                && let Some(n) = count_lines(&dir, name)
            {
                lines.push(format!("lines: {n}"));
            }
            if st.st_nlink > 1 {
                lines.push(format!("hard links: {}", st.st_nlink));
            }
        }
        FileType::Symlink => {
            let target = rustix::fs::readlinkat(&dir, name, Vec::new())
                .map(|t| escape_os(OsStr::from_bytes(t.as_bytes())).into_owned())
                .map_err(io)?;
            lines.push(format!("target: {target}"));
            // Described by following the link (inside the workspace only); every tool
            // that reads or changes refuses to go through it. Followed from the workspace
            // root, not from `dir`: beneath `dir`, a target in a sibling directory
            // (`../f.txt`) would be refused as if it were outside. Its parent was just
            // opened without following a link, so the lexical path is that link.
            let link = lexical_components(&rel, display)?.join("/");
            let points = match ws.open_following(&link) {
                Ok(fd) => match rustix::fs::fstat(&fd) {
                    Ok(t) => format!(
                        "a {} inside the workspace",
                        kind_name(FileType::from_raw_mode(t.st_mode))
                    ),
                    Err(_) => "something inside the workspace".to_owned(),
                },
                Err(Errno::XDEV) => "outside the workspace; it cannot be followed".to_owned(),
                Err(Errno::NOENT) => "nothing (the link is dangling)".to_owned(),
                Err(Errno::LOOP) => "a loop of links".to_owned(),
                Err(e) => format!("something that cannot be resolved ({e})"),
            };
            lines.push(format!("points to: {points}"));
        }
        _ => {}
    }
    Ok(lines.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339(-1), "1969-12-31T23:59:59Z");
        assert_eq!(rfc3339(4_102_444_799), "2099-12-31T23:59:59Z");
    }
}
