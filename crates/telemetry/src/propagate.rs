//! W3C trace context (`traceparent`, `tracestate`) in and out: HTTP headers at the front
//! doors, gRPC metadata between the orchestrator and its workers. With tracing off each
//! of these returns at once.
//!
//! `traceparent` is written and read here, not by the SDK's `TraceContextPropagator`:
//! it is on every call's path twice (the front door reads the caller's, the dispatch
//! writes one for the worker, which reads it), and the propagator formats it with
//! `format!` (a `String` grown field by field) and parses it by splitting it into a
//! vector and each id through `u128::from_str_radix`, some 8 000 instructions a call
//! for 55 bytes (callgrind, the gate bench traced). A `tracestate`, rare and free-form,
//! is still parsed and written by the SDK's `TraceState`.

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use tonic::metadata::{MetadataMap, MetadataValue};

/// The header names, built at compile time: looking a header up by a `&str` parses the
/// name on every lookup.
const TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");
const TRACESTATE: http::HeaderName = http::HeaderName::from_static("tracestate");

/// The length of a version-00 `traceparent`: `00-` 32 hex digits `-` 16 `-` 2.
const TRACEPARENT_LEN: usize = 55;

/// The caller's trace context from a request's `traceparent` header, as the parent of
/// a [`crate::CallSpan`]; `None` when tracing is off or there is none. A malformed or
/// repeated one gives a context with no span, so the call gets a trace of its own.
pub fn context_from_headers(headers: &http::HeaderMap) -> Option<opentelemetry::Context> {
    if !crate::enabled() {
        return None;
    }
    from_headers(headers)
}

fn from_headers(headers: &http::HeaderMap) -> Option<opentelemetry::Context> {
    let mut values = headers.get_all(&TRACEPARENT).iter();
    let first = values.next()?;
    // One value only: a repeated traceparent is ambiguous, and is ignored.
    let only = values.next().is_none().then_some(first);
    Some(remote_context(only, || single(headers, &TRACESTATE)))
}

/// As [`context_from_headers`], from a gRPC request's metadata.
pub fn context_from_metadata(metadata: &MetadataMap) -> Option<opentelemetry::Context> {
    if !crate::enabled() {
        return None;
    }
    from_metadata(metadata)
}

fn from_metadata(metadata: &MetadataMap) -> Option<opentelemetry::Context> {
    let headers = metadata.as_ref();
    let traceparent = headers.get(&TRACEPARENT)?;
    Some(remote_context(Some(traceparent), || {
        headers.get(&TRACESTATE).and_then(|v| v.to_str().ok())
    }))
}

/// Writes `parent`'s context into an outgoing gRPC request's metadata, so that the
/// worker's spans join the call's trace as its children.
///
/// Each value is sent as an HPACK literal that is never indexed: a `traceparent` is new
/// on every call, and indexed it would take a place in the connection's header table
/// only to push out the headers every call repeats (the method's path, the content
/// type, the deadline), which would then be sent and decoded in full again. An empty
/// `tracestate` is not sent: it says nothing its absence does not (W3C trace context
/// treats a missing `tracestate` as an empty one).
pub fn inject_metadata(parent: &crate::StageParent, metadata: &mut MetadataMap) {
    if !crate::enabled() {
        return;
    }
    if let Some(cx) = parent.context() {
        inject(cx, metadata);
    }
}

fn inject(cx: &opentelemetry::Context, metadata: &mut MetadataMap) {
    let span = cx.span();
    let context = span.span_context();
    if !context.is_valid() {
        return;
    }
    if let Ok(mut value) = MetadataValue::try_from(&traceparent(context)[..]) {
        value.set_sensitive(true);
        metadata.insert("traceparent", value);
    }
    let state = context.trace_state().header();
    if !state.is_empty()
        && let Ok(mut value) = MetadataValue::try_from(state.as_str())
    {
        value.set_sensitive(true);
        metadata.insert("tracestate", value);
    }
}

/// The value of header `name` if it is there exactly once and is text.
fn single<'a>(headers: &'a http::HeaderMap, name: &http::HeaderName) -> Option<&'a str> {
    let mut values = headers.get_all(name).iter();
    let first = values.next()?;
    if values.next().is_some() {
        return None;
    }
    first.to_str().ok()
}

/// A context whose span is the remote one `traceparent` names (with the `tracestate`
/// that `state` reads, only then), or an empty context when it names none.
fn remote_context<'a>(
    traceparent: Option<&http::HeaderValue>,
    state: impl FnOnce() -> Option<&'a str>,
) -> opentelemetry::Context {
    let Some((trace_id, span_id, flags)) =
        traceparent.and_then(|v| parse_traceparent(v.as_bytes()))
    else {
        return opentelemetry::Context::new();
    };
    // A malformed tracestate is dropped and the traceparent kept, as W3C trace context
    // says a vendor's list must not break the trace.
    let state = state()
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    opentelemetry::Context::new()
        .with_remote_span_context(SpanContext::new(trace_id, span_id, flags, true, state))
}

