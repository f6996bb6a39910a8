//! Group commit for the calls' writes on SQLite ([`Store::write_call`], the one write of a
//! call on the gate's hot path).
//!
//! One thread owns the writing of calls. It takes the first write waiting, then every
//! other write that queued meanwhile (at most [`MAX_BATCH`]), and commits them in one
//! `BEGIN IMMEDIATE … COMMIT`. Each write runs inside a savepoint of its own, so a write
//! that fails (a call id already taken, a claim already lost) is undone alone and
//! answered with its own error, while the others commit. Nobody is answered before the
//! transaction holding their write has committed, so a caller that hears `Ok` holds a
//! durable write, as with one transaction per call; the audit chain stays dense because
//! the writes append to it one after another inside the transaction.
//!
//! What it saves under concurrency: the pages every call writes — the audit log's last
//! leaf and its indexes' last leaves, the chain head, the calls' newest index entries —
//! go into the write-ahead log once per batch instead of once per call, and the
//! `BEGIN`/`COMMIT` pair and the hand-off to a blocking thread are paid once per batch.
//! A lone call is a batch of one: the same single transaction, without a savepoint.
//!
//! The queue is not bounded by this module: every write in it is a call whose task
//! awaits the answer, so it holds at most the calls in flight, which the front doors
//! bound.
//!
//! [`Store::write_call`]: super::super::Store::write_call

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};

use rusqlite::Connection;
use tokio::sync::oneshot;

use super::{ImmediateTx, SqliteTx, drive, execute_cached};
use crate::store::machine;
use crate::store::{CallWrite, StoreError};

/// The most writes one transaction takes: a bound on how long the connection is held
/// (and so how long other store work waits) for one commit.
const MAX_BATCH: usize = 64;

/// A write waiting for its transaction, with the caller's end of its answer.
struct Job {
    write: CallWrite,
    answer: oneshot::Sender<Result<bool, StoreError>>,
}

/// The handle the store keeps: where writes queue for the writer thread.
pub(super) struct GroupWriter {
    queue: Sender<Job>,
    /// Writes queued and not yet taken into a batch (for the tests).
    waiting: Arc<AtomicUsize>,
}

impl GroupWriter {
    /// Starts the writer thread over `conn`, the store's one connection, which it locks
    /// for each batch (other store work shares it between batches). The thread ends
    /// when this handle is dropped.
    pub(super) fn start(conn: Arc<Mutex<Connection>>) -> Result<Self, StoreError> {
        let (queue, jobs) = channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&waiting);
        std::thread::Builder::new()
            .name("airlock-store-writer".into())
            .spawn(move || write_batches(&conn, &jobs, &counter))
            .map_err(|e| StoreError::Task(format!("cannot start the store's writer: {e}")))?;
        Ok(Self { queue, waiting })
    }

    /// Queues `write` and waits until the transaction holding it has committed (or it
    /// failed).
    pub(super) async fn write_call(&self, write: CallWrite) -> Result<bool, StoreError> {
        let (answer, answered) = oneshot::channel();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let sent = self.queue.send(Job { write, answer });
        if sent.is_err() {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(StoreError::Task("the store's writer has stopped".into()));
        }
        answered.await.map_err(|_| {
            StoreError::Task("the store's writer stopped before committing the write".into())
        })?
    }

    /// Writes queued and not yet in a transaction.
    #[cfg(test)]
    pub(super) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }
}

/// The writer thread: a batch at a time until every handle is gone.
fn write_batches(conn: &Mutex<Connection>, jobs: &Receiver<Job>, waiting: &AtomicUsize) {
    while let Ok(first) = jobs.recv() {
        // The connection is locked before the queue is drained: writes that arrive
        // while other store work holds it join this batch.
        let conn = conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        waiting.fetch_sub(batch.len(), Ordering::SeqCst);
        let (writes, answers): (Vec<_>, Vec<_>) =
            batch.into_iter().map(|job| (job.write, job.answer)).unzip();
        // A panic in one batch (a bug) fails that batch's writes, not every later call:
        // the transaction rolls back as it unwinds and the thread goes on.
        let results =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| commit_batch(&conn, writes)))
                .unwrap_or_else(|_| {
                    fail_all(answers.len(), || {
                        StoreError::Task(
                            "the store's writer failed while committing a group of writes".into(),
                        )
                    })
                });
        drop(conn);
        for (answer, result) in answers.into_iter().zip(results) {
            // A caller that stopped waiting (its task was cancelled) still had its write
            // committed; nobody is left to tell.
            let _ = answer.send(result);
        }
    }
}

