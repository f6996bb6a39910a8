// The sandbox's checks, shared by two test binaries: `sandbox.rs` runs them with
// sandboxes built for each call, `sandbox_prebuilt.rs` with pre-built ones (the
// including file defines `PREBUILT`, the `prebuilt` of every `config`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

// Relative to this file, which both test binaries include.
#[path = "../../../../tests/support/cgroups.rs"]
mod cgroups;

use airlock_sandbox::{
    Cancel, CommandSpec, IsolationLevel, NoSink, RunOutcome, Sandbox, SandboxConfig, SandboxError,
    SelfConfinement, Stream, confine_self,
};

/// A config whose per-call cgroups live under a parent of their own, so that a test can
/// check that nothing is left behind without seeing other tests' calls.
fn config(test: &str) -> SandboxConfig {
    SandboxConfig {
        cgroup_parent: format!("airlock-test-{test}"),
        prebuilt: PREBUILT,
        ..SandboxConfig::default()
    }
}

fn strict(cfg: SandboxConfig) -> Sandbox {
    let cfg = SandboxConfig {
        min_isolation: IsolationLevel::Strict,
        ..cfg
    };
    match Sandbox::new(cfg) {
        Ok(s) => s,
        Err(e) => panic!("this host cannot run a strict sandbox: {e}"),
    }
}

fn standard(cfg: SandboxConfig) -> Sandbox {
    let cfg = SandboxConfig {
        min_isolation: IsolationLevel::Standard,
        force_level: Some(IsolationLevel::Standard),
        ..cfg
    };
    match Sandbox::new(cfg) {
        Ok(s) => s,
        Err(e) => panic!("this host cannot run a standard sandbox: {e}"),
    }
}

fn spec(argv: &[&str], workspace: &Path) -> CommandSpec {
    let mut spec = CommandSpec::new(argv.iter().map(|s| s.to_string()).collect(), workspace);
    spec.timeout = Duration::from_secs(20);
    spec
}

fn run(sandbox: &Sandbox, spec: &CommandSpec) -> RunOutcome {
    let outcome = match sandbox.run(spec, &mut NoSink, &Cancel::new()) {
        Ok(o) => o,
        Err(e) => panic!("run {:?} failed: {e}", spec.argv),
    };
    // With pre-built sandboxes every strict check must have run in one: a fresh
    // fallback would pass the check without testing the pool.
    let pooled = sandbox.config().prebuilt > 0 && sandbox.level() == IsolationLevel::Strict;
    assert_eq!(
        outcome.prebuilt, pooled,
        "{:?} ran {} (fallback: {:?})",
        spec.argv,
        if outcome.prebuilt { "pre-built" } else { "fresh" },
        outcome.fallback
    );
    outcome
}

fn sh(sandbox: &Sandbox, workspace: &Path, script: &str) -> RunOutcome {
    run(sandbox, &spec(&["/bin/sh", "-c", script], workspace))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn workspace() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp workspace")
}

/// Every directory named `airlock-test-<test>` under /sys/fs/cgroup (any hierarchy).
fn test_cgroup_parents(test: &str) -> Vec<PathBuf> {
    let name = format!("airlock-test-{test}");
    cgroups::cgroup_dirs(|dir| dir == name)
}

/// The directory entries (sub-cgroups) of a cgroup directory.
fn sub_cgroups(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .expect("read cgroup dir")
        .flatten()
        .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Asserts that no call cgroup is left under the test's parents: below each parent only
/// the pools of live sandbox factories (`pool-<pid>-<n>`, removed when the factory is
/// dropped), each of them empty. A call answered before its sandbox's teardown (the
/// factory's reaper) may leave its cgroup for a moment, so this looks again until the
/// state settles (within 20 s). Removes what is left of the test's parents.
fn assert_no_cgroup_left(test: &str) {
    if PREBUILT != 0 {
        wait_for_only_waiting_entries(test);
        return;
    }
    let parents = test_cgroup_parents(test);
    assert!(
        !parents.is_empty(),
        "no cgroup parent airlock-test-{test} was created"
    );
    let own_pool = format!("pool-{}-", std::process::id());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut strays = Vec::new();
        for parent in &parents {
            for child in sub_cgroups(parent) {
                if !child.starts_with(&own_pool) {
                    strays.push(parent.join(child));
                    continue;
                }
                for call in sub_cgroups(&parent.join(&child)) {
                    strays.push(parent.join(&child).join(call));
                }
            }
        }
        if strays.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "cgroups left: {strays:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    for parent in parents {
        for child in sub_cgroups(&parent) {
            let _ = std::fs::remove_dir(parent.join(child));
        }
        let _ = std::fs::remove_dir(&parent);
    }
}

/// With pre-built sandboxes, the factory's pool also holds the cgroups of the entries
/// waiting for a call: each must hold one process, an entry (`airlock-ready`), and
/// every other call cgroup must be gone. An entry being built is briefly neither, so
/// this looks again until the state settles (within 20 s).
fn wait_for_only_waiting_entries(test: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut strays = Vec::new();
        for parent in test_cgroup_parents(test) {
            for pool in sub_cgroups(&parent) {
                let pool = parent.join(pool);
                for call in sub_cgroups(&pool) {
                    let dir = pool.join(&call);
                    let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                    let comms: Vec<String> = procs
                        .split_whitespace()
                        .map(|pid| {
                            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                                .unwrap_or_default()
                                .trim()
                                .to_owned()
                        })
                        .collect();
                    if comms != ["airlock-ready"] {
                        strays.push(format!("{}: {comms:?}", dir.display()));
                    }
                }
            }
        }
        if strays.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "cgroups left: {strays:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Host processes whose environment holds `marker`.
fn processes_with_marker(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let hay = [environ, cmdline].concat();
        if hay.windows(marker.len()).any(|w| w == marker.as_bytes()) {
            found.push(format!(
                "{name}: {}",
                text(&std::fs::read(entry.path().join("cmdline")).unwrap_or_default())
            ));
        }
    }
    found
}

fn unique_marker(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("AIRLOCK_MARKER_{test}_{}_{nanos}", std::process::id())
}

#[test]
fn true_exits_zero() {
    let ws = workspace();
    let sandbox = strict(config("true"));
    let mounts_before = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let out = run(&sandbox, &spec(&["true"], ws.path()));
    assert_eq!(out.exit_code, Some(0));
    assert_eq!(out.signal, None);
    assert!(!out.timed_out && !out.cancelled);
    // Every mount lived in the sandbox's own mount namespace.
    let mounts_after = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert_eq!(mounts_before, mounts_after, "mounts leaked into the host");
    assert_no_cgroup_left("true");
}

#[test]
fn echo_streams_and_captures_output() {
    let ws = workspace();
    let sandbox = strict(config("echo"));
    let mut streamed: Vec<(Stream, Vec<u8>)> = Vec::new();
    let mut sink = |stream: Stream, data: &[u8]| streamed.push((stream, data.to_vec()));
    let out = sandbox
        .run(
            &spec(&["sh", "-c", "echo hello; echo oops >&2"], ws.path()),
            &mut sink,
            &Cancel::new(),
        )
        .expect("run");
    assert_eq!(text(&out.stdout), "hello\n");
    assert_eq!(text(&out.stderr), "oops\n");
    let streamed_out: Vec<u8> = streamed
        .iter()
        .filter(|(s, _)| *s == Stream::Stdout)
        .flat_map(|(_, d)| d.clone())
        .collect();
    assert_eq!(text(&streamed_out), "hello\n");
    assert_no_cgroup_left("echo");
}

