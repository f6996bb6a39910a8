//! Stage 3, budgets (DESIGN §3 step 6): the session's call count and wall time, and
//! repeated identical calls.
//!
//! Checked before policy and approval although DESIGN lists it after them: a session
//! over its budget is refused before a human is asked to approve a call that could not
//! run anyway, and the check is a counter read, cheaper than a policy evaluation.

use super::Gate;
use super::ctx::CallCtx;
use super::ending::Rejection;
use crate::store::now_millis;

/// What identifies "the same call again" for the repeated-call budget.
pub(super) struct RepeatKey(String);

impl Gate {
    pub(super) async fn check_budget(&self, ctx: &CallCtx) -> Result<RepeatKey, Rejection> {
        let key = RepeatKey(format!(
            "{}\u{0}{}\u{0}{}\u{0}{}",
            ctx.principal.name, ctx.session, ctx.tool_use.name, ctx.tool_use.input
        ));
        let over = |reason: String| Rejection::OverBudget { reason };
        if ctx.session_named {
            let usage = self
                .store
                .session_usage(&ctx.principal.name, ctx.session.as_str())
                .await
                .map_err(|e| over(format!("the store cannot count this session's calls: {e}")))?;
            self.budgets
                .check_session(usage.calls, usage.first_at, now_millis())
                .map_err(|e| over(e.to_string()))?;
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
