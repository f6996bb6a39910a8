//! The OTLP span exporter and the batch processor that feeds it, started late.
//!
//! `http/protobuf` (the default) is Airlock's own: requests encoded by [`crate::encode`]
//! and posted with the workspace's HTTP client. `grpc` is the OpenTelemetry crates'
//! exporter.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use opentelemetry::Context;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Span, SpanData, SpanExporter, SpanProcessor,
};

use crate::encode::TraceEncoder;
use crate::{Settings, TelemetryError};

/// `OTEL_EXPORTER_OTLP_PROTOCOL`: the two Airlock speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `http/protobuf` (the specification's default): `POST <endpoint>/v1/traces`.
    HttpProtobuf,
    /// `grpc`: the collector's `TraceService/Export`.
    Grpc,
}

impl Protocol {
    /// `value` of the setting `variable` (named in the error).
    pub fn parse(variable: &'static str, value: &str) -> Result<Self, TelemetryError> {
        match value.trim() {
            "http/protobuf" => Ok(Self::HttpProtobuf),
            "grpc" => Ok(Self::Grpc),
            _ => Err(TelemetryError::Protocol {
                variable,
                value: value.to_owned(),
            }),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::HttpProtobuf => "http/protobuf",
            Self::Grpc => "grpc",
        }
    }
}

/// An endpoint must be an `http://` URL: the exporter has no TLS client (a collector
/// runs beside Airlock, on loopback or in the pod, and forwards over TLS itself).
pub(crate) fn check_endpoint(variable: &'static str, value: &str) -> Result<(), TelemetryError> {
    let refuse = |reason: &str| TelemetryError::Variable {
        variable,
        value: value.to_owned(),
        reason: reason.to_owned(),
    };
    let uri: http::Uri = value
        .trim()
        .parse()
        .map_err(|_| refuse("not a URL; give e.g. http://127.0.0.1:4318"))?;
    match uri.scheme_str() {
        Some("http") if uri.host().is_some() => Ok(()),
        Some("https") => Err(refuse(
            "https is not supported: point it at an OpenTelemetry collector beside Airlock (http://127.0.0.1:4318 or the pod's sidecar), which forwards over TLS",
        )),
        _ => Err(refuse(
            "not an http:// URL; give e.g. http://127.0.0.1:4318",
        )),
    }
}

/// The batch processor, created by [`Deferred::start`]: until then (the process is not
/// confined yet, or tracing never started) ended spans are dropped.
#[derive(Debug, Clone)]
pub(crate) struct Deferred {
    inner: Arc<DeferredInner>,
}

#[derive(Debug)]
struct DeferredInner {
    processor: OnceLock<BatchSpanProcessor>,
    /// Kept for the life of the process (the pipeline is a static): dropping a runtime
    /// from inside another would panic.
    runtime: OnceLock<tokio::runtime::Runtime>,
    resource: Mutex<Resource>,
}

impl Deferred {
    pub(crate) fn new(resource: Resource) -> Self {
        Self {
            inner: Arc::new(DeferredInner {
                processor: OnceLock::new(),
                runtime: OnceLock::new(),
                resource: Mutex::new(resource),
            }),
        }
    }

    /// Builds the exporter on a runtime of its own and the batch processor's thread.
    pub(crate) fn start(&self, settings: &Settings) -> Result<(), TelemetryError> {
        let runtime = export_runtime()?;
        // The gRPC channel spawns its connection task where it is built: on the export
        // runtime, not on the one serving calls.
        let _entered = runtime.enter();
        let exporter = match settings.protocol {
            Protocol::Grpc => Exporter::Grpc(
                opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_timeout(crate::export_timeout())
                    .build()
                    .map_err(|e| TelemetryError::Exporter(e.to_string()))?,
            ),
            Protocol::HttpProtobuf => Exporter::Http(HttpExporter::new(settings)?),
        };
        let mut exporter = OnRuntime {
            inner: Arc::new(tokio::sync::Mutex::new(exporter)),
            runtime: runtime.handle().clone(),
        };
        let resource = match self.inner.resource.lock() {
            Ok(r) => r.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        exporter.set_resource(&resource);
        // OTEL_BSP_* (schedule delay, queue and batch sizes, export timeout) are read by
        // the SDK's default batch configuration; only the batch size has a default of
        // Airlock's own, and only when its variable is not set.
        let mut batch = BatchConfigBuilder::default();
        if std::env::var_os("OTEL_BSP_MAX_EXPORT_BATCH_SIZE").is_none() {
            batch = batch.with_max_export_batch_size(EXPORT_BATCH_SPANS);
        }
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch.build())
            .build();
        self.inner
            .processor
            .set(processor)
            .map_err(|_| TelemetryError::AlreadyStarted)?;
        self.inner
            .runtime
            .set(runtime)
            .map_err(|_| TelemetryError::AlreadyStarted)
    }
}

