//! The PostgreSQL store over TLS (`sslmode=verify-full&sslrootcert=`), against a
//! TLS-only server of this module's own (tests/support/postgres.rs `start_tls`: `ssl =
//! on`, `hostssl` lines only) whose certificate is the orchestrator's from
//! `airlock certs init --san localhost` (DNS SANs `orchestrator` and `localhost`, no IP).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use airlock_orchestrator::audit::AuditKind;
use airlock_orchestrator::store::{self, NewAuditEvent, StoreError};
use serde_json::json;

use super::pg;

struct TlsPg {
    server: pg::Server,
    /// The CA of the server's certificate.
    ca: PathBuf,
    /// Another development CA, which did not sign it.
    other_ca: PathBuf,
}

static TLS_PG: OnceLock<TlsPg> = OnceLock::new();

/// `airlock certs init --san localhost` into a temp dir; the files are copied into the
/// server's directory (removed with it at exit).
fn start() -> TlsPg {
    let certs = tempfile::tempdir().unwrap();
    airlock_tls::devpki::init(certs.path(), &["localhost".to_owned()]).unwrap();
    let server = pg::start_tls(
        &certs.path().join("orchestrator.crt"),
        &certs.path().join("orchestrator.key"),
    )
    .unwrap_or_else(|e| panic!("cannot start the TLS test PostgreSQL: {e}"));
    let ca = server.dir.join("ca.crt");
    std::fs::copy(certs.path().join("ca.crt"), &ca).unwrap();
    let other = tempfile::tempdir().unwrap();
    airlock_tls::devpki::init(other.path(), &["localhost".to_owned()]).unwrap();
    let other_ca = server.dir.join("other-ca.crt");
    std::fs::copy(other.path().join("ca.crt"), &other_ca).unwrap();
    TlsPg {
        server,
        ca,
        other_ca,
    }
}

async fn tls_pg() -> &'static TlsPg {
    tokio::task::spawn_blocking(|| TLS_PG.get_or_init(start))
        .await
        .unwrap()
}

/// A fresh database on the TLS server.
async fn database(server: &'static pg::Server) -> String {
    tokio::task::spawn_blocking(move || {
        let name = pg::unique_name("airlock_tls");
        server
            .sql("postgres", &format!("CREATE DATABASE {name};"))
            .unwrap();
        name
    })
    .await
    .unwrap()
}

fn verify_full(host: &str, port: u16, db: &str, rootcert: &Path) -> String {
    format!(
        "postgres://{}@{host}:{port}/{db}?sslmode=verify-full&sslrootcert={}",
        pg::SUPERUSER,
        rootcert.display()
    )
}

async fn open_err(url: &str) -> String {
    match store::open(url, Path::new("/nonexistent"), None).await {
        Ok(_) => panic!("{url} opened"),
        Err(e) => {
            let text = e.to_string();
            if text.contains("TLS handshake") {
                assert!(matches!(e, StoreError::TlsHandshake { .. }), "{e:?}");
            }
            text
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_works_over_verify_full_and_the_server_refuses_plaintext() {
    let tls = tls_pg().await;
    let db = database(&tls.server).await;
    let url = verify_full("localhost", tls.server.port, &db, &tls.ca);
    let store = store::open(&url, Path::new("/nonexistent"), None)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", tls.server.log()));
    for i in 0..3 {
        store
            .append(NewAuditEvent::new(AuditKind::Requested, json!({"i": i})))
            .await
            .unwrap();
    }
    let report = store.verify().await.unwrap();
    assert!(report.ok && report.records == 3, "{report:?}");

    // The store's pooled connections are TLS ones.
    let sql = format!(
        "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE s.ssl AND a.datname = '{db}' AND a.application_name = 'airlock-orchestrator';"
    );
    let server = &tls.server;
    let count = tokio::task::spawn_blocking(move || server.sql("postgres", &sql).unwrap())
        .await
        .unwrap();
    assert!(count.trim().parse::<u32>().unwrap() >= 1, "{count}");

    // The same url without TLS is refused by the server itself: success above was TLS.
    let plain = format!(
        "postgres://{}@localhost:{}/{db}",
        pg::SUPERUSER,
        tls.server.port
    );
    let e = open_err(&plain).await;
    assert!(e.contains("no encryption"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_ca_fails_certificate_verification_naming_the_file() {
    let tls = tls_pg().await;
    let e = open_err(&verify_full(
        "localhost",
        tls.server.port,
        "postgres",
        &tls.other_ca,
    ))
    .await;
    // Both development CAs have the same subject: the signature does not verify.
    assert!(e.contains("certificate verification failed"), "{e}");
    assert!(e.contains("invalid peer certificate"), "{e}");
    assert!(e.contains(&tls.other_ca.display().to_string()), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_the_certificate_does_not_name_fails_verify_full() {
    let tls = tls_pg().await;
    // Same server, same CA: only the name differs (the certificate has no IP SAN).
    let e = open_err(&verify_full(
        "127.0.0.1",
        tls.server.port,
        "postgres",
        &tls.ca,
    ))
    .await;
    assert!(e.contains("certificate verification failed"), "{e}");
    assert!(e.contains("not valid for name \"127.0.0.1\""), "{e}");
    assert!(e.contains(&tls.ca.display().to_string()), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_sslrootcert_files_fail_naming_the_file() {
    let tls = tls_pg().await;
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing-ca.crt");
    // A directory cannot be read as a file, even by root.
    let unreadable = dir.path().join("a-directory.crt");
    std::fs::create_dir(&unreadable).unwrap();
    let garbage = dir.path().join("garbage-ca.crt");
    std::fs::write(
        &garbage,
        "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let empty = dir.path().join("empty-ca.crt");
    std::fs::write(&empty, "no pem here\n").unwrap();
    for (file, says) in [
        (&missing, "cannot read"),
        (&unreadable, "cannot read"),
        (&garbage, "not a valid PEM certificate"),
        (&empty, "not a usable trust anchor"),
    ] {
        let url = verify_full("localhost", tls.server.port, "postgres", file);
        let err = match store::open(&url, Path::new("/nonexistent"), None).await {
            Ok(_) => panic!("{url} opened"),
            Err(e) => e,
        };
        assert!(matches!(err, StoreError::Tls(_)), "{err:?}");
        let e = err.to_string();
        assert!(
            e.contains(&file.display().to_string()) && e.contains(says),
            "{e}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_against_a_server_without_tls_fails() {
    let tls = tls_pg().await;
    // The shared server runs with ssl = off (and would take plaintext).
    let port = super::cluster_port().await;
    let e = open_err(&verify_full("localhost", port, "postgres", &tls.ca)).await;
    assert!(e.contains("server does not support TLS"), "{e}");
}

#[tokio::test]
async fn weak_sslmodes_are_refused_before_connecting() {
    for mode in ["require", "prefer", "verify-ca"] {
        // Port 1: nothing listens; the refusal comes before any connection.
        let e = open_err(&format!("postgres://u@localhost:1/db?sslmode={mode}")).await;
        assert!(
            e.contains(&format!("sslmode={mode} is not supported")),
            "{e}"
        );
        assert!(e.contains("verify-full"), "{e}");
    }
    let e = open_err("postgres://u@localhost:1/db?sslmode=verify-full").await;
    assert!(e.contains("needs sslrootcert"), "{e}");
}
