//! Airlock's database tools: `list_databases`, `list_tables`, `describe_table`,
//! `query_database` and `execute_sql`, over SQLite and PostgreSQL.
//!
//! `query_database` is read-only in depth, with two layers that each stop writes alone:
//!
//! 1. **Parser** (`readonly.rs`): the SQL must parse (`sqlparser`, the engine's dialect)
//!    as exactly one read statement — `SELECT`/`WITH` without data-modifying parts or
//!    locking clauses or `INTO`, `VALUES`, `EXPLAIN` of those, `SHOW` (PostgreSQL),
//!    introspection `PRAGMA`s (SQLite) — with no function from a denylist of
//!    side-effecting or privileged functions (`nextval`, `set_config`,
//!    `pg_advisory_lock`, `lo_import`, `pg_read_file`, `dblink`, `load_extension`, ...).
//! 2. **Engine**: SQLite opened read-only with `query_only`, an authorizer and
//!    `sqlite3_stmt_readonly`; PostgreSQL in a `READ ONLY` transaction, one prepared
//!    statement, `SET LOCAL statement_timeout`, rolled back, session reset.
//!
//! Results are one JSON object per call (see [`tools`]). Passwords are read at start
//! and never appear in an error, a log line or a result.
//!
//! Memory is bounded by what a result may hold, while the result is produced: SQLite
//! builds no value over 4 MiB (`SQLITE_LIMIT_LENGTH`) and no more than 256 MiB in all
//! (`hard_heap_limit`); PostgreSQL row messages over 4 MiB close the connection before
//! they are buffered (`pgwire.rs`); rows are counted value by value against the 1 MiB
//! result cap before each value is converted.
#![forbid(unsafe_code)]

mod config;
mod pgwire;
mod postgres;
mod readonly;
mod sqlite;
mod sqlite_functions;
mod tools;
mod values;

pub use config::{DatabaseConfig, DbError, Engine};
pub use postgres::PgError;
pub use readonly::ReadOnlyError;
pub use sqlite::SqliteError;
pub use tools::{sqlite_paths, tools};
pub use values::ValueError;
