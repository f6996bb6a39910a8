//! The SQLite store: `<data_dir>/airlock.db`, WAL mode, one connection behind a
//! mutex, every statement on tokio's blocking pool except the calls' writes, which a
//! writer thread of their own commits in groups ([`group_commit`]). Writes start with
//! `BEGIN IMMEDIATE`, so they are serialized across tasks and across processes that
//! open the same file (they wait up to the busy timeout).

mod group_commit;

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rusqlite::types::Value;
use rusqlite::{
    Connection, ErrorCode, OpenFlags, OptionalExtension as _, Row, Transaction,
    TransactionBehavior, params, params_from_iter,
};

use super::machine::{
    self, ApprovalMove, ApprovalState, CallFilter, CallMove, CallOwner, ChainHead, Sweep, Tx,
    Verdict,
};
use super::sql::{Placeholders, filter_sql, move_call_sql, prune_results_sql};
use super::{
    ADDED_INDEXES, APPROVAL_SELECT, AUDIT_COLUMNS, Approval, ApprovalId, ApprovalPage,
    ApprovalQuery, ApprovalStatus, AuditPage, AuditQuery, AuditRecord, CALL_COLUMNS,
    CALL_LIST_STATUS, CallId, CallListFilter, CallOutcome, CallState, CallWrite, ExpiredApproval,
    MAX_CALL_LIST, NewApproval, NewAuditEvent, NewCall, PIN_COLUMNS, PinCheck, PinRow,
    PinnedDefinition, RememberedApproval, SCHEMA_VERSION, SESSION_USAGE_SQL, SessionUsage, Store,
    StoreError, StoredCall, Timestamp, ToolPin, VerifyReport, added_tables, decode_call_status,
    fill_page, from_json_text, schema_v1, to_i64, to_json_text, to_u64,
};
use crate::audit::{ChainVerifier, GENESIS_HASH};

pub(super) struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    /// A read-only connection of `verify`'s own. Verifying reads the whole log in one
    /// snapshot, which in WAL mode neither waits for the writer nor holds it up; on
    /// `conn` it held every call's write and read for as long as the scan took (at
    /// start, hourly, on `GET /v1/audit/verify` and on each view of the console's audit
    /// page). One verify at a time: they queue on this connection, not before calls.
    verifier: Arc<Mutex<Connection>>,
    /// Commits on `conn` (its commit hook counts them; see [`Store::commits`]).
    commits: Arc<AtomicU64>,
    /// The calls' writes, committed in groups on `conn`.
    calls: group_commit::GroupWriter,
}

impl SqliteStore {
    pub(super) async fn open(path: &Path) -> Result<Self, StoreError> {
        let path = path.to_owned();
        let commits = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&commits);
        let (conn, verifier) = tokio::task::spawn_blocking(move || {
            let conn = open_blocking(&path)?;
            let verifier = open_verifier(&path)?;
            // Counted by SQLite itself rather than by each method, so that a commit no
            // method meant to make is counted too. It fires for write transactions
            // only (a read in autocommit mode is no commit).
            conn.commit_hook(Some(move || {
                counter.fetch_add(1, Ordering::Relaxed);
                false
            }))?;
            Ok::<_, StoreError>((conn, verifier))
        })
        .await
        .map_err(|e| StoreError::Task(e.to_string()))??;
        let conn = Arc::new(Mutex::new(conn));
        Ok(Self {
            calls: group_commit::GroupWriter::start(Arc::clone(&conn))?,
            conn,
            verifier: Arc::new(Mutex::new(verifier)),
            commits,
        })
    }

    /// Runs `f` with the connection on the blocking pool.
    async fn run<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    {
        run_on(&self.conn, f).await
    }
}

/// Runs `f` with `conn` on the blocking pool.
async fn run_on<T, F>(conn: &Arc<Mutex<Connection>>, f: F) -> Result<T, StoreError>
where
    T: Send + 'static,
    F: FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
{
    let conn = Arc::clone(conn);
    tokio::task::spawn_blocking(move || {
        let mut guard = conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&mut guard)
    })
    .await
    .map_err(|e| StoreError::Task(e.to_string()))?
}

/// The read-only connection `verify` reads through, opened after the store's own (which
/// made the file and switched it to WAL).
fn open_verifier(path: &Path) -> Result<Connection, StoreError> {
    let open_err = |cause: String| StoreError::Open {
        path: path.display().to_string(),
        cause,
    };
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| open_err(e.to_string()))?;
    conn.busy_timeout(BUSY_TIMEOUT)
        .map_err(|e| open_err(e.to_string()))?;
    // As on the store's own connection: nothing spills to a temporary file.
    conn.pragma_update(None, "temp_store", "MEMORY")
        .map_err(|e| open_err(e.to_string()))?;
    Ok(conn)
}

fn open_blocking(path: &PathBuf) -> Result<Connection, StoreError> {
    let open_err = |cause: String| StoreError::Open {
        path: path.display().to_string(),
        cause,
    };
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).map_err(|e| open_err(e.to_string()))?;
    }
    if !path.exists() {
        // The store holds call arguments: only its owner may read it.
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .map_err(|e| open_err(e.to_string()))?;
    }
    let mut conn = Connection::open(path).map_err(|e| open_err(e.to_string()))?;
    conn.busy_timeout(BUSY_TIMEOUT)
        .map_err(|e| open_err(e.to_string()))?;
    // Room for every statement a call's transaction runs (the call moves alone come in
    // several shapes), so that the cache never evicts one between calls.
    conn.set_prepared_statement_cache_capacity(64);
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))
        .map_err(|e| open_err(e.to_string()))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(open_err(format!(
            "cannot switch to write-ahead logging (journal mode is {mode})"
        )));
    }
    // In WAL mode NORMAL keeps every commit across a crash of the process (kill -9); it
    // may lose the last commits on power loss, which FULL avoids at an fsync per commit
    // (several per tool call). Deployments that need that durability use PostgreSQL.
    conn.pragma_update(None, "synchronous", "NORMAL")
        .map_err(|e| open_err(e.to_string()))?;
    // Sorts and temporary tables stay in memory: SQLite would otherwise spill them to a
    // file in /var/tmp or /tmp, which the confined orchestrator may not open (Landlock
    // lets it write only its data dir), and the statement would fail with "unable to
    // open database file". What they hold stays small because no query sorts rows that
    // carry call inputs or results (pages are read by id through an index).
    conn.pragma_update(None, "temp_store", "MEMORY")
        .map_err(|e| open_err(e.to_string()))?;
    // Checkpoints are the writer thread's (`group_commit`), never a commit's: a call's
    // write may commit on the runtime thread that made it, which must not copy the log
    // into the database and `fsync` both, as SQLite's own checkpoint after a commit would.
    conn.pragma_update(None, "wal_autocheckpoint", 0)
        .map_err(|e| open_err(e.to_string()))?;
    // After the pragma, which replaces the connection's WAL hook with its own (none).
    conn.wal_hook(Some(group_commit::note_log_pages));
    migrate(&mut conn)?;
    Ok(conn)
}

