//! Stage 4, policy (DESIGN §3 step 4 and the "needs approval?" half of step 5): Cedar
//! decides over the principal, the tool, the arguments and the session; forbid wins.
//! The same decision is taken again, with the principals and policy in force then,
//! before an approved call runs ([`Gate::reauthorize`]).

use airlock_policy::authz::{CallRequest, Decision};
use serde_json::Value;

use super::ctx::CallCtx;
use super::ending::Rejection;
use super::{Gate, role_names};
use crate::auth::Role;
use crate::catalog::CatalogTool;

/// What policy allows a call that it does not deny.
pub(super) enum Verdict {
    Allow,
    /// Runs only once a human approves; the reasons are shown to the approver.
    NeedsApproval {
        reasons: Vec<String>,
        /// Distinct approvers needed.
        quorum: u32,
    },
}

impl Verdict {
    pub fn needs_approval(&self) -> bool {
        matches!(self, Self::NeedsApproval { .. })
    }
}

impl Gate {
    pub(super) fn authorize(
        &self,
        ctx: &CallCtx,
        tool: &CatalogTool,
    ) -> Result<Verdict, Rejection> {
        let roles = role_names(&ctx.principal);
        match self.policy_decision(
            &ctx.principal.name,
            &roles,
            tool,
            ctx.session.as_str(),
            &ctx.tool_use.input,
        ) {
            Decision::Allow => Ok(Verdict::Allow),
            Decision::RequireApproval { reasons, quorum } => {
                Ok(Verdict::NeedsApproval { reasons, quorum })
            }
            Decision::Deny { reasons } => Err(Rejection::DeniedByPolicy { reasons }),
        }
    }

    /// Checks an approved call again against the principals and the policy in force
    /// now: its principal must still be configured with the agent role, its tool still
    /// in the catalog, and the policy must not deny it (needing approval is fine: it
    /// has been approved). `Ok` holds how many distinct approvers the policy and the
    /// `[approvals]` settings in force ask for; `Err` why the call may not run, for the
    /// audit and the caller.
    pub(crate) fn reauthorize(
        &self,
        principal: &str,
        tool: &str,
        session: &str,
        input: &Value,
    ) -> Result<u32, Vec<String>> {
        let Some(current) = self.principals.by_name(principal) else {
            return Err(vec![format!(
                "principal {principal:?} is no longer configured"
            )]);
        };
        if !current.has(Role::Agent) {
            return Err(vec![format!(
                "principal {principal:?} no longer has the agent role"
            )]);
        }
        let Some(tool) = self.catalog.get(tool) else {
            return Err(vec![format!("tool {tool:?} is no longer in the catalog")]);
        };
        let roles = role_names(&current);
        match self.policy_decision(principal, &roles, &tool, session, input) {
            Decision::Deny { reasons } => Err(reasons
                .into_iter()
                .map(|r| format!("the policy in force denies it: {r}"))
                .collect()),
            Decision::Allow => Ok(1),
            Decision::RequireApproval { quorum, .. } => Ok(quorum),
        }
    }

    /// The re-check of [`Gate::reauthorize`] as a stage: `stage` names where it was made
    /// (dispatch, resume) in the audit record.
    pub(super) fn recheck(&self, ctx: &CallCtx, stage: &'static str) -> Result<(), Rejection> {
        self.reauthorize(
            &ctx.principal.name,
            &ctx.tool_use.name,
            ctx.session.as_str(),
            &ctx.tool_use.input,
        )
        .map(|_| ())
        .map_err(|reasons| Rejection::Revoked { stage, reasons })
    }

    fn policy_decision(
        &self,
        principal: &str,
        roles: &[String],
        tool: &CatalogTool,
        session: &str,
        input: &Value,
    ) -> Decision {
        let workspace = self
            .workspaces_root
            .as_ref()
            .map(|root| root.join(principal).join(session));
        self.authorizer().decide(&CallRequest {
            principal,
            roles,
            tool: &tool.definition,
            arguments: input,
            session_id: session,
            workspace: workspace.as_deref(),
        })
    }
}
