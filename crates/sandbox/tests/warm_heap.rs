//! A worker's heap kept warm (`airlock_sandbox::heap::keep_large_buffers`), in a process
//! of its own whose main thread sets it before any other thread exists, as a worker
//! does. A call's two 1 MiB buffers — the result's text, made on another thread as on
//! a worker's blocking pool, and its encoding, made on the main thread — come from the
//! pages the last call used; once given back (`give_back_free_memory`) those pages leave
//! the resident set. The control, glibc's defaults, faults in fresh pages on every call.
//!
//! Without libtest (`harness = false`): libtest runs each test on a thread of its own,
//! which has an arena of its own before the test can set anything.

use std::process::{Command, ExitCode};

const MODE: &str = "AIRLOCK_WARM_HEAP_MODE";
const MIB: usize = 1 << 20;
/// Page faults a call takes at most with a warm heap (the stack, a thread's start).
const WARM_FAULTS_AT_MOST: u64 = 64;

fn main() -> ExitCode {
    match std::env::var(MODE).as_deref() {
        Ok("warm") => child(true),
        Ok("default") => child(false),
        _ => parent(),
    }
}

/// Runs both modes and compares what they report.
fn parent() -> ExitCode {
    let run = |mode: &str| -> Result<(u64, usize), String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let out = Command::new(exe)
            .env(MODE, mode)
            .output()
            .map_err(|e| e.to_string())?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            return Err(format!(
                "{mode}: {stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let field = |name: &str| -> Result<u64, String> {
            stdout
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(|| format!("{mode}: no {name:?} in {stdout}"))
        };
        Ok((
            field("faults per call:")?,
            usize::try_from(field("given back:")?).map_err(|e| e.to_string())?,
        ))
    };
    let checks = || -> Result<(), String> {
        let (warm_faults, given_back) = run("warm")?;
        let (default_faults, _) = run("default")?;
        println!(
            "faults per call: warm {warm_faults}, glibc's defaults {default_faults}; \
             warm, given back when idle: {given_back} bytes"
        );
        if warm_faults > WARM_FAULTS_AT_MOST {
            return Err(format!(
                "a warm heap took {warm_faults} faults a call (at most {WARM_FAULTS_AT_MOST})"
            ));
        }
        // The control shows the test can tell: two fresh 1 MiB buffers are 512 pages.
        if default_faults < 256 {
            return Err(format!(
                "glibc's defaults took only {default_faults} faults a call: the test no longer \
                 tells a warm heap from a cold one"
            ));
        }
        if given_back < 2 * MIB {
            return Err(format!(
                "giving the free memory back left it resident ({given_back} bytes left the \
                 resident set, at least {} expected)",
                2 * MIB
            ));
        }
        Ok(())
    };
    match checks() {
        Ok(()) => {
            println!("warm_heap: ok");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("warm_heap: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One call's buffers as a worker makes them: the text grown line by line (as
/// `read_file` appends lines), then its encoding grown from a small buffer (as tonic's
/// encoder does), on a thread that is not the main one (a worker's blocking pool), and
/// freed on the main thread.
fn call() -> Result<(), String> {
    let (text, encoded) = std::thread::spawn(|| {
        // A 1 MiB file and a little more (a line's end, a note): past 1 MiB, so
        // doubling leaves a 2 MiB buffer, as it does for a 1 MiB read's answer.
        let mut text = Vec::new();
        for _ in 0..MIB / 64 + 1 {
            text.extend_from_slice(&[b'a'; 64]);
        }
        let mut encoded = Vec::with_capacity(8 * 1024);
        for chunk in text.chunks(16 * 1024) {
            encoded.extend_from_slice(chunk);
        }
        (std::hint::black_box(text), std::hint::black_box(encoded))
    })
    .join()
    .map_err(|_| "the thread making the buffers panicked".to_owned())?;
    drop(text);
    drop(encoded);
    Ok(())
}

fn child(warm: bool) -> ExitCode {
    let result = (|| -> Result<(), String> {
        if warm {
            airlock_sandbox::heap::keep_large_buffers().map_err(|e| e.to_string())?;
        }
        call()?;
        call()?;
        let before = minor_faults()?;
        const CALLS: u64 = 5;
        for _ in 0..CALLS {
            call()?;
        }
        println!("faults per call: {}", (minor_faults()? - before) / CALLS);
        let kept = resident_bytes()?;
        airlock_sandbox::heap::give_back_free_memory();
        println!("given back: {}", kept.saturating_sub(resident_bytes()?));
        Ok(())
    })();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// The process's minor page faults so far (`/proc/self/stat`, its 10th field).
fn minor_faults() -> Result<u64, String> {
    let stat = std::fs::read_to_string("/proc/self/stat").map_err(|e| e.to_string())?;
    // The fields after the command's name, which ends at the last ')'.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(7))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("cannot read /proc/self/stat: {stat:?}"))
}

/// The process's resident set (`VmRSS` in `/proc/self/status`).
fn resident_bytes() -> Result<usize, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| "no VmRSS in /proc/self/status".to_owned())
}
