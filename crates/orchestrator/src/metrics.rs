//! The orchestrator's Prometheus series (DESIGN §13), served on `GET /metrics`.
//!
//! Every label value comes from a bounded set: a tool name the catalog serves (a name
//! no worker serves is counted as `unknown`, so a caller cannot grow the series), a
//! call status, a gate stage, a store operation, a refusal reason, a worker group and
//! a replica state. No call id, principal, session or path is ever a label.

use std::sync::Arc;
use std::time::Duration;

use airlock_metrics::{
    Counter, EncodeLabelSet, Family, Gauge, Histogram, LatencyFamily, Registry, latency_family,
};
use airlock_policy::CallStatus;

/// The `tool` label of a call whose tool the catalog does not serve.
pub const UNKNOWN_TOOL: &str = "unknown";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub tool: String,
    pub status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolLabel {
    pub tool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabel {
    pub stage: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabel {
    pub operation: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaLabels {
    pub group: String,
    pub state: &'static str,
}

/// Why a call was refused before policy, for `airlock_refusals_total{reason}`.
#[derive(Debug, Clone, Copy)]
pub enum Refusal {
    /// A session budget (`[budgets]`), or a repeated failing call.
    Budget,
    /// The principal's per-minute rate (`[budgets] rate_per_minute`).
    RateLimit,
}

impl Refusal {
    fn as_str(self) -> &'static str {
        match self {
            Self::Budget => "budget",
            Self::RateLimit => "rate_limit",
        }
    }
}

/// The replica states `airlock_worker_replicas` reports, each always present so that
/// a state with no replica reads 0 rather than vanishing.
pub const REPLICA_STATES: &[&str] = &["serving", "unknown", "draining", "down"];

/// Buckets of the approval wait: 1 s to about 9 h, doubling (humans decide in minutes).
fn approval_wait_buckets() -> impl Iterator<Item = f64> {
    prometheus_buckets(1.0, 16)
}

fn prometheus_buckets(start: f64, length: u16) -> impl Iterator<Item = f64> {
    (0..length).map(move |i| start * 2f64.powi(i32::from(i)))
}

/// The registry and its series; one per orchestrator process.
pub struct Metrics {
    registry: Registry,
    calls: Family<CallLabels, Counter>,
    call_duration: LatencyFamily<ToolLabel>,
    stage_duration: LatencyFamily<StageLabel>,
    approval_wait: Histogram,
    store_duration: LatencyFamily<OperationLabel>,
    in_flight: Gauge,
    cache_hits: Family<ToolLabel, Counter>,
    refusals: Family<ReasonLabel, Counter>,
    pending_approvals: Gauge,
    replicas: Family<ReplicaLabels, Gauge>,
    audit_ok: Gauge,
    audit_records: Gauge,
    audit_verified_at: Gauge,
    /// `[audit] export`: the OTLP logs stream of the audit log.
    pub audit_export: AuditExportMetrics,
}

/// The series of `[audit] export`; all zero when it is off.
#[derive(Clone, Debug, Default)]
pub struct AuditExportMetrics {
    /// Records the collector accepted.
    pub exported: Counter,
    /// Export attempts that failed (each is retried; the log keeps the records).
    pub failures: Counter,
    /// Records read from the log and not yet accepted (at most `[audit]
    /// export.max_queue`: past it the exporter stops reading ahead).
    pub queued: Gauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = airlock_metrics::registry();
        let calls = Family::<CallLabels, Counter>::default();
        registry.register(
            "airlock_tool_calls",
            "Tool calls that ended, by tool and status (ok, error, denied, timeout, cancelled)",
            calls.clone(),
        );
        let call_duration = latency_family::<ToolLabel>();
        registry.register(
            "airlock_tool_call_duration_seconds",
            "Time a call took in the gate and its worker, without its wait for approval",
            call_duration.clone(),
        );
        let stage_duration = latency_family::<StageLabel>();
        registry.register(
            "airlock_gate_stage_duration_seconds",
            "Time spent in each stage of the gate (admission, validate, budget, policy, cache, claim, dispatch, record)",
            stage_duration.clone(),
        );
        let approval_wait = Histogram::new(approval_wait_buckets());
        registry.register(
            "airlock_approval_wait_seconds",
            "How long calls held for approval waited for a decision",
            approval_wait.clone(),
        );
        let store_duration = latency_family::<OperationLabel>();
        registry.register(
            "airlock_store_operation_duration_seconds",
            "Latency of the store's writes on a call's path",
            store_duration.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "airlock_calls_in_flight",
            "Calls this orchestrator replica has accepted and not yet ended (held ones included)",
            in_flight.clone(),
        );
        let cache_hits = Family::<ToolLabel, Counter>::default();
        registry.register(
            "airlock_cache_hits",
            "Read-only calls answered from the result cache",
            cache_hits.clone(),
        );
        let refusals = Family::<ReasonLabel, Counter>::default();
        // Known label values start at 0, so that a rate over the first refusal is seen.
        for refusal in [Refusal::Budget, Refusal::RateLimit] {
            refusals.get_or_create_owned(&ReasonLabel {
                reason: refusal.as_str(),
            });
        }
        registry.register(
            "airlock_refusals",
            "Calls refused by a session budget (budget) or a principal's rate (rate_limit)",
            refusals.clone(),
        );
        let pending_approvals = Gauge::default();
        registry.register(
            "airlock_pending_approvals",
            "Approvals waiting for a decision, in the store (every replica reports the same)",
            pending_approvals.clone(),
        );
        let replicas = Family::<ReplicaLabels, Gauge>::default();
        registry.register(
            "airlock_worker_replicas",
            "Worker replicas this orchestrator sees, by group and state",
            replicas.clone(),
        );
        let audit_ok = Gauge::default();
        registry.register(
            "airlock_audit_verify_ok",
            "1 when the last check of the audit log's hash chain passed, 0 when it failed",
            audit_ok.clone(),
        );
        let audit_records = Gauge::default();
        registry.register(
            "airlock_audit_records",
            "Audit records the last chain check read",
            audit_records.clone(),
        );
        let audit_verified_at = Gauge::default();
        registry.register(
            "airlock_audit_verify_timestamp_seconds",
            "When the audit log's hash chain was last checked (Unix time)",
            audit_verified_at.clone(),
        );
        let audit_export = AuditExportMetrics::default();
        registry.register(
            "airlock_audit_exported",
            "Audit records the [audit] export collector accepted",
            audit_export.exported.clone(),
        );
        registry.register(
            "airlock_audit_export_failures",
            "Attempts to send audit records to the [audit] export collector that failed",
            audit_export.failures.clone(),
        );
        registry.register(
            "airlock_audit_export_queue",
            "Audit records read from the log and waiting to be sent to the [audit] export collector",
            audit_export.queued.clone(),
        );
        Self {
            audit_export,
            registry,
            calls,
            call_duration,
            stage_duration,
            approval_wait,
            store_duration,
            in_flight,
            cache_hits,
            refusals,
            pending_approvals,
            replicas,
            audit_ok,
            audit_records,
            audit_verified_at,
        }
    }

    /// The verdict of a check of the audit chain.
    pub fn audit_verified(&self, ok: bool, records: u64) {
        self.audit_ok.set(i64::from(ok));
        self.audit_records
            .set(i64::try_from(records).unwrap_or(i64::MAX));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.audit_verified_at
            .set(i64::try_from(now).unwrap_or(i64::MAX));
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// A call ended.
    pub fn call_ended(&self, tool: &str, status: CallStatus, duration: Duration) {
        self.calls
            .get_or_create(&CallLabels {
                tool: tool.to_owned(),
                status: status.as_str(),
            })
            .inc();
        self.call_duration
            .get_or_create(&ToolLabel {
                tool: tool.to_owned(),
            })
            .observe(duration.as_secs_f64());
    }

    pub fn stage(&self, stage: &'static str, took: Duration) {
        self.stage_duration
            .get_or_create(&StageLabel { stage })
            .observe(took.as_secs_f64());
    }

    pub fn approval_waited(&self, waited: Duration) {
        self.approval_wait.observe(waited.as_secs_f64());
    }

    pub fn store(&self, operation: &'static str, took: Duration) {
        self.store_duration
            .get_or_create(&OperationLabel { operation })
            .observe(took.as_secs_f64());
    }

    pub fn cache_hit(&self, tool: &str) {
        self.cache_hits
            .get_or_create(&ToolLabel {
                tool: tool.to_owned(),
            })
            .inc();
    }

    /// Serves `airlock_cache_hits_total{tool}` at 0 for a tool with a cache.
    pub fn cached_tool(&self, tool: &str) {
        self.cache_hits.get_or_create_owned(&ToolLabel {
            tool: tool.to_owned(),
        });
    }

    pub fn refused(&self, refusal: Refusal) {
        self.refusals
            .get_or_create(&ReasonLabel {
                reason: refusal.as_str(),
            })
            .inc();
    }

    /// Counts a call in flight until the guard drops.
    pub fn in_flight(self: &Arc<Self>) -> InFlight {
        self.in_flight.inc();
        InFlight(self.clone())
    }

    pub fn set_pending_approvals(&self, pending: u64) {
        self.pending_approvals
            .set(i64::try_from(pending).unwrap_or(i64::MAX));
    }

    /// Sets every (group, state) of `airlock_worker_replicas` from each group's replica
    /// states, zero for the states no replica of a group is in.
    pub fn set_replicas<'a>(&self, groups: impl IntoIterator<Item = (&'a str, Vec<&'a str>)>) {
        for (group, states) in groups {
            for state in REPLICA_STATES {
                let count = states.iter().filter(|s| *s == state).count();
                self.replicas
                    .get_or_create(&ReplicaLabels {
                        group: group.to_owned(),
                        state,
                    })
                    .set(i64::try_from(count).unwrap_or(i64::MAX));
            }
        }
    }

    pub fn render(&self) -> String {
        airlock_metrics::render(&self.registry)
    }
}

/// A call counted in `airlock_calls_in_flight`.
pub struct InFlight(Arc<Metrics>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pinned_series_are_there_with_bounded_labels() {
        let metrics = Arc::new(Metrics::new());
        metrics.call_ended("read_file", CallStatus::Ok, Duration::from_millis(3));
        metrics.call_ended(UNKNOWN_TOOL, CallStatus::Error, Duration::ZERO);
        metrics.set_replicas([("fs", vec!["serving", "serving", "down"])]);
        metrics.set_pending_approvals(2);
        metrics.refused(Refusal::RateLimit);
        let guard = metrics.in_flight();
        let text = metrics.render();
        drop(guard);
        for line in [
            "airlock_tool_calls_total{tool=\"read_file\",status=\"ok\"} 1",
            "airlock_tool_calls_total{tool=\"unknown\",status=\"error\"} 1",
            "airlock_worker_replicas{group=\"fs\",state=\"serving\"} 2",
            "airlock_worker_replicas{group=\"fs\",state=\"down\"} 1",
            "airlock_worker_replicas{group=\"fs\",state=\"draining\"} 0",
            "airlock_pending_approvals 2",
            "airlock_refusals_total{reason=\"rate_limit\"} 1",
            "airlock_calls_in_flight 1",
            "# TYPE airlock_tool_call_duration_seconds histogram",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(metrics.render().contains("airlock_calls_in_flight 0"));
    }
}
