//! MCP servers behind the gate (`[[mcp_servers]]`): real servers from PyPI
//! (`mcp-server-time`, `mcp-server-git`, installed by `.ci/run`) and a misbehaving one
//! of the test's own, run by the shell worker inside the sandbox. Their tools pass the
//! gate as `<name>__<tool>`; the process is confined; a crash, a hang, a flood or
//! garbage is an error result for that call only.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::{
    AIRLOCK, Airlock, cmdline, descendants, send_as, sse_events, token_digest, up_refused,
};

/// Where `.ci/run` installs the servers: a virtualenv under `/usr`, which the sandbox
/// mounts read-only (a server installed under `/root` or `/home` is not visible there).
const SERVERS: &str = "/usr/local/lib/airlock-test/mcp-servers/bin";

const FLAKY: &str = include_str!("mcp_flaky_server.py");

fn servers_bin() -> PathBuf {
    let bin = PathBuf::from(SERVERS);
    for server in ["mcp-server-time", "mcp-server-git"] {
        assert!(
            bin.join(server).exists(),
            "{server} is not installed in {SERVERS}; .ci/run installs it \
             (/usr/bin/python3 -m venv /usr/local/lib/airlock-test/mcp-servers && \
             .../bin/pip install mcp-server-time mcp-server-git)"
        );
    }
    bin
}

fn config() -> String {
    let bin = servers_bin();
    format!(
        r#"
[[mcp_servers]]
name = "time"
command = ["{time}", "--local-timezone", "UTC"]
per_session = false

[[mcp_servers]]
name = "git"
command = ["{git}"]

[[mcp_servers]]
name = "flaky"
command = ["/usr/bin/python3", "-c", '''{FLAKY}''']
"#,
        time = bin.join("mcp-server-time").display(),
        git = bin.join("mcp-server-git").display(),
    )
}

/// The host pids of the processes below airlock whose command line holds `marker`.
fn processes(airlock: &Airlock, marker: &str) -> Vec<u32> {
    descendants(airlock.pid())
        .into_iter()
        .filter(|pid| cmdline(*pid).contains(marker))
        .collect()
}

fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{field}:")))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

fn namespace(pid: &str, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).expect("namespace link")
}

