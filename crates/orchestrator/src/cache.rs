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

use crate::config::CacheConfig;

const CAPACITY: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error(
        "[cache] lists {0}, which is not annotated read-only and idempotent; only such tools may be cached"
    )]
    NotCacheable(String),
}

pub struct ResultCache {
    ttl: BTreeMap<String, Duration>,
    entries: Mutex<HashMap<String, (Instant, ToolOutcome)>>,
}

impl ResultCache {
    pub fn new(config: &CacheConfig) -> Self {
        let ttl = config
            .ttl_seconds
            .iter()
            .map(|(tool, s)| (tool.clone(), Duration::from_secs(*s)))
            .collect();
        Self {
            ttl,
            entries: Mutex::default(),
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
    ) -> Option<String> {
        if !(self.ttl.contains_key(&tool.name)
            && tool.annotations.read_only
            && tool.annotations.idempotent)
        {
            return None;
        }
        // serde_json maps are sorted by key, so this is a canonical form.
        Some(format!(
            "{principal}\u{0}{session}\u{0}{}\u{0}{input}",
            tool.name
        ))
    }

    pub fn get(&self, tool: &str, key: &str) -> Option<ToolOutcome> {
        let ttl = *self.ttl.get(tool)?;
        let entries = self.lock();
        let (at, outcome) = entries.get(key)?;
        (at.elapsed() < ttl).then(|| outcome.clone())
    }

    pub fn put(&self, key: String, outcome: &ToolOutcome) {
        if outcome.is_error {
            return;
        }
        let mut entries = self.lock();
        if entries.len() >= CAPACITY {
            let ttl = self.ttl.values().max().copied().unwrap_or_default();
            entries.retain(|_, (at, _)| at.elapsed() < ttl);
            if entries.len() >= CAPACITY {
                entries.clear();
            }
        }
        entries.insert(key, (Instant::now(), outcome.clone()));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Instant, ToolOutcome)>> {
        match self.entries.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}
