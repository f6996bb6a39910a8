//! Airlock as an ordinary user (DESIGN §1: no root needed): `airlock up` starts, every
//! component confines itself with what an unprivileged process may do and says exactly
//! that, strict isolation works where root delegated a cgroup subtree, `standard` works
//! where nothing was delegated, strict is refused with the fix spelled out otherwise, and
//! every layer an isolation report claims is checked from inside the sandbox.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;

use serde_json::{Value, json};

use crate::ordinary_user::{Delegation, OrdinaryUser};
use crate::support::{Airlock, descendants, signal};

/// What a sandboxed process sees of its own confinement: `/proc/self/status` lines,
/// namespace links, the root directory, and how many children it could fork.
const OBSERVE: &str = r#"grep -E '^(NoNewPrivs|Seccomp|CapInh|CapPrm|CapEff|CapBnd|CapAmb):' /proc/self/status
for n in user pid mnt net ipc uts cgroup; do echo "ns_$n: $(readlink /proc/self/ns/$n)"; done
echo "root_dev: $(stat -c %d /)"
python3 -c '
import os, time
n = 0
for _ in range(64):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(1)
        os._exit(0)
    n += 1
print("forked:", n)
'
"#;

/// The `execute_shell` result object of one call (approvals are off in these labs).
async fn shell(airlock: &Airlock, command: &str) -> Value {
    let (is_error, text, call) = airlock
        .call("execute_shell", json!({"command": command}))
        .await;
    let result: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("execute_shell did not run ({e}): {text}"));
    assert!(!is_error, "execute_shell failed: {text}");
    assert_eq!(call["isolation"], result["isolation"], "{call}");
    result
}

