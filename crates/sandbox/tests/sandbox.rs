//! Integration tests of the sandbox with real processes. Nothing is skipped: a host
//! without a required feature fails the test with a message naming it.
#![allow(unsafe_code)]
// Helpers outside #[test] functions panic on setup failures too, like the tests.
#![allow(clippy::expect_used, clippy::unwrap_used)]

/// Sandboxes are built for each call here.
const PREBUILT: usize = 0;

include!("support/checks.rs");

#[path = "support/v2_vm.rs"]
mod v2_vm;

/// The cgroup v2 backend on a host that has it: this host mounts v1 controllers, so the
/// tests that exercise the sandbox's cgroups run again in a guest with cgroup v2 alone
/// (every v1 controller disabled on its kernel command line), where the backend is
/// chosen by probing as on any host — and the report must say `v2`.
#[test]
fn cgroup_v2_backend_on_a_pure_v2_host() {
    const IN_GUEST: [&str; 12] = [
        "true_exits_zero",
        "echo_streams_and_captures_output",
        "exit_codes_and_signals",
        "timeout_kills_a_spinner",
        "cancel_kills_the_sandbox",
        "setsid_and_double_fork_escapees_are_killed",
        "standard_mode_escapees_are_killed_through_the_cgroup",
        "pids_limit_stops_a_fork_bomb",
        "memory_bomb_kills_only_the_sandbox",
        "strict_report_has_every_layer",
        "max_concurrent_sandboxes_run_at_once_and_the_rest_wait_within_their_deadline",
        "sandboxes_started_at_once_on_many_threads_all_start",
    ];
    let run = v2_vm::run_in_v2_guest(&IN_GUEST);
    let console = &run.console;
    assert!(
        console.contains("guest v1 mounts: 0"),
        "the guest has cgroup v2 only:\n{console}"
    );
    let controllers = console
        .lines()
        .find(|l| l.contains("guest cgroup:"))
        .unwrap_or_else(|| panic!("the guest did not report its cgroups:\n{console}"));
    for controller in ["memory", "pids", "cpu"] {
        assert!(
            controllers.contains(controller),
            "{controller} is enabled in the guest: {controllers}"
        );
    }
    assert_eq!(
        run.exit_status,
        Some(0),
        "the tests failed in the guest:\n{console}"
    );
    assert!(
        console.contains(&format!("test result: ok. {} passed", IN_GUEST.len())),
        "every test ran in the guest:\n{console}"
    );
}

/// A standard sandbox on a host without usable cgroups (what an ordinary user and the
/// Kubernetes base get): the probe's answer with the cgroups taken away.
fn standard_without_cgroups(test: &str) -> Sandbox {
    let mut host = airlock_sandbox::probe(&format!("airlock-test-{test}"));
    host.cgroup = Err(airlock_sandbox::Missing {
        feature: "cgroups",
        problem: "are not usable (simulated)".into(),
        fix: "none: this test runs without them".into(),
    });
    let cfg = SandboxConfig {
        min_isolation: IsolationLevel::Standard,
        force_level: Some(IsolationLevel::Standard),
        ..config(test)
    };
    let sandbox = Sandbox::with_probe(cfg, host).expect("a standard sandbox without cgroups");
    assert!(sandbox.report().cgroup.is_none(), "{:?}", sandbox.report());
    sandbox
}

/// The pids of processes whose command line holds `needle` (a `sleep` of a duration no
/// other process uses).
fn processes_with(needle: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse::<i32>().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            cmdline.contains(needle).then_some(pid)
        })
        .collect()
}

/// Fails, after killing them, if processes holding `needle` are still there once the
/// call has returned (a moment's grace for a SIGKILL still being delivered).
fn assert_none_left(needle: &str, what: &str, outcome: &RunOutcome) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !processes_with(needle).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left = processes_with(needle);
    for &pid in &left {
        // SAFETY: kill takes no pointers; the test's own leftover.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    assert!(
        left.is_empty(),
        "{what}: processes outlived the call: {left:?}\nstdout: {}\nstderr: {}",
        text(&outcome.stdout),
        text(&outcome.stderr)
    );
}

