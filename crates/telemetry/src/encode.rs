//! OTLP's `ExportTraceServiceRequest`, written straight from the SDK's finished spans into
//! one buffer.
//!
//! The OTLP exporter of the OpenTelemetry crates first copies every span into the
//! generated protobuf structs (a clone of each span, a `Vec` per id, a `String` per
//! attribute key and value, a map to group them by scope), then measures and encodes
//! those. Per exported span that was more work than everything the call did to record
//! it (docs/decisions.md, "Traces"). Here each field is written once, in place: nested
//! messages are written where they go and their length is filled in afterwards. The
//! bytes are the same message (a unit test decodes them with the generated types and
//! compares them with the SDK's own conversion).

use std::time::{SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{SpanId, SpanKind, Status, TraceState};
use opentelemetry::{Array, InstrumentationScope, KeyValue, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SpanData;

/// Protobuf wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

/// `SpanFlags`: the context says whether its parent is remote, and whether it is.
const HAS_IS_REMOTE: u32 = 0x100;
const IS_REMOTE: u32 = 0x200;

/// Encodes batches of spans for one process: its resource is written once, here.
#[derive(Debug, Clone, Default)]
pub(crate) struct TraceEncoder {
    /// The `Resource` message's bytes (its attributes).
    resource: Vec<u8>,
    resource_schema_url: String,
}

impl TraceEncoder {
    pub(crate) fn new(resource: &Resource) -> Self {
        let mut bytes = Vec::new();
        for (key, value) in resource.iter() {
            message(&mut bytes, 1, |out| key_value(out, key.as_str(), value));
        }
        Self {
            resource: bytes,
            resource_schema_url: resource
                .schema_url()
                .map(ToOwned::to_owned)
                .unwrap_or_default(),
        }
    }

    /// Appends the request carrying `spans` to `out`: one `ResourceSpans`, with one
    /// `ScopeSpans` per instrumentation scope in the order the scopes first appear.
    pub(crate) fn request(&self, spans: &[SpanData], out: &mut Vec<u8>) {
        if spans.is_empty() {
            return;
        }
        // ExportTraceServiceRequest.resource_spans = 1
        message(out, 1, |out| {
            // ResourceSpans.resource = 1
            message(out, 1, |out| out.extend_from_slice(&self.resource));
            let mut scopes: Vec<&InstrumentationScope> = Vec::with_capacity(1);
            for span in spans {
                if !scopes
                    .iter()
                    .any(|scope| same_scope(scope, &span.instrumentation_scope))
                {
                    scopes.push(&span.instrumentation_scope);
                }
            }
            for scope in scopes {
                // ResourceSpans.scope_spans = 2
                message(out, 2, |out| scope_spans(out, scope, spans));
            }
            // ResourceSpans.schema_url = 3
            string(out, 3, &self.resource_schema_url);
        });
    }
}

fn scope_spans(out: &mut Vec<u8>, scope: &InstrumentationScope, spans: &[SpanData]) {
    // ScopeSpans.scope = 1
    message(out, 1, |out| {
        string(out, 1, scope.name());
        string(out, 2, scope.version().unwrap_or_default());
        for attribute in scope.attributes() {
            message(out, 3, |out| attribute_kv(out, attribute));
        }
    });
    for span in spans
        .iter()
        .filter(|s| same_scope(&s.instrumentation_scope, scope))
    {
        // ScopeSpans.spans = 2
        message(out, 2, |out| span_message(out, span));
    }
    // ScopeSpans.schema_url = 3
    string(out, 3, scope.schema_url().unwrap_or_default());
}

/// Whether two spans' scopes are the same. Every span carries its own copy of its
/// tracer's scope, so the copies are compared field by field, attributes in order first;
/// only scopes whose attributes differ in order are left to the SDK's comparison, which
/// sorts both lists (two vectors allocated and sorted per span, before: a quarter of the
/// encoding's instructions).
fn same_scope(a: &InstrumentationScope, b: &InstrumentationScope) -> bool {
    a.name() == b.name()
        && a.version() == b.version()
        && a.schema_url() == b.schema_url()
        && (a.attributes().eq(b.attributes()) || a == b)
}

fn span_message(out: &mut Vec<u8>, span: &SpanData) {
    let context = &span.span_context;
    bytes(out, 1, &context.trace_id().to_bytes());
    bytes(out, 2, &context.span_id().to_bytes());
    // Almost always empty: the header is built only when there is one.
    if *context.trace_state() != TraceState::NONE {
        string(out, 3, &context.trace_state().header());
    }
    if span.parent_span_id != SpanId::INVALID {
        bytes(out, 4, &span.parent_span_id.to_bytes());
    }
    string(out, 5, &span.name);
    let kind: u64 = match span.span_kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    };
    uint(out, 6, kind);
    fixed64(out, 7, nanos(span.start_time));
    fixed64(out, 8, nanos(span.end_time));
    for attribute in &span.attributes {
        message(out, 9, |out| attribute_kv(out, attribute));
    }
    uint(out, 10, u64::from(span.dropped_attributes_count));
    for event in span.events.iter() {
        message(out, 11, |out| {
            fixed64(out, 1, nanos(event.timestamp));
            string(out, 2, &event.name);
            for attribute in &event.attributes {
                message(out, 3, |out| attribute_kv(out, attribute));
            }
            uint(out, 4, u64::from(event.dropped_attributes_count));
        });
    }
    uint(out, 12, u64::from(span.events.dropped_count));
    for link in span.links.iter() {
        message(out, 13, |out| {
            let linked = &link.span_context;
            bytes(out, 1, &linked.trace_id().to_bytes());
            bytes(out, 2, &linked.span_id().to_bytes());
            string(out, 3, &linked.trace_state().header());
            for attribute in &link.attributes {
                message(out, 4, |out| attribute_kv(out, attribute));
            }
            uint(out, 5, u64::from(link.dropped_attributes_count));
            fixed32(
                out,
                6,
                flags(linked.is_remote(), linked.trace_flags().to_u8()),
            );
        });
    }
    uint(out, 14, u64::from(span.links.dropped_count));
    // Span.status = 15, always present (the SDK's conversion always sets it).
    message(out, 15, |out| {
        let (code, text): (u64, &str) = match &span.status {
            Status::Unset => (0, ""),
            Status::Ok => (1, ""),
            Status::Error { description } => (2, description),
        };
        string(out, 2, text);
        uint(out, 3, code);
    });
    fixed32(
        out,
        16,
        flags(span.parent_span_is_remote, context.trace_flags().to_u8()),
    );
}

fn flags(remote: bool, trace_flags: u8) -> u32 {
    let mut flags = u32::from(trace_flags) | HAS_IS_REMOTE;
    if remote {
        flags |= IS_REMOTE;
    }
    flags
}

fn nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// `KeyValue { key = 1, value = 2 }`.
fn attribute_kv(out: &mut Vec<u8>, attribute: &KeyValue) {
    key_value(out, attribute.key.as_str(), &attribute.value);
}

fn key_value(out: &mut Vec<u8>, key: &str, value: &Value) {
    string(out, 1, key);
    message(out, 2, |out| any_value(out, value));
}

/// `AnyValue`: the oneof's field is written even when it holds its type's default,
/// which is what tells an empty string from no value.
fn any_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::String(text) => len_field(out, 1, text.as_str().as_bytes()),
        Value::Bool(b) => {
            tag(out, 2, VARINT);
            varint(out, u64::from(*b));
        }
        Value::I64(i) => {
            tag(out, 3, VARINT);
            varint(out, i.cast_unsigned());
        }
        Value::F64(f) => {
            tag(out, 4, FIXED64);
            out.extend_from_slice(&f.to_bits().to_le_bytes());
        }
        Value::Array(array) => message(out, 5, |out| match array {
            Array::Bool(values) => each(out, values, |v| Value::Bool(*v)),
            Array::I64(values) => each(out, values, |v| Value::I64(*v)),
            Array::F64(values) => each(out, values, |v| Value::F64(*v)),
            Array::String(values) => each(out, values, |v| Value::String(v.clone())),
            // A kind of array the protocol's conversion does not know either.
            _ => {}
        }),
        // A kind of value added to the API after this was written: sent as no value.
        _ => {}
    }
}

