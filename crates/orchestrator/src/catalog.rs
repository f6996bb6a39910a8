//! The tool catalog, gathered from the workers' `ListTools` and kept fresh.
//!
//! Each tool group (`fs`, `shell`, ...) has one or more replicas. A background task asks
//! every group for its tools: often while a group is down, so a worker that comes back
//! is picked up within a second, and now and then while it is up, so a redeployed
//! worker's new tools appear. The last known catalog stays listed while a group is down;
//! calls to its tools then fail with a clear "unavailable" result.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use airlock_policy::authz::{BUILT_IN_GROUPS, ToolExtension, ToolExtensions};
use airlock_policy::{McpServerPolicy, ToolDefinition};
use airlock_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

use crate::config::{DispatchConfig, WorkerGroupConfig};
use crate::endpoints::{Dialer, EndpointSpec};
use crate::replicas::ReplicaSet;
use crate::store::{PinCheck, PinnedDefinition, Store};

/// How often a group that is down is asked again.
const DOWN_PROBE_INTERVAL: Duration = Duration::from_millis(500);
/// How often a live group is asked again.
const LIVE_PROBE_INTERVAL: Duration = Duration::from_secs(5);
/// Longest a `ListTools` probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("worker group {group:?}: {reason}")]
    BadGroup { group: String, reason: String },
}

/// One tool as the gate uses it: its definition, its group and its compiled schema.
pub struct CatalogTool {
    pub definition: ToolDefinition,
    pub group: String,
    pub validator: jsonschema::Validator,
    /// The OpenAI strict-mode variant of the input schema, or why there is none (see
    /// [`crate::strict`]); derived once here rather than on every `GET /v1/tools`.
    pub strict_schema: Result<serde_json::Value, String>,
}

impl CatalogTool {
    /// The call's arguments in the tool's own spelling (strict clients send `null` for
    /// optional fields and lists of pairs for maps), or `None` when they already are.
    pub fn normalized_input(&self, input: &serde_json::Value) -> Option<serde_json::Value> {
        crate::strict::normalize_input(&self.definition.input_schema, input)
    }
}

/// The replicas of one tool group and whether any of them answered lately.
pub struct WorkerGroup {
    pub name: String,
    pub replicas: ReplicaSet,
    live: AtomicBool,
}

impl WorkerGroup {
    fn new(
        config: &WorkerGroupConfig,
        dialer: &Dialer,
        dispatch: &DispatchConfig,
    ) -> Result<Self, CatalogError> {
        let bad = |reason: String| CatalogError::BadGroup {
            group: config.group.clone(),
            reason,
        };
        let specs = check_group(config, dialer)?;
        let replicas = ReplicaSet::new(
            &config.group,
            specs,
            dialer,
            config.server_name.clone(),
            Duration::from_millis(dispatch.resolve_interval_ms),
        )
        .map_err(|e| bad(e.to_string()))?;
        Ok(Self {
            name: config.group.clone(),
            replicas,
            live: AtomicBool::new(false),
        })
    }

    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::Relaxed)
    }

    pub fn mark_down(&self) {
        self.live.store(false, Ordering::Relaxed);
    }
}

/// The endpoints of one `[[workers]]` entry, parsed and checked against how this
/// orchestrator dials (TCP needs `[tls]` or the lab switch).
fn check_group(
    config: &WorkerGroupConfig,
    dialer: &Dialer,
) -> Result<Vec<EndpointSpec>, CatalogError> {
    let bad = |reason: String| CatalogError::BadGroup {
        group: config.group.clone(),
        reason,
    };
    if config.endpoints.is_empty() {
        return Err(bad("has no endpoints".to_owned()));
    }
    config
        .endpoints
        .iter()
        .map(|e| {
            let spec = EndpointSpec::parse(e).map_err(|e| bad(e.to_string()))?;
            dialer.check(e, &spec).map_err(|e| bad(e.to_string()))?;
            Ok(spec)
        })
        .collect()
}

