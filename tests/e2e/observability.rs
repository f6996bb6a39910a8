//! Observability with the real tools: a Prometheus server (Debian's `prometheus`) scrapes
//! the orchestrator and every worker of `airlock up`, and PromQL over its HTTP API
//! returns the calls made, by tool and status; `promtool` reads what `/metrics` serves.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::Airlock;

const METRICS: &str = "[metrics]\nlisten = \"127.0.0.1:0\"\n";

/// A tool of the Prometheus package, or a failure that says how to install it: these
/// tests never skip.
fn prometheus_tool(name: &str) -> &'static str {
    let path = match name {
        "prometheus" => "/usr/bin/prometheus",
        _ => "/usr/bin/promtool",
    };
    assert!(
        Path::new(path).exists(),
        "{path} not found: these tests need Prometheus (apt-get install prometheus)"
    );
    path
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A Prometheus server on loopback, killed on drop.
struct Prometheus {
    child: Child,
    url: String,
    dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Prometheus scraping each `(job, url)` every second; waits (bounded) until
    /// it is ready.
    async fn start(targets: &[(String, String)]) -> Self {
        let binary = prometheus_tool("prometheus");
        let dir = tempfile::tempdir().expect("temp dir");
        let mut config =
            String::from("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n");
        for (job, url) in targets {
            let url = reqwest::Url::parse(url).expect("metrics url");
            let target = format!(
                "{}:{}",
                url.host_str().expect("host"),
                url.port().expect("port")
            );
            config.push_str(&format!(
                "  - job_name: {job}\n    metrics_path: {}\n    static_configs:\n      - targets: ['{target}']\n",
                url.path()
            ));
        }
        std::fs::write(dir.path().join("prometheus.yml"), &config).expect("write config");
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log");
        let child = Command::new(binary)
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        let prometheus = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = reqwest::get(format!("{}/-/ready", prometheus.url)).await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                return prometheus;
            }
            assert!(
                Instant::now() < deadline,
                "Prometheus did not get ready:\n{config}\n{}",
                prometheus.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// An instant PromQL query over the HTTP API: its result vector.
    async fn query(&self, promql: &str) -> Vec<Value> {
        let url = reqwest::Url::parse_with_params(
            &format!("{}/api/v1/query", self.url),
            [("query", promql)],
        )
        .expect("query url");
        let body: Value = reqwest::get(url)
            .await
            .expect("query prometheus")
            .json()
            .await
            .expect("JSON answer");
        assert_eq!(body["status"], "success", "{promql}: {body}");
        body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Polls `promql` (bounded) until `check` accepts its result; the last result when
    /// it never does, for the failure message.
    async fn eventually(&self, promql: &str, check: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let result = self.query(promql).await;
            if check(&result) {
                return result;
            }
            if Instant::now() > deadline {
                panic!(
                    "{promql} never gave what was expected; last: {}\n{}",
                    json!(result),
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

/// `(labels joined, value)` of a result vector, sorted, for comparison.
fn samples(result: &[Value], labels: &[&str]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = result
        .iter()
        .map(|s| {
            let key = labels
                .iter()
                .map(|l| s["metric"][l].as_str().unwrap_or("").to_owned())
                .collect::<Vec<_>>()
                .join("/");
            (key, s["value"][1].as_str().unwrap_or("").to_owned())
        })
        .collect();
    out.sort();
    out
}

/// `metrics` of endpoints.json: each component's scrape URL.
fn scrape_targets(airlock: &Airlock) -> Vec<(String, String)> {
    let endpoints: Value = serde_json::from_slice(
        &std::fs::read(airlock.data_dir().join("endpoints.json")).expect("endpoints.json"),
    )
    .expect("JSON");
    let metrics = endpoints["metrics"].as_object().expect("metrics endpoints");
    let mut targets: Vec<(String, String)> = metrics
        .iter()
        .map(|(component, url)| {
            let job = match component.as_str() {
                "orchestrator" => "airlock-orchestrator".to_owned(),
                group => format!("airlock-worker-{group}"),
            };
            (job, url.as_str().expect("url").to_owned())
        })
        .collect();
    targets.sort();
    targets
}

#[tokio::test]
async fn prometheus_scrapes_every_component_and_counts_calls_by_tool_and_status() {
    prometheus_tool("prometheus");
    let airlock = Airlock::start_with(&format!(
        "{METRICS}\n[approvals]\ntools = [\"write_file\"]\n[cache]\nttl_seconds = {{ list_tables = 60 }}\n"
    ))
    .await;
    let targets = scrape_targets(&airlock);
    let jobs: Vec<&str> = targets.iter().map(|(job, _)| job.as_str()).collect();
    assert_eq!(
        jobs,
        [
            "airlock-orchestrator",
            "airlock-worker-db",
            "airlock-worker-fs",
            "airlock-worker-http",
            "airlock-worker-shell"
        ]
    );

    // ok: two listings and a shell command; error: a missing file and a failing
    // command; denied: a write an approver refused.
    for _ in 0..2 {
        let (is_error, text, _) = airlock.call("list_directory", json!({"path": "."})).await;
        assert!(!is_error, "{text}");
    }
    let (is_error, text, _) = airlock
        .call("execute_shell", json!({"command": "echo hi"}))
        .await;
    assert!(!is_error, "{text}");
    let (is_error, _, _) = airlock
        .call("read_file", json!({"path": "missing.txt"}))
        .await;
    assert!(is_error);
    let (is_error, _, _) = airlock
        .call("execute_shell", json!({"command": "exit 3"}))
        .await;
    assert!(is_error);
    let (held, _) = airlock
        .propose(
            "default",
            "write_file",
            json!({"path": "a.txt", "content": "x"}),
        )
        .await;
    assert_eq!(held["status"], "pending_approval", "{held}");

    let prometheus = Prometheus::start(&targets).await;
    // Every component is scraped.
    prometheus
        .eventually("up == 1", |r| r.len() == targets.len())
        .await;
    // The held call shows in the approval backlog until it is decided.
    prometheus
        .eventually("airlock_pending_approvals", |r| {
            samples(r, &[]) == [(String::new(), "1".to_owned())]
        })
        .await;
    let approval_id = held["approval_id"].as_str().expect("approval id");
    let (status, body) = airlock
        .post(
            &format!("/v1/approvals/{approval_id}/deny"),
            &json!({"reason": "not now"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");

    let by_tool = "sum by (tool, status) (airlock_tool_calls_total{job=\"airlock-orchestrator\"})";
    let expected = [
        ("execute_shell/error", "1"),
        ("execute_shell/ok", "1"),
        ("list_directory/ok", "2"),
        ("read_file/error", "1"),
        ("write_file/denied", "1"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let result = prometheus
        .eventually(by_tool, |r| samples(r, &["tool", "status"]) == expected)
        .await;
    assert_eq!(samples(&result, &["tool", "status"]), expected);

    // The workers count what they ran (the denied write never reached one), and the
    // shell worker timed both sandboxes' start.
    let worker_calls = prometheus
        .eventually(
            "sum by (job, tool, status) (airlock_worker_calls_total)",
            |r| r.len() == 4,
        )
        .await;
    assert_eq!(
        samples(&worker_calls, &["job", "tool", "status"]),
        [
            ("airlock-worker-fs/list_directory/ok", "2"),
            ("airlock-worker-fs/read_file/error", "1"),
            ("airlock-worker-shell/execute_shell/error", "1"),
            ("airlock-worker-shell/execute_shell/ok", "1"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
    );
    prometheus
        .eventually("airlock_sandbox_spawn_seconds_count", |r| {
            samples(r, &["job"]) == [("airlock-worker-shell".to_owned(), "2".to_owned())]
        })
        .await;
    prometheus
        .eventually("airlock_pending_approvals", |r| {
            samples(r, &[]) == [(String::new(), "0".to_owned())]
        })
        .await;
    prometheus
        .eventually(
            "sum by (group) (airlock_worker_replicas{state=\"serving\"})",
            |r| r.len() == 4 && samples(r, &["group"]).iter().all(|(_, v)| v == "1"),
        )
        .await;
    // Process metrics of every component, and the audit chain checked at start.
    prometheus
        .eventually("process_resident_memory_bytes > 0", |r| {
            r.len() == targets.len()
        })
        .await;
    prometheus
        .eventually("airlock_audit_verify_ok", |r| {
            samples(r, &[]) == [(String::new(), "1".to_owned())]
        })
        .await;
    check_shipped_queries(&prometheus, &targets).await;
}

/// Every query of the shipped dashboard and alerting rules runs on this Prometheus, and
/// every series it names is one a component serves (declared, even with no sample yet).
async fn check_shipped_queries(prometheus: &Prometheus, targets: &[(String, String)]) {
    let mut served = std::collections::BTreeSet::new();
    for (_, url) in targets {
        let text = reqwest::get(url)
            .await
            .expect("scrape")
            .text()
            .await
            .expect("body");
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("# TYPE ") else {
                continue;
            };
            let mut words = rest.split(' ');
            let (name, kind) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
            served.insert(name.to_owned());
            if kind == "histogram" {
                for suffix in ["_bucket", "_count", "_sum"] {
                    served.insert(format!("{name}{suffix}"));
                }
            }
        }
    }
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/observability");
    let dashboard: Value = serde_json::from_slice(
        &std::fs::read(deploy.join("grafana-dashboard.json")).expect("dashboard"),
    )
    .expect("dashboard JSON");
    let mut queries: Vec<String> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().expect("expr").to_owned())
        .collect();
    let rules = std::fs::read_to_string(deploy.join("airlock.rules.yml")).expect("rules");
    // The rules' expressions, one-line or block (`expr: |`), without a YAML parser.
    let mut lines = rules.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(expr) = line.trim().strip_prefix("expr: ") else {
            continue;
        };
        if expr != "|" {
            queries.push(expr.to_owned());
            continue;
        }
        let mut block = String::new();
        while let Some(next) = lines.peek() {
            if next.trim().is_empty() || next.trim().ends_with(':') || next.contains(": ") {
                break;
            }
            block.push_str(next.trim());
            block.push(' ');
            lines.next();
        }
        queries.push(block);
    }
    assert!(queries.len() > 25, "{queries:?}");
    let names = regex_lite_names(&queries);
    for name in &names {
        assert!(
            served.contains(name) || name == "up",
            "{name} is queried by deploy/observability but no component serves it; served: {served:?}"
        );
    }
    for query in &queries {
        let query = query.replace("$__rate_interval", "1m");
        prometheus.query(&query).await;
    }
}

/// The series names (`airlock_*`, `process_*`, `up`) the queries mention.
fn regex_lite_names(queries: &[String]) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for query in queries {
        let mut word = String::new();
        for c in query.chars().chain([' ']) {
            if c.is_ascii_alphanumeric() || c == '_' {
                word.push(c);
                continue;
            }
            if word.starts_with("airlock_") || word.starts_with("process_") {
                names.insert(std::mem::take(&mut word));
            }
            word.clear();
        }
    }
    names
}

#[tokio::test]
async fn metrics_need_no_token_pass_promtool_and_name_no_call_session_or_argument() {
    let promtool = prometheus_tool("promtool");
    let airlock = Airlock::start_with(METRICS).await;
    let marker = "zq_marker_7731";
    let (is_error, text, call) = airlock
        .call_in(
            &format!("session-{marker}"),
            "write_file",
            json!({"path": format!("{marker}.txt"), "content": marker}),
        )
        .await;
    assert!(!is_error, "{text}");
    let call_id = call["call_id"].as_str().expect("call id").to_owned();
    // A tool name no worker serves is the caller's own text: counted as `unknown`.
    let (is_error, _, _) = airlock.call(&format!("tool_{marker}"), json!({})).await;
    assert!(is_error);

    let targets = scrape_targets(&airlock);
    for (job, url) in &targets {
        // No bearer token: Prometheus scrapes as anyone on the network would.
        let response = reqwest::get(url).await.expect("scrape");
        assert_eq!(response.status(), 200, "{job}");
        let content_type = response.headers()["content-type"]
            .to_str()
            .expect("content type")
            .to_owned();
        assert!(
            content_type.starts_with("text/plain; version=0.0.4"),
            "{job}: {content_type}"
        );
        let text = response.text().await.expect("body");
        for secret in [marker, call_id.as_str(), "/workspaces/"] {
            assert!(!text.contains(secret), "{job} shows {secret}:\n{text}");
        }
        let mut check = Command::new(promtool)
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("promtool");
        {
            use std::io::Write;
            let mut stdin = check.stdin.take().expect("stdin");
            stdin.write_all(text.as_bytes()).expect("feed promtool");
        }
        let out = check.wait_with_output().expect("promtool");
        assert!(
            out.status.success(),
            "{job}: promtool check metrics: {}{}\n{text}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = reqwest::get(format!("{}/metrics", airlock.url))
        .await
        .expect("scrape")
        .text()
        .await
        .expect("body");
    for line in [
        "airlock_tool_calls_total{tool=\"write_file\",status=\"ok\"} 1",
        "airlock_tool_calls_total{tool=\"unknown\",status=\"error\"} 1",
        "# TYPE airlock_tool_call_duration_seconds histogram",
        "# TYPE airlock_gate_stage_duration_seconds histogram",
        "# TYPE airlock_store_operation_duration_seconds histogram",
        "airlock_calls_in_flight 0",
        "airlock_pending_approvals 0",
    ] {
        assert!(text.contains(line), "{line} missing:\n{text}");
    }
}

#[tokio::test]
async fn audit_tail_follow_json_streams_events_as_appended_with_a_chain_that_verifies() {
    use std::io::BufRead;
    let airlock = Airlock::start().await;
    let (is_error, text, _) = airlock.call("list_directory", json!({"path": "."})).await;
    assert!(!is_error, "{text}");
    let mut tail = airlock
        .cli(&["audit", "tail", "--follow", "--json", "--limit", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("airlock audit tail");
    let stdout = tail.stdout.take().expect("stdout");
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if lines_tx.send(line).is_err() {
                return;
            }
        }
    });
    let next = async |lines: &mut tokio::sync::mpsc::UnboundedReceiver<String>| -> Value {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.recv())
            .await
            .expect("an event within 20 s")
            .expect("tail still running");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line}: {e}"))
    };
    // The latest event first (the call's completion), then what is appended after it.
    let first = next(&mut lines).await;
    assert_eq!(first["kind"], "completed", "{first}");
    let (is_error, text, call) = airlock
        .call(
            "write_file",
            json!({"path": "followed.txt", "content": "x"}),
        )
        .await;
    assert!(!is_error, "{text}");
    let call_id = call["call_id"].as_str().expect("call id");
    let mut events = vec![first];
    while events.last().expect("one")["kind"] != "completed" || events.len() < 2 {
        events.push(next(&mut lines).await);
    }
    let _ = tail.kill();
    let _ = tail.wait();
    for pair in events.windows(2) {
        assert_eq!(
            pair[1]["seq"].as_u64().expect("seq"),
            pair[0]["seq"].as_u64().expect("seq") + 1,
            "{events:?}"
        );
        assert_eq!(pair[1]["prev_hash"], pair[0]["hash"], "{events:?}");
    }
    for event in &events {
        let record: airlock_orchestrator::audit::AuditRecord =
            serde_json::from_value(event.clone()).expect("an audit record");
        assert!(record.hash_is_valid(), "{event}");
    }
    let followed: Vec<&Value> = events[1..].iter().collect();
    assert!(
        followed.iter().all(|e| e["call_id"] == call_id),
        "{followed:?}"
    );
    assert_eq!(followed.last().expect("completed")["data"]["status"], "ok");
}