/// `ArrayValue.values = 1`.
fn each<T>(out: &mut Vec<u8>, values: &[T], value: impl Fn(&T) -> Value) {
    for v in values {
        message(out, 1, |out| any_value(out, &value(v)));
    }
}

/// A nested message: written in place after a one-byte length, which is widened
/// afterwards when the message turned out to need more.
fn message(out: &mut Vec<u8>, field: u32, write: impl FnOnce(&mut Vec<u8>)) {
    tag(out, field, LEN);
    let at = out.len();
    out.push(0);
    write(out);
    let length = out.len() - at - 1;
    let mut prefix = [0u8; 10];
    let width = varint_into(&mut prefix, length as u64);
    if width > 1 {
        let end = out.len();
        out.resize(end + width - 1, 0);
        out.copy_within(at + 1..end, at + width);
    }
    out[at..at + width].copy_from_slice(&prefix[..width]);
}

// The field writers are inlined where they are used: a span's encoding is some forty
// calls of these few-instruction functions (inlined, the encoding takes about 3 % fewer
// instructions).
#[inline]
fn tag(out: &mut Vec<u8>, field: u32, wire: u32) {
    varint(out, u64::from(field << 3 | wire));
}

#[inline]
fn varint(out: &mut Vec<u8>, value: u64) {
    let mut buf = [0u8; 10];
    let width = varint_into(&mut buf, value);
    out.extend_from_slice(&buf[..width]);
}

