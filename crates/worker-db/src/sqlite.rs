//! SQLite: a connection per call on a blocking thread.
//!
//! The engine layer of read-only for `query_database`: the file is opened with
//! `SQLITE_OPEN_READ_ONLY`, `PRAGMA query_only=ON` is set, an authorizer allows only
//! reads (no writes, `ATTACH`/`DETACH`, transaction control, state-changing pragmas or
//! denied functions such as `load_extension`), and a prepared statement that SQLite
//! itself does not call read-only (`VACUUM INTO`, for example) is refused before it runs.
//! Every connection also runs with `SQLITE_DBCONFIG_DEFENSIVE` on and untrusted schema,
//! and with the built-in functions that one call could keep busy for minutes bounded
//! (`sqlite_functions.rs`).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use rusqlite::hooks::{AuthAction, AuthContext, Authorization};
use rusqlite::limits::Limit;
use rusqlite::{Connection, OpenFlags, TransactionBehavior};
use serde_json::{Map, Value, json};

use crate::config::Engine;
use crate::readonly::{self, ReadOnlyError, denied_function, sqlite_pragma_reads};
use crate::sqlite_functions::{self, MAX_LIKE_PATTERN_BYTES};
use crate::tools::{LIST_RESERVE, Limits, Output, SQLITE_HEAP_LIMIT};
use crate::values::{
    ValueError, approx_len, sqlite_json_len, sqlite_params, sqlite_storage_class, sqlite_value,
};

/// Failures of a SQLite call, worded for the model.
#[derive(Debug, thiserror::Error)]
pub enum SqliteError {
    #[error(
        "database {name:?} is unreachable: {reason}; check the sqlite path in the configuration"
    )]
    Unreachable { name: String, reason: String },
    #[error(transparent)]
    Refused(#[from] ReadOnlyError),
    #[error(
        "refused by the read-only SQLite connection ({0}); query_database only reads; to change data use execute_sql"
    )]
    EngineRefused(String),
    #[error(
        "refused ({0}); execute_sql does not allow ATTACH, transaction control, pragma changes or extension loading"
    )]
    WriteRefused(String),
    #[error(
        "the statement was stopped after {0} ms (statement timeout or call deadline); make it cheaper, e.g. with WHERE and LIMIT"
    )]
    Timeout(u64),
    #[error("the call was cancelled")]
    Cancelled,
    #[error(
        "database {name:?} stayed busy for the {waited_ms} ms this call could wait: all {slots} of its connections were taken by earlier statements (one may still be finishing a long function call past its timeout), so this one did not start; try again shortly, or make the earlier statements cheaper"
    )]
    Busy {
        name: String,
        slots: u32,
        waited_ms: u64,
    },
    #[error(
        "a LIKE or GLOB pattern is longer than the {max} bytes the db worker allows (matching takes time that grows with pattern times value), so nothing is returned; to find a longer piece of text use instr(column, '...') > 0, or compare substr(column, 1, n) = '...'"
    )]
    LikePatternTooLong { max: i32 },
    #[error(transparent)]
    Value(#[from] ValueError),
    #[error(
        "a value grew larger than the {max} bytes the db worker lets one value hold (SQLite: \
         string or blob too big), so nothing is returned; work on a shorter part of it, e.g. \
         substr(column, 1, 1000) or length(column), or aggregate in smaller groups"
    )]
    ValueTooLarge { max: usize },
    #[error(
        "SQLite needed more than the {max} bytes of memory the db worker allows it (many or \
         large values at once), so nothing is returned; select fewer or shorter columns, or \
         fewer rows at a time"
    )]
    OutOfMemory { max: i64 },
    #[error("SQLite error: {0}")]
    Sql(String),
    #[error("table or view {0:?} not found; call list_tables to see what exists")]
    NoTable(String),
    #[error("the SQLite call failed unexpectedly: {0}")]
    Join(String),
}

/// One configured SQLite database.
pub(crate) struct Sqlite {
    pub name: String,
    pub path: PathBuf,
    pub skip_parser: bool,
    pub skip_engine: bool,
    pub permits: Arc<tokio::sync::Semaphore>,
    /// How many permits `permits` started with (`pool_size`), for messages.
    pub pool_size: u32,
}

/// What a blocking call needs to stop in time.
#[derive(Clone)]
struct Stop {
    deadline: Instant,
    cancelled: Arc<AtomicBool>,
    budget_ms: u64,
}

