//! Group commit for the calls' writes on SQLite ([`Store::write_call`], the one write of a
//! call on the gate's hot path).
//!
//! One thread writes the calls that queue (a lone call commits itself: below). It takes
//! the first write waiting, then every other write that queued meanwhile (at most
//! [`MAX_BATCH`]), and commits them in one `BEGIN IMMEDIATE … COMMIT`. Each write runs
//! inside a savepoint of its own, so a write that fails (a call id already taken, a
//! claim already lost) is undone alone and answered with its own error, while the
//! others commit. Nobody is answered before the
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
//! A write that finds nobody queued and the connection free commits on the thread that
//! made it, without waking the writer thread: at concurrency 1 every call's write
//! used to cost two hand-offs between threads (to the writer and back), which on a
//! virtual machine cost more than the transaction. It never waits there: not for the
//! connection (another thread holds it → the queue), not for another process's write
//! lock (`BEGIN IMMEDIATE` is tried with no busy timeout → the queue, where the writer
//! waits the full timeout), and never for a checkpoint: SQLite's checkpoint after a
//! commit is off on this connection, and the writer thread checkpoints (`PASSIVE`)
//! instead, asked by whichever commit leaves the log at [`CHECKPOINT_PAGES`] or more —
//! the threshold SQLite's own checkpoint uses (the connection's WAL hook tells the
//! committing thread the log's size).
//!
//! The queue is not bounded by this module: every write in it is a call whose task
//! awaits the answer, so it holds at most the calls in flight, which the front doors
//! bound.
//!
//! [`Store::write_call`]: super::super::Store::write_call

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::Duration;

use rusqlite::Connection;
use tokio::sync::oneshot;

use super::{BUSY_TIMEOUT, ImmediateTx, SqliteTx, drive, execute_cached};
use crate::store::machine;
use crate::store::{CallWrite, StoreError};

/// The most writes one transaction takes: a bound on how long the connection is held
/// (and so how long other store work waits) for one commit.
const MAX_BATCH: usize = 64;

/// Pages in the log at which a checkpoint is due: SQLite's own default for the
/// checkpoint after a commit, which this connection no longer runs. Counted in pages, not
/// commits, since a group's commit may carry sixty-four calls and their stored results.
pub(super) const CHECKPOINT_PAGES: i32 = 1000;

thread_local! {
    /// Pages in the log after the last commit made on this thread: SQLite calls the
    /// connection's WAL hook ([`note_log_pages`]) on the committing thread, inside
    /// `COMMIT`.
    static LOG_PAGES: Cell<i32> = const { Cell::new(0) };
}

/// The store connection's WAL hook: notes the log's size for the committing thread.
pub(super) fn note_log_pages(
    _wal: &rusqlite::hooks::Wal,
    pages: std::ffi::c_int,
) -> rusqlite::Result<()> {
    LOG_PAGES.with(|noted| noted.set(pages));
    Ok(())
}

/// Whether the commit this thread just made left the log due for a checkpoint; clears
/// what the hook noted (a rolled-back batch commits nothing and notes nothing).
fn log_due() -> bool {
    LOG_PAGES.with(|noted| noted.replace(0)) >= CHECKPOINT_PAGES
}

/// What the writer thread is asked to do.
enum Message {
    /// A write waiting for its transaction.
    Write(Job),
    /// A commit passed the checkpoint mark on another thread.
    Checkpoint,
}

/// A write waiting for its transaction, with the caller's end of its answer.
struct Job {
    write: Box<CallWrite>,
    answer: oneshot::Sender<Result<bool, StoreError>>,
}

/// What became of a write its caller tried to commit itself.
enum Here {
    /// Committed (or failed) in its own transaction on the caller's thread.
    Done(Result<bool, StoreError>),
    /// Given back for the queue: committing it here would have meant waiting.
    Queue(Box<CallWrite>),
}

/// The handle the store keeps: where writes queue for the writer thread.
pub(super) struct GroupWriter {
    conn: Arc<Mutex<Connection>>,
    queue: Sender<Message>,
    /// Writes queued and not yet taken into a batch (also for the tests).
    waiting: Arc<AtomicUsize>,
    checkpoints: Arc<Checkpoints>,
    /// Writes committed on their caller's thread (for the tests).
    #[cfg(test)]
    inline: AtomicUsize,
}

