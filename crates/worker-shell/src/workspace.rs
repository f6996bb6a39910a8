//! The host directory of a call's workspace.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error("cannot prepare the workspace: {0}")]
    Create(std::io::Error),
    #[error("the workspace path is not a plain directory")]
    NotADirectory,
}

/// `<root>/<principal>/<session>`, created (mode 0700) when missing. The two segments
/// are validated path segments; the result must be a real directory, not a symlink.
pub fn prepare(root: &Path, principal: &str, session: &str) -> Result<PathBuf, WorkspaceError> {
    let path = root.join(principal).join(session);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&path)
        .map_err(WorkspaceError::Create)?;
    for dir in [root.join(principal), path.clone()] {
        let meta = std::fs::symlink_metadata(&dir).map_err(WorkspaceError::Create)?;
        if !meta.file_type().is_dir() {
            return Err(WorkspaceError::NotADirectory);
        }
    }
    Ok(path)
}

/// Checks a `cwd` argument: relative to the workspace (or under `/workspace`), no `..`.
pub fn checked_cwd(cwd: &str) -> Result<Option<String>, String> {
    let relative = if cwd == "/workspace" {
        ""
    } else if let Some(rest) = cwd.strip_prefix("/workspace/") {
        rest
    } else if cwd.starts_with('/') {
        return Err(format!(
            "cwd {cwd:?} is outside the workspace; use a path relative to it"
        ));
    } else {
        cwd
    };
    let mut clean = Vec::new();
    for part in Path::new(relative).components() {
        match part {
            std::path::Component::Normal(p) => clean.push(p.to_string_lossy().into_owned()),
            std::path::Component::CurDir => {}
            _ => {
                return Err(format!(
                    "cwd {cwd:?} may not contain \"..\"; use a path inside the workspace"
                ));
            }
        }
    }
    Ok((!clean.is_empty()).then(|| clean.join("/")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cwd_stays_inside() {
        assert_eq!(checked_cwd("src").unwrap(), Some("src".into()));
        assert_eq!(
            checked_cwd("/workspace/src/./a").unwrap(),
            Some("src/a".into())
        );
        assert_eq!(checked_cwd(".").unwrap(), None);
        assert_eq!(checked_cwd("/workspace").unwrap(), None);
        assert!(checked_cwd("../x").is_err());
        assert!(checked_cwd("a/../../x").is_err());
        assert!(checked_cwd("/etc").is_err());
        assert!(checked_cwd("/workspaces/x").is_err());
    }
}
