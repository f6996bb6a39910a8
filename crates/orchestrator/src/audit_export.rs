//! `[audit] export`: the audit log as a stream of OTLP log records, for a collector
//! that forwards it to the SIEM.
//!
//! A task of its own follows the log in the store (as `airlock audit tail --follow`
//! does) and sends each new record, in `seq` order, with its `seq`, `prev_hash` and
//! `hash`, so that the SIEM can check the chain. Nothing on a call's path waits for it:
//! calls append to the store as always, and the exporter reads behind them.
//!
//! Delivery is at least once and survives restarts: the store keeps, per destination
//! (protocol and endpoint), the `seq` of the last record its collector accepted, and a
//! restarted exporter resumes after it. The first time a destination is exported to,
//! it starts after the record that is last then (what came before is read from the log
//! itself: `GET /v1/audit`, `airlock audit tail`).
//! A crash between a send and the cursor's write resends that one batch; `seq` tells
//! duplicates apart.
//!
//! A collector that is down or refuses is retried with backoff (each failed attempt is
//! logged when the failing starts and counted in `airlock_audit_export_failures_total`);
//! meanwhile the exporter reads ahead into a queue of at most `max_queue` records — one
//! page of the log, so also at most `AuditQuery::PAGE_BYTES` of their data (records
//! carry calls' arguments, up to megabytes each) — and then stops reading until the
//! queue is sent: the log is the buffer, so nothing is dropped, and memory stays
//! bounded however long the collector is away. Once it is back, or whenever more than
//! a page waits (a burst, a first start after a long stop), the exporter reads the next
//! page as soon as the last one is sent, rather than a page per poll interval.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use airlock_telemetry::logs::{Attribute, LogsClient, Record};
use tokio_util::sync::CancellationToken;

use crate::audit::{AuditQuery, AuditRecord};
use crate::config::AuditExportConfig;
use crate::metrics::AuditExportMetrics;
use crate::store::{Store, StoreError, now_millis};

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
    /// The key of this destination's cursor in the store: protocol and endpoint.
    destination: String,
    max_queue: usize,
    metrics: AuditExportMetrics,
}

/// Where the exporter is in the log: read up to `read_to`, of which the records after
/// the last delivered one wait in `queue`.
struct Follow {
    read_to: u64,
    queue: VecDeque<(u64, Record)>,
    backoff: Backoff,
}

