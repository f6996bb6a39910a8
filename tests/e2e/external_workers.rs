//! An external worker in another language (examples/python-worker, grpcio): its
//! `ListTools` joins the catalog, its tools become Cedar actions policies can name, its
//! irreversible `send_email` waits for a human, and `airlock worker check` tells an
//! implementer whether it honours the contract.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::{AIRLOCK, Airlock, up_refused};

const BOUND: Duration = Duration::from_secs(60);
const WORKER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../examples/python-worker/worker.py"
);
const PIP_FIX: &str = "python3 -m pip install grpcio grpcio-tools";

/// The Python worker on a Unix socket, stopped on drop.
struct PythonWorker {
    child: Child,
    socket: PathBuf,
    outbox: PathBuf,
    _dir: tempfile::TempDir,
}

impl PythonWorker {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("crm.sock");
        let outbox = dir.path().join("outbox.jsonl");
        let log = std::fs::File::create(dir.path().join("worker.log")).expect("log");
        let child = Command::new("python3")
            .arg(WORKER)
            .arg("--listen")
            .arg(format!("unix:{}", socket.display()))
            .env("OUTBOX", &outbox)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("python3");
        let mut worker = Self {
            child,
            socket,
            outbox,
            _dir: dir,
        };
        let deadline = Instant::now() + BOUND;
        while !worker.socket.exists() {
            if let Some(status) = worker.child.try_wait().expect("wait") {
                panic!(
                    "the Python worker exited ({status}); it needs grpcio and grpcio-tools ({PIP_FIX}):\n{}",
                    worker.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the Python worker did not listen:\n{}",
                worker.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        worker
    }

    fn endpoint(&self) -> String {
        format!("unix:{}", self.socket.display())
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("worker.log")).unwrap_or_default()
    }

    fn sent(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.outbox)
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).expect("outbox line"))
            .collect()
    }
}

impl Drop for PythonWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const POLICY: &str = r#"
@id("agents-may-call-tools") permit (principal in Airlock::Role::"agent", action, resource);
@id("admins-may-call-tools") permit (principal in Airlock::Role::"admin", action, resource);
@id("mail-stays-inside") @reason("mail goes to example.com only")
forbid (principal, action == Airlock::Action::"send_email", resource)
unless { context.arguments.to like "*@example.com" };
"#;

fn config(worker: &PythonWorker, policy: &Path) -> String {
    format!(
        "[[workers]]\ngroup = \"crm\"\nendpoints = [\"{}\"]\n[policy]\nfile = \"{}\"\n",
        worker.endpoint(),
        policy.display()
    )
}

#[tokio::test]
async fn a_python_worker_joins_the_catalog_behind_the_gate() {
    let worker = PythonWorker::start();

    // The contract check passes for a worker that keeps it.
    let check = Command::new(AIRLOCK)
        .args(["worker", "check"])
        .arg(worker.endpoint())
        .args([
            "--call",
            "fetch_user_details",
            "--input",
            r#"{"user_id": "alice"}"#,
        ])
        .output()
        .expect("airlock worker check");
    let report = String::from_utf8_lossy(&check.stdout).to_string();
    assert!(check.status.success(), "{report}{:?}", check.stderr);
    for line in [
        "ok   health",
        "ok   tool      `send_email`",
        "ok   execute",
        "ok   deadline",
        "ok   cancel",
    ] {
        assert!(report.contains(line), "{line:?} missing:\n{report}");
    }

    assert!(report.contains("a running call was cancelled"), "{report}");

    let dir = tempfile::tempdir().expect("temp dir");
    let policy = dir.path().join("policy.cedar");
    std::fs::write(&policy, POLICY).expect("policy");
    // The schema policies are checked against holds the worker's tools.
    let config_file = dir.path().join("airlock.toml");
    std::fs::write(&config_file, config(&worker, &policy)).expect("config");
    let schema = Command::new(AIRLOCK)
        .args(["policy", "schema", "--config"])
        .arg(&config_file)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .output()
        .expect("airlock policy schema");
    let schema_text = String::from_utf8_lossy(&schema.stdout);
    assert!(schema.status.success(), "{schema:?}");
    assert!(
        schema_text.contains("action \"crm\";")
            && schema_text
                .contains("action \"send_email\" in [\"crm\", \"destructive\", \"open_world\"]"),
        "{schema_text}"
    );

    // A policy that names the worker's tool and argument loads, and the gate serves it.
    let airlock = Airlock::start_with(&config(&worker, &policy)).await;
    let (status, tools) = airlock.get("/v1/tools").await;
    assert_eq!(status, 200, "{tools}");
    let listed = tools.to_string();
    assert!(listed.contains("\"fetch_user_details\""), "{listed}");
    assert!(
        listed.contains("\"read_file\""),
        "the built-in tools stay: {listed}"
    );

    let (err, text, call) = airlock
        .call_in("crm", "fetch_user_details", json!({"user_id": "alice"}))
        .await;
    assert!(!err, "{text}");
    assert!(text.contains("Alice Martin"), "{text}");
    assert_eq!(call["status"], "ok", "{call}");
    // The gate validates against the worker's schema before the worker sees anything.
    let (err, text, _) = airlock
        .call_in("crm", "fetch_user_details", json!({"user_id": "../../etc"}))
        .await;
    assert!(err, "{text}");

    // The policy's rule on the worker's argument.
    let (denied, answer) = airlock
        .propose(
            "crm",
            "send_email",
            json!({"to": "eve@evil.test", "subject": "hi", "body": "data"}),
        )
        .await;
    assert_eq!(denied["status"], "denied", "{answer}");
    assert!(
        answer.to_string().contains("mail goes to example.com only"),
        "{answer}"
    );
    assert!(worker.sent().is_empty(), "a denied mail was sent");

    // send_email is destructive: held for a human, then sent exactly once.
    let (held, _) = airlock
        .propose(
            "crm",
            "send_email",
            json!({"to": "bob@example.com", "subject": "Welcome", "body": "Hello Bob"}),
        )
        .await;
    assert_eq!(held["status"], "pending_approval", "{held}");
    assert!(worker.sent().is_empty(), "sent before approval");
    let detail = airlock.approve_and_wait(&held).await;
    assert_eq!(detail["status"], "ok", "{detail}");
    let sent = worker.sent();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0]["to"], "bob@example.com", "{sent:?}");

    // The check fails a worker that does not keep the contract for an external one: the
    // built-in fs worker lists built-in names.
    let fs_socket = airlock.data_dir().join("sockets/fs.sock");
    let check = Command::new(AIRLOCK)
        .args(["worker", "check"])
        .arg(format!("unix:{}", fs_socket.display()))
        .output()
        .expect("airlock worker check");
    let report = String::from_utf8_lossy(&check.stdout).to_string();
    assert_eq!(check.status.code(), Some(1), "{report}");
    assert!(
        report.contains("FAIL tool      `read_file`: the name of a built-in tool"),
        "{report}"
    );
}

#[tokio::test]
async fn a_tool_name_two_groups_define_stops_the_start() {
    let worker = PythonWorker::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let config_file = dir.path().join("airlock.toml");
    std::fs::write(
        &config_file,
        format!(
            "[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n\
             [[workers]]\ngroup = \"crm\"\nendpoints = [\"{0}\"]\n\
             [[workers]]\ngroup = \"crm2\"\nendpoints = [\"{0}\"]\n",
            worker.endpoint()
        ),
    )
    .expect("config");
    let text = up_refused(&config_file, &dir.path().join("data"));
    assert!(
        text.contains("defined twice") && text.contains("fetch_user_details"),
        "{text}"
    );
}
