//! The workspace volume broker of `airlock up`: one ext4 file system per workspace,
//! sized to `[sandbox] workspace_bytes` and `workspace_inodes` (DESIGN §16), so the
//! kernel itself refuses the block or the inode past the quota, for a sandboxed command
//! and an fs tool alike.
//!
//! Mounting needs `CAP_SYS_ADMIN`, which no confined worker keeps, so the launcher —
//! which runs no tool and parses no model input — does it on a worker's request over
//! `<data_dir>/run/volumes.sock`. The request names a principal and a session, nothing
//! else; only the launcher's own children (same uid, parent pid = the launcher) are
//! answered. Each workspace's image is `<data_dir>/volumes/<principal>/<session>.ext4`,
//! a sparse file created whole (written under a temporary name, renamed when mkfs is
//! done), and mounted `nosuid,nodev` at `<workspaces_root>/<principal>/<session>`. The
//! volumes are unmounted when the launcher stops; ones left mounted by a launcher that was
//! killed are found and reused by the next.

use std::collections::BTreeSet;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use airlock_worker::volumes::{BROKER_SOCKET, MAX_LINE, Request, WorkspaceQuota, is_plain_segment};
use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::process::Command;
use tokio::sync::Mutex;

use crate::config::Loaded;

/// The probe volume's image name: a file, where principals are directories.
const PROBE: &str = ".probe";

/// Creates, mounts and unmounts workspace volumes.
pub struct Volumes {
    images: PathBuf,
    root: PathBuf,
    /// `<data_dir>/run`: where a workspace written before quotas is staged.
    run_dir: PathBuf,
    quota: WorkspaceQuota,
    /// The owner of each volume's root directory: the workers' uid and gid (the
    /// launcher's own).
    owner: (u32, u32),
    /// Mount points mounted (or found mounted) by this launcher. The lock also makes
    /// one volume at a time, so two workers asking for one new workspace get one image.
    mounted: Mutex<BTreeSet<PathBuf>>,
}

impl Volumes {
    /// `None` when `[sandbox] workspace_bytes` is 0.
    pub fn new(loaded: &Loaded) -> Option<Self> {
        let quota = loaded.workspace_quota()?;
        Some(Self {
            images: loaded.volumes_dir(),
            root: loaded.workspaces_root(),
            run_dir: loaded.data_dir.join("run"),
            quota,
            owner: (
                rustix::process::geteuid().as_raw(),
                rustix::process::getegid().as_raw(),
            ),
            mounted: Mutex::new(BTreeSet::new()),
        })
    }

    /// Proves, before any worker starts, that this host lets the launcher make and mount a
    /// volume: a small one is created, mounted, written, unmounted and removed. Fails closed
    /// with the cause and the two ways out.
    pub async fn probe(&self) -> anyhow::Result<()> {
        let fix = "run `airlock up` as root (it mounts one file system per workspace), or set \
                   [sandbox] workspace_bytes = 0 and workspace_inodes = 0 to run without a \
                   per-workspace quota";
        let quota = WorkspaceQuota {
            bytes: 16 << 20,
            inodes: 64,
        };
        let image = self.images.join(format!("{PROBE}.ext4"));
        let point = self.run_dir.join("volume-probe");
        let outcome = async {
            make_dirs(&self.images)?;
            make_dirs(&point)?;
            make_image(&image, quota, self.owner).await?;
            mount(&image, &point).await?;
            let written = std::fs::write(point.join("probe"), b"ok");
            unmount(&point).await?;
            written.context("cannot write to the probe volume")
        }
        .await;
        let _ = std::fs::remove_file(&image);
        let _ = std::fs::remove_dir(&point);
        outcome.with_context(|| {
            format!(
                "[sandbox] workspace_bytes = {} and workspace_inodes = {} need a file system \
                 per workspace, and this host does not let airlock make one; {fix}",
                self.quota.bytes, self.quota.inodes
            )
        })
    }

