//! The workers under an outside attack pass, through a real `airlock up`: results that
//! would outgrow their caps fail before the worker allocates them (the db and fs
//! workers' resident memory stays small, and they answer the next call), each worker
//! runs under its kernel memory ceiling (`[limits] worker_memory_bytes`, RLIMIT_DATA),
//! and control characters in file names never reach a result or a terminal raw.

// Its own copy of the harness (replicas.rs keeps its copy private): the first call in
// this module starts a server of its own.
#[allow(clippy::duplicate_mod, reason = "the harness is a file, not a crate")]
#[path = "../support/postgres.rs"]
mod postgres;

use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::{AIRLOCK, Airlock, cmdline, descendants, signal};

/// What a whole attack battery may add to a worker's peak resident memory.
const MAX_GROWTH: u64 = 64 << 20;
/// How long `airlock up` or `airlock call` may take to exit when it is expected to.
const EXIT_BOUND: Duration = Duration::from_secs(60);

/// The pid of the one process below the launcher whose command line holds `marker`.
fn component(airlock: &Airlock, marker: &str) -> u32 {
    let found: Vec<u32> = descendants(airlock.pid())
        .into_iter()
        .filter(|p| cmdline(*p).contains(marker))
        .collect();
    assert_eq!(found.len(), 1, "one process with {marker:?}: {found:?}");
    found[0]
}

/// A field of /proc/<pid>/status in bytes (`VmHWM`: peak resident memory).
fn status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} for pid {pid}"));
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unreadable {line:?}"));
    kib * 1024
}

/// The soft and hard "Max data size" (RLIMIT_DATA) of a process, as /proc prints them.
fn data_limit(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max data size"))
        .expect("Max data size line");
    let fields: Vec<&str> = line["Max data size".len()..].split_whitespace().collect();
    (fields[0].to_owned(), fields[1].to_owned())
}

/// Runs a command to completion within [`EXIT_BOUND`].
fn run_bounded(command: &mut Command) -> Output {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn airlock");
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(EXIT_BOUND) {
        Ok(output) => output.expect("output"),
        Err(_) => {
            let below = descendants(pid);
            signal(pid, rustix::process::Signal::KILL);
            for p in below {
                signal(p, rustix::process::Signal::KILL);
            }
            panic!("airlock did not exit within {} s", EXIT_BOUND.as_secs());
        }
    }
}

#[tokio::test]
async fn worker_memory_ceiling_follows_the_config() {
    for (snippet, expected) in [
        ("", "1073741824"),
        ("[limits]\nworker_memory_bytes = 805306368\n", "805306368"),
        // Above the default: honoured as configured, not clamped to it.
        ("[limits]\nworker_memory_bytes = 4294967296\n", "4294967296"),
        ("[limits]\nworker_memory_bytes = 0\n", "unlimited"),
    ] {
        let airlock = Airlock::start_with(snippet).await;
        let before = data_limit(std::process::id());
        // A hard limit already in force below the configured value wins.
        let expected = match (expected.parse::<u64>(), before.1.parse::<u64>()) {
            (Ok(wanted), Ok(hard)) => wanted.min(hard).to_string(),
            _ => expected.to_owned(),
        };
        for group in ["fs", "http", "db"] {
            let pid = component(&airlock, &format!("worker {group}"));
            let (soft, hard) = data_limit(pid);
            if expected == "unlimited" {
                // No ceiling of its own: whatever `airlock up` ran with.
                assert_eq!((soft, hard), before, "{group} worker, {snippet:?}");
            } else {
                // Soft and hard alike, so the worker cannot raise it again.
                assert_eq!(
                    (soft.as_str(), hard.as_str()),
                    (expected.as_str(), expected.as_str()),
                    "{group} worker, {snippet:?}"
                );
            }
        }
        // The shell worker takes the soft limit only: its sandboxes inherit its rlimits
        // and raise the soft limit back to the hard one, since each sandbox's cgroup
        // bounds its memory.
        let shell = component(&airlock, "worker shell");
        let (soft, hard) = data_limit(shell);
        assert_eq!(hard, before.1, "shell worker's hard limit, {snippet:?}");
        if expected == "unlimited" {
            assert_eq!(soft, before.0, "shell worker, {snippet:?}");
        } else {
            assert_eq!(soft, expected, "shell worker's ceiling, {snippet:?}");
        }
        let (_, text, _) = airlock
            .call(
                "execute_shell",
                json!({"command": "grep 'Max data size' /proc/self/limits"}),
            )
            .await;
        let result: serde_json::Value = serde_json::from_str(&text).expect("shell result");
        let line = result["stdout"].as_str().expect("stdout").to_owned();
        let fields: Vec<&str> = line["Max data size".len()..].split_whitespace().collect();
        assert_eq!(
            (fields[0], fields[1]),
            (before.1.as_str(), before.1.as_str()),
            "a sandbox runs without the worker's ceiling, {snippet:?}: {line}"
        );
        // The workers still serve under their ceilings.
        let (err, text, _) = airlock
            .call(
                "query_database",
                json!({"database": "demo", "sql": "SELECT 1"}),
            )
            .await;
        assert!(!err, "{text}");
        let (err, text, _) = airlock.call("list_directory", json!({"path": "."})).await;
        assert!(!err, "{text}");
    }
}