/// Waits (bounded) until the catalog lists every one of `names`: the MCP tools are
/// discovered from the ListTools of the worker serving them, and the policy is
/// validated again with them, moments after the worker is up. Returns the listing.
pub(crate) async fn wait_for_tools(airlock: &Airlock, names: &[&str]) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, tools) = airlock.get("/v1/tools").await;
        assert_eq!(status, 200, "{tools}");
        let listed = tools.to_string();
        if names
            .iter()
            .all(|name| listed.contains(&format!("\"{name}\"")))
        {
            return listed;
        }
        assert!(
            Instant::now() < deadline,
            "not all of {names:?} listed: {listed}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Cancels the call and waits (bounded) until it has ended as cancelled.
async fn cancel_and_wait(airlock: &Airlock, call_id: &str) {
    let (status, body) = airlock
        .post(&format!("/v1/calls/{call_id}/cancel"), &json!({}))
        .await;
    assert_eq!(status, 200, "{body}");
    let (_, detail) = airlock
        .get(&format!("/v1/calls/{call_id}?wait_ms=20000"))
        .await;
    assert_eq!(detail["status"], "cancelled", "{detail}");
}

/// The workspace's commits, as the host's git sees them.
fn host_git_log(repo: &Path) -> String {
    let log = std::process::Command::new("git")
        .args(["log", "--oneline"])
        .current_dir(repo)
        .output()
        .expect("git log");
    String::from_utf8_lossy(&log.stdout).into_owned()
}

async fn wait_for_file(path: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(text) = std::fs::read_to_string(path)
            && !text.is_empty()
        {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{} never appeared", path.display());
}

/// The default policy, plus a rule on an MCP tool's argument.
const POLICY: &str = r#"
@id("agents-may-call-tools") permit (principal in Airlock::Role::"agent", action, resource);
@id("admins-may-call-tools") permit (principal in Airlock::Role::"admin", action, resource);
@id("no-wip-commits") @reason("commit messages say what changed")
forbid (principal, action == Airlock::Action::"git__git_commit", resource)
when { context.arguments.message like "WIP*" };
"#;

#[tokio::test]
async fn mcp_servers_run_confined_behind_the_gate() {
    let policy_dir = tempfile::tempdir().expect("temp dir");
    let policy = policy_dir.path().join("policy.cedar");
    std::fs::write(&policy, POLICY).expect("policy");
    let airlock = Airlock::start_with(&format!(
        "{}\n[policy]\nfile = \"{}\"\n",
        config(),
        policy.display()
    ))
    .await;

    // Their tools are in the catalog as <server>__<tool>, with the servers' schemas.
    wait_for_tools(
        &airlock,
        &[
            "time__get_current_time",
            "time__convert_time",
            "git__git_status",
            "git__git_commit",
            "git__git_add",
            "flaky__echo",
        ],
    )
    .await;

    // A read-only tool runs at once; the schema is checked at the gate.
    let (err, text, _) = airlock
        .call(
            "time__get_current_time",
            json!({"timezone": "Europe/Paris"}),
        )
        .await;
    assert!(!err, "{text}");
    let now: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(now["timezone"], "Europe/Paris", "{now}");
    let (err, text, _) = airlock
        .call("time__get_current_time", json!({"timezone": 7}))
        .await;
    assert!(err, "{text}");

    // The server process is confined like a sandboxed command: its own user, mount,
    // pid and network namespaces, no privileges, seccomp, in an airlock cgroup.
    let pids = processes(&airlock, "mcp-server-time");
    assert_eq!(pids.len(), 1, "one shared time server: {pids:?}");
    let pid = pids[0];
    assert_eq!(status_field(pid, "NoNewPrivs"), "1");
    assert_eq!(status_field(pid, "Seccomp"), "2");
    assert_eq!(status_field(pid, "CapEff"), "0000000000000000");
    assert_eq!(status_field(pid, "CapBnd"), "0000000000000000");
    for kind in ["user", "mnt", "pid", "net", "ipc", "uts"] {
        assert_ne!(
            namespace(&pid.to_string(), kind),
            namespace("self", kind),
            "the MCP server shares the host's {kind} namespace"
        );
    }
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    assert!(cgroup.contains("airlock"), "{cgroup}");
    // The only network it has is its own loopback.
    let routes = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).expect("net/dev");
    let interfaces: Vec<&str> = routes
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(interfaces, ["lo"], "{routes}");

    // git: a repository in the session's workspace is visible at /workspace...
    let session = "repo";
    let (err, text, _) = airlock
        .call_in(
            session,
            "execute_shell",
            json!({"command": "git init -q . && echo hello > a.txt"}),
        )
        .await;
    assert!(!err, "{text}");
    let (err, text, _) = airlock
        .call_in(
            session,
            "git__git_status",
            json!({"repo_path": "/workspace"}),
        )
        .await;
    assert!(!err, "{text}");
    assert!(text.contains("a.txt"), "{text}");

    // ...and nothing outside it is: not a repository elsewhere on the host, not
    // another session's workspace, whatever the path says.
    let outside = tempfile::tempdir().expect("temp dir");
    let host_repo = outside.path().join("secret-repo");
    std::fs::create_dir(&host_repo).expect("dir");
    let init = std::process::Command::new("git")
        .args(["init", "-q"])
        .current_dir(&host_repo)
        .status()
        .expect("git init");
    assert!(init.success());
    std::fs::write(host_repo.join("secret.txt"), "top secret\n").expect("write");
    let (err, text, _) = airlock
        .call_in(
            "other",
            "execute_shell",
            json!({"command": "git init -q . && echo theirs > theirs.txt"}),
        )
        .await;
    assert!(!err, "{text}");
    let other_workspace = airlock.workspace("other");
    let before: Vec<_> = std::fs::read_dir(&host_repo)
        .expect("list")
        .map(|e| e.expect("entry").file_name())
        .collect();
    for path in [
        host_repo.display().to_string(),
        other_workspace.display().to_string(),
        format!("/proc/1/root{}", host_repo.display()),
        "/workspace/../../../..".to_owned() + &host_repo.display().to_string(),
        "/root".to_owned(),
    ] {
        let (err, text, _) = airlock
            .call_in(session, "git__git_status", json!({"repo_path": path}))
            .await;
        assert!(err, "{path}: {text}");
        assert!(
            !text.contains("secret.txt") && !text.contains("theirs.txt"),
            "{path}: {text}"
        );
    }
    let after: Vec<_> = std::fs::read_dir(&host_repo)
        .expect("list")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(before, after, "the host repository changed");

    // One server per session: the two sessions' git servers are two processes.
    let (err, text, _) = airlock
        .call_in(
            "other",
            "git__git_status",
            json!({"repo_path": "/workspace"}),
        )
        .await;
    assert!(!err && text.contains("theirs.txt"), "{text}");
    assert_eq!(processes(&airlock, "mcp-server-git").len(), 2);

    // `airlock policy schema` shows them as the orchestrator derives them, with typed
    // arguments, from the running shell worker.
    let schema = std::process::Command::new(AIRLOCK)
        .args(["policy", "schema", "--config"])
        .arg(airlock.dir.path().join("airlock.toml"))
        .arg("--data-dir")
        .arg(airlock.data_dir())
        .output()
        .expect("airlock policy schema");
    let schema_text = String::from_utf8_lossy(&schema.stdout);
    assert!(schema.status.success(), "{schema:?}");
    assert!(
        schema_text.contains("action \"git__git_commit\" in [\"shell\"")
            && schema_text.contains("action \"time__get_current_time\""),
        "{schema_text}"
    );

    // Policies name MCP tools and their arguments like any other tool's.
    let (denied, answer) = airlock
        .propose(
            session,
            "git__git_commit",
            json!({"repo_path": "/workspace", "message": "WIP: later"}),
        )
        .await;
    assert_eq!(denied["status"], "denied", "{denied}");
    assert!(
        answer
            .to_string()
            .contains("commit messages say what changed"),
        "{answer}"
    );

    // A tool the server does not mark read-only waits for a human, then runs once.
    let (held, _) = airlock
        .propose(
            session,
            "git__git_add",
            json!({"repo_path": "/workspace", "files": ["a.txt"]}),
        )
        .await;
    assert_eq!(held["status"], "pending_approval", "{held}");
    let detail = airlock.approve_and_wait(&held).await;
    assert_eq!(detail["status"], "ok", "{detail}");
    let (held, _) = airlock
        .propose(
            session,
            "git__git_commit",
            json!({"repo_path": "/workspace", "message": "Add a.txt through MCP"}),
        )
        .await;
    assert_eq!(held["status"], "pending_approval", "{held}");
    assert!(!host_git_log(&airlock.workspace(session)).contains("through MCP"));
    let detail = airlock.approve_and_wait(&held).await;
    assert_eq!(detail["status"], "ok", "{detail}");
    let log = host_git_log(&airlock.workspace(session));
    assert!(log.contains("Add a.txt through MCP"), "{log}");

    // The audit names the MCP tools like any other.
    let (status, audit) = airlock.get("/v1/audit?limit=1000").await;
    assert_eq!(status, 200);
    let audit = audit.to_string();
    assert!(audit.contains("git__git_commit") && audit.contains("time__get_current_time"));
    assert!(
        audit.contains("not marked read-only by the MCP server git"),
        "the approval's reason is not in the audit: {audit}"
    );
    let (_, verify) = airlock.get("/v1/audit/verify").await;
    assert_eq!(verify["ok"], true, "{verify}");
}

#[tokio::test]
async fn a_misbehaving_mcp_server_fails_only_the_call_at_hand() {
    let airlock = Airlock::start_with(&config()).await;
    wait_for_tools(
        &airlock,
        &["flaky__echo", "flaky__hang", "time__get_current_time"],
    )
    .await;
    let session = "flaky";
    let (err, text, _) = airlock
        .call_in(session, "flaky__echo", json!({"say": "hi"}))
        .await;
    assert!(!err, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).ok(),
        Some(json!({"say": "hi"}))
    );

    // A crash: an error naming the exit and the server's last words, then a new
    // process for the next call.
    let (err, text, _) = airlock.call_in(session, "flaky__crash", json!({})).await;
    assert!(err, "{text}");
    assert!(text.contains("exited with status 3"), "{text}");
    assert!(text.contains("crashing on purpose"), "{text}");
    let (err, text, _) = airlock
        .call_in(session, "flaky__echo", json!({"again": true}))
        .await;
    assert!(!err, "{text}");

    // Garbage lines are ignored; a line longer than any message is dropped unread.
    for (tool, answer) in [
        ("flaky__garbage", "after garbage"),
        ("flaky__flood", "after flood"),
    ] {
        let (err, text, _) = airlock.call_in(session, tool, json!({})).await;
        assert!(!err, "{tool}: {text}");
        assert_eq!(text, answer);
    }

    // Progress reaches the caller's stream.
    let body = json!({"session_id": session, "tool_uses": [{"type": "tool_use", "id": "p1",
        "name": "flaky__progress", "input": {}}]});
    let response = airlock
        .request(reqwest::Method::POST, "/v1/tool_calls?stream=true")
        .json(&body)
        .send()
        .await
        .expect("send");
    let text = tokio::time::timeout(Duration::from_secs(60), response.text())
        .await
        .expect("the stream ended")
        .expect("read");
    let events = sse_events(&text);
    let progress: Vec<_> = events
        .iter()
        .filter(|(name, _)| name == "call.progress")
        .collect();
    assert_eq!(progress.len(), 3, "{text}");
    assert_eq!(progress[2].1["message"], "step 3", "{text}");
    // A progress line is cut to 1000 characters, however long the server's.
    let long = progress[1].1["message"].as_str().expect("message");
    assert!(long.starts_with("step 2yyy"), "{long:.40}");
    assert_eq!(long.chars().count(), 1000, "{long:.40}");
    assert!(text.contains("progressed"), "{text}");

    // A hang: the caller cancels, the server hears notifications/cancelled, and the
    // server still answers the next call.
    let (started, _) = airlock.propose(session, "flaky__hang", json!({})).await;
    let call_id = started["call_id"].as_str().expect("call id").to_owned();
    cancel_and_wait(&airlock, &call_id).await;
    let log = wait_for_file(&airlock.workspace(session).join("cancelled.log")).await;
    assert!(log.starts_with("cancelled "), "{log}");
    let (err, text, _) = airlock
        .call_in(session, "flaky__echo", json!({"after": "hang"}))
        .await;
    assert!(!err, "{text}");

    // A listing that pages for ever is given up after 100 pages (the last listing
    // stays), and the server still answers.
    let (err, text, _) = airlock.call_in(session, "flaky__endless", json!({})).await;
    assert!(!err, "{text}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !airlock.log().contains("tools/list goes on past 100 pages") {
        assert!(
            Instant::now() < deadline,
            "an endless tools/list was not given up:\n{}",
            airlock.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (err, text, _) = airlock
        .call_in(session, "flaky__echo", json!({"after": "endless"}))
        .await;
    assert!(!err, "{text}");

    // The orchestrator and the other tools never noticed.
    let (status, _) = airlock.get("/readyz").await;
    assert_eq!(status, 200);
    let (err, text, _) = airlock
        .call("time__get_current_time", json!({"timezone": "UTC"}))
        .await;
    assert!(!err, "{text}");
}

/// A per-session server's instances stop when evicted (`max_sessions`) or idle
/// (`idle_seconds`) although the server never says its tools changed (before, the
/// watcher of its tool list kept each one alive for a day), and a start abandoned by a
/// cancelled call leaves no process behind.
#[tokio::test]
async fn evicted_idle_and_abandoned_mcp_servers_stop() {
    // The flaky server, marked so that its processes can be told from the others, and
    // slow to start in a workspace that holds a file `sleep`.
    let script = format!(
        "# lean-server\nimport os, time\nif os.path.exists('/workspace/sleep'):\n    time.sleep(600)\n{FLAKY}"
    );
    let airlock = Airlock::start_with(&format!(
        r#"
[[mcp_servers]]
name = "lean"
command = ["/usr/bin/python3", "-c", '''{script}''']
max_sessions = 1
idle_seconds = 2
start_timeout_seconds = 300
"#
    ))
    .await;
    wait_for_tools(&airlock, &["lean__echo"]).await;
    let running = || processes(&airlock, "# lean-server").len();
    let wait_until = async |count: usize, within: u64, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(within);
        while running() != count {
            assert!(
                Instant::now() < deadline,
                "{what}: {} lean servers run, expected {count}",
                running()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    for session in ["a", "b"] {
        let (err, text, _) = airlock
            .call_in(session, "lean__echo", json!({"session": session}))
            .await;
        assert!(!err, "{text}");
    }
    wait_until(1, 10, "b's call evicts a's server").await;
    wait_until(0, 30, "b's server stops once idle").await;

    std::fs::create_dir_all(airlock.workspace("c")).expect("workspace");
    std::fs::write(airlock.workspace("c").join("sleep"), "").expect("marker");
    let (started, _) = airlock.propose("c", "lean__echo", json!({})).await;
    let call_id = started["call_id"].as_str().expect("call id").to_owned();
    wait_until(1, 30, "c's server starts").await;
    cancel_and_wait(&airlock, &call_id).await;
    wait_until(0, 15, "the abandoned start is stopped").await;
}

#[test]
fn bad_mcp_server_entries_stop_the_start() {
    let dir = tempfile::tempdir().expect("temp dir");
    for (entry, says) in [
        ("name = \"a__b\"\ncommand = [\"x\"]", "must be 1 to"),
        ("name = \"t\"", "give command"),
        (
            "name = \"t\"\nurl = \"http://127.0.0.1:9/mcp\"",
            "127.0.0.1 is a loopback address",
        ),
        (
            "name = \"t\"\ncommand = [\"/nonexistent/mcp-server\"]",
            "could not be started",
        ),
        (
            "name = \"t\"\ncommand = [\"/bin/sh\", \"-c\", \"echo not-mcp; sleep 60\"]\nstart_timeout_seconds = 2",
            "did not answer initialize",
        ),
    ] {
        let config = dir.path().join("airlock.toml");
        std::fs::write(
            &config,
            format!(
                "[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n\n[[mcp_servers]]\n{entry}\n"
            ),
        )
        .expect("config");
        let log = up_refused(&config, &dir.path().join("data"));
        assert!(log.contains(says), "{entry}: {log}");
        assert!(
            log.contains("[[mcp_servers]] t") || log.contains("MCP server") || log.contains("a__b"),
            "{entry}: {log}"
        );
    }
}

/// The audit events of `kind` whose data names `tool`.
async fn audit_events_of(airlock: &Airlock, kind: &str, tool: &str) -> Vec<Value> {
    let (status, body) = airlock.get("/v1/audit?limit=1000").await;
    assert_eq!(status, 200, "{body}");
    body["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["kind"] == kind && e["data"]["tool"] == tool)
        .cloned()
        .collect()
}

/// Tool poisoning (DESIGN §11): the definition of each discovered tool is pinned by its
/// digest when first seen. A server that later rewrites a tool's description gets that
/// tool hidden, with one audit event, until an admin accepts the new definition; an
/// agent cannot accept it, and the server's other tools stay served throughout.
#[tokio::test]
async fn a_changed_mcp_tool_definition_is_hidden_until_an_admin_accepts_it() {
    let config = format!(
        r#"
[[principals]]
name = "alice"
token_sha256 = "{alice}"
roles = ["agent"]
[[principals]]
name = "root"
token_sha256 = "{root}"
roles = ["admin"]

[[mcp_servers]]
name = "flaky"
command = ["/usr/bin/python3", "-c", '''{FLAKY}''']
per_session = false
"#,
        alice = token_digest("alice-token"),
        root = token_digest("root-token"),
    );
    let mut airlock = Airlock::start_with(&config).await;
    airlock.token = "root-token".to_owned();
    wait_for_tools(&airlock, &["flaky__echo", "flaky__crash"]).await;

    // Pinned at first sight, once, and nothing waits for review.
    let pinned = audit_events_of(&airlock, "tool_pinned", "flaky__echo").await;
    assert_eq!(pinned.len(), 1, "{pinned:?}");
    let (status, pins) = airlock.get("/v1/tools/pins").await;
    assert_eq!(status, 200, "{pins}");
    let pin = pins["pins"]
        .as_array()
        .expect("pins")
        .iter()
        .find(|p| p["tool"] == "flaky__echo")
        .cloned()
        .expect("flaky__echo is pinned");
    assert_eq!(
        pin["pinned"]["digest"], pinned[0]["data"]["digest"],
        "{pin}"
    );
    assert!(pin["pending"].is_null(), "{pin}");
    let first_digest = pin["pinned"]["digest"].clone();

    // Nothing to accept yet; built-in tools are never pinned; agents may neither look
    // nor accept.
    let (status, body) = airlock
        .post("/v1/tools/flaky__echo/accept", &json!({}))
        .await;
    assert_eq!(status, 409, "{body}");
    let (status, body) = airlock.post("/v1/tools/read_file/accept", &json!({})).await;
    assert_eq!(status, 404, "{body}");
    for (method, path) in [
        (reqwest::Method::GET, "/v1/tools/pins"),
        (reqwest::Method::POST, "/v1/tools/flaky__echo/accept"),
    ] {
        let (status, body, _) = send_as(&airlock, "alice-token", method, path, None).await;
        assert_eq!(status, 403, "{path}: {body}");
    }

    // The server poisons echo's description and says its tool list changed.
    let (err, text, _) = airlock.call("flaky__poison", json!({})).await;
    assert!(!err, "{text}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, tools) = airlock.get("/v1/tools").await;
        let listed = tools.to_string();
        if !listed.contains("\"flaky__echo\"") {
            assert!(listed.contains("\"flaky__crash\""), "{listed}");
            assert!(!listed.contains("Ignore previous instructions"), "{listed}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "flaky__echo is still served after its definition changed: {listed}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Hidden means not callable, by anyone.
    let (err, text, _) = airlock.call("flaky__echo", json!({"say": "hi"})).await;
    assert!(err, "{text}");
    assert!(text.contains("unknown tool"), "{text}");

    // One audit event for the change, however often the catalog is refreshed (every
    // 5 s for a live group).
    tokio::time::sleep(Duration::from_secs(11)).await;
    let changed = audit_events_of(&airlock, "tool_definition_changed", "flaky__echo").await;
    assert_eq!(changed.len(), 1, "{changed:?}");
    assert_eq!(changed[0]["data"]["pinned_digest"], first_digest);
    assert_eq!(changed[0]["data"]["changed"], json!(["description"]));
    let (_, pins) = airlock.get("/v1/tools/pins").await;
    let pin = pins["pins"]
        .as_array()
        .expect("pins")
        .iter()
        .find(|p| p["tool"] == "flaky__echo")
        .cloned()
        .expect("flaky__echo is pinned");
    assert_eq!(pin["pinned"]["digest"], first_digest, "{pin}");
    let pending = &pin["pending"];
    assert_eq!(
        pending["digest"], changed[0]["data"]["seen_digest"],
        "{pin}"
    );
    assert!(
        pending["definition"]["description"]
            .as_str()
            .is_some_and(|d| d.contains("Ignore previous instructions")),
        "{pin}"
    );

    // An acceptance bound to a digest that is not the pending one (what the admin
    // reviewed changed again since) is refused and changes nothing; a malformed one is
    // a bad request.
    let (status, body) = airlock
        .post(
            "/v1/tools/flaky__echo/accept",
            &json!({"digest": first_digest}),
        )
        .await;
    assert_eq!(status, 409, "{body}");
    assert!(body.to_string().contains("changed again"), "{body}");
    let (status, body) = airlock
        .post("/v1/tools/flaky__echo/accept", &json!({"digest": "zz"}))
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        audit_events_of(&airlock, "tool_accepted", "flaky__echo")
            .await
            .is_empty()
    );
    let pending_digest = pending["digest"].as_str().expect("digest").to_owned();

    // The CLI shows it hidden, and the admin accepts what was reviewed.
    let pins_cli = airlock
        .cli(&["tools", "pins", "--token", "root-token"])
        .output()
        .expect("airlock tools pins");
    let shown = String::from_utf8_lossy(&pins_cli.stdout);
    assert!(pins_cli.status.success(), "{shown}");
    assert!(
        shown
            .lines()
            .any(|l| l.starts_with("flaky__echo") && l.contains("HIDDEN")),
        "{shown}"
    );
    let accepted = airlock
        .cli(&[
            "tools",
            "accept",
            "flaky__echo",
            "--digest",
            &pending_digest,
            "--token",
            "root-token",
        ])
        .output()
        .expect("airlock tools accept");
    assert!(
        accepted.status.success(),
        "{}{}",
        String::from_utf8_lossy(&accepted.stdout),
        String::from_utf8_lossy(&accepted.stderr)
    );

    // Served again, as it is now (once the policy has taken the tool back in); the
    // acceptance is audited with who gave it.
    let listed = wait_for_tools(&airlock, &["flaky__echo"]).await;
    assert!(listed.contains("Ignore previous instructions"), "{listed}");
    let (err, text, _) = airlock.call("flaky__echo", json!({"say": "again"})).await;
    assert!(!err, "{text}");
    let accepted = audit_events_of(&airlock, "tool_accepted", "flaky__echo").await;
    assert_eq!(accepted.len(), 1, "{accepted:?}");
    assert_eq!(accepted[0]["principal"], "root");
    assert_eq!(accepted[0]["data"]["previous_digest"], first_digest);
    assert_eq!(accepted[0]["data"]["digest"], pending["digest"]);
    let (status, verify) = airlock.get("/v1/audit/verify").await;
    assert_eq!(status, 200, "{verify}");
    assert_eq!(verify["ok"], true, "{verify}");
}
