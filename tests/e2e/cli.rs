//! The `airlock` command line as a newcomer meets it: one launcher per data dir, listen
//! flags on `up`, plain-text logs in files, `sandbox run` leaving nothing behind.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::{AIRLOCK, Airlock, descendants, signal};

/// Generous: a launcher that refuses to start does so long before this.
const EXIT_BOUND: Duration = Duration::from_secs(60);

/// Waits for `child` to exit, at most `bound`; kills it (and what it started) after that.
fn wait_bounded(mut child: Child, bound: Duration) -> Option<ExitStatus> {
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    match rx.recv_timeout(bound) {
        Ok(status) => Some(status.expect("wait")),
        Err(_) => {
            let below = descendants(pid);
            signal(pid, rustix::process::Signal::KILL);
            for p in below {
                signal(p, rustix::process::Signal::KILL);
            }
            None
        }
    }
}

/// An `airlock` command with no client or launcher settings from the test's environment.
fn airlock() -> Command {
    airlock_at(Path::new(AIRLOCK))
}

/// The `airlock` binary at `exe`, with no client settings from the test's environment.
fn airlock_at(exe: &Path) -> Command {
    let mut command = Command::new(exe);
    for key in [
        "AIRLOCK_URL",
        "AIRLOCK_TOKEN",
        "AIRLOCK_CONFIG",
        "AIRLOCK_DATA_DIR",
        "AIRLOCK_HTTP_LISTEN",
        "AIRLOCK_GRPC_LISTEN",
    ] {
        command.env_remove(key);
    }
    command.stdin(Stdio::null());
    command
}

/// Runs a command to completion within [`EXIT_BOUND`].
fn run_bounded(command: &mut Command) -> Output {
    let child = command
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
            signal(pid, rustix::process::Signal::KILL);
            panic!("airlock did not finish within {} s", EXIT_BOUND.as_secs());
        }
    }
}

