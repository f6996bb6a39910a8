//! End-to-end benchmark: `read_file` over HTTP, Airlock against the plain FastAPI tool
//! server (the seed simulator peer), side by side in one run.
//!
//! Run: `cargo bench -p airlock --bench e2e` (release build). Needs python3 with fastapi and
//! uvicorn (`python3 -m pip install fastapi uvicorn`). The peer is found in
//! `../shared/peers/seed-simulator` beside the repository, or in `AIRLOCK_BENCH_PEER_DIR`.
//!
//! Both servers read the very same files: the bench writes them into Airlock's workspace
//! and hands the peer their absolute paths. For every row (file size × concurrency) the
//! request budget is split into rounds that alternate between the servers, so drift on
//! the machine hits both alike. Every response is checked (status 200, no error, the exact
//! file content); one wrong answer fails the run. Latency is measured from sending the
//! request to having the whole body; checking the body is outside the timed part.
//!
//! The result is printed as a Markdown table and written to `target/bench-e2e.md`.
//!
//! After those rows come the rows across hosts (see [`cluster`]): the fs worker over TCP,
//! plaintext and mutual TLS, next to the Unix socket, and three replicas against one.
//! Those need root (each replica is held to half a CPU by a cgroup).
//!
//! `-- soak` runs only the soak instead (see [`soak`]): 100 000 mixed calls, and the
//! orchestrator's memory and the store's size meanwhile.
//!
//! A/B: with `AIRLOCK_BENCH_BASELINE=<path to another airlock binary>` (a build of an
//! earlier commit), that binary runs as a third server in the same rounds, so a change is
//! measured against its parent on the same machine at the same time.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Read as _;
use std::net::TcpListener;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

#[path = "e2e/cluster.rs"]
mod cluster;
#[path = "e2e/observe.rs"]
mod observe;
#[path = "e2e/soak.rs"]
mod soak;

/// The airlock binary under test, built by cargo in the bench profile.
const AIRLOCK_BIN: &str = env!("CARGO_BIN_EXE_airlock");
/// Size of the small file.
const SMALL_BYTES: usize = 100;
/// Size of the large file.
const LARGE_BYTES: usize = 1 << 20;
/// `[fs] max_read_bytes` for the run, so the large file comes back whole.
const MAX_READ_BYTES: usize = 2 << 20;
/// Requests per server and row: small file, large file.
const SMALL_REQUESTS: usize = 2000;
const LARGE_REQUESTS: usize = 300;
/// Requests per server and row for `execute_shell`.
const SHELL_REQUESTS: usize = 300;
/// Rounds each row's budget is split into, alternating servers.
const ROUNDS: usize = 4;
/// Time cap per server and row (split over the rounds); the row reports what it got.
const ROW_TIME_CAP: Duration = Duration::from_secs(20);
/// Warm-up requests per server before any row: small file, large file.
const WARMUP_SMALL: usize = 200;
const WARMUP_LARGE: usize = 20;
/// Deadline of one request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long each server may take to start.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a stopped server may take to exit before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(15);
const CONCURRENCY: [usize; 2] = [1, 8];

fn main() -> Result<()> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(run())
}