impl Stop {
    fn now(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed) || Instant::now() >= self.deadline
    }
}

impl Sqlite {
    /// Runs `f` on a blocking thread with a fresh connection, honouring the deadline and
    /// cancellation of `limits`. At most `pool_size` such threads run per database: a
    /// call waits for a slot until its deadline.
    async fn run<T, F>(&self, limits: &Limits, f: F) -> Result<T, SqliteError>
    where
        T: Send + 'static,
        F: FnOnce(&SqliteCall) -> Result<T, SqliteError> + Send + 'static,
    {
        let permit = tokio::select! {
            p = Arc::clone(&self.permits).acquire_owned() => p.map_err(|e| SqliteError::Join(e.to_string()))?,
            () = limits.cancel.cancelled() => return Err(SqliteError::Cancelled),
            () = tokio::time::sleep_until(limits.deadline.into()) => return Err(SqliteError::Busy {
                name: self.name.clone(),
                slots: self.pool_size,
                waited_ms: limits.budget_ms(),
            }),
        };
        let stop = Stop {
            deadline: limits.deadline,
            cancelled: Arc::new(AtomicBool::new(false)),
            budget_ms: limits.budget_ms(),
        };
        let call = SqliteCall {
            name: self.name.clone(),
            path: self.path.clone(),
            stop: stop.clone(),
            max_value_bytes: limits.max_value_bytes,
        };
        let flag = Arc::clone(&stop.cancelled);
        let cancel = limits.cancel.clone();
        let watcher = tokio::spawn(async move {
            cancel.cancelled().await;
            flag.store(true, Ordering::Relaxed);
        });
        let joined = tokio::task::spawn_blocking(move || {
            // The slot is the thread's, not the call's: SQLite stops a statement only
            // between its steps, so a thread can outlive its call (the worker answers
            // at the deadline and drops this future). Until the thread really ends its
            // slot stays taken, and later calls wait or are refused instead of starting
            // more threads.
            let _slot = permit;
            f(&call)
        })
        .await;
        watcher.abort();
        joined.map_err(|e| SqliteError::Join(e.to_string()))?
    }

    pub async fn ping(&self, limits: &Limits) -> Result<(), SqliteError> {
        self.run(limits, |c| {
            let conn = c.open(Mode::ReadOnly)?;
            conn.query_row("SELECT count(*) FROM sqlite_schema", [], |r| {
                r.get::<_, i64>(0)
            })
            .map_err(|e| c.error(e))?;
            Ok(())
        })
        .await
    }

    pub async fn query(
        &self,
        sql: String,
        params: Vec<Value>,
        limits: &Limits,
    ) -> Result<Output, SqliteError> {
        if !self.skip_parser {
            readonly::check_read_only(&sql, Engine::Sqlite)?;
        }
        let engine = !self.skip_engine;
        let (max_rows, max_bytes) = (limits.max_rows, limits.max_bytes);
        self.run(limits, move |c| {
            let params = sqlite_params(&params)?;
            let conn = c.open(if engine {
                Mode::ReadOnly
            } else {
                Mode::ReadWrite
            })?;
            if engine {
                conn.pragma_update(None, "query_only", true)
                    .map_err(|e| c.error(e))?;
                conn.authorizer(Some(read_only_authorizer))
                    .map_err(|e| c.error(e))?;
            }
            c.watch(&conn)?;
            let mut stmt = conn.prepare(&sql).map_err(|e| c.error(e))?;
            if engine && !stmt.readonly() {
                return Err(SqliteError::EngineRefused(
                    "SQLite reports that the statement writes".into(),
                ));
            }
            collect(c, &mut stmt, &params, max_rows, max_bytes, None)
        })
        .await
    }