    /// Listens on `<data_dir>/run/volumes.sock` (mode 0600) and answers requests until
    /// the task is dropped.
    pub fn listen(
        self: &Arc<Self>,
        data_dir: &Path,
    ) -> anyhow::Result<tokio::task::JoinHandle<()>> {
        let socket = data_dir.join(BROKER_SOCKET);
        match std::fs::remove_file(&socket) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("cannot remove {}", socket.display()));
            }
            _ => {}
        }
        let listener = UnixListener::bind(&socket)
            .with_context(|| format!("cannot listen on {}", socket.display()))?;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))?;
        let volumes = Arc::clone(self);
        Ok(tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let volumes = Arc::clone(&volumes);
                tokio::spawn(async move { volumes.answer(stream).await });
            }
        }))
    }

    async fn answer(&self, stream: UnixStream) {
        if let Err(refusal) = own_child(&stream) {
            tracing::warn!(%refusal, "volume broker: refused a connection");
            return;
        }
        let (read, mut write) = stream.into_split();
        let mut line = String::new();
        let mut reader = BufReader::new(tokio::io::AsyncReadExt::take(read, MAX_LINE as u64));
        let reply = match reader.read_line(&mut line).await {
            Ok(_) => match Request::parse(line.trim_end_matches('\n')) {
                Some(Request::Ping) => Ok(()),
                Some(Request::Ensure { principal, session }) => {
                    self.ensure(&principal, &session).await
                }
                None => Err(anyhow::anyhow!("not a request")),
            },
            Err(e) => Err(anyhow::anyhow!("cannot read the request: {e}")),
        };
        let reply = match reply {
            Ok(()) => "ok\n".to_owned(),
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "volume broker: request failed");
                // One line: the message's own newlines would end the reply early.
                format!("error {}\n", format!("{e:#}").replace('\n', " "))
            }
        };
        let _ = write.write_all(reply.as_bytes()).await;
    }

    /// Makes `<root>/<principal>/<session>` a mounted volume, creating its image the first
    /// time.
    async fn ensure(&self, principal: &str, session: &str) -> anyhow::Result<()> {
        if !is_plain_segment(principal) || !is_plain_segment(session) {
            bail!("principal and session must be plain path segments");
        }
        let mut mounted = self.mounted.lock().await;
        let parent = self.root.join(principal);
        let point = parent.join(session);
        if mounted.contains(&point) {
            return Ok(());
        }
        make_dirs(&point)?;
        let (above, own) = (plain_dir(&parent)?, plain_dir(&point)?);
        if above.dev() != own.dev() {
            // Mounted by an earlier launcher that did not get to unmount it.
            mounted.insert(point);
            return Ok(());
        }
        let legacy = std::fs::read_dir(&point)?.next().is_some();
        let images = self.images.join(principal);
        make_dirs(&images)?;
        let image = images.join(format!("{session}.ext4"));
        let fresh = !image.exists();
        if fresh {
            make_image(&image, self.quota, self.owner).await?;
        }
        if legacy && fresh {
            self.move_into(&image, &point).await.inspect_err(|_| {
                let _ = std::fs::remove_file(&image);
            })?;
        } else if legacy {
            bail!(
                "workspace {principal}/{session} holds files beside its volume {}; move them \
                 out of {} before it can be mounted",
                image.display(),
                point.display()
            );
        }
        mount(&image, &point).await?;
        mounted.insert(point.clone());
        if fresh {
            // mkfs leaves lost+found, which is not the workspace's; e2fsck recreates it
            // when it needs one.
            let _ = std::fs::remove_dir(point.join("lost+found"));
            std::fs::set_permissions(&point, std::fs::Permissions::from_mode(0o700))?;
        }
        tracing::info!(principal, session, fresh, "workspace volume mounted");
        Ok(())
    }

    /// A workspace written before quotas were on (or by hand, before its first call)
    /// moves into its new volume: copied in through a staging mount (symlinks stay links,
    /// nothing is followed), then removed from beneath the mount point. A workspace larger
    /// than the quota fails here, whole, and keeps its files.
    async fn move_into(&self, image: &Path, point: &Path) -> anyhow::Result<()> {
        let staging = self
            .run_dir
            .join(format!("volume-staging-{}", std::process::id()));
        make_dirs(&staging)?;
        mount(image, &staging).await?;
        let _ = std::fs::remove_dir(staging.join("lost+found"));
        let copied = run(Command::new("cp")
            .args(["-a", "--"])
            .arg(point.join("."))
            .arg(&staging))
        .await;
        let unmounted = unmount(&staging).await;
        let _ = std::fs::remove_dir(&staging);
        copied.with_context(|| {
            format!(
                "cannot move the files of {} into its volume of {} bytes and {} inodes \
                 ([sandbox] workspace_bytes, workspace_inodes)",
                point.display(),
                self.quota.bytes,
                self.quota.inodes
            )
        })?;
        unmounted?;
        for entry in std::fs::read_dir(point)? {
            let path = entry?.path();
            let removed = match std::fs::symlink_metadata(&path)?.file_type().is_dir() {
                true => std::fs::remove_dir_all(&path),
                false => std::fs::remove_file(&path),
            };
            removed.with_context(|| format!("cannot remove {} after moving it", path.display()))?;
        }
        tracing::info!(workspace = %point.display(), "workspace moved into its volume");
        Ok(())
    }

    /// Once every worker has stopped: unmounts every volume (a loop device mounted by
    /// mount(8) is released with its last mount).
    pub async fn unmount_all(&self) {
        let mut mounted = self.mounted.lock().await;
        for point in std::mem::take(&mut *mounted) {
            if let Err(e) = unmount(&point).await {
                tracing::warn!(point = %point.display(), error = format!("{e:#}"), "cannot unmount a workspace volume");
            }
        }
    }
}

