//! The result cache: off by default; per tool with a TTL; only for tools annotated
//! read-only and idempotent; keyed by principal, session, tool and canonical arguments.
//!
//! The session is part of the key although the issue names principal, tool and
//! arguments: file tools resolve paths in the session's workspace, so the same
//! arguments in two sessions are two different questions.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use airlock_policy::{ToolDefinition, ToolOutcome};

use crate::budget::{CallDigest, call_digest};
use crate::config::CacheConfig;

/// How many results are remembered at most, and how many bytes of text: a cached tool's
/// result may be a megabyte (a whole file read), and what the cache holds must not grow
/// with what callers ask for. Past either bound the expired entries go, then, if that
/// was not enough, all of them.
const CAPACITY: usize = 10_000;
const CAPACITY_BYTES: usize = 64 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error(
        "[cache] lists {0}, which is not annotated read-only and idempotent; only such tools may be cached"
    )]
    NotCacheable(String),
}

/// Which call a result answers: the digest of principal, session, tool and arguments
/// (32 bytes, however large the arguments).
pub type CacheKey = CallDigest;

pub struct ResultCache {
    ttl: BTreeMap<String, Duration>,
    entries: Mutex<Entries>,
    capacity: usize,
    capacity_bytes: usize,
}

#[derive(Default)]
struct Entries {
    map: HashMap<CacheKey, Entry>,
    /// The sum of the entries' `bytes`.
    bytes: usize,
}

struct Entry {
    at: Instant,
    outcome: ToolOutcome,
    bytes: usize,
}

impl ResultCache {
    pub fn new(config: &CacheConfig) -> Self {
        Self::bounded(config, CAPACITY, CAPACITY_BYTES)
    }

    fn bounded(config: &CacheConfig, capacity: usize, capacity_bytes: usize) -> Self {
        let ttl = config
            .ttl_seconds
            .iter()
            .map(|(tool, s)| (tool.clone(), Duration::from_secs(*s)))
            .collect();
        Self {
            ttl,
            entries: Mutex::default(),
            capacity,
            capacity_bytes,
        }
    }

    /// Refuses a configuration that caches a tool with side effects.
    pub fn check(&self, tool: &ToolDefinition) -> Result<(), CacheError> {
        if self.ttl.contains_key(&tool.name)
            && !(tool.annotations.read_only && tool.annotations.idempotent)
        {
            return Err(CacheError::NotCacheable(tool.name.clone()));
        }
        Ok(())
    }

    /// The cache key, when this tool's results are cached.
    pub fn key(
        &self,
        tool: &ToolDefinition,
        principal: &str,
        session: &str,
        input: &serde_json::Value,
    ) -> Option<CacheKey> {
        if !(self.ttl.contains_key(&tool.name)
            && tool.annotations.read_only
            && tool.annotations.idempotent)
        {
            return None;
        }
        Some(call_digest(principal, session, &tool.name, input))
    }

    pub fn get(&self, tool: &str, key: &CacheKey) -> Option<ToolOutcome> {
        let ttl = *self.ttl.get(tool)?;
        let entries = self.lock();
        let entry = entries.map.get(key)?;
        (entry.at.elapsed() < ttl).then(|| entry.outcome.clone())
    }

    pub fn put(&self, key: CacheKey, outcome: &ToolOutcome) {
        if outcome.is_error {
            return;
        }
        let bytes = outcome_bytes(outcome);
        if bytes > self.capacity_bytes {
            return;
        }
        let mut entries = self.lock();
        if let Some(old) = entries.map.remove(&key) {
            entries.bytes -= old.bytes;
        }
        let over =
            |e: &Entries| e.map.len() >= self.capacity || e.bytes + bytes > self.capacity_bytes;
        if over(&entries) {
            let ttl = self.ttl.values().max().copied().unwrap_or_default();
            entries.map.retain(|_, e| e.at.elapsed() < ttl);
            entries.bytes = entries.map.values().map(|e| e.bytes).sum();
            if over(&entries) {
                entries.map.clear();
                entries.bytes = 0;
            }
        }
        entries.bytes += bytes;
        entries.map.insert(
            key,
            Entry {
                at: Instant::now(),
                outcome: outcome.clone(),
                bytes,
            },
        );
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        match self.entries.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

/// What a result's text takes (its content blocks and isolation report).
fn outcome_bytes(outcome: &ToolOutcome) -> usize {
    let content: usize = outcome.content.iter().map(String::len).sum();
    let isolation = outcome
        .isolation
        .as_ref()
        .map_or(0, |i| i.to_string().len());
    content + isolation
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounded(capacity: usize, capacity_bytes: usize) -> ResultCache {
        let config = CacheConfig {
            ttl_seconds: BTreeMap::from([("read_file".to_owned(), 600)]),
        };
        ResultCache::bounded(&config, capacity, capacity_bytes)
    }

    fn key(n: usize) -> CacheKey {
        call_digest("alice", "s1", "read_file", &serde_json::json!({"path": n}))
    }

    #[test]
    fn what_the_cache_holds_is_bounded_in_bytes_and_count() {
        let cache = bounded(1000, 10_000);
        let result = ToolOutcome::text("x".repeat(1000));
        for n in 0..100 {
            cache.put(key(n), &result);
            let held = cache.lock().bytes;
            assert!(held <= 10_000, "{held} bytes held after {n} results");
            assert_eq!(
                held,
                cache.lock().map.values().map(|e| e.bytes).sum::<usize>()
            );
        }
        // The latest is there; a result larger than the whole budget is never held.
        assert!(cache.get("read_file", &key(99)).is_some());
        cache.put(key(1000), &ToolOutcome::text("y".repeat(20_000)));
        assert!(cache.get("read_file", &key(1000)).is_none());

        let cache = cache_by_count();
        for n in 0..50 {
            cache.put(key(n), &ToolOutcome::text("z"));
            assert!(cache.lock().map.len() <= 10);
        }
        // Putting the same key again replaces it and counts it once.
        let cache = bounded(1000, 10_000);
        for _ in 0..20 {
            cache.put(key(1), &result);
        }
        assert_eq!(cache.lock().bytes, 1000);
    }

    fn cache_by_count() -> ResultCache {
        bounded(10, usize::MAX)
    }

    #[test]
    fn errors_and_uncached_tools_are_not_remembered() {
        let cache = bounded(10, 10_000);
        let mut failed = ToolOutcome::text("no");
        failed.is_error = true;
        cache.put(key(1), &failed);
        assert!(cache.get("read_file", &key(1)).is_none());
        cache.put(key(2), &ToolOutcome::text("yes"));
        assert!(cache.get("list_directory", &key(2)).is_none());
        assert_eq!(
            cache.get("read_file", &key(2)).map(|o| o.content),
            Some(vec!["yes".to_owned()])
        );
    }
}
