//! PostgreSQL over TLS (DESIGN §9): the store's `[orchestrator] store` url and each
//! `[[databases]]` url take libpq's `sslmode=verify-full` and `sslrootcert=<CA file>`.
//!
//! [`parse`] reads a `postgres://` url, takes out what tokio-postgres cannot parse
//! (`sslrootcert`, the `verify-*` modes) and gives a [`tokio_postgres::Config`] and a
//! [`PgTls`]:
//!
//! - `sslmode` absent or `disable`: plaintext, as before (`PgTls::Plaintext`).
//! - `sslmode=verify-full`: TLS is required (no fallback to plaintext when the server
//!   answers that it has no TLS); the server's certificate must chain to the CA in
//!   `sslrootcert` (the only trust anchor: no system roots) and carry the url's host as
//!   a DNS or IP SAN.
//! - `verify-ca`, `require`, `prefer`, `allow` are refused, naming `verify-full`: each
//!   accepts a server that is not the one the url names (`verify-ca` any holder of a
//!   certificate from the CA; `require`/`prefer`/`allow` anyone, or plaintext).
//! - `sslrootcert` without `sslmode=verify-full` is refused rather than guessed.
//! - Client certificates (`sslcert`, `sslkey`) are refused: not supported yet.
//!
//! TLS over a Unix socket is refused (PostgreSQL serves no TLS there). Channel binding is
//! not offered (SCRAM without `-PLUS`).

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::{Host, SslMode};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};

use crate::files::{self, TlsFileError};

/// Why a PostgreSQL url cannot be used, or a TLS handshake failed. Never holds a
/// password.
#[derive(Debug, thiserror::Error)]
pub enum PgTlsError {
    #[error("{0}")]
    Url(String),
    #[error(
        "sslmode={mode} is not supported: {why}; use sslmode=verify-full&sslrootcert=<CA file> for TLS (or sslmode=disable for plaintext)"
    )]
    UnsupportedMode { mode: String, why: &'static str },
    #[error(
        "sslmode=verify-full needs sslrootcert=<path of the CA certificate that signs the server's certificate>"
    )]
    MissingRootCert,
    #[error(
        "sslrootcert is given but sslmode is not verify-full; add sslmode=verify-full to use TLS"
    )]
    RootCertWithoutVerify,
    #[error(
        "{key} is not supported (client certificates for PostgreSQL are not implemented); authenticate with a password"
    )]
    ClientCertificate { key: String },
    #[error(
        "sslmode=verify-full needs a TCP host; PostgreSQL serves no TLS on a Unix socket ({})",
        dir.display()
    )]
    UnixSocket { dir: PathBuf },
    #[error("sslrootcert: {0}")]
    RootCert(#[from] TlsFileError),
    #[error("cannot set up TLS: {0}")]
    Config(String),
    #[error("sslmode=verify-full: {host:?} is not a host name or IP address to verify")]
    BadHostName { host: String },
    #[error(
        "certificate verification failed for the PostgreSQL server {host}: {message} (sslmode=verify-full, sslrootcert={})",
        rootcert.display()
    )]
    Verification {
        host: String,
        rootcert: PathBuf,
        message: String,
    },
    #[error("TLS handshake with the PostgreSQL server {host} failed: {message}")]
    Handshake { host: String, message: String },
}

/// A url's TLS mode, with its connector.
#[derive(Clone)]
pub enum PgTls {
    Plaintext,
    VerifyFull(RustlsConnect),
}

impl std::fmt::Debug for PgTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PgTls::Plaintext => f.write_str("Plaintext"),
            PgTls::VerifyFull(c) => f
                .debug_struct("VerifyFull")
                .field("sslrootcert", &c.rootcert)
                .finish(),
        }
    }
}

/// A parsed url: what tokio-postgres connects with, and how.
#[derive(Debug, Clone)]
pub struct PgUrl {
    pub config: tokio_postgres::Config,
    pub tls: PgTls,
}

/// An error and its causes, `a: b: c` (tokio-postgres hides the cause of a failed
/// connection, a certificate problem say, behind "error performing TLS handshake").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// The `sslrootcert` a url names, if any: a component that confines itself keeps its
/// directory readable, since the file is read when connections are made.
pub fn root_cert(url: &str) -> Option<PathBuf> {
    split_tls_params(url)
        .ok()
        .and_then(|(_, _, rootcert)| rootcert)
        .map(PathBuf::from)
}