/// Runs `writes` in one transaction and answers each: its own result, or the
/// transaction's error when the transaction as a whole did not commit.
fn commit_batch(conn: &Connection, writes: Vec<CallWrite>) -> Vec<Result<bool, StoreError>> {
    let count = writes.len();
    let tx = match ImmediateTx::begin(conn) {
        Ok(tx) => tx,
        Err(e) => return shared_failure(&e, count),
    };
    let alone = count == 1;
    let mut results = Vec::with_capacity(count);
    for write in writes {
        let result = if alone {
            drive(machine::write_call(&mut SqliteTx { conn }, write))
        } else {
            match in_savepoint(conn, write) {
                Ok(result) => result,
                // The failed write could not be undone alone: nothing of the batch may
                // commit.
                Err(e) => return shared_failure(&e, count),
            }
        };
        results.push(result);
        if conn.is_autocommit() {
            if alone && results.iter().all(Result::is_err) {
                // A lone write's own error says what happened.
                return results;
            }
            // SQLite rolled the whole transaction back on its own (a full disk, an I/O
            // error): the writes before this one are gone too, and the ones after it
            // must not run outside a transaction.
            let gone = rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ABORT),
                Some("the transaction of a group of call writes was rolled back".into()),
            );
            return shared_failure(&gone, count);
        }
    }
    if results.iter().all(Result::is_err) {
        // Nothing to keep; dropping the transaction rolls it back.
        return results;
    }
    match tx.commit() {
        Ok(()) => results,
        Err(e) => shared_failure(&e, count),
    }
}

/// One write of a batch in a savepoint of its own, undone alone if it fails. The outer
/// error is the savepoint's own: the write could not be isolated.
fn in_savepoint(
    conn: &Connection,
    write: CallWrite,
) -> Result<Result<bool, StoreError>, rusqlite::Error> {
    execute_cached(conn, "SAVEPOINT call_write", [])?;
    let result = drive(machine::write_call(&mut SqliteTx { conn }, write));
    if conn.is_autocommit() {
        // The transaction is gone; the caller sees it and fails the batch.
        return Ok(result);
    }
    if result.is_err() {
        execute_cached(conn, "ROLLBACK TO call_write", [])?;
    }
    execute_cached(conn, "RELEASE call_write", [])?;
    Ok(result)
}

/// The error of a transaction that failed as a whole, once for each of its writes.
fn shared_failure(error: &rusqlite::Error, count: usize) -> Vec<Result<bool, StoreError>> {
    fail_all(count, || match error {
        rusqlite::Error::SqliteFailure(code, message) => {
            StoreError::Sqlite(rusqlite::Error::SqliteFailure(*code, message.clone()))
        }
        other => StoreError::Task(format!("sqlite store: {other}")),
    })
}