#[test]
fn exit_codes_and_signals() {
    let ws = workspace();
    let sandbox = strict(config("exit"));
    let out = sh(&sandbox, ws.path(), "exit 42");
    assert_eq!((out.exit_code, out.signal), (Some(42), None));
    let out = sh(&sandbox, ws.path(), "kill -TERM $$");
    assert_eq!((out.exit_code, out.signal), (None, Some(libc::SIGTERM)));
    let out = sh(&sandbox, ws.path(), "kill -KILL $$");
    assert_eq!((out.exit_code, out.signal), (None, Some(libc::SIGKILL)));
    let out = run(
        &sandbox,
        &spec(&["perl", "-e", "kill 'SEGV', $$"], ws.path()),
    );
    assert_eq!(out.signal, Some(libc::SIGSEGV));
    assert_no_cgroup_left("exit");
}

#[test]
fn stdin_is_fed() {
    let ws = workspace();
    let sandbox = strict(config("stdin"));
    let mut s = spec(&["cat"], ws.path());
    s.stdin = b"line one\nline two\n".repeat(20_000); // larger than a pipe buffer
    let out = run(&sandbox, &s);
    assert_eq!(out.exit_code, Some(0));
    assert_eq!(out.stdout, s.stdin);
    assert_no_cgroup_left("stdin");
}

#[test]
fn missing_program_is_a_setup_error_naming_the_step() {
    let ws = workspace();
    let sandbox = strict(config("missing"));
    match sandbox.run(
        &spec(&["/nonexistent/program"], ws.path()),
        &mut NoSink,
        &Cancel::new(),
    ) {
        Err(SandboxError::Setup { step, source }) => {
            assert_eq!(step, "execute the command");
            assert_eq!(source.raw_os_error(), Some(libc::ENOENT));
        }
        other => panic!("expected a setup error, got {other:?}"),
    }
    assert_no_cgroup_left("missing");
}

#[test]
fn output_is_capped_and_flagged_and_the_child_never_blocks() {
    let ws = workspace();
    let sandbox = strict(SandboxConfig {
        output_cap_bytes: 1000,
        ..config("cap")
    });
    // 10 MB on each stream: far more than pipe buffers, so the child would block if we
    // stopped draining at the cap.
    let out = sh(
        &sandbox,
        ws.path(),
        "head -c 10000000 /dev/zero; head -c 10000000 /dev/zero >&2; echo done >&2",
    );
    assert_eq!(out.exit_code, Some(0));
    assert_eq!(out.stdout.len(), 1000);
    assert_eq!(out.stderr.len(), 1000);
    assert!(out.stdout_truncated && out.stderr_truncated);
    let out = sh(&sandbox, ws.path(), "echo small");
    assert!(!out.stdout_truncated);
    // Exactly the cap: all of it, not flagged.
    let out = sh(&sandbox, ws.path(), "head -c 1000 /dev/zero | tr '\\0' a");
    assert_eq!(out.stdout, vec![b'a'; 1000]);
    assert!(!out.stdout_truncated);
    // One byte more: the cap's worth, flagged.
    let out = sh(&sandbox, ws.path(), "head -c 1001 /dev/zero | tr '\\0' a");
    assert_eq!(out.stdout, vec![b'a'; 1000]);
    assert!(out.stdout_truncated);
    assert_no_cgroup_left("cap");
}

#[test]
fn output_far_beyond_a_first_read_arrives_whole_and_in_order() {
    let ws = workspace();
    let sandbox = strict(config("output-large"));
    let out = sh(&sandbox, ws.path(), "seq 1 100000");
    let expected: String = (1..=100_000).map(|i| format!("{i}\n")).collect();
    assert!(out.stdout == expected.as_bytes(), "{} bytes", out.stdout.len());
    assert!(!out.stdout_truncated);
    assert_no_cgroup_left("output-large");
}

#[test]
fn timeout_kills_a_spinner() {
    let ws = workspace();
    let sandbox = strict(config("timeout"));
    let mut s = spec(&["sh", "-c", "while :; do :; done"], ws.path());
    s.timeout = Duration::from_millis(500);
    let started = Instant::now();
    let out = run(&sandbox, &s);
    // The spinner never ends by itself: only the deadline's kill ends it.
    assert!(out.timed_out && !out.cancelled);
    assert_eq!(out.signal, Some(libc::SIGKILL));
    assert_eq!(out.exit_code, None);
    eprintln!(
        "a 500 ms timeout ended the run after {:?} (measured, not asserted)",
        started.elapsed()
    );
    // The timeout the command was given: the requested 500 ms less any wait for a
    // sandbox slot (which a slow or busy host makes measurable).
    let given = out.isolation.limits.timeout_ms;
    assert!(matches!(given, Some(1..=500)), "timeout_ms {given:?}");
    assert_no_cgroup_left("timeout");
}

#[test]
fn cancel_kills_the_sandbox() {
    let ws = workspace();
    let sandbox = strict(config("cancel"));
    let cancel = Cancel::new();
    // The command says it is running, then sleeps far past the test; the cancel is
    // sent when that line arrives, so it always hits a running command.
    let mut seen = Vec::new();
    let mut on_output = |stream: Stream, data: &[u8]| {
        if stream == Stream::Stdout {
            seen.extend_from_slice(data);
            if seen.ends_with(b"running\n") {
                cancel.cancel();
            }
        }
    };
    let started = Instant::now();
    let out = sandbox
        .run(
            &spec(&["sh", "-c", "echo running; exec sleep 100"], ws.path()),
            &mut on_output,
            &cancel,
        )
        .expect("run");
    assert!(out.cancelled && !out.timed_out);
    assert_eq!(out.signal, Some(libc::SIGKILL));
    assert_eq!(text(&out.stdout), "running\n");
    eprintln!(
        "cancelled after {:?} (measured, not asserted)",
        started.elapsed()
    );
    assert_no_cgroup_left("cancel");
}

fn escapees_are_killed(sandbox: &Sandbox, test: &str, timeout: bool) {
    let ws = workspace();
    let marker = unique_marker(test);
    // Each escapee, carrying the marker, touches a file once it runs; the script goes
    // on only when all three are up.
    let script = format!(
        "setsid env {marker}=1 sh -c 'touch up1; exec sleep 1000' & \
         ( env {marker}=2 sh -c 'touch up2; exec sleep 1001' & ) ; \
         ( setsid sh -c 'env {marker}=3 sh -c \"touch up3; exec sleep 1002\" & ' & ) ; \
         while [ ! -e up1 ] || [ ! -e up2 ] || [ ! -e up3 ]; do sleep 0.01; done; {}",
        if timeout { "sleep 1000" } else { "exit 0" }
    );
    let mut s = spec(&["sh", "-c", &script], ws.path());
    s.timeout = Duration::from_secs(if timeout { 5 } else { 20 });
    let out = run(sandbox, &s);
    assert_eq!(out.timed_out, timeout);
    for up in ["up1", "up2", "up3"] {
        assert!(
            ws.path().join(up).exists(),
            "escapee {up} never ran: {}",
            text(&out.stderr)
        );
    }
    if !timeout {
        assert_eq!(out.exit_code, Some(0), "{}", text(&out.stderr));
    }
    // The kill is synchronous with the run's end, but exiting processes may take a
    // moment to leave /proc.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = processes_with_marker(&marker);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "processes escaped the sandbox: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn setsid_and_double_fork_escapees_are_killed() {
    let sandbox = strict(config("escape"));
    escapees_are_killed(&sandbox, "escape", false);
    escapees_are_killed(&sandbox, "escape", true);
    assert_no_cgroup_left("escape");
}

