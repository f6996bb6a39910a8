//! Airlock's OpenTelemetry traces (DESIGN §13): one place that reads the standard
//! `OTEL_*` variables, builds the OTLP exporter, composes the `tracing` subscriber (logs
//! to stderr, and the spans Airlock exports), carries W3C trace context over HTTP and
//! gRPC, and flushes on shutdown.
//!
//! Tracing is on when `OTEL_EXPORTER_OTLP_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set (and `OTEL_SDK_DISABLED` is not `true`).
//! Off, no OpenTelemetry layer is installed at all: the call spans (level TRACE, target
//! [`TARGET`]) are disabled at their call sites and cost a cached interest check.
//!
//! Only spans under [`TARGET`] are exported, and never log events: what a span carries
//! is what the code that opens it writes into it (tool names and ids, never argument
//! values), whatever some library logs inside it. Log lines are tied to a trace by the
//! `trace_id` and `span_id` that JSON logs carry instead ([`json`]).
//!
//! Processes that confine themselves must not start threads before they do: the export
//! thread (one thread at a lowered priority, so that encoding and sending spans yields
//! to calls, [`batch`]) starts in [`start`], called after confinement; spans that end
//! before it are dropped.

mod batch;
mod encode;
mod export;
pub mod json;
pub mod logs;
pub mod propagate;
mod span;
mod stage;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanProcessor};
use tracing_subscriber::Layer;
use tracing_subscriber::registry::LookupSpan;

pub use batch::BatchSettings;
pub use export::Protocol;
/// What a [`CallSpan`] is made of, for the code that opens one.
pub use opentelemetry::{KeyValue, Value, trace::SpanKind};
pub use span::{CallSpan, InSpan, SpanStart};
pub use stage::{OpenStage, Stage, StageParent};

/// The `tracing` target of every span Airlock exports. Spans under it are opened at
/// level TRACE, so that with tracing off (and `RUST_LOG` at its usual levels) they are
/// disabled where they are written.
pub const TARGET: &str = "airlock::trace";

/// The instrumentation scope of every span Airlock exports.
const TRACER_NAME: &str = "airlock";

/// What can stop tracing from starting. Each names the variable to fix.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error(
        "{variable}={value:?} is not supported: use \"http/protobuf\" (the default) or \"grpc\""
    )]
    Protocol {
        variable: &'static str,
        value: String,
    },
    #[error(
        "{variable}={value:?} is not a sampler Airlock knows: use always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off or parentbased_traceidratio"
    )]
    Sampler {
        variable: &'static str,
        value: String,
    },
    #[error("{variable}={value:?}: {reason}")]
    Variable {
        variable: &'static str,
        value: String,
        reason: String,
    },
    #[error("cannot build the OTLP trace exporter (check OTEL_EXPORTER_OTLP_*): {0}")]
    Exporter(String),
    #[error("tracing was started twice in one process")]
    AlreadyStarted,
}

/// Which process this is, for the `service.name` resource attribute.
#[derive(Debug, Clone)]
pub enum Service {
    /// `OTEL_SERVICE_NAME` when set, else `airlock-orchestrator`.
    Orchestrator,
    /// Always `airlock-worker-<group>` (DESIGN §13): under `airlock up` every worker
    /// inherits the launcher's environment, and one `OTEL_SERVICE_NAME` would merge them.
    Worker(String),
}

impl Service {
    /// The `service.name` this process reports, `OTEL_SERVICE_NAME` being `env`.
    pub fn name(&self, env: Option<&str>) -> String {
        match self {
            Self::Orchestrator => env
                .filter(|v| !v.trim().is_empty())
                .unwrap_or("airlock-orchestrator")
                .to_owned(),
            Self::Worker(group) => format!("airlock-worker-{group}"),
        }
    }
}

