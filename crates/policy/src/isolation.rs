//! Isolation levels a deployment may demand of the shell sandbox.

use serde::{Deserialize, Serialize};

/// The minimum isolation a worker accepts before it starts (`[sandbox] min_isolation`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IsolationLevel {
    /// Landlock, seccomp, rlimits and no_new_privs, without namespaces: for unprivileged
    /// containers that cannot create user namespaces.
    Standard,
    /// Every layer: namespaces, new root, cgroup limits, Landlock, seccomp, rlimits.
    #[default]
    Strict,
}

impl IsolationLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            IsolationLevel::Standard => "standard",
            IsolationLevel::Strict => "strict",
        }
    }
}
