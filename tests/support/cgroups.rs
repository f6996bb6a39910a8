//! The host's cgroup directories, in every hierarchy: where tests look for what a
//! sandbox must not leave behind.
//!
//! Include it as a module (it is not a crate):
//!
//! ```ignore
//! #[path = "../../../tests/support/cgroups.rs"]
//! mod cgroups;
//! ```

use std::path::PathBuf;

/// How many levels below /sys/fs/cgroup are looked through: deeper than any parent a
/// test configures, and than the service a test runs under nests.
const MAX_DEPTH: usize = 10;

/// Every directory below /sys/fs/cgroup, in any hierarchy, whose name `matches` (those
/// below a match included).
pub fn cgroup_dirs(matches: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![(PathBuf::from("/sys/fs/cgroup"), 0)];
    while let Some((dir, depth)) = stack.pop() {
        // A cgroup removed meanwhile, or a hierarchy we may not read: nothing below it.
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let path = entry.path();
            if matches(&entry.file_name().to_string_lossy()) {
                found.push(path.clone());
            }
            if depth < MAX_DEPTH {
                stack.push((path, depth + 1));
            }
        }
    }
    found
}
