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

use std::time::SystemTime;

use opentelemetry::trace::{Status, TraceContextExt as _, Tracer as _};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// Where the stage spans of a piece of code go: the OpenTelemetry context of the
/// `tracing` span that was current when it was taken. Taking it once and opening several
/// stages from it saves a lookup in `tracing`'s registry per stage.
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
    /// is current (a stage is never the root of a trace of its own).
    pub fn current() -> Self {
        if !crate::enabled() {
            return Self(None);
        }
        let cx = tracing::Span::current().context();
        Self(cx.has_active_span().then_some(cx))
    }

    /// Starts the stage `name` under this parent.
    pub fn stage(&self, name: &'static str) -> Stage {
        Stage(self.0.as_ref().map(|parent| Started {
            name,
            parent: parent.clone(),
            start: SystemTime::now(),
        }))
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
    parent: opentelemetry::Context,
    start: SystemTime,
}

impl Stage {
    /// Starts the stage `name` under the current span.
    pub fn current(name: &'static str) -> Self {
        StageParent::current().stage(name)
    }

    /// Ends the stage now; `failed` marks it as an error (the stage refused the call or
    /// could not do its work).
    pub fn end(self, failed: bool) {
        let (Some(started), Some(pipeline)) = (self.0, crate::PIPELINE.get()) else {
            return;
        };
        let tracer = &pipeline.tracer;
        let mut span = tracer
            .span_builder(started.name)
            .with_start_time(started.start)
            .start_with_context(tracer, &started.parent);
        if failed {
            opentelemetry::trace::Span::set_status(&mut span, Status::error(""));
        }
        opentelemetry::trace::Span::end(&mut span);
    }
}
