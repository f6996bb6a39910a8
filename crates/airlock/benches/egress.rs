//! What the egress proxy costs (`[sandbox] network = "proxy"`, DESIGN §12): `pip
//! download` of a local package from a loopback index (tests/e2e/egress_servers.py),
//! side by side in one run:
//! - on the host, no sandbox;
//! - in a strict sandbox with the host's network, straight to the index;
//! - in a strict sandbox behind the egress proxy, through `HTTP_PROXY` (the proxy the
//!   shell worker runs for each call: rules, name pinning, address checks, relaying).
//!
//! `cargo bench -p airlock --bench egress` (as root, like the shell worker's strict
//! sandbox). Prints a Markdown table of medians, p90 and ratios, and writes it to
//! `target/bench-egress.md`. Rows take turns, one run of each per round, so that other
//! load falls on every row alike.

use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_sandbox::{
    Cancel, CommandSpec, IsolationLevel, Network, OutputSink, PROXY_PORT, Sandbox, SandboxConfig,
    Stream,
};
use airlock_worker_shell::egress::{self, EgressConfig, EgressRules};
use tokio_util::sync::CancellationToken;

const RUNS: usize = 25;
const WARMUP: usize = 2;
/// The bench stops after this long even if it has not finished its rounds.
const BUDGET: Duration = Duration::from_secs(300);
const SERVERS: &str = include_str!("../../../tests/e2e/egress_servers.py");

type Result<T> = std::result::Result<T, Box<dyn Error>>;

fn percentile(samples: &[Duration], p: f64) -> Duration {
    let index = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples.get(index).copied().unwrap_or_default()
}

