//! `cargo run -p airlock-sandbox --example sandbox_run -- <cmd…>`: runs one command in a
//! sandbox over the current directory and prints the isolation report — what
//! `airlock sandbox run -- <cmd…>` does.

use std::io::Write;
use std::time::Duration;

use airlock_sandbox::{Cancel, CommandSpec, Sandbox, SandboxConfig, Stream};

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.is_empty() {
        eprintln!("usage: sandbox_run <command> [args…]");
        std::process::exit(2);
    }
    let sandbox = match Sandbox::new(SandboxConfig::default()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let workspace = std::env::current_dir().unwrap_or_else(|_| "/tmp".into());
    let mut spec = CommandSpec::new(argv, workspace);
    spec.timeout = Duration::from_secs(30);
    let mut sink = |stream: Stream, data: &[u8]| {
        let _ = match stream {
            Stream::Stdout => std::io::stdout().write_all(data),
            Stream::Stderr => std::io::stderr().write_all(data),
        };
    };
    match sandbox.run(&spec, &mut sink, &Cancel::new()) {
        Ok(outcome) => {
            eprintln!("{}", outcome.isolation);
            eprintln!(
                "exit_code={:?} signal={:?} timed_out={} duration_ms={} usage={:?}",
                outcome.exit_code,
                outcome.signal,
                outcome.timed_out,
                outcome.duration.as_millis(),
                outcome.usage
            );
            std::process::exit(outcome.exit_code.unwrap_or(128));
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
