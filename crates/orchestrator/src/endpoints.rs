//! Where workers listen and how they are dialed: `unix:`, `https://`, `dns:///` and
//! (with the lab switch) `http://` endpoints, and the channel each replica is reached
//! by ([`WorkerChannel`], which dials with what is made here and tells a connection
//! that could not be made apart from a call that failed once sent: see
//! [`crate::replicas::never_started`]).

use std::path::PathBuf;
use std::sync::Arc;

use tonic::transport::Uri;

use crate::replicas::Replica;
use crate::worker_channel::{WorkerChannel, dial};

#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error(
        "endpoint {0:?} must be unix:/path, https://host:port, http://host:port or dns:///host:port"
    )]
    Unrecognised(String),
    #[error(
        "endpoint {0:?} is reached over TCP, where workers take mutual TLS: give the orchestrator [tls] cert_file, key_file and ca_file (airlock certs init writes a development set), or [tls] insecure_plaintext = true for a lab"
    )]
    TlsRequired(String),
    #[error(
        "endpoint {0:?} is plaintext while [tls] is set: use https://host:port or dns:///host:port (both mutual TLS), or set [tls] insecure_plaintext = true for a lab"
    )]
    PlaintextWithTls(String),
    #[error("endpoint {endpoint:?}: {reason}")]
    Invalid { endpoint: String, reason: String },
}

/// A configured worker endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointSpec {
    Unix(PathBuf),
    Http(String),
    /// Mutual TLS to one address.
    Https {
        host: String,
        port: u16,
    },
    /// Every address the name resolves to is a replica (a headless Service); mutual TLS
    /// when the orchestrator has `[tls]`.
    Dns {
        host: String,
        port: u16,
    },
}

/// `host:port` of an endpoint, `[v6]:port` included.
fn host_port(value: &str, rest: &str) -> Result<(String, u16), EndpointError> {
    let (host, port) = rest
        .trim_end_matches('/')
        .rsplit_once(':')
        .ok_or_else(|| EndpointError::Unrecognised(value.to_owned()))?;
    let port = port
        .parse()
        .map_err(|_| EndpointError::Unrecognised(value.to_owned()))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(EndpointError::Unrecognised(value.to_owned()));
    }
    Ok((host.to_owned(), port))
}

impl EndpointSpec {
    pub fn parse(value: &str) -> Result<Self, EndpointError> {
        if let Some(path) = value.strip_prefix("unix:") {
            let path = path.strip_prefix("//").unwrap_or(path);
            if path.is_empty() {
                return Err(EndpointError::Unrecognised(value.to_owned()));
            }
            return Ok(EndpointSpec::Unix(PathBuf::from(path)));
        }
        if let Some(rest) = value.strip_prefix("https://") {
            let (host, port) = host_port(value, rest)?;
            return Ok(EndpointSpec::Https { host, port });
        }
        if value.starts_with("http://") {
            value.parse::<Uri>().map_err(|e| EndpointError::Invalid {
                endpoint: value.to_owned(),
                reason: e.to_string(),
            })?;
            return Ok(EndpointSpec::Http(value.to_owned()));
        }
        if let Some(rest) = value.strip_prefix("dns:///") {
            let (host, port) = host_port(value, rest)?;
            return Ok(EndpointSpec::Dns { host, port });
        }
        Err(EndpointError::Unrecognised(value.to_owned()))
    }

    pub fn is_dns(&self) -> bool {
        matches!(self, EndpointSpec::Dns { .. })
    }
}

/// How the orchestrator dials its workers: Unix sockets as they are; TCP under mutual
/// TLS with `[tls]`, plaintext only with `[tls] insecure_plaintext = true`.
#[derive(Clone, Default)]
pub struct Dialer {
    pub mtls: Option<Arc<airlock_tls::mtls::Reloading>>,
    pub insecure_plaintext: bool,
}

