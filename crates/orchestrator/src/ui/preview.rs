//! What a pending call would do, shown to its approver: the unified diff of a
//! `write_file` or `edit_file` against the file as it is now, or the full command of
//! `execute_shell`.
//!
//! The current file is read through the call's own worker, in the call's own workspace
//! (`get_file_info`, then `read_file`), and an `edit_file` is first run there with
//! `dry_run: true`, so that an edit that would fail says so here. The diff itself is
//! computed here, between the current and the proposed text each redacted as the audit
//! redacts a string: a secret in the file or the arguments is no more visible in the
//! diff than in the arguments.

use std::time::Duration;

use serde_json::{Value, json};

use crate::gate::Gate;
use crate::store::Approval;

/// Files larger than this get no diff (the default `[fs] max_read_bytes`).
const MAX_PREVIEW_BYTES: u64 = 256 * 1024;
/// Longest a diff may take to compute; `similar` then gives a coarser one.
const DIFF_TIMEOUT: Duration = Duration::from_secs(2);

/// What the approver sees beside the arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Preview {
    /// A unified diff (empty when the file would not change), and what it is of.
    Diff { diff: String, note: String },
    /// The command line `execute_shell` would run, and where.
    Command {
        command: String,
        cwd: Option<String>,
        env_names: Vec<String>,
        stdin: bool,
    },
    /// Why no diff can be shown; the arguments still are.
    Unavailable(String),
    /// The tool has no preview beyond its arguments.
    Nothing,
}

/// The preview of `approval` (its input as stored, not redacted).
pub async fn preview(gate: &Gate, approval: &Approval) -> Preview {
    let input = &approval.input;
    match approval.tool.as_str() {
        "write_file" => {
            let (Some(path), Some(content)) = (str_arg(input, "path"), str_arg(input, "content"))
            else {
                return Preview::Unavailable("the arguments hold no path and content".into());
            };
            match current_text(gate, approval, path).await {
                Ok(Current::Missing) => diff(gate, "", content, path, "a new file".into()),
                Ok(Current::Text(old)) => diff(
                    gate,
                    &old,
                    content,
                    path,
                    "the file now → write_file".into(),
                ),
                Err(why) => Preview::Unavailable(why),
            }
        }
        "edit_file" => edit_preview(gate, approval).await,
        "execute_shell" => command_preview(gate, input),
        _ => Preview::Nothing,
    }
}

async fn edit_preview(gate: &Gate, approval: &Approval) -> Preview {
    let input = &approval.input;
    let (Some(path), Some(edits)) = (
        str_arg(input, "path"),
        input.get("edits").and_then(Value::as_array),
    ) else {
        return Preview::Unavailable("the arguments hold no path and edits".into());
    };
    let mut dry_run = input.clone();
    dry_run["dry_run"] = json!(true);
    let summary = match gate.preview_run(approval, "edit_file", &dry_run).await {
        Err(e) => return Preview::Unavailable(format!("the dry run could not run: {e}")),
        Ok(outcome) if outcome.is_error => {
            return Preview::Unavailable(format!(
                "the dry run fails, so the call would fail too: {}",
                gate.redact_text(&outcome.content.join("\n"))
            ));
        }
        Ok(outcome) => {
            let text = outcome.content.join("\n");
            let first = text.lines().next().unwrap_or_default().to_owned();
            gate.redact_text(&first)
        }
    };
    let old = match current_text(gate, approval, path).await {
        Ok(Current::Text(old)) => old,
        Ok(Current::Missing) => {
            return Preview::Unavailable(format!("{path:?} no longer exists"));
        }
        Err(why) => return Preview::Unavailable(why),
    };
    match apply_edits(&old, edits) {
        Ok(new) => diff(gate, &old, &new, path, summary),
        Err(EditsMiss::NoLongerApply) => Preview::Unavailable(format!(
            "the file changed since the dry run ({summary}); reload to see it again"
        )),
        Err(EditsMiss::TooLarge) => Preview::Unavailable(format!(
            "the edited file would be more than the {MAX_PREVIEW_BYTES} bytes a diff is shown for ({summary})"
        )),
    }
}

