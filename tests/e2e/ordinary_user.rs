//! Running Airlock as an ordinary user, the way a laptop user does: a system user the
//! tests create, a copy of the binary that user can execute, and (made by root, as an
//! administrator would) a cgroup subtree delegated to that user.
//!
//! Processes are started with `setpriv --reuid --regid --clear-groups`, which leaves
//! exactly what a login shell has: no effective or permitted capabilities and a full
//! bounding set that the process may not drop (no `CAP_SETPCAP`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The user the tests run Airlock as.
const USER: &str = "airlock-e2e";

/// An ordinary (non-root) user.
#[derive(Debug, Clone)]
pub struct OrdinaryUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// The `airlock` binary, somewhere this user may execute it.
    pub airlock: PathBuf,
}

impl OrdinaryUser {
    /// The test user, created on first use. The tests run as root (they make sandboxes
    /// for other tests and start PostgreSQL); creating the user is part of the test,
    /// never a step someone has to remember.
    pub fn get() -> &'static OrdinaryUser {
        static USER_ONCE: OnceLock<OrdinaryUser> = OnceLock::new();
        USER_ONCE.get_or_init(create)
    }

    /// `setpriv` arguments that run a command as this user.
    pub fn command(&self, program: &Path) -> Command {
        let mut cmd = Command::new("setpriv");
        cmd.arg(format!("--reuid={}", self.uid))
            .arg(format!("--regid={}", self.gid))
            .arg("--clear-groups")
            .arg("--")
            .arg(program)
            .env("USER", &self.name)
            .env("HOME", "/nonexistent");
        cmd
    }

    /// Gives `path` and everything below it to this user.
    pub fn own(&self, path: &Path) {
        let mut stack = vec![path.to_path_buf()];
        while let Some(p) = stack.pop() {
            std::os::unix::fs::lchown(&p, Some(self.uid), Some(self.gid))
                .unwrap_or_else(|e| panic!("chown {}: {e}", p.display()));
            if p.is_dir() && !p.is_symlink() {
                for entry in std::fs::read_dir(&p).expect("read dir").flatten() {
                    stack.push(entry.path());
                }
            }
        }
    }
}

fn create() -> OrdinaryUser {
    assert!(
        rustix::process::geteuid().is_root(),
        "the ordinary-user tests create their user and so must start as root \
         (as .ci/run does); run `cargo test` as root"
    );
    for tool in ["useradd", "setpriv"] {
        assert!(
            Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .output()
                .is_ok_and(|o| o.status.success()),
            "the ordinary-user tests need `{tool}` (Debian: passwd, util-linux)"
        );
    }
    if id(USER, "-u").is_none() {
        let out = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--home-dir",
                "/nonexistent",
                "--shell",
                "/usr/sbin/nologin",
                USER,
            ])
            .output()
            .expect("run useradd");
        // Another test process may have created it meanwhile (exit 9: already exists).
        assert!(
            out.status.success() || out.status.code() == Some(9),
            "useradd {USER}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let uid = id(USER, "-u").expect("uid of the test user");
    let gid = id(USER, "-g").expect("gid of the test user");
    assert_ne!(uid, 0, "{USER} must not be root");
    OrdinaryUser {
        name: USER.to_owned(),
        uid,
        gid,
        airlock: executable_copy(),
    }
}

fn id(user: &str, flag: &str) -> Option<u32> {
    let out = Command::new("id").args([flag, user]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// The build's binary usually sits below a directory other users cannot enter (a
/// checkout in /root): a copy in a world-readable directory of its own, made once per
/// test process.
fn executable_copy() -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("airlock-e2e-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("binary dir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
    let copy = dir.join("airlock");
    std::fs::copy(crate::support::AIRLOCK, &copy).expect("copy the airlock binary");
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).expect("chmod bin");
    copy
}

/// A cgroup subtree that root delegated to the user, in every hierarchy of the host,
/// removed (bottom-up) on drop.
pub struct Delegation {
    /// Directories made for the user, one per hierarchy.
    dirs: Vec<PathBuf>,
    /// `[sandbox] cgroup_parent` for a worker started inside.
    pub cgroup_parent: String,
    /// cgroup v2 with controllers: the launcher must start inside the subtree (the
    /// kernel lets a process move only between cgroups below one it may write to).
    pub enter: Option<PathBuf>,
}

impl Delegation {
    pub fn new(user: &OrdinaryUser, tag: &str) -> Delegation {
        let name = format!("airlock-e2e-{tag}-{}", std::process::id());
        let mut dirs = Vec::new();
        let mut enter = None;
        for mount in crate::support::cgroup_mounts() {
            let wanted = mount.v2
                || ["memory", "pids", "cpu", "cpuacct", "freezer"]
                    .iter()
                    .any(|c| mount.options.iter().any(|o| o == c));
            if !wanted {
                continue;
            }
            let mount_point = mount.mount_point.as_path();
            let dir = mount_point.join(&name);
            std::fs::create_dir_all(&dir)
                .unwrap_or_else(|e| panic!("delegate {}: {e}", dir.display()));
            chown(&dir, user);
            if mount.v2 {
                // Delegation in v2 is the directory plus these three files.
                for file in ["cgroup.procs", "cgroup.subtree_control", "cgroup.threads"] {
                    chown(&dir.join(file), user);
                }
                let controllers =
                    std::fs::read_to_string(mount_point.join("cgroup.subtree_control"))
                        .unwrap_or_default();
                if ["memory", "pids", "cpu"]
                    .iter()
                    .all(|c| controllers.split_whitespace().any(|have| have == *c))
                {
                    enter = Some(dir.clone());
                }
            }
            dirs.push(dir);
        }
        assert!(
            !dirs.is_empty(),
            "no cgroup hierarchy is mounted on this host"
        );
        // Pure v2: the launcher starts inside the delegated directory and the worker
        // sets up its parent below its own cgroup; v1 and hybrid: the parent is the
        // delegated directory, named from the root of each hierarchy.
        let cgroup_parent = if enter.is_some() {
            "airlock".to_owned()
        } else {
            format!("/{name}")
        };
        Delegation {
            dirs,
            cgroup_parent,
            enter,
        }
    }
}

fn chown(path: &Path, user: &OrdinaryUser) {
    std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid))
        .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
}

impl Drop for Delegation {
    fn drop(&mut self) {
        for dir in &self.dirs {
            remove_cgroup_tree(dir);
        }
    }
}

/// Removes a cgroup directory and the (empty) cgroups below it, deepest first.
fn remove_cgroup_tree(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&entry.path());
            }
        }
    }
    // A v2 leaf that still holds a process cannot go; move it to the parent first.
    if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs"))
        && let Some(parent) = dir.parent()
    {
        for pid in procs.lines() {
            let _ = std::fs::write(parent.join("cgroup.procs"), pid);
        }
    }
    let _ = std::fs::remove_dir(dir);
}
