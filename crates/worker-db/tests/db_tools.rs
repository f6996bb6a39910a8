//! The db tools against a real PostgreSQL (tests/support/postgres.rs: `initdb` +
//! `postgres` on a free port, shared by all tests of this binary, stopped when the
//! binary exits) and against SQLite files in temp dirs.
//!
//! PostgreSQL must be installed (`apt-get install postgresql`); the tests fail — never
//! skip — when it is not. Run as root, the server runs as `nobody` (initdb refuses root).
//! The roles `airlock_ro` and `airlock_rw` log in with passwords; the superuser sets up
//! database `airlock_test`.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use airlock_worker::{CallContext, CancellationToken, SessionId, ToolOutcome, ToolSet};
use airlock_worker_db::{DatabaseConfig, sqlite_paths, tools};
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------
// The PostgreSQL server
// ---------------------------------------------------------------------------------------

#[path = "../../../tests/support/postgres.rs"]
mod postgres;

/// `[[databases]]` over TLS (db_tools/tls.rs).
#[path = "db_tools/tls.rs"]
mod tls;

/// The shared server (tests/support/postgres.rs) with this binary's roles, database
/// `airlock_test` and password files on top.
struct PgServer {
    port: u16,
    /// Holds `ro.pw`, `rw.pw` and `wrong.pw`; removed with the server at exit.
    base: PathBuf,
}

static PG: OnceLock<Result<PgServer, String>> = OnceLock::new();

const RO_PASSWORD: &str = "Ro-Secret-Canary-7c1e";
const RW_PASSWORD: &str = "Rw-Secret-Canary-93ab";

fn pg() -> &'static PgServer {
    match PG.get_or_init(start_pg) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    }
}

fn start_pg() -> Result<PgServer, String> {
    let server = postgres::server();
    server.create_role("airlock_ro", RO_PASSWORD);
    server.create_role("airlock_rw", RW_PASSWORD);
    server.create_database("airlock_test");
    for (file, pw) in [("ro.pw", RO_PASSWORD), ("rw.pw", RW_PASSWORD)] {
        std::fs::write(server.dir.join(file), format!("{pw}\n")).unwrap();
    }
    std::fs::write(server.dir.join("wrong.pw"), "Wrong-Password-Canary-55\n").unwrap();
    std::thread::spawn(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(setup_pg())
    })
    .join()
    .map_err(|_| "setting up the test database panicked".to_owned())??;
    Ok(PgServer {
        port: server.port,
        base: server.dir.clone(),
    })
}

/// A superuser connection to `db` (trusted on loopback: no password).
async fn superuser(db: &str) -> tokio_postgres::Client {
    let (client, conn) =
        tokio_postgres::connect(&postgres::server().url(db), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(conn);
    client
}

async fn setup_pg() -> Result<(), String> {
    let db = superuser("airlock_test").await;
    db.batch_execute(
        r#"
        CREATE EXTENSION IF NOT EXISTS dblink;
        CREATE TABLE t (id int PRIMARY KEY, name text NOT NULL, amount numeric(12,2));
        INSERT INTO t VALUES (1, 'alpha', 1.50), (2, 'beta', 2.25), (3, 'gamma', NULL);
        CREATE SEQUENCE s;
        CREATE VIEW v AS SELECT id, name FROM t;
        CREATE TABLE big AS SELECT g AS n FROM generate_series(1, 5000) g;
        CREATE TABLE parent (id int PRIMARY KEY, label text);
        CREATE TABLE child (
            id serial PRIMARY KEY,
            parent_id int NOT NULL REFERENCES parent(id) ON DELETE CASCADE,
            note text DEFAULT 'none',
            code text UNIQUE
        );
        CREATE INDEX child_note_idx ON child (note);
        CREATE TABLE w (id serial PRIMARY KEY, v text);
        CREATE TABLE types (
            i int, bi bigint, num numeric(30,10), f float8, r real, txt text, b bytea,
            flag bool, d date, ts timestamp, tstz timestamptz, j json, jb jsonb, u uuid,
            n int, arr int[], iv interval, tarr text[]
        );
        INSERT INTO types VALUES (
            42, 9007199254740993, 12345678901234567890.0123456789, 1.5, 2.5, 'héllo',
            '\x00ff10', true, '2024-02-29', '2024-02-29 13:14:15.123456',
            '2024-02-29 13:14:15+02', '{"a": [1, 2]}', '{"b": null}',
            'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', NULL, '{1,2,NULL}', '1 day 02:00:00',
            '{{"x","y"},{"z",NULL}}'
        );
        CREATE PROCEDURE p() LANGUAGE sql AS $$ DELETE FROM t $$;
        GRANT SELECT ON ALL TABLES IN SCHEMA public TO airlock_ro;
        -- airlock_rw may write: the read-only transaction alone must stop it.
        GRANT ALL ON ALL TABLES IN SCHEMA public TO airlock_rw;
        GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO airlock_rw;
        GRANT CREATE ON SCHEMA public TO airlock_rw;
        GRANT EXECUTE ON PROCEDURE p() TO airlock_rw;
        "#,
    )
    .await
    .map_err(|e| {
        format!(
            "setup: {}",
            e.as_db_error()
                .map_or(e.to_string(), |d| d.message().to_owned())
        )
    })?;
    Ok(())
}

/// A `[[databases]]` entry for the test PostgreSQL, as `user` (`airlock_ro` or
/// `airlock_rw`) with that user's password file.
fn pg_db(name: &str, user: &str) -> DatabaseConfig {
    let server = pg();
    let mut c = DatabaseConfig::new(
        name,
        format!("postgres://{user}@127.0.0.1:{}/airlock_test", server.port),
    );
    let file = if user == "airlock_ro" {
        "ro.pw"
    } else {
        "rw.pw"
    };
    c.password_file = Some(server.base.join(file));
    c
}

/// The superuser's view of the test data: a checksum of everything an attack could touch.
/// Tests that compare the shared PostgreSQL database before and after, and the test that
/// writes to it, run one at a time: a write in flight would show up in another test's
/// "nothing changed" check.
static PG_STATE_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn pg_state() -> String {
    pg(); // set up (once) before looking
    let db = superuser("airlock_test").await;
    let row = db
        .query_one(
            "SELECT concat_ws(' | ',
                (SELECT md5(string_agg(t::text, ',' ORDER BY id)) FROM t),
                (SELECT last_value::text || is_called::text FROM s),
                (SELECT string_agg(relname, ',' ORDER BY relname) FROM pg_class
                   WHERE relnamespace = 'public'::regnamespace),
                (SELECT count(*)::text FROM pg_largeobject_metadata),
                (SELECT count(*)::text FROM pg_locks WHERE locktype = 'advisory'),
                (SELECT count(*)::text FROM w))",
            &[],
        )
        .await
        .unwrap();
    row.get(0)
}

// ---------------------------------------------------------------------------------------
// Calling tools
// ---------------------------------------------------------------------------------------

async fn call_with(set: &ToolSet, tool: &str, args: Value, deadline: Duration) -> ToolOutcome {
    let (tx, _rx) = tokio::sync::mpsc::channel(16);
    let ctx = CallContext::new(
        "call-1".into(),
        "alice".into(),
        SessionId::parse("s1").unwrap(),
        Instant::now() + deadline,
        CancellationToken::new(),
        tx,
    );
    set.get(tool)
        .unwrap_or_else(|| panic!("no tool {tool}"))
        .execute(args, ctx)
        .await
}

async fn call(set: &ToolSet, tool: &str, args: Value) -> ToolOutcome {
    call_with(set, tool, args, Duration::from_secs(30)).await
}

async fn ok(set: &ToolSet, tool: &str, args: Value) -> Value {
    let out = call(set, tool, args.clone()).await;
    assert!(
        !out.is_error,
        "{tool} {args} failed: {}",
        out.content.join("\n")
    );
    assert_eq!(out.content.len(), 1, "one text block");
    serde_json::from_str(&out.content[0]).unwrap()
}

