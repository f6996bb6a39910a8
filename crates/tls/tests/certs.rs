//! `airlock certs init` output, and the start-up checks of `[tls]` files against it.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use airlock_tls::devpki::{self, COMPONENTS};
use airlock_tls::{TlsFileError, TlsFiles};
use rustls::pki_types::ServerName;

fn files(dir: &Path, component: &str) -> TlsFiles {
    TlsFiles {
        cert_file: dir.join(format!("{component}.crt")),
        key_file: dir.join(format!("{component}.key")),
        ca_file: dir.join("ca.crt"),
    }
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// Whether the component's certificate is valid for `name` (what a peer checks).
fn valid_for(dir: &Path, component: &str, name: &str) -> bool {
    let identity = files(dir, component).load().unwrap();
    let cert = webpki::EndEntityCert::try_from(&identity.chain[0]).unwrap();
    let name = ServerName::try_from(name.to_owned()).unwrap();
    cert.verify_is_valid_for_subject_name(&name).is_ok()
}

#[test]
fn init_writes_a_ca_and_a_certificate_per_component_that_load_and_chain() {
    let scratch = tempfile::tempdir().unwrap();
    let out = scratch.path().join("pki");
    let written = devpki::init(
        &out,
        &[
            "airlock.test".into(),
            "127.0.0.1".into(),
            "worker-http=http-1.test".into(),
        ],
    )
    .unwrap();
    assert_eq!(written.files.len(), 2 + 2 * COMPONENTS.len());
    assert_eq!(mode(&out), 0o700);
    assert_eq!(mode(&out.join("ca.key")), 0o600);
    assert_eq!(mode(&out.join("ca.crt")), 0o644);
    for component in COMPONENTS {
        assert_eq!(
            mode(&out.join(format!("{component}.key"))),
            0o600,
            "{component}"
        );
        let identity = files(&out, component).load().unwrap();
        assert_eq!(identity.chain.len(), 1);
        // Its own name and the extra SANs meant for it (plain ones: the orchestrator's),
        // and no other component's name nor extra SAN.
        assert!(valid_for(&out, component, component));
        let orchestrator = component == "orchestrator";
        assert_eq!(valid_for(&out, component, "airlock.test"), orchestrator);
        assert_eq!(valid_for(&out, component, "127.0.0.1"), orchestrator);
        assert_eq!(
            valid_for(&out, component, "http-1.test"),
            component == "worker-http"
        );
        for other in COMPONENTS.iter().filter(|c| **c != component) {
            assert!(
                !valid_for(&out, component, other),
                "{component} is not {other}"
            );
        }
    }
}

#[test]
fn init_never_overwrites_and_refuses_a_bad_san_before_writing() {
    let scratch = tempfile::tempdir().unwrap();
    let out = scratch.path().join("pki");
    devpki::init(&out, &[]).unwrap();
    let before = std::fs::read(out.join("ca.key")).unwrap();
    match devpki::init(&out, &[]) {
        Err(devpki::DevPkiError::Exists { path }) => assert_eq!(path, out.join("ca.crt")),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(
        std::fs::read(out.join("ca.key")).unwrap(),
        before,
        "the old key stays"
    );
    // One stray file is enough to refuse.
    let partial = scratch.path().join("partial");
    std::fs::create_dir(&partial).unwrap();
    std::fs::write(partial.join("worker-db.key"), "mine").unwrap();
    let error = devpki::init(&partial, &[]).unwrap_err().to_string();
    assert!(
        error.contains("worker-db.key") && error.contains("never overwrites"),
        "{error}"
    );
    assert_eq!(
        std::fs::read_dir(&partial).unwrap().count(),
        1,
        "nothing written"
    );
    // A name that is neither DNS nor IP.
    let bad = scratch.path().join("bad");
    let error = devpki::init(&bad, &["not a name!".into()])
        .unwrap_err()
        .to_string();
    assert!(error.contains("--san \"not a name!\""), "{error}");
    assert!(!bad.exists(), "nothing written");
    // A directory others may write to (or that is not a directory).
    let open = scratch.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let error = devpki::init(&open, &[]).unwrap_err().to_string();
    assert!(
        error.contains("others may write to it (mode 777)"),
        "{error}"
    );
    assert_eq!(
        std::fs::read_dir(&open).unwrap().count(),
        0,
        "nothing written"
    );
    let target = scratch.path().join("target");
    std::fs::create_dir(&target).unwrap();
    let link = scratch.path().join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let error = devpki::init(&link, &[]).unwrap_err().to_string();
    assert!(error.contains("not a directory"), "{error}");
    assert_eq!(
        std::fs::read_dir(&target).unwrap().count(),
        0,
        "nothing written"
    );
    // A scope that names no component.
    let error = devpki::init(&bad, &["worker-sql=db.internal".into()])
        .unwrap_err()
        .to_string();
    assert!(error.contains("names no component"), "{error}");
    assert!(!bad.exists(), "nothing written");
}

#[test]
fn bad_tls_files_are_refused_naming_the_file_and_the_problem() {
    let scratch = tempfile::tempdir().unwrap();
    let pki = scratch.path().join("pki");
    let other = scratch.path().join("other");
    devpki::init(&pki, &[]).unwrap();
    devpki::init(&other, &[]).unwrap();
    let junk = scratch.path().join("junk.pem");
    std::fs::write(&junk, "hello\n").unwrap();
    let not_x509 = scratch.path().join("not-x509.pem");
    std::fs::write(
        &not_x509,
        "-----BEGIN CERTIFICATE-----\naGVsbG8gd29ybGQ=\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let good = files(&pki, "worker-fs");
    type Case<'a> = (&'a str, TlsFiles, fn(&TlsFileError) -> bool, &'a Path);
    let cases: Vec<Case<'_>> = vec![
        (
            "missing cert",
            TlsFiles {
                cert_file: scratch.path().join("absent.crt"),
                ..good.clone()
            },
            |e| matches!(e, TlsFileError::Unreadable { .. }),
            Path::new("absent.crt"),
        ),
        (
            "no PEM certificate",
            TlsFiles {
                cert_file: junk.clone(),
                ..good.clone()
            },
            |e| matches!(e, TlsFileError::NoCertificate { .. }),
            Path::new("junk.pem"),
        ),
        (
            "PEM that is not X.509",
            TlsFiles {
                cert_file: not_x509.clone(),
                ..good.clone()
            },
            |e| matches!(e, TlsFileError::BadCertificate { .. }),
            Path::new("not-x509.pem"),
        ),
        (
            "no key",
            TlsFiles {
                key_file: junk.clone(),
                ..good.clone()
            },
            |e| matches!(e, TlsFileError::BadKey { .. }),
            Path::new("junk.pem"),
        ),
        (
            "another component's key",
            TlsFiles {
                key_file: pki.join("worker-shell.key"),
                ..good.clone()
            },
            |e| matches!(e, TlsFileError::KeyMismatch { .. }),
            Path::new("worker-shell.key"),
        ),
        (
            "an empty CA",
            TlsFiles {
                ca_file: junk.clone(),
                ..good.clone()
            },
            |e| matches!(e, TlsFileError::BadCa { .. }),
            Path::new("junk.pem"),
        ),
        (
            "a CA that did not sign it",
            TlsFiles {
                ca_file: other.join("ca.crt"),
                ..good.clone()
            },
            |e| matches!(e, TlsFileError::NotSignedByCa { .. }),
            Path::new("other/ca.crt"),
        ),
    ];
    for (what, tls, expected, named) in cases {
        let error = tls.load().expect_err(what);
        assert!(expected(&error), "{what}: {error:?}");
        let message = error.to_string();
        assert!(
            message.contains(&named.display().to_string()),
            "{what}: the message names {}: {message}",
            named.display()
        );
    }
    good.load().expect("the matching files load");
}
