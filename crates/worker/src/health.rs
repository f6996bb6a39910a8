//! `grpc.health.v1` as a worker serves it: tonic's health service, except that a worker
//! that drains ends every `Watch` stream once it has said NOT_SERVING.
//!
//! The orchestrator holds one `Watch` per replica open for as long as the replica
//! lives; tonic's own streams never end, so a draining worker's graceful shutdown would
//! wait for them until the drain grace ran out. Ending them is also the orchestrator's
//! cue: the replica is going away, new calls go elsewhere.

use std::pin::Pin;

use futures::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_health::server::{HealthReporter, HealthService};

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

/// The health service, with the token that marks the worker draining.
pub(crate) struct DrainingHealth {
    inner: HealthService,
    draining: CancellationToken,
}

impl DrainingHealth {
    pub(crate) fn server(
        reporter: &HealthReporter,
        draining: CancellationToken,
    ) -> HealthServer<Self> {
        HealthServer::new(Self {
            inner: HealthService::from_health_reporter(reporter.clone()),
            draining,
        })
    }
}

fn not_serving() -> HealthCheckResponse {
    HealthCheckResponse {
        status: ServingStatus::NotServing as i32,
    }
}

#[tonic::async_trait]
impl Health for DrainingHealth {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.inner.check(request).await
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let mut statuses = self.inner.watch(request).await?.into_inner();
        let draining = self.draining.clone();
        let stream = async_stream::stream! {
            loop {
                tokio::select! {
                    // A status change already sent goes out before the stream ends.
                    biased;
                    next = statuses.next() => match next {
                        Some(item) => yield item,
                        None => return,
                    },
                    _ = draining.cancelled() => {
                        yield Ok(not_serving());
                        return;
                    }
                }
            }
        };
        Ok(Response::new(Box::pin(stream)))
    }
}
