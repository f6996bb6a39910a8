//! The gate's own cost per call (DESIGN §15 goal: at most 100 µs of CPU at the median):
//! authentication, schema validation, Cedar, budgets, the store and the audit chain, with
//! an in-process worker that answers `read_file` at once (the real tool's definition, a
//! fixed answer), so that what is left is the gate and the gRPC hop to the worker.
//!
//! Run: `cargo bench -p airlock-orchestrator --bench gate`. Three rows:
//! - `gate/cpu_per_call`: the process's CPU time (every thread's, from `schedstat`) per call,
//!   the gate's and the in-process worker's together;
//! - `gate/wall_per_call`: the same calls by the clock, which adds the store's `fsync`s;
//! - `gate/hop_cpu_per_call`: the same call's hop alone (the dispatch straight to the same
//!   worker, no gate), CPU per call as in the first row; the first row less this one is
//!   the gate's own CPU (auth, schema, Cedar, budgets, audit, store).
//!
//! With `AIRLOCK_GATE_BENCH_CALLS=<n>` it makes `n` calls after the warm-up and exits, with
//! no criterion around them: a bounded run for an instruction profiler, e.g.
//! `valgrind --tool=callgrind target/release/deps/gate-<hash> --bench`. With
//! `AIRLOCK_GATE_BENCH_HOP=1` as well, those calls are hops alone (the third row's).
//!
//! With `AIRLOCK_GATE_BENCH_TRACE=1` every call is traced as in production: the
//! OpenTelemetry layer installed, every span (the call's, the gate's stages, the
//! dispatch, the worker's) exported over OTLP/HTTP to a receiver in this process. The
//! difference against a run without it is what tracing costs the gate per call, counted
//! in instructions when run under callgrind.

use std::time::{Duration, Instant};

use airlock_orchestrator::harness::GateHarness;
use airlock_worker::{
    BoundListener, CallContext, ListenAddr, Tool, ToolDefinition, ToolOutcome, ToolSet,
    WorkerServer, WorkerSettings,
};
use criterion::{Criterion, criterion_group, criterion_main};
use serde_json::{Value, json};

#[path = "support/otlp_sink.rs"]
mod otlp_sink;

const TOKEN: &str = "gate-bench-token-0c9e";

/// `read_file` as the fs worker defines it, answering a fixed text without touching disk.
struct FixedRead(ToolDefinition);

#[airlock_worker::async_trait]
impl Tool for FixedRead {
    fn definition(&self) -> ToolDefinition {
        self.0.clone()
    }

    async fn execute(&self, _arguments: Value, _ctx: CallContext) -> ToolOutcome {
        ToolOutcome::text("one hundred bytes of a small file")
    }
}

/// CPU time of each thread of this process by thread id, from each thread's `schedstat`
/// (its first field: nanoseconds on a CPU), which unlike `/proc/self/stat` is not counted
/// in ticks.
fn thread_times() -> std::collections::HashMap<String, u64> {
    let mut times = std::collections::HashMap::new();
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for task in tasks.flatten() {
            let nanos = std::fs::read_to_string(task.path().join("schedstat"))
                .ok()
                .and_then(|s| {
                    s.split_whitespace()
                        .next()
                        .and_then(|n| n.parse::<u64>().ok())
                });
            times.insert(
                task.file_name().to_string_lossy().into_owned(),
                nanos.unwrap_or(0),
            );
        }
    }
    times
}

