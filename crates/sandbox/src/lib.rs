//! Linux confinement for Airlock: a fresh sandbox per tool call, and self-confinement
//! for Airlock's own long-running processes.
//!
//! A strict sandbox, per call, in the child between `clone` and `execve` (see
//! [`spawn`](crate::spawn) for the one straight sequence): user, pid, mount, net, ipc,
//! uts and cgroup namespaces; a new root with read-only system directories, a minimal
//! `/etc`, the workspace read-write at `/workspace`, a size-limited `/tmp`, fresh
//! `/proc`, minimal `/dev`; `pivot_root`; a cgroup with memory (no swap), pids and CPU
//! limits (v2 or v1); rlimits; only stdin/stdout/stderr open; an empty environment plus
//! the variables the call names; `no_new_privs`; every capability dropped; Landlock;
//! seccomp last. The parent enforces the wall clock, caps captured output, kills the
//! whole cgroup on timeout or cancel, and leaves no process, mount or cgroup behind.
//!
//! A standard sandbox (for hosts without user namespaces) keeps Landlock, seccomp,
//! rlimits, `no_new_privs` and dropped capabilities, and cgroups when available.
//!
//! [`Sandbox::new`] probes the host and fails closed, naming the missing layer and the
//! fix, when it cannot provide the configured `min_isolation`. Every
//! [`RunOutcome`] carries the [`IsolationReport`] of the layers actually in force.
//!
//! [`heap`] sets how the C allocator serves the orchestrator's large buffers.
//!
//! This is the only crate of the workspace allowed `unsafe`; every block says why it
//! is sound in a `// SAFETY:` comment (`clippy::undocumented_unsafe_blocks` is denied).
//! It is synchronous: call [`Sandbox::run`] from a blocking thread.
#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]
// Every cast in this crate meets the kernel's ABI; one that could truncate or change
// sign must say how (try_from, cast_unsigned), not hide it.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap
)]
#![cfg(target_os = "linux")]

mod caps;
pub mod cgroup;
mod fds;
pub mod heap;
mod inherit;
mod landlock_rules;
mod loopback;
mod namespaces;
mod probe;
mod rlimits;
mod rootfs;
mod sandbox;
mod seccomp;
mod self_confine;
mod slots;
mod spawn;
mod step;
mod sys;

/// Unit tests that use the real host (probes, cgroups, sandboxes) take turns: the probe's
/// test counts how often the host is probed, which another test's factory would move.
#[cfg(test)]
static REAL_HOST: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub use airlock_policy::IsolationLevel;
pub use caps::CapsError;
pub use cgroup::{CgroupBackend, CgroupError, CgroupLimits, CgroupVersion};
pub use fds::FdError;
pub use inherit::{InheritError, LISTEN_FDS_ENV, inherited_listeners, pass_listeners};
pub use landlock_rules::{LandlockError, abi_version as landlock_abi_version};
pub use namespaces::NamespaceError;
pub use probe::{HostProbe, IsolationReport, LimitsReport, Missing, probe};
pub use rlimits::{RlimitError, RlimitReport};
pub use rootfs::RootfsError;
pub use sandbox::{
    AttachedStdio, Cancel, CommandSpec, Network, NoSink, OutputSink, PROXY_PORT, RunOutcome,
    Sandbox, SandboxConfig, SandboxError, Stream, Usage,
};
pub use seccomp::{SeccompError, filter_available as seccomp_filter_available};
pub use self_confine::{SelfConfineError, SelfConfinement, SelfConfinementReport, confine_self};
pub use slots::{SlotError, default_max_concurrent};
pub use step::Step;