async fn err(set: &ToolSet, tool: &str, args: Value) -> String {
    let out = call(set, tool, args.clone()).await;
    assert!(
        out.is_error,
        "{tool} {args} should fail but gave: {}",
        out.content.join("\n")
    );
    out.content.join("\n")
}

async fn query(set: &ToolSet, db: &str, sql: &str) -> Value {
    ok(set, "query_database", json!({"database": db, "sql": sql})).await
}

// ---------------------------------------------------------------------------------------
// SQLite fixtures
// ---------------------------------------------------------------------------------------

struct Lite {
    dir: tempfile::TempDir,
}

impl Lite {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let conn = rusqlite::Connection::open(dir.path().join("test.db")).unwrap();
        conn.execute_batch(
            r#"
            CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT NOT NULL);
            INSERT INTO t VALUES (1, 'alpha'), (2, 'beta'), (3, 'gamma');
            CREATE VIEW v AS SELECT id, name FROM t;
            CREATE TABLE parent (id INTEGER PRIMARY KEY, label TEXT);
            CREATE TABLE child (
                id INTEGER PRIMARY KEY,
                parent_id INTEGER NOT NULL REFERENCES parent(id) ON DELETE CASCADE,
                note TEXT DEFAULT 'none',
                code TEXT UNIQUE
            );
            CREATE INDEX child_note_idx ON child (note);
            CREATE TABLE w (id INTEGER PRIMARY KEY, v TEXT);
            CREATE TABLE types (
                i INTEGER, bi BIGINT, num NUMERIC(30,10), f REAL, txt TEXT, b BLOB,
                flag BOOLEAN, d DATE, ts TIMESTAMP, tstz TIMESTAMPTZ, j JSON, u UUID, n INTEGER
            );
            INSERT INTO types VALUES (
                42, 9007199254740993, 12.5, 1.5, 'héllo', x'00ff10', 1, '2024-02-29',
                '2024-02-29T13:14:15.123456', '2024-02-29T11:14:15Z', '{"a": [1, 2]}',
                x'a0eebc999c0b4ef8bb6d6bb9bd380a11', NULL
            );
            WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 5000)
            INSERT INTO w (v) SELECT 'row ' || n FROM g;
            "#,
        )
        .unwrap();
        Self { dir }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("test.db")
    }

    fn db(&self, name: &str) -> DatabaseConfig {
        DatabaseConfig::new(name, format!("sqlite://{}", self.path().display()))
    }

    /// Content, schema and the files in the directory.
    fn state(&self) -> String {
        let conn = rusqlite::Connection::open_with_flags(
            self.path(),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .unwrap();
        let data: String = conn
            .query_row(
                "SELECT (SELECT group_concat(id || ':' || name, ',') FROM t) || ' | ' ||
                        (SELECT group_concat(type || ':' || name || ':' || coalesce(sql, ''), ';')
                           FROM sqlite_schema) || ' | ' ||
                        (SELECT count(*) FROM w) || ' | ' ||
                        (SELECT user_version FROM pragma_user_version)",
                [],
                |r| r.get(0),
            )
            .unwrap();
        let mut files: Vec<String> = std::fs::read_dir(self.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|f| !f.ends_with("-journal") && !f.ends_with("-wal") && !f.ends_with("-shm"))
            .collect();
        files.sort();
        format!("{data} | files: {}", files.join(","))
    }
}

// ---------------------------------------------------------------------------------------
// Types, limits, metadata
// ---------------------------------------------------------------------------------------

/// PostgreSQL's dates and timestamps reach far beyond the years a result renders: such
/// a value is an error that says to cast it, and the worker answers the next call.
#[tokio::test]
async fn postgres_dates_beyond_the_rendered_years_are_an_error_not_a_crash() {
    let set = tools(vec![pg_db("pg", "airlock_ro")]).unwrap();
    for sql in [
        "SELECT '5874897-12-31'::date",
        "SELECT '294276-01-01'::timestamp",
        "SELECT '294276-01-01 00:00:00+00'::timestamptz",
        "SELECT d FROM (VALUES ('2024-02-29'::date), ('5874897-12-31'::date)) AS v(d)",
    ] {
        let e = err(
            &set,
            "query_database",
            json!({"database": "pg", "sql": sql}),
        )
        .await;
        assert!(e.contains("to text"), "{sql}: {e}");
    }
    let out = query(
        &set,
        "pg",
        "SELECT '5874897-12-31'::date::text AS d, 'infinity'::date AS i, '2024-02-29'::date AS ok",
    )
    .await;
    assert_eq!(
        out["rows"],
        json!([["5874897-12-31", "infinity", "2024-02-29"]])
    );
}

