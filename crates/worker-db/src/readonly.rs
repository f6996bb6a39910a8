//! The parser layer of read-only enforcement: `query_database` SQL must parse as exactly
//! one read statement with no side-effecting function in it.
//!
//! This layer fails closed: what `sqlparser` cannot parse is refused, and every statement
//! kind not known to be a read is refused. The engine layer (`sqlite.rs`, `postgres.rs`)
//! enforces read-only again on its own. Before any parse (here and for `execute_sql`), a
//! statement whose operators nest too deep for the tree to be dropped safely is refused
//! ([`MAX_NESTED_OPERATORS`]).

use std::ops::ControlFlow;
use std::panic::{AssertUnwindSafe, catch_unwind};

use sqlparser::ast::{
    Expr, ObjectName, ObjectNamePart, Query, SetExpr, Statement, TableFactor, Visit, Visitor,
};
use sqlparser::dialect::{Dialect, PostgreSqlDialect, SQLiteDialect};
use sqlparser::keywords::Keyword;
use sqlparser::parser::{Parser, ParserError};
use sqlparser::tokenizer::{Token, TokenWithSpan, Tokenizer};

use crate::config::Engine;

const SUGGEST: &str = "query_database only reads; to change data use execute_sql (which may \
                       need approval and is refused on databases configured read_only)";

/// The most operators that may nest in one statement, as [`nesting`] counts them.
///
/// `sqlparser` builds a chain of operators (`1+1+1...`, `a = 1 OR a = 2 OR ...`, `UNION`
/// after `UNION`) in a loop, one tree level per operator, which its recursion limit does
/// not see; dropping that tree (and any other walk of it not guarded by `sqlparser`'s
/// own stack growth) then recurses once per level. The parse runs on the thread that
/// polls the call: the main thread of the db worker (its single-threaded runtime, 8 MiB
/// of stack by default), and 2 MiB threads in tests and multi-threaded runtimes.
/// Dropping one level takes at most about 130 bytes of stack in a debug build (measured
/// on `sqlparser` 0.61: 97 for `+` and `UNION` chains, 129 for `int[][]...`; 32–97 when
/// optimised), so 4000 levels need about 0.5 MiB: safe on a 2 MiB stack with the rest
/// of the call above it, while a 1000-term `a = 1 OR a = 2 ...` (about 2000 operators)
/// still passes.
pub(crate) const MAX_NESTED_OPERATORS: usize = 4000;

/// The most operators that may come before SQLite's `MATCH` or `REGEXP` in one
/// expression: `sqlparser`'s SQLite dialect copies the whole left operand of these two
/// recursively, at up to about 6 KiB of stack per level in a debug build (1.1 KiB
/// optimised), so 100 levels stay under 0.6 MiB.
pub(crate) const MAX_OPERATORS_BEFORE_MATCH: usize = 100;

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
    #[error(
        "refused before parsing: the statement nests {found} operators; at most {max}: split it or simplify (e.g. `col IN (1, 2, 3)` instead of a long OR chain, or several shorter statements)"
    )]
    TooDeep { found: usize, max: usize },
    #[error(
        "refused before parsing: {keyword} follows {found} operators in the same expression; at most {max} may come before MATCH or REGEXP: put that condition first (e.g. `WHERE body {keyword} 'x' AND ...`) or simplify the expression before it"
    )]
    TooMuchBeforeMatch {
        keyword: &'static str,
        found: usize,
        max: usize,
    },
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

/// One bracketed group of tokens (or the whole statement) while [`nesting`] counts.
#[derive(Default)]
struct Group {
    /// Nesting operators in the current comma-separated item of the group.
    ops: usize,
    /// The deepest group nested in the current item.
    inner: usize,
    /// The deepest item finished so far.
    deepest: usize,
    /// Set operators and PIVOT/UNPIVOT, which chain whole queries and tables across the
    /// commas of their select lists, so they count for the whole group.
    chained: usize,
}

impl Group {
    fn end_item(&mut self) {
        self.deepest = self.deepest.max(self.ops + self.inner);
        self.ops = 0;
        self.inner = 0;
    }

    fn depth(mut self) -> usize {
        self.end_item();
        self.deepest + self.chained
    }
}

