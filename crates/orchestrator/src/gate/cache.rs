//! Stage 5, the result cache (read-only, idempotent tools only; `[cache]`).
//!
//! It sits after policy and before approval. After policy, so that a cached result is
//! never handed to a call that policy now denies (a policy change takes effect on the
//! next call, cached or not). Before approval, because a hit runs nothing: the same
//! principal, in the same session, already received this result from an identical call
//! that passed every stage, its approval included. And a hit is still recorded like any
//! call (it counts against the session and can be fetched), so it comes after budgets.

use airlock_policy::CallStatus;

use super::Gate;
use super::ctx::CallCtx;
use super::ending::Ending;
use crate::catalog::CatalogTool;

/// The key of a cacheable call's result.
pub(super) struct CacheKey(crate::cache::CacheKey);

impl Gate {
    pub(super) fn cache_key(&self, ctx: &CallCtx, tool: &CatalogTool) -> Option<CacheKey> {
        self.cache
            .key(
                &tool.definition,
                &ctx.principal.name,
                ctx.session.as_str(),
                &ctx.tool_use.input,
            )
            .map(CacheKey)
    }

    /// The remembered result of an identical call, recorded as this call's.
    pub(super) fn cached(
        &self,
        ctx: &mut CallCtx,
        tool: &CatalogTool,
        key: Option<&CacheKey>,
    ) -> Option<Ending> {
        let hit = key.and_then(|k| self.cache.get(&tool.definition.name, &k.0))?;
        // Stored with its outcome when it ends, like a call that ran and changed nothing.
        self.hold_row(ctx);
        ctx.note(crate::audit::AuditKind::CacheHit, serde_json::json!({}));
        Some(Ending::produced(CallStatus::Ok, hit, None))
    }

    /// Remembers a successful result for the next identical call.
    pub(super) fn remember_result(&self, key: Option<CacheKey>, ending: &Ending) {
        if let (Some(key), CallStatus::Ok) = (key, ending.status) {
            self.cache.put(key.0, &ending.outcome);
        }
    }
}