/// The exporter's settings, read from the environment.
#[derive(Debug, Clone)]
pub struct Settings {
    pub protocol: Protocol,
    pub service_name: String,
    /// Where `http/protobuf` posts: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as is, else
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` with `/v1/traces` (gRPC's exporter reads its own).
    pub traces_url: String,
    /// `OTEL_EXPORTER_OTLP_TRACES_HEADERS`, else `OTEL_EXPORTER_OTLP_HEADERS`, parsed
    /// (values marked sensitive).
    pub headers: http::HeaderMap,
    /// `OTEL_BSP_*`: the queue, the batch, the schedule delay and the export timeout.
    pub batch: BatchSettings,
    /// `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`.
    pub sampler: Sampler,
}

impl Settings {
    /// `None` when tracing is off (no endpoint, or `OTEL_SDK_DISABLED=true`); an error
    /// for a variable Airlock cannot honour, so that a typo does not silently turn
    /// tracing into something else.
    pub fn from_env(service: &Service) -> Result<Option<Self>, TelemetryError> {
        Self::from_lookup(service, |name| std::env::var(name).ok())
    }

    fn from_lookup(
        service: &Service,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, TelemetryError> {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        if set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none()
            && set("OTEL_EXPORTER_OTLP_ENDPOINT").is_none()
        {
            return Ok(None);
        }
        if set("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim() == "none") {
            return Ok(None);
        }
        // The signal's own variable wins over the general one; errors name the one set.
        let signal_or_general = |signal: &'static str, general: &'static str| {
            set(signal)
                .map(|value| (signal, value))
                .or_else(|| set(general).map(|value| (general, value)))
        };
        let protocol = match signal_or_general(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ) {
            Some((variable, value)) => Protocol::parse(variable, &value)?,
            None => Protocol::HttpProtobuf,
        };
        let sampler = sampler(set("OTEL_TRACES_SAMPLER"), set("OTEL_TRACES_SAMPLER_ARG"))?;
        for variable in [
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ] {
            if let Some(value) = set(variable) {
                export::check_endpoint(variable, &value)?;
            }
        }
        for variable in [
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
            "OTEL_EXPORTER_OTLP_COMPRESSION",
        ] {
            if let Some(value) = set(variable) {
                export::check_compression(variable, &value)?;
            }
        }
        // The signal's own variable is the whole URL, as the specification says.
        let traces_url = match set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            Some(url) => url.trim().to_owned(),
            None => set("OTEL_EXPORTER_OTLP_ENDPOINT").map_or_else(String::new, |base| {
                format!("{}/v1/traces", base.trim().trim_end_matches('/'))
            }),
        };
        let headers = match signal_or_general(
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
            "OTEL_EXPORTER_OTLP_HEADERS",
        ) {
            Some((variable, value)) => export::parse_headers(variable, &value)?,
            None => http::HeaderMap::new(),
        };
        Ok(Some(Self {
            protocol,
            service_name: service.name(set("OTEL_SERVICE_NAME").as_deref()),
            traces_url,
            headers,
            batch: BatchSettings::from_lookup(set)?,
            sampler,
        }))
    }
}

/// The sampler `OTEL_TRACES_SAMPLER` names (`parentbased_always_on` when unset), with
/// the ratio `OTEL_TRACES_SAMPLER_ARG` gives the ratio samplers (1 when unset). Read
/// here rather than by the SDK, which falls back to another sampler for a name or a
/// ratio it cannot read: a typo would quietly change which calls are traced.
fn sampler(name: Option<String>, arg: Option<String>) -> Result<Sampler, TelemetryError> {
    let ratio = || -> Result<f64, TelemetryError> {
        let Some(value) = arg else {
            return Ok(1.0);
        };
        match value.trim().parse::<f64>() {
            Ok(ratio) if (0.0..=1.0).contains(&ratio) => Ok(ratio),
            _ => Err(TelemetryError::Variable {
                variable: "OTEL_TRACES_SAMPLER_ARG",
                value,
                reason: "must be a sampling ratio from 0 to 1, e.g. 0.1".to_owned(),
            }),
        }
    };
    let Some(name) = name else {
        return Ok(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)));
    };
    Ok(match name.trim() {
        "always_on" => Sampler::AlwaysOn,
        "always_off" => Sampler::AlwaysOff,
        "traceidratio" => Sampler::TraceIdRatioBased(ratio()?),
        "parentbased_always_on" => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
        "parentbased_always_off" => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
        "parentbased_traceidratio" => {
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio()?)))
        }
        _ => {
            return Err(TelemetryError::Sampler {
                variable: "OTEL_TRACES_SAMPLER",
                value: name,
            });
        }
    })
}

/// The tracer provider of this process, set once by [`layer`].
struct Pipeline {
    provider: SdkTracerProvider,
    /// The provider's scope and ids, for the spans built without its tracer (every
    /// span of a call: [`CallSpan`], [`OpenStage`], [`Stage`]), which the settings'
    /// sampler samples as the provider does.
    scope: opentelemetry::InstrumentationScope,
    ids: opentelemetry_sdk::trace::RandomIdGenerator,
    processor: export::Deferred,
    settings: Settings,
}

static PIPELINE: OnceLock<Pipeline> = OnceLock::new();
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether spans are being exported (checked before any work on trace context).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The OpenTelemetry layer for this process's subscriber, or `None` when tracing is
/// off or this is a worker (whose spans are all [`CallSpan`]s, exported without one).
/// It exports the spans under [`TARGET`] and nothing else; the exporter starts in
/// [`start`].
pub fn layer<S>(service: &Service) -> Result<Option<impl Layer<S> + use<S>>, TelemetryError>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    let Some(settings) = Settings::from_env(service)? else {
        return Ok(None);
    };
    let resource = Resource::builder()
        .with_service_name(settings.service_name.clone())
        .build();
    let processor = export::Deferred::new(resource.clone());
    // The `tracing` spans (the approval wait, the agent loop's) are sampled by the
    // provider, the call's own spans by the pipeline: one sampler, from the settings.
    let provider = SdkTracerProvider::builder()
        .with_resource(resource)
        .with_span_processor(processor.clone())
        .with_sampler(settings.sampler.clone())
        .build();
    let scope = opentelemetry::InstrumentationScope::builder(TRACER_NAME).build();
    let tracer = provider.tracer_with_scope(scope.clone());
    PIPELINE
        .set(Pipeline {
            provider,
            scope,
            ids: opentelemetry_sdk::trace::RandomIdGenerator::default(),
            processor,
            settings,
        })
        .map_err(|_| TelemetryError::AlreadyStarted)?;
    ENABLED.store(true, Ordering::Relaxed);
    // A worker's spans (its `execute_tool`, the shell's sandbox run) are all built
    // through the SDK directly (`CallSpan`), so it needs no `tracing` layer. Without
    // one, its subscriber's most verbose level stays the log lines' (info by default)
    // instead of TRACE, the level of the spans this layer takes.
    if matches!(service, Service::Worker(_)) {
        return Ok(None);
    }
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        // What each span costs is paid per call: no busy/idle timing (two clock reads
        // per enter and exit), no thread and source-location attributes (five more
        // attributes per span to build, encode and send, saying nothing a span name
        // does not).
        .with_tracked_inactivity(false)
        .with_threads(false)
        .with_location(false)
        // Every exported span has the same target; saying so on each is bytes per span.
        .with_target(false)
        // A `tracing` span's context is taken from the span itself
        // (`OpenTelemetrySpanExt::context`), not from OpenTelemetry's thread-local
        // current context: activating it would attach and detach a context on every
        // poll of every instrumented future. Only a `CallSpan` is made current, and only
        // around the futures it wraps; a `tracing` span opened there with no `tracing`
        // parent takes it as its parent.
        .with_context_activation(false)
        // Spans only: an event inside a call span is a log line, which may quote what
        // a library saw; it goes to the log (with the trace id), never to the trace.
        .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
            meta.is_span() && meta.target() == TARGET
        }));
    Ok(Some(layer))
}

/// Starts exporting: builds the exporter and the export thread that runs it. A no-op
/// when tracing is off. Call it once the process is confined.
pub fn start() -> Result<(), TelemetryError> {
    let Some(pipeline) = PIPELINE.get() else {
        return Ok(());
    };
    pipeline.processor.start(&pipeline.settings)?;
    tracing::info!(
        service = %pipeline.settings.service_name,
        protocol = pipeline.settings.protocol.as_str(),
        "exporting traces over OTLP"
    );
    Ok(())
}

/// Exports what is left and stops the exporter; waits at most `OTEL_BSP_EXPORT_TIMEOUT`
/// (30 s by default). Call it from inside the runtime, before the process exits.
pub async fn shutdown() {
    let Some(pipeline) = PIPELINE.get() else {
        return;
    };
    ENABLED.store(false, Ordering::Relaxed);
    let provider = pipeline.provider.clone();
    let timeout = pipeline.settings.batch.timeout;
    let done = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(timeout)).await;
    match done {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "the last spans could not be exported"),
        Err(e) => tracing::warn!(error = %e, "the trace exporter did not shut down"),
    }
}

/// Spans ended but not exported yet are sent now (tests and the bench wait on this
/// rather than on the batch delay).
pub fn flush() {
    if let Some(pipeline) = PIPELINE.get()
        && let Err(e) = pipeline.processor.force_flush()
    {
        tracing::warn!(error = %e, "cannot flush the trace exporter");
    }
}

/// How long an export may take, from `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` or
/// `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds), 10 s by default.
fn export_timeout() -> Duration {
    [
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ]
    .iter()
    .find_map(|name| std::env::var(name).ok()?.trim().parse::<u64>().ok())
    .map_or(Duration::from_secs(10), Duration::from_millis)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings(
        vars: &[(&str, &str)],
        service: Service,
    ) -> Result<Option<Settings>, TelemetryError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Settings::from_lookup(&service, |name| vars.get(name).cloned())
    }

    #[test]
    fn off_without_an_endpoint_or_when_disabled() {
        assert!(settings(&[], Service::Orchestrator).unwrap().is_none());
        assert!(
            settings(
                &[
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
                    ("OTEL_SDK_DISABLED", "true")
                ],
                Service::Orchestrator
            )
            .unwrap()
            .is_none()
        );
        assert!(
            settings(
                &[
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
                    ("OTEL_TRACES_EXPORTER", "none")
                ],
                Service::Orchestrator
            )
            .unwrap()
            .is_none()
        );
    }

    #[test]
    fn protocol_and_names_follow_the_variables() {
        let s = settings(
            &[(
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "http://127.0.0.1:4318/v1/traces",
            )],
            Service::Orchestrator,
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.protocol, Protocol::HttpProtobuf);
        assert_eq!(s.service_name, "airlock-orchestrator");
        assert_eq!(s.traces_url, "http://127.0.0.1:4318/v1/traces");
        let s = settings(
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
                ("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=acme"),
                ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "api-key=k%2C1"),
            ],
            Service::Orchestrator,
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.traces_url, "http://collector:4318/v1/traces");
        assert_eq!(s.headers["api-key"], "k,1", "the traces variable wins");
        assert!(s.headers.get("x-tenant").is_none());
        let s = settings(
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                ("OTEL_SERVICE_NAME", "gate-eu"),
            ],
            Service::Orchestrator,
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.protocol, Protocol::Grpc);
        assert_eq!(s.service_name, "gate-eu");
        let s = settings(
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
                ("OTEL_SERVICE_NAME", "gate-eu"),
            ],
            Service::Worker("shell".into()),
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            s.protocol,
            Protocol::HttpProtobuf,
            "the traces variable wins"
        );
        assert_eq!(s.service_name, "airlock-worker-shell");
    }

    /// The error that refuses `vars`, as text.
    fn refusal(vars: &[(&str, &str)]) -> String {
        match settings(vars, Service::Orchestrator) {
            Ok(s) => panic!("{vars:?} was accepted: {s:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn the_sampler_is_the_one_the_variables_name() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318");
        let sampler = |vars: &[(&str, &str)]| {
            let mut all = vec![endpoint];
            all.extend_from_slice(vars);
            format!(
                "{:?}",
                settings(&all, Service::Orchestrator)
                    .unwrap()
                    .unwrap()
                    .sampler
            )
        };
        assert_eq!(sampler(&[]), "ParentBased(AlwaysOn)");
        assert_eq!(
            sampler(&[("OTEL_TRACES_SAMPLER", " always_off ")]),
            "AlwaysOff"
        );
        assert_eq!(
            sampler(&[("OTEL_TRACES_SAMPLER", "traceidratio")]),
            "TraceIdRatioBased(1.0)",
            "the ratio is 1 when unset"
        );
        assert_eq!(
            sampler(&[
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ]),
            "ParentBased(TraceIdRatioBased(0.25))"
        );
        assert_eq!(
            sampler(&[("OTEL_TRACES_SAMPLER", "parentbased_always_off")]),
            "ParentBased(AlwaysOff)"
        );
    }

    #[test]
    fn values_it_cannot_honour_are_refused_by_name() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318");
        for (vars, named) in [
            (
                vec![endpoint, ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")],
                "OTEL_EXPORTER_OTLP_PROTOCOL=\"http/json\"",
            ),
            (
                vec![endpoint, ("OTEL_TRACES_SAMPLER", "sometimes")],
                "OTEL_TRACES_SAMPLER=\"sometimes\"",
            ),
            (
                vec![
                    endpoint,
                    ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                    ("OTEL_TRACES_SAMPLER_ARG", "10%"),
                ],
                "OTEL_TRACES_SAMPLER_ARG=\"10%\"",
            ),
            (
                vec![
                    endpoint,
                    ("OTEL_TRACES_SAMPLER", "traceidratio"),
                    ("OTEL_TRACES_SAMPLER_ARG", "1.5"),
                ],
                "OTEL_TRACES_SAMPLER_ARG=\"1.5\"",
            ),
            (
                vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")],
                "OTEL_EXPORTER_OTLP_ENDPOINT",
            ),
            (
                vec![endpoint, ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")],
                "OTEL_EXPORTER_OTLP_COMPRESSION=\"gzip\"",
            ),
            (
                vec![endpoint, ("OTEL_EXPORTER_OTLP_HEADERS", "api-key")],
                "OTEL_EXPORTER_OTLP_HEADERS",
            ),
        ] {
            let e = refusal(&vars);
            assert!(e.contains(named), "{e}");
        }
        assert!(
            settings(
                &[endpoint, ("OTEL_EXPORTER_OTLP_COMPRESSION", "none")],
                Service::Orchestrator,
            )
            .unwrap()
            .is_some()
        );
    }
}
