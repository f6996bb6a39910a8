//! A running `airlock up` for one test, stopped (and checked for leftovers) on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::ordinary_user::{Delegation, OrdinaryUser};

pub const AIRLOCK: &str = env!("CARGO_BIN_EXE_airlock");

pub struct Airlock {
    pub dir: tempfile::TempDir,
    pub url: String,
    pub grpc: String,
    pub token: String,
    child: Option<Child>,
    client: reqwest::Client,
}

impl Airlock {
    /// Starts `airlock up` with an optional extra config snippet.
    pub async fn start() -> Self {
        Self::start_with("").await
    }

    /// Starts `airlock up` with extra config. Unless the snippet has its own
    /// `[approvals]` (or `[budgets]`) section, approvals and the rate limit are off, so
    /// tests about other things are not held up by them.
    pub async fn start_with(extra_config: &str) -> Self {
        Self::start_with_env(extra_config, &[]).await
    }

    /// [`Airlock::start_with`], with extra environment variables for `airlock up` (which
    /// passes its environment to the orchestrator, e.g. a model provider's API key).
    pub async fn start_with_env(extra_config: &str, env: &[(&str, &str)]) -> Self {
        Self::launch("", extra_config, env, None).await
    }

    /// [`Airlock::start_with`], with keys of the file's top level (`tool_packs = …`),
    /// which must come before the first table.
    pub async fn start_with_top_level(top_level: &str, extra_config: &str) -> Self {
        Self::launch(top_level, extra_config, &[], None).await
    }

    /// [`Airlock::start_with`] as an ordinary user (see `ordinary_user`), inside
    /// `delegation` when given (whose `cgroup_parent` the snippet should then name).
    pub async fn start_as(
        user: &OrdinaryUser,
        delegation: Option<&Delegation>,
        extra_config: &str,
    ) -> Self {
        Self::launch("", extra_config, &[], Some((user, delegation))).await
    }

    /// Runs `airlock up` as `user` and expects it to refuse to start: returns its exit
    /// status and log once it has exited (bounded).
    pub fn refused_as(
        user: &OrdinaryUser,
        extra_config: &str,
    ) -> (std::process::ExitStatus, String) {
        let (dir, mut command) = Self::up_command("", extra_config, &[], Some((user, None)));
        let mut child = command.spawn().expect("spawn airlock up");
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "airlock up as {} was expected to refuse to start but kept running:\n{}",
                    user.name,
                    std::fs::read_to_string(dir.path().join("airlock.log")).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let log = std::fs::read_to_string(dir.path().join("airlock.log")).unwrap_or_default();
        (status, log)
    }

    /// The temp dir (config, data dir, log) and the `airlock up` command for a test.
    /// Unless the snippet has its own `[approvals]` (or `[budgets]`) section, approvals
    /// and the rate limit are off.
    fn up_command(
        top_level: &str,
        extra_config: &str,
        env: &[(&str, &str)],
        user: Option<(&OrdinaryUser, Option<&Delegation>)>,
    ) -> (tempfile::TempDir, Command) {
        let mut extra = extra_config.to_owned();
        if !extra.contains("[approvals]") {
            extra.push_str("\n[approvals]\ntools = []\n");
        }
        if !extra.contains("[budgets]") {
            extra.push_str("\n[budgets]\nrate_per_minute = 0\n");
        }
        // An ordinary user cannot mount the workspace volumes (`as_user` shows the
        // refusal that names this setting); unless the snippet says otherwise, its
        // launches run without the per-workspace quota.
        if user.is_some() && !extra.contains("workspace_bytes") {
            const NO_QUOTA: &str = "workspace_bytes = 0\nworkspace_inodes = 0\n";
            extra = match extra.contains("[sandbox]\n") {
                true => extra.replacen("[sandbox]\n", &format!("[sandbox]\n{NO_QUOTA}"), 1),
                false => format!("{extra}\n[sandbox]\n{NO_QUOTA}"),
            };
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("airlock.toml");
        std::fs::write(
            &config,
            format!(
                "{top_level}\n[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n{extra}"
            ),
        )
        .expect("write config");
        let data_dir = dir.path().join("data");
        let log = std::fs::File::create(dir.path().join("airlock.log")).expect("log file");
        let mut command = match user {
            None => Command::new(AIRLOCK),
            Some((user, delegation)) => {
                user.own(dir.path());
                match delegation.and_then(|d| d.enter.as_ref()) {
                    // Start inside the delegated cgroup, then drop to the user.
                    Some(cgroup) => {
                        let mut c = Command::new("sh");
                        c.arg("-c")
                            .arg("echo $$ > \"$0/cgroup.procs\" && shift && exec \"$@\"")
                            .arg(cgroup)
                            .arg("--")
                            .arg("setpriv")
                            .arg(format!("--reuid={}", user.uid))
                            .arg(format!("--regid={}", user.gid))
                            .arg("--clear-groups")
                            .arg("--")
                            .arg(&user.airlock)
                            .env("USER", &user.name)
                            .env("HOME", "/nonexistent");
                        c
                    }
                    None => user.command(&user.airlock),
                }
            }
        };
        command
            .args(["up", "--data-dir"])
            .arg(&data_dir)
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "info")
            .env_remove("AIRLOCK_URL")
            .env_remove("AIRLOCK_TOKEN")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        (dir, command)
    }

