//! `[[databases]]` over TLS (`sslmode=verify-full&sslrootcert=`), against a TLS-only
//! server of this module's own (tests/support/postgres.rs `start_tls`: `ssl = on`,
//! `hostssl` lines only) whose certificate is the db worker's from
//! `airlock certs init --san worker-db=localhost` (DNS SANs `worker-db` and `localhost`,
//! no IP).
//! Role `airlock_ro` logs in with its password (SCRAM inside TLS).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use airlock_worker_db::{DatabaseConfig, DbError, tools};
use serde_json::json;

use super::{RO_PASSWORD, err, postgres, postgres_results_are_capped, query};

struct TlsPg {
    server: postgres::Server,
    ca: PathBuf,
}

static TLS_PG: OnceLock<TlsPg> = OnceLock::new();

fn start() -> TlsPg {
    let certs = tempfile::tempdir().unwrap();
    airlock_tls::devpki::init(certs.path(), &["worker-db=localhost".to_owned()]).unwrap();
    let server = postgres::start_tls(
        &certs.path().join("worker-db.crt"),
        &certs.path().join("worker-db.key"),
    )
    .unwrap_or_else(|e| panic!("cannot start the TLS test PostgreSQL: {e}"));
    let ca = server.dir.join("ca.crt");
    std::fs::copy(certs.path().join("ca.crt"), &ca).unwrap();
    std::fs::write(server.dir.join("ro.pw"), format!("{RO_PASSWORD}\n")).unwrap();
    server.create_role("airlock_ro", RO_PASSWORD);
    server
        .sql("postgres", "CREATE DATABASE airlock_test;")
        .unwrap();
    server
        .sql(
            "airlock_test",
            "CREATE TABLE big AS SELECT g AS n FROM generate_series(1, 5000) g; \
             GRANT SELECT ON ALL TABLES IN SCHEMA public TO airlock_ro;",
        )
        .unwrap();
    TlsPg { server, ca }
}

fn tls_pg() -> &'static TlsPg {
    TLS_PG.get_or_init(start)
}

/// Database `name` on the TLS server at `host`, verified against `rootcert`.
fn tls_db(name: &str, host: &str, port: u16, rootcert: &Path) -> DatabaseConfig {
    let mut c = DatabaseConfig::new(
        name,
        format!(
            "postgres://airlock_ro@{host}:{port}/airlock_test?sslmode=verify-full&sslrootcert={}",
            rootcert.display()
        ),
    );
    c.password_file = Some(tls_pg().server.dir.join("ro.pw"));
    c
}

#[tokio::test]
async fn queries_run_over_verify_full() {
    let tls = tokio::task::spawn_blocking(tls_pg).await.unwrap();
    let set = tools(vec![tls_db("pg", "localhost", tls.server.port, &tls.ca)]).unwrap();
    assert_eq!(
        query(&set, "pg", "SELECT count(*)::int FROM big").await["rows"],
        json!([[5000]])
    );
    // The server has only `hostssl` lines: it would have refused a plaintext login.
    let mut plain = DatabaseConfig::new(
        "plain",
        format!(
            "postgres://airlock_ro@localhost:{}/airlock_test",
            tls.server.port
        ),
    );
    plain.password_file = Some(tls.server.dir.join("ro.pw"));
    let set = tools(vec![plain]).unwrap();
    let e = err(
        &set,
        "query_database",
        json!({"database": "plain", "sql": "SELECT 1"}),
    )
    .await;
    assert!(e.contains("no encryption"), "{e}");
}

/// The 4 MiB bound on one server message holds over TLS: the bounded reader sits on the
/// decrypted stream, and a huge row closes the connection at its header.
#[tokio::test]
async fn results_are_capped_over_tls() {
    let tls = tokio::task::spawn_blocking(tls_pg).await.unwrap();
    let set = tools(vec![tls_db("pg", "localhost", tls.server.port, &tls.ca)]).unwrap();
    postgres_results_are_capped(&set).await;
}

#[tokio::test]
async fn a_host_the_certificate_does_not_name_is_refused() {
    let tls = tokio::task::spawn_blocking(tls_pg).await.unwrap();
    let set = tools(vec![tls_db("pg", "127.0.0.1", tls.server.port, &tls.ca)]).unwrap();
    let e = err(
        &set,
        "query_database",
        json!({"database": "pg", "sql": "SELECT 1"}),
    )
    .await;
    assert!(e.contains("certificate verification failed"), "{e}");
    assert!(e.contains("not valid for name \"127.0.0.1\""), "{e}");
    assert!(e.contains(&tls.ca.display().to_string()), "{e}");
}

#[tokio::test]
async fn a_server_without_tls_is_refused() {
    let tls = tokio::task::spawn_blocking(tls_pg).await.unwrap();
    // The shared server runs with ssl = off.
    let port = tokio::task::spawn_blocking(postgres::port).await.unwrap();
    let set = tools(vec![tls_db("pg", "localhost", port, &tls.ca)]).unwrap();
    let e = err(
        &set,
        "query_database",
        json!({"database": "pg", "sql": "SELECT 1"}),
    )
    .await;
    assert!(e.contains("server does not support TLS"), "{e}");
}

#[test]
fn bad_sslrootcert_files_stop_the_start_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing-ca.crt");
    let garbage = dir.path().join("garbage-ca.crt");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    for file in [&missing, &garbage] {
        let db = DatabaseConfig::new(
            "pg",
            format!(
                "postgres://u@localhost:1/db?sslmode=verify-full&sslrootcert={}",
                file.display()
            ),
        );
        let e = match tools(vec![db]) {
            Ok(_) => panic!("{} accepted", file.display()),
            Err(e) => e,
        };
        assert!(matches!(e, DbError::PostgresTls { .. }), "{e:?}");
        assert!(e.to_string().contains(&file.display().to_string()), "{e}");
    }
    let db = DatabaseConfig::new("pg", "postgres://u@localhost:1/db?sslmode=require");
    let e = tools(vec![db]).err().unwrap().to_string();
    assert!(e.contains("sslmode=require is not supported"), "{e}");
}
