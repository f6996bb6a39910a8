//! Rows across hosts (DESIGN §9), in the same run as the rest:
//! - the fs worker reached over TCP, plaintext and mutual TLS, next to `airlock up`'s
//!   Unix socket: what the transport costs;
//! - one fs replica against three behind one orchestrator, each replica held to half a
//!   CPU by a cgroup (a pod with a 500m CPU limit: on one machine, the stand-in for
//!   replicas on their own nodes), on a call that is worker-bound (`search_files` with a
//!   regex over 4 MiB) and on a small read (orchestrator-bound).
//!
//! Every component is its own process (`airlock serve worker fs --listen`, `airlock serve
//! orchestrator`), with certificates from `airlock certs init`.

use std::fmt::Write as _;

use super::*;

/// The principal the cluster orchestrators accept, and the variable holding its token.
const PRINCIPAL: &str = "bench";
const TOKEN_ENV: &str = "AIRLOCK_BENCH_TOKEN";
const TOKEN: &str = "bench-cluster-token-4f1c";
/// CPU of each limited replica, in millicores.
const REPLICA_MILLICORES: u64 = 500;
/// The search corpus: files × bytes each.
const CORPUS_FILES: usize = 64;
const CORPUS_FILE_BYTES: usize = 64 * 1024;
/// Requests per target and row.
const CLUSTER_REQUESTS: usize = 1200;
const SEARCH_REQUESTS: usize = 300;

/// A cgroup that holds processes to a CPU quota (v2 `cpu.max` or v1 CFS quota); removed
/// when dropped.
struct CpuLimit {
    dir: PathBuf,
    procs_file: PathBuf,
    root_procs: PathBuf,
}

impl CpuLimit {
    fn new(name: &str, millicores: u64) -> Result<Self> {
        let period = 100_000u64;
        let quota = period * millicores / 1000;
        let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers");
        let v1 = Path::new("/sys/fs/cgroup/cpu/cpu.cfs_quota_us");
        let (root, write): (PathBuf, Vec<(&str, String)>) = if std::fs::read_to_string(v2)
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "cpu"))
        {
            (
                PathBuf::from("/sys/fs/cgroup"),
                vec![("cpu.max", format!("{quota} {period}"))],
            )
        } else if v1.exists() {
            (
                PathBuf::from("/sys/fs/cgroup/cpu"),
                vec![
                    ("cpu.cfs_period_us", period.to_string()),
                    ("cpu.cfs_quota_us", quota.to_string()),
                ],
            )
        } else {
            bail!(
                "the replica rows hold each replica to {millicores}m CPU with a cgroup, and \
                 this host has no cgroup cpu controller (neither {} nor {}); run the bench \
                 as root on a host with one",
                v2.display(),
                v1.display()
            );
        };
        let dir = root.join(format!("airlock-bench-{name}-{}", std::process::id()));
        std::fs::create_dir(&dir).with_context(|| {
            format!(
                "cannot create the cgroup {} (the replica rows need root)",
                dir.display()
            )
        })?;
        for (file, value) in write {
            std::fs::write(dir.join(file), &value)
                .with_context(|| format!("cannot write {value} to {}/{file}", dir.display()))?;
        }
        Ok(Self {
            procs_file: dir.join("cgroup.procs"),
            root_procs: root.join("cgroup.procs"),
            dir,
        })
    }

    fn add(&self, pid: u32) -> Result<()> {
        std::fs::write(&self.procs_file, pid.to_string())
            .with_context(|| format!("cannot move {pid} into {}", self.dir.display()))
    }
}