    async fn launch(
        top_level: &str,
        extra_config: &str,
        env: &[(&str, &str)],
        user: Option<(&OrdinaryUser, Option<&Delegation>)>,
    ) -> Self {
        // `airlock up` binds the orchestrator's ports itself, but a worker's metrics port 0
        // is settled to a free port (outside the ephemeral range, which outgoing
        // connections use) and bound by the worker; in between, another test's start may
        // still settle on the same port. Such a start is tried once more, and only such a
        // start.
        let mut attempt = 0;
        let (mut airlock, endpoints) = loop {
            attempt += 1;
            let (dir, mut command) = Self::up_command(top_level, extra_config, env, user);
            let child = command.spawn().expect("spawn airlock up");
            let mut airlock = Self {
                dir,
                url: String::new(),
                grpc: String::new(),
                token: String::new(),
                child: Some(child),
                client: reqwest::Client::new(),
            };
            match airlock.try_endpoints().await {
                Ok(endpoints) => break (airlock, endpoints),
                Err(log) if attempt == 1 && log.contains("Address already in use") => {}
                Err(log) => panic!("airlock up exited early:\n{log}"),
            }
        };
        airlock.url = endpoints["http"]
            .as_str()
            .expect("http endpoint")
            .to_owned();
        airlock.grpc = endpoints["grpc"]
            .as_str()
            .expect("grpc endpoint")
            .to_owned();
        // With configured principals there is no generated token; tests bring their own.
        if let Some(token_file) = endpoints["token_file"].as_str() {
            airlock.token = std::fs::read_to_string(token_file)
                .expect("token")
                .trim()
                .to_owned();
        }
        airlock.wait_ready().await;
        airlock
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The workspace of principal `local`, session `session`.
    pub fn workspace(&self, session: &str) -> PathBuf {
        self.data_dir()
            .join("workspaces")
            .join("local")
            .join(session)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("airlock.log")).unwrap_or_default()
    }

    /// The kinds of the audit events of `call_id`, in order.
    pub async fn audit_kinds(&self, call_id: &str) -> Vec<String> {
        let (_, audit) = self.get(&format!("/v1/audit?call_id={call_id}")).await;
        audit["events"]
            .as_array()
            .expect("events")
            .iter()
            .filter_map(|e| e["kind"].as_str().map(str::to_owned))
            .collect()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// The process below the launcher whose command line contains `command`
    /// (`"serve orchestrator"`, `"serve worker fs"`).
    pub fn process(&self, command: &str) -> u32 {
        descendants(self.pid())
            .into_iter()
            .find(|p| cmdline(*p).contains(command))
            .unwrap_or_else(|| panic!("no `{command}` process below the launcher\n{}", self.log()))
    }

    /// `endpoints.json` once `airlock up` wrote it, or its log when it exited first.
    async fn try_endpoints(&mut self) -> Result<Value, String> {
        let path = self.data_dir().join("endpoints.json");
        let log = self.dir.path().join("airlock.log");
        let child = self.child.as_mut().expect("running");
        try_wait_for_endpoints(&path, child, &log).await
    }

    /// `airlock <args…> --data-dir <this test's data dir>`, with no client settings from
    /// the test's own environment (URL, token, config, data dir).
    pub fn cli(&self, args: &[&str]) -> Command {
        let mut command = Command::new(AIRLOCK);
        for key in [
            "AIRLOCK_URL",
            "AIRLOCK_TOKEN",
            "AIRLOCK_CONFIG",
            "AIRLOCK_DATA_DIR",
        ] {
            command.env_remove(key);
        }
        command
            .args(args)
            .arg("--data-dir")
            .arg(self.data_dir())
            .stdin(Stdio::null());
        command
    }

    /// Waits until `/readyz` answers 200.
    pub async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = self.client.get(format!("{}/readyz", self.url)).send().await
                && r.status() == 200
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "airlock never became ready:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn http(&self) -> &reqwest::Client {
        &self.client
    }

