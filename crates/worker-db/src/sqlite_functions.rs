//! SQLite built-in functions whose single call could outlast any statement timeout,
//! bounded on every connection the worker opens.
//!
//! SQLite runs the progress handler (statement timeout, cancellation) only between the
//! steps of a statement, never inside one function call, and a few built-ins take time
//! that grows with the product of their arguments' lengths, each up to
//! `SQLITE_LIMIT_LENGTH` (4 MiB): `instr(4 MB of 'a', 2 MB of 'a' || 'b')` ran 130 s, a
//! `LIKE '%aaa...b'` with a 50 000-byte pattern minutes. Two bounds:
//!
//! - LIKE and GLOB patterns may hold at most [`MAX_LIKE_PATTERN_BYTES`]
//!   (`SQLITE_LIMIT_LIKE_PATTERN_LENGTH`): SQLite's matcher then takes at most about
//!   pattern × value steps, under about a second against a 4 MiB value.
//! - `instr` is replaced by the same function in time linear in its arguments.
//!
//! Limits, stated honestly: `replace(X, Y, Z)` and the two-argument `trim`, `ltrim` and
//! `rtrim` are quadratic in the same way and still SQLite's own. A call stuck in one of
//! them keeps its connection slot until it ends (`Sqlite::run`), so it cannot make the
//! worker start more threads than `pool_size`.

use std::borrow::Cow;
use std::cell::RefCell;

use rusqlite::Connection;
use rusqlite::functions::{Context, FunctionFlags};
use rusqlite::limits::Limit;
use rusqlite::types::ValueRef;

/// The longest LIKE or GLOB pattern, in bytes. Measured against a 4 MiB value with
/// `'%' || 'a' × 98 || 'b'` (the worst shape: every position matches all but the last
/// byte), an optimised build takes 0.4–1.3 s under load; 1000 bytes took 6–8 s. Longer
/// substring searches have a linear form: `instr(column, '...') > 0`.
pub(crate) const MAX_LIKE_PATTERN_BYTES: i32 = 100;

/// Bounds the functions of `conn` (see the module documentation).
pub(crate) fn bound(conn: &Connection) -> rusqlite::Result<()> {
    conn.set_limit(
        Limit::SQLITE_LIMIT_LIKE_PATTERN_LENGTH,
        MAX_LIKE_PATTERN_BYTES,
    )?;
    // In a UTF-16 database SQLite reads a blob given to instr() with text as UTF-16;
    // the replacement handles UTF-8 databases (the default) only, and leaves the others
    // to SQLite's own.
    let encoding: String = conn.pragma_query_value(None, "encoding", |r| r.get(0))?;
    if encoding == "UTF-8" {
        // Innocuous, as SQLite's own is: views and indexes that use instr() must keep
        // working on connections with an untrusted schema.
        conn.create_scalar_function(
            "instr",
            2,
            FunctionFlags::SQLITE_UTF8
                | FunctionFlags::SQLITE_DETERMINISTIC
                | FunctionFlags::SQLITE_INNOCUOUS,
            instr,
        )?;
    }
    Ok(())
}

/// `instr(X, Y)` as SQLite defines it (`instrFunc` in its func.c): the position of the
/// first Y in X counted from 1, in characters for text and in bytes when both are
/// blobs; 0 when Y is not in X, 1 when Y is empty, NULL when either is NULL; numbers are
/// searched as their text. SQLite compares Y at every position of X (time |X| × |Y|);
/// this finds it with Knuth–Morris–Pratt in time |X| + |Y|.
fn instr(ctx: &Context<'_>) -> rusqlite::Result<Option<i64>> {
    let (haystack, needle, text) = match (ctx.get_raw(0), ctx.get_raw(1)) {
        (ValueRef::Null, _) | (_, ValueRef::Null) => return Ok(None),
        (ValueRef::Blob(h), ValueRef::Blob(n)) => (Cow::Borrowed(h), Cow::Borrowed(n), false),
        (h, n) => (as_text(h)?, as_text(n)?, true),
    };
    if needle.is_empty() {
        return Ok(Some(1));
    }
    // SQLite steps through text a character at a time: from byte 0, then from every
    // byte that does not continue a UTF-8 sequence.
    let starts_step = |at: usize| at == 0 || haystack.get(at).is_some_and(|b| b & 0xC0 != 0x80);
    let position = match first_match(&haystack, &needle, |at| !text || starts_step(at)) {
        None => 0,
        Some(at) if text => {
            1 + haystack
                .get(1..=at)
                .map_or(0, |s| s.iter().filter(|b| *b & 0xC0 != 0x80).count())
        }
        Some(at) => at + 1,
    };
    Ok(Some(i64::try_from(position).unwrap_or(i64::MAX)))
}