/// `context` as a version-00 `traceparent`, with only the sampled flag (the one flag
/// this version defines).
fn traceparent(context: &SpanContext) -> [u8; TRACEPARENT_LEN] {
    let mut out = [0u8; TRACEPARENT_LEN];
    let (version, rest) = out.split_at_mut(3);
    version.copy_from_slice(b"00-");
    let (trace, rest) = rest.split_at_mut(32);
    hex_into(trace, &context.trace_id().to_bytes());
    let (dash, rest) = rest.split_at_mut(1);
    dash.copy_from_slice(b"-");
    let (span, rest) = rest.split_at_mut(16);
    hex_into(span, &context.span_id().to_bytes());
    let (dash, flags) = rest.split_at_mut(1);
    dash.copy_from_slice(b"-");
    hex_into(
        flags,
        &[(context.trace_flags() & TraceFlags::SAMPLED).to_u8()],
    );
    out
}

/// Writes `bytes` as lowercase hex digits into `out` (twice their length).
fn hex_into(out: &mut [u8], bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (pair, byte) in out.chunks_exact_mut(2).zip(bytes) {
        pair.copy_from_slice(&[
            DIGITS[usize::from(byte >> 4)],
            DIGITS[usize::from(byte & 0x0f)],
        ]);
    }
}

/// A `traceparent` as W3C trace context (level 1, "traceparent header") defines it:
/// `version-traceid-parentid-flags` in lowercase hex, version `ff` invalid, trace and
/// parent ids not all zeros. A version-00 value is exactly 55 bytes; a later version
/// may append fields after another `-`, which are ignored. Surrounding spaces and tabs
/// (optional white space around an HTTP field value) are allowed. The flags keep only
/// the sampled bit.
fn parse_traceparent(value: &[u8]) -> Option<(TraceId, SpanId, TraceFlags)> {
    let value = value.trim_ascii();
    let (head, tail) = value.split_at_checked(TRACEPARENT_LEN)?;
    let version = hex_byte(head.get(0..2)?)?;
    let well_ended = match tail.first() {
        None => true,
        Some(&next) => version != 0 && next == b'-',
    };
    if version == 0xff || !well_ended {
        return None;
    }
    if [2, 35, 52].iter().any(|&at| head.get(at) != Some(&b'-')) {
        return None;
    }
    let mut trace = [0u8; 16];
    hex_decode(head.get(3..35)?, &mut trace)?;
    let mut span = [0u8; 8];
    hex_decode(head.get(36..52)?, &mut span)?;
    let flags = hex_byte(head.get(53..55)?)?;
    let (trace_id, span_id) = (TraceId::from_bytes(trace), SpanId::from_bytes(span));
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    Some((
        trace_id,
        span_id,
        TraceFlags::new(flags) & TraceFlags::SAMPLED,
    ))
}

/// Decodes lowercase hex `digits` into `out` (half their length); `None` on any other
/// character.
fn hex_decode(digits: &[u8], out: &mut [u8]) -> Option<()> {
    for (pair, byte) in digits.chunks_exact(2).zip(out.iter_mut()) {
        *byte = hex_byte(pair)?;
    }
    Some(())
}

/// Two lowercase hex digits as a byte.
fn hex_byte(pair: &[u8]) -> Option<u8> {
    let [high, low] = pair else {
        return None;
    };
    Some(nibble(*high)? << 4 | nibble(*low)?)
}

