//! Spans that every call opens in every process it crosses (the front door's, the
//! worker's `execute_tool`, the sandbox's run), built here rather than through `tracing`
//! or the SDK's tracer.
//!
//! A `tracing` span exported by tracing-opentelemetry is registered in `tracing`'s
//! registry, passed through each layer's filter, entered and exited on every poll, built
//! as a span builder and converted when it closes: measured span by span, about 4 % of
//! its process's CPU on a 100 B read (docs/decisions.md, "What each `tracing` span
//! costs"). A [`CallSpan`] is a `Recording` in an OpenTelemetry context, and nothing
//! else: the SDK's tracer did the same work through a span builder, a boxed sampler, a
//! span that holds a clone of the tracer (a reference count on the provider, shared by
//! every thread that opens a span) and a conversion when it ends (docs/decisions.md,
//! "Call spans are Airlock's own").
//!
//! What runs inside one finds it through OpenTelemetry's current context, which
//! [`CallSpan::attach_to`] makes the span's on each poll of the future it wraps: the
//! gate's stages and the worker's sandbox span take it as their parent
//! ([`crate::StageParent::current`]), a `tracing` span opened there (the gate's
//! approval wait, the agent loop's run) takes it as its parent (tracing-opentelemetry's
//! rule for a span with no `tracing` parent), and a log line written there carries its
//! ids ([`crate::json`]).
//!
//! With tracing off a call span is nothing: no clock is read, nothing is allocated, and
//! an instrumented future is polled as it is.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::SystemTime;

use opentelemetry::trace::{
    SamplingDecision, SpanContext, SpanId, SpanKind, Status, TraceContextExt as _,
};
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::trace::{
    IdGenerator as _, RandomIdGenerator, Sampler, ShouldSample as _, SpanData, SpanEvents,
    SpanLinks, SpanProcessor as _,
};

/// One span of a call, open until it [ends](CallSpan::end) (or is dropped, which ends
/// it too: a future cancelled mid-call still exports what it did).
#[derive(Clone, Debug, Default)]
pub struct CallSpan(Option<opentelemetry::Context>);

/// What a span is, decided by the code that opens it: its name, its kind and the
/// attributes it has from the start. Built only when tracing is on.
pub struct SpanStart {
    pub name: Cow<'static, str>,
    pub kind: SpanKind,
    pub attributes: Vec<KeyValue>,
}

impl SpanStart {
    /// A tool's execution, named as OpenTelemetry's GenAI conventions name it
    /// (`execute_tool <tool>`), with the tool's name and Airlock's call id: the
    /// orchestrator's span of a call and each worker's. Never the call's arguments.
    pub fn execute_tool(kind: SpanKind, tool: &str, call_id: &str) -> Self {
        Self {
            name: execute_tool_name(tool).into(),
            kind,
            attributes: vec![
                KeyValue::new("gen_ai.operation.name", "execute_tool"),
                KeyValue::new("gen_ai.tool.name", tool.to_owned()),
                KeyValue::new("airlock.call_id", call_id.to_owned()),
            ],
        }
    }
}

/// `execute_tool {tool}`, the GenAI conventions' span name, in one allocation (it is
/// built twice a call, by the orchestrator and by the worker).
fn execute_tool_name(tool: &str) -> String {
    const PREFIX: &str = "execute_tool ";
    let mut name = String::with_capacity(PREFIX.len() + tool.len());
    name.push_str(PREFIX);
    name.push_str(tool);
    name
}

impl CallSpan {
    /// Starts a span under `parent` (a caller's trace context, from
    /// [`crate::propagate`]), or a trace of its own when there is none; `start` is called
    /// only when tracing is on.
    pub fn start(
        parent: Option<opentelemetry::Context>,
        start: impl FnOnce() -> SpanStart,
    ) -> Self {
        let Some(pipeline) = crate::PIPELINE.get() else {
            return Self(None);
        };
        // A context with no span in it, rather than the current one: a request's span
        // continues its caller's trace, never whatever this thread ran before.
        let parent = parent.unwrap_or_default();
        Self(Some(start_span(
            &pipeline.settings.sampler,
            &pipeline.ids,
            &parent,
            start,
        )))
    }

    /// Starts a span under the current one ([`crate::StageParent::current`]), or a
    /// trace of its own when nothing exported is current.
    pub fn under_current(start: impl FnOnce() -> SpanStart) -> Self {
        Self::start(crate::StageParent::current().context().cloned(), start)
    }