/// The text SQLite gives a value (`sqlite3_value_text`) in a UTF-8 database.
fn as_text(value: ValueRef<'_>) -> rusqlite::Result<Cow<'_, [u8]>> {
    Ok(match value {
        ValueRef::Text(t) | ValueRef::Blob(t) => Cow::Borrowed(t),
        ValueRef::Integer(i) => Cow::Owned(i.to_string().into_bytes()),
        ValueRef::Real(r) => Cow::Owned(real_text(r)?.into_bytes()),
        ValueRef::Null => Cow::Borrowed(&[]),
    })
}

thread_local! {
    /// A private in-memory database on each thread that runs SQLite calls, used only
    /// to render REAL values as text.
    static RENDER: RefCell<Option<Connection>> = const { RefCell::new(None) };
}

/// A REAL as SQLite renders it as text (`%!.15g`, with its own digit rounding): asked
/// of SQLite itself, so the replaced function searches exactly the text SQLite's own
/// would.
fn real_text(r: f64) -> rusqlite::Result<String> {
    RENDER.with(|slot| {
        let mut slot = slot.borrow_mut();
        let conn = match slot.take() {
            Some(conn) => conn,
            None => Connection::open_in_memory()?,
        };
        let text = conn.query_row("SELECT CAST(?1 AS TEXT)", [r], |row| row.get(0));
        *slot = Some(conn);
        text
    })
}

/// The first position where `needle` (not empty) occurs in `haystack` and `accept`
/// holds, by Knuth–Morris–Pratt.
fn first_match(haystack: &[u8], needle: &[u8], accept: impl Fn(usize) -> bool) -> Option<usize> {
    let last = needle.len().checked_sub(1)?;
    // border[i]: the length of the longest proper prefix of needle[..=i] that is also
    // its suffix. Lengths fit in u32: SQLite values are shorter than 2^31 bytes.
    let mut border = vec![0u32; needle.len()];
    let mut k = 0usize;
    for i in 1..needle.len() {
        while k > 0 && needle[i] != needle[k] {
            k = border[k - 1] as usize;
        }
        if needle[i] == needle[k] {
            k += 1;
        }
        border[i] = k as u32;
    }
    let mut k = 0usize;
    for (i, &b) in haystack.iter().enumerate() {
        while k > 0 && b != needle[k] {
            k = border[k - 1] as usize;
        }
        if b == needle[k] {
            k += 1;
        }
        if k > last {
            let start = i - last;
            if accept(start) {
                return Some(start);
            }
            k = border[last] as usize;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use rusqlite::types::Value;

    /// Values of every kind and the text shapes that matter to instr(): characters of
    /// one to four bytes, bytes that continue a character, invalid UTF-8, NUL bytes,
    /// repeats that make naive and KMP searches differ.
    const VALUES: &[&str] = &[
        "NULL",
        "0",
        "-5",
        "12",
        "9223372036854775807",
        "-9223372036854775808",
        "1.0",
        "0.1",
        "-2.5",
        "0.1 + 0.2",
        "1e20",
        "1e300",
        "-2.5e-7",
        "3.141592653589793",
        "''",
        "'a'",
        "'1'",
        "'.'",
        "'e'",
        "'abc'",
        "'aab'",
        "'aaab'",
        "'abab'",
        "'ababab'",
        "'é'",
        "'aé€😀b'",
        "'€😀'",
        "'😀'",
        "'xx€xx'",
        "x''",
        "x'00'",
        "x'61'",
        "x'6100'",
        "x'006100'",
        "x'c3a9'",
        "x'a9'",
        "x'80'",
        "x'e282ac'",
        "x'82ac'",
        "x'616263'",
        "CAST(x'80c3a9' AS TEXT)",
        "CAST(x'a9' AS TEXT)",
        "CAST(x'c3' AS TEXT)",
        "CAST(x'61a961' AS TEXT)",
        "CAST(x'6100e282ac' AS TEXT)",
    ];

    fn all(conn: &Connection, sql: &str) -> Vec<Value> {
        let mut stmt = conn.prepare(sql).unwrap();
        stmt.query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    /// The replacement answers exactly what SQLite's own does, for every pair.
    #[test]
    fn instr_answers_as_sqlites_own() {
        let own = Connection::open_in_memory().unwrap();
        let bounded = Connection::open_in_memory().unwrap();
        bound(&bounded).unwrap();
        let rows: Vec<String> = VALUES
            .iter()
            .enumerate()
            .map(|(i, v)| format!("({i}, {v})"))
            .collect();
        let sql = format!(
            "WITH v(i, x) AS (VALUES {}) \
             SELECT instr(a.x, b.x) FROM v AS a, v AS b ORDER BY a.i, b.i",
            rows.join(", ")
        );
        let (expected, got) = (all(&own, &sql), all(&bounded, &sql));
        assert_eq!(expected.len(), VALUES.len() * VALUES.len());
        for (i, (e, g)) in expected.iter().zip(&got).enumerate() {
            let (h, n) = (VALUES[i / VALUES.len()], VALUES[i % VALUES.len()]);
            assert_eq!(e, g, "instr({h}, {n})");
        }
        // Longer, with many near matches, and over a table (a value read from disk).
        bounded
            .execute_batch(
                "CREATE TABLE t (v); INSERT INTO t VALUES
                   (printf('%.*c', 5000, 'a') || 'é' || printf('%.*c', 300, 'a') || 'b'),
                   (replace(printf('%.*c', 400, 'x'), 'x', 'ab') || 'abc');",
            )
            .unwrap();
        own.execute_batch(
            "CREATE TABLE t (v); INSERT INTO t VALUES
               (printf('%.*c', 5000, 'a') || 'é' || printf('%.*c', 300, 'a') || 'b'),
               (replace(printf('%.*c', 400, 'x'), 'x', 'ab') || 'abc');",
        )
        .unwrap();
        for sql in [
            "SELECT instr(v, printf('%.*c', 300, 'a') || 'b') FROM t",
            "SELECT instr(v, 'é' || printf('%.*c', 30, 'a')) FROM t",
            "SELECT instr(v, 'ababc') FROM t",
            "SELECT instr(CAST(v AS BLOB), CAST('é' AS BLOB)) FROM t",
            "SELECT instr(v, x'a9') FROM t",
        ] {
            assert_eq!(all(&own, sql), all(&bounded, sql), "{sql}");
        }
    }

    /// The call that took 130 s: linear now.
    #[test]
    fn instr_is_linear() {
        let bounded = Connection::open_in_memory().unwrap();
        bound(&bounded).unwrap();
        let started = std::time::Instant::now();
        let found: i64 = bounded
            .query_row(
                "SELECT instr(printf('%.*c', 4000000, 'a'), printf('%.*c', 2000000, 'a') || 'b')",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(found, 0);
        eprintln!("instr(4 MB, 2 MB): {:?} (measured)", started.elapsed());
        let found: i64 = bounded
            .query_row(
                "SELECT instr(printf('%.*c', 4000000, 'a') || 'b', printf('%.*c', 2000000, 'a') || 'b')",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(found, 2_000_001);
    }

    /// Views that call instr() still work with an untrusted schema (the replacement is
    /// innocuous), and a long LIKE pattern is refused by name.
    #[test]
    fn views_still_work_and_long_patterns_are_refused() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE VIEW v AS SELECT instr('abc', 'c') AS i")
            .unwrap();
        use rusqlite::config::DbConfig;
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_TRUSTED_SCHEMA, false)
            .unwrap();
        bound(&conn).unwrap();
        let i: i64 = conn.query_row("SELECT i FROM v", [], |r| r.get(0)).unwrap();
        assert_eq!(i, 3);
        let ok: bool = conn
            .query_row(&format!("SELECT 'a' LIKE '{}'", "%".repeat(100)), [], |r| {
                r.get(0)
            })
            .unwrap();
        assert!(ok);
        let e = conn
            .query_row(&format!("SELECT 'a' GLOB '{}'", "*".repeat(101)), [], |r| {
                r.get::<_, bool>(0)
            })
            .unwrap_err();
        assert!(e.to_string().contains("pattern too complex"), "{e}");
    }
}
