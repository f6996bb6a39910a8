//! Two orchestrators on one PostgreSQL store (DESIGN §4 `store = "postgres://…"`):
//! `airlock up` (orchestrator A and the workers) and a second `airlock serve
//! orchestrator` (B) that uses A's worker sockets and the same database. A call pending
//! on A is approved through B and runs exactly once; concurrent writers through both
//! keep one valid, dense audit chain.

#[path = "../support/postgres.rs"]
mod postgres;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::{AIRLOCK, Airlock, descendants, signal, token_digest};

/// The one token both orchestrators accept (principal `ops`: agent, approver, admin).
const TOKEN: &str = "replica-test-token-5c0ffee";
const PRINCIPAL: &str = "ops";
const STORE_ROLE: &str = "airlock_store";
const STORE_PASSWORD: &str = "Store-Pw-Canary-31d";
/// Longer than the gate's RESUME_AFTER (5 s), so that B's resume loop may also go for
/// the approved call while A's waiting task takes it: the claim must let one run it.
const APPROVE_AFTER: Duration = Duration::from_secs(6);

/// The `[orchestrator]` store keys (continuing the section), principals, approvals and
/// budgets: the same on both orchestrators.
fn shared_config(store_url: &str, password_file: &Path) -> String {
    format!(
        r#"store = "{store_url}"
store_password_file = "{password_file}"

[[principals]]
name = "{PRINCIPAL}"
token_sha256 = "{digest}"
roles = ["agent", "approver", "admin"]

[approvals]
tools = ["execute_shell", "write_file"]

[budgets]
rate_per_minute = 0
"#,
        password_file = password_file.display(),
        digest = token_digest(TOKEN),
    )
}

/// `airlock serve orchestrator` on its own data dir, killed on drop.
struct Replica {
    dir: tempfile::TempDir,
    url: String,
    child: Option<Child>,
    client: reqwest::Client,
}

impl Replica {
    /// Starts orchestrator B with A's worker sockets and workspaces.
    async fn start(a: &Airlock, shared: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let a_data = a.data_dir();
        let mut workers = String::new();
        for group in ["fs", "shell", "http", "db"] {
            let socket = a_data.join("sockets").join(format!("{group}.sock"));
            workers.push_str(&format!(
                "[[workers]]\ngroup = \"{group}\"\nendpoints = [\"unix:{}\"]\n\n",
                socket.display()
            ));
        }
        let config = dir.path().join("airlock.toml");
        std::fs::write(
            &config,
            format!(
                "workspaces_root = \"{}\"\n\n[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\n\
                 grpc_listen = \"127.0.0.1:0\"\n{shared}\n{workers}",
                a_data.join("workspaces").display()
            ),
        )
        .expect("write config");
        let data_dir = dir.path().join("data");
        let log = std::fs::File::create(dir.path().join("orchestrator.log")).expect("log");
        let child = Command::new(AIRLOCK)
            .args(["serve", "orchestrator", "--config"])
            .arg(&config)
            .arg("--data-dir")
            .arg(&data_dir)
            .env("RUST_LOG", "info")
            // Dies with this test binary (parent-death signal), like a launcher's child.
            .env("AIRLOCK_LAUNCHER_PID", std::process::id().to_string())
            .env_remove("AIRLOCK_URL")
            .env_remove("AIRLOCK_TOKEN")
            .env_remove("AIRLOCK_DATA_DIR")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn airlock serve orchestrator");
        let mut replica = Self {
            dir,
            url: String::new(),
            child: Some(child),
            client: reqwest::Client::new(),
        };
        let run_file = data_dir.join("run/orchestrator.json");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(text) = std::fs::read_to_string(&run_file)
                && let Ok(v) = serde_json::from_str::<Value>(&text)
                && let Some(http) = v["http"].as_str()
            {
                replica.url = http.to_owned();
                break;
            }
            if let Some(status) = replica
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("orchestrator B exited early ({status}):\n{}", replica.log());
            }
            assert!(
                Instant::now() < deadline,
                "orchestrator B did not start:\n{}",
                replica.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = replica
                .client
                .get(format!("{}/readyz", replica.url))
                .send()
                .await
                && r.status() == 200
            {
                return replica;
            }
            assert!(
                Instant::now() < deadline,
                "orchestrator B never became ready:\n{}",
                replica.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("orchestrator.log")).unwrap_or_default()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pids = descendants(child.id());
            signal(child.id(), rustix::process::Signal::TERM);
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
            for pid in pids {
                signal(pid, rustix::process::Signal::KILL);
            }
        }
    }
}

