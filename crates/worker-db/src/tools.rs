//! The five db tools: definitions, argument parsing, dispatch to an engine, and the JSON
//! result object.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_worker::{
    CallContext, CancellationToken, Tool, ToolAnnotations, ToolDefinition, ToolOutcome, ToolSet,
};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::config::{DatabaseConfig, DbError, Engine, Target};
use crate::postgres::Postgres;
use crate::sqlite::Sqlite;
use crate::values::ValueError;

/// One result holds at most about this many bytes of values: rows that would take it
/// further are left out (flagged `truncated`, like rows past `max_rows`), and a first
/// row that alone does not fit fails the call. Counted while the rows are produced.
pub(crate) const MAX_RESULT_BYTES: usize = 1024 * 1024;
/// What a `list_tables` answer keeps free below [`MAX_RESULT_BYTES`] for its other
/// fields and its note: the list itself stops before the rest, so a database with
/// thousands of long names still answers within the result cap (and far below the
/// worker's 32 MiB message limit).
pub(crate) const LIST_RESERVE: usize = 1024;
/// The lists of a `describe_table` answer that can be long, in the order they give way
/// when the answer would pass [`MAX_RESULT_BYTES`]: indexes first, then foreign keys,
/// then columns (the columns a model needs most, kept in table order from the first).
const DESCRIPTION_LISTS: [&str; 3] = ["indexes", "foreign_keys", "columns"];

/// Fits a `describe_table` answer within `max` bytes as serialized, less
/// [`LIST_RESERVE`] for the note: items are left out from the end of its lists, in
/// [`DESCRIPTION_LISTS`]'s order, until it does. The answer says whether anything was
/// left out (`truncated`, also set when the engine stopped reading early) and, if so,
/// how to list the rest (`rest`, the engine's catalog queries). A table with thousands
/// of columns, indexes or long defaults would otherwise answer above the worker's
/// message limit, failing at the transport with no advice.
pub(crate) fn fit_description(mut answer: Value, max: usize, rest: &str) -> Value {
    let size = |v: &Value| serde_json::to_vec(v).map_or(usize::MAX, |text| text.len());
    let mut total = size(&answer);
    let Some(fields) = answer.as_object_mut() else {
        return answer;
    };
    let cap = max.saturating_sub(LIST_RESERVE);
    let mut truncated = fields.get("truncated") == Some(&Value::Bool(true));
    for key in DESCRIPTION_LISTS {
        let Some(list) = fields.get_mut(key).and_then(Value::as_array_mut) else {
            continue;
        };
        while total > cap {
            let Some(item) = list.pop() else { break };
            // The item and the comma before it.
            total = total.saturating_sub(size(&item).saturating_add(1));
            truncated = true;
        }
    }
    fields.insert("truncated".into(), Value::Bool(truncated));
    if truncated {
        fields.insert(
            "note".into(),
            Value::String(format!(
                "this description stops before about {max} bytes, the most one answer holds: indexes, then foreign keys, then columns past those listed are left out; list them with query_database, e.g. {rest}"
            )),
        );
    }
    answer
}

/// The largest value SQLite may build (`SQLITE_LIMIT_LENGTH`) and the largest row
/// message the worker reads from PostgreSQL: four times the result cap, so a query may
/// still filter or measure values larger than it could return (`WHERE body LIKE ...`,
/// `length(body)`, `substr(body, 1, 100)`), while no value is ever allocated much beyond
/// what a result could hold (`randomblob(1e9)`, `repeat('x', 2e8)` fail at once).
pub(crate) const MAX_VALUE_BYTES: usize = 4 * MAX_RESULT_BYTES;
/// SQLite's heap ceiling for the whole worker (`PRAGMA hard_heap_limit`): a statement
/// that builds many values below [`MAX_VALUE_BYTES`] at once (hundreds of columns of
/// `randomblob(4000000)`) fails with an error naming it, well below the worker's kernel
/// memory ceiling (`[limits] worker_memory_bytes`, 1 GiB by default).
pub(crate) const SQLITE_HEAP_LIMIT: i64 = 256 * 1024 * 1024;
/// The largest row message the metadata queries (list_tables, describe_table: one JSON
/// row each) read from PostgreSQL.
const METADATA_MAX_VALUE_BYTES: usize = 16 * MAX_VALUE_BYTES;
/// `list_databases` waits at most this long for each database to answer.
const PING_BUDGET: Duration = Duration::from_secs(5);
/// Longest SQL text accepted.
const MAX_SQL_LEN: u64 = 1024 * 1024;