#[inline]
fn varint_into(buf: &mut [u8; 10], mut value: u64) -> usize {
    let mut i = 0;
    while value >= 0x80 {
        buf[i] = (value as u8) | 0x80;
        value >>= 7;
        i += 1;
    }
    buf[i] = value as u8;
    i + 1
}

#[inline]
fn len_field(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    tag(out, field, LEN);
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// Scalar fields are left out at their default, as proto3 writes them.
fn string(out: &mut Vec<u8>, field: u32, text: &str) {
    bytes(out, field, text.as_bytes());
}

fn bytes(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    if !data.is_empty() {
        len_field(out, field, data);
    }
}

fn uint(out: &mut Vec<u8>, field: u32, value: u64) {
    if value != 0 {
        tag(out, field, VARINT);
        varint(out, value);
    }
}

fn fixed64(out: &mut Vec<u8>, field: u32, value: u64) {
    if value != 0 {
        tag(out, field, FIXED64);
        out.extend_from_slice(&value.to_le_bytes());
    }
}

fn fixed32(out: &mut Vec<u8>, field: u32, value: u32) {
    if value != 0 {
        tag(out, field, FIXED32);
        out.extend_from_slice(&value.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;
    use std::time::Duration;

    use opentelemetry::trace::{Event, Link, SpanContext, TraceFlags, TraceId, TraceState};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
    use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use prost::Message as _;

    fn context(trace: u128, span: u64, remote: bool) -> SpanContext {
        SpanContext::new(
            TraceId::from(trace),
            SpanId::from(span),
            TraceFlags::SAMPLED,
            remote,
            TraceState::from_key_value([("vendor", "value")]).unwrap(),
        )
    }

    fn span(name: &'static str, scope: &InstrumentationScope, variant: u64) -> SpanData {
        let start = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789 + variant);
        let mut events = SpanEvents::default();
        events.events.push(Event::new(
            "retry",
            start + Duration::from_micros(3),
            vec![KeyValue::new("attempt", 2)],
            1,
        ));
        events.dropped_count = 4;
        let mut links = SpanLinks::default();
        links.links.push(Link::new(
            context(7, 8, true),
            vec![KeyValue::new("why", "batch")],
            0,
        ));
        let mut span_context = context(
            0x0123_4567_89ab_cdef_0011_2233_4455_6677,
            0x42 + variant,
            false,
        );
        if variant == 3 {
            // Most spans carry no tracestate.
            span_context = SpanContext::new(
                span_context.trace_id(),
                span_context.span_id(),
                span_context.trace_flags(),
                false,
                TraceState::NONE,
            );
        }
        SpanData {
            span_context,
            parent_span_id: if variant == 0 {
                SpanId::INVALID
            } else {
                SpanId::from(0x41)
            },
            parent_span_is_remote: variant == 2,
            span_kind: [SpanKind::Server, SpanKind::Internal, SpanKind::Client]
                [variant as usize % 3]
                .clone(),
            name: if variant == 1 {
                Cow::Owned(format!("{name} owned"))
            } else {
                Cow::Borrowed(name)
            },
            start_time: start,
            end_time: start + Duration::from_micros(250 * (variant + 1)),
            attributes: vec![
                KeyValue::new("gen_ai.tool.name", "read_file"),
                KeyValue::new("http.response.status_code", 200i64),
                KeyValue::new("negative", -5i64),
                KeyValue::new("ratio", 0.25f64),
                KeyValue::new("timed_out", false),
                KeyValue::new("empty", ""),
                KeyValue::new(
                    "list",
                    Value::Array(Array::String(vec!["a".into(), "".into()])),
                ),
                KeyValue::new("flags", Value::Array(Array::Bool(vec![true, false]))),
                KeyValue::new("long", "x".repeat(300)),
            ],
            dropped_attributes_count: variant as u32,
            events: if variant == 1 {
                events
            } else {
                SpanEvents::default()
            },
            links: if variant == 2 {
                links
            } else {
                SpanLinks::default()
            },
            status: match variant {
                0 => Status::Unset,
                1 => Status::Ok,
                _ => Status::error("refused"),
            },
            instrumentation_scope: scope.clone(),
        }
    }

    /// Ours, decoded with the generated types, is the SDK's conversion: every field of
    /// every span, with the scopes in the order their spans came (the SDK's grouping
    /// goes through a hash map, so its order is not compared).
    #[test]
    fn the_same_message_as_the_sdk_conversion() {
        let resource = Resource::builder_empty()
            .with_service_name("airlock-worker-shell")
            .with_attribute(KeyValue::new("deployment.environment", "test"))
            .build();
        let airlock = InstrumentationScope::builder("airlock").build();
        let other = InstrumentationScope::builder("other")
            .with_version("1.2.3")
            .with_schema_url("https://opentelemetry.io/schemas/1.30.0")
            .with_attributes([KeyValue::new("scope.attr", 1)])
            .build();
        let spans = vec![
            span("execute_tool", &airlock, 0),
            span("gate.policy", &airlock, 1),
            span("sandbox.run", &other, 2),
            span("gate.store", &airlock, 3),
        ];
        let mut ours = Vec::new();
        TraceEncoder::new(&resource).request(&spans, &mut ours);
        let ours = ExportTraceServiceRequest::decode(ours.as_slice()).unwrap();
        let mut theirs = ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(
                spans,
                &ResourceAttributesWithSchema::from(&resource),
            ),
        };
        theirs.resource_spans[0].scope_spans.sort_by(|a, b| {
            a.scope
                .as_ref()
                .unwrap()
                .name
                .cmp(&b.scope.as_ref().unwrap().name)
        });
        assert_eq!(ours, theirs);
        assert_eq!(ours.resource_spans[0].scope_spans[0].spans.len(), 3);
    }

    /// Scopes are the same by value, whatever the order of their attributes, as the
    /// SDK compares them.
    #[test]
    fn scopes_compare_by_value() {
        let scope = |version: &'static str, attributes: Vec<KeyValue>| {
            InstrumentationScope::builder("airlock")
                .with_version(version)
                .with_attributes(attributes)
                .build()
        };
        let (a, b) = (KeyValue::new("a", 1), KeyValue::new("b", "two"));
        let ab = scope("1", vec![a.clone(), b.clone()]);
        for (other, same) in [
            (scope("1", vec![a.clone(), b.clone()]), true),
            (scope("1", vec![b.clone(), a.clone()]), true),
            (scope("2", vec![a.clone(), b.clone()]), false),
            (scope("1", vec![a.clone()]), false),
            (
                scope("1", vec![a.clone(), KeyValue::new("b", "three")]),
                false,
            ),
            (
                InstrumentationScope::builder("other")
                    .with_version("1")
                    .build(),
                false,
            ),
        ] {
            assert_eq!(same_scope(&ab, &other), same, "{other:?}");
            assert_eq!(ab == other, same, "the SDK disagrees on {other:?}");
        }
    }

    #[test]
    fn lengths_of_every_width() {
        for length in [0usize, 1, 127, 128, 300, 16_383, 16_384, 70_000] {
            let mut out = Vec::new();
            message(&mut out, 1, |out| {
                out.extend(std::iter::repeat_n(7u8, length))
            });
            let mut reference = Vec::new();
            prost::encoding::bytes::encode(1, &vec![7u8; length], &mut reference);
            assert_eq!(out, reference, "length {length}");
        }
    }

    #[test]
    fn no_spans_no_request() {
        let mut out = Vec::new();
        TraceEncoder::default().request(&[], &mut out);
        assert!(out.is_empty());
    }
}
