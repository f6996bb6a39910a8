//! `[fs] hidden`: subtrees of the workspace that no fs tool lists, searches, reads or
//! writes.
//!
//! Cedar path rules judge the paths a call names; they cannot see what a recursive tool
//! finds beneath a directory (a search of "." reads `.git/config` without naming it).
//! These patterns are applied by the worker to every path it is given and to every
//! entry a walk meets, so a forbidden subtree stays out of listings and searches too.
//! Paths are matched after the policy's lexical normalisation, relative to the
//! workspace root; since the worker refuses paths that go through a symlink, that
//! normalised path is the file the kernel touches.

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};

#[derive(Debug, thiserror::Error)]
pub enum HiddenError {
    #[error("[fs] hidden pattern {pattern:?} is not a valid glob: {reason}")]
    Pattern { pattern: String, reason: String },
    #[error("[fs] hidden pattern {pattern:?} must be relative to the workspace root")]
    Absolute { pattern: String },
}

/// The compiled `[fs] hidden` patterns.
#[derive(Debug, Clone)]
pub struct Hidden {
    set: GlobSet,
}

impl Default for Hidden {
    fn default() -> Self {
        Self {
            set: GlobSet::empty(),
        }
    }
}

impl Hidden {
    /// Compiles `patterns`: globs relative to the workspace root, where `*` stays inside
    /// one path component and `**` crosses them (`**/.env` also matches `.env`).
    pub fn new(patterns: &[String]) -> Result<Self, HiddenError> {
        let mut builder = GlobSetBuilder::new();
        for pattern in patterns {
            if pattern.starts_with('/') {
                return Err(HiddenError::Absolute {
                    pattern: pattern.clone(),
                });
            }
            let trimmed = pattern.trim_start_matches("./").trim_end_matches('/');
            let glob = GlobBuilder::new(trimmed)
                .literal_separator(true)
                .backslash_escape(true)
                .build()
                .map_err(|e| HiddenError::Pattern {
                    pattern: pattern.clone(),
                    reason: e.kind().to_string(),
                })?;
            builder.add(glob);
        }
        let set = builder.build().map_err(|e| HiddenError::Pattern {
            pattern: patterns.join(", "),
            reason: e.to_string(),
        })?;
        Ok(Self { set })
    }

    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// Whether `rel` (normalised, relative to the workspace root) is hidden itself.
    pub fn matches(&self, rel: &str) -> bool {
        !self.set.is_empty() && self.set.is_match(rel)
    }

    /// The hidden path that `rel` is or lies beneath, if any: `rel` or one of its
    /// ancestors matches a pattern.
    pub fn covering<'a>(&self, rel: &'a str) -> Option<&'a str> {
        if self.set.is_empty() || rel == "." || rel.starts_with('/') {
            return None;
        }
        let mut end = 0;
        loop {
            let next = rel[end..].find('/').map(|i| end + i);
            let prefix = &rel[..next.unwrap_or(rel.len())];
            if self.set.is_match(prefix) {
                return Some(prefix);
            }
            match next {
                Some(i) => end = i + 1,
                None => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hidden(patterns: &[&str]) -> Hidden {
        Hidden::new(&patterns.iter().map(|p| (*p).to_owned()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn patterns_cover_subtrees() {
        let h = hidden(&[".git", ".env", ".env.*", "**/.env", "secrets/"]);
        assert_eq!(h.covering(".git"), Some(".git"));
        assert_eq!(h.covering(".git/config"), Some(".git"));
        assert_eq!(h.covering(".env"), Some(".env"));
        assert_eq!(h.covering(".env.local"), Some(".env.local"));
        assert_eq!(h.covering("app/deep/.env"), Some("app/deep/.env"));
        assert_eq!(h.covering("secrets/key"), Some("secrets"));
        assert_eq!(h.covering("src/.git"), None, "only the root .git is named");
        assert_eq!(
            h.covering("src/.env.local"),
            None,
            "`*` stays in one component"
        );
        assert_eq!(h.covering("src/main.rs"), None);
        assert_eq!(h.covering("."), None);
        assert_eq!(h.covering(".gitignore"), None);
        assert!(hidden(&[]).covering(".env").is_none());
    }

    #[test]
    fn bad_patterns_are_refused() {
        assert!(Hidden::new(&["a[".to_owned()]).is_err());
        assert!(Hidden::new(&["/etc".to_owned()]).is_err());
    }
}
