//! A call as a pre-built sandbox receives it: the per-call part of the child's plan
//! (workspace source, working directory, rlimits, `execve` candidates, argv, envp)
//! encoded by the worker into one message, and decoded by the child into a buffer
//! and a pointer array it had before `clone` — no allocation after the fork.
//!
//! Layout (native endianness): a magic number (u32), the rlimits
//! ([`RlimitValues::ENCODED_LEN`] bytes), the numbers of candidates, arguments and
//! environment entries (u32 each), then the NUL-terminated strings in that order:
//! workspace source, working directory, candidates, arguments, environment.

use std::ffi::CStr;

use super::Call;
use super::plan::{CallView, ExecPlan, ExecView};
use crate::rlimits::RlimitValues;

/// Bytes of the largest call a pre-built sandbox accepts: argument and environment
/// strings well beyond a shell command's, in sixteen pages the child never touches
/// unless a call fills them. A larger call runs in a fresh sandbox.
pub(super) const CALL_BYTES: usize = 64 << 10;

/// Pointers (candidates, arguments and environment entries, plus two terminators) a
/// pre-built sandbox can hold.
pub(super) const CALL_POINTERS: usize = 2048;

const MAGIC: u32 = 0x4149_5231;
const HEADER: usize = 4 + RlimitValues::ENCODED_LEN + 12;

/// Why a call does not fit a pre-built sandbox (it then runs in a fresh one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TooLarge {
    Bytes(usize),
    Pointers(usize),
}

impl std::fmt::Display for TooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TooLarge::Bytes(n) => write!(
                f,
                "the call takes {n} bytes, more than the {CALL_BYTES} a pre-built sandbox holds"
            ),
            TooLarge::Pointers(n) => write!(
                f,
                "the call has {n} strings, more than the {CALL_POINTERS} a pre-built sandbox holds"
            ),
        }
    }
}

/// The worker's side: the call as one message, or why it does not fit.
pub(super) fn encode(call: &Call) -> Result<Vec<u8>, TooLarge> {
    encode_view(&call.exec, call.view())
}

fn encode_view(exec: &ExecPlan, view: CallView<'_>) -> Result<Vec<u8>, TooLarge> {
    let pointers = exec.candidates.len() + exec.argv.len() + exec.envp.len() + 2;
    if pointers > CALL_POINTERS {
        return Err(TooLarge::Pointers(pointers));
    }
    let strings = [view.workspace_source, view.cwd]
        .into_iter()
        .chain(exec.candidates.iter().map(|c| c.as_c_str()))
        .chain(exec.argv.iter().map(|c| c.as_c_str()))
        .chain(exec.envp.iter().map(|c| c.as_c_str()));
    let size = HEADER
        + strings
            .clone()
            .map(|s| s.to_bytes_with_nul().len())
            .sum::<usize>();
    if size > CALL_BYTES {
        return Err(TooLarge::Bytes(size));
    }
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&MAGIC.to_ne_bytes());
    view.rlimits.encode(&mut out);
    for n in [exec.candidates.len(), exec.argv.len(), exec.envp.len()] {
        // Bounded by CALL_POINTERS above.
        out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_ne_bytes());
    }
    for s in strings {
        out.extend_from_slice(s.to_bytes_with_nul());
    }
    Ok(out)
}

