//! Streamable HTTP MCP servers behind the gate (`[[mcp_servers]]` with `url`): a real
//! server built with the official MCP Python SDK, reached by the http worker under its
//! egress rules. Its tools pass the gate as `<name>__<tool>`; the one not marked
//! read-only waits for a human; progress reaches the caller's stream; a URL the egress
//! policy refuses stops the start; a server killed mid-call fails that call only.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::mcp::require_python_sdk;
use crate::mcp_servers::wait_for_tools;
use crate::support::{AIRLOCK, Airlock, sse_events, up_refused};

const SERVER: &str = include_str!("mcp_http_server.py");

/// The test's MCP server: a python3 process listening on a loopback port.
struct PyServer {
    child: Child,
    port: u16,
    /// One line per run of `deploy`.
    marker: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl PyServer {
    /// Starts the server on a free port and waits (bounded) until it accepts
    /// connections.
    async fn start() -> Self {
        require_python_sdk().await;
        let dir = tempfile::tempdir().expect("temp dir");
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.local_addr().expect("addr").port()
        };
        Self::start_on(dir, port)
    }

    fn start_on(dir: tempfile::TempDir, port: u16) -> Self {
        let script = dir.path().join("server.py");
        std::fs::write(&script, SERVER).expect("server script");
        let marker = dir.path().join("deployed.txt");
        let log = dir.path().join("server.log");
        let out = std::fs::File::create(&log).expect("log");
        let child = Command::new("python3")
            .arg(&script)
            .arg(port.to_string())
            .arg(&marker)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("python3 (install Python 3.10+ and the MCP SDK: python3 -m pip install mcp)");
        let mut server = Self {
            child,
            port,
            marker,
            log,
            _dir: dir,
        };
        server.wait_listening();
        server
    }

    fn wait_listening(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "the MCP server exited ({status}) before it listened:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the MCP server did not listen on port {} within 30 s:\n{}",
                self.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn deployed(&self) -> String {
        std::fs::read_to_string(&self.marker).unwrap_or_default()
    }

    /// Kills it outright (no goodbye to its clients); returns its directory.
    fn kill(mut self) -> tempfile::TempDir {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let dir = tempfile::tempdir().expect("temp dir");
        std::mem::replace(&mut self._dir, dir)
    }
}

impl Drop for PyServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The bearer token the entry's header reads from `airlock up`'s environment.
const TOKEN: (&str, &str) = ("WEATHER_MCP_TOKEN", "wx-7d1c04b9e2f35a86");

/// `[http]` opening exactly the server's loopback port, and the entry, whose header
/// names a secret: the http worker starts only if the launcher passed it the variable.
fn config(server: &PyServer) -> String {
    format!(
        "[http]\nallow = [\"127.0.0.1:{port}\"]\n\n[[mcp_servers]]\nname = \"weather\"\n\
         url = \"{url}\"\nheaders = {{ Authorization = \"Bearer ${{env:{var}}}\" }}\n",
        port = server.port,
        url = server.url(),
        var = TOKEN.0,
    )
}

/// Runs `POST /v1/tool_calls?stream=true` for one call, approving it when it is held:
/// the stream's events once `call.completed` arrived.
async fn stream_approving(
    airlock: &Airlock,
    session: &str,
    tool: &str,
    input: Value,
) -> Vec<(String, Value)> {
    let body = json!({"session_id": session, "tool_uses": [{"type": "tool_use", "id": "s1",
        "name": tool, "input": input}]});
    let mut response = airlock
        .request(reqwest::Method::POST, "/v1/tool_calls?stream=true")
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut text = String::new();
    let mut approved = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let chunk = tokio::time::timeout(left, response.chunk())
            .await
            .unwrap_or_else(|_| panic!("no call.completed within 60 s: {text}"))
            .expect("read the stream");
        let Some(chunk) = chunk else {
            panic!("the stream ended without call.completed: {text}");
        };
        text.push_str(&String::from_utf8_lossy(&chunk));
        let events = sse_events(&text);
        if !approved
            && let Some((_, held)) = events.iter().find(|(n, _)| n == "call.pending_approval")
        {
            let id = held["approval_id"].as_str().expect("approval id");
            let (status, answer) = airlock
                .post(&format!("/v1/approvals/{id}/approve"), &json!({}))
                .await;
            assert_eq!(status, 200, "{answer}");
            approved = true;
        }
        if events.iter().any(|(n, _)| n == "call.completed") {
            return events;
        }
    }
}