fn command_preview(gate: &Gate, input: &Value) -> Preview {
    let command = match (input.get("command"), input.get("argv")) {
        (Some(Value::String(command)), _) => command.clone(),
        (_, Some(Value::Array(argv))) => argv
            .iter()
            .map(|a| shell_quote(a.as_str().unwrap_or_default()))
            .collect::<Vec<_>>()
            .join(" "),
        _ => return Preview::Unavailable("the arguments hold no command or argv".into()),
    };
    let env_names = input
        .get("env")
        .and_then(Value::as_object)
        .map(|env| env.keys().cloned().collect())
        .unwrap_or_default();
    Preview::Command {
        command: gate.redact_text(&command),
        cwd: str_arg(input, "cwd").map(|c| gate.redact_text(c)),
        env_names,
        stdin: input.get("stdin").is_some_and(|s| !s.is_null()),
    }
}

/// `argv` as `/bin/sh` would read it back: each word in single quotes unless it is
/// plainly safe.
fn shell_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

fn str_arg<'a>(input: &'a Value, key: &str) -> Option<&'a str> {
    input.get(key).and_then(Value::as_str)
}

enum Current {
    Missing,
    Text(String),
}

/// The file at `path` in the call's workspace as it is now, through its worker.
async fn current_text(gate: &Gate, approval: &Approval, path: &str) -> Result<Current, String> {
    let info = gate
        .preview_run(approval, "get_file_info", &json!({"path": path}))
        .await
        .map_err(|e| format!("cannot look at the current file: {e}"))?;
    let info_text = info.content.join("\n");
    if info.is_error {
        // The fs worker's "does not exist" (ResolveError::NotFound): a new file.
        if info_text.contains("does not exist") {
            return Ok(Current::Missing);
        }
        return Err(format!(
            "cannot look at the current file: {}",
            gate.redact_text(&info_text)
        ));
    }
    let field = |name: &str| {
        info_text
            .lines()
            .find_map(|l| l.strip_prefix(name).map(str::trim))
            .map(str::to_owned)
    };
    let kind = field("type:").unwrap_or_default();
    if kind != "file" {
        return Err(format!(
            "{path:?} is a {kind}, not a regular file: no diff is shown"
        ));
    }
    let size = field("size:")
        .and_then(|s| s.trim_end_matches("bytes").trim().parse::<u64>().ok())
        .ok_or_else(|| "the worker did not say how large the current file is".to_owned())?;
    if size == 0 {
        return Ok(Current::Text(String::new()));
    }
    if size > MAX_PREVIEW_BYTES {
        return Err(format!(
            "the current file is {size} bytes, more than the {MAX_PREVIEW_BYTES} a diff is shown for; the arguments below hold the proposed content"
        ));
    }
    let read = gate
        .preview_run(approval, "read_file", &json!({"path": path}))
        .await
        .map_err(|e| format!("cannot read the current file: {e}"))?;
    let text = read.content.join("\n");
    if read.is_error {
        return Err(format!(
            "cannot read the current file: {}",
            gate.redact_text(&text)
        ));
    }
    // A paging note or a file that changed in between: not the whole file as it is.
    if text.len() as u64 != size {
        return Err(
            "the file changed while it was read, or is not plain text; reload to try again".into(),
        );
    }
    Ok(Current::Text(text))
}

/// Why `edits` give no text to show.
#[derive(Debug, PartialEq, Eq)]
enum EditsMiss {
    /// One of them does not apply to the file as it is now.
    NoLongerApply,
    /// The result would be larger than a diff is shown for.
    TooLarge,
}