impl GroupWriter {
    /// Starts the writer thread over `conn`, the store's one connection, which it locks
    /// for each batch (other store work shares it between batches) and whose WAL hook
    /// is [`note_log_pages`]. The thread ends when this handle is dropped.
    pub(super) fn start(conn: Arc<Mutex<Connection>>) -> Result<Self, StoreError> {
        let (queue, jobs) = channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        let checkpoints = Arc::new(Checkpoints::default());
        let thread = Writer {
            conn: Arc::clone(&conn),
            waiting: Arc::clone(&waiting),
            checkpoints: Arc::clone(&checkpoints),
        };
        std::thread::Builder::new()
            .name("airlock-store-writer".into())
            .spawn(move || thread.run(&jobs))
            .map_err(|e| StoreError::Task(format!("cannot start the store's writer: {e}")))?;
        Ok(Self {
            conn,
            queue,
            waiting,
            checkpoints,
            #[cfg(test)]
            inline: AtomicUsize::new(0),
        })
    }

    /// Commits `write` here when nobody waits and the connection is free, else queues
    /// it; returns once the transaction holding it has committed (or it failed).
    pub(super) async fn write_call(&self, write: CallWrite) -> Result<bool, StoreError> {
        let write = match self.commit_here(write) {
            Here::Done(result) => return result,
            Here::Queue(write) => write,
        };
        let (answer, answered) = oneshot::channel();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let sent = self.queue.send(Message::Write(Job { write, answer }));
        if sent.is_err() {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(StoreError::Task("the store's writer has stopped".into()));
        }
        answered.await.map_err(|_| {
            StoreError::Task("the store's writer stopped before committing the write".into())
        })?
    }

    /// A batch of one on this thread, if that needs no waiting; the write back if it
    /// would (writes queued before it, the connection busy, another writer's lock).
    fn commit_here(&self, write: CallWrite) -> Here {
        // Behind queued writes, and behind an asked-for checkpoint: the log grows no
        // further than the commits already under way when it was asked for.
        if self.waiting.load(Ordering::SeqCst) > 0
            || self.checkpoints.requested.load(Ordering::SeqCst)
        {
            return Here::Queue(Box::new(write));
        }
        let conn = match self.conn.try_lock() {
            Ok(conn) => conn,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return Here::Queue(Box::new(write)),
        };
        // SQLite's busy handler would sleep until the lock is free: not on this thread.
        if conn.busy_timeout(Duration::ZERO).is_err() {
            return Here::Queue(Box::new(write));
        }
        let result = {
            let begun = ImmediateTx::begin(&conn);
            // Restored before anything else runs on the connection; for an open
            // connection `sqlite3_busy_timeout` cannot fail.
            let _ = conn.busy_timeout(BUSY_TIMEOUT);
            let tx = match begun {
                Ok(tx) => tx,
                Err(_) => return Here::Queue(Box::new(write)),
            };
            unless_panicked(1, || commit_begun(&conn, tx, vec![write])).pop()
        };
        drop(conn);
        #[cfg(test)]
        self.inline.fetch_add(1, Ordering::SeqCst);
        let result =
            result.unwrap_or_else(|| Err(StoreError::Task("a write of one had no answer".into())));
        if log_due() && self.checkpoints.request() {
            // The writer thread checkpoints when it gets to it; a send fails only once
            // it has stopped, and then nothing is left to checkpoint for.
            let _ = self.queue.send(Message::Checkpoint);
        }
        Here::Done(result)
    }

    /// Writes queued and not yet in a transaction.
    #[cfg(test)]
    pub(super) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Writes committed on their caller's thread.
    #[cfg(test)]
    pub(super) fn inline(&self) -> usize {
        self.inline.load(Ordering::SeqCst)
    }

    /// Checkpoints the writer thread has run.
    #[cfg(test)]
    pub(super) fn checkpoints(&self) -> u64 {
        self.checkpoints.done.load(Ordering::SeqCst)
    }
}

