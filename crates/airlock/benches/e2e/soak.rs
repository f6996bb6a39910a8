//! The soak (DESIGN §15): many calls at a steady concurrency against one `airlock up`,
//! and what its memory and its store do meanwhile. Selected with
//! `cargo bench -p airlock --bench e2e -- soak` (it replaces the other rows).
//!
//! The mix, by call index: one in ten reads the 1 MiB file, two in ten run
//! `execute_shell` (`echo ok`, a fresh sandbox each), the rest read the 100-byte file.
//! Every answer is checked as in the other rows. Every [`SAMPLE_EVERY`] calls the
//! orchestrator's resident memory (`VmRSS`) and the store's size on disk (`airlock.db`
//! with its WAL) are sampled; the report gives them after warm-up, at the middle and at
//! the end, the peak, and the store's growth per call.

use super::*;

/// Calls in the soak (`AIRLOCK_BENCH_SOAK_CALLS` sets another count, for a shorter run
/// that still passes the warm-up) and workers sending them.
const SOAK_CALLS: usize = 100_000;
const SOAK_CONCURRENCY: usize = 16;
/// The soak stops here even if calls remain; the report says how many were made.
const SOAK_TIME_CAP: Duration = Duration::from_secs(30 * 60);
/// Calls before the first sample that counts ("after warm-up").
const WARMUP_CALLS: usize = 10_000;
const SAMPLE_EVERY: usize = 5_000;

/// One sample: calls done, orchestrator RSS (bytes), store size (bytes).
#[derive(Debug, Clone, Copy)]
struct Sample {
    calls: usize,
    rss: u64,
    store: u64,
}

pub async fn run(airlock: &Airlock, files: [&BenchFile; 3]) -> Result<String> {
    let soak_calls = match std::env::var("AIRLOCK_BENCH_SOAK_CALLS") {
        Ok(n) => n
            .parse::<usize>()
            .ok()
            .filter(|n| *n > WARMUP_CALLS)
            .with_context(|| {
                format!("AIRLOCK_BENCH_SOAK_CALLS={n}: give a count above the {WARMUP_CALLS} calls of warm-up")
            })?,
        Err(_) => SOAK_CALLS,
    };
    let target = airlock.target();
    let orchestrator = orchestrator_pid(airlock.process.child.id())?;
    // Each worker before its first call: what an idle replica costs.
    let idle_workers: Vec<(String, u64)> = descendants(airlock.process.child.id())
        .into_iter()
        .filter_map(|pid| {
            let args = cmdline(pid);
            let at = args.iter().position(|a| a == "worker")?;
            let group = args.get(at + 1)?.clone();
            Some((group, rss_bytes(pid).ok()?))
        })
        .collect();
    let store = airlock.data_dir.join("airlock.db");
    let bodies: Vec<Vec<u8>> = files
        .iter()
        .map(|f| target.body(f))
        .collect::<Result<_>>()?;
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let samples = std::sync::Mutex::new(vec![Sample {
        calls: 0,
        rss: rss_bytes(orchestrator)?,
        store: store_bytes(&store),
    }]);
    let started = Instant::now();
    let deadline = started + SOAK_TIME_CAP;
    let workers = (0..SOAK_CONCURRENCY).map(|_| {
        let (next, done, samples, bodies, target, store) =
            (&next, &done, &samples, &bodies, &target, &store);
        async move {
            let client = client()?;
            let mut latencies = Vec::new();
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= soak_calls || Instant::now() >= deadline {
                    break;
                }
                let which = match index % 10 {
                    0 => 1,
                    1 | 2 => 2,
                    _ => 0,
                };
                let sent = Instant::now();
                let response = target
                    .request(&client, &bodies[which])
                    .send()
                    .await
                    .context("soak: request failed")?;
                let status = response.status();
                let bytes = response.bytes().await.context("soak: reading failed")?;
                latencies.push(sent.elapsed());
                target.verify(status, &bytes, files[which])?;
                let finished = done.fetch_add(1, Ordering::Relaxed) + 1;
                if finished % SAMPLE_EVERY == 0 {
                    let sample = Sample {
                        calls: finished,
                        rss: rss_bytes(orchestrator)?,
                        store: store_bytes(store),
                    };
                    eprintln!(
                        "soak: {} calls, orchestrator RSS {:.1} MiB, store {:.1} MiB",
                        sample.calls,
                        mib(sample.rss),
                        mib(sample.store)
                    );
                    if let Ok(mut all) = samples.lock() {
                        all.push(sample);
                    }
                }
            }
            Ok::<_, anyhow::Error>(latencies)
        }
    });
    let per_worker = futures::future::try_join_all(workers).await?;
    let wall = started.elapsed();
    let calls = done.load(Ordering::Relaxed);
    let mut latencies: Vec<Duration> = per_worker.into_iter().flatten().collect();
    latencies.sort();
    let mut samples = samples
        .into_inner()
        .map_err(|_| anyhow::anyhow!("a soak worker panicked"))?;
    samples.push(Sample {
        calls,
        rss: rss_bytes(orchestrator)?,
        store: store_bytes(&store),
    });
    let mut out = report(&samples, calls, wall, &latencies);
    // What the end's resident memory is made of: the heap and other private memory, and
    // pages of files (the binary, mostly), which the page cache shares.
    let _ = writeln!(
        out,
        "| end, by kind | anonymous {:.1} MiB, file {:.1} MiB |",
        mib(status_bytes(orchestrator, "RssAnon")?),
        mib(status_bytes(orchestrator, "RssFile")?)
    );
    let idle: Vec<String> = idle_workers
        .iter()
        .map(|(group, rss)| format!("{group} {:.1} MiB", mib(*rss)))
        .collect();
    let _ = writeln!(
        out,
        "| idle workers, before the first call | {} |",
        idle.join(", ")
    );
    Ok(out)
}

