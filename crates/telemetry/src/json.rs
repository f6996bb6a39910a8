//! JSON log lines with the trace they belong to: `"trace_id"` and `"span_id"` (lowercase
//! hex, as OTLP and W3C spell them) first in the object, whenever the line is written
//! inside an exported span, so that a log search and a trace view meet on one id.

use std::fmt;

use opentelemetry::trace::{SpanId, TraceContextExt as _, TraceId};
use tracing::Subscriber;
use tracing_opentelemetry::OtelData;
use tracing_subscriber::Registry;
use tracing_subscriber::fmt::format::{Format, Json, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// tracing-subscriber's JSON format, with the trace and span ids added.
#[derive(Debug)]
pub struct JsonWithTrace {
    inner: Format<Json>,
}

impl JsonWithTrace {
    pub fn new(inner: Format<Json>) -> Self {
        Self { inner }
    }
}

impl<S, N> FormatEvent<S, N> for JsonWithTrace
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> fmt::Result {
        let Some((trace_id, span_id)) = current_ids(event) else {
            return self.inner.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        self.inner
            .format_event(ctx, Writer::new(&mut line), event)?;
        match line.strip_prefix('{') {
            Some(rest) => write!(
                writer,
                "{{\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\",{rest}"
            ),
            None => writer.write_str(&line),
        }
    }
}

/// The ids of the innermost exported span around `event`: a `tracing` span's, or else
/// the [`crate::CallSpan`] that is OpenTelemetry's current context. The registry is
/// asked directly: the log layer's own filter (`RUST_LOG`) may not enable the call
/// spans, which are exported whatever it says.
fn current_ids(event: &tracing::Event<'_>) -> Option<(TraceId, SpanId)> {
    if !crate::enabled() {
        return None;
    }
    let id = match event.parent() {
        Some(id) => Some(id.clone()),
        None if event.is_contextual() => tracing::Span::current().id(),
        None => return None,
    };
    id.and_then(|id| traced_ids(&id)).or_else(|| {
        opentelemetry::Context::map_current(|cx| {
            let span = cx.span();
            let context = span.span_context();
            context
                .is_valid()
                .then(|| (context.trace_id(), context.span_id()))
        })
    })
}

/// The ids of the innermost span exported through `tracing` around the span `id`.
fn traced_ids(id: &tracing::span::Id) -> Option<(TraceId, SpanId)> {
    tracing::dispatcher::get_default(|dispatch| {
        let registry = dispatch.downcast_ref::<Registry>()?;
        let span = registry.span(id)?;
        span.scope().find_map(|span| {
            let extensions = span.extensions();
            let data = extensions.get::<OtelData>()?;
            Some((data.trace_id()?, data.span_id()?))
        })
    })
}