/// How long a statement on the store's connection waits for another connection's lock
/// (another process's, or the verifier's during a WAL reset) before it fails.
const BUSY_TIMEOUT: Duration = Duration::from_secs(15);

/// Whether any result is due for the prune: `?1` the finished state, `?2` the cut. Found
/// through the partial index `calls_unpruned`.
const RESULTS_DUE_SQL: &str = "SELECT 1 FROM calls WHERE state = ?1 AND result IS NOT NULL \
     AND finished_at < ?2 LIMIT 1";

fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    tx.execute_batch("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")?;
    let version: Option<i64> =
        tx.query_row("SELECT MAX(version) FROM schema_version", [], |row| {
            row.get(0)
        })?;
    match version {
        None => {
            tx.execute_batch(&schema_v1("INTEGER"))?;
            tx.execute(
                "INSERT INTO audit_head (id, seq, hash) VALUES (1, 0, ?1)",
                [GENESIS_HASH],
            )?;
            tx.execute(
                "INSERT INTO schema_version (version) VALUES (?1)",
                [SCHEMA_VERSION],
            )?;
        }
        Some(found) if found > SCHEMA_VERSION => {
            return Err(StoreError::SchemaTooNew {
                found,
                supported: SCHEMA_VERSION,
            });
        }
        Some(_) => {}
    }
    tx.execute_batch(ADDED_INDEXES)?;
    tx.execute_batch(&added_tables("INTEGER"))?;
    tx.commit()?;
    Ok(())
}

fn is_unique_violation(err: &rusqlite::Error) -> bool {
    matches!(err, rusqlite::Error::SqliteFailure(e, _) if e.code == ErrorCode::ConstraintViolation)
}

/// An insert's outcome: `Ok(true)` when it inserted, `Ok(false)` when the row's key was
/// taken, the error otherwise.
fn inserted_unless_taken<T>(inserted: Result<T, rusqlite::Error>) -> Result<bool, StoreError> {
    match inserted {
        Ok(_) => Ok(true),
        Err(e) if is_unique_violation(&e) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

fn audit_from_row(row: &Row<'_>) -> rusqlite::Result<(i64, RawAudit)> {
    let seq: i64 = row.get("seq")?;
    Ok((
        seq,
        RawAudit {
            ts: row.get("ts")?,
            kind: row.get("kind")?,
            call_id: row.get("call_id")?,
            principal: row.get("principal")?,
            session_id: row.get("session_id")?,
            data: row.get("data")?,
            prev_hash: row.get("prev_hash")?,
            hash: row.get("hash")?,
        },
    ))
}

/// A page of the audit log: `?1` is `after`, `?2` the limit, the filters' values follow.
fn audit_page_sql(query: &AuditQuery) -> (String, Vec<&str>) {
    let order = if query.latest { "DESC" } else { "ASC" };
    let (filters, values) = query.filters(3, |n| format!("?{n}"));
    (
        format!(
            "SELECT {AUDIT_COLUMNS} FROM audit_events \
             WHERE seq > ?1{filters} ORDER BY seq {order} LIMIT ?2"
        ),
        values,
    )
}

/// An audit row before its JSON is parsed.
struct RawAudit {
    ts: String,
    kind: String,
    call_id: Option<String>,
    principal: Option<String>,
    session_id: Option<String>,
    data: String,
    prev_hash: String,
    hash: String,
}

impl RawAudit {
    fn into_record(self, seq: i64) -> Result<AuditRecord, (u64, String)> {
        let seq_u =
            u64::try_from(seq).map_err(|_| (0, format!("record {seq} has a negative seq")))?;
        let data = serde_json::from_str(&self.data).map_err(|_| {
            (
                seq_u,
                format!("record {seq_u} holds data that is not valid json"),
            )
        })?;
        Ok(AuditRecord {
            seq: seq_u,
            ts: self.ts,
            kind: self.kind,
            call_id: self.call_id,
            principal: self.principal,
            session_id: self.session_id,
            data,
            prev_hash: self.prev_hash,
            hash: self.hash,
        })
    }
}

fn call_from_row(row: &Row<'_>) -> Result<StoredCall, StoreError> {
    let input: String = row.get("input")?;
    let state: String = row.get("state")?;
    let result: Option<String> = row.get("result")?;
    let duration_ms: Option<i64> = row.get("duration_ms")?;
    let approval_id: Option<String> = row.get("approval_id")?;
    Ok(StoredCall {
        call_id: CallId::from(row.get::<_, String>("call_id")?),
        tool_use_id: row.get("tool_use_id")?,
        tool: row.get("tool")?,
        input: from_json_text(&input, "a call's input")?,
        principal: row.get("principal")?,
        session_id: row.get("session_id")?,
        state: CallState::parse(&state)?,
        approval_id: approval_id.map(ApprovalId::from),
        status: decode_call_status(row.get("status")?)?,
        result: result
            .map(|r| from_json_text(&r, "a call's result"))
            .transpose()?,
        duration_ms: duration_ms
            .map(|d| to_u64(d, "a call's duration"))
            .transpose()?,
        replica: row.get("replica")?,
        claimed_by: row.get("claimed_by")?,
        lease_until: row.get("lease_until")?,
        created_at: row.get("created_at")?,
        finished_at: row.get("finished_at")?,
    })
}

fn approval_from_row(row: &Row<'_>) -> Result<Approval, StoreError> {
    let input: String = row.get("input")?;
    let status: String = row.get("status")?;
    let input = from_json_text(&input, "an approval's input")?;
    Ok(Approval {
        input_sha256: crate::audit::value_sha256(&input),
        approved_by: Vec::new(),
        approval_id: ApprovalId::from(row.get::<_, String>("approval_id")?),
        call_id: CallId::from(row.get::<_, String>("call_id")?),
        tool: row.get("tool")?,
        input,
        principal: row.get("principal")?,
        session_id: row.get("session_id")?,
        status: ApprovalStatus::parse(&status)?,
        created_at: row.get("created_at")?,
        expires_at: row.get("expires_at")?,
        decided_by: row.get("decided_by")?,
        reason: row.get("reason")?,
        decided_at: row.get("decided_at")?,
    })
}

fn select_approval(conn: &Connection, id: &str) -> Result<Option<Approval>, StoreError> {
    Ok(select_approval_sized(conn, id)?.map(|(approval, _)| approval))
}

/// Who approved an approval so far, in the order they did.
fn select_votes(conn: &Connection, id: &str) -> Result<Vec<String>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT approver FROM approval_votes WHERE approval_id = ?1 ORDER BY decided_at, approver",
    )?;
    let votes = stmt
        .query_map([id], |row| row.get::<_, String>(0))?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(votes)
}