/// Without a cgroup or a pid namespace, what a command leaves behind still ends with
/// the call, however it left the command's process group: a new session, a new group,
/// a double fork, a stopped process, hundreds of them, and on a timeout as on a normal
/// exit. Each variation's processes are `sleep`s of a duration of their own; none may
/// be left once the call has returned.
#[test]
fn a_standard_command_leaves_nothing_behind_without_a_cgroup() {
    let ws = workspace();
    let sandbox = standard_without_cgroups("leftovers");
    let tag = std::process::id() % 100_000;
    // What lingers: a process that says it started (a file `up.<pid>` in the workspace)
    // and becomes a `sleep` of the variation's own duration.
    let linger = ws.path().join("linger");
    std::fs::write(&linger, "#!/bin/sh\ntouch \"up.$$\"\nexec sleep \"$1\"\n").expect("linger");
    std::fs::set_permissions(&linger, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod linger");
    // (what, script, how many processes start lingering)
    let variations: [(&str, &str, usize); 7] = [
        ("same group", "./linger {D} &", 1),
        ("new session", "setsid ./linger {D} &", 1),
        (
            "new group",
            "perl -e 'setpgrp(0, 0); exec \"./linger\", \"{D}\"' &",
            1,
        ),
        (
            "double fork into a new session",
            "(setsid sh -c '(./linger {D} &); ./linger {D}' &)",
            2,
        ),
        (
            "stopped",
            "setsid sh -c 'touch up.$$; kill -STOP $$; sleep {D}' & setsid ./linger {D} &",
            2,
        ),
        (
            "a subreaper of its own",
            "perl -e 'syscall(157, 36, 1, 0, 0, 0); \
             if (fork() == 0) { if (fork() == 0) { setpgrp(0, 0); exec \"./linger\", \"{D}\" } exit 0 } \
             sleep 1' &",
            1,
        ),
        (
            "two hundred",
            "for i in $(seq 200); do setsid ./linger {D} & done",
            200,
        ),
    ];
    let started = |ws: &Path| {
        std::fs::read_dir(ws)
            .expect("workspace")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("up."))
            .map(|e| std::fs::remove_file(e.path()).expect("remove up file"))
            .count()
    };
    for (n, (what, script, lingering)) in variations.iter().enumerate() {
        let duration = format!("{}.{tag}{n}", 3000 + n);
        // Waits until every lingering process has said it started, then exits.
        let script = format!(
            "{}\nwhile [ $(ls | grep -c '^up\\.') -lt {lingering} ]; do sleep 0.01; done; echo started",
            script.replace("{D}", &duration)
        );
        let out = sh(&sandbox, ws.path(), &script);
        assert!(
            text(&out.stdout).contains("started") && out.exit_code == Some(0),
            "{what}: {:?} {}",
            out.exit_code,
            text(&out.stderr)
        );
        assert_eq!(started(ws.path()), *lingering, "{what}");
        assert_none_left(&duration, what, &out);
    }

    // On a timeout: the command is still running, and so is what it moved away.
    let duration = format!("3100.{tag}");
    let script = format!(
        "setsid ./linger {duration} & (setsid sh -c './linger {duration}' &)\n\
         while [ $(ls | grep -c '^up\\.') -lt 2 ]; do sleep 0.01; done; echo started; \
         sleep {duration}"
    );
    let mut timed = spec(&["/bin/sh", "-c", &script], ws.path());
    timed.timeout = Duration::from_secs(3);
    let out = run(&sandbox, &timed);
    assert!(
        out.timed_out && text(&out.stdout).contains("started"),
        "{out:?}"
    );
    assert_eq!(started(ws.path()), 2, "timed out");
    assert_none_left(&duration, "timed out", &out);
    assert_no_cgroup_left("leftovers");
}

/// With Landlock's signal scoping (ABI 6), a standard command cannot kill the init that
/// cleans up after it, nor anything outside the sandbox: `kill -9 $PPID` and `kill -9 -1`
/// fail, what it left behind is still killed, and a process of the host's with the
/// same uid is untouched.
#[test]
fn a_standard_command_cannot_signal_its_init_or_the_host() {
    let abi = airlock_sandbox::probe("airlock-test-scope")
        .landlock_abi
        .expect("Landlock");
    assert!(
        abi >= 6,
        "this test needs Landlock ABI 6 (signal scoping, Linux 6.12); the kernel has ABI {abi}"
    );
    let ws = workspace();
    let sandbox = standard_without_cgroups("scope");
    let tag = std::process::id() % 100_000;
    /// The host's process, killed however the test ends.
    struct HostProcess(std::process::Child);
    impl Drop for HostProcess {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut host = HostProcess(
        std::process::Command::new("sleep")
            .arg(format!("3200.{tag}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("a process of the host's"),
    );
    // Each attempt runs beside a process the command moved to a session of its own,
    // which must not outlive the call. `kill -9 -1` answers 0 when every process
    // refused it (the kernel's rule), so only what it left standing tells.
    let host_pid = host.0.id();
    for (n, (what, attempt, answers)) in [
        ("its init", "setsid sleep {D} & kill -9 $PPID", true),
        (
            "its init's group",
            "setsid sleep {D} & kill -9 -$PPID",
            true,
        ),
        ("every process", "kill -9 -1", false),
        (
            "the host's process",
            &*format!("setsid sleep {{D}} & kill -9 {host_pid}"),
            true,
        ),
        (
            "the host's process, by TERM",
            &*format!("setsid sleep {{D}} & kill -TERM {host_pid}"),
            true,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let duration = format!("3300.{tag}{n}");
        let attempt = attempt.replace("{D}", &duration);
        let out = sh(
            &sandbox,
            ws.path(),
            &format!("{attempt} 2>/dev/null; echo \"refused: $?\"; setsid sleep {duration} &"),
        );
        assert!(
            !answers || text(&out.stdout).contains("refused: 1"),
            "{what}: the signal went through: {:?} {}",
            text(&out.stdout),
            text(&out.stderr)
        );
        assert_none_left(&format!("sleep {duration}"), what, &out);
        assert!(
            host.0.try_wait().expect("the host's process").is_none(),
            "{what}: the host's process was killed"
        );
    }
}