#[test]
fn standard_mode_escapees_are_killed_through_the_cgroup() {
    let sandbox = standard(config("escape-std"));
    assert!(
        sandbox.report().cgroup.is_some(),
        "standard mode on this host should use cgroups"
    );
    escapees_are_killed(&sandbox, "escape_std", false);
    escapees_are_killed(&sandbox, "escape_std", true);
    assert_no_cgroup_left("escape-std");
}

#[test]
fn pids_limit_stops_a_fork_bomb() {
    let ws = workspace();
    let sandbox = strict(SandboxConfig {
        pids: 32,
        ..config("pids")
    });
    // `echo $!` is a builtin: it prints the pid of every background process that could
    // be forked, and needs no fork itself.
    let mut s = spec(
        &[
            "sh",
            "-c",
            "for i in $(seq 1 100); do sleep 3 & echo $!; done 2>/dev/null",
        ],
        ws.path(),
    );
    s.timeout = Duration::from_secs(10);
    let out = run(&sandbox, &s);
    let started: BTreeSet<String> = text(&out.stdout).lines().map(str::to_owned).collect();
    let started = started.len();
    assert!(started <= 32, "{started} processes forked despite pids=32");
    assert!(
        started >= 20,
        "only {started} processes started: {}",
        text(&out.stderr)
    );
    // A real bomb: it must be contained and killed at the deadline. The shell forks its
    // own `sleep` and the bomb's subshell before the bomb fills the pids — so no fork of
    // its own can fail and end it early — then waits for them (a builtin, no fork), so
    // only the deadline can end the run.
    let mut s = spec(
        &["sh", "-c", "sleep 100 & (b() { b | b & }; b) & wait"],
        ws.path(),
    );
    s.timeout = Duration::from_secs(2);
    let out = run(&sandbox, &s);
    assert!(out.timed_out, "{out:?}");
    assert_eq!(out.signal, Some(libc::SIGKILL), "{out:?}");
    assert_no_cgroup_left("pids");
}

#[test]
fn memory_bomb_kills_only_the_sandbox() {
    let ws = workspace();
    let sandbox = strict(SandboxConfig {
        memory_bytes: 64 << 20,
        ..config("memory")
    });
    let out = run(
        &sandbox,
        &spec(
            &[
                "perl",
                "-e",
                "my $x = 'a' x (400*1024*1024); print qq(survived\\n)",
            ],
            ws.path(),
        ),
    );
    assert!(
        !text(&out.stdout).contains("survived"),
        "the memory limit did not hold"
    );
    assert_eq!(
        out.signal,
        Some(libc::SIGKILL),
        "expected an OOM kill: {out:?}"
    );
    assert!(
        out.usage.peak_memory_bytes <= 65 << 20,
        "peak {}",
        out.usage.peak_memory_bytes
    );
    // We are still here, and the next call works.
    assert_eq!(sh(&sandbox, ws.path(), "true").exit_code, Some(0));
    assert_no_cgroup_left("memory");
}

#[test]
fn fsize_caps_file_writes() {
    let ws = workspace();
    let sandbox = strict(SandboxConfig {
        fsize_bytes: 1 << 20,
        ..config("fsize")
    });
    let out = sh(
        &sandbox,
        ws.path(),
        "head -c 3000000 /dev/zero > big; echo $?",
    );
    assert_eq!(text(&out.stdout).trim(), (128 + libc::SIGXFSZ).to_string());
    let size = std::fs::metadata(ws.path().join("big")).expect("big").len();
    assert!(size <= 1 << 20, "file grew to {size}");
    assert_no_cgroup_left("fsize");
}

#[test]
fn tmp_is_size_limited() {
    let ws = workspace();
    let sandbox = strict(SandboxConfig {
        tmp_bytes: 1 << 20,
        ..config("tmp")
    });
    let out = sh(
        &sandbox,
        ws.path(),
        "head -c 3000000 /dev/zero > /tmp/x; echo rc=$?; df -k /tmp",
    );
    assert!(
        text(&out.stdout).contains("rc=1"),
        "stdout: {}",
        text(&out.stdout)
    );
    assert!(
        text(&out.stderr).contains("No space left"),
        "stderr: {}",
        text(&out.stderr)
    );
    assert_no_cgroup_left("tmp");
}

#[test]
fn host_secrets_are_not_reachable() {
    let ws = workspace();
    let sandbox = strict(config("secrets"));
    let out = sh(
        &sandbox,
        ws.path(),
        "for p in /etc/shadow /etc/gshadow /root /home /etc/ssh /sys /old_root /oldroot /run; do \
           test -e $p && echo present:$p; done; \
         cut -d: -f1 /etc/passwd | tr '\\n' ' '; echo; \
         cat /proc/1/cmdline >/dev/null && echo proc1-ok; \
         ls /proc | grep -c '^[0-9]'",
    );
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("present:"), "host paths visible: {stdout}");
    assert!(stdout.contains("root nobody \n"), "passwd: {stdout}");
    // Our pid namespace only: pid 1 (init), the shell, and a few helpers.
    let pids: usize = stdout
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .expect("process count");
    assert!(pids < 10, "{pids} processes visible in /proc");
    assert_no_cgroup_left("secrets");
}

