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
    ///
    /// An empty value is not sent: the propagator writes `tracestate` on every call,
    /// empty unless a caller's trace carried one, and an empty header says nothing
    /// its absence does not (W3C trace context treats a missing `tracestate` as an
    /// empty one) while both ends of the hop encode, decode and look it up.
    fn set(&mut self, key: &str, value: String) {
        if value.is_empty() {
            return;
        }
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

    /// The propagator writes `tracestate` on every call; an empty one is not sent, a
    /// caller's non-empty one still reaches the worker whole.
    #[test]
    fn an_empty_tracestate_is_not_sent_and_a_real_one_is() {
        use opentelemetry::trace::{
            SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
        };
        let span = |state: TraceState| {
            opentelemetry::Context::new().with_remote_span_context(SpanContext::new(
                TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
                SpanId::from_hex("b7ad6b7169203331").unwrap(),
                TraceFlags::SAMPLED,
                true,
                state,
            ))
        };
        let propagator = TraceContextPropagator::new();

        let mut metadata = MetadataMap::new();
        propagator.inject_context(
            &span(TraceState::NONE),
            &mut MetadataInjector(&mut metadata),
        );
        assert!(metadata.contains_key("traceparent"));
        assert!(
            !metadata.contains_key("tracestate"),
            "an empty tracestate was sent: {metadata:?}"
        );
        let cx = propagator.extract(&MetadataExtractor(&metadata));
        assert_eq!(cx.span().span_context().trace_state().header(), "");

        let state: TraceState = "vendor=opaque,other=1".parse().unwrap();
        let mut metadata = MetadataMap::new();
        propagator.inject_context(&span(state.clone()), &mut MetadataInjector(&mut metadata));
        assert_eq!(
            metadata.get("tracestate").and_then(|v| v.to_str().ok()),
            Some("vendor=opaque,other=1")
        );
        let cx = propagator.extract(&MetadataExtractor(&metadata));
        assert_eq!(cx.span().span_context().trace_state(), &state);
    }
}
