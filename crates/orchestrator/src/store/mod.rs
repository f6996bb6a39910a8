//! Durable state shared by the gate: the hash-chained audit log, calls (a small state
//! machine that survives an orchestrator restart) and approvals.
//!
//! One trait, [`Store`], two implementations chosen by [`open`]:
//!
//! - `"sqlite"` (the embedded default): `<data_dir>/airlock.db`, WAL mode, one
//!   connection behind a mutex, every statement on tokio's blocking pool; writes take
//!   the database lock up front (`BEGIN IMMEDIATE`), so many tasks — and even several
//!   processes on the same file — keep the audit chain linear.
//! - `"postgres://user@host:port/db"`: a connection pool; several orchestrator replicas
//!   share one database. Appends lock the `audit_head` row (`SELECT … FOR UPDATE`) so
//!   concurrent writers keep the chain linear and dense; approval decisions and
//!   dispatch claims are compare-and-set updates, so exactly one replica wins.
//!
//! The state machine below and the audit seal are written once, in `machine`, over
//! the row operations each engine supplies (its `Tx`); the engines keep their SQL and
//! their locking.
//!
//! # Call states
//!
//! ```text
//! pending_approval ──decide(approve)──▶ approved ──claim_for_dispatch──▶ dispatched ──finish_call──▶ finished
//!        │                                  ▲                              │
//!        └─decide(deny) / expire─▶ rejected  └── lease expired: claim again ┘
//! ```
//!
//! A call that needs no approval is inserted `approved` and claimed at once, in one
//! transaction ([`CallChange::InsertClaimed`]), or, if it changes nothing, inserted
//! `finished` when it ends ([`CallChange::InsertFinished`]). A restarted orchestrator
//! asks [`Store::resumable_calls`] for approved calls nobody claimed and for dispatched
//! calls whose lease ran out, claims each, and dispatches it again with the *same*
//! `call_id` (workers deduplicate by `call_id`).
//!
//! # Time
//!
//! [`Timestamp`] is Unix time in milliseconds (UTC). Methods that depend on the clock
//! take `now` from the caller, so tests can move time; [`now_millis`] gives the real
//! one and [`rfc3339`] formats one for the wire.

mod ids;
mod machine;
mod postgres;
mod sql;
mod sqlite;

use std::path::Path;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use airlock_policy::CallStatus;
use async_trait::async_trait;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;

pub use self::ids::{ApprovalId, CallId, fresh_id};
pub use crate::audit::{AuditPage, AuditQuery, AuditRecord, NewAuditEvent, VerifyReport};