/// An approval and the size of its stored input.
fn select_approval_sized(
    conn: &Connection,
    id: &str,
) -> Result<Option<(Approval, usize)>, StoreError> {
    let mut stmt = conn.prepare_cached(&format!("{APPROVAL_SELECT} WHERE a.approval_id = ?1"))?;
    let mut rows = stmt.query([id])?;
    match rows.next()? {
        Some(row) => {
            let size = row.get_ref("input")?.as_bytes().map_or(0, <[u8]>::len);
            let mut approval = approval_from_row(row)?;
            approval.approved_by = select_votes(conn, id)?;
            Ok(Some((approval, size)))
        }
        None => Ok(None),
    }
}

/// The ids of a page of approvals, in index order, `limit + 1` of them.
fn approval_page_ids(
    tx: &Transaction<'_>,
    query: &ApprovalQuery,
) -> Result<Vec<String>, StoreError> {
    // Where the page starts: after the cursor's (created_at, approval_id), or anywhere.
    let (from_at, from_id) = match &query.after {
        Some(id) => {
            let at: Option<Timestamp> = tx
                .query_row(
                    "SELECT created_at FROM approvals WHERE approval_id = ?1",
                    [id],
                    |row| row.get("created_at"),
                )
                .optional()?;
            let at = at.ok_or_else(|| StoreError::NotFound {
                what: "approval",
                id: id.clone(),
            })?;
            (at, id.clone())
        }
        None => (Timestamp::MIN, String::new()),
    };
    let fetch = i64::try_from(query.effective_limit() + 1).unwrap_or(i64::MAX);
    // Two statements rather than `?1 IS NULL OR status = ?1`, which no index serves.
    let ids = match query.status {
        Some(status) => {
            let mut stmt = tx.prepare_cached(
                "SELECT approval_id FROM approvals WHERE status = ?1                  AND (created_at, approval_id) > (?2, ?3)                  ORDER BY created_at ASC, approval_id ASC LIMIT ?4",
            )?;
            let rows = stmt
                .query_map(params![status.as_str(), from_at, from_id, fetch], |row| {
                    row.get("approval_id")
                })?;
            rows.collect::<Result<Vec<String>, _>>()?
        }
        None => {
            let mut stmt = tx.prepare_cached(
                "SELECT approval_id FROM approvals WHERE (created_at, approval_id) > (?1, ?2)                  ORDER BY created_at ASC, approval_id ASC LIMIT ?3",
            )?;
            let rows = stmt.query_map(params![from_at, from_id, fetch], |row| {
                row.get("approval_id")
            })?;
            rows.collect::<Result<Vec<String>, _>>()?
        }
    };
    Ok(ids)
}

fn call_exists(conn: &Connection, call_id: &CallId) -> Result<bool, StoreError> {
    Ok(conn
        .query_row(
            "SELECT 1 FROM calls WHERE call_id = ?1",
            [call_id.as_str()],
            |_| Ok(()),
        )
        .optional()?
        .is_some())
}

/// Whether a pending approval is due at `now` (what the expiry sweep would take).
fn any_overdue(conn: &Connection, now: Timestamp) -> Result<bool, StoreError> {
    Ok(conn
        .query_row(
            "SELECT 1 FROM approvals WHERE status = 'pending' AND expires_at <= ?1 LIMIT 1",
            [now],
            |_| Ok(()),
        )
        .optional()?
        .is_some())
}

fn select_call(conn: &Connection, call_id: &CallId) -> Result<Option<StoredCall>, StoreError> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {CALL_COLUMNS} FROM calls WHERE call_id = ?1"
    ))?;
    let mut rows = stmt.query([call_id.as_str()])?;
    match rows.next()? {
        Some(row) => Ok(Some(call_from_row(row)?)),
        None => Ok(None),
    }
}

/// Parameters of a statement built from a move, numbered `?1`, `?2`, … as bound.
#[derive(Default)]
struct Binds(Vec<Value>);

impl Binds {
    /// Binds `value` and answers its placeholder.
    fn bind(&mut self, value: impl Into<Value>) -> String {
        self.0.push(value.into());
        format!("?{}", self.0.len())
    }
}

impl Placeholders for Binds {
    fn timestamp(&mut self, value: Timestamp) -> String {
        self.bind(value)
    }

    fn text(&mut self, value: String) -> String {
        self.bind(value)
    }

    fn maybe_integer(&mut self, value: Option<i64>) -> String {
        self.bind(value)
    }

    fn maybe_text(&mut self, value: Option<String>) -> String {
        self.bind(value)
    }
}

/// The audit event's insert, three times in every call's transaction: its text is
/// built once, not formatted for each event.
static INSERT_AUDIT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO audit_events ({AUDIT_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
    )
});