impl Follow {
    /// Nothing queued yet, the collector not yet failing.
    fn after(read_to: u64) -> Self {
        Self {
            read_to,
            queue: VecDeque::new(),
            backoff: Backoff::default(),
        }
    }
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
            destination: format!(
                "{} {}",
                protocol.as_str(),
                config.endpoint.trim().trim_end_matches('/')
            ),
            max_queue: config.max_queue,
            metrics,
        })
    }

    /// Follows the log after `read_to` (from [`AuditExporter::start`]) until `stop`;
    /// what is queued then is sent once more.
    pub async fn run(self, store: Arc<dyn Store>, read_to: u64, stop: CancellationToken) {
        let mut follow = Follow::after(read_to);
        loop {
            let stopping = stop.is_cancelled();
            let behind = self.poll(store.as_ref(), &mut follow).await;
            if stopping {
                return;
            }
            if behind {
                // Sent a whole page with more after it: the next one at once, letting
                // the runtime's other tasks run in between.
                tokio::task::yield_now().await;
                continue;
            }
            tokio::select! {
                () = stop.cancelled() => {}
                () = tokio::time::sleep(POLL) => {}
            }
        }
    }

    /// The `seq` to follow from: this destination's cursor, or the end of the log the
    /// first time (recorded at once, so that a restart before the first delivery does
    /// not skip what was appended meanwhile).
    pub async fn start(&self, store: &dyn Store) -> Result<u64, StoreError> {
        if let Some(seq) = store.export_cursor(&self.destination).await? {
            return Ok(seq);
        }
        let seq = last_seq(store).await?;
        store
            .advance_export_cursor(&self.destination, seq, now_millis())
            .await?;
        Ok(seq)
    }

    /// Reads what fits in the queue, sends it when the backoff allows, and records how
    /// far the collector has accepted. Whether it is behind: it sent a whole page and
    /// the log has more after it, so the next poll should not wait. Never while the
    /// collector fails, whose retries the backoff paces.
    async fn poll(&self, store: &dyn Store, follow: &mut Follow) -> bool {
        // One page at a time: the next is read once the queue is sent, so the queue
        // holds one page's bytes at most, however many polls the collector misses.
        let room = if follow.queue.is_empty() {
            self.max_queue
        } else {
            0
        };
        let mut more = false;
        if room > 0 {
            match store
                .audit_page(AuditQuery {
                    after: Some(follow.read_to),
                    limit: room.min(AuditQuery::MAX_LIMIT),
                    ..AuditQuery::default()
                })
                .await
            {
                Ok(page) => {
                    more = page.more;
                    for record in page.records {
                        follow.read_to = follow.read_to.max(record.seq);
                        follow.queue.push_back((record.seq, log_record(&record)));
                    }
                }
                Err(e) => tracing::warn!(error = %e, "[audit] export cannot read the audit log"),
            }
        }
        if follow.backoff.due()
            && let Some(delivered) = self
                .send_queued(&mut follow.queue, &mut follow.backoff)
                .await
            && let Err(e) = store
                .advance_export_cursor(&self.destination, delivered, now_millis())
                .await
        {
            // The records are delivered; a restart before the next write resends them.
            tracing::warn!(error = %e, "[audit] export cannot record how far it has sent");
        }
        self.metrics
            .queued
            .set(i64::try_from(follow.queue.len()).unwrap_or(i64::MAX));
        more && follow.queue.is_empty()
    }

    /// Sends the queue in batches, oldest first, until it is empty or a batch fails;
    /// the `seq` of the last record accepted, if any was.
    async fn send_queued(
        &self,
        queue: &mut VecDeque<(u64, Record)>,
        backoff: &mut Backoff,
    ) -> Option<u64> {
        let mut delivered = None;
        while !queue.is_empty() {
            let batch: Vec<Record> = queue
                .iter()
                .take(BATCH)
                .map(|(_, record)| record.clone())
                .collect();
            match self.client.send(&batch).await {
                Ok(()) => {
                    delivered = queue.drain(..batch.len()).next_back().map(|(seq, _)| seq);
                    self.metrics.exported.inc_by(batch.len() as u64);
                    if backoff.failing() {
                        tracing::info!("[audit] export: the collector accepts records again");
                    }
                    backoff.reset();
                }
                Err(e) => {
                    self.metrics.failures.inc();
                    if !backoff.failing() {
                        tracing::warn!(error = %e, queued = queue.len(), max_queue = self.max_queue, "[audit] export: cannot send audit records; retrying with backoff (calls go on; the log keeps the records until the collector takes them)");
                    }
                    backoff.failed();
                    break;
                }
            }
        }
        delivered
    }
}