    /// The span as the parent of stages opened from it.
    pub fn parent(&self) -> crate::StageParent {
        crate::StageParent::from_context(self.0.clone())
    }

    /// Sets an attribute; `value` is called only when tracing is on.
    pub fn set(&self, key: &'static str, value: impl FnOnce() -> Value) {
        if let Some(cx) = &self.0 {
            cx.span().set_attribute(KeyValue::new(key, value()));
        }
    }

    /// Marks the span as failed (OpenTelemetry's status `ERROR`, with no description:
    /// a description could quote what the call carried).
    pub fn fail(&self) {
        if let Some(cx) = &self.0 {
            cx.span().set_status(Status::error(""));
        }
    }

    /// Ends the span now.
    pub fn end(self) {
        if let Some(cx) = self.0 {
            cx.span().end();
        }
    }

    /// Runs `inner` with this span as OpenTelemetry's current context on each of its
    /// polls (and only then: the context goes with the future, not with the thread).
    pub fn attach_to<F: Future>(&self, inner: F) -> InSpan<F> {
        InSpan {
            inner,
            context: self.0.clone(),
        }
    }

    /// Runs `f` with this span as OpenTelemetry's current context.
    pub fn in_scope<T>(&self, f: impl FnOnce() -> T) -> T {
        let _attached = self.0.clone().map(opentelemetry::Context::attach);
        f()
    }
}

/// Starts the span `start` under `parent` (a context with no span: a new trace), as
/// the SDK's tracer does: the trace id is the parent's, the sampler decides, the flags
/// are the parent's with the decision in them, and only a sampled span records.
///
/// The sampler decides before the span is built, and `start` is called only for a span
/// that records: the samplers Airlock accepts (`OTEL_TRACES_SAMPLER`, crate root) decide
/// by the parent and the trace id alone, never by a span's name, kind or attributes, so
/// a call that a ratio leaves out allocates none of them.
pub(crate) fn start_span(
    sampler: &Sampler,
    ids: &RandomIdGenerator,
    parent: &opentelemetry::Context,
    start: impl FnOnce() -> SpanStart,
) -> opentelemetry::Context {
    let has_parent = parent.has_active_span();
    let parent_span = parent.span();
    let parent_context = parent_span.span_context();
    let trace_id = if has_parent {
        parent_context.trace_id()
    } else {
        ids.new_trace_id()
    };
    let sampling = sampler.should_sample(Some(parent), trace_id, "", &SpanKind::Internal, &[], &[]);
    let sampled = sampling.decision == SamplingDecision::RecordAndSample;
    let context = SpanContext::new(
        trace_id,
        ids.new_span_id(),
        parent_context.trace_flags().with_sampled(sampled),
        false,
        sampling.trace_state,
    );
    if sampling.decision == SamplingDecision::Drop {
        // Not recorded, but still the parent of what runs inside and of the worker's
        // span (which the flags tell not to record either).
        return parent.with_remote_span_context(context);
    }
    let start = start();
    let mut attributes = start.attributes;
    attributes.extend(sampling.attributes);
    let (parent_span_id, parent_is_remote) = if has_parent {
        (parent_context.span_id(), parent_context.is_remote())
    } else {
        (SpanId::INVALID, false)
    };
    parent.with_span(Recording {
        context,
        parent_span_id,
        parent_is_remote,
        name: start.name,
        kind: start.kind,
        start: SystemTime::now(),
        attributes,
        status: Status::Unset,
        ended: false,
    })
}

/// A span that records: what it is and what was set on it, handed to the exporter as
/// the SDK's `SpanData` when it ends (or is dropped, the last clone of its context gone).
///
/// It carries no events and no links: Airlock's spans have none (what happens inside a
/// span is a log line, with the span's ids).
#[derive(Debug)]
struct Recording {
    context: SpanContext,
    parent_span_id: SpanId,
    parent_is_remote: bool,
    name: Cow<'static, str>,
    kind: SpanKind,
    start: SystemTime,
    attributes: Vec<KeyValue>,
    status: Status,
    ended: bool,
}

impl opentelemetry::trace::Span for Recording {
    fn add_event_with_timestamp<T>(&mut self, _name: T, _at: SystemTime, _: Vec<KeyValue>)
    where
        T: Into<Cow<'static, str>>,
    {
    }

    fn span_context(&self) -> &SpanContext {
        &self.context
    }

    fn is_recording(&self) -> bool {
        !self.ended
    }

