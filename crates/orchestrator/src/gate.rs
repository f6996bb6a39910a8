//! The gate: what happens to one tool call between a front door and a worker.
//!
//! resolve → size cap → schema → budget → policy → approval → cache → claim → dispatch,
//! each step an event in the hash-chained audit log and a state of the durable call
//! record. A call that waits for approval survives an orchestrator restart: any replica
//! resumes it after the decision, and it runs exactly once (claims are compare-and-set
//! in the store, and workers join a repeated call id to the original run).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use airlock_policy::authz::{Authorizer, CallRequest, Decision, PrincipalRef};
use airlock_policy::{CallStatus, Limits, SessionId, ToolOutcome};
use airlock_proto::v1 as pb;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::audit::{AuditKind, NewAuditEvent, redact};
use crate::auth::{Principal, Principals, Role};
use crate::budget::Budgets;
use crate::cache::ResultCache;
use crate::calls::{CallRecord, CallRegistry};
use crate::catalog::{Catalog, CatalogTool};
use crate::config::{ApprovalsConfig, AuditConfig};
use crate::dispatch::{self, DispatchError, WorkerEvent};
use crate::store::{
    Approval, ApprovalStatus, CallOutcome, CallState, NewApproval, NewCall, Store, StoredCall,
    now_millis,
};

/// How many schema violations are listed in one error result.
/// Approvals one expiry sweep transaction takes at most.
const EXPIRE_BATCH: usize = 256;

const MAX_REPORTED_VIOLATIONS: usize = 5;
/// How long a dispatch claim holds before another replica may take the call over; the
/// dispatching task renews it every third of that.
const LEASE: Duration = Duration::from_secs(15);
/// How often waiting calls look at the store (decisions made on other replicas).
const POLL: Duration = Duration::from_millis(250);
/// A call this young is left to its own task by the resume loop.
const RESUME_AFTER: Duration = Duration::from_secs(5);
/// How long a replica that lost the dispatch claim waits, once cancelled, for the
/// winner to record how the call ended.
const STOPPED_ELSEWHERE: Duration = Duration::from_secs(30);

/// One proposed call, already in domain form.
#[derive(Debug, Clone)]
pub struct ToolUse {
    pub id: String,
    pub name: String,
    pub input: Value,
}

pub struct Gate {
    pub catalog: Arc<Catalog>,
    pub calls: CallRegistry,
    pub limits: Limits,
    pub store: Arc<dyn Store>,
    pub approvals: ApprovalsConfig,
    pub budgets: Budgets,
    pub cache: ResultCache,
    pub audit_config: AuditConfig,
    /// This replica's name in dispatch claims.
    pub replica_id: String,
    pub workspaces_root: Option<std::path::PathBuf>,
    /// The principals in force (the front doors' table, reloaded on SIGHUP): an approved
    /// call is checked against them again before it runs.
    pub principals: Arc<Principals>,
    authorizer: RwLock<Arc<Authorizer>>,
    /// Woken when an approval is decided through this replica.
    decided: Notify,
    /// Remembered visibility answers (see [`Gate::is_visible`]).
    visibility: std::sync::Mutex<HashMap<VisibilityKey, bool>>,
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

/// How long a call was held for approval.
#[derive(Debug, Clone, Copy, Default)]
struct Held {
    /// Measured here (monotonic clock): taken out of the call's `duration_ms`, which is
    /// the time the call itself took.
    local: Duration,
    /// Reported as `approval_wait_ms`: from the approval's creation to its decision as
    /// the store recorded them, so every replica reports the same number.
    reported_ms: u64,
}

impl Held {
    fn new(approval: Option<&Approval>, local: Duration) -> Self {
        let from_store = approval.and_then(|a| {
            let decided = a.decided_at?;
            u64::try_from(decided.saturating_sub(a.created_at)).ok()
        });
        Self {
            local,
            reported_ms: from_store.unwrap_or(local.as_millis() as u64),
        }
    }
}

/// How a call ended, before it is recorded.
struct Ending {
    status: CallStatus,
    outcome: ToolOutcome,
    replica: Option<String>,
    /// Whether this task owns the call's outcome. A replica that lost the dispatch
    /// claim only reports what the winner recorded; it never writes an outcome.
    owned: bool,
}

impl Ending {
    fn error(status: CallStatus, message: impl Into<String>) -> Self {
        Self {
            status,
            outcome: ToolOutcome::error(message),
            replica: None,
            owned: true,
        }
    }