#[tokio::test]
async fn postgres_types_round_trip() {
    let set = tools(vec![pg_db("pg", "airlock_ro")]).unwrap();
    let out = query(&set, "pg", "SELECT * FROM types").await;
    let row = &out["rows"][0];
    let col = |name: &str| -> &Value {
        let i = out["columns"]
            .as_array()
            .unwrap()
            .iter()
            .position(|c| c["name"] == name)
            .unwrap();
        &row[i]
    };
    assert_eq!(col("i"), &json!(42));
    assert_eq!(col("bi").as_i64(), Some(9_007_199_254_740_993));
    assert_eq!(col("num"), &json!("12345678901234567890.0123456789"));
    assert_eq!(col("f"), &json!(1.5));
    assert_eq!(col("r"), &json!(2.5));
    assert_eq!(col("txt"), &json!("héllo"));
    assert_eq!(col("b"), &json!("AP8Q"));
    assert_eq!(col("flag"), &json!(true));
    assert_eq!(col("d"), &json!("2024-02-29"));
    assert_eq!(col("ts"), &json!("2024-02-29T13:14:15.123456"));
    assert_eq!(col("tstz"), &json!("2024-02-29T11:14:15Z"));
    assert_eq!(col("j"), &json!({"a": [1, 2]}));
    assert_eq!(col("jb"), &json!({"b": null}));
    assert_eq!(col("u"), &json!("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"));
    assert_eq!(col("n"), &Value::Null);
    assert_eq!(col("arr"), &json!([1, 2, null]));
    assert_eq!(col("iv"), &json!("P1DT2H"));
    assert_eq!(col("tarr"), &json!([["x", "y"], ["z", null]]));
    let types: Vec<&str> = out["columns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["type"].as_str().unwrap())
        .collect();
    assert_eq!(&types[..4], &["int4", "int8", "numeric", "float8"]);
    // The exact big integer is in the text, not rounded through a float.
    let raw = call(
        &set,
        "query_database",
        json!({"database": "pg", "sql": "SELECT bi FROM types"}),
    )
    .await;
    assert!(
        raw.content[0].contains("9007199254740993"),
        "{}",
        raw.content[0]
    );

    // Parameters are bound by the server's inferred types.
    let out = ok(
        &set,
        "query_database",
        json!({"database": "pg", "sql": "SELECT name, $2::bool AS b, $3::text IS NULL AS n FROM t WHERE id = $1",
               "params": [2, true, null]}),
    )
    .await;
    assert_eq!(out["rows"], json!([["beta", true, true]]));
    let e = err(
        &set,
        "query_database",
        json!({"database": "pg", "sql": "SELECT $1::int", "params": []}),
    )
    .await;
    assert!(e.contains("parameter"), "{e}");
    let e = err(
        &set,
        "query_database",
        json!({"database": "pg", "sql": "SELECT $1::int", "params": [[1]]}),
    )
    .await;
    assert!(e.contains("params[0]"), "{e}");
}

#[tokio::test]
async fn sqlite_types_round_trip() {
    let lite = Lite::new();
    let set = tools(vec![lite.db("lite")]).unwrap();
    let out = query(&set, "lite", "SELECT * FROM types").await;
    assert_eq!(
        out["rows"][0],
        json!([
            42,
            9_007_199_254_740_993_i64,
            "12.5",
            1.5,
            "héllo",
            "AP8Q",
            true,
            "2024-02-29",
            "2024-02-29T13:14:15.123456",
            "2024-02-29T11:14:15Z",
            {"a": [1, 2]},
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            null
        ])
    );
    assert_eq!(out["columns"][0], json!({"name": "i", "type": "integer"}));
    assert_eq!(
        out["columns"][6],
        json!({"name": "flag", "type": "boolean"})
    );
    let out = ok(
        &set,
        "query_database",
        json!({"database": "lite", "sql": "SELECT name, ?2 AS x, 1.25 AS f FROM t WHERE id = ?1", "params": [3, "p"]}),
    )
    .await;
    assert_eq!(out["rows"], json!([["gamma", "p", 1.25]]));
    assert_eq!(out["columns"][2]["type"], "real");
}

#[tokio::test]
async fn max_rows_truncates_on_both_engines() {
    let lite = Lite::new();
    let mut pgc = pg_db("pg", "airlock_ro");
    pgc.max_rows = 100;
    let mut litec = lite.db("lite");
    litec.max_rows = 100;
    let set = tools(vec![pgc, litec]).unwrap();
    for (db, sql) in [
        ("pg", "SELECT n FROM big ORDER BY n"),
        ("lite", "SELECT id FROM w ORDER BY id"),
    ] {
        let out = ok(
            &set,
            "query_database",
            json!({"database": db, "sql": sql, "max_rows": 10}),
        )
        .await;
        assert_eq!(out["row_count"], 10, "{db}");
        assert_eq!(out["truncated"], true, "{db}");
        assert_eq!(out["rows"][9], json!([10]), "{db}");
        assert!(out["note"].as_str().unwrap().contains("more rows"));
        // Without max_rows, and with a larger one, the database's limit applies.
        for args in [
            json!({"database": db, "sql": sql}),
            json!({"database": db, "sql": sql, "max_rows": 100000}),
        ] {
            let out = ok(&set, "query_database", args).await;
            assert_eq!(out["row_count"], 100, "{db}");
            assert_eq!(out["truncated"], true, "{db}");
        }
        let out = ok(
            &set,
            "query_database",
            json!({"database": db, "sql": format!("{sql} LIMIT 5")}),
        )
        .await;
        assert_eq!(out["row_count"], 5);
        assert_eq!(out["truncated"], false);
    }
}

#[tokio::test]
async fn list_tables_includes_views_and_describe_shows_keys() {
    let lite = Lite::new();
    let set = tools(vec![pg_db("pg", "airlock_ro"), lite.db("lite")]).unwrap();
    for db in ["pg", "lite"] {
        let tables = ok(&set, "list_tables", json!({"database": db})).await;
        let list = tables["tables"].as_array().unwrap();
        let find = |n: &str| list.iter().find(|t| t["name"] == n).cloned();
        assert_eq!(find("v").unwrap()["type"], "view", "{db}: {tables}");
        assert_eq!(find("t").unwrap()["type"], "table", "{db}: {tables}");
        assert!(find("child").is_some());

        let d = ok(
            &set,
            "describe_table",
            json!({"database": db, "table": "child"}),
        )
        .await;
        assert_eq!(d["primary_key"], json!(["id"]), "{db}: {d}");
        let cols = d["columns"].as_array().unwrap();
        let parent_id = cols.iter().find(|c| c["name"] == "parent_id").unwrap();
        assert_eq!(parent_id["nullable"], false, "{db}: {d}");
        let note = cols.iter().find(|c| c["name"] == "note").unwrap();
        assert_eq!(note["nullable"], true);
        assert!(
            note["default"].as_str().unwrap().contains("none"),
            "{db}: {d}"
        );
        assert_eq!(cols[0]["primary_key"], true);
        let fk = &d["foreign_keys"][0];
        assert_eq!(fk["columns"], json!(["parent_id"]), "{db}: {d}");
        assert_eq!(fk["references"]["table"], "parent");
        assert_eq!(fk["references"]["columns"], json!(["id"]));
        let idx = d["indexes"].as_array().unwrap();
        let note_idx = idx.iter().find(|i| i["name"] == "child_note_idx").unwrap();
        assert_eq!(note_idx["columns"], json!(["note"]));
        assert_eq!(note_idx["unique"], false);
        assert!(
            idx.iter()
                .any(|i| i["unique"] == true && i["columns"] == json!(["code"])),
            "{db}: {d}"
        );

        let view = ok(
            &set,
            "describe_table",
            json!({"database": db, "table": "v"}),
        )
        .await;
        assert_eq!(view["type"], "view");
        assert_eq!(view["columns"].as_array().unwrap().len(), 2);

        let e = err(
            &set,
            "describe_table",
            json!({"database": db, "table": "nope"}),
        )
        .await;
        assert!(e.contains("not found") && e.contains("list_tables"), "{e}");
    }
    let d = ok(
        &set,
        "describe_table",
        json!({"database": "pg", "table": "public.t"}),
    )
    .await;
    assert_eq!(d["primary_key"], json!(["id"]));
    let e = err(&set, "list_tables", json!({"database": "nope"})).await;
    assert!(e.contains("unknown database") && e.contains("lite"), "{e}");
}

/// A database with thousands of long names answers list_tables within the result cap,
/// with a note on how to list the rest. Before, SQLite answered with all of them
/// (2000 names of 1000 characters: 2 MB here, and without end in general) and
/// PostgreSQL with up to 64 MiB, above the worker's 32 MiB message limit, which failed
/// at the transport with no advice.
#[tokio::test]
async fn list_tables_answers_stay_within_the_result_cap() {
    const CAP: usize = 1024 * 1024;
    let lite = Lite::new();
    {
        let conn = rusqlite::Connection::open(lite.path()).unwrap();
        let mut ddl = String::from("BEGIN;");
        for i in 0..2000 {
            ddl.push_str(&format!("CREATE TABLE t{i:04}{} (a);", "x".repeat(995)));
        }
        ddl.push_str("COMMIT;");
        conn.execute_batch(&ddl).unwrap();
    }
    // PostgreSQL names are at most 63 bytes: 7000 tables with such names in a schema
    // with such a name, in a database of their own.
    let many = postgres::unique_name("airlock_many");
    postgres::create_database(&many);
    superuser(&many)
        .await
        .batch_execute(&format!(
            "CREATE SCHEMA {schema}; GRANT USAGE ON SCHEMA {schema} TO PUBLIC;
             DO $$ BEGIN FOR i IN 1..7000 LOOP
               EXECUTE format('CREATE TABLE {schema}.%I ()', 't' || lpad(i::text, 5, '0') || repeat('x', 57));
             END LOOP; END $$",
            schema = format!("s{}", "x".repeat(62)),
        ))
        .await
        .unwrap();
    let mut pgc = pg_db("pg", "airlock_ro");
    pgc.url = pgc.url.replace("/airlock_test", &format!("/{many}"));
    let set = tools(vec![lite.db("lite"), pgc]).unwrap();

    for (db, fitting, next) in [("lite", 1000, "sqlite_schema"), ("pg", 5000, "pg_class")] {
        let out = call(&set, "list_tables", json!({"database": db})).await;
        assert!(!out.is_error, "{db}: {:?}", out.content);
        let text = out.content.join("");
        assert!(text.len() <= CAP, "{db}: {} bytes", text.len());
        let v: Value = serde_json::from_str(&text).unwrap();
        let tables = v["tables"].as_array().unwrap();
        assert!(tables.len() >= fitting, "{db}: {} tables", tables.len());
        assert_eq!(v["truncated"], true, "{db}");
        let note = v["note"].as_str().unwrap();
        assert!(
            note.contains("query_database") && note.contains(next) && note.contains("1048576"),
            "{db}: {note}"
        );
        // The first ones in name order.
        let names: Vec<&str> = tables.iter().map(|t| t["name"].as_str().unwrap()).collect();
        assert!(names.is_sorted(), "{db}");
        let first = if db == "lite" {
            format!("t0000{}", "x".repeat(995))
        } else {
            format!("t00001{}", "x".repeat(57))
        };
        assert!(names.contains(&first.as_str()), "{db}");
    }
    // A small catalog is whole, and says so.
    let small = Lite::new();
    let set = tools(vec![small.db("lite")]).unwrap();
    let v = ok(&set, "list_tables", json!({"database": "lite"})).await;
    assert_eq!(v["truncated"], false);
    assert!(v.get("note").is_none(), "{v}");
}

/// A table with thousands of long columns (and indexes on top) is described within the
/// result cap: indexes give way first, then columns from the end, and the answer says
/// so, with how to list the rest. Before, SQLite answered with all of it (2000 columns
/// of 1000-character names: 2 MB here, and without end in general: any number of
/// indexes) and PostgreSQL with up to 64 MiB, above the worker's 32 MiB message limit.
#[tokio::test]
async fn describe_table_answers_stay_within_the_result_cap() {
    const CAP: usize = 1024 * 1024;
    let lite = Lite::new();
    {
        let conn = rusqlite::Connection::open(lite.path()).unwrap();
        let columns: Vec<String> = (0..2000)
            .map(|i| format!("c{i:04}{}", "x".repeat(995)))
            .collect();
        let mut ddl = format!("BEGIN; CREATE TABLE wide ({});", columns.join(", "));
        for (i, column) in columns.iter().take(50).enumerate() {
            ddl.push_str(&format!("CREATE INDEX wide_{i} ON wide ({column});"));
        }
        ddl.push_str("CREATE TABLE small (id INTEGER PRIMARY KEY, note TEXT); COMMIT;");
        conn.execute_batch(&ddl).unwrap();
    }
    // PostgreSQL names are at most 63 bytes, and a table at most 1600 columns: long
    // defaults make the width.
    let wide = postgres::unique_name("airlock_wide");
    postgres::create_database(&wide);
    superuser(&wide)
        .await
        .batch_execute(
            "DO $$ BEGIN
               EXECUTE 'CREATE TABLE wide (' || (SELECT string_agg(format('%I text DEFAULT %L',
                 'c' || lpad(i::text, 4, '0') || repeat('x', 58), repeat('d', 700)), ', ' ORDER BY i)
                 FROM generate_series(0, 1599) i) || ')';
               FOR i IN 0..49 LOOP
                 EXECUTE format('CREATE INDEX %I ON wide (%I)', 'wide_' || i, 'c' || lpad(i::text, 4, '0') || repeat('x', 58));
               END LOOP;
             END $$;
             CREATE TABLE small (id int PRIMARY KEY, note text);
             GRANT SELECT ON ALL TABLES IN SCHEMA public TO PUBLIC;",
        )
        .await
        .unwrap();
    let mut pgc = pg_db("pg", "airlock_ro");
    pgc.url = pgc.url.replace("/airlock_test", &format!("/{wide}"));
    let set = tools(vec![lite.db("lite"), pgc]).unwrap();

    for (db, fitting, first, rest) in [
        (
            "lite",
            900,
            format!("c0000{}", "x".repeat(995)),
            "pragma_table_xinfo",
        ),
        (
            "pg",
            1000,
            format!("c0000{}", "x".repeat(58)),
            "information_schema.columns",
        ),
    ] {
        let out = call(
            &set,
            "describe_table",
            json!({"database": db, "table": "wide"}),
        )
        .await;
        assert!(!out.is_error, "{db}: {:?}", out.content);
        let text = out.content.join("");
        assert!(text.len() <= CAP, "{db}: {} bytes", text.len());
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["truncated"], true, "{db}");
        let note = v["note"].as_str().unwrap();
        assert!(
            note.contains("query_database") && note.contains(rest) && note.contains("1048576"),
            "{db}: {note}"
        );
        // Indexes gave way first; the columns kept are the first ones, in order.
        assert_eq!(v["indexes"], json!([]), "{db}");
        let names: Vec<&str> = v["columns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert!(names.len() >= fitting, "{db}: {} columns", names.len());
        assert!(names.len() < 1600, "{db}: {} columns", names.len());
        assert_eq!(names[0], first, "{db}");
        assert!(names.is_sorted(), "{db}");
        // A small table is whole, and says so.
        let v = ok(
            &set,
            "describe_table",
            json!({"database": db, "table": "small"}),
        )
        .await;
        assert_eq!(v["truncated"], false, "{db}: {v}");
        assert!(v.get("note").is_none(), "{db}: {v}");
        assert_eq!(v["columns"].as_array().unwrap().len(), 2, "{db}: {v}");
    }
}

// ---------------------------------------------------------------------------------------
// Timeouts, outages, passwords
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn statement_timeouts_stop_slow_queries() {
    let lite = Lite::new();
    let mut pgc = pg_db("pg", "airlock_ro");
    pgc.statement_timeout_ms = 500;
    let mut litec = lite.db("lite");
    litec.statement_timeout_ms = 500;
    let set = tools(vec![pgc, litec]).unwrap();
    let forever =
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c";
    for (db, sql) in [
        ("pg", "SELECT pg_sleep(10)"),
        ("pg", forever),
        ("lite", forever),
    ] {
        let started = Instant::now();
        let e = err(&set, "query_database", json!({"database": db, "sql": sql})).await;
        eprintln!(
            "{db}: {sql}: stopped after {:?} (measured)",
            started.elapsed()
        );
        assert!(e.contains("stopped after"), "{db}: {e}");
    }
    // One long call of a built-in function, inside which SQLite never looks at the
    // timeout: the instr() call ran 130 s, the LIKE minutes. The 10 s are a failure
    // deadline only (the measured times are printed).
    let long_calls = [
        (
            "SELECT instr(printf('%.*c', 4000000, 'a'), printf('%.*c', 2000000, 'a') || 'b') AS i",
            None,
        ),
        (
            "SELECT printf('%.*c', 4000000, 'a') LIKE '%' || printf('%.*c', 49990, 'a') || 'b' AS l",
            Some("LIKE or GLOB pattern is longer than the 100 bytes"),
        ),
        (
            "SELECT glob('*' || printf('%.*c', 49990, 'a') || 'b', printf('%.*c', 4000000, 'a')) AS g",
            Some("LIKE or GLOB pattern is longer than the 100 bytes"),
        ),
    ];
    for (sql, refusal) in long_calls {
        let started = Instant::now();
        let out = tokio::time::timeout(
            Duration::from_secs(10),
            call(
                &set,
                "query_database",
                json!({"database": "lite", "sql": sql}),
            ),
        )
        .await
        .unwrap_or_else(|_| panic!("{sql}: still running after 10 s"));
        eprintln!("lite: {sql}: {:?} (measured)", started.elapsed());
        let text = out.content.join("");
        match refusal {
            None => {
                assert!(!out.is_error, "{sql}: {text}");
                let v: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(v["rows"], json!([[0]]), "{sql}");
            }
            Some(expected) => {
                assert!(out.is_error, "{sql}: {text}");
                assert!(
                    text.contains(expected) && text.contains("instr("),
                    "{sql}: {text}"
                );
            }
        }
    }
    // The call's deadline also stops it, when it comes before the statement timeout.
    let set = tools(vec![pg_db("pg", "airlock_ro"), lite.db("lite")]).unwrap();
    for (db, sql) in [("pg", "SELECT pg_sleep(10)"), ("lite", forever)] {
        let started = Instant::now();
        let out = call_with(
            &set,
            "query_database",
            json!({"database": db, "sql": sql}),
            Duration::from_millis(700),
        )
        .await;
        assert!(out.is_error, "{db}");
        assert!(
            out.content.join("").contains("stopped after"),
            "{db}: {:?}",
            out.content
        );
        eprintln!(
            "{db}: {:?}: {:?} (measured)",
            out.content,
            started.elapsed()
        );
    }
    // And the databases still answer afterwards.
    assert_eq!(
        query(&set, "pg", "SELECT 1 AS x").await["rows"],
        json!([[1]])
    );
    assert_eq!(
        query(&set, "lite", "SELECT 1 AS x").await["rows"],
        json!([[1]])
    );
}

/// A statement whose call has ended (the worker answers at the call's deadline and drops
/// the call) still holds its connection slot until its thread ends: with `pool_size = 1`
/// the next call waits for it, and says so when it cannot wait long enough. Before, the
/// slot was released with the call, so every repeated call started one more thread.
#[tokio::test]
async fn a_statement_outliving_its_call_keeps_its_connection_slot() {
    let lite = Lite::new();
    let mut c = lite.db("lite");
    c.pool_size = 1;
    c.statement_timeout_ms = 2000;
    let set = tools(vec![c]).unwrap();
    let forever =
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c";
    let started = Instant::now();
    // Dropped after 300 ms, as the worker's own timer drops a call at its deadline; the
    // statement runs on until its 2 s timeout.
    let dropped = tokio::time::timeout(
        Duration::from_millis(300),
        call(
            &set,
            "query_database",
            json!({"database": "lite", "sql": forever}),
        ),
    )
    .await;
    assert!(dropped.is_err(), "the statement should still run");

    let out = call_with(
        &set,
        "query_database",
        json!({"database": "lite", "sql": "SELECT 1 AS x"}),
        Duration::from_millis(500),
    )
    .await;
    let text = out.content.join("");
    assert!(out.is_error, "the only slot should still be taken: {text}");
    assert!(
        text.contains("stayed busy") && text.contains("all 1 of its connections"),
        "{text}"
    );

    // Once the statement's thread has ended, the slot is free again.
    assert_eq!(
        query(&set, "lite", "SELECT 1 AS x").await["rows"],
        json!([[1]])
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(1500),
        "answered after {waited:?}, before the first statement's thread ended"
    );
}

/// `SELECT 1+1+...` with 200 000 terms (400 KB, under the 1 MiB maxLength) made the SQL
/// parser build a 200 000-level tree whose drop overflowed the stack: the process
/// aborted, with every call in flight. It is refused before it is parsed, by both tools
/// on both engines, and the same tools answer the next call.
#[tokio::test]
async fn statements_nested_too_deep_are_refused_and_the_worker_answers_on() {
    let lite = Lite::new();
    let mut pgrw = pg_db("pgrw", "airlock_rw");
    pgrw.read_only = false;
    let mut literw = lite.db("literw");
    literw.read_only = false;
    let set = tools(vec![
        pg_db("pg", "airlock_ro"),
        lite.db("lite"),
        pgrw,
        literw,
    ])
    .unwrap();
    let sql = format!("SELECT 1{}", "+1".repeat(200_000));
    for (tool, db) in [
        ("query_database", "pg"),
        ("query_database", "lite"),
        ("execute_sql", "pgrw"),
        ("execute_sql", "literw"),
    ] {
        let out = call(&set, tool, json!({"database": db, "sql": sql})).await;
        let text = out.content.join("");
        assert!(out.is_error, "{tool} {db}");
        assert!(
            text.contains("nests 200000 operators")
                && text.contains("at most 4000")
                && text.contains("split it or simplify"),
            "{tool} {db}: {text}"
        );
        assert_eq!(
            query(&set, db, "SELECT 1 AS x").await["rows"],
            json!([[1]]),
            "{db}"
        );
    }
}

#[tokio::test]
async fn a_database_that_is_down_does_not_stop_the_others() {
    let lite = Lite::new();
    let closed_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut down = DatabaseConfig::new(
        "down",
        format!("postgres://airlock_ro@127.0.0.1:{closed_port}/airlock_test"),
    );
    down.password_file = Some(pg().base.join("ro.pw"));
    let missing = DatabaseConfig::new(
        "missing",
        format!("sqlite://{}", lite.dir.path().join("nope.db").display()),
    );
    // Start-up does not connect, so it succeeds.
    let set = tools(vec![
        down,
        missing,
        pg_db("pg", "airlock_ro"),
        lite.db("lite"),
    ])
    .unwrap();
    let e = err(
        &set,
        "query_database",
        json!({"database": "down", "sql": "SELECT 1"}),
    )
    .await;
    assert!(
        e.contains("database \"down\" is unreachable: connection refused; check that PostgreSQL is running at 127.0.0.1:"),
        "{e}"
    );
    let e = err(
        &set,
        "query_database",
        json!({"database": "missing", "sql": "SELECT 1"}),
    )
    .await;
    assert!(
        e.contains("unreachable") && e.contains("does not exist"),
        "{e}"
    );
    let list = ok(&set, "list_databases", json!({})).await;
    let dbs = list["databases"].as_array().unwrap();
    let by = |n: &str| dbs.iter().find(|d| d["name"] == n).unwrap().clone();
    assert_eq!(by("down")["reachable"], false);
    assert!(
        by("down")["error"]
            .as_str()
            .unwrap()
            .contains("connection refused")
    );
    assert_eq!(by("missing")["reachable"], false);
    assert_eq!(by("pg")["reachable"], true, "{list}");
    assert_eq!(by("pg")["engine"], "postgresql");
    assert_eq!(by("lite")["reachable"], true);
    assert_eq!(by("lite")["engine"], "sqlite");
    assert_eq!(by("lite")["read_only"], true);
    assert_eq!(
        query(&set, "pg", "SELECT count(*) AS n FROM t").await["rows"],
        json!([[3]])
    );
    assert_eq!(
        query(&set, "lite", "SELECT count(*) AS n FROM t").await["rows"],
        json!([[3]])
    );
}

#[tokio::test]
async fn a_wrong_password_is_never_echoed() {
    let mut c = pg_db("pg", "airlock_ro");
    c.password_file = Some(pg().base.join("wrong.pw"));
    let set = tools(vec![c]).unwrap();
    for (tool, args) in [
        (
            "query_database",
            json!({"database": "pg", "sql": "SELECT 1"}),
        ),
        ("list_tables", json!({"database": "pg"})),
        ("list_databases", json!({})),
    ] {
        let out = call(&set, tool, args).await;
        let text = out.content.join("\n");
        assert!(!text.contains("Wrong-Password-Canary"), "{text}");
        assert!(!text.contains(RO_PASSWORD), "{text}");
        if tool != "list_databases" {
            assert!(out.is_error);
            assert!(text.contains("password authentication failed"), "{text}");
        }
    }
    // A password in the url is refused at start, without echoing it.
    let e = tools(vec![DatabaseConfig::new(
        "x",
        "postgres://u:Url-Canary-1@127.0.0.1/db",
    )])
    .err()
    .unwrap()
    .to_string();
    assert!(
        !e.contains("Url-Canary-1") && e.contains("password_env"),
        "{e}"
    );
    // And the config's Debug output does not carry it either.
    let mut c = pg_db("pg", "airlock_ro");
    c.password_env = Some("SOME_VAR".into());
    assert!(!format!("{c:?}").contains(RO_PASSWORD));
}

// ---------------------------------------------------------------------------------------
// execute_sql
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn execute_sql_writes_and_is_refused_on_read_only_databases() {
    let _exclusive = PG_STATE_LOCK.lock().await;
    let lite = Lite::new();
    let mut rw = pg_db("pgrw", "airlock_rw");
    rw.read_only = false;
    let mut lrw = lite.db("literw");
    lrw.read_only = false;
    let set = tools(vec![rw, lrw, pg_db("pg", "airlock_ro"), lite.db("lite")]).unwrap();

    let before = pg_state().await;
    let out = ok(
        &set,
        "execute_sql",
        json!({"database": "pgrw", "sql": "INSERT INTO w (v) VALUES ($1), ($2)", "params": ["x", "y"]}),
    )
    .await;
    assert_eq!(out["rows_affected"], 2, "{out}");
    let out = ok(
        &set,
        "execute_sql",
        json!({"database": "pgrw", "sql": "UPDATE w SET v = upper(v) WHERE v IN ('x', 'y') RETURNING v"}),
    )
    .await;
    assert_eq!(out["rows_affected"], 2, "{out}");
    assert_eq!(out["rows"].as_array().unwrap().len(), 2);
    let out = ok(
        &set,
        "execute_sql",
        json!({"database": "pgrw", "sql": "DELETE FROM w WHERE v IN ('X', 'Y')"}),
    )
    .await;
    assert_eq!(out["rows_affected"], 2);
    assert_eq!(pg_state().await, before);

    let out = ok(
        &set,
        "execute_sql",
        json!({"database": "literw", "sql": "INSERT INTO t (id, name) VALUES (?1, ?2)", "params": [10, "ten"]}),
    )
    .await;
    assert_eq!(out["rows_affected"], 1);
    let out = ok(
        &set,
        "execute_sql",
        json!({"database": "literw", "sql": "UPDATE w SET v = 'z' WHERE id <= 7"}),
    )
    .await;
    assert_eq!(out["rows_affected"], 7);
    assert_eq!(
        query(&set, "lite", "SELECT name FROM t WHERE id = 10").await["rows"],
        json!([["ten"]])
    );

    for db in ["pg", "lite"] {
        let e = err(
            &set,
            "execute_sql",
            json!({"database": db, "sql": "DELETE FROM w"}),
        )
        .await;
        assert!(
            e.contains("read_only") && e.contains("execute_sql is refused"),
            "{e}"
        );
    }
    for (db, sql) in [
        ("pgrw", "COMMIT"),
        ("pgrw", "INSERT INTO w (v) VALUES ('a'); DELETE FROM w"),
        ("literw", "BEGIN"),
        ("literw", "ATTACH DATABASE 'x.db' AS x"),
        ("literw", "INSERT INTO w (v) VALUES ('a'); DELETE FROM w"),
        ("literw", "SELECT load_extension('x')"),
    ] {
        err(&set, "execute_sql", json!({"database": db, "sql": sql})).await;
    }
    // A failing statement leaves nothing behind.
    let before = pg_state().await;
    err(
        &set,
        "execute_sql",
        json!({"database": "pgrw", "sql": "INSERT INTO t VALUES (1, 'dup')"}),
    )
    .await;
    assert_eq!(pg_state().await, before);
}

// ---------------------------------------------------------------------------------------
// The attack battery
// ---------------------------------------------------------------------------------------

/// Writes and side effects that query_database must refuse on PostgreSQL.
const PG_ATTACKS: &[&str] = &[
    "INSERT INTO t VALUES (9, 'x', 1)",
    "UPDATE t SET name = 'x'",
    "DELETE FROM t",
    "DROP TABLE t",
    "CREATE TABLE evil (a int)",
    "ALTER TABLE t ADD COLUMN evil int",
    "TRUNCATE t",
    "SELECT 1; DROP TABLE t",
    "SELECT 1; DELETE FROM t",
    "SELECT 1 -- \n; DELETE FROM t",
    "/* hi */ DeLeTe FROM t",
    "   \n\t ( DELETE FROM t )",
    "WITH x AS (DELETE FROM t RETURNING *) SELECT * FROM x",
    "WITH x AS (UPDATE t SET name = 'x' RETURNING *) SELECT count(*) FROM x",
    "WITH x AS (INSERT INTO t VALUES (9, 'x', 1) RETURNING *) SELECT * FROM x",
    "SELECT * FROM t FOR UPDATE",
    "SELECT * FROM t FOR SHARE",
    "SELECT nextval('s')",
    "SELECT setval('s', 42)",
    "SELECT lo_import('/etc/passwd')",
    "SELECT pg_read_file('/etc/passwd')",
    "SELECT * FROM dblink('dbname=airlock_test', 'DELETE FROM t RETURNING 1') AS r(x int)",
    "COPY t TO PROGRAM 'id'",
    "COPY t FROM '/etc/passwd'",
    "DO $$ BEGIN DELETE FROM t; END $$",
    "DO $$ BEGIN SET TRANSACTION READ WRITE; DELETE FROM t; END $$",
    "CALL p()",
    "SELECT * INTO newtab FROM t",
    "CREATE TABLE newtab AS SELECT * FROM t",
    "EXPLAIN ANALYZE DELETE FROM t",
    "SELECT query_to_xml('DELETE FROM t RETURNING 1', true, false, '')",
    "COMMIT",
    "GRANT ALL ON t TO PUBLIC",
];

/// Side effects that PostgreSQL allows in a read-only transaction (settings, advisory
/// locks, table locks): the parser refuses them; without the parser, the engine layer
/// leaves no lasting effect (rollback, DISCARD ALL) — see `engine_layer_alone_*`.
const PG_TRANSIENT_EFFECTS: &[&str] = &[
    "LOCK TABLE t",
    "SELECT set_config('default_transaction_read_only', 'off', false)",
    "SELECT pg_advisory_lock(1)",
    "SELECT pg_try_advisory_lock(2)",
    // Denied functions inside SQL given as a string, which these functions run.
    "SELECT * FROM ts_stat($$SELECT to_tsvector(pg_try_advisory_lock(3)::text)$$)",
    "SELECT * FROM pg_catalog.ts_stat('SELECT to_tsvector(set_config(''default_transaction_read_only'', ''off'', false))')",
    "SELECT word FROM ts_stat('SELECT to_tsvector(pg_terminate_backend(pid)::text) FROM pg_stat_activity WHERE pid <> pg_backend_pid()')",
    "SELECT ts_rewrite('a'::tsquery, 'SELECT ''a''::tsquery, to_tsquery(pg_try_advisory_lock(4)::text)')",
    "SELECT * FROM crosstab('SELECT set_config(''a.b'', ''c'', false), 1, 1') AS ct(a text, b int)",
];

const LITE_ATTACKS: &[&str] = &[
    "INSERT INTO t VALUES (9, 'x')",
    "UPDATE t SET name = 'x'",
    "DELETE FROM t",
    "DROP TABLE t",
    "CREATE TABLE evil (a)",
    "ALTER TABLE t ADD COLUMN evil",
    "DELETE FROM t WHERE 1",
    "SELECT 1; DROP TABLE t",
    "SELECT 1 -- \n; DELETE FROM t",
    "/* */ DeLeTe FROM t",
    "  \n ( DELETE FROM t )",
    "WITH x AS (SELECT 1) DELETE FROM t",
    "REPLACE INTO t VALUES (1, 'x')",
    "INSERT INTO t VALUES (1, 'x') ON CONFLICT (id) DO UPDATE SET name = 'x'",
    "INSERT OR REPLACE INTO t VALUES (1, 'x')",
    "ATTACH DATABASE '{dir}/x.db' AS x",
    "PRAGMA writable_schema=ON",
    "PRAGMA user_version = 7",
    "PRAGMA journal_mode = WAL",
    "VACUUM INTO '{dir}/y.db'",
    "VACUUM",
    "SELECT load_extension('x')",
    "BEGIN",
    "CREATE TEMP TABLE evil (a)",
    "REINDEX",
    "ANALYZE",
];

fn lite_sql(sql: &str, lite: &Lite) -> String {
    sql.replace("{dir}", &lite.dir.path().display().to_string())
}

#[tokio::test]
async fn attack_battery_postgres_both_layers() {
    let _exclusive = PG_STATE_LOCK.lock().await;
    let set = tools(vec![pg_db("pg", "airlock_ro")]).unwrap();
    let before = pg_state().await;
    for sql in PG_ATTACKS.iter().chain(PG_TRANSIENT_EFFECTS) {
        let e = err(
            &set,
            "query_database",
            json!({"database": "pg", "sql": sql}),
        )
        .await;
        assert!(
            e.starts_with("refused") || e.contains("statements") || e.contains("could not parse"),
            "{sql}: refused for another reason: {e}"
        );
        assert_eq!(pg_state().await, before, "{sql} changed the data");
    }
    let e = err(
        &set,
        "query_database",
        json!({"database": "pg", "sql": "DROP TABLE t"}),
    )
    .await;
    assert!(e.contains("DROP TABLE") && e.contains("execute_sql"), "{e}");
    // Reads still work, with the lower-case and commented variants.
    assert_eq!(
        query(&set, "pg", "  /* c */ (select count(*) from t)").await["rows"],
        json!([[3]])
    );
    assert_eq!(
        query(
            &set,
            "pg",
            "SELECT currval_ok FROM (SELECT 1 AS currval_ok) x"
        )
        .await["rows"],
        json!([[1]])
    );
    assert_eq!(
        query(&set, "pg", "SHOW transaction_read_only").await["rows"],
        json!([["on"]])
    );
}

#[tokio::test]
async fn attack_battery_sqlite_both_layers() {
    let lite = Lite::new();
    let set = tools(vec![lite.db("lite")]).unwrap();
    let before = lite.state();
    for sql in LITE_ATTACKS {
        let sql = lite_sql(sql, &lite);
        let e = err(
            &set,
            "query_database",
            json!({"database": "lite", "sql": sql}),
        )
        .await;
        assert!(
            e.starts_with("refused") || e.contains("statements") || e.contains("could not parse"),
            "{sql}: refused for another reason: {e}"
        );
        assert_eq!(lite.state(), before, "{sql} changed the database");
    }
    assert_eq!(
        query(&set, "lite", "  /* c */ select count(*) from t").await["rows"],
        json!([[3]])
    );
    assert_eq!(
        query(&set, "lite", "PRAGMA table_info('t')").await["row_count"],
        2
    );
}

#[tokio::test]
async fn engine_layer_alone_stops_postgres_writes() {
    let _exclusive = PG_STATE_LOCK.lock().await;
    // Parser off; a role that MAY write the tables: only the READ ONLY transaction, the
    // single prepared statement and the rollback stand in the way.
    let mut c = pg_db("pg", "airlock_rw");
    c.unsafe_skip_parser_for_tests = true;
    let set = tools(vec![c]).unwrap();
    let before = pg_state().await;
    for sql in PG_ATTACKS {
        let out = call(
            &set,
            "query_database",
            json!({"database": "pg", "sql": sql}),
        )
        .await;
        let text = out.content.join("\n");
        if *sql == "COMMIT" {
            // Commits an empty read-only transaction: harmless, and nothing changed.
            assert_eq!(pg_state().await, before);
            continue;
        }
        eprintln!("engine layer, {sql:?} => {text}");
        assert!(out.is_error, "{sql}: engine layer let it run: {text}");
        assert!(
            !text.starts_with("refused: "),
            "{sql}: the parser was supposed to be off: {text}"
        );
        assert_eq!(pg_state().await, before, "{sql} changed the data");
    }
    // Session effects PostgreSQL allows in a read-only transaction leave nothing behind.
    for sql in PG_TRANSIENT_EFFECTS {
        let _ = call(
            &set,
            "query_database",
            json!({"database": "pg", "sql": sql}),
        )
        .await;
        assert_eq!(
            pg_state().await,
            before,
            "{sql} left an effect (advisory lock?)"
        );
        let out = query(
            &set,
            "pg",
            "SELECT current_setting('default_transaction_read_only') AS x",
        )
        .await;
        assert_eq!(out["rows"], json!([["off"]]));
    }
}

#[tokio::test]
async fn parser_layer_alone_stops_postgres_writes() {
    let _exclusive = PG_STATE_LOCK.lock().await;
    // Engine layer off (read-write transaction, committed) and a role that may write:
    // only the parser stands in the way.
    let mut c = pg_db("pg", "airlock_rw");
    c.unsafe_skip_engine_read_only_for_tests = true;
    let set = tools(vec![c]).unwrap();
    let before = pg_state().await;
    for sql in PG_ATTACKS.iter().chain(PG_TRANSIENT_EFFECTS) {
        let e = err(
            &set,
            "query_database",
            json!({"database": "pg", "sql": sql}),
        )
        .await;
        assert!(
            e.starts_with("refused") || e.contains("statements") || e.contains("could not parse"),
            "{sql}: not refused by the parser: {e}"
        );
        assert_eq!(pg_state().await, before, "{sql} changed the data");
    }
    // Proof that the engine layer is really off here: a write that slips past the parser
    // (none should) would commit. A read still works.
    assert_eq!(
        query(&set, "pg", "SHOW transaction_read_only").await["rows"],
        json!([["off"]])
    );
}

#[tokio::test]
async fn engine_layer_alone_stops_sqlite_writes() {
    let lite = Lite::new();
    let mut c = lite.db("lite");
    c.unsafe_skip_parser_for_tests = true;
    let set = tools(vec![c]).unwrap();
    let before = lite.state();
    for sql in LITE_ATTACKS {
        let sql = lite_sql(sql, &lite);
        let e = err(
            &set,
            "query_database",
            json!({"database": "lite", "sql": sql}),
        )
        .await;
        eprintln!("engine layer, {sql:?} => {e}");
        assert!(
            !e.starts_with("refused: "),
            "{sql}: the parser was supposed to be off: {e}"
        );
        assert_eq!(lite.state(), before, "{sql} changed the database");
    }
}

#[tokio::test]
async fn parser_layer_alone_stops_sqlite_writes() {
    let lite = Lite::new();
    let mut c = lite.db("lite");
    c.unsafe_skip_engine_read_only_for_tests = true;
    let set = tools(vec![c]).unwrap();
    let before = lite.state();
    for sql in LITE_ATTACKS {
        let sql = lite_sql(sql, &lite);
        let e = err(
            &set,
            "query_database",
            json!({"database": "lite", "sql": sql}),
        )
        .await;
        assert!(
            e.starts_with("refused") || e.contains("statements") || e.contains("could not parse"),
            "{sql}: not refused by the parser: {e}"
        );
        assert_eq!(lite.state(), before, "{sql} changed the database");
    }
    assert_eq!(
        query(&set, "lite", "PRAGMA query_only").await["rows"],
        json!([[0]])
    );
}

#[test]
fn sqlite_paths_are_the_configured_files() {
    let mut rel = DatabaseConfig::new("rel", "sqlite://data/demo.db");
    rel.resolve_relative(Path::new("/etc/airlock"));
    let dbs = vec![
        rel,
        DatabaseConfig::new("abs", "sqlite:///var/lib/airlock/x.db"),
        DatabaseConfig::new("pg", "postgres://u@localhost/db"),
    ];
    assert_eq!(
        sqlite_paths(&dbs),
        vec![
            PathBuf::from("/etc/airlock/data/demo.db"),
            PathBuf::from("/var/lib/airlock/x.db")
        ]
    );
}

// ---------------------------------------------------------------------------------------
// Memory: results are capped while they are produced
// ---------------------------------------------------------------------------------------

/// The result cap (tools.rs `MAX_RESULT_BYTES`) and the largest value or PostgreSQL row
/// message the worker holds (`MAX_VALUE_BYTES`), as the error messages name them.
const RESULT_CAP: &str = "1048576 bytes";
const VALUE_CAP: &str = "4194304 bytes";
/// What one attack may add to this process's peak resident memory. The other tests of
/// this binary run beside it in the same process, so the bound leaves them room; the
/// tight bound (64 MiB) is asserted on a worker process of its own, through `airlock up`,
/// in tests/e2e/adversarial_workers.rs. Unbounded, these attacks grew the process by
/// 293 MiB (edits) to 1144 MiB (SQLite blobs).
const MAX_GROWTH: u64 = 256 << 20;

/// The memory measurements of this binary run one at a time: each resets the process's
/// peak, which another measuring test would see. (SQLite's process-wide heap ceiling is
/// tested through `airlock up`, tests/e2e/adversarial_workers.rs: filling it here would
/// fail the SQLite calls of the tests running beside it.)
static MEMORY_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A field of /proc/self/status in bytes (`VmHWM`, `VmRSS`).
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unreadable {line:?}"));
    kib * 1024
}