fn report(samples: &[Sample], calls: usize, wall: Duration, latencies: &[Duration]) -> String {
    let at = |n: usize| {
        samples
            .iter()
            .find(|s| s.calls >= n)
            .or(samples.last())
            .copied()
    };
    let warm = at(WARMUP_CALLS);
    let middle = at(calls / 2);
    let last = samples.last().copied();
    let after_warmup: Vec<&Sample> = samples.iter().filter(|s| s.calls >= WARMUP_CALLS).collect();
    let peak = after_warmup.iter().map(|s| s.rss).max().unwrap_or(0);
    let low = after_warmup.iter().map(|s| s.rss).min().unwrap_or(0);
    let first = samples.first().copied();
    let growth = match (first, last) {
        (Some(f), Some(l)) if calls > 0 => (l.store.saturating_sub(f.store)) as f64 / calls as f64,
        _ => 0.0,
    };
    let fmt = |s: Option<Sample>| {
        s.map_or("–".to_owned(), |s| {
            format!(
                "{:.1} MiB (store {:.1} MiB) at {} calls",
                mib(s.rss),
                mib(s.store),
                s.calls
            )
        })
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "### Soak: {calls} calls at concurrency {SOAK_CONCURRENCY} in {:.0} s ({:.0}/s; p50 {:.2} ms, p99 {:.2} ms)\n",
        wall.as_secs_f64(),
        calls as f64 / wall.as_secs_f64().max(1e-9),
        percentile(latencies, 0.5).map_or(0.0, |d| d.as_secs_f64() * 1000.0),
        percentile(latencies, 0.99).map_or(0.0, |d| d.as_secs_f64() * 1000.0),
    );
    let _ = writeln!(out, "| | orchestrator RSS |");
    let _ = writeln!(out, "|---|---|");
    let _ = writeln!(out, "| start | {} |", fmt(first));
    let _ = writeln!(out, "| after warm-up | {} |", fmt(warm));
    let _ = writeln!(out, "| middle | {} |", fmt(middle));
    let _ = writeln!(out, "| end | {} |", fmt(last));
    let _ = writeln!(
        out,
        "| after warm-up: lowest, peak | {:.1} MiB, {:.1} MiB ({:+.1} MiB) |",
        mib(low),
        mib(peak),
        mib(peak) - mib(low)
    );
    let _ = writeln!(
        out,
        "| store growth | {:.1} KiB per call on average |",
        growth / 1024.0
    );
    out
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// `VmRSS` of a process, in bytes.
fn rss_bytes(pid: u32) -> Result<u64> {
    status_bytes(pid, "VmRSS")
}

/// A memory field of `/proc/<pid>/status` (given in KiB there), in bytes.
fn status_bytes(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("cannot read /proc/{pid}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))?;
    Ok(kib * 1024)
}

/// The SQLite store and its write-ahead log, in bytes (0 when absent).
fn store_bytes(db: &Path) -> u64 {
    ["", "-wal"]
        .iter()
        .filter_map(|suffix| std::fs::metadata(format!("{}{suffix}", db.display())).ok())
        .map(|m| m.len())
        .sum()
}

/// The arguments of a process (empty when it is gone).
fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// `root` and every process below it.
fn descendants(root: u32) -> Vec<u32> {
    let mut all = Vec::new();
    let mut frontier = vec![root];
    while let Some(pid) = frontier.pop() {
        all.push(pid);
        let children =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        frontier.extend(
            children
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok()),
        );
    }
    all
}

/// The orchestrator among `airlock up`'s processes (`airlock serve orchestrator`), or
/// `airlock up` itself.
fn orchestrator_pid(root: u32) -> Result<u32> {
    Ok(descendants(root)
        .into_iter()
        .find(|pid| {
            cmdline(*pid)
                .windows(2)
                .any(|w| w[0] == "serve" && w[1] == "orchestrator")
        })
        .unwrap_or(root))
}