    fn set_attribute(&mut self, attribute: KeyValue) {
        if !self.ended {
            self.attributes.push(attribute);
        }
    }

    /// As the SDK does: `Ok` wins over `Error`, which wins over `Unset`.
    fn set_status(&mut self, status: Status) {
        if !self.ended && status > self.status {
            self.status = status;
        }
    }

    fn update_name<T>(&mut self, name: T)
    where
        T: Into<Cow<'static, str>>,
    {
        if !self.ended {
            self.name = name.into();
        }
    }

    fn add_link(&mut self, _span_context: SpanContext, _attributes: Vec<KeyValue>) {}

    fn end_with_timestamp(&mut self, end: SystemTime) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let name = std::mem::take(&mut self.name);
        let attributes = std::mem::take(&mut self.attributes);
        let status = std::mem::replace(&mut self.status, Status::Unset);
        let Some(pipeline) = crate::PIPELINE.get() else {
            return;
        };
        pipeline.processor.on_end(SpanData {
            span_context: self.context.clone(),
            parent_span_id: self.parent_span_id,
            parent_span_is_remote: self.parent_is_remote,
            span_kind: self.kind.clone(),
            name,
            start_time: self.start,
            end_time: end,
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status,
            instrumentation_scope: pipeline.scope.clone(),
        });
    }
}

impl Drop for Recording {
    /// A span dropped without an end ends now; one that ended is not timed again.
    fn drop(&mut self) {
        if !self.ended {
            opentelemetry::trace::Span::end(self);
        }
    }
}

pin_project_lite::pin_project! {
    /// A future polled with a [`CallSpan`] as OpenTelemetry's current context.
    #[derive(Debug)]
    pub struct InSpan<F> {
        #[pin]
        inner: F,
        context: Option<opentelemetry::Context>,
    }
}