async fn run() -> Result<()> {
    // Declared first so it is removed last, after both servers have stopped.
    let scratch = tempfile::Builder::new()
        .prefix("airlock-bench-e2e-")
        .tempdir()
        .context("cannot create a temp dir")?;

    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if filters.iter().any(|f| f == "observe") {
        let table = observe::run(scratch.path()).await?;
        println!("\n{table}");
        let out = target_dir().join("bench-observe.md");
        std::fs::write(&out, &table).with_context(|| format!("cannot write {}", out.display()))?;
        eprintln!("written to {}", out.display());
        return Ok(());
    }
    eprintln!("starting airlock ({AIRLOCK_BIN})");
    let airlock = Airlock::start(scratch.path(), Path::new(AIRLOCK_BIN), "airlock").await?;
    let small = airlock.write_file("small.txt", &text_file(SMALL_BYTES))?;
    let large = airlock.write_file("large.txt", &text_file(LARGE_BYTES))?;
    // Positional arguments select rows by substring, e.g. `-- "1 MiB"`; cargo's own
    // flags (`--bench`) are ignored. `soak` runs the soak alone, `observe` the rows with
    // tracing and metrics on and off.
    if filters.iter().any(|f| f == "soak") {
        let shell = BenchFile::shell("echo ok", "ok\n");
        let table = soak::run(&airlock, [&small, &large, &shell]).await?;
        println!("\n{table}");
        let out = target_dir().join("bench-soak.md");
        std::fs::write(&out, &table).with_context(|| format!("cannot write {}", out.display()))?;
        eprintln!("written to {}", out.display());
        return Ok(());
    }
    let peer_dir = peer_dir()?;
    check_python()?;
    let baseline = match std::env::var_os("AIRLOCK_BENCH_BASELINE") {
        Some(bin) => {
            let bin = PathBuf::from(bin);
            eprintln!("starting the baseline airlock ({})", bin.display());
            let dir = scratch.path().join("baseline");
            std::fs::create_dir(&dir).context("cannot create the baseline's scratch dir")?;
            let baseline = Airlock::start(&dir, &bin, "airlock (baseline)").await?;
            baseline.write_file("small.txt", &text_file(SMALL_BYTES))?;
            baseline.write_file("large.txt", &text_file(LARGE_BYTES))?;
            Some(baseline)
        }
        None => None,
    };

    eprintln!("starting the FastAPI peer ({})", peer_dir.display());
    let peer = Peer::start(&peer_dir, scratch.path()).await?;

    let mut targets = vec![airlock.target()];
    targets.extend(baseline.as_ref().map(Airlock::target));
    targets.push(peer.target());
    for target in &targets {
        eprintln!("warming up {}", target.name);
        run_requests(target, &small, WARMUP_SMALL, 1, ROW_TIME_CAP).await?;
        run_requests(target, &large, WARMUP_LARGE, 1, ROW_TIME_CAP).await?;
    }

    let load_before = load_average();
    let mut rows = Vec::new();
    let shell = BenchFile::shell("echo ok", "ok\n");
    for (file, budget) in [
        (&small, SMALL_REQUESTS),
        (&large, LARGE_REQUESTS),
        (&shell, SHELL_REQUESTS),
    ] {
        for concurrency in CONCURRENCY {
            let label = format!("{} c={concurrency}", file.label);
            if !filters.is_empty() && !filters.iter().any(|f| label.contains(f.as_str())) {
                continue;
            }
            eprintln!("row {label}: {budget} requests per server in {ROUNDS} alternating rounds");
            let stats = alternate_rounds(&targets, file, budget, concurrency, ROUNDS).await?;
            rows.push(Row { label, stats });
        }
    }

    let load = format!("{load_before} before the rows, {} after", load_average());
    let mut table = render(&rows, &targets, &load);
    eprintln!("starting the cluster rows (TCP, mutual TLS, replicas)");
    let cluster = cluster::run(scratch.path(), &airlock.target(), &small, &filters).await?;
    table.push('\n');
    table.push_str(&cluster);
    println!("\n{table}");
    let out = target_dir().join("bench-e2e.md");
    std::fs::write(&out, &table).with_context(|| format!("cannot write {}", out.display()))?;
    eprintln!("written to {}", out.display());

    drop(peer);
    drop(baseline);
    drop(airlock);
    drop(scratch);
    Ok(())
}

/// Runs `budget` requests of `file` against each target in `rounds` rounds: one
/// `Stats` per target, in `targets`' order.
async fn alternate_rounds(
    targets: &[Target],
    file: &BenchFile,
    budget: usize,
    concurrency: usize,
    rounds: usize,
) -> Result<Vec<Stats>> {
    let rounds = rounds.max(1);
    let mut stats: Vec<Stats> = targets.iter().map(|_| Stats::default()).collect();
    let quota = budget.div_ceil(rounds);
    let cap = ROW_TIME_CAP / u32::try_from(rounds).unwrap_or(u32::MAX);
    for round in 0..rounds {
        // Rotate who goes first, so no one always runs on a "warmer" machine.
        let mut order: Vec<usize> = (0..targets.len()).collect();
        order.rotate_left(round % targets.len().max(1));
        for index in order {
            let run = run_requests(&targets[index], file, quota, concurrency, cap).await?;
            stats[index].add(run);
        }
    }
    Ok(stats)
}

/// `target/` of this build: the airlock binary is `target/<profile>/airlock`.
fn target_dir() -> PathBuf {
    let bin = Path::new(AIRLOCK_BIN);
    bin.parent()
        .and_then(Path::parent)
        .map_or_else(|| PathBuf::from("target"), Path::to_path_buf)
}