/// What [`nesting`] found.
#[derive(Debug, PartialEq, Eq)]
struct Nesting {
    /// An upper bound on how deep the operators of the statement nest.
    depth: usize,
    /// The most operators before a MATCH or REGEXP in one expression (SQLite), with it.
    before_match: Option<(usize, &'static str)>,
}

/// Counts, without building the tree, how deep operators can nest in `tokens`: the
/// operators of one comma-separated item (no operator chain crosses a comma at the same
/// bracket level) plus the deepest bracketed group inside that item, plus the set
/// operators of the group. Every symbol other than brackets, commas, periods and
/// literals counts, and so do the keywords the parser reads as operators: a symbol this
/// list does not know is counted rather than missed.
fn nesting(tokens: &[TokenWithSpan], engine: Engine) -> Nesting {
    let mut current = Group::default();
    let mut outer: Vec<Group> = Vec::new();
    let mut before_match: Option<(usize, &'static str)> = None;
    let close = |current: &mut Group, outer: &mut Vec<Group>| {
        if let Some(parent) = outer.pop() {
            let depth = std::mem::replace(current, parent).depth();
            current.inner = current.inner.max(depth);
        }
    };
    for token in tokens {
        match &token.token {
            Token::LParen | Token::LBrace => outer.push(std::mem::take(&mut current)),
            // Also an operator: subscripts and `int[][]` array types nest per bracket.
            Token::LBracket => {
                current.ops += 1;
                outer.push(std::mem::take(&mut current));
            }
            Token::RParen | Token::RBrace | Token::RBracket => close(&mut current, &mut outer),
            Token::Comma | Token::SemiColon => current.end_item(),
            Token::Word(w) => match w.keyword {
                Keyword::UNION
                | Keyword::EXCEPT
                | Keyword::INTERSECT
                | Keyword::MINUS
                | Keyword::PIVOT
                | Keyword::UNPIVOT => current.chained += 1,
                Keyword::MATCH | Keyword::REGEXP => {
                    if engine == Engine::Sqlite {
                        let found = current.ops + current.inner;
                        if before_match.is_none_or(|(most, _)| found > most) {
                            let keyword = if w.keyword == Keyword::MATCH {
                                "MATCH"
                            } else {
                                "REGEXP"
                            };
                            before_match = Some((found, keyword));
                        }
                    }
                    current.ops += 1;
                }
                Keyword::AND
                | Keyword::OR
                | Keyword::XOR
                | Keyword::NOT
                | Keyword::IS
                | Keyword::NOTNULL
                | Keyword::IN
                | Keyword::BETWEEN
                | Keyword::OVERLAPS
                | Keyword::LIKE
                | Keyword::ILIKE
                | Keyword::RLIKE
                | Keyword::SIMILAR
                | Keyword::MEMBER
                | Keyword::OPERATOR
                | Keyword::DIV
                | Keyword::AT
                | Keyword::COLLATE => current.ops += 1,
                _ => {}
            },
            Token::Whitespace(_)
            | Token::EOF
            | Token::Period
            | Token::Number(..)
            | Token::Placeholder(_)
            | Token::SingleQuotedString(_)
            | Token::DoubleQuotedString(_)
            | Token::TripleSingleQuotedString(_)
            | Token::TripleDoubleQuotedString(_)
            | Token::DollarQuotedString(_)
            | Token::SingleQuotedByteStringLiteral(_)
            | Token::DoubleQuotedByteStringLiteral(_)
            | Token::TripleSingleQuotedByteStringLiteral(_)
            | Token::TripleDoubleQuotedByteStringLiteral(_)
            | Token::SingleQuotedRawStringLiteral(_)
            | Token::DoubleQuotedRawStringLiteral(_)
            | Token::TripleSingleQuotedRawStringLiteral(_)
            | Token::TripleDoubleQuotedRawStringLiteral(_)
            | Token::NationalStringLiteral(_)
            | Token::QuoteDelimitedStringLiteral(_)
            | Token::NationalQuoteDelimitedStringLiteral(_)
            | Token::EscapedStringLiteral(_)
            | Token::UnicodeStringLiteral(_)
            | Token::HexStringLiteral(_) => {}
            _ => current.ops += 1,
        }
    }
    // Unclosed brackets: the parser still builds (and drops) what came before the error.
    while !outer.is_empty() {
        close(&mut current, &mut outer);
    }
    Nesting {
        depth: current.depth(),
        before_match,
    }
}

fn parse(sql: &str, engine: Engine) -> Result<Vec<Statement>, ReadOnlyError> {
    let dialect = dialect(engine);
    // Tokenizing is a loop, so it is safe on any input; the counts below then keep the
    // parser from building a tree too deep to drop.
    let tokens = Tokenizer::new(dialect.as_ref(), sql)
        .tokenize_with_location()
        .map_err(|e| ReadOnlyError::Parse(ParserError::from(e).to_string()))?;
    let found = nesting(&tokens, engine);
    if found.depth > MAX_NESTED_OPERATORS {
        return Err(ReadOnlyError::TooDeep {
            found: found.depth,
            max: MAX_NESTED_OPERATORS,
        });
    }
    if let Some((found, keyword)) = found.before_match
        && found > MAX_OPERATORS_BEFORE_MATCH
    {
        return Err(ReadOnlyError::TooMuchBeforeMatch {
            keyword,
            found,
            max: MAX_OPERATORS_BEFORE_MATCH,
        });
    }
    // `sqlparser`'s SQLite dialect unwraps the parse of the right side of MATCH and
    // REGEXP (`SELECT 1 MATCH )` panics): that is a statement that does not parse, not a
    // reason to lose the call. The parser is local, so nothing is left half-changed.
    let parsed = catch_unwind(AssertUnwindSafe(|| {
        Parser::new(dialect.as_ref())
            .with_tokens_with_locations(tokens)
            .parse_statements()
    }));
    match parsed {
        Ok(statements) => statements.map_err(|e| ReadOnlyError::Parse(e.to_string())),
        Err(_) => Err(ReadOnlyError::Parse(
            "the SQL parser failed on this statement".into(),
        )),
    }
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
/// control or `ATTACH`/`DETACH`, and not nested too deep to parse. SQL that `sqlparser`
/// cannot parse is left to the engine, which runs exactly one prepared statement either
/// way.
pub fn check_single_statement(sql: &str, engine: Engine) -> Result<(), ReadOnlyError> {
    let statements = match parse(sql, engine) {
        Ok(s) => s,
        Err(ReadOnlyError::Parse(_)) => return Ok(()),
        // Too deep to parse safely: refused here too (the engine's own parser has limits
        // of its own, but this process must not build the tree to find out).
        Err(e) => return Err(e),
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

    /// `SELECT 1+1+1...`: `sqlparser` builds one tree level per `+` in a loop.
    fn chain(terms: usize) -> String {
        let mut sql = String::from("SELECT 1");
        for _ in 0..terms {
            sql.push_str("+1");
        }
        sql
    }

    /// `SELECT * FROM t WHERE a = 1 OR a = 2 ...`, the long chain a caller really writes.
    fn or_chain(terms: usize) -> String {
        let conditions: Vec<String> = (1..=terms).map(|i| format!("a = {i}")).collect();
        format!("SELECT * FROM t WHERE {}", conditions.join(" OR "))
    }

    /// Without the count, the first of these (each deep enough) aborted the test binary
    /// with a stack overflow while dropping the tree, taking every test with it.
    #[test]
    fn statements_nested_too_deep_are_refused_before_they_are_parsed() {
        let long = chain(200_000);
        assert!(long.len() < 1024 * 1024, "under the sql maxLength");
        // Each deep enough to overflow a 2 MiB stack when dropped (about 20 000 levels).
        let unions = format!("SELECT 1{}", " UNION SELECT 1".repeat(30_000));
        let arrays = format!("SELECT CAST(1 AS int{})", "[]".repeat(30_000));
        let pivots = format!(
            "SELECT * FROM t{}",
            " PIVOT(sum(a) FOR b IN (1))".repeat(30_000)
        );
        let unclosed = format!("SELECT ({}", &long["SELECT ".len()..]);
        for engine in [Engine::Sqlite, Engine::Postgres] {
            for sql in [&long, &unions, &arrays, &pivots, &unclosed] {
                if engine == Engine::Sqlite && sql == &arrays {
                    continue; // `[...]` quotes a name in SQLite
                }
                let head = &sql[..40];
                for result in [
                    check_read_only(sql, engine),
                    check_single_statement(sql, engine),
                ] {
                    match result {
                        Err(ReadOnlyError::TooDeep { found, max }) => {
                            assert!(found > max, "{engine:?} {head}");
                            assert_eq!(max, MAX_NESTED_OPERATORS);
                        }
                        other => panic!("{engine:?} {head}...: {other:?}"),
                    }
                }
            }
        }
        let e = lite(&long).unwrap_err().to_string();
        assert!(
            e.contains("nests 200000 operators")
                && e.contains("at most 4000")
                && e.contains("split it or simplify"),
            "{e}"
        );
    }

    /// What a caller writes still parses, up to the bound, on a 2 MiB stack (the
    /// smallest a call runs on) in this unoptimised build.
    #[test]
    fn long_but_realistic_statements_still_parse() {
        let worst = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(|| {
                let mut results = Vec::new();
                for engine in [Engine::Sqlite, Engine::Postgres] {
                    results.push(check_read_only(&or_chain(1000), engine));
                    results.push(check_read_only(&chain(MAX_NESTED_OPERATORS - 10), engine));
                    // 20 subqueries deep, near what the parser's own recursion limit
                    // allows, with the chain inside, and the same failing to parse at its
                    // end (the tree is then dropped while the parser unwinds).
                    let mut nested = chain(MAX_NESTED_OPERATORS - 100);
                    let mut broken = format!("{nested} +");
                    for _ in 0..20 {
                        nested = format!("SELECT ({nested})");
                        broken = format!("SELECT ({broken})");
                    }
                    results.push(check_read_only(&nested, engine));
                    results.push(match check_read_only(&broken, engine) {
                        Err(ReadOnlyError::Parse(_)) => Ok(()),
                        other => other,
                    });
                }
                results
            })
            .unwrap()
            .join()
            .unwrap();
        assert!(worst.iter().all(Result::is_ok), "{worst:?}");
        assert_eq!(
            nesting(&tokens(&or_chain(1000)), Engine::Postgres).depth,
            2000,
            "1000 comparisons, 999 ORs and the `*`"
        );

        // Operators in different list items do not nest: a large insert of negative
        // numbers counts one per row, not one per value.
        let rows: Vec<String> = (1..=20_000)
            .map(|i| format!("(-{i}, -{i}.5, 'x')"))
            .collect();
        let insert = format!("INSERT INTO t VALUES {}", rows.join(", "));
        for engine in [Engine::Sqlite, Engine::Postgres] {
            assert_eq!(check_single_statement(&insert, engine), Ok(()));
        }
        assert_eq!(nesting(&tokens(&insert), Engine::Sqlite).depth, 1);
    }

    fn tokens(sql: &str) -> Vec<TokenWithSpan> {
        tokens_in(sql, &SQLiteDialect {})
    }

    fn tokens_in(sql: &str, dialect: &dyn Dialect) -> Vec<TokenWithSpan> {
        Tokenizer::new(dialect, sql)
            .tokenize_with_location()
            .unwrap()
    }

    /// The count is an upper bound of how deep the parser nests: brackets add, commas
    /// separate, set operators chain across commas.
    #[test]
    fn nesting_counts_per_item_and_adds_brackets() {
        let depth = |sql: &str| nesting(&tokens(sql), Engine::Sqlite).depth;
        assert_eq!(depth("SELECT a, b FROM t"), 0);
        assert_eq!(depth("SELECT a + b, c"), 1);
        assert_eq!(depth("SELECT f(a + b + c) + 1, 2"), 3);
        assert_eq!(depth("SELECT (a + (b + (c + d)))"), 3);
        assert_eq!(depth("SELECT a, b UNION SELECT c, d UNION SELECT e, f"), 2);
        // In SQLite, `[x]` quotes a name.
        assert_eq!(depth("SELECT x[1][2] FROM t"), 0);
        assert_eq!(
            nesting(
                &tokens_in("SELECT x[1][2] FROM t", &PostgreSqlDialect {}),
                Engine::Postgres
            )
            .depth,
            2
        );
        assert_eq!(depth("SELECT (1 + 1"), 1);
        assert_eq!(depth("SELECT 'a + b', \"c - d\", $1, ?2"), 0);
    }

    /// `sqlparser`'s SQLite dialect copies the left side of MATCH and REGEXP, and panics
    /// when their right side does not parse.
    #[test]
    fn sqlite_match_is_bounded_and_never_panics() {
        assert_eq!(lite("SELECT * FROM docs WHERE docs MATCH 'word'"), Ok(()));
        assert_eq!(lite("SELECT * FROM t WHERE a = 1 AND b REGEXP 'x'"), Ok(()));
        let long = format!("{} MATCH 'x'", chain(2000));
        match lite(&long) {
            Err(e @ ReadOnlyError::TooMuchBeforeMatch { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("MATCH follows 2000 operators") && text.contains("at most 100"),
                    "{text}"
                );
            }
            other => panic!("{other:?}"),
        }
        // PostgreSQL's dialect copies nothing.
        assert!(!matches!(
            pg(&long),
            Err(ReadOnlyError::TooMuchBeforeMatch { .. })
        ));
        for sql in ["SELECT 1 MATCH )", "SELECT a REGEXP ) FROM t"] {
            assert!(
                matches!(lite(sql), Err(ReadOnlyError::Parse(_))),
                "{sql}: {:?}",
                lite(sql)
            );
            assert_eq!(check_single_statement(sql, Engine::Sqlite), Ok(()));
        }
    }
}