impl<F: Future> Future for InSpan<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let _attached = this.context.clone().map(opentelemetry::Context::attach);
        this.inner.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{TraceFlags, TraceId, TraceState};

    fn remote() -> SpanContext {
        SpanContext::new(
            TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
            SpanId::from_hex("b7ad6b7169203331").unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        )
    }

    fn current_span_id() -> SpanId {
        opentelemetry::Context::map_current(|cx| cx.span().span_context().span_id())
    }

    #[test]
    fn a_wrapped_future_sees_the_span_only_while_it_is_polled() {
        let span = CallSpan(Some(
            opentelemetry::Context::new().with_remote_span_context(remote()),
        ));
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = seen.clone();
        let mut polls = 0;
        let inner = std::future::poll_fn(move |cx| {
            record.lock().unwrap().push(current_span_id());
            polls += 1;
            if polls < 2 {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Poll::Ready(())
        });
        let mut wrapped = std::pin::pin!(span.attach_to(inner));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(wrapped.as_mut().poll(&mut cx).is_pending());
        assert_eq!(current_span_id(), SpanId::INVALID, "not between polls");
        assert!(wrapped.as_mut().poll(&mut cx).is_ready());
        assert_eq!(current_span_id(), SpanId::INVALID, "not after the end");
        assert_eq!(*seen.lock().unwrap(), vec![remote().span_id(); 2]);
        assert_eq!(span.in_scope(current_span_id), remote().span_id());
    }

    fn start(sampler: &Sampler, parent: &opentelemetry::Context) -> opentelemetry::Context {
        let start = || SpanStart::execute_tool(SpanKind::Server, "read_file", "c-1");
        start_span(sampler, &RandomIdGenerator::default(), parent, start)
    }

    #[test]
    fn a_span_continues_its_parents_trace_and_records_only_when_sampled() {
        let parent_based = Sampler::ParentBased(Box::new(Sampler::AlwaysOn));
        let root = opentelemetry::Context::new();

        // No parent: a trace of its own, sampled, recording.
        let cx = start(&parent_based, &root);
        let span = cx.span();
        assert!(span.is_recording());
        assert!(span.span_context().is_sampled());
        assert!(!span.span_context().is_remote());
        assert_ne!(span.span_context().trace_id(), TraceId::INVALID);
        let other = start(&parent_based, &root);
        assert_ne!(
            other.span().span_context().trace_id(),
            span.span_context().trace_id(),
            "each root is a trace of its own"
        );

        // A caller's sampled context: its trace, a new span id, its trace state.
        let caller = opentelemetry::Context::new().with_remote_span_context(remote());
        let cx = start(&parent_based, &caller);
        let span = cx.span();
        assert!(span.is_recording());
        assert_eq!(span.span_context().trace_id(), remote().trace_id());
        assert_ne!(span.span_context().span_id(), remote().span_id());
        assert!(span.span_context().is_sampled());
        assert!(
            !span.span_context().is_remote(),
            "the new span is this process's"
        );

        // A caller that did not sample: followed, not recorded, still the parent of what
        // runs inside (its trace id, unsampled flags).
        let unsampled = SpanContext::new(
            remote().trace_id(),
            remote().span_id(),
            TraceFlags::default(),
            true,
            TraceState::default(),
        );
        let caller = opentelemetry::Context::new().with_remote_span_context(unsampled);
        let cx = start(&parent_based, &caller);
        assert!(cx.has_active_span());
        assert!(!cx.span().is_recording());
        assert!(!cx.span().span_context().is_sampled());
        assert_eq!(cx.span().span_context().trace_id(), remote().trace_id());

        // The sampler decides for a root: `always_off` and a ratio of 0 record nothing.
        for sampler in [Sampler::AlwaysOff, Sampler::TraceIdRatioBased(0.0)] {
            let cx = start(&sampler, &root);
            assert!(!cx.span().is_recording(), "{sampler:?}");
            assert!(!cx.span().span_context().is_sampled(), "{sampler:?}");
        }
        // ... and `always_on` records under an unsampled caller: it does not follow.
        let cx = start(&Sampler::AlwaysOn, &caller);
        assert!(cx.span().is_recording());
        assert!(cx.span().span_context().is_sampled());
    }

    #[test]
    fn a_span_that_is_not_sampled_is_never_built() {
        let built = std::cell::Cell::new(0);
        let start = || {
            built.set(built.get() + 1);
            SpanStart::execute_tool(SpanKind::Server, "read_file", "c-1")
        };
        let ids = RandomIdGenerator::default();
        let root = opentelemetry::Context::new();
        for sampler in [
            Sampler::AlwaysOff,
            Sampler::TraceIdRatioBased(0.0),
            Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
        ] {
            let cx = start_span(&sampler, &ids, &root, start);
            assert!(!cx.span().span_context().is_sampled(), "{sampler:?}");
            // Still the parent of what runs inside: a valid, unsampled context.
            assert!(cx.span().span_context().is_valid(), "{sampler:?}");
        }
        assert_eq!(
            built.get(),
            0,
            "attributes built for a span that is dropped"
        );
        let cx = start_span(&Sampler::AlwaysOn, &ids, &root, start);
        assert!(cx.span().is_recording());
        assert_eq!(built.get(), 1);
    }

    #[test]
    fn a_recording_keeps_the_strongest_status_and_nothing_after_its_end() {
        use opentelemetry::trace::Span as _;
        let mut span = Recording {
            context: remote(),
            parent_span_id: SpanId::INVALID,
            parent_is_remote: false,
            name: "execute_tool read_file".into(),
            kind: SpanKind::Server,
            start: SystemTime::now(),
            attributes: Vec::new(),
            status: Status::Unset,
            ended: false,
        };
        span.set_status(Status::error(""));
        span.set_status(Status::Unset);
        assert_eq!(
            span.status,
            Status::error(""),
            "unset does not clear an error"
        );
        span.set_status(Status::Ok);
        span.set_status(Status::error(""));
        assert_eq!(span.status, Status::Ok, "ok is final");
        span.set_attribute(KeyValue::new("airlock.status", "ok"));
        span.update_name("execute_tool write_file");
        assert_eq!(span.attributes.len(), 1);
        assert!(span.is_recording());
        span.end();
        assert!(!span.is_recording());
        span.set_attribute(KeyValue::new("airlock.late", "x"));
        span.update_name("late");
        assert!(
            span.attributes.is_empty(),
            "handed over at the end, nothing added after"
        );
        assert_ne!(span.name, "late");
    }

    #[test]
    fn with_tracing_off_a_span_is_nothing() {
        // No pipeline in this test process: nothing is built, and a wrapped future runs
        // with no current span.
        let span = CallSpan::start(None, || unreachable!("built only with tracing on"));
        span.set("airlock.status", || {
            unreachable!("built only with tracing on")
        });
        span.fail();
        let inner = std::future::poll_fn(|_| Poll::Ready(current_span_id()));
        let mut wrapped = std::pin::pin!(span.attach_to(inner));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert_eq!(wrapped.as_mut().poll(&mut cx), Poll::Ready(SpanId::INVALID));
        span.end();
    }
}