/// One orchestrator's front door, as the test's token.
#[derive(Clone)]
struct Door {
    name: &'static str,
    url: String,
    client: reqwest::Client,
}

impl Door {
    async fn send(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut request = self
            .client
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(TOKEN)
            .timeout(Duration::from_secs(90));
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request
            .send()
            .await
            .unwrap_or_else(|e| panic!("{} {path}: {e}", self.name));
        let status = response.status().as_u16();
        let body = response.json::<Value>().await.unwrap_or(Value::Null);
        (status, body)
    }

    async fn get(&self, path: &str) -> Value {
        let (status, body) = self.send(reqwest::Method::GET, path, None).await;
        assert_eq!(status, 200, "{} GET {path}: {body}", self.name);
        body
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.send(reqwest::Method::POST, path, Some(body)).await
    }

    /// One tool call; returns `calls[0]` and the whole answer.
    async fn call(&self, session: Option<&str>, tool: &str, input: Value, wait_ms: u64) -> Value {
        let mut body = json!({
            "wait_ms": wait_ms,
            "tool_uses": [{"type": "tool_use", "id": "t1", "name": tool, "input": input}],
        });
        if let Some(session) = session {
            body["session_id"] = json!(session);
        }
        let (status, answer) = self.post("/v1/tool_calls", body).await;
        assert_eq!(status, 200, "{} POST /v1/tool_calls: {answer}", self.name);
        answer
    }
}