/// The child's side: the call in `bytes`, with `pointers` filled to point into it
/// (async-signal-safe: no allocation). `None` when the message is malformed.
pub(super) fn decode<'a>(
    bytes: &'a [u8],
    pointers: &'a mut [*const libc::c_char],
) -> Option<CallView<'a>> {
    let word = |at: usize| -> Option<usize> {
        let b = bytes.get(at..at + 4)?;
        usize::try_from(u32::from_ne_bytes([b[0], b[1], b[2], b[3]])).ok()
    };
    if word(0)? != MAGIC as usize {
        return None;
    }
    let rlimits = RlimitValues::decode(bytes.get(4..)?)?;
    let counts_at = 4 + RlimitValues::ENCODED_LEN;
    let (candidates, argv, env) = (word(counts_at)?, word(counts_at + 4)?, word(counts_at + 8)?);
    if candidates + argv + env + 2 > pointers.len() || argv == 0 {
        return None;
    }
    let mut at = HEADER;
    let mut next = || -> Option<&'a CStr> {
        let s = CStr::from_bytes_until_nul(bytes.get(at..)?).ok()?;
        at += s.to_bytes_with_nul().len();
        Some(s)
    };
    let workspace_source = next()?;
    let cwd = next()?;
    let argv_at = candidates;
    let envp_at = candidates + argv + 1;
    for i in 0..candidates + argv + env {
        let slot = if i < candidates + argv { i } else { i + 1 };
        pointers[slot] = next()?.as_ptr();
    }
    pointers[argv_at + argv] = std::ptr::null();
    pointers[envp_at + env] = std::ptr::null();
    if at != bytes.len() {
        return None;
    }
    let pointers: &'a [*const libc::c_char] = pointers;
    Some(CallView {
        workspace_source,
        cwd,
        rlimits,
        exec: ExecView {
            candidates: &pointers[..candidates],
            argv: pointers[argv_at..].as_ptr(),
            envp: pointers[envp_at..].as_ptr(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rlimits::{RlimitPlan, Rlimits};

    fn exec(argv: &[&str]) -> ExecPlan {
        let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        let env = vec![("PATH".to_owned(), "/usr/bin:/bin".to_owned())];
        ExecPlan::prepare(&argv, &env).expect("exec plan")
    }

    fn view<'a>(exec: &'a ExecPlan, rlimits: RlimitValues) -> CallView<'a> {
        CallView {
            workspace_source: c"/oldroot/srv/ws",
            cwd: c"/workspace/sub",
            rlimits,
            exec: exec.view(),
        }
    }

    fn rlimits() -> RlimitValues {
        RlimitPlan::prepare(Rlimits {
            nofile: 64,
            fsize_bytes: 1 << 20,
            timeout: std::time::Duration::from_secs(5),
        })
        .expect("rlimits")
        .values()
    }

    /// The strings behind a NULL-terminated pointer array.
    fn strings(mut p: *const *const libc::c_char) -> Vec<String> {
        let mut out = Vec::new();
        // SAFETY: `p` is a NULL-terminated array of NUL-terminated strings (test data).
        unsafe {
            while !(*p).is_null() {
                out.push(CStr::from_ptr(*p).to_string_lossy().into_owned());
                p = p.add(1);
            }
        }
        out
    }

    #[test]
    fn a_call_round_trips_into_the_buffers_made_before_clone() {
        let exec = exec(&["sh", "-c", "echo hi"]);
        let limits = rlimits();
        let message = encode_view(&exec, view(&exec, limits)).expect("fits");
        let mut pointers = vec![std::ptr::null(); CALL_POINTERS];
        let call = decode(&message, &mut pointers).expect("decodes");
        assert_eq!(call.workspace_source, c"/oldroot/srv/ws");
        assert_eq!(call.cwd, c"/workspace/sub");
        assert_eq!(call.rlimits, limits);
        let candidates: Vec<String> = call
            .exec
            .candidates
            .iter()
            // SAFETY: each candidate points at a NUL-terminated string in `message`.
            .map(|&c| unsafe { CStr::from_ptr(c) }.to_string_lossy().into_owned())
            .collect();
        assert_eq!(candidates, ["/usr/bin/sh", "/bin/sh"]);
        assert_eq!(strings(call.exec.argv), ["sh", "-c", "echo hi"]);
        assert_eq!(strings(call.exec.envp), ["PATH=/usr/bin:/bin"]);
    }

    #[test]
    fn a_malformed_call_is_refused() {
        let exec = exec(&["true"]);
        let message = encode_view(&exec, view(&exec, rlimits())).expect("fits");
        let mut pointers = vec![std::ptr::null(); CALL_POINTERS];
        // Cut short, one byte too many, or another magic number: refused.
        assert!(decode(&message[..message.len() - 1], &mut pointers).is_none());
        let mut longer = message.clone();
        longer.push(0);
        assert!(decode(&longer, &mut pointers).is_none());
        let mut wrong = message.clone();
        wrong[0] ^= 1;
        assert!(decode(&wrong, &mut pointers).is_none());
        // Fewer pointers than the call has strings: refused, not overrun.
        let mut few = vec![std::ptr::null(); 3];
        assert!(decode(&message, &mut few).is_none());
    }

    #[test]
    fn a_call_larger_than_the_buffer_does_not_fit() {
        let big = "x".repeat(CALL_BYTES);
        let plan = exec(&["echo", &big]);
        assert!(matches!(
            encode_view(&plan, view(&plan, rlimits())),
            Err(TooLarge::Bytes(n)) if n > CALL_BYTES
        ));
        let many: Vec<String> = (0..CALL_POINTERS).map(|i| i.to_string()).collect();
        let many: Vec<&str> = std::iter::once("echo")
            .chain(many.iter().map(String::as_str))
            .collect();
        let plan = exec(&many);
        assert!(matches!(
            encode_view(&plan, view(&plan, rlimits())),
            Err(TooLarge::Pointers(_))
        ));
    }
}
