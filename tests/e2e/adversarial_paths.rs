//! Path rules attacked the way an agent (or a program it ran in the shell) would: through
//! recursive tools at the root, move_path, symlinks planted in the workspace, and the
//! canonical spelling of a workspace reached through a symlinked data dir. Each runs a
//! real `airlock up` with the default policy plus examples/fs-paths.cedar.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::{AIRLOCK, Airlock, descendants, signal};

const SECRET: &str = "SECRET-CANARY-7f3a";
const HIDDEN: &str = r#"[fs]
hidden = [".git", ".env", ".env.*", "**/.env", "**/.env.*", "secrets"]
"#;

/// The default policy with the fs-paths example appended, written under `dir`.
fn policy_file(dir: &Path) -> PathBuf {
    let policies = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/policies");
    let default = std::fs::read_to_string(policies.join("default.cedar")).expect("default");
    let paths =
        std::fs::read_to_string(policies.join("examples/fs-paths.cedar")).expect("fs-paths");
    let file = dir.join("policy.cedar");
    std::fs::write(&file, format!("{default}\n{paths}")).expect("policy");
    file
}

fn policy_section(file: &Path) -> String {
    format!("[policy]\nfile = {:?}\n", file.display().to_string())
}

/// A workspace as a repository checkout with secrets in it.
fn plant(ws: &Path) {
    for (rel, content) in [
        (".env", SECRET),
        (".env.local", SECRET),
        ("secrets/key", SECRET),
        (".git/config", SECRET),
        (".git/hooks/pre-commit", SECRET),
        ("app/.env", SECRET),
        ("src/main.rs", "fn main() {}\n"),
    ] {
        let path = ws.join(rel);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("dirs");
        std::fs::write(path, content).expect("plant");
    }
}

#[tokio::test]
async fn recursive_tools_and_moves_never_reach_hidden_secrets() {
    let keep = tempfile::tempdir().expect("temp");
    let policy = policy_file(keep.path());
    let airlock = Airlock::start_with(&format!("{}\n{HIDDEN}", policy_section(&policy))).await;
    let ws = airlock.workspace("default");
    plant(&ws);

    // Searches and listings at the root: nothing hidden is read or named.
    for input in [
        json!({"path": ".", "content_regex": "SECRET"}),
        json!({"path": "/workspace", "content_regex": "CANARY"}),
        json!({"path": "./src/..", "glob": "**/*"}),
        json!({"path": "app", "content_regex": "."}),
    ] {
        let (is_error, text, _) = airlock.call("search_files", input.clone()).await;
        assert!(!text.contains(SECRET), "search {input} leaked: {text}");
        assert!(
            !text.contains(".env") && !text.contains("secrets/") && !text.contains(".git"),
            "search {input} named a hidden path (is_error {is_error}): {text}"
        );
    }
    let (is_error, text, _) = airlock
        .call("list_directory", json!({"path": ".", "recursive": true}))
        .await;
    assert!(!is_error, "{text}");
    assert!(text.contains("src/main.rs"), "{text}");
    for hidden in [".git", ".env", "secrets", "app/.env"] {
        assert!(
            !text.lines().any(|l| l.starts_with(hidden)),
            "{hidden} listed: {text}"
        );
    }

    // Moves: neither end may be hidden, and a directory holding a hidden entry stays.
    for input in [
        json!({"source": ".env", "destination": "src/env.txt"}),
        json!({"source": "./src/../.env", "destination": "src/x"}),
        json!({"source": "secrets/key", "destination": "src/key"}),
        json!({"source": "app", "destination": "src/app"}),
        json!({"source": "src/main.rs", "destination": ".env.main"}),
    ] {
        let (is_error, text, _) = airlock.call("move_path", input.clone()).await;
        assert!(is_error, "move {input} succeeded: {text}");
    }
    assert_eq!(
        std::fs::read_to_string(ws.join(".env")).expect(".env"),
        SECRET
    );
    assert!(ws.join("secrets/key").exists() && ws.join("app/.env").exists());
    assert!(!ws.join("src/env.txt").exists() && !ws.join("src/app").exists());

    // Direct calls on hidden paths, however spelled.
    for (tool, input) in [
        ("read_file", json!({"path": "/workspace/.env"})),
        ("read_file", json!({"path": "src/../secrets/key"})),
        ("read_file", json!({"path": "app/.env"})),
        ("get_file_info", json!({"path": ".git/config"})),
        ("delete_path", json!({"path": "app", "recursive": true})),
    ] {
        let (is_error, text, _) = airlock.call(tool, input.clone()).await;
        assert!(is_error, "{tool} {input} succeeded: {text}");
        assert!(!text.contains(SECRET), "{tool} {input} leaked: {text}");
    }
    assert!(
        ws.join("app/.env").exists(),
        "recursive delete removed a hidden file"
    );
}