/// Reads a libpq-style url (see the module docs). Urls that are not `postgres://` or
/// `postgresql://` go to tokio-postgres unchanged (plaintext unless it says otherwise).
pub fn parse(url: &str) -> Result<PgUrl, PgTlsError> {
    let (rest, mode, rootcert) = split_tls_params(url)?;
    let mut config: tokio_postgres::Config = rest
        .parse()
        .map_err(|e: tokio_postgres::Error| PgTlsError::Url(e.to_string()))?;
    let tls = match (mode.as_deref(), rootcert) {
        (None | Some("disable"), None) => {
            // tokio-postgres' default is `prefer`; with no connector it is plaintext,
            // stated here so that it stays so.
            config.ssl_mode(SslMode::Disable);
            PgTls::Plaintext
        }
        (None | Some("disable"), Some(_)) => return Err(PgTlsError::RootCertWithoutVerify),
        (Some("verify-full"), None) => return Err(PgTlsError::MissingRootCert),
        (Some("verify-full"), Some(path)) => {
            if let Some(Host::Unix(dir)) = config
                .get_hosts()
                .iter()
                .find(|h| matches!(h, Host::Unix(_)))
            {
                return Err(PgTlsError::UnixSocket { dir: dir.clone() });
            }
            config.ssl_mode(SslMode::Require);
            PgTls::VerifyFull(RustlsConnect::new(Path::new(&path))?)
        }
        (Some(other), _) => {
            let why = match other {
                "verify-ca" => {
                    "it accepts any server holding a certificate from the CA, whatever its name; put the server's host name in its certificate (airlock certs init --san)"
                }
                "require" | "prefer" | "allow" => {
                    "it does not verify the server's certificate (and prefer/allow fall back to plaintext)"
                }
                _ => "unknown sslmode",
            };
            return Err(PgTlsError::UnsupportedMode {
                mode: other.to_owned(),
                why,
            });
        }
    };
    Ok(PgUrl { config, tls })
}

/// The url without `sslmode` and `sslrootcert`, and their (percent-decoded) values.
type Split = (String, Option<String>, Option<String>);

fn split_tls_params(url: &str) -> Result<Split, PgTlsError> {
    let is_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
    let Some((base, query)) = url.split_once('?').filter(|_| is_url) else {
        return Ok((url.to_owned(), None, None));
    };
    let (mut mode, mut rootcert) = (None, None);
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match decode(key)?.as_str() {
            "sslmode" => mode = Some(decode(value)?),
            "sslrootcert" => rootcert = Some(decode(value)?),
            key @ ("sslcert" | "sslkey" | "sslpassword") => {
                return Err(PgTlsError::ClientCertificate {
                    key: key.to_owned(),
                });
            }
            _ => kept.push(pair),
        }
    }
    let rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((rest, mode, rootcert))
}

/// `%XX` decoding (and `+` kept as is, as libpq does).
fn decode(text: &str) -> Result<String, PgTlsError> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| PgTlsError::Url(format!("invalid percent-encoding in {text:?}")))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| PgTlsError::Url(format!("{text:?} is not UTF-8")))
}

/// rustls for tokio-postgres: the roots of one `sslrootcert` file, the server's name
/// verified against the url's host.
#[derive(Clone)]
pub struct RustlsConnect {
    config: Arc<ClientConfig>,
    rootcert: PathBuf,
}

impl RustlsConnect {
    /// Loads `rootcert` (errors name the file).
    pub fn new(rootcert: &Path) -> Result<Self, PgTlsError> {
        let roots = files::roots(rootcert)?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| PgTlsError::Config(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        // What libpq 17 sends; required by servers that take direct TLS connections.
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        Ok(Self {
            config: Arc::new(config),
            rootcert: rootcert.to_owned(),
        })
    }

    /// The `sslrootcert` file.
    pub fn rootcert(&self) -> &Path {
        &self.rootcert
    }

    /// The connector for one server, `host` being the url's host (the name verified).
    pub fn for_host(&self, host: &str) -> Result<RustlsTlsConnect, PgTlsError> {
        // tokio-postgres keeps `[::1]` as `::1`; both forms are accepted.
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(bare.to_owned()).map_err(|_| PgTlsError::BadHostName {
            host: host.to_owned(),
        })?;
        Ok(RustlsTlsConnect {
            config: Arc::clone(&self.config),
            rootcert: self.rootcert.clone(),
            name,
        })
    }
}

impl<S> MakeTlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsTlsConnect;
    type Error = PgTlsError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsTlsConnect, PgTlsError> {
        self.for_host(domain)
    }
}