fn status_fields(stdout: &str) -> BTreeMap<String, String> {
    stdout
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

/// Checks each layer the report claims — and each it disclaims — against what the
/// sandboxed process observed: the report must never claim a layer not in force.
fn assert_report_holds(report: &Value, stdout: &str) {
    let seen = status_fields(stdout);
    let field = |k: &str| {
        seen.get(k)
            .unwrap_or_else(|| panic!("sandbox did not report {k}:\n{stdout}"))
            .as_str()
    };
    assert_eq!(report["no_new_privs"], true, "{report}");
    assert_eq!(field("NoNewPrivs"), "1", "no_new_privs claimed:\n{stdout}");
    assert_eq!(report["seccomp"], "filter", "{report}");
    assert_eq!(field("Seccomp"), "2", "a seccomp filter claimed:\n{stdout}");
    assert_eq!(report["capabilities_dropped"], true, "{report}");
    for set in ["CapInh", "CapPrm", "CapEff", "CapAmb"] {
        assert_eq!(
            field(set),
            "0000000000000000",
            "{set} must be empty:\n{stdout}"
        );
    }
    let bounding_empty = field("CapBnd") == "0000000000000000";
    assert_eq!(
        report["bounding_set_dropped"].as_bool(),
        Some(bounding_empty),
        "bounding_set_dropped must say what is in force (CapBnd {}): {report}",
        field("CapBnd")
    );

    // Namespaces: a claimed one differs from the host's, an unclaimed one is the host's.
    let claimed: Vec<&str> = report["namespaces"]
        .as_array()
        .expect("namespaces")
        .iter()
        .map(|n| n.as_str().expect("name"))
        .collect();
    for (link, name) in [
        ("user", "user"),
        ("pid", "pid"),
        ("mnt", "mount"),
        ("net", "net"),
        ("ipc", "ipc"),
        ("uts", "uts"),
        ("cgroup", "cgroup"),
    ] {
        let host = std::fs::read_link(format!("/proc/self/ns/{link}"))
            .expect("host namespace")
            .to_string_lossy()
            .into_owned();
        let inside = field(&format!("ns_{link}"));
        assert_eq!(
            inside != host,
            claimed.contains(&name),
            "namespace {name}: report claims {claimed:?}, sandbox sees {inside}, host {host}"
        );
    }

    // pivot_root: `/` is another file system than the host's exactly when claimed.
    let host_root = std::os::unix::fs::MetadataExt::dev(&std::fs::metadata("/").expect("/"));
    let root = field("root_dev");
    assert_eq!(
        root != host_root.to_string(),
        report["pivot_root"] == true,
        "pivot_root {}, yet / is device {root} (host: {host_root})",
        report["pivot_root"]
    );

    // The pids limit: enforced when claimed, absent when not.
    let forked: u64 = field("forked").parse().expect("fork count");
    match report["limits"]["pids"].as_u64() {
        Some(limit) => assert!(
            forked < limit,
            "pids limit {limit} claimed but {forked} children were forked"
        ),
        None => assert_eq!(
            forked, 64,
            "no pids limit claimed, yet forks stopped at {forked}"
        ),
    }
    assert_eq!(
        report["cgroup"].is_null(),
        report["limits"]["pids"].is_null(),
        "a cgroup version is reported exactly when its limits are: {report}"
    );
}

/// Every long-running component runs as the user, with no_new_privs, a seccomp filter
/// and no effective capabilities; its log line says whether the bounding set went.
fn assert_components_confined(airlock: &Airlock, user: &OrdinaryUser) {
    let launcher = airlock.pid();
    let components: Vec<u32> = descendants(launcher)
        .into_iter()
        .filter(|p| crate::support::cmdline(*p).contains(" serve "))
        .collect();
    assert_eq!(
        components.len(),
        5,
        "orchestrator and four workers: {components:?}"
    );
    for pid in components {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        let fields = status_fields(&status);
        let cmd = crate::support::cmdline(pid);
        assert_eq!(
            fields["Uid"].split_whitespace().next(),
            Some(&*user.uid.to_string()),
            "{cmd}"
        );
        assert_eq!(fields["NoNewPrivs"], "1", "{cmd}");
        assert_eq!(fields["Seccomp"], "2", "{cmd}");
        assert_eq!(fields["CapEff"], "0000000000000000", "{cmd}");
        assert_eq!(fields["CapPrm"], "0000000000000000", "{cmd}");
        // setpriv leaves the full bounding set of a login shell, which an ordinary
        // user may not drop: the log must not claim it went.
        assert_ne!(fields["CapBnd"], "0000000000000000", "{cmd}");
    }
    let log = airlock.log();
    let confined: Vec<&str> = log.lines().filter(|l| l.contains("confined:")).collect();
    assert_eq!(
        confined.len(),
        5,
        "one confinement line per component:\n{log}"
    );
    for line in confined {
        assert!(
            line.contains("bounding set kept: no CAP_SETPCAP")
                && !line.contains("bounding set included"),
            "the log must say the bounding set stays: {line}"
        );
    }
}

#[tokio::test]
async fn strict_is_refused_without_a_delegated_cgroup_and_the_refusal_names_the_fix() {
    let user = OrdinaryUser::get();
    // A parent cgroup that root created (as any root run of the shell worker from this
    // cgroup does) must not pass for one the user may use: the probe creates, joins and
    // removes a real call cgroup instead of trusting a directory that exists.
    let root_run = std::process::Command::new(crate::support::AIRLOCK)
        .args(["sandbox", "run", "--", "true"])
        .output()
        .expect("airlock sandbox run as root");
    assert!(root_run.status.success(), "{root_run:?}");
    let (status, log) = Airlock::refused_as(user, "");
    assert!(!status.success(), "airlock up must refuse: {status}\n{log}");
    for fix in [
        "cgroups are not usable",
        "[sandbox] cgroup_parent",
        "systemd-run --user --scope -p Delegate=yes",
        "min_isolation = \"standard\"",
    ] {
        assert!(log.contains(fix), "the refusal must name `{fix}`:\n{log}");
    }
    // What used to stop every component of an ordinary user: gone.
    assert!(!log.contains("cannot drop capabilities"), "{log}");
    // Said once, not once per level of the error chain.
    assert_eq!(
        log.matches("no usable cgroup hierarchy").count(),
        1,
        "the cause is printed once:\n{log}"
    );
}

#[tokio::test]
async fn standard_isolation_works_for_an_ordinary_user_and_reports_only_what_holds() {
    let user = OrdinaryUser::get();
    let airlock = Airlock::start_as(user, None, "[sandbox]\nmin_isolation = \"standard\"\n").await;
    assert_components_confined(&airlock, user);

    let result = shell(&airlock, OBSERVE).await;
    let report = &result["isolation"];
    assert_eq!(report["level"], "standard", "{report}");
    assert_eq!(report["bounding_set_dropped"], false, "{report}");
    assert_report_holds(report, result["stdout"].as_str().expect("stdout"));

    // Landlock is in force: a directory the user owns outside the workspace stays
    // unwritable from the sandbox (without Landlock, plain permissions would allow it).
    let outside = tempfile::tempdir().expect("dir");
    user.own(outside.path());
    let target = outside.path().join("written-from-the-sandbox");
    let attempt = shell(
        &airlock,
        &format!("(echo pwned > {}) 2>&1; echo rc=$?", target.display()),
    )
    .await;
    let out = attempt["stdout"].as_str().expect("stdout");
    assert!(
        out.contains("Permission denied") && out.contains("rc=2"),
        "{out}"
    );
    assert!(!target.exists(), "the sandbox wrote outside its workspace");
}

#[tokio::test]
async fn strict_isolation_works_for_an_ordinary_user_in_a_delegated_cgroup() {
    let user = OrdinaryUser::get();
    let delegation = Delegation::new(user, "strict");
    let airlock = Airlock::start_as(
        user,
        Some(&delegation),
        &format!(
            "[sandbox]\ncgroup_parent = \"{}\"\npids = 32\n",
            delegation.cgroup_parent
        ),
    )
    .await;
    assert_components_confined(&airlock, user);

    let result = shell(&airlock, OBSERVE).await;
    let report = &result["isolation"];
    assert_eq!(report["level"], "strict", "{report}");
    assert_eq!(report["bounding_set_dropped"], true, "{report}");
    assert_eq!(report["limits"]["pids"], 32, "{report}");
    assert!(!report["cgroup"].is_null(), "{report}");
    assert_report_holds(report, result["stdout"].as_str().expect("stdout"));

    // The sandbox's root is the user: host root's files stay out of reach.
    let id = shell(&airlock, "id -u; cat /etc/shadow 2>&1; echo rc=$?").await;
    let out = id["stdout"].as_str().expect("stdout");
    assert!(
        out.starts_with("0\n"),
        "root of its own user namespace: {out}"
    );
    assert!(out.contains("rc=1") && !out.contains("root:"), "{out}");
}

/// Runs the `airlock` CLI as the user against `airlock`'s data dir.
fn cli(user: &OrdinaryUser, airlock: &Airlock, args: &[&str]) -> Output {
    user.command(&user.airlock)
        .args(args)
        .arg("--data-dir")
        .arg(airlock.data_dir())
        .env_remove("AIRLOCK_URL")
        .env_remove("AIRLOCK_TOKEN")
        .output()
        .expect("run the airlock CLI")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The README's short session, as the user would type it, approvals on.
#[tokio::test]
async fn the_readme_short_session_passes_for_an_ordinary_user() {
    let user = OrdinaryUser::get();
    let delegation = Delegation::new(user, "readme");
    let airlock = Airlock::start_as(
        user,
        Some(&delegation),
        &format!(
            "[sandbox]\ncgroup_parent = \"{}\"\n[approvals]\ntimeout_seconds = 600\n",
            delegation.cgroup_parent
        ),
    )
    .await;

    let tools = cli(user, &airlock, &["tools"]);
    assert!(tools.status.success(), "{tools:?}");
    for name in ["read_file", "write_file", "execute_shell", "query_database"] {
        assert!(stdout(&tools).contains(name), "{}", stdout(&tools));
    }

    // The curl example: a held write and a read that runs at once.
    let (status, body) = airlock
        .post(
            "/v1/tool_calls",
            &json!({
                "session_id": "demo",
                "wait_ms": 2000,
                "tool_uses": [
                    {"type": "tool_use", "id": "t1", "name": "write_file",
                     "input": {"path": "notes/todo.md", "content": "- ship it\n"}},
                    {"type": "tool_use", "id": "t2", "name": "list_directory",
                     "input": {"path": ".", "recursive": true}}
                ]
            }),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["calls"][0]["status"], "pending_approval", "{body}");
    assert_eq!(body["calls"][1]["status"], "ok", "{body}");
    let approval = body["calls"][0]["approval_id"]
        .as_str()
        .expect("approval id");
    let call_id = body["calls"][0]["call_id"].as_str().expect("call id");

    let listed = cli(user, &airlock, &["approvals", "list"]);
    assert!(stdout(&listed).contains(approval), "{listed:?}");
    let approved = cli(user, &airlock, &["approvals", "approve", approval]);
    assert!(approved.status.success(), "{approved:?}");
    let (status, call) = airlock
        .get(&format!("/v1/calls/{call_id}?wait_ms=20000"))
        .await;
    assert_eq!(status, 200, "{call}");
    assert_eq!(call["status"], "ok", "{call}");
    let written = airlock
        .data_dir()
        .join("workspaces/local/demo/notes/todo.md");
    assert_eq!(
        std::fs::read_to_string(&written).expect("written"),
        "- ship it\n"
    );
    let meta = std::fs::metadata(&written).expect("metadata");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&meta),
        user.uid,
        "the file belongs to the user who runs Airlock"
    );

    let read = cli(
        user,
        &airlock,
        &[
            "call",
            "--session",
            "demo",
            "read_file",
            r#"{"path": "notes/todo.md"}"#,
        ],
    );
    assert!(read.status.success(), "{read:?}");
    assert!(stdout(&read).contains("- ship it"), "{read:?}");
    let escape = cli(
        user,
        &airlock,
        &["call", "read_file", r#"{"path": "../../etc/passwd"}"#],
    );
    assert_eq!(escape.status.code(), Some(1), "{escape:?}");
    assert!(
        stdout(&escape).contains("outside the workspace"),
        "{escape:?}"
    );
    let query = cli(
        user,
        &airlock,
        &[
            "call",
            "query_database",
            r#"{"database": "demo", "sql": "SELECT count(*) AS n FROM order_totals"}"#,
        ],
    );
    assert!(query.status.success(), "{query:?}");

    let verify = cli(user, &airlock, &["audit", "verify"]);
    assert!(verify.status.success(), "{verify:?}");
    assert!(Path::new(&airlock.data_dir().join("airlock.db")).exists());
}

/// `airlock sandbox run`, the host check, as the user: strict refused up front with the
/// fix (not "strict" first and a cgroup error after), standard runs and says so.
#[tokio::test]
async fn sandbox_run_as_an_ordinary_user_is_honest_about_its_level() {
    let user = OrdinaryUser::get();
    let strict = user
        .command(&user.airlock)
        .args(["sandbox", "run", "--", "true"])
        .output()
        .expect("airlock sandbox run");
    let err = String::from_utf8_lossy(&strict.stderr);
    assert!(!strict.status.success(), "{err}");
    assert!(
        err.contains("cgroups are not usable") && err.contains("cgroup_parent"),
        "{err}"
    );
    assert!(
        !err.contains("\"level\": \"strict\""),
        "no strict report before failing: {err}"
    );

    // `sh -c <script>` in a standard sandbox, as the user.
    let standard_sh = |script: &str| {
        user.command(&user.airlock)
            .args([
                "sandbox",
                "run",
                "--profile",
                "standard",
                "--",
                "sh",
                "-c",
                script,
            ])
            .output()
            .expect("airlock sandbox run --profile standard")
    };
    let standard = standard_sh("grep CapBnd /proc/self/status");
    let err = String::from_utf8_lossy(&standard.stderr);
    assert!(standard.status.success(), "{err}");
    assert!(err.contains("\"level\": \"standard\""), "{err}");
    assert!(err.contains("\"bounding_set_dropped\": false"), "{err}");
    assert!(!String::from_utf8_lossy(&standard.stdout).contains("0000000000000000"));

    // Without a cgroup (an ordinary user's standard sandbox has none), what the command
    // leaves in the background still ends with it: its process group is killed.
    let marker = format!("airlock-left-behind-{}", std::process::id());
    let left = standard_sh(&format!(
        "sh -c 'sleep 300; echo {marker}' >/dev/null 2>&1 & echo started"
    ));
    let err = String::from_utf8_lossy(&left.stderr);
    assert!(left.status.success(), "{err}");
    assert!(
        String::from_utf8_lossy(&left.stdout).contains("started"),
        "{err}"
    );
    let alive = || {
        std::fs::read_dir("/proc")
            .expect("/proc")
            .filter_map(|e| e.ok())
            .filter(|e| {
                std::fs::read(e.path().join("cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&marker))
            })
            .filter_map(|e| e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()))
            .collect::<Vec<u32>>()
    };
    // Fails, after killing them, if processes holding the marker are still there a
    // moment after the call returned.
    let assert_gone = |what: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !alive().is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let survivors = alive();
        for &pid in &survivors {
            // The test's own leftover, killed before failing.
            signal(pid, rustix::process::Signal::KILL);
        }
        assert!(
            survivors.is_empty(),
            "{what} outlived the call: {survivors:?}"
        );
    };
    assert_gone("the command's background process");

    // Nor what left the command's session (the sandbox's init is the subreaper of all
    // it starts): the command returns once the process has said it started.
    let left = standard_sh(&format!(
        "setsid sh -c 'touch \"$TMPDIR/up\"; sleep 300; echo {marker}' >/dev/null 2>&1 & \
         while [ ! -e \"$TMPDIR/up\" ]; do sleep 0.01; done; echo started"
    ));
    let err = String::from_utf8_lossy(&left.stderr);
    assert!(
        left.status.success() && String::from_utf8_lossy(&left.stdout).contains("started"),
        "{err}"
    );
    assert_gone("a process in a session of its own");
}

#[tokio::test]
async fn the_workspace_quota_is_refused_to_an_ordinary_user_and_the_refusal_names_the_fix() {
    let user = OrdinaryUser::get();
    // The defaults, spelt out (the harness turns the quota off for ordinary users).
    let (status, log) = Airlock::refused_as(
        user,
        "[sandbox]\nworkspace_bytes = 1073741824\nworkspace_inodes = 100000\n",
    );
    assert!(!status.success(), "airlock up must refuse: {status}\n{log}");
    for fix in [
        "need a file system per workspace",
        "as root",
        "workspace_bytes = 0 and workspace_inodes = 0",
    ] {
        assert!(log.contains(fix), "the refusal must name `{fix}`:\n{log}");
    }
    // Refused before any worker started: no component ever ran.
    assert!(!log.contains("fs worker starting"), "{log}");
}