/// `edits` applied to `text` as `edit_file` applies them: in order, each `old_text`
/// found exactly once unless `replace_all`. The file is read after the dry run and may
/// have changed since, so the worker's own bound on the result does not hold here: each
/// edit's result is measured before it is built, and one past [`MAX_PREVIEW_BYTES`]
/// stops (chained `replace_all` edits that double the text would otherwise grow it
/// exponentially in the orchestrator's memory).
fn apply_edits(text: &str, edits: &[Value]) -> Result<String, EditsMiss> {
    let mut current = text.to_owned();
    for edit in edits {
        let field = |name: &str| edit.get(name).and_then(Value::as_str);
        let (Some(old), Some(new)) = (field("old_text"), field("new_text")) else {
            return Err(EditsMiss::NoLongerApply);
        };
        let all = edit
            .get("replace_all")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let count = if old.is_empty() {
            0
        } else {
            current.matches(old).count()
        };
        let replaced = match count {
            0 => return Err(EditsMiss::NoLongerApply),
            1 => 1,
            _ if all => count,
            _ => return Err(EditsMiss::NoLongerApply),
        };
        let size = (current.len() - replaced * old.len()) as u64
            + (replaced as u64).saturating_mul(new.len() as u64);
        if size > MAX_PREVIEW_BYTES {
            return Err(EditsMiss::TooLarge);
        }
        current = current.replacen(old, new, replaced);
    }
    Ok(current)
}

/// The unified diff of `old` and `new`, each redacted first.
fn diff(gate: &Gate, old: &str, new: &str, path: &str, note: String) -> Preview {
    if new.len() as u64 > MAX_PREVIEW_BYTES {
        return Preview::Unavailable(format!(
            "the proposed content is {} bytes, more than the {MAX_PREVIEW_BYTES} a diff is shown for",
            new.len()
        ));
    }
    let (old, new) = (gate.redact_text(old), gate.redact_text(new));
    let name = gate.redact_text(path.trim_start_matches("./"));
    let diff = similar::TextDiff::configure()
        .timeout(DIFF_TIMEOUT)
        .diff_lines(old.as_str(), new.as_str())
        .unified_diff()
        .context_radius(3)
        .header(&format!("a/{name}"), &format!("b/{name}"))
        .to_string();
    let note = if diff.is_empty() {
        format!("{note}: the file would not change")
    } else {
        note
    };
    Preview::Diff { diff, note }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_apply_like_edit_file() {
        let text = "a b a\nc\n";
        let edit = |old: &str, new: &str, all: bool| json!({"old_text": old, "new_text": new, "replace_all": all});
        assert_eq!(
            apply_edits(text, &[edit("c", "d", false), edit("d", "e", false)]).as_deref(),
            Ok("a b a\ne\n")
        );
        let missed = Err(EditsMiss::NoLongerApply);
        assert_eq!(apply_edits(text, &[edit("a", "x", false)]), missed);
        assert_eq!(
            apply_edits(text, &[edit("a", "x", true)]).as_deref(),
            Ok("x b x\nc\n")
        );
        assert_eq!(apply_edits(text, &[edit("zz", "y", false)]), missed);
        assert_eq!(apply_edits(text, &[edit("", "y", false)]), missed);
        assert_eq!(apply_edits(text, &[json!({"old_text": "a"})]), missed);
    }

    /// Chained `replace_all` edits that double the text: 24 of them on 256 KiB would
    /// ask for 2^42 bytes. The preview stops at its bound before building the result.
    #[test]
    fn doubling_edits_stop_at_the_preview_bound() {
        let text = "x".repeat(256 * 1024);
        let doubling = vec![json!({"old_text": "x", "new_text": "xx", "replace_all": true}); 24];
        assert_eq!(apply_edits(&text, &doubling), Err(EditsMiss::TooLarge));
        // Within the bound they apply.
        let small = vec![json!({"old_text": "x", "new_text": "xx", "replace_all": true}); 3];
        assert_eq!(apply_edits("x", &small).map(|t| t.len()), Ok(8));
    }

    #[test]
    fn argv_is_quoted_for_the_shell() {
        let words = ["ls", "-la", "my file", "it's", "$(id)", ""];
        let line: Vec<String> = words.iter().map(|w| shell_quote(w)).collect();
        assert_eq!(line.join(" "), r#"ls -la 'my file' 'it'\''s' '$(id)' ''"#);
    }
}
