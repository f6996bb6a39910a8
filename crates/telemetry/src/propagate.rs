//! W3C trace context (`traceparent`, `tracestate`) in and out: HTTP headers at the front
//! doors, gRPC metadata between the orchestrator and its workers. With tracing off each
//! of these returns at once.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};

/// The caller's trace context from a request's `traceparent` header, as the parent of
/// a [`crate::CallSpan`]; `None` when tracing is off or there is none. A malformed one
/// gives a context with no span, so the call gets a trace of its own.
pub fn context_from_headers(headers: &http::HeaderMap) -> Option<opentelemetry::Context> {
    if !crate::enabled() || !headers.contains_key("traceparent") {
        return None;
    }
    Some(TraceContextPropagator::new().extract(&HeaderExtractor(headers)))
}

/// As [`context_from_headers`], from a gRPC request's metadata.
pub fn context_from_metadata(metadata: &MetadataMap) -> Option<opentelemetry::Context> {
    if !crate::enabled() || !metadata.contains_key("traceparent") {
        return None;
    }
    Some(TraceContextPropagator::new().extract(&MetadataExtractor(metadata)))
}

/// Writes `parent`'s context into an outgoing gRPC request's metadata, so that the
/// worker's spans join the call's trace as its children.
pub fn inject_metadata(parent: &crate::StageParent, metadata: &mut MetadataMap) {
    if !crate::enabled() {
        return;
    }
    let Some(cx) = parent.context() else {
        return;
    };
    TraceContextPropagator::new().inject_context(cx, &mut MetadataInjector(metadata));
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        // One value only: a repeated traceparent is ambiguous, and is ignored.
        let mut values = self.0.get_all(key).iter();
        let first = values.next()?;
        if values.next().is_some() {
            return None;
        }
        first.to_str().ok()
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    /// Each value is sent as an HPACK literal that is never indexed: a `traceparent`
    /// is new on every call, and indexed it would take a place in the connection's
    /// header table only to push out the headers every call repeats (the method's path,
    /// the content type, the deadline), which would then be sent and decoded in full
    /// again.
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(mut value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            value.set_sensitive(true);
            self.0.insert(key, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_traceparent_is_not_read() {
        let mut headers = http::HeaderMap::new();
        headers.append(
            "traceparent",
            http::HeaderValue::from_static(
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
        );
        assert_eq!(
            HeaderExtractor(&headers).get("traceparent"),
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        );
        headers.append(
            "traceparent",
            http::HeaderValue::from_static(
                "00-1af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
        );
        assert_eq!(HeaderExtractor(&headers).get("traceparent"), None);
    }

    #[test]
    fn metadata_round_trips_the_context() {
        let mut metadata = MetadataMap::new();
        MetadataInjector(&mut metadata).set(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        );
        let cx = TraceContextPropagator::new().extract(&MetadataExtractor(&metadata));
        use opentelemetry::trace::TraceContextExt as _;
        let span = cx.span();
        let remote = span.span_context();
        assert_eq!(
            remote.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(remote.span_id().to_string(), "b7ad6b7169203331");
        assert!(remote.is_remote());
    }

    #[test]
    fn trace_context_is_never_indexed_in_the_header_table() {
        let mut metadata = MetadataMap::new();
        MetadataInjector(&mut metadata).set(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        );
        let value = metadata
            .get("traceparent")
            .expect("the traceparent was set");
        assert!(
            value.is_sensitive(),
            "{value:?} would churn the HPACK table"
        );
    }
}