impl Dialer {
    /// Refuses an endpoint this dialer would reach in a weaker way than it must.
    pub fn check(&self, endpoint: &str, spec: &EndpointSpec) -> Result<(), EndpointError> {
        match (spec, &self.mtls, self.insecure_plaintext) {
            (EndpointSpec::Unix(_), _, _) => Ok(()),
            (EndpointSpec::Https { .. }, Some(_), _) => Ok(()),
            (EndpointSpec::Https { .. }, None, _) => {
                Err(EndpointError::TlsRequired(endpoint.to_owned()))
            }
            (EndpointSpec::Dns { .. }, Some(_), _) => Ok(()),
            (EndpointSpec::Http(_) | EndpointSpec::Dns { .. }, _, true) => Ok(()),
            (EndpointSpec::Http(_), Some(_), false) => {
                Err(EndpointError::PlaintextWithTls(endpoint.to_owned()))
            }
            (EndpointSpec::Http(_) | EndpointSpec::Dns { .. }, None, false) => {
                Err(EndpointError::TlsRequired(endpoint.to_owned()))
            }
        }
    }

    /// The replica of a static endpoint; `None` for DNS endpoints, resolved later.
    pub fn static_replica(
        &self,
        spec: &EndpointSpec,
        server_name: Option<&str>,
    ) -> Option<Result<Replica, EndpointError>> {
        match spec {
            EndpointSpec::Unix(path) => Some(Ok(Replica::new(
                spec.to_string(),
                unix_channel(path.clone()),
            ))),
            EndpointSpec::Http(url) => Some(http_replica(url)),
            EndpointSpec::Https { host, port } => Some(self.tls_replica(
                format!("https://{host}:{port}"),
                (host.clone(), *port),
                server_name.unwrap_or(host),
            )),
            EndpointSpec::Dns { .. } => None,
        }
    }

    /// The replicas `spec` stands for now, reusing those in `current`; an error when a
    /// `dns:///` name cannot be resolved (the caller keeps what it had).
    pub async fn resolve(
        &self,
        spec: &EndpointSpec,
        server_name: Option<&str>,
        current: &[Arc<Replica>],
    ) -> Result<Vec<Arc<Replica>>, std::io::Error> {
        let reuse = |endpoint: &str| current.iter().find(|r| r.endpoint == endpoint).cloned();
        let EndpointSpec::Dns { host, port } = spec else {
            let name = spec.to_string();
            return Ok(match reuse(&name) {
                Some(r) => vec![r],
                None => self
                    .static_replica(spec, server_name)
                    .and_then(Result::ok)
                    .map(Arc::new)
                    .into_iter()
                    .collect(),
            });
        };
        let addrs = tokio::net::lookup_host((host.as_str(), *port)).await?;
        let mut replicas = Vec::new();
        for addr in addrs {
            let scheme = if self.mtls.is_some() { "https" } else { "http" };
            let url = format!("{scheme}://{addr}");
            if replicas.iter().any(|r: &Arc<Replica>| r.endpoint == url) {
                continue;
            }
            if let Some(r) = reuse(&url) {
                replicas.push(r);
                continue;
            }
            let made = match self.mtls {
                Some(_) => self.tls_replica(
                    url,
                    (addr.ip().to_string(), addr.port()),
                    server_name.unwrap_or(host),
                ),
                None => Ok(Replica::new(
                    url,
                    tcp_channel(addr.ip().to_string(), addr.port()),
                )),
            };
            match made {
                Ok(r) => replicas.push(Arc::new(r)),
                Err(e) => tracing::warn!(error = %e, "skipping a resolved replica"),
            }
        }
        Ok(replicas)
    }

    fn tls_replica(
        &self,
        endpoint: String,
        target: (String, u16),
        server_name: &str,
    ) -> Result<Replica, EndpointError> {
        let invalid = |reason: String| EndpointError::Invalid {
            endpoint: endpoint.clone(),
            reason,
        };
        let Some(mtls) = &self.mtls else {
            return Err(EndpointError::TlsRequired(endpoint));
        };
        let name = rustls::pki_types::ServerName::try_from(server_name.to_owned())
            .map_err(|e| invalid(format!("server name {server_name:?}: {e}")))?;
        let identity = mtls.clone();
        // The connector dials `target` and checks the worker's certificate against
        // `ca_file` and `name`, with the identity in force when it connects (a rotation
        // applies from the next connection).
        let channel = WorkerChannel::new(dial(move || {
            let connector = tokio_rustls::TlsConnector::from(identity.current().client.clone());
            let (name, target) = (name.clone(), target.clone());
            async move {
                let tcp = tokio::net::TcpStream::connect((target.0.as_str(), target.1)).await?;
                tcp.set_nodelay(true)?;
                connector.connect(name, tcp).await
            }
        }));
        Ok(Replica::new(endpoint, channel))
    }
}