#[tokio::test]
async fn streamable_http_mcp_servers_run_behind_the_gate() {
    let server = PyServer::start().await;
    let airlock = Airlock::start_with_env(&config(&server), &[TOKEN]).await;

    // Its tools are in the catalog as <server>__<tool>, served by the http worker.
    let listed = wait_for_tools(
        &airlock,
        &["weather__lookup", "weather__deploy", "weather__wait"],
    )
    .await;
    assert!(listed.contains("Today's weather in a city."), "{listed}");

    // The read-only tool runs at once; the schema is checked at the gate.
    let (err, text, call) = airlock
        .call("weather__lookup", json!({"city": "Paris"}))
        .await;
    assert!(!err, "{text}");
    assert!(text.contains("Paris: sunny, 21 C"), "{text}");
    assert_eq!(call["status"], "ok", "{call}");
    let (err, text, _) = airlock.call("weather__lookup", json!({"city": 7})).await;
    assert!(err, "{text}");

    // The other waits for a human, then runs once; its progress reaches the stream.
    let (held, _) = airlock
        .propose("ops", "weather__deploy", json!({"service": "billing"}))
        .await;
    assert_eq!(held["status"], "pending_approval", "{held}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(server.deployed(), "", "a held call ran");
    let detail = airlock.approve_and_wait(&held).await;
    assert_eq!(detail["status"], "ok", "{detail}");
    assert_eq!(server.deployed(), "billing\n");

    let events = stream_approving(
        &airlock,
        "ops",
        "weather__deploy",
        json!({"service": "api"}),
    )
    .await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"call.pending_approval"), "{events:?}");
    let progress: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "call.progress")
        .map(|(_, v)| v)
        .collect();
    assert_eq!(progress.len(), 3, "{events:?}");
    assert_eq!(progress[2]["message"], "deploy step 3", "{events:?}");
    let (_, completed) = events
        .iter()
        .find(|(n, _)| n == "call.completed")
        .expect("completed");
    assert_eq!(completed["tool_result"]["is_error"], false, "{completed}");
    assert!(
        completed.to_string().contains("deployed api"),
        "{completed}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        server.deployed(),
        "billing\napi\n",
        "each approved call runs once"
    );

    // `airlock policy schema` asks the running http worker for them.
    let schema = Command::new(AIRLOCK)
        .args(["policy", "schema", "--config"])
        .arg(airlock.dir.path().join("airlock.toml"))
        .arg("--data-dir")
        .arg(airlock.data_dir())
        .output()
        .expect("airlock policy schema");
    let schema_text = String::from_utf8_lossy(&schema.stdout);
    assert!(schema.status.success(), "{schema:?}");
    assert!(
        schema_text.contains("action \"weather__deploy\" in [\"http\""),
        "{schema_text}"
    );

    // The audit names them, with the approval's reason, and its chain verifies.
    let (status, audit) = airlock.get("/v1/audit?limit=1000").await;
    assert_eq!(status, 200);
    let audit = audit.to_string();
    assert!(audit.contains("weather__deploy") && audit.contains("weather__lookup"));
    assert!(
        audit.contains("not marked read-only by the MCP server weather"),
        "the approval's reason is not in the audit: {audit}"
    );
    let (_, verify) = airlock.get("/v1/audit/verify").await;
    assert_eq!(verify["ok"], true, "{verify}");
    // The header's secret went to the server only.
    assert!(!audit.contains(TOKEN.1) && !airlock.log().contains(TOKEN.1));
}