/// Spans per export unless `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` says otherwise (the
/// specification's default is 512). The SDK's batch processor hands each batch over in a
/// vector of this many `SpanData` allocated afresh per export; at 512 that vector was
/// over 128 KiB, a buffer the orchestrator's allocator maps on its own and unmaps when
/// freed (crates/sandbox/src/heap.rs), so every export took page faults for a fresh
/// mapping (about 0.8 more a call than untraced). At 256 the vector comes from the heap
/// and the traced orchestrator takes no more faults than the untraced one.
const EXPORT_BATCH_SPANS: usize = 256;

/// The niceness of the export thread: spans yield the CPU to calls.
const EXPORT_NICENESS: i32 = 10;

/// One thread that converts, encodes and sends batches of spans, at a lower priority
/// than the threads that serve calls. On the calls' own runtime an export (a batch of
/// 512 spans is milliseconds of CPU) would hold one of its few worker threads while
/// calls wait behind it; on its own lowered thread it takes the CPU calls leave idle,
/// and under full load a share small enough not to delay them (a batch that cannot
/// keep up is dropped by the SDK's bounded queue, never waited for).
fn export_runtime() -> Result<tokio::runtime::Runtime, TelemetryError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(1)
        .thread_name("airlock-otlp")
        .enable_all()
        .on_thread_start(|| {
            // On Linux a nice value belongs to a thread: `who` = 0 is the calling
            // thread, not the whole process. Failing to lower it costs calls some
            // latency, never correctness, so it is not an error.
            let _ = rustix::process::setpriority_process(None, EXPORT_NICENESS);
        })
        .build()
        .map_err(|e| TelemetryError::Exporter(format!("cannot start the export thread: {e}")))
}

impl SpanProcessor for Deferred {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        if let Some(p) = self.inner.processor.get() {
            p.on_start(span, cx);
        }
    }

    fn on_end(&self, span: SpanData) {
        if let Some(p) = self.inner.processor.get() {
            p.on_end(span);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner
            .processor
            .get()
            .map_or(Ok(()), SpanProcessor::force_flush)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner
            .processor
            .get()
            .map_or(Ok(()), |p| p.shutdown_with_timeout(timeout))
    }

    fn set_resource(&mut self, resource: &Resource) {
        match self.inner.resource.lock() {
            Ok(mut r) => *r = resource.clone(),
            Err(poisoned) => *poisoned.into_inner() = resource.clone(),
        }
    }
}

/// Runs each export on the export runtime: the batch processor's own thread has none,
/// and the gRPC and HTTP clients need one.
#[derive(Debug)]
struct OnRuntime {
    inner: Arc<tokio::sync::Mutex<Exporter>>,
    runtime: tokio::runtime::Handle,
}

impl SpanExporter for OnRuntime {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let inner = self.inner.clone();
        let exported = self
            .runtime
            .spawn(async move { inner.lock().await.export(batch).await });
        match exported.await {
            Ok(result) => result,
            Err(e) => Err(OTelSdkError::InternalFailure(format!(
                "the export task failed: {e}"
            ))),
        }
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        match self.inner.try_lock() {
            Ok(mut inner) => inner.shutdown_with_timeout(timeout),
            // An export still running ends with the runtime.
            Err(_) => Ok(()),
        }
    }

    fn set_resource(&mut self, resource: &Resource) {
        if let Ok(mut inner) = self.inner.try_lock() {
            inner.set_resource(resource);
        }
    }
}

/// The exporter of the configured protocol.
#[derive(Debug)]
enum Exporter {
    Grpc(opentelemetry_otlp::SpanExporter),
    Http(HttpExporter),
}

impl SpanExporter for Exporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        match self {
            Self::Grpc(e) => e.export(batch).await,
            Self::Http(e) => e.export(batch).await,
        }
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        match self {
            Self::Grpc(e) => e.shutdown_with_timeout(timeout),
            Self::Http(_) => Ok(()),
        }
    }

    fn set_resource(&mut self, resource: &Resource) {
        match self {
            Self::Grpc(e) => e.set_resource(resource),
            Self::Http(e) => e.encoder = TraceEncoder::new(resource),
        }
    }
}

/// `http/protobuf`: `POST <endpoint>/v1/traces` of requests Airlock encodes itself.
#[derive(Debug)]
struct HttpExporter {
    client: reqwest::Client,
    url: String,
    headers: http::HeaderMap,
    encoder: TraceEncoder,
}