/// Accepts only the launcher's own children: same uid, and the peer's parent is this
/// process.
fn own_child(stream: &UnixStream) -> Result<(), String> {
    let cred = stream.peer_cred().map_err(|e| e.to_string())?;
    if cred.uid() != rustix::process::geteuid().as_raw() {
        return Err(format!("peer uid {} is not the launcher's", cred.uid()));
    }
    let pid = cred.pid().ok_or("the peer's pid is unknown")?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| e.to_string())?;
    // The fields after the command name, which is in parentheses and may hold anything.
    let ppid = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1))
        .and_then(|p| p.parse::<u32>().ok())
        .ok_or("cannot read the peer's parent pid")?;
    if ppid != std::process::id() {
        return Err(format!("peer pid {pid} is not a child of the launcher"));
    }
    Ok(())
}

fn make_dirs(path: &Path) -> anyhow::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .with_context(|| format!("cannot create {}", path.display()))
}

/// The metadata of a real directory (not a symlink to one).
fn plain_dir(path: &Path) -> anyhow::Result<std::fs::Metadata> {
    let meta = std::fs::symlink_metadata(path)
        .with_context(|| format!("cannot inspect {}", path.display()))?;
    if !meta.file_type().is_dir() {
        bail!("{} is not a plain directory", path.display());
    }
    Ok(meta)
}

/// Writes a sparse image of `quota.bytes` and makes an ext4 file system of at least
/// `quota.inodes` inodes on it, then renames it into place, so an image either exists
/// whole or not at all.
async fn make_image(image: &Path, quota: WorkspaceQuota, owner: (u32, u32)) -> anyhow::Result<()> {
    let partial = image.with_extension("ext4.partial");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&partial)
        .with_context(|| format!("cannot create {}", partial.display()))?;
    file.set_len(quota.bytes)
        .with_context(|| format!("cannot size {}", partial.display()))?;
    drop(file);
    let made = run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0", "-N"])
        .arg(quota.inodes.to_string())
        .arg("-E")
        .arg(format!(
            "root_owner={}:{},lazy_itable_init=1,lazy_journal_init=1",
            owner.0, owner.1
        ))
        .arg(&partial))
    .await
    .context("mkfs.ext4 (from e2fsprogs) failed");
    if let Err(e) = made {
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    std::fs::rename(&partial, image)
        .with_context(|| format!("cannot rename {} into place", partial.display()))
}

async fn mount(image: &Path, point: &Path) -> anyhow::Result<()> {
    run(Command::new("mount")
        .args(["-t", "ext4", "-o", "loop,nosuid,nodev,noatime"])
        .arg(image)
        .arg(point))
    .await
    .with_context(|| format!("cannot mount {} at {}", image.display(), point.display()))
}

async fn unmount(point: &Path) -> anyhow::Result<()> {
    run(Command::new("umount").arg(point))
        .await
        .with_context(|| format!("cannot unmount {}", point.display()))
}

/// Runs a helper with an empty environment but `PATH`, and turns a failure into its
/// stderr.
async fn run(command: &mut Command) -> anyhow::Result<()> {
    let output = command
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .context("cannot run it")?;
    if !output.status.success() {
        bail!(
            "{}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}
