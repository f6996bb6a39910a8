//! Validation of names that end up in paths, URLs and catalogs.

use std::fmt;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("{what} must not be empty")]
    Empty { what: &'static str },
    #[error("{what} is longer than {max} characters")]
    TooLong { what: &'static str, max: usize },
    #[error(
        "{what} may contain only letters, digits, '_', '-' and '.' and must not be '.' or '..'"
    )]
    BadCharacters { what: &'static str },
    #[error("tool name must match ^[a-zA-Z0-9_-]{{1,64}}$")]
    BadToolName,
}

/// Checks one path segment derived from caller input (a principal or session name):
/// `^[A-Za-z0-9_.-]{1,64}$`, and not `.` or `..`.
pub fn validate_segment(what: &'static str, value: &str) -> Result<(), NameError> {
    if value.is_empty() {
        return Err(NameError::Empty { what });
    }
    if value.len() > 64 {
        return Err(NameError::TooLong { what, max: 64 });
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    if value == "." || value == ".." || !value.chars().all(allowed) {
        return Err(NameError::BadCharacters { what });
    }
    Ok(())
}

/// Tool names follow the Anthropic and OpenAI rule `^[a-zA-Z0-9_-]{1,64}$`.
pub fn validate_tool_name(name: &str) -> Result<(), NameError> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-');
    if name.is_empty() || name.len() > 64 || !name.chars().all(allowed) {
        return Err(NameError::BadToolName);
    }
    Ok(())
}

/// A validated session id; calls without one belong to the session `default`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SessionId(String);

impl SessionId {
    pub const DEFAULT: &'static str = "default";

    pub fn parse(value: &str) -> Result<Self, NameError> {
        validate_segment("session_id", value)?;
        Ok(Self(value.to_owned()))
    }

    pub fn default_session() -> Self {
        Self(Self::DEFAULT.to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for SessionId {
    type Error = NameError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<SessionId> for String {
    fn from(value: SessionId) -> Self {
        value.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_reject_traversal_and_separators() {
        for bad in ["", ".", "..", "a/b", "a\\b", "a b", "é", &"x".repeat(65)] {
            assert!(
                validate_segment("session_id", bad).is_err(),
                "{bad:?} accepted"
            );
        }
        for good in ["default", "s-1", "agent_7.run", &"x".repeat(64)] {
            assert!(
                validate_segment("session_id", good).is_ok(),
                "{good:?} refused"
            );
        }
    }

    #[test]
    fn tool_names_follow_the_provider_rule() {
        assert!(validate_tool_name("read_file").is_ok());
        assert!(validate_tool_name("a-b_9").is_ok());
        assert!(validate_tool_name("read.file").is_err());
        assert!(validate_tool_name("").is_err());
        assert!(validate_tool_name(&"x".repeat(65)).is_err());
    }
}
