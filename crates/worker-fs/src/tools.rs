//! The nine fs tools: definitions (schemas, descriptions, annotations) and dispatch onto
//! a blocking thread.

use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_worker::{CallContext, Tool, ToolAnnotations, ToolDefinition, ToolOutcome, ToolSet};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::FsConfig;
use crate::resolve::Workspace;
use crate::schema::{boolean, file_path, integer, object, path, string};
use crate::{edit, info, list, mutate, read, search, write};

/// Walks stop this long before the call's deadline so partial results still get back.
const DEADLINE_MARGIN: Duration = Duration::from_millis(250);

const PATHS: &str = "Paths are relative to the workspace root; absolute paths under \
                     /workspace (where the shell sees the workspace) are accepted too. \
                     Nothing outside the workspace can be reached, also not through symbolic \
                     links.";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
    Edit,
    List,
    Search,
    Info,
    CreateDir,
    Move,
    Delete,
}

const ALL: [Kind; 9] = [
    Kind::Read,
    Kind::Write,
    Kind::Edit,
    Kind::List,
    Kind::Search,
    Kind::Info,
    Kind::CreateDir,
    Kind::Move,
    Kind::Delete,
];

/// All fs tools, sharing `config`.
pub fn tools(config: FsConfig) -> ToolSet {
    let config = Arc::new(config);
    ALL.iter().fold(ToolSet::new("fs"), |set, &kind| {
        set.with(FsTool {
            kind,
            config: Arc::clone(&config),
        })
    })
}

struct FsTool {
    kind: Kind,
    config: Arc<FsConfig>,
}

fn annotations(read_only: bool, destructive: bool, idempotent: bool) -> ToolAnnotations {
    ToolAnnotations {
        read_only,
        destructive,
        idempotent,
        open_world: false,
    }
}