/// The tables of schema version 1, with `{int}` standing for the engine's 64-bit integer
/// type (`INTEGER` in SQLite, where `INTEGER PRIMARY KEY` is the rowid, `BIGINT` in
/// PostgreSQL).
const SCHEMA_V1_TEMPLATE: &str = "
CREATE TABLE IF NOT EXISTS audit_events (
    seq        {int} PRIMARY KEY,
    ts         TEXT NOT NULL,
    kind       TEXT NOT NULL,
    call_id    TEXT,
    principal  TEXT,
    session_id TEXT,
    data       TEXT NOT NULL,
    prev_hash  TEXT NOT NULL,
    hash       TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_events_session ON audit_events (session_id, seq);
CREATE INDEX IF NOT EXISTS audit_events_call ON audit_events (call_id, seq);
CREATE TABLE IF NOT EXISTS audit_head (
    id   INTEGER PRIMARY KEY CHECK (id = 1),
    seq  {int} NOT NULL,
    hash TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS calls (
    call_id     TEXT PRIMARY KEY,
    tool_use_id TEXT NOT NULL,
    tool        TEXT NOT NULL,
    input       TEXT NOT NULL,
    principal   TEXT NOT NULL,
    session_id  TEXT,
    state       TEXT NOT NULL,
    approval_id TEXT,
    status      TEXT,
    result      TEXT,
    duration_ms {int},
    replica     TEXT,
    claimed_by  TEXT,
    lease_until {int},
    created_at  {int} NOT NULL,
    finished_at {int}
);
CREATE INDEX IF NOT EXISTS calls_state ON calls (state);
CREATE INDEX IF NOT EXISTS calls_session ON calls (principal, session_id);
CREATE TABLE IF NOT EXISTS approvals (
    approval_id TEXT PRIMARY KEY,
    call_id     TEXT NOT NULL REFERENCES calls (call_id),
    status      TEXT NOT NULL,
    created_at  {int} NOT NULL,
    expires_at  {int} NOT NULL,
    decided_by  TEXT,
    reason      TEXT,
    decided_at  {int}
);
CREATE INDEX IF NOT EXISTS approvals_status ON approvals (status, created_at);
";

/// Indexes added after schema version 1 was pinned, created (if missing) at every open.
/// They change no table, so a store that has them still opens with older builds.
///
/// `GET /v1/approvals` reads a page's ids from the paging indexes in order (with or
/// without a status filter) and never sorts rows that carry call inputs.
///
/// `calls_session_created` answers [`SESSION_USAGE_SQL`], which the gate runs before
/// every call, from the index alone. Through `calls_session` it read each of the
/// session's rows, and a row's `created_at` comes after its `result`: SQLite walked the
/// overflow pages of every stored result (up to `[store] max_result_bytes`) to reach it
/// — 3.3 ms a call in a session of 389 calls with 64 KiB results, growing with the
/// session. The new index starts with the old one's columns, so it serves every query
/// that used `calls_session`, which is dropped (one index fewer to write per call).
///
/// `calls_unpruned` holds the calls whose stored result has not been pruned yet
/// (`result IS NOT NULL`, a condition every statement meant to use it must contain), by
/// state and `finished_at`: the hourly prune (`[store] retention_days`) finds the
/// results due in it alone. Through `calls_state` it read every finished
/// call's row, again past its stored result to `finished_at`: the whole store, every
/// hour. (Keyed by state too, so that SQLite's planner, which has no statistics,
/// prefers it to `calls_state` for `state = 'finished' AND finished_at < ?`.)
///
/// `calls_open` indexes by state only the calls not finished — those a restart resumes,
/// a lapsed claim hands over, an approval holds —, which is what every statement on a
/// call's state looks for (the prune goes through `calls_unpruned`). Through
/// `calls_state`, every call added an entry for `finished`, which nothing ever read: a
/// page written to the WAL by every call's commit. A statement that means to use it
/// repeats its condition (`state <> 'finished'`, in `sql::filter_sql`), since SQLite
/// does not infer it from `state = 'approved'`.
pub(super) const ADDED_INDEXES: &str = "
CREATE INDEX IF NOT EXISTS approvals_page ON approvals (created_at, approval_id);
CREATE INDEX IF NOT EXISTS approvals_status_page ON approvals (status, created_at, approval_id);
CREATE INDEX IF NOT EXISTS calls_created ON calls (created_at);
CREATE INDEX IF NOT EXISTS calls_session_created ON calls (principal, session_id, created_at);
DROP INDEX IF EXISTS calls_session;
CREATE INDEX IF NOT EXISTS calls_unpruned ON calls (state, finished_at) WHERE result IS NOT NULL;
CREATE INDEX IF NOT EXISTS calls_open ON calls (state) WHERE state <> 'finished';
DROP INDEX IF EXISTS calls_state;
";

/// How many calls a session has had and when its first came (`[budgets]
/// max_calls_per_session`, `session_wall_time_seconds`); `$1` the principal, `$2` the
/// session (SQLite numbers `$N` parameters in order of appearance, so both engines bind
/// them by position). Answered from `calls_session_created` alone ([`ADDED_INDEXES`]).
pub(super) const SESSION_USAGE_SQL: &str = "SELECT COUNT(*) AS calls, MIN(created_at) AS first_at \
     FROM calls WHERE principal = $1 AND session_id = $2";

/// Tables added after schema version 1 was pinned, created (if missing) at every open
/// with `{int}` as in [`schema_v1`]. Older builds never read them, so a store that has
/// them still opens with those builds. `tool_pins` holds the definition of each tool a
/// worker discovers (an external worker's, an MCP server's) as first seen or last
/// accepted, and a later definition that differs while it waits for an admin (DESIGN
/// §11). Its `tool_group` column is not `group`, a reserved word in both engines.
/// `approval_votes` holds each approver's approval of a pending approval and the
/// `input_sha256` it approved (`[approvals] quorum`, DESIGN §14);
/// `remembered_approvals` the approvals given with `"remember": "session"`, each
/// covering later calls of the same principal, session, tool and input until it ends.
/// `audit_export_cursors` holds, per `[audit] export` destination, the `seq` of the last
/// audit record its collector accepted, so that a restarted exporter resumes there.
const ADDED_TABLES_TEMPLATE: &str = "
CREATE TABLE IF NOT EXISTS tool_pins (
    tool               TEXT PRIMARY KEY,
    tool_group         TEXT NOT NULL,
    digest             TEXT NOT NULL,
    definition         TEXT NOT NULL,
    pinned_at          {int} NOT NULL,
    accepted_by        TEXT,
    pending_group      TEXT,
    pending_digest     TEXT,
    pending_definition TEXT,
    pending_since      {int}
);
CREATE TABLE IF NOT EXISTS approval_votes (
    approval_id  TEXT NOT NULL,
    approver     TEXT NOT NULL,
    decided_at   {int} NOT NULL,
    input_sha256 TEXT NOT NULL,
    PRIMARY KEY (approval_id, approver)
);
CREATE TABLE IF NOT EXISTS remembered_approvals (
    principal    TEXT NOT NULL,
    session_id   TEXT NOT NULL,
    tool         TEXT NOT NULL,
    input_sha256 TEXT NOT NULL,
    approval_id  TEXT NOT NULL,
    expires_at   {int} NOT NULL,
    PRIMARY KEY (principal, session_id, tool, input_sha256)
);
CREATE TABLE IF NOT EXISTS audit_export_cursors (
    exporter   TEXT PRIMARY KEY,
    seq        {int} NOT NULL,
    updated_at {int} NOT NULL
);
";

/// The DDL of [`ADDED_TABLES_TEMPLATE`] for an engine whose 64-bit integer type is
/// `integer`.
pub(super) fn added_tables(integer: &str) -> String {
    ADDED_TABLES_TEMPLATE.replace("{int}", integer)
}

pub(super) const PIN_COLUMNS: &str = "tool, tool_group, digest, definition, pinned_at, \
     accepted_by, pending_group, pending_digest, pending_definition, pending_since";

/// The schema-1 DDL for an engine whose 64-bit integer type is `integer`.
pub(super) fn schema_v1(integer: &str) -> String {
    SCHEMA_V1_TEMPLATE.replace("{int}", integer)
}

pub(super) const AUDIT_COLUMNS: &str =
    "seq, ts, kind, call_id, principal, session_id, data, prev_hash, hash";

pub(super) const CALL_COLUMNS: &str = "call_id, tool_use_id, tool, input, principal, session_id, state, \
     approval_id, status, result, duration_ms, replica, claimed_by, lease_until, created_at, \
     finished_at";

pub(super) const APPROVAL_SELECT: &str = "SELECT a.approval_id, a.call_id, c.tool, c.input, c.principal, \
     c.session_id, a.status, a.created_at, a.expires_at, a.decided_by, a.reason, a.decided_at \
     FROM approvals a JOIN calls c ON c.call_id = a.call_id";

/// The console's list of calls ([`Store::recent_calls`]): the newest first, each filter
/// applied when set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallListFilter {
    pub principal: Option<String>,
    pub tool: Option<String>,
    /// A final status (`ok`, `error`, `denied`, `timeout`, `cancelled`), or
    /// `pending_approval`, or `running` (approved or on a worker).
    pub status: Option<String>,
    /// At most this many; capped at [`MAX_CALL_LIST`].
    pub limit: usize,
}

/// Most calls [`Store::recent_calls`] lists at once.
pub const MAX_CALL_LIST: usize = 500;

/// The status a listed call is filtered by: its final status once it has one, else what
/// its state means to a reader (`pending_approval`, `running`, `rejected`).
pub(super) const CALL_LIST_STATUS: &str = "COALESCE(status, CASE state WHEN 'approved' THEN 'running' \
     WHEN 'dispatched' THEN 'running' ELSE state END)";

/// Approvals in one page when the caller does not say.
pub const DEFAULT_APPROVAL_PAGE: usize = 100;
/// Most approvals in one page.
pub const MAX_APPROVAL_PAGE: usize = 1000;
/// The inputs of one page add up to at most this many bytes (a page always holds at
/// least one approval, however large): inputs are up to `[limits] max_argument_bytes`
/// each, and a page of them must fit in memory and in one gRPC message.
pub const APPROVAL_PAGE_BYTES: usize = 8 * 1024 * 1024;

/// Unix time in milliseconds, UTC.
pub type Timestamp = i64;

/// The schema version this build writes (`schema_version` table).
pub const SCHEMA_VERSION: i64 = 1;

/// The SQLite store's file name inside the data dir.
pub const SQLITE_FILE: &str = "airlock.db";

/// Errors of the store. Messages never contain a password or token.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "unknown store `{0}`: use \"sqlite\" or a postgres://user@host:port/db url in [orchestrator] store"
    )]
    UnknownKind(String),
    #[error("invalid postgres store url: {0}")]
    InvalidUrl(String),
    #[error("postgres store url: {0}")]
    Tls(airlock_tls::postgres::PgTlsError),
    #[error(
        "cannot reach the postgresql store at {endpoint}: {cause}; start the server or fix `store` (host, port, user, database) and its password in [orchestrator]"
    )]
    Unreachable { endpoint: String, cause: String },
    #[error(
        "no TLS connection to the postgresql store at {endpoint}: {cause}; check sslrootcert in `store` and the server's certificate (it must chain to that CA and name the url's host)"
    )]
    TlsHandshake { endpoint: String, cause: String },
    #[error("cannot open the sqlite store at {path}: {cause}")]
    Open { path: String, cause: String },
    #[error(
        "the store's schema version {found} is newer than this airlock supports ({supported}); upgrade airlock"
    )]
    SchemaTooNew { found: i64, supported: i64 },
    #[error("sqlite store: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("postgresql store: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("postgresql store: no connection available: {0}")]
    Pool(String),
    #[error("store task failed: {0}")]
    Task(String),
    #[error("the store holds invalid data: {0}")]
    Corrupt(String),
    #[error("{what} {id} not found")]
    NotFound { what: &'static str, id: String },
    #[error("{what} {id} already exists")]
    AlreadyExists { what: &'static str, id: String },
    #[error("approval {id} was already decided: {status}")]
    AlreadyDecided { id: String, status: ApprovalStatus },
    #[error("approval {id} has expired")]
    Expired { id: String },
    #[error("approval {id} already has {approver}'s approval; another approver must approve it")]
    AlreadyApprovedBy { id: String, approver: String },
    #[error(
        "tool {tool} has no changed definition waiting to be accepted (its workers list the definition pinned for it)"
    )]
    NothingToAccept { tool: String },
    #[error(
        "tool {tool:?} changed again: the definition waiting now has digest {pending}, not the {expected} that was reviewed; review it (GET /v1/tools/pins) and accept that digest"
    )]
    PendingChanged {
        tool: String,
        expected: String,
        pending: String,
    },
}

