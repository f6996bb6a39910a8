//! The parser layer of read-only enforcement: `query_database` SQL must parse as exactly
//! one read statement with no side-effecting function in it.
//!
//! This layer fails closed: what `sqlparser` cannot parse is refused, and every statement
//! kind not known to be a read is refused. The engine layer (`sqlite.rs`, `postgres.rs`)
//! enforces read-only again on its own.

use std::ops::ControlFlow;

use sqlparser::ast::{
    Expr, ObjectName, ObjectNamePart, Query, SetExpr, Statement, TableFactor, Visit, Visitor,
};
use sqlparser::dialect::{Dialect, PostgreSqlDialect, SQLiteDialect};
use sqlparser::parser::Parser;

use crate::config::Engine;

const SUGGEST: &str = "query_database only reads; to change data use execute_sql (which may \
                       need approval and is refused on databases configured read_only)";

/// Why SQL was refused by the parser layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadOnlyError {
    #[error(
        "could not parse the SQL, so it was not run: {0}; query_database accepts one SELECT, WITH, VALUES, EXPLAIN or SHOW statement"
    )]
    Parse(String),
    #[error("no SQL statement found; send one statement")]
    Empty,
    #[error("found {0} statements; send exactly one statement per call")]
    Several(usize),
    #[error("refused: this is a {0} statement; {SUGGEST}")]
    NotRead(String),
    #[error("refused: the query contains {0}; {SUGGEST}")]
    Modifying(String),
    #[error(
        "refused: function {0}() has side effects or needs privileges and is not allowed in query_database"
    )]
    Function(String),
    #[error(
        "refused: {0} is not allowed in execute_sql, which runs its one statement in a transaction of its own"
    )]
    NotInExecute(String),
}

fn dialect(engine: Engine) -> Box<dyn Dialect> {
    match engine {
        Engine::Sqlite => Box::new(SQLiteDialect {}),
        Engine::Postgres => Box::new(PostgreSqlDialect {}),
    }
}

/// Functions refused anywhere in a `query_database` statement (compared by their last,
/// lower-cased name part, so `pg_catalog.set_config` matches too). Prefix entries end
/// with `*`.
const DENIED_FUNCTIONS: &[&str] = &[
    // PostgreSQL: sequences, settings, locks, large objects, server files, other servers.
    "nextval",
    "setval",
    "set_config",
    "pg_advisory_*",
    "pg_try_advisory_*",
    "lo_*",
    "loread",
    "lowrite",
    "pg_read_file",
    "pg_read_binary_file",
    "pg_ls_*",
    "pg_stat_file",
    "pg_file_*",
    "dblink*",
    "pg_terminate_backend",
    "pg_cancel_backend",
    "pg_reload_conf",
    "pg_rotate_logfile",
    "pg_switch_wal",
    "pg_create_restore_point",
    "pg_backup_*",
    "pg_start_backup",
    "pg_stop_backup",
    "pg_promote",
    "pg_create_*",
    "pg_drop_replication_slot",
    "pg_copy_*",
    "pg_replication_*",
    "pg_logical_*",
    "pg_notify",
    "pg_import_system_collations",
    "pg_wal_replay_*",
    "pg_log_backend_memory_contexts",
    "txid_current",
    "pg_current_xact_id",
    // Functions that run SQL given as a string (the parser could not see inside it):
    // the XML exports, the text-search statistics and rewrite functions of the core,
    // and the `tablefunc` extension's pivots.
    "query_to_xml*",
    "query_to_xmlschema",
    "cursor_to_xml*",
    "table_to_xml*",
    "schema_to_xml*",
    "database_to_xml*",
    "ts_stat",
    "ts_rewrite",
    "crosstab*",
    "connectby",
    // SQLite: extensions and file access (not in the bundled build, refused anyway).
    "load_extension",
    "readfile",
    "writefile",
    "edit",
    "fts3_tokenizer",
    "sqlite_dbpage",
];

pub(crate) fn denied_function(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    DENIED_FUNCTIONS.iter().any(|d| match d.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == *d,
    })
}

/// SQLite pragmas that only report, with or without an argument (`PRAGMA table_info(t)`).
pub(crate) const SQLITE_INTROSPECTION_PRAGMAS: &[&str] = &[
    "table_info",
    "table_xinfo",
    "table_list",
    "index_list",
    "index_info",
    "index_xinfo",
    "foreign_key_list",
    "database_list",
    "collation_list",
    "function_list",
    "module_list",
    "pragma_list",
    "compile_options",
];

