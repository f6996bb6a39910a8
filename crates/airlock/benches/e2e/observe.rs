//! `-- observe`: what observability costs a call. Two `airlock up` take turns in the same
//! rounds: one without any `OTEL_*` variable (no tracing layer at all), and one that
//! exports every span over OTLP/HTTP (`http/protobuf`) to a receiver in this process,
//! with the workers' metrics listeners on and the orchestrator's `/metrics` scraped every
//! second, as Prometheus would. Same rows, same checks as the main bench.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::sync::atomic::AtomicU64;

use super::*;

/// The rows: (file, requests per server, concurrency).
const ROWS: [(&str, usize, usize); 5] = [
    ("small", SMALL_REQUESTS, 1),
    ("small", SMALL_REQUESTS, 8),
    ("large", LARGE_REQUESTS, 1),
    ("shell", SHELL_REQUESTS, 1),
    ("shell", SHELL_REQUESTS, 8),
];

pub async fn run(scratch: &Path) -> Result<String> {
    let receiver = Receiver::start()?;
    let off_dir = scratch.join("off");
    let on_dir = scratch.join("on");
    for dir in [&off_dir, &on_dir] {
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
    let mut files = Vec::new();
    for airlock in [&off, &on] {
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
    let targets = [off.target(), on.target()];
    for target in &targets {
        eprintln!("warming up {}", target.name);
        run_requests(target, &small, WARMUP_SMALL, 1, ROW_TIME_CAP).await?;
        run_requests(target, &shell, 20, 1, ROW_TIME_CAP).await?;
    }
    let load_before = load_average();
    let mut rows = Vec::new();
    for (which, budget, concurrency) in ROWS {
        let file = match which {
            "small" => &small,
            "large" => &large,
            _ => &shell,
        };
        let label = format!("{} c={concurrency}", file.label);
        eprintln!("row {label}: {budget} requests per server in {ROUNDS} alternating rounds");
        let stats = alternate_rounds(&targets, file, budget, concurrency).await?;
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

fn render_observe(rows: &[Row], load: &str, receiver: &Receiver) -> String {
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## Tracing and metrics on vs off (same run)\n\n\
         {cores} CPUs, loopback; per server and row up to the main bench's request counts \
         in {ROUNDS} alternating rounds, every response verified. *On*: every span exported \
         over OTLP/HTTP to a receiver in the bench process ({} export requests, {} bytes \
         received), the workers' metrics listeners on and `/metrics` scraped every second. \
         *Off*: no `OTEL_*` variable. Load average (1/5/15 min): {load}.\n",
        receiver.requests.load(Ordering::Relaxed),
        receiver.bytes.load(Ordering::Relaxed),
    );
    let _ = writeln!(
        out,
        "| row | p50 ms off | p50 ms on | p50 on/off | p99 ms off | p99 ms on | \
         req/s off | req/s on | server CPU ms/req off | on |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for row in rows {
        let off = row.stats[0].summary();
        let on = row.stats[1].summary();
        let _ = writeln!(
            out,
            "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.0} | {:.0} | {:.2} | {:.2} |",
            row.label,
            off.p50,
            on.p50,
            on.p50 / off.p50,
            off.p99,
            on.p99,
            off.throughput,
            on.throughput,
            off.cpu_ms,
            on.cpu_ms
        );
    }
    out
}

/// A minimal OTLP/HTTP receiver: answers 200 to every request and counts what it got.
struct Receiver {
    url: String,
    requests: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
}

impl Receiver {
    fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("cannot bind the receiver")?;
        let url = format!("http://{}", listener.local_addr()?);
        let requests = Arc::new(AtomicU64::new(0));
        let bytes = Arc::new(AtomicU64::new(0));
        let (r, b) = (requests.clone(), bytes.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (r, b) = (r.clone(), b.clone());
                std::thread::spawn(move || {
                    let _ = serve(stream, &r, &b);
                });
            }
        });
        Ok(Self {
            url,
            requests,
            bytes,
        })
    }
}

/// HTTP/1.1 requests on one connection, until the client closes it.
fn serve(stream: std::net::TcpStream, requests: &AtomicU64, bytes: &AtomicU64) -> Result<()> {
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    loop {
        let mut length = 0usize;
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        loop {
            line.clear();
            reader.read_line(&mut line)?;
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0u8; length];
        reader.read_exact(&mut body)?;
        requests.fetch_add(1, Ordering::Relaxed);
        bytes.fetch_add(length as u64, Ordering::Relaxed);
        writer.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n",
        )?;
    }
}