/// Where a call is in its life (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallState {
    /// Waiting for a human decision.
    PendingApproval,
    /// May run; nobody has claimed it yet.
    Approved,
    /// Claimed by one orchestrator replica and sent to a worker.
    Dispatched,
    /// Has its final outcome ([`StoredCall::status`] and [`StoredCall::result`]).
    Finished,
    /// Denied or expired before it ran.
    Rejected,
}

impl CallState {
    pub fn as_str(self) -> &'static str {
        match self {
            CallState::PendingApproval => "pending_approval",
            CallState::Approved => "approved",
            CallState::Dispatched => "dispatched",
            CallState::Finished => "finished",
            CallState::Rejected => "rejected",
        }
    }

    pub fn parse(text: &str) -> Result<Self, StoreError> {
        Ok(match text {
            "pending_approval" => CallState::PendingApproval,
            "approved" => CallState::Approved,
            "dispatched" => CallState::Dispatched,
            "finished" => CallState::Finished,
            "rejected" => CallState::Rejected,
            other => return Err(StoreError::Corrupt(format!("unknown call state `{other}`"))),
        })
    }
}

/// Decodes a stored call's status column: a name `CallStatus::as_str` gives, or nothing
/// (a call not finished yet). Any other text is a corrupt row, never a guess.
pub(crate) fn decode_call_status(text: Option<String>) -> Result<Option<CallStatus>, StoreError> {
    text.map(|text| {
        CallStatus::parse(&text)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown call status `{text}`")))
    })
    .transpose()
}

