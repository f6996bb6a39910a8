//! Declared command tools (`[[tools]]` with `command`, and the `dev` pack): served by
//! the shell worker in the same sandbox as `execute_shell`, behind the same gate —
//! schema, Cedar policy naming the tool and its arguments, approval, audit.

use std::process::Command;

use serde_json::{Value, json};

use crate::support::{AIRLOCK, Airlock, up_refused};

/// A tool of the operator's own, and one whose template forgets the `--`.
const OWN_TOOLS: &str = r#"
[[tools]]
name = "word_count"
description = "Counts the words of one file of the workspace. Returns wc's output."
command = ["wc", "-w", "--", "{path}"]
annotations = { read_only = true, idempotent = true }
[tools.input_schema]
type = "object"
required = ["path"]
properties = { path = { type = "string", maxLength = 4096 } }

[[tools]]
name = "show_commit"
description = "Shows one commit of the workspace's repository."
command = ["git", "--no-pager", "log", "-1", "{rev}"]
annotations = { read_only = true }
[tools.input_schema]
type = "object"
required = ["rev"]
properties = { rev = { type = "string", maxLength = 200 } }
"#;

/// The default policy, plus a rule on a declared tool's argument.
const POLICY: &str = r#"
@id("agents-may-call-tools") permit (principal in Airlock::Role::"agent", action, resource);
@id("admins-may-call-tools") permit (principal in Airlock::Role::"admin", action, resource);
@id("no-wip-commits") @reason("commit messages say what changed")
forbid (principal, action == Airlock::Action::"git_commit", resource)
when { context.arguments.message like "WIP*" };
"#;

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

