//! The adversarial suite: escape and abuse attempts through `execute_shell`, driven
//! through a real `airlock up` exactly as a model would drive it. Every attempt asserts
//! that it failed in the expected way (errno, message, exit status or signal) and then
//! that the host is unchanged: canary files outside the workspace, host files and
//! directory mtimes, host sysctls and mounts, no file named after the test's marker in
//! host directories, no process carrying the marker anywhere on the host, the launcher's
//! process tree back to its baseline, and no per-call cgroup of this instance's shell
//! worker left in any hierarchy.
//!
//! Raw system calls go through `perl -e 'syscall(...)'` with the host's `libc::SYS_*`
//! numbers; sockets through perl's `socket`.

use std::collections::BTreeSet;
use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{Value, json};

#[path = "../support/cgroups.rs"]
mod cgroups;

use crate::ordinary_user::{Delegation, OrdinaryUser};
use crate::support::{Airlock, alive, cmdline, descendants, snapshot};

const SECRET: &str = "ADVERSARIAL-CANARY-3f9c1e";
const SESSION: &str = "adv";
/// The default `[sandbox]` limits the assertions rely on.
const PIDS_MAX: u64 = 256;
const MEMORY_MAX: u64 = 512 << 20;
const NOFILE: u64 = 1024;
const MODEL_OUTPUT_BYTES: usize = 64 << 10;

/// Host files whose content and mtime must never change.
const HOST_FILES: [&str; 7] = [
    "/etc/passwd",
    "/etc/shadow",
    "/etc/group",
    "/etc/hosts",
    "/etc/hostname",
    "/etc/resolv.conf",
    "/usr/bin/su",
];
/// Host directories whose mtime must never change (an entry added or removed).
const HOST_DIRS: [&str; 4] = ["/", "/etc", "/usr", "/home"];
/// Host directories that must never hold an entry named after the marker.
const MARKER_DIRS: [&str; 7] = [
    "/", "/tmp", "/etc", "/usr", "/usr/bin", "/var/tmp", "/dev/shm",
];
/// Host kernel knobs that must keep their values.
const SYSCTLS: [&str; 8] = [
    "/proc/sys/kernel/core_pattern",
    "/proc/sys/kernel/hostname",
    "/proc/sys/kernel/domainname",
    "/proc/sys/kernel/randomize_va_space",
    "/proc/sys/kernel/kptr_restrict",
    "/proc/sys/kernel/dmesg_restrict",
    "/proc/sys/net/ipv4/ip_forward",
    "/proc/sys/vm/overcommit_memory",
];
/// Top-level directories of the host that the sandbox's root must not show.
const HOST_ONLY_ROOT_DIRS: [&str; 9] = [
    "home", "root", "var", "work", "boot", "opt", "srv", "mnt", "run",
];

/// One `execute_shell` result.
struct Outcome {
    is_error: bool,
    result: Value,
    call: Value,
}

impl Outcome {
    fn stdout(&self) -> &str {
        self.result["stdout"].as_str().unwrap_or_default()
    }
    fn stderr(&self) -> &str {
        self.result["stderr"].as_str().unwrap_or_default()
    }
    fn exit_code(&self) -> Option<i64> {
        self.result["exit_code"].as_i64()
    }
    fn signal(&self) -> Option<i64> {
        self.result["signal"].as_i64()
    }
    fn timed_out(&self) -> bool {
        self.result["timed_out"].as_bool().expect("timed_out")
    }
    fn stdout_lines(&self) -> BTreeSet<&str> {
        self.stdout().lines().collect()
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cut = |s: &str| s.chars().take(2000).collect::<String>();
        write!(
            f,
            "is_error={} exit_code={:?} signal={:?} timed_out={} status={}\n--- stdout\n{}\n--- stderr\n{}",
            self.is_error,
            self.exit_code(),
            self.signal(),
            self.result["timed_out"],
            self.call["status"],
            cut(self.stdout()),
            cut(self.stderr()),
        )
    }
}

/// A host file's content and mtime, or its absence.
type FileState = Option<(Vec<u8>, SystemTime)>;

/// What must stay identical on the host.
struct HostState {
    canaries: Vec<(PathBuf, Vec<u8>, SystemTime)>,
    files: Vec<(String, FileState)>,
    dirs: Vec<(String, Option<SystemTime>)>,
    sysctls: Vec<(String, Option<String>)>,
    mounts: String,
}

impl HostState {
    fn capture(canary_roots: &[PathBuf]) -> Self {
        HostState {
            canaries: canary_roots.iter().flat_map(|r| snapshot(r)).collect(),
            files: HOST_FILES
                .iter()
                .map(|f| {
                    let state = std::fs::read(f).ok().map(|content| {
                        (
                            content,
                            std::fs::metadata(f)
                                .and_then(|m| m.modified())
                                .expect("mtime"),
                        )
                    });
                    ((*f).to_owned(), state)
                })
                .collect(),
            dirs: HOST_DIRS
                .iter()
                .map(|d| {
                    (
                        (*d).to_owned(),
                        std::fs::metadata(d).and_then(|m| m.modified()).ok(),
                    )
                })
                .collect(),
            sysctls: SYSCTLS
                .iter()
                .map(|s| ((*s).to_owned(), std::fs::read_to_string(s).ok()))
                .collect(),
            mounts: host_mounts(),
        }
    }

    /// Names what differs (never the contents: some are secrets).
    fn differences(&self, now: &HostState) -> Vec<String> {
        let mut out = Vec::new();
        if self.canaries != now.canaries {
            out.push(format!(
                "canary files outside the workspace changed: {:?} -> {:?}",
                self.canaries.iter().map(|c| &c.0).collect::<Vec<_>>(),
                now.canaries.iter().map(|c| &c.0).collect::<Vec<_>>()
            ));
        }
        for (before, after) in self.files.iter().zip(&now.files) {
            if before != after {
                out.push(format!("host file {} changed (content or mtime)", before.0));
            }
        }
        for (before, after) in self.dirs.iter().zip(&now.dirs) {
            if before != after {
                out.push(format!(
                    "host directory {} changed: {:?} -> {:?}",
                    before.0, before.1, after.1
                ));
            }
        }
        for (before, after) in self.sysctls.iter().zip(&now.sysctls) {
            if before != after {
                out.push(format!(
                    "host sysctl {} changed: {:?} -> {:?}",
                    before.0, before.1, after.1
                ));
            }
        }
        if self.mounts != now.mounts {
            out.push(format!(
                "host mount table changed:\n{}\n->\n{}",
                self.mounts, now.mounts
            ));
        }
        out
    }
}

/// Who runs the `airlock up` under attack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Runner {
    Root,
    /// An ordinary user (no capabilities, a bounding set it cannot drop) with a
    /// delegated cgroup subtree: what a laptop user gets.
    OrdinaryUser,
}

/// One `airlock up` under attack, with the host's baseline.
struct Lab {
    airlock: Airlock,
    /// The cgroup subtree root delegated to the ordinary user the lab runs as, if any;
    /// dropped after `airlock`.
    _delegation: Option<Delegation>,
    /// The host uid the workers (and so the sandboxes' root) run as.
    worker_uid: u32,
    /// Unique to this lab: attempts name files and processes after it.
    marker: String,
    canary_roots: Vec<PathBuf>,
    launcher: u32,
    orchestrator: u32,
    shell_worker: u32,
    fs_worker: u32,
    tree: BTreeSet<u32>,
    baseline: HostState,
}

impl Lab {
    async fn start(tag: &str, extra_config: &str) -> Lab {
        Lab::start_for(tag, extra_config, Runner::Root).await
    }