/// An approval's status, as `GET /v1/approvals` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalStatus {
    Pending,
    Approved,
    Denied,
    Expired,
}

impl ApprovalStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalStatus::Pending => "pending",
            ApprovalStatus::Approved => "approved",
            ApprovalStatus::Denied => "denied",
            ApprovalStatus::Expired => "expired",
        }
    }

    pub fn parse(text: &str) -> Result<Self, StoreError> {
        Ok(match text {
            "pending" => ApprovalStatus::Pending,
            "approved" => ApprovalStatus::Approved,
            "denied" => ApprovalStatus::Denied,
            "expired" => ApprovalStatus::Expired,
            other => {
                return Err(StoreError::Corrupt(format!(
                    "unknown approval status `{other}`"
                )));
            }
        })
    }
}

impl std::fmt::Display for ApprovalStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ApprovalStatus {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// A call to record.
#[derive(Debug, Clone, PartialEq)]
pub struct NewCall {
    pub call_id: CallId,
    pub tool_use_id: String,
    pub tool: String,
    /// The real (unredacted) arguments: a resumed call runs with them. Only the audit
    /// log gets the redacted copy.
    pub input: Value,
    pub principal: String,
    pub session_id: Option<String>,
    /// `Approved` for a call that may run now, `PendingApproval` when it waits.
    pub state: CallState,
    pub created_at: Timestamp,
}

/// A call as stored.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StoredCall {
    pub call_id: CallId,
    pub tool_use_id: String,
    pub tool: String,
    pub input: Value,
    pub principal: String,
    pub session_id: Option<String>,
    pub state: CallState,
    pub approval_id: Option<ApprovalId>,
    /// The final status once finished.
    pub status: Option<CallStatus>,
    /// The final result (whatever JSON the caller stored) once finished.
    pub result: Option<Value>,
    pub duration_ms: Option<u64>,
    /// The worker replica that ran it.
    pub replica: Option<String>,
    /// Who claimed it for dispatch, and until when the claim holds.
    pub claimed_by: Option<String>,
    pub lease_until: Option<Timestamp>,
    pub created_at: Timestamp,
    pub finished_at: Option<Timestamp>,
}

/// The final outcome of a call.
#[derive(Debug, Clone, PartialEq)]
pub struct CallOutcome {
    /// The final status, stored as its `as_str` name.
    pub status: CallStatus,
    /// The result to keep (e.g. the `tool_result` and isolation report).
    pub result: Value,
    pub duration_ms: Option<u64>,
    pub replica: Option<String>,
    pub finished_at: Timestamp,
}

/// An approval to create, for a call that is recorded in the same transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct NewApproval {
    pub approval_id: ApprovalId,
    /// The call that waits; inserted (state `pending_approval`) if not yet stored,
    /// otherwise moved to `pending_approval`.
    pub call: NewCall,
    pub created_at: Timestamp,
    pub expires_at: Timestamp,
}

/// An approval by who and what it was for, without the call's input (which may be
/// megabytes): one the sweep expired, or one whose expiry a late decision may find.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpiredApproval {
    pub approval_id: ApprovalId,
    pub call_id: CallId,
    pub principal: String,
    pub session_id: Option<String>,
}

/// An approval; serializes to the `GET /v1/approvals` item shape (times as RFC 3339).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Approval {
    pub approval_id: ApprovalId,
    pub call_id: CallId,
    pub tool: String,
    /// The call's real arguments: redact them before showing them if the approver
    /// must not see secrets.
    pub input: Value,
    /// SHA-256 of the canonical JSON of the input as stored (not as redacted): what an
    /// approver quotes back to bind the decision to these arguments.
    pub input_sha256: String,
    /// Who approved it so far, first first: under a quorum a pending approval lists the
    /// approvers it has.
    pub approved_by: Vec<String>,
    pub principal: String,
    pub session_id: Option<String>,
    pub status: ApprovalStatus,
    #[serde(serialize_with = "ser_time")]
    pub created_at: Timestamp,
    #[serde(serialize_with = "ser_time")]
    pub expires_at: Timestamp,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(
        serialize_with = "ser_opt_time",
        skip_serializing_if = "Option::is_none"
    )]
    pub decided_at: Option<Timestamp>,
}

/// An approval given with `"remember": "session"`: later calls of `principal` in
/// `session_id` with the same `tool` and input digest run without a new one until
/// `expires_at`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RememberedApproval {
    pub principal: String,
    pub session_id: String,
    pub tool: String,
    pub input_sha256: String,
    pub approval_id: ApprovalId,
    pub expires_at: Timestamp,
}

/// Which page of approvals to list: oldest first, by `(created_at, approval_id)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalQuery {
    /// Only approvals with this status (all when `None`).
    pub status: Option<ApprovalStatus>,
    /// Only approvals listed after this one: the `next_cursor` of the previous page.
    /// [`StoreError::NotFound`] when no approval has this id.
    pub after: Option<String>,
    /// At most this many; 0 means [`DEFAULT_APPROVAL_PAGE`], and more than
    /// [`MAX_APPROVAL_PAGE`] means that.
    pub limit: usize,
    /// The listed inputs add up to at most this many bytes of JSON, unless the page holds
    /// a single approval (one is always listed when any is left).
    pub max_bytes: usize,
}

