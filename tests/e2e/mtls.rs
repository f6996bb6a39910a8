//! Workers on TCP trust only their orchestrator (DESIGN §9): a worker and an
//! orchestrator as separate processes with certificates from `airlock certs init`. The
//! orchestrator's calls run; a plaintext client, a client with another CA's certificate,
//! and a client whose certificate lacks an allowed name reach no tool, and the worker logs
//! each refusal. Without `[tls]` a worker on TCP does not start, and an orchestrator does
//! not dial `https://` workers.
//!
//! With `[orchestrator] grpc_tls = true` the orchestrator's gRPC front door serves TLS
//! with its `[tls]` certificate: a client trusting the CA reaches the API with its token,
//! a plaintext client and a client trusting another CA do not, and a missing or broken
//! certificate refuses the start.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use airlock_proto::v1 as pb;
use airlock_proto::v1::orchestrator_client::OrchestratorClient;
use airlock_proto::v1::tool_worker_client::ToolWorkerClient;
use serde_json::{Value, json};
use tonic::transport::{Endpoint, Uri};

use crate::support::{AIRLOCK, Airlock, token_digest};

const TOKEN: &str = "mtls-test-token-9f1";

/// A component process, killed on drop; its stderr goes to `log`.
pub(crate) struct Component {
    pub(crate) child: Child,
    pub(crate) log: PathBuf,
}

impl Component {
    pub(crate) fn start(args: &[&str], config: &Path, data_dir: &Path, log: PathBuf) -> Self {
        Self::start_under(Command::new(AIRLOCK), args, config, data_dir, log)
    }