#[tokio::test]
async fn paths_through_planted_symlinks_are_refused() {
    // Policy only, no [fs] hidden: the rule on .git must hold by itself for a path
    // that names .git only after resolving a symlink.
    let keep = tempfile::tempdir().expect("temp");
    let policy = policy_file(keep.path());
    let airlock = Airlock::start_with(&policy_section(&policy)).await;
    let ws = airlock.workspace("default");
    plant(&ws);
    // What `ln -s` in execute_shell would leave behind.
    symlink("../.git/hooks", ws.join("src/h")).expect("symlink");
    symlink("../.git", ws.join("src/g")).expect("symlink");
    symlink(".env", ws.join("notes.txt")).expect("symlink");

    for (tool, input) in [
        ("read_file", json!({"path": "src/h/../config"})),
        ("read_file", json!({"path": "src/g/config"})),
        ("read_file", json!({"path": "notes.txt"})),
        ("list_directory", json!({"path": "src/g"})),
        (
            "search_files",
            json!({"path": "src/h/..", "content_regex": "SECRET"}),
        ),
        (
            "write_file",
            json!({"path": "src/h/../config", "content": "pwned"}),
        ),
        (
            "edit_file",
            json!({"path": "src/g/config", "edits": [{"old_text": "SECRET", "new_text": "x"}]}),
        ),
    ] {
        let (is_error, text, _) = airlock.call(tool, input.clone()).await;
        assert!(is_error, "{tool} {input} succeeded: {text}");
        assert!(!text.contains(SECRET), "{tool} {input} leaked: {text}");
        assert!(
            text.contains("symbolic link"),
            "{tool} {input}: the refusal should name the link: {text}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(ws.join(".git/config")).expect("config"),
        SECRET
    );
}

/// `airlock up` with its data dir reached through a symlink (support.rs picks the data
/// dir itself, so this test launches its own).
struct Linked {
    _dir: tempfile::TempDir,
    real: PathBuf,
    link: PathBuf,
    url: String,
    token: String,
    child: Option<Child>,
    client: reqwest::Client,
}

impl Linked {
    async fn start(extra: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp");
        let real = dir.path().join("real");
        std::fs::create_dir_all(&real).expect("real");
        let link = dir.path().join("link");
        symlink(&real, &link).expect("data dir link");
        let config = dir.path().join("airlock.toml");
        std::fs::write(
            &config,
            format!(
                "[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n\
                 [approvals]\ntools = []\n[budgets]\nrate_per_minute = 0\n{extra}"
            ),
        )
        .expect("config");
        let log = std::fs::File::create(dir.path().join("airlock.log")).expect("log");
        let child = Command::new(AIRLOCK)
            .args(["up", "--data-dir"])
            .arg(&link)
            .arg("--config")
            .arg(&config)
            .env_remove("AIRLOCK_URL")
            .env_remove("AIRLOCK_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn airlock up");
        let mut linked = Self {
            _dir: dir,
            real,
            link,
            url: String::new(),
            token: String::new(),
            child: Some(child),
            client: reqwest::Client::new(),
        };
        let log = linked._dir.path().join("airlock.log");
        let deadline = Instant::now() + Duration::from_secs(60);
        let endpoints: Value = loop {
            if let Ok(text) = std::fs::read_to_string(linked.link.join("endpoints.json"))
                && let Ok(v) = serde_json::from_str::<Value>(&text)
            {
                break v;
            }
            if let Some(status) = linked
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "airlock up exited ({status}):\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "airlock up did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        linked.url = endpoints["http"].as_str().expect("http").to_owned();
        let token_file = endpoints["token_file"].as_str().expect("token file");
        linked.token = std::fs::read_to_string(token_file)
            .expect("token")
            .trim()
            .to_owned();
        loop {
            if let Ok(r) = linked
                .client
                .get(format!("{}/readyz", linked.url))
                .send()
                .await
                && r.status() == 200
            {
                break;
            }
            assert!(Instant::now() < deadline, "airlock never became ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        linked
    }

    /// The workspace of principal `local`, session `session`, by its canonical path.
    fn workspace(&self, session: &str) -> PathBuf {
        std::fs::canonicalize(&self.real)
            .expect("canonical")
            .join("workspaces/local")
            .join(session)
    }

    async fn call(&self, tool: &str, input: Value) -> (bool, String) {
        let body = json!({
            "session_id": "default",
            "tool_uses": [{"type": "tool_use", "id": "t1", "name": tool, "input": input}],
        });
        let response = self
            .client
            .post(format!("{}/v1/tool_calls", self.url))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .expect("send");
        assert_eq!(response.status(), 200);
        let body: Value = response.json().await.expect("json");
        let result = &body["tool_results"][0];
        let text = result["content"]
            .as_array()
            .expect("content")
            .iter()
            .filter_map(|b| b["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n");
        (result["is_error"].as_bool().expect("is_error"), text)
    }
}

impl Drop for Linked {
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
    }
}

#[tokio::test]
async fn a_symlinked_data_dir_gives_no_second_spelling_of_the_workspace() {
    let keep = tempfile::tempdir().expect("temp");
    let policy = policy_file(keep.path());
    let airlock = Linked::start(&policy_section(&policy)).await;
    // The first call creates the session's workspace.
    let (is_error, text) = airlock
        .call("write_file", json!({"path": "src/a.rs", "content": "ok"}))
        .await;
    assert!(!is_error, "{text}");
    let canonical = airlock.workspace("default");
    std::fs::write(canonical.join(".env"), SECRET).expect("plant");
    std::fs::create_dir_all(canonical.join(".git")).expect("git");
    std::fs::write(canonical.join(".git/config"), SECRET).expect("plant");
    let configured = airlock.link.join("workspaces/local/default");

    // The canonical absolute path is judged like the relative one: by the path rules.
    for root in [&canonical, &configured] {
        for (tool, input) in [
            (
                "read_file",
                json!({"path": format!("{}/.env", root.display())}),
            ),
            (
                "read_file",
                json!({"path": format!("{}/src/../.git/config", root.display())}),
            ),
            (
                "write_file",
                json!({"path": format!("{}/README.md", root.display()), "content": "x"}),
            ),
        ] {
            let (is_error, text) = airlock.call(tool, input.clone()).await;
            assert!(is_error, "{tool} {input} succeeded: {text}");
            assert!(!text.contains(SECRET), "{tool} {input} leaked: {text}");
        }
    }
    let (is_error, text) = airlock
        .call(
            "read_file",
            json!({"path": format!("{}/.env", canonical.display())}),
        )
        .await;
    assert!(is_error && text.contains("fs-no-dotenv"), "{text}");
    // The canonical spelling of an allowed path still works.
    let (is_error, text) = airlock
        .call(
            "read_file",
            json!({"path": format!("{}/src/a.rs", canonical.display())}),
        )
        .await;
    assert!(!is_error && text.contains("ok"), "{text}");
    assert!(!canonical.join("README.md").exists());
}
