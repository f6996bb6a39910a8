//! `airlock certs init`: a development certificate authority and one certificate per
//! component (DESIGN §9), for compose files, tests and labs. Production issues its
//! certificates elsewhere (cert-manager); these are made to be thrown away.
//!
//! Every certificate carries its component's name as a DNS SAN (what `allowed_peers` and
//! the orchestrator's server-name check match) and may act as client and as server: the
//! orchestrator is a client of the workers and a server to callers, and a worker could
//! be reached either way in a lab. A `--san NAME` goes on the orchestrator's certificate
//! alone (the one callers of the gRPC front door, or a database it serves as, verify);
//! `--san COMPONENT=NAME` on that component's alone. A name is an identity: were one name
//! on every certificate, any component's key would pass for the orchestrator (or a
//! worker) under that name.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use chrono::Datelike as _;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType,
};

/// The components that get a certificate, by the names DESIGN §9 gives their files.
pub const COMPONENTS: [&str; 5] = [
    "orchestrator",
    "worker-shell",
    "worker-fs",
    "worker-http",
    "worker-db",
];

/// How long the development CA is valid, in years.
const CA_YEARS: i32 = 5;
/// How long each component's certificate is valid, in years.
const LEAF_YEARS: i32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum DevPkiError {
    #[error(
        "{} already exists; `airlock certs init` never overwrites keys: choose an empty --out directory or remove the old files",
        path.display()
    )]
    Exists { path: PathBuf },
    #[error("cannot create {}: {source}", path.display())]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{} is not a safe place for keys: {why}; choose a directory of your own that only you may write to, or a new path",
        path.display()
    )]
    UnsafeDir { path: PathBuf, why: String },
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--san {name:?} is neither a DNS name nor an IP address: {message}")]
    BadSan { name: String, message: String },
    #[error(
        "--san {given:?} names no component; write NAME (the orchestrator's certificate) or COMPONENT=NAME with COMPONENT one of orchestrator, worker-shell, worker-fs, worker-http, worker-db"
    )]
    UnknownComponent { given: String },
    #[error("cannot make the {what}: {source}")]
    Generate {
        what: &'static str,
        source: rcgen::Error,
    },
}

/// The files `init` wrote, in the order written.
#[derive(Debug, Clone)]
pub struct Written {
    pub files: Vec<PathBuf>,
}

/// Writes `ca.crt`, `ca.key` and `<component>.crt`/`.key` for every [`COMPONENTS`] into
/// `out` (created, mode 0700, if missing). Keys are mode 0600 from their creation.
/// Refuses, before writing anything, when any of the files already exists.
pub fn init(out: &Path, extra_sans: &[String]) -> Result<Written, DevPkiError> {
    let mut names = vec!["ca".to_owned()];
    names.extend(COMPONENTS.iter().map(|c| (*c).to_owned()));
    for name in &names {
        for ext in ["crt", "key"] {
            let path = out.join(format!("{name}.{ext}"));
            if path.exists() {
                return Err(DevPkiError::Exists { path });
            }
        }
    }
    let extra = scoped_sans(extra_sans)?;
    create_dir(out)?;
    let (year, month, day) = today();

    let ca_key = KeyPair::generate().map_err(generate("CA key"))?;
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name = name("Airlock development CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca_params.not_before = rcgen::date_time_ymd(year, month, day);
    ca_params.not_after = rcgen::date_time_ymd(year + CA_YEARS, month, day);
    let ca = CertifiedIssuer::self_signed(ca_params, ca_key).map_err(generate("CA certificate"))?;
    let mut written = Written { files: Vec::new() };
    write(
        &mut written,
        &out.join("ca.crt"),
        ca.pem().as_bytes(),
        0o644,
    )?;
    write(
        &mut written,
        &out.join("ca.key"),
        ca.key().serialize_pem().as_bytes(),
        0o600,
    )?;

    for component in COMPONENTS {
        let key = KeyPair::generate().map_err(generate("component key"))?;
        let mut params = CertificateParams::default();
        params.distinguished_name = name(component);
        params.subject_alt_names = vec![san(component)?];
        params.subject_alt_names.extend(
            extra
                .iter()
                .filter(|(owner, _)| *owner == component)
                .map(|(_, name)| name.clone()),
        );
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        params.not_before = rcgen::date_time_ymd(year, month, day);
        params.not_after = rcgen::date_time_ymd(year + LEAF_YEARS, month, day);
        let cert = params
            .signed_by(&key, &ca)
            .map_err(generate("component certificate"))?;
        write(
            &mut written,
            &out.join(format!("{component}.crt")),
            cert.pem().as_bytes(),
            0o644,
        )?;
        write(
            &mut written,
            &out.join(format!("{component}.key")),
            key.serialize_pem().as_bytes(),
            0o600,
        )?;
    }
    Ok(written)
}

fn generate(what: &'static str) -> impl Fn(rcgen::Error) -> DevPkiError {
    move |source| DevPkiError::Generate { what, source }
}

fn name(common_name: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common_name);
    name.push(DnType::OrganizationName, "Airlock (development)");
    name
}