#[tokio::test]
async fn declared_and_dev_pack_tools_run_sandboxed_behind_the_gate() {
    let policy_dir = tempfile::tempdir().expect("temp dir");
    let policy = policy_dir.path().join("policy.cedar");
    std::fs::write(&policy, POLICY).expect("policy");
    let airlock = Airlock::start_with_top_level(
        "tool_packs = [\"dev\"]\n",
        &format!("{OWN_TOOLS}\n[policy]\nfile = \"{}\"\n", policy.display()),
    )
    .await;
    let session = "dev";

    // The catalog shows them with their schemas, as any other tool.
    let (status, tools) = airlock.get("/v1/tools").await;
    assert_eq!(status, 200, "{tools}");
    let listed = tools.to_string();
    for name in [
        "git_status",
        "git_diff",
        "git_log",
        "git_commit",
        "execute_python",
        "word_count",
        "show_commit",
    ] {
        assert!(listed.contains(&format!("\"{name}\"")), "{name}: {listed}");
    }

    // A repository in the workspace (approvals are off for execute_shell here).
    let (err, text, _) = airlock
        .call_in(
            session,
            "execute_shell",
            json!({"command": "git init -q . && printf 'hello declared world\\n' > a.txt"}),
        )
        .await;
    assert!(!err, "{text}");

    // Read-only declared tools run at once, in the sandbox, with the isolation report.
    let (err, text, call) = airlock.call_in(session, "git_status", json!({})).await;
    assert!(!err, "{text}");
    let status = parse(&text);
    assert_eq!(status["exit_code"], 0, "{status}");
    assert!(
        status["stdout"]
            .as_str()
            .unwrap_or_default()
            .contains("?? a.txt"),
        "{status}"
    );
    assert_eq!(call["isolation"]["level"], "strict", "{call}");
    assert_eq!(call["isolation"]["network"], "none", "{call}");
    let (err, text, _) = airlock
        .call_in(session, "word_count", json!({"path": "a.txt"}))
        .await;
    assert!(!err, "{text}");
    assert_eq!(parse(&text)["stdout"], "3 a.txt\n", "{text}");

    // execute_python takes its program on standard input (`python3 -I -`). It is
    // destructive, and a declared destructive tool needs approval whatever `[approvals]
    // tools` says (it is empty here), unless its entry says `approval = false`.
    let (held, _) = airlock
        .propose(
            session,
            "execute_python",
            json!({"code": "import os\nprint(6 * 7, os.getcwd())"}),
        )
        .await;
    assert_eq!(held["status"], "pending_approval", "{held}");
    let output = airlock.approve_and_wait(&held).await;
    assert_eq!(output["status"], "ok", "{output}");
    assert!(output.to_string().contains("42 /workspace"), "{output}");
    // pip_install needs the egress proxy; without network it says so and runs nothing.
    let (held, _) = airlock
        .propose(
            session,
            "pip_install",
            json!({"packages": ["requests==2.32.3"]}),
        )
        .await;
    let output = airlock.approve_and_wait(&held).await;
    assert_eq!(output["status"], "error", "{output}");
    assert!(output.to_string().contains("needs the network"), "{output}");
    assert!(!airlock.workspace(session).join(".airlock/python").exists());

    // Option injection. After the template's `--`, a value is a file name, never an
    // option: wc reads no file list.
    let (err, text, _) = airlock
        .call_in(
            session,
            "word_count",
            json!({"path": "--files0-from=/etc/passwd"}),
        )
        .await;
    assert!(err, "{text}");
    assert!(!text.contains("root:"), "{text}");
    // Without a `--`, a value that starts with '-' is refused before anything runs: git
    // would have written its output to a file of the attacker's choosing.
    let workspace = airlock.workspace(session);
    for rev in [
        "--output=pwned.txt",
        "-opwned2.txt",
        "--exec-path=/tmp",
        "-",
    ] {
        let (err, text, _) = airlock
            .call_in(session, "show_commit", json!({"rev": rev}))
            .await;
        assert!(err, "{rev}: {text}");
        assert!(
            text.contains("starts with '-'") && text.contains("\"rev\""),
            "{rev}: {text}"
        );
    }
    assert!(!workspace.join("pwned.txt").exists(), "git ran the option");
    assert!(!workspace.join("pwned2.txt").exists(), "git ran the option");
    // Arguments are validated against the declared schema first.
    let (err, text, _) = airlock
        .call_in(session, "word_count", json!({"path": 7}))
        .await;
    assert!(err, "{text}");

    // The policy names the declared tool and its argument.
    let (denied, answer) = airlock
        .propose(session, "git_commit", json!({"message": "WIP: later"}))
        .await;
    assert_eq!(denied["status"], "denied", "{denied}");
    assert!(
        answer
            .to_string()
            .contains("commit messages say what changed"),
        "{answer}"
    );

    // git_commit is destructive: held for a human by default, then run exactly once.
    let (held, _) = airlock
        .propose(
            session,
            "git_commit",
            json!({"message": "Add a.txt", "paths": ["a.txt"]}),
        )
        .await;
    assert_eq!(held["status"], "pending_approval", "{held}");
    let (err, text, _) = airlock.call_in(session, "git_log", json!({})).await;
    assert!(
        !text.contains("Add a.txt"),
        "committed before approval: {err} {text}"
    );
    let detail = airlock.approve_and_wait(&held).await;
    assert_eq!(detail["status"], "ok", "{detail}");
    let (err, text, _) = airlock
        .call_in(session, "git_log", json!({"max_count": 5}))
        .await;
    assert!(!err, "{text}");
    let log = parse(&text)["stdout"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert_eq!(
        log.lines().filter(|l| l.contains("Add a.txt")).count(),
        1,
        "{log}"
    );
    assert!(log.contains("Airlock agent"), "{log}");

    // The audit names the declared tool like any other.
    let (status, audit) = airlock.get("/v1/audit?limit=200").await;
    assert_eq!(status, 200, "{audit}");
    let events = audit.to_string();
    assert!(events.contains("git_commit"), "{events}");
    let verify = airlock.cli(&["audit", "verify"]).output().expect("verify");
    assert!(verify.status.success(), "{verify:?}");
}

#[tokio::test]
async fn the_policy_schema_command_prints_every_declared_tool() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("airlock.toml");
    std::fs::write(&config, format!("tool_packs = [\"dev\"]\n{OWN_TOOLS}")).expect("config");
    let out = Command::new(AIRLOCK)
        .args(["policy", "schema", "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .output()
        .expect("airlock policy schema");
    assert!(out.status.success(), "{out:?}");
    let schema = String::from_utf8_lossy(&out.stdout);
    assert!(schema.contains("action \"read_file\""), "{schema}");
    assert!(
        schema.contains("action \"git_commit\" in [\"shell\", \"destructive\"]"),
        "{schema}"
    );
    assert!(
        schema.contains("arguments: { \"message\": String, \"paths\"?: Set<String> }"),
        "{schema}"
    );
    assert!(
        schema.contains("action \"word_count\" in [\"shell\", \"read_only\", \"idempotent\"]"),
        "{schema}"
    );
}

/// Runs `airlock up` with `config_text` (then its `[orchestrator]`) and expects it to
/// refuse to start, naming the file; returns its output.
fn refused(config_text: &str) -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("airlock.toml");
    std::fs::write(
        &config,
        format!("{config_text}\n[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n"),
    )
    .expect("config");
    let text = up_refused(&config, &dir.path().join("data"));
    assert!(
        text.contains(&config.display().to_string()),
        "the error names no file: {text}"
    );
    assert!(
        !dir.path().join("data/run/orchestrator.json").exists(),
        "the orchestrator started"
    );
    text
}

#[test]
fn a_bad_tools_entry_stops_start_up_naming_the_file_the_tool_and_the_reason() {
    let tool = |command: &str, schema: &str| {
        format!(
            "[[tools]]\nname = \"broken\"\ndescription = \"d\"\ncommand = {command}\n[tools.input_schema]\n{schema}\n"
        )
    };
    let object = "type = \"object\"\nproperties = { path = { type = \"string\" } }";
    for (config, reason) in [
        (
            tool("[\"cat\", \"{pth}\"]", object),
            "names the field \"pth\", which input_schema.properties lacks (it has: path)",
        ),
        (
            tool("[\"cat\", \"{path}\"]", "type = \"object\"\nproperties = 3"),
            "input_schema is not valid JSON Schema",
        ),
        (
            tool("[\"{path}\"]", object),
            "command[0] is the program and must be literal",
        ),
        (
            tool("[\"cat\", \"a{path}b\"]", object),
            "puts a placeholder inside other text",
        ),
        (
            tool("[\"cat\", \"{path}\"]", object).replace("\"broken\"", "\"read_file\""),
            "is a built-in tool",
        ),
        (
            format!("{}{}", tool("[\"cat\"]", object), tool("[\"cat\"]", object)),
            "defined twice",
        ),
        (
            "tool_packs = [\"devv\"]\n".to_owned(),
            "unknown pack \"devv\"",
        ),
    ] {
        let log = refused(&config);
        assert!(log.contains(reason), "expected {reason:?} in: {log}");
        if !config.starts_with("tool_packs") {
            assert!(log.contains("[[tools]] "), "no entry named: {log}");
        }
    }
}