/// Runs one statement through the connection's cache of prepared statements: the gate
/// writes the same few statements in every call's transaction, and parsing and planning
/// them again each time cost more than executing them.
fn execute_cached(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> rusqlite::Result<usize> {
    conn.prepare_cached(sql)?.execute(params)
}

/// [`execute_cached`] for a statement that answers one row.
fn query_row_cached<T>(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
    row: impl FnOnce(&Row<'_>) -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    conn.prepare_cached(sql)?.query_row(params, row)
}

/// The [`Tx`] primitives on one connection: inside a transaction (a [`Transaction`]
/// derefs to its connection) or, for a single statement, on its own. Every method does
/// its work synchronously, so the state machine's futures complete on their first poll
/// (see [`drive`]).
struct SqliteTx<'c> {
    conn: &'c Connection,
}

/// Runs one of the state machine's functions over this engine's synchronous primitives.
fn drive<T>(work: impl Future<Output = T>) -> T {
    futures::executor::block_on(work)
}

impl Tx for SqliteTx<'_> {
    async fn chain_head(&mut self) -> Result<Option<ChainHead>, StoreError> {
        // The write lock `BEGIN IMMEDIATE` took holds the head until commit.
        Ok(query_row_cached(
            self.conn,
            "SELECT seq, hash FROM audit_head WHERE id = 1",
            [],
            |row| {
                Ok(ChainHead {
                    seq: row.get("seq")?,
                    hash: row.get("hash")?,
                })
            },
        )
        .optional()?)
    }

    async fn insert_audit(&mut self, record: &AuditRecord) -> Result<(), StoreError> {
        execute_cached(
            self.conn,
            &INSERT_AUDIT,
            params![
                to_i64(record.seq),
                record.ts,
                record.kind,
                record.call_id,
                record.principal,
                record.session_id,
                to_json_text(&record.data),
                record.prev_hash,
                record.hash,
            ],
        )?;
        Ok(())
    }

    async fn move_chain_head(&mut self, seq: u64, hash: &str) -> Result<(), StoreError> {
        execute_cached(
            self.conn,
            "UPDATE audit_head SET seq = ?1, hash = ?2 WHERE id = 1",
            params![to_i64(seq), hash],
        )?;
        Ok(())
    }

    async fn insert_call_row(
        &mut self,
        call: &NewCall,
        approval_id: Option<&ApprovalId>,
        outcome: Option<&CallOutcome>,
    ) -> Result<bool, StoreError> {
        let state = if outcome.is_some() {
            CallState::Finished
        } else {
            call.state
        };
        let inserted = execute_cached(
            self.conn,
            "INSERT INTO calls (call_id, tool_use_id, tool, input, principal, session_id, state, \
             approval_id, status, result, duration_ms, replica, created_at, finished_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
            params![
                call.call_id.as_str(),
                call.tool_use_id,
                call.tool,
                to_json_text(&call.input),
                call.principal,
                call.session_id,
                state.as_str(),
                approval_id.map(ApprovalId::as_str),
                outcome.map(|o| o.status.as_str()),
                outcome.map(|o| to_json_text(&o.result)),
                outcome.and_then(|o| o.duration_ms.map(to_i64)),
                outcome.and_then(|o| o.replica.as_deref()),
                call.created_at,
                outcome.map(|o| o.finished_at),
            ],
        );
        inserted_unless_taken(inserted)
    }

    async fn call_exists(&mut self, call_id: &CallId) -> Result<bool, StoreError> {
        call_exists(self.conn, call_id)
    }

    async fn call(&mut self, call_id: &CallId) -> Result<Option<StoredCall>, StoreError> {
        select_call(self.conn, call_id)
    }

    async fn call_owner(&mut self, call_id: &CallId) -> Result<Option<CallOwner>, StoreError> {
        Ok(query_row_cached(
            self.conn,
            "SELECT principal, session_id FROM calls WHERE call_id = ?1",
            [call_id.as_str()],
            |row| {
                Ok(CallOwner {
                    principal: row.get("principal")?,
                    session_id: row.get("session_id")?,
                })
            },
        )
        .optional()?)
    }

    async fn move_call(&mut self, mv: &CallMove<'_>) -> Result<bool, StoreError> {
        let mut binds = Binds::default();
        let sql = move_call_sql(mv, &mut binds);
        let changed = execute_cached(self.conn, &sql, params_from_iter(binds.0))?;
        Ok(changed == 1)
    }

    async fn call_ids(&mut self, filter: &CallFilter<'_>) -> Result<Vec<CallId>, StoreError> {
        let mut binds = Binds::default();
        let filter = filter_sql(filter, &mut binds)
            .map(|cond| format!(" WHERE {cond}"))
            .unwrap_or_default();
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT call_id FROM calls{filter} ORDER BY created_at ASC, call_id ASC"
        ))?;
        let rows = stmt.query_map(params_from_iter(binds.0), |row| {
            row.get::<_, String>("call_id")
        })?;
        let mut ids = Vec::new();
        for id in rows {
            ids.push(CallId::from(id?));
        }
        Ok(ids)
    }

    async fn insert_approval_row(
        &mut self,
        approval: &NewApproval,
        status: ApprovalStatus,
    ) -> Result<bool, StoreError> {
        let inserted = execute_cached(
            self.conn,
            "INSERT INTO approvals (approval_id, call_id, status, created_at, expires_at) \
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                approval.approval_id.as_str(),
                approval.call.call_id.as_str(),
                status.as_str(),
                approval.created_at,
                approval.expires_at
            ],
        );
        inserted_unless_taken(inserted)
    }

    async fn approval_for_update(
        &mut self,
        approval_id: &ApprovalId,
    ) -> Result<Option<ApprovalState>, StoreError> {
        // The write lock `BEGIN IMMEDIATE` took keeps other deciders out until commit.
        let found: Option<(String, String, Timestamp)> = query_row_cached(
            self.conn,
            "SELECT call_id, status, expires_at FROM approvals WHERE approval_id = ?1",
            [approval_id.as_str()],
            |row| {
                Ok((
                    row.get("call_id")?,
                    row.get("status")?,
                    row.get("expires_at")?,
                ))
            },
        )
        .optional()?;
        found
            .map(|(call_id, status, expires_at)| {
                Ok(ApprovalState {
                    call_id: CallId::from(call_id),
                    status: ApprovalStatus::parse(&status)?,
                    expires_at,
                })
            })
            .transpose()
    }

    async fn approval(&mut self, approval_id: &ApprovalId) -> Result<Option<Approval>, StoreError> {
        select_approval(self.conn, approval_id.as_str())
    }

    async fn approval_votes(
        &mut self,
        approval_id: &ApprovalId,
    ) -> Result<Vec<String>, StoreError> {
        select_votes(self.conn, approval_id.as_str())
    }

    async fn insert_approval_vote(
        &mut self,
        approval_id: &ApprovalId,
        approver: &str,
        input_sha256: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        execute_cached(
            self.conn,
            "INSERT INTO approval_votes (approval_id, approver, decided_at, input_sha256) \
             VALUES (?1, ?2, ?3, ?4)",
            params![approval_id.as_str(), approver, at, input_sha256],
        )?;
        Ok(())
    }

    async fn move_approval(&mut self, mv: &ApprovalMove<'_>) -> Result<bool, StoreError> {
        let changed = match mv.verdict {
            Some(verdict) => execute_cached(
                self.conn,
                "UPDATE approvals SET status = ?2, decided_by = ?3, reason = ?4, decided_at = ?5 \
                 WHERE approval_id = ?1 AND status = ?6",
                params![
                    mv.approval_id.as_str(),
                    mv.to.as_str(),
                    verdict.by,
                    verdict.reason,
                    mv.decided_at,
                    mv.from.as_str(),
                ],
            )?,
            None => execute_cached(
                self.conn,
                "UPDATE approvals SET status = ?2, decided_at = ?3 \
                 WHERE approval_id = ?1 AND status = ?4",
                params![
                    mv.approval_id.as_str(),
                    mv.to.as_str(),
                    mv.decided_at,
                    mv.from.as_str(),
                ],
            )?,
        };
        Ok(changed == 1)
    }

    async fn prune_results(&mut self, before: Timestamp) -> Result<u64, StoreError> {
        let mut binds = Binds::default();
        let sql = prune_results_sql(before, &mut binds);
        let changed = execute_cached(self.conn, &sql, params_from_iter(binds.0))?;
        Ok(u64::try_from(changed).unwrap_or(u64::MAX))
    }

    async fn sweep_approvals(
        &mut self,
        sweep: &Sweep,
    ) -> Result<Vec<(ApprovalId, CallId)>, StoreError> {
        let limit = i64::try_from(sweep.limit).unwrap_or(i64::MAX);
        // One statement under the write lock: a concurrent sweeper (another task or
        // process) waits for it and then finds these no longer in `from`.
        let mut stmt = self.conn.prepare(
            "UPDATE approvals SET status = ?1, decided_at = ?2 \
             WHERE status = ?3 AND approval_id IN (SELECT approval_id FROM \
             approvals WHERE status = ?3 AND expires_at <= ?4 \
             ORDER BY expires_at, approval_id LIMIT ?5) RETURNING approval_id, call_id",
        )?;
        let rows = stmt.query_map(
            params![
                sweep.to.as_str(),
                sweep.decided_at,
                sweep.from.as_str(),
                sweep.due_by,
                limit
            ],
            |row| {
                Ok((
                    row.get::<_, String>("approval_id")?,
                    row.get::<_, String>("call_id")?,
                ))
            },
        )?;
        let mut swept = Vec::new();
        for row in rows {
            let (approval_id, call_id) = row?;
            swept.push((ApprovalId::from(approval_id), CallId::from(call_id)));
        }
        Ok(swept)
    }

    async fn tool_pin(&mut self, tool: &str) -> Result<Option<ToolPin>, StoreError> {
        query_row_cached(
            self.conn,
            &format!("SELECT {PIN_COLUMNS} FROM tool_pins WHERE tool = ?1"),
            [tool],
            pin_from_row,
        )
        .optional()?
        .map(PinRow::into_pin)
        .transpose()
    }

    async fn put_tool_pin(&mut self, pin: &ToolPin) -> Result<(), StoreError> {
        let row = PinRow::from_pin(pin);
        execute_cached(
            self.conn,
            &format!(
                "INSERT OR REPLACE INTO tool_pins ({PIN_COLUMNS}) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)"
            ),
            params![
                row.tool,
                row.group,
                row.digest,
                row.definition,
                row.pinned_at,
                row.accepted_by,
                row.pending_group,
                row.pending_digest,
                row.pending_definition,
                row.pending_since,
            ],
        )?;
        Ok(())
    }
}