#[tokio::test]
async fn a_second_up_on_the_same_data_dir_refuses_and_leaves_the_first_alone() {
    let first = Airlock::start().await;
    let endpoints = first.data_dir().join("endpoints.json");
    let before = std::fs::read(&endpoints).expect("the first's endpoints.json");

    let log = first.dir.path().join("second.log");
    let second = airlock()
        .args(["up", "--data-dir"])
        .arg(first.data_dir())
        .arg("--config")
        .arg(first.dir.path().join("airlock.toml"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("spawn the second airlock up");
    let status = wait_bounded(second, EXIT_BOUND);
    let message = std::fs::read_to_string(&log).unwrap_or_default();
    let status = status.unwrap_or_else(|| {
        panic!("the second airlock up kept running on a data dir in use:\n{message}")
    });

    assert!(!status.success(), "{status}\n{message}");
    assert!(message.contains("already running"), "{message}");
    assert!(
        message.contains(&first.data_dir().display().to_string()),
        "the message names the data dir: {message}"
    );
    assert!(
        message.contains(&format!("pid {}", first.pid())),
        "the message names the running launcher: {message}"
    );
    assert_eq!(
        std::fs::read(&endpoints).expect("the first's endpoints.json is still there"),
        before
    );

    // The first still serves, through its own workers' sockets.
    first.wait_ready().await;
    let (is_error, text, _) = first
        .call(
            "write_file",
            json!({"path": "still.txt", "content": "here"}),
        )
        .await;
    assert!(!is_error, "{text}");
    let (is_error, text, _) = first
        .call("execute_shell", json!({"command": "cat still.txt"}))
        .await;
    assert!(!is_error, "{text}");
    let result: Value = serde_json::from_str(&text).expect("JSON result");
    assert_eq!(result["stdout"], "here");
}

/// `airlock up` started by hand, stopped on drop.
struct Up {
    child: Option<Child>,
    log: PathBuf,
}

impl Up {
    fn start(dir: &Path, args: &[&str]) -> Self {
        Self::start_with(airlock(), dir, args)
    }

    /// `command up <args>`, its log in `dir/up.log`.
    fn start_with(mut command: Command, dir: &Path, args: &[&str]) -> Self {
        let log = dir.join("up.log");
        let child = command
            .arg("up")
            .args(args)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn airlock up");
        Self {
            child: Some(child),
            log,
        }
    }

    /// Waits (bounded) for `endpoints.json` in `data_dir`.
    async fn endpoints(&mut self, data_dir: &Path) -> Value {
        let child = self.child.as_mut().expect("running");
        crate::support::wait_for_endpoints(&data_dir.join("endpoints.json"), child, &self.log).await
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Some(child) = self.child.take() {
            let pid = child.id();
            signal(pid, rustix::process::Signal::TERM);
            if wait_bounded(child, Duration::from_secs(30)).is_none() {
                eprintln!("airlock up did not stop on SIGTERM; killed");
            }
        }
    }
}

#[tokio::test]
async fn up_listen_flags_override_the_config() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("airlock.toml");
    // Addresses nothing can bind: unless the flags win, the orchestrator cannot start.
    std::fs::write(
        &config,
        "[orchestrator]\nhttp_listen = \"not-an-address\"\ngrpc_listen = \"not-an-address\"\n",
    )
    .expect("config");
    let data_dir = dir.path().join("data");
    // Other loopback addresses than 127.0.0.1, so the endpoints can only come from the
    // flags; port 0 still lets the launcher pick free ports.
    let mut up = Up::start(
        dir.path(),
        &[
            "--config",
            config.to_str().expect("utf-8 path"),
            "--data-dir",
            data_dir.to_str().expect("utf-8 path"),
            "--http-listen",
            "127.0.0.2:0",
            "--grpc-listen",
            "127.0.0.3:0",
        ],
    );
    let endpoints = up.endpoints(&data_dir).await;
    let http = endpoints["http"].as_str().expect("http endpoint");
    let grpc = endpoints["grpc"].as_str().expect("grpc endpoint");
    assert!(http.starts_with("http://127.0.0.2:"), "{endpoints}");
    assert!(grpc.contains("127.0.0.3:"), "{endpoints}");
    let status = reqwest::get(format!("{http}/healthz"))
        .await
        .expect("healthz")
        .status();
    assert_eq!(status, 200);
}

#[tokio::test]
async fn logs_written_to_a_file_have_no_colour_codes() {
    let airlock = Airlock::start().await;
    // A call, so the workers log too.
    let (is_error, text, _) = airlock
        .call("execute_shell", json!({"command": "echo hi"}))
        .await;
    assert!(!is_error, "{text}");
    let log = airlock.log();
    assert!(log.contains("INFO"), "the log has lines to check:\n{log}");
    assert!(
        !log.contains('\u{1b}'),
        "ANSI escape codes in a log file:\n{log}"
    );
}

/// The start-up lines of `component`'s async runtime in an `airlock up` log.
fn runtime_lines(log: &str, component: &str) -> Vec<String> {
    let field = format!("component=\"{component}\"");
    log.lines()
        .filter(|l| l.contains("async runtime started") && l.contains(&field))
        .map(str::to_owned)
        .collect()
}

/// The orchestrator's async threads: one per CPU by default, `[orchestrator]
/// async_threads` when set (read back from the runtime itself, in its start-up line), and
/// a value that would leave it no thread refused before anything starts.
#[tokio::test]
async fn the_orchestrator_runs_on_the_async_threads_it_is_given() {
    let started = |log: &str| runtime_lines(log, "orchestrator");
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let airlock = Airlock::start().await;
    let lines = started(&airlock.log());
    assert!(
        lines.len() == 1 && lines[0].contains(&format!("async_threads={cpus} cpus={cpus}")),
        "expected one start-up line with async_threads={cpus} cpus={cpus}:\n{}",
        airlock.log()
    );
    drop(airlock);

    // Lands in `[orchestrator]`, right after its listen addresses.
    let airlock = Airlock::start_with("async_threads = 3\n").await;
    let (is_error, text, _) = airlock
        .call("execute_shell", json!({"command": "echo hi"}))
        .await;
    assert!(!is_error && text.contains("hi"), "{text}");
    let lines = started(&airlock.log());
    assert!(
        lines.len() == 1 && lines[0].contains("async_threads=3 "),
        "expected async_threads=3:\n{}",
        airlock.log()
    );
    drop(airlock);

    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("airlock.toml");
    std::fs::write(&config, "[orchestrator]\nasync_threads = 0\n").expect("config");
    let text = crate::support::up_refused(&config, &dir.path().join("data"));
    assert!(
        text.contains("async_threads = 0 is not between 1 and 256"),
        "the refusal names the key and its range:\n{text}"
    );
    assert!(
        !dir.path().join("data").join("endpoints.json").exists(),
        "nothing was started"
    );
}

/// `airlock up` (root here) refuses a data dir another user owns or others may write to:
/// such a user could plant `airlock.lock` (truncated, then written) or the token file as
/// a link to a file of root's. Each attempt is refused naming the cause, and the file the
/// link points to is unchanged.
#[test]
fn up_refuses_a_data_dir_others_can_plant_links_in() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test plants links as another user and needs root (CI runs as root)"
    );
    let scratch = tempfile::tempdir().expect("temp dir");
    let config = scratch.path().join("airlock.toml");
    std::fs::write(&config, "").expect("config");
    let victim = scratch.path().join("victim");
    std::fs::write(&victim, "root's data\n").expect("victim");
    let cases: [(&str, u32, u32, &str); 2] = [
        ("owned-by-nobody", 65534, 0o700, "belongs to uid 65534"),
        (
            "world-writable",
            0,
            0o777,
            "may be written by others (mode 777)",
        ),
    ];
    for (name, uid, mode, expected) in cases {
        let data = scratch.path().join(name);
        std::fs::create_dir(&data).expect("data dir");
        for planted in ["airlock.lock", "token"] {
            std::os::unix::fs::symlink(&victim, data.join(planted)).expect("plant");
        }
        std::os::unix::fs::lchown(&data, Some(uid), Some(uid)).expect("chown");
        std::fs::set_permissions(&data, std::os::unix::fs::PermissionsExt::from_mode(mode))
            .expect("chmod");
        let text = crate::support::up_refused(&config, &data);
        assert!(text.contains(expected), "{name}: {text}");
        assert_eq!(
            std::fs::read_to_string(&victim).expect("victim"),
            "root's data\n",
            "{name}: the planted link was followed"
        );
        assert!(
            !data.join("endpoints.json").exists(),
            "{name}: nothing started"
        );
    }
}

