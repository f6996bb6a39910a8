//! Opening regular files for reading, telling text from binary, and printing file names.

use std::borrow::Cow;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{BufRead, Read};
use std::os::unix::ffi::OsStrExt;

use rustix::fs::{FileType, OFlags};
use rustix::io::Errno;

use crate::resolve::{ResolveError, Workspace};

/// How much of a file's start is inspected for NUL bytes.
pub const SNIFF_BYTES: usize = 8192;

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error("{path:?} is a directory; use list_directory to see what it contains")]
    IsDirectory { path: String },
    #[error("{path:?} is a {kind}, not a regular file; only regular files can be read")]
    NotRegular { path: String, kind: &'static str },
    #[error("{path:?} is a binary file ({size} bytes); read_file returns text only")]
    Binary { path: String, size: u64 },
    #[error("cannot read {path:?}: {errno}")]
    Io { path: String, errno: Errno },
}

impl FileError {
    pub fn io(path: &str, err: &std::io::Error) -> Self {
        Self::Io {
            path: path.to_owned(),
            errno: Errno::from_io_error(err).unwrap_or(Errno::IO),
        }
    }
}

/// The bytes an answer made of lines may still take: `list_directory` and
/// `search_files` stop at it, as `read_file` stops at `[fs] max_read_bytes`, so that what
/// a workspace holds (ten thousand links with 4 KiB targets, names escaped to six times
/// their length) never decides how large an answer grows.
pub struct LineBudget {
    max: u64,
    used: u64,
    exhausted: bool,
}

impl LineBudget {
    pub fn new(max: u64) -> Self {
        Self {
            max,
            used: 0,
            exhausted: false,
        }
    }

    /// Counts `line` and its line break; false (and nothing counted) when it would go
    /// over.
    pub fn take(&mut self, line: &str) -> bool {
        let len = u64::try_from(line.len())
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        if self.used.saturating_add(len) > self.max {
            self.exhausted = true;
            return false;
        }
        self.used += len;
        true
    }

    /// The note that ends a cut answer, with `advice`; `None` when nothing was cut.
    pub fn note(&self, advice: &str) -> Option<String> {
        self.exhausted.then(|| {
            format!(
                "[truncated: the answer reached {} bytes, the most one answer holds ([fs] max_read_bytes); {advice}]",
                self.max
            )
        })
    }
}

/// A file name or path as the fs tools print it: control characters (C0, DEL, C1), the
/// bidirectional controls (U+061C, U+200E, U+200F, U+202A–U+202E, U+2066–U+2069) and the
/// line and paragraph separators U+2028, U+2029 are written as Rust writes them in a
/// string literal (`\n`, `\r`, `\t`, `\u{1b}`, `\u{202e}`), and a backslash as `\\`, so
/// that a name can neither forge a line of a listing nor send escape sequences to the
/// terminal that shows the result, and every printed name reads back to exactly one name.
/// Error messages quote paths with `{:?}`, which escapes the same way.
pub fn escape_name(name: &str) -> std::borrow::Cow<'_, str> {
    if !name.chars().any(|c| c == '\\' || needs_escape(c)) {
        return std::borrow::Cow::Borrowed(name);
    }
    let mut out = String::with_capacity(name.len() + 8);
    for c in name.chars() {
        if c == '\\' {
            out.push_str("\\\\");
        } else if needs_escape(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// As [`escape_name`], for a name as the bytes on disk, which need not be UTF-8: each
/// byte that is not part of a UTF-8 character is written `\xFF`, as Rust's `Debug` of
/// an `OsStr` writes it. A name's own backslash is doubled, so a name that holds the four
/// characters `\xFF` prints differently, and every printed name still reads back to
/// exactly one name.
pub fn escape_os(name: &OsStr) -> Cow<'_, str> {
    let bytes = name.as_bytes();
    if let Ok(text) = std::str::from_utf8(bytes) {
        return escape_name(text);
    }
    let mut out = String::with_capacity(bytes.len() * 2);
    for chunk in bytes.utf8_chunks() {
        out.push_str(&escape_name(chunk.valid()));
        for byte in chunk.invalid() {
            out.push_str(&format!("\\x{byte:02X}"));
        }
    }
    Cow::Owned(out)
}

fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

pub fn kind_name(ft: FileType) -> &'static str {
    match ft {
        FileType::RegularFile => "file",
        FileType::Directory => "directory",
        FileType::Symlink => "symlink",
        FileType::Fifo => "named pipe",
        FileType::Socket => "socket",
        FileType::CharacterDevice => "character device",
        FileType::BlockDevice => "block device",
        FileType::Unknown => "special file",
    }
}