    pub async fn execute(
        &self,
        sql: String,
        params: Vec<Value>,
        limits: &Limits,
    ) -> Result<Output, SqliteError> {
        readonly::check_single_statement(&sql, Engine::Sqlite)?;
        let (max_rows, max_bytes) = (limits.max_rows, limits.max_bytes);
        self.run(limits, move |c| {
            let params = sqlite_params(&params)?;
            let mut conn = c.open(Mode::ReadWrite)?;
            c.watch(&conn)?;
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| c.error(e))?;
            tx.authorizer(Some(write_authorizer))
                .map_err(|e| c.error(e))?;
            let out = {
                let mut stmt = tx.prepare(&sql).map_err(|e| c.error(e))?;
                collect(c, &mut stmt, &params, max_rows, max_bytes, Some(&tx))?
            };
            tx.authorizer(None::<fn(AuthContext<'_>) -> Authorization>)
                .map_err(|e| c.error(e))?;
            tx.commit().map_err(|e| c.error(e))?;
            Ok(out)
        })
        .await
    }

    /// The tables and views, in name order, as many as fit in the result cap: a file
    /// may hold thousands of names of any length.
    pub async fn list_tables(&self, limits: &Limits) -> Result<Value, SqliteError> {
        let max = limits.max_bytes;
        let cap = max.saturating_sub(LIST_RESERVE);
        self.run(limits, move |c| {
            let conn = c.open(Mode::ReadOnly)?;
            let mut stmt = conn
                .prepare(
                    "SELECT name, type FROM sqlite_schema WHERE type IN ('table', 'view') \
                     AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name",
                )
                .map_err(|e| c.error(e))?;
            let mut rows = stmt.query([]).map_err(|e| c.error(e))?;
            let mut tables = Vec::new();
            let mut bytes = 0usize;
            let mut truncated = false;
            while let Some(row) = rows.next().map_err(|e| c.error(e))? {
                let table = json!({
                    "name": row.get::<_, String>(0).map_err(|e| c.error(e))?,
                    "type": row.get::<_, String>(1).map_err(|e| c.error(e))?,
                });
                // As serialized (escapes included), plus the comma.
                let len = serde_json::to_string(&table).map_or(usize::MAX, |t| t.len() + 1);
                if bytes.saturating_add(len) > cap {
                    truncated = true;
                    break;
                }
                bytes += len;
                tables.push(table);
            }
            let mut answer = json!({ "tables": tables, "truncated": truncated });
            if truncated {
                answer["note"] = json!(format!(
                    "more tables and views exist than were returned: this list stops before about {} bytes, the most one answer holds; list the rest with query_database, e.g. SELECT name, type FROM sqlite_schema WHERE type IN ('table', 'view') AND name > ?1 ORDER BY name LIMIT 100 with params [the last name above], or narrow by name with AND name LIKE 'prefix%'",
                    max
                ));
            }
            Ok(answer)
        })
        .await
    }

    pub async fn describe(&self, table: String, limits: &Limits) -> Result<Value, SqliteError> {
        let max = limits.max_bytes;
        self.run(limits, move |c| {
            let conn = c.open(Mode::ReadOnly)?;
            describe(c, &conn, &table, max)
        })
        .await
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    ReadOnly,
    ReadWrite,
}

/// One call's view of the database, on the blocking thread.
struct SqliteCall {
    name: String,
    path: PathBuf,
    stop: Stop,
    /// `SQLITE_LIMIT_LENGTH` of the call's connection.
    max_value_bytes: usize,
}

impl SqliteCall {
    fn open(&self, mode: Mode) -> Result<Connection, SqliteError> {
        if !self.path.is_file() {
            return Err(SqliteError::Unreachable {
                name: self.name.clone(),
                reason: format!("the file {} does not exist", self.path.display()),
            });
        }
        let flags = match mode {
            Mode::ReadOnly => OpenFlags::SQLITE_OPEN_READ_ONLY,
            Mode::ReadWrite => OpenFlags::SQLITE_OPEN_READ_WRITE,
        } | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(&self.path, flags).map_err(|e| {
            SqliteError::Unreachable {
                name: self.name.clone(),
                reason: e.to_string(),
            }
        })?;
        use rusqlite::config::DbConfig;
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_DEFENSIVE, true)
            .map_err(|e| self.error(e))?;
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_TRUSTED_SCHEMA, false)
            .map_err(|e| self.error(e))?;
        // No string, blob or row larger than this is ever built: SQLite checks the
        // length before it allocates (randomblob, zeroblob, ||, replace, printf,
        // group_concat, reading a stored value), so a statement cannot make the worker
        // allocate far beyond what one result could return.
        let length = i32::try_from(self.max_value_bytes).unwrap_or(i32::MAX);
        conn.set_limit(Limit::SQLITE_LIMIT_LENGTH, length)
            .map_err(|e| self.error(e))?;
        // Before anything that reads the schema (`bound` asks the database's encoding): a
        // database another process is writing waits until the call's deadline.
        let wait = self.stop.deadline.saturating_duration_since(Instant::now());
        conn.busy_timeout(wait).map_err(|e| self.error(e))?;
        sqlite_functions::bound(&conn).map_err(|e| self.error(e))?;
        // Process-wide, and it only ever lowers the ceiling: setting it on every
        // connection is idempotent. Neither authorizer lets a statement change it.
        conn.pragma_update(None, "hard_heap_limit", SQLITE_HEAP_LIMIT)
            .map_err(|e| self.error(e))?;
        // Sorts, recursive CTE queues and other temporary tables stay in memory, under
        // the heap ceiling above: the confined worker may not create files in the
        // temporary directory, where SQLite would otherwise spill them.
        conn.pragma_update(None, "temp_store", "MEMORY")
            .map_err(|e| self.error(e))?;
        Ok(conn)
    }