/// What one call may use: until when, how many rows and bytes.
#[derive(Clone)]
pub(crate) struct Limits {
    pub deadline: Instant,
    pub started: Instant,
    pub cancel: CancellationToken,
    pub max_rows: u64,
    pub max_bytes: usize,
    /// Largest single value (SQLite) or row message (PostgreSQL) held while producing.
    pub max_value_bytes: usize,
}

impl Limits {
    fn new(ctx: &CallContext, timeout: Duration, max_rows: u64) -> Self {
        let started = Instant::now();
        let deadline = started
            .checked_add(timeout)
            .map_or(ctx.deadline, |d| d.min(ctx.deadline));
        Self {
            deadline,
            started,
            cancel: ctx.cancel.clone(),
            max_rows,
            max_bytes: MAX_RESULT_BYTES,
            max_value_bytes: MAX_VALUE_BYTES,
        }
    }

    /// The limits of a metadata query: one row of any size up to
    /// [`METADATA_MAX_VALUE_BYTES`].
    pub fn metadata(&self) -> Self {
        Self {
            max_rows: 1,
            max_bytes: usize::MAX,
            max_value_bytes: METADATA_MAX_VALUE_BYTES,
            ..self.clone()
        }
    }

    /// The whole time budget of the call, in milliseconds.
    pub fn budget_ms(&self) -> u64 {
        self.deadline
            .saturating_duration_since(self.started)
            .as_millis()
            .try_into()
            .unwrap_or(u64::MAX)
    }

    /// Milliseconds left until the deadline.
    pub fn remaining_ms(&self) -> u64 {
        self.deadline
            .saturating_duration_since(Instant::now())
            .as_millis()
            .try_into()
            .unwrap_or(u64::MAX)
    }
}

/// Rows of one statement, engine-independent.
#[derive(Debug, Default)]
pub(crate) struct Output {
    /// (name, type) per column.
    pub columns: Vec<(String, String)>,
    pub rows: Vec<Vec<Value>>,
    pub truncated: bool,
    /// The rows stopped at the byte cap rather than at `max_rows`.
    pub byte_capped: bool,
    pub rows_affected: Option<u64>,
}

impl Output {
    /// A row does not fit in what is left of the byte cap: the rows so far are the
    /// result, flagged truncated — unless there are none and the call only reads, where
    /// an empty "truncated" result would say nothing useful and the call fails instead.
    /// A write keeps going (its statement runs to the end) with its rows_affected.
    pub fn over_cap(&mut self, writing: bool, max_bytes: usize) -> Result<(), ValueError> {
        if self.rows.is_empty() && !writing {
            return Err(ValueError::FirstRowTooLarge { max: max_bytes });
        }
        self.truncated = true;
        self.byte_capped = true;
        Ok(())
    }

    fn to_json(&self, max_rows: u64) -> Value {
        let mut v = json!({
            "columns": self.columns.iter().map(|(n, t)| json!({"name": n, "type": t})).collect::<Vec<_>>(),
            "rows": self.rows,
            "row_count": self.rows.len(),
            "truncated": self.truncated,
        });
        if let Some(n) = self.rows_affected {
            v["rows_affected"] = json!(n);
        }
        if self.byte_capped {
            v["note"] = json!(format!(
                "more rows exist than were returned: the next row would have taken the result past about {MAX_RESULT_BYTES} bytes, the most one result holds; select fewer or shorter columns (substr, length), or narrow the query with WHERE, aggregates or LIMIT/OFFSET"
            ));
        } else if self.truncated {
            v["note"] = json!(format!(
                "more rows exist than were returned (limit {max_rows} rows or about {MAX_RESULT_BYTES} bytes); narrow the query with WHERE, fewer columns, aggregates or LIMIT/OFFSET"
            ));
        }
        v
    }
}

