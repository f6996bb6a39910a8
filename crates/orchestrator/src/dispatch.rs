//! Reaching workers: endpoints, channels, and running one call on a replica.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use airlock_policy::ToolOutcome;
use airlock_proto::v1 as pb;
use airlock_proto::v1::tool_worker_client::ToolWorkerClient;
use hyper_util::rt::TokioIo;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint, Uri};

/// Largest gRPC message exchanged with a worker.
const MAX_MESSAGE_BYTES: usize = 32 * 1024 * 1024;
/// How long connecting to a worker may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Grace beyond the worker's own deadline before the orchestrator gives up on it.
const DEADLINE_SLACK: Duration = Duration::from_secs(5);
/// How long a cancelled call may take to end on its worker once the worker was asked
/// to stop it: the worker's own cleanup grace (5 s) and slack.
const STOP_BOUND: Duration = Duration::from_secs(15);

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
            EndpointSpec::Unix(path) => Some(Ok(Replica::unix(path.clone()))),
            EndpointSpec::Http(url) => Some(Replica::http(url)),
            EndpointSpec::Https { host, port } => Some(self.tls_replica(
                format!("https://{host}:{port}"),
                (host.clone(), *port),
                server_name.unwrap_or(host),
            )),
            EndpointSpec::Dns { .. } => None,
        }
    }

    /// The replicas `spec` stands for now, reusing channels from `current`.
    pub async fn resolve(
        &self,
        spec: &EndpointSpec,
        server_name: Option<&str>,
        current: &[Arc<Replica>],
    ) -> Vec<Arc<Replica>> {
        let reuse = |endpoint: &str| current.iter().find(|r| r.endpoint == endpoint).cloned();
        let EndpointSpec::Dns { host, port } = spec else {
            let name = match spec {
                EndpointSpec::Unix(path) => format!("unix:{}", path.display()),
                EndpointSpec::Http(url) => url.clone(),
                EndpointSpec::Https { host, port } => format!("https://{host}:{port}"),
                EndpointSpec::Dns { .. } => String::new(),
            };
            return match reuse(&name) {
                Some(r) => vec![r],
                None => self
                    .static_replica(spec, server_name)
                    .and_then(Result::ok)
                    .map(Arc::new)
                    .into_iter()
                    .collect(),
            };
        };
        let Ok(addrs) = tokio::net::lookup_host((host.as_str(), *port)).await else {
            tracing::warn!(%host, port, "cannot resolve worker service");
            return Vec::new();
        };
        let mut replicas = Vec::new();
        for addr in addrs {
            let scheme = if self.mtls.is_some() { "https" } else { "http" };
            let url = format!("{scheme}://{addr}");
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
                None => Replica::http(&url),
            };
            if let Ok(r) = made {
                replicas.push(Arc::new(r));
            }
        }
        replicas
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
        // The URI is required by the HTTP/2 layer; the connector dials `target` and checks
        // the worker's certificate against `ca_file` and `name`, with the identity in
        // force when it connects (a rotation applies from the next connection).
        let channel = Endpoint::from_static("http://worker.airlock.invalid")
            .connect_timeout(CONNECT_TIMEOUT)
            .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
                let connector = tokio_rustls::TlsConnector::from(identity.current().client.clone());
                let (name, target) = (name.clone(), target.clone());
                async move {
                    let tcp = tokio::net::TcpStream::connect((target.0.as_str(), target.1)).await?;
                    tcp.set_nodelay(true)?;
                    let tls = connector.connect(name, tcp).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(tls))
                }
            }));
        Ok(Replica { endpoint, channel })
    }
}

/// One worker replica and its (lazily connecting, self-reconnecting) channel.
pub struct Replica {
    pub endpoint: String,
    channel: Channel,
}

impl Replica {
    fn unix(path: PathBuf) -> Self {
        let endpoint = format!("unix:{}", path.display());
        // The URI is required by the HTTP/2 layer but never resolved: the connector dials
        // the socket path.
        let channel = Endpoint::from_static("http://worker.airlock.invalid")
            .connect_timeout(CONNECT_TIMEOUT)
            .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            }));
        Self { endpoint, channel }
    }

    fn http(url: &str) -> Result<Self, EndpointError> {
        let endpoint = Endpoint::from_shared(url.to_owned())
            .map_err(|e| EndpointError::Invalid {
                endpoint: url.to_owned(),
                reason: e.to_string(),
            })?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
        Ok(Self {
            endpoint: url.to_owned(),
            channel: endpoint.connect_lazy(),
        })
    }

    pub fn client(&self) -> ToolWorkerClient<Channel> {
        ToolWorkerClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }
}

/// Something a running call reports before its result.
#[derive(Debug, Clone)]
#[allow(
    dead_code,
    reason = "progress is forwarded by the streaming front doors that report it"
)]
pub enum WorkerEvent {
    Progress {
        progress: f64,
        total: Option<f64>,
        message: String,
    },
    Output {
        stream: &'static str,
        data: Vec<u8>,
    },
}

