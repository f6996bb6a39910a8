//! A pure cgroup v2 host for the cgroup v2 backend: a virtual machine (qemu, emulated)
//! booting a distribution kernel with every v1 controller disabled
//! (`cgroup_no_v1=all`) and only cgroup2 mounted, whose initramfs holds this very test
//! binary, its libraries and busybox. The sandbox tests named by the caller run inside
//! it, as root, and their output comes back over the serial console.
//!
//! Needs `qemu-system-x86_64`, busybox (`busybox-static`) and a kernel image at
//! `$AIRLOCK_TEST_KERNEL` (default `/var/cache/airlock-test/vmlinuz`; `.ci/run` extracts
//! Debian's `linux-image-amd64` there). A missing one fails the test, naming it.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const DEFAULT_KERNEL: &str = "/var/cache/airlock-test/vmlinuz";
/// Printed by the guest's init with the test binary's exit status.
const EXIT_MARKER: &str = "AIRLOCK-VM-EXIT=";
/// Generous: the guest boots in seconds under KVM, in a minute or two without it.
const VM_BOUND: Duration = Duration::from_secs(900);

/// The guest's output and the test binary's exit status inside it.
pub struct VmRun {
    pub console: String,
    pub exit_status: Option<i32>,
}

fn need(path: &Path, what: &str, fix: &str) {
    assert!(
        path.exists(),
        "{what} is missing at {}: {fix}",
        path.display()
    );
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|p| p.is_file())
    })
}

/// Boots the guest and runs `tests` (exact names) of this binary inside it.
pub fn run_in_v2_guest(tests: &[&str]) -> VmRun {
    let kernel = PathBuf::from(
        std::env::var("AIRLOCK_TEST_KERNEL").unwrap_or_else(|_| DEFAULT_KERNEL.to_owned()),
    );
    need(
        &kernel,
        "the guest kernel",
        "run .ci/run, or extract ./boot/vmlinuz-* of Debian's linux-image-amd64 there, or set \
         AIRLOCK_TEST_KERNEL",
    );
    let qemu = which("qemu-system-x86_64").unwrap_or_else(|| {
        panic!("qemu-system-x86_64 is missing: apt-get install qemu-system-x86")
    });
    let busybox = which("busybox")
        .unwrap_or_else(|| panic!("busybox is missing: apt-get install busybox-static"));

    let dir = tempfile::tempdir().expect("temp dir");
    let image = dir.path().join("initramfs.cpio");
    let mut archive = Cpio::create(&image);
    // The host's layout of the top-level directories (merged /usr: /bin → usr/bin ...).
    for top in [
        "bin", "sbin", "lib", "lib64", "usr", "usr/bin", "usr/sbin", "usr/lib",
    ] {
        let host = Path::new("/").join(top);
        match std::fs::read_link(&host) {
            Ok(target) => archive.symlink(top, &target),
            Err(_) => archive.dir(top),
        }
    }
    for d in ["etc", "proc", "sys", "dev", "tmp", "newroot", "test"] {
        archive.dir(d);
    }
    let me = std::env::current_exe().expect("current exe");
    archive.file("test/sandbox", &me, 0o755);
    // Programs the sandbox tests run besides busybox's applets.
    let perl = which("perl").unwrap_or_else(|| panic!("perl is missing: apt-get install perl"));
    let perl = std::fs::canonicalize(&perl).expect("perl");
    archive.parents(&perl);
    archive.file(rel(&perl), &perl, 0o755);
    let binaries = [me.clone(), busybox.clone(), perl];
    for lib in binaries.iter().flat_map(|b| libraries(b)) {
        let lib = &lib;
        let real = std::fs::canonicalize(lib).expect("library path");
        archive.parents(&real);
        archive.file(rel(&real), &real, 0o755);
        // The name the loader asks for, where it is another file name than the library's
        // (a symlinked directory above it is mirrored already).
        let alias = lib
            .parent()
            .and_then(|p| std::fs::canonicalize(p).ok())
            .zip(lib.file_name())
            .map(|(dir, name)| dir.join(name));
        if let Some(alias) = alias.filter(|a| *a != real) {
            archive.parents(&alias);
            archive.symlink(rel(&alias), &real);
        }
    }
    let bb = std::fs::canonicalize(&busybox).expect("busybox");
    archive.parents(&bb);
    archive.file(rel(&bb), &bb, 0o755);
    archive.text("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n", 0o644);
    archive.text("etc/group", "root:x:0:\n", 0o644);
    let filter = tests.join(" ");
    archive.text("init", &init_script(&bb), 0o755);
    archive.text("stage2", &stage2_script(&bb, &filter), 0o755);
    archive.finish();

    // Emulated (TCG), never KVM: the hosts we test on are virtual machines themselves,
    // where nested KVM refuses CPU features or hangs before the kernel prints; emulation
    // is slower and works on every x86_64 host. `AIRLOCK_TEST_VM_ACCEL=kvm` overrides.
    let accel = std::env::var("AIRLOCK_TEST_VM_ACCEL").unwrap_or_else(|_| "tcg".to_owned());
    let mut child = Command::new(qemu)
        .args(["-machine", "q35", "-cpu", "max", "-accel"])
        .arg(match accel.as_str() {
            "tcg" => "tcg,thread=multi",
            other => other,
        })
        .args(["-m", "2048", "-smp", "2", "-nographic", "-no-reboot"])
        .args(["-serial", "stdio", "-monitor", "none", "-nic", "none"])
        .arg("-kernel")
        .arg(&kernel)
        .arg("-initrd")
        .arg(&image)
        .args([
            "-append",
            "console=ttyS0 rdinit=/init cgroup_no_v1=all panic=-1 oops=panic quiet loglevel=3",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start qemu");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + VM_BOUND;
    let mut console = String::new();
    let mut exit_status = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let line = line.trim_end_matches('\r').to_owned();
                if let Some(code) = line.trim().strip_prefix(EXIT_MARKER) {
                    exit_status = code.trim().parse().ok();
                }
                console.push_str(&line);
                console.push('\n');
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "the guest did not finish within {} s:\n{console}",
                    VM_BOUND.as_secs()
                );
            }
        }
    }
    let status = child.wait().expect("qemu exit");
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
    }
    assert!(
        exit_status.is_some(),
        "the guest never reported (qemu {status}, accel {accel}):\n{console}\n{stderr}"
    );
    VmRun {
        console,
        exit_status,
    }
}