fn nibble(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use opentelemetry::propagation::TextMapPropagator as _;
    use opentelemetry_sdk::propagation::TraceContextPropagator;

    use super::*;

    const VALID: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    fn headers(pairs: &[(&str, &str)]) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        for (name, value) in pairs {
            headers.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                http::HeaderValue::from_str(value).unwrap(),
            );
        }
        headers
    }

    /// The remote span context `traceparent` (and `tracestate`) give at the front door,
    /// or `None` when they give none.
    fn read(traceparent: &str, tracestate: Option<&str>) -> Option<SpanContext> {
        let mut pairs = vec![("traceparent", traceparent)];
        pairs.extend(tracestate.map(|s| ("tracestate", s)));
        let cx = from_headers(&headers(&pairs)).expect("a traceparent was sent");
        cx.has_active_span()
            .then(|| cx.span().span_context().clone())
    }

    /// What the SDK's propagator reads from the same headers.
    fn sdk_read(traceparent: &str, tracestate: Option<&str>) -> Option<SpanContext> {
        let mut carrier = HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
        if let Some(state) = tracestate {
            carrier.insert("tracestate".to_owned(), state.to_owned());
        }
        let cx = TraceContextPropagator::new()
            .extract_with_context(&opentelemetry::Context::new(), &carrier);
        cx.has_active_span()
            .then(|| cx.span().span_context().clone())
    }

    fn context(flags: TraceFlags, state: &str) -> opentelemetry::Context {
        opentelemetry::Context::new().with_remote_span_context(SpanContext::new(
            TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
            SpanId::from_hex("b7ad6b7169203331").unwrap(),
            flags,
            true,
            state.parse().unwrap(),
        ))
    }

    #[test]
    fn valid_traceparents_read_as_the_sdk_reads_them() {
        for (traceparent, tracestate) in [
            (VALID, None),
            (
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
                None,
            ),
            (
                "00-00000000000000000000000000000001-0000000000000001-01",
                None,
            ),
            (VALID, Some("vendor=opaque,other=1")),
            (VALID, Some("not a tracestate")),
            (
                " 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\t",
                None,
            ),
        ] {
            let ours = read(traceparent, tracestate)
                .unwrap_or_else(|| panic!("{traceparent:?} was not read"));
            assert_eq!(Some(&ours), sdk_read(traceparent, tracestate).as_ref());
            assert!(ours.is_remote());
        }
        let read = read(VALID, Some("vendor=opaque")).unwrap();
        assert_eq!(
            read.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(read.span_id().to_string(), "b7ad6b7169203331");
        assert!(read.is_sampled());
        assert_eq!(read.trace_state().header(), "vendor=opaque");
    }

    /// A later version may append fields; they are ignored, and only the sampled flag
    /// is kept.
    #[test]
    fn a_later_version_is_read_by_its_version_00_fields() {
        let read = read(
            "cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03-what-the-future-holds",
            None,
        )
        .expect("a later version with more fields is read");
        assert_eq!(read.span_id().to_string(), "b7ad6b7169203331");
        assert_eq!(read.trace_flags(), TraceFlags::SAMPLED);
    }

    /// Each malformed value starts a trace of its own instead of joining one.
    #[test]
    fn malformed_traceparents_are_not_read() {
        for bad in [
            "",
            "00",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0",
            // Version 00 has exactly four fields.
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01x",
            // Version ff is invalid.
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            // Uppercase, signs and other characters are not lowercase hex.
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-B7AD6B7169203331-01",
            "00-+af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-+7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0g",
            "0g-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            // Separators where they belong.
            "00_0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c_b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331_01",
            "00-0af7651916cd43dd8448eb211c8031-9c-b7ad6b7169203331-01",
            // All-zero ids.
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        ] {
            assert_eq!(read(bad, None), None, "{bad:?} was read");
        }
    }

    #[test]
    fn a_repeated_traceparent_is_not_read() {
        let twice = headers(&[
            ("traceparent", VALID),
            (
                "traceparent",
                "00-1af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
        ]);
        let cx = from_headers(&twice).expect("a traceparent was sent");
        assert!(!cx.has_active_span());
        assert!(from_headers(&headers(&[("tracestate", "a=b")])).is_none());
    }

    /// What the orchestrator sends the worker reads back as the same span context, by
    /// the worker and by the SDK's propagator alike.
    #[test]
    fn metadata_round_trips_the_context() {
        for (flags, state) in [
            (TraceFlags::SAMPLED, ""),
            (TraceFlags::NOT_SAMPLED, ""),
            (TraceFlags::SAMPLED, "vendor=opaque,other=1"),
        ] {
            let sent = context(flags, state);
            let mut metadata = MetadataMap::new();
            inject(&sent, &mut metadata);
            let received = from_metadata(&metadata).expect("a traceparent was sent");
            assert_eq!(received.span().span_context(), sent.span().span_context());

            let mut carrier = HashMap::new();
            for (name, value) in metadata.as_ref() {
                carrier.insert(name.to_string(), value.to_str().unwrap().to_owned());
            }
            let sdk = TraceContextPropagator::new()
                .extract_with_context(&opentelemetry::Context::new(), &carrier);
            assert_eq!(sdk.span().span_context(), sent.span().span_context());
        }
        let mut metadata = MetadataMap::new();
        inject(&context(TraceFlags::SAMPLED, ""), &mut metadata);
        assert_eq!(
            metadata.get("traceparent").and_then(|v| v.to_str().ok()),
            Some(VALID)
        );
    }

    #[test]
    fn trace_context_is_never_indexed_in_the_header_table() {
        let mut metadata = MetadataMap::new();
        inject(
            &context(TraceFlags::SAMPLED, "vendor=opaque"),
            &mut metadata,
        );
        for name in ["traceparent", "tracestate"] {
            let value = metadata.get(name).expect("the header was set");
            assert!(
                value.is_sensitive(),
                "{value:?} would churn the HPACK table"
            );
        }
    }

    /// An empty `tracestate` is not sent; a caller's non-empty one reaches the worker
    /// whole. A context with no span sends nothing.
    #[test]
    fn an_empty_tracestate_is_not_sent_and_a_real_one_is() {
        let mut metadata = MetadataMap::new();
        inject(&context(TraceFlags::SAMPLED, ""), &mut metadata);
        assert!(metadata.contains_key("traceparent"));
        assert!(
            !metadata.contains_key("tracestate"),
            "an empty tracestate was sent: {metadata:?}"
        );

        let mut metadata = MetadataMap::new();
        inject(
            &context(TraceFlags::SAMPLED, "vendor=opaque,other=1"),
            &mut metadata,
        );
        assert_eq!(
            metadata.get("tracestate").and_then(|v| v.to_str().ok()),
            Some("vendor=opaque,other=1")
        );

        let mut metadata = MetadataMap::new();
        inject(&opentelemetry::Context::new(), &mut metadata);
        assert!(metadata.is_empty(), "{metadata:?}");
    }
}