#[test]
fn writes_outside_the_workspace_fail() {
    let ws = workspace();
    let sandbox = strict(config("writes"));
    let out = sh(
        &sandbox,
        ws.path(),
        "for p in /usr/evil /etc/evil /evil /dev/evil /proc/sys/kernel/hostname /bin/evil; do \
           (echo x > $p) 2>/dev/null && echo wrote:$p; done; \
         echo hello > /workspace/inside && mkdir -p /workspace/d/e && echo ok > /tmp/t && echo done",
    );
    let stdout = text(&out.stdout);
    assert!(
        !stdout.contains("wrote:"),
        "wrote outside the workspace: {stdout}"
    );
    assert!(
        stdout.contains("done"),
        "workspace write failed: {stdout} {}",
        text(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(ws.path().join("inside")).expect("inside"),
        "hello\n"
    );
    assert!(ws.path().join("d/e").is_dir());
    assert_no_cgroup_left("writes");
}

#[test]
fn network_is_off() {
    let ws = workspace();
    let sandbox = strict(config("net"));
    let out = run(
        &sandbox,
        &spec(
            &[
                "perl",
                "-e",
                "use Socket; \
                 socket(my $a, AF_INET, SOCK_STREAM, 0) ? print(qq(inet-ok\\n)) : print(qq(inet: $!\\n)); \
                 socket(my $b, AF_INET6, SOCK_DGRAM, 0) ? print(qq(inet6-ok\\n)) : print(qq(inet6: $!\\n)); \
                 socket(my $c, AF_UNIX, SOCK_STREAM, 0) ? print(qq(unix-ok\\n)) : print(qq(unix: $!\\n));",
            ],
            ws.path(),
        ),
    );
    let stdout = text(&out.stdout);
    assert!(stdout.contains("inet: Operation not permitted"), "{stdout}");
    assert!(
        stdout.contains("inet6: Operation not permitted"),
        "{stdout}"
    );
    assert!(stdout.contains("unix-ok"), "{stdout}");
    assert_eq!(sandbox.report().network, "none");
    assert_no_cgroup_left("net");
}

/// Takes the proxy sandbox's listener and answers one line on the first connection.
struct ProxySink {
    seen: std::sync::mpsc::Sender<std::net::SocketAddr>,
    server: Option<std::thread::JoinHandle<usize>>,
}

impl airlock_sandbox::OutputSink for ProxySink {
    fn chunk(&mut self, _: Stream, _: &[u8]) {}

    fn proxy_listener(&mut self, listener: std::net::TcpListener) {
        let _ = self
            .seen
            .send(listener.local_addr().expect("local address"));
        listener.set_nonblocking(true).expect("non-blocking");
        self.server = Some(std::thread::spawn(move || {
            use std::io::Write as _;
            let deadline = Instant::now() + Duration::from_secs(15);
            let mut served = 0;
            while Instant::now() < deadline && served < 1 {
                match listener.accept() {
                    Ok((mut stream, _)) => {
                        let _ = stream.write_all(b"hello from the worker\n");
                        served += 1;
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
            served
        }));
    }
}

#[test]
fn proxy_network_reaches_only_the_listener_the_worker_holds() {
    let ws = workspace();
    let sandbox = strict(SandboxConfig {
        network: airlock_sandbox::Network::Proxy,
        ..config("proxy")
    });
    assert_eq!(sandbox.report().network, "proxy");
    let (seen, addresses) = std::sync::mpsc::channel();
    let mut sink = ProxySink { seen, server: None };
    // As an attacker would: the proxy's port, every other way out, and listening.
    let script = r#"use Socket;
        sub try_connect { my ($name, $host, $port) = @_;
          socket(my $s, AF_INET, SOCK_STREAM, 0) or do { print "$name: socket $!\n"; return };
          if (connect($s, pack_sockaddr_in($port, inet_aton($host)))) {
            my $line = <$s>; print "$name: connected ", ($line // "nothing\n") }
          else { print "$name: $!\n" } }
        try_connect("proxy", "127.0.0.1", 3128);
        try_connect("other-port", "127.0.0.1", 3129);
        try_connect("outside", "192.0.2.1", 3128);
        try_connect("dns", "1.1.1.1", 53);
        socket(my $u, AF_INET, SOCK_DGRAM, 0) ? print("udp-ok\n") : print("udp: $!\n");
        socket(my $r, AF_INET, SOCK_RAW, 1) ? print("raw-ok\n") : print("raw: $!\n");
        socket(my $six, AF_INET6, SOCK_STREAM, 0) ? print("inet6-ok\n") : print("inet6: $!\n");
        socket(my $p, 17, SOCK_RAW, 0) ? print("packet-ok\n") : print("packet: $!\n");
        socket(my $n, 16, SOCK_RAW, 0) ? print("netlink-ok\n") : print("netlink: $!\n");
        socket(my $l, AF_INET, SOCK_STREAM, 0);
        bind($l, pack_sockaddr_in(4000, inet_aton("127.0.0.1"))) ? print("bind-ok\n") : print("bind: $!\n");
        socket(my $x, AF_UNIX, SOCK_STREAM, 0) ? print("unix-ok\n") : print("unix: $!\n");"#;
    let out = sandbox
        .run(
            &spec(&["perl", "-e", script], ws.path()),
            &mut sink,
            &Cancel::new(),
        )
        .expect("run");
    let stdout = text(&out.stdout);
    assert_eq!(out.exit_code, Some(0), "{stdout} {}", text(&out.stderr));
    assert_eq!(
        addresses.recv_timeout(Duration::from_secs(5)).ok(),
        Some("127.0.0.1:3128".parse().unwrap())
    );
    let served = sink
        .server
        .take()
        .expect("listener handed over")
        .join()
        .unwrap();
    assert_eq!(served, 1, "{stdout}");
    assert!(
        stdout.contains("proxy: connected hello from the worker"),
        "{stdout}"
    );
    for refused in [
        "other-port: ",
        "outside: ",
        "dns: ",
        "udp: ",
        "raw: ",
        "inet6: ",
        "packet: ",
        "netlink: ",
        "bind: ",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(refused))
            .unwrap_or_else(|| panic!("no {refused} line (it succeeded?): {stdout}"));
        assert!(!line.contains("connected"), "{line}");
    }
    assert!(stdout.contains("unix-ok"), "{stdout}");
    // The listener lives in the sandbox's namespace, not the host's: nothing of it is
    // reachable from here, and it is closed with the run.
    assert!(std::net::TcpStream::connect("127.0.0.1:3128").is_err());
    assert_no_cgroup_left("proxy");
}

#[test]
fn proxy_network_is_refused_below_strict() {
    let err = Sandbox::new(SandboxConfig {
        network: airlock_sandbox::Network::Proxy,
        min_isolation: IsolationLevel::Standard,
        force_level: Some(IsolationLevel::Standard),
        ..config("proxy-standard")
    })
    .expect_err("a standard sandbox has no network namespace for the proxy");
    assert!(err.to_string().contains("network = \"proxy\""), "{err}");
}

#[test]
fn seccomp_blocks_escape_syscalls() {
    let ws = workspace();
    let sandbox = strict(config("seccomp"));
    // (number, expected errno): ptrace, mount, unshare, setns, bpf, keyctl,
    // io_uring_setup, userfaultfd, perf_event_open, open_by_handle_at, clone3.
    let script = "for my $c ([101,1],[165,1],[272,1],[308,1],[321,1],[250,1],[425,1],[323,1],\
                  [298,1],[304,1],[435,38]) { my ($n,$e)=@$c; my $r=syscall($n,0,0,0,0,0); \
                  print qq($n:$r:), $!+0, qq(\\n) }";
    let out = run(&sandbox, &spec(&["perl", "-e", script], ws.path()));
    for line in text(&out.stdout).lines() {
        let parts: Vec<&str> = line.split(':').collect();
        let expected = if parts[0] == "435" { "38" } else { "1" };
        assert_eq!(parts[1], "-1", "syscall {} succeeded", parts[0]);
        assert_eq!(
            parts[2], expected,
            "syscall {} failed with errno {}",
            parts[0], parts[2]
        );
    }
    assert_eq!(
        text(&out.stdout).lines().count(),
        11,
        "{}",
        text(&out.stderr)
    );
    // Namespaces through the unshare tool (clone with flags), and forks still work.
    let out = sh(
        &sandbox,
        ws.path(),
        "unshare -U true || echo unshare-denied; (true) && echo fork-ok",
    );
    assert!(
        text(&out.stdout).contains("unshare-denied"),
        "{}",
        text(&out.stdout)
    );
    assert!(text(&out.stdout).contains("fork-ok"));
    assert_no_cgroup_left("seccomp");
}

#[test]
fn environment_is_empty_but_for_passed_variables() {
    let ws = workspace();
    let sandbox = strict(config("env"));
    // SAFETY: not actually unsafe to read; a secret in our own environment must not leak.
    let mut s = spec(&["env"], ws.path());
    s.env = vec![("FOO".into(), "bar".into())];
    let out = run(&sandbox, &s);
    let vars: BTreeSet<String> = text(&out.stdout)
        .lines()
        .map(|l| l.split('=').next().unwrap_or("").to_owned())
        .collect();
    let expected: BTreeSet<String> = ["FOO", "HOME", "PATH", "TMPDIR"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(vars, expected);
    assert_no_cgroup_left("env");
}

#[test]
fn only_standard_descriptors_are_open_and_cwd_is_honoured() {
    let ws = workspace();
    std::fs::create_dir(ws.path().join("sub")).expect("sub");
    let sandbox = strict(config("fds"));
    let mut s = spec(
        &[
            "sh",
            "-c",
            "pwd; sleep 5 & sleep 0.2; echo $(ls /proc/$!/fd); kill $!",
        ],
        ws.path(),
    );
    s.cwd = Some("sub".into());
    let out = run(&sandbox, &s);
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("/workspace/sub\n"), "{stdout}");
    assert_eq!(stdout.lines().nth(1), Some("0 1 2"), "{stdout}");
    let mut s = spec(&["true"], ws.path());
    s.cwd = Some("../..".into());
    assert!(matches!(
        sandbox.run(&s, &mut NoSink, &Cancel::new()),
        Err(SandboxError::InvalidCommand(_))
    ));
    assert_no_cgroup_left("fds");
}

#[test]
fn strict_report_has_every_layer() {
    let ws = workspace();
    let sandbox = strict(config("report"));
    let out = sh(
        &sandbox,
        ws.path(),
        "grep -E '^(NoNewPrivs|Seccomp|CapEff|CapBnd):' /proc/self/status",
    );
    let status = text(&out.stdout);
    assert!(status.contains("NoNewPrivs:\t1"), "{status}");
    assert!(status.contains("Seccomp:\t2"), "{status}");
    assert!(status.contains("CapEff:\t0000000000000000"), "{status}");
    assert!(status.contains("CapBnd:\t0000000000000000"), "{status}");

    let r = &out.isolation;
    assert_eq!(r.level, IsolationLevel::Strict);
    assert_eq!(
        r.namespaces,
        ["user", "pid", "mount", "net", "ipc", "uts", "cgroup"]
    );
    assert!(r.pivot_root);
    assert!(r.landlock_abi.is_some_and(|abi| abi >= 1));
    assert_eq!(r.seccomp, Some("filter"));
    assert!(r.cgroup.is_some());
    assert!(r.no_new_privs && r.capabilities_dropped);
    assert_eq!(r.rlimits.nofile, 1024);
    assert_eq!(r.rlimits.core_bytes, 0);
    assert_eq!(r.rlimits.cpu_seconds, Some(21));
    assert_eq!(r.limits.memory_bytes, Some(512 << 20));
    assert_eq!(r.limits.pids, Some(256));
    assert_eq!(r.limits.cpu, Some(1.0));
    assert_eq!(r.limits.tmp_bytes, Some(64 << 20));
    // The call's 20 s, less the time it waited for a sandbox slot: none here, but taking
    // a free slot can take a few milliseconds on a loaded machine (or in the emulated
    // guest), and that time counts against the call.
    assert!(
        r.limits
            .timeout_ms
            .is_some_and(|ms| (10_000..=20_000).contains(&ms)),
        "{:?}",
        r.limits.timeout_ms
    );
    assert_eq!(r.network, "none");

    let json = serde_json::to_value(&out).expect("json");
    assert_eq!(json["isolation"]["level"], "strict");
    assert_eq!(json["isolation"]["seccomp"], "filter");
    // The CI hosts are hybrid (v1 controllers, a controller-less v2 tree): v1 there; v2
    // only where a cgroup v2 tree has the memory, pids and cpu controllers.
    let expected_cgroup = if airlock_sandbox::cgroup::host_has_v2_controllers() {
        "v2"
    } else {
        "v1"
    };
    assert_eq!(json["isolation"]["cgroup"], expected_cgroup);
    assert!(json["isolation"]["landlock_abi"].is_u64());
    assert_eq!(json["isolation"]["limits"]["memory_bytes"], 512u64 << 20);
    assert!(json["usage"]["peak_memory_bytes"].is_u64());
    assert!(
        sandbox
            .report()
            .to_string()
            .contains("isolation level: strict")
    );
    assert_no_cgroup_left("report");
}

#[test]
fn standard_mode_works() {
    let ws = workspace();
    let sandbox = standard(config("standard"));
    let r = sandbox.report();
    assert_eq!(r.level, IsolationLevel::Standard);
    assert!(r.namespaces.is_empty() && !r.pivot_root);
    let out = sh(
        &sandbox,
        ws.path(),
        "pwd; echo hi > f && echo wrote; cat /etc/shadow 2>/dev/null || echo shadow-denied; \
         ls /root >/dev/null 2>&1 || echo root-denied; (echo x > /etc/evil) 2>/dev/null || echo etc-denied; \
         echo t > \"$TMPDIR/t\" && echo tmp-ok; \
         grep -E '^(NoNewPrivs|Seccomp|Seccomp_filters|CapEff):' /proc/self/status",
    );
    let stdout = text(&out.stdout);
    let ws_path = std::fs::canonicalize(ws.path()).expect("canonical workspace");
    assert!(
        stdout.starts_with(&format!("{}\n", ws_path.display())),
        "{stdout}"
    );
    for expected in [
        "wrote",
        "shadow-denied",
        "root-denied",
        "etc-denied",
        "tmp-ok",
        "NoNewPrivs:\t1",
        "Seccomp:\t2",
        // The sandbox's filter and the guard of its init.
        "Seccomp_filters:\t2",
        "CapEff:\t0000000000000000",
    ] {
        assert!(stdout.contains(expected), "missing {expected}: {stdout}");
    }
    assert_eq!(
        std::fs::read_to_string(ws.path().join("f")).expect("f"),
        "hi\n"
    );
    let out = run(
        &sandbox,
        &spec(
            &[
                "perl",
                "-e",
                "use Socket; socket(my $s, AF_INET, SOCK_STREAM, 0) or print qq($!)",
            ],
            ws.path(),
        ),
    );
    assert_eq!(text(&out.stdout), "Operation not permitted");
    // Without mount and network namespaces the host's Unix sockets are in reach of a
    // path, and a worker trusts whoever reaches its socket: a listening socket of the
    // host's, named and abstract, must stay out of reach, while socketpair works.
    let outside = tempfile::tempdir().expect("temp dir");
    let named = outside.path().join("worker.sock");
    let _named = std::os::unix::net::UnixListener::bind(&named).expect("bind named");
    // A datagram socket of the host's, as /dev/log is.
    let log = outside.path().join("log.sock");
    let log_socket = std::os::unix::net::UnixDatagram::bind(&log).expect("bind datagram");
    log_socket.set_nonblocking(true).expect("non-blocking");
    let abstract_name = format!("airlock-test-{}", std::process::id());
    let _abstract = {
        use std::os::linux::net::SocketAddrExt as _;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes())
            .expect("abstract address");
        std::os::unix::net::UnixListener::bind_addr(&addr).expect("bind abstract")
    };
    let script = format!(
        r#"use Socket; my ($named, $abs, $dgram, $x, $y);
        if (socket($named, AF_UNIX, SOCK_STREAM, 0)) {{ connect($named, pack_sockaddr_un("{}")) ? print("named-connected\n") : print("named: $!\n") }} else {{ print("named socket: $!\n") }}
        if (socket($abs, AF_UNIX, SOCK_STREAM, 0)) {{ connect($abs, pack_sockaddr_un("\0{abstract_name}")) ? print("abstract-connected\n") : print("abstract: $!\n") }} else {{ print("abstract socket: $!\n") }}
        socket($dgram, AF_UNIX, SOCK_DGRAM, 0) ? print("dgram-ok\n") : print("dgram socket: $!\n");
        socketpair($x, $y, AF_UNIX, SOCK_STREAM, 0) ? print("pair-ok\n") : print("pair: $!\n");
        my ($p, $q);
        if (socketpair($p, $q, AF_UNIX, SOCK_DGRAM, 0)) {{ send($p, "forged", 0, pack_sockaddr_un("{}")) ? print("dgram-sent\n") : print("dgram send: $!\n") }} else {{ print("dgram pair: $!\n") }}"#,
        named.display(),
        log.display()
    );
    let out = run(&sandbox, &spec(&["perl", "-e", &script], ws.path()));
    let stdout = text(&out.stdout);
    for expected in [
        "named socket: Operation not permitted",
        "abstract socket: Operation not permitted",
        "dgram socket: Operation not permitted",
        "pair-ok",
        "dgram pair: Operation not permitted",
    ] {
        assert!(stdout.contains(expected), "missing {expected}: {stdout} {}", text(&out.stderr));
    }
    let mut got = [0u8; 64];
    assert!(log_socket.recv(&mut got).is_err(), "the host's datagram socket received a message");
    assert_no_cgroup_left("standard");
}

#[test]
fn forcing_a_level_below_the_minimum_is_refused() {
    let cfg = SandboxConfig {
        min_isolation: IsolationLevel::Strict,
        force_level: Some(IsolationLevel::Standard),
        ..config("refuse")
    };
    assert!(matches!(
        Sandbox::new(cfg),
        Err(SandboxError::InvalidConfig(_))
    ));
}

#[test]
fn missing_user_namespaces_error_names_the_fix() {
    // Simulate a host without user namespaces: the probe result is what Sandbox::new
    // judges, so a strict minimum must be refused with the fix spelled out.
    let mut host = airlock_sandbox::probe("airlock-test-probe");
    host.user_namespaces = Err(airlock_sandbox::Missing {
        feature: "user namespaces",
        problem: "are not available (simulated)".into(),
        fix: "enable them, run the pod with hostUsers: false, or set [sandbox] min_isolation = \"standard\""
            .into(),
    });
    let err = Sandbox::with_probe(config("probe"), host.clone()).expect_err("must refuse");
    let msg = err.to_string();
    assert!(
        msg.contains("user namespaces") && msg.contains("min_isolation"),
        "{msg}"
    );
    let cfg = SandboxConfig {
        min_isolation: IsolationLevel::Standard,
        ..config("probe")
    };
    let sandbox = Sandbox::with_probe(cfg, host).expect("standard is enough");
    assert_eq!(sandbox.level(), IsolationLevel::Standard);
    for parent in test_cgroup_parents("probe") {
        let _ = std::fs::remove_dir(parent);
    }
}

/// Runs `body` in a forked child (single-threaded, as `confine_self` requires) and
/// returns what it wrote to the pipe, and its exit status.
fn in_forked_child(body: impl FnOnce(&mut dyn FnMut(&str))) -> (String, i32) {
    let mut fds = [0; 2];
    // SAFETY: valid array for pipe to fill.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the child runs `body` and exits; glibc's fork keeps malloc usable.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: closing the read end in the child.
        unsafe { libc::close(fds[0]) };
        let mut say = |s: &str| {
            let line = format!("{s}\n");
            // SAFETY: writing a valid buffer to our pipe.
            unsafe { libc::write(fds[1], line.as_ptr().cast(), line.len()) };
        };
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&mut say)));
        // SAFETY: leaving the forked child without running the test harness's atexit.
        unsafe { libc::_exit(if result.is_ok() { 0 } else { 101 }) };
    }
    // SAFETY: closing the write end in the parent.
    unsafe { libc::close(fds[1]) };
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        // SAFETY: reading into a valid buffer.
        let n = unsafe { libc::read(fds[0], buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            break;
        }
        out.extend_from_slice(&buf[..n as usize]);
    }
    // SAFETY: closing our descriptor; reaping our child.
    unsafe { libc::close(fds[0]) };
    let mut status = 0;
    // SAFETY: valid out-pointer.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    (text(&out), status)
}