/// `count` answers, each the error `error` makes (a `StoreError` is not `Clone`).
fn fail_all(count: usize, error: impl Fn() -> StoreError) -> Vec<Result<bool, StoreError>> {
    (0..count).map(|_| Err(error())).collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use airlock_policy::CallStatus;
    use serde_json::json;

    use super::super::SqliteStore;
    use crate::audit::{AuditKind, AuditQuery, NewAuditEvent};
    use crate::store::{
        CallChange, CallOutcome, CallState, NewCall, Store, StoreError, now_millis,
    };

    use super::CallWrite;

    /// A call recorded when it ends, as the gate records an auto-allowed read: the row,
    /// its outcome and its three events.
    fn finished_call(id: &str) -> CallWrite {
        let event = |kind| NewAuditEvent::new(kind, json!({})).call_id(id);
        CallWrite {
            events: vec![event(AuditKind::Requested), event(AuditKind::Dispatched)],
            change: CallChange::InsertFinished {
                call: NewCall {
                    call_id: id.into(),
                    tool_use_id: format!("toolu_{id}"),
                    tool: "read_file".into(),
                    input: json!({"path": "n.txt"}),
                    principal: "alice".into(),
                    session_id: Some("s1".into()),
                    state: CallState::Approved,
                    created_at: now_millis(),
                },
                outcome: CallOutcome {
                    status: CallStatus::Ok,
                    result: json!({"is_error": false, "content": ["hello"]}),
                    duration_ms: Some(1),
                    replica: None,
                    finished_at: now_millis(),
                },
            },
            then: vec![event(AuditKind::Completed)],
        }
    }

    async fn open() -> (Arc<SqliteStore>, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SqliteStore::open(&dir.path().join("airlock.db"))
            .await
            .expect("open the store");
        (Arc::new(store), dir)
    }

    /// Makes `writes` while the store's connection is held by other work, and lets it go
    /// only once all of them wait in the queue: what a busy store sees under load. Each
    /// write reaches the queue before the next is made, so the queue holds them in the
    /// order given. Returns each write's answer, in that order.
    async fn write_while_busy(
        store: &Arc<SqliteStore>,
        writes: Vec<CallWrite>,
    ) -> Vec<Result<bool, StoreError>> {
        let busy = store.conn.lock().expect("the connection");
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut tasks = Vec::new();
        for (queued, write) in writes.into_iter().enumerate() {
            let writer = Arc::clone(store);
            tasks.push(tokio::spawn(async move { writer.write_call(write).await }));
            while store.calls.waiting() <= queued {
                assert!(
                    Instant::now() < deadline,
                    "write {} did not reach the queue",
                    queued + 1
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        drop(busy);
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(task.await.expect("the write's task"));
        }
        answers
    }

    /// Writes that queue while the store is busy are committed together: one commit for
    /// sixteen calls, each answered only after it, and the audit chain dense and valid.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_that_queue_while_the_store_is_busy_commit_together() {
        let (store, _dir) = open().await;
        let before = store.commits();
        let writes = (0..16)
            .map(|i| finished_call(&format!("call-{i}")))
            .collect();
        let answers = write_while_busy(&store, writes).await;
        for answer in &answers {
            assert!(matches!(answer, Ok(true)), "{answer:?}");
        }
        assert_eq!(store.commits() - before, 1, "sixteen writes, one commit");

        let report = store.verify().await.expect("verify");
        assert!(report.ok, "{report:?}");
        assert_eq!(report.records, 48);
        for i in 0..16 {
            let call = store
                .get_call(&format!("call-{i}").into())
                .await
                .expect("read the call")
                .expect("the call is stored");
            assert_eq!(call.status, Some(CallStatus::Ok));
        }
    }

    /// A write that fails inside a group is undone alone: its events are not in the
    /// audit log, the others commit, and the chain has no gap where it was.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_that_fails_in_a_group_fails_alone() {
        let (store, _dir) = open().await;
        let before = store.commits();
        // The third write takes an id the first already took.
        let writes = vec![
            finished_call("call-a"),
            finished_call("call-b"),
            finished_call("call-a"),
            finished_call("call-c"),
        ];
        let answers = write_while_busy(&store, writes).await;
        assert!(matches!(answers[0], Ok(true)), "{:?}", answers[0]);
        assert!(matches!(answers[1], Ok(true)), "{:?}", answers[1]);
        assert!(
            matches!(answers[2], Err(StoreError::AlreadyExists { .. })),
            "{:?}",
            answers[2]
        );
        assert!(matches!(answers[3], Ok(true)), "{:?}", answers[3]);
        assert_eq!(store.commits() - before, 1);

        let records = store
            .audit(AuditQuery {
                call_id: Some("call-a".into()),
                ..AuditQuery::default()
            })
            .await
            .expect("audit");
        assert_eq!(
            records.len(),
            3,
            "only the first call-a's events: {records:?}"
        );
        let report = store.verify().await.expect("verify");
        assert!(report.ok, "{report:?}");
        assert_eq!(report.records, 9);
    }

    /// A call's write reads and moves the chain's head once for all its events, and
    /// writes the call's row once, finished: the rows it changes are its three records,
    /// the head once and the call's insert (eight when the head moved after every
    /// record, six when the call was inserted `approved` and then moved to `finished`).
    /// The records still chain one to the next, and the head names the last.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_calls_events_move_the_chain_head_once() {
        let (store, _dir) = open().await;
        let changes = || store.conn.lock().expect("the connection").total_changes();
        let before = changes();
        let written = store.write_call(finished_call("call-1")).await;
        assert!(matches!(written, Ok(true)), "{written:?}");
        assert_eq!(
            changes() - before,
            5,
            "3 records, the head, the call's one insert"
        );
        let records = store.audit(AuditQuery::default()).await.expect("audit");
        assert_eq!(records.len(), 3);
        for pair in records.windows(2) {
            assert_eq!(pair[1].prev_hash, pair[0].hash);
            assert_eq!(pair[1].seq, pair[0].seq + 1);
        }
        let head: (i64, String) = store
            .conn
            .lock()
            .expect("the connection")
            .query_row("SELECT seq, hash FROM audit_head WHERE id = 1", [], |row| {
                Ok((row.get(0)?, row.get(1)?))
            })
            .expect("the head");
        assert_eq!(head.0, 3);
        assert_eq!(head.1, records[2].hash);
        assert!(store.verify().await.expect("verify").ok);
    }

    /// A lone write is its own transaction, as before group commit: one commit each.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lone_write_is_one_commit() {
        let (store, _dir) = open().await;
        for i in 0..5 {
            let before = store.commits();
            let written = store.write_call(finished_call(&format!("call-{i}"))).await;
            assert!(matches!(written, Ok(true)), "{written:?}");
            assert_eq!(store.commits() - before, 1);
        }
        let again = store.write_call(finished_call("call-0")).await;
        assert!(
            matches!(again, Err(StoreError::AlreadyExists { .. })),
            "{again:?}"
        );
        assert!(store.verify().await.expect("verify").ok);
    }
}
