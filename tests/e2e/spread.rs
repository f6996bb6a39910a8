//! One name, three replicas (DESIGN §9), on one machine as several hosts: three fs
//! workers on 127.0.0.2, .3 and .4 (same port, mutual TLS), and an orchestrator in a
//! mount namespace of its own whose `/etc/hosts` maps `fs.airlock.test` to all three,
//! dialing `dns:///fs.airlock.test:<port>`. Calls spread over the replicas; a replica
//! killed with calls in flight costs no read-only call and reports a destructive one as
//! of unknown outcome; a frozen one (SIGSTOP) is ejected and re-admitted; a rolling
//! restart under load loses no call.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::process::Signal;
use serde_json::{Value, json};

use crate::mtls::{Component, certs_init, tls_section};
use crate::support::{AIRLOCK, signal, token_digest};

const TOKEN: &str = "spread-test-token-77a";
const NAME: &str = "fs.airlock.test";
const HOSTS: [&str; 3] = ["127.0.0.2", "127.0.0.3", "127.0.0.4"];

/// Three fs worker replicas and an orchestrator that knows them by one name.
struct Cluster {
    scratch: tempfile::TempDir,
    pki: PathBuf,
    port: u16,
    workers: Vec<Option<Component>>,
    orchestrator: Component,
    url: String,
    http: reqwest::Client,
}

/// A port free on every replica address (each binds its own address).
fn free_port() -> u16 {
    let probe = std::net::TcpListener::bind((HOSTS[0], 0)).expect("bind a probe port");
    let port = probe.local_addr().expect("probe address").port();
    for host in &HOSTS[1..] {
        std::net::TcpListener::bind((*host, port)).expect("the port is free on every replica");
    }
    port
}

