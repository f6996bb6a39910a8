//! What the store keeps of results, and for how long (`[store]`, DESIGN §15): one
//! result is cut to `max_result_bytes` when it is stored, and results older than
//! `retention_days` are dropped on a schedule. The audit chain is untouched by both: its
//! `completed` events hold the digest of the whole result, not the result.

use std::sync::Arc;
use std::time::Duration;

use airlock_policy::ToolOutcome;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::Gate;
use crate::store::now_millis;

/// How often old results are pruned (and once at start).
const PRUNE_INTERVAL: Duration = Duration::from_secs(3600);
const DAY_MS: i64 = 24 * 3600 * 1000;
/// Room kept for the note that says a stored result was cut.
const NOTE_BYTES: usize = 200;

impl Gate {
    /// Drops the stored results of calls finished more than `retention_days` ago, at
    /// start and every hour, until `stop`. Several replicas doing it at once is
    /// harmless: the statement is idempotent.
    pub async fn prune_forever(self: Arc<Self>, stop: CancellationToken) {
        let days = self.retention.retention_days;
        if days == 0 {
            return;
        }
        let keep_ms = i64::try_from(days)
            .unwrap_or(i64::MAX / DAY_MS)
            .saturating_mul(DAY_MS);
        loop {
            let before = now_millis().saturating_sub(keep_ms);
            match self.store.prune_results(before).await {
                Ok(0) => {}
                Ok(pruned) => {
                    tracing::info!(pruned, retention_days = days, "pruned stored results")
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot prune stored results; trying again later")
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(PRUNE_INTERVAL) => {}
            }
        }
    }

    /// `outcome` as the store keeps it (see [`stored_result`]).
    pub(super) fn stored_result(&self, outcome: &ToolOutcome, digest: &str) -> Value {
        let max = usize::try_from(self.retention.max_result_bytes).unwrap_or(usize::MAX);
        stored_result(outcome, max, digest)
    }
}

/// The result whole when its text fits in `max_bytes`, else its text cut there (on a
/// character boundary) and a last block that says so, with the digest of the whole.
pub(super) fn stored_result(outcome: &ToolOutcome, max_bytes: usize, digest: &str) -> Value {
    let total: usize = outcome.content.iter().map(String::len).sum();
    if total <= max_bytes {
        return serde_json::to_value(outcome).unwrap_or(Value::Null);
    }
    let mut room = max_bytes.saturating_sub(NOTE_BYTES);
    let mut content = Vec::new();
    for block in &outcome.content {
        if room == 0 {
            break;
        }
        let mut end = block.len().min(room);
        while !block.is_char_boundary(end) {
            end -= 1;
        }
        content.push(block[..end].to_owned());
        room -= end;
    }
    let kept: usize = content.iter().map(String::len).sum();
    content.push(format!(
        "[stored result cut by [store] max_result_bytes: {kept} of {total} bytes kept; \
         result_sha256 {digest} is of the whole]"
    ));
    // Field by field: `..outcome.clone()` would copy the whole text only to drop it.
    let cut = ToolOutcome {
        is_error: outcome.is_error,
        content,
        isolation: outcome.isolation.clone(),
        timed_out: outcome.timed_out,
    };
    serde_json::to_value(&cut).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_result_is_cut_and_says_so() {
        let small = ToolOutcome::text("short");
        assert_eq!(
            stored_result(&small, 1000, "d"),
            serde_json::to_value(&small).unwrap()
        );
        let long = ToolOutcome {
            content: vec!["é".repeat(600), "b".repeat(600)],
            ..ToolOutcome::text("")
        };
        let stored: ToolOutcome =
            serde_json::from_value(stored_result(&long, 1000, "abc123")).unwrap();
        let text: usize = stored.content.iter().map(String::len).sum();
        assert!(text <= 1000, "{text}");
        let note = stored.content.last().unwrap();
        assert!(
            note.contains("of 1800 bytes kept") && note.contains("abc123"),
            "{note}"
        );
        assert!(stored.content[0].chars().all(|c| c == 'é'));
        assert_eq!(stored.is_error, long.is_error);
    }
}