/// SQLite pragmas that read a setting when given no value (and change it when given one).
pub(crate) const SQLITE_SETTING_PRAGMAS: &[&str] = &[
    "user_version",
    "schema_version",
    "application_id",
    "encoding",
    "page_size",
    "page_count",
    "freelist_count",
    "journal_mode",
    "foreign_keys",
    "data_version",
    "query_only",
];

/// Whether the SQLite pragma `name` with `has_value` only reads.
pub(crate) fn sqlite_pragma_reads(name: &str, has_value: bool) -> bool {
    let name = name.to_ascii_lowercase();
    SQLITE_INTROSPECTION_PRAGMAS.contains(&name.as_str())
        || (!has_value && SQLITE_SETTING_PRAGMAS.contains(&name.as_str()))
}

fn parse(sql: &str, engine: Engine) -> Result<Vec<Statement>, ReadOnlyError> {
    Parser::parse_sql(dialect(engine).as_ref(), sql)
        .map_err(|e| ReadOnlyError::Parse(e.to_string()))
}

/// Checks that `sql` is exactly one read statement for `query_database`.
pub fn check_read_only(sql: &str, engine: Engine) -> Result<(), ReadOnlyError> {
    let statements = parse(sql, engine)?;
    let statement = match statements.as_slice() {
        [] => return Err(ReadOnlyError::Empty),
        [one] => one,
        many => return Err(ReadOnlyError::Several(many.len())),
    };
    let mut checker = ReadChecker { engine };
    match statement.visit(&mut checker) {
        ControlFlow::Break(e) => Err(e),
        ControlFlow::Continue(()) => Ok(()),
    }
}

/// Checks `execute_sql` SQL: one statement (when it parses) that is not transaction
/// control or `ATTACH`/`DETACH`. SQL that `sqlparser` cannot parse is left to the engine,
/// which runs exactly one prepared statement either way.
pub fn check_single_statement(sql: &str, engine: Engine) -> Result<(), ReadOnlyError> {
    let statements = match parse(sql, engine) {
        Ok(s) => s,
        Err(_) => return Ok(()),
    };
    match statements.as_slice() {
        [] => Err(ReadOnlyError::Empty),
        [one] => match one {
            Statement::StartTransaction { .. }
            | Statement::Commit { .. }
            | Statement::Rollback { .. }
            | Statement::Savepoint { .. }
            | Statement::ReleaseSavepoint { .. }
            | Statement::AttachDatabase { .. }
            | Statement::AttachDuckDBDatabase { .. }
            | Statement::DetachDuckDBDatabase { .. } => Err(ReadOnlyError::NotInExecute(kind(one))),
            _ => Ok(()),
        },
        many => Err(ReadOnlyError::Several(many.len())),
    }
}

/// A short name of a statement's kind for messages: its first keyword, two for
/// CREATE/DROP/ALTER (`DROP TABLE`).
fn kind(statement: &Statement) -> String {
    let text = statement.to_string();
    let mut words = text.split_whitespace().map(str::to_ascii_uppercase);
    let first = words.next().unwrap_or_default();
    match first.as_str() {
        "CREATE" | "DROP" | "ALTER" | "EXPLAIN" => match words.next() {
            Some(second) => format!("{first} {second}"),
            None => first,
        },
        _ => first,
    }
}

fn last_part(name: &ObjectName) -> String {
    match name.0.last() {
        Some(ObjectNamePart::Identifier(ident)) => ident.value.clone(),
        Some(ObjectNamePart::Function(f)) => f.name.value.clone(),
        None => String::new(),
    }
}

struct ReadChecker {
    engine: Engine,
}

impl ReadChecker {
    fn check_function(&self, name: &ObjectName) -> ControlFlow<ReadOnlyError> {
        let last = last_part(name);
        if denied_function(&last) {
            return ControlFlow::Break(ReadOnlyError::Function(last.to_ascii_lowercase()));
        }
        ControlFlow::Continue(())
    }

    fn check_set_expr(&self, body: &SetExpr) -> ControlFlow<ReadOnlyError> {
        match body {
            SetExpr::Select(select) => {
                if select.into.is_some() {
                    return ControlFlow::Break(ReadOnlyError::Modifying(
                        "SELECT … INTO (which creates a table)".into(),
                    ));
                }
                ControlFlow::Continue(())
            }
            SetExpr::Query(_) | SetExpr::Values(_) | SetExpr::Table(_) => ControlFlow::Continue(()),
            SetExpr::SetOperation { left, right, .. } => {
                self.check_set_expr(left)?;
                self.check_set_expr(right)
            }
            SetExpr::Insert(s) | SetExpr::Update(s) | SetExpr::Delete(s) | SetExpr::Merge(s) => {
                ControlFlow::Break(ReadOnlyError::Modifying(format!(
                    "a data-modifying {} inside WITH or a subquery",
                    kind(s)
                )))
            }
        }
    }

