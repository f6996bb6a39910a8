//! The PostgreSQL store, shared by several orchestrator replicas.
//!
//! Appends lock the single `audit_head` row (`SELECT … FOR UPDATE`) for the length of
//! their transaction, so concurrent writers from any replica append one after the
//! other and the chain stays linear and dense. Approval decisions lock the approval
//! row; dispatch claims and expiry are single conditional `UPDATE`s, which PostgreSQL
//! re-checks after a concurrent writer commits, so exactly one replica wins each.
//! Connections are plain TCP or Unix-socket, or TLS with `sslmode=verify-full` and
//! `sslrootcert=` in the url (airlock_tls::postgres; no fallback to plaintext).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use airlock_tls::postgres::{PgTls, PgTlsError, PgUrl, error_chain};
use async_trait::async_trait;
use deadpool_postgres::GenericClient;
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use tokio_postgres::config::Host;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{IsolationLevel, NoTls, Row};

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

/// `pg_advisory_xact_lock` key that serializes schema creation across replicas.
/// Records read per round trip by `verify`.
const VERIFY_PAGE: i64 = 5000;

const MIGRATION_LOCK: i64 = 0x6169_726c_6f63_6b01; // "airlock" + 1

pub(super) struct PostgresStore {
    pool: Pool,
    /// Write transactions committed (see [`Store::commits`]).
    commits: AtomicU64,
}

/// `host:port` list of a config, for messages (never the password).
fn endpoint_of(config: &tokio_postgres::Config) -> String {
    let ports = config.get_ports();
    let port_at = |i: usize| {
        ports
            .get(i)
            .or_else(|| ports.first())
            .copied()
            .unwrap_or(5432)
    };
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| match host {
            Host::Tcp(name) => format!("{name}:{}", port_at(i)),
            Host::Unix(dir) => format!("{}/.s.PGSQL.{}", dir.display(), port_at(i)),
        })
        .collect();
    if hosts.is_empty() {
        format!("localhost:{}", port_at(0))
    } else {
        hosts.join(",")
    }
}

impl PostgresStore {
    pub(super) async fn open(url: &str, password: Option<String>) -> Result<Self, StoreError> {
        let PgUrl { mut config, tls } = airlock_tls::postgres::parse(url).map_err(|e| match e {
            PgTlsError::Url(message) => StoreError::InvalidUrl(message),
            other => StoreError::Tls(other),
        })?;
        if let Some(password) = password {
            config.password(password);
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(10));
        }
        if config.get_application_name().is_none() {
            config.application_name("airlock-orchestrator");
        }
        let endpoint = endpoint_of(&config);
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let manager = match tls {
            PgTls::Plaintext => Manager::from_config(config, NoTls, manager_config),
            PgTls::VerifyFull(rustls) => Manager::from_config(config, rustls, manager_config),
        };
        let pool = Pool::builder(manager)
            .max_size(16)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(Duration::from_secs(30)))
            .create_timeout(Some(Duration::from_secs(15)))
            .build()
            .map_err(|e| StoreError::Pool(e.to_string()))?;
        let mut client = pool.get().await.map_err(|e| {
            let (cause, tls) = match &e {
                deadpool_postgres::PoolError::Backend(err) => match err.as_db_error() {
                    Some(db) => (db.message().to_owned(), false),
                    // tokio-postgres' "error performing TLS handshake: …"
                    None => (error_chain(err), err.to_string().contains("TLS")),
                },
                other => (other.to_string(), false),
            };
            if tls {
                StoreError::TlsHandshake { endpoint, cause }
            } else {
                StoreError::Unreachable { endpoint, cause }
            }
        })?;
        migrate(&mut client).await?;
        drop(client);
        Ok(Self {
            pool,
            commits: AtomicU64::new(0),
        })
    }

    /// Counts one committed write transaction when `answer` says it committed.
    fn counted<T>(&self, answer: Result<T, StoreError>) -> Result<T, StoreError> {
        self.counted_if(answer, |_| true)
    }

    /// Counts a single statement that committed and, by `wrote`, changed a row: one that
    /// matched none wrote nothing (PostgreSQL gives it no transaction id and logs no
    /// commit).
    fn counted_if<T>(
        &self,
        answer: Result<T, StoreError>,
        wrote: impl FnOnce(&T) -> bool,
    ) -> Result<T, StoreError> {
        if answer.as_ref().is_ok_and(wrote) {
            self.commits.fetch_add(1, Ordering::Relaxed);
        }
        answer
    }

    async fn client(&self) -> Result<Object, StoreError> {
        self.pool.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Backend(err) => StoreError::Postgres(err),
            other => StoreError::Pool(other.to_string()),
        })
    }
}

async fn migrate(client: &mut Object) -> Result<(), StoreError> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)")
        .await?;
    let version: Option<i64> = tx
        .query_one("SELECT MAX(version) FROM schema_version", &[])
        .await?
        .get(0);
    match version {
        None => {
            tx.batch_execute(&schema_v1("BIGINT")).await?;
            tx.execute(
                "INSERT INTO audit_head (id, seq, hash) VALUES (1, 0, $1)",
                &[&GENESIS_HASH],
            )
            .await?;
            tx.execute(
                "INSERT INTO schema_version (version) VALUES ($1)",
                &[&SCHEMA_VERSION],
            )
            .await?;
        }
        Some(found) if found > SCHEMA_VERSION => {
            return Err(StoreError::SchemaTooNew {
                found,
                supported: SCHEMA_VERSION,
            });
        }
        Some(_) => {}
    }
    // Under the migration lock, so replicas starting together do not race to create them.
    tx.batch_execute(ADDED_INDEXES).await?;
    tx.batch_execute(&added_tables("BIGINT")).await?;
    tx.commit().await?;
    Ok(())
}