/// The catalog: every group and the tools they serve.
pub struct Catalog {
    groups: Vec<Arc<WorkerGroup>>,
    tools: RwLock<BTreeMap<String, Arc<CatalogTool>>>,
    /// Tools already reported as refused, so that each refresh does not log them again.
    refused: std::sync::Mutex<std::collections::HashSet<String>>,
    /// The declared tools (`[[tools]]`, `tool_packs`), as policies know them.
    extensions: Arc<ToolExtensions>,
    /// Tools that external worker groups (any group but shell, fs, http and db) define
    /// in their `ListTools`: the one source of their schemas and annotations, from which
    /// their Cedar actions are derived. Bumps `changes` when it changes.
    discovered: RwLock<BTreeMap<String, ToolExtension>>,
    changes: tokio::sync::watch::Sender<u64>,
    /// Names an external group lists that another source already defines.
    conflicts: std::sync::Mutex<Vec<String>>,
    /// `[[mcp_servers]]`: whose tools a built-in group may list as discovered ones.
    mcp_servers: Vec<McpServerPolicy>,
    /// Where discovered tools' definitions are pinned (DESIGN §11); `None` serves every
    /// definition as listed (the in-process benchmark harness, which discovers nothing).
    pins: Option<Arc<dyn Store>>,
    /// Tool → the digest the store pinned for it, as last confirmed: a definition with
    /// this digest is served without asking the store again.
    pinned: std::sync::Mutex<std::collections::HashMap<String, String>>,
    /// Tool → the digest of the changed definition it is hidden for, so that each
    /// change is logged once.
    hidden: std::sync::Mutex<std::collections::HashMap<String, String>>,
}

