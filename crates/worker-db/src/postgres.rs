//! PostgreSQL: a small lazy pool of connections, one transaction per call.
//!
//! The engine layer of read-only for `query_database`: every call runs in
//! `START TRANSACTION READ ONLY` (with a snapshot taken before the user's statement, so
//! it cannot switch the transaction to read-write), with `SET LOCAL statement_timeout`,
//! as ONE prepared statement over the extended protocol (which refuses several
//! statements), and is rolled back; the connection is then reset with `DISCARD ALL`,
//! which also releases session-level advisory locks. Limits of this layer, stated
//! honestly: PostgreSQL allows advisory locks, `set_config` (undone by the rollback) and
//! reading functions such as `pg_read_file` in read-only transactions; the parser's
//! function denylist refuses them, and production should connect as a role without
//! superuser or file-access privileges (`pg_read_server_files`, `pg_execute_server_program`).
//!
//! A connection is made on first use, so a database that is down never stops the worker
//! from starting; every call reports it again until it is back.

use std::error::Error as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_tls::postgres::{PgTls, PgTlsError, error_chain};
use futures::TryStreamExt;
use serde_json::Value;
use tokio_postgres::config::Host;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{NoTls, Transaction};

use crate::config::Engine;
use crate::pgwire::{self, Connected, WireError};
use crate::readonly::{self, ReadOnlyError};
use crate::tools::{LIST_RESERVE, Limits, Output};
use crate::values::{PgJson, RawLen, TextParam, ValueError, approx_len, pg_json_len, pg_params};

/// Failures of a PostgreSQL call, worded for the model. Never holds the password.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error("database {name:?} is unreachable: {reason}; check that PostgreSQL is running at {at}")]
    Unreachable {
        name: String,
        reason: String,
        at: String,
    },
    #[error(
        "could not connect to database {name:?}: {reason}; check the user, database and password (password_env or password_file) in the configuration"
    )]
    Connect { name: String, reason: String },
    #[error(
        "could not connect to database {name:?} over TLS: {reason}; check sslmode and sslrootcert in its url and the server's certificate"
    )]
    Tls { name: String, reason: String },
    #[error(transparent)]
    Refused(#[from] ReadOnlyError),
    #[error(
        "refused by PostgreSQL's read-only transaction ({0}); query_database only reads; to change data use execute_sql"
    )]
    EngineRefused(String),
    #[error(
        "the statement was stopped after {0} ms (statement timeout or call deadline); make it cheaper, e.g. with WHERE and LIMIT"
    )]
    Timeout(u64),
    #[error("the call was cancelled")]
    Cancelled,
    #[error(transparent)]
    Value(#[from] ValueError),
    #[error(
        "PostgreSQL sent a message of {size} bytes (a row of the result, or an error quoting \
         a value), more than the {max} bytes the db worker reads at once, so nothing is \
         returned; select fewer or shorter columns, e.g. left(column, 1000), length(column) \
         or md5(column)"
    )]
    MessageTooLarge { size: usize, max: usize },
    #[error("the statement has {expected} parameter(s) ($1, $2, ...) but params has {given}")]
    ParamCount { expected: usize, given: usize },
    #[error("PostgreSQL error: {0}")]
    Sql(String),
    #[error("table or view {0:?} not found; call list_tables to see what exists")]
    NoTable(String),
}

/// The first error of type `E` among `e`'s causes.
fn find_source<E: std::error::Error + 'static>(e: &dyn std::error::Error) -> Option<&E> {
    let mut source = e.source();
    while let Some(s) = source {
        if let Some(found) = s.downcast_ref::<E>() {
            return Some(found);
        }
        source = s.source();
    }
    None
}

/// One configured PostgreSQL database.
pub(crate) struct Postgres {
    pub name: String,
    pub config: tokio_postgres::Config,
    /// Plaintext, or TLS with the server's certificate verified (`sslmode=verify-full`).
    pub tls: PgTls,
    pub password: Option<String>,
    pub skip_parser: bool,
    pub skip_engine: bool,
    pub permits: Arc<tokio::sync::Semaphore>,
    pub idle: Mutex<Vec<Connected>>,
}