/// The checkpoints asked for and run.
#[derive(Default)]
struct Checkpoints {
    /// A checkpoint was asked of the writer thread and has not run yet.
    requested: AtomicBool,
    done: AtomicU64,
}

impl Checkpoints {
    /// Whether the caller is the one to ask the writer thread (no request is pending).
    fn request(&self) -> bool {
        !self.requested.swap(true, Ordering::SeqCst)
    }
}

/// The writer thread's share of the handle.
struct Writer {
    conn: Arc<Mutex<Connection>>,
    waiting: Arc<AtomicUsize>,
    checkpoints: Arc<Checkpoints>,
}

impl Writer {
    /// A batch at a time until every handle is gone.
    fn run(&self, jobs: &Receiver<Message>) {
        while let Ok(first) = jobs.recv() {
            let mut checkpoint = false;
            let mut batch = Vec::new();
            match first {
                Message::Write(job) => batch.push((*job.write, job.answer)),
                Message::Checkpoint => checkpoint = true,
            }
            if !batch.is_empty() {
                // The connection is locked before the queue is drained: writes that
                // arrive while other store work holds it join this batch.
                let conn = self.lock();
                while batch.len() < MAX_BATCH {
                    match jobs.try_recv() {
                        Ok(Message::Write(job)) => batch.push((*job.write, job.answer)),
                        Ok(Message::Checkpoint) => checkpoint = true,
                        Err(_) => break,
                    }
                }
                self.waiting.fetch_sub(batch.len(), Ordering::SeqCst);
                let (writes, answers): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
                let results = unless_panicked(answers.len(), || commit_batch(&conn, writes));
                drop(conn);
                for (answer, result) in answers.into_iter().zip(results) {
                    // A caller that stopped waiting (its task was cancelled) still had
                    // its write committed; nobody is left to tell.
                    let _ = answer.send(result);
                }
                checkpoint |= log_due();
            }
            if checkpoint {
                self.checkpoint();
            }
        }
    }