    async fn start_for(tag: &str, extra_config: &str, runner: Runner) -> Lab {
        // Approvals off (DESIGN §3: `[]` for a sandbox-only deployment): every attempt
        // reaches the sandbox without a human in the loop.
        let config = format!("[approvals]\ntools = []\n{extra_config}");
        let (airlock, delegation, worker_uid) = match runner {
            Runner::Root => (Airlock::start_with(&config).await, None, 0),
            Runner::OrdinaryUser => {
                // Strict isolation for an ordinary user: in a cgroup subtree that root
                // delegated to it, as an administrator would.
                let user = OrdinaryUser::get();
                let delegation = Delegation::new(user, tag);
                let config = format!(
                    "{config}\n[sandbox]\ncgroup_parent = \"{}\"\n",
                    delegation.cgroup_parent
                );
                let airlock = Airlock::start_as(user, Some(&delegation), &config).await;
                (airlock, Some(delegation), user.uid)
            }
        };
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .expect("clock")
            .subsec_nanos();
        let marker = format!("advx{tag}{}n{nanos}", std::process::id());
        // A first call creates the session's workspace and the worker's cgroup parents.
        let warm = run_shell(&airlock, SESSION, "warm-up", json!({"command": "true"})).await;
        assert_eq!(warm.exit_code(), Some(0), "warm-up: {warm}");

        let launcher = airlock.pid();
        let find = |what: &str| {
            let procs: Vec<(u32, String)> = descendants(launcher)
                .into_iter()
                .map(|p| (p, cmdline(p)))
                .collect();
            procs
                .iter()
                .find(|(_, c)| c.contains(what))
                .map(|(p, _)| *p)
                .unwrap_or_else(|| panic!("no `{what}` process below the launcher: {procs:?}"))
        };
        let orchestrator = find("serve orchestrator");
        let shell_worker = find("serve worker shell");
        let fs_worker = find("serve worker fs");

        // Canaries: beside the workspaces in the data dir, and beside the data dir.
        let mut canary_roots = Vec::new();
        for root in [
            airlock.data_dir().join("canary"),
            airlock.dir.path().join("canary"),
        ] {
            std::fs::create_dir_all(root.join("sub")).expect("canary dir");
            std::fs::write(root.join("secret.txt"), SECRET).expect("canary");
            std::fs::write(root.join("sub/nested.txt"), SECRET).expect("canary");
            canary_roots.push(root);
        }
        // Other tests of this binary create the ordinary test user (useradd writes
        // /etc/passwd): it exists before the baseline, so that only what an attempt does
        // can change the host.
        OrdinaryUser::get();
        // The warm-up's sandbox is torn down after its answer (the worker's reaper): the
        // baseline is taken once nothing of it is left, or a process about to go would
        // count as part of the host and be "missing" after every attempt. Its cgroups
        // are removed after its init is reaped, so none left means all of it is gone.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = call_cgroups(shell_worker);
            if left.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the warm-up's sandbox was not torn down: {left:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let baseline = HostState::capture(&canary_roots);
        let tree = lasting_tree(launcher, shell_worker);
        Lab {
            airlock,
            _delegation: delegation,
            worker_uid,
            marker,
            canary_roots,
            launcher,
            orchestrator,
            shell_worker,
            fs_worker,
            tree,
            baseline,
        }
    }

    /// Runs one `execute_shell` call and checks the host afterwards.
    async fn attempt_in(&self, session: &str, what: &str, input: Value) -> Outcome {
        let outcome = run_shell(&self.airlock, session, what, input).await;
        self.assert_host_unchanged(what).await;
        outcome
    }

    async fn attempt(&self, what: &str, input: Value) -> Outcome {
        self.attempt_in(SESSION, what, input).await
    }

    /// `command` through `/bin/sh -c` in the default session, with `@M` replaced by the
    /// marker.
    async fn sh(&self, what: &str, command: &str) -> Outcome {
        self.attempt(
            what,
            json!({"command": command.replace("@M", &self.marker)}),
        )
        .await
    }

    /// A raw system call through perl; returns what it printed (`errno=N` or `ret=R`).
    async fn syscall(&self, what: &str, prelude: &str, call: &str) -> Outcome {
        let script = format!(
            "{prelude} $! = 0; my $r = syscall({call}); print $r == -1 ? \"errno=\" . ($!+0) : \"ret=$r\", \"\\n\"; # @M"
        );
        self.attempt(
            what,
            json!({"argv": ["perl", "-e", script.replace("@M", &self.marker)]}),
        )
        .await
    }

    async fn expect_errno(&self, what: &str, prelude: &str, call: &str, errno: i32) {
        let out = self.syscall(what, prelude, call).await;
        assert_eq!(out.stdout(), format!("errno={errno}\n"), "{what}: {out}");
    }

    /// A socket of this family/type through perl; returns what it printed.
    async fn expect_socket_denied(&self, what: &str, family: i32, kind: i32, protocol: i32) {
        let script = format!(
            "socket(my $s, {family}, {kind}, {protocol}) ? print \"created\\n\" : print \"errno=\", $!+0, \"\\n\"; # {}",
            self.marker
        );
        let out = self
            .attempt(what, json!({"argv": ["perl", "-e", script]}))
            .await;
        assert_eq!(
            out.stdout(),
            format!("errno={}\n", libc::EPERM),
            "{what}: {out}"
        );
    }

    /// Whatever an attempt did, the host looks as it did before it.
    async fn assert_host_unchanged(&self, what: &str) {
        let differences = self
            .baseline
            .differences(&HostState::capture(&self.canary_roots));
        assert!(
            differences.is_empty(),
            "{what}: the host changed:\n{}",
            differences.join("\n")
        );
        for dir in MARKER_DIRS {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                assert!(
                    !name.contains(&self.marker),
                    "{what}: {dir}/{name} appeared on the host"
                );
            }
        }
        for (pid, name) in [
            (self.launcher, "launcher"),
            (self.orchestrator, "orchestrator"),
            (self.shell_worker, "shell worker"),
            (self.fs_worker, "fs worker"),
        ] {
            assert!(
                alive(pid),
                "{what}: the {name} (pid {pid}) is gone:\n{}",
                self.airlock.log()
            );
        }
        // Processes and cgroups are gone by the time the result is returned; the bounded
        // wait only absorbs the kernel's asynchronous reaping.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut problems = Vec::new();
            let marked = processes_with(&self.marker);
            if !marked.is_empty() {
                problems.push(format!(
                    "processes carrying the marker survive on the host: {marked:?}"
                ));
            }
            let tree = lasting_tree(self.launcher, self.shell_worker);
            if tree != self.tree {
                let extra: Vec<(u32, String)> = tree
                    .difference(&self.tree)
                    .map(|p| (*p, cmdline(*p)))
                    .collect();
                let missing: Vec<&u32> = self.tree.difference(&tree).collect();
                problems.push(format!(
                    "the launcher's process tree changed: extra {extra:?}, missing {missing:?}"
                ));
            }
            let cgroups = call_cgroups(self.shell_worker);
            if !cgroups.is_empty() {
                problems.push(format!("per-call cgroups left behind: {cgroups:?}"));
            }
            if problems.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "{what}: {}", problems.join("\n"));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The sandbox still works after an attack.
    async fn assert_still_serves(&self, what: &str) {
        let out = self.sh(&format!("{what} (next call)"), "echo alive").await;
        assert_eq!(
            out.stdout(),
            "alive\n",
            "{what}: the next call failed: {out}"
        );
    }
}

/// One `execute_shell` call; checks the isolation report of every result.
async fn run_shell(airlock: &Airlock, session: &str, what: &str, input: Value) -> Outcome {
    let (is_error, text, call) = airlock.call_in(session, "execute_shell", input).await;
    let result: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{what}: execute_shell did not run the command ({e}): {text}"));
    let isolation = &result["isolation"];
    assert_eq!(isolation["level"], "strict", "{what}: {isolation}");
    assert_eq!(isolation["seccomp"], "filter", "{what}: {isolation}");
    assert_eq!(isolation["network"], "none", "{what}: {isolation}");
    assert_eq!(isolation["no_new_privs"], true, "{what}: {isolation}");
    assert!(
        call.get("isolation").is_some(),
        "{what}: calls[0].isolation is missing: {call}"
    );
    assert_eq!(
        &call["isolation"], isolation,
        "{what}: calls[0].isolation differs from the result's"
    );
    Outcome {
        is_error,
        result,
        call,
    }
}

/// Every process on the host whose command line contains `needle`.
fn processes_with(needle: &str) -> Vec<(u32, String)> {
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me)
        .map(|pid| (pid, cmdline(pid)))
        .filter(|(_, c)| c.contains(needle))
        .collect()
}

/// The shell worker's pre-built sandboxes waiting for a call (`[sandbox] prebuilt`):
/// its own children named `airlock-ready`, or still being built by its
/// `airlock-prebuild` thread (whose name they carry until then). They come and go with
/// the calls (each serves one call, then the worker builds another), so the checks
/// below leave them out; anything else — a used one that survived its call (named
/// `airlock-init` by then) included — still counts.
fn waiting_sandboxes(shell_worker: u32) -> BTreeSet<u32> {
    let mut children = BTreeSet::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{shell_worker}/task")) else {
        return children;
    };
    for task in tasks.flatten() {
        let list = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        children.extend(
            list.split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok()),
        );
    }
    children.retain(|pid| {
        std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .is_ok_and(|c| matches!(c.trim(), "airlock-ready" | "airlock-prebuil"))
    });
    children
}

/// The launcher's descendants but the shell worker's waiting pre-built sandboxes.
fn lasting_tree(launcher: u32, shell_worker: u32) -> BTreeSet<u32> {
    let waiting = waiting_sandboxes(shell_worker);
    descendants(launcher)
        .into_iter()
        .filter(|p| !waiting.contains(p))
        .collect()
}