fn peer_dir() -> Result<PathBuf> {
    let dir = match std::env::var_os("AIRLOCK_BENCH_PEER_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/peers/seed-simulator"),
    };
    ensure!(
        dir.join("main.py").is_file(),
        "the FastAPI peer is not at {} (no main.py); set AIRLOCK_BENCH_PEER_DIR to the \
         seed-simulator folder",
        dir.display()
    );
    Ok(dir)
}

fn check_python() -> Result<()> {
    let fix = "run python3 -m pip install fastapi uvicorn";
    let output = Command::new("python3")
        .args(["-c", "import fastapi, uvicorn"])
        .stdin(Stdio::null())
        .output()
        .with_context(|| {
            format!("cannot run python3, which the FastAPI peer needs: install python3, then {fix}")
        })?;
    if !output.status.success() {
        bail!(
            "python3 cannot import fastapi/uvicorn ({}): {fix}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// ASCII text of exactly `size` bytes in lines of at most 64 bytes, each ending in `\n`.
fn text_file(size: usize) -> String {
    let mut text = String::with_capacity(size);
    let mut line = 0usize;
    while text.len() < size {
        let mut l = format!("line {line:06} the quick brown fox jumps over the lazy dog");
        l.truncate(63);
        let room = size - text.len();
        if l.len() + 1 > room {
            l.truncate(room.saturating_sub(1));
        }
        text.push_str(&l);
        text.push('\n');
        line += 1;
    }
    text
}

/// One file both servers read.
struct BenchFile {
    label: String,
    path: PathBuf,
    content: Arc<str>,
    /// When set, the row calls `execute_shell` with this command instead of `read_file`,
    /// and `content` is the expected stdout.
    shell: Option<String>,
    /// When set, the row calls this tool with these arguments (Airlock only), and
    /// `content` is the expected text of the result.
    tool: Option<(&'static str, Value)>,
}

impl BenchFile {
    /// An `execute_shell` row: Airlock runs the command in a fresh sandbox, the peer in a
    /// plain `subprocess.run(shell=True)`.
    fn shell(command: &str, expected_stdout: &str) -> Self {
        BenchFile {
            label: format!("execute_shell `{command}`"),
            path: PathBuf::new(),
            content: expected_stdout.into(),
            shell: Some(command.to_owned()),
            tool: None,
        }
    }
}

/// A process stopped with SIGTERM (then SIGKILL after a grace period) when dropped, so a
/// failing run leaves nothing behind.
struct ChildGuard {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl ChildGuard {
    fn spawn(name: &'static str, mut command: Command, log: PathBuf) -> Result<Self> {
        let out = std::fs::File::create(&log)
            .with_context(|| format!("cannot create {}", log.display()))?;
        let err = out.try_clone()?;
        let child = command
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        Ok(Self { name, child, log })
    }

    /// Fails with the end of the log when the process has exited.
    fn check_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}); its log ends:\n{}",
                self.name,
                self.log_tail()
            );
        }
        Ok(())
    }

    fn log_tail(&self) -> String {
        let mut text = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut text);
        }
        let start = text.len().saturating_sub(4000);
        let start = (start..text.len())
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(0);
        text[start..].to_owned()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let pid = i32::try_from(self.child.id())
            .ok()
            .and_then(rustix::process::Pid::from_raw);
        if let Some(pid) = pid {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_)) | Err(_)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "{} did not stop within {} s; killing it",
            self.name,
            STOP_GRACE.as_secs()
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a started Airlock gets beside the bench's own configuration.
#[derive(Default)]
struct Extra {
    /// Appended to the config file.
    config: String,
    /// Environment of `airlock up` (which passes `OTEL_*` to every component).
    env: Vec<(String, String)>,
}

struct Airlock {
    name: &'static str,
    process: ChildGuard,
    url: String,
    token: String,
    workspace: PathBuf,
    data_dir: PathBuf,
}

impl Airlock {
    async fn start(scratch: &Path, bin: &Path, name: &'static str) -> Result<Self> {
        Self::start_with(scratch, bin, name, &Extra::default()).await
    }