fn is_unique_violation(err: &tokio_postgres::Error) -> bool {
    err.code() == Some(&SqlState::UNIQUE_VIOLATION)
}

/// An insert's outcome: `Ok(true)` when it inserted, `Ok(false)` when the row's key was
/// taken, the error otherwise.
fn inserted_unless_taken<T>(
    inserted: Result<T, tokio_postgres::Error>,
) -> Result<bool, StoreError> {
    match inserted {
        Ok(_) => Ok(true),
        Err(e) if is_unique_violation(&e) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The most audit rows fetched per round trip while a page is read; fewer as the page's
/// byte budget fills.
const AUDIT_FETCH_ROWS: i32 = 64;
/// Rows of a page's first round trip, before any row's size is known: two events of the
/// largest arguments (4 MiB) stay within the page's budget.
const AUDIT_FIRST_FETCH_ROWS: i32 = 2;

fn audit_from_row(row: &Row) -> Result<AuditRecord, (u64, String)> {
    let seq: i64 = row
        .try_get("seq")
        .map_err(|e| (0, format!("unreadable audit row: {e}")))?;
    let seq_u = u64::try_from(seq).map_err(|_| (0, format!("record {seq} has a negative seq")))?;
    let bad = |e: tokio_postgres::Error| (seq_u, format!("record {seq_u} is unreadable: {e}"));
    let data: String = row.try_get("data").map_err(bad)?;
    let data = serde_json::from_str(&data).map_err(|_| {
        (
            seq_u,
            format!("record {seq_u} holds data that is not valid json"),
        )
    })?;
    Ok(AuditRecord {
        seq: seq_u,
        ts: row.try_get("ts").map_err(bad)?,
        kind: row.try_get("kind").map_err(bad)?,
        call_id: row.try_get("call_id").map_err(bad)?,
        principal: row.try_get("principal").map_err(bad)?,
        session_id: row.try_get("session_id").map_err(bad)?,
        data,
        prev_hash: row.try_get("prev_hash").map_err(bad)?,
        hash: row.try_get("hash").map_err(bad)?,
    })
}

fn call_from_row(row: &Row) -> Result<StoredCall, StoreError> {
    let input: String = row.try_get("input")?;
    let state: String = row.try_get("state")?;
    let result: Option<String> = row.try_get("result")?;
    let duration_ms: Option<i64> = row.try_get("duration_ms")?;
    let approval_id: Option<String> = row.try_get("approval_id")?;
    Ok(StoredCall {
        call_id: CallId::from(row.try_get::<_, String>("call_id")?),
        tool_use_id: row.try_get("tool_use_id")?,
        tool: row.try_get("tool")?,
        input: from_json_text(&input, "a call's input")?,
        principal: row.try_get("principal")?,
        session_id: row.try_get("session_id")?,
        state: CallState::parse(&state)?,
        approval_id: approval_id.map(ApprovalId::from),
        status: decode_call_status(row.try_get("status")?)?,
        result: result
            .map(|r| from_json_text(&r, "a call's result"))
            .transpose()?,
        duration_ms: duration_ms
            .map(|d| to_u64(d, "a call's duration"))
            .transpose()?,
        replica: row.try_get("replica")?,
        claimed_by: row.try_get("claimed_by")?,
        lease_until: row.try_get("lease_until")?,
        created_at: row.try_get("created_at")?,
        finished_at: row.try_get("finished_at")?,
    })
}

fn approval_from_row(row: &Row) -> Result<Approval, StoreError> {
    let input: String = row.try_get("input")?;
    let status: String = row.try_get("status")?;
    let input = from_json_text(&input, "an approval's input")?;
    Ok(Approval {
        input_sha256: crate::audit::value_sha256(&input),
        approved_by: Vec::new(),
        approval_id: ApprovalId::from(row.try_get::<_, String>("approval_id")?),
        call_id: CallId::from(row.try_get::<_, String>("call_id")?),
        tool: row.try_get("tool")?,
        input,
        principal: row.try_get("principal")?,
        session_id: row.try_get("session_id")?,
        status: ApprovalStatus::parse(&status)?,
        created_at: row.try_get("created_at")?,
        expires_at: row.try_get("expires_at")?,
        decided_by: row.try_get("decided_by")?,
        reason: row.try_get("reason")?,
        decided_at: row.try_get("decided_at")?,
    })
}

async fn select_approval<C: GenericClient>(
    client: &C,
    id: &str,
) -> Result<Option<Approval>, StoreError> {
    let row = client
        .query_opt(
            &format!("{APPROVAL_SELECT} WHERE a.approval_id = $1"),
            &[&id],
        )
        .await?;
    match row {
        Some(row) => {
            let mut approval = approval_from_row(&row)?;
            approval.approved_by = select_votes(client, id).await?;
            Ok(Some(approval))
        }
        None => Ok(None),
    }
}

/// Who approved an approval so far, in the order they did.
async fn select_votes<C: GenericClient>(client: &C, id: &str) -> Result<Vec<String>, StoreError> {
    let rows = client
        .query(
            "SELECT approver FROM approval_votes WHERE approval_id = $1 ORDER BY decided_at, approver",
            &[&id],
        )
        .await?;
    rows.iter()
        .map(|row| row.try_get::<_, String>(0).map_err(StoreError::from))
        .collect()
}

/// An approval and the size of its stored input.
async fn select_approval_sized<C: GenericClient>(
    client: &C,
    id: &str,
) -> Result<Option<(Approval, usize)>, StoreError> {
    let row = client
        .query_opt(
            &format!("{APPROVAL_SELECT} WHERE a.approval_id = $1"),
            &[&id],
        )
        .await?;
    match row {
        Some(row) => {
            let input: &str = row.try_get("input")?;
            let size = input.len();
            let mut approval = approval_from_row(&row)?;
            approval.approved_by = select_votes(client, id).await?;
            Ok(Some((approval, size)))
        }
        None => Ok(None),
    }
}

/// The ids of a page of approvals, in index order, `limit + 1` of them.
async fn approval_page_ids<C: GenericClient>(
    client: &C,
    query: &ApprovalQuery,
) -> Result<Vec<String>, StoreError> {
    let (from_at, from_id) = match &query.after {
        Some(id) => {
            let row = client
                .query_opt(
                    "SELECT created_at FROM approvals WHERE approval_id = $1",
                    &[id],
                )
                .await?
                .ok_or_else(|| StoreError::NotFound {
                    what: "approval",
                    id: id.clone(),
                })?;
            let at: Timestamp = row.try_get("created_at")?;
            (at, id.clone())
        }
        None => (Timestamp::MIN, String::new()),
    };
    let fetch = i64::try_from(query.effective_limit() + 1).unwrap_or(i64::MAX);
    // Two statements rather than `$1 IS NULL OR status = $1`, which no index serves.
    let rows =
        match query.status {
            Some(status) => {
                client
                    .query(
                        "SELECT approval_id FROM approvals WHERE status = $1 \
                     AND (created_at, approval_id) > ($2, $3) \
                     ORDER BY created_at ASC, approval_id ASC LIMIT $4",
                        &[&status.as_str(), &from_at, &from_id, &fetch],
                    )
                    .await?
            }
            None => client
                .query(
                    "SELECT approval_id FROM approvals WHERE (created_at, approval_id) > ($1, $2) \
                     ORDER BY created_at ASC, approval_id ASC LIMIT $3",
                    &[&from_at, &from_id, &fetch],
                )
                .await?,
        };
    rows.iter()
        .map(|row| row.try_get("approval_id").map_err(StoreError::from))
        .collect()
}

async fn call_exists<C: GenericClient>(client: &C, call_id: &CallId) -> Result<bool, StoreError> {
    Ok(client
        .query_opt(
            "SELECT 1 FROM calls WHERE call_id = $1",
            &[&call_id.as_str()],
        )
        .await?
        .is_some())
}

async fn select_call<C: GenericClient>(
    client: &C,
    call_id: &CallId,
) -> Result<Option<StoredCall>, StoreError> {
    let row = client
        .query_opt(
            &format!("SELECT {CALL_COLUMNS} FROM calls WHERE call_id = $1"),
            &[&call_id.as_str()],
        )
        .await?;
    row.as_ref().map(call_from_row).transpose()
}

/// A statement parameter built from a move.
type Bind = Box<dyn ToSql + Sync + Send>;

/// Parameters of a statement built from a move, numbered `$1`, `$2`, … as bound.
#[derive(Default)]
struct Binds(Vec<Bind>);

impl Binds {
    /// Binds `value` and answers its placeholder.
    fn bind(&mut self, value: impl ToSql + Sync + Send + 'static) -> String {
        self.push(Box::new(value))
    }

    fn push(&mut self, value: Bind) -> String {
        self.0.push(value);
        format!("${}", self.0.len())
    }

    fn refs(&self) -> Vec<&(dyn ToSql + Sync)> {
        self.0
            .iter()
            .map(|bind| &**bind as &(dyn ToSql + Sync))
            .collect()
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

/// The [`Tx`] primitives on a transaction, or on a pooled connection where a method of
/// the store runs single statements, each atomic on its own (as it did before the state
/// machine moved to [`machine`]).
struct PgTx<'a, C> {
    client: &'a C,
}

impl<C: GenericClient> Tx for PgTx<'_, C> {
    async fn chain_head(&mut self) -> Result<Option<ChainHead>, StoreError> {
        // The row lock serializes appenders of every replica until commit.
        let row = self
            .client
            .query_opt(
                "SELECT seq, hash FROM audit_head WHERE id = 1 FOR UPDATE",
                &[],
            )
            .await?;
        row.map(|row| {
            Ok(ChainHead {
                seq: row.try_get("seq")?,
                hash: row.try_get("hash")?,
            })
        })
        .transpose()
    }

    async fn insert_audit(&mut self, record: &AuditRecord) -> Result<(), StoreError> {
        self.client
            .execute(
                &format!(
                    "INSERT INTO audit_events ({AUDIT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
                ),
                &[
                    &to_i64(record.seq),
                    &record.ts,
                    &record.kind,
                    &record.call_id,
                    &record.principal,
                    &record.session_id,
                    &to_json_text(&record.data),
                    &record.prev_hash,
                    &record.hash,
                ],
            )
            .await?;
        Ok(())
    }

    async fn move_chain_head(&mut self, seq: u64, hash: &str) -> Result<(), StoreError> {
        self.client
            .execute(
                "UPDATE audit_head SET seq = $1, hash = $2 WHERE id = 1",
                &[&to_i64(seq), &hash],
            )
            .await?;
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
        let inserted = self
            .client
            .execute(
                "INSERT INTO calls (call_id, tool_use_id, tool, input, principal, session_id, state, \
                 approval_id, status, result, duration_ms, replica, created_at, finished_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
                &[
                    &call.call_id.as_str(),
                    &call.tool_use_id,
                    &call.tool,
                    &to_json_text(&call.input),
                    &call.principal,
                    &call.session_id,
                    &state.as_str(),
                    &approval_id.map(ApprovalId::as_str),
                    &outcome.map(|o| o.status.as_str()),
                    &outcome.map(|o| to_json_text(&o.result)),
                    &outcome.and_then(|o| o.duration_ms.map(to_i64)),
                    &outcome.and_then(|o| o.replica.as_deref()),
                    &call.created_at,
                    &outcome.map(|o| o.finished_at),
                ],
            )
            .await;
        inserted_unless_taken(inserted)
    }

    async fn call_exists(&mut self, call_id: &CallId) -> Result<bool, StoreError> {
        call_exists(self.client, call_id).await
    }

    async fn call(&mut self, call_id: &CallId) -> Result<Option<StoredCall>, StoreError> {
        select_call(self.client, call_id).await
    }

    async fn call_owner(&mut self, call_id: &CallId) -> Result<Option<CallOwner>, StoreError> {
        let row = self
            .client
            .query_opt(
                "SELECT principal, session_id FROM calls WHERE call_id = $1",
                &[&call_id.as_str()],
            )
            .await?;
        row.map(|row| {
            Ok(CallOwner {
                principal: row.try_get("principal")?,
                session_id: row.try_get("session_id")?,
            })
        })
        .transpose()
    }

    async fn move_call(&mut self, mv: &CallMove<'_>) -> Result<bool, StoreError> {
        let mut binds = Binds::default();
        let sql = move_call_sql(mv, &mut binds);
        let changed = self.client.execute(sql.as_str(), &binds.refs()).await?;
        Ok(changed == 1)
    }

    async fn call_ids(&mut self, filter: &CallFilter<'_>) -> Result<Vec<CallId>, StoreError> {
        let mut binds = Binds::default();
        let filter = filter_sql(filter, &mut binds)
            .map(|cond| format!(" WHERE {cond}"))
            .unwrap_or_default();
        let rows = self
            .client
            .query(
                &format!("SELECT call_id FROM calls{filter} ORDER BY created_at ASC, call_id ASC"),
                &binds.refs(),
            )
            .await?;
        rows.iter()
            .map(|row| Ok(CallId::from(row.try_get::<_, String>("call_id")?)))
            .collect()
    }

    async fn insert_approval_row(
        &mut self,
        approval: &NewApproval,
        status: ApprovalStatus,
    ) -> Result<bool, StoreError> {
        let inserted = self
            .client
            .execute(
                "INSERT INTO approvals (approval_id, call_id, status, created_at, expires_at) \
                 VALUES ($1, $2, $3, $4, $5)",
                &[
                    &approval.approval_id.as_str(),
                    &approval.call.call_id.as_str(),
                    &status.as_str(),
                    &approval.created_at,
                    &approval.expires_at,
                ],
            )
            .await;
        inserted_unless_taken(inserted)
    }

    async fn approval_for_update(
        &mut self,
        approval_id: &ApprovalId,
    ) -> Result<Option<ApprovalState>, StoreError> {
        // The row lock makes concurrent deciders (of any replica) wait for this one.
        let row = self
            .client
            .query_opt(
                "SELECT call_id, status, expires_at FROM approvals WHERE approval_id = $1 FOR UPDATE",
                &[&approval_id.as_str()],
            )
            .await?;
        row.map(|row| {
            let status: String = row.try_get("status")?;
            Ok(ApprovalState {
                call_id: CallId::from(row.try_get::<_, String>("call_id")?),
                status: ApprovalStatus::parse(&status)?,
                expires_at: row.try_get("expires_at")?,
            })
        })
        .transpose()
    }

    async fn approval(&mut self, approval_id: &ApprovalId) -> Result<Option<Approval>, StoreError> {
        select_approval(self.client, approval_id.as_str()).await
    }

    async fn approval_votes(
        &mut self,
        approval_id: &ApprovalId,
    ) -> Result<Vec<String>, StoreError> {
        select_votes(self.client, approval_id.as_str()).await
    }

    async fn insert_approval_vote(
        &mut self,
        approval_id: &ApprovalId,
        approver: &str,
        input_sha256: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        self.client
            .execute(
                "INSERT INTO approval_votes (approval_id, approver, decided_at, input_sha256) \
                 VALUES ($1, $2, $3, $4)",
                &[&approval_id.as_str(), &approver, &at, &input_sha256],
            )
            .await?;
        Ok(())
    }

    async fn move_approval(&mut self, mv: &ApprovalMove<'_>) -> Result<bool, StoreError> {
        let changed = match mv.verdict {
            Some(verdict) => {
                self.client
                    .execute(
                        "UPDATE approvals SET status = $2, decided_by = $3, reason = $4, \
                         decided_at = $5 WHERE approval_id = $1 AND status = $6",
                        &[
                            &mv.approval_id.as_str(),
                            &mv.to.as_str(),
                            &verdict.by,
                            &verdict.reason,
                            &mv.decided_at,
                            &mv.from.as_str(),
                        ],
                    )
                    .await?
            }
            None => {
                self.client
                    .execute(
                        "UPDATE approvals SET status = $2, decided_at = $3 \
                         WHERE approval_id = $1 AND status = $4",
                        &[
                            &mv.approval_id.as_str(),
                            &mv.to.as_str(),
                            &mv.decided_at,
                            &mv.from.as_str(),
                        ],
                    )
                    .await?
            }
        };
        Ok(changed == 1)
    }

    async fn prune_results(&mut self, before: Timestamp) -> Result<u64, StoreError> {
        let mut binds = Binds::default();
        let sql = prune_results_sql(before, &mut binds);
        Ok(self.client.execute(sql.as_str(), &binds.refs()).await?)
    }

    async fn sweep_approvals(
        &mut self,
        sweep: &Sweep,
    ) -> Result<Vec<(ApprovalId, CallId)>, StoreError> {
        let limit = i64::try_from(sweep.limit).unwrap_or(i64::MAX);
        // SKIP LOCKED: sweeping replicas take disjoint batches instead of queueing.
        let rows = self
            .client
            .query(
                "UPDATE approvals SET status = $1, decided_at = $2 \
                 WHERE status = $3 AND approval_id IN (SELECT approval_id FROM \
                 approvals WHERE status = $3 AND expires_at <= $4 \
                 ORDER BY expires_at, approval_id LIMIT $5 FOR UPDATE SKIP LOCKED) \
                 RETURNING approval_id, call_id",
                &[
                    &sweep.to.as_str(),
                    &sweep.decided_at,
                    &sweep.from.as_str(),
                    &sweep.due_by,
                    &limit,
                ],
            )
            .await?;
        rows.iter()
            .map(|row| {
                Ok((
                    ApprovalId::from(row.try_get::<_, String>("approval_id")?),
                    CallId::from(row.try_get::<_, String>("call_id")?),
                ))
            })
            .collect()
    }

    async fn tool_pin(&mut self, tool: &str) -> Result<Option<ToolPin>, StoreError> {
        self.client
            .query_opt(
                &format!("SELECT {PIN_COLUMNS} FROM tool_pins WHERE tool = $1"),
                &[&tool],
            )
            .await?
            .map(|row| pin_from_row(&row)?.into_pin())
            .transpose()
    }

    async fn put_tool_pin(&mut self, pin: &ToolPin) -> Result<(), StoreError> {
        let row = PinRow::from_pin(pin);
        self.client
            .execute(
                &format!(
                    "INSERT INTO tool_pins ({PIN_COLUMNS}) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
                     ON CONFLICT (tool) DO UPDATE SET tool_group = EXCLUDED.tool_group, \
                     digest = EXCLUDED.digest, definition = EXCLUDED.definition, \
                     pinned_at = EXCLUDED.pinned_at, accepted_by = EXCLUDED.accepted_by, \
                     pending_group = EXCLUDED.pending_group, \
                     pending_digest = EXCLUDED.pending_digest, \
                     pending_definition = EXCLUDED.pending_definition, \
                     pending_since = EXCLUDED.pending_since"
                ),
                &[
                    &row.tool,
                    &row.group,
                    &row.digest,
                    &row.definition,
                    &row.pinned_at,
                    &row.accepted_by,
                    &row.pending_group,
                    &row.pending_digest,
                    &row.pending_definition,
                    &row.pending_since,
                ],
            )
            .await?;
        Ok(())
    }
}

fn pin_from_row(row: &Row) -> Result<PinRow, StoreError> {
    Ok(PinRow {
        tool: row.try_get("tool")?,
        group: row.try_get("tool_group")?,
        digest: row.try_get("digest")?,
        definition: row.try_get("definition")?,
        pinned_at: row.try_get("pinned_at")?,
        accepted_by: row.try_get("accepted_by")?,
        pending_group: row.try_get("pending_group")?,
        pending_digest: row.try_get("pending_digest")?,
        pending_definition: row.try_get("pending_definition")?,
        pending_since: row.try_get("pending_since")?,
    })
}

#[async_trait]
impl Store for PostgresStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    async fn check_tool_pin(
        &self,
        tool: &str,
        seen: PinnedDefinition,
    ) -> Result<PinCheck, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let check = machine::check_tool_pin(&mut PgTx { client: &tx }, tool, seen).await?;
        self.counted(tx.commit().await.map_err(StoreError::from))?;
        Ok(check)
    }

    async fn accept_tool_pin(
        &self,
        tool: &str,
        accepted_by: &str,
        reviewed: Option<&str>,
    ) -> Result<ToolPin, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let pin = machine::accept_tool_pin(&mut PgTx { client: &tx }, tool, accepted_by, reviewed)
            .await?;
        self.counted(tx.commit().await.map_err(StoreError::from))?;
        Ok(pin)
    }

    async fn pending_approvals(&self) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_one(
                "SELECT COUNT(*) FROM approvals WHERE status = $1",
                &[&ApprovalStatus::Pending.as_str()],
            )
            .await?;
        let count: i64 = row.try_get(0)?;
        Ok(u64::try_from(count).unwrap_or(0))
    }

    async fn recent_calls(&self, filter: &CallListFilter) -> Result<Vec<StoredCall>, StoreError> {
        let client = self.client().await?;
        let limit = i64::try_from(filter.limit.clamp(1, MAX_CALL_LIST)).unwrap_or(1);
        let rows = client
            .query(
                &format!(
                    "SELECT {CALL_COLUMNS} FROM calls WHERE ($1::text IS NULL OR principal = $1::text) \
                     AND ($2::text IS NULL OR tool = $2::text) \
                     AND ($3::text IS NULL OR {CALL_LIST_STATUS} = $3::text) \
                     ORDER BY created_at DESC, call_id DESC LIMIT $4"
                ),
                &[&filter.principal, &filter.tool, &filter.status, &limit],
            )
            .await?;
        rows.iter().map(call_from_row).collect()
    }

    async fn tool_pins(&self) -> Result<Vec<ToolPin>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                &format!("SELECT {PIN_COLUMNS} FROM tool_pins ORDER BY tool"),
                &[],
            )
            .await?;
        rows.iter()
            .map(|row| pin_from_row(row)?.into_pin())
            .collect()
    }

    async fn append(&self, event: NewAuditEvent) -> Result<AuditRecord, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let record = machine::append(&mut PgTx { client: &tx }, event).await?;
        self.counted(tx.commit().await.map_err(StoreError::from))?;
        Ok(record)
    }

    async fn audit_page(&self, query: AuditQuery) -> Result<AuditPage, StoreError> {
        let mut client = self.client().await?;
        let order = if query.latest { "DESC" } else { "ASC" };
        let limit = query.effective_limit();
        // One row past the page: whether it exists is whether more follow.
        let fetch_limit = i64::try_from(limit + 1).unwrap_or(i64::MAX);
        let after = query.after.map_or(0, to_i64);
        let (filters, values) = query.filters(3, |n| format!("${n}::text"));
        let sql = format!(
            "SELECT {AUDIT_COLUMNS} FROM audit_events \
             WHERE seq > $1{filters} ORDER BY seq {order} LIMIT $2"
        );
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&after, &fetch_limit];
        params.extend(values.iter().map(|v| v as &(dyn ToSql + Sync)));
        // Through a portal, a few rows at a time, so that the page stops at its byte
        // budget without the rest of the rows ever being sent.
        let tx = client.transaction().await?;
        let statement = tx.prepare_cached(&sql).await?;
        let portal = tx.bind(&statement, &params).await?;
        let mut out = Vec::new();
        let mut bytes = 0usize;
        let mut largest = 0usize;
        let mut more = false;
        'page: loop {
            // As many rows as the budget left holds at the largest size seen so far: a
            // batch of 64 events of 4 MiB each would be 256 MiB in one round trip.
            let fetch = match largest {
                0 => AUDIT_FIRST_FETCH_ROWS,
                largest => {
                    let left = AuditQuery::PAGE_BYTES.saturating_sub(bytes) / largest;
                    i32::try_from(left)
                        .unwrap_or(AUDIT_FETCH_ROWS)
                        .clamp(1, AUDIT_FETCH_ROWS)
                }
            };
            let rows = tx.query_portal(&portal, fetch).await?;
            if rows.is_empty() {
                break;
            }
            for row in &rows {
                let size = row.try_get::<_, &str>("data").map_or(0, str::len);
                largest = largest.max(size);
                bytes = bytes.saturating_add(size);
                if out.len() == limit || (bytes > AuditQuery::PAGE_BYTES && !out.is_empty()) {
                    more = true;
                    break 'page;
                }
                out.push(audit_from_row(row).map_err(|(_, reason)| StoreError::Corrupt(reason))?);
            }
        }
        tx.commit().await?;
        if query.latest {
            out.reverse();
        }
        Ok(AuditPage { records: out, more })
    }

    async fn verify(&self) -> Result<VerifyReport, StoreError> {
        let mut client = self.client().await?;
        // One snapshot for the anchor and every page of records.
        let tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await?;
        let head = tx
            .query_opt("SELECT seq, hash FROM audit_head WHERE id = 1", &[])
            .await?;
        let head = match head {
            Some(row) => {
                let seq: i64 = row.try_get("seq")?;
                Some((to_u64(seq, "the audit head's seq")?, row.try_get("hash")?))
            }
            None => None,
        };
        let mut verifier = ChainVerifier::default();
        let mut after = i64::MIN;
        loop {
            let rows = tx
                .query(
                    &format!(
                        "SELECT {AUDIT_COLUMNS} FROM audit_events WHERE seq > $1 \
                         ORDER BY seq ASC LIMIT $2"
                    ),
                    &[&after, &VERIFY_PAGE],
                )
                .await?;
            let Some(last) = rows.last() else { break };
            after = last.try_get("seq")?;
            let full = i64::try_from(rows.len()).unwrap_or(i64::MAX) == VERIFY_PAGE;
            for row in &rows {
                verifier.push(audit_from_row(row));
            }
            if !full {
                break;
            }
        }
        tx.commit().await?;
        Ok(verifier.finish(head))
    }

    async fn insert_call(&self, call: NewCall) -> Result<(), StoreError> {
        let client = self.client().await?;
        self.counted(machine::insert_call(&mut PgTx { client: &client }, &call, None).await)
    }

    async fn get_call(&self, call_id: &CallId) -> Result<Option<StoredCall>, StoreError> {
        let client = self.client().await?;
        select_call(&client, call_id).await
    }

    async fn finish_call(
        &self,
        call_id: &CallId,
        outcome: &CallOutcome,
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        self.counted_if(
            machine::finish_call(&mut PgTx { client: &client }, call_id, outcome).await,
            |finished| *finished,
        )
    }

    async fn create_approval(&self, approval: NewApproval) -> Result<Approval, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let created = machine::create_approval(&mut PgTx { client: &tx }, &approval).await?;
        self.counted(tx.commit().await.map_err(StoreError::from))?;
        Ok(created)
    }

    async fn approvals_page(&self, query: &ApprovalQuery) -> Result<ApprovalPage, StoreError> {
        let mut client = self.client().await?;
        // One snapshot for the ids and the rows.
        let tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await?;
        let ids = approval_page_ids(&tx, query).await?;
        let limit = query.effective_limit();
        // `fill_page` fetches synchronously; here the rows are fetched first, one at a
        // time and by the same rule (up to the first that would not fit), then handed
        // over in order.
        let mut fetched = Vec::new();
        let (mut bytes, mut listed) = (0usize, 0usize);
        for id in ids.iter().take(limit) {
            let found = select_approval_sized(&tx, id).await?;
            let size = found.as_ref().map(|(_, size)| *size);
            fetched.push(found);
            if let Some(size) = size {
                if listed > 0 && bytes.saturating_add(size) > query.max_bytes {
                    break;
                }
                bytes = bytes.saturating_add(size);
                listed += 1;
            }
        }
        tx.commit().await?;
        let mut fetched = fetched.into_iter();
        fill_page(ids, query, |_| Ok(fetched.next().flatten()))
    }

    async fn get_approval(&self, approval_id: &ApprovalId) -> Result<Option<Approval>, StoreError> {
        let client = self.client().await?;
        select_approval(&client, approval_id.as_str()).await
    }

    async fn decide_approval(
        &self,
        approval_id: &ApprovalId,
        approve: bool,
        decided_by: &str,
        reason: Option<&str>,
        now: Timestamp,
    ) -> Result<Approval, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let verdict = Verdict {
            by: decided_by,
            reason,
        };
        let answer = machine::decide_approval(
            &mut PgTx { client: &tx },
            approval_id,
            approve,
            verdict,
            now,
        )
        .await?;
        self.counted(tx.commit().await.map_err(StoreError::from))?;
        answer
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
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let verdict = Verdict {
            by: approver,
            reason,
        };
        let answer = machine::approve_approval(
            &mut PgTx { client: &tx },
            approval_id,
            verdict,
            input_sha256,
            quorum,
            now,
        )
        .await?;
        self.counted(tx.commit().await.map_err(StoreError::from))?;
        answer
    }

    async fn withdraw_votes(
        &self,
        approval_id: &ApprovalId,
        approvers: &[String],
    ) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let taken = client
            .execute(
                "DELETE FROM approval_votes WHERE approval_id = $1 AND approver = ANY($2) \
                 AND EXISTS (SELECT 1 FROM approvals \
                 WHERE approval_id = $1 AND status = 'pending')",
                &[&approval_id.as_str(), &approvers],
            )
            .await
            .map_err(StoreError::from);
        self.counted_if(taken, |n| *n > 0)
    }

    async fn remember_approval(
        &self,
        remembered: &RememberedApproval,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let r = remembered;
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        tx.execute(
            "DELETE FROM remembered_approvals WHERE expires_at <= $1",
            &[&now],
        )
        .await?;
        tx.execute(
            "INSERT INTO remembered_approvals \
             (principal, session_id, tool, input_sha256, approval_id, expires_at) \
             VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (principal, session_id, tool, input_sha256) \
             DO UPDATE SET approval_id = EXCLUDED.approval_id, expires_at = EXCLUDED.expires_at",
            &[
                &r.principal,
                &r.session_id,
                &r.tool,
                &r.input_sha256,
                &r.approval_id.as_str(),
                &r.expires_at,
            ],
        )
        .await?;
        self.counted(tx.commit().await.map_err(StoreError::from))
    }

    async fn remembered_approval(
        &self,
        principal: &str,
        session_id: &str,
        tool: &str,
        input_sha256: &str,
        now: Timestamp,
    ) -> Result<Option<RememberedApproval>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                "SELECT approval_id, expires_at FROM remembered_approvals \
                 WHERE principal = $1 AND session_id = $2 AND tool = $3 \
                 AND input_sha256 = $4 AND expires_at > $5",
                &[&principal, &session_id, &tool, &input_sha256, &now],
            )
            .await?;
        row.map(|row| {
            Ok(RememberedApproval {
                principal: principal.to_owned(),
                session_id: session_id.to_owned(),
                tool: tool.to_owned(),
                input_sha256: input_sha256.to_owned(),
                approval_id: ApprovalId::from(row.try_get::<_, String>("approval_id")?),
                expires_at: row.try_get("expires_at")?,
            })
        })
        .transpose()
    }

    async fn claim_for_dispatch(
        &self,
        call_id: &CallId,
        claimant: &str,
        now: Timestamp,
        lease_until: Timestamp,
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let mut tx = PgTx { client: &client };
        self.counted_if(
            machine::claim_for_dispatch(&mut tx, call_id, claimant, now, lease_until).await,
            |claimed| *claimed,
        )
    }

    async fn prune_results(&self, finished_before: Timestamp) -> Result<u64, StoreError> {
        let client = self.client().await?;
        self.counted_if(
            machine::prune_results(&mut PgTx { client: &client }, finished_before).await,
            |pruned| *pruned > 0,
        )
    }

    async fn renew_lease(
        &self,
        call_id: &CallId,
        claimant: &str,
        lease_until: Timestamp,
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        self.counted_if(
            machine::renew_lease(
                &mut PgTx { client: &client },
                call_id,
                claimant,
                lease_until,
            )
            .await,
            |renewed| *renewed,
        )
    }

    async fn resumable_calls(&self, now: Timestamp) -> Result<Vec<StoredCall>, StoreError> {
        let client = self.client().await?;
        machine::resumable_calls(&mut PgTx { client: &client }, now).await
    }

    async fn expire_approvals(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> Result<Vec<ExpiredApproval>, StoreError> {
        let mut client = self.client().await?;
        // Every replica sweeps every few seconds: when nothing is overdue (nearly
        // always) one read answers, and no transaction is counted as a write.
        let due = client
            .query_opt(
                "SELECT 1 FROM approvals WHERE status = 'pending' AND expires_at <= $1 LIMIT 1",
                &[&now],
            )
            .await?;
        if due.is_none() {
            return Ok(Vec::new());
        }
        let tx = client.transaction().await?;
        let expired = machine::expire_approvals(&mut PgTx { client: &tx }, now, limit).await?;
        self.counted(tx.commit().await.map_err(StoreError::from))?;
        Ok(expired)
    }

    async fn write_call(&self, write: CallWrite) -> Result<bool, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let applied = machine::write_call(&mut PgTx { client: &tx }, write).await?;
        self.counted(tx.commit().await.map_err(StoreError::from))?;
        Ok(applied)
    }

    fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    async fn export_cursor(&self, exporter: &str) -> Result<Option<u64>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                "SELECT seq FROM audit_export_cursors WHERE exporter = $1",
                &[&exporter],
            )
            .await?;
        row.map(|row| {
            let seq: i64 = row.try_get(0)?;
            to_u64(seq, "an export cursor")
        })
        .transpose()
    }

    async fn advance_export_cursor(
        &self,
        exporter: &str,
        seq: u64,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let client = self.client().await?;
        let seq = to_i64(seq);
        let written = client
            .execute(
                "INSERT INTO audit_export_cursors (exporter, seq, updated_at) \
                 VALUES ($1, $2, $3) ON CONFLICT (exporter) DO UPDATE \
                 SET seq = GREATEST(audit_export_cursors.seq, EXCLUDED.seq), \
                 updated_at = EXCLUDED.updated_at",
                &[&exporter, &seq, &now],
            )
            .await
            .map_err(StoreError::from);
        self.counted(written.map(|_| ()))
    }

    async fn session_usage(
        &self,
        principal: &str,
        session_id: &str,
    ) -> Result<SessionUsage, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_one(SESSION_USAGE_SQL, &[&principal, &session_id])
            .await?;
        let calls: i64 = row.try_get("calls")?;
        Ok(SessionUsage {
            calls: to_u64(calls, "a call count")?,
            first_at: row.try_get("first_at")?,
        })
    }
}