enum Backend {
    Sqlite(Sqlite),
    Postgres(Box<Postgres>),
}

struct Db {
    config: DatabaseConfig,
    engine: Engine,
    backend: Backend,
}

struct Shared {
    dbs: BTreeMap<String, Db>,
}

/// Builds the five db tools over `databases`. Validates every entry and reads the
/// PostgreSQL passwords now; connects to nothing (connections are made on first use).
pub fn tools(databases: Vec<DatabaseConfig>) -> Result<ToolSet, DbError> {
    let mut dbs = BTreeMap::new();
    for config in databases {
        let target = config.target()?;
        if dbs.contains_key(&config.name) {
            return Err(DbError::DuplicateName(config.name));
        }
        let permits = Arc::new(tokio::sync::Semaphore::new(config.pool_size as usize));
        let (engine, backend) = match target {
            Target::Sqlite(path) => (
                Engine::Sqlite,
                Backend::Sqlite(Sqlite {
                    name: config.name.clone(),
                    path,
                    skip_parser: config.unsafe_skip_parser_for_tests,
                    skip_engine: config.unsafe_skip_engine_read_only_for_tests,
                    permits,
                    pool_size: config.pool_size,
                }),
            ),
            Target::Postgres(pg, tls) => (
                Engine::Postgres,
                Backend::Postgres(Box::new(Postgres {
                    name: config.name.clone(),
                    password: pg
                        .get_password()
                        .map(|p| String::from_utf8_lossy(p).into_owned()),
                    config: *pg,
                    tls,
                    skip_parser: config.unsafe_skip_parser_for_tests,
                    skip_engine: config.unsafe_skip_engine_read_only_for_tests,
                    permits,
                    idle: Mutex::new(Vec::new()),
                })),
            ),
        };
        dbs.insert(
            config.name.clone(),
            Db {
                config,
                engine,
                backend,
            },
        );
    }
    let shared = Arc::new(Shared { dbs });
    Ok(ALL.iter().fold(ToolSet::new("db"), |set, &kind| {
        set.with(DbTool {
            kind,
            shared: Arc::clone(&shared),
        })
    }))
}

/// The SQLite files of `databases`, absolute (after [`DatabaseConfig::resolve_relative`]).
/// SQLite also creates `-journal`, `-wal` and `-shm` files beside each, so a sandbox that
/// lets the worker write them must allow writing in their parent directories.
pub fn sqlite_paths(databases: &[DatabaseConfig]) -> Vec<PathBuf> {
    databases
        .iter()
        .filter_map(DatabaseConfig::sqlite_path)
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    ListDatabases,
    ListTables,
    DescribeTable,
    Query,
    Execute,
}

const ALL: [Kind; 5] = [
    Kind::ListDatabases,
    Kind::ListTables,
    Kind::DescribeTable,
    Kind::Query,
    Kind::Execute,
];