impl Default for ApprovalQuery {
    fn default() -> Self {
        Self {
            status: None,
            after: None,
            limit: DEFAULT_APPROVAL_PAGE,
            max_bytes: APPROVAL_PAGE_BYTES,
        }
    }
}

impl ApprovalQuery {
    /// The page size actually used.
    pub fn effective_limit(&self) -> usize {
        match self.limit {
            0 => DEFAULT_APPROVAL_PAGE,
            n => n.min(MAX_APPROVAL_PAGE),
        }
    }
}

/// One page of approvals.
#[derive(Debug, Clone, PartialEq)]
pub struct ApprovalPage {
    pub approvals: Vec<Approval>,
    /// Pass as [`ApprovalQuery::after`] for the next page; `None` when this page is the
    /// last.
    pub next_cursor: Option<String>,
}

/// Builds a page from ids read in order (`limit + 1` of them, to know whether more
/// follow), fetching one approval at a time so that only the page's inputs are ever in
/// memory. `fetch` answers an approval and the size of its stored input, or `None` for
/// one that vanished since its id was read. An approval that would take the page past
/// `max_bytes` is left for the next page, unless the page is still empty.
pub(super) fn fill_page<F>(
    ids: Vec<String>,
    query: &ApprovalQuery,
    mut fetch: F,
) -> Result<ApprovalPage, StoreError>
where
    F: FnMut(&str) -> Result<Option<(Approval, usize)>, StoreError>,
{
    let limit = query.effective_limit();
    let mut approvals = Vec::new();
    let mut bytes = 0usize;
    let mut examined = 0usize;
    for id in ids.iter().take(limit) {
        if let Some((approval, size)) = fetch(id)? {
            if !approvals.is_empty() && bytes.saturating_add(size) > query.max_bytes {
                break;
            }
            bytes = bytes.saturating_add(size);
            approvals.push(approval);
        }
        examined += 1;
    }
    let next_cursor = (examined < ids.len())
        .then(|| ids.get(examined.saturating_sub(1)).cloned())
        .flatten();
    Ok(ApprovalPage {
        approvals,
        next_cursor,
    })
}

/// What one call writes in one transaction (see [`Store::write_call`]): the audit
/// events it has gathered since its last write, then one change to its row, then the
/// events that hold only if the change took effect (a `completed` event is recorded by
/// the one replica that finished the call).
#[derive(Debug, Clone, PartialEq)]
pub struct CallWrite {
    pub events: Vec<NewAuditEvent>,
    pub change: CallChange,
    pub then: Vec<NewAuditEvent>,
}

/// The change to a call's row in a [`CallWrite`].
#[derive(Debug, Clone, PartialEq)]
pub enum CallChange {
    /// None: the events alone.
    Nothing,
    /// A new call, approved and claimed at once by `claimant` until `lease_until`
    /// (state `dispatched`): its record before a worker runs it.
    InsertClaimed {
        call: NewCall,
        claimant: String,
        lease_until: Timestamp,
    },
    /// A new call with its final outcome (state `finished`): a call recorded only when
    /// it ends. [`StoreError::AlreadyExists`] if the id is taken.
    InsertFinished { call: NewCall, outcome: CallOutcome },
    /// [`Store::finish_call`]: takes effect unless the call was already finished.
    Finish {
        call_id: CallId,
        outcome: CallOutcome,
    },
    /// [`Store::claim_for_dispatch`]: takes effect for the one claimant that wins.
    Claim {
        call_id: CallId,
        claimant: String,
        now: Timestamp,
        lease_until: Timestamp,
    },
    /// [`Store::create_approval`].
    CreateApproval(NewApproval),
}

/// How much one session has used, for budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct SessionUsage {
    /// Calls recorded with this principal and session id.
    pub calls: u64,
    /// When the first of them was recorded.
    pub first_at: Option<Timestamp>,
}

/// One definition of a discovered tool: as pinned, or as a worker lists it now.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PinnedDefinition {
    /// The worker group that lists it.
    pub group: String,
    /// SHA-256 (hex) of the canonical JSON of `definition`.
    pub digest: String,
    /// `{name, title, description, input_schema, annotations}`.
    pub definition: Value,
}

/// What the store pins of a discovered tool (DESIGN §11): the definition first seen or
/// last accepted, which is the one served, and a later one that differs, which is hidden
/// until an admin accepts it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolPin {
    pub tool: String,
    pub pinned: PinnedDefinition,
    #[serde(serialize_with = "ser_time")]
    pub pinned_at: Timestamp,
    /// The admin who accepted `pinned`; `None` when it is the first definition seen.
    pub accepted_by: Option<String>,
    /// A definition seen since that differs from `pinned`.
    pub pending: Option<PinnedDefinition>,
    #[serde(serialize_with = "ser_opt_time")]
    pub pending_since: Option<Timestamp>,
}

/// A `tool_pins` row as both engines read it, before its JSON is parsed.
pub(super) struct PinRow {
    pub tool: String,
    pub group: String,
    pub digest: String,
    pub definition: String,
    pub pinned_at: Timestamp,
    pub accepted_by: Option<String>,
    pub pending_group: Option<String>,
    pub pending_digest: Option<String>,
    pub pending_definition: Option<String>,
    pub pending_since: Option<Timestamp>,
}