impl std::fmt::Display for EndpointSpec {
    /// The endpoint as replicas are named (`calls[].replica`, logs, `/readyz`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EndpointSpec::Unix(path) => write!(f, "unix:{}", path.display()),
            EndpointSpec::Http(url) => f.write_str(url),
            EndpointSpec::Https { host, port } => write!(f, "https://{host}:{port}"),
            EndpointSpec::Dns { host, port } => write!(f, "dns:///{host}:{port}"),
        }
    }
}

/// The channel of the worker listening on the Unix socket at `path`.
pub(crate) fn unix_channel(path: PathBuf) -> WorkerChannel {
    WorkerChannel::new(dial(move || tokio::net::UnixStream::connect(path.clone())))
}

fn tcp_channel(host: String, port: u16) -> WorkerChannel {
    WorkerChannel::new(dial(move || {
        let host = host.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            Ok(tcp)
        }
    }))
}

/// A plaintext `http://host:port` replica (`[tls] insecure_plaintext = true` only).
fn http_replica(url: &str) -> Result<Replica, EndpointError> {
    let uri: Uri =
        url.parse().map_err(
            |e: tonic::codegen::http::uri::InvalidUri| EndpointError::Invalid {
                endpoint: url.to_owned(),
                reason: e.to_string(),
            },
        )?;
    let (Some(host), Some(port)) = (uri.host(), uri.port_u16()) else {
        return Err(EndpointError::Unrecognised(url.to_owned()));
    };
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    Ok(Replica::new(url.to_owned(), tcp_channel(host, port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_forms() {
        assert_eq!(
            EndpointSpec::parse("unix:/a.sock").unwrap(),
            EndpointSpec::Unix("/a.sock".into())
        );
        assert!(matches!(
            EndpointSpec::parse("http://10.0.0.1:50051").unwrap(),
            EndpointSpec::Http(_)
        ));
        assert_eq!(
            EndpointSpec::parse("dns:///fs-worker.airlock.svc:50051").unwrap(),
            EndpointSpec::Dns {
                host: "fs-worker.airlock.svc".into(),
                port: 50051
            }
        );
        assert_eq!(
            EndpointSpec::parse("https://worker-fs:50051").unwrap(),
            EndpointSpec::Https {
                host: "worker-fs".into(),
                port: 50051
            }
        );
        assert!(EndpointSpec::parse("ftp://x").is_err());
        assert!(EndpointSpec::parse("dns:///nohost").is_err());
        assert!(EndpointSpec::parse("https://:1").is_err());
    }

    /// TCP is mutual TLS, or plaintext only with the explicit switch; never a quiet
    /// downgrade either way.
    #[test]
    fn tcp_endpoints_need_tls_or_the_lab_switch() {
        let bare = Dialer::default();
        let lab = Dialer {
            mtls: None,
            insecure_plaintext: true,
        };
        let unix = EndpointSpec::parse("unix:/a.sock").unwrap();
        let http = EndpointSpec::parse("http://10.0.0.1:50051").unwrap();
        let https = EndpointSpec::parse("https://worker-fs:50051").unwrap();
        let dns = EndpointSpec::parse("dns:///fs.svc:50051").unwrap();
        assert!(bare.check("unix", &unix).is_ok());
        for (name, spec) in [("http", &http), ("https", &https), ("dns", &dns)] {
            let error = bare.check(name, spec).unwrap_err().to_string();
            assert!(
                error.contains("[tls]") && error.contains("insecure_plaintext"),
                "{error}"
            );
        }
        assert!(lab.check("http", &http).is_ok());
        assert!(lab.check("dns", &dns).is_ok());
        assert!(matches!(
            lab.check("https", &https),
            Err(EndpointError::TlsRequired(_))
        ));
    }
}