    fn check_statement(&self, statement: &Statement) -> ControlFlow<ReadOnlyError> {
        match statement {
            Statement::Query(_) => ControlFlow::Continue(()),
            Statement::Explain {
                analyze, statement, ..
            } => match statement.as_ref() {
                Statement::Query(_) => ControlFlow::Continue(()),
                inner => ControlFlow::Break(ReadOnlyError::NotRead(format!(
                    "EXPLAIN{} {}",
                    if *analyze { " ANALYZE" } else { "" },
                    kind(inner)
                ))),
            },
            Statement::ShowVariable { .. }
            | Statement::ShowVariables { .. }
            | Statement::ShowTables { .. }
            | Statement::ShowColumns { .. }
            | Statement::ShowViews { .. }
            | Statement::ShowFunctions { .. }
            | Statement::ShowDatabases { .. }
            | Statement::ShowSchemas { .. }
            | Statement::ShowCollation { .. }
                if self.engine == Engine::Postgres =>
            {
                ControlFlow::Continue(())
            }
            Statement::Pragma {
                name, value, is_eq, ..
            } if self.engine == Engine::Sqlite
                && !*is_eq
                && sqlite_pragma_reads(&last_part(name), value.is_some()) =>
            {
                ControlFlow::Continue(())
            }
            other => ControlFlow::Break(ReadOnlyError::NotRead(kind(other))),
        }
    }
}

impl Visitor for ReadChecker {
    type Break = ReadOnlyError;

    fn pre_visit_statement(&mut self, statement: &Statement) -> ControlFlow<Self::Break> {
        self.check_statement(statement)
    }

    fn pre_visit_query(&mut self, query: &Query) -> ControlFlow<Self::Break> {
        if !query.locks.is_empty() {
            return ControlFlow::Break(ReadOnlyError::Modifying(
                "a locking clause (FOR UPDATE / FOR SHARE)".into(),
            ));
        }
        if query.for_clause.is_some() || !query.pipe_operators.is_empty() {
            return ControlFlow::Break(ReadOnlyError::NotRead("non-standard query".into()));
        }
        self.check_set_expr(&query.body)
    }