impl FsTool {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Read => "read_file",
            Kind::Write => "write_file",
            Kind::Edit => "edit_file",
            Kind::List => "list_directory",
            Kind::Search => "search_files",
            Kind::Info => "get_file_info",
            Kind::CreateDir => "create_directory",
            Kind::Move => "move_path",
            Kind::Delete => "delete_path",
        }
    }

    fn describe(&self) -> (&'static str, String, Value, ToolAnnotations) {
        let c = &self.config;
        match self.kind {
            Kind::Read => (
                "Read file",
                format!(
                    "Read a text file from the workspace and return its text exactly as stored. \
                     For large files, page with `offset` (1-based line number to start at) and \
                     `limit` (number of lines). At most {} bytes are returned per call. When \
                     only part of the file is returned, the first line of the result is a note \
                     in square brackets, e.g. \"[lines 11-20 of 200; call read_file with \
                     offset=21 to continue]\"; that note is not part of the file. Binary files \
                     are refused; for directories use list_directory. {PATHS}",
                    c.max_read_bytes
                ),
                object(
                    json!({
                        "path": file_path("File to read, e.g. \"src/main.rs\"."),
                        "offset": integer(1, None, "1-based line number to start reading at (default 1)."),
                        "limit": integer(1, None, "Maximum number of lines to return (default: as many as fit in the byte cap)."),
                    }),
                    &["path"],
                ),
                annotations(true, false, true),
            ),
            Kind::Write => (
                "Write file",
                format!(
                    "Create a file or replace its entire content. The write is atomic: the file \
                     either keeps its old content or gets the new one, never a mix. Missing \
                     parent directories are created. An existing file keeps its permissions; a \
                     symbolic link at `path` is replaced by a regular file. To change part of \
                     a file, prefer edit_file. Content is limited to {} bytes. {PATHS}",
                    c.max_write_bytes
                ),
                object(
                    json!({
                        "path": file_path("File to create or overwrite, e.g. \"notes/todo.md\"."),
                        "content": string("The complete new content of the file (UTF-8 text)."),
                    }),
                    &["path", "content"],
                ),
                annotations(false, true, true),
            ),
            Kind::Edit => (
                "Edit file",
                format!(
                    "Edit a text file by exact-text replacement and return a unified diff of \
                     the change. Edits apply in order, each to the result of the previous one. \
                     Every `old_text` must match the file exactly (including whitespace and \
                     indentation) and exactly once, unless `replace_all` is true; if any edit \
                     fails, nothing is changed. With `dry_run` true, only the diff is returned. \
                     The write is atomic. Files up to {} bytes, at most {} edits per call. \
                     {PATHS}",
                    c.max_write_bytes,
                    edit::MAX_EDITS
                ),
                object(
                    json!({
                        "path": file_path("Text file to edit."),
                        "edits": {
                            "type": "array",
                            "minItems": 1,
                            "maxItems": edit::MAX_EDITS,
                            "description": "Replacements to apply, in order.",
                            "items": object(
                                json!({
                                    "old_text": {
                                        "type": "string",
                                        "minLength": 1,
                                        "description": "Exact text to find; copy it from read_file output, with enough surrounding lines to be unique.",
                                    },
                                    "new_text": string("Text to put in its place (may be empty to delete)."),
                                    "replace_all": boolean("Replace every occurrence instead of requiring exactly one (default false)."),
                                }),
                                &["old_text", "new_text"],
                            ),
                        },
                        "dry_run": boolean("Only show the diff; write nothing (default false)."),
                    }),
                    &["path", "edits"],
                ),
                annotations(false, true, false),
            ),
            Kind::List => (
                "List directory",
                format!(
                    "List the entries of a directory in the workspace, sorted by name, one per \
                     line: directories end with \"/\", symbolic links show \"name -> target\" \
                     (never followed). With `recursive` true, entries of subdirectories are \
                     listed too, as paths relative to `path`. At most `max_entries` entries \
                     (default {}, at most {}); a note says when the list was cut. {PATHS}",
                    list::DEFAULT_MAX_ENTRIES.min(c.max_list_entries),
                    c.max_list_entries
                ),
                object(
                    json!({
                        "path": path("Directory to list; \".\" or \"\" for the workspace root."),
                        "recursive": boolean("Also list everything below subdirectories (default false)."),
                        "max_entries": integer(1, Some(c.max_list_entries as u64), "Maximum number of entries to return."),
                    }),
                    &["path"],
                ),
                annotations(true, false, true),
            ),
            Kind::Search => (
                "Search files",
                format!(
                    "Search the files under a directory, recursively. `glob` selects files by \
                     name: a pattern without \"/\" (e.g. \"*.rs\") matches the file name at any \
                     depth; a pattern with \"/\" (e.g. \"src/**/*.rs\") matches the path \
                     relative to `path`, where \"*\" stays within one directory and \"**\" \
                     spans any number. Without `content_regex`, matching file paths are \
                     returned; with it (Rust regex syntax), every matching line is returned as \
                     \"path:line: text\". Returned paths are relative to the workspace root. \
                     Binary files, files over {} bytes and symbolic links are skipped. At most \
                     `max_results` results (default {}, at most {}). {PATHS}",
                    c.max_search_file_bytes,
                    search::DEFAULT_MAX_RESULTS.min(c.max_search_results),
                    c.max_search_results
                ),
                object(
                    json!({
                        "path": path("Directory to search in; \".\" or \"\" for the whole workspace."),
                        "glob": string("File name pattern, e.g. \"*.py\" or \"src/**/*.ts\" (default: all files)."),
                        "content_regex": string("Regular expression to look for in file contents, line by line, e.g. \"fn\\\\s+main\"."),
                        "max_results": integer(1, Some(c.max_search_results as u64), "Maximum number of results to return."),
                    }),
                    &["path"],
                ),
                annotations(true, false, true),
            ),
            Kind::Info => (
                "Get file info",
                format!(
                    "Show the type, size, permissions (octal), modification time (UTC, RFC \
                     3339) and, for small text files, the line count of a path. A symbolic \
                     link is described itself (its target is shown, not followed). {PATHS}"
                ),
                object(
                    json!({ "path": path("File, directory or link to describe.") }),
                    &["path"],
                ),
                annotations(true, false, true),
            ),
            Kind::CreateDir => (
                "Create directory",
                format!(
                    "Create a directory, including any missing parent directories (like mkdir \
                     -p). Succeeds without change if it already exists. {PATHS}"
                ),
                object(
                    json!({ "path": file_path("Directory to create, e.g. \"src/utils\".") }),
                    &["path"],
                ),
                annotations(false, false, true),
            ),
            Kind::Move => (
                "Move or rename",
                format!(
                    "Move or rename a file, directory or symbolic link. Fails if `destination` \
                     already exists (nothing is ever overwritten) or if its parent directory \
                     does not exist. {PATHS}"
                ),
                object(
                    json!({
                        "source": file_path("Existing path to move."),
                        "destination": file_path("New path, including the new name (not just the target directory)."),
                    }),
                    &["source", "destination"],
                ),
                annotations(false, true, false),
            ),
            Kind::Delete => (
                "Delete path",
                format!(
                    "Delete a file, a symbolic link (only the link, never its target) or a \
                     directory. A directory that is not empty is deleted only with `recursive` \
                     true, together with everything in it. The workspace root itself cannot be \
                     deleted. {PATHS}"
                ),
                object(
                    json!({
                        "path": file_path("Path to delete."),
                        "recursive": boolean("Delete a non-empty directory and everything in it (default false)."),
                    }),
                    &["path"],
                ),
                annotations(false, true, false),
            ),
        }
    }
}

fn parse<T: DeserializeOwned>(tool: &str, arguments: Value) -> Result<T, String> {
    serde_json::from_value(arguments)
        .map_err(|e| format!("invalid arguments for {tool}: {e}; check the tool's input schema"))
}