fn pin_from_row(row: &Row<'_>) -> rusqlite::Result<PinRow> {
    Ok(PinRow {
        tool: row.get("tool")?,
        group: row.get("tool_group")?,
        digest: row.get("digest")?,
        definition: row.get("definition")?,
        pinned_at: row.get("pinned_at")?,
        accepted_by: row.get("accepted_by")?,
        pending_group: row.get("pending_group")?,
        pending_digest: row.get("pending_digest")?,
        pending_definition: row.get("pending_definition")?,
        pending_since: row.get("pending_since")?,
    })
}

impl SqliteStore {
    /// Runs `work` in a `BEGIN IMMEDIATE` transaction and commits when it succeeds (an
    /// error rolls it back).
    async fn write<T, F>(&self, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut SqliteTx<'_>) -> Result<T, StoreError> + Send + 'static,
    {
        self.run(move |conn| {
            let tx = ImmediateTx::begin(conn)?;
            let answer = work(&mut SqliteTx { conn: tx.conn })?;
            tx.commit()?;
            Ok(answer)
        })
        .await
    }
}

/// A `BEGIN IMMEDIATE` transaction like rusqlite's, with its `BEGIN` and `COMMIT` taken
/// from the statement cache (rusqlite parses them anew for every transaction, a good
/// part of a call's store work). Dropped without a commit (an error, a failed commit or
/// a panic in between), it rolls back, as rusqlite's does.
struct ImmediateTx<'c> {
    conn: &'c Connection,
    committed: bool,
}

impl<'c> ImmediateTx<'c> {
    fn begin(conn: &'c Connection) -> rusqlite::Result<Self> {
        execute_cached(conn, "BEGIN IMMEDIATE", [])?;
        Ok(Self {
            conn,
            committed: false,
        })
    }

