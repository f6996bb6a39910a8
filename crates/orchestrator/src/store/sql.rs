//! The SQL both engines write alike: conditions on a call's state and claim, with the
//! parameters bound through each engine's own placeholders (`$1` in PostgreSQL, `?1` in
//! SQLite).

use super::CallState;
use super::Timestamp;
use super::machine::{CallFilter, States};

/// Where an engine keeps a statement's parameters: each call binds a value and answers
/// its placeholder.
pub(super) trait Placeholders {
    fn timestamp(&mut self, value: Timestamp) -> String;
    fn text(&mut self, value: String) -> String;
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
    if let Some(holder) = filter.held_by {
        conds.push(format!("claimed_by = {}", binds.text(holder.to_owned())));
    }
    (!conds.is_empty()).then(|| conds.join(" AND "))
}