/// The `seq` of the last record in the log (0 when it is empty).
async fn last_seq(store: &dyn Store) -> Result<u64, StoreError> {
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
    use crate::audit::NewAuditEvent;
    use serde_json::json;

    /// A SQLite store in a directory of its own (kept alive by the returned guard).
    async fn temp_store() -> (tempfile::TempDir, Arc<dyn Store>) {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::open_sqlite_file(&dir.path().join("airlock.db"))
            .await
            .unwrap();
        (dir, store)
    }

    /// Appends `n` `requested` events.
    async fn append(store: &dyn Store, n: u64) {
        for i in 0..n {
            store
                .append(NewAuditEvent::new(
                    crate::audit::AuditKind::Requested,
                    json!({ "i": i }),
                ))
                .await
                .unwrap();
        }
    }

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

    /// With the collector down, the exporter reads no further than its queue holds,
    /// drops nothing, and keeps its cursor where the collector last accepted; a new
    /// exporter for the same destination starts there, one for another at the log's end.
    #[tokio::test]
    async fn a_collector_that_is_down_holds_the_cursor_and_nothing_is_dropped() {
        let (_dir, store) = temp_store().await;
        append(store.as_ref(), 3).await;
        let config = |endpoint: &str| AuditExportConfig {
            endpoint: endpoint.into(),
            protocol: "http/protobuf".into(),
            max_queue: 2,
            timeout_ms: 200,
        };
        let metrics = AuditExportMetrics::default();
        let exporter = AuditExporter::new(&config("http://127.0.0.1:9"), metrics.clone()).unwrap();
        // First time: from the log's end, recorded at once.
        let start = exporter.start(store.as_ref()).await.unwrap();
        assert_eq!(start, 3);
        assert_eq!(
            store
                .export_cursor("http/protobuf http://127.0.0.1:9")
                .await
                .unwrap(),
            Some(3)
        );
        append(store.as_ref(), 5).await;
        let mut follow = Follow::after(start);
        for _ in 0..3 {
            follow.backoff = Backoff::default();
            assert!(
                !exporter.poll(store.as_ref(), &mut follow).await,
                "a failing collector is retried at the backoff's pace, not at once"
            );
        }
        let queued: Vec<u64> = follow.queue.iter().map(|(seq, _)| *seq).collect();
        assert_eq!(queued, vec![4, 5], "read only as far as the queue holds");
        assert_eq!(follow.read_to, 5);
        assert_eq!(metrics.failures.get(), 3);
        assert_eq!(metrics.exported.get(), 0);
        assert_eq!(metrics.queued.get(), 2);
        // A restart resumes after the last record the collector accepted.
        let again = AuditExporter::new(&config("http://127.0.0.1:9/"), metrics.clone()).unwrap();
        assert_eq!(again.start(store.as_ref()).await.unwrap(), 3);
        // The cursor never moves back; another destination has its own.
        store
            .advance_export_cursor("http/protobuf http://127.0.0.1:9", 2, now_millis())
            .await
            .unwrap();
        assert_eq!(again.start(store.as_ref()).await.unwrap(), 3);
        let other = AuditExporter::new(&config("http://127.0.0.1:10"), metrics).unwrap();
        assert_eq!(other.start(store.as_ref()).await.unwrap(), 8);
    }

    /// With more in the log than a page, the exporter reads the next page as soon as it
    /// has sent one (`poll` says it is behind) and stops saying so at the log's end:
    /// every record is delivered, in pages, and the cursor follows.
    #[tokio::test]
    async fn a_backlog_is_sent_page_after_page_without_waiting() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (_dir, store) = temp_store().await;
        let requests = Arc::new(AtomicUsize::new(0));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let counted = requests.clone();
        let collector = axum::Router::new().route(
            "/v1/logs",
            axum::routing::post(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                async { axum::http::StatusCode::OK }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, collector).await });
        let endpoint = format!("http://{address}");
        let config = AuditExportConfig {
            endpoint: endpoint.clone(),
            protocol: "http/protobuf".into(),
            max_queue: 2,
            timeout_ms: 5_000,
        };
        let metrics = AuditExportMetrics::default();
        let exporter = AuditExporter::new(&config, metrics.clone()).unwrap();
        let start = exporter.start(store.as_ref()).await.unwrap();
        assert_eq!(start, 0);
        append(store.as_ref(), 5).await;
        let mut follow = Follow::after(start);
        let mut behind = Vec::new();
        for _ in 0..4 {
            behind.push(exporter.poll(store.as_ref(), &mut follow).await);
        }
        assert_eq!(
            behind,
            vec![true, true, false, false],
            "pages of 2, 2 and 1 record, then nothing to read"
        );
        assert_eq!(requests.load(Ordering::SeqCst), 3);
        assert_eq!(metrics.exported.get(), 5);
        assert_eq!(
            store
                .export_cursor(&format!("http/protobuf {endpoint}"))
                .await
                .unwrap(),
            Some(5)
        );
        assert!(follow.queue.is_empty());
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
