//! The sandbox's checks again, with pre-built sandboxes (`prebuilt = 2`): every strict
//! check must run in one (the shared `run` helper asserts it), and the same assertions
//! must hold. Then what is particular to them: an entry serves one call only, nothing
//! is left when the factory is dropped, and what an entry cannot take runs fresh.
#![allow(unsafe_code)]
// Helpers outside #[test] functions panic on setup failures too, like the tests.
#![allow(clippy::expect_used, clippy::unwrap_used)]

/// Two pre-built sandboxes per factory.
const PREBUILT: usize = 2;

include!("support/checks.rs");

/// Waits until the factory has `n` entries ready (they are built in the background).
fn wait_until_ready(sandbox: &Sandbox, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while sandbox.prebuilt_ready() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} pre-built sandboxes ready after 30 s",
            sandbox.prebuilt_ready()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Pids of this process's waiting entries (children named `airlock-ready`) of the
/// test's factory (in its cgroups: other tests run at the same time).
fn waiting_entries(test: &str) -> Vec<String> {
    let parent = format!("/airlock-test-{test}/");
    let me = std::process::id().to_string();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // "pid (comm) state ppid ...": the comm may hold spaces, the rest does not.
        let Some((comm, rest)) = stat
            .split_once(" (")
            .and_then(|(_, rest)| rest.rsplit_once(") "))
        else {
            continue;
        };
        let ppid = rest.split_whitespace().nth(1).unwrap_or_default();
        let cgroup = std::fs::read_to_string(entry.path().join("cgroup")).unwrap_or_default();
        if comm == "airlock-ready" && ppid == me && cgroup.contains(&parent) {
            found.push(pid);
        }
    }
    found
}

#[test]
fn an_entry_serves_one_call_and_the_next_call_gets_new_namespaces() {
    let ws = workspace();
    let sandbox = strict(config("once"));
    let script = "readlink /proc/self/ns/pid /proc/self/ns/net /proc/self/ns/mnt; \
                  ls /tmp; echo secret > /tmp/left-behind";
    let first = sh(&sandbox, ws.path(), script);
    let second = sh(&sandbox, ws.path(), script);
    for out in [&first, &second] {
        assert_eq!(out.exit_code, Some(0), "{}", text(&out.stderr));
        assert!(out.prebuilt, "fallback: {:?}", out.fallback);
    }
    let lines = |out: &RunOutcome| -> Vec<String> {
        text(&out.stdout).lines().map(str::to_owned).collect()
    };
    let (a, b) = (lines(&first), lines(&second));
    // Three namespace links each, and /tmp empty both times: the second call does not
    // see the file the first left in its /tmp.
    assert_eq!(a.len(), 3, "{a:?}");
    assert_eq!(b.len(), 3, "{b:?}");
    for (i, kind) in ["pid", "net", "mnt"].iter().enumerate() {
        assert!(a[i].starts_with(&format!("{kind}:[")), "{a:?}");
        assert_ne!(a[i], b[i], "both calls ran in the same {kind} namespace");
    }
    assert_no_cgroup_left("once");
}

#[test]
fn a_pre_built_run_reports_the_same_isolation_as_a_fresh_one() {
    let ws = workspace();
    let pooled = strict(config("same-report"));
    let fresh = strict(SandboxConfig {
        prebuilt: 0,
        ..config("same-report-fresh")
    });
    let a = run(&pooled, &spec(&["true"], ws.path()));
    let b = run(&fresh, &spec(&["true"], ws.path()));
    assert!(a.prebuilt && !b.prebuilt);
    assert_eq!(a.isolation, b.isolation);
    assert_eq!(a.isolation.level, IsolationLevel::Strict);
}