#[tokio::test]
async fn worker_memory_below_the_floor_is_refused_at_start() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("airlock.toml");
    std::fs::write(
        &config,
        "[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n\
         [limits]\nworker_memory_bytes = 1000000\n",
    )
    .expect("config");
    let output = run_bounded(
        Command::new(AIRLOCK)
            .arg("up")
            .arg("--config")
            .arg(&config)
            .arg("--data-dir")
            .arg(dir.path().join("data")),
    );
    assert!(!output.status.success(), "airlock up must refuse to start");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("worker_memory_bytes = 1000000") && stderr.contains("raise it"),
        "says what to change: {stderr}"
    );
}

/// One db attack: the call fails naming `expect`, or with `expect` = "truncated"
/// returns a result flagged truncated by the byte cap.
async fn db_attack(airlock: &Airlock, database: &str, sql: &str, expect: &str) {
    let (err, text, _) = airlock
        .call("query_database", json!({"database": database, "sql": sql}))
        .await;
    if expect == "truncated" {
        assert!(!err, "{sql}: {text:.300}");
        let v: Value = serde_json::from_str(&text).expect("JSON result");
        assert_eq!(v["truncated"], true, "{sql}");
        assert!(
            v["note"].as_str().expect("note").contains("1048576 bytes"),
            "{sql}: {}",
            v["note"]
        );
    } else {
        assert!(err, "{sql} should fail: {text:.300}");
        assert!(text.contains(expect), "{sql}: {text}");
    }
}

/// A PostgreSQL database whose password comes from `password_env` (README, DESIGN §4)
/// works under `airlock up`: the launcher passes that variable, and only that one of
/// its own environment, to the db worker.
#[tokio::test]
async fn a_database_password_from_the_environment_reaches_the_db_worker_alone() {
    const PASSWORD: &str = "Db-Pw-Env-Canary-7e1";
    let server = postgres::server();
    let role = postgres::unique_name("airlock_pwenv");
    let db = postgres::unique_name("airlock_pwenv_db");
    server.create_role(&role, PASSWORD);
    server
        .sql("postgres", &format!("CREATE DATABASE {db} OWNER {role};"))
        .unwrap_or_else(|e| panic!("{e}"));
    let airlock = Airlock::start_with_env(
        &format!(
            "[[databases]]\nname = \"pg\"\nurl = \"{}\"\npassword_env = \"AIRLOCK_TEST_PG_PASSWORD\"\n",
            server.url_as(&role, &db)
        ),
        &[
            ("AIRLOCK_TEST_PG_PASSWORD", PASSWORD),
            ("AIRLOCK_TEST_UNRELATED_SECRET", "Unrelated-Canary-4b2"),
        ],
    )
    .await;
    let (err, text, _) = airlock
        .call(
            "query_database",
            json!({"database": "pg", "sql": "SELECT current_user AS who"}),
        )
        .await;
    assert!(!err, "{text}");
    assert!(text.contains(&role), "connected as {role}: {text}");
    let environ = |pid: u32| {
        String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/environ")).expect("environ"))
            .into_owned()
    };
    let db_worker = environ(component(&airlock, "worker db"));
    assert!(
        db_worker.contains("AIRLOCK_TEST_PG_PASSWORD="),
        "the db worker lacks its password variable"
    );
    assert!(
        !db_worker.contains("Unrelated-Canary"),
        "the db worker got the launcher's other variables"
    );
    for other in ["worker fs", "worker shell", "worker http"] {
        assert!(
            !environ(component(&airlock, other)).contains(PASSWORD),
            "{other} got the database password"
        );
    }
    assert!(
        !airlock.log().contains(PASSWORD),
        "the password reached the log"
    );
}