/// Per-call cgroups of the shell worker, but those holding exactly one of its waiting
/// pre-built sandboxes.
fn call_cgroups(worker: u32) -> Vec<PathBuf> {
    let waiting = waiting_sandboxes(worker);
    let mut found = all_call_cgroups(worker);
    found.retain(|dir| {
        let procs: Vec<u32> = std::fs::read_to_string(dir.join("cgroup.procs"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
        !(procs.len() == 1 && waiting.contains(&procs[0]))
    });
    found
}

/// Per-call cgroups (`call-<worker pid>-<n>`) of one shell worker, in every hierarchy.
fn all_call_cgroups(worker: u32) -> Vec<PathBuf> {
    let prefix = format!("call-{worker}-");
    cgroups::cgroup_dirs(|dir| dir.starts_with(&prefix))
}

/// The entries of the sandbox's root as listed by `ls`: none of the host's own.
fn assert_sandbox_root(what: &str, out: &Outcome) {
    let listing = out.stdout_lines();
    assert!(
        listing.contains("workspace") && listing.contains("usr"),
        "{what}: not the sandbox root: {out}"
    );
    for dir in HOST_ONLY_ROOT_DIRS {
        assert!(
            !listing.contains(dir),
            "{what}: the host's /{dir} is visible: {out}"
        );
    }
}

fn host_has(path: &str) {
    assert!(
        Path::new(path).exists(),
        "host feature missing: {path} must exist on the host for this attempt to mean anything"
    );
}

#[tokio::test]
async fn host_secrets_and_filesystem_escapes_fail() {
    host_secrets_and_filesystem_escapes(Lab::start("fs", "").await).await;
}

#[tokio::test]
async fn host_secrets_and_filesystem_escapes_fail_as_an_ordinary_user() {
    host_secrets_and_filesystem_escapes(Lab::start_for("ufs", "", Runner::OrdinaryUser).await)
        .await;
}

async fn host_secrets_and_filesystem_escapes(lab: Lab) {
    let ws = lab.airlock.workspace(SESSION);
    let endpoints: Value = serde_json::from_str(
        &std::fs::read_to_string(lab.airlock.data_dir().join("endpoints.json"))
            .expect("endpoints.json"),
    )
    .expect("endpoints JSON");
    let token_file = endpoints["token_file"]
        .as_str()
        .expect("token_file")
        .to_owned();
    let token = lab.airlock.token.clone();
    assert!(
        token.len() >= 16,
        "token too short to search for: {token:?}"
    );
    let host_passwd = std::fs::read_to_string("/etc/passwd").expect("host /etc/passwd");
    let host_root_line = host_passwd
        .lines()
        .find(|l| l.starts_with("root:"))
        .expect("host root line")
        .to_owned();
    assert!(
        host_passwd.contains("\ndaemon:"),
        "host feature missing: a `daemon` user in the host's /etc/passwd"
    );
    for dir in ["/root", "/home", "/etc/shadow"] {
        host_has(dir);
    }

    // 1. The host's password hashes.
    let out = lab.sh("read /etc/shadow", "cat /etc/shadow").await;
    assert_eq!(out.exit_code(), Some(1), "read /etc/shadow: {out}");
    assert!(
        out.stdout().is_empty()
            && out
                .stderr()
                .contains("/etc/shadow: No such file or directory"),
        "read /etc/shadow: {out}"
    );

    // 2. Host-only directories.
    let out = lab.sh("list /root and /home", "ls /root; ls /home").await;
    assert!(out.stdout().is_empty(), "list /root and /home: {out}");
    for dir in ["/root", "/home"] {
        assert!(
            out.stderr()
                .contains(&format!("cannot access '{dir}': No such file or directory")),
            "list {dir}: {out}"
        );
    }

    // 3. The orchestrator's bearer token by its host path.
    let out = lab
        .sh(
            "read the token file by its host path",
            &format!("cat {token_file}"),
        )
        .await;
    assert!(
        !out.stdout().contains(&token) && out.stderr().contains("No such file or directory"),
        "token file: {out}"
    );

    // 4. The token through the orchestrator's /proc/<pid>/root.
    let out = lab
        .sh(
            "read the token through /proc/<orchestrator>/root",
            &format!("cat /proc/{}/root{token_file}", lab.orchestrator),
        )
        .await;
    assert!(
        !out.stdout().contains(&token) && out.stderr().contains("No such file or directory"),
        "token via /proc: {out}"
    );

    // 5. The token anywhere the sandbox can read (split so that no command line holds it).
    let (t1, t2) = token.split_at(token.len() / 2);
    let out = lab
        .sh(
            "search readable files for the token",
            &format!(
                "a={t1}; b={t2}; grep -rslF -e \"$a$b\" /etc /tmp /workspace /dev/shm /proc/1/cmdline /proc/1/environ /proc/self/environ; echo \"grep=$?\""
            ),
        )
        .await;
    assert!(!out.stdout().contains(&token), "token found: {out}");
    assert!(
        out.stdout().starts_with("grep="),
        "grep listed files holding the token: {out}"
    );

    // 6. The orchestrator's environment.
    if let Ok(environ) = std::fs::read(format!("/proc/{}/environ", lab.orchestrator)) {
        assert!(
            String::from_utf8_lossy(&environ).contains("RUST_LOG="),
            "the orchestrator's environment has RUST_LOG"
        );
    }
    for (name, pid) in [
        ("orchestrator", lab.orchestrator),
        ("launcher", lab.launcher),
        ("shell worker", lab.shell_worker),
    ] {
        let what = format!("read the {name}'s environment by its host pid");
        let out = lab.sh(&what, &format!("cat /proc/{pid}/environ")).await;
        assert!(
            !out.stdout().contains("RUST_LOG") && !out.stdout().contains("CARGO"),
            "{what}: {out}"
        );
        assert!(
            out.stderr()
                .contains(&format!("/proc/{pid}/environ: No such file or directory")),
            "{what}: {out}"
        );
    }

    // 7. The sandbox's pid 1 is a fork of the shell worker: its environment, memory and
    //    file descriptors must be out of reach of the command.
    let out = lab
        .sh(
            "read the worker's environment through /proc/1/environ",
            "cat /proc/1/environ",
        )
        .await;
    assert!(out.stdout().is_empty(), "/proc/1/environ: {out}");
    assert!(
        out.stderr().contains("/proc/1/environ: Permission denied"),
        "/proc/1/environ: {out}"
    );
    let out = lab
        .attempt(
            "read the worker's memory through /proc/1/mem",
            json!({"argv": ["perl", "-e", r#"open(my $f, "<", "/proc/1/maps") or die "maps: $!\n";
                my ($heap) = grep { /\[heap\]/ } <$f>; die "no heap\n" unless $heap;
                my ($start) = $heap =~ /^([0-9a-f]+)-/;
                open(my $m, "<", "/proc/1/mem") or die "mem: $!\n";
                sysseek($m, hex($start), 0) or die "seek: $!\n";
                my $n = sysread($m, my $buf, 65536); die "read: $!\n" unless defined $n;
                print "read $n bytes\n";"#]}),
        )
        .await;
    assert!(
        !out.stdout().contains("read "),
        "the worker's heap is readable: {out}"
    );
    assert!(
        out.stderr().contains("mem: Permission denied")
            || out.stderr().contains("maps: Permission denied"),
        "/proc/1/mem: {out}"
    );
    let out = lab
        .sh(
            "forge the exit status through init's status pipe /proc/1/fd/4",
            "printf '\\000\\000\\000\\000' > /proc/1/fd/4; exit 3",
        )
        .await;
    assert_eq!(
        out.exit_code(),
        Some(3),
        "the exit status was forged: {out}"
    );
    assert!(
        out.stderr().contains("Permission denied"),
        "/proc/1/fd/4: {out}"
    );
    let out = lab
        .sh(
            "read and run the worker's executable through /proc/1/exe",
            "head -c 4 /proc/1/exe; /proc/1/exe --version",
        )
        .await;
    assert!(out.stdout().is_empty(), "/proc/1/exe: {out}");
    assert_eq!(
        out.stderr().matches("Permission denied").count(),
        2,
        "/proc/1/exe: {out}"
    );

    // 8. Writes outside the workspace.
    let out = lab
        .sh(
            "write into /etc, /usr, /usr/bin and /",
            "echo x > /etc/@M; echo x > /usr/@M; echo x > /usr/bin/@M; echo x > /@M; mkdir /@Md; echo end",
        )
        .await;
    assert_eq!(out.stdout(), "end\n", "writes outside: {out}");
    assert_eq!(
        out.stderr().matches("Read-only file system").count(),
        5,
        "writes outside: {out}"
    );
    let canary = lab.canary_roots[0].join("secret.txt");
    let out = lab
        .sh(
            "overwrite a canary by its absolute host path",
            &format!(
                "echo pwned > {}; cat {}",
                canary.display(),
                canary.display()
            ),
        )
        .await;
    assert!(
        !out.stdout().contains(SECRET) && !out.stdout().contains("pwned"),
        "canary: {out}"
    );
    assert!(
        out.stderr().contains("nonexistent") && out.stderr().contains("No such file or directory"),
        "canary: {out}"
    );

    // 9. The sandbox's /tmp is its own: the host's /tmp never sees the file.
    let out = lab
        .sh("write /tmp", "echo x > /tmp/@M && cat /tmp/@M")
        .await;
    assert_eq!(out.stdout(), "x\n", "write /tmp: {out}");
    assert!(
        !Path::new("/tmp").join(&lab.marker).exists(),
        "the sandbox wrote the host's /tmp"
    );

    // 10. Symlink escapes resolve inside the sandbox's root.
    let out = lab
        .sh(
            "symlink to /etc/passwd",
            "ln -s /etc/passwd passwd-link && cat passwd-link",
        )
        .await;
    assert!(
        out.stdout().contains("root:x:0:0:root:/workspace:/bin/sh"),
        "symlink: {out}"
    );
    assert!(
        !out.stdout().contains(&host_root_line) && !out.stdout().contains("daemon:"),
        "symlink read the host's passwd: {out}"
    );
    let out = lab
        .sh(
            "symlink to .. chains",
            "ln -s ../../.. deep && ln -s deep/../.. chain && ls deep/ && ls chain/ && cat chain/etc/shadow",
        )
        .await;
    assert_sandbox_root("symlink to .. chains", &out);
    assert!(
        out.stderr().contains("No such file or directory"),
        "symlink to ..: {out}"
    );
    let out = lab
        .sh(
            "cd .. out of the workspace",
            "cd /workspace/../../..; pwd; ls",
        )
        .await;
    assert!(out.stdout().starts_with("/\n"), "cd ..: {out}");
    assert_sandbox_root("cd ..", &out);

    // 11. Hard links to files outside the workspace.
    let out = lab
        .sh(
            "hard link to /etc/passwd and /usr/bin/perl",
            "ln /etc/passwd hl1; ln /usr/bin/perl hl2",
        )
        .await;
    assert_eq!(
        out.stderr().matches("Invalid cross-device link").count(),
        2,
        "hard links: {out}"
    );
    assert!(
        !ws.join("hl1").exists() && !ws.join("hl2").exists(),
        "a hard link appeared in the workspace"
    );

    // 12. /proc/self/root and /proc/1/root show the sandbox's root (or nothing).
    let out = lab
        .sh(
            "/proc/self/root",
            "ls /proc/self/root/; cat /proc/self/root/etc/shadow",
        )
        .await;
    assert_sandbox_root("/proc/self/root", &out);
    assert!(
        out.stderr()
            .contains("/proc/self/root/etc/shadow: No such file or directory"),
        "/proc/self/root: {out}"
    );
    let out = lab
        .sh(
            "/proc/1/root",
            "ls /proc/1/root/; cat /proc/1/root/etc/shadow",
        )
        .await;
    if out.stdout().is_empty() {
        assert_eq!(
            out.stderr().matches("Permission denied").count(),
            2,
            "/proc/1/root: {out}"
        );
    } else {
        assert_sandbox_root("/proc/1/root", &out);
        assert!(
            out.stderr().contains("No such file or directory"),
            "/proc/1/root: {out}"
        );
    }

    // 13. Host kernel knobs.
    let out = lab
        .sh(
            "core_pattern",
            "echo '|/workspace/pwn' > /proc/sys/kernel/core_pattern",
        )
        .await;
    assert!(
        out.stderr().contains("Read-only file system"),
        "core_pattern: {out}"
    );
    let out = lab
        .sh(
            "set the hostname",
            "hostname @M; echo @M > /proc/sys/kernel/hostname; hostname",
        )
        .await;
    assert_eq!(out.stdout(), "airlock\n", "hostname: {out}");
    assert!(
        out.stderr().contains("hostname: you must be root")
            && out.stderr().contains("Read-only file system"),
        "hostname: {out}"
    );

    // 14. Device nodes.
    let out = lab
        .sh(
            "mknod a block device and /dev/mem",
            "mknod sda b 8 0; mknod /tmp/mem c 1 1",
        )
        .await;
    assert_eq!(
        out.stderr().matches("Operation not permitted").count(),
        2,
        "mknod: {out}"
    );
    assert!(
        !ws.join("sda").exists(),
        "mknod left a node in the workspace"
    );
    let out = lab
        .sh(
            "find block devices, /dev/mem, /dev/kmsg",
            "ls -la /dev | grep -c '^b'; ls /dev/mem /dev/kmsg /dev/sda /dev/port",
        )
        .await;
    assert_eq!(out.stdout(), "0\n", "block devices in /dev: {out}");
    assert_eq!(
        out.stderr().matches("No such file or directory").count(),
        4,
        "/dev: {out}"
    );
    let out = lab
        .sh("read the kernel log", "head -c 100 /proc/kmsg; dmesg")
        .await;
    assert!(out.stdout().is_empty(), "kernel log: {out}");
    // Root of the sandbox lacks CAP_SYSLOG (EPERM); an ordinary user's sandbox is refused
    // by /proc/kmsg's mode first (EACCES). Either way both reads fail.
    assert_eq!(
        out.stderr().matches("Operation not permitted").count()
            + out.stderr().matches("Permission denied").count(),
        2,
        "kernel log: {out}"
    );

    // 15. Mounts.
    let out = lab.sh("mount a tmpfs", "mount -t tmpfs none /tmp").await;
    assert_eq!(out.exit_code(), Some(32), "mount: {out}");
    assert!(out.stderr().contains("permission denied"), "mount: {out}");
    lab.expect_errno(
        "mount(2) a bind of /workspace",
        "my ($s, $t) = (\"/workspace\", \"/tmp\");",
        &format!("{}, $s, $t, 0, {}, 0", libc::SYS_mount, libc::MS_BIND),
        libc::EPERM,
    )
    .await;

    // 16. Remapping the user namespace to more host ids.
    let out = lab
        .sh(
            "rewrite /proc/self/uid_map",
            "echo '0 0 4294967295' > /proc/self/uid_map; cat /proc/self/uid_map",
        )
        .await;
    assert!(out.stderr().contains("Permission denied"), "uid_map: {out}");
    // Still one id: the sandbox's root is the worker's own uid on the host.
    let worker_uid = lab.worker_uid.to_string();
    assert_eq!(
        out.stdout().split_whitespace().collect::<Vec<_>>(),
        ["0", worker_uid.as_str(), "1"],
        "uid_map: {out}"
    );

    // 17. setuid binaries grant nothing (no_new_privs, nosuid, empty bounding set).
    let out = lab.sh("su -c id", "su -c id").await;
    assert!(
        out.exit_code() != Some(0) && !out.stdout().contains("uid="),
        "su: {out}"
    );
    assert!(out.stderr().contains("su:"), "su: {out}");
    let out = lab
        .sh("setuid mount(8)", "/usr/bin/mount -t proc proc /tmp")
        .await;
    assert_eq!(out.exit_code(), Some(32), "setuid mount: {out}");
    // Setuid copies planted by the host: one owned by uid 1000, one by root.
    for (name, source, uid) in [
        ("suid-id", "/usr/bin/id", 1000),
        ("suid-grep", "/usr/bin/grep", 0),
    ] {
        let path = ws.join(name);
        std::fs::copy(source, &path).expect("copy setuid binary");
        std::os::unix::fs::chown(&path, Some(uid), Some(uid)).expect("chown");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o6755)).expect("chmod");
    }
    let out = lab
        .sh(
            "setuid binaries in the workspace",
            "./suid-id -u; ./suid-grep -E '^(CapPrm|CapEff|NoNewPrivs)' /proc/self/status",
        )
        .await;
    assert_eq!(
        out.stdout().split_whitespace().collect::<Vec<_>>(),
        [
            "0",
            "CapPrm:",
            "0000000000000000",
            "CapEff:",
            "0000000000000000",
            "NoNewPrivs:",
            "1"
        ],
        "setuid binaries: {out}"
    );

    // 18. cgroupfs and sysfs.
    let out = lab
        .sh(
            "write to /sys/fs/cgroup",
            "ls /sys; mkdir -p /sys/fs/cgroup/pids/@M; cat /proc/self/cgroup",
        )
        .await;
    assert!(
        out.stderr()
            .contains("cannot access '/sys': No such file or directory"),
        "/sys: {out}"
    );
    assert!(
        out.stderr().contains("Read-only file system"),
        "/sys: {out}"
    );
    assert!(
        out.stdout().lines().all(|l| l.ends_with(":/")),
        "the host's cgroup paths leak: {out}"
    );

    // 19. Raising its own limits.
    let out = lab
        .sh(
            "raise rlimits",
            "ulimit -n 100000; ulimit -Hn 100000; ulimit -f unlimited; prlimit --nofile=4096:4096 --pid $$; ulimit -Hn",
        )
        .await;
    assert_eq!(out.stdout(), format!("{NOFILE}\n"), "raise rlimits: {out}");
    assert_eq!(
        out.stderr().matches("Operation not permitted").count(),
        4,
        "raise rlimits: {out}"
    );

    // 20. Symlinks planted by the sandbox and then followed by the fs tool on the host.
    let out = lab
        .sh(
            "plant symlinks for the fs tool",
            "ln -s /etc/shadow shadow-link; ln -s / root-link; echo planted",
        )
        .await;
    assert_eq!(out.stdout(), "planted\n", "plant: {out}");
    let shadow = std::fs::read_to_string("/etc/shadow").expect("host /etc/shadow");
    for path in [
        "shadow-link",
        "root-link/etc/shadow",
        "root-link/etc/passwd",
    ] {
        let (is_error, text, _) = lab
            .airlock
            .call_in(SESSION, "read_file", json!({"path": path}))
            .await;
        assert!(
            is_error,
            "read_file {path} through a planted symlink succeeded: {text}"
        );
        assert!(
            !shadow.lines().any(|l| !l.is_empty() && text.contains(l)),
            "read_file {path} leaked /etc/shadow"
        );
        assert!(
            !text.contains(&host_root_line),
            "read_file {path} leaked /etc/passwd"
        );
        lab.assert_host_unchanged(&format!("read_file {path}"))
            .await;
    }
}

#[tokio::test]
async fn processes_namespaces_syscalls_and_network_fail() {
    processes_namespaces_syscalls_and_network(Lab::start("ps", "").await).await;
}

#[tokio::test]
async fn processes_namespaces_syscalls_and_network_fail_as_an_ordinary_user() {
    processes_namespaces_syscalls_and_network(
        Lab::start_for("ups", "", Runner::OrdinaryUser).await,
    )
    .await;
}

async fn processes_namespaces_syscalls_and_network(lab: Lab) {
    assert_eq!(
        std::env::consts::ARCH,
        "x86_64",
        "host feature missing: the x32 check needs an x86_64 host"
    );
    let components = [
        lab.launcher,
        lab.orchestrator,
        lab.shell_worker,
        lab.fs_worker,
    ];

    // 1. /proc and ps show only the sandbox's own processes.
    let out = lab.sh("list /proc", "ls /proc | grep -E '^[0-9]+$'").await;
    let pids: Vec<u32> = out
        .stdout()
        .lines()
        .map(|l| l.parse().expect("pid"))
        .collect();
    assert!(
        !pids.is_empty() && pids.len() <= 5 && pids.iter().all(|p| *p < 100),
        "/proc: {out}"
    );
    for pid in components {
        assert!(!pids.contains(&pid), "host pid {pid} visible: {out}");
    }
    let out = lab.sh("ps -e", "ps -eo pid,args").await;
    assert!(out.stdout().lines().count() <= 5, "ps: {out}");
    assert!(
        !out.stdout().contains("serve")
            && !out
                .stdout()
                .contains(&lab.airlock.data_dir().display().to_string()),
        "ps: {out}"
    );

    // 2. Signalling host processes by pid.
    let pid_list = components.map(|p| p.to_string()).join(" ");
    let out = lab
        .sh(
            "kill -9 the launcher, orchestrator and workers",
            &format!("for p in {pid_list}; do kill -9 $p; done"),
        )
        .await;
    assert_eq!(
        out.stderr().matches("No such process").count(),
        components.len(),
        "kill: {out}"
    );
    let out = lab.sh("kill -9 -1", "kill -9 -1; echo survived").await;
    assert_eq!(out.stdout(), "survived\n", "kill -1: {out}");
    lab.assert_still_serves("kill -9 -1").await;

    // 3. ptrace and cross-process memory.
    lab.expect_errno(
        "ptrace(PTRACE_TRACEME)",
        "",
        &format!("{}, 0, 0, 0, 0", libc::SYS_ptrace),
        libc::EPERM,
    )
    .await;
    lab.expect_errno(
        "ptrace(PTRACE_ATTACH, 1)",
        "",
        &format!("{}, 16, 1, 0, 0", libc::SYS_ptrace),
        libc::EPERM,
    )
    .await;
    lab.expect_errno(
        "process_vm_readv(1)",
        "",
        &format!("{}, 1, 0, 0, 0, 0, 0", libc::SYS_process_vm_readv),
        libc::EPERM,
    )
    .await;

    // 4. Nested namespaces.
    let out = lab
        .sh(
            "unshare -U / -n / -m / -p",
            "unshare -U true; unshare -n true; unshare -m true; unshare -pf true",
        )
        .await;
    assert_eq!(
        out.stderr()
            .matches("unshare failed: Operation not permitted")
            .count(),
        4,
        "unshare: {out}"
    );
    for (what, flag) in [
        ("unshare(CLONE_NEWUSER)", libc::CLONE_NEWUSER),
        ("unshare(CLONE_NEWNET)", libc::CLONE_NEWNET),
        ("unshare(CLONE_NEWNS)", libc::CLONE_NEWNS),
    ] {
        lab.expect_errno(
            what,
            "",
            &format!("{}, {flag}", libc::SYS_unshare),
            libc::EPERM,
        )
        .await;
    }
    lab.expect_errno(
        "clone(CLONE_NEWUSER)",
        "",
        &format!(
            "{}, {}, 0, 0, 0, 0",
            libc::SYS_clone,
            libc::CLONE_NEWUSER | libc::SIGCHLD
        ),
        libc::EPERM,
    )
    .await;
    lab.expect_errno(
        "clone3 (flags unreadable by seccomp)",
        "",
        &format!("{}, 0, 0", libc::SYS_clone3),
        libc::ENOSYS,
    )
    .await;
    lab.expect_errno(
        "setns",
        "",
        &format!("{}, 0, 0", libc::SYS_setns),
        libc::EPERM,
    )
    .await;

    // 5. Kernel interfaces that reach past the other layers.
    let strings =
        "my ($t, $d, $p, $e, $m, $z) = (\"user\", \"k\", \"v\", \"\", \"dummy\", \"/tmp\");";
    for (what, call, errno) in [
        (
            "keyctl",
            format!("{}, 0, -3, 0", libc::SYS_keyctl),
            libc::EPERM,
        ),
        (
            "add_key",
            format!("{}, $t, $d, $p, 1, -2", libc::SYS_add_key),
            libc::EPERM,
        ),
        (
            "request_key",
            format!("{}, $t, $d, 0, 0", libc::SYS_request_key),
            libc::EPERM,
        ),
        (
            "bpf(BPF_MAP_CREATE)",
            format!("{}, 0, 0, 0", libc::SYS_bpf),
            libc::EPERM,
        ),
        (
            "perf_event_open",
            format!("{}, 0, 0, -1, -1, 0", libc::SYS_perf_event_open),
            libc::EPERM,
        ),
        (
            "io_uring_setup",
            format!("{}, 1, 0", libc::SYS_io_uring_setup),
            libc::EPERM,
        ),
        (
            "userfaultfd",
            format!("{}, 0", libc::SYS_userfaultfd),
            libc::EPERM,
        ),
        (
            "init_module",
            format!("{}, 0, 0, $e", libc::SYS_init_module),
            libc::EPERM,
        ),
        (
            "finit_module",
            format!("{}, 0, $e, 0", libc::SYS_finit_module),
            libc::EPERM,
        ),
        (
            "delete_module",
            format!("{}, $m, 0", libc::SYS_delete_module),
            libc::EPERM,
        ),
        (
            "kexec_load",
            format!("{}, 0, 0, 0, 0", libc::SYS_kexec_load),
            libc::EPERM,
        ),
        (
            "open_by_handle_at",
            format!("{}, -100, 0, 0", libc::SYS_open_by_handle_at),
            libc::EPERM,
        ),
        (
            "name_to_handle_at",
            format!("{}, -100, $z, 0, 0, 0", libc::SYS_name_to_handle_at),
            libc::EPERM,
        ),
        ("chroot", format!("{}, $z", libc::SYS_chroot), libc::EPERM),
        (
            "pivot_root",
            format!("{}, $z, $z", libc::SYS_pivot_root),
            libc::EPERM,
        ),
        (
            "x32 ABI getpid (bypassing x86-64 rules)",
            format!("{}", 0x4000_0000 + libc::SYS_getpid),
            libc::ENOSYS,
        ),
    ] {
        lab.expect_errno(what, strings, &call, errno).await;
    }

    // 6. Network: the orchestrator's own HTTP port on the host's loopback.
    let port: u16 = lab
        .airlock
        .url
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .expect("port");
    let out = lab
        .sh(
            "TCP to the orchestrator's HTTP port",
            &format!(
                "perl -e 'use Socket; socket(my $s, PF_INET, SOCK_STREAM, 0) or die \"socket: $!\\n\"; connect($s, pack_sockaddr_in({port}, inet_aton(\"127.0.0.1\"))) or die \"connect: $!\\n\"; print \"connected\\n\"'; \
                 bash -c 'echo x > /dev/tcp/127.0.0.1/{port}'; curl -sS -m 5 http://127.0.0.1:{port}/readyz; echo curl=$?"
            ),
        )
        .await;
    assert!(!out.stdout().contains("connected"), "TCP: {out}");
    assert!(out.stdout().ends_with("curl=7\n"), "curl: {out}");
    assert!(
        out.stderr().contains("socket: Operation not permitted"),
        "perl TCP: {out}"
    );
    assert!(
        out.stderr().contains(&format!(
            "/dev/tcp/127.0.0.1/{port}: Operation not permitted"
        )),
        "bash TCP: {out}"
    );

    let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("host UDP socket");
    udp.set_nonblocking(true).expect("nonblocking");
    let udp_port = udp.local_addr().expect("addr").port();
    let out = lab
        .sh(
            "UDP to a host loopback port",
            &format!(
                "perl -e 'use Socket; socket(my $s, PF_INET, SOCK_DGRAM, 0) or die \"socket: $!\\n\"; send($s, \"@M\", 0, pack_sockaddr_in({udp_port}, inet_aton(\"127.0.0.1\"))) or die \"send: $!\\n\"'"
            ),
        )
        .await;
    assert!(
        out.stderr().contains("socket: Operation not permitted"),
        "UDP: {out}"
    );
    let mut buf = [0u8; 64];
    assert!(
        matches!(udp.recv_from(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the host UDP socket received a datagram from the sandbox"
    );

    let host_name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .expect("hostname")
        .trim()
        .to_owned();
    assert!(
        !["localhost", "airlock"].contains(&host_name.as_str()),
        "the host's name {host_name} is one the sandbox knows"
    );
    let out = lab
        .sh(
            "DNS lookups",
            &format!("getent hosts example.com; echo rc=$?; getent hosts {host_name}; echo rc=$?; wc -c < /etc/resolv.conf"),
        )
        .await;
    assert_eq!(out.stdout(), "rc=2\nrc=2\n0\n", "DNS: {out}");

    for (what, family, kind, protocol) in [
        (
            "raw IPv4 socket",
            libc::AF_INET,
            libc::SOCK_RAW,
            libc::IPPROTO_ICMP,
        ),
        ("IPv6 socket", libc::AF_INET6, libc::SOCK_STREAM, 0),
        (
            "packet socket (AF_PACKET)",
            libc::AF_PACKET,
            libc::SOCK_RAW,
            0,
        ),
        (
            "netlink socket (AF_NETLINK)",
            libc::AF_NETLINK,
            libc::SOCK_RAW,
            0,
        ),
        ("vsock (AF_VSOCK)", libc::AF_VSOCK, libc::SOCK_STREAM, 0),
    ] {
        lab.expect_socket_denied(what, family, kind, protocol).await;
    }
    let out = lab.sh("ip link (netlink)", "ip link").await;
    assert!(
        out.stderr()
            .contains("Cannot open netlink socket: Operation not permitted"),
        "ip link: {out}"
    );

    // 7. A Unix socket in the host's abstract namespace: reachable from the host, not
    //    from the sandbox (its own network namespace).
    let abstract_name = format!("airlock-{}", lab.marker);
    let listener = {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes())
            .expect("abstract name");
        std::os::unix::net::UnixListener::bind_addr(&addr).expect("bind abstract socket")
    };
    listener.set_nonblocking(true).expect("nonblocking");
    let connect = format!(
        "use Socket; socket(my $s, PF_UNIX, SOCK_STREAM, 0) or die \"socket: $!\\n\"; connect($s, pack_sockaddr_un(\"\\0{abstract_name}\")) or die \"connect: $!\\n\"; print \"connected\\n\";"
    );
    let host = std::process::Command::new("perl")
        .args(["-e", &connect])
        .output()
        .expect("host perl");
    assert_eq!(
        String::from_utf8_lossy(&host.stdout),
        "connected\n",
        "the same connect works on the host"
    );
    listener.accept().expect("the host's own connection");
    let out = lab
        .attempt(
            "connect to a host abstract Unix socket",
            json!({"argv": ["perl", "-e", connect]}),
        )
        .await;
    assert!(
        out.stderr().contains("connect: Connection refused"),
        "abstract socket: {out}"
    );
    assert!(
        matches!(listener.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the sandbox reached the host's abstract socket"
    );

    // 8. The components' Unix sockets by their host paths.
    let sockets: Vec<PathBuf> = std::fs::read_dir(lab.airlock.data_dir().join("sockets"))
        .expect("sockets dir")
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(
        !sockets.is_empty(),
        "no component sockets under the data dir"
    );
    for socket in &sockets {
        let what = format!("connect to {}", socket.display());
        let script = format!(
            "use Socket; socket(my $s, PF_UNIX, SOCK_STREAM, 0) or die \"socket: $!\\n\"; connect($s, pack_sockaddr_un(\"{}\")) or die \"connect: $!\\n\"; print \"connected\\n\";",
            socket.display()
        );
        let out = lab
            .attempt(&what, json!({"argv": ["perl", "-e", script]}))
            .await;
        assert!(
            out.stderr().contains("connect: No such file or directory"),
            "{what}: {out}"
        );
    }

    // 9. Terminal injection, the clock, the host's SysV IPC.
    let out = lab
        .sh("write to /dev/tty (TIOCSTI target)", "echo x > /dev/tty")
        .await;
    assert!(
        out.stderr().contains("No such device or address"),
        "/dev/tty: {out}"
    );
    let out = lab.sh("set the clock", "date -s @$(date +%s)").await;
    assert!(
        out.stderr()
            .contains("cannot set date: Operation not permitted"),
        "date: {out}"
    );
    let made = std::process::Command::new("ipcmk")
        .args(["-M", "4096"])
        .output()
        .expect("host feature missing: ipcmk (util-linux)");
    assert!(
        made.status.success(),
        "host feature missing: SysV shared memory: {made:?}"
    );
    let made = String::from_utf8_lossy(&made.stdout).into_owned();
    // "Shared memory id: <id>"
    let shmid = made.trim().rsplit(' ').next().expect("shmid").to_owned();
    let _cleanup = ShmGuard(shmid.clone());
    let out = lab
        .sh(
            "see the host's SysV shared memory",
            "ipcs -m | grep -c '^0x'",
        )
        .await;
    assert_eq!(
        out.stdout(),
        "0\n",
        "SysV IPC (host segment {shmid}): {out}"
    );
    let still = std::process::Command::new("ipcs")
        .args(["-m", "-i", &shmid])
        .output()
        .expect("ipcs");
    assert!(
        still.status.success(),
        "the host's segment {shmid} vanished"
    );
}

/// Removes a host SysV shared memory segment.
struct ShmGuard(String);

impl Drop for ShmGuard {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ipcrm")
            .args(["-m", &self.0])
            .output();
    }
}

#[tokio::test]
async fn sessions_cannot_reach_each_other() {
    let lab = Lab::start("ss", "").await;
    let secret_name = format!("secret-{}.txt", lab.marker);
    let alice = lab
        .attempt_in(
            "alice",
            "alice writes a secret",
            json!({"command": format!("echo {SECRET} > {secret_name}")}),
        )
        .await;
    assert_eq!(alice.exit_code(), Some(0), "alice: {alice}");
    let alice_ws = lab.airlock.workspace("alice");
    assert!(
        alice_ws.join(&secret_name).exists(),
        "alice's file is in her workspace"
    );

    let attempts = [
        ("../alice", format!("cat /workspace/../alice/{secret_name}")),
        (
            "host path",
            format!("cat {}/{secret_name}", alice_ws.display()),
        ),
        (
            "/proc/1/root",
            format!("cat /proc/1/root{}/{secret_name}", alice_ws.display()),
        ),
        (
            "find /",
            format!("find / -path /proc -prune -o -name '{secret_name}' -print"),
        ),
    ];
    for (name, command) in attempts {
        let what = format!("bob reads alice's file ({name})");
        let out = lab
            .attempt_in("bob", &what, json!({"command": command}))
            .await;
        assert!(
            !out.stdout().contains(SECRET) && !out.stdout().contains(&secret_name),
            "{what}: {out}"
        );
        if name != "find /" {
            assert!(
                out.stderr().contains("No such file or directory")
                    || out.stderr().contains("Permission denied"),
                "{what}: {out}"
            );
        }
    }
    let out = lab
        .attempt_in(
            "bob",
            "bob lists /workspace/..",
            json!({"command": "ls -a /workspace/.."}),
        )
        .await;
    assert_sandbox_root("bob lists /workspace/..", &out);
    assert!(
        !out.stdout().contains("alice"),
        "bob lists /workspace/..: {out}"
    );

    // While alice runs: her processes, /tmp, /dev/shm and SysV IPC are invisible to bob.
    let key = 0x4144_5658;
    let alice_running = format!("{}alice", lab.marker);
    // A sleep with a duration unique to this run: its own process appears only after
    // alice's files and segment exist.
    let alice_sleep = format!("sleep 6.{} ", std::process::id());
    let alice_call = run_shell(
        &lab.airlock,
        "alice",
        "alice holds resources",
        json!({"command": format!(
            "echo x > /tmp/alice-{m}; echo x > /dev/shm/alice-{m}; perl -e 'defined shmget({key}, 4096, 01600) or die \"shmget: $!\\n\"'; {alice_sleep}; : {alice_running}",
            m = lab.marker
        ), "timeout_seconds": 30}),
    );
    let bob_call = async {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !processes_with(&alice_sleep)
            .iter()
            .any(|(_, c)| c == &alice_sleep)
        {
            assert!(Instant::now() < deadline, "alice's command never started");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The host-side checks see a running sandbox (they are not vacuous).
        assert!(
            !call_cgroups(lab.shell_worker).is_empty(),
            "alice's call has no cgroup named after the shell worker"
        );
        assert!(
            lasting_tree(lab.launcher, lab.shell_worker).len() > lab.tree.len(),
            "alice's sandbox is not below the launcher"
        );
        // The split needle keeps the marker out of bob's own command line.
        let (m1, m2) = alice_running.split_at(4);
        run_shell(
            &lab.airlock,
            "bob",
            "bob looks for alice while she runs",
            json!({"command": format!(
                "ls -a /tmp /dev/shm; grep -ls -e '{m1}''{m2}' /proc/[0-9]*/cmdline; perl -e 'my $id = shmget({key}, 4096, 0600); print defined $id ? \"shm=$id\\n\" : \"shmget=\" . ($!+0) . \"\\n\"'"
            )}),
        )
        .await
    };
    let (alice_out, bob_out) = tokio::join!(alice_call, bob_call);
    assert_eq!(alice_out.exit_code(), Some(0), "alice: {alice_out}");
    assert!(
        !bob_out.stdout().contains("alice"),
        "bob saw alice's files or processes: {bob_out}"
    );
    assert!(
        bob_out
            .stdout()
            .ends_with(&format!("shmget={}\n", libc::ENOENT)),
        "bob found alice's SysV segment: {bob_out}"
    );
    lab.assert_host_unchanged("concurrent sessions").await;

    // Nothing of alice's /tmp survives her call, even for alice.
    let out = lab
        .attempt_in(
            "alice",
            "alice's /tmp does not persist",
            json!({"command": format!("ls /tmp/alice-{}", lab.marker)}),
        )
        .await;
    assert!(
        out.stderr().contains("No such file or directory"),
        "/tmp persisted: {out}"
    );

    // Session ids that would name another session's workspace are refused by the API.
    for session in ["../alice", "bob/../alice", "..", "alice/"] {
        let body = json!({"session_id": session, "tool_uses": [{"type": "tool_use", "id": "t1", "name": "execute_shell",
            "input": {"command": "cat secret*"}}]});
        let (status, response) = lab.airlock.post("/v1/tool_calls", &body).await;
        assert_eq!(status, 400, "session {session:?}: {response}");
        assert!(
            response.to_string().contains("session_id"),
            "session {session:?}: {response}"
        );
    }
    let roots: Vec<String> = std::fs::read_dir(lab.airlock.data_dir().join("workspaces"))
        .expect("workspaces")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        roots,
        ["local"],
        "workspaces outside the principal's directory: {roots:?}"
    );
    lab.assert_host_unchanged("session ids").await;
}

#[tokio::test]
async fn resource_exhaustion_is_contained() {
    let lab = Lab::start("rx", "").await;

    // 1. Fork bomb: the pids limit makes forks fail; the call ends; nothing is left.
    let out = lab
        .attempt("fork bomb", json!({"command": format!("b(){{ b|b& }}; b; sleep 20; : {}", lab.marker), "timeout_seconds": 5}))
        .await;
    assert!(out.stderr().contains("Cannot fork"), "fork bomb: {out}");
    assert!(out.is_error, "fork bomb: {out}");
    lab.assert_still_serves("fork bomb").await;

    // 2. The pids limit, exactly: forks fail with EAGAIN before pids.max processes exist.
    let script = format!(
        "my $n = 0; while (1) {{ my $p = fork(); if (!defined $p) {{ print \"forks=$n errno=\", $!+0, \"\\n\"; last }} if ($p == 0) {{ sleep 60; exit 0 }} $n++ }} # {}",
        lab.marker
    );
    let out = lab
        .attempt(
            "fork until the pids limit",
            json!({"argv": ["perl", "-e", script], "timeout_seconds": 60}),
        )
        .await;
    let forks: u64 = out
        .stdout()
        .strip_prefix("forks=")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("fork until the pids limit: {out}"));
    assert!(
        forks < PIDS_MAX && forks > PIDS_MAX / 2,
        "forks before EAGAIN: {forks}: {out}"
    );
    assert!(
        out.stdout().ends_with(&format!("errno={}\n", libc::EAGAIN)),
        "pids limit: {out}"
    );

    // 3. Memory bomb: only the sandbox dies (OOM kill), within the memory limit.
    let script = format!(
        "my $s = \"x\" x (1 << 20); my $t = \"\"; $t .= $s while 1; # {}",
        lab.marker
    );
    let out = lab
        .attempt(
            "memory bomb",
            json!({"argv": ["perl", "-e", script], "timeout_seconds": 120}),
        )
        .await;
    assert_eq!(
        out.signal(),
        Some(i64::from(libc::SIGKILL)),
        "memory bomb: {out}"
    );
    assert!(!out.timed_out(), "memory bomb: {out}");
    let peak = out.result["usage"]["peak_memory_bytes"]
        .as_u64()
        .expect("peak_memory_bytes");
    assert!(
        peak > MEMORY_MAX / 2 && peak <= MEMORY_MAX,
        "peak memory {peak}: {out}"
    );
    lab.assert_still_serves("memory bomb").await;

    // 4. File descriptor exhaustion stops at NOFILE.
    let script = "my @f; while (1) { open(my $h, \"<\", \"/dev/null\") or last; push @f, $h } print scalar(@f), \" \", $!+0, \"\\n\";";
    let out = lab
        .attempt(
            "open files until EMFILE",
            json!({"argv": ["perl", "-e", script]}),
        )
        .await;
    let fields: Vec<u64> = out
        .stdout()
        .split_whitespace()
        .map(|f| f.parse().expect("number"))
        .collect();
    assert_eq!(fields.len(), 2, "fd exhaustion: {out}");
    assert!(
        fields[0] < NOFILE && fields[0] > NOFILE - 16,
        "open files: {out}"
    );
    assert_eq!(fields[1], libc::EMFILE as u64, "fd exhaustion: {out}");

    // 5. A CPU spin is killed at its timeout.
    let out = lab
        .attempt("CPU spin", json!({"command": format!("while :; do :; done # {}", lab.marker), "timeout_seconds": 1}))
        .await;
    assert!(out.timed_out(), "CPU spin: {out}");
    assert_eq!(out.call["status"], "timeout", "CPU spin: {out}");
    assert_eq!(
        out.signal(),
        Some(i64::from(libc::SIGKILL)),
        "CPU spin: {out}"
    );

    // 6. Escaping the kill by setsid, double fork and nohup: everything dies with the call.
    // The command waits (bounded) until all four escapees run, then exits.
    let command = "setsid sh -c 'sleep 300; : @M-setsid' >/dev/null 2>&1 &
        ( sh -c 'sleep 300; : @M-double' >/dev/null 2>&1 & ) &
        nohup sh -c 'sleep 300; : @M-nohup' >/dev/null 2>&1 &
        perl -e 'exit if fork; require POSIX; POSIX::setsid(); exit if fork; $0 = \"@M-daemon\"; sleep 300' &
        i=0; while :; do n=0
            for s in setsid double nohup; do pgrep -f -- \"^sh -c sleep 300; : @M-$s\" >/dev/null && n=$((n+1)); done
            pgrep -f -- '^@M-daemon' >/dev/null && n=$((n+1))
            [ $n -eq 4 ] || [ $i -ge 200 ] && break; i=$((i+1)); sleep 0.1
        done; echo running=$n";
    let out = lab.sh("setsid / double fork / nohup escape", command).await;
    assert_eq!(out.stdout(), "running=4\n", "escape: {out}");
    assert!(!out.timed_out(), "escape: {out}");

    // 7. Huge output is capped for the model, and the call still returns.
    let out = lab.sh("50 MB of output", "yes | head -c 50M").await;
    assert_eq!(out.exit_code(), Some(0), "huge output: {out}");
    assert_eq!(out.stdout().len(), MODEL_OUTPUT_BYTES, "huge output: {out}");
    assert_eq!(out.result["stdout_truncated"], true, "huge output: {out}");
    let out = lab
        .attempt(
            "endless output on both streams",
            json!({"command": format!("yes >&2 & yes # {}", lab.marker), "timeout_seconds": 2}),
        )
        .await;
    assert!(out.timed_out(), "endless output: {out}");
    assert_eq!(
        out.stdout().len(),
        MODEL_OUTPUT_BYTES,
        "endless output: {out}"
    );
    assert_eq!(
        out.stderr().len(),
        MODEL_OUTPUT_BYTES,
        "endless output: {out}"
    );
    assert_eq!(
        out.result["stdout_truncated"], true,
        "endless output: {out}"
    );
    assert_eq!(
        out.result["stderr_truncated"], true,
        "endless output: {out}"
    );
    lab.assert_still_serves("output floods").await;
}

#[tokio::test]
async fn disk_fill_is_bounded() {
    const FSIZE: u64 = 8 << 20;
    const TMP: u64 = 4 << 20;
    let lab = Lab::start(
        "df",
        &format!("[sandbox]\nfsize_bytes = {FSIZE}\ntmp_bytes = {TMP}\n"),
    )
    .await;
    let ws = lab.airlock.workspace(SESSION);

    // 1. FSIZE: the writer gets SIGXFSZ, the file stops at the limit.
    let out = lab
        .sh(
            "fill the workspace with one file",
            "head -c 2G /dev/zero > big; echo status=$?",
        )
        .await;
    assert_eq!(
        out.stdout(),
        format!("status={}\n", 128 + libc::SIGXFSZ),
        "fsize: {out}"
    );
    assert_eq!(
        std::fs::metadata(ws.join("big")).expect("big").len(),
        FSIZE,
        "fsize"
    );
    std::fs::remove_file(ws.join("big")).expect("rm big");

    // 2. With SIGXFSZ ignored, the write fails with EFBIG.
    let script = "$SIG{XFSZ} = \"IGNORE\"; open(my $f, \">\", \"big2\") or die \"open: $!\\n\"; my $b = \"x\" x 65536; my $n = 0; \
        while (1) { my $w = syswrite($f, $b); if (!defined $w) { print \"errno=\", $!+0, \" written=$n\\n\"; last } $n += $w }";
    let out = lab
        .attempt(
            "write past FSIZE ignoring SIGXFSZ",
            json!({"argv": ["perl", "-e", script]}),
        )
        .await;
    assert_eq!(
        out.stdout(),
        format!("errno={} written={FSIZE}\n", libc::EFBIG),
        "EFBIG: {out}"
    );
    assert_eq!(
        std::fs::metadata(ws.join("big2")).expect("big2").len(),
        FSIZE,
        "EFBIG"
    );
    std::fs::remove_file(ws.join("big2")).expect("rm big2");

    // 3. /tmp and /dev/shm are small tmpfs: ENOSPC.
    for dir in ["/tmp", "/dev/shm"] {
        let what = format!("fill {dir}");
        let out = lab
            .sh(
                &what,
                &format!("head -c 100M /dev/zero > {dir}/@M; echo status=$?; stat -c %s {dir}/@M"),
            )
            .await;
        assert!(
            out.stderr().contains("No space left on device"),
            "{what}: {out}"
        );
        let lines: Vec<&str> = out.stdout().lines().collect();
        assert_eq!(lines.first(), Some(&"status=1"), "{what}: {out}");
        let size: u64 = lines
            .get(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{what}: {out}"));
        assert!(size <= TMP, "{what}: {size} bytes: {out}");
    }
    lab.assert_still_serves("disk fill").await;
}

/// Issue: the set-id guard missed `O_TMPFILE` + `linkat`, which left a `-rwsr-xr-x` file
/// owned by the worker's uid (host root under a root worker) in the workspace. Every way
/// of creating an unnamed file with a set-id mode is refused, named or not; plain
/// unnamed temp files still work.
#[tokio::test]
async fn setid_files_cannot_be_planted_through_unnamed_temp_files() {
    let lab = Lab::start("tmpf", "").await;
    let ws = lab.airlock.workspace(SESSION);
    let o_tmpfile = libc::O_TMPFILE | libc::O_RDWR;
    let link = format!(
        "my ($src, $dst) = (\"/proc/self/fd/$r\", \"planted\"); syscall({}, {}, $src, {}, $dst, {})",
        libc::SYS_linkat,
        libc::AT_FDCWD,
        libc::AT_FDCWD,
        libc::AT_SYMLINK_FOLLOW
    );
    for (what, call) in [
        (
            "openat O_TMPFILE 04755",
            format!(
                "{}, {}, $dot, {o_tmpfile}, 04755",
                libc::SYS_openat,
                libc::AT_FDCWD
            ),
        ),
        (
            "openat O_TMPFILE 02755",
            format!(
                "{}, {}, $dot, {o_tmpfile}, 02755",
                libc::SYS_openat,
                libc::AT_FDCWD
            ),
        ),
        (
            "openat O_TMPFILE 06777 in /tmp",
            format!(
                "{}, {}, $tmp, {o_tmpfile}, 06777",
                libc::SYS_openat,
                libc::AT_FDCWD
            ),
        ),
        (
            "open O_TMPFILE 04755",
            format!("{}, $ws, {o_tmpfile}, 04755", libc::SYS_open),
        ),
        (
            "openat O_TMPFILE|O_EXCL 04711",
            format!(
                "{}, {}, $dot, {}, 04711",
                libc::SYS_openat,
                libc::AT_FDCWD,
                o_tmpfile | libc::O_EXCL
            ),
        ),
    ] {
        // On success the attacker names the file at once: the result shows what it got.
        let script = format!(
            "my ($dot, $tmp, $ws) = (\".\", \"/tmp\", \"/workspace\"); $! = 0; my $r = syscall({call}); if ($r == -1) {{ print \"errno=\" . ($!+0) . \"\\n\" }} else {{ {link}; print \"ret=$r\\n\" }} # @M"
        );
        let out = lab
            .attempt(
                what,
                json!({"argv": ["perl", "-e", script.replace("@M", &lab.marker)]}),
            )
            .await;
        assert_eq!(
            out.stdout(),
            format!("errno={}\n", libc::EPERM),
            "{what}: {out}"
        );
        assert!(!ws.join("planted").exists(), "{what}: a file was planted");
    }
    // An unnamed temp file with an ordinary mode, named afterwards, still works.
    let script = format!(
        "my $dot = \".\"; my $r = syscall({}, {}, $dot, {o_tmpfile}, 0644); {link}; print -e \"planted\" ? \"named\\n\" : \"missing\\n\"",
        libc::SYS_openat,
        libc::AT_FDCWD
    );
    let out = lab
        .attempt("plain O_TMPFILE", json!({"argv": ["perl", "-e", script]}))
        .await;
    assert_eq!(out.stdout(), "named\n", "plain O_TMPFILE: {out}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(ws.join("planted"))
        .expect("plain temp file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o644, "mode {mode:o}");
}

/// Issue: one request ran 16 sandboxes at once, and 64 calls of 512 MiB each could
/// reserve 32 GiB. With `[sandbox] max_concurrent = 2`, a request of eight calls (and a
/// second request beside it) never has more than two sandboxes running; every call
/// still completes once others finish, and one whose timeout runs out while it waits
/// fails without running.
#[tokio::test]
async fn sandboxes_beyond_max_concurrent_wait_for_a_free_one() {
    let airlock = Airlock::start_with("[sandbox]\nmax_concurrent = 2\n").await;
    let ws = airlock.workspace("slots");
    // Each sandbox records how many ran beside it, then holds its slot until released.
    let uses: Vec<Value> = (0..8)
        .map(|i| {
            let script = format!(
                "touch running-{i}; ls running-* | wc -l >> counts; \
                 while [ ! -e release ]; do sleep 0.02; done; rm running-{i}"
            );
            json!({"type": "tool_use", "id": format!("c{i}"), "name": "execute_shell",
                   "input": {"command": script, "timeout_seconds": 120}})
        })
        .collect();
    let body = json!({"session_id": "slots", "wait_ms": 120_000, "tool_uses": uses});
    let first = {
        let airlock_url = airlock.url.clone();
        let token = airlock.token.clone();
        let body = body.clone();
        tokio::spawn(async move {
            reqwest::Client::new()
                .post(format!("{airlock_url}/v1/tool_calls"))
                .bearer_auth(token)
                .json(&body)
                .send()
                .await
                .expect("send")
                .json::<Value>()
                .await
                .expect("json")
        })
    };
    // Two run; wait (bounded) until both are in, then give the rest time to pile up.
    let deadline = Instant::now() + Duration::from_secs(60);
    let running = |ws: &Path| {
        std::fs::read_dir(ws)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("running-"))
                    .count()
            })
            .unwrap_or(0)
    };
    while running(&ws) < 2 {
        assert!(Instant::now() < deadline, "two sandboxes never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A call that may wait only 1 s while both slots stay taken never starts.
    let (is_error, text, call) = airlock
        .call_in(
            "slots",
            "execute_shell",
            json!({"command": "touch impatient-ran", "timeout_seconds": 1}),
        )
        .await;
    assert!(is_error, "{call}");
    assert!(
        text.contains("max_concurrent") && text.contains("no sandbox became free"),
        "{text}"
    );
    assert!(!ws.join("impatient-ran").exists(), "it ran without a slot");
    assert_eq!(
        running(&ws),
        2,
        "still exactly two sandboxes hold the slots"
    );

    std::fs::write(ws.join("release"), "").expect("release");
    let answer = first.await.expect("request");
    let calls = answer["calls"].as_array().expect("calls");
    assert_eq!(calls.len(), 8, "{answer}");
    for call in calls {
        assert_eq!(call["status"], "ok", "{answer}");
    }
    let counts = std::fs::read_to_string(ws.join("counts")).expect("counts");
    let counts: Vec<u32> = counts
        .lines()
        .map(|l| l.trim().parse().expect("count"))
        .collect();
    assert_eq!(counts.len(), 8, "every call ran once: {counts:?}");
    assert!(
        counts.iter().all(|n| *n <= 2),
        "at most two sandboxes ran at once: {counts:?}"
    );
}

/// The host's mount table without the volumes that the launchers of this test and of
/// the tests running beside it mount in their temp data dirs: one per workspace is what
/// the quota is made of (`workspace_quota`), plus each launcher's start-up probe, and
/// they come and go with their launchers. Every other mount counts — a sandbox can
/// mount nothing on the host, least of all a loop device.
fn host_mounts() -> String {
    let temp = std::env::temp_dir();
    std::fs::read_to_string("/proc/self/mountinfo")
        .expect("mountinfo")
        .lines()
        .filter(|line| {
            let point = std::path::Path::new(line.split(' ').nth(4).unwrap_or(""));
            let is_volume = point.starts_with(&temp) && line.contains(" - ext4 /dev/loop");
            !is_volume
        })
        .map(|line| format!("{line}\n"))
        .collect()
}