    /// [`Component::start`] with `launcher` in front: a command that ends by running
    /// the arguments it is given (`unshare … sh -c '… exec "$@"'`), or `airlock` itself.
    pub(crate) fn start_under(
        mut launcher: Command,
        args: &[&str],
        config: &Path,
        data_dir: &Path,
        log: PathBuf,
    ) -> Self {
        let child = launcher
            .args(args)
            .arg("--config")
            .arg(config)
            .arg("--data-dir")
            .arg(data_dir)
            .env("RUST_LOG", "info")
            .env("AIRLOCK_LAUNCHER_PID", std::process::id().to_string())
            .env_remove("AIRLOCK_URL")
            .env_remove("AIRLOCK_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn airlock");
        Self { child, log }
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (bounded) for an orchestrator's run file in `data_dir`; its HTTP URL.
    pub(crate) async fn http_url(&mut self, data_dir: &Path) -> String {
        let run_file = data_dir.join("run/orchestrator.json");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(url) = std::fs::read_to_string(&run_file)
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .and_then(|v| v["http"].as_str().map(str::to_owned))
            {
                return url;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("the orchestrator exited ({status}):\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the log has a line with `needle`, and returns that line.
    pub(crate) fn wait_for_line(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(line) = self.log().lines().find(|l| l.contains(needle)) {
                return line.to_owned();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "exited ({status}) before logging {needle:?}:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "no {needle:?} in:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `key=value` of a log line.
pub(crate) fn field(line: &str, key: &str) -> String {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in {line}"))
        .trim_matches('"')
        .to_owned()
}

pub(crate) fn tls_section(pki: &Path, component: &str) -> String {
    format!(
        "[tls]\ncert_file = \"{dir}/{component}.crt\"\nkey_file = \"{dir}/{component}.key\"\nca_file = \"{dir}/ca.crt\"\n",
        dir = pki.display()
    )
}

pub(crate) fn certs_init(out: &Path) {
    let status = Command::new(AIRLOCK)
        .args(["certs", "init", "--out"])
        .arg(out)
        .stdout(Stdio::null())
        .status()
        .expect("airlock certs init");
    assert!(status.success());
}

/// A worker client over mutual TLS with `component`'s certificate from `pki`, trusting
/// `trust`'s CA and expecting the worker to be `worker-fs`.
async fn tls_client(
    addr: &str,
    pki: &Path,
    component: &str,
    trust: &Path,
) -> ToolWorkerClient<tonic::transport::Channel> {
    let identity = airlock_tls::TlsFiles {
        cert_file: pki.join(format!("{component}.crt")),
        key_file: pki.join(format!("{component}.key")),
        ca_file: pki.join("ca.crt"),
    }
    .load()
    .expect("client identity");
    let roots = airlock_tls::files::roots(&trust.join("ca.crt")).expect("roots");
    let identity = airlock_tls::Identity { roots, ..identity };
    let mtls = airlock_tls::Mtls::new(identity, Vec::new()).expect("client config");
    let connector = tokio_rustls::TlsConnector::from(mtls.client.clone());
    let addr = addr.to_owned();
    let channel = Endpoint::from_static("http://worker.invalid")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
            let (connector, addr) = (connector.clone(), addr.clone());
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let name = rustls::pki_types::ServerName::try_from("worker-fs").expect("name");
                let tls = connector.connect(name, tcp).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }));
    ToolWorkerClient::new(channel)
}

async fn list_tools(
    client: &mut ToolWorkerClient<tonic::transport::Channel>,
) -> Result<usize, tonic::Status> {
    let listed = tokio::time::timeout(
        Duration::from_secs(15),
        client.list_tools(pb::ListToolsRequest {}),
    )
    .await
    .map_err(|_| tonic::Status::deadline_exceeded("no answer in 15 s"))??;
    Ok(listed.into_inner().tools.len())
}

#[tokio::test]
async fn a_worker_on_tcp_serves_only_its_orchestrator() {
    let scratch = tempfile::tempdir().expect("temp dir");
    let pki = scratch.path().join("pki");
    let other = scratch.path().join("other-pki");
    certs_init(&pki);
    certs_init(&other);
    let workspaces = scratch.path().join("workspaces");

    // The fs worker on TCP, trusting only `orchestrator` from `pki`.
    let worker_config = scratch.path().join("worker.toml");
    std::fs::write(
        &worker_config,
        format!(
            "workspaces_root = \"{}\"\n[sandbox]\nworkspace_bytes = 0\nworkspace_inodes = 0\n{}",
            workspaces.display(),
            tls_section(&pki, "worker-fs")
        ),
    )
    .expect("worker config");
    let mut worker = Component::start(
        &["serve", "worker", "fs", "--listen", "127.0.0.1:0"],
        &worker_config,
        &scratch.path().join("worker-data"),
        scratch.path().join("worker.log"),
    );
    let addr = field(&worker.wait_for_line("mutual TLS on TCP"), "listen");

    // The orchestrator dials it by address, checking the certificate's name.
    let orchestrator_config = scratch.path().join("orchestrator.toml");
    std::fs::write(
        &orchestrator_config,
        format!(
            "workspaces_root = \"{}\"\n[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n\n\
             [[principals]]\nname = \"ops\"\ntoken_sha256 = \"{}\"\nroles = [\"agent\", \"admin\"]\n\n\
             [approvals]\ntools = []\n[budgets]\nrate_per_minute = 0\n\n\
             [[workers]]\ngroup = \"fs\"\nendpoints = [\"https://{addr}\"]\nserver_name = \"worker-fs\"\n\n{}",
            workspaces.display(),
            token_digest(TOKEN),
            tls_section(&pki, "orchestrator")
        ),
    )
    .expect("orchestrator config");
    let orchestrator_data = scratch.path().join("orchestrator-data");
    let mut orchestrator = Component::start(
        &["serve", "orchestrator"],
        &orchestrator_config,
        &orchestrator_data,
        scratch.path().join("orchestrator.log"),
    );
    let url = orchestrator.http_url(&orchestrator_data).await;

    // 1. The orchestrator's calls run on the worker, over mutual TLS.
    let http = reqwest::Client::new();
    let call = |tool: &str, input: Value| {
        http.post(format!("{url}/v1/tool_calls"))
            .bearer_auth(TOKEN)
            .json(&json!({"session_id": "mtls", "tool_uses": [{"type": "tool_use", "id": "t", "name": tool, "input": input}]}))
            .send()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let response: Value = call(
            "write_file",
            json!({"path": "hello.txt", "content": "over mTLS"}),
        )
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
        if response["calls"][0]["status"] == "ok" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{response}\n--- orchestrator\n{}\n--- worker\n{}",
            orchestrator.log(),
            worker.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let response: Value = call("read_file", json!({"path": "hello.txt"}))
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(response["calls"][0]["status"], "ok", "{response}");
    assert!(response.to_string().contains("over mTLS"), "{response}");

    // 2. A client with the orchestrator's certificate is served (the control).
    let mut allowed = tls_client(&addr, &pki, "orchestrator", &pki).await;
    assert!(
        list_tools(&mut allowed)
            .await
            .expect("the orchestrator's identity is served")
            >= 9
    );

    // 3. Everyone else reaches no tool, however they try.
    let mut plaintext = ToolWorkerClient::new(
        Endpoint::from_shared(format!("http://{addr}"))
            .expect("endpoint")
            .connect_timeout(Duration::from_secs(5))
            .connect_lazy(),
    );
    assert!(
        list_tools(&mut plaintext).await.is_err(),
        "plaintext gRPC is refused"
    );
    let mut foreign = tls_client(&addr, &other, "orchestrator", &pki).await;
    assert!(
        list_tools(&mut foreign).await.is_err(),
        "another CA's certificate is refused"
    );
    let mut wrong_name = tls_client(&addr, &pki, "worker-shell", &pki).await;
    assert!(
        list_tools(&mut wrong_name).await.is_err(),
        "a certificate without an allowed name is refused"
    );
    let mut execute = tls_client(&addr, &pki, "worker-shell", &pki).await;
    let attempt = tokio::time::timeout(
        Duration::from_secs(15),
        execute.execute(pb::ExecuteRequest {
            call_id: "call_forged".into(),
            tool: "write_file".into(),
            arguments_json: json!({"path": "forged.txt", "content": "x"}).to_string(),
            principal: "ops".into(),
            session_id: "mtls".into(),
            timeout_ms: 5000,
            ..Default::default()
        }),
    )
    .await;
    assert!(!matches!(attempt, Ok(Ok(_))), "Execute is refused too");
    assert!(
        !workspaces.join("ops/mtls/forged.txt").exists(),
        "nothing was written"
    );
    assert!(workspaces.join("ops/mtls/hello.txt").exists());
    // Each refusal is in the worker's log, with its reason.
    let log = worker.log();
    assert!(log.contains("the TLS handshake failed"), "{log}");
    assert!(log.contains("the peer is not allowed"), "{log}");
    drop(allowed);

    // 4. Rotation under load: a new CA and new certificates replace the files on both
    // sides (each file renamed into place, one after another); no call fails, the new
    // identity is served, and the old one is refused from then on.
    let old = scratch.path().join("old-pki");
    std::fs::create_dir(&old).expect("old pki dir");
    for file in ["ca.crt", "orchestrator.crt", "orchestrator.key"] {
        std::fs::copy(pki.join(file), old.join(file)).expect("keep the old identity");
    }
    let rotated = scratch.path().join("rotated-pki");
    certs_init(&rotated);
    let calls = {
        let (http, url) = (http.clone(), url.clone());
        tokio::spawn(async move {
            let mut failures = Vec::new();
            for i in 0..60 {
                let response: Value = http
                    .post(format!("{url}/v1/tool_calls"))
                    .bearer_auth(TOKEN)
                    .json(&json!({"session_id": "mtls", "tool_uses": [{"type": "tool_use", "id": "t", "name": "read_file", "input": {"path": "hello.txt"}}]}))
                    .send()
                    .await
                    .expect("send")
                    .json()
                    .await
                    .expect("json");
                if response["calls"][0]["status"] != "ok" {
                    failures.push(format!("call {i}: {response}"));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            failures
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    for file in [
        "ca.crt",
        "worker-fs.crt",
        "worker-fs.key",
        "orchestrator.crt",
        "orchestrator.key",
    ] {
        let staged = pki.join(format!(".{file}.new"));
        std::fs::copy(rotated.join(file), &staged).expect("stage");
        std::fs::rename(&staged, pki.join(file)).expect("rotate");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let failures = calls.await.expect("load task");
    assert!(
        failures.is_empty(),
        "calls failed during rotation:\n{}",
        failures.join("\n")
    );
    worker.wait_for_line("the new certificate is in force");
    let mut renewed = tls_client(&addr, &rotated, "orchestrator", &rotated).await;
    assert!(
        list_tools(&mut renewed)
            .await
            .expect("the rotated identity is served")
            >= 9
    );
    let mut stale = tls_client(&addr, &old, "orchestrator", &old).await;
    assert!(
        list_tools(&mut stale).await.is_err(),
        "the old certificate is refused after rotation"
    );
}

#[tokio::test]
async fn tcp_without_tls_is_refused_at_start_naming_the_fix() {
    let scratch = tempfile::tempdir().expect("temp dir");
    let pki = scratch.path().join("pki");
    certs_init(&pki);
    let run = |args: &[&str], config: &str| {
        let path = scratch.path().join("config.toml");
        std::fs::write(&path, config).expect("config");
        Command::new(AIRLOCK)
            .args(args)
            .arg("--config")
            .arg(&path)
            .arg("--data-dir")
            .arg(scratch.path().join("data"))
            .env("AIRLOCK_LAUNCHER_PID", std::process::id().to_string())
            .stdin(Stdio::null())
            .output()
            .expect("run airlock")
    };
    let worker = ["serve", "worker", "http", "--listen", "127.0.0.1:0"];
    // No [tls]: refused, naming both ways out.
    let out = run(&worker, "");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("[tls]") && stderr.contains("insecure_plaintext"),
        "{stderr}"
    );
    // The lab switch: it starts, and says so in its log and in health.
    {
        let config = scratch.path().join("lab.toml");
        std::fs::write(&config, "[tls]\ninsecure_plaintext = true\n").expect("config");
        let mut lab = Component::start(
            &worker,
            &config,
            &scratch.path().join("lab-data"),
            scratch.path().join("lab.log"),
        );
        let line = lab.wait_for_line("insecure_plaintext = true");
        assert!(line.contains("WARN"), "{line}");
        let addr = field(&lab.wait_for_line("http worker starting"), "listen");
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: "airlock.insecure_plaintext".into(),
            })
            .await
            .expect("the marker is known")
            .into_inner()
            .status;
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    }
    // Broken files: refused, naming the file, never plaintext.
    let mut broken = tls_section(&pki, "worker-http");
    broken = broken.replace("worker-http.key", "worker-db.key");
    let out = run(&worker, &broken);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("worker-db.key") && stderr.contains("does not belong"),
        "{stderr}"
    );
    // An orchestrator without [tls] does not dial a TLS worker, nor plaintext TCP.
    for endpoint in [
        "https://127.0.0.1:1",
        "http://127.0.0.1:1",
        "dns:///localhost:1",
    ] {
        let out = run(
            &["serve", "orchestrator"],
            &format!(
                "[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n[[workers]]\ngroup = \"fs\"\nendpoints = [\"{endpoint}\"]\n"
            ),
        );
        assert!(!out.status.success(), "{endpoint}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("[tls]") && stderr.contains("insecure_plaintext"),
            "{endpoint}: {stderr}"
        );
    }
}

/// A gRPC client of the orchestrator's front door at `grpc` (`https://host:port`) over
/// TLS without a client certificate, trusting only `trust`'s CA and expecting the
/// server's certificate to be valid for `orchestrator`.
fn front_door_client(grpc: &str, trust: &Path) -> OrchestratorClient<tonic::transport::Channel> {
    let addr = grpc
        .strip_prefix("https://")
        .unwrap_or_else(|| panic!("the gRPC front door is not https:// ({grpc})"))
        .to_owned();
    let roots = airlock_tls::files::roots(&trust.join("ca.crt")).expect("roots");
    let mut config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let channel = Endpoint::from_static("http://orchestrator.invalid")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
            let (connector, addr) = (connector.clone(), addr.clone());
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let name = rustls::pki_types::ServerName::try_from("orchestrator").expect("name");
                let tls = connector.connect(name, tcp).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }));
    OrchestratorClient::new(channel)
}

fn authed<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("metadata"),
    );
    request
}

/// The tools the front door lists to `token`, within 15 s.
async fn front_door_tools(
    client: &mut OrchestratorClient<tonic::transport::Channel>,
    token: &str,
) -> Result<Vec<String>, tonic::Status> {
    let listed = tokio::time::timeout(
        Duration::from_secs(15),
        client.list_tools(authed(pb::OrchestratorListToolsRequest {}, token)),
    )
    .await
    .map_err(|_| tonic::Status::deadline_exceeded("no answer in 15 s"))??;
    Ok(listed
        .into_inner()
        .tools
        .into_iter()
        .map(|t| t.name)
        .collect())
}

#[tokio::test]
async fn the_grpc_front_door_serves_tls_with_grpc_tls() {
    let scratch = tempfile::tempdir().expect("temp dir");
    let pki = scratch.path().join("pki");
    let other = scratch.path().join("other-pki");
    certs_init(&pki);
    certs_init(&other);
    let before = scratch.path().join("pki-before");
    std::fs::create_dir(&before).expect("dir");
    std::fs::copy(pki.join("ca.crt"), before.join("ca.crt")).expect("keep the old CA");
    let airlock = Airlock::start_with(&format!(
        "grpc_tls = true\n{}",
        tls_section(&pki, "orchestrator")
    ))
    .await;

    // Announced: https:// in the run file, the endpoints file and the start-up log.
    let run: Value = serde_json::from_str(
        &std::fs::read_to_string(airlock.data_dir().join("run/orchestrator.json"))
            .expect("run file"),
    )
    .expect("run file JSON");
    let grpc = run["grpc"]
        .as_str()
        .expect("grpc in the run file")
        .to_owned();
    assert!(grpc.starts_with("https://127.0.0.1:"), "{run}");
    assert!(
        run["http"].as_str().expect("http").starts_with("http://"),
        "{run}"
    );
    assert_eq!(airlock.grpc, grpc);
    let log = airlock.log();
    let listening = log
        .lines()
        .find(|l| l.contains("orchestrator listening"))
        .unwrap_or_else(|| panic!("no start-up line in:\n{log}"));
    assert!(
        listening.contains("grpc_tls=true") && listening.contains(&grpc),
        "{listening}"
    );

    // A client trusting the CA, checking the name `orchestrator`: the API as ever,
    // token and all.
    let mut client = front_door_client(&grpc, &pki);
    let tools = front_door_tools(&mut client, &airlock.token)
        .await
        .expect("listed over TLS");
    assert!(tools.iter().any(|t| t == "read_file"), "{tools:?}");
    let anonymous = front_door_tools(&mut client, "alk_wrong").await;
    assert_eq!(
        anonymous.expect_err("a wrong token").code(),
        tonic::Code::Unauthenticated
    );
    let response = client
        .call_tools(authed(
            pb::CallToolsRequest {
                session_id: "grpc-tls".into(),
                tool_uses: vec![pb::ToolUse {
                    id: "w".into(),
                    name: "write_file".into(),
                    input_json: r#"{"path":"t.txt","content":"over TLS"}"#.into(),
                }],
                wait_ms: None,
            },
            &airlock.token,
        ))
        .await
        .expect("call over TLS")
        .into_inner();
    assert_eq!(response.calls[0].status, "ok", "{response:?}");
    assert_eq!(
        std::fs::read_to_string(airlock.workspace("grpc-tls").join("t.txt")).expect("file"),
        "over TLS"
    );

    // A plaintext client, and one trusting another CA, get nothing.
    let mut plaintext = OrchestratorClient::new(
        Endpoint::from_shared(format!("http://{}", grpc.trim_start_matches("https://")))
            .expect("endpoint")
            .connect_timeout(Duration::from_secs(5))
            .connect_lazy(),
    );
    assert!(
        front_door_tools(&mut plaintext, &airlock.token)
            .await
            .is_err(),
        "plaintext gRPC is refused"
    );
    let mut foreign = front_door_client(&grpc, &other);
    assert!(
        front_door_tools(&mut foreign, &airlock.token)
            .await
            .is_err(),
        "a client trusting another CA does not connect"
    );
    // Each failed handshake is logged with its reason and harms no one else: the open
    // connection and a new one are both served.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !airlock.log().contains("the TLS handshake failed") {
        assert!(Instant::now() < deadline, "{}", airlock.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    front_door_tools(&mut client, &airlock.token)
        .await
        .expect("the open connection is still served");
    let mut again = front_door_client(&grpc, &pki);
    front_door_tools(&mut again, &airlock.token)
        .await
        .expect("a new connection is served");

    // Rotation: new files are served to new connections without a restart; the open
    // connection keeps its session, and the old CA no longer verifies a new one.
    let rotated = scratch.path().join("rotated-pki");
    certs_init(&rotated);
    for file in ["ca.crt", "orchestrator.crt", "orchestrator.key"] {
        let staged = pki.join(format!(".{file}.new"));
        std::fs::copy(rotated.join(file), &staged).expect("stage");
        std::fs::rename(&staged, pki.join(file)).expect("rotate");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !airlock.log().contains("the new certificate is in force") {
        assert!(Instant::now() < deadline, "{}", airlock.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    front_door_tools(&mut client, &airlock.token)
        .await
        .expect("the connection opened before the rotation is still served");
    let mut renewed = front_door_client(&grpc, &rotated);
    front_door_tools(&mut renewed, &airlock.token)
        .await
        .expect("the rotated certificate is served");
    let mut stale = front_door_client(&grpc, &scratch.path().join("pki-before"));
    assert!(
        front_door_tools(&mut stale, &airlock.token).await.is_err(),
        "the old certificate is no longer served"
    );

    // The HTTP front door is unchanged: plaintext HTTP, as before.
    let (is_error, text, _) = airlock
        .call_in("grpc-tls", "read_file", json!({"path": "t.txt"}))
        .await;
    assert!(!is_error && text.contains("over TLS"), "{text}");
}

/// Runs `airlock serve orchestrator` with `config`, expecting it to refuse to start
/// within 60 s; returns its stderr.
fn orchestrator_refuses(scratch: &Path, name: &str, config: &str) -> String {
    let path = scratch.join(format!("{name}.toml"));
    std::fs::write(&path, config).expect("config");
    let stderr = scratch.join(format!("{name}.log"));
    let mut child = Command::new(AIRLOCK)
        .args(["serve", "orchestrator", "--config"])
        .arg(&path)
        .arg("--data-dir")
        .arg(scratch.join(format!("{name}-data")))
        .env("AIRLOCK_LAUNCHER_PID", std::process::id().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).expect("log file"))
        .spawn()
        .expect("spawn airlock");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{name}: the orchestrator started:\n{}",
                std::fs::read_to_string(&stderr).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let log = std::fs::read_to_string(&stderr).unwrap_or_default();
    assert!(!status.success(), "{name}: {log}");
    log
}

#[test]
fn grpc_tls_without_a_usable_certificate_refuses_to_start() {
    let scratch = tempfile::tempdir().expect("temp dir");
    let pki = scratch.path().join("pki");
    certs_init(&pki);
    let orchestrator = "[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\ngrpc_tls = true\n";

    // No [tls] at all, and a section without key_file: refused, naming [tls] and the key.
    let stderr = orchestrator_refuses(scratch.path(), "none", orchestrator);
    assert!(
        stderr.contains("grpc_tls") && stderr.contains("[tls] cert_file"),
        "{stderr}"
    );
    let no_key = tls_section(&pki, "orchestrator")
        .lines()
        .filter(|l| !l.starts_with("key_file"))
        .collect::<Vec<_>>()
        .join("\n");
    let stderr = orchestrator_refuses(
        scratch.path(),
        "no-key",
        &format!("{orchestrator}{no_key}\n"),
    );
    assert!(stderr.contains("[tls] key_file"), "{stderr}");

    // A certificate file that is not there, and one that is garbage: refused, naming it.
    let missing = pki.join("absent.crt");
    let config = format!(
        "{orchestrator}{}",
        tls_section(&pki, "orchestrator").replace(
            &pki.join("orchestrator.crt").display().to_string(),
            &missing.display().to_string()
        )
    );
    let stderr = orchestrator_refuses(scratch.path(), "missing", &config);
    assert!(
        stderr.contains(&missing.display().to_string()) && stderr.contains("cannot read"),
        "{stderr}"
    );
    let garbage = pki.join("garbage.crt");
    std::fs::write(&garbage, "not a certificate\n").expect("garbage");
    let config = format!(
        "{orchestrator}{}",
        tls_section(&pki, "orchestrator").replace(
            &pki.join("orchestrator.crt").display().to_string(),
            &garbage.display().to_string()
        )
    );
    let stderr = orchestrator_refuses(scratch.path(), "garbage", &config);
    assert!(
        stderr.contains(&garbage.display().to_string()) && stderr.contains("no PEM certificate"),
        "{stderr}"
    );
}