/// Each `--san` with the component whose certificate carries it: `COMPONENT=NAME`, or
/// `NAME` for the orchestrator's.
fn scoped_sans(given: &[String]) -> Result<Vec<(&'static str, SanType)>, DevPkiError> {
    given
        .iter()
        .map(|text| {
            let (component, name) = match text.split_once('=') {
                Some((component, name)) => {
                    let component =
                        COMPONENTS
                            .iter()
                            .find(|c| **c == component)
                            .ok_or_else(|| DevPkiError::UnknownComponent {
                                given: text.clone(),
                            })?;
                    (*component, name)
                }
                None => ("orchestrator", text.as_str()),
            };
            Ok((component, san(name)?))
        })
        .collect()
}

/// A SAN: an IP address when it parses as one, else a DNS name.
fn san(name: &str) -> Result<SanType, DevPkiError> {
    if let Ok(ip) = name.parse::<std::net::IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    // rcgen takes any ASCII; a peer's name check takes only a valid host name.
    rustls::pki_types::DnsName::try_from(name).map_err(|e| DevPkiError::BadSan {
        name: name.to_owned(),
        message: e.to_string(),
    })?;
    let dns = name
        .to_owned()
        .try_into()
        .map_err(|e: rcgen::Error| DevPkiError::BadSan {
            name: name.to_owned(),
            message: e.to_string(),
        })?;
    Ok(SanType::DnsName(dns))
}

/// Today (UTC) as year, month and day; day 28 at most, so that the same day exists in
/// every later year.
fn today() -> (i32, u8, u8) {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let today = chrono::DateTime::from_timestamp(i64::try_from(secs).unwrap_or(0), 0)
        .unwrap_or_default()
        .date_naive();
    (
        today.year(),
        u8::try_from(today.month()).unwrap_or(1),
        u8::try_from(today.day().min(28)).unwrap_or(1),
    )
}

/// Creates `out` (mode 0700) or takes an existing directory that is this user's own and
/// that no one else may write to: the owner of a directory, or anyone who may write to
/// it, can swap a `ca.crt` and a component's pair for their own after they are written,
/// and a peer that trusts that `ca.crt` trusts them.
fn create_dir(out: &Path) -> Result<(), DevPkiError> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(out)
        .map_err(|source| DevPkiError::Create {
            path: out.to_owned(),
            source,
        })?;
    let unsafe_dir = |why: String| DevPkiError::UnsafeDir {
        path: out.to_owned(),
        why,
    };
    let meta = std::fs::symlink_metadata(out).map_err(|source| DevPkiError::Create {
        path: out.to_owned(),
        source,
    })?;
    if !meta.is_dir() {
        return Err(unsafe_dir(
            "it is not a directory (a symbolic link?)".into(),
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(unsafe_dir(format!(
            "others may write to it (mode {:o})",
            meta.mode() & 0o777
        )));
    }
    // The owner of /proc/self is this process's user.
    let me = std::fs::metadata("/proc/self")
        .map_err(|e| unsafe_dir(format!("cannot tell who owns it (/proc/self: {e})")))?
        .uid();
    if meta.uid() != me {
        return Err(unsafe_dir(format!(
            "it belongs to uid {}, not to this user (uid {me})",
            meta.uid()
        )));
    }
    Ok(())
}

/// Writes a new file with `mode` from its creation (never a key readable by others,
/// even for a moment); refuses one that appeared meanwhile.
fn write(written: &mut Written, path: &Path, content: &[u8], mode: u32) -> Result<(), DevPkiError> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|source| match source.kind() {
            std::io::ErrorKind::AlreadyExists => DevPkiError::Exists {
                path: path.to_owned(),
            },
            _ => DevPkiError::Create {
                path: path.to_owned(),
                source,
            },
        })?;
    file.write_all(content)
        .and_then(|()| file.sync_all())
        .map_err(|source| DevPkiError::Write {
            path: path.to_owned(),
            source,
        })?;
    written.files.push(path.to_owned());
    Ok(())
}
