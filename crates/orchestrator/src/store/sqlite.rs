//! The SQLite store: `<data_dir>/airlock.db`, WAL mode, one connection behind a
//! mutex, every statement on tokio's blocking pool. Writes start with
//! `BEGIN IMMEDIATE`, so they are serialized across tasks and across processes that
//! open the same file (they wait up to the busy timeout).

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rusqlite::{
    Connection, ErrorCode, OptionalExtension as _, Row, Transaction, TransactionBehavior, params,
};

use super::{
    APPROVAL_SELECT, AUDIT_COLUMNS, Approval, ApprovalId, ApprovalPage, ApprovalQuery,
    ApprovalStatus, AuditQuery, AuditRecord, CALL_COLUMNS, CallId, CallOutcome, CallState,
    ExpiredApproval, NewApproval, NewAuditEvent, NewCall, PAGING_INDEXES, SCHEMA_VERSION,
    SessionUsage, Store, StoreError, StoredCall, Timestamp, VerifyReport, decode_call_status,
    fill_page, from_json_text, now_millis, rfc3339, schema_v1, to_i64, to_json_text, to_u64,
};
use crate::audit::{ChainVerifier, GENESIS_HASH, chain_hash};

pub(super) struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
}

impl SqliteStore {
    pub(super) async fn open(path: &Path) -> Result<Self, StoreError> {
        let path = path.to_owned();
        let conn = tokio::task::spawn_blocking(move || open_blocking(&path))
            .await
            .map_err(|e| StoreError::Task(e.to_string()))??;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    /// Runs `f` with the connection on the blocking pool.
    async fn run<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let conn = Arc::clone(&self.conn);
        tokio::task::spawn_blocking(move || {
            let mut guard = conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            f(&mut guard)
        })
        .await
        .map_err(|e| StoreError::Task(e.to_string()))?
    }
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
    conn.busy_timeout(Duration::from_secs(15))
        .map_err(|e| open_err(e.to_string()))?;
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
    migrate(&mut conn)?;
    Ok(conn)
}

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
    tx.execute_batch(PAGING_INDEXES)?;
    tx.commit()?;
    Ok(())
}

fn is_unique_violation(err: &rusqlite::Error) -> bool {
    matches!(err, rusqlite::Error::SqliteFailure(e, _) if e.code == ErrorCode::ConstraintViolation)
}