/// A cgroup with a CPU quota of half a CPU (a pod's `limits.cpu: 500m`), on the cgroup v1
/// `cpu` hierarchy or a v2 hierarchy with the `cpu` controller; removed when dropped.
struct HalfCpu {
    dir: PathBuf,
}

impl HalfCpu {
    fn new() -> Self {
        let name = format!("airlock-e2e-quota-{}", std::process::id());
        for mount in crate::support::cgroup_mounts() {
            let mount_point = mount.mount_point.as_path();
            let quota: &[(&str, &str)] = if !mount.v2 && mount.options.iter().any(|o| o == "cpu") {
                &[
                    ("cpu.cfs_period_us", "100000"),
                    ("cpu.cfs_quota_us", "50000"),
                ]
            } else if mount.v2
                && std::fs::read_to_string(mount_point.join("cgroup.subtree_control"))
                    .is_ok_and(|c| c.split_whitespace().any(|c| c == "cpu"))
            {
                &[("cpu.max", "50000 100000")]
            } else {
                continue;
            };
            let dir = mount_point.join(&name);
            std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
            let half = HalfCpu { dir };
            for (file, value) in quota {
                std::fs::write(half.dir.join(file), value)
                    .unwrap_or_else(|e| panic!("write {value} to {file}: {e}"));
            }
            return half;
        }
        panic!(
            "this host has no cgroup hierarchy with the cpu controller (v1 `cpu`, or v2 with \
             `cpu` in the root's cgroup.subtree_control): the CPU quota cannot be tested"
        );
    }
}

impl Drop for HalfCpu {
    fn drop(&mut self) {
        // The launcher and its components are gone by now; their last exit may lag.
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("could not remove {}", self.dir.display());
    }
}

