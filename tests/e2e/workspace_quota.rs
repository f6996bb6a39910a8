//! `[sandbox] workspace_bytes` and `workspace_inodes` (DESIGN §16): each workspace is a
//! file system of its own, so the kernel refuses what would exceed the quota — whatever a
//! sandboxed command or an fs tool tries — and nothing of it reaches the host's disk.

use std::os::unix::fs::MetadataExt;

use serde_json::{Value, json};

use crate::support::{AIRLOCK, Airlock, mounts_under};

const BYTES: u64 = 32 << 20;
const INODES: u64 = 400;

fn quota_config(bytes: u64, inodes: u64) -> String {
    format!("[sandbox]\nworkspace_bytes = {bytes}\nworkspace_inodes = {inodes}\n")
}

/// Runs `command` in the sandbox of `session`; returns the parsed result and its text.
async fn shell(airlock: &Airlock, session: &str, command: &str) -> Value {
    let (_, text, _) = airlock
        .call_in(
            session,
            "execute_shell",
            json!({"command": command, "timeout_seconds": 60}),
        )
        .await;
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("shell result {text:?}: {e}"))
}

/// Bytes the host's disk holds for the workspace volumes of `airlock` (allocated blocks
/// of every image, not their apparent size).
fn images_on_disk(airlock: &Airlock) -> u64 {
    let mut total = 0;
    let mut stack = vec![airlock.data_dir().join("volumes")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                stack.push(entry.path());
            } else {
                total += meta.blocks() * 512;
            }
        }
    }
    total
}

/// Bytes used below `dir` on the host's own file system, stopping at mount points.
fn host_bytes_below(dir: &std::path::Path) -> u64 {
    let Ok(top) = std::fs::symlink_metadata(dir) else {
        return 0;
    };
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let meta = std::fs::symlink_metadata(entry.path()).unwrap();
            if meta.dev() != top.dev() {
                continue;
            }
            if meta.is_dir() {
                stack.push(entry.path());
            }
            total += meta.blocks() * 512;
        }
    }
    total
}

#[tokio::test]
async fn a_workspace_cannot_grow_past_its_byte_quota_by_any_route() {
    let mut airlock = Airlock::start_with(&quota_config(BYTES, INODES)).await;

    // Every way a command fills a disk: one big write, preallocation, dd, a sparse file
    // filled in, and several writers at once.
    let attempts = [
        "head -c 100000000 /dev/zero > big",
        "fallocate -l 100M prealloc",
        "dd if=/dev/zero of=dd.bin bs=1M count=100",
        "truncate -s 10G sparse && dd if=/dev/zero of=sparse bs=1M count=100 conv=notrunc",
        "for i in 1 2 3 4; do head -c 20000000 /dev/zero > p$i & done; wait; exit 1",
    ];
    for attempt in attempts {
        let result = shell(&airlock, "default", attempt).await;
        assert_ne!(result["exit_code"], 0, "{attempt} must fail: {result}");
        let usage = shell(
            &airlock,
            "default",
            "du -sk --apparent-size . | cut -f1; df -B1 --output=used,size . | tail -1",
        )
        .await;
        let out = usage["stdout"].as_str().unwrap().to_owned();
        let mut lines = out.lines();
        let _apparent = lines.next();
        let mut df = lines.next().unwrap().split_whitespace();
        let used: u64 = df.next().unwrap().parse().unwrap();
        let size: u64 = df.next().unwrap().parse().unwrap();
        assert!(size <= BYTES, "the workspace is at most the quota: {out}");
        assert!(used <= BYTES, "{attempt}: {out}");
        shell(
            &airlock,
            "default",
            "rm -f big prealloc dd.bin sparse p1 p2 p3 p4",
        )
        .await;
    }

    // Full: the command's own error, the result's flag and note, the quota in the report.
    let full = shell(&airlock, "default", "head -c 100000000 /dev/zero > big").await;
    assert!(
        full["stderr"]
            .as_str()
            .unwrap()
            .contains("No space left on device"),
        "{full}"
    );
    assert_eq!(full["workspace_full"], true, "{full}");
    assert!(
        full["note"].as_str().unwrap().contains("workspace_bytes"),
        "{full}"
    );
    assert_eq!(
        full["isolation"]["workspace_quota"],
        json!({"bytes": BYTES, "inodes": INODES}),
        "{full}"
    );

    // The fs tools meet the same wall, with an error that says what to do.
    let (is_error, text, _) = airlock
        .call(
            "write_file",
            json!({"path": "more.txt", "content": "x".repeat(200_000)}),
        )
        .await;
    assert!(is_error, "{text}");
    assert!(
        text.contains("the workspace is full") && text.contains("delete files"),
        "{text}"
    );
    assert!(
        !airlock.workspace("default").join("more.txt").exists(),
        "a refused write leaves no file behind"
    );

    // Another workspace of the same principal has its own quota, untouched.
    let (is_error, text, _) = airlock
        .call_in(
            "other",
            "write_file",
            json!({"path": "ok.txt", "content": "fine"}),
        )
        .await;
    assert!(!is_error, "{text}");

    // Freeing space makes room again.
    shell(&airlock, "default", "rm big").await;
    let (is_error, text, _) = airlock
        .call(
            "write_file",
            json!({"path": "more.txt", "content": "x".repeat(200_000)}),
        )
        .await;
    assert!(!is_error, "{text}");

    // The host: what the workspaces hold is in their images, which never exceed the
    // quota on disk, and nothing of it sits beside the mount points.
    let on_disk = images_on_disk(&airlock);
    assert!(
        on_disk <= 2 * BYTES + (1 << 20),
        "two workspaces' images hold {on_disk} bytes on the host"
    );
    let beside = host_bytes_below(&airlock.data_dir().join("workspaces"));
    assert!(
        beside < 1 << 20,
        "{beside} bytes were written to the host's disk outside the volumes"
    );

    // Stopping unmounts every volume (`stop` asserts it); the files stay in the image.
    let mounted = mounts_under(airlock.dir.path());
    assert_eq!(mounted.len(), 2, "one volume per workspace: {mounted:?}");
    airlock.stop();
}