    /// [`Airlock::start`] with more configuration and environment.
    async fn start_with(
        scratch: &Path,
        bin: &Path,
        name: &'static str,
        extra: &Extra,
    ) -> Result<Self> {
        let data_dir = scratch.join("data");
        let config = scratch.join("airlock.toml");
        // Ephemeral ports; a read cap that lets the 1 MiB file through whole; and no
        // per-principal rate limit (600 calls a minute by default), which a benchmark that
        // sends thousands of calls a minute would otherwise hit.
        // AIRLOCK_BENCH_RESULT_MEMORY_BYTES: `[limits] result_memory_bytes` (what the soak's
        // memory depends on most).
        let limits = std::env::var("AIRLOCK_BENCH_RESULT_MEMORY_BYTES")
            .map(|bytes| format!("[limits]\nresult_memory_bytes = {bytes}\n\n"))
            .unwrap_or_default();
        // AIRLOCK_BENCH_ASYNC_THREADS: `[orchestrator] async_threads` of every server (not
        // with an AIRLOCK_BENCH_BASELINE older than the key, which refuses it).
        let threads = std::env::var("AIRLOCK_BENCH_ASYNC_THREADS")
            .map(|n| format!("async_threads = {n}\n"))
            .unwrap_or_default();
        std::fs::write(
            &config,
            format!(
                "[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n{threads}\n\
                 [fs]\nmax_read_bytes = {MAX_READ_BYTES}\n\n\
                 [budgets]\nrate_per_minute = 0\n\n\
                 {limits}[approvals]\ntools = []\n\n{}",
                extra.config
            ),
        )?;
        let mut command = Command::new(bin);
        command
            .envs(extra.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .arg("up")
            .arg("--data-dir")
            .arg(&data_dir)
            .arg("--config")
            .arg(&config);
        let mut process = ChildGuard::spawn(name, command, scratch.join("airlock.log"))?;

        let endpoints_file = data_dir.join("endpoints.json");
        let deadline = Instant::now() + START_TIMEOUT;
        let endpoints: Value = loop {
            process.check_running()?;
            if let Ok(text) = std::fs::read_to_string(&endpoints_file)
                && let Ok(v) = serde_json::from_str::<Value>(&text)
            {
                break v;
            }
            ensure!(
                Instant::now() < deadline,
                "airlock up wrote no {} within {} s; its log ends:\n{}",
                endpoints_file.display(),
                START_TIMEOUT.as_secs(),
                process.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let url = endpoints["http"]
            .as_str()
            .context("endpoints.json has no \"http\" address")?
            .trim_end_matches('/')
            .to_owned();
        let token_file = endpoints["token_file"]
            .as_str()
            .map_or_else(|| data_dir.join("token"), PathBuf::from);
        let token = std::fs::read_to_string(&token_file)
            .with_context(|| format!("cannot read the token {}", token_file.display()))?
            .trim()
            .to_owned();
        wait_ok(&mut process, &format!("{url}/readyz")).await?;
        eprintln!("airlock is ready at {url}");

        let workspace = data_dir.join("workspaces/local/default");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&workspace)
            .with_context(|| format!("cannot create the workspace {}", workspace.display()))?;
        Ok(Self {
            name,
            process,
            url,
            token,
            workspace,
            data_dir,
        })
    }

    fn write_file(&self, name: &str, content: &str) -> Result<BenchFile> {
        let path = self.workspace.join(name);
        std::fs::write(&path, content)
            .with_context(|| format!("cannot write {}", path.display()))?;
        let label = if content.len() >= 1 << 20 {
            format!("{} MiB", content.len() >> 20)
        } else {
            format!("{} B", content.len())
        };
        Ok(BenchFile {
            label,
            path,
            content: content.into(),
            shell: None,
            tool: None,
        })
    }

    fn target(&self) -> Target {
        Target {
            name: self.name,
            url: format!("{}/v1/tool_calls", self.url),
            kind: Kind::Airlock {
                auth: format!("Bearer {}", self.token),
            },
            pid: self.process.child.id(),
        }
    }
}

impl Drop for Airlock {
    fn drop(&mut self) {
        eprintln!("stopping {}", self.process.name);
    }
}

struct Peer {
    process: ChildGuard,
    url: String,
}

impl Peer {
    async fn start(dir: &Path, scratch: &Path) -> Result<Self> {
        let port = free_port()?;
        let mut command = Command::new("python3");
        command
            .args(["-m", "uvicorn", "main:app", "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .args(["--log-level", "warning"])
            .current_dir(dir);
        let mut process = ChildGuard::spawn("the FastAPI peer", command, scratch.join("peer.log"))?;
        let url = format!("http://127.0.0.1:{port}");
        wait_ok(&mut process, &format!("{url}/tools")).await?;
        eprintln!("the FastAPI peer is ready at {url}");
        Ok(Self { process, url })
    }

    fn target(&self) -> Target {
        Target {
            name: "fastapi peer",
            url: format!("{}/tool-call", self.url),
            kind: Kind::Peer,
            pid: self.process.child.id(),
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        eprintln!("stopping {}", self.process.name);
    }
}

fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("cannot find a free port")?;
    Ok(listener.local_addr()?.port())
}

/// Polls `url` until it answers 200, failing if the process exits or time runs out.
async fn wait_ok(process: &mut ChildGuard, url: &str) -> Result<()> {
    let client = client()?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        process.check_running()?;
        let last = match client.get(url).timeout(Duration::from_secs(2)).send().await {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => format!("status {}", r.status()),
            Err(e) => e.to_string(),
        };
        ensure!(
            Instant::now() < deadline,
            "{} did not answer 200 on {url} within {} s (last: {last}); its log ends:\n{}",
            process.name,
            START_TIMEOUT.as_secs(),
            process.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A keep-alive HTTP client for one worker task.
fn client() -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(1)
        .timeout(REQUEST_TIMEOUT)
        .build()
        .context("cannot build the HTTP client")
}

#[derive(Clone)]
enum Kind {
    Airlock { auth: String },
    Peer,
}

/// One server's `read_file` endpoint.
#[derive(Clone)]
struct Target {
    name: &'static str,
    url: String,
    kind: Kind,
    /// The server's process; its CPU time (with its descendants') is measured per run.
    pid: u32,
}

impl Target {
    fn body(&self, file: &BenchFile) -> Result<Vec<u8>> {
        if let Some((tool, input)) = &file.tool {
            ensure!(
                matches!(self.kind, Kind::Airlock { .. }),
                "{}: {tool} rows are for airlock only",
                self.name
            );
            let body = json!({"tool_uses": [{"type": "tool_use", "id": "t1", "name": tool, "input": input}]});
            return Ok(serde_json::to_vec(&body)?);
        }
        if let Some(command) = &file.shell {
            let body = match &self.kind {
                Kind::Airlock { .. } => json!({"tool_uses": [{
                    "type": "tool_use", "id": "t1", "name": "execute_shell", "input": {"command": command},
                }]}),
                Kind::Peer => {
                    json!({"tool_name": "execute_shell", "arguments": {"command": command}})
                }
            };
            return Ok(serde_json::to_vec(&body)?);
        }
        let body = match &self.kind {
            Kind::Airlock { .. } => json!({"tool_uses": [{
                "type": "tool_use",
                "id": "t1",
                "name": "read_file",
                "input": {"path": file.path.file_name().and_then(|n| n.to_str()).context("file name")?},
            }]}),
            Kind::Peer => json!({
                "tool_name": "read_file",
                "arguments": {"filepath": file.path.to_str().context("non-UTF-8 path")?},
            }),
        };
        Ok(serde_json::to_vec(&body)?)
    }

    fn request(&self, client: &reqwest::Client, body: &[u8]) -> reqwest::RequestBuilder {
        let request = client
            .post(&self.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_vec());
        match &self.kind {
            Kind::Airlock { auth } => request.header(reqwest::header::AUTHORIZATION, auth),
            Kind::Peer => request,
        }
    }

    /// Checks that `body` is a successful `read_file` result holding exactly `expected`.
    fn verify(&self, status: reqwest::StatusCode, body: &[u8], file: &BenchFile) -> Result<()> {
        let expected: &str = &file.content;
        let show = || String::from_utf8_lossy(&body[..body.len().min(500)]).into_owned();
        ensure!(
            status == reqwest::StatusCode::OK,
            "{}: status {status}: {}",
            self.name,
            show()
        );
        let v: Value = serde_json::from_slice(body)
            .with_context(|| format!("{}: response is not JSON: {}", self.name, show()))?;
        let text = match &self.kind {
            Kind::Airlock { .. } => {
                let result = &v["tool_results"][0];
                ensure!(
                    v["calls"][0]["status"] == "ok" && result["is_error"] == false,
                    "{}: the call failed: {}",
                    self.name,
                    show()
                );
                let text = result["content"][0]["text"].as_str();
                if file.shell.is_some() {
                    // execute_shell answers with a JSON object holding stdout.
                    let shell: Value = serde_json::from_str(text.unwrap_or_default())
                        .with_context(|| format!("{}: shell result is not JSON", self.name))?;
                    return check_text(self.name, shell["stdout"].as_str(), expected, &show);
                }
                text
            }
            Kind::Peer => {
                ensure!(
                    v["success"] == true,
                    "{}: the call failed: {}",
                    self.name,
                    show()
                );
                if file.shell.is_some() {
                    v["output"]["stdout"].as_str()
                } else {
                    v["output"]["content"].as_str()
                }
            }
        };
        check_text(self.name, text, expected, &show)
    }
}

/// Checks that a result text is exactly `expected`.
fn check_text(
    name: &str,
    text: Option<&str>,
    expected: &str,
    show: &dyn Fn() -> String,
) -> Result<()> {
    let text = text.with_context(|| format!("{name}: no result text: {}", show()))?;
    ensure!(
        text.len() == expected.len() && text == expected,
        "{name}: wrong content: {} bytes, expected {} bytes",
        text.len(),
        expected.len()
    );
    Ok(())
}

/// What one run of requests measured.
struct RunResult {
    latencies: Vec<Duration>,
    wall: Duration,
    /// CPU time the server's processes spent during the run.
    cpu: Duration,
    /// The same by role, with minor page faults.
    roles: BTreeMap<String, RoleUsage>,
}

/// Sends up to `count` requests with `concurrency` workers (each with its own keep-alive
/// client, connected before the clock starts), stopping early at `cap`.
async fn run_requests(
    target: &Target,
    file: &BenchFile,
    count: usize,
    concurrency: usize,
    cap: Duration,
) -> Result<RunResult> {
    let body = target.body(file)?;
    let mut clients = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        let client = client()?;
        let response = target.request(&client, &body).send().await?;
        let status = response.status();
        let bytes = response.bytes().await?;
        target.verify(status, &bytes, file)?;
        clients.push(client);
    }
    let next = AtomicUsize::new(0);
    let usage_before = process_tree(target.pid)?;
    let started = Instant::now();
    let deadline = started + cap;
    let workers = clients.iter().map(|client| {
        let (next, body) = (&next, &body);
        async move {
            let mut latencies = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < count && Instant::now() < deadline {
                let sent = Instant::now();
                let response = target
                    .request(client, body)
                    .send()
                    .await
                    .with_context(|| format!("{}: request failed", target.name))?;
                let status = response.status();
                let bytes = response
                    .bytes()
                    .await
                    .with_context(|| format!("{}: reading the response failed", target.name))?;
                latencies.push(sent.elapsed());
                target.verify(status, &bytes, file)?;
            }
            Ok::<_, anyhow::Error>(latencies)
        }
    });
    let per_worker = futures::future::try_join_all(workers).await?;
    let wall = started.elapsed();
    let usage_after = settled(target.pid).await?;
    let (cpu, roles) = usage_between(&usage_before, &usage_after);
    Ok(RunResult {
        latencies: per_worker.into_iter().flatten().collect(),
        wall,
        cpu,
        roles,
    })
}

/// The server's usage once it has finished what its requests left behind (a batch of
/// spans still to export, a store write still to flush): read every 50 ms until a
/// reading shows no more CPU time than the one before, for at most a second.
///
/// What a server does after its turn is its own cost, counted in its CPU time, and it
/// must not run during the next server's turn: with the servers taking turns in a
/// fixed rotation, the one that always follows the traced server paid for the spans
/// that server exported late (at concurrency 8, two identical untraced servers read
/// 4 to 5 % apart, the slower one the one that followed the traced server in two
/// rounds of three).
async fn settled(root: u32) -> Result<BTreeMap<u32, ProcessUsage>> {
    let total = |t: &BTreeMap<u32, ProcessUsage>| t.values().map(|p| p.ticks).sum::<u64>();
    let mut last = process_tree(root)?;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = process_tree(root)?;
        if total(&now) <= total(&last) {
            return Ok(now);
        }
        last = now;
    }
    Ok(last)
}

/// What one process of a server's tree had used at one moment, from `/proc/<pid>/stat`.
#[derive(Clone)]
struct ProcessUsage {
    /// What the process is in the server: `launcher`, `orchestrator`, `worker <group>`,
    /// or its command name.
    role: String,
    /// User plus system time, in clock ticks of 10 ms (the kernel's fixed USER_HZ).
    ticks: u64,
    /// Minor page faults: on a worker that forks its sandboxes, mostly the copy-on-write
    /// faults taken on its own pages after each fork.
    faults: u64,
    /// Context switches, voluntary and not, summed over the process's live threads: each
    /// hand-off between threads that finds the other asleep costs a wake-up and a switch.
    switches: u64,
}

/// CPU time, minor faults and context switches of one role over a run.
#[derive(Clone, Copy, Default)]
struct RoleUsage {
    cpu: Duration,
    faults: u64,
    switches: u64,
}

/// One role's usage divided by the requests of a row.
#[derive(Clone, Copy, Default)]
struct PerRequest {
    cpu_us: f64,
    faults: f64,
    switches: f64,
}

/// Context switches of every live thread of `pid`, from `/proc/<pid>/task/*/status`
/// (a thread that ended between two readings takes its count with it).
fn context_switches(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                // `voluntary_ctxt_switches:` and `nonvoluntary_ctxt_switches:`.
                .filter_map(|l| l.split_once("ctxt_switches:")?.1.trim().parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

const TICK: Duration = Duration::from_millis(10);

/// Every live process of `root`'s tree (`root` and its descendants), by pid.
fn process_tree(root: u32) -> Result<BTreeMap<u32, ProcessUsage>> {
    // (pid, ppid, usage) of every process.
    let mut procs = Vec::new();
    for entry in std::fs::read_dir("/proc").context("cannot read /proc")? {
        let entry = entry?;
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        // The process may have exited since the listing.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // Fields after the command name, which is in parentheses and may hold spaces.
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let field = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
        // rest[0] is the state (field 3); ppid is field 4, minflt 10, utime 14, stime 15.
        if let (Some(ppid), Some(faults), Some(utime), Some(stime)) =
            (field(1), field(7), field(11), field(12))
        {
            let comm = head.split_once('(').map_or("?", |(_, c)| c);
            procs.push((pid, ppid, comm.to_owned(), utime + stime, faults));
        }
    }
    let mut tree = vec![root];
    // Each pass adds one generation; process trees here are two levels deep.
    for _ in 0..8 {
        let before = tree.len();
        for (pid, ppid, ..) in &procs {
            if tree.contains(&u32::try_from(*ppid).unwrap_or(0)) && !tree.contains(pid) {
                tree.push(*pid);
            }
        }
        if tree.len() == before {
            break;
        }
    }
    ensure!(
        procs.iter().any(|(pid, ..)| *pid == root),
        "process {root} is gone"
    );
    Ok(procs
        .into_iter()
        .filter(|(pid, ..)| tree.contains(pid))
        .map(|(pid, _, comm, ticks, faults)| {
            let switches = context_switches(pid);
            let role = if pid == root {
                "launcher".to_owned()
            } else {
                role_of(pid).unwrap_or(comm)
            };
            (
                pid,
                ProcessUsage {
                    role,
                    ticks,
                    faults,
                    switches,
                },
            )
        })
        .collect())
}

/// `orchestrator` or `worker <group>` from an `airlock serve …` command line.
fn role_of(pid: u32) -> Option<String> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let at = |i: usize| args.get(i).and_then(|a| std::str::from_utf8(a).ok());
    match (at(1)?, at(2)?) {
        ("serve", "orchestrator") => Some("orchestrator".to_owned()),
        ("serve", "worker") => Some(format!("worker {}", at(3)?)),
        _ => None,
    }
}

/// The tree's CPU time between two readings (processes that ended in between are not
/// counted: a reaped sandbox's time is its worker's children's, not the worker's),
/// and each role's CPU time and minor faults.
fn usage_between(
    before: &BTreeMap<u32, ProcessUsage>,
    after: &BTreeMap<u32, ProcessUsage>,
) -> (Duration, BTreeMap<String, RoleUsage>) {
    let total_ticks = |t: &BTreeMap<u32, ProcessUsage>| t.values().map(|p| p.ticks).sum::<u64>();
    let ticks = total_ticks(after).saturating_sub(total_ticks(before));
    let mut roles: BTreeMap<String, RoleUsage> = BTreeMap::new();
    for (pid, now) in after {
        let (ticks_then, faults_then, switches_then) = before
            .get(pid)
            .map_or((0, 0, 0), |p| (p.ticks, p.faults, p.switches));
        let role = roles.entry(now.role.clone()).or_default();
        role.cpu += TICK * u32::try_from(now.ticks.saturating_sub(ticks_then)).unwrap_or(u32::MAX);
        role.faults += now.faults.saturating_sub(faults_then);
        role.switches += now.switches.saturating_sub(switches_then);
    }
    (TICK * u32::try_from(ticks).unwrap_or(u32::MAX), roles)
}

#[derive(Default)]
struct Stats {
    latencies: Vec<Duration>,
    wall: Duration,
    cpu: Duration,
    roles: BTreeMap<String, RoleUsage>,
}

impl Stats {
    fn add(&mut self, run: RunResult) {
        self.latencies.extend(run.latencies);
        self.wall += run.wall;
        self.cpu += run.cpu;
        for (role, usage) in run.roles {
            let total = self.roles.entry(role).or_default();
            total.cpu += usage.cpu;
            total.faults += usage.faults;
            total.switches += usage.switches;
        }
    }

    /// Per request: each role's CPU time, minor page faults and context switches.
    fn per_request_by_role(&self) -> BTreeMap<String, PerRequest> {
        let n = self.latencies.len().max(1) as f64;
        self.roles
            .iter()
            .map(|(role, u)| {
                let per = PerRequest {
                    cpu_us: u.cpu.as_secs_f64() * 1e6 / n,
                    faults: u.faults as f64 / n,
                    switches: u.switches as f64 / n,
                };
                (role.clone(), per)
            })
            .collect()
    }

    fn summary(&self) -> Summary {
        let mut sorted = self.latencies.clone();
        sorted.sort_unstable();
        let ms = |q: f64| percentile(&sorted, q).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3);
        let n = sorted.len().max(1) as f64;
        let throughput = sorted.len() as f64 / self.wall.as_secs_f64().max(f64::MIN_POSITIVE);
        Summary {
            n: sorted.len(),
            p50: ms(0.50),
            p99: ms(0.99),
            throughput,
            cpu_ms: self.cpu.as_secs_f64() * 1e3 / n,
        }
    }
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[Duration], q: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

struct Summary {
    n: usize,
    p50: f64,
    p99: f64,
    throughput: f64,
    /// Server CPU time per request.
    cpu_ms: f64,
}

struct Row {
    label: String,
    stats: Vec<Stats>,
}

/// The 1, 5 and 15 minute load averages: other work on the machine skews the numbers.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".to_owned())
}

fn render(rows: &[Row], targets: &[Target], load: &str) -> String {
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## Tool calls over HTTP: airlock vs the FastAPI peer (same run)\n"
    );
    let _ = writeln!(
        out,
        "{cores} CPUs, loopback, keep-alive client per worker; per server and row up to \
         {SMALL_REQUESTS} (small) / {LARGE_REQUESTS} (1 MiB) requests in {ROUNDS} alternating \
         rounds, capped at {} s; every response verified. Ratios are airlock / peer: p50 below 1 \
         and throughput above 1 favour airlock. Server CPU is the user+system time of the \
         server's processes (airlock: `airlock up` and every process it starts; peer: uvicorn) per \
         request. Load average (1/5/15 min): {load}.\n",
        ROW_TIME_CAP.as_secs()
    );
    let _ = writeln!(
        out,
        "| row | server | n | p50 ms | p99 ms | throughput req/s | p50 ratio vs peer | \
         throughput ratio vs peer | server CPU ms/req |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let peer = targets.iter().position(|t| matches!(t.kind, Kind::Peer));
    for row in rows {
        let summaries: Vec<Summary> = row.stats.iter().map(Stats::summary).collect();
        let base = peer.and_then(|i| summaries.get(i));
        for (target, s) in targets.iter().zip(&summaries) {
            let (p50_ratio, tp_ratio) = match (base, &target.kind) {
                (Some(b), Kind::Airlock { .. }) => (
                    format!("{:.2}", s.p50 / b.p50),
                    format!("{:.2}", s.throughput / b.throughput),
                ),
                _ => ("1 (baseline)".to_owned(), "1 (baseline)".to_owned()),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.3} | {:.3} | {:.0} | {p50_ratio} | {tp_ratio} | {:.2} |",
                row.label, target.name, s.n, s.p50, s.p99, s.throughput, s.cpu_ms
            );
        }
    }
    out
}