/// The connector for one server.
#[derive(Clone)]
pub struct RustlsTlsConnect {
    config: Arc<ClientConfig>,
    rootcert: PathBuf,
    name: ServerName<'static>,
}

/// The handshake in progress.
pub type Handshake<S> = Pin<Box<dyn Future<Output = Result<RustlsStream<S>, PgTlsError>> + Send>>;

impl<S> TlsConnect<S> for RustlsTlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = PgTlsError;
    type Future = Handshake<S>;

    fn connect(self, stream: S) -> Handshake<S> {
        Box::pin(async move {
            let host = self.name.to_str().into_owned();
            tokio_rustls::TlsConnector::from(self.config)
                .connect(self.name, stream)
                .await
                .map(RustlsStream)
                .map_err(|e| handshake_error(e, host, self.rootcert))
        })
    }
}

fn handshake_error(e: io::Error, host: String, rootcert: PathBuf) -> PgTlsError {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(tls @ rustls::Error::InvalidCertificate(_)) => PgTlsError::Verification {
            host,
            rootcert,
            message: tls.to_string(),
        },
        Some(tls) => PgTlsError::Handshake {
            host,
            message: tls.to_string(),
        },
        None => PgTlsError::Handshake {
            host,
            message: e.to_string(),
        },
    }
}

/// A TLS connection to a PostgreSQL server.
pub struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for RustlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(url: &str) -> String {
        match parse(url) {
            Ok(parsed) => panic!("{url} parsed: {parsed:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn plaintext_stays_plaintext() {
        for url in [
            "postgres://u@db.example:5432/app",
            "postgres://u@db.example/app?sslmode=disable&application_name=x",
        ] {
            let parsed = parse(url).unwrap();
            assert!(matches!(parsed.tls, PgTls::Plaintext), "{url}");
            assert_eq!(parsed.config.get_ssl_mode(), SslMode::Disable);
        }
        let parsed = parse("postgres://u@h/app?application_name=x&sslmode=disable").unwrap();
        assert_eq!(parsed.config.get_application_name(), Some("x"));
    }

    #[test]
    fn verify_full_loads_the_root_and_keeps_other_options() {
        let dir = tempfile::tempdir().unwrap();
        crate::devpki::init(dir.path(), &[]).unwrap();
        let ca = dir.path().join("ca.crt");
        let encoded = ca.display().to_string().replace('/', "%2F");
        let url = format!(
            "postgresql://u@db.example:6432/app?connect_timeout=3&sslmode=verify-full&sslrootcert={encoded}"
        );
        let parsed = parse(&url).unwrap();
        assert_eq!(parsed.config.get_ssl_mode(), SslMode::Require);
        assert_eq!(
            parsed.config.get_connect_timeout(),
            Some(&std::time::Duration::from_secs(3))
        );
        match parsed.tls {
            PgTls::VerifyFull(c) => assert_eq!(c.rootcert(), ca),
            PgTls::Plaintext => panic!("plaintext"),
        }
    }

    #[test]
    fn weak_modes_and_missing_pieces_are_refused() {
        for mode in ["require", "prefer", "allow", "verify-ca", "bogus"] {
            let e = err(&format!("postgres://u@h/db?sslmode={mode}"));
            assert!(
                e.contains(&format!("sslmode={mode} is not supported"))
                    && e.contains("verify-full"),
                "{e}"
            );
        }
        assert!(err("postgres://u@h/db?sslmode=verify-full").contains("needs sslrootcert"));
        assert!(err("postgres://u@h/db?sslrootcert=/x").contains("not verify-full"));
        assert!(
            err("postgres://u@h/db?sslmode=verify-full&sslrootcert=/x&sslcert=/c")
                .contains("sslcert")
        );
        let e = err("postgres://u@%2Ftmp/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.crt");
        assert!(e.contains("Unix socket"), "{e}");
    }

    #[test]
    fn bad_root_files_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.crt");
        let garbage = dir.path().join("garbage.crt");
        std::fs::write(&garbage, "not a certificate\n").unwrap();
        for path in [&missing, &garbage] {
            let e = err(&format!(
                "postgres://u@h/db?sslmode=verify-full&sslrootcert={}",
                path.display()
            ));
            assert!(e.contains(&path.display().to_string()), "{e}");
        }
    }
}
