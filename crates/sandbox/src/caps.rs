//! Capabilities: every set emptied — bounding, ambient, inheritable, permitted and
//! effective — and the root-privilege securebits locked where we may set them.
//!
//! The bounding set matters most: the sandbox's processes run as uid 0 of their user
//! namespace (and a standard-mode sandbox may run as host root), and `execve` by uid 0
//! grants every capability of the bounding set. An empty bounding set plus
//! `no_new_privs` makes uid 0 capability-less for good.
//!
//! # Without `CAP_SETPCAP`
//!
//! Dropping from the bounding set needs `CAP_SETPCAP`, which an ordinary user's login
//! shell does not have (its bounding set is full, its permitted set empty). Such a
//! process cannot empty its bounding set, and need not: with `no_new_privs` set and the
//! permitted set empty, `execve` grants no more than the permitted set already holds
//! (the kernel intersects the new permitted set with the old one), so the bounding set
//! grants nothing. We then leave it as it is and *say so* ([`Dropped::bounding_set`]
//! is false), instead of failing or claiming a layer that is not in force.

use crate::step::{AtStep, Failure, Step};
use crate::sys;

/// One `thiserror` enum per module: capability failures outside the child.
#[derive(Debug, thiserror::Error)]
pub enum CapsError {
    #[error("cannot drop capabilities: {0}")]
    Drop(#[source] std::io::Error),
}

const CAP_SETPCAP: libc::c_ulong = 8;
const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

// securebits (linux/securebits.h)
const SECBIT_NOROOT: libc::c_ulong = 1 << 0;
const SECBIT_NOROOT_LOCKED: libc::c_ulong = 1 << 1;
const SECBIT_NO_SETUID_FIXUP: libc::c_ulong = 1 << 2;
const SECBIT_NO_SETUID_FIXUP_LOCKED: libc::c_ulong = 1 << 3;
const SECBIT_KEEP_CAPS_LOCKED: libc::c_ulong = 1 << 5;
const SECBIT_NO_CAP_AMBIENT_RAISE: libc::c_ulong = 1 << 6;
const SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED: libc::c_ulong = 1 << 7;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// What [`drop_all_but`] achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dropped {
    /// The bounding set is empty (dropped now or already empty). False only for a
    /// process without `CAP_SETPCAP`, see the module docs.
    pub bounding_set: bool,
    /// The capabilities of `keep` that were permitted and so stay.
    pub kept: u64,
}

/// Empties the calling thread's bounding set where it holds `CAP_SETPCAP`
/// (async-signal-safe). The sandbox's child does this before its call (a pre-built
/// sandbox while it waits for one): the bounding set only limits what a later `execve`
/// may grant, so the capabilities the rest of the setup uses (mounting the workspace)
/// stay effective until [`drop_all`].
///
/// `require_empty`: fail when a capability stays in the set and we lack `CAP_SETPCAP`
/// to drop it — set when the isolation report promised an empty one.
pub(crate) fn empty_bounding_set(require_empty: bool) -> Result<(), Failure> {
    let emptied = effective_has(CAP_SETPCAP).and_then(|can_setpcap| {
        if can_setpcap {
            drop_bounding_set().map(|()| true)
        } else {
            // Read only when it matters: 64 system calls otherwise spent for nothing.
            Ok(!require_empty || bounding_set_empty())
        }
    });
    match emptied {
        Ok(false) if require_empty => Err(libc::EPERM),
        Ok(_) => Ok(()),
        Err(e) => Err(e),
    }
    .at(Step::DropCapabilities)
}

/// Drops every other capability of the calling thread (async-signal-safe): ambient,
/// inheritable, permitted and effective, with the root securebits locked. The
/// bounding set was emptied before ([`empty_bounding_set`]).
pub(crate) fn drop_all() -> Result<(), Failure> {
    drop_sets_except(0).map(drop).at(Step::DropCapabilities)
}

/// For callers outside the child: drops every capability but those in `keep` (a bit
/// mask) that are permitted now, which stay permitted and effective; empties the
/// bounding set where this process may.
pub(crate) fn drop_all_but(keep: u64) -> Result<Dropped, CapsError> {
    drop_all_except(keep).map_err(|e| CapsError::Drop(std::io::Error::from_raw_os_error(e)))
}