/// The CPU time the threads of this process spent since `before` was read. Summed thread
/// by thread over the threads alive now: a blocking-pool thread that exits in between
/// (idle for ten seconds, as during a row that does not use the store) must not take its
/// whole life's CPU off the total, which made a row read zero.
fn cpu_since(before: &std::collections::HashMap<String, u64>) -> Duration {
    let total: u64 = thread_times()
        .iter()
        .map(|(tid, now)| now.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum();
    Duration::from_nanos(total)
}

/// Stops the run at the first failure, naming it: a benchmark of failing calls measures
/// nothing.
fn fail(what: &str, error: impl std::fmt::Display) -> ! {
    eprintln!("gate bench: {what}: {error}");
    std::process::exit(1)
}

/// `AIRLOCK_GATE_BENCH_CALLS`: how many calls a profiling run makes, when set.
fn profiled_calls() -> Option<u64> {
    let text = std::env::var("AIRLOCK_GATE_BENCH_CALLS").ok()?;
    match text.parse() {
        Ok(calls) => Some(calls),
        Err(e) => fail("AIRLOCK_GATE_BENCH_CALLS is not a number of calls", e),
    }
}

/// The CPU time `iterations` repetitions of `one` take, every thread's.
fn cpu_of(iterations: u64, one: &dyn Fn()) -> Duration {
    let before = thread_times();
    for _ in 0..iterations {
        one();
    }
    cpu_since(&before)
}

/// `AIRLOCK_GATE_BENCH_HOP=1`: a profiling run makes hops alone.
fn profiled_hops() -> bool {
    std::env::var("AIRLOCK_GATE_BENCH_HOP").is_ok_and(|v| v == "1")
}

/// `AIRLOCK_GATE_BENCH_TRACE=1`: trace every call.
fn traced() -> bool {
    std::env::var("AIRLOCK_GATE_BENCH_TRACE").is_ok_and(|v| v == "1")
}

/// Installs the subscriber an orchestrator runs with: plain log lines at `info` (a
/// call writes one, "call finished"), formatted and written as `airlock up` writes them
/// to a file, here `/dev/null`; and with [`traced`] the OpenTelemetry layer, exporting
/// to `OTEL_EXPORTER_OTLP_ENDPOINT`. Without any subscriber `tracing` hands every span
/// the libraries open — h2 opens dozens for each request — to its `log` fallback, some
/// 27 k instructions a call that no running orchestrator pays.
///
/// Traced without an endpoint, this process starts a receiver and runs itself again
/// with the variable set (the environment is read by the exporter, and is not this
/// process's to change once it runs), then exits as that run did: under callgrind, give
/// `--trace-children=yes`.
fn install_subscriber() -> Result<(), Box<dyn std::error::Error>> {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let null = std::fs::File::options().append(true).open("/dev/null")?;
    let logs = tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .with_writer(std::sync::Mutex::new(null))
        .with_filter(tracing_subscriber::EnvFilter::new("info"));
    if !traced() {
        tracing_subscriber::registry().with(logs).try_init()?;
        return Ok(());
    }
    if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_none() {
        let sink = otlp_sink::OtlpSink::start()?;
        let status = std::process::Command::new(std::env::current_exe()?)
            .args(std::env::args_os().skip(1))
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &sink.url)
            .status()?;
        std::process::exit(status.code().unwrap_or(1));
    }
    let traces = airlock_telemetry::layer(&airlock_telemetry::Service::Orchestrator)?
        .ok_or("the OpenTelemetry layer is off although an endpoint is set")?;
    tracing_subscriber::registry()
        .with(logs)
        .with(traces)
        .try_init()?;
    Ok(())
}

struct Setup {
    runtime: tokio::runtime::Runtime,
    harness: GateHarness,
    stop: tokio_util::sync::CancellationToken,
    _dir: tempfile::TempDir,
}

fn setup() -> Result<Setup, Box<dyn std::error::Error>> {
    install_subscriber()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("fs.sock");
    let definition = airlock_worker_fs::tools(airlock_worker_fs::FsConfig::default())
        .get("read_file")
        .ok_or("the fs worker has no read_file")?
        .definition();
    let tools = ToolSet::new("fs").with(FixedRead(definition));
    let listener = BoundListener::bind(&ListenAddr::Unix(socket.clone()))?;
    let stop = tokio_util::sync::CancellationToken::new();
    {
        let stop = stop.clone();
        let _guard = runtime.enter();
        runtime.spawn(async move {
            let server = WorkerServer::new(tools, WorkerSettings::default());
            if let Err(e) = server
                .serve(listener, async move { stop.cancelled().await })
                .await
            {
                fail("the worker stopped", e);
            }
        });
    }
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data)?;
    let harness = runtime.block_on(GateHarness::start(&data, "fs", &socket, TOKEN))?;
    airlock_telemetry::start()?;
    Ok(Setup {
        runtime,
        harness,
        stop,
        _dir: dir,
    })
}

fn bench_gate(c: &mut Criterion) {
    let Setup {
        runtime,
        harness,
        stop,
        _dir,
    } = setup().unwrap_or_else(|e| fail("setting up", e));
    let input = json!({"path": "small.txt"});
    let call = || {
        if let Err(e) = runtime.block_on(harness.call("read_file", input.clone())) {
            fail("a call failed", e);
        }
    };
    let hop = || {
        if let Err(e) = runtime.block_on(harness.hop("read_file", &input)) {
            fail("a call's hop failed", e);
        }
    };
    // Warm the store, the channel and Cedar's caches.
    for _ in 0..200 {
        call();
    }
    if let Some(calls) = profiled_calls() {
        let profiled: &dyn Fn() = if profiled_hops() { &hop } else { &call };
        for _ in 0..calls {
            profiled();
        }
        airlock_telemetry::flush();
        stop.cancel();
        std::process::exit(0);
    }

    let mut group = c.benchmark_group("gate");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(10));
    group.bench_function("cpu_per_call", |b| {
        b.iter_custom(|iterations| cpu_of(iterations, &call))
    });
    group.bench_function("wall_per_call", |b| {
        b.iter_custom(|iterations| {
            let started = Instant::now();
            for _ in 0..iterations {
                call();
            }
            started.elapsed()
        })
    });
    group.bench_function("hop_cpu_per_call", |b| {
        b.iter_custom(|iterations| cpu_of(iterations, &hop))
    });
    group.finish();
    stop.cancel();
}

criterion_group!(benches, bench_gate);
criterion_main!(benches);