impl HttpExporter {
    /// Posts to the URL with the headers the settings resolved, within
    /// `OTEL_EXPORTER_OTLP_TIMEOUT`.
    fn new(settings: &Settings) -> Result<Self, TelemetryError> {
        let client = reqwest::Client::builder()
            .timeout(crate::export_timeout())
            // The collector is named by the operator; a proxy variable meant for the
            // agents' traffic must not reroute the spans.
            .no_proxy()
            .build()
            .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
        Ok(Self {
            client,
            url: settings.traces_url.clone(),
            headers: settings.headers.clone(),
            encoder: TraceEncoder::default(),
        })
    }

    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        // About 150 bytes a span; one allocation for most batches.
        let mut body = Vec::with_capacity(batch.len() * 192 + 256);
        self.encoder.request(&batch, &mut body);
        drop(batch);
        let response = self
            .client
            .post(&self.url)
            .headers(self.headers.clone())
            .header(http::header::CONTENT_TYPE, "application/x-protobuf")
            .body(body)
            .send()
            .await
            .map_err(|e| {
                OTelSdkError::InternalFailure(format!("cannot reach {}: {e}", self.url))
            })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let body = response.bytes().await.unwrap_or_default();
        Err(OTelSdkError::InternalFailure(format!(
            "the collector at {} answered {status}: {}",
            self.url,
            String::from_utf8_lossy(&body[..body.len().min(512)])
        )))
    }
}

/// Compression of the request bodies: none. The collector beside Airlock compresses what
/// it forwards; on loopback or in the pod gzip would cost CPU on every call's process.
pub(crate) fn check_compression(variable: &'static str, value: &str) -> Result<(), TelemetryError> {
    if value.trim() == "none" {
        return Ok(());
    }
    Err(TelemetryError::Variable {
        variable,
        value: value.to_owned(),
        reason: "compression is not supported: leave it unset or \"none\" (the collector beside Airlock compresses what it forwards)".to_owned(),
    })
}

/// `key1=value1,key2=value2`, values percent-encoded (the specification's format).
pub(crate) fn parse_headers(
    variable: &'static str,
    value: &str,
) -> Result<http::HeaderMap, TelemetryError> {
    // The value may hold a credential: an error names the variable and the position,
    // never the text.
    let refuse = |reason: String| TelemetryError::Variable {
        variable,
        value: "(not shown)".to_owned(),
        reason,
    };
    let mut headers = http::HeaderMap::new();
    for (index, pair) in value.split(',').enumerate() {
        if pair.trim().is_empty() {
            continue;
        }
        let (name, raw) = pair
            .split_once('=')
            .ok_or_else(|| refuse(format!("entry {} is not key=value", index + 1)))?;
        let name = http::HeaderName::from_bytes(name.trim().as_bytes())
            .map_err(|_| refuse(format!("entry {} has no valid header name", index + 1)))?;
        let decoded = percent_decode(raw.trim())
            .ok_or_else(|| refuse(format!("entry {} has a bad %-escape", index + 1)))?;
        let mut header = http::HeaderValue::from_bytes(&decoded)
            .map_err(|_| refuse(format!("entry {} has no valid header value", index + 1)))?;
        header.set_sensitive(true);
        headers.append(name, header);
    }
    Ok(headers)
}

fn percent_decode(text: &str) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch's vector stays under the size from which the orchestrator's allocator maps
    /// a buffer on its own (glibc's initial mmap threshold, which the orchestrator fixes:
    /// crates/sandbox/src/heap.rs); the specification's 512 spans would not.
    #[test]
    fn a_batch_of_spans_is_served_from_the_heap() {
        const MMAP_THRESHOLD_BYTES: usize = 128 * 1024;
        let span = std::mem::size_of::<SpanData>();
        assert!(
            EXPORT_BATCH_SPANS * span < MMAP_THRESHOLD_BYTES,
            "{EXPORT_BATCH_SPANS} spans of {span} bytes"
        );
        assert!(
            512 * span >= MMAP_THRESHOLD_BYTES,
            "the default batch of 512 spans of {span} bytes fits under the threshold: the \
             default of Airlock's own is no longer needed"
        );
    }

    #[test]
    fn headers_are_key_value_pairs_with_percent_escapes() {
        let headers = parse_headers("V", "api-key=s%3Dcret , x-tenant=acme,").unwrap();
        assert_eq!(headers["api-key"], "s=cret");
        assert_eq!(headers["x-tenant"], "acme");
        for bad in ["novalue", "bad name=x", "k=%zz", "k=%4"] {
            let e = parse_headers("V", bad).unwrap_err().to_string();
            assert!(e.starts_with("V=\"(not shown)\""), "{e}");
            assert!(!e.contains(bad), "the value is not echoed: {e}");
        }
    }

    #[test]
    fn endpoints_must_be_plain_http_urls() {
        check_endpoint("V", "http://127.0.0.1:4318").unwrap();
        check_endpoint("V", "http://collector.observability:4317/").unwrap();
        let e = check_endpoint("V", "https://collector:4318")
            .unwrap_err()
            .to_string();
        assert!(e.contains("https is not supported"), "{e}");
        let e = check_endpoint("V", "127.0.0.1:4318")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("V=\"127.0.0.1:4318\""), "{e}");
    }
}
