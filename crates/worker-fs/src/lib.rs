//! Airlock's file tools: `read_file`, `write_file`, `edit_file`, `list_directory`,
//! `search_files`, `get_file_info`, `create_directory`, `move_path` and `delete_path`.
//!
//! Every call works inside its session's workspace,
//! `<workspaces_root>/<principal>/<session_id>`, created on demand. Confinement is done by
//! the kernel, never by string checks: every path is opened with
//! `openat2(workspace_fd, path, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`, and every
//! operation on a final name (create, rename, unlink, mkdir) is an `*at` system call
//! relative to a parent directory fd that was opened that way. `..`, absolute or escaping
//! symbolic links, `/proc` magic links and directories swapped for symlinks mid-call all
//! fail to reach anything outside the workspace.
//!
//! Writes are atomic (temporary file, `fsync`, `renameat`), so a write or edit never
//! changes an inode shared by hard link with a path outside the workspace.
#![forbid(unsafe_code)]

mod atomic;
mod edit;
mod hidden;
mod info;
mod list;
mod mutate;
mod read;
mod resolve;
mod schema;
mod search;
mod text;
mod tools;
mod walk;
mod write;

use std::path::PathBuf;

pub use hidden::{Hidden, HiddenError};
pub use tools::tools;

/// The `[fs]` section of `airlock.toml`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FsConfig {
    /// Root of all workspaces; a call's workspace is
    /// `<workspaces_root>/<principal>/<session_id>`. The binary sets it from the data dir.
    pub workspaces_root: PathBuf,
    /// Per-call cap of `read_file` output, in bytes.
    pub max_read_bytes: u64,
    /// Largest file `write_file` writes and `edit_file` edits, in bytes.
    pub max_write_bytes: u64,
    /// Upper bound of `search_files`' `max_results`.
    pub max_search_results: usize,
    /// Upper bound of `list_directory`'s `max_entries`.
    pub max_list_entries: usize,
    /// Files `search_files` examines at most in one call.
    pub max_search_files: usize,
    /// Files larger than this are not searched for content.
    pub max_search_file_bytes: u64,
    /// Globs relative to the workspace root (`[".git", ".env", "**/.env", "secrets"]`):
    /// matching paths, and everything beneath them, are never listed, searched, read or
    /// changed by any fs tool; a call naming one is refused. Cedar path rules judge the
    /// paths a call names; this is what keeps subtrees out of recursive tools.
    pub hidden: Vec<String>,
    /// The broker that mounts each workspace as a file system of its own, sized to
    /// `[sandbox] workspace_bytes` and `workspace_inodes`; set by the binary. `None`: no
    /// per-workspace quota.
    #[serde(skip)]
    pub volumes: Option<airlock_worker::volumes::VolumeClient>,
}

impl Default for FsConfig {
    fn default() -> Self {
        Self {
            workspaces_root: PathBuf::from("/var/lib/airlock/workspaces"),
            max_read_bytes: 262_144,
            max_write_bytes: 10 * 1024 * 1024,
            max_search_results: 1000,
            max_list_entries: 10_000,
            max_search_files: 20_000,
            max_search_file_bytes: 4 * 1024 * 1024,
            hidden: Vec::new(),
            volumes: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_defaults_and_toml_shape() {
        let c: FsConfig = serde_json::from_str(r#"{"max_read_bytes": 1000}"#).unwrap();
        assert_eq!(c.max_read_bytes, 1000);
        assert_eq!(c.max_write_bytes, FsConfig::default().max_write_bytes);
        assert!(serde_json::from_str::<FsConfig>(r#"{"nope": 1}"#).is_err());
        assert_eq!(FsConfig::default().max_read_bytes, 262_144);
    }
}