    fn commit(mut self) -> rusqlite::Result<()> {
        execute_cached(self.conn, "COMMIT", [])?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for ImmediateTx<'_> {
    fn drop(&mut self) {
        // After a failed statement SQLite may have rolled back already; then there is
        // nothing left to undo and the error says so.
        if !self.committed && !self.conn.is_autocommit() {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
    }
}

#[async_trait]
impl Store for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn append(&self, event: NewAuditEvent) -> Result<AuditRecord, StoreError> {
        self.write(move |tx| drive(machine::append(tx, event)))
            .await
    }

    async fn audit_page(&self, query: AuditQuery) -> Result<AuditPage, StoreError> {
        self.run(move |conn| {
            let (sql, values) = audit_page_sql(&query);
            let mut stmt = conn.prepare_cached(&sql)?;
            let limit = query.effective_limit();
            // One row past the page: whether it exists is whether more follow.
            let fetch = i64::try_from(limit + 1).unwrap_or(i64::MAX);
            let after = query.after.map_or(0, to_i64);
            let mut binds: Vec<Value> = vec![Value::Integer(after), Value::Integer(fetch)];
            binds.extend(values.iter().map(|v| Value::Text((*v).to_owned())));
            let rows = stmt.query_map(params_from_iter(binds), audit_from_row)?;
            let mut out = Vec::new();
            let mut bytes = 0usize;
            let mut more = false;
            for row in rows {
                let (seq, raw) = row?;
                // Rows are read one at a time: the page stops at its limit or its byte
                // budget, and a row it stops at is not parsed.
                bytes = bytes.saturating_add(raw.data.len());
                if out.len() == limit || (bytes > AuditQuery::PAGE_BYTES && !out.is_empty()) {
                    more = true;
                    break;
                }
                out.push(
                    raw.into_record(seq)
                        .map_err(|(_, reason)| StoreError::Corrupt(reason))?,
                );
            }
            if query.latest {
                out.reverse();
            }
            Ok(AuditPage { records: out, more })
        })
        .await
    }

    async fn verify(&self) -> Result<VerifyReport, StoreError> {
        run_on(&self.verifier, |conn| {
            // One read transaction: a consistent snapshot of head and records.
            let tx = conn.transaction_with_behavior(TransactionBehavior::Deferred)?;
            let head: Option<(i64, String)> = tx
                .query_row("SELECT seq, hash FROM audit_head WHERE id = 1", [], |row| {
                    Ok((row.get("seq")?, row.get("hash")?))
                })
                .optional()?;
            let head = head
                .map(|(seq, hash)| {
                    Ok::<_, StoreError>((to_u64(seq, "the audit head's seq")?, hash))
                })
                .transpose()?;
            let mut verifier = ChainVerifier::default();
            {
                let mut stmt = tx.prepare(&format!(
                    "SELECT {AUDIT_COLUMNS} FROM audit_events ORDER BY seq ASC"
                ))?;
                let rows = stmt.query_map([], audit_from_row)?;
                for row in rows {
                    let (seq, raw) = row?;
                    verifier.push(raw.into_record(seq));
                }
            }
            tx.finish()?;
            Ok(verifier.finish(head))
        })
        .await
    }

    async fn insert_call(&self, call: NewCall) -> Result<(), StoreError> {
        self.write(move |tx| drive(machine::insert_call(tx, &call, None)))
            .await
    }

    async fn get_call(&self, call_id: &CallId) -> Result<Option<StoredCall>, StoreError> {
        let call_id = call_id.clone();
        self.run(move |conn| select_call(conn, &call_id)).await
    }

    async fn finish_call(
        &self,
        call_id: &CallId,
        outcome: &CallOutcome,
    ) -> Result<bool, StoreError> {
        let call_id = call_id.clone();
        let outcome = outcome.clone();
        self.write(move |tx| drive(machine::finish_call(tx, &call_id, &outcome)))
            .await
    }

    async fn create_approval(&self, approval: NewApproval) -> Result<Approval, StoreError> {
        self.write(move |tx| drive(machine::create_approval(tx, &approval)))
            .await
    }

    async fn approvals_page(&self, query: &ApprovalQuery) -> Result<ApprovalPage, StoreError> {
        let query = query.clone();
        self.run(move |conn| {
            // One read transaction: the ids and the rows come from the same snapshot.
            let tx = conn.transaction_with_behavior(TransactionBehavior::Deferred)?;
            let ids = approval_page_ids(&tx, &query)?;
            let page = fill_page(ids, &query, |id| select_approval_sized(&tx, id))?;
            tx.finish()?;
            Ok(page)
        })
        .await
    }

    async fn get_approval(&self, approval_id: &ApprovalId) -> Result<Option<Approval>, StoreError> {
        let id = approval_id.clone();
        self.run(move |conn| select_approval(conn, id.as_str()))
            .await
    }

    async fn decide_approval(
        &self,
        approval_id: &ApprovalId,
        approve: bool,
        decided_by: &str,
        reason: Option<&str>,
        now: Timestamp,
    ) -> Result<Approval, StoreError> {
        let id = approval_id.clone();
        let decided_by = decided_by.to_owned();
        let reason = reason.map(str::to_owned);
        self.write(move |tx| {
            let verdict = Verdict {
                by: &decided_by,
                reason: reason.as_deref(),
            };
            drive(machine::decide_approval(tx, &id, approve, verdict, now))
        })
        .await?
    }

    async fn approve_approval(
        &self,
        approval_id: &ApprovalId,
        approver: &str,
        reason: Option<&str>,
        input_sha256: &str,
        quorum: u32,
        now: Timestamp,
    ) -> Result<Approval, StoreError> {
        let id = approval_id.clone();
        let approver = approver.to_owned();
        let reason = reason.map(str::to_owned);
        let input_sha256 = input_sha256.to_owned();
        self.write(move |tx| {
            let verdict = Verdict {
                by: &approver,
                reason: reason.as_deref(),
            };
            drive(machine::approve_approval(
                tx,
                &id,
                verdict,
                &input_sha256,
                quorum,
                now,
            ))
        })
        .await?
    }

    async fn withdraw_votes(
        &self,
        approval_id: &ApprovalId,
        approvers: &[String],
    ) -> Result<u64, StoreError> {
        let id = approval_id.as_str().to_owned();
        let approvers = approvers.to_vec();
        self.write(move |tx| {
            let mut taken = 0u64;
            for approver in &approvers {
                let n = tx.conn.execute(
                    "DELETE FROM approval_votes WHERE approval_id = ?1 AND approver = ?2 \
                     AND EXISTS (SELECT 1 FROM approvals \
                     WHERE approval_id = ?1 AND status = 'pending')",
                    params![id, approver],
                )?;
                taken += n as u64;
            }
            Ok(taken)
        })
        .await
    }

    async fn remember_approval(
        &self,
        remembered: &RememberedApproval,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let r = remembered.clone();
        self.write(move |tx| {
            tx.conn.execute(
                "DELETE FROM remembered_approvals WHERE expires_at <= ?1",
                [now],
            )?;
            tx.conn.execute(
                "INSERT OR REPLACE INTO remembered_approvals \
                 (principal, session_id, tool, input_sha256, approval_id, expires_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![
                    r.principal,
                    r.session_id,
                    r.tool,
                    r.input_sha256,
                    r.approval_id.as_str(),
                    r.expires_at
                ],
            )?;
            Ok(())
        })
        .await
    }

    async fn remembered_approval(
        &self,
        principal: &str,
        session_id: &str,
        tool: &str,
        input_sha256: &str,
        now: Timestamp,
    ) -> Result<Option<RememberedApproval>, StoreError> {
        let key = [principal, session_id, tool, input_sha256].map(str::to_owned);
        self.run(move |conn| {
            let found: Option<(String, Timestamp)> = conn
                .query_row(
                    "SELECT approval_id, expires_at FROM remembered_approvals \
                     WHERE principal = ?1 AND session_id = ?2 AND tool = ?3 \
                     AND input_sha256 = ?4 AND expires_at > ?5",
                    params![key[0], key[1], key[2], key[3], now],
                    |row| Ok((row.get(0)?, row.get(1)?)),
                )
                .optional()?;
            let [principal, session_id, tool, input_sha256] = key;
            Ok(found.map(|(approval_id, expires_at)| RememberedApproval {
                principal,
                session_id,
                tool,
                input_sha256,
                approval_id: ApprovalId::from(approval_id),
                expires_at,
            }))
        })
        .await
    }

    async fn claim_for_dispatch(
        &self,
        call_id: &CallId,
        claimant: &str,
        now: Timestamp,
        lease_until: Timestamp,
    ) -> Result<bool, StoreError> {
        let call_id = call_id.clone();
        let claimant = claimant.to_owned();
        self.write(move |tx| {
            drive(machine::claim_for_dispatch(
                tx,
                &call_id,
                &claimant,
                now,
                lease_until,
            ))
        })
        .await
    }

    async fn prune_results(&self, finished_before: Timestamp) -> Result<u64, StoreError> {
        // One statement: atomic on its own. A read first, so that a prune with nothing
        // to drop (at start, and most hours) takes no write lock and makes no commit.
        self.run(move |conn| {
            let due = conn
                .query_row(
                    RESULTS_DUE_SQL,
                    params![CallState::Finished.as_str(), finished_before],
                    |_| Ok(()),
                )
                .optional()?;
            if due.is_none() {
                return Ok(0);
            }
            let mut tx = SqliteTx { conn };
            drive(machine::prune_results(&mut tx, finished_before))
        })
        .await
    }

    async fn renew_lease(
        &self,
        call_id: &CallId,
        claimant: &str,
        lease_until: Timestamp,
    ) -> Result<bool, StoreError> {
        let call_id = call_id.clone();
        let claimant = claimant.to_owned();
        // One statement: atomic on its own, no transaction needed.
        self.run(move |conn| {
            let mut tx = SqliteTx { conn };
            drive(machine::renew_lease(
                &mut tx,
                &call_id,
                &claimant,
                lease_until,
            ))
        })
        .await
    }