    /// Copies the log into the database (`PASSIVE`: what no reader still needs, waiting
    /// for nobody; what a reader's snapshot holds back is left for the next one).
    fn checkpoint(&self) {
        let conn = self.lock();
        self.checkpoints.requested.store(false, Ordering::SeqCst);
        let done = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
        match done {
            Ok(()) => {
                self.checkpoints.done.fetch_add(1, Ordering::SeqCst);
            }
            Err(e) => {
                tracing::warn!(error = %e, "the store's checkpoint failed; the next one retries")
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Runs `writes` in one transaction and answers each: its own result, or the
/// transaction's error when the transaction as a whole did not commit.
fn commit_batch(conn: &Connection, writes: Vec<CallWrite>) -> Vec<Result<bool, StoreError>> {
    match ImmediateTx::begin(conn) {
        Ok(tx) => commit_begun(conn, tx, writes),
        Err(e) => shared_failure(&e, writes.len()),
    }
}

/// [`commit_batch`] in the transaction `tx`, begun on `conn`.
fn commit_begun(
    conn: &Connection,
    tx: ImmediateTx<'_>,
    writes: Vec<CallWrite>,
) -> Vec<Result<bool, StoreError>> {
    let count = writes.len();
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

/// The answers `commit` gives to its `count` writes; if it panics (a bug), an error for
/// each, and not every later call's: the transaction rolls back as it unwinds, and the
/// thread — the writer, or the runtime's that made the write — goes on.
fn unless_panicked(
    count: usize,
    commit: impl FnOnce() -> Vec<Result<bool, StoreError>>,
) -> Vec<Result<bool, StoreError>> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(commit)).unwrap_or_else(|_| {
        fail_all(count, || {
            StoreError::Task("the store failed while committing a call's write".into())
        })
    })
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

    /// A write that finds nobody queued and the connection free commits on its
    /// caller's thread — one commit, answered, the chain intact — with no hand-off to
    /// the writer thread; one that finds the connection held queues, as before.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lone_write_commits_on_its_callers_thread() {
        let (store, _dir) = open().await;
        let before = store.commits();
        let written = store.write_call(finished_call("call-1")).await;
        assert!(matches!(written, Ok(true)), "{written:?}");
        assert_eq!(store.calls.inline(), 1);
        assert_eq!(store.commits() - before, 1);

        let answers = write_while_busy(&store, vec![finished_call("call-2")]).await;
        assert!(matches!(answers[0], Ok(true)), "{:?}", answers[0]);
        assert_eq!(
            store.calls.inline(),
            1,
            "a held connection sends the write to the queue"
        );
        let report = store.verify().await.expect("verify");
        assert!(report.ok, "{report:?}");
        assert_eq!(report.records, 6);
    }

    /// While another connection (another process) holds the database's write lock, a
    /// call's write does not wait on the thread that made it: on a runtime with one
    /// thread, other tasks keep running while the write waits in the queue, and the
    /// write commits once the lock is let go.
    #[tokio::test(flavor = "current_thread")]
    async fn a_write_never_waits_on_its_callers_thread_for_another_writers_lock() {
        let (store, dir) = open().await;
        let other = rusqlite::Connection::open(dir.path().join("airlock.db")).expect("open");
        other
            .execute_batch("BEGIN IMMEDIATE")
            .expect("take the write lock");

        let writer = Arc::clone(&store);
        let write = tokio::spawn(async move { writer.write_call(finished_call("call-1")).await });
        let ticks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let ticker = {
            let ticks = Arc::clone(&ticks);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    ticks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            ticks.load(std::sync::atomic::Ordering::SeqCst) >= 10,
            "the runtime's one thread was held by the write"
        );
        assert!(
            !write.is_finished(),
            "the write went through another writer's lock"
        );
        assert_eq!(store.calls.inline(), 0);

        other.execute_batch("ROLLBACK").expect("let the lock go");
        let written = tokio::time::timeout(Duration::from_secs(30), write)
            .await
            .expect("the write committed after the lock was let go")
            .expect("the write's task");
        assert!(matches!(written, Ok(true)), "{written:?}");
        ticker.abort();
        assert!(store.verify().await.expect("verify").ok);
    }

    /// SQLite's own checkpoint after a commit is off on the store's connection (a
    /// commit may run on a runtime thread); the writer thread checkpoints once the log
    /// reaches `CHECKPOINT_PAGES` instead, so the log does not grow for ever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_writer_thread_checkpoints_the_log() {
        let (store, dir) = open().await;
        let autocheckpoint: i64 = store
            .conn
            .lock()
            .expect("the connection")
            .query_row("PRAGMA wal_autocheckpoint", [], |row| row.get(0))
            .expect("read the pragma");
        assert_eq!(autocheckpoint, 0);
        // A lone call's commit is about a dozen pages: some 3 500 pages in all.
        let calls = 300;
        for i in 0..calls {
            let written = store.write_call(finished_call(&format!("call-{i}"))).await;
            assert!(matches!(written, Ok(true)), "{written:?}");
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while store.calls.checkpoints() < 2 {
            assert!(
                Instant::now() < deadline,
                "no checkpoint after {calls} commits"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // What was checkpointed is in the database file itself, not only in the log.
        let db_bytes = std::fs::metadata(dir.path().join("airlock.db"))
            .expect("the database file")
            .len();
        assert!(
            db_bytes > 64 * 1024,
            "{db_bytes} bytes in the database file"
        );
        // And the log, reused from its start after each checkpoint, stays near the
        // threshold: its pages and the few commits under way when the checkpoint was
        // asked for (writes queue behind it), each page a frame with a 24-byte header.
        // Without checkpoints it would hold some 3 500 pages.
        let wal_bytes = std::fs::metadata(dir.path().join("airlock.db-wal"))
            .expect("the log")
            .len();
        let bound = (u64::try_from(super::CHECKPOINT_PAGES).expect("pages") + 300) * (4096 + 24);
        assert!(
            wal_bytes <= bound,
            "{wal_bytes} bytes in the log (bound {bound})"
        );
        assert!(store.verify().await.expect("verify").ok);
    }
}
