//! Resource limits of the sandboxed process: open files, file size, no core dumps, and
//! CPU seconds derived from the wall-clock timeout (a backstop to the parent's timer).
//! The data segment's soft limit goes back up to its hard limit: a worker may keep a
//! soft memory ceiling of its own (`[limits] worker_memory_bytes`), which is not the
//! sandbox's — the sandbox's cgroup bounds its memory.
//!
//! Hard limits can only be lowered without `CAP_SYS_RESOURCE` (absent from many bounding
//! sets), so each limit is clamped to the hard limit the worker already has, and the
//! report states the value actually set.

use std::io;
use std::time::Duration;

use serde::Serialize;

use crate::step::{AtStep, Failure, Step};
use crate::sys;

/// One `thiserror` enum per module: failures reading the current limits.
#[derive(Debug, thiserror::Error)]
pub enum RlimitError {
    #[error("cannot read the current {name} limit: {source}")]
    Read {
        name: &'static str,
        #[source]
        source: io::Error,
    },
}

/// The limits as set (after clamping), for the isolation report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RlimitReport {
    pub nofile: u64,
    pub fsize_bytes: u64,
    pub core_bytes: u64,
    /// `None` until a call's timeout is known.
    pub cpu_seconds: Option<u64>,
}

/// The requested limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rlimits {
    pub nofile: u64,
    pub fsize_bytes: u64,
    pub timeout: Duration,
}

/// The resources a sandbox limits, in the order of [`RlimitValues`].
const RESOURCES: [libc::__rlimit_resource_t; 5] = [
    libc::RLIMIT_NOFILE,
    libc::RLIMIT_FSIZE,
    libc::RLIMIT_CORE,
    libc::RLIMIT_CPU,
    libc::RLIMIT_DATA,
];

/// The (soft, hard) values of [`RESOURCES`], in that order: what the child sets. Plain
/// integers, so that a pre-built sandbox receives them as bytes (`encode`/`decode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RlimitValues([(u64, u64); 5]);

impl RlimitValues {
    /// Bytes of [`RlimitValues::encode`].
    pub(crate) const ENCODED_LEN: usize = 80;

    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        for (soft, hard) in self.0 {
            out.extend_from_slice(&soft.to_ne_bytes());
            out.extend_from_slice(&hard.to_ne_bytes());
        }
    }

    /// The inverse of [`RlimitValues::encode`] (async-signal-safe: no allocation).
    pub(crate) fn decode(bytes: &[u8]) -> Option<Self> {
        let bytes = bytes.get(..Self::ENCODED_LEN)?;
        let mut values = [(0u64, 0u64); 5];
        for (i, value) in values.iter_mut().enumerate() {
            let word = |at: usize| {
                let mut b = [0u8; 8];
                b.copy_from_slice(&bytes[at..at + 8]);
                u64::from_ne_bytes(b)
            };
            *value = (word(i * 16), word(i * 16 + 8));
        }
        Some(RlimitValues(values))
    }

    /// Child side (async-signal-safe).
    pub(crate) fn apply(&self) -> Result<(), Failure> {
        for (resource, (soft, hard)) in RESOURCES.iter().zip(self.0) {
            let limit = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            // SAFETY: `limit` is a valid rlimit value.
            sys::check_int(unsafe { libc::setrlimit(*resource, &limit) }).at(Step::Rlimits)?;
        }
        Ok(())
    }
}

/// Prepared `setrlimit` calls (built before `clone`).
pub(crate) struct RlimitPlan {
    values: RlimitValues,
    report: RlimitReport,
}

impl RlimitPlan {
    pub(crate) fn prepare(want: Rlimits) -> Result<Self, RlimitError> {
        let cpu = cpu_seconds(want.timeout);
        let nofile = clamp(libc::RLIMIT_NOFILE, "nofile", want.nofile, want.nofile)?;
        let fsize = clamp(
            libc::RLIMIT_FSIZE,
            "fsize",
            want.fsize_bytes,
            want.fsize_bytes,
        )?;
        let core = clamp(libc::RLIMIT_CORE, "core", 0, 0)?;
        // Soft limit: SIGXCPU; one second later the hard limit SIGKILLs.
        let cpu_limit = clamp(libc::RLIMIT_CPU, "cpu", cpu, cpu + 1)?;
        let data = clamp(libc::RLIMIT_DATA, "data", u64::MAX, u64::MAX)?;
        let pair = |l: libc::rlimit| (l.rlim_cur, l.rlim_max);
        Ok(RlimitPlan {
            values: RlimitValues([
                pair(nofile),
                pair(fsize),
                pair(core),
                pair(cpu_limit),
                pair(data),
            ]),
            report: RlimitReport {
                nofile: nofile.rlim_cur,
                fsize_bytes: fsize.rlim_cur,
                core_bytes: core.rlim_cur,
                cpu_seconds: Some(cpu_limit.rlim_cur),
            },
        })
    }

    pub(crate) fn report(&self) -> RlimitReport {
        self.report
    }

    /// What the child sets.
    pub(crate) fn values(&self) -> RlimitValues {
        self.values
    }
}

/// CPU seconds for a wall-clock timeout: the timeout rounded up, plus one.
pub(crate) fn cpu_seconds(timeout: Duration) -> u64 {
    timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0) + 1
}

/// The limit `(soft, hard)`, lowered to the current hard limit if needed.
fn clamp(
    resource: libc::__rlimit_resource_t,
    name: &'static str,
    soft: u64,
    hard: u64,
) -> Result<libc::rlimit, RlimitError> {
    let mut current = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `current` is a valid out-pointer.
    if unsafe { libc::getrlimit(resource, &mut current) } == -1 {
        return Err(RlimitError::Read {
            name,
            source: io::Error::last_os_error(),
        });
    }
    let hard = hard.min(current.rlim_max);
    Ok(libc::rlimit {
        rlim_cur: soft.min(hard),
        rlim_max: hard,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_through_bytes() {
        let values = RlimitValues([(1, 2), (3, 4), (0, 0), (u64::MAX, u64::MAX), (7, 8)]);
        let mut bytes = Vec::new();
        values.encode(&mut bytes);
        assert_eq!(bytes.len(), RlimitValues::ENCODED_LEN);
        assert_eq!(RlimitValues::decode(&bytes), Some(values));
        assert_eq!(RlimitValues::decode(&bytes[..79]), None);
    }
}
