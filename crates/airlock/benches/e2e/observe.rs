//! `-- observe`: what observability costs a call. Three `airlock up` take turns in the
//! same rounds: one without any `OTEL_*` variable (no tracing layer at all), one that
//! exports every span over OTLP/HTTP (`http/protobuf`) to a receiver in this process,
//! with the workers' metrics listeners on and the orchestrator's `/metrics` scraped every
//! second, as Prometheus would, and a second one without tracing, the control: how far
//! two identical servers differ in the same run is the noise floor an on/off ratio is
//! read against. Same rows, same checks as the main bench.

use super::*;

#[path = "../../../orchestrator/benches/support/otlp_sink.rs"]
mod otlp_sink;
use otlp_sink::OtlpSink;

/// The rows: (file, requests per server, concurrency, rounds). Many short rounds: a
/// machine whose speed drifts (other tenants, frequency) then drifts under all three
/// servers alike, where four long rounds left ratios off by up to 10 % between two
/// identical servers. A concurrent row keeps rounds of at least 60 requests, so that
/// the ramp at each round's ends stays small beside its steady part.
const ROWS: [(&str, usize, usize, usize); 5] = [
    ("small", SMALL_REQUESTS, 1, 20),
    ("small", SMALL_REQUESTS, 8, 10),
    ("large", LARGE_REQUESTS, 1, 10),
    ("shell", SHELL_REQUESTS, 1, 10),
    ("shell", SHELL_REQUESTS, 8, 5),
];