/// `CAP_SETFCAP` as a mask for [`drop_all_but`].
pub(crate) const SETFCAP_MASK: u64 = 1 << 31;

/// Whether a process in this state ends with an empty bounding set after
/// [`drop_all_but`]: it holds `CAP_SETPCAP`, or the set is empty already.
pub(crate) fn bounding_set_can_be_emptied() -> bool {
    effective_has(CAP_SETPCAP).unwrap_or(false) || bounding_set_empty()
}

fn bounding_set_empty() -> bool {
    (0..64u32).all(|cap| {
        // SAFETY: prctl with integer arguments only.
        let present =
            unsafe { libc::prctl(libc::PR_CAPBSET_READ, libc::c_ulong::from(cap), 0, 0, 0) };
        present != 1
    })
}

fn drop_all_except(keep: u64) -> Result<Dropped, i32> {
    // 1. Bounding set: what execve can ever grant. Without CAP_SETPCAP it stays (and is
    //    inert under no_new_privs with an empty permitted set, see the module docs).
    if effective_has(CAP_SETPCAP)? {
        drop_bounding_set()?;
    }
    drop_sets_except(keep)
}

/// Empties the bounding set; the caller holds `CAP_SETPCAP`. Dropping a capability that
/// is not in the set succeeds, so each one is dropped without reading it first: one
/// system call per capability, not two, in a sequence every sandbox runs.
fn drop_bounding_set() -> Result<(), i32> {
    for cap in 0..64u32 {
        // SAFETY: prctl with integer arguments only.
        match sys::check_int(unsafe {
            libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0)
        }) {
            Ok(_) => {}
            // Past the last capability this kernel knows.
            Err(libc::EINVAL) => break,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Steps 2–4 of [`drop_all_except`]: everything but the bounding set.
fn drop_sets_except(keep: u64) -> Result<Dropped, i32> {
    let can_setpcap = effective_has(CAP_SETPCAP)?;
    // Only what is permitted can stay: capset refuses to raise anything.
    let keep = keep & permitted()?;

    // 2. Ambient set (EINVAL before Linux 4.3, where it does not exist).
    // SAFETY: prctl with integer arguments only.
    let ret = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if ret == -1 && sys::errno() != libc::EINVAL {
        return Err(sys::errno());
    }

    // 3. Securebits: uid 0 gets no capabilities from exec or setuid, locked.
    if can_setpcap {
        let bits = SECBIT_NOROOT
            | SECBIT_NOROOT_LOCKED
            | SECBIT_NO_SETUID_FIXUP
            | SECBIT_NO_SETUID_FIXUP_LOCKED
            | SECBIT_KEEP_CAPS_LOCKED
            | SECBIT_NO_CAP_AMBIENT_RAISE
            | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED;
        // SAFETY: prctl with integer arguments only.
        sys::check_int(unsafe { libc::prctl(libc::PR_SET_SECUREBITS, bits, 0, 0, 0) })?;
    }

    // 4. Effective and permitted sets: empty but for `keep`; inheritable: empty.
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    for (word, d) in data.iter_mut().enumerate() {
        // The low 32 bits of the shifted mask: the kernel takes the set as two words.
        let bits = u32::try_from((keep >> (32 * word)) & u64::from(u32::MAX)).unwrap_or(0);
        d.effective = bits;
        d.permitted = bits;
    }
    // SAFETY: header and data are valid, correctly sized capset arguments.
    sys::check(unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) })?;
    Ok(Dropped {
        bounding_set: can_setpcap || bounding_set_empty(),
        kept: keep,
    })
}

/// The calling thread's capability sets (async-signal-safe).
fn capget() -> Result<[CapData; 2], i32> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: header and data are valid, correctly sized capget arguments.
    sys::check(unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) })?;
    Ok(data)
}

/// Whether the calling thread's effective set holds `cap` (async-signal-safe).
fn effective_has(cap: libc::c_ulong) -> Result<bool, i32> {
    let data = capget()?;
    let word = (cap / 32) as usize;
    Ok(data[word].effective & (1 << (cap % 32)) != 0)
}

/// The calling thread's permitted set as a bit mask (async-signal-safe).
fn permitted() -> Result<u64, i32> {
    let data = capget()?;
    Ok(u64::from(data[0].permitted) | (u64::from(data[1].permitted) << 32))
}
