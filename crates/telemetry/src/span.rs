//! Spans that every call opens in every process it crosses (the front door's, the
//! worker's `execute_tool`, the sandbox's run), built through the SDK's tracer directly
//! rather than through `tracing`.
//!
//! A `tracing` span exported by tracing-opentelemetry is registered in `tracing`'s
//! registry, passed through each layer's filter, entered and exited on every poll, built
//! as a span builder and converted when it closes: measured span by span, about 4 % of
//! its process's CPU on a 100 B read (docs/decisions.md, "What each `tracing` span
//! costs"). A [`CallSpan`] is the SDK's span in an OpenTelemetry context, and nothing
//! else.
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

use opentelemetry::trace::{SpanKind, Status, TraceContextExt as _, Tracer as _};
use opentelemetry::{KeyValue, Value};

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
        let start = start();
        let tracer = &pipeline.tracer;
        let span = tracer
            .span_builder(start.name)
            .with_kind(start.kind)
            .with_attributes(start.attributes)
            .start_with_context(tracer, &parent);
        Self(Some(parent.with_span(span)))
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
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

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