    async fn resumable_calls(&self, now: Timestamp) -> Result<Vec<StoredCall>, StoreError> {
        self.run(move |conn| {
            // One read transaction: the ids and the rows come from the same snapshot.
            let tx = conn.transaction_with_behavior(TransactionBehavior::Deferred)?;
            let out = drive(machine::resumable_calls(&mut SqliteTx { conn: &tx }, now))?;
            tx.finish()?;
            Ok(out)
        })
        .await
    }

    async fn expire_approvals(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> Result<Vec<ExpiredApproval>, StoreError> {
        self.run(move |conn| {
            // Every replica sweeps every few seconds: when nothing is overdue (nearly
            // always) a read answers, and no write lock is taken nor commit made.
            if !any_overdue(conn, now)? {
                return Ok(Vec::new());
            }
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let expired = drive(machine::expire_approvals(
                &mut SqliteTx { conn: &tx },
                now,
                limit,
            ))?;
            tx.commit()?;
            Ok(expired)
        })
        .await
    }

    async fn write_call(&self, write: CallWrite) -> Result<bool, StoreError> {
        self.calls.write_call(write).await
    }

    async fn check_tool_pin(
        &self,
        tool: &str,
        seen: PinnedDefinition,
    ) -> Result<PinCheck, StoreError> {
        let tool = tool.to_owned();
        self.write(move |tx| drive(machine::check_tool_pin(tx, &tool, seen)))
            .await
    }

    async fn accept_tool_pin(
        &self,
        tool: &str,
        accepted_by: &str,
        reviewed: Option<&str>,
    ) -> Result<ToolPin, StoreError> {
        let (tool, by) = (tool.to_owned(), accepted_by.to_owned());
        let reviewed = reviewed.map(str::to_owned);
        self.write(move |tx| {
            drive(machine::accept_tool_pin(
                tx,
                &tool,
                &by,
                reviewed.as_deref(),
            ))
        })
        .await
    }

    async fn pending_approvals(&self) -> Result<u64, StoreError> {
        self.run(|conn| {
            let count: i64 = conn.query_row(
                "SELECT COUNT(*) FROM approvals WHERE status = ?1",
                [ApprovalStatus::Pending.as_str()],
                |row| row.get(0),
            )?;
            Ok(u64::try_from(count).unwrap_or(0))
        })
        .await
    }

    async fn recent_calls(&self, filter: &CallListFilter) -> Result<Vec<StoredCall>, StoreError> {
        let filter = filter.clone();
        self.run(move |conn| {
            let limit = i64::try_from(filter.limit.clamp(1, MAX_CALL_LIST)).unwrap_or(1);
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {CALL_COLUMNS} FROM calls WHERE (?1 IS NULL OR principal = ?1) \
                 AND (?2 IS NULL OR tool = ?2) AND (?3 IS NULL OR {CALL_LIST_STATUS} = ?3) \
                 ORDER BY created_at DESC, call_id DESC LIMIT ?4"
            ))?;
            let mut rows =
                stmt.query(params![filter.principal, filter.tool, filter.status, limit])?;
            let mut out = Vec::new();
            while let Some(row) = rows.next()? {
                out.push(call_from_row(row)?);
            }
            Ok(out)
        })
        .await
    }

    async fn tool_pins(&self) -> Result<Vec<ToolPin>, StoreError> {
        self.run(|conn| {
            let mut stmt = conn.prepare(&format!(
                "SELECT {PIN_COLUMNS} FROM tool_pins ORDER BY tool"
            ))?;
            let rows = stmt.query_map([], pin_from_row)?;
            let mut pins = Vec::new();
            for row in rows {
                pins.push(row?.into_pin()?);
            }
            Ok(pins)
        })
        .await
    }

    fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    async fn export_cursor(&self, exporter: &str) -> Result<Option<u64>, StoreError> {
        let exporter = exporter.to_owned();
        self.run(move |conn| {
            let seq: Option<i64> = conn
                .query_row(
                    "SELECT seq FROM audit_export_cursors WHERE exporter = ?1",
                    [exporter],
                    |row| row.get(0),
                )
                .optional()?;
            seq.map(|seq| to_u64(seq, "an export cursor")).transpose()
        })
        .await
    }

    async fn advance_export_cursor(
        &self,
        exporter: &str,
        seq: u64,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let exporter = exporter.to_owned();
        let seq = to_i64(seq);
        self.write(move |tx| {
            tx.conn.execute(
                "INSERT INTO audit_export_cursors (exporter, seq, updated_at) \
                 VALUES (?1, ?2, ?3) ON CONFLICT (exporter) DO UPDATE \
                 SET seq = MAX(seq, excluded.seq), updated_at = excluded.updated_at",
                params![exporter, seq, now],
            )?;
            Ok(())
        })
        .await
    }

    async fn session_usage(
        &self,
        principal: &str,
        session_id: &str,
    ) -> Result<SessionUsage, StoreError> {
        let principal = principal.to_owned();
        let session_id = session_id.to_owned();
        self.run(move |conn| {
            let (calls, first_at): (i64, Option<Timestamp>) =
                conn.query_row(SESSION_USAGE_SQL, params![principal, session_id], |row| {
                    Ok((row.get("calls")?, row.get("first_at")?))
                })?;
            Ok(SessionUsage {
                calls: to_u64(calls, "a call count")?,
                first_at,
            })
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::AuditKind;

    fn rows(conn: &Connection) -> i64 {
        conn.query_row("SELECT COUNT(*) FROM t", [], |row| row.get(0))
            .unwrap()
    }

    /// The column `column` of every row `sql` answers, as text. Parameters stay unbound
    /// (NULL), which is all `EXPLAIN QUERY PLAN` needs.
    fn texts(conn: &Connection, sql: &str, column: &str) -> Vec<String> {
        let mut stmt = conn.prepare(sql).unwrap();
        let mut rows = stmt.raw_query();
        let mut out = Vec::new();
        while let Some(row) = rows.next().unwrap() {
            out.push(row.get::<_, String>(column).unwrap());
        }
        out
    }

    /// Asserts that SQLite's plan for `sql` has a step containing `step`.
    fn assert_plan(conn: &Connection, sql: &str, step: &str) {
        let plan = texts(conn, &format!("EXPLAIN QUERY PLAN {sql}"), "detail");
        assert!(plan.iter().any(|d| d.contains(step)), "{sql}: {plan:?}");
    }

    /// A page of one call's or one session's events is read through that index (the
    /// console reads one call's for each pending approval on every view), never by
    /// walking the log from its start.
    #[test]
    fn a_filtered_audit_page_uses_its_index() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn).unwrap();
        let by = |session: Option<&str>, call: Option<&str>, latest: bool| AuditQuery {
            session_id: session.map(str::to_owned),
            call_id: call.map(str::to_owned),
            latest,
            ..AuditQuery::default()
        };
        for latest in [false, true] {
            let (sql, _) = audit_page_sql(&by(None, Some("c"), latest));
            assert_plan(&conn, &sql, "audit_events_call");
            let (sql, _) = audit_page_sql(&by(Some("s"), None, latest));
            assert_plan(&conn, &sql, "audit_events_session");
        }
    }

    fn call_indexes(conn: &Connection) -> Vec<String> {
        texts(
            conn,
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'calls'",
            "name",
        )
    }

    /// A verify reads through a connection of its own: while one holds its snapshot
    /// (as a verify of a long log does for as long as it reads), calls' writes go on,
    /// and the next verify, once that snapshot is released, sees them.
    #[tokio::test]
    async fn writes_go_on_while_a_verify_holds_its_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("airlock.db"))
            .await
            .unwrap();
        store
            .append(NewAuditEvent::new(
                AuditKind::Requested,
                serde_json::json!({"n": 1}),
            ))
            .await
            .unwrap();
        let verifier = Arc::clone(&store.verifier);
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let mut conn = verifier.lock().unwrap();
            let tx = conn.transaction().unwrap();
            let seen: i64 = tx
                .query_row("SELECT COUNT(*) FROM audit_events", [], |row| row.get(0))
                .unwrap();
            held_tx.send(seen).unwrap();
            release_rx.recv_timeout(Duration::from_secs(60)).unwrap();
            drop(tx);
        });
        assert_eq!(held_rx.recv_timeout(Duration::from_secs(60)).unwrap(), 1);
        for n in 2..=5 {
            tokio::time::timeout(
                Duration::from_secs(60),
                store.append(NewAuditEvent::new(
                    AuditKind::Requested,
                    serde_json::json!({"n": n}),
                )),
            )
            .await
            .expect("a write waited for the verify's snapshot")
            .unwrap();
        }
        release_tx.send(()).unwrap();
        holder.join().unwrap();
        let report = store.verify().await.unwrap();
        assert!(report.ok, "{report:?}");
        assert_eq!(report.records, 5);
    }

    /// A store as the first builds made it: schema version 1 and nothing added since.
    fn store_of_version_1() -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(&schema_v1("INTEGER")).unwrap();
        conn.execute_batch(
            "CREATE TABLE schema_version (version INTEGER NOT NULL); \
             INSERT INTO schema_version (version) VALUES (1);",
        )
        .unwrap();
        conn
    }

    /// The gate counts a session's calls before every call: from an index alone, never
    /// from the calls' rows, where `created_at` sits after the stored result and SQLite
    /// would walk each result's overflow pages to reach it. Also on a store made before
    /// the index existed, whose old index goes.
    #[test]
    fn a_sessions_usage_is_read_from_an_index_alone() {
        let covered = "USING COVERING INDEX calls_session_created";
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn).unwrap();
        assert_plan(&conn, SESSION_USAGE_SQL, covered);
        assert!(!call_indexes(&conn).contains(&"calls_session".to_owned()));

        // A store of an earlier build: schema version 1 with its index, none added since.
        let mut old = store_of_version_1();
        assert!(call_indexes(&old).contains(&"calls_session".to_owned()));
        migrate(&mut old).unwrap();
        assert_plan(&old, SESSION_USAGE_SQL, covered);
        assert!(!call_indexes(&old).contains(&"calls_session".to_owned()));
    }

    /// The statements on calls not yet finished — the claimable ones a restart resumes,
    /// a held approval's call — find them through `calls_open`, which holds no finished
    /// call: a finished call adds no state entry for its commit to write. Also on a store
    /// made before it, whose `calls_state` goes.
    #[test]
    fn open_calls_are_found_through_an_index_of_open_calls_alone() {
        use super::super::machine::{CallFilter, States};
        let fresh = || {
            let mut conn = Connection::open_in_memory().unwrap();
            migrate(&mut conn).unwrap();
            conn
        };
        let mut old = store_of_version_1();
        assert!(call_indexes(&old).contains(&"calls_state".to_owned()));
        migrate(&mut old).unwrap();
        let filters = [
            CallFilter::claimable(1_000),
            CallFilter::states(States::In(&[CallState::PendingApproval])),
            CallFilter::states(States::Not(CallState::Finished)),
        ];
        for conn in [fresh(), old] {
            let indexes = call_indexes(&conn);
            assert!(indexes.contains(&"calls_open".to_owned()), "{indexes:?}");
            assert!(!indexes.contains(&"calls_state".to_owned()), "{indexes:?}");
            for filter in &filters {
                let cond = super::filter_sql(filter, &mut Binds::default()).unwrap();
                let sql = format!("SELECT call_id FROM calls WHERE {cond}");
                assert_plan(&conn, &sql, "calls_open");
            }
            // A finished call, inserted as the gate records one, has no entry in it.
            conn.execute(
                "INSERT INTO calls (call_id, tool_use_id, tool, input, principal, state, \
                 created_at) VALUES ('done', 't', 'x', '{}', 'p', 'finished', 1), \
                 ('held', 't', 'x', '{}', 'p', 'approved', 1)",
                [],
            )
            .unwrap();
            let open: Vec<String> = texts(
                &conn,
                "SELECT state FROM calls INDEXED BY calls_open WHERE state <> 'finished'",
                "state",
            );
            assert_eq!(open, ["approved"]);
        }
    }

    /// The hourly prune finds the results due through the partial index of the calls
    /// whose results are still stored, both its check and its update: never by reading
    /// every finished call's row past its stored result.
    #[test]
    fn the_prune_finds_the_results_due_through_its_index() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn).unwrap();
        let update = super::prune_results_sql(1_000, &mut Binds::default());
        for sql in [RESULTS_DUE_SQL, &update] {
            assert_plan(
                &conn,
                sql,
                "USING INDEX calls_unpruned (state=? AND finished_at<?)",
            );
        }
    }

    /// The cached `BEGIN IMMEDIATE … COMMIT` keeps rusqlite's promise: what is not
    /// committed is rolled back, whether the work failed or panicked.
    #[test]
    fn an_uncommitted_transaction_is_rolled_back() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE t (x INTEGER)").unwrap();

        let tx = ImmediateTx::begin(&conn).unwrap();
        execute_cached(tx.conn, "INSERT INTO t VALUES (1)", []).unwrap();
        drop(tx);
        assert_eq!(rows(&conn), 0);
        assert!(conn.is_autocommit());

        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let tx = ImmediateTx::begin(&conn).unwrap();
            execute_cached(tx.conn, "INSERT INTO t VALUES (2)", []).unwrap();
            panic!("the work failed half-way");
        }));
        assert!(panicked.is_err());
        assert_eq!(rows(&conn), 0);
        assert!(conn.is_autocommit());

        // The same cached statements begin and commit the next transaction.
        for x in 3..5 {
            let tx = ImmediateTx::begin(&conn).unwrap();
            execute_cached(tx.conn, "INSERT INTO t VALUES (?1)", [x]).unwrap();
            tx.commit().unwrap();
        }
        assert_eq!(rows(&conn), 2);
        assert!(conn.is_autocommit());
    }
}