/// A CPU quota is a CPU count: under half a CPU (a pod's CPU limit), the orchestrator and
/// the http worker count one CPU, not the host's, and run one async thread each. They
/// read the quota before they confine themselves, after which /proc and /sys are out of
/// their reach (built after it, as before, both runtimes counted the host's CPUs).
#[tokio::test]
async fn the_default_async_threads_follow_the_cgroup_cpu_quota() {
    let host_cpus = std::thread::available_parallelism().map_or(1, usize::from);
    assert!(
        host_cpus >= 2,
        "this test needs at least 2 CPUs to tell a quota of half a CPU from the host's count"
    );
    let half = HalfCpu::new();
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("airlock.toml");
    std::fs::write(
        &config,
        "[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n",
    )
    .expect("config");
    let log_path = dir.path().join("airlock.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    // The launcher starts inside the cgroup; its components inherit it.
    let child = Command::new("sh")
        .arg("-c")
        .arg("echo $$ > \"$0/cgroup.procs\" && shift && exec \"$@\"")
        .arg(&half.dir)
        .arg("--")
        .arg(AIRLOCK)
        .args(["up", "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn airlock up");
    // The orchestrator's runtime, and the http worker's (one async thread per CPU).
    let components = ["orchestrator", "http worker"];
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let lines = loop {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let lines: Vec<Vec<String>> = components.iter().map(|c| runtime_lines(&text, c)).collect();
        if lines.iter().all(|l| !l.is_empty()) {
            break lines;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the orchestrator and the http worker did not start within 60 s:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    signal(child.id(), rustix::process::Signal::TERM);
    assert!(
        wait_bounded(child, EXIT_BOUND).is_some(),
        "airlock up did not stop on SIGTERM"
    );
    for (component, lines) in components.iter().zip(&lines) {
        assert!(
            lines.len() == 1 && lines[0].contains("async_threads=1 cpus=1"),
            "under half a CPU the {component} should count one CPU (the host has \
             {host_cpus}): {lines:?}"
        );
    }
    drop(half);
}

/// `airlock sandbox run` started from a terminal (a pseudo-terminal made by
/// util-linux's `script`): the sandboxed command has no controlling terminal at either
/// level, so it cannot open `/dev/tty` to push input into the user's terminal (TIOCSTI)
/// or read what is typed there — bubblewrap's CVE-2017-5226.
#[test]
fn a_sandboxed_command_cannot_reach_the_terminal_it_was_started_from() {
    assert!(
        Command::new("script")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success()),
        "this test needs util-linux's `script` (Debian: bsdutils) for a pseudo-terminal"
    );
    let probe = "( exec 3<>/dev/tty ) 2>/dev/null && echo TTY-OPENED || echo TTY-REFUSED";
    for profile in ["strict", "standard"] {
        let inner = format!("{AIRLOCK} sandbox run --profile {profile} -- sh -c '{probe}'");
        let mut command = Command::new("script");
        command
            .args(["-q", "-e", "-c", &inner, "/dev/null"])
            .stdin(Stdio::null());
        let output = run_bounded(&mut command);
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "{profile}: script (util-linux) ran {inner}: {}\n{stdout}\n{stderr}",
            output.status
        );
        // The terminal is there for airlock itself: the probe outside the sandbox opens it.
        assert!(
            stdout.contains("TTY-REFUSED"),
            "{profile}: {stdout}\n{stderr}"
        );
        assert!(!stdout.contains("TTY-OPENED"), "{profile}: {stdout}");
    }
    let control = run_bounded(
        Command::new("script")
            .args(["-q", "-e", "-c", &format!("sh -c '{probe}'"), "/dev/null"])
            .stdin(Stdio::null()),
    );
    assert!(
        String::from_utf8_lossy(&control.stdout).contains("TTY-OPENED"),
        "outside the sandbox the pseudo-terminal is the controlling terminal: {}",
        String::from_utf8_lossy(&control.stdout)
    );
}

#[test]
fn sandbox_run_without_a_data_dir_leaves_nothing_behind() {
    let dir = tempfile::tempdir().expect("temp dir");
    let home = dir.path().join("home");
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&home).expect("home");
    std::fs::create_dir(&tmp).expect("tmp");

    let output = run_bounded(
        airlock()
            .args([
                "sandbox",
                "run",
                "--",
                "sh",
                "-c",
                "echo kept > marker; pwd",
            ])
            .env("HOME", &home)
            .env("TMPDIR", &tmp),
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{}\n{stderr}", output.status);
    assert!(
        !String::from_utf8_lossy(&output.stdout).trim().is_empty(),
        "{stderr}"
    );
    assert!(stderr.contains("airlock sandbox report"), "{stderr}");
    assert!(
        !home.join(".airlock").exists(),
        "sandbox run wrote into HOME/.airlock"
    );
    let left: Vec<_> = std::fs::read_dir(&tmp)
        .expect("read tmp")
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "temporary workspace left behind: {left:?}");
}

#[test]
fn sandbox_run_with_a_data_dir_uses_its_workspaces() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let output = run_bounded(
        airlock()
            .args(["sandbox", "run", "--data-dir"])
            .arg(&data_dir)
            .args(["--", "sh", "-c", "echo kept > marker"])
            .env("HOME", dir.path()),
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let marker = data_dir.join("workspaces/local/sandbox-run/marker");
    assert_eq!(
        std::fs::read_to_string(&marker).expect("the marker in the named workspace"),
        "kept\n"
    );
}

/// `airlock certs init`: the files DESIGN §9 names, keys private, each certificate
/// valid for its own name and the `--san`s meant for it — a plain one for the
/// orchestrator, `COMPONENT=NAME` for that component — and for no other's, as a third
/// party (OpenSSL) checks them.
#[test]
fn certs_init_writes_a_ca_and_component_certificates_that_openssl_accepts() {
    assert!(
        Command::new("openssl")
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "this test checks the certificates with openssl (Debian: openssl)"
    );
    let scratch = tempfile::tempdir().expect("temp dir");
    let out = scratch.path().join("pki");
    let run = |extra: &[&str]| {
        Command::new(AIRLOCK)
            .args(["certs", "init", "--out"])
            .arg(&out)
            .args(extra)
            .output()
            .expect("run airlock certs init")
    };
    let first = run(&[
        "--san",
        "airlock.internal",
        "--san",
        "10.0.0.7",
        "--san",
        "worker-fs=fs-1.internal",
    ]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let listed = String::from_utf8_lossy(&first.stdout).into_owned();
    let components = [
        "orchestrator",
        "worker-shell",
        "worker-fs",
        "worker-http",
        "worker-db",
    ];
    for name in std::iter::once("ca").chain(components) {
        for ext in ["crt", "key"] {
            let file = out.join(format!("{name}.{ext}"));
            assert!(listed.contains(&file.display().to_string()), "{listed}");
            let mode = std::os::unix::fs::PermissionsExt::mode(
                &std::fs::metadata(&file).expect("written").permissions(),
            ) & 0o777;
            assert_eq!(
                mode,
                if ext == "key" { 0o600 } else { 0o644 },
                "{}",
                file.display()
            );
        }
    }
    let ca = out.join("ca.crt");
    for component in components {
        let cert = out.join(format!("{component}.crt"));
        for purpose in ["sslserver", "sslclient"] {
            let verify = Command::new("openssl")
                .args(["verify", "-purpose", purpose, "-CAfile"])
                .arg(&ca)
                .arg(&cert)
                .output()
                .expect("openssl verify");
            assert!(
                verify.status.success(),
                "{component} ({purpose}): {}{}",
                String::from_utf8_lossy(&verify.stdout),
                String::from_utf8_lossy(&verify.stderr)
            );
        }
        let text = Command::new("openssl")
            .args(["x509", "-noout", "-ext", "subjectAltName", "-in"])
            .arg(&cert)
            .output()
            .expect("openssl x509");
        let sans = String::from_utf8_lossy(&text.stdout).into_owned();
        assert!(
            sans.contains(&format!("DNS:{component}")),
            "{component}: its own name in {sans}"
        );
        for (owner, needle) in [
            ("orchestrator", "DNS:airlock.internal"),
            ("orchestrator", "IP Address:10.0.0.7"),
            ("worker-fs", "DNS:fs-1.internal"),
        ] {
            assert_eq!(
                sans.contains(needle),
                component == owner,
                "{component}: {needle} belongs to {owner}'s certificate alone: {sans}"
            );
        }
        // No other component's name either: each key passes for one component only.
        for other in components.iter().filter(|c| **c != component) {
            assert!(
                !sans.contains(&format!("DNS:{other}")),
                "{component}: {other} in {sans}"
            );
        }
    }
    // A second run changes nothing and says why.
    let key = std::fs::read(out.join("ca.key")).expect("ca.key");
    let second = run(&[]);
    assert!(!second.status.success());
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(stderr.contains("never overwrites"), "{stderr}");
    assert_eq!(std::fs::read(out.join("ca.key")).expect("ca.key"), key);
}

/// The binary starts for every component and every `airlock sandbox run`: its relative
/// relocations are packed (a `DT_RELR` table of a few kilobytes instead of 1.7 MB of
/// `RELA` entries for the loader to read), and it stays position-independent.
#[test]
fn the_binary_packs_its_relative_relocations_and_stays_position_independent() {
    let elf = std::fs::read(AIRLOCK).expect("read the airlock binary");
    let u16_at = |at: usize| u16::from_le_bytes(elf[at..at + 2].try_into().expect("2 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(elf[at..at + 8].try_into().expect("8 bytes"));
    assert_eq!(&elf[..5], b"\x7fELF\x02", "a 64-bit ELF file");
    const ET_DYN: u16 = 3;
    assert_eq!(u16_at(0x10), ET_DYN, "position-independent (ET_DYN)");
    let (phoff, phentsize, phnum) = (u64_at(0x20) as usize, u16_at(0x36), u16_at(0x38));
    const PT_DYNAMIC: u32 = 2;
    let dynamic = (0..usize::from(phnum))
        .map(|i| phoff + i * usize::from(phentsize))
        .find(|&ph| u32::from_le_bytes(elf[ph..ph + 4].try_into().expect("4 bytes")) == PT_DYNAMIC)
        .map(|ph| (u64_at(ph + 0x08) as usize, u64_at(ph + 0x20) as usize))
        .expect("a dynamic segment");
    let tags: Vec<u64> = (dynamic.0..dynamic.0 + dynamic.1)
        .step_by(16)
        .map(u64_at)
        .take_while(|tag| *tag != 0)
        .collect();
    const DT_RELR: u64 = 36;
    const DT_RELACOUNT: u64 = 0x6fff_fff9;
    assert!(tags.contains(&DT_RELR), "no DT_RELR among {tags:x?}");
    let relacount = (dynamic.0..dynamic.0 + dynamic.1)
        .step_by(16)
        .find(|at| u64_at(*at) == DT_RELACOUNT)
        .map_or(0, |at| u64_at(at + 8));
    assert!(
        relacount < 1000,
        "{relacount} relative relocations left unpacked"
    );
}

/// A component that cannot be started again (its binary replaced or removed by an
/// upgrade under a running `airlock up`) stops the others in order — drained, their
/// sockets and `endpoints.json` removed — and `airlock up` exits saying which one,
/// rather than dying with its children killed on the way out.
#[tokio::test]
async fn a_component_that_cannot_restart_stops_airlock_up_in_order() {
    let dir = tempfile::tempdir().expect("temp dir");
    let exe = dir.path().join("airlock");
    std::fs::copy(AIRLOCK, &exe).expect("copy the binary");
    let config = dir.path().join("airlock.toml");
    std::fs::write(
        &config,
        "[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n",
    )
    .expect("config");
    let data = dir.path().join("data");
    let (config, data_arg) = (config.display().to_string(), data.display().to_string());
    let mut up = Up::start_with(
        airlock_at(&exe),
        dir.path(),
        &["--config", &config, "--data-dir", &data_arg],
    );
    up.endpoints(&data).await;
    let child = up.child.take().expect("running");
    let fs_worker = descendants(child.id())
        .into_iter()
        .find(|p| crate::support::cmdline(*p).contains("serve worker fs"))
        .expect("the fs worker");
    std::fs::remove_file(&exe).expect("remove the binary");
    signal(fs_worker, rustix::process::Signal::KILL);
    let status = wait_bounded(child, EXIT_BOUND).expect("airlock up exits");
    let text = std::fs::read_to_string(&up.log).unwrap_or_default();
    assert!(!status.success(), "{text}");
    assert!(text.contains("cannot restart the fs worker"), "{text}");
    let sockets: Vec<_> = std::fs::read_dir(data.join("sockets"))
        .map(|entries| entries.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(sockets.is_empty(), "sockets left behind: {sockets:?}");
    assert!(
        !data.join("endpoints.json").exists(),
        "endpoints.json left behind"
    );
}
