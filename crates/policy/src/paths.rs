//! Workspace paths as policies and the fs worker both see them.
//!
//! One function, used by the policy (every fs path argument and `context.paths`) and by
//! the fs worker (its `[fs] hidden` check), so that both judge the same string. It is
//! lexical; it describes the file the kernel opens only because the fs worker refuses
//! any path that goes through a symbolic link.

/// Lexical normalisation of a workspace path (see the Cedar schema's header). The fs worker
/// applies the same function before its `[fs] hidden` check, and refuses any path whose
/// resolution would go through a symlink, so the normalised path is what it touches.
/// `workspace` should be canonical (the binary canonicalises the workspaces root once),
/// which is the only host spelling the fs worker accepts besides `/workspace`.
pub fn normalize_path(raw: &str, workspace: Option<&str>) -> String {
    let absolute = raw.starts_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for part in raw.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                if parts.last().is_some_and(|last| *last != "..") {
                    parts.pop();
                } else if !absolute {
                    parts.push("..");
                }
            }
            other => parts.push(other),
        }
    }
    if absolute {
        // The host path of the workspace, and `/workspace`, where the shell sandbox and
        // the fs tools also accept it.
        for root in workspace.into_iter().chain(["/workspace"]) {
            let root: Vec<&str> = root
                .split('/')
                .filter(|part| !part.is_empty() && *part != ".")
                .collect();
            if !root.is_empty() && parts.starts_with(&root) {
                let rest = &parts[root.len()..];
                return if rest.is_empty() {
                    ".".to_owned()
                } else {
                    rest.join("/")
                };
            }
        }
        return format!("/{}", parts.join("/"));
    }
    if parts.is_empty() {
        ".".to_owned()
    } else {
        parts.join("/")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_normalised_lexically() {
        let cases = [
            ("src/main.rs", None, "src/main.rs"),
            ("./src//a/../b.rs", None, "src/b.rs"),
            ("src/../.env", None, ".env"),
            ("../outside", None, "../outside"),
            ("a/../../x", None, "../x"),
            ("", None, "."),
            ("./", None, "."),
            ("src/", None, "src"),
            ("/etc/passwd", None, "/etc/passwd"),
            ("/../etc", None, "/etc"),
            ("/ws/alice/s1/src/a.rs", Some("/ws/alice/s1"), "src/a.rs"),
            ("/ws/alice/s1", Some("/ws/alice/s1/"), "."),
            (
                "/ws/alice/s1/../s2/x",
                Some("/ws/alice/s1"),
                "/ws/alice/s2/x",
            ),
            ("/ws/alice/s10/x", Some("/ws/alice/s1"), "/ws/alice/s10/x"),
        ];
        for (raw, workspace, expected) in cases {
            assert_eq!(normalize_path(raw, workspace), expected, "{raw:?}");
        }
    }
}
