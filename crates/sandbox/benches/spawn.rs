//! Spawn-to-exit latency of `/bin/true`, side by side in one run: bare fork+exec,
//! `bwrap --unshare-all`, and Airlock's sandbox at the strict and standard levels.
//!
//! `cargo bench -p airlock-sandbox --bench spawn` (as root; needs bubblewrap:
//! `apt-get install bubblewrap`). Prints a Markdown table of medians, p99 and ratios,
//! and writes it to `target/bench-spawn.md`.

use std::error::Error;
use std::process::Command;
use std::time::{Duration, Instant};

use airlock_sandbox::{Cancel, CommandSpec, IsolationLevel, NoSink, Sandbox, SandboxConfig};

const RUNS: usize = 300;
const WARMUP: usize = 20;
/// Every row stops after this long even if it has not finished its runs.
const ROW_BUDGET: Duration = Duration::from_secs(60);

type Result<T> = std::result::Result<T, Box<dyn Error>>;

fn measure(mut once: impl FnMut() -> Result<()>) -> Result<Vec<Duration>> {
    for _ in 0..WARMUP {
        once()?;
    }
    let started = Instant::now();
    let mut samples = Vec::with_capacity(RUNS);
    while samples.len() < RUNS && started.elapsed() < ROW_BUDGET {
        let t = Instant::now();
        once()?;
        samples.push(t.elapsed());
    }
    samples.sort();
    Ok(samples)
}

fn percentile(samples: &[Duration], p: f64) -> Duration {
    let index = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples.get(index).copied().unwrap_or_default()
}

fn run_checked(command: &mut Command) -> Result<()> {
    let status = command.status()?;
    if !status.success() {
        return Err(format!("{command:?} failed: {status}").into());
    }
    Ok(())
}

fn sandbox(
    level: IsolationLevel,
    workspace: &std::path::Path,
) -> Result<impl FnMut() -> Result<()>> {
    let config = SandboxConfig {
        min_isolation: IsolationLevel::Standard,
        force_level: Some(level),
        cgroup_parent: format!("airlock-bench-{}", level.as_str()),
        ..SandboxConfig::default()
    };
    let sandbox = Sandbox::new(config)?;
    let spec = CommandSpec::new(vec!["/bin/true".into()], workspace);
    let cancel = Cancel::new();
    Ok(move || {
        let outcome = sandbox.run(&spec, &mut NoSink, &cancel)?;
        if outcome.exit_code != Some(0) {
            return Err(format!("sandboxed true exited {:?}", outcome.exit_code).into());
        }
        Ok(())
    })
}

fn main() -> Result<()> {
    if !std::path::Path::new("/usr/bin/bwrap").exists() {
        return Err("bwrap is missing: install bubblewrap (apt-get install bubblewrap)".into());
    }
    let workspace = tempfile::tempdir()?;
    let mut bwrap = Command::new("/usr/bin/bwrap");
    bwrap.args([
        "--unshare-all",
        "--die-with-parent",
        "--ro-bind",
        "/usr",
        "/usr",
    ]);
    for link in ["bin", "lib", "lib64", "sbin"] {
        let target = format!("usr/{link}");
        if std::fs::symlink_metadata(format!("/{link}")).is_ok_and(|m| m.file_type().is_symlink()) {
            bwrap.args(["--symlink", &target, &format!("/{link}")]);
        } else if std::path::Path::new(&format!("/{link}")).exists() {
            bwrap.args(["--ro-bind", &format!("/{link}"), &format!("/{link}")]);
        }
    }
    bwrap.args([
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
        "/bin/true",
    ]);

    let rows: Vec<(&str, Vec<Duration>)> = vec![
        (
            "bare fork+exec",
            measure(|| run_checked(&mut Command::new("/bin/true")))?,
        ),
        ("bwrap --unshare-all", measure(|| run_checked(&mut bwrap))?),
        (
            "airlock sandbox, strict",
            measure(sandbox(IsolationLevel::Strict, workspace.path())?)?,
        ),
        (
            "airlock sandbox, standard",
            measure(sandbox(IsolationLevel::Standard, workspace.path())?)?,
        ),
    ];
    let bare = percentile(&rows[0].1, 0.5).as_secs_f64();
    let bwrap_median = percentile(&rows[1].1, 0.5).as_secs_f64();
    let mut table = String::from(
        "| spawn-to-exit of /bin/true | runs | median ms | p99 ms | × bare | × bwrap |\n|---|---|---|---|---|---|\n",
    );
    for (name, samples) in &rows {
        let median = percentile(samples, 0.5).as_secs_f64();
        table.push_str(&format!(
            "| {name} | {} | {:.2} | {:.2} | {:.2} | {:.2} |\n",
            samples.len(),
            median * 1e3,
            percentile(samples, 0.99).as_secs_f64() * 1e3,
            median / bare,
            median / bwrap_median,
        ));
    }
    println!("{table}");
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-spawn.md");
    std::fs::write(out, &table)?;
    Ok(())
}
