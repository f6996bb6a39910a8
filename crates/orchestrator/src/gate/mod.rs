//! The gate: what happens to one tool call between a front door and a worker.
//!
//! A call passes these stages, one module each, in this order (DESIGN §3's steps in
//! brackets; `docs/decisions.md` says why budgets and the cache sit where they do):
//!
//! 1. [`admission`]: resolve the tool (unknown and hidden alike) and cap the arguments'
//!    size, then record the request (2, 3)
//! 2. [`validate`]: the arguments against the tool's JSON Schema (3)
//! 3. [`budget`]: the session's budgets and repeated calls (6)
//! 4. [`policy`]: Cedar decides allow, deny or needs approval (4)
//! 5. [`cache`]: a read-only tool's remembered result (after policy, before approval)
//! 6. [`approval`]: allowed at once, or held for a human in a durable approval (5)
//! 7. [`claim`]: exactly one replica dispatches a stored call (compare-and-set in the
//!    store); a fresh call with side effects is written ahead of its worker
//! 8. [`dispatch`]: the worker runs it with a deadline (7)
//! 9. [`ending`]: the one place a call ends — audited, stored once, answered (8)
//!
//! Each stage takes the call's [`CallCtx`] and returns a typed [`ending::Rejection`] or
//! what the next stage needs; [`Gate::pipeline`] is the whole sequence, and
//! [`Gate::conclude`] records the ending. A call's audit events wait in its context and
//! go into the store with its next write, in the same transaction: a call that needs no
//! approval and changes nothing is written once, when it ends (docs/decisions.md, "One
//! durable write per call"). A call that waits for approval survives an
//! orchestrator restart: any replica resumes it after the decision ([`resume`]), and it
//! runs exactly once (claims are compare-and-set in the store, and workers join a
//! repeated call id to the original run).

mod admission;
mod approval;
mod budget;
mod cache;
mod claim;
mod console;
mod ctx;
pub(crate) mod decisions;
mod dispatch;
mod ending;
mod policy;
mod resume;
mod retention;
mod validate;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use airlock_policy::authz::{Authorizer, PrincipalRef};
use airlock_policy::{CallStatus, Limits, SessionId, ToolOutcome};
use airlock_telemetry::{CallSpan, KeyValue, SpanKind, SpanStart, Stage, StageParent};
use serde_json::Value;
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

pub use console::HoldReasons;
pub use ctx::ToolUse;

use crate::audit::{AuditPage, AuditQuery, AuditRecord, NewAuditEvent, VerifyReport, redact};
use crate::auth::{Principal, Principals, Role};
use crate::budget::{BudgetError, Budgets};
use crate::cache::{CacheError, ResultCache};
use crate::calls::{CallRecord, CallRegistry};
use crate::catalog::{Catalog, CatalogTool};
use crate::config::StoreRetention;
use crate::config::{ApprovalsConfig, AuditConfig};
use crate::dispatch::WorkerEvent;
use crate::metrics::{Metrics, Refusal};
use crate::store::{CallChange, CallWrite, Store, StoreError};
use crate::traces::stage;
use ctx::CallCtx;
use ending::{Ending, Rejection};

/// How one worker group is doing (`/readyz`).
pub struct GroupHealth {
    pub name: String,
    pub live: bool,
    pub replicas: Vec<ReplicaHealth>,
}

/// How one replica is doing: `serving`, `unknown`, `draining` or `down`, and the
/// calls this orchestrator runs on it now.
pub struct ReplicaHealth {
    pub endpoint: String,
    pub state: &'static str,
    pub in_flight: usize,
}