#[test]
fn dropping_the_factory_kills_and_reaps_every_waiting_entry() {
    let ws = workspace();
    let sandbox = strict(config("drop"));
    assert_eq!(
        run(&sandbox, &spec(&["true"], ws.path())).exit_code,
        Some(0)
    );
    wait_until_ready(&sandbox, PREBUILT);
    let waiting = waiting_entries("drop");
    assert_eq!(waiting.len(), PREBUILT, "{waiting:?}");
    let mounts_before = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    drop(sandbox);
    // Reaped, not merely killed: no /proc entry (a zombie would still have one).
    for pid in &waiting {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "entry {pid} outlived its factory"
        );
    }
    assert_eq!(waiting_entries("drop"), Vec::<String>::new());
    for parent in test_cgroup_parents("drop") {
        assert_eq!(
            sub_cgroups(&parent),
            Vec::<String>::new(),
            "{}",
            parent.display()
        );
        let _ = std::fs::remove_dir(&parent);
    }
    let mounts_after = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert_eq!(mounts_before, mounts_after, "mounts leaked into the host");
}

#[test]
fn a_call_too_large_for_an_entry_runs_in_a_fresh_sandbox() {
    let ws = workspace();
    let sandbox = strict(config("large"));
    // Warm: an entry is ready, so only the size can send the call elsewhere.
    assert!(run(&sandbox, &spec(&["true"], ws.path())).prebuilt);
    wait_until_ready(&sandbox, PREBUILT);
    let big = "x".repeat(100_000);
    let out = sandbox
        .run(
            &spec(&["/bin/sh", "-c", "echo ${#1}", "sh", &big], ws.path()),
            &mut NoSink,
            &Cancel::new(),
        )
        .expect("a large call runs");
    assert_eq!(out.exit_code, Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "100000\n");
    assert!(!out.prebuilt);
    let why = out.fallback.expect("the reason for the fresh sandbox");
    assert!(
        why.contains("more than the 65536 a pre-built sandbox holds"),
        "{why}"
    );
    // The entries were not spent on it: the next call is pre-built again.
    assert_eq!(sandbox.prebuilt_ready(), PREBUILT);
    assert!(run(&sandbox, &spec(&["true"], ws.path())).prebuilt);
    assert_no_cgroup_left("large");
}

/// An entry's mount namespace is a copy of the worker's from when it was cloned. A
/// volume mounted on a workspace since then (a per-workspace quota) is not in it: the
/// entry must not bind the directory underneath, and the call runs fresh, in the volume.
#[test]
fn a_workspace_mounted_after_the_entries_were_built_runs_fresh_in_its_volume() {
    let ws = workspace();
    let sandbox = strict(config("volume"));
    assert!(run(&sandbox, &spec(&["true"], ws.path())).prebuilt);
    wait_until_ready(&sandbox, PREBUILT);
    let mount = |args: &[&str]| {
        let status = std::process::Command::new(args[0])
            .args(&args[1..])
            .status()
            .expect("mount/umount");
        assert!(status.success(), "{args:?} failed (the test runs as root)");
    };
    let target = ws.path().to_str().expect("utf-8 path").to_owned();
    mount(&[
        "mount",
        "-t",
        "tmpfs",
        "-o",
        "size=1m",
        "airlock-test",
        &target,
    ]);
    let out = sandbox.run(
        &spec(&["sh", "-c", "echo in-volume > here"], ws.path()),
        &mut NoSink,
        &Cancel::new(),
    );
    let in_volume = std::fs::read_to_string(ws.path().join("here"));
    mount(&["umount", &target]);
    let out = out.expect("run");
    assert_eq!(out.exit_code, Some(0), "{}", text(&out.stderr));
    assert!(!out.prebuilt);
    let why = out.fallback.expect("the reason for the fresh sandbox");
    assert!(why.contains("does not see the workspace"), "{why}");
    assert_eq!(in_volume.expect("the file is in the volume"), "in-volume\n");
    // The directory underneath the volume got nothing.
    assert!(!ws.path().join("here").exists());
    assert_no_cgroup_left("volume");
}