/// Opens `rel` beneath the workspace as a regular file (non-blocking, so a FIFO never
/// hangs the call) and returns it with its size.
pub fn open_regular(ws: &Workspace, rel: &str, display: &str) -> Result<(File, u64), FileError> {
    let fd = ws.open(
        rel,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY,
        display,
    )?;
    let st = rustix::fs::fstat(&fd).map_err(|errno| FileError::Io {
        path: display.to_owned(),
        errno,
    })?;
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => {}
        FileType::Directory => {
            return Err(FileError::IsDirectory {
                path: display.to_owned(),
            });
        }
        other => {
            return Err(FileError::NotRegular {
                path: display.to_owned(),
                kind: kind_name(other),
            });
        }
    }
    Ok((File::from(fd), u64::try_from(st.st_size).unwrap_or(0)))
}

/// Whether `head` (the start of a file) looks binary: a NUL byte, or bytes that are not
/// UTF-8 (a multi-byte character cut at the end of `head` does not count).
pub fn looks_binary(head: &[u8]) -> bool {
    if head.contains(&0) {
        return true;
    }
    match std::str::from_utf8(head) {
        Ok(_) => false,
        Err(e) => e.error_len().is_some(),
    }
}

/// Reads a whole regular file of at most `cap` bytes; `None` when it is larger.
pub fn read_capped(file: &mut File, cap: u64) -> std::io::Result<Option<Vec<u8>>> {
    let mut buf = Vec::new();
    file.take(cap.saturating_add(1)).read_to_end(&mut buf)?;
    if buf.len() as u64 > cap {
        Ok(None)
    } else {
        Ok(Some(buf))
    }
}

/// Reads the next line (with its `\n`) into `buf`, keeping at most `cap` bytes of it and
/// skipping the rest. Returns `None` at end of file, else whether the line was cut.
pub fn next_line(
    r: &mut impl BufRead,
    buf: &mut Vec<u8>,
    cap: usize,
) -> std::io::Result<Option<bool>> {
    buf.clear();
    append_line(r, buf, cap)
}