#[tokio::test]
async fn db_worker_memory_stays_small_under_oversized_results() {
    let lite = tempfile::tempdir().expect("temp dir");
    let lite_db = lite.path().join("empty.db");
    // An empty file is an empty SQLite database; the attacks need no tables.
    std::fs::write(&lite_db, b"").expect("db file");
    let server = postgres::server();
    let pg_db = postgres::unique_name("airlock_adv");
    server.create_database(&pg_db);
    let airlock = Airlock::start_with(&format!(
        "[[databases]]\nname = \"lite\"\nurl = \"sqlite://{}\"\n\
         [[databases]]\nname = \"pg\"\nurl = \"{}\"\n",
        lite_db.display(),
        server.url(&pg_db)
    ))
    .await;
    let worker = component(&airlock, "worker db");
    // Connect, open, warm up: what the worker needs anyway.
    for db in ["lite", "pg"] {
        let (err, text, _) = airlock
            .call("query_database", json!({"database": db, "sql": "SELECT 1"}))
            .await;
        assert!(!err, "{db}: {text}");
    }
    let base = status_bytes(worker, "VmHWM");
    for (db, sql, expect) in [
        // The attack pass's payloads: 1.2 GB and 200 MB before.
        (
            "lite",
            "SELECT randomblob(150000000), randomblob(150000000), randomblob(150000000)",
            "4194304 bytes",
        ),
        ("pg", "SELECT repeat('x', 200000000)", "4194304 bytes"),
        // Variations: one huge value, a zeroblob, a doubling recursive CTE, many
        // medium columns, many medium rows, a large bytea.
        ("lite", "SELECT randomblob(1000000000)", "4194304 bytes"),
        ("lite", "SELECT zeroblob(1000000000)", "4194304 bytes"),
        (
            "lite",
            "WITH RECURSIVE r(s, n) AS (SELECT 'x', 0 UNION ALL SELECT s || s, n + 1 FROM r \
             WHERE n < 40) SELECT length(s) FROM r",
            "4194304 bytes",
        ),
        (
            "lite",
            "SELECT randomblob(3000000), randomblob(3000000), randomblob(3000000), \
             randomblob(3000000), randomblob(3000000), randomblob(3000000)",
            "1048576 bytes",
        ),
        (
            "pg",
            "SELECT repeat('x', 100000000), repeat('y', 100000000), repeat('z', 100000000)",
            "4194304 bytes",
        ),
        (
            "pg",
            "SELECT repeat('x', 900000), repeat('y', 900000), repeat('z', 900000)",
            "1048576 bytes",
        ),
        (
            "pg",
            "SELECT decode(repeat('ab', 1000000), 'hex')",
            "1048576 bytes",
        ),
        (
            "lite",
            "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 1000) \
             SELECT n, randomblob(100000) FROM g",
            "truncated",
        ),
        (
            "pg",
            "SELECT n, repeat('x', 100000) FROM generate_series(1, 1000) n",
            "truncated",
        ),
    ] {
        db_attack(&airlock, db, sql, expect).await;
    }
    let growth = status_bytes(worker, "VmHWM").saturating_sub(base);
    eprintln!("db worker: peak resident memory +{} MiB", growth >> 20);
    assert!(
        growth < MAX_GROWTH,
        "the db worker's peak resident memory grew by {} MiB",
        growth >> 20
    );
    // Many values just under the value cap, all held at once by one row (400 MB): SQLite
    // stops at its heap ceiling for the worker (256 MiB) with an error naming it.
    let columns = vec!["randomblob(4000000)"; 100].join(", ");
    db_attack(
        &airlock,
        "lite",
        &format!("SELECT {columns}"),
        "268435456 bytes of memory",
    )
    .await;
    let growth = status_bytes(worker, "VmHWM").saturating_sub(base);
    eprintln!(
        "db worker, after the wide row: peak resident memory +{} MiB",
        growth >> 20
    );
    assert!(
        growth < (256 << 20) + MAX_GROWTH,
        "the db worker's peak resident memory grew by {} MiB",
        growth >> 20
    );
    // The same worker answers the next calls: it was never restarted.
    assert_eq!(component(&airlock, "worker db"), worker);
    for db in ["lite", "pg"] {
        let (err, text, _) = airlock
            .call(
                "query_database",
                json!({"database": db, "sql": "SELECT 40 + 2 AS answer"}),
            )
            .await;
        assert!(!err, "{db}: {text}");
        assert_eq!(
            serde_json::from_str::<Value>(&text).expect("JSON")["rows"],
            json!([[42]])
        );
    }
}