/// A connection taken from the pool; only [`Pooled::release`] gives it back, so a
/// connection left in an unknown state (error, timeout, cancel) is closed on drop.
struct Pooled<'a> {
    conn: Connected,
    pool: &'a Postgres,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Pooled<'_> {
    fn release(self) {
        if !self.conn.client.is_closed()
            && let Ok(mut idle) = self.pool.idle.lock()
        {
            idle.push(self.conn);
        }
    }
}

/// The tables and views in name order, as many as fit in `$1` bytes of JSON (measured
/// on PostgreSQL's rendering, which has more spaces than the answer's), and whether
/// more exist: the list is cut on the server, so a catalog of any size costs one row of
/// about `$1` bytes.
const LIST_TABLES: &str = "\
WITH t AS (
  SELECT n.nspname, c.relname,
         json_build_object('schema', n.nspname, 'name', c.relname, 'type',
           CASE c.relkind WHEN 'r' THEN 'table' WHEN 'p' THEN 'partitioned table'
                          WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view'
                          ELSE 'foreign table' END) AS entry
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
  WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f')
    AND n.nspname NOT IN ('pg_catalog', 'information_schema')
    AND n.nspname NOT LIKE 'pg\\_toast%' AND n.nspname NOT LIKE 'pg\\_temp%'
), sized AS (
  SELECT nspname, relname, entry,
         sum(octet_length(entry::text) + 1) OVER (ORDER BY nspname, relname) AS total
  FROM t
)
SELECT json_build_object(
  'tables', coalesce(json_agg(entry ORDER BY nspname, relname)
                       FILTER (WHERE total <= $1::bigint), '[]'),
  'truncated', coalesce(bool_or(total > $1::bigint), false))
FROM sized";

/// How to list what a `describe_table` answer left out ([`crate::tools::fit_description`]).
pub(crate) const DESCRIPTION_REST: &str = "SELECT column_name, data_type, is_nullable, column_default FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2 ORDER BY ordinal_position LIMIT 200 OFFSET 200 with params [schema, table]; indexes from pg_indexes (indexname, indexdef) and foreign keys from pg_constraint (contype = 'f', pg_get_constraintdef(oid)) likewise";

const DESCRIBE: &str = "\
WITH t AS (
  SELECT c.oid, n.nspname, c.relname, c.relkind
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
  WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f')
    AND (c.relname = $1::text OR n.nspname || '.' || c.relname = $1::text)
  ORDER BY pg_table_is_visible(c.oid) DESC, n.nspname LIMIT 1
)
SELECT json_build_object(
  'schema', t.nspname, 'table', t.relname,
  'type', CASE t.relkind WHEN 'r' THEN 'table' WHEN 'p' THEN 'partitioned table'
                         WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view'
                         ELSE 'foreign table' END,
  'columns', (SELECT coalesce(json_agg(json_build_object(
      'name', a.attname, 'type', format_type(a.atttypid, a.atttypmod),
      'nullable', NOT a.attnotnull, 'default', pg_get_expr(d.adbin, d.adrelid),
      'primary_key', coalesce(a.attnum = ANY(pk.conkey), false)) ORDER BY a.attnum), '[]')
    FROM pg_attribute a
    LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    LEFT JOIN pg_constraint pk ON pk.conrelid = a.attrelid AND pk.contype = 'p'
    WHERE a.attrelid = t.oid AND a.attnum > 0 AND NOT a.attisdropped),
  'primary_key', (SELECT coalesce(json_agg(a.attname ORDER BY k.ord), '[]')
    FROM pg_constraint pk
    CROSS JOIN LATERAL unnest(pk.conkey) WITH ORDINALITY k(attnum, ord)
    JOIN pg_attribute a ON a.attrelid = pk.conrelid AND a.attnum = k.attnum
    WHERE pk.conrelid = t.oid AND pk.contype = 'p'),
  'foreign_keys', (SELECT coalesce(json_agg(json_build_object(
      'name', fk.conname,
      'columns', (SELECT json_agg(a.attname ORDER BY k.ord)
                  FROM unnest(fk.conkey) WITH ORDINALITY k(attnum, ord)
                  JOIN pg_attribute a ON a.attrelid = fk.conrelid AND a.attnum = k.attnum),
      'references', json_build_object(
         'table', fk.confrelid::regclass::text,
         'columns', (SELECT json_agg(a.attname ORDER BY k.ord)
                     FROM unnest(fk.confkey) WITH ORDINALITY k(attnum, ord)
                     JOIN pg_attribute a ON a.attrelid = fk.confrelid AND a.attnum = k.attnum)),
      'definition', pg_get_constraintdef(fk.oid)) ORDER BY fk.conname), '[]')
    FROM pg_constraint fk WHERE fk.conrelid = t.oid AND fk.contype = 'f'),
  'indexes', (SELECT coalesce(json_agg(json_build_object(
      'name', ic.relname,
      'columns', (SELECT json_agg(coalesce(a.attname::text, pg_get_indexdef(i.indexrelid, k.ord::int, true)) ORDER BY k.ord)
                  FROM unnest(i.indkey::int2[]) WITH ORDINALITY k(attnum, ord)
                  LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum),
      'unique', i.indisunique, 'primary', i.indisprimary,
      'definition', pg_get_indexdef(i.indexrelid)) ORDER BY ic.relname), '[]')
    FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid WHERE i.indrelid = t.oid)
) FROM t";