fn status_lines() -> String {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            ["NoNewPrivs:", "Seccomp:", "CapEff:", "CapBnd:"]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn self_confinement_denies_exec() {
    let dir = workspace();
    let writable = dir.path().to_path_buf();
    let (out, status) = in_forked_child(|say| {
        let spec = SelfConfinement {
            read_paths: vec![],
            write_paths: vec![writable.clone()],
            allow_exec: false,
            allow_namespaces: false,
        };
        match confine_self(&spec) {
            Ok(report) => say(&format!(
                "confined landlock_fs={}",
                report.landlock_filesystem
            )),
            Err(e) => say(&format!("error {e}")),
        }
        say(&status_lines());
        let err = std::process::Command::new("/bin/true").status().err();
        say(&format!(
            "exec errno={:?}",
            err.and_then(|e| e.raw_os_error())
        ));
        say(&format!(
            "write-allowed={}",
            std::fs::write(writable.join("ok"), b"1").is_ok()
        ));
        say(&format!(
            "write-denied={}",
            std::fs::write("/var/tmp/airlock-evil", b"1").is_err()
        ));
        say(&format!(
            "read-denied={}",
            std::fs::read("/etc/passwd").is_err()
        ));
    });
    assert_eq!(status, 0, "child failed: {out}");
    assert!(out.contains("confined landlock_fs=true"), "{out}");
    assert!(out.contains("NoNewPrivs:\t1"), "{out}");
    assert!(out.contains("Seccomp:\t2"), "{out}");
    assert!(out.contains("CapEff:\t0000000000000000"), "{out}");
    assert!(out.contains("CapBnd:\t0000000000000000"), "{out}");
    assert!(
        out.contains(&format!("exec errno=Some({})", libc::EPERM)),
        "{out}"
    );
    assert!(out.contains("write-allowed=true"), "{out}");
    assert!(out.contains("write-denied=true"), "{out}");
    assert!(out.contains("read-denied=true"), "{out}");
}

#[test]
fn self_confined_shell_worker_can_still_create_strict_sandboxes() {
    let ws = workspace();
    let ws_path = ws.path().to_path_buf();
    let (out, status) = in_forked_child(|say| {
        // The worker probes (and prepares its cgroup parents) first, then confines
        // itself, then serves calls.
        let sandbox = match Sandbox::new(config("worker")) {
            Ok(s) => s,
            Err(e) => return say(&format!("sandbox error {e}")),
        };
        let spec = SelfConfinement {
            read_paths: vec![],
            write_paths: vec![ws_path.clone(), PathBuf::from("/sys/fs/cgroup")],
            allow_exec: true,
            allow_namespaces: true,
        };
        match confine_self(&spec) {
            Ok(_) => say("confined"),
            Err(e) => say(&format!("error {e}")),
        }
        say(&status_lines());
        match sandbox.run(&spec_for(&ws_path), &mut NoSink, &Cancel::new()) {
            Ok(o) => say(&format!(
                "ran exit={:?} out={}",
                o.exit_code,
                text(&o.stdout).trim()
            )),
            Err(e) => say(&format!("run error {e}")),
        }
        // As a worker does when it stops: the factory's drop finishes the teardown of
        // sandboxes whose calls were answered (the child `_exit`s next).
        drop(sandbox);
    });
    assert_eq!(status, 0, "child failed: {out}");
    assert!(out.contains("confined"), "{out}");
    // A root worker keeps CAP_SETFCAP only (needed to map the sandbox's root to its own
    // uid 0); any other worker keeps nothing.
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let expected_caps = if root {
        "CapEff:\t0000000080000000"
    } else {
        "CapEff:\t0000000000000000"
    };
    assert!(out.contains(expected_caps), "root: {root}: {out}");
    assert!(out.contains("CapBnd:\t0000000000000000"), "{out}");
    assert!(out.contains("ran exit=Some(0) out=/workspace"), "{out}");
    assert_no_cgroup_left("worker");
}

fn spec_for(ws: &Path) -> CommandSpec {
    spec(&["sh", "-c", "pwd"], ws)
}

#[test]
fn confine_self_refuses_a_multithreaded_process() {
    // The test harness runs this on a thread of a multithreaded process.
    let err = confine_self(&SelfConfinement::default()).expect_err("must refuse");
    assert!(err.to_string().contains("single thread"), "{err}");
}

#[test]
fn max_concurrent_sandboxes_run_at_once_and_the_rest_wait_within_their_deadline() {
    let sandbox = std::sync::Arc::new(strict(SandboxConfig {
        max_concurrent: 1,
        ..config("slots")
    }));
    let report = sandbox.report();
    assert_eq!(report.limits.max_concurrent, 1);
    // Under our own cgroup the parent is ours: all calls together are limited too.
    assert_eq!(
        report.limits.aggregate_memory_bytes,
        report.limits.memory_bytes
    );
    let ws = workspace();
    // The first sandbox holds its slot until the test lets it go.
    let holder = {
        let sandbox = sandbox.clone();
        let spec = spec(
            &[
                "sh",
                "-c",
                "touch running; while [ ! -e release ]; do sleep 0.02; done",
            ],
            ws.path(),
        );
        std::thread::spawn(move || run(&sandbox, &spec))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !ws.path().join("running").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the first sandbox never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // A second call whose whole timeout passes while it waits never starts.
    let mut second = spec(&["touch", "second-ran"], ws.path());
    second.timeout = Duration::from_millis(300);
    let err = sandbox
        .run(&second, &mut NoSink, &Cancel::new())
        .expect_err("no free slot");
    assert!(
        matches!(
            err,
            airlock_sandbox::SandboxError::Slot(airlock_sandbox::SlotError::Busy { max: 1, .. })
        ),
        "{err}"
    );
    assert!(!ws.path().join("second-ran").exists());
    // Once the first is done, the next call runs.
    std::fs::write(ws.path().join("release"), "").expect("release");
    assert_eq!(holder.join().expect("holder").exit_code, Some(0));
    let third = run(&sandbox, &spec(&["touch", "third-ran"], ws.path()));
    assert_eq!(third.exit_code, Some(0));
    assert!(ws.path().join("third-ran").exists());
    // Dropping the factory removes its pool from every hierarchy.
    drop(sandbox);
    for parent in test_cgroup_parents("slots") {
        assert_eq!(
            sub_cgroups(&parent),
            Vec::<String>::new(),
            "{}",
            parent.display()
        );
    }
    assert_no_cgroup_left("slots");
}

/// Sandboxes made at once on several threads (as a worker's calls and a test binary's
/// tests are): each start proves its cgroups with a probe process, and a probe forked
/// by one thread holds a copy of the others' pipes until it exits. Released by end of
/// file alone, two probes waited for each other for ever; every start must finish.
#[test]
fn sandboxes_started_at_once_on_many_threads_all_start() {
    const THREADS: usize = 8;
    const ROUNDS: usize = 50;
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(THREADS));
    let (tx, rx) = std::sync::mpsc::channel();
    for thread in 0..THREADS {
        let (barrier, tx) = (barrier.clone(), tx.clone());
        std::thread::spawn(move || {
            for round in 0..ROUNDS {
                barrier.wait();
                let started = Sandbox::new(SandboxConfig {
                    min_isolation: IsolationLevel::Strict,
                    ..config(&format!("threads-{thread}"))
                })
                .map(|_| ())
                .map_err(|e| e.to_string());
                let _ = tx.send((thread, round, started));
            }
        });
    }
    drop(tx);
    for _ in 0..THREADS * ROUNDS {
        // Generous: a start takes milliseconds; only a deadlock reaches this bound.
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok((thread, round, started)) => {
                assert!(
                    started.is_ok(),
                    "thread {thread} round {round}: {started:?}"
                )
            }
            Err(e) => panic!("sandbox starts did not all finish: {e}"),
        }
    }
}

