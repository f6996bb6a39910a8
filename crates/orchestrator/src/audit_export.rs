//! `[audit] export`: the audit log as a stream of OTLP log records, for a collector
//! that forwards it to the SIEM.
//!
//! A task of its own follows the log in the store (as `airlock audit tail --follow`
//! does) from the record that was last when the orchestrator started, and sends each
//! new record, in `seq` order, with its `seq`, `prev_hash` and `hash`, so that the SIEM
//! can check the chain. Nothing on a call's path waits for it: calls append to the
//! store as always, and the exporter reads behind them.
//!
//! A collector that is down or refuses is retried with backoff (each failed attempt is
//! logged when the failing starts and counted in `airlock_audit_export_failures_total`);
//! meanwhile the exporter keeps reading into a queue of at most `max_queue` records,
//! past which the oldest are dropped and counted (`airlock_audit_export_dropped_total`).
//! The records stay in the audit log itself either way.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use airlock_telemetry::logs::{Attribute, LogsClient, Record};
use tokio_util::sync::CancellationToken;

use crate::audit::{AuditQuery, AuditRecord};
use crate::config::AuditExportConfig;
use crate::metrics::AuditExportMetrics;
use crate::store::Store;

/// How often the log is read for new records.
const POLL: Duration = Duration::from_millis(200);
/// Records per OTLP request.
const BATCH: usize = 256;
/// The longest wait between attempts while the collector fails.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum AuditExportError {
    #[error("[audit] export: {0}")]
    Setup(#[from] airlock_telemetry::TelemetryError),
    #[error("[audit] export.max_queue must be at least 1")]
    EmptyQueue,
}

/// The exporter, built at start (a bad setting stops the start, naming it).
pub struct AuditExporter {
    client: LogsClient,
    max_queue: usize,
    metrics: AuditExportMetrics,
}

impl AuditExporter {
    /// Needs the async runtime (a gRPC channel starts on it).
    pub fn new(
        config: &AuditExportConfig,
        metrics: AuditExportMetrics,
    ) -> Result<Self, AuditExportError> {
        if config.max_queue == 0 {
            return Err(AuditExportError::EmptyQueue);
        }
        let protocol =
            airlock_telemetry::Protocol::parse("[audit] export.protocol", &config.protocol)?;
        let service = std::env::var("OTEL_SERVICE_NAME")
            .ok()
            .filter(|v| !v.trim().is_empty())
            .unwrap_or_else(|| "airlock-orchestrator".to_owned());
        let client = LogsClient::new(
            &config.endpoint,
            protocol,
            Duration::from_millis(config.timeout_ms.max(1)),
            &service,
            "airlock.audit",
        )?;
        Ok(Self {
            client,
            max_queue: config.max_queue,
            metrics,
        })
    }

    /// Follows the log until `stop`; what is queued then is sent once more.
    pub async fn run(self, store: Arc<dyn Store>, stop: CancellationToken) {
        let mut cursor = loop {
            match last_seq(store.as_ref()).await {
                Ok(seq) => break seq,
                Err(e) => {
                    tracing::warn!(error = %e, "[audit] export cannot read the audit log; trying again");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(POLL * 5) => {}
                    }
                }
            }
        };
        let mut queue: VecDeque<Record> = VecDeque::new();
        let mut backoff = Backoff::default();
        loop {
            let stopping = stop.is_cancelled();
            match store
                .audit(AuditQuery {
                    after: Some(cursor),
                    limit: AuditQuery::MAX_LIMIT,
                    ..AuditQuery::default()
                })
                .await
            {
                Ok(records) => {
                    for record in records {
                        cursor = cursor.max(record.seq);
                        self.enqueue(&mut queue, record);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "[audit] export cannot read the audit log"),
            }
            if backoff.due() {
                self.send_queued(&mut queue, &mut backoff).await;
            }
            self.set_queued(&queue);
            if stopping {
                return;
            }
            tokio::select! {
                () = stop.cancelled() => {}
                () = tokio::time::sleep(POLL) => {}
            }
        }
    }

    fn enqueue(&self, queue: &mut VecDeque<Record>, record: AuditRecord) {
        if queue.len() >= self.max_queue {
            queue.pop_front();
            self.metrics.dropped.inc();
        }
        queue.push_back(log_record(&record));
    }

    /// Sends the queue in batches, oldest first, until it is empty or a batch fails.
    async fn send_queued(&self, queue: &mut VecDeque<Record>, backoff: &mut Backoff) {
        while !queue.is_empty() {
            let batch: Vec<Record> = queue.iter().take(BATCH).cloned().collect();
            match self.client.send(&batch).await {
                Ok(()) => {
                    queue.drain(..batch.len());
                    self.metrics.exported.inc_by(batch.len() as u64);
                    if backoff.failing() {
                        tracing::info!("[audit] export: the collector accepts records again");
                    }
                    backoff.reset();
                }
                Err(e) => {
                    self.metrics.failures.inc();
                    if !backoff.failing() {
                        tracing::warn!(error = %e, queued = queue.len(), max_queue = self.max_queue, "[audit] export: cannot send audit records; retrying with backoff (calls go on; the queue drops its oldest records when full)");
                    }
                    backoff.failed();
                    return;
                }
            }
        }
    }

    fn set_queued(&self, queue: &VecDeque<Record>) {
        self.metrics
            .queued
            .set(i64::try_from(queue.len()).unwrap_or(i64::MAX));
    }
}