impl PinRow {
    pub(super) fn into_pin(self) -> Result<ToolPin, StoreError> {
        let pending = match (
            self.pending_group,
            self.pending_digest,
            self.pending_definition,
        ) {
            (Some(group), Some(digest), Some(definition)) => Some(PinnedDefinition {
                group,
                digest,
                definition: from_json_text(&definition, "a pending tool definition")?,
            }),
            _ => None,
        };
        Ok(ToolPin {
            pinned: PinnedDefinition {
                group: self.group,
                digest: self.digest,
                definition: from_json_text(&self.definition, "a pinned tool definition")?,
            },
            tool: self.tool,
            pinned_at: self.pinned_at,
            accepted_by: self.accepted_by,
            pending,
            pending_since: self.pending_since,
        })
    }

    /// The columns of `pin`, JSON as canonical text.
    pub(super) fn from_pin(pin: &ToolPin) -> Self {
        Self {
            tool: pin.tool.clone(),
            group: pin.pinned.group.clone(),
            digest: pin.pinned.digest.clone(),
            definition: to_json_text(&pin.pinned.definition),
            pinned_at: pin.pinned_at,
            accepted_by: pin.accepted_by.clone(),
            pending_group: pin.pending.as_ref().map(|p| p.group.clone()),
            pending_digest: pin.pending.as_ref().map(|p| p.digest.clone()),
            pending_definition: pin.pending.as_ref().map(|p| to_json_text(&p.definition)),
            pending_since: pin.pending_since,
        }
    }
}

/// How a definition a worker lists compares with its tool's pin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinCheck {
    /// The tool had no pin; this definition is now pinned (audited `tool_pinned`).
    FirstSeen,
    /// It is the pinned definition: serve it.
    Pinned,
    /// It differs from the pinned one: hide the tool. `tool_definition_changed` was
    /// audited when this definition was first seen.
    Changed,
}

/// The durable state of the gate. Every method is atomic on its own.
#[async_trait]
pub trait Store: Send + Sync {
    /// `"sqlite"` or `"postgres"`.
    fn kind(&self) -> &'static str;

    /// Appends one audit event: assigns the next `seq`, the time (now), `prev_hash` and
    /// `hash`, and moves the head anchor, in one transaction. Concurrent appends, from
    /// tasks or replicas, are serialized, so `seq` stays dense and the chain linear.
    async fn append(&self, event: NewAuditEvent) -> Result<AuditRecord, StoreError>;

    /// Reads a page of audit records in ascending `seq` (see [`AuditQuery`]), and
    /// whether more matched than the page holds.
    async fn audit_page(&self, query: AuditQuery) -> Result<AuditPage, StoreError>;

    /// The records of [`Store::audit_page`] alone.
    async fn audit(&self, query: AuditQuery) -> Result<Vec<AuditRecord>, StoreError> {
        Ok(self.audit_page(query).await?.records)
    }

    /// Walks the whole chain in one consistent snapshot and reports the first record
    /// that was modified, deleted, inserted or moved, and a truncated tail (see the
    /// [`audit`](crate::audit) module docs for what is and is not detectable).
    async fn verify(&self) -> Result<VerifyReport, StoreError>;

    /// Records a new call. [`StoreError::AlreadyExists`] if the id is taken.
    async fn insert_call(&self, call: NewCall) -> Result<(), StoreError>;

    async fn get_call(&self, call_id: &CallId) -> Result<Option<StoredCall>, StoreError>;

    /// Stores the final outcome and moves the call to `finished`. Returns false (and
    /// changes nothing) if it was already finished, so "completed" is recorded once
    /// even if two replicas ran a re-dispatched call. [`StoreError::NotFound`] if absent.
    async fn finish_call(
        &self,
        call_id: &CallId,
        outcome: &CallOutcome,
    ) -> Result<bool, StoreError>;

    /// Creates a pending approval and records its call (`pending_approval`) in one
    /// transaction. [`StoreError::AlreadyExists`] if the approval id is taken.
    async fn create_approval(&self, approval: NewApproval) -> Result<Approval, StoreError>;

    /// One page of approvals, oldest first (see [`ApprovalQuery`]). The page's ids are
    /// read in index order and its approvals fetched one by one, so no row holding a
    /// call's input is ever sorted.
    async fn approvals_page(&self, query: &ApprovalQuery) -> Result<ApprovalPage, StoreError>;

    /// Every approval with `status` (all when `None`), oldest first, read page by page.
    /// For tests and tools: what it returns grows with the store, so the front doors
    /// answer pages instead.
    async fn list_approvals(
        &self,
        status: Option<ApprovalStatus>,
    ) -> Result<Vec<Approval>, StoreError> {
        let mut query = ApprovalQuery {
            status,
            limit: MAX_APPROVAL_PAGE,
            ..ApprovalQuery::default()
        };
        let mut out = Vec::new();
        loop {
            let page = self.approvals_page(&query).await?;
            out.extend(page.approvals);
            match page.next_cursor {
                Some(cursor) => query.after = Some(cursor),
                None => return Ok(out),
            }
        }
    }

    async fn get_approval(&self, approval_id: &ApprovalId) -> Result<Option<Approval>, StoreError>;