    /// Interrupts the running statement at the deadline or on cancellation.
    fn watch(&self, conn: &Connection) -> Result<(), SqliteError> {
        let stop = self.stop.clone();
        conn.progress_handler(1000, Some(move || stop.now()))
            .map_err(|e| self.error(e))
    }

    fn error(&self, e: rusqlite::Error) -> SqliteError {
        use rusqlite::ffi::ErrorCode;
        if let rusqlite::Error::SqliteFailure(f, msg) = &e {
            let text = msg.clone().unwrap_or_else(|| f.to_string());
            match f.code {
                ErrorCode::OperationInterrupted => {
                    return if self.stop.cancelled.load(Ordering::Relaxed) {
                        SqliteError::Cancelled
                    } else {
                        SqliteError::Timeout(self.stop.budget_ms)
                    };
                }
                ErrorCode::ReadOnly | ErrorCode::AuthorizationForStatementDenied => {
                    return SqliteError::EngineRefused(text);
                }
                ErrorCode::TooBig => {
                    return SqliteError::ValueTooLarge {
                        max: self.max_value_bytes,
                    };
                }
                ErrorCode::OutOfMemory => {
                    return SqliteError::OutOfMemory {
                        max: SQLITE_HEAP_LIMIT,
                    };
                }
                // SQLite's own words for SQLITE_LIMIT_LIKE_PATTERN_LENGTH.
                _ if text.contains("LIKE or GLOB pattern too complex") => {
                    return SqliteError::LikePatternTooLong {
                        max: MAX_LIKE_PATTERN_BYTES,
                    };
                }
                _ => return SqliteError::Sql(text),
            }
        }
        if matches!(e, rusqlite::Error::MultipleStatement) {
            return SqliteError::Sql(
                "found more than one statement; send exactly one statement per call".into(),
            );
        }
        SqliteError::Sql(e.to_string())
    }
}

/// Authorizer for `query_database`: reads only.
fn read_only_authorizer(ctx: AuthContext<'_>) -> Authorization {
    match ctx.action {
        AuthAction::Select | AuthAction::Read { .. } | AuthAction::Recursive => {
            Authorization::Allow
        }
        AuthAction::Function { function_name } if !denied_function(function_name) => {
            Authorization::Allow
        }
        AuthAction::Pragma {
            pragma_name,
            pragma_value,
        } if sqlite_pragma_reads(pragma_name, pragma_value.is_some()) => Authorization::Allow,
        _ => Authorization::Deny,
    }
}

/// Authorizer for `execute_sql`: no ATTACH/DETACH, transaction control, pragma changes
/// or denied functions; ordinary DML and DDL pass.
fn write_authorizer(ctx: AuthContext<'_>) -> Authorization {
    match ctx.action {
        AuthAction::Attach { .. }
        | AuthAction::Detach { .. }
        | AuthAction::Transaction { .. }
        | AuthAction::Savepoint { .. } => Authorization::Deny,
        AuthAction::Function { function_name } if denied_function(function_name) => {
            Authorization::Deny
        }
        AuthAction::Pragma {
            pragma_name,
            pragma_value,
        } if !sqlite_pragma_reads(pragma_name, pragma_value.is_some()) => Authorization::Deny,
        _ => Authorization::Allow,
    }
}

