//! Logs go to stderr; `AIRLOCK_LOG_FORMAT=json` switches to JSON lines, `RUST_LOG` filters.
//!
//! Colour only on a terminal: `airlock up 2>airlock.log` and the components' logs under a
//! supervisor must be plain text, and `NO_COLOR` (any non-empty value, no-color.org)
//! turns colour off everywhere.

use std::ffi::OsString;
use std::io::IsTerminal;

use airlock_telemetry::Service;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Logs, and for a component (`service`), its OpenTelemetry layer when `OTEL_*` turn
/// tracing on. The exporter itself starts later, once the component is confined
/// ([`airlock_telemetry::start`]).
pub fn init(service: Option<&Service>) -> Result<(), airlock_telemetry::TelemetryError> {
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // The MCP library logs each session's start at info, with what the (untrusted)
    // server says about itself; the workers log what matters of it. RUST_LOG that
    // names rmcp still decides.
    let names_rmcp = std::env::var("RUST_LOG").is_ok_and(|v| v.contains("rmcp"));
    if !names_rmcp && let Ok(quiet) = "rmcp=warn".parse() {
        filter = filter.add_directive(quiet);
    }
    let log_level = log_crate_level(filter.max_level_hint());
    let json = std::env::var("AIRLOCK_LOG_FORMAT").is_ok_and(|v| v == "json");
    let ansi = colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR"),
    );
    // RUST_LOG filters the log lines only: the exported spans have their own filter, so
    // that `RUST_LOG=warn` does not turn tracing off.
    let logs = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let logs = if json {
        logs.json()
            .event_format(airlock_telemetry::json::JsonWithTrace::new(
                tracing_subscriber::fmt::format().json(),
            ))
            .with_filter(filter)
            .boxed()
    } else {
        logs.with_filter(filter).boxed()
    };
    let registry = tracing_subscriber::registry().with(logs);
    let traces = match service {
        Some(service) => airlock_telemetry::layer(service)?,
        None => None,
    };
    registry.with(traces).init();
    // `init` also routes the `log` crate's records into `tracing`, and lets through
    // every level the subscriber might want — TRACE as soon as the OpenTelemetry layer
    // is in, for its spans. But records from `log` are events, which only the log lines
    // take: left at TRACE, every `log::trace!` in the dependencies on a call's path
    // (HTTP clients, pools, TLS) would build its record and ask the filters, per call,
    // for nothing. They get the log lines' own level.
    if let Some(level) = log_level {
        log::set_max_level(level);
    }
    Ok(())
}

/// The `log` crate's level for the log lines' filter level.
fn log_crate_level(hint: Option<LevelFilter>) -> Option<log::LevelFilter> {
    let level = hint?;
    Some(if level == LevelFilter::OFF {
        log::LevelFilter::Off
    } else if level == LevelFilter::ERROR {
        log::LevelFilter::Error
    } else if level == LevelFilter::WARN {
        log::LevelFilter::Warn
    } else if level == LevelFilter::INFO {
        log::LevelFilter::Info
    } else if level == LevelFilter::DEBUG {
        log::LevelFilter::Debug
    } else {
        log::LevelFilter::Trace
    })
}

/// Whether log lines get ANSI colour codes.
fn colour(stderr_is_terminal: bool, no_color: Option<OsString>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::{LevelFilter, colour, log_crate_level};

    #[test]
    fn the_log_crate_gets_the_log_lines_level() {
        assert_eq!(
            log_crate_level(Some(LevelFilter::INFO)),
            Some(log::LevelFilter::Info)
        );
        assert_eq!(
            log_crate_level(Some(LevelFilter::OFF)),
            Some(log::LevelFilter::Off)
        );
        assert_eq!(
            log_crate_level(Some(LevelFilter::TRACE)),
            Some(log::LevelFilter::Trace)
        );
        assert_eq!(log_crate_level(None), None);
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some("".into())), "an empty NO_COLOR is unset");
        assert!(!colour(true, Some("1".into())));
        assert!(
            !colour(true, Some("false".into())),
            "any non-empty value counts"
        );
        assert!(!colour(false, None));
        assert!(!colour(false, Some("1".into())));
    }
}