    /// A client of the orchestrator's gRPC front door (no credentials attached).
    pub async fn grpc_client(
        &self,
    ) -> airlock_proto::v1::orchestrator_client::OrchestratorClient<tonic::transport::Channel> {
        let channel = tonic::transport::Endpoint::from_shared(self.grpc.clone())
            .expect("endpoint")
            .connect()
            .await
            .expect("connect to the gRPC front door");
        airlock_proto::v1::orchestrator_client::OrchestratorClient::new(channel)
    }

    /// An authenticated request.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.token)
    }

    /// POST /v1/tool_calls with a JSON body; returns status and body.
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let response = self
            .request(reqwest::Method::POST, path)
            .json(body)
            .send()
            .await
            .expect("send");
        let status = response.status().as_u16();
        let body = response.json::<Value>().await.expect("JSON body");
        (status, body)
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let response = self
            .request(reqwest::Method::GET, path)
            .send()
            .await
            .expect("send");
        let status = response.status().as_u16();
        let body = response.json::<Value>().await.expect("JSON body");
        (status, body)
    }

    /// Calls one tool in `session`; returns (is_error, text, calls[0]).
    pub async fn call_in(&self, session: &str, tool: &str, input: Value) -> (bool, String, Value) {
        let body = json!({
            "session_id": session,
            "tool_uses": [{"type": "tool_use", "id": "t1", "name": tool, "input": input}],
        });
        let (status, body) = self.post("/v1/tool_calls", &body).await;
        assert_eq!(status, 200, "{body}");
        let result = &body["tool_results"][0];
        assert_eq!(result["type"], "tool_result", "{body}");
        assert_eq!(result["tool_use_id"], "t1");
        let text = result["content"]
            .as_array()
            .expect("content")
            .iter()
            .map(|b| b["text"].as_str().expect("text block").to_owned())
            .collect::<Vec<_>>()
            .join("\n");
        (
            result["is_error"].as_bool().expect("is_error"),
            text,
            body["calls"][0].clone(),
        )
    }

    /// Proposes one call in `session` with `wait_ms: 0`, so that it answers at once
    /// whether the call runs or waits for approval: the call's entry and the whole body.
    pub async fn propose(&self, session: &str, tool: &str, input: Value) -> (Value, Value) {
        let body = json!({"session_id": session, "wait_ms": 0,
            "tool_uses": [{"type": "tool_use", "id": "t1", "name": tool, "input": input}]});
        let (status, body) = self.post("/v1/tool_calls", &body).await;
        assert_eq!(status, 200, "{body}");
        (body["calls"][0].clone(), body)
    }

    /// Approves a held call (a `calls[]` entry with its `approval_id`) and waits,
    /// bounded, for its end: the call's detail.
    pub async fn approve_and_wait(&self, held: &Value) -> Value {
        let approval_id = held["approval_id"].as_str().expect("approval id");
        let call_id = held["call_id"].as_str().expect("call id");
        let (status, body) = self
            .post(&format!("/v1/approvals/{approval_id}/approve"), &json!({}))
            .await;
        assert_eq!(status, 200, "{body}");
        let (status, detail) = self
            .get(&format!("/v1/calls/{call_id}?wait_ms=30000"))
            .await;
        assert_eq!(status, 200, "{detail}");
        detail
    }

    pub async fn call(&self, tool: &str, input: Value) -> (bool, String, Value) {
        self.call_in("default", tool, input).await
    }

    /// Whether a process whose command line holds `marker` runs below the launcher.
    pub fn runs(&self, marker: &str) -> bool {
        descendants(self.pid())
            .iter()
            .any(|p| cmdline(*p).contains(marker))
    }

    /// Waits (bounded) until a process holding `marker` runs below the launcher.
    pub async fn wait_started(&self, marker: &str, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.runs(marker) {
            assert!(Instant::now() < deadline, "{what} never started");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits (bounded) until no process holding `marker` is left below the launcher.
    pub async fn wait_gone(&self, marker: &str, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.runs(marker) {
            assert!(Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Reaps a launcher that was killed from outside.
    pub fn stop_after_kill(&mut self) -> Option<std::process::ExitStatus> {
        self.child.take().and_then(|mut c| c.wait().ok())
    }

    /// Sends SIGTERM to the launcher and waits for it; a launcher that stopped leaves
    /// no workspace volume mounted.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        signal(child.id(), rustix::process::Signal::TERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                let left = mounts_under(self.dir.path());
                assert!(
                    left.is_empty(),
                    "airlock up stopped and left volumes mounted: {left:?}"
                );
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("airlock up did not stop within 30 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Airlock {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pids = descendants(child.id());
            signal(child.id(), rustix::process::Signal::TERM);
            let deadline = Instant::now() + Duration::from_secs(15);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
            for pid in pids {
                signal(pid, rustix::process::Signal::KILL);
            }
        }
        // A launcher killed outright cannot unmount its workspace volumes.
        for point in mounts_under(self.dir.path()) {
            let _ = Command::new("umount").arg("-l").arg(&point).status();
        }
    }
}

/// Mount points at or below `dir`, deepest first (from /proc/self/mountinfo, whose
/// fifth field is the mount point with spaces and the like octal-escaped).
/// Runs `airlock up --config <config>` and expects it to refuse to start, within a
/// bound: its stdout and stderr.
pub fn up_refused(config: &Path, data_dir: &Path) -> String {
    // Output goes to a file, not a pipe: a pipe nobody reads while we wait would fill
    // and stall a chatty start-up.
    let log_path = data_dir.with_extension("up.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let mut child = Command::new(AIRLOCK)
        .args(["up", "--config"])
        .arg(config)
        .arg("--data-dir")
        .arg(data_dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log file"))
        .stderr(log)
        .spawn()
        .expect("spawn airlock up");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "airlock up neither started nor refused within 60 s:\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(!status.success(), "airlock up started: {text}");
    text
}

/// A cgroup hierarchy mounted here (from /proc/self/mountinfo).
pub struct CgroupMount {
    pub mount_point: PathBuf,
    /// `true` for `cgroup2`, `false` for a v1 hierarchy.
    pub v2: bool,
    /// A v1 hierarchy's controllers (its super options: `cpu`, `memory`, …).
    pub options: Vec<String>,
}

/// Every cgroup hierarchy (v1 and v2) mounted in this mount namespace.
pub fn cgroup_mounts() -> Vec<CgroupMount> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    info.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mount_point = PathBuf::from(left.split(' ').nth(4)?);
            let mut fields = right.split(' ');
            let v2 = match fields.next()? {
                "cgroup" => false,
                "cgroup2" => true,
                _ => return None,
            };
            let options = fields
                .nth(1)
                .unwrap_or("")
                .split(',')
                .map(str::to_owned)
                .collect();
            Some(CgroupMount {
                mount_point,
                v2,
                options,
            })
        })
        .collect()
}

pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points
}

/// Waits (bounded) until `endpoints` holds the JSON that a started `airlock up` writes;
/// fails with `log` when the launcher exits first or the bound runs out.
pub async fn wait_for_endpoints(endpoints: &Path, launcher: &mut Child, log: &Path) -> Value {
    match try_wait_for_endpoints(endpoints, launcher, log).await {
        Ok(endpoints) => endpoints,
        Err(log) => panic!("airlock up exited early:\n{log}"),
    }
}

/// [`wait_for_endpoints`], answering the launcher's log when it exited before writing
/// them.
async fn try_wait_for_endpoints(
    endpoints: &Path,
    launcher: &mut Child,
    log: &Path,
) -> Result<Value, String> {
    let log = || std::fs::read_to_string(log).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(text) = std::fs::read_to_string(endpoints)
            && let Ok(v) = serde_json::from_str::<Value>(&text)
        {
            return Ok(v);
        }
        if let Some(status) = launcher.try_wait().ok().flatten() {
            return Err(format!("({status})\n{}", log()));
        }
        assert!(
            Instant::now() < deadline,
            "airlock up did not start:\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `token_sha256` of a `[[principals]]` entry: lowercase hex of SHA-256.
pub fn token_digest(token: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `[[principals]]` entries, each with its roles and the token `<name>-token`, then
/// `extra` (more configuration).
pub fn principals_config(principals: &[(&str, &[&str])], extra: &str) -> String {
    principals_config_with_tokens(principals, "token", extra)
}

/// [`principals_config`] with the token `<name>-<token_suffix>`: a test whose tokens
/// must not be anyone else's (the console's, which its script signs in with).
pub fn principals_config_with_tokens(
    principals: &[(&str, &[&str])],
    token_suffix: &str,
    extra: &str,
) -> String {
    let mut config = String::new();
    for (name, roles) in principals {
        let roles: Vec<String> = roles.iter().map(|r| format!("{r:?}")).collect();
        config.push_str(&format!(
            "\n[[principals]]\nname = {name:?}\ntoken_sha256 = \"{}\"\nroles = [{}]\n",
            token_digest(&format!("{name}-{token_suffix}")),
            roles.join(", ")
        ));
    }
    config.push_str(extra);
    config
}

/// The approval `approval_id`, whatever its status, as `GET /v1/approvals` lists it to
/// `token` (an approver's or an admin's).
pub async fn listed_approval(airlock: &Airlock, token: &str, approval_id: &str) -> Value {
    let (status, list, _) = send_as(
        airlock,
        token,
        reqwest::Method::GET,
        "/v1/approvals?limit=1000",
        None,
    )
    .await;
    assert_eq!(status, 200, "{list}");
    list["approvals"]
        .as_array()
        .expect("approvals")
        .iter()
        .find(|a| a["approval_id"] == approval_id)
        .cloned()
        .unwrap_or_else(|| panic!("no approval {approval_id}: {list}"))
}

/// One HTTP request to `airlock` with `token`: status, JSON body (`null` when none) and
/// headers.
pub async fn send_as(
    airlock: &Airlock,
    token: &str,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value, reqwest::header::HeaderMap) {
    let mut request = airlock
        .http()
        .request(method, format!("{}{path}", airlock.url))
        .bearer_auth(token);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("send");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.json::<Value>().await.unwrap_or(Value::Null);
    (status, body, headers)
}

pub fn signal(pid: u32, signal: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

/// Every live descendant of `pid` (from /proc/<pid>/task/*/children).
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut frontier = vec![pid];
    while let Some(p) = frontier.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for child in children
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
            {
                if !found.contains(&child) {
                    found.push(child);
                    frontier.push(child);
                }
            }
        }
    }
    found
}

/// Whether a process exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

/// Whether the process is gone (or a zombie) within ten seconds: for what is torn down
/// just after the answer it belongs to was sent.
pub async fn ends_soon(pid: u32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid) {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// The command line of a process, arguments joined by spaces.
pub fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// A snapshot of a file tree: path → (content, mtime), for "nothing changed" checks.
pub fn snapshot(root: &Path) -> Vec<(PathBuf, Vec<u8>, std::time::SystemTime)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let meta = std::fs::symlink_metadata(&path).expect("metadata");
            if meta.is_dir() {
                stack.push(path.clone());
            }
            let content = if meta.is_file() {
                std::fs::read(&path).expect("read")
            } else {
                Vec::new()
            };
            out.push((path, content, meta.modified().expect("mtime")));
        }
    }
    out.sort();
    out
}

/// The complete Server-Sent Events in `text`: (event name, parsed data).
pub fn sse_events(text: &str) -> Vec<(String, Value)> {
    let complete = match text.rfind("\n\n") {
        Some(end) => &text[..end],
        None => return Vec::new(),
    };
    complete
        .split("\n\n")
        .filter_map(|block| {
            let mut name = None;
            let mut data = String::new();
            for line in block.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = Some(n.to_owned());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data.push_str(d);
                }
            }
            Some((name?, serde_json::from_str(&data).ok()?))
        })
        .collect()
}