/// Steps `stmt` to the end, keeping at most `max_rows` rows and `max_bytes` of values
/// (counted value by value, each from its raw size before it is converted, so no row is
/// converted past the cap). With `changes_from`, also reports rows affected
/// (execute_sql).
fn collect(
    c: &SqliteCall,
    stmt: &mut rusqlite::Statement<'_>,
    params: &[rusqlite::types::Value],
    max_rows: u64,
    max_bytes: usize,
    changes_from: Option<&Connection>,
) -> Result<Output, SqliteError> {
    let decls: Vec<String> = stmt
        .columns()
        .iter()
        .map(|col| col.decl_type().unwrap_or_default().to_owned())
        .collect();
    let names: Vec<String> = stmt.column_names().into_iter().map(str::to_owned).collect();
    let mut types: Vec<Option<String>> = decls
        .iter()
        .map(|d| (!d.is_empty()).then(|| d.to_ascii_lowercase()))
        .collect();
    let mut out = Output::default();
    let mut rows = stmt
        .query(rusqlite::params_from_iter(params.iter()))
        .map_err(|e| c.error(e))?;
    let mut bytes = 0usize;
    let writing = changes_from.is_some();
    while let Some(row) = rows.next().map_err(|e| c.error(e))? {
        if out.truncated {
            if writing {
                continue; // run a write to the end, but keep no more rows
            }
            break;
        }
        if out.rows.len() as u64 >= max_rows {
            out.truncated = true;
            if writing {
                continue;
            }
            break;
        }
        let mut values = Vec::with_capacity(names.len());
        let mut row_bytes = 0usize;
        let mut fits = true;
        for (i, decl) in decls.iter().enumerate() {
            let v = row.get_ref(i).map_err(|e| c.error(e))?;
            if bytes + row_bytes + sqlite_json_len(v) > max_bytes {
                fits = false;
                break;
            }
            if let Some(slot) = types.get_mut(i)
                && slot.is_none()
                && !matches!(v, rusqlite::types::ValueRef::Null)
            {
                *slot = Some(sqlite_storage_class(v).to_owned());
            }
            let json = sqlite_value(v, decl);
            row_bytes += approx_len(&json);
            values.push(json);
        }
        if !fits || bytes + row_bytes > max_bytes {
            out.over_cap(writing, max_bytes)?;
            if writing {
                continue;
            }
            break;
        }
        bytes += row_bytes;
        out.rows.push(values);
    }
    drop(rows);
    out.columns = names
        .into_iter()
        .zip(types)
        .map(|(name, ty)| (name, ty.unwrap_or_else(|| "null".into())))
        .collect();
    if let Some(conn) = changes_from {
        out.rows_affected = Some(conn.changes());
    }
    Ok(out)
}

/// How to list what a `describe_table` answer left out ([`crate::tools::fit_description`]).
pub(crate) const DESCRIPTION_REST: &str = "SELECT name, type, \"notnull\", dflt_value, pk FROM pragma_table_xinfo(?1) LIMIT 200 OFFSET 200 with params [the table]; indexes from pragma_index_list(?1) and pragma_index_info(?1) with params [the index], foreign keys from pragma_foreign_key_list(?1) likewise";