impl Postgres {
    /// Where the server is expected, for error messages: `host:port` or a socket dir.
    fn at(&self) -> String {
        let ports = self.config.get_ports();
        let hosts: Vec<String> = self
            .config
            .get_hosts()
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
                match h {
                    Host::Tcp(host) => format!("{host}:{port}"),
                    Host::Unix(dir) => format!("{}/.s.PGSQL.{port}", dir.display()),
                }
            })
            .collect();
        if hosts.is_empty() {
            "the default socket".into()
        } else {
            hosts.join(",")
        }
    }

    fn scrub(&self, text: String) -> String {
        match &self.password {
            Some(p) if !p.is_empty() => text.replace(p.as_str(), "***"),
            _ => text,
        }
    }

    fn wire_error(&self, e: &WireError) -> PgError {
        match e {
            WireError::Postgres(e) => self.connect_error(e),
            WireError::Io(io) => PgError::Unreachable {
                name: self.name.clone(),
                reason: self.io_reason(io),
                at: self.at(),
            },
            WireError::SessionAttrs(reason) => PgError::Connect {
                name: self.name.clone(),
                reason: (*reason).to_owned(),
            },
            WireError::NoHost => PgError::Unreachable {
                name: self.name.clone(),
                reason: e.to_string(),
                at: self.at(),
            },
            WireError::Tls(tls) => self.tls_error(tls),
        }
    }

    fn io_reason(&self, io: &std::io::Error) -> String {
        match io.kind() {
            std::io::ErrorKind::ConnectionRefused => "connection refused".to_owned(),
            std::io::ErrorKind::TimedOut => "connection timed out".to_owned(),
            std::io::ErrorKind::NotFound => "no such host or socket".to_owned(),
            _ => self.scrub(io.to_string()),
        }
    }

    /// A TLS failure: the url's TLS settings, or the handshake (the server's
    /// certificate not verified, no TLS on the server).
    fn tls_error(&self, e: &PgTlsError) -> PgError {
        PgError::Tls {
            name: self.name.clone(),
            reason: self.scrub(e.to_string()),
        }
    }

    fn connect_error(&self, e: &tokio_postgres::Error) -> PgError {
        let name = self.name.clone();
        if let Some(db) = e.as_db_error() {
            return PgError::Connect {
                name,
                reason: self.scrub(db.message().to_owned()),
            };
        }
        if let Some(tls) = find_source::<PgTlsError>(e) {
            return self.tls_error(tls);
        }
        let mut source = e.source();
        while let Some(s) = source {
            if let Some(io) = s.downcast_ref::<std::io::Error>() {
                let reason = self.io_reason(io);
                return PgError::Unreachable {
                    name,
                    reason,
                    at: self.at(),
                };
            }
            source = s.source();
        }
        let reason = self.scrub(error_chain(e));
        // tokio-postgres' own TLS failures ("error performing TLS handshake: server
        // does not support TLS"): never a fallback to plaintext.
        if e.to_string().contains("TLS") {
            return PgError::Tls { name, reason };
        }
        PgError::Unreachable {
            name,
            reason,
            at: self.at(),
        }
    }

    /// A statement error, classified; `timeout_ms` names the budget when PostgreSQL
    /// cancelled the statement.
    fn sql_error(&self, e: &tokio_postgres::Error, timeout_ms: u64) -> PgError {
        if let Some(db) = e.as_db_error() {
            let mut text = db.message().to_owned();
            if let Some(detail) = db.detail() {
                text.push_str(&format!(" (detail: {detail})"));
            }
            if let Some(hint) = db.hint() {
                text.push_str(&format!(" (hint: {hint})"));
            }
            let text = self.scrub(text);
            return match *db.code() {
                SqlState::READ_ONLY_SQL_TRANSACTION => PgError::EngineRefused(text),
                SqlState::QUERY_CANCELED => PgError::Timeout(timeout_ms),
                _ => PgError::Sql(text),
            };
        }
        if e.is_closed() {
            return PgError::Unreachable {
                name: self.name.clone(),
                reason: "the connection was closed".into(),
                at: self.at(),
            };
        }
        // A value Airlock could not convert ("error deserializing column 0") says why in
        // its source: the caller needs that part to change the query.
        match std::error::Error::source(e) {
            Some(why) => PgError::Sql(self.scrub(format!("{e}: {why}"))),
            None => PgError::Sql(self.scrub(e.to_string())),
        }
    }

    async fn get(&self, limits: &Limits) -> Result<Pooled<'_>, PgError> {
        let permit = tokio::select! {
            p = Arc::clone(&self.permits).acquire_owned() => p.map_err(|e| PgError::Sql(e.to_string()))?,
            () = limits.cancel.cancelled() => return Err(PgError::Cancelled),
            () = tokio::time::sleep_until(limits.deadline.into()) => return Err(PgError::Timeout(limits.budget_ms())),
        };
        let reused = match self.idle.lock() {
            Ok(mut idle) => {
                idle.retain(|c| !c.client.is_closed());
                idle.pop()
            }
            Err(_) => None,
        };
        if let Some(conn) = reused {
            conn.guard.set_limit(limits.max_value_bytes);
            return Ok(Pooled {
                conn,
                pool: self,
                _permit: permit,
            });
        }
        let connect = pgwire::connect(&self.config, &self.tls, limits.max_value_bytes, &self.name);
        let conn = tokio::select! {
            r = connect => r.map_err(|e| self.wire_error(&e))?,
            () = limits.cancel.cancelled() => return Err(PgError::Cancelled),
            () = tokio::time::sleep_until(limits.deadline.into()) => return Err(PgError::Unreachable {
                name: self.name.clone(),
                reason: "connecting took longer than the call's deadline".into(),
                at: self.at(),
            }),
        };
        Ok(Pooled {
            conn,
            pool: self,
            _permit: permit,
        })
    }

    /// Runs one statement in one transaction and returns its rows (at most `max_rows` and
    /// `max_bytes`; no row message over `max_value_bytes` is read). `read_only` selects
    /// the engine layer; `write` reports rows affected and commits.
    async fn run(
        &self,
        sql: &str,
        params: Vec<TextParam>,
        limits: &Limits,
        read_only: bool,
        write: bool,
    ) -> Result<Output, PgError> {
        let mut pooled = self.get(limits).await?;
        let cancel_token = pooled.conn.client.cancel_token();
        let guard = Arc::clone(&pooled.conn.guard);
        let addr = pooled.conn.addr.clone();
        let cancel_tls = pooled.conn.tls.clone();
        let budget = limits.budget_ms();
        let (max_rows, max_bytes) = (limits.max_rows, limits.max_bytes);
        let work = async {
            let tx = if read_only {
                pooled
                    .conn
                    .client
                    .build_transaction()
                    .read_only(true)
                    .start()
                    .await
            } else {
                pooled.conn.client.transaction().await
            }
            .map_err(|e| self.sql_error(&e, budget))?;
            let ms = limits.remaining_ms().max(1);
            // `SELECT 1` takes the transaction's first snapshot: from here on, nothing in
            // the user's statement can make a read-only transaction read-write.
            tx.batch_execute(&format!("SET LOCAL statement_timeout = {ms}; SELECT 1"))
                .await
                .map_err(|e| self.sql_error(&e, budget))?;
            let out =
                statement(self, &tx, sql, &params, max_rows, max_bytes, write, budget).await?;
            if write || !read_only {
                tx.commit().await
            } else {
                tx.rollback().await
            }
            .map_err(|e| self.sql_error(&e, budget))?;
            Ok::<_, PgError>(out)
        };
        let result = tokio::select! {
            r = work => r,
            () = limits.cancel.cancelled() => Err(PgError::Cancelled),
            () = tokio::time::sleep_until(limits.deadline.into()) => Err(PgError::Timeout(budget)),
        };
        // A refused row message closed the connection: whatever error the statement saw
        // ("connection closed"), the reason is the size.
        let result = match (result, guard.tripped()) {
            (Err(_), Some(size)) => Err(PgError::MessageTooLarge {
                size,
                max: limits.max_value_bytes,
            }),
            (result, _) => result,
        };
        match result {
            Ok(out) => {
                // Reset the session (advisory locks, prepared statements, settings).
                match pooled.conn.client.batch_execute("DISCARD ALL").await {
                    Ok(()) => pooled.release(),
                    Err(e) => {
                        tracing::debug!(database = %self.name, error = %e, "discard failed; dropping connection")
                    }
                }
                Ok(out)
            }
            Err(e) => {
                if matches!(
                    e,
                    PgError::Cancelled | PgError::Timeout(_) | PgError::MessageTooLarge { .. }
                ) {
                    // Stop the statement on the server too; the connection is dropped.
                    let cancel = async {
                        let socket = pgwire::open(&self.config, &addr).await.ok()?;
                        match cancel_tls {
                            Some(tls) => cancel_token.cancel_query_raw(socket, tls).await.ok(),
                            None => cancel_token.cancel_query_raw(socket, NoTls).await.ok(),
                        }
                    };
                    let _ = tokio::time::timeout(Duration::from_secs(2), cancel).await;
                }
                Err(e)
            }
        }
    }

    pub async fn ping(&self, limits: &Limits) -> Result<(), PgError> {
        self.run("SELECT 1", Vec::new(), limits, true, false)
            .await
            .map(|_| ())
    }

    pub async fn query(
        &self,
        sql: String,
        params: Vec<Value>,
        limits: &Limits,
    ) -> Result<Output, PgError> {
        if !self.skip_parser {
            readonly::check_read_only(&sql, Engine::Postgres)?;
        }
        let params = pg_params(&params)?;
        self.run(&sql, params, limits, !self.skip_engine, false)
            .await
    }

    pub async fn execute(
        &self,
        sql: String,
        params: Vec<Value>,
        limits: &Limits,
    ) -> Result<Output, PgError> {
        readonly::check_single_statement(&sql, Engine::Postgres)?;
        let params = pg_params(&params)?;
        self.run(&sql, params, limits, false, true).await
    }

    async fn metadata(
        &self,
        sql: &str,
        params: Vec<TextParam>,
        limits: &Limits,
    ) -> Result<Option<Value>, PgError> {
        let out = self
            .run(sql, params, &limits.metadata(), true, false)
            .await?;
        Ok(out
            .rows
            .into_iter()
            .next()
            .and_then(|r| r.into_iter().next()))
    }

    pub async fn list_tables(&self, limits: &Limits) -> Result<Value, PgError> {
        let max = limits.max_bytes;
        let cap = max.saturating_sub(LIST_RESERVE);
        let mut answer = self
            .metadata(LIST_TABLES, vec![TextParam::Text(cap.to_string())], limits)
            .await?
            .unwrap_or_else(|| serde_json::json!({ "tables": [], "truncated": false }));
        if answer["truncated"] == Value::Bool(true) {
            answer["note"] = serde_json::json!(format!(
                "more tables and views exist than were returned: this list stops before about {max} bytes, the most one answer holds; list the rest with query_database, e.g. SELECT n.nspname AS schema, c.relname AS name, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f') AND (n.nspname, c.relname) > ($1, $2) ORDER BY 1, 2 LIMIT 100 with params [the last schema and name above], or narrow it with AND n.nspname = '...' or AND c.relname LIKE 'prefix%'"
            ));
        }
        Ok(answer)
    }

    pub async fn describe(&self, table: String, limits: &Limits) -> Result<Value, PgError> {
        match self
            .metadata(DESCRIBE, vec![TextParam::Text(table.clone())], limits)
            .await?
        {
            Some(v) if !v.is_null() => Ok(v),
            _ => Err(PgError::NoTable(table)),
        }
    }
}