/// The `airlock_store` role (password login) and its own database on the shared server;
/// returns the store URL and the password file.
fn store_database(secrets: &Path) -> (String, PathBuf) {
    let server = postgres::server();
    let role = postgres::unique_name(STORE_ROLE);
    let db = postgres::unique_name("airlock_replicas");
    server.create_role(&role, STORE_PASSWORD);
    server
        .sql("postgres", &format!("CREATE DATABASE {db} OWNER {role};"))
        .unwrap_or_else(|e| panic!("{e}"));
    let password_file = secrets.join("store.pw");
    std::fs::write(&password_file, format!("{STORE_PASSWORD}\n")).expect("password file");
    (server.url_as(&role, &db), password_file)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_orchestrators_share_approvals_and_one_audit_chain() {
    let started = Instant::now();
    let secrets = tempfile::tempdir().expect("temp dir");
    let secrets_path = secrets.path().to_owned();
    let (store_url, password_file) =
        tokio::task::spawn_blocking(move || store_database(&secrets_path))
            .await
            .expect("postgres");
    let shared = shared_config(&store_url, &password_file);
    let mut a = Airlock::start_with(&shared).await;
    a.token = TOKEN.to_owned();
    let b = Replica::start(&a, &shared).await;
    let client = reqwest::Client::new();
    let door_a = Door {
        name: "A",
        url: a.url.clone(),
        client: client.clone(),
    };
    let door_b = Door {
        name: "B",
        url: b.url.clone(),
        client,
    };
    assert_ne!(door_a.url, door_b.url);
    // The password never shows up where an operator might paste it.
    assert!(!a.log().contains(STORE_PASSWORD) && !b.log().contains(STORE_PASSWORD));

    // --- 1. pending on A, approved through B, run exactly once ------------------------
    let session = "replicas";
    let marker = format!("airlock-replicas-{}", std::process::id());
    let answer = door_a
        .call(
            Some(session),
            "execute_shell",
            json!({"command": format!("echo ran >> count.txt # {marker}")}),
            300,
        )
        .await;
    let meta = &answer["calls"][0];
    assert_eq!(meta["status"], "pending_approval", "{answer}");
    assert!(
        answer["tool_results"].as_array().is_none_or(Vec::is_empty),
        "a pending call has no result yet: {answer}"
    );
    let call_id = meta["call_id"].as_str().expect("call_id").to_owned();
    let approval_id = meta["approval_id"]
        .as_str()
        .expect("approval_id")
        .to_owned();

    // B lists A's pending approval and knows the call.
    let listed = door_b.get("/v1/approvals?status=pending").await;
    let mine = listed["approvals"]
        .as_array()
        .expect("approvals")
        .iter()
        .find(|x| x["approval_id"] == approval_id.as_str())
        .unwrap_or_else(|| panic!("B does not list {approval_id}: {listed}"))
        .clone();
    assert_eq!(mine["call_id"], call_id.as_str(), "{mine}");
    assert_eq!(mine["tool"], "execute_shell", "{mine}");
    assert_eq!(mine["principal"], PRINCIPAL, "{mine}");
    assert_eq!(mine["status"], "pending", "{mine}");
    let on_b = door_b.get(&format!("/v1/calls/{call_id}")).await;
    assert_eq!(on_b["status"], "pending_approval", "{on_b}");

    tokio::time::sleep(APPROVE_AFTER).await;
    let (status, decided) = door_b
        .post(
            &format!("/v1/approvals/{approval_id}/approve"),
            json!({"reason": "approved on replica B"}),
        )
        .await;
    assert_eq!(status, 200, "{decided}");
    assert_eq!(decided["status"], "approved", "{decided}");
    // Deciding it again, on either replica, is refused.
    for door in [&door_a, &door_b] {
        let (status, body) = door
            .post(&format!("/v1/approvals/{approval_id}/deny"), json!({}))
            .await;
        assert_eq!(status, 409, "{} second decision: {body}", door.name);
    }

    let wait = format!("/v1/calls/{call_id}?wait_ms=30000");
    let (done_a, done_b) = tokio::join!(door_a.get(&wait), door_b.get(&wait));
    for (name, done) in [("A", &done_a), ("B", &done_b)] {
        assert_eq!(done["status"], "ok", "{name}: {done}");
        assert_eq!(done["call_id"], call_id.as_str(), "{name}: {done}");
        assert_eq!(done["tool_result"]["is_error"], false, "{name}: {done}");
    }
    assert_eq!(
        done_a["tool_result"]["content"], done_b["tool_result"]["content"],
        "both replicas return the same result"
    );
    // Both replicas read the call's final outcome from the store, so neither can claim
    // it any more; once no sandbox of it runs, every run there was has written its line.
    a.wait_gone(&marker, "a run of the approved call kept going")
        .await;
    let workspace = a
        .data_dir()
        .join("workspaces")
        .join(PRINCIPAL)
        .join(session);
    let count = std::fs::read_to_string(workspace.join("count.txt")).expect("count.txt");
    assert_eq!(count, "ran\n", "the approved call ran exactly once");
    let trail = door_a
        .get(&format!("/v1/audit?call_id={call_id}&limit=1000"))
        .await;
    let kinds: Vec<&str> = trail["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == "dispatched").count(),
        1,
        "dispatched exactly once: {kinds:?}"
    );
    assert!(kinds.contains(&"pending_approval"), "{kinds:?}");
    assert!(kinds.contains(&"approved"), "{kinds:?}");
    assert!(kinds.contains(&"completed"), "{kinds:?}");

    // --- 2. concurrent writers through both replicas ------------------------------------
    const PER_REPLICA: usize = 40;
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..PER_REPLICA {
        for door in [&door_a, &door_b] {
            let door = door.clone();
            calls.spawn(async move {
                let answer = door
                    .call(None, "list_directory", json!({"path": "."}), 60_000)
                    .await;
                (door.name, i, answer)
            });
        }
    }
    let mut ok = 0;
    while let Some(joined) = calls.join_next().await {
        let (name, i, answer) = joined.expect("call task");
        assert_eq!(answer["calls"][0]["status"], "ok", "{name} #{i}: {answer}");
        ok += 1;
    }
    assert_eq!(ok, 2 * PER_REPLICA);

    let verify_a = door_a.get("/v1/audit/verify").await;
    let verify_b = door_b.get("/v1/audit/verify").await;
    assert_eq!(verify_a["ok"], true, "A: {verify_a}");
    assert_eq!(verify_b["ok"], true, "B: {verify_b}");
    assert_eq!(
        verify_a["records"], verify_b["records"],
        "both replicas verify the same chain"
    );
    let records = verify_a["records"].as_u64().expect("records");
    // Each call leaves at least `requested`, `dispatched` and `completed`.
    assert!(
        records >= 3 * 2 * PER_REPLICA as u64,
        "{records} records for {} calls",
        2 * PER_REPLICA
    );
    for door in [&door_a, &door_b] {
        let log = door.get("/v1/audit?limit=10000").await;
        let seqs: Vec<u64> = log["events"]
            .as_array()
            .expect("events")
            .iter()
            .map(|e| e["seq"].as_u64().expect("seq"))
            .collect();
        assert!(seqs.len() as u64 >= records, "{}", door.name);
        assert_eq!(
            seqs,
            (1..=seqs.len() as u64).collect::<Vec<_>>(),
            "{}: seq is dense 1..n",
            door.name
        );
    }
    // Both replicas dispatched calls (the claimant is the replica's id).
    let log = door_a.get("/v1/audit?limit=10000").await;
    let claimants: std::collections::HashSet<&str> = log["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["kind"] == "dispatched")
        .filter_map(|e| e["data"]["claimant"].as_str())
        .collect();
    assert_eq!(claimants.len(), 2, "{claimants:?}");
    eprintln!(
        "two replicas, one approval and {} calls: {:?} (measured, not asserted)",
        2 * PER_REPLICA,
        started.elapsed()
    );
    drop(b);
    drop(a);
}

/// The store over TLS, from the binary as it runs confined (DESIGN §9): the CA named by
/// `sslrootcert` lives in a directory of its own, read when the pool connects, after
/// the orchestrator has confined itself.
#[tokio::test]
async fn the_confined_orchestrator_reaches_its_store_over_verified_tls() {
    let scratch = tempfile::tempdir().expect("temp dir");
    let pki = scratch.path().join("pki");
    let status = Command::new(AIRLOCK)
        .args(["certs", "init", "--san", "worker-db=localhost", "--out"])
        .arg(&pki)
        .stdout(Stdio::null())
        .status()
        .expect("airlock certs init");
    assert!(status.success());
    let (cert, key) = (pki.join("worker-db.crt"), pki.join("worker-db.key"));
    let server = tokio::task::spawn_blocking(move || postgres::start_tls(&cert, &key))
        .await
        .expect("join")
        .unwrap_or_else(|e| panic!("cannot start a TLS PostgreSQL: {e}"));
    let role = postgres::unique_name(STORE_ROLE);
    let db = postgres::unique_name("airlock_store_tls");
    server.create_role(&role, STORE_PASSWORD);
    server
        .sql("postgres", &format!("CREATE DATABASE {db} OWNER {role};"))
        .unwrap_or_else(|e| panic!("{e}"));
    let ca_dir = scratch.path().join("store-ca");
    std::fs::create_dir(&ca_dir).expect("ca dir");
    std::fs::copy(pki.join("ca.crt"), ca_dir.join("ca.crt")).expect("copy ca");
    let password_file = scratch.path().join("store.pw");
    std::fs::write(&password_file, STORE_PASSWORD).expect("password file");
    let store = format!(
        "postgres://{role}@localhost:{}/{db}?sslmode=verify-full&sslrootcert={}",
        server.port,
        ca_dir.join("ca.crt").display()
    );
    // The config's own directory stays readable; the CA's is elsewhere.
    std::fs::create_dir(scratch.path().join("config")).expect("config dir");
    let config = scratch.path().join("config/airlock.toml");
    std::fs::write(
        &config,
        format!(
            "[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n\
             store = \"{store}\"\nstore_password_file = \"{}\"\n\n\
             [[principals]]\nname = \"{PRINCIPAL}\"\ntoken_sha256 = \"{}\"\nroles = [\"agent\", \"admin\"]\n",
            password_file.display(),
            token_digest(TOKEN)
        ),
    )
    .expect("config");
    let data = scratch.path().join("data");
    let mut orchestrator = crate::mtls::Component::start(
        &["serve", "orchestrator"],
        &config,
        &data,
        scratch.path().join("orchestrator.log"),
    );
    let url = orchestrator.http_url(&data).await;
    let verified: Value = reqwest::Client::new()
        .get(format!("{url}/v1/audit/verify"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("verify")
        .json()
        .await
        .expect("json");
    assert_eq!(verified["ok"], true, "{verified}\n{}", orchestrator.log());
}

/// Write transactions a replica's store handle committed since it started (`/readyz`).
async fn store_commits(url: &str) -> u64 {
    let ready: Value = reqwest::get(format!("{url}/readyz"))
        .await
        .expect("readyz")
        .json()
        .await
        .expect("json");
    assert_eq!(ready["store"]["kind"], "postgres", "{ready}");
    ready["store"]["commits"].as_u64().expect("store.commits")
}

/// Two orchestrators on one PostgreSQL: a call that needs no approval and changes
/// nothing is written in one transaction when it ends (docs/decisions.md, "One durable
/// write per call"). Counted twice: by each replica (`/readyz`), and by PostgreSQL
/// itself — every row a transaction writes carries its id (`xmin`), so the calls'
/// audit events and call rows name exactly one transaction per call (before, four: the
/// `requested`, `dispatched` and `completed` appends and the outcome's update). The
/// concurrent writers of both replicas still make one dense chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_auto_allowed_read_is_one_transaction_on_a_shared_postgres() {
    const PER_REPLICA: u64 = 20;
    let secrets = tempfile::tempdir().expect("temp dir");
    let secrets_path = secrets.path().to_owned();
    let (store_url, password_file) =
        tokio::task::spawn_blocking(move || store_database(&secrets_path))
            .await
            .expect("postgres");
    let db = store_url.rsplit('/').next().expect("database").to_owned();
    let shared = shared_config(&store_url, &password_file);
    let mut a = Airlock::start_with(&shared).await;
    a.token = TOKEN.to_owned();
    let b = Replica::start(&a, &shared).await;
    let client = reqwest::Client::new();
    let doors = [
        Door {
            name: "A",
            url: a.url.clone(),
            client: client.clone(),
        },
        Door {
            name: "B",
            url: b.url.clone(),
            client,
        },
    ];
    let before = store_commits(&doors[0].url).await + store_commits(&doors[1].url).await;
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..PER_REPLICA {
        for door in &doors {
            let door = door.clone();
            calls.spawn(async move {
                let answer = door
                    .call(None, "list_directory", json!({"path": "."}), 60_000)
                    .await;
                (door.name, i, answer)
            });
        }
    }
    let mut ids = Vec::new();
    while let Some(joined) = calls.join_next().await {
        let (name, i, answer) = joined.expect("call task");
        assert_eq!(answer["calls"][0]["status"], "ok", "{name} #{i}: {answer}");
        ids.push(
            answer["calls"][0]["call_id"]
                .as_str()
                .expect("id")
                .to_owned(),
        );
    }
    let total = 2 * PER_REPLICA;
    let commits = store_commits(&doors[0].url).await + store_commits(&doors[1].url).await - before;
    let list = ids
        .iter()
        .map(|id| format!("'{id}'"))
        .collect::<Vec<_>>()
        .join(",");
    let writers = tokio::task::spawn_blocking(move || {
        postgres::server().sql(
            &db,
            &format!(
                "SELECT count(DISTINCT x) FROM (\
                 SELECT xmin::text AS x FROM audit_events WHERE call_id IN ({list}) \
                 UNION ALL SELECT xmin::text FROM calls WHERE call_id IN ({list})) AS w;"
            ),
        )
    })
    .await
    .expect("psql")
    .unwrap_or_else(|e| panic!("{e}"));
    let writers: u64 = writers.trim().parse().expect("a count");
    eprintln!(
        "{total} list_directory calls over two replicas: {commits} commits counted by the replicas, {writers} transactions wrote their rows (PostgreSQL)"
    );
    assert_eq!(writers, total, "one transaction wrote each call's rows");
    assert_eq!(commits, total, "one commit per auto-allowed call");

    let verify = doors[0].get("/v1/audit/verify").await;
    assert_eq!(verify["ok"], true, "{verify}");
    let log = doors[1].get("/v1/audit?limit=10000").await;
    let seqs: Vec<u64> = log["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["seq"].as_u64().expect("seq"))
        .collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>(), "dense");
    assert_eq!(verify["records"].as_u64(), Some(seqs.len() as u64));

    // PostgreSQL refuses a NUL in text: an id or a filter holding one names nothing
    // and gets the 4xx any unknown id or bad filter gets, never the 503 of a store
    // that is down.
    let door = &doors[0];
    for (method, path, expected) in [
        (reqwest::Method::GET, "/v1/calls/call_%00x", 404),
        (reqwest::Method::POST, "/v1/calls/call_%00x/cancel", 404),
        (reqwest::Method::POST, "/v1/approvals/apr_%00x/approve", 404),
        (reqwest::Method::POST, "/v1/approvals/apr_%00x/deny", 404),
        (reqwest::Method::GET, "/v1/audit?session_id=s%00", 400),
        (reqwest::Method::GET, "/v1/audit?call_id=c%00", 400),
        (reqwest::Method::POST, "/v1/tools/t%00/accept", 404),
    ] {
        let body = (method == reqwest::Method::POST).then(|| json!({}));
        let (status, answer) = door.send(method.clone(), path, body).await;
        assert_eq!(status, expected, "{method} {path}: {answer}");
    }
    drop(b);
    drop(a);
}
