//! Stage spans: short children of a call's span (the gate's checks, a store write) that
//! are timed by the code that runs them and handed to the exporter when they end,
//! without passing through `tracing`.
//!
//! A call crosses some ten gate stages of a few microseconds each. As `tracing` spans
//! each would be registered, filtered, entered and exited on every poll, and converted
//! by tracing-opentelemetry when it closes — per call, more work than the export of the
//! spans themselves (measured: docs/decisions.md, "Traces"). A stage is a leaf: nothing
//! is ever opened inside it, so it needs no place in `tracing`'s span tree, only its
//! parent's OpenTelemetry context, its name, its two timestamps and whether it failed.
//!
//! With tracing off a stage is nothing: no clock is read and nothing is allocated.

use std::borrow::Cow;
use std::time::SystemTime;

use opentelemetry::InstrumentationScope;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags,
};
use opentelemetry_sdk::trace::{
    IdGenerator as _, SpanData, SpanEvents, SpanLinks, SpanProcessor as _,
};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// Where the stage spans of a piece of code go: the OpenTelemetry context of the span
/// that was current when it was taken ([`StageParent::current`]), or of a
/// [`crate::CallSpan`] ([`crate::CallSpan::parent`]). Taking it once and opening several
/// stages from it saves a lookup per stage.
#[derive(Clone, Default)]
pub struct StageParent(Option<opentelemetry::Context>);

impl std::fmt::Debug for StageParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("StageParent")
            .field(&self.0.as_ref().map(|cx| cx.span().span_context().span_id()))
            .finish()
    }
}

impl StageParent {
    /// The current span's context; empty when tracing is off, or when no exported span
    /// is current (a stage is never the root of a trace of its own). The current
    /// `tracing` span's, when it is exported; otherwise OpenTelemetry's current context,
    /// which a [`crate::CallSpan`] sets while the future it wraps is polled.
    pub fn current() -> Self {
        if !crate::enabled() {
            return Self(None);
        }
        let cx = tracing::Span::current().context();
        if cx.has_active_span() {
            return Self(Some(cx));
        }
        let cx = opentelemetry::Context::current();
        Self(cx.has_active_span().then_some(cx))
    }

    pub(crate) fn from_context(cx: Option<opentelemetry::Context>) -> Self {
        Self(cx)
    }

    /// Starts the stage `name` under this parent, as a span at once: its context is
    /// known before it ends, so that work elsewhere (a worker, through the trace context
    /// in its request) can be its child. Dearer than [`StageParent::stage`] by an id
    /// and a context; for the one stage a call hands on, the dispatch.
    pub fn open(&self, name: &'static str) -> OpenStage {
        let Some((parent, pipeline)) = self.0.as_ref().zip(crate::PIPELINE.get()) else {
            return OpenStage(Self(None));
        };
        let start = || crate::SpanStart {
            name: Cow::Borrowed(name),
            kind: SpanKind::Internal,
            attributes: Vec::new(),
        };
        let cx = crate::span::start_span(&pipeline.settings.sampler, &pipeline.ids, parent, start);
        OpenStage(Self(Some(cx)))
    }

    /// The context to send on (W3C trace context), if there is one.
    pub(crate) fn context(&self) -> Option<&opentelemetry::Context> {
        self.0.as_ref()
    }

    /// Starts the stage `name` under this parent. Under a parent that is not sampled it
    /// is nothing, as with tracing off: it would not be exported (`stage_span`), so
    /// no clock is read and no id drawn for it — what a call costs when a sampling
    /// ratio leaves it out.
    pub fn stage(&self, name: &'static str) -> Stage {
        let parent = self.0.as_ref().and_then(|cx| {
            let span = cx.span();
            let parent = span.span_context();
            parent.is_sampled().then(|| parent.clone())
        });
        Stage(parent.map(|parent| Started {
            name,
            parent,
            start: SystemTime::now(),
        }))
    }
}

/// A stage started as a span ([`StageParent::open`]); exported when it
/// [ends](OpenStage::end), not when it is dropped.
#[derive(Debug)]
#[must_use = "a stage is exported only when it ends"]
pub struct OpenStage(StageParent);

impl OpenStage {
    /// The stage as the parent of what runs inside it (in this process or another).
    pub fn parent(&self) -> &StageParent {
        &self.0
    }

    /// Ends the stage now; `failed` marks it as an error.
    pub fn end(self, failed: bool) {
        let Some(cx) = self.0.0 else {
            return;
        };
        let span = cx.span();
        if failed {
            span.set_status(Status::error(""));
        }
        span.end();
    }
}

/// One stage, started; exported when it [ends](Stage::end). A stage dropped without
/// ending (its future cancelled) is not exported.
#[derive(Debug)]
#[must_use = "a stage is exported only when it ends"]
pub struct Stage(Option<Started>);

#[derive(Debug)]
struct Started {
    name: &'static str,
    parent: SpanContext,
    start: SystemTime,
}

impl Stage {
    /// Starts the stage `name` under the current span.
    pub fn current(name: &'static str) -> Self {
        StageParent::current().stage(name)
    }

