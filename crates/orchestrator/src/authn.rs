//! Authentication, once for every front door: a tower layer over `http` requests that
//! wraps the axum routes (`/v1`, `/mcp`) and the tonic `Orchestrator` service alike (a
//! gRPC call's metadata is its HTTP/2 headers). It reads `Authorization: Bearer
//! <token>`, puts the caller's [`Principal`] into the request's extensions, and answers
//! a request without a valid token itself, in its door's wire format ([`Refusal`]: the
//! one place that says an authentication failure as JSON or as a gRPC status).
//!
//! Health, readiness, the OpenAPI document, and gRPC health and reflection stay outside
//! it: probes and discovery carry no token.

use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::IntoResponse;
use futures::future::{Either, Ready, ready};
use tower::{Layer, Service};

use crate::auth::{Principal, Principals, Unauthenticated};

/// What a caller is told when it has no valid token.
pub fn message(why: Unauthenticated, hint: &str) -> String {
    match why {
        Unauthenticated::Missing => {
            format!("missing Authorization: Bearer <token> header; {hint}")
        }
        Unauthenticated::NotBearer => {
            format!("the Authorization header must use the Bearer scheme; {hint}")
        }
        Unauthenticated::InvalidToken => format!("the bearer token is not valid; {hint}"),
    }
}

/// The caller's principal, from its one `Authorization` header.
pub fn authenticate(
    principals: &Principals,
    headers: &HeaderMap,
) -> Result<Principal, Unauthenticated> {
    let values: Vec<&HeaderValue> = headers.get_all(header::AUTHORIZATION).iter().collect();
    let header = match values.as_slice() {
        [] => None,
        // A non-UTF-8 or repeated header is a credential that cannot be right.
        [one] => Some(one.to_str().unwrap_or_default()),
        _ => Some(""),
    };
    principals.authenticate_header(header)
}

/// How a door answers a request that is not authenticated.
pub trait Refusal<B>: Clone + Send + Sync + 'static {
    fn refuse(&self, why: Unauthenticated, hint: &'static str) -> axum::http::Response<B>;
}

/// `/v1` and `/mcp`: 401 with the JSON error body and a `WWW-Authenticate` challenge.
#[derive(Debug, Clone, Copy)]
pub struct JsonRefusal;

impl Refusal<axum::body::Body> for JsonRefusal {
    fn refuse(
        &self,
        why: Unauthenticated,
        hint: &'static str,
    ) -> axum::http::Response<axum::body::Body> {
        crate::http_api::ApiError::unauthenticated(why, hint).into_response()
    }
}

/// gRPC: a trailers-only `UNAUTHENTICATED` status.
#[derive(Debug, Clone, Copy)]
pub struct GrpcRefusal;

impl Refusal<tonic::body::Body> for GrpcRefusal {
    fn refuse(
        &self,
        why: Unauthenticated,
        hint: &'static str,
    ) -> axum::http::Response<tonic::body::Body> {
        tonic::Status::unauthenticated(message(why, hint)).into_http()
    }
}

/// Authenticates every request of the service it wraps.
#[derive(Clone)]
pub struct AuthLayer<R> {
    principals: Arc<Principals>,
    refusal: R,
}

impl<R> AuthLayer<R> {
    pub fn new(principals: Arc<Principals>, refusal: R) -> Self {
        Self {
            principals,
            refusal,
        }
    }
}

impl<S, R: Clone> Layer<S> for AuthLayer<R> {
    type Service = Authenticated<S, R>;

    fn layer(&self, inner: S) -> Self::Service {
        Authenticated {
            inner,
            principals: self.principals.clone(),
            refusal: self.refusal.clone(),
        }
    }
}

/// A service whose requests all carry an authenticated [`Principal`].
#[derive(Clone)]
pub struct Authenticated<S, R> {
    inner: S,
    principals: Arc<Principals>,
    refusal: R,
}

impl<S, R, ReqBody, ResBody> Service<axum::http::Request<ReqBody>> for Authenticated<S, R>
where
    S: Service<axum::http::Request<ReqBody>, Response = axum::http::Response<ResBody>>,
    R: Refusal<ResBody>,
{
    type Response = axum::http::Response<ResBody>;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<Self::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: axum::http::Request<ReqBody>) -> Self::Future {
        let stage = airlock_telemetry::Stage::current("gate.auth");
        let authenticated = authenticate(&self.principals, request.headers());
        stage.end(authenticated.is_err());
        match authenticated {
            Ok(principal) => {
                request.extensions_mut().insert(principal);
                Either::Left(self.inner.call(request))
            }
            Err(why) => Either::Right(ready(Ok(self
                .refusal
                .refuse(why, self.principals.token_hint())))),
        }
    }
}

/// tonic routes by the wrapped service's name.
impl<S: tonic::server::NamedService, R> tonic::server::NamedService for Authenticated<S, R> {
    const NAME: &'static str = S::NAME;
}
