//! Budgets: calls and wall time per session, repeated identical failures, and a
//! per-principal rate limit.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::BudgetConfig;

/// A refused call or request, saying which limit was hit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BudgetError {
    #[error("session budget exhausted: {used} of {max} calls used; start a new session")]
    SessionCalls { used: u64, max: u64 },
    #[error(
        "session wall time exhausted: the session started {elapsed_s} s ago and may last {max_s} s; start a new session"
    )]
    SessionWallTime { elapsed_s: u64, max_s: u64 },
    #[error(
        "this exact call failed {failures} times in a row; change the arguments or the approach instead of repeating it"
    )]
    RepeatedFailure { failures: u32 },
    #[error("rate limit of {per_minute} calls per minute exceeded; retry in {retry_after_s} s")]
    RateLimited { per_minute: u32, retry_after_s: u64 },
}

/// What names "this exact call" in the repeated-failure table: a SHA-256 digest of the
/// principal, the session, the tool and the arguments. A digest rather than the text, so
/// that an entry costs 32 bytes however large the arguments were: the table is bounded
/// by count, and a caller choosing what to send must not choose its size too.
pub type CallDigest = [u8; 32];

/// The digest of who called which tool with which arguments in which session, for the
/// tables that remember "this exact call" (the repeated-failure budget, the result
/// cache). Each name is followed by a NUL (names hold none), and the arguments are
/// hashed as their canonical JSON (keys sorted at every depth: equal arguments give
/// equal digests however their keys were ordered) while it is written, without building
/// its text.
pub fn call_digest(
    principal: &str,
    session: &str,
    tool: &str,
    input: &serde_json::Value,
) -> CallDigest {
    use sha2::{Digest as _, Sha256};
    let mut hasher = Sha256::new();
    for name in [principal, session, tool] {
        hasher.update(name.as_bytes());
        hasher.update([0]);
    }
    crate::json_text::write_sorted(input, &mut hasher);
    hasher.finalize().into()
}

/// In-memory counters (per replica): consecutive failures of identical calls and each
/// principal's token bucket. Session call counts and wall time come from the store, so
/// they hold across replicas and restarts.
pub struct Budgets {
    config: BudgetConfig,
    failures: Mutex<HashMap<CallDigest, u32>>,
    buckets: Mutex<HashMap<String, Bucket>>,
}

struct Bucket {
    tokens: f64,
    refilled: Instant,
}

/// How many identical-call keys are remembered before the table is reset.
const MAX_FAILURE_KEYS: usize = 50_000;

impl Budgets {
    pub fn new(config: BudgetConfig) -> Self {
        Self {
            config,
            failures: Mutex::default(),
            buckets: Mutex::default(),
        }
    }

    /// Checks the session's call count and age (from the store).
    pub fn check_session(
        &self,
        calls_before: u64,
        first_at_ms: Option<i64>,
        now_ms: i64,
    ) -> Result<(), BudgetError> {
        let max = self.config.max_calls_per_session;
        if calls_before >= max {
            return Err(BudgetError::SessionCalls {
                used: calls_before,
                max,
            });
        }
        if let Some(first) = first_at_ms {
            let elapsed_s = u64::try_from((now_ms - first).max(0) / 1000).unwrap_or(0);
            let max_s = self.config.session_wall_time_seconds;
            if elapsed_s >= max_s {
                return Err(BudgetError::SessionWallTime { elapsed_s, max_s });
            }
        }
        Ok(())
    }

    /// When a session whose first call was at `first_at_ms` reaches its wall time, after
    /// which [`Budgets::check_session`] refuses its calls.
    pub fn session_ends_at(&self, first_at_ms: i64) -> i64 {
        let wall_ms = self.config.session_wall_time_seconds.saturating_mul(1000);
        first_at_ms.saturating_add(i64::try_from(wall_ms).unwrap_or(i64::MAX))
    }

    /// Refuses an identical call that already failed `max_repeated_failures` times in a row.
    pub fn check_repeat(&self, key: &CallDigest) -> Result<(), BudgetError> {
        let failures = lock(&self.failures).get(key).copied().unwrap_or(0);
        if self.config.max_repeated_failures > 0 && failures >= self.config.max_repeated_failures {
            return Err(BudgetError::RepeatedFailure { failures });
        }
        Ok(())
    }

