//! Mutual TLS between the orchestrator and its workers (DESIGN §9): the `[tls]` section,
//! the server side (a client certificate is required, chained to `ca_file` and carrying
//! one of `allowed_peers`), and the client side (the worker's certificate must chain to
//! `ca_file` and be valid for the endpoint's name). The same identity also serves the
//! orchestrator's gRPC front door (`[orchestrator] grpc_tls`), where callers authenticate
//! with bearer tokens and no client certificate is asked for.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ServerConfig};
use serde::Deserialize;

use crate::files::{Identity, TlsFileError, TlsFiles};

/// How long a peer may take to finish the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// `[tls]` in any component's configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// The trust anchor for peers.
    pub ca_file: Option<PathBuf>,
    /// Names one of which a peer's certificate must carry as a SAN (a worker's default:
    /// `["orchestrator"]`).
    pub allowed_peers: Vec<String>,
    /// The explicit lab switch: serve or dial plaintext TCP.
    pub insecure_plaintext: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum MtlsError {
    #[error(
        "[tls] {key} is not set; give cert_file, key_file and ca_file (airlock certs init writes a development set)"
    )]
    Missing { key: &'static str },
    #[error(transparent)]
    File(#[from] TlsFileError),
    #[error("[tls] cannot be used: {0}")]
    Config(String),
}

/// A loaded, checked identity with its trust anchor and the peers it accepts.
pub struct Mtls {
    /// Mutual TLS: a client certificate chained to `ca_file` is required (workers).
    pub server: Arc<ServerConfig>,
    /// Server authentication only: no client certificate is requested (the
    /// orchestrator's gRPC front door, whose callers present bearer tokens).
    pub front_door: Arc<ServerConfig>,
    pub client: Arc<ClientConfig>,
    pub allowed_peers: Vec<String>,
}

impl std::fmt::Debug for Mtls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The configs hold the private key: only what identifies the set-up is shown.
        f.debug_struct("Mtls")
            .field("allowed_peers", &self.allowed_peers)
            .finish_non_exhaustive()
    }
}

impl TlsConfig {
    /// The files of the section; every one is required.
    pub fn files(&self) -> Result<TlsFiles, MtlsError> {
        let need = |value: &Option<PathBuf>, key| value.clone().ok_or(MtlsError::Missing { key });
        Ok(TlsFiles {
            cert_file: need(&self.cert_file, "cert_file")?,
            key_file: need(&self.key_file, "key_file")?,
            ca_file: need(&self.ca_file, "ca_file")?,
        })
    }

    /// Whether the section names any file (a section with only `insecure_plaintext` is
    /// the lab switch).
    pub fn has_files(&self) -> bool {
        self.cert_file.is_some() || self.key_file.is_some() || self.ca_file.is_some()
    }

    /// Loads and checks the files; `default_peers` when `allowed_peers` is empty.
    pub fn mutual_tls(&self, default_peers: &[&str]) -> Result<Mtls, MtlsError> {
        let identity = self.files()?.load()?;
        let allowed_peers = if self.allowed_peers.is_empty() {
            default_peers.iter().map(|p| (*p).to_owned()).collect()
        } else {
            self.allowed_peers.clone()
        };
        Mtls::new(identity, allowed_peers)
    }
}

impl Mtls {
    pub fn new(identity: Identity, allowed_peers: Vec<String>) -> Result<Self, MtlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = Arc::new(identity.roots);
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| MtlsError::Config(e.to_string()))?;
        let server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| MtlsError::Config(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(identity.chain.clone(), identity.key.clone_key())
            .map_err(|e| MtlsError::Config(e.to_string()))?;
        let mut front_door = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| MtlsError::Config(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(identity.chain.clone(), identity.key.clone_key())
            .map_err(|e| MtlsError::Config(e.to_string()))?;
        front_door.alpn_protocols = vec![b"h2".to_vec()];
        let client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| MtlsError::Config(e.to_string()))?
            .with_root_certificates(roots)
            .with_client_auth_cert(identity.chain, identity.key)
            .map_err(|e| MtlsError::Config(e.to_string()))?;
        let mut server = server;
        server.alpn_protocols = vec![b"h2".to_vec()];
        let mut client = client;
        client.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Self {
            server: Arc::new(server),
            front_door: Arc::new(front_door),
            client: Arc::new(client),
            allowed_peers,
        })
    }

    /// The allowed name the peer's certificate carries, or why it is refused. The chain
    /// itself was verified in the handshake.
    pub fn allowed_peer(&self, peer: Option<&[CertificateDer<'_>]>) -> Result<String, String> {
        let Some(end) = peer.and_then(|chain| chain.first()) else {
            return Err("the peer sent no certificate".to_owned());
        };
        let cert = webpki::EndEntityCert::try_from(end).map_err(|e| format!("{e:?}"))?;
        for name in &self.allowed_peers {
            let Ok(server_name) = ServerName::try_from(name.clone()) else {
                continue;
            };
            if cert.verify_is_valid_for_subject_name(&server_name).is_ok() {
                return Ok(name.clone());
            }
        }
        Err(format!(
            "the peer's certificate carries none of the allowed names {:?}",
            self.allowed_peers
        ))
    }
}