#[tokio::test]
async fn fs_worker_memory_stays_small_under_growing_edits() {
    let airlock = Airlock::start().await;
    let worker = component(&airlock, "worker fs");
    let original = "a".repeat(1024);
    let (err, text, _) = airlock
        .call("write_file", json!({"path": "f.txt", "content": original}))
        .await;
    assert!(!err, "{text}");
    let base = status_bytes(worker, "VmHWM");
    let doubling = |n: usize| -> Vec<Value> {
        (0..n)
            .map(|_| json!({"old_text": "a", "new_text": "aa", "replace_all": true}))
            .collect()
    };
    let long = "b".repeat(1 << 20);
    for (edits, expect) in [
        // The attack pass's payload: 17 doublings of 1 KiB (210 MB before).
        (json!(doubling(17)), "edit 14"),
        (json!(doubling(40)), "edit 14"),
        // One edit: a long new_text times many matches (1 GiB).
        (
            json!([{"old_text": "a", "new_text": long, "replace_all": true}]),
            "1073741824 bytes",
        ),
    ] {
        for dry_run in [true, false] {
            let (err, text, _) = airlock
                .call(
                    "edit_file",
                    json!({"path": "f.txt", "dry_run": dry_run, "edits": edits}),
                )
                .await;
            assert!(err, "should fail: {text:.300}");
            assert!(
                text.contains(expect) && text.contains("10485760 bytes"),
                "{text}"
            );
        }
    }
    let growth = status_bytes(worker, "VmHWM").saturating_sub(base);
    eprintln!("fs worker: peak resident memory +{} MiB", growth >> 20);
    assert!(
        growth < MAX_GROWTH,
        "the fs worker's peak resident memory grew by {} MiB",
        growth >> 20
    );
    assert_eq!(component(&airlock, "worker fs"), worker);
    let (err, text, _) = airlock.call("read_file", json!({"path": "f.txt"})).await;
    assert!(!err, "{text}");
    assert_eq!(text, original, "nothing was written");
}

/// Names created on disk, each with how the fs tools print it.
const HOSTILE_NAMES: &[(&str, &str)] = &[
    ("x\nforged.txt", "x\\nforged.txt"),
    ("cr\rover.txt", "cr\\rover.txt"),
    ("esc\u{1b}[2Jclear", "esc\\u{1b}[2Jclear"),
    ("bidi\u{202e}txt.exe", "bidi\\u{202e}txt.exe"),
    ("back\\slash", "back\\\\slash"),
];

/// Whether `c` must never reach a result or a terminal raw.
fn hostile(c: char) -> bool {
    (c.is_control() && c != '\n') || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[tokio::test]
async fn control_characters_in_names_are_escaped_through_airlock() {
    let airlock = Airlock::start().await;
    // The first call creates the session's workspace; the names are made on the host.
    let (err, text, _) = airlock.call("list_directory", json!({"path": "."})).await;
    assert!(!err, "{text}");
    let ws = airlock.workspace("default");
    for (name, _) in HOSTILE_NAMES {
        std::fs::write(ws.join(name), "x\n").expect("hostile name");
    }

    let (err, text, _) = airlock.call("list_directory", json!({"path": "."})).await;
    assert!(!err, "{text}");
    assert!(
        !text.chars().any(hostile),
        "raw control character in {text:?}"
    );
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines.len(),
        HOSTILE_NAMES.len(),
        "one line per entry: {text}"
    );
    for (_, shown) in HOSTILE_NAMES {
        assert_eq!(
            lines.iter().filter(|l| **l == *shown).count(),
            1,
            "{shown} once in:\n{text}"
        );
    }
    assert!(!lines.contains(&"forged.txt"), "forged entry in:\n{text}");

    let (err, text, _) = airlock.call("search_files", json!({"path": "."})).await;
    assert!(!err, "{text}");
    assert!(
        !text.chars().any(hostile),
        "raw control character in {text:?}"
    );
    for (_, shown) in HOSTILE_NAMES {
        assert!(text.lines().any(|l| l == *shown), "{shown} in:\n{text}");
    }
    let (err, text, _) = airlock
        .call("get_file_info", json!({"path": "esc\u{1b}[2Jclear"}))
        .await;
    assert!(!err, "{text}");
    assert!(text.starts_with("path: esc\\u{1b}[2Jclear\n"), "{text}");

    // What `airlock call` prints to the operator's terminal holds no escape sequence.
    let output = run_bounded(
        Command::new(AIRLOCK)
            .env_remove("AIRLOCK_URL")
            .env_remove("AIRLOCK_TOKEN")
            .args(["call", "list_directory", r#"{"path": "."}"#, "--data-dir"])
            .arg(airlock.data_dir()),
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("2Jclear"), "{stdout}");
    assert!(
        !stdout.chars().any(|c| hostile(c) && c != '\t'),
        "raw control character on the terminal: {stdout:?}"
    );
}