    /// Ends the stage now; `failed` marks it as an error (the stage refused the call or
    /// could not do its work).
    ///
    /// The span is handed to the exporter as the SDK's `SpanData`, built here rather
    /// than through the SDK's tracer: a stage has no attributes, events or children, so
    /// the tracer's work (a sampler's decision, a span object, its conversion when it
    /// ends) is an id and a struct (measured: docs/decisions.md, "Traces").
    pub fn end(self, failed: bool) {
        let (Some(started), Some(pipeline)) = (self.0, crate::PIPELINE.get()) else {
            return;
        };
        let ended = Ended {
            name: started.name,
            start: started.start,
            end: SystemTime::now(),
            failed,
        };
        let id = pipeline.ids.new_span_id();
        if let Some(span) = stage_span(&started.parent, id, ended, &pipeline.scope) {
            pipeline.processor.on_end(span);
        }
    }
}

/// What a stage did, once it is over.
struct Ended {
    name: &'static str,
    start: SystemTime,
    end: SystemTime,
    failed: bool,
}

/// The exported span of a stage whose span id is `id`, under `parent`; `None` when the
/// parent is not sampled. That is the decision the SDK would make for the child, for
/// every sampler Airlock accepts: the parent-based ones follow the parent, and
/// `always_on`, `always_off` and `traceidratio` decide by the trace id alone, which
/// parent and child share.
fn stage_span(
    parent: &SpanContext,
    id: SpanId,
    ended: Ended,
    scope: &InstrumentationScope,
) -> Option<SpanData> {
    if !parent.is_sampled() {
        return None;
    }
    Some(SpanData {
        span_context: SpanContext::new(
            parent.trace_id(),
            id,
            TraceFlags::SAMPLED,
            false,
            parent.trace_state().clone(),
        ),
        parent_span_id: parent.span_id(),
        // A stage's parent is a span of this process (the call's, or the front door's).
        parent_span_is_remote: false,
        span_kind: SpanKind::Internal,
        name: Cow::Borrowed(ended.name),
        start_time: ended.start,
        end_time: ended.end,
        attributes: Vec::new(),
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status: if ended.failed {
            Status::error("")
        } else {
            Status::Unset
        },
        instrumentation_scope: scope.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{TraceId, TraceState};

    fn parent(flags: TraceFlags) -> SpanContext {
        SpanContext::new(
            TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
            SpanId::from_hex("b7ad6b7169203331").unwrap(),
            flags,
            false,
            TraceState::from_key_value([("vendor", "1")]).unwrap(),
        )
    }

    fn ended(failed: bool) -> Ended {
        let start = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        Ended {
            name: "gate.policy",
            start,
            end: start + std::time::Duration::from_micros(7),
            failed,
        }
    }

    #[test]
    fn a_stage_is_a_sampled_child_of_its_parent() {
        let scope = InstrumentationScope::builder("airlock").build();
        let id = SpanId::from_hex("00f067aa0ba902b7").unwrap();
        let span = stage_span(&parent(TraceFlags::SAMPLED), id, ended(false), &scope).unwrap();
        assert_eq!(span.name, "gate.policy");
        assert_eq!(
            span.span_context.trace_id(),
            parent(TraceFlags::SAMPLED).trace_id()
        );
        assert_eq!(span.span_context.span_id(), id);
        assert!(span.span_context.is_sampled());
        assert!(!span.span_context.is_remote());
        assert_eq!(span.span_context.trace_state().header(), "vendor=1");
        assert_eq!(span.parent_span_id, parent(TraceFlags::SAMPLED).span_id());
        assert!(!span.parent_span_is_remote);
        assert_eq!(span.span_kind, SpanKind::Internal);
        assert_eq!(span.status, Status::Unset);
        assert_eq!(
            span.end_time.duration_since(span.start_time).unwrap(),
            std::time::Duration::from_micros(7)
        );
        assert_eq!(span.instrumentation_scope, scope);
        assert!(span.attributes.is_empty());

        let failed = stage_span(&parent(TraceFlags::SAMPLED), id, ended(true), &scope).unwrap();
        assert_eq!(failed.status, Status::error(""));
    }

    #[test]
    fn a_stage_under_an_unsampled_parent_is_not_exported() {
        let scope = InstrumentationScope::builder("airlock").build();
        let id = SpanId::from_hex("00f067aa0ba902b7").unwrap();
        assert!(stage_span(&parent(TraceFlags::NOT_SAMPLED), id, ended(false), &scope).is_none());
    }

    #[test]
    fn a_stage_is_started_only_under_a_sampled_parent() {
        let under = |flags| {
            let cx = opentelemetry::Context::new().with_remote_span_context(parent(flags));
            StageParent::from_context(Some(cx)).stage("gate.policy")
        };
        let sampled = under(TraceFlags::SAMPLED);
        let started = sampled.0.as_ref().expect("started under a sampled parent");
        assert_eq!(started.parent, parent(TraceFlags::SAMPLED));
        assert!(under(TraceFlags::NOT_SAMPLED).0.is_none());
        assert!(StageParent::default().stage("gate.policy").0.is_none());
    }
}