    fn pre_visit_expr(&mut self, expr: &Expr) -> ControlFlow<Self::Break> {
        if let Expr::Function(f) = expr {
            self.check_function(&f.name)?;
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_relation(&mut self, relation: &ObjectName) -> ControlFlow<Self::Break> {
        // Table-valued functions (`FROM dblink(...)`, `FROM pg_ls_dir('/')`) are relations.
        self.check_function(relation)
    }

    fn pre_visit_table_factor(&mut self, factor: &TableFactor) -> ControlFlow<Self::Break> {
        if let TableFactor::Function { name, .. } = factor {
            self.check_function(name)?;
        }
        ControlFlow::Continue(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg(sql: &str) -> Result<(), ReadOnlyError> {
        check_read_only(sql, Engine::Postgres)
    }
    fn lite(sql: &str) -> Result<(), ReadOnlyError> {
        check_read_only(sql, Engine::Sqlite)
    }

    #[test]
    fn reads_pass() {
        for sql in [
            "SELECT 1",
            "  (SELECT 1)",
            "select * from t where a = $1 order by 1 limit 5",
            "WITH x AS (SELECT 1 AS a) SELECT * FROM x",
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c",
            "VALUES (1, 'a'), (2, 'b')",
            "EXPLAIN SELECT * FROM t",
            "SHOW statement_timeout",
            "SELECT currval('s'), now(), pg_sleep(0.1)",
            "SELECT 1 UNION SELECT 2 EXCEPT SELECT 3",
        ] {
            assert_eq!(pg(sql), Ok(()), "{sql}");
        }
        for sql in [
            "SELECT * FROM t WHERE a = ?1",
            "PRAGMA table_info('t')",
            "PRAGMA user_version",
            "SELECT * FROM pragma_table_info('t')",
        ] {
            assert_eq!(lite(sql), Ok(()), "{sql}");
        }
    }

    #[test]
    fn writes_and_tricks_are_refused() {
        for sql in [
            "INSERT INTO t VALUES (1)",
            "UPDATE t SET a = 1",
            "DELETE FROM t",
            "DROP TABLE t",
            "CREATE TABLE u (a int)",
            "ALTER TABLE t ADD COLUMN b int",
            "TRUNCATE t",
            "SELECT 1; DROP TABLE t",
            "SELECT 1 -- \n; DELETE FROM t",
            "/* x */ DeLeTe FROM t",
            "WITH x AS (DELETE FROM t RETURNING *) SELECT * FROM x",
            "WITH x AS (UPDATE t SET a = 1 RETURNING *) SELECT * FROM x",
            "SELECT * FROM t FOR UPDATE",
            "SELECT * FROM t FOR SHARE",
            "SELECT * INTO newtab FROM t",
            "SELECT nextval('s')",
            "SELECT setval('s', 5)",
            "SELECT set_config('x', 'y', false)",
            "SELECT pg_catalog.set_config('x', 'y', false)",
            "SELECT pg_advisory_lock(1)",
            "SELECT lo_import('/etc/passwd')",
            "SELECT pg_read_file('/etc/passwd')",
            "SELECT * FROM pg_ls_dir('/')",
            "SELECT * FROM dblink('host=x', 'DELETE FROM t') AS r(a int)",
            "SELECT query_to_xml('DELETE FROM t', true, false, '')",
            "SELECT * FROM ts_stat('SELECT to_tsvector(pg_terminate_backend(1)::text)')",
            "SELECT * FROM PG_CATALOG.TS_STAT('SELECT 1', 'a')",
            "SELECT ts_rewrite('a'::tsquery, 'SELECT ''a''::tsquery, ''b''::tsquery')",
            "SELECT * FROM crosstab3('SELECT 1, 2, 3')",
            "SELECT * FROM connectby('t', 'id', 'parent', '1', 0) AS c(id int, p int, l int)",
            "COPY t TO PROGRAM 'id'",
            "DO $$ BEGIN DELETE FROM t; END $$",
            "CALL p()",
            "EXPLAIN ANALYZE DELETE FROM t",
            "EXPLAIN DELETE FROM t",
            "SET statement_timeout = 0",
            "BEGIN",
            "COMMIT",
            "",
            "  ;  ",
            "SELECT (SELECT nextval('s'))",
            "SELECT 1 WHERE EXISTS (SELECT setval('s', 1))",
        ] {
            assert!(pg(sql).is_err(), "{sql:?} passed");
        }
        for sql in [
            "ATTACH DATABASE '/tmp/x.db' AS x",
            "DETACH DATABASE x",
            "PRAGMA writable_schema=ON",
            "PRAGMA writable_schema(1)",
            "PRAGMA user_version = 5",
            "VACUUM INTO '/tmp/y.db'",
            "VACUUM",
            "SELECT load_extension('x')",
            "REPLACE INTO t VALUES (1)",
            "INSERT INTO t VALUES (1) ON CONFLICT DO NOTHING",
            "INSERT OR REPLACE INTO t VALUES (1)",
            "/* */ DeLeTe FROM t",
            "SELECT 1 -- \n; DELETE FROM t",
            "CREATE TEMP TABLE x (a)",
            "REINDEX",
            "ANALYZE",
        ] {
            assert!(lite(sql).is_err(), "{sql:?} passed");
        }
    }

    #[test]
    fn messages_name_what_was_found() {
        let e = pg("DROP TABLE t").unwrap_err().to_string();
        assert!(e.contains("DROP TABLE") && e.contains("execute_sql"), "{e}");
        let e = pg("SELECT 1; SELECT 2").unwrap_err().to_string();
        assert!(e.contains("2 statements"), "{e}");
        let e = pg("SELECT set_config('a','b',false)")
            .unwrap_err()
            .to_string();
        assert!(e.contains("set_config()"), "{e}");
        let e = pg("WITH x AS (DELETE FROM t RETURNING *) SELECT * FROM x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("DELETE"), "{e}");
    }

    #[test]
    fn execute_checks() {
        assert!(check_single_statement("INSERT INTO t VALUES (1)", Engine::Postgres).is_ok());
        assert!(check_single_statement("SELECT nextval('s')", Engine::Postgres).is_ok());
        assert!(check_single_statement("COMMIT", Engine::Postgres).is_err());
        assert!(check_single_statement("BEGIN", Engine::Sqlite).is_err());
        assert!(check_single_statement("ATTACH 'x.db' AS x", Engine::Sqlite).is_err());
        assert!(
            check_single_statement("INSERT INTO t VALUES (1); DELETE FROM t", Engine::Sqlite)
                .is_err()
        );
    }
}