/// What the gate is assembled from, once, at start-up.
pub struct GateParts {
    pub catalog: Arc<Catalog>,
    pub limits: Limits,
    pub store: Arc<dyn Store>,
    pub authorizer: Authorizer,
    pub approvals: ApprovalsConfig,
    pub budgets: Budgets,
    pub cache: ResultCache,
    pub audit: AuditConfig,
    /// Where workspaces live, for policy's `context.workspace`.
    pub workspaces_root: Option<PathBuf>,
    /// The principals in force (the front doors' table, reloaded on SIGHUP): an
    /// approved call is checked against them again before it runs.
    pub principals: Arc<Principals>,
    /// `[store]`: what the store keeps of results, and for how long.
    pub retention: StoreRetention,
    /// The Prometheus series the gate feeds (`GET /metrics`).
    pub metrics: Arc<Metrics>,
}

pub struct Gate {
    catalog: Arc<Catalog>,
    calls: CallRegistry,
    limits: Limits,
    store: Arc<dyn Store>,
    approvals: ApprovalsConfig,
    budgets: Budgets,
    cache: ResultCache,
    audit_config: AuditConfig,
    /// This replica's name in dispatch claims.
    replica_id: String,
    workspaces_root: Option<PathBuf>,
    principals: Arc<Principals>,
    retention: StoreRetention,
    metrics: Arc<Metrics>,
    authorizer: RwLock<Arc<Authorizer>>,
    /// Woken when an approval is decided through this replica.
    decided: Notify,
    /// Remembered visibility answers (see [`Gate::is_visible`]).
    visibility: std::sync::Mutex<HashMap<VisibilityKey, bool>>,
    /// Calls that count against their session but are not in the store yet.
    unrecorded: budget::Unrecorded,
    /// The agent runs going per principal (`[agent] max_runs_per_principal`).
    pub(crate) agent_runs: Arc<crate::agent::RunSlots>,
}

type VisibilityKey = (String, String, airlock_policy::ToolAnnotations);

/// Remembered visibility answers before the memo starts over.
const VISIBILITY_MEMO: usize = 10_000;

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

pub fn role_names(principal: &Principal) -> Vec<String> {
    principal
        .roles
        .iter()
        .map(|r| match r {
            Role::Agent => "agent",
            Role::Approver => "approver",
            Role::Admin => "admin",
        })
        .map(String::from)
        .collect()
}

/// When a call that may run is first written to the store (see docs/decisions.md, "One
/// durable write per call").
#[derive(Clone, Copy, PartialEq, Eq)]
enum Record {
    /// The store holds it already (approved after a wait, or resumed): claimed there,
    /// and its dispatch written before the worker runs it.
    Stored,
    /// Auto-allowed with side effects: written, claimed and its dispatch recorded in
    /// one transaction before the worker runs it.
    Ahead,
    /// Auto-allowed, changes nothing and reaches nothing outside Airlock (read-only and
    /// not open-world): written once, with its outcome and all its events, when it ends.
    AtEnd,
}

/// How the claimed call is dispatched.
struct Dispatch {
    /// When the call is first written to the store.
    record: Record,
    /// An approved call: the worker keeps running it if this replica goes away.
    durable: bool,
    /// Check the call against the principals and policy in force first, naming this
    /// stage in the audit record (an approved call, which may have waited long).
    recheck: Option<&'static str>,
    /// What the worker's spans are children of: the `gate.dispatch` stage.
    trace: StageParent,
    /// The call was sent to its worker attached before, by a replica that went away
    /// (or could not record its end): the worker kept no record of it, so sending it
    /// again would run it a second time. Claimed, it ends as [`Rejection::LostInFlight`].
    sent_attached: bool,
}

impl Gate {
    pub fn new(parts: GateParts) -> Self {
        Self {
            catalog: parts.catalog,
            calls: CallRegistry::new(parts.limits.result_memory_bytes),
            limits: parts.limits,
            store: parts.store,
            approvals: parts.approvals,
            budgets: parts.budgets,
            cache: parts.cache,
            audit_config: parts.audit,
            replica_id: format!("orchestrator-{}", uuid::Uuid::new_v4().simple()),
            workspaces_root: parts.workspaces_root,
            principals: parts.principals,
            retention: parts.retention,
            metrics: parts.metrics,
            authorizer: RwLock::new(Arc::new(parts.authorizer)),
            decided: Notify::new(),
            visibility: std::sync::Mutex::default(),
            unrecorded: budget::Unrecorded::default(),
            agent_runs: Arc::default(),
        }
    }