#[tokio::test]
async fn a_workspace_cannot_hold_more_files_than_its_inode_quota() {
    let airlock = Airlock::start_with(&quota_config(64 << 20, 200)).await;
    let attempts = [
        // plain files, until the shell stops
        "i=0; while true 2>/dev/null > f$i; do i=$((i+1)); done; echo $i",
        // directories and symbolic links use inodes too
        "i=0; while mkdir d$i 2>/dev/null; do i=$((i+1)); done; echo $i",
        "i=0; while ln -s target l$i 2>/dev/null; do i=$((i+1)); done; echo $i",
    ];
    for attempt in attempts {
        let result = shell(&airlock, "default", attempt).await;
        let made: u64 = result["stdout"].as_str().unwrap().trim().parse().unwrap();
        assert!(
            (1..=200).contains(&made),
            "{attempt}: created {made} entries under a 200-inode quota: {result}"
        );
        let full = shell(&airlock, "default", "df --output=iavail . | tail -1").await;
        assert_eq!(full["workspace_full"], true, "{full}");
        let (is_error, text, _) = airlock
            .call("create_directory", json!({"path": "one-more"}))
            .await;
        assert!(is_error && text.contains("the workspace is full"), "{text}");
        let (is_error, text, _) = airlock
            .call(
                "write_file",
                json!({"path": "one-more.txt", "content": "x"}),
            )
            .await;
        assert!(is_error && text.contains("the workspace is full"), "{text}");
        shell(&airlock, "default", "rm -rf f* d* l*").await;
    }
    let (is_error, text, _) = airlock
        .call("write_file", json!({"path": "after.txt", "content": "x"}))
        .await;
    assert!(!is_error, "room again after deleting: {text}");
}

#[tokio::test]
async fn a_sandbox_cannot_unmount_remount_or_reach_past_its_volume() {
    let airlock = Airlock::start_with(&quota_config(BYTES, INODES)).await;
    let before = shell(&airlock, "default", "df -B1 --output=size . | tail -1").await;
    let attempts = [
        "umount /workspace",
        "umount -l /workspace",
        "mount -t tmpfs -o size=1g none /workspace",
        "mount -o remount,size=10g /workspace",
        "mount --bind /tmp /workspace",
        // a hard link to a file of another file system, and a rename out of the volume
        "ln /etc/hostname here",
        "echo x > /tmp/t && mv /workspace/../tmp/t /workspace/t && test ! -e /tmp/t",
        "chattr -i . || lsattr -d .",
    ];
    for attempt in attempts {
        let result = shell(&airlock, "default", &format!("{attempt} 2>&1; echo rc=$?")).await;
        let out = result["stdout"].as_str().unwrap();
        let after = shell(&airlock, "default", "df -B1 --output=size . | tail -1").await;
        assert_eq!(
            after["stdout"], before["stdout"],
            "{attempt} changed the workspace's size: {out}"
        );
        if attempt.starts_with("umount") || attempt.starts_with("mount") {
            assert!(!out.contains("rc=0"), "{attempt} succeeded: {out}");
        }
        if attempt.starts_with("ln ") {
            assert!(!out.contains("rc=0"), "{attempt} succeeded: {out}");
        }
    }
    // The volume is still mounted on the host, where it was.
    let point = airlock.workspace("default");
    assert!(
        mounts_under(airlock.dir.path()).contains(&point),
        "{point:?} is no longer a mount point"
    );
    let full = shell(&airlock, "default", "head -c 100000000 /dev/zero > big").await;
    assert_eq!(
        full["workspace_full"], true,
        "the quota still holds: {full}"
    );
}

