//! `read_file`: a text file, or a window of its lines, capped in bytes.

use std::io::{BufReader, Read, Seek};

use crate::resolve::Workspace;
use crate::text::{
    FileError, SNIFF_BYTES, append_line, looks_binary, next_line, open_regular, trim_partial_char,
};

/// Files up to this size get an exact line total in paging notes.
const COUNT_LIMIT: u64 = 64 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error(
        "offset {offset} is past the end of {path:?}, which has {total} lines; call read_file \
         with an offset between 1 and {total}"
    )]
    PastEnd {
        path: String,
        offset: u64,
        total: u64,
    },
    #[error("read_file stopped: the call was cancelled or reached its deadline")]
    Stopped,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadArgs {
    pub path: String,
    /// 1-based line to start at.
    #[serde(default)]
    pub offset: Option<u64>,
    /// Lines to return at most.
    #[serde(default)]
    pub limit: Option<u64>,
}

enum Stop {
    Eof,
    Limit,
    Bytes,
    LongLine,
}

/// Runs `read_file`. `max_bytes` caps the text returned; `stop` is polled while scanning.
pub fn read_file(
    ws: &Workspace,
    args: &ReadArgs,
    max_bytes: u64,
    stop: &dyn Fn() -> bool,
) -> Result<String, ReadError> {
    let display = args.path.as_str();
    let rel = ws.relative(display).map_err(FileError::from)?;
    let (mut file, size) = open_regular(ws, &rel, display)?;
    let io = |e: std::io::Error| ReadError::File(FileError::io(display, &e));

    let mut head = Vec::with_capacity(SNIFF_BYTES);
    (&mut file)
        .take(SNIFF_BYTES as u64)
        .read_to_end(&mut head)
        .map_err(io)?;
    if looks_binary(&head) {
        return Err(FileError::Binary {
            path: display.to_owned(),
            size,
        }
        .into());
    }
    file.rewind().map_err(io)?;

    let offset = args.offset.unwrap_or(1).max(1);
    let limit = args.limit.unwrap_or(u64::MAX).max(1);
    let max_bytes = usize::try_from(max_bytes).unwrap_or(usize::MAX).max(1);

    let mut reader = BufReader::with_capacity(64 * 1024, file);
    let mut out: Vec<u8> = Vec::new();
    let mut n: u64 = 0; // lines consumed so far
    let mut shown: u64 = 0;
    let mut stop_reason = Stop::Eof;

    loop {
        if n.is_multiple_of(4096) && stop() {
            return Err(ReadError::Stopped);
        }
        let collecting = n + 1 >= offset;
        let cap = if collecting { max_bytes - out.len() } else { 0 };
        // The line goes straight onto the output (a line before the window, with no
        // room, adds nothing); one that does not fit is taken off again below.
        let start = out.len();
        let Some(cut) = append_line(&mut reader, &mut out, cap).map_err(io)? else {
            break;
        };
        n += 1;
        if !collecting {
            continue;
        }
        if cut {
            if start == 0 {
                trim_partial_char(&mut out);
                shown = 1;
                stop_reason = Stop::LongLine;
            } else {
                // The line does not fit; it is left for the next call.
                out.truncate(start);
                stop_reason = Stop::Bytes;
            }
            break;
        }
        shown += 1;
        if shown >= limit {
            stop_reason = Stop::Limit;
            break;
        }
    }

    let total = match stop_reason {
        Stop::Eof => Total::Exact(n),
        _ => count_rest(&mut reader, n, size, stop).map_err(io)?,
    };
    if shown == 0 {
        if n == 0 && offset == 1 {
            return Ok("[file is empty]".to_owned());
        }
        return Err(ReadError::PastEnd {
            path: display.to_owned(),
            offset,
            total: n,
        });
    }
    let first = offset;
    let last = first + shown - 1;
    finish(
        out,
        display,
        size,
        Window {
            first,
            last,
            total,
            stop: stop_reason,
        },
        max_bytes,
    )
}

#[derive(Debug, Clone, Copy)]
enum Total {
    Exact(u64),
    AtLeast(u64),
}

impl Total {
    fn more_after(self, last: u64) -> bool {
        match self {
            Total::Exact(t) => t > last,
            Total::AtLeast(_) => true,
        }
    }
}

impl std::fmt::Display for Total {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Total::Exact(t) => write!(f, "{t}"),
            Total::AtLeast(t) => write!(f, "at least {t}"),
        }
    }
}

/// Counts the lines left in `reader` (after `seen` lines), unless the file is too large
/// to be worth it.
fn count_rest(
    reader: &mut impl std::io::BufRead,
    seen: u64,
    size: u64,
    stop: &dyn Fn() -> bool,
) -> std::io::Result<Total> {
    if size > COUNT_LIMIT {
        return Ok(Total::AtLeast(seen + 1));
    }
    let mut n = seen;
    let mut line = Vec::new();
    while next_line(reader, &mut line, 0)?.is_some() {
        n += 1;
        if n.is_multiple_of(65536) && stop() {
            return Ok(Total::AtLeast(n));
        }
    }
    Ok(Total::Exact(n))
}

struct Window {
    first: u64,
    last: u64,
    total: Total,
    stop: Stop,
}

fn finish(
    out: Vec<u8>,
    display: &str,
    size: u64,
    window: Window,
    max_bytes: usize,
) -> Result<String, ReadError> {
    let Window {
        first,
        last,
        total,
        stop,
    } = window;
    let text = String::from_utf8(out).map_err(|_| FileError::Binary {
        path: display.to_owned(),
        size,
    })?;
    let more = total.more_after(last);
    let note = match stop {
        Stop::LongLine => Some(format!(
            "[line {first} of {total} is longer than {max_bytes} bytes; showing its first \
             {max_bytes} bytes{}]",
            if more {
                format!(
                    "; call read_file with offset={} to continue after it",
                    last + 1
                )
            } else {
                String::new()
            }
        )),
        Stop::Bytes => Some(format!(
            "[truncated at {max_bytes} bytes: lines {first}-{last} of {total}; call read_file \
             with offset={} to continue]",
            last + 1
        )),
        Stop::Limit | Stop::Eof if more => Some(format!(
            "[lines {first}-{last} of {total}; call read_file with offset={} to continue]",
            last + 1
        )),
        Stop::Limit | Stop::Eof if first > 1 => Some(format!("[lines {first}-{last} of {total}]")),
        Stop::Limit | Stop::Eof => None,
    };
    Ok(match note {
        Some(note) => format!("{note}\n{text}"),
        None => text,
    })
}
