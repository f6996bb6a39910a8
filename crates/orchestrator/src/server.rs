//! Binding, serving and shutting down the orchestrator's front doors.

use std::future::Future;
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use airlock_proto::v1::orchestrator_server::OrchestratorServer;
use tokio_util::sync::CancellationToken;

use crate::audit::{AuditKind, NewAuditEvent};
use crate::auth::{AuthError, Principals};
use crate::authn::{AuthLayer, GrpcRefusal};
use crate::budget::Budgets;
use crate::cache::ResultCache;
use crate::catalog::{Catalog, CatalogError};
use crate::config::OrchestratorConfig;
use crate::connections::{self, ConnectionLimits};
use crate::gate::{Gate, GateParts};
use crate::grpc_api::GrpcFrontDoor;
use crate::http_api::{self, HttpState};
use crate::service::CallService;
use airlock_policy::authz::{
    Authorizer, BUILT_IN_GROUPS, PolicyError, PolicyInputs, ToolExtensions,
};
use tower::Layer;

/// Largest gRPC message the orchestrator sends (a page of approvals, a call's results);
/// what it accepts is `[limits] max_request_bytes`, like the HTTP body cap.
const MAX_GRPC_MESSAGE_BYTES: usize = 32 * 1024 * 1024;
/// HTTP/2 keep-alive: a ping this often, and a peer that has not answered within the
/// timeout is disconnected (a vanished client, or one that stopped reading).
const GRPC_KEEPALIVE: Duration = Duration::from_secs(30);
const GRPC_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Calls in flight on one gRPC connection; more wait for one to finish.
const GRPC_STREAMS_PER_CONNECTION: u32 = 256;
/// No handler legitimately runs longer than the longest `wait_ms` (streams answer at
/// once and then stream); past this a gRPC request is answered `cancelled`, and the call
/// itself goes on in the gate.
const GRPC_HANDLER_TIMEOUT: Duration = Duration::from_millis(crate::wire::MAX_WAIT_MS + 60_000);

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot bind {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error("policy: {0}")]
    Policy(#[from] PolicyError),
    #[error("the declared tools cannot be given to policy: {0}")]
    Tools(#[from] airlock_policy::authz::ExtensionError),
    #[error("a tool name is defined twice: {0}")]
    DefinedTwice(String),
    #[error("store: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error(transparent)]
    Cache(#[from] crate::cache::CacheError),
    #[error("cannot write {path}: {source}")]
    RunFile {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot build the reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("grpc server failed: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error(transparent)]
    AuditExport(#[from] crate::audit_export::AuditExportError),
}

/// The orchestrator's sockets, bound before the process confines itself.
#[derive(Debug)]
pub struct BoundListeners {
    pub http: TcpListener,
    pub grpc: TcpListener,
}

impl BoundListeners {
    pub fn bind(config: &OrchestratorConfig) -> Result<Self, ServeError> {
        let bind = |what, addr: &str| {
            let listener = TcpListener::bind(addr).map_err(|source| ServeError::Bind {
                what,
                addr: addr.to_owned(),
                source,
            })?;
            listener
                .set_nonblocking(true)
                .map_err(|source| ServeError::Bind {
                    what,
                    addr: addr.to_owned(),
                    source,
                })?;
            Ok::<_, ServeError>(listener)
        };
        Ok(Self {
            http: bind("http", &config.http_listen)?,
            grpc: bind("grpc", &config.grpc_listen)?,
        })
    }

    /// `{"http": "http://…", "grpc": "http://…"}` as bound (port 0 resolved); the gRPC
    /// URL is `https://…` when the front door serves TLS (`grpc_tls`).
    pub fn endpoints(&self, grpc_tls: bool) -> serde_json::Value {
        let url = |l: &TcpListener, scheme: &str| {
            l.local_addr()
                .map(|a| format!("{scheme}://{a}"))
                .unwrap_or_default()
        };
        let grpc_scheme = if grpc_tls { "https" } else { "http" };
        serde_json::json!({"http": url(&self.http, "http"), "grpc": url(&self.grpc, grpc_scheme)})
    }
}

pub struct Orchestrator;

impl Orchestrator {
    /// Loads what the gate needs (principals, catalog) — everything that reads files
    /// outside the data dir happens here, before the caller confines the process.
    pub fn prepare(config: &OrchestratorConfig) -> Result<Prepared, ServeError> {
        let principals = Principals::load(&config.principals, &config.data_dir)?;
        Catalog::check(&config.workers, &config.worker_tls.dialer())?;
        let extensions = Arc::new(
            ToolExtensions::new(&config.tool_extensions)?.with_shell_network(&config.shell_network),
        );
        let (text, file) = read_policy(config)?;
        let inputs = PolicyInputs {
            approvals: config.approvals.knob(),
            extensions,
        };
        let (authorizer, pending) = match Authorizer::from_sources(&text, &file, inputs.clone()) {
            Ok(authorizer) => (authorizer, None),
            // The policy may name tools that only an external worker's ListTools
            // defines: it is validated again once the workers have answered, and until
            // then nothing is allowed (the placeholder has no policy at all).
            Err(PolicyError::Validation { .. }) if has_external_groups(config) => {
                (Authorizer::from_sources("", &file, inputs)?, Some(text))
            }
            Err(error) => return Err(error.into()),
        };
        for warning in authorizer.warnings() {
            tracing::warn!(%warning, "policy warning");
        }
        Ok(Prepared {
            principals: Arc::new(principals),
            authorizer,
            pending,
        })
    }

    /// Serves HTTP and gRPC until `shutdown` resolves; writes
    /// `<data_dir>/run/orchestrator.json` once both listen.
    pub async fn serve(
        config: OrchestratorConfig,
        prepared: Prepared,
        listeners: BoundListeners,
        shutdown: impl Future<Output = ()> + Send + 'static,
        mut reload: tokio::sync::mpsc::Receiver<Reload>,
    ) -> Result<(), ServeError> {
        if let Some(identity) = &config.worker_tls.mtls {
            airlock_tls::mtls::watch(identity.clone(), "orchestrator");
        }
        let store = crate::store::open(
            &config.store,
            &config.data_dir,
            config.store_password.clone(),
        )
        .await?;
        // Channels need the runtime, so the catalog is built here, not in `prepare`.
        let catalog = Arc::new(
            Catalog::new(
                &config.workers,
                &config.worker_tls.dialer(),
                &config.dispatch,
            )?
            .with_extensions(prepared.authorizer.extensions().clone())
            .with_mcp_servers(config.mcp_servers.clone())
            .with_pins(store.clone()),
        );
        let metrics = Arc::new(crate::metrics::Metrics::new());
        for tool in config.cache.ttl_seconds.keys() {
            metrics.cached_tool(tool);
        }
        // A bad `[audit] export` stops the start; a collector that is down does not.
        let audit_export = config
            .audit
            .export
            .as_ref()
            .map(|export| {
                crate::audit_export::AuditExporter::new(export, metrics.audit_export.clone())
            })
            .transpose()?
            .map(|exporter| (exporter, store.clone()));
        let gate = Arc::new(Gate::new(GateParts {
            catalog: catalog.clone(),
            limits: config.limits.clone(),
            store,
            authorizer: prepared.authorizer,
            approvals: config.approvals.clone(),
            budgets: Budgets::new(config.budgets.clone()),
            cache: ResultCache::new(&config.cache),
            audit: config.audit.clone(),
            workspaces_root: config.workspaces_root.clone(),
            // The front doors' table, so that a reload reaches the gate's re-checks too.
            principals: prepared.principals.clone(),
            retention: config.retention.clone(),
            metrics,
        }));
        let stop = CancellationToken::new();
        gate.probe_workers().await?;
        // External workers have answered (or not): their tools join the policy's view,
        // and a name defined twice stops the start.
        let conflicts = catalog.conflicts();
        if !conflicts.is_empty() {
            return Err(ServeError::DefinedTwice(conflicts.join("; ")));
        }
        let mut changes = catalog.subscribe();
        changes.mark_unchanged();
        if let Some(text) = &prepared.pending {
            let current = gate.authorizer();
            let authorizer = Authorizer::from_sources(
                text,
                current.file(),
                PolicyInputs {
                    approvals: current.approvals().clone(),
                    extensions: catalog_extensions(&config, &catalog)?,
                },
            )?;
            gate.replace_authorizer(authorizer);
        } else if !catalog.discovered().is_empty() {
            let extensions = catalog_extensions(&config, &catalog)?;
            gate.replace_authorizer(gate.authorizer().with_extensions(extensions)?);
        }
        {
            let gate = gate.clone();
            let config = config.clone();
            let catalog = catalog.clone();
            tokio::spawn(async move {
                while changes.changed().await.is_ok() {
                    follow_catalog(&gate, &config, &catalog).await;
                }
            });
        }
        tokio::spawn(catalog.refresh_forever(stop.clone()));
        tokio::spawn(gate.clone().resume_forever(stop.clone()));
        tokio::spawn(gate.clone().prune_forever(stop.clone()));
        tokio::spawn(gate.clone().verify_forever(stop.clone()));
        if let Some((exporter, store)) = audit_export {
            // Where to follow from is settled before the front doors open, so that no
            // call's records come before it the first time an endpoint is exported to.
            let read_to = exporter.start(store.as_ref()).await?;
            tokio::spawn(exporter.run(store, read_to, stop.clone()));
        }
        {
            let gate = gate.clone();
            let config = config.clone();
            tokio::spawn(async move {
                while let Some(request) = reload.recv().await {
                    reload_principals(&gate, request.principals, &config).await;
                    reload_policy(&gate, &config).await;
                }
            });
        }

        let (health, health_service) = tonic_health::server::health_reporter();
        health
            .set_serving::<OrchestratorServer<GrpcFrontDoor>>()
            .await;
        let reflection_v1 = reflection(ORCHESTRATOR_SERVICE).build_v1()?;
        let reflection_v1alpha = reflection(ORCHESTRATOR_SERVICE).build_v1alpha()?;
        let agent = Arc::new(config.agent.clone());
        let front_door = GrpcFrontDoor {
            gate: gate.clone(),
            calls: CallService::new(gate.clone()),
            agent: agent.clone(),
        };
        let max_request = usize::try_from(config.limits.max_request_bytes).unwrap_or(usize::MAX);
        let grpc_router = tonic::transport::Server::builder()
            .timeout(GRPC_HANDLER_TIMEOUT)
            .concurrency_limit_per_connection(GRPC_STREAMS_PER_CONNECTION as usize)
            .max_concurrent_streams(GRPC_STREAMS_PER_CONNECTION)
            .http2_keepalive_interval(Some(GRPC_KEEPALIVE))
            .http2_keepalive_timeout(Some(GRPC_KEEPALIVE_TIMEOUT))
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(
                crate::traces::FrontDoorLayer(crate::traces::Door::Grpc).layer(
                    AuthLayer::new(prepared.principals.clone(), GrpcRefusal).layer(
                        OrchestratorServer::new(front_door)
                            .max_decoding_message_size(max_request)
                            .max_encoding_message_size(MAX_GRPC_MESSAGE_BYTES),
                    ),
                ),
            );
        // Fires when the front doors stop; endless responses (the console's live list)
        // end with it, so that a graceful stop does not wait for their browsers.
        let shutting_down = CancellationToken::new();
        let http_router = http_api::router(HttpState {
            gate: gate.clone(),
            calls: CallService::new(gate.clone()),
            principals: prepared.principals,
            agent,
            stopping: shutting_down.clone(),
            live_streams: Arc::default(),
        });

        let endpoints = listeners.endpoints(config.grpc_tls.is_some());
        let http_listener =
            tokio::net::TcpListener::from_std(listeners.http).map_err(|source| {
                ServeError::Bind {
                    what: "http",
                    addr: config.http_listen.clone(),
                    source,
                }
            })?;
        let grpc_listener =
            tokio::net::TcpListener::from_std(listeners.grpc).map_err(|source| {
                ServeError::Bind {
                    what: "grpc",
                    addr: config.grpc_listen.clone(),
                    source,
                }
            })?;
        write_run_file(&config.data_dir, &endpoints)?;
        tracing::info!(
            http = %endpoints["http"],
            grpc = %endpoints["grpc"],
            grpc_tls = config.grpc_tls.is_some(),
            "orchestrator listening"
        );

        let trigger = shutting_down.clone();
        tokio::spawn(async move {
            shutdown.await;
            trigger.cancel();
        });
        let limits = ConnectionLimits::from_limits(&config.limits);
        let http =
            connections::serve_http(http_listener, http_router, limits, shutting_down.clone());
        let grpc_stop = shutting_down.clone();
        let grpc_stopped = async move { grpc_stop.cancelled().await };
        let grpc = async {
            match config.grpc_tls.clone() {
                Some(identity) => {
                    grpc_router
                        .serve_with_incoming_shutdown(
                            connections::grpc_incoming_tls(
                                grpc_listener,
                                limits,
                                shutting_down.clone(),
                                identity,
                            ),
                            grpc_stopped,
                        )
                        .await
                }
                None => {
                    grpc_router
                        .serve_with_incoming_shutdown(
                            connections::grpc_incoming(
                                grpc_listener,
                                limits,
                                shutting_down.clone(),
                            ),
                            grpc_stopped,
                        )
                        .await
                }
            }
        };
        let ((), grpc_result) = tokio::join!(http, grpc);
        stop.cancel();
        grpc_result?;
        Ok(())
    }
}

/// The gRPC service this server exists for.
const ORCHESTRATOR_SERVICE: &str = "airlock.v1.Orchestrator";

/// Server reflection that lists exactly what this server serves: the orchestrator,
/// health, and reflection itself in both versions (v1, and v1alpha for grpcurl up to 1.8
/// and grpcio-reflection's client). `airlock.v1.ToolWorker` shares the descriptor file
/// but is served by the workers, not here. Called once per version: the builder is
/// consumed by `build_*`.
fn reflection(service: &str) -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(airlock_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
        .include_reflection_service(false)
        .with_service_name(service)
        .with_service_name("grpc.health.v1.Health")
        .with_service_name("grpc.reflection.v1.ServerReflection")
        .with_service_name("grpc.reflection.v1alpha.ServerReflection")
}

/// What [`Orchestrator::prepare`] loaded.
pub struct Prepared {
    principals: Arc<Principals>,
    authorizer: Authorizer,
    /// The policy text, when it could only be validated once external workers have
    /// listed their tools.
    pending: Option<String>,
}

/// The policy file's text and name (the embedded default's when none is configured).
fn read_policy(config: &OrchestratorConfig) -> Result<(String, String), PolicyError> {
    match &config.policy_file {
        Some(path) => {
            let file = path.display().to_string();
            let text = std::fs::read_to_string(path).map_err(|error| PolicyError::Read {
                file: file.clone(),
                error,
            })?;
            Ok((text, file))
        }
        None => Ok((
            airlock_policy::authz::DEFAULT_POLICY_SOURCE.to_owned(),
            airlock_policy::authz::DEFAULT_POLICY_FILE_NAME.to_owned(),
        )),
    }
}

fn has_external_groups(config: &OrchestratorConfig) -> bool {
    !config.mcp_servers.is_empty()
        || config
            .workers
            .iter()
            .any(|w| !BUILT_IN_GROUPS.contains(&w.group.as_str()))
}

/// The declared tools and those external workers list, as one set for policy.
fn catalog_extensions(
    config: &OrchestratorConfig,
    catalog: &Catalog,
) -> Result<Arc<ToolExtensions>, airlock_policy::authz::ExtensionError> {
    let mut tools = config.tool_extensions.clone();
    tools.extend(catalog.discovered());
    ToolExtensions::new(&tools)
        .map(|extensions| Arc::new(extensions.with_shell_network(&config.shell_network)))
}

/// An external worker listed other tools: the policy is validated again against them.
/// A policy that no longer validates (it names a tool that is gone) keeps the previous
/// one in force, which does not allow the new tools.
async fn follow_catalog(gate: &Gate, config: &OrchestratorConfig, catalog: &Catalog) {
    let rebuilt = catalog_extensions(config, catalog)
        .map_err(|e| e.to_string())
        .and_then(|extensions| {
            gate.authorizer()
                .with_extensions(extensions)
                .map_err(|e| e.to_string())
        });
    match rebuilt {
        Ok(authorizer) => {
            let tools: Vec<String> = authorizer.extensions().names().map(str::to_owned).collect();
            let file = authorizer.file().to_owned();
            gate.replace_authorizer(authorizer);
            tracing::info!(%file, ?tools, "policy validated again for the workers' tools");
            gate.audit(NewAuditEvent::new(
                AuditKind::PolicyReloaded,
                serde_json::json!({"file": file, "reason": "catalog", "tools": tools}),
            ))
            .await;
        }
        Err(error) => {
            tracing::error!(%error, "the policy does not validate against the workers' tools; the previous policy stays in force");
            gate.audit(NewAuditEvent::new(
                AuditKind::PolicyReloadFailed,
                serde_json::json!({"error": error, "reason": "catalog"}),
            ))
            .await;
        }
    }
}

fn load_policy(
    config: &OrchestratorConfig,
    extensions: &Arc<ToolExtensions>,
) -> Result<Authorizer, PolicyError> {
    let inputs = PolicyInputs {
        approvals: config.approvals.knob(),
        extensions: extensions.clone(),
    };
    match &config.policy_file {
        Some(path) => Authorizer::load_file(path, inputs),
        None => Authorizer::default_policy(inputs),
    }
}

/// What one SIGHUP asks the orchestrator to load again: the policy file (named at
/// start) always, and the `[[principals]]` the binary read from the config file again.
#[derive(Debug, Clone)]
pub struct Reload {
    /// The `[[principals]]` as the config file reads now, or why it could not be read
    /// (the principals in force then stay).
    pub principals: Result<Vec<crate::config::PrincipalConfig>, String>,
}

/// SIGHUP: put the reloaded `[[principals]]` in force. A removed principal's token stops
/// working at once, and approved calls are checked against the new table before they
/// run; a table that does not load keeps the old one in force.
async fn reload_principals(
    gate: &Gate,
    principals: Result<Vec<crate::config::PrincipalConfig>, String>,
    config: &OrchestratorConfig,
) {
    let loaded = principals.and_then(|configs| {
        Principals::load(&configs, &config.data_dir).map_err(|e| e.to_string())
    });
    match loaded {
        Ok(table) => {
            gate.replace_principals(table);
            let names = gate.principal_names();
            tracing::info!(?names, "principals reloaded");
            gate.audit(NewAuditEvent::new(
                AuditKind::PrincipalsReloaded,
                serde_json::json!({"principals": names}),
            ))
            .await;
        }
        Err(e) => {
            tracing::error!(error = %e, "principals reload failed; the previous principals stay in force");
            gate.audit(NewAuditEvent::new(
                AuditKind::PrincipalsReloadFailed,
                serde_json::json!({"error": e}),
            ))
            .await;
        }
    }
}

/// SIGHUP: load the policy file again; a broken file keeps the old policy in force.
async fn reload_policy(gate: &Gate, config: &OrchestratorConfig) {
    // `[[tools]]` is read at start only: the reloaded policy sees the same tools.
    match load_policy(config, gate.authorizer().extensions()) {
        Ok(authorizer) => {
            let file = authorizer.file().to_owned();
            gate.replace_authorizer(authorizer);
            tracing::info!(%file, "policy reloaded");
            gate.audit(NewAuditEvent::new(
                AuditKind::PolicyReloaded,
                serde_json::json!({"file": file}),
            ))
            .await;
        }
        Err(e) => {
            tracing::error!(error = %e, "policy reload failed; the previous policy stays in force");
            gate.audit(NewAuditEvent::new(
                AuditKind::PolicyReloadFailed,
                serde_json::json!({"error": e.to_string()}),
            ))
            .await;
        }
    }
}

fn write_run_file(data_dir: &Path, endpoints: &serde_json::Value) -> Result<(), ServeError> {
    let run_dir = data_dir.join("run");
    let path = run_dir.join("orchestrator.json");
    let err = |source| ServeError::RunFile {
        path: path.display().to_string(),
        source,
    };
    std::fs::create_dir_all(&run_dir).map_err(err)?;
    let tmp = run_dir.join(".orchestrator.json.tmp");
    std::fs::write(&tmp, endpoints.to_string()).map_err(err)?;
    std::fs::rename(&tmp, &path).map_err(err)?;
    Ok(())
}