#[tokio::test]
async fn files_written_before_the_first_call_move_into_the_new_volume() {
    let airlock = Airlock::start_with(&quota_config(BYTES, INODES)).await;
    // A workspace written without a quota (by hand, or by a release without one).
    let legacy = airlock.workspace("legacy");
    std::fs::create_dir_all(legacy.join("src")).unwrap();
    std::fs::write(legacy.join("src/main.txt"), "kept").unwrap();
    std::os::unix::fs::symlink("src/main.txt", legacy.join("link")).unwrap();
    let (is_error, text, _) = airlock
        .call_in("legacy", "read_file", json!({"path": "link"}))
        .await;
    assert!(is_error, "symlinks stay links, not copies: {text}");
    let (is_error, text, _) = airlock
        .call_in("legacy", "read_file", json!({"path": "src/main.txt"}))
        .await;
    assert!(!is_error && text.contains("kept"), "{text}");
    assert!(
        mounts_under(airlock.dir.path()).contains(&legacy),
        "the workspace is now a volume"
    );
    let root_dev = std::fs::metadata(airlock.data_dir()).unwrap().dev();
    assert_ne!(std::fs::metadata(&legacy).unwrap().dev(), root_dev);

    // One that does not fit its quota is refused whole and keeps its files.
    let big = airlock.workspace("too-big");
    std::fs::create_dir_all(&big).unwrap();
    std::fs::write(big.join("blob"), vec![7u8; 40 << 20]).unwrap();
    let (is_error, text, _) = airlock
        .call_in("too-big", "list_directory", json!({"path": "."}))
        .await;
    assert!(is_error, "{text}");
    assert!(text.contains("workspace_bytes"), "{text}");
    assert_eq!(std::fs::metadata(big.join("blob")).unwrap().len(), 40 << 20);
    assert!(!mounts_under(airlock.dir.path()).contains(&big));
    assert!(
        !airlock
            .data_dir()
            .join("volumes/local/too-big.ext4")
            .exists(),
        "the failed image is removed"
    );
}

#[tokio::test]
async fn half_a_quota_or_one_too_small_is_refused_at_start() {
    for (config, expected) in [
        (
            "[sandbox]\nworkspace_bytes = 0\nworkspace_inodes = 100\n",
            "set both to 0",
        ),
        (
            "[sandbox]\nworkspace_bytes = 1000000\nworkspace_inodes = 100\n",
            "16 MiB",
        ),
        (
            "[sandbox]\nworkspace_bytes = 33554432\nworkspace_inodes = 3\n",
            "workspace_inodes = 3",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("airlock.toml"), config).unwrap();
        let data_dir = dir.path().join("data");
        let output = std::process::Command::new(AIRLOCK)
            .arg("up")
            .arg("--data-dir")
            .arg(&data_dir)
            .arg("--config")
            .arg(dir.path().join("airlock.toml"))
            .env_remove("AIRLOCK_CONFIG")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{config}");
        assert!(stderr.contains(expected), "{config}: {stderr}");
        assert!(
            !data_dir.exists(),
            "nothing is created for a refused config"
        );
    }
}

#[tokio::test]
async fn the_volume_broker_answers_only_the_launchers_own_workers() {
    use std::io::{Read, Write};
    let airlock = Airlock::start_with(&quota_config(BYTES, INODES)).await;
    let socket = airlock.data_dir().join("run/volumes.sock");
    let mode = std::fs::metadata(&socket).unwrap().mode() & 0o777;
    assert_eq!(mode, 0o600, "the socket is the launcher's user's only");
    // Same uid as the launcher, but not its child: refused without an answer.
    for request in [
        "ensure local intruder\n",
        "ensure ../.. x\n",
        "ping\n",
        &format!("ensure {} x\n", "a".repeat(5000)),
    ] {
        let mut stream = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let _ = stream.write_all(request.as_bytes());
        let mut reply = String::new();
        let _ = stream.read_to_string(&mut reply);
        assert_eq!(reply, "", "{request:?} was answered");
    }
    assert!(
        !airlock
            .data_dir()
            .join("volumes/local/intruder.ext4")
            .exists()
    );
    assert!(!airlock.workspace("intruder").exists());
    assert!(mounts_under(airlock.dir.path()).is_empty());
}

#[tokio::test]
async fn a_worker_started_alone_with_the_quota_on_refuses_without_a_launcher() {
    let dir = tempfile::tempdir().unwrap();
    for group in ["fs", "shell"] {
        let output = std::process::Command::new(AIRLOCK)
            .args([
                "serve",
                "worker",
                group,
                "--listen",
                "127.0.0.1:0",
                "--data-dir",
            ])
            .arg(dir.path())
            .env_remove("AIRLOCK_CONFIG")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{group}: {stderr}");
        for needle in [
            "cannot give workspaces their quota",
            "volumes.sock",
            "workspace_bytes = 0 and workspace_inodes = 0",
        ] {
            assert!(stderr.contains(needle), "{group}: `{needle}` in {stderr}");
        }
    }
}