/// Describes `table`, reading no more of the catalog than about `max` bytes of names,
/// types and defaults: a table may have thousands of columns and any number of indexes,
/// and what is read past that would only be left out of the answer
/// ([`crate::tools::fit_description`] fits what is read; `truncated` says whether
/// reading stopped early).
fn describe(
    c: &SqliteCall,
    conn: &Connection,
    table: &str,
    max: usize,
) -> Result<Value, SqliteError> {
    let found: Option<(String, String)> = conn
        .query_row(
            "SELECT name, type FROM sqlite_schema WHERE type IN ('table', 'view') \
             AND name = ?1 COLLATE NOCASE ORDER BY name = ?1 DESC LIMIT 1",
            [table],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .map(Some)
        .or_else(|e| match e {
            rusqlite::Error::QueryReturnedNoRows => Ok(None),
            e => Err(c.error(e)),
        })?;
    let Some((name, kind)) = found else {
        return Err(SqliteError::NoTable(table.to_owned()));
    };
    // Bytes of catalog text read so far; once past `max`, reading stops.
    let read = std::cell::Cell::new(0usize);
    let stopped = std::cell::Cell::new(false);
    let q = |sql: &str, arg: &str| -> Result<Vec<Map<String, Value>>, SqliteError> {
        let mut stmt = conn.prepare(sql).map_err(|e| c.error(e))?;
        let cols: Vec<String> = stmt.column_names().into_iter().map(str::to_owned).collect();
        let mut rows = stmt.query([arg]).map_err(|e| c.error(e))?;
        let mut out = Vec::new();
        while let Some(row) = rows.next().map_err(|e| c.error(e))? {
            if read.get() > max {
                stopped.set(true);
                break;
            }
            let mut m = Map::new();
            for (i, col) in cols.iter().enumerate() {
                let v = row.get_ref(i).map_err(|e| c.error(e))?;
                // Field names and punctuation, then the value itself.
                let len = 16 + v.as_bytes().map_or(8, <[u8]>::len);
                read.set(read.get().saturating_add(len));
                m.insert(col.clone(), sqlite_value(v, ""));
            }
            out.push(m);
        }
        Ok(out)
    };
    let mut pk: Vec<(i64, String)> = Vec::new();
    let columns: Vec<Value> = q(
        "SELECT name, type, \"notnull\", dflt_value, pk FROM pragma_table_xinfo(?1) WHERE hidden IN (0, 2, 3) ORDER BY cid",
        &name,
    )?
    .into_iter()
    .map(|m| {
        let col = m.get("name").and_then(Value::as_str).unwrap_or_default().to_owned();
        let pk_pos = m.get("pk").and_then(Value::as_i64).unwrap_or(0);
        if pk_pos > 0 {
            pk.push((pk_pos, col.clone()));
        }
        json!({
            "name": col,
            "type": m.get("type").cloned().unwrap_or(Value::Null),
            "nullable": m.get("notnull").and_then(Value::as_i64) == Some(0) && pk_pos == 0,
            "default": m.get("dflt_value").cloned().unwrap_or(Value::Null),
            "primary_key": pk_pos > 0,
        })
    })
    .collect();
    pk.sort();
    let mut fks: Vec<(i64, Value)> = Vec::new();
    for m in q(
        "SELECT id, seq, \"table\", \"from\", \"to\", on_update, on_delete FROM pragma_foreign_key_list(?1) ORDER BY id, seq",
        &name,
    )? {
        let id = m.get("id").and_then(Value::as_i64).unwrap_or(0);
        if fks.last().map(|(i, _)| *i) != Some(id) {
            fks.push((
                id,
                json!({
                    "columns": [],
                    "references": {"table": m.get("table").cloned().unwrap_or(Value::Null), "columns": []},
                    "on_update": m.get("on_update").cloned().unwrap_or(Value::Null),
                    "on_delete": m.get("on_delete").cloned().unwrap_or(Value::Null),
                }),
            ));
        }
        if let Some((_, fk)) = fks.last_mut() {
            if let Some(a) = fk["columns"].as_array_mut() {
                a.push(m.get("from").cloned().unwrap_or(Value::Null));
            }
            if let Some(a) = fk["references"]["columns"].as_array_mut() {
                a.push(m.get("to").cloned().unwrap_or(Value::Null));
            }
        }
    }
    if stopped.get() {
        // The last one may have lost columns to the stop.
        fks.pop();
    }
    let mut indexes = Vec::new();
    for m in q(
        "SELECT name, \"unique\", origin, partial FROM pragma_index_list(?1) ORDER BY name",
        &name,
    )? {
        if read.get() > max {
            stopped.set(true);
            break;
        }
        let index = m
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let cols: Vec<Value> = q(
            "SELECT name FROM pragma_index_info(?1) ORDER BY seqno",
            &index,
        )?
        .into_iter()
        .map(|c| c.get("name").cloned().unwrap_or(Value::Null))
        .collect();
        if stopped.get() {
            // Its columns may be cut: left out whole.
            break;
        }
        indexes.push(json!({
            "name": index,
            "columns": cols,
            "unique": m.get("unique").and_then(Value::as_i64) == Some(1),
            "primary": m.get("origin").and_then(Value::as_str) == Some("pk"),
            "partial": m.get("partial").and_then(Value::as_i64) == Some(1),
        }));
    }
    Ok(json!({
        "table": name,
        "type": kind,
        "columns": columns,
        "primary_key": pk.into_iter().map(|(_, c)| c).collect::<Vec<_>>(),
        "foreign_keys": fks.into_iter().map(|(_, v)| v).collect::<Vec<_>>(),
        "indexes": indexes,
        "truncated": stopped.get(),
    }))
}
