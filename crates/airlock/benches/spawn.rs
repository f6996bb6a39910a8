//! Spawn-to-exit latency of `/bin/true`, side by side in one run: bare fork+exec,
//! `bwrap --unshare-all`, `airlock sandbox run -- true` as a whole process (the binary
//! this bench was built with: start-up, configuration, host probe, one sandbox, clean-up)
//! and Airlock's sandbox in process at the strict and standard levels, and strict from a
//! pool of pre-built sandboxes (`prebuilt = 2`; each used once, the pool refilling in
//! the background between two runs of the row).
//!
//! `cargo bench -p airlock --bench spawn` (as root; needs bubblewrap: `apt-get install
//! bubblewrap`). Prints a Markdown table of medians, p99 and ratios, and writes it to
//! `target/bench-spawn.md`. `AIRLOCK_BENCH_BASELINE=/path/to/old/airlock` adds that
//! binary's `airlock sandbox run -- true` as a row of the same run, to compare a change
//! with its parent.
//!
//! Rows take turns, one run of each per round, so that other load on the machine falls
//! on every row alike and the ratios stay comparable.

use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use airlock_sandbox::{Cancel, CommandSpec, IsolationLevel, NoSink, Sandbox, SandboxConfig};

const RUNS: usize = 300;
const WARMUP: usize = 20;
/// The bench stops after this long even if it has not finished its rounds.
const BUDGET: Duration = Duration::from_secs(240);

type Result<T> = std::result::Result<T, Box<dyn Error>>;

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

/// One row: a name and what one run does.
struct Row {
    name: String,
    once: Box<dyn FnMut() -> Result<()>>,
    samples: Vec<Duration>,
}

impl Row {
    fn new(name: impl Into<String>, once: impl FnMut() -> Result<()> + 'static) -> Self {
        Row {
            name: name.into(),
            once: Box::new(once),
            samples: Vec::with_capacity(RUNS),
        }
    }
}

/// The in-process sandbox at `level`; with `prebuilt`, every run must come from the
/// pool (rows take turns, so it refills between two runs of its row).
fn sandbox(
    level: IsolationLevel,
    prebuilt: usize,
    workspace: PathBuf,
) -> Result<impl FnMut() -> Result<()>> {
    let config = SandboxConfig {
        min_isolation: IsolationLevel::Standard,
        force_level: Some(level),
        cgroup_parent: format!("airlock-bench-{}-{prebuilt}", level.as_str()),
        prebuilt,
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
        if outcome.prebuilt != (prebuilt > 0) {
            return Err(format!(
                "the run was not from the pool: {}",
                outcome.fallback.unwrap_or_default()
            )
            .into());
        }
        Ok(())
    })
}

/// `<airlock> sandbox run [--profile P] -- /bin/true`, as an operator runs it: a temporary
/// workspace, the embedded default configuration (no config file, no data dir).
fn sandbox_run(binary: &Path, profile: Option<&str>) -> Command {
    let mut command = Command::new(binary);
    command.args(["sandbox", "run"]);
    if let Some(profile) = profile {
        command.args(["--profile", profile]);
    }
    command
        .args(["--", "/bin/true"])
        .env_remove("AIRLOCK_CONFIG")
        .env_remove("AIRLOCK_DATA_DIR")
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    command
}

fn bwrap() -> Command {
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
        } else if Path::new(&format!("/{link}")).exists() {
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
    bwrap
}

fn main() -> Result<()> {
    if !Path::new("/usr/bin/bwrap").exists() {
        return Err("bwrap is missing: install bubblewrap (apt-get install bubblewrap)".into());
    }
    let workspace = tempfile::tempdir()?;
    let airlock = PathBuf::from(env!("CARGO_BIN_EXE_airlock"));

    let mut rows = vec![
        Row::new("bare fork+exec", || {
            run_checked(&mut Command::new("/bin/true"))
        }),
        Row::new("`bwrap --unshare-all`", {
            let mut bwrap = bwrap();
            move || run_checked(&mut bwrap)
        }),
        Row::new("`airlock sandbox run -- true` (whole process)", {
            let mut command = sandbox_run(&airlock, None);
            move || run_checked(&mut command)
        }),
        Row::new("`airlock sandbox run --profile standard -- true`", {
            let mut command = sandbox_run(&airlock, Some("standard"));
            move || run_checked(&mut command)
        }),
    ];
    if let Some(baseline) = std::env::var_os("AIRLOCK_BENCH_BASELINE") {
        let baseline = PathBuf::from(baseline);
        rows.push(Row::new(
            format!(
                "baseline `{}` `sandbox run -- true`",
                baseline.file_name().unwrap_or_default().to_string_lossy()
            ),
            {
                let mut command = sandbox_run(&baseline, None);
                move || run_checked(&mut command)
            },
        ));
    }
    rows.push(Row::new(
        "Airlock sandbox in process, strict (every layer)",
        sandbox(IsolationLevel::Strict, 0, workspace.path().to_path_buf())?,
    ));
    rows.push(Row::new(
        "Airlock sandbox in process, strict, from the pool",
        sandbox(IsolationLevel::Strict, 2, workspace.path().to_path_buf())?,
    ));
    rows.push(Row::new(
        "Airlock sandbox in process, standard",
        sandbox(IsolationLevel::Standard, 0, workspace.path().to_path_buf())?,
    ));

    for row in &mut rows {
        for _ in 0..WARMUP {
            (row.once)()?;
        }
    }
    let started = Instant::now();
    for _ in 0..RUNS {
        if started.elapsed() > BUDGET {
            break;
        }
        for row in &mut rows {
            let t = Instant::now();
            (row.once)()?;
            row.samples.push(t.elapsed());
        }
    }
    for row in &mut rows {
        row.samples.sort();
    }

    let median = |row: &Row| percentile(&row.samples, 0.5).as_secs_f64();
    let bare = median(&rows[0]);
    let bwrap_median = median(&rows[1]);
    let mut table = String::from(
        "| spawn-to-exit of /bin/true | runs | median ms | p99 ms | × bare fork+exec | × bwrap |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    for row in &rows {
        let m = median(row);
        table.push_str(&format!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} |\n",
            row.name,
            row.samples.len(),
            m * 1e3,
            percentile(&row.samples, 0.99).as_secs_f64() * 1e3,
            m / bare,
            m / bwrap_median,
        ));
    }
    println!("{table}");
    // The target directory: two levels above the binary (`<target>/release/airlock`).
    let target = airlock
        .parent()
        .and_then(Path::parent)
        .map_or_else(|| PathBuf::from("target"), Path::to_path_buf);
    std::fs::write(target.join("bench-spawn.md"), &table)?;
    Ok(())
}