impl Cluster {
    async fn start() -> Self {
        let scratch = tempfile::tempdir().expect("temp dir");
        let pki = scratch.path().join("pki");
        certs_init(&pki);
        let port = free_port();
        let mut cluster_workers = Vec::new();
        for index in 0..HOSTS.len() {
            cluster_workers.push(Some(start_worker(scratch.path(), &pki, index, port)));
        }
        for worker in cluster_workers.iter_mut().flatten() {
            worker.wait_for_line("mutual TLS on TCP");
        }

        let hosts = scratch.path().join("hosts");
        let mut lines = String::from("127.0.0.1 localhost\n");
        for host in HOSTS {
            lines.push_str(&format!("{host} {NAME}\n"));
        }
        std::fs::write(&hosts, lines).expect("hosts file");
        let config = scratch.path().join("orchestrator.toml");
        std::fs::write(
            &config,
            format!(
                "workspaces_root = \"{workspaces}\"\n[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n\n\
                 [[principals]]\nname = \"ops\"\ntoken_sha256 = \"{digest}\"\nroles = [\"agent\", \"admin\"]\n\n\
                 [approvals]\ntools = []\n[budgets]\nrate_per_minute = 0\nmax_calls_per_session = 1000000\nsession_wall_time_seconds = 86400\n\n\
                 [dispatch]\nresolve_interval_ms = 1000\n\n\
                 [[workers]]\ngroup = \"fs\"\nendpoints = [\"dns:///{NAME}:{port}\"]\nserver_name = \"worker-fs\"\n\n{tls}",
                workspaces = scratch.path().join("workspaces").display(),
                digest = token_digest(TOKEN),
                tls = tls_section(&pki, "orchestrator"),
            ),
        )
        .expect("orchestrator config");
        let data = scratch.path().join("orchestrator-data");
        let mut orchestrator = start_in_own_hosts(&hosts, &config, &data, scratch.path());
        let url = orchestrator.http_url(&data).await;
        let cluster = Self {
            scratch,
            pki,
            port,
            workers: cluster_workers,
            orchestrator,
            url,
            http: reqwest::Client::new(),
        };
        cluster.wait_states(&["serving"; 3]).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        while cluster
            .call("list_directory", json!({"path": "."}))
            .await
            .status
            != "ok"
        {
            assert!(
                Instant::now() < deadline,
                "the fs tools never appeared:\n{}",
                cluster.orchestrator.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        cluster
    }

    fn endpoint(&self, index: usize) -> String {
        format!("https://{}:{}", HOSTS[index], self.port)
    }

    /// `/readyz`'s replicas of the fs group, by endpoint.
    async fn replica_states(&self) -> Vec<(String, String, u64)> {
        let Ok(response) = self.http.get(format!("{}/readyz", self.url)).send().await else {
            return Vec::new();
        };
        let body: Value = response.json().await.unwrap_or(Value::Null);
        body["replicas"]["fs"]
            .as_array()
            .map(|all| {
                all.iter()
                    .map(|r| {
                        (
                            r["endpoint"].as_str().unwrap_or_default().to_owned(),
                            r["state"].as_str().unwrap_or_default().to_owned(),
                            r["in_flight"].as_u64().unwrap_or_default(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    async fn state_of(&self, index: usize) -> String {
        let endpoint = self.endpoint(index);
        self.replica_states()
            .await
            .into_iter()
            .find(|(e, _, _)| *e == endpoint)
            .map(|(_, s, _)| s)
            .unwrap_or_default()
    }

    /// Waits until replica `i` is in state `states[i]` (an empty string: any).
    async fn wait_states(&self, states: &[&str]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let now = self.replica_states().await;
            let matched = states.iter().enumerate().all(|(i, want)| {
                want.is_empty()
                    || now
                        .iter()
                        .any(|(e, s, _)| *e == self.endpoint(i) && s == want)
            });
            if matched {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "replicas {now:?}, want {states:?}\n--- orchestrator\n{}",
                self.orchestrator.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// One call; returns (status, is_error, text, replica).
    async fn call(&self, tool: &str, input: Value) -> Call {
        call(&self.http, &self.url, tool, input).await
    }

    fn pid(&self, index: usize) -> u32 {
        self.workers[index]
            .as_ref()
            .expect("worker runs")
            .child
            .id()
    }

    /// Replaces replica `index` with a new process on the same address.
    fn restart(&mut self, index: usize) {
        let mut fresh = start_worker(self.scratch.path(), &self.pki, index, self.port);
        fresh.wait_for_line("mutual TLS on TCP");
        self.workers[index] = Some(fresh);
    }
}

#[derive(Debug, Clone)]
struct Call {
    status: String,
    is_error: bool,
    text: String,
    replica: String,
}

async fn call(http: &reqwest::Client, url: &str, tool: &str, input: Value) -> Call {
    let sent = http
        .post(format!("{url}/v1/tool_calls"))
        .bearer_auth(TOKEN)
        .json(&json!({"session_id": "spread", "tool_uses": [{"type": "tool_use", "id": "t", "name": tool, "input": input}]}))
        .timeout(Duration::from_secs(90))
        .send()
        .await;
    let body: Value = match sent {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(e) => {
            return Call {
                status: "transport".to_owned(),
                is_error: true,
                text: e.to_string(),
                replica: String::new(),
            };
        }
    };
    Call {
        status: body["calls"][0]["status"]
            .as_str()
            .unwrap_or("?")
            .to_owned(),
        is_error: body["tool_results"][0]["is_error"]
            .as_bool()
            .unwrap_or(true),
        text: body["tool_results"][0]["content"].to_string(),
        replica: body["calls"][0]["replica"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    }
}

fn start_worker(scratch: &Path, pki: &Path, index: usize, port: u16) -> Component {
    let config = scratch.join(format!("worker-{index}.toml"));
    std::fs::write(
        &config,
        format!(
            "workspaces_root = \"{}\"\n[sandbox]\nworkspace_bytes = 0\nworkspace_inodes = 0\n[worker]\ndrain_seconds = 10\n{}",
            scratch.join("workspaces").display(),
            tls_section(pki, "worker-fs")
        ),
    )
    .expect("worker config");
    let listen = format!("{}:{port}", HOSTS[index]);
    let logs = std::fs::read_dir(scratch)
        .map(|d| d.count())
        .unwrap_or_default();
    Component::start(
        &["serve", "worker", "fs", "--listen", &listen],
        &config,
        &scratch.join(format!("worker-{index}-data")),
        scratch.join(format!("worker-{index}-{logs}.log")),
    )
}

/// The orchestrator in a mount namespace of its own, where `/etc/hosts` is `hosts`: the
/// name resolves as a cluster DNS would, and nothing on the host changes.
fn start_in_own_hosts(hosts: &Path, config: &Path, data: &Path, scratch: &Path) -> Component {
    let mut unshare = Command::new("unshare");
    unshare
        .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg("mount --bind \"$0\" /etc/hosts && exec \"$@\"")
        .arg(hosts)
        .arg(AIRLOCK);
    Component::start_under(
        unshare,
        &["serve", "orchestrator"],
        config,
        data,
        scratch.join("orchestrator.log"),
    )
}

/// Runs `calls` calls, `concurrency` at a time, each made by `make(i)`; returns them in
/// order. Bounded in count; every call is bounded in time.
async fn load(
    cluster: &Cluster,
    calls: usize,
    concurrency: usize,
    make: impl Fn(usize) -> (&'static str, Value) + Send + Sync + 'static,
) -> Vec<Call> {
    let make = Arc::new(make);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let results = Arc::new(std::sync::Mutex::new(vec![None; calls]));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, url) = (cluster.http.clone(), cluster.url.clone());
        let (make, next, results) = (make.clone(), next.clone(), results.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= calls {
                    return;
                }
                let (tool, input) = make(i);
                let done = call(&http, &url, tool, input).await;
                results.lock().expect("results")[i] = Some(done);
            }
        }));
    }
    for task in tasks {
        task.await.expect("load task");
    }
    let results = std::mem::take(&mut *results.lock().expect("results"));
    results
        .into_iter()
        .map(|c| c.expect("every call ran"))
        .collect()
}

/// The calls `cluster` runs on replica `index` now.
async fn held_by(cluster: &Cluster, index: usize) -> u64 {
    let endpoint = cluster.endpoint(index);
    cluster
        .replica_states()
        .await
        .into_iter()
        .find(|(e, _, _)| *e == endpoint)
        .map(|(_, _, n)| n)
        .unwrap_or_default()
}

/// Sends `tool` calls in waves of 8 until replica `index` (frozen) holds `want` calls;
/// bounded in time. Returns the calls, still running.
async fn until_held(
    cluster: &Cluster,
    index: usize,
    tool: &'static str,
    want: u64,
) -> Vec<tokio::task::JoinHandle<Call>> {
    let mut tasks = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(
            Instant::now() < deadline,
            "no {tool} call reached the frozen replica"
        );
        for n in 0..8 {
            let (http, url) = (cluster.http.clone(), cluster.url.clone());
            let input = if tool == "write_file" {
                json!({"path": format!("w{}-{n}.txt", tasks.len()), "content": "x"})
            } else {
                json!({"path": "shared.txt"})
            };
            tasks.push(tokio::spawn(
                async move { call(&http, &url, tool, input).await },
            ));
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        if held_by(cluster, index).await >= want {
            return tasks;
        }
    }
}

fn read(_: usize) -> (&'static str, Value) {
    ("read_file", json!({"path": "shared.txt"}))
}

#[tokio::test]
async fn three_replicas_behind_one_name_share_the_calls_and_survive_losing_one() {
    let mut cluster = Cluster::start().await;
    let wrote = cluster
        .call(
            "write_file",
            json!({"path": "shared.txt", "content": "one file, three replicas"}),
        )
        .await;
    assert_eq!(wrote.status, "ok", "{wrote:?}");

    // 1. 300 read-only calls at concurrency 16 spread over all three.
    let calls = load(&cluster, 300, 16, read).await;
    let mut share = std::collections::BTreeMap::<String, usize>::new();
    for c in &calls {
        assert_eq!(c.status, "ok", "{c:?}");
        assert!(c.text.contains("one file, three replicas"), "{c:?}");
        *share.entry(c.replica.clone()).or_default() += 1;
    }
    assert_eq!(share.len(), 3, "every replica serves a share: {share:?}");
    for (replica, n) in &share {
        assert!(*n >= 30, "{replica} served only {n} of 300: {share:?}");
    }

    // 2. A replica dies with calls in flight. To have calls on it when it dies, it is
    //    frozen first: writes go out in waves until one waits on it, then reads until
    //    one waits there too; then it is killed.
    let victim = 1;
    signal(cluster.pid(victim), Signal::STOP);
    let writes = until_held(&cluster, victim, "write_file", 1).await;
    // Settled: every write still running waits on the frozen replica.
    let settle = Instant::now() + Duration::from_secs(10);
    while Instant::now() < settle
        && writes.iter().filter(|t| !t.is_finished()).count() as u64
            != held_by(&cluster, victim).await
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let waiting = held_by(&cluster, victim).await;
    let reads = until_held(&cluster, victim, "read_file", waiting + 1).await;
    signal(cluster.pid(victim), Signal::KILL);
    if let Some(mut dead) = cluster.workers[victim].take() {
        let _ = dead.child.wait();
    }
    let mut read_results = Vec::new();
    for t in reads {
        read_results.push(t.await.expect("read"));
    }
    let mut write_results = Vec::new();
    for t in writes {
        write_results.push(t.await.expect("write"));
    }
    for c in &read_results {
        assert_eq!(c.status, "ok", "a read-only call is never lost: {c:?}");
        assert_ne!(c.replica, cluster.endpoint(victim), "{c:?}");
    }
    assert!(
        cluster
            .orchestrator
            .log()
            .contains("running the read-only call on another replica"),
        "the read that waited on the dead replica ran again elsewhere:\n{}",
        cluster.orchestrator.log()
    );
    let mut unknown = 0;
    for c in &write_results {
        if c.status == "ok" {
            assert_ne!(c.replica, cluster.endpoint(victim), "{c:?}");
            continue;
        }
        assert!(c.is_error, "{c:?}");
        assert!(
            c.text.contains("may or may not have taken effect"),
            "a destructive call on the dead replica is reported as of unknown outcome: {c:?}"
        );
        unknown += 1;
    }
    assert!(
        unknown > 0,
        "the write that waited on the dead replica: {write_results:?}"
    );
    cluster.wait_states(&["serving", "down", "serving"]).await;

    // 3. It comes back on the same address and is re-admitted.
    cluster.restart(victim);
    cluster.wait_states(&["serving"; 3]).await;
    let after = load(&cluster, 60, 6, read).await;
    assert!(after.iter().all(|c| c.status == "ok"), "{after:?}");
    assert!(
        after.iter().any(|c| c.replica == cluster.endpoint(victim)),
        "the re-admitted replica takes calls again: {after:?}"
    );
}

#[tokio::test]
async fn a_frozen_replica_is_ejected_and_its_calls_go_elsewhere() {
    let cluster = Cluster::start().await;
    let wrote = cluster
        .call(
            "write_file",
            json!({"path": "shared.txt", "content": "frozen"}),
        )
        .await;
    assert_eq!(wrote.status, "ok", "{wrote:?}");
    let frozen = 2;
    signal(cluster.pid(frozen), Signal::STOP);
    // Calls go on while it is frozen; the keepalive ejects it within seconds.
    let during = load(&cluster, 80, 4, read).await;
    for c in &during {
        assert_eq!(c.status, "ok", "{c:?}");
    }
    cluster.wait_states(&["", "", "down"]).await;
    let ejected = load(&cluster, 40, 4, read).await;
    for c in &ejected {
        assert_eq!(c.status, "ok", "{c:?}");
        assert_ne!(
            c.replica,
            cluster.endpoint(frozen),
            "an ejected replica takes no call: {c:?}"
        );
    }
    assert!(
        cluster.orchestrator.log().contains("replica ejected"),
        "{}",
        cluster.orchestrator.log()
    );
    // Thawed, it is re-admitted.
    signal(cluster.pid(frozen), Signal::CONT);
    cluster.wait_states(&["serving"; 3]).await;
    let thawed = load(&cluster, 60, 6, read).await;
    assert!(thawed.iter().all(|c| c.status == "ok"), "{thawed:?}");
    assert!(
        thawed.iter().any(|c| c.replica == cluster.endpoint(frozen)),
        "{thawed:?}"
    );
    assert_eq!(cluster.state_of(frozen).await, "serving");
}

#[tokio::test]
async fn a_rolling_restart_under_load_loses_no_call() {
    let mut cluster = Cluster::start().await;
    let wrote = cluster
        .call(
            "write_file",
            json!({"path": "shared.txt", "content": "rolling"}),
        )
        .await;
    assert_eq!(wrote.status, "ok", "{wrote:?}");
    // Bounded load: reads and writes, 6 at a time, until the restart is over (and at
    // most 3000 calls or 3 minutes).
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for lane in 0..6 {
        let (http, url, stop) = (cluster.http.clone(), cluster.url.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed)
                && out.len() < 500
                && started.elapsed() < Duration::from_secs(180)
            {
                let done = if lane % 2 == 0 {
                    call(&http, &url, "read_file", json!({"path": "shared.txt"})).await
                } else {
                    call(
                        &http,
                        &url,
                        "write_file",
                        json!({"path": format!("lane{lane}-{i}.txt"), "content": "r"}),
                    )
                    .await
                };
                out.push(done);
                i += 1;
            }
            out
        }));
    }
    for index in 0..HOSTS.len() {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let pid = cluster.pid(index);
        signal(pid, Signal::TERM);
        let mut old = cluster.workers[index].take().expect("worker");
        let status = tokio::task::spawn_blocking(move || {
            let status = old.child.wait();
            (status, old)
        })
        .await
        .expect("wait");
        let (status, old) = status;
        assert!(
            status.expect("exit status").success(),
            "a drained worker exits 0:\n{}",
            old.log()
        );
        assert!(old.log().contains("drained"), "{}", old.log());
        cluster.restart(index);
        let mut states = vec![""; 3];
        states[index] = "serving";
        cluster.wait_states(&states).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("lane"));
    }
    assert!(all.len() >= 30, "the load ran: {} calls", all.len());
    let failed: Vec<&Call> = all.iter().filter(|c| c.status != "ok").collect();
    assert!(
        failed.is_empty(),
        "{} of {} calls failed during the rolling restart, first: {:?}\n--- orchestrator\n{}",
        failed.len(),
        all.len(),
        &failed[..failed.len().min(5)],
        cluster.orchestrator.log()
    );
    let on: std::collections::BTreeSet<&str> = all.iter().map(|c| c.replica.as_str()).collect();
    assert_eq!(on.len(), 3, "{on:?}");
}