impl Catalog {
    pub fn new(
        configs: &[WorkerGroupConfig],
        dialer: &Dialer,
        dispatch: &DispatchConfig,
    ) -> Result<Self, CatalogError> {
        let groups = configs
            .iter()
            .map(|config| WorkerGroup::new(config, dialer, dispatch))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            groups: groups.into_iter().map(Arc::new).collect(),
            tools: RwLock::default(),
            refused: std::sync::Mutex::default(),
            extensions: Arc::default(),
            discovered: RwLock::default(),
            changes: tokio::sync::watch::Sender::new(0),
            conflicts: std::sync::Mutex::default(),
            mcp_servers: Vec::new(),
            pins: None,
            pinned: std::sync::Mutex::default(),
            hidden: std::sync::Mutex::default(),
        })
    }

    /// Pins each discovered tool's definition in `store` when first seen, and hides a
    /// tool whose worker later lists another definition until an admin accepts it
    /// ([`Store::accept_tool_pin`]).
    pub fn with_pins(mut self, store: Arc<dyn Store>) -> Self {
        self.pins = Some(store);
        self
    }

    /// Serves the tools of these MCP servers (`<name>__<tool>`) as discovered tools of
    /// whichever group lists them; without this, a built-in group's tool that is not
    /// built in or declared is refused.
    pub fn with_mcp_servers(mut self, servers: Vec<McpServerPolicy>) -> Self {
        self.mcp_servers = servers;
        self
    }

    /// Serves the declared tools (`[[tools]]`, `tool_packs`) when workers list them as
    /// declared; without this, a tool that is not built in is refused.
    pub fn with_extensions(mut self, extensions: Arc<ToolExtensions>) -> Self {
        self.extensions = extensions;
        self
    }

    /// The tools external worker groups define, as policies are to see them: a
    /// destructive one needs approval for every call.
    pub fn discovered(&self) -> Vec<ToolExtension> {
        read(&self.discovered).values().cloned().collect()
    }

    /// Told each time [`Self::discovered`] changes.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Names an external group lists that a built-in tool, a declared tool or another
    /// group already defines (such a tool is not served).
    pub fn conflicts(&self) -> Vec<String> {
        lock(&self.conflicts).clone()
    }

    /// Checks the configuration without connecting (no async runtime needed).
    pub fn check(configs: &[WorkerGroupConfig], dialer: &Dialer) -> Result<(), CatalogError> {
        for config in configs {
            check_group(config, dialer)?;
        }
        Ok(())
    }

    pub fn groups(&self) -> &[Arc<WorkerGroup>] {
        &self.groups
    }

    pub fn group(&self, name: &str) -> Option<Arc<WorkerGroup>> {
        self.groups.iter().find(|g| g.name == name).cloned()
    }

    pub fn get(&self, tool: &str) -> Option<Arc<CatalogTool>> {
        self.read_tools().get(tool).cloned()
    }

    /// Every tool, sorted by name.
    pub fn tools(&self) -> Vec<Arc<CatalogTool>> {
        self.read_tools().values().cloned().collect()
    }

    fn read_tools(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Arc<CatalogTool>>> {
        match self.tools.read() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Keeps every group's replicas current and asks every group for its tools, until
    /// `stop` is cancelled.
    pub async fn refresh_forever(self: Arc<Self>, stop: CancellationToken) {
        let mut tasks = Vec::new();
        for group in self.groups.clone() {
            let stop = stop.clone();
            tasks.push(tokio::spawn(
                async move { group.replicas.maintain(stop).await },
            ));
        }
        for group in self.groups.clone() {
            let catalog = self.clone();
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    catalog.refresh_group(&group).await;
                    let pause = if group.is_live() {
                        LIVE_PROBE_INTERVAL
                    } else {
                        DOWN_PROBE_INTERVAL
                    };
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(pause) => {}
                    }
                }
            }));
        }
        futures::future::join_all(tasks).await;
    }

    /// One probe of one group: the first replica that answers `ListTools` defines the
    /// group's tools.
    pub async fn refresh_group(&self, group: &WorkerGroup) {
        let mut tried = Vec::new();
        while let Some(replica) = group.replicas.choose(&tried) {
            tried.push(replica.clone());
            let mut client = replica.client();
            let request = tonic::Request::new(pb::ListToolsRequest {});
            match tokio::time::timeout(PROBE_TIMEOUT, client.list_tools(request)).await {
                Ok(Ok(response)) => {
                    group.replicas.answered(&replica);
                    let was_live = group.live.swap(true, Ordering::Relaxed);
                    if !was_live {
                        tracing::info!(group = %group.name, endpoint = %replica.endpoint, "worker group is live");
                    }
                    let tools = parse_listing(&group.name, response.into_inner().tools);
                    let hidden = self.check_pins(&group.name, &tools).await;
                    self.install(&group.name, tools, &hidden);
                    return;
                }
                Ok(Err(status)) => {
                    tracing::debug!(group = %group.name, endpoint = %replica.endpoint, %status, "ListTools failed");
                }
                Err(_) => {
                    tracing::debug!(group = %group.name, endpoint = %replica.endpoint, "ListTools timed out");
                }
            }
        }
        if group.live.swap(false, Ordering::Relaxed) {
            tracing::warn!(group = %group.name, "worker group is down");
        }
    }

    /// Whether `group`'s tool `name` is discovered: its worker's `ListTools` is its one
    /// source (an external group's tools, and any group's MCP server tools).
    fn is_discovered(&self, group: &str, name: &str) -> bool {
        !BUILT_IN_GROUPS.contains(&group) || self.mcp_servers.iter().any(|s| s.owns(name))
    }

    /// Compares each discovered tool `group` lists with its pin (pinning it when first
    /// seen) and answers the tools to hide: those whose definition differs from the
    /// pin, and, failing closed, those the store could not be asked about.
    async fn check_pins(
        &self,
        group: &str,
        definitions: &[ToolDefinition],
    ) -> std::collections::HashSet<String> {
        let mut hidden = std::collections::HashSet::new();
        let Some(store) = &self.pins else {
            return hidden;
        };
        for tool in definitions {
            if !self.is_discovered(group, &tool.name) {
                continue;
            }
            let Ok(definition) = serde_json::to_value(tool) else {
                continue;
            };
            let digest = crate::audit::value_sha256(&definition);
            let name = tool.name.clone();
            if lock(&self.pinned).get(&name) == Some(&digest) {
                continue;
            }
            let seen = PinnedDefinition {
                group: group.to_owned(),
                digest: digest.clone(),
                definition,
            };
            match store.check_tool_pin(&name, seen).await {
                Ok(PinCheck::FirstSeen | PinCheck::Pinned) => {
                    if let Some(was) = lock(&self.hidden).remove(&name) {
                        tracing::info!(group, tool = %name, %digest, hidden_for = %was, "serving the tool again: its definition is the pinned one");
                    }
                    lock(&self.pinned).insert(name, digest);
                }
                Ok(PinCheck::Changed) => {
                    let first_time = lock(&self.hidden).insert(name.clone(), digest.clone())
                        != Some(digest.clone());
                    if first_time {
                        tracing::warn!(group, tool = %name, %digest, "hiding a tool whose definition differs from the one pinned for it; review it (GET /v1/tools/pins) and run `airlock tools accept {name}` to serve it");
                    }
                    lock(&self.pinned).remove(&name);
                    hidden.insert(name);
                }
                Err(error) => {
                    tracing::error!(group, tool = %name, %error, "hiding a tool whose definition cannot be checked against its pin");
                    hidden.insert(name);
                }
            }
        }
        hidden
    }

    /// Replaces the tools of `group` with `definitions`, skipping any that are badly
    /// named, claimed by another group or `hidden` (their definition is not the pinned
    /// one).
    fn install(
        &self,
        group: &str,
        definitions: Vec<ToolDefinition>,
        hidden: &std::collections::HashSet<String>,
    ) {
        let mut listed = BTreeMap::new();
        let mut fresh = Vec::new();
        for definition in definitions {
            let name = definition.name.clone();
            if let Err(e) = airlock_policy::validate_tool_name(&definition.name) {
                tracing::error!(group, tool = %name, error = %e, "skipping tool");
                continue;
            }
            if hidden.contains(&name) {
                continue;
            }
            let mcp_server = self.mcp_servers.iter().find(|s| s.owns(&definition.name));
            let external = self.is_discovered(group, &definition.name);
            if external {
                if let Some(conflict) = self.defined_elsewhere(group, &definition.name) {
                    let mut conflicts = lock(&self.conflicts);
                    if !conflicts.contains(&conflict) {
                        tracing::error!(group, tool = %name, %conflict, "not serving a tool whose name another source defines");
                        conflicts.push(conflict);
                    }
                    continue;
                }
                let approval = match mcp_server {
                    Some(server) => server.approval_reason(&definition),
                    None => definition.annotations.destructive.then(|| {
                        format!(
                            "{name} is destructive (as the {group} worker's ListTools annotates it), so every call needs approval"
                        )
                    }),
                };
                listed.insert(
                    name.clone(),
                    ToolExtension {
                        group: group.to_owned(),
                        definition: definition.clone(),
                        approval,
                        network: None,
                    },
                );
            }
            // One source of truth: the policies must see the tool as its worker
            // defines it, or a rule could miss an argument; such a tool is not served.
            let problems = if external {
                Vec::new()
            } else {
                self.extensions.check_tool(group, &definition)
            };
            if !problems.is_empty() {
                let first_time = match self.refused.lock() {
                    Ok(mut refused) => refused.insert(name.clone()),
                    Err(poisoned) => poisoned.into_inner().insert(name.clone()),
                };
                if first_time {
                    tracing::error!(group, tool = %name, problems = %problems.join("; "), "not serving a tool that the policies do not see as its worker defines it; align deploy/policies/schema.cedarschema (built-in tools) or the orchestrator's [[tools]] (declared ones) with the worker");
                }
                continue;
            }
            let validator = match jsonschema::validator_for(&definition.input_schema) {
                Ok(v) => v,
                Err(e) => {
                    tracing::error!(group, tool = %name, error = %e, "skipping tool with an invalid schema");
                    continue;
                }
            };
            let strict_schema = crate::strict::strict_schema(&definition.input_schema)
                .map_err(|e| {
                    tracing::info!(group, tool = %name, reason = %e, "no strict-mode variant of the schema; the tool is listed with strict: false");
                    e.to_string()
                });
            fresh.push(CatalogTool {
                definition,
                group: group.to_owned(),
                validator,
                strict_schema,
            });
        }
        let mut tools = match self.tools.write() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        tools.retain(|_, tool| tool.group != group);
        for tool in fresh {
            match tools.get(&tool.definition.name) {
                Some(other) if other.group != group => {
                    tracing::error!(group, tool = %tool.definition.name, other = %other.group, "tool name already served by another group; skipping");
                }
                _ => {
                    tools.insert(tool.definition.name.clone(), Arc::new(tool));
                }
            }
        }
        drop(tools);
        self.record_discovered(group, listed);
    }

    /// Which other source defines `name`, if any: a built-in tool, a declared one, or
    /// another group.
    fn defined_elsewhere(&self, group: &str, name: &str) -> Option<String> {
        if airlock_policy::tool::BUILT_IN_TOOLS.contains(&name) {
            return Some(format!(
                "the {group} worker lists `{name}`, the name of a built-in tool"
            ));
        }
        if self.extensions.contains(name) {
            return Some(format!(
                "the {group} worker lists `{name}`, which [[tools]] or tool_packs declares"
            ));
        }
        match read(&self.tools).get(name) {
            Some(other) if other.group != group => Some(format!(
                "the {group} worker lists `{name}`, which the {} worker serves",
                other.group
            )),
            _ => None,
        }
    }

    /// Replaces the discovered tools of `group` with those it now serves; tells the
    /// subscribers when that changes what policies must see.
    fn record_discovered(&self, group: &str, listed: BTreeMap<String, ToolExtension>) {
        let served = read(&self.tools);
        let listed: BTreeMap<String, ToolExtension> = listed
            .into_iter()
            .filter(|(name, _)| served.get(name).is_some_and(|tool| tool.group == group))
            .collect();
        drop(served);
        let mut discovered = write(&self.discovered);
        let before: BTreeMap<&String, &ToolExtension> = discovered
            .iter()
            .filter(|(_, tool)| tool.group == group)
            .collect();
        let after: BTreeMap<&String, &ToolExtension> = listed.iter().collect();
        if before == after {
            return;
        }
        discovered.retain(|_, tool| tool.group != group);
        discovered.extend(listed);
        drop(discovered);
        self.changes.send_modify(|version| *version += 1);
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    match lock.read() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    match lock.write() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// A worker's `ListTools` as definitions, parsed once for the pin check and the
/// install; a malformed one is logged and skipped.
fn parse_listing(group: &str, listing: Vec<pb::ToolDefinition>) -> Vec<ToolDefinition> {
    listing
        .into_iter()
        .filter_map(|wire| {
            let name = wire.name.clone();
            ToolDefinition::try_from(wire)
                .map_err(|e| tracing::error!(group, tool = %name, error = %e, "skipping tool"))
                .ok()
        })
        .collect()
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}