#[allow(clippy::too_many_arguments, reason = "one call site, all plain values")]
async fn statement(
    pg: &Postgres,
    tx: &Transaction<'_>,
    sql: &str,
    params: &[TextParam],
    max_rows: u64,
    max_bytes: usize,
    write: bool,
    budget: u64,
) -> Result<Output, PgError> {
    let stmt = tx
        .prepare(sql)
        .await
        .map_err(|e| pg.sql_error(&e, budget))?;
    if stmt.params().len() != params.len() {
        return Err(PgError::ParamCount {
            expected: stmt.params().len(),
            given: params.len(),
        });
    }
    let mut out = Output {
        columns: stmt
            .columns()
            .iter()
            .map(|c| (c.name().to_owned(), c.type_().name().to_owned()))
            .collect(),
        ..Output::default()
    };
    let args = params.iter().map(|p| p as &(dyn ToSql + Sync));
    let mut bytes = 0usize;
    if write {
        let stream = tx
            .query_raw(&stmt, args)
            .await
            .map_err(|e| pg.sql_error(&e, budget))?;
        futures::pin_mut!(stream);
        while let Some(row) = stream
            .try_next()
            .await
            .map_err(|e| pg.sql_error(&e, budget))?
        {
            // Run a write to the end, but keep no more rows once they were cut.
            if out.truncated {
                continue;
            }
            if out.rows.len() as u64 >= max_rows {
                out.truncated = true;
                continue;
            }
            match convert(pg, &row, &mut bytes, max_bytes, budget)? {
                Some(values) => out.rows.push(values),
                None => out.over_cap(true, max_bytes)?,
            }
        }
        out.rows_affected = stream.rows_affected();
    } else {
        let portal = tx
            .bind_raw(&stmt, args)
            .await
            .map_err(|e| pg.sql_error(&e, budget))?;
        let fetch = i32::try_from(max_rows.saturating_add(1)).unwrap_or(i32::MAX);
        let stream = tx
            .query_portal_raw(&portal, fetch)
            .await
            .map_err(|e| pg.sql_error(&e, budget))?;
        futures::pin_mut!(stream);
        while let Some(row) = stream
            .try_next()
            .await
            .map_err(|e| pg.sql_error(&e, budget))?
        {
            if out.truncated {
                continue;
            }
            if out.rows.len() as u64 >= max_rows {
                out.truncated = true;
                continue;
            }
            match convert(pg, &row, &mut bytes, max_bytes, budget)? {
                Some(values) => out.rows.push(values),
                // The rest is not read: the transaction is rolled back anyway.
                None => {
                    out.over_cap(false, max_bytes)?;
                    break;
                }
            }
        }
    }
    Ok(out)
}

/// Converts one row, value by value, each only after its wire size shows that it fits in
/// what is left of `max_bytes`; `None` (with `bytes` unchanged) when the row does not fit.
fn convert(
    pg: &Postgres,
    row: &tokio_postgres::Row,
    bytes: &mut usize,
    max_bytes: usize,
    budget: u64,
) -> Result<Option<Vec<Value>>, PgError> {
    let mut values = Vec::with_capacity(row.len());
    let mut row_bytes = 0usize;
    for (i, column) in row.columns().iter().enumerate() {
        let RawLen(raw) = row
            .try_get::<_, RawLen>(i)
            .map_err(|e| pg.sql_error(&e, budget))?;
        if *bytes + row_bytes + pg_json_len(column.type_(), raw) > max_bytes {
            return Ok(None);
        }
        let v = row
            .try_get::<_, PgJson>(i)
            .map_err(|e| pg.sql_error(&e, budget))?
            .0;
        row_bytes += approx_len(&v);
        values.push(v);
    }
    if *bytes + row_bytes > max_bytes {
        return Ok(None);
    }
    *bytes += row_bytes;
    Ok(Some(values))
}