#[tokio::test]
async fn a_server_killed_mid_call_fails_that_call_only() {
    let server = PyServer::start().await;
    let port = server.port;
    let airlock = Airlock::start_with_env(
        &format!("{}per_session = false\n", config(&server)),
        &[TOKEN],
    )
    .await;
    wait_for_tools(&airlock, &["weather__wait", "weather__lookup"]).await;
    let (err, text, _) = airlock
        .call("weather__lookup", json!({"city": "Oslo"}))
        .await;
    assert!(!err, "{text}");

    let (started, _) = airlock
        .propose("default", "weather__wait", json!({"seconds": 60}))
        .await;
    let call_id = started["call_id"].as_str().expect("call id").to_owned();
    assert_eq!(started["status"], "running", "{started}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let dir = server.kill();
    let (status, detail) = airlock
        .get(&format!("/v1/calls/{call_id}?wait_ms=20000"))
        .await;
    assert_eq!(status, 200, "{detail}");
    let result = detail.to_string();
    assert_eq!(detail["tool_result"]["is_error"], true, "{detail}");
    assert!(
        result.contains("the MCP server weather did not answer the call of wait"),
        "{detail}"
    );

    // While it is down: an error naming it; the rest of Airlock never noticed.
    let (err, text, _) = airlock
        .call("weather__lookup", json!({"city": "Oslo"}))
        .await;
    assert!(err, "{text}");
    assert!(
        text.contains("the MCP server weather could not be reached"),
        "{text}"
    );
    assert!(text.contains("cannot connect"), "{text}");
    let (status, ready) = airlock.get("/readyz").await;
    assert_eq!(status, 200, "{ready}");
    let (err, text, _) = airlock
        .call(
            "write_file",
            json!({"path": "still.txt", "content": "here"}),
        )
        .await;
    assert!(!err, "{text}");

    // Back on the same port: the next call opens a new session.
    let _server = PyServer::start_on(dir, port);
    let (err, text, _) = airlock
        .call("weather__lookup", json!({"city": "Oslo"}))
        .await;
    assert!(!err, "{text}");
    assert!(text.contains("Oslo: sunny"), "{text}");
}

/// `airlock up` with `config`, expected to refuse to start: its log.
async fn refused(dir: &Path, name: &str, config: String) -> String {
    let file = dir.join(format!("{name}.toml"));
    std::fs::write(
        &file,
        format!(
            "[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n\n{config}"
        ),
    )
    .expect("config");
    let data = dir.join(name);
    tokio::task::spawn_blocking(move || up_refused(&file, &data))
        .await
        .expect("up")
}

#[tokio::test]
async fn a_url_the_egress_policy_refuses_stops_the_start() {
    // The server runs and answers: only the policy stands in the way.
    let server = PyServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let entry = format!(
        "[[mcp_servers]]\nname = \"weather\"\nurl = \"{}\"\n",
        server.url()
    );

    // Loopback is a special-purpose address, refused unless [http] opens it.
    let log = refused(dir.path(), "private", entry.clone()).await;
    assert!(
        log.contains("the http worker cannot serve its MCP servers"),
        "{log}"
    );
    assert!(
        log.contains("the MCP server weather could not be started"),
        "{log}"
    );
    assert!(log.contains("127.0.0.1 is a loopback address"), "{log}");

    // A deny rule wins over private_addresses = "allow".
    let log = refused(
        dir.path(),
        "denied",
        format!("[http]\nprivate_addresses = \"allow\"\ndeny = [\"127.0.0.1\"]\n\n{entry}"),
    )
    .await;
    assert!(
        log.contains("the MCP server weather could not be started"),
        "{log}"
    );
    assert!(
        log.contains("matches [http] deny pattern \"127.0.0.1\""),
        "{log}"
    );
    assert!(
        !server.log().contains("POST /mcp"),
        "a refused request reached the server:\n{}",
        server.log()
    );
}