/// The loopback index, killed on drop.
struct Mirror {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Mirror {
    fn start() -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let root = dir.path().join("srv");
        std::fs::create_dir(&root)?;
        let ports = dir.path().join("ports.json");
        let child = Command::new("python3")
            .arg("-c")
            .arg(SERVERS)
            .arg(&root)
            .arg(&ports)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let text = loop {
            if let Ok(text) = std::fs::read_to_string(&ports) {
                break text;
            }
            if Instant::now() > deadline {
                return Err("the loopback index did not start".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let ports: serde_json::Value = serde_json::from_str(&text)?;
        let port = ports["mirror"]
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .ok_or("no mirror port")?;
        Ok(Self {
            child,
            port,
            _dir: dir,
        })
    }
}

impl Drop for Mirror {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `pip download` of the index's one package into a fresh directory of `workspace`.
fn pip_download(host: &str, port: u16, into: &str) -> Vec<String> {
    [
        "python3",
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--no-cache-dir",
        "--no-input",
        "--no-deps",
        "--quiet",
        "-d",
        into,
        "--trusted-host",
        host,
        "--index-url",
        &format!("http://{host}:{port}/simple/"),
        "demo-pkg",
    ]
    .map(String::from)
    .to_vec()
}

/// Hands a proxy sandbox's listener to the call's proxy on the bench's runtime.
struct ProxySink {
    runtime: tokio::runtime::Handle,
    rules: Arc<EgressRules>,
    stop: CancellationToken,
    served: Option<tokio::task::JoinHandle<egress::EgressLog>>,
}

impl OutputSink for ProxySink {
    fn chunk(&mut self, _: Stream, _: &[u8]) {}

    fn proxy_listener(&mut self, listener: std::net::TcpListener) {
        let (rules, stop) = (self.rules.clone(), self.stop.clone());
        self.served = Some(
            self.runtime
                .spawn(async move { egress::serve(listener, rules, stop).await }),
        );
    }
}

/// One row: a name and what one run does.
struct Row {
    name: &'static str,
    once: Box<dyn FnMut(usize) -> Result<()>>,
    samples: Vec<Duration>,
}

fn sandbox(network: Network) -> Result<Sandbox> {
    Ok(Sandbox::new(SandboxConfig {
        min_isolation: IsolationLevel::Strict,
        network,
        cgroup_parent: format!("airlock-bench-egress-{}", network.as_str()),
        ..SandboxConfig::default()
    })?)
}

fn checked(outcome: &airlock_sandbox::RunOutcome, what: &str) -> Result<()> {
    if outcome.exit_code != Some(0) {
        return Err(format!(
            "{what}: pip exited {:?}: {}",
            outcome.exit_code,
            String::from_utf8_lossy(&outcome.stderr)
        )
        .into());
    }
    Ok(())
}

fn main() -> Result<()> {
    let mirror = Mirror::start()?;
    let port = mirror.port;
    let workspace = tempfile::tempdir()?;
    let ws: PathBuf = workspace.path().to_path_buf();
    let runtime = tokio::runtime::Runtime::new()?;
    let rules = Arc::new(
        EgressConfig {
            allow: vec![format!("mirror.test:{port}")],
            hosts: [("mirror.test".to_owned(), "127.0.0.1".to_owned())]
                .into_iter()
                .collect(),
            ..EgressConfig::default()
        }
        .check()?,
    );

    let host_ws = ws.clone();
    let direct = sandbox(Network::Host)?;
    let direct_ws = ws.clone();
    let proxied = sandbox(Network::Proxy)?;
    let proxied_ws = ws.clone();
    let handle = runtime.handle().clone();
    let mut rows = vec![
        Row {
            name: "`pip download` on the host (no sandbox)",
            once: Box::new(move |i| {
                let into = host_ws.join(format!("host-{i}"));
                let argv = pip_download("127.0.0.1", port, &into.to_string_lossy());
                let status = Command::new(&argv[0])
                    .args(&argv[1..])
                    .stdout(Stdio::null())
                    .status()?;
                if !status.success() {
                    return Err(format!("pip on the host: {status}").into());
                }
                Ok(())
            }),
            samples: Vec::new(),
        },
        Row {
            name: "strict sandbox, host network, straight to the index",
            once: Box::new(move |i| {
                let mut spec = CommandSpec::new(
                    pip_download("127.0.0.1", port, &format!("/workspace/direct-{i}")),
                    direct_ws.clone(),
                );
                spec.timeout = Duration::from_secs(60);
                let outcome = direct.run(&spec, &mut airlock_sandbox::NoSink, &Cancel::new())?;
                checked(&outcome, "direct")
            }),
            samples: Vec::new(),
        },
        Row {
            name: "strict sandbox behind the egress proxy",
            once: Box::new(move |i| {
                let mut spec = CommandSpec::new(
                    pip_download("mirror.test", port, &format!("/workspace/proxied-{i}")),
                    proxied_ws.clone(),
                );
                spec.timeout = Duration::from_secs(60);
                let url = format!("http://127.0.0.1:{PROXY_PORT}");
                spec.env = ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"]
                    .iter()
                    .map(|name| (name.to_string(), url.clone()))
                    .collect();
                let mut sink = ProxySink {
                    runtime: handle.clone(),
                    rules: rules.clone(),
                    stop: CancellationToken::new(),
                    served: None,
                };
                let outcome = proxied.run(&spec, &mut sink, &Cancel::new())?;
                sink.stop.cancel();
                let log = match sink.served.take() {
                    Some(task) => handle.block_on(task)?,
                    None => return Err("the sandbox handed over no listener".into()),
                };
                checked(&outcome, "proxied")?;
                if !log.attempts.iter().any(|a| a.bytes_received > 0) {
                    return Err(format!("nothing went through the proxy: {log:?}").into());
                }
                Ok(())
            }),
            samples: Vec::new(),
        },
    ];

    let mut run = 0;
    for row in &mut rows {
        for _ in 0..WARMUP {
            run += 1;
            (row.once)(run)?;
        }
    }
    let started = Instant::now();
    for _ in 0..RUNS {
        if started.elapsed() > BUDGET {
            break;
        }
        for row in &mut rows {
            run += 1;
            let t = Instant::now();
            (row.once)(run)?;
            row.samples.push(t.elapsed());
        }
    }
    for row in &mut rows {
        row.samples.sort();
    }
    let median = |row: &Row| percentile(&row.samples, 0.5).as_secs_f64();
    let host = median(&rows[0]);
    let direct = median(&rows[1]);
    let mut table = String::from(
        "| `pip download` of one package from a loopback index | runs | median ms | p90 ms | × host | × sandbox, direct |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    for row in &rows {
        let m = median(row);
        table.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {:.2} | {:.2} |\n",
            row.name,
            row.samples.len(),
            m * 1000.0,
            percentile(&row.samples, 0.9).as_secs_f64() * 1000.0,
            m / host,
            m / direct,
        ));
    }
    let proxied = median(&rows[2]);
    table.push_str(&format!(
        "\nThe proxy's overhead: {:.1} ms per `pip download` at the median ({:+.1} %).\n",
        (proxied - direct) * 1000.0,
        (proxied / direct - 1.0) * 100.0
    ));
    print!("{table}");
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-egress.md");
    std::fs::write(out, &table)?;
    drop(workspace);
    Ok(())
}