/// Why a call did not produce a tool result.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    #[error("no replica of the {group} worker is reachable ({detail}); retry shortly")]
    Unavailable { group: String, detail: String },
    #[error("the call did not finish within its deadline of {timeout_ms} ms and was stopped")]
    DeadlineExceeded { timeout_ms: u64 },
    #[error("the call was cancelled")]
    Cancelled,
    #[error(
        "the {group} worker failed during the call ({detail}); it may or may not have taken effect"
    )]
    Failed { group: String, detail: String },
    #[error("the {group} worker refused the call: {detail}")]
    Refused { group: String, detail: String },
}

/// The result of a dispatched call and the replica that ran it.
pub struct Dispatched {
    pub outcome: ToolOutcome,
    pub replica: String,
}

/// One call as the gate hands it to a worker; converted to the wire's
/// `ExecuteRequest` here, at the boundary, and nowhere else.
pub struct WorkerCall<'a> {
    pub call_id: String,
    pub tool: String,
    pub input: &'a serde_json::Value,
    pub principal: String,
    pub session_id: String,
    /// The deadline the worker enforces.
    pub timeout_ms: u64,
    /// Whether the worker keeps running the call when this side goes away (an approved
    /// call must not be lost with its replica).
    pub detached: bool,
}

impl WorkerCall<'_> {
    fn into_wire(self) -> pb::ExecuteRequest {
        pb::ExecuteRequest {
            call_id: self.call_id,
            tool: self.tool,
            arguments_json: self.input.to_string(),
            principal: self.principal,
            session_id: self.session_id,
            timeout_ms: self.timeout_ms,
            trace_context: Default::default(),
            detached: self.detached,
        }
    }
}

/// Runs `call` on one replica of `group`. A replica that cannot be reached is
/// skipped; a call that reached a worker is never retried, so it runs at most once.
///
/// When `cancel` fires after the request went out, the worker is asked to stop the call
/// (`Cancel`, which kills its sandbox, detached or not) and this returns only once the
/// call's stream has ended: [`DispatchError::Cancelled`] then means the worker stopped
/// it, and a call that finished before the cancel reached it keeps its result. Nothing
/// here reports a call cancelled while it may still run.
pub async fn execute(
    group: &crate::catalog::WorkerGroup,
    call: WorkerCall<'_>,
    events: Option<mpsc::Sender<WorkerEvent>>,
    cancel: &CancellationToken,
) -> Result<Dispatched, DispatchError> {
    let request = call.into_wire();
    let timeout_ms = request.timeout_ms;
    let overall = Duration::from_millis(timeout_ms) + DEADLINE_SLACK;
    let mut last_unreachable = String::from("no replicas are known");
    for replica in group.replicas_in_turn() {
        if cancel.is_cancelled() {
            // Nothing has gone out: there is nothing to stop.
            return Err(DispatchError::Cancelled);
        }
        let mut wire_request = tonic::Request::new(request.clone());
        wire_request.set_timeout(overall);
        let mut client = replica.client();
        // Not raced against `cancel`: once the request is out the worker may be running
        // the call (a detached one even if this side goes away), so a cancel is dealt
        // with on the stream the worker answers with, below. Starting is quick (the
        // worker answers before the tool runs) and bounded by the deadline.
        let started = client.execute(wire_request).await;
        let mut stream = match started {
            Ok(response) => response.into_inner(),
            Err(status) if is_unreachable(&status) => {
                tracing::warn!(group = %group.name, endpoint = %replica.endpoint, %status, "replica unreachable");
                last_unreachable = status.message().to_owned();
                continue;
            }
            Err(status) => return Err(status_error(&group.name, status, timeout_ms)),
        };
        let deadline = tokio::time::Instant::now() + overall;
        let consumed = tokio::select! {
            _ = cancel.cancelled() => {
                return stop(group, &replica, &request, &mut stream, events.as_ref(), deadline).await;
            }
            r = tokio::time::timeout_at(deadline, consume(&mut stream, events.as_ref())) => r,
        };
        return match consumed {
            Ok(Ok(outcome)) => Ok(Dispatched {
                outcome,
                replica: replica.endpoint.clone(),
            }),
            Ok(Err(status)) => {
                if is_unreachable(&status) {
                    group.mark_down();
                }
                Err(status_error(&group.name, status, timeout_ms))
            }
            Err(_) => Err(DispatchError::DeadlineExceeded { timeout_ms }),
        };
    }
    group.mark_down();
    Err(DispatchError::Unavailable {
        group: group.name.clone(),
        detail: last_unreachable,
    })
}