    fn observed(mut self) -> Self {
        self.owned = false;
        self
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

impl Gate {
    #[allow(clippy::too_many_arguments, reason = "assembled once, at start-up")]
    pub fn new(
        catalog: Arc<Catalog>,
        limits: Limits,
        store: Arc<dyn Store>,
        authorizer: Authorizer,
        approvals: ApprovalsConfig,
        budgets: Budgets,
        cache: ResultCache,
        audit_config: AuditConfig,
    ) -> Self {
        Self {
            catalog,
            calls: CallRegistry::default(),
            limits,
            store,
            approvals,
            budgets,
            cache,
            audit_config,
            replica_id: format!("orchestrator-{}", uuid::Uuid::new_v4().simple()),
            workspaces_root: None,
            principals: Arc::new(Principals::default()),
            authorizer: RwLock::new(Arc::new(authorizer)),
            decided: Notify::new(),
            visibility: std::sync::Mutex::default(),
        }
    }

    pub fn authorizer(&self) -> Arc<Authorizer> {
        match self.authorizer.read() {
            Ok(a) => a.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
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

    fn redacted(&self, tool: Option<&CatalogTool>, input: &Value) -> Value {
        let schema = tool
            .map(|t| t.definition.input_schema.clone())
            .unwrap_or(Value::Null);
        redact(input, &schema, &self.audit_config.secret_fields)
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
        let call_id = format!("call_{}", uuid::Uuid::new_v4().simple());
        let cancel = CancellationToken::new();
        let rx = self.calls.insert(
            CallRecord::running(&call_id, &tool_use.id, &tool_use.name, &principal.name),
            cancel.clone(),
        );
        let gate = self.clone();
        let principal = principal.clone();
        let session = session.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let mut held = None;
            let ending = gate
                .run(
                    &call_id,
                    &principal,
                    &session,
                    session_named,
                    &tool_use,
                    events,
                    &cancel,
                    &mut held,
                )
                .await;
            gate.conclude(
                &call_id,
                &principal.name,
                Some(session.as_str()),
                started,
                held,
                ending,
            )
            .await;
        });
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
        let call_id = format!("call_{}", uuid::Uuid::new_v4().simple());
        let mut record = CallRecord::running(&call_id, &tool_use_id, &tool, &principal.name);
        record.status = CallStatus::Error;
        record.duration_ms = Some(0);
        record.result = Some(ToolOutcome::error(message));
        record.checked = true;
        self.calls.insert(record, CancellationToken::new())
    }

    /// Records the end of a call: memory, store (once), audit. `duration_ms` is the
    /// time since `started` without the time the call was `held` for approval: a 2 ms
    /// write that waited a minute for a human reports 2 ms, and the minute separately.
    async fn conclude(
        &self,
        call_id: &str,
        principal: &str,
        session: Option<&str>,
        started: Instant,
        held: Option<Held>,
        ending: Ending,
    ) {
        let local_wait = held.map(|h| h.local).unwrap_or_default();
        let duration_ms = started.elapsed().saturating_sub(local_wait).as_millis() as u64;
        let approval_wait_ms = held.map(|h| h.reported_ms);
        let status = ending.status;
        if !ending.owned {
            // The replica that won the claim records the outcome and its audit event.
            self.calls.update(call_id, |r| {
                r.status = status;
                r.duration_ms = Some(duration_ms);
                r.approval_wait_ms = approval_wait_ms;
                r.replica = ending.replica;
                r.result = Some(ending.outcome);
                r.checked = true;
            });
            return;
        }
        let digest = hex::encode(Sha256::digest(ending.outcome.content.join("\n").as_bytes()));
        let stored = CallOutcome {
            status,
            result: serde_json::to_value(&ending.outcome).unwrap_or(Value::Null),
            duration_ms: Some(duration_ms),
            replica: ending.replica.clone(),
            finished_at: now_millis(),
        };
        match self.store.finish_call(call_id, &stored).await {
            Ok(true) | Err(crate::store::StoreError::NotFound { .. }) => {}
            // Already finished by another replica: its outcome and audit event stand.
            Ok(false) => return,
            Err(e) => tracing::error!(call_id, error = %e, "cannot record the call's outcome"),
        }
        let mut completed = json!({
            "status": status.as_str(),
            "is_error": ending.outcome.is_error,
            "duration_ms": duration_ms,
            "replica": ending.replica,
            "result_sha256": digest,
            "isolation": ending.outcome.isolation,
        });
        if let Some(ms) = approval_wait_ms {
            completed["approval_wait_ms"] = json!(ms);
        }
        self.audit(
            NewAuditEvent::new(AuditKind::Completed, completed)
                .call_id(call_id)
                .principal(principal)
                .session_id(session.map(str::to_owned)),
        )
        .await;
        tracing::info!(
            call_id,
            principal,
            status = status.as_str(),
            duration_ms,
            approval_wait_ms,
            "call finished"
        );
        self.calls.update(call_id, |r| {
            r.status = status;
            r.duration_ms = Some(duration_ms);
            r.approval_wait_ms = approval_wait_ms;
            r.replica = ending.replica;
            r.result = Some(ending.outcome);
            r.checked = true;
        });
    }

    #[allow(clippy::too_many_arguments, reason = "the call's whole context")]
    async fn run(
        &self,
        call_id: &str,
        principal: &Principal,
        session: &SessionId,
        session_named: bool,
        tool_use: &ToolUse,
        events: Option<mpsc::Sender<WorkerEvent>>,
        cancel: &CancellationToken,
        held: &mut Option<Held>,
    ) -> Ending {
        let event = |kind: AuditKind, data: Value| {
            NewAuditEvent::new(kind, data)
                .call_id(call_id)
                .principal(&principal.name)
                .session_id(Some(session.as_str().to_owned()))
        };
        // Resolve: unknown and hidden tools get the same answer (no catalog probing).
        let tool = self.visible_tool(principal, &tool_use.name);
        // Resolved and size-checked before the first audit event (DESIGN §16), so what the
        // append-only log keeps of a call does not grow with what the caller sends:
        // arguments over the cap, and any sent to a tool that does not exist (they never
        // run, and no schema says which of them are secret), are recorded as their digest
        // and size.
        let size = json_size(&tool_use.input);
        let oversized = size > self.limits.max_argument_bytes;
        // Strict-mode clients send `null` for optional fields and pairs for maps; from here
        // on (audit redaction, schema, policy, worker) the tool's own spelling is used.
        let normalized = tool.as_deref().filter(|_| !oversized).and_then(|t| {
            t.normalized_input(&tool_use.input).map(|input| ToolUse {
                input,
                ..tool_use.clone()
            })
        });
        let tool_use = normalized.as_ref().unwrap_or(tool_use);
        let mut requested =
            json!({"tool": bounded(&tool_use.name), "tool_use_id": bounded(&tool_use.id)});
        if oversized || tool.is_none() {
            requested["arguments_sha256"] = json!(hex::encode(Sha256::digest(
                crate::audit::canonical_json(&tool_use.input).as_bytes()
            )));
            requested["arguments_bytes"] = json!(size);
        } else {
            requested["arguments"] = self.redacted(tool.as_deref(), &tool_use.input);
        }
        self.audit(event(AuditKind::Requested, requested)).await;
        let Some(tool) = tool else {
            self.audit(event(
                AuditKind::Rejected,
                json!({"reason": "unknown_tool"}),
            ))
            .await;
            return Ending::error(
                CallStatus::Error,
                format!(
                    "unknown tool {:?}; list the available tools with GET /v1/tools",
                    bounded(&tool_use.name)
                ),
            );
        };
        // Size cap before the schema, so a huge argument is never walked.
        if oversized {
            self.audit(event(
                AuditKind::Rejected,
                json!({"reason": "arguments_too_large", "bytes": size}),
            ))
            .await;
            return Ending::error(
                CallStatus::Error,
                format!(
                    "arguments of {} are {size} bytes, over the limit of {} bytes; send less data per call",
                    tool_use.name, self.limits.max_argument_bytes
                ),
            );
        }
        if let Err(violations) = validate(&tool, &tool_use.input) {
            self.audit(event(
                AuditKind::RejectedSchema,
                json!({"violations": violations}),
            ))
            .await;
            return Ending::error(
                CallStatus::Error,
                format!(
                    "invalid arguments for {}: {}. Fix the arguments to match the tool's input_schema and call again",
                    tool.definition.name,
                    violations.join("; ")
                ),
            );
        }
        // Budgets.
        let repeat_key = format!(
            "{}\u{0}{}\u{0}{}\u{0}{}",
            principal.name, session, tool_use.name, tool_use.input
        );
        let budget = async {
            if session_named {
                let usage = self
                    .store
                    .session_usage(&principal.name, session.as_str())
                    .await
                    .map_err(|e| format!("the store cannot count this session's calls: {e}"))?;
                self.budgets
                    .check_session(usage.calls, usage.first_at, now_millis())
                    .map_err(|e| e.to_string())?;
            }
            self.budgets
                .check_repeat(&repeat_key)
                .map_err(|e| e.to_string())
        };
        if let Err(message) = budget.await {
            self.audit(event(AuditKind::BudgetExceeded, json!({"reason": message})))
                .await;
            return Ending::error(CallStatus::Error, message);
        }
        // Policy.
        let roles = role_names(principal);
        let workspace = self
            .workspaces_root
            .as_ref()
            .map(|root| root.join(&principal.name).join(session.as_str()));
        let decision = self.authorizer().decide(&CallRequest {
            principal: &principal.name,
            roles: &roles,
            tool: &tool.definition,
            arguments: &tool_use.input,
            session_id: session.as_str(),
            workspace: workspace.as_deref(),
        });
        if let Decision::Deny { reasons } = &decision {
            self.audit(event(AuditKind::Denied, json!({"reasons": reasons})))
                .await;
            return Ending::error(
                CallStatus::Denied,
                format!("denied by policy: {}", reasons.join("; ")),
            );
        }
        // Cache (read-only, idempotent tools only).
        let cache_key = self.cache.key(
            &tool.definition,
            &principal.name,
            session.as_str(),
            &tool_use.input,
        );
        let new_call = |state| NewCall {
            call_id: call_id.to_owned(),
            tool_use_id: tool_use.id.clone(),
            tool: tool_use.name.clone(),
            input: tool_use.input.clone(),
            principal: principal.name.clone(),
            session_id: Some(session.as_str().to_owned()),
            state,
            created_at: now_millis(),
        };
        if let Some(hit) = cache_key
            .as_ref()
            .and_then(|k| self.cache.get(&tool.definition.name, k))
        {
            // Recorded like any call: it counts against the session and can be fetched.
            if let Err(e) = self.store.insert_call(new_call(CallState::Approved)).await {
                return Ending::error(
                    CallStatus::Error,
                    format!("the store cannot record the call: {e}"),
                );
            }
            self.audit(event(AuditKind::CacheHit, json!({}))).await;
            return Ending {
                status: CallStatus::Ok,
                outcome: hit,
                replica: None,
                owned: true,
            };
        }
        // Approval.
        let approved = if let Decision::RequireApproval { reasons } = &decision {
            match self
                .await_approval(
                    call_id,
                    new_call(CallState::PendingApproval),
                    reasons,
                    cancel,
                    held,
                )
                .await
            {
                Ok(()) => true,
                Err(ending) => return ending,
            }
        } else {
            if let Err(e) = self.store.insert_call(new_call(CallState::Approved)).await {
                return Ending::error(
                    CallStatus::Error,
                    format!("the store cannot record the call: {e}"),
                );
            }
            false
        };
        self.calls.update(call_id, |r| r.checked = true);
        let ending = self
            .dispatch_claimed(
                call_id,
                &tool,
                principal,
                session.as_str(),
                &tool_use.input,
                events,
                cancel,
                approved,
                approved.then_some("dispatch"),
            )
            .await;
        self.budgets.record(&repeat_key, ending.outcome.is_error);
        if let (Some(key), CallStatus::Ok) = (cache_key, ending.status) {
            self.cache.put(key, &ending.outcome);
        }
        ending
    }

    /// Creates the durable pending approval and waits for its decision (taken on any
    /// replica), its expiry, or the caller's cancellation; `held` is how long it waited.
    async fn await_approval(
        &self,
        call_id: &str,
        call: NewCall,
        reasons: &[String],
        cancel: &CancellationToken,
        held: &mut Option<Held>,
    ) -> Result<(), Ending> {
        let since = Instant::now();
        let approval_id = format!("apr_{}", uuid::Uuid::new_v4().simple());
        let now = now_millis();
        let expires_at = now
            + i64::try_from(self.approvals.timeout_seconds.saturating_mul(1000))
                .unwrap_or(i64::MAX);
        let principal = call.principal.clone();
        let session = call.session_id.clone();
        let created = self
            .store
            .create_approval(NewApproval {
                approval_id: approval_id.clone(),
                call,
                created_at: now,
                expires_at,
            })
            .await;
        if let Err(e) = created {
            return Err(Ending::error(
                CallStatus::Error,
                format!("the store cannot record the pending approval: {e}"),
            ));
        }
        self.calls.update(call_id, |r| {
            r.status = CallStatus::PendingApproval;
            r.approval_id = Some(approval_id.clone());
            r.checked = true;
        });
        self.audit(
            NewAuditEvent::new(AuditKind::PendingApproval, json!({"approval_id": approval_id, "reasons": reasons, "expires_at": crate::store::rfc3339(expires_at)}))
                .call_id(call_id)
                .principal(&principal)
                .session_id(session),
        )
        .await;
        loop {
            match self.store.get_approval(&approval_id).await {
                Ok(Some(a)) => match a.status {
                    ApprovalStatus::Pending if a.expires_at <= now_millis() => {
                        let _ = self.expire_sweep().await;
                    }
                    ApprovalStatus::Pending => {}
                    ApprovalStatus::Approved => {
                        let waited = Held::new(Some(&a), since.elapsed());
                        *held = Some(waited);
                        self.calls.update(call_id, |r| {
                            r.status = CallStatus::Running;
                            r.approval_wait_ms = Some(waited.reported_ms);
                        });
                        return Ok(());
                    }
                    ApprovalStatus::Denied => {
                        *held = Some(Held::new(Some(&a), since.elapsed()));
                        let by = a.decided_by.unwrap_or_default();
                        let reason = a.reason.map(|r| format!(": {r}")).unwrap_or_default();
                        return Err(Ending::error(
                            CallStatus::Denied,
                            format!("the approval was denied by {by}{reason}"),
                        ));
                    }
                    ApprovalStatus::Expired => {
                        *held = Some(Held::new(Some(&a), since.elapsed()));
                        return Err(Ending::error(
                            CallStatus::Denied,
                            "the approval expired before anyone decided; ask an approver and call again",
                        ));
                    }
                },
                Ok(None) => {
                    *held = Some(Held::new(None, since.elapsed()));
                    return Err(Ending::error(
                        CallStatus::Error,
                        "the pending approval disappeared from the store",
                    ));
                }
                Err(e) => tracing::warn!(error = %e, "cannot read the approval; retrying"),
            }
            tokio::select! {
                _ = cancel.cancelled() => {
                    // Withdraw the request so that a later approval cannot run it.
                    let withdrawn = self.store.decide_approval(&approval_id, false, "system:cancelled", Some("the caller cancelled the call"), now_millis()).await;
                    *held = Some(Held::new(withdrawn.as_ref().ok(), since.elapsed()));
                    self.audit(NewAuditEvent::new(AuditKind::ApprovalWithdrawn, json!({"approval_id": approval_id})).call_id(call_id)).await;
                    return Err(Ending::error(CallStatus::Cancelled, "the call was cancelled while it waited for approval"));
                }
                _ = self.decided.notified() => {}
                _ = tokio::time::sleep(POLL) => {}
            }
        }
    }

    /// Claims the call (exactly one replica wins) and runs it on a worker; a loser waits
    /// for the winner's outcome in the store. With `recheck` (the stage's name), the
    /// winner first checks the call against the principals and the policy in force now
    /// ([`Gate::reauthorize`]): an approval granted to a principal that has since lost
    /// the right does not run.
    #[allow(clippy::too_many_arguments, reason = "the call's whole context")]
    async fn dispatch_claimed(
        &self,
        call_id: &str,
        tool: &CatalogTool,
        principal: &Principal,
        session: &str,
        input: &Value,
        events: Option<mpsc::Sender<WorkerEvent>>,
        cancel: &CancellationToken,
        durable: bool,
        recheck: Option<&'static str>,
    ) -> Ending {
        let lease_until = || now_millis() + LEASE.as_millis() as i64;
        let group = self.catalog.group(&tool.group);
        match self
            .store
            .claim_for_dispatch(call_id, &self.replica_id, now_millis(), lease_until())
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                return self
                    .await_stored_outcome(call_id, group.as_deref(), cancel)
                    .await;
            }
            Err(e) => {
                return Ending::error(
                    CallStatus::Error,
                    format!("the store cannot claim the call: {e}"),
                );
            }
        }
        // After the claim, so that exactly one replica decides whether the call runs.
        if let Some(stage) = recheck
            && let Err(reasons) =
                self.reauthorize(&principal.name, &tool.definition.name, session, input)
        {
            self.audit(
                NewAuditEvent::new(
                    AuditKind::Revoked,
                    json!({"stage": stage, "reasons": reasons}),
                )
                .call_id(call_id)
                .principal(&principal.name)
                .session_id(Some(session.to_owned())),
            )
            .await;
            return Ending::error(
                CallStatus::Denied,
                format!(
                    "denied: the approved call was checked again before it ran, and {}",
                    reasons.join("; ")
                ),
            );
        }
        let Some(group) = group else {
            return Ending::error(
                CallStatus::Error,
                format!("no worker group serves {}", tool.definition.name),
            );
        };
        self.audit(
            NewAuditEvent::new(
                AuditKind::Dispatched,
                json!({"group": tool.group, "claimant": self.replica_id, "durable": durable}),
            )
            .call_id(call_id)
            .principal(&principal.name)
            .session_id(Some(session.to_owned())),
        )
        .await;
        let timeout_ms = self.call_timeout_ms(input);
        let request = pb::ExecuteRequest {
            call_id: call_id.to_owned(),
            tool: tool.definition.name.clone(),
            arguments_json: input.to_string(),
            principal: principal.name.clone(),
            session_id: session.to_owned(),
            timeout_ms,
            trace_context: Default::default(),
            // An approved call must not be lost with this replica: the worker keeps
            // running it, and a replica that resumes it joins the same run.
            detached: durable,
        };
        let renewing = CancellationToken::new();
        let renew = {
            let store = self.store.clone();
            let (call_id, me, stop) = (
                call_id.to_owned(),
                self.replica_id.clone(),
                renewing.clone(),
            );
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(LEASE / 3) => {
                            let _ = store.renew_lease(&call_id, &me, now_millis() + LEASE.as_millis() as i64).await;
                        }
                    }
                }
            })
        };
        let result = dispatch::execute(&group, request, events, cancel).await;
        renewing.cancel();
        let _ = renew.await;
        match result {
            Ok(done) => {
                let status = match (done.outcome.timed_out, done.outcome.is_error) {
                    (true, _) => CallStatus::Timeout,
                    (false, true) => CallStatus::Error,
                    (false, false) => CallStatus::Ok,
                };
                Ending {
                    status,
                    outcome: done.outcome,
                    replica: Some(done.replica),
                    owned: true,
                }
            }
            Err(e @ DispatchError::DeadlineExceeded { .. }) => {
                Ending::error(CallStatus::Timeout, e.to_string())
            }
            Err(e @ DispatchError::Cancelled) => {
                Ending::error(CallStatus::Cancelled, e.to_string())
            }
            Err(e) => Ending::error(CallStatus::Error, e.to_string()),
        }
    }

    /// Waits until another replica records the call's outcome. Cancelled, it asks the
    /// tool's workers to stop the call (only they know where it runs) and goes on
    /// waiting for that outcome, so that this replica never reports a call cancelled
    /// while it may still run elsewhere.
    async fn await_stored_outcome(
        &self,
        call_id: &str,
        group: Option<&crate::catalog::WorkerGroup>,
        cancel: &CancellationToken,
    ) -> Ending {
        let mut gave_up_at = None;
        loop {
            if let Ok(Some(stored)) = self.store.get_call(call_id).await
                && let Some(ending) = stored_ending(&stored)
            {
                return ending;
            }
            if gave_up_at.is_some_and(|at: Instant| at.elapsed() > STOPPED_ELSEWHERE) {
                return Ending::error(
                    CallStatus::Error,
                    format!(
                        "the call was cancelled, and the replica running it has not recorded how it ended; GET /v1/calls/{call_id} later shows its outcome"
                    ),
                )
                .observed();
            }
            tokio::select! {
                _ = cancel.cancelled(), if gave_up_at.is_none() => {
                    gave_up_at = Some(Instant::now());
                    if let Some(group) = group {
                        dispatch::cancel_everywhere(group, call_id).await;
                    }
                }
                _ = tokio::time::sleep(POLL) => {}
            }
        }
    }

    /// Checks an approved call again against the principals and the policy in force
    /// now: its principal must still be configured with the agent role, its tool still
    /// in the catalog, and the policy must not deny it (needing approval is fine: it
    /// has been approved). `Err` holds why not, for the audit and the caller.
    pub(crate) fn reauthorize(
        &self,
        principal: &str,
        tool: &str,
        session: &str,
        input: &Value,
    ) -> Result<(), Vec<String>> {
        let Some(current) = self.principals.by_name(principal) else {
            return Err(vec![format!(
                "principal {principal:?} is no longer configured"
            )]);
        };
        if !current.has(Role::Agent) {
            return Err(vec![format!(
                "principal {principal:?} no longer has the agent role"
            )]);
        }
        let Some(tool) = self.catalog.get(tool) else {
            return Err(vec![format!("tool {tool:?} is no longer in the catalog")]);
        };
        let roles = role_names(&current);
        let workspace = self
            .workspaces_root
            .as_ref()
            .map(|root| root.join(principal).join(session));
        let decision = self.authorizer().decide(&CallRequest {
            principal,
            roles: &roles,
            tool: &tool.definition,
            arguments: input,
            session_id: session,
            workspace: workspace.as_deref(),
        });
        match decision {
            Decision::Deny { reasons } => Err(reasons
                .into_iter()
                .map(|r| format!("the policy in force denies it: {r}"))
                .collect()),
            Decision::Allow | Decision::RequireApproval { .. } => Ok(()),
        }
    }

    /// Cancels a call this replica holds no task for (another replica's, or one only
    /// the store knows): a pending approval is withdrawn, a dispatched call is stopped
    /// on its worker. The replica running it records how it ended.
    pub async fn cancel_elsewhere(&self, call_id: &str) {
        let Ok(Some(stored)) = self.store.get_call(call_id).await else {
            return;
        };
        match stored.state {
            CallState::PendingApproval => {
                let Some(approval_id) = stored.approval_id else {
                    return;
                };
                let withdrawn = self
                    .store
                    .decide_approval(
                        &approval_id,
                        false,
                        "system:cancelled",
                        Some("the caller cancelled the call"),
                        now_millis(),
                    )
                    .await;
                if withdrawn.is_ok() {
                    self.audit(
                        NewAuditEvent::new(
                            AuditKind::ApprovalWithdrawn,
                            json!({"approval_id": approval_id}),
                        )
                        .call_id(call_id),
                    )
                    .await;
                    self.notify_decided();
                }
            }
            CallState::Approved | CallState::Dispatched => {
                let group = self
                    .catalog
                    .get(&stored.tool)
                    .and_then(|tool| self.catalog.group(&tool.group));
                if let Some(group) = group {
                    dispatch::cancel_everywhere(&group, call_id).await;
                }
            }
            CallState::Finished | CallState::Rejected => {}
        }
    }

    /// The deadline the worker enforces: the call's own `timeout_seconds` when the tool
    /// takes one (plus a second for set-up), else the default; never above the maximum.
    fn call_timeout_ms(&self, input: &Value) -> u64 {
        let requested = input
            .get("timeout_seconds")
            .and_then(Value::as_f64)
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(|s| (s * 1000.0) as u64 + 1000);
        requested
            .unwrap_or(self.limits.default_call_timeout_ms)
            .min(self.limits.max_call_timeout_ms)
    }

    pub fn default_wait(&self) -> Duration {
        Duration::from_millis(self.limits.default_wait_ms)
    }

    /// How long an MCP request waits on a call held for approval (`[limits] mcp_wait_ms`).
    pub fn mcp_wait(&self) -> Duration {
        Duration::from_millis(self.limits.mcp_wait_ms.min(crate::wire::MAX_WAIT_MS))
    }

    /// Marks overdue approvals expired and audits each (once, across replicas).
    pub async fn expire_sweep(&self) -> Result<(), crate::store::StoreError> {
        let now = now_millis();
        // In batches, so that a sweep after a long outage holds a bounded number of
        // rows, never every overdue approval at once.
        loop {
            let batch = self.store.expire_approvals(now, EXPIRE_BATCH).await?;
            let full = batch.len() >= EXPIRE_BATCH;
            for approval in batch {
                self.audit(
                    NewAuditEvent::new(
                        AuditKind::Expired,
                        json!({"approval_id": approval.approval_id}),
                    )
                    .call_id(approval.call_id)
                    .principal(approval.principal)
                    .session_id(approval.session_id),
                )
                .await;
            }
            self.notify_decided();
            if !full {
                return Ok(());
            }
        }
    }

    /// Resumes calls that no live task will finish: approved while their orchestrator
    /// was down, or dispatched by a replica whose lease ran out.
    pub async fn resume_forever(self: Arc<Self>, stop: CancellationToken) {
        loop {
            if let Err(e) = self.expire_sweep().await {
                tracing::warn!(error = %e, "cannot expire approvals");
            }
            match self.store.resumable_calls(now_millis()).await {
                Ok(calls) => {
                    let cutoff = now_millis() - RESUME_AFTER.as_millis() as i64;
                    for call in calls.into_iter().filter(|c| c.created_at < cutoff) {
                        if self
                            .calls
                            .watch(&call.call_id)
                            .is_some_and(|r| !r.borrow().status.is_final())
                        {
                            continue; // a task of this replica is on it
                        }
                        let gate = self.clone();
                        tokio::spawn(async move { gate.resume(call).await });
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot list resumable calls"),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
        }
    }

    async fn resume(self: Arc<Self>, call: StoredCall) {
        let Some(tool) = self.catalog.get(&call.tool) else {
            return;
        };
        let principal = Principal {
            name: call.principal.clone(),
            roles: Vec::new(),
        };
        let cancel = CancellationToken::new();
        let mut record = CallRecord::running(
            &call.call_id,
            &call.tool_use_id,
            &call.tool,
            &call.principal,
        );
        record.approval_id = call.approval_id.clone();
        record.checked = true;
        self.calls.insert(record, cancel.clone());
        self.audit(
            NewAuditEvent::new(AuditKind::Resumed, json!({"state": call.state.as_str()}))
                .call_id(call.call_id.clone()),
        )
        .await;
        let session = call
            .session_id
            .clone()
            .unwrap_or_else(|| SessionId::DEFAULT.to_owned());
        // The wait was on another task (or before a restart): only the store knows it.
        let held = match &call.approval_id {
            Some(id) => match self.store.get_approval(id).await {
                Ok(Some(a)) => Some(Held::new(Some(&a), Duration::ZERO)),
                _ => None,
            },
            None => None,
        };
        let started = Instant::now();
        // A call that never reached a worker is checked again like a fresh dispatch; one
        // that did is joined on its worker, where it started while it was allowed.
        let recheck = (call.state == CallState::Approved).then_some("resume");
        let ending = self
            .dispatch_claimed(
                &call.call_id,
                &tool,
                &principal,
                &session,
                &call.input,
                None,
                &cancel,
                true,
                recheck,
            )
            .await;
        self.conclude(
            &call.call_id,
            &call.principal,
            Some(&session),
            started,
            held,
            ending,
        )
        .await;
    }

    /// A call known only to the store (another replica's, or from before a restart).
    pub async fn stored_record(&self, call_id: &str) -> Option<CallRecord> {
        let stored = self.store.get_call(call_id).await.ok()??;
        let mut record = CallRecord::running(
            &stored.call_id,
            &stored.tool_use_id,
            &stored.tool,
            &stored.principal,
        );
        record.approval_id = stored.approval_id.clone();
        record.duration_ms = stored.duration_ms;
        record.replica = stored.replica.clone();
        record.checked = true;
        if let Some(id) = &stored.approval_id
            && let Ok(Some(approval)) = self.store.get_approval(id).await
            && approval.decided_at.is_some()
        {
            record.approval_wait_ms = Some(Held::new(Some(&approval), Duration::ZERO).reported_ms);
        }
        match stored_ending(&stored) {
            Some(ending) => {
                record.status = ending.status;
                record.result = Some(ending.outcome);
            }
            None if stored.state == CallState::PendingApproval => {
                record.status = CallStatus::PendingApproval
            }
            None => {}
        }
        Some(record)
    }
}

/// The final outcome a stored call holds, if it is finished or rejected.
fn stored_ending(stored: &StoredCall) -> Option<Ending> {
    match stored.state {
        CallState::Finished => {
            let outcome: ToolOutcome = stored
                .result
                .clone()
                .and_then(|v| serde_json::from_value(v).ok())
                .unwrap_or_else(|| ToolOutcome::error("the stored result is unreadable"));
            // A finished row always has its final status (one update writes both); the
            // store refuses a row whose status it cannot name.
            let status = stored
                .status
                .filter(|status| status.is_final())
                .unwrap_or(CallStatus::Error);
            Some(Ending {
                status,
                outcome,
                replica: stored.replica.clone(),
                owned: false,
            })
        }
        CallState::Rejected => Some(
            Ending::error(
                CallStatus::Denied,
                "the call was denied or its approval expired",
            )
            .observed(),
        ),
        _ => None,
    }
}

/// Checks `input` against the tool's schema; each violation names the field and rule so
/// the model can correct itself.
fn validate(tool: &CatalogTool, input: &Value) -> Result<(), Vec<String>> {
    if !input.is_object() {
        return Err(vec![format!(
            "input of {} must be a JSON object",
            tool.definition.name
        )]);
    }
    let violations: Vec<String> = tool
        .validator
        .iter_errors(input)
        .take(MAX_REPORTED_VIOLATIONS)
        .map(|e| {
            let at = e.instance_path().to_string();
            let field = if at.is_empty() {
                "(arguments)".to_owned()
            } else {
                at
            };
            let schema_path = e.schema_path().to_string();
            let rule = schema_path
                .rsplit('/')
                .next()
                .unwrap_or_default()
                .to_owned();
            format!("{field}: {e} (rule: {rule})")
        })
        .collect();
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations)
    }
}

/// The length of `value`'s compact JSON text, counted without building the text.
fn json_size(value: &Value) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    match serde_json::to_writer(&mut count, value) {
        Ok(()) => count.0,
        Err(_) => u64::MAX,
    }
}

/// A caller-chosen name or id as the audit log records it: at most 256 characters (what
/// HTTP and gRPC accept), so no front door can make one event large.
fn bounded(text: &str) -> String {
    text.chars().take(256).collect()
}