impl Drop for CpuLimit {
    fn drop(&mut self) {
        if let Ok(pids) = std::fs::read_to_string(&self.procs_file) {
            for pid in pids.lines() {
                let _ = std::fs::write(&self.root_procs, pid);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// One fs worker on TCP.
struct Worker {
    /// Stopped (SIGTERM, then SIGKILL) when the worker is dropped.
    _process: ChildGuard,
    addr: String,
    _limit: Option<CpuLimit>,
}

/// How the components of a cluster talk: mutual TLS with the certificates in `pki`, or
/// plaintext (`insecure_plaintext`).
#[derive(Clone, Copy)]
enum Transport<'a> {
    Plaintext,
    MutualTls(&'a Path),
}

impl Transport<'_> {
    fn section(self, component: &str) -> String {
        match self {
            Transport::Plaintext => "[tls]\ninsecure_plaintext = true\n".to_owned(),
            Transport::MutualTls(pki) => format!(
                "[tls]\ncert_file = \"{dir}/{component}.crt\"\nkey_file = \"{dir}/{component}.key\"\nca_file = \"{dir}/ca.crt\"\n",
                dir = pki.display()
            ),
        }
    }

    fn scheme(self) -> &'static str {
        match self {
            Transport::Plaintext => "http",
            Transport::MutualTls(_) => "https",
        }
    }
}

fn start_worker(
    scratch: &Path,
    name: &'static str,
    workspaces: &Path,
    transport: Transport<'_>,
    limit: Option<u64>,
) -> Result<Worker> {
    let dir = scratch.join(name);
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("worker.toml");
    std::fs::write(
        &config,
        format!(
            "workspaces_root = \"{}\"\n[sandbox]\nworkspace_bytes = 0\nworkspace_inodes = 0\n\
             [fs]\nmax_read_bytes = {MAX_READ_BYTES}\n{}",
            workspaces.display(),
            transport.section("worker-fs")
        ),
    )?;
    let port = free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let mut command = Command::new(AIRLOCK_BIN);
    command
        .args(["serve", "worker", "fs", "--listen", &addr, "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.join("data"));
    let mut process = ChildGuard::spawn(name, command, dir.join("worker.log"))?;
    let limit = match limit {
        Some(millicores) => {
            let limit = CpuLimit::new(name, millicores)?;
            limit.add(process.child.id())?;
            Some(limit)
        }
        None => None,
    };
    let deadline = Instant::now() + START_TIMEOUT;
    while std::net::TcpStream::connect(&addr).is_err() {
        process.check_running()?;
        ensure!(
            Instant::now() < deadline,
            "{name} did not listen on {addr}:\n{}",
            process.log_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(Worker {
        _process: process,
        addr,
        _limit: limit,
    })
}

/// An orchestrator on its own, dialing `workers` as one fs group.
struct Orchestrator {
    name: &'static str,
    process: ChildGuard,
    url: String,
}

async fn start_orchestrator(
    scratch: &Path,
    name: &'static str,
    workspaces: &Path,
    workers: &[&Worker],
    transport: Transport<'_>,
) -> Result<Orchestrator> {
    let dir = scratch.join(name);
    std::fs::create_dir_all(&dir)?;
    let endpoints: Vec<String> = workers
        .iter()
        .map(|w| format!("\"{}://{}\"", transport.scheme(), w.addr))
        .collect();
    let config = dir.join("orchestrator.toml");
    std::fs::write(
        &config,
        format!(
            "workspaces_root = \"{workspaces}\"\n[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n\n\
             [[principals]]\nname = \"{PRINCIPAL}\"\ntoken_env = \"{TOKEN_ENV}\"\nroles = [\"agent\"]\n\n\
             [approvals]\ntools = []\n[budgets]\nrate_per_minute = 0\n\n\
             [[workers]]\ngroup = \"fs\"\nendpoints = [{endpoints}]\nserver_name = \"worker-fs\"\n\n{tls}",
            workspaces = workspaces.display(),
            endpoints = endpoints.join(", "),
            tls = transport.section("orchestrator"),
        ),
    )?;
    let data = dir.join("data");
    let mut command = Command::new(AIRLOCK_BIN);
    command
        .args(["serve", "orchestrator", "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(&data)
        .env(TOKEN_ENV, TOKEN);
    let mut process = ChildGuard::spawn(name, command, dir.join("orchestrator.log"))?;
    let run_file = data.join("run/orchestrator.json");
    let deadline = Instant::now() + START_TIMEOUT;
    let url = loop {
        process.check_running()?;
        if let Some(url) = std::fs::read_to_string(&run_file)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| v["http"].as_str().map(str::to_owned))
        {
            break url.trim_end_matches('/').to_owned();
        }
        ensure!(
            Instant::now() < deadline,
            "{name} wrote no run file:\n{}",
            process.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    wait_ok(&mut process, &format!("{url}/readyz")).await?;
    Ok(Orchestrator { name, process, url })
}

impl Orchestrator {
    fn target(&self) -> Target {
        Target {
            name: self.name,
            url: format!("{}/v1/tool_calls", self.url),
            kind: Kind::Airlock {
                auth: format!("Bearer {TOKEN}"),
            },
            pid: self.process.child.id(),
        }
    }
}

/// Runs `rows` (file × concurrency) over `targets` in alternating rounds.
async fn measure(
    targets: &[Target],
    rows: &[(&BenchFile, usize, usize)],
    filters: &[String],
) -> Result<Vec<Row>> {
    let mut out = Vec::new();
    for (file, concurrency, budget) in rows {
        let label = format!("{} c={concurrency}", file.label);
        if !filters.is_empty() && !filters.iter().any(|f| label.contains(f.as_str())) {
            continue;
        }
        eprintln!("row {label}: {budget} requests per server in {ROUNDS} alternating rounds");
        for target in targets {
            run_requests(target, file, 20, 1, ROW_TIME_CAP).await?;
        }
        let stats = alternate_rounds(targets, file, *budget, *concurrency, ROUNDS).await?;
        out.push(Row { label, stats });
    }
    Ok(out)
}

/// A table whose ratios are against the table's first target.
fn table(title: &str, note: &str, rows: &[Row], targets: &[Target]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "## {title}\n\n{note}\n");
    let _ = writeln!(
        out,
        "| row | server | n | p50 ms | p99 ms | throughput req/s | p50 ratio | throughput ratio | server CPU ms/req |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for row in rows {
        let summaries: Vec<Summary> = row.stats.iter().map(Stats::summary).collect();
        let Some(base) = summaries.first() else {
            continue;
        };
        for (target, s) in targets.iter().zip(&summaries) {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.3} | {:.3} | {:.0} | {:.2} | {:.2} | {:.2} |",
                row.label,
                target.name,
                s.n,
                s.p50,
                s.p99,
                s.throughput,
                s.p50 / base.p50,
                s.throughput / base.throughput,
                s.cpu_ms
            );
        }
    }
    out
}

/// The search corpus in `workspace/corpus`, and a row that searches it.
fn corpus(workspace: &Path) -> Result<BenchFile> {
    let dir = workspace.join("corpus");
    std::fs::create_dir_all(&dir)?;
    let body = text_file(CORPUS_FILE_BYTES);
    for i in 0..CORPUS_FILES {
        let mut text = body.clone();
        if i % 16 == 7 {
            text.push_str(&format!("needle-{i}\n"));
        }
        std::fs::write(dir.join(format!("f{i:03}.txt")), text)?;
    }
    Ok(BenchFile {
        label: format!(
            "search_files regex over {} MiB",
            (CORPUS_FILES * CORPUS_FILE_BYTES) >> 20
        ),
        path: PathBuf::new(),
        content: "".into(),
        shell: None,
        tool: Some((
            "search_files",
            json!({"path": "corpus", "content_regex": "needle-[0-9]+"}),
        )),
    })
}

/// Asks `target` once for `file`'s answer and keeps it as the answer every later call
/// must give (the search result's exact text), checking that it found every needle.
async fn expect_first_answer(target: &Target, mut file: BenchFile) -> Result<BenchFile> {
    let client = client()?;
    let response = target.request(&client, &target.body(&file)?).send().await?;
    let body: Value = response.json().await?;
    let text = body["tool_results"][0]["content"][0]["text"]
        .as_str()
        .with_context(|| format!("no search result: {body}"))?
        .to_owned();
    for i in (0..CORPUS_FILES).filter(|i| i % 16 == 7) {
        ensure!(
            text.contains(&format!("needle-{i}")),
            "the search missed needle-{i}: {text}"
        );
    }
    file.content = text.into();
    Ok(file)
}

/// Starts the clusters, measures their rows, and returns the tables.
pub async fn run(
    scratch: &Path,
    unix: &Target,
    small: &BenchFile,
    filters: &[String],
) -> Result<String> {
    let scratch = scratch.join("cluster");
    let pki = scratch.join("pki");
    std::fs::create_dir_all(&scratch)?;
    let status = Command::new(AIRLOCK_BIN)
        .args(["certs", "init", "--out"])
        .arg(&pki)
        .stdout(Stdio::null())
        .status()
        .context("cannot run airlock certs init")?;
    ensure!(status.success(), "airlock certs init failed");
    let workspaces = scratch.join("workspaces");
    let workspace = workspaces.join(PRINCIPAL).join("default");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&workspace)?;
    std::fs::write(workspace.join("small.txt"), &*small.content)?;
    let tls = Transport::MutualTls(&pki);

    // 1. Transport: one unlimited worker over plaintext TCP, one over mutual TLS.
    let plain_worker = start_worker(
        &scratch,
        "worker-tcp",
        &workspaces,
        Transport::Plaintext,
        None,
    )?;
    let tls_worker = start_worker(&scratch, "worker-mtls", &workspaces, tls, None)?;
    let plain = start_orchestrator(
        &scratch,
        "airlock tcp plaintext",
        &workspaces,
        &[&plain_worker],
        Transport::Plaintext,
    )
    .await?;
    let mtls = start_orchestrator(
        &scratch,
        "airlock tcp mTLS",
        &workspaces,
        &[&tls_worker],
        tls,
    )
    .await?;
    let transport_targets = vec![unix.clone(), plain.target(), mtls.target()];
    let transport_rows = measure(
        &transport_targets,
        &[(small, 1, CLUSTER_REQUESTS), (small, 16, CLUSTER_REQUESTS)],
        filters,
    )
    .await?;
    drop((plain, mtls, plain_worker, tls_worker));

    // 2. Replicas: one against three, each held to REPLICA_MILLICORES.
    let limit = Some(REPLICA_MILLICORES);
    let one = start_worker(&scratch, "replica-solo", &workspaces, tls, limit)?;
    let three = [
        start_worker(&scratch, "replica-a", &workspaces, tls, limit)?,
        start_worker(&scratch, "replica-b", &workspaces, tls, limit)?,
        start_worker(&scratch, "replica-c", &workspaces, tls, limit)?,
    ];
    let single =
        start_orchestrator(&scratch, "1 fs replica (500m)", &workspaces, &[&one], tls).await?;
    let triple = start_orchestrator(
        &scratch,
        "3 fs replicas (500m each)",
        &workspaces,
        &three.iter().collect::<Vec<_>>(),
        tls,
    )
    .await?;
    let search = expect_first_answer(&single.target(), corpus(&workspace)?).await?;
    let replica_targets = vec![single.target(), triple.target()];
    let replica_rows = measure(
        &replica_targets,
        &[
            (&search, 16, SEARCH_REQUESTS),
            (small, 16, CLUSTER_REQUESTS),
        ],
        filters,
    )
    .await?;

    let mut out = table(
        "The fs worker over TCP: plaintext and mutual TLS next to the Unix socket (same run)",
        "`airlock up` (workers on Unix sockets) against an orchestrator and one fs worker as \
         separate processes on 127.0.0.1, plaintext (`insecure_plaintext`) and mutual TLS \
         (certificates from `airlock certs init`). Ratios are against `airlock up`; mTLS \
         against plaintext is the last row of each pair over the one before.",
        &transport_rows,
        &transport_targets,
    );
    out.push('\n');
    out.push_str(&table(
        "Three fs replicas against one, at concurrency 16 (same run)",
        &format!(
            "Each replica is held to {REPLICA_MILLICORES}m CPU by a cgroup (a pod's CPU \
             limit; on one machine, the stand-in for replicas on their own nodes); the \
             orchestrators are not limited. Over mutual TLS. Ratios are against one replica."
        ),
        &replica_rows,
        &replica_targets,
    ));
    Ok(out)
}