pub async fn run(scratch: &Path) -> Result<String> {
    let receiver = OtlpSink::start().context("cannot start the OTLP receiver")?;
    let off_dir = scratch.join("off");
    let on_dir = scratch.join("on");
    let control_dir = scratch.join("control");
    for dir in [&off_dir, &on_dir, &control_dir] {
        std::fs::create_dir(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    eprintln!("starting airlock without tracing");
    let off = Airlock::start(&off_dir, Path::new(AIRLOCK_BIN), "traces off").await?;
    eprintln!("starting airlock exporting to {}", receiver.url);
    let on = Airlock::start_with(
        &on_dir,
        Path::new(AIRLOCK_BIN),
        "traces + metrics on",
        &Extra {
            config: "[metrics]\nlisten = \"127.0.0.1:0\"\n".to_owned(),
            env: traced_env(&receiver.url),
        },
    )
    .await?;
    eprintln!("starting a second airlock without tracing (the control)");
    let control = Airlock::start(&control_dir, Path::new(AIRLOCK_BIN), "control (off)").await?;
    let mut files = Vec::new();
    for airlock in [&off, &on, &control] {
        files.push((
            airlock.write_file("small.txt", &text_file(SMALL_BYTES))?,
            airlock.write_file("large.txt", &text_file(LARGE_BYTES))?,
        ));
    }
    let (small, large) = files.swap_remove(0);
    let shell = BenchFile::shell("echo ok", "ok\n");
    let scraper = {
        let url = format!("{}/metrics", on.url);
        let client = client()?;
        tokio::spawn(async move {
            loop {
                let _ = client.get(&url).send().await;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    let targets = [off.target(), on.target(), control.target()];
    for target in &targets {
        eprintln!("warming up {}", target.name);
        run_requests(target, &small, WARMUP_SMALL, 1, ROW_TIME_CAP).await?;
        run_requests(target, &shell, 20, 1, ROW_TIME_CAP).await?;
    }
    let load_before = load_average();
    let mut rows = Vec::new();
    for (which, budget, concurrency, rounds) in ROWS {
        let file = match which {
            "small" => &small,
            "large" => &large,
            _ => &shell,
        };
        let label = format!("{} c={concurrency}", file.label);
        eprintln!("row {label}: {budget} requests per server in {rounds} rotating rounds");
        let stats = alternate_rounds(&targets, file, budget, concurrency, rounds).await?;
        rows.push(Row { label, stats });
    }
    scraper.abort();
    // The last spans leave within the batch delay (5 s by default).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let load = format!("{load_before} before the rows, {} after", load_average());
    Ok(render_observe(&rows, &load, &receiver))
}

/// The traced server's variables: the receiver, then `AIRLOCK_BENCH_OBSERVE_ENV`
/// (`NAME=value` pairs separated by spaces), e.g. `OTEL_TRACES_SAMPLER=always_off` to
/// build every span but export none, or a sampler ratio.
fn traced_env(receiver: &str) -> Vec<(String, String)> {
    let mut env = vec![(
        "OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(),
        receiver.to_owned(),
    )];
    let extra = std::env::var("AIRLOCK_BENCH_OBSERVE_ENV").unwrap_or_default();
    for pair in extra.split_whitespace() {
        if let Some((name, value)) = pair.split_once('=') {
            env.push((name.to_owned(), value.to_owned()));
        }
    }
    env
}

fn render_observe(rows: &[Row], load: &str, receiver: &OtlpSink) -> String {
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## Tracing and metrics on vs off (same run)\n\n\
         {cores} CPUs, loopback; per server and row up to the main bench's request counts \
         in 5–20 rotating rounds, every response verified; a server's turn ends once its \
         processes are idle (what they did after the last response is counted in their \
         CPU time and does not run in the next server's turn). *On*: every span exported \
         over OTLP/HTTP to a receiver in the bench process ({} export requests, {} bytes \
         received), the workers' metrics listeners on and `/metrics` scraped every second. \
         *Off* and *control*: no `OTEL_*` variable, two identical servers; control/off is \
         the run's noise floor. Load average (1/5/15 min): {load}.\n",
        receiver.requests(),
        receiver.bytes(),
    );
    let _ = writeln!(
        out,
        "| row | p50 ms off | p50 ms on | p50 ms control | p50 on/off | p50 control/off | \
         p99 ms off | p99 ms on | req/s off | req/s on | server CPU ms/req off | on | control |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for row in rows {
        let off = row.stats[0].summary();
        let on = row.stats[1].summary();
        let control = row.stats[2].summary();
        let _ = writeln!(
            out,
            "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.0} | {:.0} | \
             {:.2} | {:.2} | {:.2} |",
            row.label,
            off.p50,
            on.p50,
            control.p50,
            on.p50 / off.p50,
            control.p50 / off.p50,
            off.p99,
            on.p99,
            off.throughput,
            on.throughput,
            off.cpu_ms,
            on.cpu_ms,
            control.cpu_ms
        );
    }
    let _ = writeln!(
        out,
        "\nBy process, per request: CPU time (µs, clock ticks of 10 ms summed over the \
         row), minor page faults (a worker that forks its sandboxes takes a \
         copy-on-write fault on each of its pages it writes after a fork, so what tracing \
         adds to the pages it writes per call costs faults there too) and context \
         switches of all its threads (each hand-off to a thread that was asleep costs a \
         wake-up and a switch).\n"
    );
    let _ = writeln!(
        out,
        "| row | process | CPU µs off | on | control | faults off | on | control \
         | switches off | on | control |"
    );
    let _ = writeln!(
        out,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for row in rows {
        let by_role: Vec<_> = row.stats.iter().map(Stats::per_request_by_role).collect();
        let mut roles: Vec<&String> = by_role.iter().flat_map(BTreeMap::keys).collect();
        roles.sort();
        roles.dedup();
        for role in roles {
            let at = |i: usize| by_role[i].get(role).copied().unwrap_or_default();
            let (off, on, control) = (at(0), at(1), at(2));
            // Processes idle during the row (the other workers) say nothing.
            if off.cpu_us + on.cpu_us + control.cpu_us == 0.0
                && off.faults + on.faults + control.faults < 0.5
            {
                continue;
            }
            let _ = writeln!(
                out,
                "| {} | {role} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} \
                 | {:.1} | {:.1} | {:.1} |",
                row.label,
                off.cpu_us,
                on.cpu_us,
                control.cpu_us,
                off.faults,
                on.faults,
                control.faults,
                off.switches,
                on.switches,
                control.switches
            );
        }
    }
    out
}
