//! `search_files`: find files by glob and lines by regular expression, bounded.

use rustix::fs::{FileType, Mode, OFlags};

use crate::resolve::{ResolveError, Workspace, open_beneath};
use crate::text::{SNIFF_BYTES, escape_name, escape_os, read_capped};
use crate::walk::{Entry, Visit, WalkError, open_directory, walk};

pub const DEFAULT_MAX_RESULTS: usize = 100;
/// Compiled-size limit of a content regex.
const REGEX_SIZE_LIMIT: usize = 1 << 20;
/// Longest line text shown in a content match.
const MAX_LINE_CHARS: usize = 300;

#[derive(Debug, thiserror::Error)]
pub enum SearchError {
    #[error(transparent)]
    Walk(#[from] WalkError),
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error("invalid glob {glob:?}: {reason}; use patterns like \"*.rs\" or \"src/**/*.py\"")]
    Glob { glob: String, reason: String },
    #[error("invalid content_regex {regex:?}: {reason}")]
    Regex { regex: String, reason: String },
    #[error("cannot search {path:?}: {errno}")]
    Io {
        path: String,
        errno: rustix::io::Errno,
    },
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchArgs {
    pub path: String,
    #[serde(default)]
    pub glob: Option<String>,
    #[serde(default)]
    pub content_regex: Option<String>,
    #[serde(default)]
    pub max_results: Option<usize>,
}

/// Bounds of one search, from the configuration.
#[derive(Debug, Clone, Copy)]
pub struct SearchLimits {
    pub max_results: usize,
    pub max_files: usize,
    pub max_file_bytes: u64,
    /// The most text one answer holds (each result's line is bounded, their names not).
    pub max_output_bytes: u64,
}

/// A glob matched against the path relative to the search root when it holds a `/`,
/// else against the file name; `*` never crosses `/`, `**` does.
struct NameMatcher {
    matcher: globset::GlobMatcher,
    whole_path: bool,
}

impl NameMatcher {
    fn new(glob: &str) -> Result<Self, SearchError> {
        let pattern = glob.trim_start_matches("./");
        let matcher = globset::GlobBuilder::new(pattern)
            .literal_separator(true)
            .backslash_escape(true)
            .build()
            .map_err(|e| SearchError::Glob {
                glob: glob.to_owned(),
                reason: e.kind().to_string(),
            })?
            .compile_matcher();
        Ok(Self {
            matcher,
            whole_path: pattern.contains('/'),
        })
    }

    /// Matched on the bytes on disk: globset matches a path's bytes, UTF-8 or not.
    fn is_match(&self, entry: &Entry<'_>) -> bool {
        if self.whole_path {
            self.matcher.is_match(entry.rel)
        } else {
            self.matcher.is_match(entry.name)
        }
    }
}

fn shorten(line: &str) -> String {
    let line = line.trim_end_matches(['\r', '\n']);
    if line.chars().count() <= MAX_LINE_CHARS {
        return line.to_owned();
    }
    let cut: String = line.chars().take(MAX_LINE_CHARS).collect();
    format!("{cut}…")
}

#[derive(Default)]
struct Tally {
    results: Vec<String>,
    more_results: bool,
    files_seen: usize,
    files_limit_hit: bool,
    skipped_large: usize,
    skipped_binary: usize,
}

pub fn search_files(
    ws: &Workspace,
    args: &SearchArgs,
    limits: SearchLimits,
    stop: &dyn Fn() -> bool,
) -> Result<String, SearchError> {
    let display = args.path.as_str();
    let matcher = args
        .glob
        .as_deref()
        .filter(|g| !g.is_empty())
        .map(NameMatcher::new)
        .transpose()?;
    let regex = match args.content_regex.as_deref().filter(|r| !r.is_empty()) {
        Some(re) => Some(
            regex::RegexBuilder::new(re)
                .size_limit(REGEX_SIZE_LIMIT)
                .dfa_size_limit(REGEX_SIZE_LIMIT)
                .build()
                .map_err(|e| SearchError::Regex {
                    regex: re.to_owned(),
                    reason: e.to_string(),
                })?,
        ),
        None => None,
    };
    let max_results = args
        .max_results
        .unwrap_or(DEFAULT_MAX_RESULTS)
        .clamp(1, limits.max_results.max(1));

    let rel = ws.relative(display)?;
    let dir = open_directory(ws, &rel, display, "pass the directory that holds it")?;
    let prefix = rel.trim_end_matches('/').trim_start_matches("./");
    let prefix = if prefix.is_empty() || prefix == "." {
        String::new()
    } else {
        format!("{prefix}/")
    };

    let mut tally = Tally::default();
    let mut bytes = crate::text::LineBudget::new(limits.max_output_bytes);
    let mut visit = |entry: &Entry<'_>| -> Visit {
        if entry.kind != FileType::RegularFile {
            return Visit::Continue;
        }
        if tally.files_seen >= limits.max_files {
            tally.files_limit_hit = true;
            return Visit::Stop;
        }
        tally.files_seen += 1;
        if matcher.as_ref().is_some_and(|m| !m.is_match(entry)) {
            return Visit::Continue;
        }
        let shown = format!("{}{}", escape_name(&prefix), escape_os(entry.rel));
        let Some(regex) = regex.as_ref() else {
            if tally.results.len() >= max_results {
                tally.more_results = true;
                return Visit::Stop;
            }
            if !bytes.take(&shown) {
                return Visit::Stop;
            }
            tally.results.push(shown);
            return Visit::Continue;
        };
        let Some(text) = read_text(entry, limits.max_file_bytes, &mut tally) else {
            return Visit::Continue;
        };
        for (i, line) in text.lines().enumerate() {
            if regex.is_match(line) {
                if tally.results.len() >= max_results {
                    tally.more_results = true;
                    return Visit::Stop;
                }
                let found = format!("{shown}:{}: {}", i + 1, shorten(line));
                if !bytes.take(&found) {
                    return Visit::Stop;
                }
                tally.results.push(found);
            }
        }
        Visit::Continue
    };
    let hidden = ws.hidden_beneath(&rel);
    let end = walk(&dir, true, &mut visit, stop, &hidden).map_err(|errno| SearchError::Io {
        path: display.to_owned(),
        errno,
    })?;