/// Voluntary context switches of the calling thread so far.
fn own_wakeups() -> u64 {
    let status = std::fs::read_to_string("/proc/thread-self/status").expect("thread status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("voluntary_ctxt_switches")
}

/// The supervisor sleeps until something happens — the command's exit (pidfd), its
/// output, a cancel (the Cancel's eventfd), the deadline — instead of waking on a
/// timer: a quiet command of 1.5 s costs a handful of wakeups, where a 20 ms tick cost
/// more than seventy. A count of wakeups, not a duration.
#[test]
fn the_supervisor_waits_on_events_not_on_a_tick() {
    let ws = workspace();
    let sandbox = strict(config("wakeups"));
    let before = own_wakeups();
    let out = run(&sandbox, &spec(&["sleep", "1.5"], ws.path()));
    let wakeups = own_wakeups() - before;
    eprintln!("a quiet 1.5 s command: {wakeups} wakeups of the supervising thread");
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    assert!(
        wakeups < 40,
        "the supervising thread woke {wakeups} times for a quiet 1.5 s command"
    );

    // A cancel from another thread wakes it at once and kills the sandbox.
    let cancel = Cancel::new();
    let canceller = {
        let cancel = cancel.clone();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let handle = std::thread::spawn(move || {
            let _ = rx.recv();
            cancel.cancel();
        });
        (tx, handle)
    };
    let mut tx = Some(canceller.0);
    let mut on_output = |_: Stream, data: &[u8]| {
        if data.ends_with(b"running\n") {
            tx.take();
        }
    };
    let before = own_wakeups();
    let out = sandbox
        .run(
            &spec(&["sh", "-c", "echo running; exec sleep 100"], ws.path()),
            &mut on_output,
            &cancel,
        )
        .expect("run");
    let wakeups = own_wakeups() - before;
    eprintln!("a cancelled command: {wakeups} wakeups of the supervising thread");
    canceller.1.join().expect("canceller");
    assert!(out.cancelled && !out.timed_out, "{out:?}");
    assert_eq!(out.signal, Some(libc::SIGKILL));
    assert!(wakeups < 40, "{wakeups} wakeups for a cancelled command");
    assert_no_cgroup_left("wakeups");
}

/// The calling process's RLIMIT_NOFILE (soft, hard).
fn own_nofile_limit() -> (u64, u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid out-pointer.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
    (limit.rlim_cur, limit.rlim_max)
}

/// The nice value of this process's main thread (the one its pid names).
fn own_nice() -> i32 {
    // SAFETY: getpid has no preconditions; getpriority only reads.
    let pid = unsafe { libc::getpid() };
    // SAFETY: as above.
    unsafe { libc::getpriority(libc::PRIO_PROCESS, pid.cast_unsigned()) }
}

/// A standard sandbox has the worker's uid and the worker as its parent: the kernel
/// lets a same-uid process change another's limits, priority and scheduling. The
/// command may change its own; naming any other process is refused (but for CPU
/// affinity, which threads set naming themselves by their id).
#[test]
fn standard_commands_cannot_change_other_processes_limits_or_priority() {
    let ws = workspace();
    let sandbox = standard(config("own-process"));
    let (limit, nice) = (own_nofile_limit(), own_nice());
    let out = sh(
        &sandbox,
        ws.path(),
        "for tool in prlimit renice taskset ionice; do command -v $tool >/dev/null || echo \"missing $tool\"; done; \
         prlimit --pid $PPID --nofile=64:64 2>/dev/null && echo prlimit-changed || echo prlimit-refused; \
         renice -n 19 -p $PPID >/dev/null 2>&1 && echo renice-changed || echo renice-refused; \
         taskset -p 1 $$ >/dev/null 2>&1 && echo own-affinity; \
         ionice -c 3 -p $PPID >/dev/null 2>&1 && echo ionice-changed || echo ionice-refused; \
         ulimit -n 100 && echo \"own-limit $(ulimit -n)\"; \
         prlimit --nofile=90:90 sh -c 'echo own-prlimit $(ulimit -n)'; \
         nice -n 5 sh -c 'echo own-nice $(nice)'",
    );
    let (limit_after, nice_after) = (own_nofile_limit(), own_nice());
    // Put this process back (root may raise a hard limit) before judging, so that the
    // other tests of this binary are not run with them.
    if limit_after != limit {
        let restore = libc::rlimit {
            rlim_cur: limit.0,
            rlim_max: limit.1,
        };
        // SAFETY: `restore` is a valid rlimit.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &restore) };
    }
    if nice_after != nice {
        // SAFETY: getpid has no preconditions; setpriority takes integers.
        unsafe {
            libc::setpriority(libc::PRIO_PROCESS, libc::getpid().cast_unsigned(), nice)
        };
    }
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("missing"), "a tool the test needs: {stdout}");
    for expected in [
        "prlimit-refused",
        "renice-refused",
        // Threads pin themselves by their own id (`pthread_setaffinity_np`, OpenMP).
        "own-affinity",
        "ionice-refused",
        "own-limit 100",
        "own-prlimit 90",
        "own-nice 5",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected}: {stdout} {}",
            text(&out.stderr)
        );
    }
    assert_eq!(limit_after, limit, "the command changed the worker's RLIMIT_NOFILE");
    assert_eq!(nice_after, nice, "the command changed the worker's nice value");
    assert_no_cgroup_left("own-process");
}

