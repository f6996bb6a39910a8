//! Stage 7, the claim: exactly one replica dispatches a call (compare-and-set in the
//! store). A replica that loses waits for the winner's outcome instead.

use std::time::{Duration, Instant};

use airlock_policy::CallStatus;

use super::Gate;
use super::ctx::CallCtx;
use super::ending::{Ending, Rejection};
use super::resume::stored_ending;
use crate::audit::NewAuditEvent;
use crate::catalog::WorkerGroup;
use crate::dispatch;
use crate::store::{CallChange, CallWrite, now_millis};

/// How long a dispatch claim holds before another replica may take the call over; the
/// dispatching task renews it every third of that.
pub(super) const LEASE: Duration = Duration::from_secs(15);
/// How often a replica that lost the claim looks for the winner's outcome.
const POLL: Duration = Duration::from_millis(250);
/// How long a replica that lost the dispatch claim waits, once cancelled, for the
/// winner to record how the call ended.
const STOPPED_ELSEWHERE: Duration = Duration::from_secs(30);

/// Who dispatches the call.
pub(super) enum Claim {
    /// This replica: go on to dispatch.
    Won,
    /// Another replica ran it; this is how it ended there.
    Lost(Ending),
}

/// The end of this replica's lease, if it claims or renews now.
pub(super) fn lease_until() -> i64 {
    now_millis() + LEASE.as_millis() as i64
}

impl Gate {
    /// Claims a call the store holds (approved after a wait, or resumed), writing the
    /// events it gathered in the same transaction.
    pub(super) async fn claim(
        &self,
        ctx: &mut CallCtx,
        group: Option<&WorkerGroup>,
    ) -> Result<Claim, Rejection> {
        let claimed = self
            .write_call(CallWrite {
                events: ctx.journal.clone(),
                change: CallChange::Claim {
                    call_id: crate::store::CallId::from(&ctx.call_id),
                    claimant: self.replica_id.clone(),
                    now: now_millis(),
                    lease_until: lease_until(),
                },
                then: Vec::new(),
            })
            .await
            .map_err(|error| Rejection::Store {
                doing: "claim the call",
                error,
            })?;
        ctx.journal.clear();
        if claimed {
            return Ok(Claim::Won);
        }
        Ok(Claim::Lost(self.await_stored_outcome(ctx, group).await))
    }

    /// Writes a fresh call that may change something before a worker runs it: its
    /// events so far (its request and dispatch), its row approved and claimed by this
    /// replica, in one transaction. After a crash the log shows that it was sent to a
    /// worker, and the resume loop finds its lapsed claim.
    pub(super) async fn write_ahead(
        &self,
        ctx: &mut CallCtx,
        dispatched: NewAuditEvent,
    ) -> Result<(), Rejection> {
        let Some(row) = ctx.row.take() else {
            // Already stored: the dispatch goes with its next write.
            ctx.journal.push(dispatched);
            return Ok(());
        };
        let written = self
            .write_call(CallWrite {
                events: ctx.journal.clone(),
                change: CallChange::InsertClaimed {
                    call: row.call.clone(),
                    claimant: self.replica_id.clone(),
                    lease_until: lease_until(),
                },
                then: vec![dispatched],
            })
            .await;
        match written {
            Ok(_) => {
                ctx.journal.clear();
                ctx.recorded = true;
                // Dropping the row's slot: the store counts the call now.
                drop(row);
                Ok(())
            }
            Err(error) => {
                // Not run; the ending writes the row and the events once.
                ctx.row = Some(row);
                Err(Rejection::Store {
                    doing: "record the call",
                    error,
                })
            }
        }
    }

    /// Waits until another replica records the call's outcome. Cancelled, it asks the
    /// tool's workers to stop the call (only they know where it runs) and goes on
    /// waiting for that outcome, so that this replica never reports a call cancelled
    /// while it may still run elsewhere.
    async fn await_stored_outcome(&self, ctx: &CallCtx, group: Option<&WorkerGroup>) -> Ending {
        let call_id = ctx.call_id.as_str();
        let mut gave_up_at = None;
        loop {
            if let Ok(Some(stored)) = self.store.get_call(&call_id.into()).await
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
                _ = ctx.cancel.cancelled(), if gave_up_at.is_none() => {
                    gave_up_at = Some(Instant::now());
                    if let Some(group) = group {
                        dispatch::cancel_everywhere(group, call_id).await;
                    }
                }
                _ = tokio::time::sleep(POLL) => {}
            }
        }
    }
}