    let mut out = tally.results;
    if out.is_empty() {
        out.push(match (&args.glob, &regex) {
            (_, Some(_)) => format!("no lines matched under {display:?}"),
            (Some(g), None) => format!("no files matched {g:?} under {display:?}"),
            (None, None) => format!("no files under {display:?}"),
        });
    }
    if tally.more_results {
        out.push(format!(
            "[stopped at {max_results} results; narrow the glob or regex, or search a subdirectory]"
        ));
    }
    if let Some(note) = bytes.note("narrow the glob or regex, or search a subdirectory") {
        out.push(note);
    }
    if tally.files_limit_hit {
        out.push(format!(
            "[stopped after examining {} files; search a subdirectory or narrow the glob]",
            limits.max_files
        ));
    }
    if end.stopped {
        out.push("[stopped early: the call was cancelled or reached its deadline]".to_owned());
    }
    if end.depth_limited {
        out.push(format!(
            "[directories deeper than {} levels were not searched]",
            crate::walk::MAX_DEPTH
        ));
    }
    if tally.skipped_large > 0 {
        out.push(format!(
            "[{} file(s) larger than {} bytes were not searched for content]",
            tally.skipped_large, limits.max_file_bytes
        ));
    }
    if tally.skipped_binary > 0 {
        out.push(format!("[skipped {} binary file(s)]", tally.skipped_binary));
    }
    Ok(out.join("\n"))
}

/// Reads a file found by the walk, by name in its directory, never following a symlink.
fn read_text(entry: &Entry<'_>, max_bytes: u64, tally: &mut Tally) -> Option<String> {
    let fd = open_beneath(
        entry.dir,
        entry.name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY,
        Mode::empty(),
    )
    .ok()?;
    let st = rustix::fs::fstat(&fd).ok()?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return None;
    }
    if u64::try_from(st.st_size).unwrap_or(u64::MAX) > max_bytes {
        tally.skipped_large += 1;
        return None;
    }
    let mut file = std::fs::File::from(fd);
    let Ok(Some(bytes)) = read_capped(&mut file, max_bytes) else {
        tally.skipped_large += 1;
        return None;
    };
    if bytes[..bytes.len().min(SNIFF_BYTES)].contains(&0) {
        tally.skipped_binary += 1;
        return None;
    }
    match String::from_utf8(bytes) {
        Ok(text) => Some(text),
        Err(_) => {
            tally.skipped_binary += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_semantics() {
        let m = NameMatcher::new("*.rs").unwrap();
        assert!(!m.whole_path);
        assert!(m.matcher.is_match("main.rs"));
        let m = NameMatcher::new("src/**/*.rs").unwrap();
        assert!(m.whole_path);
        assert!(m.matcher.is_match("src/a/b/main.rs"));
        assert!(m.matcher.is_match("src/main.rs"));
        let m = NameMatcher::new("src/*.rs").unwrap();
        assert!(!m.matcher.is_match("src/a/main.rs"));
        assert!(NameMatcher::new("[").is_err());
    }

    #[test]
    fn long_lines_are_shortened() {
        let s = "x".repeat(1000);
        assert_eq!(shorten(&s).chars().count(), MAX_LINE_CHARS + 1);
        assert_eq!(shorten("abc\r"), "abc");
    }
}