    /// Probes every worker group once (so a ready launcher means a populated catalog)
    /// and refuses a cache configured for a tool with side effects.
    pub async fn probe_workers(&self) -> Result<(), CacheError> {
        for group in self.catalog.groups() {
            self.catalog.refresh_group(group).await;
        }
        for tool in self.catalog.tools() {
            self.cache.check(&tool.definition)?;
        }
        Ok(())
    }

    /// Each worker group: its name, whether a replica of it is live, and how each of
    /// its replicas is doing.
    pub fn worker_health(&self) -> Vec<GroupHealth> {
        self.catalog
            .groups()
            .iter()
            .map(|g| GroupHealth {
                name: g.name.clone(),
                live: g.is_live(),
                replicas: g
                    .replicas
                    .all()
                    .iter()
                    .map(|r| ReplicaHealth {
                        endpoint: r.endpoint.clone(),
                        state: r.state().as_str(),
                        in_flight: r.in_flight(),
                    })
                    .collect(),
            })
            .collect()
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Takes `calls` from the principal's per-minute rate (`[budgets] rate_per_minute`).
    pub fn take_rate(&self, principal: &str, calls: u32) -> Result<(), BudgetError> {
        let taken = self.budgets.take(principal, calls);
        if taken.is_err() {
            self.metrics.refused(Refusal::RateLimit);
        }
        taken
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The metrics as Prometheus text, with the gauges that are read rather than
    /// counted (pending approvals in the store, worker replicas) brought up to date.
    pub async fn scrape(&self) -> String {
        match self.store.pending_approvals().await {
            Ok(pending) => self.metrics.set_pending_approvals(pending),
            Err(e) => tracing::warn!(error = %e, "cannot count the pending approvals for /metrics"),
        }
        let health = self.worker_health();
        self.metrics.set_replicas(health.iter().map(|g| {
            (
                g.name.as_str(),
                g.replicas.iter().map(|r| r.state).collect(),
            )
        }));
        self.metrics.render()
    }

    /// A store write on a call's path, timed for `airlock_store_operation_duration_seconds`.
    async fn write_call(&self, write: CallWrite) -> Result<bool, StoreError> {
        let started = Instant::now();
        let written = timed(self.store.write_call(write), Stage::current("gate.store")).await;
        self.metrics.store("write_call", started.elapsed());
        written
    }

    /// Follows a call this replica knows.
    pub fn watch(&self, call_id: &str) -> Option<watch::Receiver<CallRecord>> {
        self.calls.watch(call_id)
    }

    /// Cancels a call this replica runs; `false` when it runs none by that id.
    pub fn cancel(&self, call_id: &str) -> bool {
        self.calls.cancel(call_id)
    }

    /// The names of the principals in force.
    pub fn principal_names(&self) -> Vec<String> {
        self.principals.names()
    }

    pub async fn audit_events(&self, query: AuditQuery) -> Result<Vec<AuditRecord>, StoreError> {
        self.store.audit(query).await
    }

    /// A page of the audit log, and whether more records follow it.
    pub async fn audit_page(&self, query: AuditQuery) -> Result<AuditPage, StoreError> {
        self.store.audit_page(query).await
    }

    /// `"sqlite"` or `"postgres"`.
    pub fn store_kind(&self) -> &'static str {
        self.store.kind()
    }

    /// Write transactions the store committed since start ([`Store::commits`]).
    pub fn store_commits(&self) -> u64 {
        self.store.commits()
    }

    /// Checks the audit log's hash chain; the verdict is also `airlock_audit_verify_ok`.
    pub async fn verify_audit(&self) -> Result<VerifyReport, StoreError> {
        let report = self.store.verify().await;
        if let Ok(report) = &report {
            self.metrics.audit_verified(report.ok, report.records);
        }
        report
    }

    /// Verifies the audit chain now and every `[audit] verify_interval_seconds`, so that
    /// a broken chain raises an alert without anyone asking.
    pub async fn verify_forever(self: Arc<Self>, stop: CancellationToken) {
        let every = self.audit_config.verify_interval_seconds;
        if every == 0 {
            return;
        }
        loop {
            match self.verify_audit().await {
                Ok(report) if !report.ok => tracing::error!(
                    first_bad_seq = report.first_bad_seq,
                    reason = report.reason.as_deref().unwrap_or(""),
                    "the audit log's hash chain does not verify"
                ),
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "cannot verify the audit log; trying again later")
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(every)) => {}
            }
        }
    }

    /// The pinned definitions of discovered tools, with any change waiting for review.
    pub async fn tool_pins(&self) -> Result<Vec<crate::store::ToolPin>, StoreError> {
        self.store.tool_pins().await
    }

    /// Accepts the changed definition of `tool` (audited as `by`) — only if it is still
    /// the one with digest `reviewed`, when given — and asks its group for its tools at
    /// once, so that the tool is served again before this answers.
    pub async fn accept_tool(
        &self,
        tool: &str,
        by: &str,
        reviewed: Option<&str>,
    ) -> Result<crate::store::ToolPin, StoreError> {
        let pin = self.store.accept_tool_pin(tool, by, reviewed).await?;
        if let Some(group) = self.catalog.group(&pin.pinned.group) {
            self.catalog.refresh_group(&group).await;
        }
        Ok(pin)
    }

    pub fn authorizer(&self) -> Arc<Authorizer> {
        match self.authorizer.read() {
            Ok(a) => a.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// SHA-256 of the policy text in force: nothing else versions a policy, and the
    /// digest names the same text on every replica and after every reload.
    pub fn policy_sha256(&self) -> String {
        use sha2::Digest as _;
        hex::encode(sha2::Sha256::digest(self.authorizer().source().as_bytes()))
    }

    pub fn replace_authorizer(&self, authorizer: Authorizer) {
        match self.authorizer.write() {
            Ok(mut a) => *a = Arc::new(authorizer),
            Err(poisoned) => *poisoned.into_inner() = Arc::new(authorizer),
        }
        lock(&self.visibility).clear();
    }

    /// Puts a reloaded principal table in force. Remembered visibility answers go too:
    /// they are keyed by principal name, and a principal's roles may have changed.
    pub fn replace_principals(&self, principals: Principals) {
        self.principals.replace(principals);
        lock(&self.visibility).clear();
    }

    /// Wakes calls waiting for an approval decision.
    pub fn notify_decided(&self) {
        self.decided.notify_waiters();
    }

    /// The tools `principal` may see: the same answer for hidden and unknown tools.
    pub fn visible_tools(&self, principal: &Principal) -> Vec<Arc<CatalogTool>> {
        self.catalog
            .tools()
            .into_iter()
            .filter(|t| self.is_visible(principal, t))
            .collect()
    }

    fn visible_tool(&self, principal: &Principal, name: &str) -> Option<Arc<CatalogTool>> {
        let tool = self.catalog.get(name)?;
        self.is_visible(principal, &tool).then_some(tool)
    }

    /// Visibility depends only on the principal, the tool and the policy (not on
    /// arguments), and partial evaluation is not free, so answers are remembered until
    /// the policy is replaced.
    fn is_visible(&self, principal: &Principal, tool: &CatalogTool) -> bool {
        let key = (
            principal.name.clone(),
            tool.definition.name.clone(),
            tool.definition.annotations,
        );
        if let Some(known) = lock(&self.visibility).get(&key) {
            return *known;
        }
        let roles = role_names(principal);
        let who = PrincipalRef {
            name: &principal.name,
            roles: &roles,
        };
        let visible = self.authorizer().visible(&who, &tool.definition);
        let mut memo = lock(&self.visibility);
        if memo.len() >= VISIBILITY_MEMO {
            memo.clear();
        }
        memo.insert(key, visible);
        visible
    }

    /// Appends an audit event; a store that cannot record is logged loudly (the call's
    /// own outcome is still recorded with the call).
    pub async fn audit(&self, event: NewAuditEvent) {
        if let Err(e) = self.store.append(event).await {
            tracing::error!(error = %e, "cannot append to the audit log");
        }
    }

    pub(crate) fn redacted(&self, tool: Option<&CatalogTool>, input: &Value) -> Value {
        // Borrowed: a copy of the tool's schema per call was a fifth of admission's cost.
        static NO_SCHEMA: Value = Value::Null;
        let schema = tool.map_or(&NO_SCHEMA, |t| &t.definition.input_schema);
        redact(input, schema, &self.audit_config.secret_fields)
    }

    /// Starts a call; it runs to completion even if the caller stops waiting.
    /// `session_named` says whether the request named its session (only those count
    /// against session budgets).
    pub fn submit(
        self: &Arc<Self>,
        principal: &Principal,
        session: &SessionId,
        session_named: bool,
        tool_use: ToolUse,
        events: Option<mpsc::Sender<WorkerEvent>>,
    ) -> watch::Receiver<CallRecord> {
        let call_id = crate::store::fresh_id("call_");
        let cancel = CancellationToken::new();
        let rx = self.calls.insert(
            CallRecord::running(&call_id, &tool_use.id, &tool_use.name, &principal.name),
            cancel.clone(),
        );
        // A child of the front door's span (the caller's), or of the agent run's.
        let span = call_span(&call_id, &tool_use);
        let mut ctx = CallCtx {
            call_id,
            principal: principal.clone(),
            session: session.clone(),
            session_named,
            tool_use,
            events,
            cancel,
            held: None,
            started: Instant::now(),
            journal: Vec::new(),
            budget_slot: None,
            row: None,
            recorded: false,
            span: span.clone(),
        };
        let gate = self.clone();
        let in_flight = self.metrics.in_flight();
        // The pipeline's and the conclusion's state machines are boxed where they start:
        // the spawned future stays small, so handing it to the runtime copies a few
        // hundred bytes instead of tens of kilobytes through each frame of `spawn`
        // (measured: README, "The gate alone").
        // The call's span is carried into the task, as OpenTelemetry's current context
        // while it runs.
        tokio::spawn(span.attach_to(async move {
            let result = Box::pin(gate.pipeline(&mut ctx)).await;
            Box::pin(gate.conclude(&mut ctx, result)).await;
            drop(in_flight);
        }));
        rx
    }

    /// Records a call that failed before it could enter the gate (arguments that are not
    /// a JSON object); it is final at once.
    pub fn reject(
        &self,
        principal: &Principal,
        tool_use_id: String,
        tool: String,
        message: String,
    ) -> watch::Receiver<CallRecord> {
        let call_id = crate::store::fresh_id("call_");
        let mut record = CallRecord::running(&call_id, &tool_use_id, &tool, &principal.name);
        record.status = CallStatus::Error;
        record.duration_ms = Some(0);
        record.result = Some(Arc::new(ToolOutcome::error(message)));
        record.checked = true;
        self.calls.insert(record, CancellationToken::new())
    }

    /// The stages of a fresh call, in order, each in its own span.
    async fn pipeline(&self, ctx: &mut CallCtx) -> Result<Ending, Rejection> {
        let mut laps = Laps::new(&self.metrics);
        // The checks' spans are stages (see `airlock_telemetry::Stage`): many, short,
        // and each a leaf under the call's span.
        let stages = ctx.span.parent();
        let tool = in_stage(stages.stage("gate.admission"), || self.admit(ctx))?;
        laps.lap("admission");
        in_stage(stages.stage("gate.schema"), || {
            validate::validate(&tool, &ctx.tool_use.input)
        })?;
        laps.lap("validate");
        let repeat = timed(self.check_budget(ctx), stages.stage("gate.budget")).await?;
        laps.lap("budget");
        let verdict = in_stage(stages.stage("gate.policy"), || self.authorize(ctx, &tool))?;
        laps.lap("policy");
        let cache_key = self.cache_key(ctx, &tool);
        let cache = stages.stage("gate.cache");
        let hit = self.cached(ctx, &tool, cache_key.as_ref());
        cache.end(false);
        if let Some(hit) = hit {
            laps.lap("cache");
            self.metrics.cache_hit(&tool.definition.name);
            return Ok(hit);
        }
        laps.lap("cache");
        // The wait for a human is `airlock_approval_wait_seconds`, not a stage's time.
        if verdict.needs_approval() {
            failed_async(self.approve(ctx, &verdict), stage!("gate.approval_wait")).await?;
        } else {
            self.approve(ctx, &verdict).await?;
        }
        laps.restart();
        self.calls.update(&ctx.call_id, |r| r.checked = true);
        // Held and approved: the store has the call. One covered by a remembered
        // approval did not wait and is not stored yet (its row is kept for its first
        // write), so it goes on like a call policy allowed.
        let approved = verdict.needs_approval() && ctx.row.is_none();
        let record = if approved {
            Record::Stored
        } else if tool.definition.annotations.read_only && !tool.definition.annotations.open_world {
            // A read that reaches outside (`fetch_url`, a declared GET, an MCP tool) is
            // an act of its own — its URL can carry what it read — so the log shows it
            // before the worker runs, as a write's does.
            Record::AtEnd
        } else {
            Record::Ahead
        };
        // Opened as a span at once: its context goes to the worker in the request.
        let dispatch = stages.open("gate.dispatch");
        let how = Dispatch {
            record,
            durable: approved,
            recheck: approved.then_some("dispatch"),
            trace: dispatch.parent().clone(),
            sent_attached: false,
        };
        let result = self.claim_and_dispatch(ctx, &tool, how).await;
        dispatch.end(result.is_err());
        laps.lap("dispatch");
        let failed = result.as_ref().map_or(true, |e| e.outcome.is_error);
        self.record_repeat(&repeat, failed);
        if let Ok(ending) = &result {
            self.remember_result(cache_key, ending);
        }
        result
    }

    /// Claims the call (exactly one replica wins) and runs it on a worker; a loser
    /// reports the winner's outcome. The re-check comes after the claim, so that
    /// exactly one replica decides whether the call runs. A fresh call that needed no
    /// approval has nothing to claim: no other replica can know its id before it is
    /// stored.
    async fn claim_and_dispatch(
        &self,
        ctx: &mut CallCtx,
        tool: &CatalogTool,
        how: Dispatch,
    ) -> Result<Ending, Rejection> {
        let group = self.catalog.group(&tool.group);
        if how.record == Record::Stored {
            if let claim::Claim::Lost(ending) = self.claim(ctx, group.as_deref()).await? {
                return Ok(ending);
            }
            if how.sent_attached {
                return Err(Rejection::LostInFlight);
            }
            if let Some(stage) = how.recheck {
                self.recheck(ctx, stage)?;
            }
            // Cancelled while it waited (a cancel that came after its approval): it
            // ends here, claimed and never sent, so the log does not say `dispatched`.
            if ctx.cancel.is_cancelled() {
                return Err(Rejection::Dispatch(
                    crate::dispatch::DispatchError::Cancelled,
                ));
            }
        }
        let Some(group) = group else {
            return Err(Rejection::NoWorkerGroup {
                tool: tool.definition.name.clone(),
            });
        };
        let dispatched = self.dispatched_event(ctx, &group, how.durable);
        match how.record {
            Record::Stored => {
                // A call that waited for approval: its dispatch is on record before it
                // runs.
                ctx.journal.push(dispatched);
                self.flush(ctx).await;
            }
            Record::Ahead => self.write_ahead(ctx, dispatched).await?,
            Record::AtEnd => ctx.journal.push(dispatched),
        }
        self.dispatch(ctx, &group, how.durable, &how.trace).await
    }

    /// Writes the call's gathered audit events on their own (a store that cannot is
    /// logged loudly; the call's outcome is still recorded with the call).
    async fn flush(&self, ctx: &mut CallCtx) {
        if ctx.journal.is_empty() {
            return;
        }
        let write = CallWrite {
            events: std::mem::take(&mut ctx.journal),
            change: CallChange::Nothing,
            then: Vec::new(),
        };
        if let Err(e) = self.write_call(write).await {
            tracing::error!(call_id = %ctx.call_id, error = %e, "cannot append to the audit log");
        }
    }

    pub fn default_wait(&self) -> Duration {
        Duration::from_millis(self.limits.default_wait_ms)
    }

    /// How long an MCP request waits on a call held for approval (`[limits] mcp_wait_ms`).
    pub fn mcp_wait(&self) -> Duration {
        Duration::from_millis(self.limits.mcp_wait_ms.min(crate::wire::MAX_WAIT_MS))
    }
}

/// The call's span: one per call, named as OpenTelemetry's GenAI conventions name a
/// tool's execution, with the tool, the model's id for the call and Airlock's; never
/// its arguments. Status and isolation level are set when it ends. Built through the
/// SDK directly (`airlock_telemetry::CallSpan`): as a `tracing` span it cost the
/// orchestrator about 4 % of its CPU on a 100 B read (docs/decisions.md, "Traces").
fn call_span(call_id: &str, tool_use: &ToolUse) -> CallSpan {
    CallSpan::under_current(|| {
        let mut start = SpanStart::execute_tool(SpanKind::Internal, &tool_use.name, call_id);
        start
            .attributes
            .push(KeyValue::new("gen_ai.tool.call.id", tool_use.id.clone()));
        start
    })
}

/// Runs a synchronous check as `stage`, marking it failed when it refused the call.
fn in_stage<T, E>(stage: Stage, check: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    let result = check();
    stage.end(result.is_err());
    result
}

/// Runs an asynchronous check or store write as `stage`, marking it failed when it
/// refused the call or failed.
async fn timed<T, E>(
    work: impl std::future::Future<Output = Result<T, E>>,
    stage: Stage,
) -> Result<T, E> {
    let result = work.await;
    stage.end(result.is_err());
    result
}

/// Runs a stage that others nest in (the approval wait, whose store writes and
/// notifications are its children) in a `tracing` span, marking it failed when it
/// refused the call.
async fn failed_async<T, E>(
    stage: impl std::future::Future<Output = Result<T, E>>,
    span: tracing::Span,
) -> Result<T, E> {
    let result = stage.instrument(span.clone()).await;
    if result.is_err() {
        span.record("otel.status_code", "ERROR");
    }
    result
}

/// Times the gate's stages one after the other, for
/// `airlock_gate_stage_duration_seconds{stage}`; a stage that rejects the call is not
/// timed (the call's own duration covers it).
struct Laps<'a> {
    metrics: &'a Metrics,
    since: Instant,
}

impl<'a> Laps<'a> {
    fn new(metrics: &'a Metrics) -> Self {
        Self {
            metrics,
            since: Instant::now(),
        }
    }

    /// Records the stage that just ended and starts the next.
    fn lap(&mut self, stage: &'static str) {
        let now = Instant::now();
        self.metrics.stage(stage, now.duration_since(self.since));
        self.since = now;
    }

    /// Starts the next stage without recording the time since the last one.
    fn restart(&mut self) {
        self.since = Instant::now();
    }
}
