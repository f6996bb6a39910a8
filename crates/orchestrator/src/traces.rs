//! The front-door span of every authenticated request (HTTP `/v1`, `/mcp`, gRPC), with
//! the caller's W3C `traceparent` as its parent (DESIGN §13). The gate's spans open
//! inside it; see `airlock_telemetry` for what is exported and when. It is an
//! `airlock_telemetry::CallSpan` (built through the SDK, not `tracing`): OpenTelemetry's
//! current context while the request is served, which is where the gate's spans find
//! their parent.
//!
//! With tracing off the layer passes requests through untouched.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use airlock_telemetry::{CallSpan, KeyValue, SpanKind, SpanStart};
use axum::extract::MatchedPath;
use futures::future::Either;
use tower::{Layer, Service};

/// The front-door span, in the request's extensions for handlers that run the call in
/// another task (rmcp's).
#[derive(Clone, Debug)]
pub struct FrontDoorSpan(pub CallSpan);

/// Which front door a request came through.
#[derive(Clone, Copy, Debug)]
pub enum Door {
    /// `/v1` and `/mcp`: the span is named after the matched route.
    Http,
    /// The gRPC `Orchestrator` service: named after the RPC.
    Grpc,
}

/// Opens the front-door span around each request.
#[derive(Clone, Copy, Debug)]
pub struct FrontDoorLayer(pub Door);

impl<S> Layer<S> for FrontDoorLayer {
    type Service = FrontDoor<S>;

    fn layer(&self, inner: S) -> Self::Service {
        FrontDoor {
            inner,
            door: self.0,
        }
    }
}

#[derive(Clone, Debug)]
pub struct FrontDoor<S> {
    inner: S,
    door: Door,
}

type Traced<F> = Pin<Box<dyn Future<Output = F> + Send>>;

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for FrontDoor<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    ResBody: 'static,
{
    type Response = http::Response<ResBody>;
    type Error = S::Error;
    type Future = Either<S::Future, Traced<Result<Self::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        if !airlock_telemetry::enabled() {
            return Either::Left(self.inner.call(request));
        }
        let parent = airlock_telemetry::propagate::context_from_headers(request.headers());
        let span = CallSpan::start(parent, || door_span(self.door, &request));
        request.extensions_mut().insert(FrontDoorSpan(span.clone()));
        let answered = span.attach_to(self.inner.call(request));
        Either::Right(Box::pin(async move {
            let response = answered.await;
            if let Ok(response) = &response {
                let status = response.status();
                span.set("http.response.status_code", || {
                    i64::from(status.as_u16()).into()
                });
                if status.is_server_error() {
                    span.fail();
                }
            }
            span.end();
            response
        }))
    }
}

/// What the front door's span is for a request through `door`: named after the HTTP
/// route's pattern (never the path itself: ids in a path would make every span name
/// unique) or the gRPC method.
fn door_span<B>(door: Door, request: &http::Request<B>) -> SpanStart {
    match door {
        Door::Http => {
            let route = request
                .extensions()
                .get::<MatchedPath>()
                .map_or("unmatched", MatchedPath::as_str)
                .to_owned();
            SpanStart {
                name: format!("{} {route}", request.method()).into(),
                kind: SpanKind::Server,
                attributes: vec![
                    KeyValue::new("http.request.method", request.method().as_str().to_owned()),
                    KeyValue::new("http.route", route),
                ],
            }
        }
        Door::Grpc => {
            let path = request.uri().path().trim_start_matches('/');
            let (service, method) = path.split_once('/').unwrap_or((path, ""));
            SpanStart {
                name: path.to_owned().into(),
                kind: SpanKind::Server,
                attributes: vec![
                    KeyValue::new("rpc.system", "grpc"),
                    KeyValue::new("rpc.service", service.to_owned()),
                    KeyValue::new("rpc.method", method.to_owned()),
                ],
            }
        }
    }
}

/// tonic routes by the wrapped service's name.
impl<S: tonic::server::NamedService> tonic::server::NamedService for FrontDoor<S> {
    const NAME: &'static str = S::NAME;
}

/// A gate stage that others in this process nest in (the approval wait, opened only for
/// calls held for a human), as a `tracing` span under the call's: the call's span is
/// OpenTelemetry's current context while the call's task is polled, which
/// tracing-opentelemetry takes as the parent of a span with no `tracing` parent. The
/// other stages are `airlock_telemetry::Stage`s, and the dispatch an
/// `airlock_telemetry::OpenStage`: its only child is the worker's span, which it reaches
/// through the request's trace context, not through `tracing`.
macro_rules! stage {
    ($name:literal) => {
        tracing::span!(
            target: airlock_telemetry::TARGET,
            tracing::Level::TRACE,
            $name,
            otel.status_code = tracing::field::Empty,
        )
    };
}
pub(crate) use stage;
