//! Stage 3, budgets (DESIGN §3 step 6): the session's call count and wall time, and
//! repeated identical calls.
//!
//! Checked before policy and approval although DESIGN lists it after them: a session
//! over its budget is refused before a human is asked to approve a call that could not
//! run anyway, and the check is a counter read, cheaper than a policy evaluation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use super::ctx::CallCtx;
use super::ending::Rejection;
use super::{Gate, lock};
use crate::budget::{CallDigest, call_digest};
use crate::store::{Timestamp, now_millis};

/// What identifies "the same call again" for the repeated-call budget.
pub(super) struct RepeatKey(CallDigest);

impl RepeatKey {
    fn of(ctx: &CallCtx) -> Self {
        Self(call_digest(
            &ctx.principal.name,
            ctx.session.as_str(),
            &ctx.tool_use.name,
            &ctx.tool_use.input,
        ))
    }
}

type SessionKey = (String, String);

/// How long a call that the session's count puts over its budget waits for the calls
/// counted twice to be let go before it is refused (see [`Gate::check_budget`]).
const SETTLE: Duration = Duration::from_secs(1);

/// Calls of this replica that passed their session's budget and whose rows are not in
/// the store yet (a call that changes nothing is stored when it ends): the store counts
/// only the calls it holds, so these are added to its count.
#[derive(Default)]
pub(super) struct Unrecorded(Arc<Counted>);

#[derive(Default)]
struct Counted {
    sessions: Mutex<HashMap<SessionKey, (u64, Timestamp)>>,
    /// Woken whenever a slot is let go.
    released: Notify,
}

impl Unrecorded {
    /// How many there are in the session, and when the first of them was created.
    fn usage(&self, principal: &str, session: &str) -> (u64, Option<Timestamp>) {
        let key = (principal.to_owned(), session.to_owned());
        lock(&self.0.sessions)
            .get(&key)
            .map_or((0, None), |&(calls, first_at)| (calls, Some(first_at)))
    }

    /// Waits until the session holds fewer than `than` slots, or `until` has passed;
    /// whether it does.
    async fn until_fewer(
        &self,
        principal: &str,
        session: &str,
        than: u64,
        until: tokio::time::Instant,
    ) -> bool {
        loop {
            // Armed before the count is read, so that no release is missed.
            let released = self.0.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if self.usage(principal, session).0 < than {
                return true;
            }
            if tokio::time::timeout_at(until, released).await.is_err() {
                return false;
            }
        }
    }

    /// Counts one more until the returned slot is dropped; with how many were counted
    /// before it.
    pub(super) fn hold(
        &self,
        principal: &str,
        session: &str,
        created_at: Timestamp,
    ) -> (Slot, u64) {
        let key = (principal.to_owned(), session.to_owned());
        let mut map = lock(&self.0.sessions);
        let entry = map.entry(key.clone()).or_insert((0, created_at));
        let ahead = entry.0;
        entry.0 += 1;
        entry.1 = entry.1.min(created_at);
        let slot = Slot {
            counted: Arc::clone(&self.0),
            key,
        };
        (slot, ahead)
    }
}

/// One unrecorded call in its session's count; dropped once the store holds the call
/// (or the call ends without a row).
pub(super) struct Slot {
    counted: Arc<Counted>,
    key: SessionKey,
}

impl Drop for Slot {
    fn drop(&mut self) {
        {
            let mut map = lock(&self.counted.sessions);
            if let Some(entry) = map.get_mut(&self.key) {
                entry.0 = entry.0.saturating_sub(1);
                if entry.0 == 0 {
                    map.remove(&self.key);
                }
            }
        }
        self.counted.released.notify_waiters();
    }
}

impl Gate {
    pub(super) async fn check_budget(&self, ctx: &mut CallCtx) -> Result<RepeatKey, Rejection> {
        let key = RepeatKey::of(ctx);
        let over = |reason: String| Rejection::OverBudget { reason };
        if ctx.session_named {
            // The call takes its place in the count before the store is read: calls
            // checked at the same time (one request's, or several requests') each count
            // those that came before it, so together they cannot overshoot the budget.
            let (slot, ahead) =
                self.unrecorded
                    .hold(&ctx.principal.name, ctx.session.as_str(), now_millis());
            let settle_until = tokio::time::Instant::now() + SETTLE;
            loop {
                // Read before the store: a call held now and stored after the store's
                // read is then counted here; one stored before it and not let go yet
                // (its slot goes just after its write) is counted twice.
                let (running, since) = self
                    .unrecorded
                    .usage(&ctx.principal.name, ctx.session.as_str());
                let usage = self
                    .store
                    .session_usage(&ctx.principal.name, ctx.session.as_str())
                    .await
                    .map_err(|e| {
                        over(format!("the store cannot count this session's calls: {e}"))
                    })?;
                // Those ahead of it still uncounted by the store: no more than are held
                // now besides this one (one that was ahead may have been stored and let
                // go since).
                let others = ahead.min(running.saturating_sub(1));
                // An unrecorded call's creation time is when its row will say it was
                // created.
                let first_at = match (usage.first_at, since) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let now = now_millis();
                let Err(e) = self
                    .budgets
                    .check_session(usage.calls + others, first_at, now)
                else {
                    break;
                };
                // Over only with the calls held here, some of which the store may have
                // counted already: in a burst, many are stored together and let go only
                // as their tasks run again, and counting them twice refused calls the
                // session had room for. Once they are let go, the count is exact; a
                // session that is full is still refused, after at most `SETTLE`.
                let store_alone = self.budgets.check_session(usage.calls, first_at, now);
                if others == 0
                    || store_alone.is_err()
                    || !self
                        .unrecorded
                        .until_fewer(
                            &ctx.principal.name,
                            ctx.session.as_str(),
                            running,
                            settle_until,
                        )
                        .await
                {
                    return Err(over(e.to_string()));
                }
            }
            ctx.budget_slot = Some(slot);
        }
        self.budgets
            .check_repeat(&key.0)
            .map_err(|e| over(e.to_string()))?;
        Ok(key)
    }

    /// Counts a call that ran against the repeated-call budget.
    pub(super) fn record_repeat(&self, key: &RepeatKey, failed: bool) {
        self.budgets.record(&key.0, failed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unrecorded_calls_count_until_their_slots_drop() {
        let unrecorded = Unrecorded::default();
        assert_eq!(unrecorded.usage("alice", "s1"), (0, None));
        let (first, ahead) = unrecorded.hold("alice", "s1", 2_000);
        assert_eq!(ahead, 0);
        let (second, ahead) = unrecorded.hold("alice", "s1", 1_000);
        assert_eq!(ahead, 1, "counted after the first");
        let (other, ahead) = unrecorded.hold("alice", "s2", 5_000);
        assert_eq!(ahead, 0, "sessions are counted apart");
        assert_eq!(unrecorded.usage("alice", "s1"), (2, Some(1_000)));
        assert_eq!(unrecorded.usage("bob", "s1"), (0, None));
        drop(second);
        assert_eq!(unrecorded.usage("alice", "s1").0, 1);
        drop(first);
        assert_eq!(unrecorded.usage("alice", "s1"), (0, None));
        assert!(!lock(&unrecorded.0.sessions).contains_key(&("alice".into(), "s1".into())));
        assert_eq!(unrecorded.usage("alice", "s2"), (1, Some(5_000)));
        drop(other);
        assert!(
            lock(&unrecorded.0.sessions).is_empty(),
            "nothing outlives its calls"
        );
    }
}