    /// Moves a pending approval to approved or denied (compare-and-set: of concurrent
    /// deciders exactly one succeeds) and its call to `approved` or `rejected`.
    /// Errors: [`StoreError::NotFound`]; [`StoreError::AlreadyDecided`] if it is no
    /// longer pending; [`StoreError::Expired`] if `expires_at <= now` (the approval is
    /// then marked expired and its call rejected). Checking that the approver may
    /// decide (role, distinct approver) is the caller's job.
    async fn decide_approval(
        &self,
        approval_id: &ApprovalId,
        approve: bool,
        decided_by: &str,
        reason: Option<&str>,
        now: Timestamp,
    ) -> Result<Approval, StoreError>;

    /// Records `approver`'s approval of a pending approval (with the `input_sha256` it
    /// approved) and approves it once `quorum` distinct approvers have: until then it
    /// stays pending and lists them in `approved_by`. Errors as for
    /// [`Store::decide_approval`], and [`StoreError::AlreadyApprovedBy`] if this
    /// approver approved it already.
    async fn approve_approval(
        &self,
        approval_id: &ApprovalId,
        approver: &str,
        reason: Option<&str>,
        input_sha256: &str,
        quorum: u32,
        now: Timestamp,
    ) -> Result<Approval, StoreError>;

    /// Takes back the votes of `approvers` on an approval that is still pending (they
    /// are no longer approvers: their votes must not count toward its quorum); how many
    /// were taken back. An approval decided meanwhile keeps its votes.
    async fn withdraw_votes(
        &self,
        approval_id: &ApprovalId,
        approvers: &[String],
    ) -> Result<u64, StoreError>;

    /// Remembers an approval for its session (replacing an earlier one for the same
    /// principal, session, tool and input), and forgets those that ended by `now`.
    async fn remember_approval(
        &self,
        remembered: &RememberedApproval,
        now: Timestamp,
    ) -> Result<(), StoreError>;

    /// The remembered approval covering this call at `now`, if any.
    async fn remembered_approval(
        &self,
        principal: &str,
        session_id: &str,
        tool: &str,
        input_sha256: &str,
        now: Timestamp,
    ) -> Result<Option<RememberedApproval>, StoreError>;

    /// Claims a call for dispatch, exactly once: `approved` → `dispatched` (or takes
    /// over a `dispatched` call whose lease ended at or before `now`), setting
    /// `claimed_by` and `lease_until`. Returns true for the one claimant that won;
    /// false if the call is in any other state or someone else holds a live claim.
    /// [`StoreError::NotFound`] if the call does not exist. Choose `lease_until` past
    /// the call's deadline (or renew it with [`Store::renew_lease`]); a restarted
    /// single orchestrator may take over its own old claims by passing
    /// `now = Timestamp::MAX`.
    async fn claim_for_dispatch(
        &self,
        call_id: &CallId,
        claimant: &str,
        now: Timestamp,
        lease_until: Timestamp,
    ) -> Result<bool, StoreError>;

    /// Drops the stored results of calls finished before `finished_before` (`[store]
    /// retention_days`, DESIGN §15); returns how many. The calls and their statuses
    /// stay, and so does the audit chain, whose events hold digests, not results.
    async fn prune_results(&self, finished_before: Timestamp) -> Result<u64, StoreError>;

    /// Extends the lease of a call that `claimant` holds; false if it does not hold it.
    async fn renew_lease(
        &self,
        call_id: &CallId,
        claimant: &str,
        lease_until: Timestamp,
    ) -> Result<bool, StoreError>;

    /// Calls to pick up (e.g. after a restart): approved but never claimed, and
    /// dispatched but never finished whose lease ended at or before `now`. Oldest
    /// first. Claim each with [`Store::claim_for_dispatch`] before running it.
    async fn resumable_calls(&self, now: Timestamp) -> Result<Vec<StoredCall>, StoreError>;

