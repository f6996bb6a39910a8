//! Turning byte offsets and miette diagnostics into `line:column` for error messages.

use std::fmt::Write as _;

use miette::Diagnostic;

/// A 1-based line and column (in characters) of a byte offset into `text`. Offsets past
/// the end point just after the last character; offsets inside a character are rounded
/// down to its start.
pub(crate) fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |newline| newline + 1);
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

/// The offset of the first labelled span of a diagnostic, if it has one.
pub(crate) fn first_offset(diagnostic: &dyn Diagnostic) -> Option<usize> {
    let mut labels = diagnostic.labels()?;
    let first = labels.next()?;
    Some(first.offset())
}

/// The message of a diagnostic on one line: the error, its label texts when they add
/// something, and its help.
pub(crate) fn message(diagnostic: &dyn Diagnostic) -> String {
    let mut message = diagnostic.to_string();
    if let Some(labels) = diagnostic.labels() {
        for label in labels {
            if let Some(text) = label.label()
                && !text.is_empty()
                && !message.contains(text)
            {
                let _ = write!(message, "; {text}");
            }
        }
    }
    if let Some(help) = diagnostic.help() {
        let _ = write!(message, " (help: {help})");
    }
    lowercase_first(message.trim_end_matches('.'))
}

fn lowercase_first(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_become_lines_and_columns() {
        let text = "ab\ncdé\n\nx";
        assert_eq!(line_column(text, 0), (1, 1));
        assert_eq!(line_column(text, 2), (1, 3));
        assert_eq!(line_column(text, 3), (2, 1));
        assert_eq!(line_column(text, 7), (2, 4));
        assert_eq!(line_column(text, 6), (2, 3));
        assert_eq!(line_column(text, 9), (4, 1));
        assert_eq!(line_column(text, 100), (4, 2));
    }
}
