//! The gate without a front door, for benchmarks: the same store, catalog, Cedar policy,
//! budgets and audit as `airlock serve orchestrator` builds, with calls entering through
//! the call service the front doors use, authenticated by token as they are. What a
//! benchmark measures through it is the gate's own cost per call (authentication, schema
//! validation, Cedar, the store and the audit chain) plus the worker the caller serves.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use airlock_policy::authz::Authorizer;
use airlock_policy::{CallStatus, Limits};
use serde_json::Value;

use crate::auth::Principals;
use crate::budget::Budgets;
use crate::cache::ResultCache;
use crate::catalog::{Catalog, CatalogError, WorkerGroup};
use crate::config::{
    ApprovalsConfig, AuditConfig, BudgetConfig, CacheConfig, DispatchConfig, PrincipalConfig,
    StoreRetention, WorkerGroupConfig, WorkerTls,
};
use crate::gate::{Gate, GateParts, ToolUse};
use crate::server::ServeError;
use crate::service::{Batch, CallService, OnDrop};

/// Why a harness call did not end well.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("the token names no principal")]
    Unauthenticated,
    #[error("the call was not admitted: {0}")]
    NotAdmitted(String),
    #[error("the call ended {status:?}: {text}")]
    Failed { status: CallStatus, text: String },
}

/// A gate over one worker group, with one agent principal whose token is `token`.
pub struct GateHarness {
    service: CallService,
    principals: Arc<Principals>,
    token: String,
    /// The worker group, for calls that skip the gate ([`GateHarness::hop`]).
    group: Arc<WorkerGroup>,
}

impl GateHarness {
    /// Builds the gate on a SQLite store in `data_dir`, with the default policy, no
    /// approvals and no rate limit, over the worker group `group` at `unix:<socket>`.
    pub async fn start(
        data_dir: &Path,
        group: &str,
        socket: &Path,
        token: &str,
    ) -> Result<Self, ServeError> {
        let principal = PrincipalConfig {
            name: "bench".into(),
            token_env: None,
            token_sha256: Some(crate::auth::token_sha256_hex(token)),
            roles: vec!["agent".into()],
        };
        let principals = Arc::new(Principals::load(&[principal], data_dir)?);
        let workers = vec![WorkerGroupConfig {
            group: group.to_owned(),
            endpoints: vec![format!("unix:{}", socket.display())],
            server_name: None,
        }];
        let dialer = WorkerTls {
            mtls: None,
            insecure_plaintext: false,
        }
        .dialer();
        let catalog = Arc::new(Catalog::new(&workers, &dialer, &DispatchConfig::default())?);
        // Resolved once here, not on every hop: the catalog was built from this one group.
        let worker_group = catalog.group(group).ok_or_else(|| CatalogError::BadGroup {
            group: group.to_owned(),
            reason: "the catalog built from it does not hold it".into(),
        })?;
        let store = crate::store::open("sqlite", data_dir, None).await?;
        let approvals = ApprovalsConfig {
            tools: Vec::new(),
            ..ApprovalsConfig::default()
        };
        let authorizer = Authorizer::default_policy(approvals.knob())?;
        let gate = Arc::new(Gate::new(GateParts {
            catalog,
            limits: Limits::default(),
            store,
            authorizer,
            approvals,
            budgets: Budgets::new(BudgetConfig {
                rate_per_minute: 0,
                ..BudgetConfig::default()
            }),
            cache: ResultCache::new(&CacheConfig::default()),
            audit: AuditConfig::default(),
            workspaces_root: None,
            principals: principals.clone(),
            retention: StoreRetention::default(),
            metrics: Arc::new(crate::metrics::Metrics::new()),
        }));
        gate.probe_workers().await?;
        Ok(Self {
            service: CallService::new(gate),
            principals,
            token: token.to_owned(),
            group: worker_group,
        })
    }

    /// One call, as a front door makes it: authenticate the token, admit, follow to the
    /// end. Returns the result's text.
    pub async fn call(&self, tool: &str, input: Value) -> Result<String, HarnessError> {
        let principal = self
            .principals
            .authenticate(&self.token)
            .ok_or(HarnessError::Unauthenticated)?;
        let batch = Batch {
            session: None,
            calls: vec![Ok(ToolUse {
                id: "t1".into(),
                name: tool.to_owned(),
                input,
            })],
            with_events: false,
            on_drop: OnDrop::Cancel,
        };
        let handles = self
            .service
            .admit(&principal, batch)
            .map_err(|e| HarnessError::NotAdmitted(e.to_string()))?;
        let mut text = String::new();
        for handle in handles {
            let record = handle.wait_final(Duration::from_secs(30)).await;
            let body = record
                .result
                .as_ref()
                .map(|r| r.content.join(""))
                .unwrap_or_default();
            if record.status != CallStatus::Ok {
                return Err(HarnessError::Failed {
                    status: record.status,
                    text: body,
                });
            }
            text = body;
        }
        Ok(text)
    }

    /// The same call's hop alone, without the gate: straight to the worker through the
    /// dispatch the gate uses (the same channel, the same request, its stream read to its
    /// end), with no authentication, schema, Cedar, store or audit. What a call through
    /// [`GateHarness::call`] costs beyond this is the gate's own.
    pub async fn hop(&self, tool: &str, input: &Value) -> Result<String, HarnessError> {
        let trace = airlock_telemetry::StageParent::default();
        let call = crate::dispatch::WorkerCall {
            call_id: uuid::Uuid::new_v4().to_string(),
            tool: tool.to_owned(),
            input,
            principal: "bench".into(),
            session_id: "bench".into(),
            timeout_ms: 30_000,
            detached: false,
            retryable: true,
            trace: &trace,
        };
        let never = tokio_util::sync::CancellationToken::new();
        let dispatched = crate::dispatch::execute(&self.group, call, None, &never)
            .await
            .map_err(|e| HarnessError::Failed {
                status: CallStatus::Error,
                text: e.to_string(),
            })?;
        if dispatched.outcome.is_error {
            return Err(HarnessError::Failed {
                status: CallStatus::Error,
                text: dispatched.outcome.content.join(""),
            });
        }
        Ok(dispatched.outcome.content.join(""))
    }
}