/// As [`next_line`], but appends the line to what `buf` already holds: a caller that
/// gathers lines into one buffer copies each once. Lines are found with `memchr`, which
/// compares a vector of bytes at a time: scanning a 1 MiB file byte by byte was 40 % of
/// the fs worker's CPU for `read_file` (measured: README, "Tool calls over HTTP").
pub fn append_line(
    r: &mut impl BufRead,
    buf: &mut Vec<u8>,
    cap: usize,
) -> std::io::Result<Option<bool>> {
    let mut taken = 0usize;
    let mut any = false;
    let mut cut = false;
    loop {
        let avail = r.fill_buf()?;
        if avail.is_empty() {
            return Ok(if any { Some(cut) } else { None });
        }
        any = true;
        let (chunk_len, done) = match memchr::memchr(b'\n', avail) {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        let room = cap.saturating_sub(taken);
        let kept = chunk_len.min(room);
        buf.extend_from_slice(&avail[..kept]);
        taken += kept;
        cut |= chunk_len > room;
        r.consume(chunk_len);
        if done {
            return Ok(Some(cut));
        }
    }
}

/// Cuts `bytes` at the last complete UTF-8 character (after a byte cap split one).
pub fn trim_partial_char(bytes: &mut Vec<u8>) {
    if let Err(e) = std::str::from_utf8(bytes)
        && e.error_len().is_none()
    {
        bytes.truncate(e.valid_up_to());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_detection() {
        assert!(!looks_binary(b"hello\nworld"));
        assert!(looks_binary(b"hel\0lo"));
        assert!(looks_binary(&[0xff, 0xfe, b'a']));
        // "é" cut in half at the end of the sniffed window is still text.
        assert!(!looks_binary(&[b'a', 0xc3]));
    }

    #[test]
    fn lines_are_capped() {
        let mut r = std::io::BufReader::with_capacity(4, &b"abcdefgh\nxy\nz"[..]);
        let mut buf = Vec::new();
        assert_eq!(next_line(&mut r, &mut buf, 3).unwrap(), Some(true));
        assert_eq!(buf, b"abc");
        assert_eq!(next_line(&mut r, &mut buf, 100).unwrap(), Some(false));
        assert_eq!(buf, b"xy\n");
        assert_eq!(next_line(&mut r, &mut buf, 0).unwrap(), Some(true));
        assert!(buf.is_empty());
        assert_eq!(next_line(&mut r, &mut buf, 10).unwrap(), None);
    }

    #[test]
    fn lines_are_appended_with_their_own_cap() {
        // A reader's buffer of 4 bytes: lines span several fills.
        let mut r = std::io::BufReader::with_capacity(4, &b"abcdefgh\nxy\nlonger line\nz"[..]);
        let mut out = b"kept:".to_vec();
        assert_eq!(append_line(&mut r, &mut out, 100).unwrap(), Some(false));
        assert_eq!(out, b"kept:abcdefgh\n");
        // The cap is the line's own, whatever `out` already holds.
        assert_eq!(append_line(&mut r, &mut out, 3).unwrap(), Some(false));
        assert_eq!(out, b"kept:abcdefgh\nxy\n");
        assert_eq!(append_line(&mut r, &mut out, 5).unwrap(), Some(true));
        assert_eq!(
            out, b"kept:abcdefgh\nxy\nlonge",
            "the rest of the line is skipped"
        );
        assert_eq!(append_line(&mut r, &mut out, 0).unwrap(), Some(true));
        assert_eq!(out, b"kept:abcdefgh\nxy\nlonge", "no room adds nothing");
        assert_eq!(append_line(&mut r, &mut out, 10).unwrap(), None);
    }

    #[test]
    fn names_are_escaped_unambiguously() {
        assert_eq!(escape_name("plain/é.txt"), "plain/é.txt");
        assert!(matches!(escape_name("x"), std::borrow::Cow::Borrowed(_)));
        assert_eq!(escape_name("a\nb\rc\td"), "a\\nb\\rc\\td");
        assert_eq!(escape_name("\u{1b}[2J"), "\\u{1b}[2J");
        assert_eq!(escape_name("\u{7f}\u{85}"), "\\u{7f}\\u{85}");
        assert_eq!(escape_name("ab\u{202e}txt.exe"), "ab\\u{202e}txt.exe");
        assert_eq!(escape_name("\u{2066}\u{2028}"), "\\u{2066}\\u{2028}");
        // A real backslash followed by "n" stays distinct from an escaped newline.
        assert_eq!(escape_name("a\\nb"), "a\\\\nb");
        assert_ne!(escape_name("a\\nb"), escape_name("a\nb"));
        // What is printed is what Rust's Debug prints, without the quotes.
        for name in ["a\nb", "\u{1b}x", "q\u{202e}", "\\", "t\tu"] {
            assert_eq!(format!("\"{}\"", escape_name(name)), format!("{name:?}"));
        }
    }

    #[test]
    fn raw_names_are_escaped_unambiguously() {
        let raw = |b: &[u8]| OsStr::from_bytes(b).to_owned();
        assert_eq!(escape_os(&raw(b"plain.txt")), "plain.txt");
        assert!(matches!(escape_os(&raw(b"x")), Cow::Borrowed(_)));
        assert_eq!(escape_os(&raw(b"\xff")), "\\xFF");
        assert_eq!(escape_os(&raw(b"a\xfe\nb\xc3")), "a\\xFE\\nb\\xC3");
        // A name spelling a backslash, x, F, F is a different name, printed differently.
        assert_eq!(escape_os(&raw(b"\\xFF")), "\\\\xFF");
        // What is printed is what Rust's Debug prints, without the quotes.
        for name in [
            &b"a\xffb"[..],
            b"\xe2\x82",
            b"\n\xff\\",
            "é\u{202e}".as_bytes(),
        ] {
            let name = raw(name);
            assert_eq!(format!("\"{}\"", escape_os(&name)), format!("{name:?}"));
        }
    }

    #[test]
    fn partial_chars_are_trimmed() {
        let mut v = "aé".as_bytes()[..2].to_vec();
        trim_partial_char(&mut v);
        assert_eq!(v, b"a");
    }
}
