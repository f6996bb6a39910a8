//! Reading the `[tls]` files (DESIGN §9) and checking them before anything listens: a
//! certificate chain, its private key and the trust anchor for peers. Each failure names
//! the file and what is wrong with it; none falls back to plaintext.

use std::path::{Path, PathBuf};

use rustls::RootCertStore;
use rustls::crypto::ring::default_provider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::sign::CertifiedKey;

#[derive(Debug, thiserror::Error)]
pub enum TlsFileError {
    #[error("cannot read {}: {source}", path.display())]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} holds no PEM certificate (a `-----BEGIN CERTIFICATE-----` block)", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{} is not a valid PEM certificate file: {message}", path.display())]
    BadCertificate { path: PathBuf, message: String },
    #[error("{} holds no PEM private key (PKCS#8, PKCS#1 or SEC1): {message}", path.display())]
    BadKey { path: PathBuf, message: String },
    #[error("the key in {} does not belong to the certificate in {}: {message}", key.display(), cert.display())]
    KeyMismatch {
        cert: PathBuf,
        key: PathBuf,
        message: String,
    },
    #[error("{} is not a usable trust anchor: {message}", path.display())]
    BadCa { path: PathBuf, message: String },
    #[error("the certificate in {} is not signed by the CA in {} (or is expired): {message}", cert.display(), ca.display())]
    NotSignedByCa {
        cert: PathBuf,
        ca: PathBuf,
        message: String,
    },
}

/// The three files of a `[tls]` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub ca_file: PathBuf,
}

/// What the files hold, checked: the key matches the certificate, and the certificate
/// chains to the CA (so a component never starts with an identity its peers refuse).
#[derive(Debug)]
pub struct Identity {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    pub roots: RootCertStore,
}

impl TlsFiles {
    pub fn load(&self) -> Result<Identity, TlsFileError> {
        let chain = certificates(&self.cert_file)?;
        let key = private_key(&self.key_file)?;
        let roots = roots(&self.ca_file)?;
        let provider = default_provider();
        let certified =
            CertifiedKey::from_der(chain.clone(), key.clone_key(), &provider).map_err(|e| {
                TlsFileError::KeyMismatch {
                    cert: self.cert_file.clone(),
                    key: self.key_file.clone(),
                    message: e.to_string(),
                }
            })?;
        certified
            .keys_match()
            .map_err(|e| TlsFileError::KeyMismatch {
                cert: self.cert_file.clone(),
                key: self.key_file.clone(),
                message: e.to_string(),
            })?;
        chains_to(&chain, &roots).map_err(|message| TlsFileError::NotSignedByCa {
            cert: self.cert_file.clone(),
            ca: self.ca_file.clone(),
            message,
        })?;
        Ok(Identity { chain, key, roots })
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsFileError> {
    std::fs::read(path).map_err(|source| TlsFileError::Unreadable {
        path: path.to_owned(),
        source,
    })
}

/// Every certificate of a PEM file, in order (the end entity first).
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    let bytes = read(path)?;
    let chain = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsFileError::BadCertificate {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
    if chain.is_empty() {
        return Err(TlsFileError::NoCertificate {
            path: path.to_owned(),
        });
    }
    // Each must parse as X.509, not only as PEM.
    for cert in &chain {
        webpki::EndEntityCert::try_from(cert).map_err(|e| TlsFileError::BadCertificate {
            path: path.to_owned(),
            message: format!("{e:?}"),
        })?;
    }
    Ok(chain)
}

pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsFileError> {
    let bytes = read(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsFileError::BadKey {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

/// The CA file as a root store: every certificate in it must be usable as an anchor.
pub fn roots(path: &Path) -> Result<RootCertStore, TlsFileError> {
    let anchors = certificates(path).map_err(|e| match e {
        TlsFileError::NoCertificate { path } => TlsFileError::BadCa {
            path,
            message: "it holds no certificate".to_owned(),
        },
        other => other,
    })?;
    let mut roots = RootCertStore::empty();
    for anchor in anchors {
        roots.add(anchor).map_err(|e| TlsFileError::BadCa {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
    }
    Ok(roots)
}

/// Whether `chain` verifies against `roots` now, for a client or a server (the
/// components' certificates serve as both).
fn chains_to(chain: &[CertificateDer<'static>], roots: &RootCertStore) -> Result<(), String> {
    let Some((end, intermediates)) = chain.split_first() else {
        return Err("no certificate".to_owned());
    };
    let cert = webpki::EndEntityCert::try_from(end).map_err(|e| format!("{e:?}"))?;
    let algorithms = default_provider().signature_verification_algorithms;
    let now = UnixTime::now();
    let for_usage = |usage| {
        cert.verify_for_usage(
            algorithms.all,
            &roots.roots,
            intermediates,
            now,
            usage,
            None,
            None,
        )
        .map(|_| ())
        .map_err(|e| format!("{e:?}"))
    };
    for_usage(webpki::KeyUsage::server_auth())
        .or_else(|_| for_usage(webpki::KeyUsage::client_auth()))
}