/// The key of the test's SysV segment ("ARLL").
const SHM_KEY: libc::key_t = 0x4152_4c4c;

/// Whether the host's IPC namespace (this process's) has a segment with [`SHM_KEY`].
fn host_has_shm_segment() -> bool {
    let table = std::fs::read_to_string("/proc/sysvipc/shm")
        .expect("/proc/sysvipc/shm (SysV IPC in the kernel) is needed by this test");
    table
        .lines()
        .skip(1)
        .any(|l| l.split_whitespace().next() == Some(&SHM_KEY.to_string()))
}

/// Removes a segment with [`SHM_KEY`] from the host, if there is one.
fn remove_shm_segment() {
    // SAFETY: shmget and shmctl with integers and a null buffer (IPC_RMID reads none).
    unsafe {
        let id = libc::shmget(SHM_KEY, 0, 0);
        if id >= 0 {
            libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut());
        }
    }
}

/// A standard sandbox shares the host's IPC namespace: a segment it made would outlive
/// the call and be open to the next call of any principal. SysV IPC is refused.
#[test]
fn standard_commands_have_no_sysv_ipc() {
    remove_shm_segment();
    let ws = workspace();
    let sandbox = standard(config("sysv-ipc"));
    let out = run(
        &sandbox,
        &spec(
            &[
                "perl",
                "-e",
                &format!("shmget({SHM_KEY}, 4096, 0600 | 01000) or do {{ print qq($!); exit 3 }}"),
            ],
            ws.path(),
        ),
    );
    let made = host_has_shm_segment();
    remove_shm_segment();
    assert!(!made, "the command's segment outlived it on the host");
    assert_eq!(out.exit_code, Some(3), "{out:?}");
    assert_eq!(text(&out.stdout), "Function not implemented");
    assert_no_cgroup_left("sysv-ipc");
}

