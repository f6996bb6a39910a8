//! Prometheus metrics shared by every Airlock component (DESIGN §13): a registry that
//! always carries the process metrics, the text exposition of it, and the `/metrics`
//! listener a worker serves on `--metrics-listen`.
//!
//! Label sets are bounded by construction: the components label by tool name (from
//! their catalog, never from a caller), status, stage, group or reason — never by call
//! id, principal, session or path.

mod process;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

pub use prometheus_client::encoding::EncodeLabelSet;
pub use prometheus_client::metrics::counter::Counter;
pub use prometheus_client::metrics::family::Family;
pub use prometheus_client::metrics::gauge::Gauge;
pub use prometheus_client::metrics::histogram::Histogram;
pub use prometheus_client::registry::Registry;

/// The Prometheus text format (0.0.4), which every Prometheus and `promtool check
/// metrics` reads.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot bind the metrics listener on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("the metrics listener failed: {0}")]
    Serve(std::io::Error),
}

/// A registry with the standard `process_*` series (CPU, memory, descriptors, start
/// time) already in it.
pub fn registry() -> Registry {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(process::ProcessCollector));
    registry
}

/// The registry in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut text = String::new();
    // Writing to a String cannot fail; a metric that cannot encode leaves what was
    // written so far, which Prometheus rejects loudly rather than reading wrong values.
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut text, registry) {
        tracing::error!(error = %e, "cannot encode the metrics");
    }
    text
}

/// Buckets of a latency histogram in seconds: 1 ms to about 65 s, doubling.
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 17)
}

/// A histogram over [`latency_buckets`].
pub fn latency_histogram() -> Histogram {
    Histogram::new(latency_buckets())
}

/// A family of latency histograms, one per label set.
pub type LatencyFamily<S> = Family<S, Histogram, fn() -> Histogram>;

pub fn latency_family<S: Clone + std::hash::Hash + Eq>() -> LatencyFamily<S> {
    Family::new_with_constructor(latency_histogram as fn() -> Histogram)
}

/// A worker's `/metrics` socket, bound before the process confines itself (like its
/// gRPC listener) and served once its runtime runs.
#[derive(Debug)]
pub struct MetricsListener(std::net::TcpListener);

impl MetricsListener {
    pub fn bind(addr: &str) -> Result<Self, MetricsError> {
        let bind_err = |source| MetricsError::Bind {
            addr: addr.to_owned(),
            source,
        };
        let listener = std::net::TcpListener::bind(addr).map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        Ok(Self(listener))
    }

    /// The address actually bound (port 0 resolved).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.0.local_addr().ok()
    }

    /// Serves `GET /metrics` (and nothing else) until `shutdown` resolves.
    pub async fn serve(
        self,
        registry: Arc<Registry>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), MetricsError> {
        let listener = tokio::net::TcpListener::from_std(self.0).map_err(MetricsError::Serve)?;
        let router = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let registry = registry.clone();
                async move { exposition(&registry) }
            }),
        );
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(MetricsError::Serve)
    }
}

/// The answer to a scrape: the registry as text, with its content type.
pub fn exposition(registry: &Registry) -> impl axum::response::IntoResponse + use<> {
    (
        [(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)],
        render(registry),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct Labels {
        tool: String,
        status: &'static str,
    }

    #[test]
    fn counters_and_histograms_render_in_the_text_format() {
        let mut registry = registry();
        let calls = Family::<Labels, Counter>::default();
        let latency = latency_family::<Labels>();
        registry.register("airlock_tool_calls", "Tool calls", calls.clone());
        registry.register(
            "airlock_tool_call_duration_seconds",
            "Latency",
            latency.clone(),
        );
        let labels = Labels {
            tool: "read_file".into(),
            status: "ok",
        };
        calls.get_or_create(&labels).inc();
        latency.get_or_create(&labels).observe(0.003);
        let text = render(&registry);
        assert!(
            text.contains("airlock_tool_calls_total{tool=\"read_file\",status=\"ok\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "airlock_tool_call_duration_seconds_bucket{le=\"0.004\",tool=\"read_file\",status=\"ok\"} 1"
            ) || text.contains(
                "airlock_tool_call_duration_seconds_bucket{tool=\"read_file\",status=\"ok\",le=\"0.004\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("process_resident_memory_bytes "), "{text}");
        assert!(text.contains("process_open_fds "), "{text}");
        assert!(
            !text.contains("# EOF"),
            "the 0.0.4 text format has no EOF line"
        );
    }

    #[tokio::test]
    async fn a_listener_serves_metrics_and_nothing_else() {
        let listener = MetricsListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(listener.serve(Arc::new(registry()), async {
            let _ = stopped.await;
        }));
        let get = |path: &'static str| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            tcp.write_all(request.as_bytes()).await.unwrap();
            let mut answer = String::new();
            tcp.read_to_string(&mut answer).await.unwrap();
            answer
        };
        let metrics = get("/metrics").await;
        assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
        assert!(metrics.contains("text/plain; version=0.0.4"), "{metrics}");
        assert!(metrics.contains("process_cpu_seconds_total"), "{metrics}");
        assert!(get("/").await.starts_with("HTTP/1.1 404"));
        stop.send(()).unwrap();
        served.await.unwrap().unwrap();
    }
}
