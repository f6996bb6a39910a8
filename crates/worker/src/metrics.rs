//! What a worker counts of its calls, served on `--metrics-listen` (DESIGN §13).
//!
//! The names differ from the orchestrator's `airlock_tool_calls_total`, so that a sum
//! over every target never counts a call twice. The `tool` label is a tool this worker
//! serves (an unknown name is refused before it is counted).

use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_metrics::{
    Counter, EncodeLabelSet, Family, Gauge, LatencyFamily, Registry, latency_family,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    tool: String,
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolLabel {
    tool: String,
}

/// The worker's series; cloning shares them.
#[derive(Clone)]
pub struct WorkerMetrics {
    calls: Family<CallLabels, Counter>,
    duration: LatencyFamily<ToolLabel>,
    in_flight: Gauge,
}

impl std::fmt::Debug for WorkerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerMetrics").finish_non_exhaustive()
    }
}

impl Default for WorkerMetrics {
    /// Series that no registry serves: for a worker without a metrics listener.
    fn default() -> Self {
        Self::register(&mut Registry::default())
    }
}

impl WorkerMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let calls = Family::<CallLabels, Counter>::default();
        registry.register(
            "airlock_worker_calls",
            "Calls this worker ran, by tool and status (ok, error, timeout, cancelled)",
            calls.clone(),
        );
        let duration = latency_family::<ToolLabel>();
        registry.register(
            "airlock_worker_call_duration_seconds",
            "Time from a call's arrival at this worker to its answer",
            duration.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "airlock_worker_calls_in_flight",
            "Calls this worker is running now",
            in_flight.clone(),
        );
        Self {
            calls,
            duration,
            in_flight,
        }
    }

    /// Starts counting one call of `tool`; it is in flight until [`CallMeter::ended`]
    /// or until the meter drops.
    pub(crate) fn start(self: &Arc<Self>, tool: &str) -> CallMeter {
        self.in_flight.inc();
        CallMeter {
            metrics: self.clone(),
            tool: tool.to_owned(),
            started: Instant::now(),
        }
    }
}

/// One call being counted.
pub(crate) struct CallMeter {
    metrics: Arc<WorkerMetrics>,
    tool: String,
    started: Instant,
}

impl CallMeter {
    pub fn ended(self, status: &'static str) {
        let took: Duration = self.started.elapsed();
        let tool = self.tool.clone();
        self.metrics
            .duration
            .get_or_create(&ToolLabel { tool: tool.clone() })
            .observe(took.as_secs_f64());
        self.metrics
            .calls
            .get_or_create(&CallLabels { tool, status })
            .inc();
    }
}

impl Drop for CallMeter {
    fn drop(&mut self) {
        self.metrics.in_flight.dec();
    }
}