struct DbTool {
    kind: Kind,
    shared: Arc<Shared>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoArgs {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DatabaseArgs {
    database: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DescribeArgs {
    database: String,
    table: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QueryArgs {
    database: String,
    sql: String,
    #[serde(default)]
    params: Vec<Value>,
    #[serde(default)]
    max_rows: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExecuteArgs {
    database: String,
    sql: String,
    #[serde(default)]
    params: Vec<Value>,
}

fn object(properties: Value, required: &[&str]) -> Value {
    json!({
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": false,
    })
}

fn annotations(read_only: bool, destructive: bool, idempotent: bool) -> ToolAnnotations {
    ToolAnnotations {
        read_only,
        destructive,
        idempotent,
        open_world: false,
    }
}

impl DbTool {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::ListDatabases => "list_databases",
            Kind::ListTables => "list_tables",
            Kind::DescribeTable => "describe_table",
            Kind::Query => "query_database",
            Kind::Execute => "execute_sql",
        }
    }

    fn database_schema(&self) -> Value {
        let names: Vec<&str> = self.shared.dbs.keys().map(String::as_str).collect();
        let mut s = json!({
            "type": "string",
            "description": "Name of a configured database (see list_databases).",
        });
        if !names.is_empty() {
            s["enum"] = json!(names);
        }
        s
    }

    fn catalog(&self) -> String {
        if self.shared.dbs.is_empty() {
            return "No databases are configured.".into();
        }
        let list: Vec<String> = self
            .shared
            .dbs
            .values()
            .map(|d| {
                format!(
                    "{} ({}{})",
                    d.config.name,
                    d.engine.as_str(),
                    if d.config.read_only {
                        ", read-only"
                    } else {
                        ""
                    }
                )
            })
            .collect();
        format!("Databases: {}.", list.join(", "))
    }

    fn params_schema() -> Value {
        json!({
            "type": "array",
            "items": {"type": ["string", "number", "integer", "boolean", "null"]},
            "description": "Values bound to the statement's placeholders, in order: $1, $2, ... for PostgreSQL; ?1, ?2, ... (or ?) for SQLite. Prefer params over putting values into the SQL text.",
        })
    }

    fn describe(&self) -> (&'static str, String, Value, ToolAnnotations) {
        let db = self.database_schema();
        let catalog = self.catalog();
        let max = self
            .shared
            .dbs
            .values()
            .map(|d| d.config.max_rows)
            .max()
            .unwrap_or(1000);
        match self.kind {
            Kind::ListDatabases => (
                "List databases",
                format!(
                    "List the configured databases with their engine (sqlite or postgresql), whether they are read-only, and whether they are reachable right now. Start here to learn the names for the `database` argument. {catalog}"
                ),
                object(json!({}), &[]),
                annotations(true, false, true),
            ),
            Kind::ListTables => (
                "List tables",
                format!(
                    "List the tables and views of a database (with schema for PostgreSQL and type: table, view, materialized view, ...), in name order, up to about {MAX_RESULT_BYTES} bytes of names; `truncated` says when there were more. Then use describe_table for columns and keys. {catalog}"
                ),
                object(json!({"database": db}), &["database"]),
                annotations(true, false, true),
            ),
            Kind::DescribeTable => (
                "Describe table",
                format!(
                    "Describe a table or view: columns with types, nullability and defaults, the primary key, foreign keys (with the referenced table and columns) and indexes, up to about {MAX_RESULT_BYTES} bytes; `truncated` says when some were left out, and `note` how to list them. {catalog}"
                ),
                object(
                    json!({
                        "database": db,
                        "table": {"type": "string", "minLength": 1, "maxLength": 256, "description": "Table or view name as shown by list_tables; for PostgreSQL optionally schema-qualified, e.g. \"public.orders\"."},
                    }),
                    &["database", "table"],
                ),
                annotations(true, false, true),
            ),
            Kind::Query => (
                "Query database",
                format!(
                    "Run ONE read-only SQL statement (SELECT, WITH ... SELECT, VALUES, EXPLAIN of a SELECT, SHOW; for SQLite also introspection PRAGMAs) and return the rows as JSON: {{\"columns\": [{{\"name\", \"type\"}}], \"rows\": [[...]], \"row_count\", \"truncated\"}}. Read-only is enforced by the SQL parser and again by the database engine: writes, several statements, locking clauses (FOR UPDATE) and functions with side effects are refused; use execute_sql to change data. Use the SQL dialect of the database's engine. Integers are exact, NUMERIC/DECIMAL values are strings, bytes are base64, dates and times are ISO-8601. At most `max_rows` rows are returned (default and upper bound per database, at most {max}); `truncated` says when there were more. {catalog}"
                ),
                object(
                    json!({
                        "database": db,
                        "sql": {"type": "string", "minLength": 1, "maxLength": MAX_SQL_LEN, "description": "One read-only SQL statement, e.g. \"SELECT id, name FROM customers WHERE country = $1 ORDER BY id LIMIT 50\"."},
                        "params": Self::params_schema(),
                        "max_rows": {"type": "integer", "minimum": 1, "maximum": max, "description": "Maximum number of rows to return (default: the database's limit)."},
                    }),
                    &["database", "sql"],
                ),
                annotations(true, false, true),
            ),
            Kind::Execute => (
                "Execute SQL",
                format!(
                    "Run ONE SQL statement that changes data or schema (INSERT, UPDATE, DELETE, CREATE, ...) in a transaction of its own, committed when it succeeds, and return {{\"rows_affected\", \"columns\", \"rows\"}} (rows only for RETURNING). Refused on databases configured read-only; usually needs a human's approval first. Transaction control (BEGIN, COMMIT, ...) and ATTACH are not allowed. For reading use query_database. {catalog}"
                ),
                object(
                    json!({
                        "database": db,
                        "sql": {"type": "string", "minLength": 1, "maxLength": MAX_SQL_LEN, "description": "One SQL statement, e.g. \"UPDATE orders SET status = $1 WHERE id = $2\"."},
                        "params": Self::params_schema(),
                    }),
                    &["database", "sql"],
                ),
                annotations(false, true, false),
            ),
        }
    }

    fn db(&self, name: &str) -> Result<&Db, String> {
        self.shared.dbs.get(name).ok_or_else(|| {
            let known: Vec<&str> = self.shared.dbs.keys().map(String::as_str).collect();
            format!(
                "unknown database {name:?}; configured databases: {}",
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            )
        })
    }

    async fn run(&self, arguments: Value, ctx: &CallContext) -> Result<Value, String> {
        let tool = self.name();
        match self.kind {
            Kind::ListDatabases => {
                let _: NoArgs = parse(tool, arguments)?;
                let pings = self.shared.dbs.values().map(|d| async move {
                    let limits = Limits::new(ctx, PING_BUDGET, 1);
                    let reached = match &d.backend {
                        Backend::Sqlite(s) => s.ping(&limits).await.map_err(|e| e.to_string()),
                        Backend::Postgres(p) => p.ping(&limits).await.map_err(|e| e.to_string()),
                    };
                    let mut v = json!({
                        "name": d.config.name,
                        "engine": d.engine.as_str(),
                        "read_only": d.config.read_only,
                        "max_rows": d.config.max_rows,
                        "reachable": reached.is_ok(),
                    });
                    if let Err(e) = reached {
                        v["error"] = json!(e);
                    }
                    v
                });
                let list = futures::future::join_all(pings).await;
                Ok(json!({ "databases": list }))
            }
            Kind::ListTables => {
                let args: DatabaseArgs = parse(tool, arguments)?;
                let db = self.db(&args.database)?;
                let limits = db.limits(ctx, 1);
                match &db.backend {
                    Backend::Sqlite(s) => s.list_tables(&limits).await.map_err(|e| e.to_string()),
                    Backend::Postgres(p) => p.list_tables(&limits).await.map_err(|e| e.to_string()),
                }
            }
            Kind::DescribeTable => {
                let args: DescribeArgs = parse(tool, arguments)?;
                let db = self.db(&args.database)?;
                let limits = db.limits(ctx, 1);
                let max = limits.max_bytes;
                match &db.backend {
                    Backend::Sqlite(s) => s
                        .describe(args.table, &limits)
                        .await
                        .map(|d| fit_description(d, max, crate::sqlite::DESCRIPTION_REST))
                        .map_err(|e| e.to_string()),
                    Backend::Postgres(p) => p
                        .describe(args.table, &limits)
                        .await
                        .map(|d| fit_description(d, max, crate::postgres::DESCRIPTION_REST))
                        .map_err(|e| e.to_string()),
                }
            }
            Kind::Query => {
                let args: QueryArgs = parse(tool, arguments)?;
                let db = self.db(&args.database)?;
                let max_rows = args
                    .max_rows
                    .unwrap_or(db.config.max_rows)
                    .clamp(1, db.config.max_rows);
                let limits = db.limits(ctx, max_rows);
                let out = match &db.backend {
                    Backend::Sqlite(s) => s
                        .query(args.sql, args.params, &limits)
                        .await
                        .map_err(|e| e.to_string()),
                    Backend::Postgres(p) => p
                        .query(args.sql, args.params, &limits)
                        .await
                        .map_err(|e| e.to_string()),
                }?;
                Ok(out.to_json(max_rows))
            }
            Kind::Execute => {
                let args: ExecuteArgs = parse(tool, arguments)?;
                let db = self.db(&args.database)?;
                if db.config.read_only {
                    return Err(format!(
                        "database {:?} is configured read_only, so execute_sql is refused; use query_database to read, or ask an operator to set read_only = false for it",
                        db.config.name
                    ));
                }
                let limits = db.limits(ctx, db.config.max_rows);
                let out = match &db.backend {
                    Backend::Sqlite(s) => s
                        .execute(args.sql, args.params, &limits)
                        .await
                        .map_err(|e| e.to_string()),
                    Backend::Postgres(p) => p
                        .execute(args.sql, args.params, &limits)
                        .await
                        .map_err(|e| e.to_string()),
                }?;
                Ok(out.to_json(db.config.max_rows))
            }
        }
    }
}

impl Db {
    fn limits(&self, ctx: &CallContext, max_rows: u64) -> Limits {
        Limits::new(
            ctx,
            Duration::from_millis(self.config.statement_timeout_ms),
            max_rows,
        )
    }
}

fn parse<T: serde::de::DeserializeOwned>(tool: &str, arguments: Value) -> Result<T, String> {
    let arguments = if arguments.is_null() {
        json!({})
    } else {
        arguments
    };
    serde_json::from_value(arguments)
        .map_err(|e| format!("invalid arguments for {tool}: {e}; see the tool's input schema"))
}

#[airlock_worker::async_trait]
impl Tool for DbTool {
    fn definition(&self) -> ToolDefinition {
        let (title, description, input_schema, annotations) = self.describe();
        ToolDefinition {
            name: self.name().to_owned(),
            title: title.to_owned(),
            description,
            input_schema,
            annotations,
        }
    }

    async fn execute(&self, arguments: Value, ctx: CallContext) -> ToolOutcome {
        let started = Instant::now();
        let result = self.run(arguments, &ctx).await;
        let outcome = match &result {
            Ok(v) => ToolOutcome::json(v),
            Err(message) => ToolOutcome::error(message.clone()),
        };
        tracing::debug!(
            tool = self.name(),
            call_id = %ctx.call_id,
            is_error = outcome.is_error,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "db call finished"
        );
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The policies see each tool as this worker defines it: every argument typed in
    /// `context.arguments` (or left out on purpose), and the annotations as the Cedar
    /// schema's action groups.
    #[test]
    fn the_policy_sees_every_tool_as_this_worker_defines_it() {
        let problems: Vec<String> =
            tools(vec![DatabaseConfig::new("demo", "sqlite:///tmp/demo.db")])
                .unwrap()
                .definitions()
                .iter()
                .flat_map(airlock_policy::authz::check_tool)
                .collect();
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn five_tools_with_strict_schemas() {
        let set = tools(vec![DatabaseConfig::new("demo", "sqlite:///tmp/demo.db")]).unwrap();
        let defs = set.definitions();
        assert_eq!(defs.len(), 5);
        for d in &defs {
            assert_eq!(d.input_schema["type"], "object", "{}", d.name);
            assert_eq!(d.input_schema["additionalProperties"], false, "{}", d.name);
            assert!(!d.description.is_empty());
            assert!(!(d.annotations.read_only && d.annotations.destructive));
        }
        let exec = set.get("execute_sql").unwrap().definition();
        assert!(exec.annotations.destructive && !exec.annotations.read_only);
        let q = set.get("query_database").unwrap().definition();
        assert!(q.annotations.read_only && q.annotations.idempotent);
        assert_eq!(
            q.input_schema["properties"]["database"]["enum"],
            json!(["demo"])
        );
    }

    #[test]
    fn duplicate_names_are_refused() {
        let r = tools(vec![
            DatabaseConfig::new("a", "sqlite:///x.db"),
            DatabaseConfig::new("a", "sqlite:///y.db"),
        ]);
        assert!(matches!(r, Err(DbError::DuplicateName(_))));
    }

    #[test]
    fn sqlite_paths_lists_only_sqlite() {
        let dbs = vec![
            DatabaseConfig::new("a", "sqlite:///data/a.db"),
            DatabaseConfig::new("b", "postgres://u@localhost/b"),
        ];
        assert_eq!(sqlite_paths(&dbs), vec![PathBuf::from("/data/a.db")]);
    }
}