/// The `seq` of the last record in the log (0 when it is empty).
async fn last_seq(store: &dyn Store) -> Result<u64, crate::store::StoreError> {
    let last = store
        .audit(AuditQuery {
            limit: 1,
            latest: true,
            ..AuditQuery::default()
        })
        .await?;
    Ok(last.last().map_or(0, |r| r.seq))
}

/// One audit record as an OTLP log record: the record's JSON (the `GET /v1/audit` item,
/// so that its hash can be checked) as the body, and what a SIEM filters on as
/// attributes.
fn log_record(record: &AuditRecord) -> Record {
    let time_unix_nano = chrono::DateTime::parse_from_rfc3339(&record.ts)
        .ok()
        .and_then(|t| t.timestamp_nanos_opt())
        .and_then(|n| u64::try_from(n).ok())
        .unwrap_or(0);
    let mut attributes = vec![
        (
            "airlock.audit.seq".to_owned(),
            Attribute::Int(i64::try_from(record.seq).unwrap_or(i64::MAX)),
        ),
        (
            "airlock.audit.kind".to_owned(),
            Attribute::Text(record.kind.clone()),
        ),
        (
            "airlock.audit.hash".to_owned(),
            Attribute::Text(record.hash.clone()),
        ),
        (
            "airlock.audit.prev_hash".to_owned(),
            Attribute::Text(record.prev_hash.clone()),
        ),
    ];
    for (key, value) in [
        ("airlock.call_id", &record.call_id),
        ("enduser.id", &record.principal),
        ("session.id", &record.session_id),
    ] {
        if let Some(value) = value {
            attributes.push((key.to_owned(), Attribute::Text(value.clone())));
        }
    }
    Record {
        time_unix_nano,
        event_name: "airlock.audit".to_owned(),
        body: serde_json::to_string(record).unwrap_or_default(),
        attributes,
    }
}

/// Doubling waits between failed attempts, from one poll up to [`MAX_BACKOFF`].
#[derive(Default)]
struct Backoff {
    wait: Option<Duration>,
    next: Option<tokio::time::Instant>,
}

impl Backoff {
    fn due(&self) -> bool {
        self.next.is_none_or(|at| tokio::time::Instant::now() >= at)
    }

    fn failing(&self) -> bool {
        self.wait.is_some()
    }

    fn failed(&mut self) {
        let wait = self.wait.map_or(POLL * 5, |w| (w * 2).min(MAX_BACKOFF));
        self.wait = Some(wait);
        self.next = Some(tokio::time::Instant::now() + wait);
    }

    fn reset(&mut self) {
        self.wait = None;
        self.next = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(seq: u64) -> AuditRecord {
        AuditRecord {
            seq,
            ts: "2026-05-20T12:34:56.789Z".into(),
            kind: "requested".into(),
            call_id: Some("call_1".into()),
            principal: Some("agent".into()),
            session_id: None,
            data: json!({"tool": "read_file"}),
            prev_hash: "00".repeat(32),
            hash: "ab".repeat(32),
        }
    }

    #[test]
    fn a_log_record_carries_seq_hash_and_the_whole_record() {
        let r = log_record(&record(7));
        assert_eq!(r.time_unix_nano, 1_779_280_496_789_000_000);
        assert!(
            r.attributes
                .contains(&("airlock.audit.seq".into(), Attribute::Int(7)))
        );
        assert!(r.attributes.contains(&(
            "airlock.audit.hash".into(),
            Attribute::Text("ab".repeat(32))
        )));
        assert!(
            r.attributes
                .contains(&("airlock.call_id".into(), Attribute::Text("call_1".into())))
        );
        assert!(!r.attributes.iter().any(|(k, _)| k == "session.id"));
        let body: AuditRecord = serde_json::from_str(&r.body).unwrap();
        assert_eq!(body, record(7));
    }

    #[tokio::test]
    async fn a_full_queue_drops_its_oldest_and_counts_them() {
        let metrics = AuditExportMetrics::default();
        let exporter = AuditExporter::new(
            &AuditExportConfig {
                endpoint: "http://127.0.0.1:9".into(),
                protocol: "http/protobuf".into(),
                max_queue: 2,
                timeout_ms: 100,
            },
            metrics.clone(),
        )
        .unwrap();
        let mut queue = VecDeque::new();
        for seq in 1..=5 {
            exporter.enqueue(&mut queue, record(seq));
        }
        assert_eq!(metrics.dropped.get(), 3);
        let kept: Vec<_> = queue.iter().map(|r| r.attributes[0].1.clone()).collect();
        assert_eq!(kept, vec![Attribute::Int(4), Attribute::Int(5)]);
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        let config = |endpoint: &str, protocol: &str, max_queue| AuditExportConfig {
            endpoint: endpoint.into(),
            protocol: protocol.into(),
            max_queue,
            timeout_ms: 100,
        };
        let e = AuditExporter::new(
            &config("http://127.0.0.1:4318", "http/json", 10),
            AuditExportMetrics::default(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("[audit] export.protocol=\"http/json\""), "{e}");
        let e = AuditExporter::new(
            &config("collector:4318", "grpc", 10),
            AuditExportMetrics::default(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("[audit] export.endpoint"), "{e}");
        let e = AuditExporter::new(
            &config("http://127.0.0.1:4318", "grpc", 0),
            AuditExportMetrics::default(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("max_queue"), "{e}");
    }
}