/// Starts a measurement: resets the peak resident size to the current one (Linux 4.0
/// and later) and returns that.
fn reset_peak() -> u64 {
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    status_bytes("VmRSS")
}

/// How much the peak resident size grew since `base`.
fn peak_growth(base: u64) -> u64 {
    status_bytes("VmHWM").saturating_sub(base)
}

/// Runs one attack: the call must fail with `expect` in its message (or, with
/// `truncated`, succeed flagged truncated by the byte cap), and this process's peak
/// resident memory must grow by less than `bound`.
async fn attack(set: &ToolSet, tool: &str, db: &str, sql: &str, expect: &str, bound: u64) {
    let base = reset_peak();
    let out = call(set, tool, json!({"database": db, "sql": sql})).await;
    let growth = peak_growth(base);
    let text = out.content.join("\n");
    eprintln!(
        "{tool} {sql:.70}: peak resident memory +{} MiB",
        growth >> 20
    );
    if expect == "truncated" {
        assert!(!out.is_error, "{sql}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["truncated"], true, "{sql}: {v}");
        let note = v["note"].as_str().unwrap();
        assert!(note.contains(RESULT_CAP), "{sql}: {note}");
        assert!(text.len() < 1 << 20, "{sql}: {} bytes", text.len());
    } else {
        assert!(out.is_error, "{sql} should fail: {text:.300}");
        assert!(text.contains(expect), "{sql}: {text}");
    }
    assert!(
        growth < bound,
        "{sql}: peak resident memory grew by {} MiB (bound {} MiB)",
        growth >> 20,
        bound >> 20
    );
}

#[tokio::test]
async fn sqlite_results_are_capped_before_they_are_allocated() {
    let _one = MEMORY_LOCK.lock().await;
    let lite = Lite::new();
    let mut writable = lite.db("rw");
    writable.read_only = false;
    let set = tools(vec![lite.db("lite"), writable]).unwrap();
    let q = "query_database";
    for (sql, expect) in [
        // The attack pass's payload: three 150 MB values (1.2 GB before).
        (
            "SELECT randomblob(150000000), randomblob(150000000), randomblob(150000000)",
            VALUE_CAP,
        ),
        ("SELECT randomblob(1000000000)", VALUE_CAP),
        ("SELECT zeroblob(1000000000)", VALUE_CAP),
        ("SELECT length(zeroblob(1000000000))", VALUE_CAP),
        (
            "SELECT replace(printf('%.4000000c', 'x'), 'x', 'xx')",
            VALUE_CAP,
        ),
        // Doubling a string in a recursive CTE until it passes the value cap.
        (
            "WITH RECURSIVE r(s, n) AS (SELECT 'x', 0 UNION ALL SELECT s || s, n + 1 FROM r \
             WHERE n < 40) SELECT length(s) FROM r",
            VALUE_CAP,
        ),
        (
            "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 100000) \
             SELECT group_concat(printf('%.1000c', 'x')) FROM g",
            VALUE_CAP,
        ),
        // Medium values, many columns: each below the value cap, the row past the
        // result cap — stopped at the first value that does not fit.
        (
            "SELECT randomblob(3000000), randomblob(3000000), randomblob(3000000), \
             randomblob(3000000), randomblob(3000000), randomblob(3000000)",
            RESULT_CAP,
        ),
        (
            "SELECT printf('%.900000c', 'x'), printf('%.900000c', 'y')",
            RESULT_CAP,
        ),
        // Many rows of medium values: the rows that fit, flagged truncated.
        (
            "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 1000) \
             SELECT n, randomblob(100000) FROM g",
            "truncated",
        ),
    ] {
        attack(&set, q, "lite", sql, expect, MAX_GROWTH).await;
    }
    // A write cannot build an oversized value either, and keeps nothing of it.
    attack(
        &set,
        "execute_sql",
        "rw",
        "INSERT INTO w (v) VALUES (randomblob(150000000))",
        VALUE_CAP,
        MAX_GROWTH,
    )
    .await;
    let base = reset_peak();
    let out = ok(
        &set,
        "execute_sql",
        json!({"database": "rw", "sql": "UPDATE w SET v = v WHERE id <= 500 RETURNING id, randomblob(20000)"}),
    )
    .await;
    assert!(peak_growth(base) < MAX_GROWTH);
    assert_eq!(
        out["rows_affected"], 500,
        "the write ran to the end: {out:.300}"
    );
    assert_eq!(out["truncated"], true);
    assert!(
        out["note"].as_str().unwrap().contains(RESULT_CAP),
        "{out:.300}"
    );
    // Neither tool lets a statement move SQLite's process-wide heap ceiling.
    for tool in ["query_database", "execute_sql"] {
        let e = err(
            &set,
            tool,
            json!({"database": "rw", "sql": "PRAGMA hard_heap_limit = 1"}),
        )
        .await;
        assert!(
            e.contains("refused") || e.contains("not allowed"),
            "{tool}: {e}"
        );
    }
    // The worker still answers, and a value just under the caps still comes back.
    assert_eq!(
        query(&set, "lite", "SELECT count(*) FROM w").await["rows"],
        json!([[5000]])
    );
    let out = query(
        &set,
        "lite",
        "SELECT length(printf('%.4000000c', 'x')), printf('%.700000c', 'x')",
    )
    .await;
    assert_eq!(out["rows"][0][0], 4_000_000);
    assert_eq!(out["rows"][0][1].as_str().unwrap().len(), 700_000);
    assert_eq!(out["truncated"], false);
}

#[tokio::test]
async fn postgres_results_are_capped_before_they_are_allocated() {
    let set = tools(vec![pg_db("pg", "airlock_ro")]).unwrap();
    postgres_results_are_capped(&set).await;
}

/// On database `pg` of `set` (plaintext here, TLS in tls.rs): needs table `big`.
async fn postgres_results_are_capped(set: &ToolSet) {
    let _one = MEMORY_LOCK.lock().await;
    query(set, "pg", "SELECT 1").await; // connect and set up before measuring
    let q = "query_database";
    for (sql, expect) in [
        // The attack pass's payload: one 200 MB value, refused at its message header.
        ("SELECT repeat('x', 200000000)", VALUE_CAP),
        (
            "SELECT repeat('x', 100000000), repeat('y', 100000000), repeat('z', 100000000)",
            VALUE_CAP,
        ),
        (
            "SELECT string_agg(repeat('x', 1000), '') FROM generate_series(1, 100000)",
            VALUE_CAP,
        ),
        // Medium values, many columns: read (under the row limit), then stopped at the
        // first value that does not fit in the result.
        (
            "SELECT repeat('x', 900000) AS a, repeat('y', 900000) AS b, repeat('z', 900000) AS c",
            RESULT_CAP,
        ),
        ("SELECT decode(repeat('ab', 1000000), 'hex')", RESULT_CAP),
        (
            "SELECT n, repeat('x', 100000) FROM generate_series(1, 1000) n",
            "truncated",
        ),
    ] {
        attack(set, q, "pg", sql, expect, MAX_GROWTH).await;
    }
    // The worker still answers; the connection that was closed is replaced.
    assert_eq!(
        query(set, "pg", "SELECT count(*)::int FROM big").await["rows"],
        json!([[5000]])
    );
    let tables = ok(set, "list_tables", json!({"database": "pg"})).await;
    assert!(tables.to_string().contains("\"big\""), "{tables}");
    let out = query(
        set,
        "pg",
        "SELECT length(repeat('x', 3000000)), repeat('x', 700000)",
    )
    .await;
    assert_eq!(out["rows"][0][0], 3_000_000);
    assert_eq!(out["rows"][0][1].as_str().unwrap().len(), 700_000);
}

#[tokio::test]
async fn postgres_writes_run_to_the_end_past_the_byte_cap() {
    let _exclusive = PG_STATE_LOCK.lock().await;
    let mut rw = pg_db("pg", "airlock_rw");
    rw.read_only = false;
    let set = tools(vec![rw]).unwrap();
    let out = ok(
        &set,
        "execute_sql",
        json!({"database": "pg", "sql": "INSERT INTO w (v) SELECT 'cap-test' FROM generate_series(1, 20) RETURNING id, repeat('y', 200000)"}),
    )
    .await;
    assert_eq!(out["rows_affected"], 20, "{out:.300}");
    assert_eq!(out["truncated"], true);
    let kept = out["row_count"].as_u64().unwrap();
    assert!((1..20).contains(&kept), "{kept} rows kept");
    assert!(out["note"].as_str().unwrap().contains(RESULT_CAP));
    let out = ok(
        &set,
        "execute_sql",
        json!({"database": "pg", "sql": "DELETE FROM w WHERE v = 'cap-test'"}),
    )
    .await;
    assert_eq!(out["rows_affected"], 20);
}