/// Every command starts with every signal's default disposition and none blocked, at
/// both levels: the worker ignores SIGPIPE (as Rust programs do), and an ignored
/// signal survives `execve` — a pipeline's writer got EPIPE instead of SIGPIPE.
#[test]
fn commands_start_with_default_signal_dispositions() {
    let ws = workspace();
    for sandbox in [strict(config("signals")), standard(config("signals"))] {
        let level = sandbox.level();
        let out = run(
            &sandbox,
            &spec(&["grep", "-E", "^Sig(Ign|Blk):", "/proc/self/status"], ws.path()),
        );
        let stdout = text(&out.stdout);
        for expected in ["SigIgn:\t0000000000000000", "SigBlk:\t0000000000000000"] {
            assert!(stdout.contains(expected), "{level:?}: missing {expected}: {stdout}");
        }
        let out = run(
            &sandbox,
            &spec(
                &["bash", "-c", "yes | head -1 >/dev/null; echo ${PIPESTATUS[*]}"],
                ws.path(),
            ),
        );
        assert_eq!(
            text(&out.stdout),
            "141 0\n",
            "{level:?}: {}",
            text(&out.stderr)
        );
    }
    assert_no_cgroup_left("signals");
}

/// Takes `caps` out of the calling thread's effective and permitted sets.
fn drop_capabilities(caps: &[u32]) {
    // struct __user_cap_header_struct (version 3) and two __user_cap_data_struct.
    let mut header = [0x2008_0522u32, 0];
    let mut data = [0u32; 6];
    // SAFETY: valid header and data buffers of the kernel's layout.
    let got = unsafe { libc::syscall(libc::SYS_capget, header.as_mut_ptr(), data.as_mut_ptr()) };
    assert_eq!(got, 0, "capget");
    for &cap in caps {
        let (word, bit) = ((cap / 32) as usize, 1u32 << (cap % 32));
        data[3 * word] &= !bit;
        data[3 * word + 1] &= !bit;
    }
    // SAFETY: as above.
    let set = unsafe { libc::syscall(libc::SYS_capset, header.as_mut_ptr(), data.as_ptr()) };
    assert_eq!(set, 0, "capset");
}

/// A standard call's /tmp is a directory of the worker's, removed after the call: a
/// command that made a directory in it unreadable must not leave it behind. Run as a
/// worker that cannot override file modes (root without CAP_DAC_OVERRIDE,
/// CAP_DAC_READ_SEARCH and CAP_FOWNER, as any other uid): capabilities are a thread's,
/// and the call's /tmp is made and removed on the thread that runs the call.
#[test]
fn a_standard_calls_tmp_is_removed_even_when_made_unreadable() {
    let ws = workspace();
    let ws_path = ws.path().to_path_buf();
    let tmp = std::thread::spawn(move || {
        // CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER (linux/capability.h).
        drop_capabilities(&[1, 2, 3]);
        let sandbox = standard(config("call-tmp"));
        let out = sh(
            &sandbox,
            &ws_path,
            "mkdir \"$TMPDIR/d\" && head -c 1000000 /dev/zero > \"$TMPDIR/d/f\" && \
             chmod 000 \"$TMPDIR/d\" && printf %s \"$TMPDIR\"",
        );
        text(&out.stdout)
    })
    .join()
    .expect("the call's thread");
    let left = !tmp.is_empty() && Path::new(&tmp).exists();
    if left {
        // This thread may clean up what the call's could not.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    assert!(tmp.contains("airlock-"), "the call's TMPDIR: {tmp:?}");
    assert!(!left, "{tmp} was left behind");
    assert_no_cgroup_left("call-tmp");
}
