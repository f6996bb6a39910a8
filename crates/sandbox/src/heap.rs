//! How Airlock's processes use the C allocator. The orchestrator keeps no large buffer
//! in its heaps; the workers that answer with large results keep theirs warm while they
//! work and give them back once idle.
//!
//! glibc's `malloc` serves a request of at least its mmap threshold (128 KiB to start
//! with) from a mapping of its own, and raises the threshold to the size of each such
//! buffer that is freed, up to 32 MiB. After the first 1 MiB result had come and gone,
//! the orchestrator therefore carved every later 1 MiB buffer (a worker's answer as
//! decoded, a result kept for `GET /v1/calls/{id}`, the answer written to the client) out
//! of its heaps, one per thread that asked; what was freed there stayed resident as holes
//! between smaller blocks that live on.
//!
//! Setting the threshold explicitly turns that adjustment off: every buffer of 128 KiB
//! or more is mapped when allocated and given back to the kernel when freed, so what the
//! process holds is what it uses. The price is the page faults of a fresh mapping for
//! each large buffer. Measured on the soak's mix (DESIGN §15): the orchestrator's
//! anonymous memory 12 to 21 MiB lower after 30 000 calls, the soak's throughput 5 to 8 %
//! lower (docs/decisions.md, "Large buffers are mapped, not kept in the heap").

/// One `thiserror` enum per module: the allocator refused a setting.
#[derive(Debug, thiserror::Error)]
pub enum HeapError {
    #[error(
        "the C allocator refused {parameter} = {bytes} bytes (mallopt); is this binary linked against glibc?"
    )]
    Refused {
        parameter: &'static str,
        bytes: libc::c_int,
    },
}

/// The size from which an orchestrator's buffer is a mapping of its own: glibc's
/// initial threshold, kept fixed.
const MMAP_THRESHOLD_BYTES: libc::c_int = 128 * 1024;

/// Fixes the allocator's mmap threshold at 128 KiB (`MMAP_THRESHOLD_BYTES`), for the whole
/// process. Call it at start, before threads allocate.
pub fn map_large_buffers() -> Result<(), HeapError> {
    set(
        "M_MMAP_THRESHOLD",
        libc::M_MMAP_THRESHOLD,
        MMAP_THRESHOLD_BYTES,
    )
}

/// The size from which a worker's buffer is a mapping of its own (rare: results are
/// capped below it by default; gRPC's limit is 32 MiB).
const WARM_MMAP_THRESHOLD_BYTES: libc::c_int = 8 << 20;
/// How much free memory each of a worker's heaps may keep at its top between calls.
const WARM_TRIM_THRESHOLD_BYTES: libc::c_int = 8 << 20;

/// Keeps a worker's large buffers in its heaps, warm, between calls.
///
/// A worker's large buffers live for one call: a 1 MiB result's text, and tonic's
/// buffer that encodes it. Left to glibc, each was a fresh mapping or a fresh stretch
/// of heap given back when freed (its trim threshold follows the largest buffer
/// freed), so every 1 MiB read took about 480 page faults in the fs worker, and the
/// kernel's fault and unmap paths a fifth of its CPU. With buffers under 8 MiB served
/// from the heaps, and up to 8 MiB of free memory kept at each heap's top, the next
/// call reuses the pages the last one used. What is kept is given back once the worker
/// is idle ([`give_back_free_memory`], which the worker server calls), so an idle
/// worker holds what it held before its first call. One arena for every thread
/// (`M_ARENA_MAX` = 1): `malloc_trim` shrinks only the main arena's top, and a heap
/// per thread would each keep up to 8 MiB. The workers this is for run their async side
/// on one thread and do their work in system calls, so the one arena's lock is seldom
/// contended. Call it at start, before threads allocate.
pub fn keep_large_buffers() -> Result<(), HeapError> {
    set("M_ARENA_MAX", libc::M_ARENA_MAX, 1)?;
    set(
        "M_MMAP_THRESHOLD",
        libc::M_MMAP_THRESHOLD,
        WARM_MMAP_THRESHOLD_BYTES,
    )?;
    set(
        "M_TRIM_THRESHOLD",
        libc::M_TRIM_THRESHOLD,
        WARM_TRIM_THRESHOLD_BYTES,
    )
}

/// Gives the free memory of every heap back to the kernel (`malloc_trim(0)`): the top
/// of each heap, and the free pages inside it. It walks every arena under its lock,
/// so it runs off the async threads and only when the process is idle.
pub fn give_back_free_memory() {
    // SAFETY: `malloc_trim` works on glibc's own arenas under their locks; it frees
    // only memory the allocator holds as free and touches no memory of ours.
    unsafe { libc::malloc_trim(0) };
}

fn set(parameter: &'static str, option: libc::c_int, bytes: libc::c_int) -> Result<(), HeapError> {
    // SAFETY: `mallopt` only changes a parameter of glibc's allocator, under the
    // allocator's own lock; it touches no memory of ours and takes plain integers.
    if unsafe { libc::mallopt(option, bytes) } == 1 {
        Ok(())
    } else {
        Err(HeapError::Refused { parameter, bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes in the process's mapped (not heap) allocations, as glibc counts them.
    fn mapped_bytes() -> usize {
        // SAFETY: `mallinfo2` fills and returns a plain struct of counters.
        unsafe { libc::mallinfo2() }.hblkhd
    }

    /// The behaviour itself, in a process of its own: other tests of this binary allocate
    /// on other threads, which would move the counter under the test.
    const CHILD: &str = "AIRLOCK_HEAP_TEST_CHILD";

    #[test]
    fn a_large_buffer_stays_a_mapping_after_a_larger_one_was_freed() {
        if std::env::var_os(CHILD).is_some() {
            child(std::env::var(CHILD).as_deref() == Ok("fixed"));
            return;
        }
        for (mode, expect_mapped) in [("fixed", true), ("glibc-default", false)] {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "heap::tests::a_large_buffer_stays_a_mapping_after_a_larger_one_was_freed",
                    "--test-threads=1",
                    "--nocapture",
                ])
                .env(CHILD, mode)
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{mode}: {stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let line = format!("mapped while alive: {expect_mapped}");
            assert!(
                stdout.contains(&line),
                "{mode}: expected {line:?} in {stdout}"
            );
        }
    }

    /// Frees a 2 MiB buffer (which raises glibc's threshold to 2 MiB unless it is fixed),
    /// then allocates 1 MiB and says whether that buffer is a mapping of its own.
    fn child(fixed: bool) {
        if fixed {
            map_large_buffers().unwrap();
        }
        let larger = std::hint::black_box(vec![1u8; 2 << 20]);
        drop(larger);
        let before = mapped_bytes();
        let buffer = std::hint::black_box(vec![1u8; 1 << 20]);
        let mapped = mapped_bytes() >= before + buffer.len();
        drop(buffer);
        let after = mapped_bytes();
        println!("mapped while alive: {mapped}");
        if mapped {
            assert_eq!(after, before, "freed, the mapping is given back");
        }
    }
}