/// How often the `[tls]` files are looked at for a rotation.
pub const RELOAD_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// The identity in force, re-read when its files change (rotation) without a restart.
/// A new connection takes the identity in force when it starts; connections already
/// open keep theirs, so calls in flight are unharmed. A rotated set that does not load
/// (a key written before its certificate, a CA that does not sign) leaves the last good
/// identity in force and is logged, naming the file; it is tried again at the next
/// change.
pub struct Reloading {
    config: TlsConfig,
    default_peers: Vec<String>,
    current: std::sync::RwLock<Arc<Mtls>>,
    seen: std::sync::Mutex<Fingerprint>,
}

/// Size and modification time of each file: what a rotation changes.
type Fingerprint = Vec<Option<(u64, std::time::SystemTime)>>;

impl std::fmt::Debug for Reloading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloading")
            .field("current", &self.current())
            .finish_non_exhaustive()
    }
}

impl Reloading {
    /// Loads the files now (an error here refuses the start).
    pub fn new(config: &TlsConfig, default_peers: &[&str]) -> Result<Arc<Self>, MtlsError> {
        let default_peers: Vec<String> = default_peers.iter().map(|p| (*p).to_owned()).collect();
        let peers: Vec<&str> = default_peers.iter().map(String::as_str).collect();
        let seen = fingerprint(config);
        let mtls = config.mutual_tls(&peers)?;
        Ok(Arc::new(Self {
            config: config.clone(),
            default_peers,
            current: std::sync::RwLock::new(Arc::new(mtls)),
            seen: std::sync::Mutex::new(seen),
        }))
    }

    /// The identity in force.
    pub fn current(&self) -> Arc<Mtls> {
        match self.current.read() {
            Ok(current) => current.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Re-reads the files if they changed since the last look: `Ok(true)` when a new
    /// identity is in force, `Ok(false)` when nothing changed, `Err` when the changed
    /// files do not load (the last good identity stays in force).
    pub fn reload_if_changed(&self) -> Result<bool, MtlsError> {
        let now = fingerprint(&self.config);
        {
            let mut seen = match self.seen.lock() {
                Ok(seen) => seen,
                Err(poisoned) => poisoned.into_inner(),
            };
            if *seen == now {
                return Ok(false);
            }
            *seen = now;
        }
        let peers: Vec<&str> = self.default_peers.iter().map(String::as_str).collect();
        let mtls = Arc::new(self.config.mutual_tls(&peers)?);
        match self.current.write() {
            Ok(mut current) => *current = mtls,
            Err(poisoned) => *poisoned.into_inner() = mtls,
        }
        Ok(true)
    }
}

/// Looks at the files every [`RELOAD_CHECK`] for as long as the runtime runs, and logs
/// each rotation (or why a rotated set was not taken).
pub fn watch(reloading: Arc<Reloading>, component: &'static str) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(RELOAD_CHECK).await;
            match reloading.reload_if_changed() {
                Ok(true) => tracing::info!(
                    component,
                    "[tls] files changed: the new certificate is in force for new connections"
                ),
                Ok(false) => {}
                Err(e) => tracing::error!(
                    component,
                    error = %e,
                    "[tls] files changed but do not load; the previous certificate stays in force"
                ),
            }
        }
    });
}

fn fingerprint(config: &TlsConfig) -> Fingerprint {
    [&config.cert_file, &config.key_file, &config.ca_file]
        .into_iter()
        .map(|path| {
            let meta = std::fs::metadata(path.as_ref()?).ok()?;
            Some((meta.len(), meta.modified().ok()?))
        })
        .collect()
}