    /// Marks at most `limit` of the pending approvals with `expires_at <= now` expired
    /// (the earliest first; their calls rejected) and returns them. Each expired
    /// approval is returned to exactly one caller, even with several replicas sweeping at
    /// once; a caller sweeps again while it gets `limit` of them.
    async fn expire_approvals(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> Result<Vec<ExpiredApproval>, StoreError>;

    /// Writes `write` in one transaction: `events` appended in order, then `change`,
    /// then `then` if the change took effect. Answers whether it did (always true for
    /// [`CallChange::Nothing`], [`CallChange::InsertClaimed`],
    /// [`CallChange::InsertFinished`] and [`CallChange::CreateApproval`]); an error
    /// rolls everything back.
    async fn write_call(&self, write: CallWrite) -> Result<bool, StoreError>;

    /// Write transactions this handle has committed since it was opened (SQLite: every
    /// commit on its connection, counted by a commit hook; PostgreSQL: every
    /// transaction it committed, and every single write statement that changed a row).
    /// `/readyz` reports it, so that tests and benchmarks can count the durable writes
    /// of a call.
    fn commits(&self) -> u64;

    /// Compares a definition a worker lists with its tool's pin: pins it when the tool
    /// has none, records it as pending (once per digest) when it differs, each with its
    /// audit event in the same transaction. Replicas on one store agree: the first
    /// definition any of them sees is the pin.
    async fn check_tool_pin(
        &self,
        tool: &str,
        seen: PinnedDefinition,
    ) -> Result<PinCheck, StoreError>;

    /// Makes the pending definition of `tool` its pin (audited `tool_accepted`, by
    /// `accepted_by`). [`StoreError::NotFound`] without a pin,
    /// [`StoreError::NothingToAccept`] without a pending definition,
    /// [`StoreError::PendingChanged`] when `reviewed` (the digest the admin looked at)
    /// is not the pending one's: a definition that changed between the review and the
    /// acceptance is not accepted unseen.
    async fn accept_tool_pin(
        &self,
        tool: &str,
        accepted_by: &str,
        reviewed: Option<&str>,
    ) -> Result<ToolPin, StoreError>;

    /// Every pin, by tool name.
    async fn tool_pins(&self) -> Result<Vec<ToolPin>, StoreError>;

    /// How many approvals wait for a decision (`airlock_pending_approvals`): counted
    /// over the status index, without reading any row's input.
    async fn pending_approvals(&self) -> Result<u64, StoreError>;
    /// The latest calls that match `filter`, newest first (the approvals console).
    async fn recent_calls(&self, filter: &CallListFilter) -> Result<Vec<StoredCall>, StoreError>;

    /// The `seq` of the last audit record `[audit] export` delivered to `exporter` (its
    /// protocol and endpoint), or `None` if it never recorded one.
    async fn export_cursor(&self, exporter: &str) -> Result<Option<u64>, StoreError>;

    /// Records that `exporter` delivered the log up to `seq`. Never moves back: of two
    /// replicas exporting to the same place, the one further on is kept.
    async fn advance_export_cursor(
        &self,
        exporter: &str,
        seq: u64,
        now: Timestamp,
    ) -> Result<(), StoreError>;

    /// Calls recorded for `(principal, session_id)` and the time of the first.
    async fn session_usage(
        &self,
        principal: &str,
        session_id: &str,
    ) -> Result<SessionUsage, StoreError>;
}

/// Opens (and creates or migrates) the store named by `store`: `"sqlite"` (the file
/// `<data_dir>/airlock.db`; the directory is created) or a `postgres://` /
/// `postgresql://` URL. `password`, when given, overrides one in the URL (from
/// `password_env`/`password_file`). Fails fast, naming host and port, when PostgreSQL
/// is unreachable.
pub async fn open(
    store: &str,
    data_dir: &Path,
    password: Option<String>,
) -> Result<Arc<dyn Store>, StoreError> {
    let trimmed = store.trim();
    if trimmed.is_empty() || trimmed.eq_ignore_ascii_case("sqlite") {
        let store = sqlite::SqliteStore::open(&data_dir.join(SQLITE_FILE)).await?;
        return Ok(Arc::new(store));
    }
    if trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://") {
        let store = postgres::PostgresStore::open(trimmed, password).await?;
        return Ok(Arc::new(store));
    }
    // Name only the scheme: the rest may hold credentials.
    let shown = match trimmed.find("://") {
        Some(pos) => format!("{}://…", &trimmed[..pos]),
        None if trimmed.len() <= 32 && !trimmed.contains('@') => trimmed.to_owned(),
        None => "…".to_owned(),
    };
    Err(StoreError::UnknownKind(shown))
}

/// Opens the SQLite store at an explicit file path (tests, tools).
pub async fn open_sqlite_file(path: &Path) -> Result<Arc<dyn Store>, StoreError> {
    Ok(Arc::new(sqlite::SqliteStore::open(path).await?))
}

/// The current time.
pub fn now_millis() -> Timestamp {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(_) => 0,
    }
}

/// `2026-05-20T12:34:56.789Z` for a [`Timestamp`] (UTC, milliseconds).
pub fn rfc3339(ts: Timestamp) -> String {
    match chrono::DateTime::<chrono::Utc>::from_timestamp_millis(ts) {
        Some(time) => time.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        // Beyond chrono's ±262 000 years: no stored time is, but say what it is.
        None => format!("{ts} ms from the Unix epoch"),
    }
}

fn ser_time<S: Serializer>(ts: &Timestamp, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&rfc3339(*ts))
}

fn ser_opt_time<S: Serializer>(ts: &Option<Timestamp>, s: S) -> Result<S::Ok, S::Error> {
    match ts {
        Some(ts) => s.serialize_str(&rfc3339(*ts)),
        None => s.serialize_none(),
    }
}

/// JSON text for a column.
fn to_json_text(value: &Value) -> String {
    crate::audit::canonical_json(value)
}

fn from_json_text(text: &str, what: &str) -> Result<Value, StoreError> {
    serde_json::from_str(text)
        .map_err(|e| StoreError::Corrupt(format!("{what} is not valid json: {e}")))
}

fn to_u64(value: i64, what: &str) -> Result<u64, StoreError> {
    u64::try_from(value).map_err(|_| StoreError::Corrupt(format!("{what} is negative")))
}

fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(1_779_280_496_789), "2026-05-20T12:34:56.789Z");
        assert_eq!(rfc3339(-1), "1969-12-31T23:59:59.999Z");
    }

    #[test]
    fn call_statuses_decode_by_name_and_refuse_anything_else() {
        for status in CallStatus::ALL {
            let decoded = decode_call_status(Some(status.as_str().to_owned())).unwrap();
            assert_eq!(decoded, Some(status));
        }
        assert_eq!(decode_call_status(None).unwrap(), None);
        // Once an unknown status silently became `error`; now the row is corrupt.
        for bad in ["OK", "succeeded", "", "ok "] {
            let err = decode_call_status(Some(bad.to_owned())).unwrap_err();
            assert!(
                err.to_string().contains("unknown call status"),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn parses_states() {
        for s in [
            CallState::PendingApproval,
            CallState::Approved,
            CallState::Dispatched,
            CallState::Finished,
            CallState::Rejected,
        ] {
            assert_eq!(CallState::parse(s.as_str()).ok(), Some(s));
        }
        assert!(ApprovalStatus::parse("nope").is_err());
    }
}