    /// Records the outcome of an identical-call key.
    pub fn record(&self, key: &CallDigest, failed: bool) {
        let mut failures = lock(&self.failures);
        if failed {
            if failures.len() >= MAX_FAILURE_KEYS {
                failures.clear();
            }
            *failures.entry(*key).or_insert(0) += 1;
        } else {
            failures.remove(key);
        }
    }

    /// Takes `calls` tokens from the principal's bucket (capacity and refill: the
    /// per-minute rate), or says when to retry.
    pub fn take(&self, principal: &str, calls: u32) -> Result<(), BudgetError> {
        let per_minute = self.config.rate_per_minute;
        if per_minute == 0 {
            return Ok(());
        }
        let capacity = f64::from(per_minute);
        let per_second = capacity / 60.0;
        let mut buckets = lock(&self.buckets);
        let now = Instant::now();
        let bucket = buckets.entry(principal.to_owned()).or_insert(Bucket {
            tokens: capacity,
            refilled: now,
        });
        let refill = now.duration_since(bucket.refilled).as_secs_f64() * per_second;
        bucket.tokens = (bucket.tokens + refill).min(capacity);
        bucket.refilled = now;
        let wanted = f64::from(calls);
        if bucket.tokens >= wanted {
            bucket.tokens -= wanted;
            return Ok(());
        }
        let missing = wanted - bucket.tokens;
        let retry = Duration::from_secs_f64(missing / per_second)
            .as_secs()
            .max(1);
        Err(BudgetError::RateLimited {
            per_minute,
            retry_after_s: retry,
        })
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budgets(rate: u32) -> Budgets {
        Budgets::new(BudgetConfig {
            max_calls_per_session: 3,
            session_wall_time_seconds: 10,
            max_repeated_failures: 2,
            rate_per_minute: rate,
        })
    }

    #[test]
    fn session_limits_name_the_limit() {
        let b = budgets(0);
        assert!(b.check_session(2, Some(0), 1000).is_ok());
        assert!(matches!(
            b.check_session(3, Some(0), 1000),
            Err(BudgetError::SessionCalls { .. })
        ));
        assert!(matches!(
            b.check_session(0, Some(0), 11_000),
            Err(BudgetError::SessionWallTime { .. })
        ));
    }

    #[test]
    fn repeated_failures_reset_on_success() {
        let b = budgets(0);
        let k = [7; 32];
        b.record(&k, true);
        assert!(b.check_repeat(&k).is_ok());
        b.record(&k, true);
        assert!(matches!(
            b.check_repeat(&k),
            Err(BudgetError::RepeatedFailure { failures: 2 })
        ));
        b.record(&k, false);
        assert!(b.check_repeat(&k).is_ok());
    }

    #[test]
    fn rate_limit_says_when_to_retry() {
        let b = budgets(60);
        assert!(b.take("p", 60).is_ok());
        let Err(BudgetError::RateLimited { retry_after_s, .. }) = b.take("p", 2) else {
            panic!("not limited")
        };
        assert!(retry_after_s >= 1);
        assert!(b.take("other", 1).is_ok(), "buckets are per principal");
    }

    #[test]
    fn the_call_digest_names_the_call_in_32_bytes_whatever_its_size() {
        let input = serde_json::json!({"path": "a.txt", "content": "x".repeat(1 << 20)});
        let key = call_digest("alice", "s1", "write_file", &input);
        assert_eq!(key, call_digest("alice", "s1", "write_file", &input));
        let other_input = serde_json::json!({"path": "b.txt", "content": "x".repeat(1 << 20)});
        for different in [
            call_digest("bob", "s1", "write_file", &input),
            call_digest("alice", "s2", "write_file", &input),
            call_digest("alice", "s1", "read_file", &input),
            call_digest("alice", "s1", "write_file", &other_input),
            // The names are delimited: moving a character from one to the next is
            // another call.
            call_digest("alices", "1", "write_file", &input),
        ] {
            assert_ne!(key, different);
        }
        // Key order does not matter: the maps are sorted.
        let a: serde_json::Value = serde_json::from_str(r#"{"a": 1, "b": 2}"#).unwrap();
        let b: serde_json::Value = serde_json::from_str(r#"{"b": 2, "a": 1}"#).unwrap();
        assert_eq!(
            call_digest("p", "s", "t", &a),
            call_digest("p", "s", "t", &b)
        );
    }
}