/// Asks `replica` to stop the call whose `stream` is open and waits for the stream's
/// last word: the call's result if it finished first, else the worker's CANCELLED.
async fn stop(
    group: &crate::catalog::WorkerGroup,
    replica: &Replica,
    request: &pb::ExecuteRequest,
    stream: &mut tonic::Streaming<pb::ExecuteEvent>,
    events: Option<&mpsc::Sender<WorkerEvent>>,
    deadline: tokio::time::Instant,
) -> Result<Dispatched, DispatchError> {
    let asked = tokio::time::timeout(
        STOP_BOUND,
        replica.client().cancel(pb::CancelRequest {
            call_id: request.call_id.clone(),
        }),
    )
    .await;
    let refusal = match asked {
        Ok(Ok(_)) => None,
        Ok(Err(status)) => Some(status.to_string()),
        Err(_) => Some(format!("no answer within {} s", STOP_BOUND.as_secs())),
    };
    let until = match refusal {
        None => tokio::time::Instant::now() + STOP_BOUND,
        Some(why) if !request.detached => {
            // A worker that cannot take `Cancel` (an external one predating it) stops an
            // attached call when its stream goes away, which returning here does.
            tracing::warn!(call_id = %request.call_id, endpoint = %replica.endpoint, %why, "the worker did not take Cancel; dropping the call's stream to stop it");
            return Err(DispatchError::Cancelled);
        }
        Some(why) => {
            // Nothing else stops a detached call: it runs to its end and is reported as
            // what it did, not as cancelled.
            tracing::warn!(call_id = %request.call_id, endpoint = %replica.endpoint, %why, "the worker did not take Cancel; the detached call runs to its end");
            deadline
        }
    };
    match tokio::time::timeout_at(until, consume(stream, events)).await {
        Ok(Ok(outcome)) => Ok(Dispatched {
            outcome,
            replica: replica.endpoint.clone(),
        }),
        Ok(Err(status)) => Err(status_error(&group.name, status, request.timeout_ms)),
        Err(_) if until == deadline => Err(DispatchError::DeadlineExceeded {
            timeout_ms: request.timeout_ms,
        }),
        Err(_) => Err(DispatchError::Failed {
            group: group.name.clone(),
            detail: "it was asked to cancel the call and did not report the call's end".to_owned(),
        }),
    }
}

/// Asks every replica of `group` to stop `call_id` (a call another orchestrator
/// replica dispatched: only its worker knows where it runs). Best effort; the replica
/// that dispatched it records how it ended.
pub async fn cancel_everywhere(group: &crate::catalog::WorkerGroup, call_id: &str) {
    for replica in group.replicas_in_turn() {
        let asked = tokio::time::timeout(
            STOP_BOUND,
            replica.client().cancel(pb::CancelRequest {
                call_id: call_id.to_owned(),
            }),
        )
        .await;
        match asked {
            Ok(Ok(answer)) if answer.get_ref().found => return,
            Ok(Ok(_)) => {}
            Ok(Err(status)) => {
                tracing::warn!(call_id, endpoint = %replica.endpoint, %status, "cannot cancel the call on this replica")
            }
            Err(_) => {
                tracing::warn!(call_id, endpoint = %replica.endpoint, "cancelling the call on this replica timed out")
            }
        }
    }
}

async fn consume(
    stream: &mut tonic::Streaming<pb::ExecuteEvent>,
    events: Option<&mpsc::Sender<WorkerEvent>>,
) -> Result<ToolOutcome, tonic::Status> {
    use pb::execute_event::Event;
    while let Some(message) = stream.message().await? {
        match message.event {
            Some(Event::Result(result)) => {
                return ToolOutcome::try_from(result)
                    .map_err(|e| tonic::Status::internal(format!("malformed result: {e}")));
            }
            Some(Event::Progress(p)) => {
                if let Some(events) = events {
                    let total = (p.total > 0.0).then_some(p.total);
                    let _ = events
                        .send(WorkerEvent::Progress {
                            progress: p.progress,
                            total,
                            message: p.message,
                        })
                        .await;
                }
            }
            Some(Event::Output(o)) => {
                if let Some(events) = events {
                    let stream = if o.stream == pb::OutputStream::Stderr as i32 {
                        "stderr"
                    } else {
                        "stdout"
                    };
                    let _ = events
                        .send(WorkerEvent::Output {
                            stream,
                            data: o.data,
                        })
                        .await;
                }
            }
            None => {}
        }
    }
    Err(tonic::Status::unavailable(
        "the worker closed the stream without a result",
    ))
}

/// A failure to reach the worker at all, as opposed to one the worker reported.
fn is_unreachable(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unavailable
}

fn status_error(group: &str, status: tonic::Status, timeout_ms: u64) -> DispatchError {
    match status.code() {
        tonic::Code::DeadlineExceeded => DispatchError::DeadlineExceeded { timeout_ms },
        tonic::Code::Cancelled => DispatchError::Cancelled,
        tonic::Code::InvalidArgument | tonic::Code::NotFound => DispatchError::Refused {
            group: group.to_owned(),
            detail: status.message().to_owned(),
        },
        _ => DispatchError::Failed {
            group: group.to_owned(),
            detail: status.message().to_owned(),
        },
    }
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
