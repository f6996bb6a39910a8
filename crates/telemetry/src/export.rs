//! The OTLP span exporter and the batch processor that feeds it, started late.
//!
//! `http/protobuf` (the default) is Airlock's own: requests encoded by [`crate::encode`]
//! and posted with the workspace's HTTP client. `grpc` is the OpenTelemetry crates'
//! exporter. Either runs on the export thread of [`crate::batch`].

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use opentelemetry::Context;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};

use crate::batch::{Batcher, Export};
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
    batcher: OnceLock<Batcher>,
    resource: Mutex<Resource>,
}

impl Deferred {
    pub(crate) fn new(resource: Resource) -> Self {
        Self {
            inner: Arc::new(DeferredInner {
                batcher: OnceLock::new(),
                resource: Mutex::new(resource),
            }),
        }
    }

    /// Builds the exporter and starts the thread that exports.
    pub(crate) fn start(&self, settings: &Settings) -> Result<(), TelemetryError> {
        // The export thread's own runtime, driven by that thread alone while it exports:
        // the HTTP and gRPC clients need one, and the calls' runtime is not theirs to use.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| {
                TelemetryError::Exporter(format!("cannot build the export runtime: {e}"))
            })?;
        // The gRPC channel spawns its connection task where it is built: on the export
        // runtime, not on the one serving calls.
        let entered = runtime.enter();
        let mut exporter = match settings.protocol {
            Protocol::Grpc => Exporter::Grpc(
                opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_timeout(crate::export_timeout())
                    .build()
                    .map_err(|e| TelemetryError::Exporter(e.to_string()))?,
            ),
            Protocol::HttpProtobuf => Exporter::Http(HttpExporter::new(settings)?),
        };
        drop(entered);
        let resource = match self.inner.resource.lock() {
            Ok(r) => r.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        exporter.set_resource(&resource);
        let batcher = Batcher::start(exporter, runtime, settings.batch)?;
        self.inner
            .batcher
            .set(batcher)
            .map_err(|_| TelemetryError::AlreadyStarted)
    }
}

impl SpanProcessor for Deferred {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if let Some(b) = self.inner.batcher.get() {
            b.on_end(span);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner
            .batcher
            .get()
            .map_or(Ok(()), Batcher::force_flush)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner
            .batcher
            .get()
            .map_or(Ok(()), |b| b.shutdown(timeout))
    }

    fn set_resource(&mut self, resource: &Resource) {
        match self.inner.resource.lock() {
            Ok(mut r) => *r = resource.clone(),
            Err(poisoned) => *poisoned.into_inner() = resource.clone(),
        }
    }
}

/// The exporter of the configured protocol.
#[derive(Debug)]
enum Exporter {
    Grpc(opentelemetry_otlp::SpanExporter),
    Http(HttpExporter),
}

impl Export for Exporter {
    async fn export(&self, batch: &mut Vec<SpanData>) -> OTelSdkResult {
        match self {
            // The crates' exporter takes the batch; the export thread allocates the next.
            Self::Grpc(e) => e.export(std::mem::take(batch)).await,
            Self::Http(e) => e.export(batch).await,
        }
    }

    fn shutdown(&mut self) -> OTelSdkResult {
        match self {
            Self::Grpc(e) => e.shutdown(),
            Self::Http(_) => Ok(()),
        }
    }
}

impl Exporter {
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

    async fn export(&self, batch: &mut Vec<SpanData>) -> OTelSdkResult {
        // About 120 bytes a span on average, more for a call's span with its
        // attributes: room for 160 makes it one allocation (a batch that outgrew 128 a
        // span was copied into a buffer twice the size).
        let mut body = Vec::with_capacity(batch.len() * 160 + 1024);
        self.encoder.request(batch, &mut body);
        batch.clear();
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
