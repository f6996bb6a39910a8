//! Stage 8, dispatch (DESIGN §3 step 7): the claimed call runs on a replica of its
//! tool's worker, with a deadline the worker enforces, while this task keeps its claim
//! alive.

use airlock_policy::CallStatus;
use airlock_telemetry::StageParent;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::Gate;
use super::claim::{LEASE, lease_until};
use super::ctx::CallCtx;
use super::ending::{Ending, Rejection};
use crate::audit::{AuditKind, NewAuditEvent};
use crate::catalog::WorkerGroup;
use crate::dispatch::{self, WorkerCall};

impl Gate {
    /// The `dispatched` event of a call about to run on `group`.
    pub(super) fn dispatched_event(
        &self,
        ctx: &CallCtx,
        group: &WorkerGroup,
        durable: bool,
    ) -> NewAuditEvent {
        ctx.event(
            AuditKind::Dispatched,
            json!({"group": group.name, "claimant": self.replica_id, "durable": durable}),
        )
    }

    /// Runs the call on `group`. `durable` (an approved call) asks the worker to keep
    /// it running if this replica goes away, so that a replica that resumes it joins
    /// the same run.
    pub(super) async fn dispatch(
        &self,
        ctx: &CallCtx,
        group: &WorkerGroup,
        durable: bool,
        trace: &StageParent,
    ) -> Result<Ending, Rejection> {
        let call = WorkerCall {
            call_id: ctx.call_id.clone(),
            tool: ctx.tool_use.name.clone(),
            input: &ctx.tool_use.input,
            principal: ctx.principal.name.clone(),
            session_id: ctx.session.as_str().to_owned(),
            timeout_ms: self.call_timeout_ms(&ctx.tool_use.input),
            detached: durable,
            retryable: self.is_retryable(&ctx.tool_use.name),
            trace,
        };
        // Only a stored call has a claim to keep alive.
        let renewal = ctx.recorded.then(|| self.renew_lease(&ctx.call_id));
        let result = dispatch::execute(group, call, ctx.events.clone(), &ctx.cancel).await;
        if let Some(renewal) = renewal {
            renewal.stop().await;
        }
        let done = result?;
        let status = match (done.outcome.timed_out, done.outcome.is_error) {
            (true, _) => CallStatus::Timeout,
            (false, true) => CallStatus::Error,
            (false, false) => CallStatus::Ok,
        };
        Ok(Ending::produced(status, done.outcome, Some(done.replica)))
    }

    /// Renews this replica's claim on `call_id` every third of the lease until
    /// [`LeaseRenewal::stop`].
    fn renew_lease(&self, call_id: &str) -> LeaseRenewal {
        let stop = CancellationToken::new();
        let store = self.store.clone();
        let (call_id, me, stopped) = (call_id.to_owned(), self.replica_id.clone(), stop.clone());
        let call_id = crate::store::CallId::from(call_id);
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stopped.cancelled() => return,
                    _ = tokio::time::sleep(LEASE / 3) => {
                        let _ = store.renew_lease(&call_id, &me, lease_until()).await;
                    }
                }
            }
        });
        LeaseRenewal { stop, task }
    }

    /// Whether a call of `tool` may run once more on another replica when its replica
    /// failed before answering: only a tool that changes nothing and gives the same
    /// answer twice.
    fn is_retryable(&self, tool: &str) -> bool {
        self.catalog.get(tool).is_some_and(|t| {
            let hints = t.definition.annotations;
            hints.read_only && hints.idempotent && !hints.destructive
        })
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
}

/// The task that keeps a dispatch claim alive.
struct LeaseRenewal {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseRenewal {
    /// Stops renewing; no renewal is in flight once this returns.
    async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}