fn head_missing() -> StoreError {
    StoreError::Corrupt(
        "the audit head anchor is missing (the log was tampered with); run `airlock audit verify`"
            .to_owned(),
    )
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
    Ok(Approval {
        approval_id: ApprovalId::from(row.get::<_, String>("approval_id")?),
        call_id: CallId::from(row.get::<_, String>("call_id")?),
        tool: row.get("tool")?,
        input: from_json_text(&input, "an approval's input")?,
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
            Ok(Some((approval_from_row(row)?, size)))
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
                    |row| row.get(0),
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
                    row.get(0)
                })?;
            rows.collect::<Result<Vec<String>, _>>()?
        }
        None => {
            let mut stmt = tx.prepare_cached(
                "SELECT approval_id FROM approvals WHERE (created_at, approval_id) > (?1, ?2)                  ORDER BY created_at ASC, approval_id ASC LIMIT ?3",
            )?;
            let rows = stmt.query_map(params![from_at, from_id, fetch], |row| row.get(0))?;
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

fn insert_call_row(
    tx: &Transaction<'_>,
    call: &NewCall,
    approval_id: Option<&ApprovalId>,
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO calls (call_id, tool_use_id, tool, input, principal, session_id, state, \
         approval_id, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![
            call.call_id.as_str(),
            call.tool_use_id,
            call.tool,
            to_json_text(&call.input),
            call.principal,
            call.session_id,
            call.state.as_str(),
            approval_id.map(ApprovalId::as_str),
            call.created_at,
        ],
    )
    .map_err(|e| {
        if is_unique_violation(&e) {
            StoreError::AlreadyExists {
                what: "call",
                id: call.call_id.to_string(),
            }
        } else {
            e.into()
        }
    })?;
    Ok(())
}

#[async_trait]
impl Store for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn append(&self, event: NewAuditEvent) -> Result<AuditRecord, StoreError> {
        self.run(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let (head_seq, prev_hash): (i64, String) = tx
                .query_row("SELECT seq, hash FROM audit_head WHERE id = 1", [], |row| {
                    Ok((row.get(0)?, row.get(1)?))
                })
                .optional()?
                .ok_or_else(head_missing)?;
            let seq = to_u64(head_seq, "the audit head's seq")? + 1;
            let ts = rfc3339(now_millis());
            let hash = chain_hash(
                &prev_hash,
                seq,
                &ts,
                event.kind.as_str(),
                event.call_id.as_deref(),
                event.principal.as_deref(),
                event.session_id.as_deref(),
                &event.data,
            );
            tx.execute(
                &format!(
                    "INSERT INTO audit_events ({AUDIT_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
                ),
                params![
                    to_i64(seq),
                    ts,
                    event.kind.as_str(),
                    event.call_id,
                    event.principal,
                    event.session_id,
                    to_json_text(&event.data),
                    prev_hash,
                    hash,
                ],
            )?;
            tx.execute(
                "UPDATE audit_head SET seq = ?1, hash = ?2 WHERE id = 1",
                params![to_i64(seq), hash],
            )?;
            tx.commit()?;
            Ok(AuditRecord {
                seq,
                ts,
                kind: event.kind.as_str().to_owned(),
                call_id: event.call_id,
                principal: event.principal,
                session_id: event.session_id,
                data: event.data,
                prev_hash,
                hash,
            })
        })
        .await
    }

    async fn audit(&self, query: AuditQuery) -> Result<Vec<AuditRecord>, StoreError> {
        self.run(move |conn| {
            let order = if query.latest { "DESC" } else { "ASC" };
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {AUDIT_COLUMNS} FROM audit_events \
                 WHERE (?1 IS NULL OR session_id = ?1) AND (?2 IS NULL OR call_id = ?2) \
                 AND seq > ?3 ORDER BY seq {order} LIMIT ?4"
            ))?;
            let limit = i64::try_from(query.effective_limit()).unwrap_or(i64::MAX);
            let after = query.after.map_or(0, to_i64);
            let rows = stmt.query_map(
                params![query.session_id, query.call_id, after, limit],
                audit_from_row,
            )?;
            let mut out = Vec::new();
            for row in rows {
                let (seq, raw) = row?;
                out.push(
                    raw.into_record(seq)
                        .map_err(|(_, reason)| StoreError::Corrupt(reason))?,
                );
            }
            if query.latest {
                out.reverse();
            }
            Ok(out)
        })
        .await
    }

    async fn verify(&self) -> Result<VerifyReport, StoreError> {
        self.run(|conn| {
            // One read transaction: a consistent snapshot of head and records.
            let tx = conn.transaction_with_behavior(TransactionBehavior::Deferred)?;
            let head: Option<(i64, String)> = tx
                .query_row("SELECT seq, hash FROM audit_head WHERE id = 1", [], |row| {
                    Ok((row.get(0)?, row.get(1)?))
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
        self.run(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            insert_call_row(&tx, &call, None)?;
            tx.commit()?;
            Ok(())
        })
        .await
    }

    async fn get_call(&self, call_id: &CallId) -> Result<Option<StoredCall>, StoreError> {
        let call_id = call_id.clone();
        self.run(move |conn| {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {CALL_COLUMNS} FROM calls WHERE call_id = ?1"
            ))?;
            let mut rows = stmt.query([call_id.as_str()])?;
            match rows.next()? {
                Some(row) => Ok(Some(call_from_row(row)?)),
                None => Ok(None),
            }
        })
        .await
    }

    async fn finish_call(
        &self,
        call_id: &CallId,
        outcome: &CallOutcome,
    ) -> Result<bool, StoreError> {
        let call_id = call_id.clone();
        let outcome = outcome.clone();
        self.run(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let changed = tx.execute(
                "UPDATE calls SET state = 'finished', status = ?2, result = ?3, duration_ms = ?4, \
                 replica = ?5, finished_at = ?6 WHERE call_id = ?1 AND state <> 'finished'",
                params![
                    call_id.as_str(),
                    outcome.status.as_str(),
                    to_json_text(&outcome.result),
                    outcome.duration_ms.map(to_i64),
                    outcome.replica,
                    outcome.finished_at,
                ],
            )?;
            if changed == 0 && !call_exists(&tx, &call_id)? {
                return Err(StoreError::NotFound {
                    what: "call",
                    id: call_id.to_string(),
                });
            }
            tx.commit()?;
            Ok(changed == 1)
        })
        .await
    }

    async fn create_approval(&self, approval: NewApproval) -> Result<Approval, StoreError> {
        self.run(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let id = approval.approval_id.clone();
            let call = &approval.call;
            if call_exists(&tx, &call.call_id)? {
                tx.execute(
                    "UPDATE calls SET state = 'pending_approval', approval_id = ?2 WHERE call_id = ?1",
                    params![call.call_id.as_str(), id.as_str()],
                )?;
            } else {
                let mut pending = call.clone();
                pending.state = CallState::PendingApproval;
                insert_call_row(&tx, &pending, Some(&id))?;
            }
            tx.execute(
                "INSERT INTO approvals (approval_id, call_id, status, created_at, expires_at) \
                 VALUES (?1, ?2, 'pending', ?3, ?4)",
                params![
                    id.as_str(),
                    call.call_id.as_str(),
                    approval.created_at,
                    approval.expires_at
                ],
            )
            .map_err(|e| {
                if is_unique_violation(&e) {
                    StoreError::AlreadyExists {
                        what: "approval",
                        id: id.to_string(),
                    }
                } else {
                    e.into()
                }
            })?;
            let created = select_approval(&tx, &id)?.ok_or_else(|| StoreError::NotFound {
                what: "approval",
                id: id.to_string(),
            })?;
            tx.commit()?;
            Ok(created)
        })
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
        self.run(move |conn| select_approval(conn, &id)).await
    }

    async fn decide_approval(
        &self,
        approval_id: &ApprovalId,
        approve: bool,
        decided_by: &str,
        reason: Option<&str>,
        now: Timestamp,
    ) -> Result<Approval, StoreError> {
        let id = approval_id.to_string();
        let decided_by = decided_by.to_owned();
        let reason = reason.map(str::to_owned);
        self.run(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let found: Option<(String, String, Timestamp)> = tx
                .query_row(
                    "SELECT call_id, status, expires_at FROM approvals WHERE approval_id = ?1",
                    [&id],
                    |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)),
                )
                .optional()?;
            let Some((call_id, status, expires_at)) = found else {
                return Err(StoreError::NotFound {
                    what: "approval",
                    id,
                });
            };
            let status = ApprovalStatus::parse(&status)?;
            if status != ApprovalStatus::Pending {
                return Err(StoreError::AlreadyDecided { id, status });
            }
            if expires_at <= now {
                tx.execute(
                    "UPDATE approvals SET status = 'expired', decided_at = ?2 \
                     WHERE approval_id = ?1 AND status = 'pending'",
                    params![id, now],
                )?;
                tx.execute(
                    "UPDATE calls SET state = 'rejected' WHERE call_id = ?1 AND state = 'pending_approval'",
                    [&call_id],
                )?;
                tx.commit()?;
                return Err(StoreError::Expired { id });
            }
            let (new_status, new_state) = if approve {
                (ApprovalStatus::Approved, CallState::Approved)
            } else {
                (ApprovalStatus::Denied, CallState::Rejected)
            };
            tx.execute(
                "UPDATE approvals SET status = ?2, decided_by = ?3, reason = ?4, decided_at = ?5 \
                 WHERE approval_id = ?1 AND status = 'pending'",
                params![id, new_status.as_str(), decided_by, reason, now],
            )?;
            tx.execute(
                "UPDATE calls SET state = ?2 WHERE call_id = ?1 AND state = 'pending_approval'",
                params![call_id, new_state.as_str()],
            )?;
            let decided = select_approval(&tx, &id)?.ok_or_else(|| StoreError::NotFound {
                what: "approval",
                id: id.clone(),
            })?;
            tx.commit()?;
            Ok(decided)
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
        self.run(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let changed = tx.execute(
                "UPDATE calls SET state = 'dispatched', claimed_by = ?2, lease_until = ?3 \
                 WHERE call_id = ?1 AND (state = 'approved' OR (state = 'dispatched' \
                 AND (lease_until IS NULL OR lease_until <= ?4)))",
                params![call_id.as_str(), claimant, lease_until, now],
            )?;
            if changed == 0 && !call_exists(&tx, &call_id)? {
                return Err(StoreError::NotFound {
                    what: "call",
                    id: call_id.to_string(),
                });
            }
            tx.commit()?;
            Ok(changed == 1)
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
        self.run(move |conn| {
            let changed = conn.execute(
                "UPDATE calls SET lease_until = ?3 \
                 WHERE call_id = ?1 AND state = 'dispatched' AND claimed_by = ?2",
                params![call_id.as_str(), claimant, lease_until],
            )?;
            Ok(changed == 1)
        })
        .await
    }

    async fn resumable_calls(&self, now: Timestamp) -> Result<Vec<StoredCall>, StoreError> {
        self.run(move |conn| {
            // Ids first, then each row: the sort never holds a call's input.
            let tx = conn.transaction_with_behavior(TransactionBehavior::Deferred)?;
            let ids: Vec<String> = {
                let mut stmt = tx.prepare_cached(
                    "SELECT call_id FROM calls WHERE state = 'approved' OR (state = 'dispatched' \
                     AND (lease_until IS NULL OR lease_until <= ?1)) ORDER BY created_at ASC, call_id ASC",
                )?;
                let rows = stmt.query_map([now], |row| row.get(0))?;
                rows.collect::<Result<_, _>>()?
            };
            let mut out = Vec::with_capacity(ids.len());
            {
                let mut stmt = tx.prepare_cached(&format!(
                    "SELECT {CALL_COLUMNS} FROM calls WHERE call_id = ?1"
                ))?;
                for id in &ids {
                    let mut rows = stmt.query([id])?;
                    if let Some(row) = rows.next()? {
                        out.push(call_from_row(row)?);
                    }
                }
            }
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
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.run(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let ids: Vec<String> = {
                let mut stmt = tx.prepare(
                    "UPDATE approvals SET status = 'expired', decided_at = ?1 \
                     WHERE status = 'pending' AND approval_id IN (SELECT approval_id FROM \
                     approvals WHERE status = 'pending' AND expires_at <= ?1 \
                     ORDER BY expires_at, approval_id LIMIT ?2) RETURNING approval_id",
                )?;
                let rows = stmt.query_map(params![now, limit], |row| row.get(0))?;
                rows.collect::<Result<_, _>>()?
            };
            let mut out = Vec::with_capacity(ids.len());
            for id in &ids {
                tx.execute(
                    "UPDATE calls SET state = 'rejected' WHERE state = 'pending_approval' \
                     AND call_id = (SELECT call_id FROM approvals WHERE approval_id = ?1)",
                    [id],
                )?;
                let expired = tx.query_row(
                    "SELECT a.approval_id, a.call_id, c.principal, c.session_id \
                     FROM approvals a JOIN calls c ON c.call_id = a.call_id \
                     WHERE a.approval_id = ?1",
                    [id],
                    |row| {
                        Ok(ExpiredApproval {
                            approval_id: ApprovalId::from(row.get::<_, String>("approval_id")?),
                            call_id: CallId::from(row.get::<_, String>("call_id")?),
                            principal: row.get("principal")?,
                            session_id: row.get("session_id")?,
                        })
                    },
                )?;
                out.push(expired);
            }
            tx.commit()?;
            Ok(out)
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
            let (calls, first_at): (i64, Option<Timestamp>) = conn.query_row(
                "SELECT COUNT(*), MIN(created_at) FROM calls WHERE principal = ?1 AND session_id = ?2",
                params![principal, session_id],
                |row| Ok((row.get(0)?, row.get(1)?)),
            )?;
            Ok(SessionUsage {
                calls: to_u64(calls, "a call count")?,
                first_at,
            })
        })
        .await
    }
}
