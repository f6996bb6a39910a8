//! The SQL both engines write alike: conditions on a call's state and claim, with the
//! parameters bound through each engine's own placeholders (`$1` in PostgreSQL, `?1` in
//! SQLite).

use super::machine::{CallFilter, CallMove, CallSet, States};
use super::{CallState, Timestamp, to_i64, to_json_text};

/// Where an engine keeps a statement's parameters: each call binds a value and answers
/// its placeholder.
pub(super) trait Placeholders {
    fn timestamp(&mut self, value: Timestamp) -> String;
    fn text(&mut self, value: String) -> String;
    fn maybe_integer(&mut self, value: Option<i64>) -> String;
    fn maybe_text(&mut self, value: Option<String>) -> String;
}

/// `state = 'a'`, `state IN ('a', 'b')`: the names are `CallState::as_str`, never input.
pub(super) fn states_sql(states: States) -> Option<String> {
    match states {
        States::Any => None,
        States::In([]) => Some("FALSE".to_owned()),
        States::In([one]) => Some(format!("state = '{}'", one.as_str())),
        States::In(many) => {
            let names: Vec<String> = many.iter().map(|s| format!("'{}'", s.as_str())).collect();
            Some(format!("state IN ({})", names.join(", ")))
        }
        States::Not(state) => Some(format!("state <> '{}'", state.as_str())),
    }
}

/// The condition of a [`CallFilter`], or `None` when it takes every call.
pub(super) fn filter_sql(filter: &CallFilter<'_>, binds: &mut impl Placeholders) -> Option<String> {
    let mut conds = Vec::new();
    // Any state already takes a lapsed claim.
    if let Some(states) = states_sql(filter.states) {
        match filter.or_lapsed_at {
            Some(at) => conds.push(format!(
                "({states} OR (state = '{}' AND (lease_until IS NULL OR lease_until <= {})))",
                CallState::Dispatched.as_str(),
                binds.timestamp(at)
            )),
            None => conds.push(states),
        }
    }
    // The condition of the partial index `calls_open`, so that a statement on calls not
    // finished may use it (`States::Not(Finished)` is that condition already).
    if let States::In(states) = filter.states
        && !states.contains(&CallState::Finished)
    {
        conds.push(format!("state <> '{}'", CallState::Finished.as_str()));
    }
    if let Some(holder) = filter.held_by {
        conds.push(format!("claimed_by = {}", binds.text(holder.to_owned())));
    }
    (!conds.is_empty()).then(|| conds.join(" AND "))
}

/// `UPDATE calls SET …` for a move: one statement, which the engine re-checks against a
/// row a concurrent writer changed, so of racing movers at most one moves the call.
pub(super) fn move_call_sql(mv: &CallMove<'_>, binds: &mut impl Placeholders) -> String {
    let mut set = vec![format!("state = {}", binds.text(mv.to.as_str().to_owned()))];
    match mv.set {
        CallSet::State => {}
        CallSet::Approval(id) => {
            set.push(format!(
                "approval_id = {}",
                binds.text(id.as_str().to_owned())
            ));
        }
        CallSet::Claim {
            claimant,
            lease_until,
        } => {
            set.push(format!("claimed_by = {}", binds.text(claimant.to_owned())));
            set.push(format!("lease_until = {}", binds.timestamp(lease_until)));
        }
        CallSet::Lease(lease_until) => {
            set.push(format!("lease_until = {}", binds.timestamp(lease_until)));
        }
        CallSet::Outcome(outcome) => {
            set.push(format!(
                "status = {}",
                binds.text(outcome.status.as_str().to_owned())
            ));
            set.push(format!(
                "result = {}",
                binds.text(to_json_text(&outcome.result))
            ));
            let duration = outcome.duration_ms.map(to_i64);
            set.push(format!("duration_ms = {}", binds.maybe_integer(duration)));
            set.push(format!(
                "replica = {}",
                binds.maybe_text(outcome.replica.clone())
            ));
            set.push(format!(
                "finished_at = {}",
                binds.timestamp(outcome.finished_at)
            ));
        }
    }
    let call_id = binds.text(mv.call_id.as_str().to_owned());
    let mut sql = format!(
        "UPDATE calls SET {} WHERE call_id = {call_id}",
        set.join(", ")
    );
    if let Some(cond) = filter_sql(&mv.from, binds) {
        sql.push_str(" AND ");
        sql.push_str(&cond);
    }
    sql
}

/// `UPDATE calls SET result = NULL …` for the results of calls finished before
/// `before` (`[store] retention_days`): the row, its status and digest-bearing audit
/// events stay. The calls due are found through the partial index `calls_unpruned`.
pub(super) fn prune_results_sql(before: Timestamp, binds: &mut impl Placeholders) -> String {
    format!(
        "UPDATE calls SET result = NULL WHERE state = '{}' AND result IS NOT NULL AND finished_at < {}",
        CallState::Finished.as_str(),
        binds.timestamp(before)
    )
}