/// Runs one call on the blocking thread: parses arguments, opens the workspace, acts.
fn run(
    kind: Kind,
    config: &FsConfig,
    principal: &str,
    session: &str,
    arguments: Value,
    stop: &dyn Fn() -> bool,
    tool: &str,
) -> Result<String, String> {
    let ws = |config: &FsConfig| {
        let hidden = crate::Hidden::new(&config.hidden).map_err(|e| e.to_string())?;
        if let Some(volumes) = &config.volumes {
            volumes
                .ensure(&config.workspaces_root, principal, session)
                .map_err(|e| e.to_string())?;
        }
        Workspace::open_session(&config.workspaces_root, principal, session)
            .map(|ws| ws.with_hidden(hidden))
            .map_err(|e| e.to_string())
    };
    match kind {
        Kind::Read => {
            let args: read::ReadArgs = parse(tool, arguments)?;
            read::read_file(&ws(config)?, &args, config.max_read_bytes, stop)
                .map_err(|e| e.to_string())
        }
        Kind::Write => {
            let args: write::WriteArgs = parse(tool, arguments)?;
            write::write_file(&ws(config)?, &args, config.max_write_bytes)
                .map_err(|e| e.to_string())
        }
        Kind::Edit => {
            let args: edit::EditArgs = parse(tool, arguments)?;
            edit::edit_file(
                &ws(config)?,
                &args,
                config.max_write_bytes,
                config.max_read_bytes,
                stop,
            )
            .map_err(|e| e.to_string())
        }
        Kind::List => {
            let args: list::ListArgs = parse(tool, arguments)?;
            let ws = ws(config)?;
            list::list_directory(
                &ws,
                &args,
                config.max_list_entries,
                config.max_read_bytes,
                stop,
            )
            .map_err(|e| e.to_string())
        }
        Kind::Search => {
            let args: search::SearchArgs = parse(tool, arguments)?;
            let limits = search::SearchLimits {
                max_results: config.max_search_results,
                max_files: config.max_search_files,
                max_file_bytes: config.max_search_file_bytes,
                max_output_bytes: config.max_read_bytes,
            };
            search::search_files(&ws(config)?, &args, limits, stop).map_err(|e| e.to_string())
        }
        Kind::Info => {
            let args: info::InfoArgs = parse(tool, arguments)?;
            info::get_file_info(&ws(config)?, &args).map_err(|e| e.to_string())
        }
        Kind::CreateDir => {
            let args: mutate::CreateDirArgs = parse(tool, arguments)?;
            mutate::create_directory(&ws(config)?, &args).map_err(|e| e.to_string())
        }
        Kind::Move => {
            let args: mutate::MoveArgs = parse(tool, arguments)?;
            mutate::move_path(&ws(config)?, &args).map_err(|e| e.to_string())
        }
        Kind::Delete => {
            let args: mutate::DeleteArgs = parse(tool, arguments)?;
            mutate::delete_path(&ws(config)?, &args, stop).map_err(|e| e.to_string())
        }
    }
}

#[airlock_worker::async_trait]
impl Tool for FsTool {
    fn definition(&self) -> ToolDefinition {
        let (title, description, input_schema, annotations) = self.describe();
        ToolDefinition {
            name: self.name().to_owned(),
            title: title.to_owned(),
            description,
            input_schema,
            annotations,
        }
    }

    async fn execute(&self, arguments: Value, ctx: CallContext) -> ToolOutcome {
        let (kind, config, tool) = (self.kind, Arc::clone(&self.config), self.name());
        let principal = ctx.principal.clone();
        let session = ctx.session_id.as_str().to_owned();
        let cancel = ctx.cancel.clone();
        let deadline = ctx.deadline;
        let started = Instant::now();
        let joined = tokio::task::spawn_blocking(move || {
            let stop = || {
                cancel.is_cancelled()
                    || Instant::now()
                        .checked_add(DEADLINE_MARGIN)
                        .is_none_or(|t| t >= deadline)
            };
            run(kind, &config, &principal, &session, arguments, &stop, tool)
        })
        .await;
        let outcome = match joined {
            Ok(Ok(text)) => ToolOutcome::text(text),
            Ok(Err(message)) => ToolOutcome::error(message),
            Err(e) => ToolOutcome::error(format!("{tool} failed unexpectedly: {e}")),
        };
        tracing::debug!(
            tool,
            call_id = %ctx.call_id,
            is_error = outcome.is_error,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "fs call finished"
        );
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The policies see each tool as this worker defines it: every argument typed in
    /// `context.arguments` (or left out on purpose), and the annotations as the Cedar
    /// schema's action groups.
    #[test]
    fn the_policy_sees_every_tool_as_this_worker_defines_it() {
        let problems: Vec<String> = tools(FsConfig::default())
            .definitions()
            .iter()
            .flat_map(airlock_policy::authz::check_tool)
            .collect();
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn nine_tools_with_strict_schemas() {
        let set = tools(FsConfig::default());
        let defs = set.definitions();
        assert_eq!(defs.len(), 9);
        for d in &defs {
            assert_eq!(d.input_schema["type"], "object", "{}", d.name);
            assert_eq!(d.input_schema["additionalProperties"], false, "{}", d.name);
            assert!(!d.description.is_empty());
            assert!(!d.annotations.open_world);
            assert!(!(d.annotations.read_only && d.annotations.destructive));
        }
    }
}