/// The first stage, on the initramfs: pivot_root cannot leave the initial rootfs, so
/// everything is copied into a tmpfs and the second stage runs there.
fn init_script(busybox: &Path) -> String {
    let bb = busybox.display();
    format!(
        "#!{bb} sh\n\
         {bb} mount -t tmpfs -o size=1536m tmpfs /newroot\n\
         for d in /*; do case \"$d\" in /newroot|/proc|/sys|/dev) ;; *) {bb} cp -a \"$d\" /newroot/ ;; esac; done\n\
         {bb} mkdir -p /newroot/proc /newroot/sys /newroot/dev\n\
         exec {bb} switch_root /newroot /stage2\n"
    )
}

fn stage2_script(busybox: &Path, tests: &str) -> String {
    let bb = busybox.display();
    format!(
        "#!{bb} sh\n\
         {bb} --install -s /bin\n\
         export PATH=/bin:/sbin:/usr/bin:/usr/sbin RUST_BACKTRACE=1\n\
         mount -t proc proc /proc\n\
         mount -t sysfs sysfs /sys\n\
         mount -t devtmpfs devtmpfs /dev\n\
         mount -t tmpfs -o size=256m tmpfs /tmp\n\
         mount -t cgroup2 cgroup2 /sys/fs/cgroup\n\
         echo '+memory +pids +cpu' > /sys/fs/cgroup/cgroup.subtree_control\n\
         echo \"guest cgroup: $(cat /proc/self/cgroup) controllers: $(cat /sys/fs/cgroup/cgroup.subtree_control)\"\n\
         echo \"guest v1 mounts: $(grep -c ' cgroup ' /proc/mounts)\"\n\
         cd /tmp\n\
         /test/sandbox --exact --test-threads=2 {tests}\n\
         echo {EXIT_MARKER}$?\n\
         poweroff -f\n"
    )
}

/// The libraries `binary` loads (from ldd), absolute paths as the loader names them.
fn libraries(binary: &Path) -> Vec<PathBuf> {
    let out = Command::new("ldd").arg(binary).output().expect("ldd");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next(),
                None => line.split_whitespace().next(),
            }?;
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

fn rel(path: &Path) -> &str {
    path.to_str().expect("utf-8 path").trim_start_matches('/')
}

/// A newc cpio archive, the initramfs format.
struct Cpio {
    out: std::io::BufWriter<std::fs::File>,
    ino: u32,
    names: std::collections::BTreeSet<String>,
}

impl Cpio {
    fn create(path: &Path) -> Self {
        Self {
            out: std::io::BufWriter::new(std::fs::File::create(path).expect("initramfs")),
            ino: 1,
            names: std::collections::BTreeSet::new(),
        }
    }

    fn has(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        if !self.names.insert(name.to_owned()) {
            return;
        }
        self.ino += 1;
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0
        );
        self.out.write_all(header.as_bytes()).expect("write");
        self.out.write_all(name.as_bytes()).expect("write");
        self.out.write_all(&[0]).expect("write");
        self.pad(110 + name.len() + 1);
        self.out.write_all(data).expect("write");
        self.pad(data.len());
    }

    fn pad(&mut self, len: usize) {
        let pad = (4 - len % 4) % 4;
        self.out.write_all(&[0; 3][..pad]).expect("write");
    }

    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, &[]);
    }

    /// Every directory above `path`, as directories unless already present.
    fn parents(&mut self, path: &Path) {
        let mut above: Vec<&Path> = path.ancestors().skip(1).collect();
        above.reverse();
        for dir in above {
            let name = rel(dir);
            if !name.is_empty() && !self.has(name) {
                self.dir(name);
            }
        }
    }

    fn symlink(&mut self, name: &str, target: &Path) {
        let target = target.to_str().expect("utf-8 target").as_bytes().to_vec();
        self.entry(name, 0o120_777, &target);
    }

    fn file(&mut self, name: &str, source: &Path, mode: u32) {
        let data = std::fs::read(source).expect("read file for the initramfs");
        self.entry(name, 0o100_000 | mode, &data);
    }

    fn text(&mut self, name: &str, text: &str, mode: u32) {
        self.entry(name, 0o100_000 | mode, text.as_bytes());
    }

    fn finish(mut self) {
        self.entry("TRAILER!!!", 0, &[]);
        self.out.flush().expect("flush");
    }
}