/// The PostgreSQL server the tests below start (tests/support/postgres.rs).
#[cfg(test)]
#[path = "../../../../tests/support/postgres.rs"]
mod test_server;

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan PostgreSQL makes for `sql` with `params`, as text. Sequential scans are
    /// priced out (`enable_seqscan = off`): an empty table would be scanned whatever
    /// its indexes, and what is asked here is whether the statement can use its index
    /// at all.
    async fn plan(
        client: &tokio_postgres::Client,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> String {
        let rows = client
            .query(format!("EXPLAIN {sql}").as_str(), params)
            .await
            .unwrap_or_else(|e| panic!("EXPLAIN {sql}: {e}"));
        rows.iter()
            .map(|row| row.get::<_, String>(0))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The statements that must not read every call's row, on PostgreSQL as on SQLite
    /// (whose plans `store::sqlite`'s tests pin): the session usage the gate reads
    /// before every call, through `calls_session_created`, and the hourly prune,
    /// through the partial index `calls_unpruned` — which PostgreSQL uses only when the
    /// statement repeats the index's condition (`result IS NOT NULL`).
    #[tokio::test]
    async fn the_hot_statements_use_their_indexes() {
        let url = tokio::task::spawn_blocking(|| {
            test_server::create_database(&test_server::unique_name("airlock_plans"))
        })
        .await
        .unwrap();
        // Opening the store creates the schema and its indexes.
        let _store = super::super::open(&url, std::path::Path::new("/nonexistent"), None)
            .await
            .unwrap();
        let (client, connection) = tokio_postgres::connect(&url, NoTls).await.unwrap();
        tokio::spawn(connection);
        client
            .batch_execute("SET enable_seqscan = off")
            .await
            .unwrap();

        let usage = plan(&client, SESSION_USAGE_SQL, &[&"alice", &"s1"]).await;
        assert!(usage.contains("calls_session_created"), "{usage}");

        let mut binds = Binds::default();
        let prune = prune_results_sql(1_000, &mut binds);
        let prune_plan = plan(&client, &prune, &binds.refs()).await;
        assert!(prune_plan.contains("calls_unpruned"), "{prune_plan}");

        // The check fails where it should: without the index's condition the partial
        // index cannot answer the prune.
        let unconditioned = prune.replace(" AND result IS NOT NULL", "");
        assert_ne!(unconditioned, prune);
        let other = plan(&client, &unconditioned, &binds.refs()).await;
        assert!(!other.contains("calls_unpruned"), "{other}");

        // Calls to resume, through the index of calls not finished.
        let mut binds = Binds::default();
        let claimable = super::filter_sql(&CallFilter::claimable(1_000), &mut binds).unwrap();
        let sql = format!("SELECT call_id FROM calls WHERE {claimable}");
        let open = plan(&client, &sql, &binds.refs()).await;
        assert!(open.contains("calls_open"), "{open}");
        let indexes: Vec<String> = client
            .query(
                "SELECT indexname FROM pg_indexes WHERE tablename = 'calls'",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        assert!(!indexes.contains(&"calls_state".to_owned()), "{indexes:?}");
    }
}
