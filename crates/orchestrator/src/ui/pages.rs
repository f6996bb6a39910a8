//! The console's pages. maud escapes every value spliced into a template, in text and
//! in attributes alike, so arguments, commands, file contents and results from a model
//! reach the browser as text; nothing here builds HTML from strings by hand.

use axum::http::StatusCode;
use maud::{DOCTYPE, Markup, html};
use serde_json::Value;

use super::CALL_STATUSES;
use super::preview::Preview;
use crate::audit::{AuditRecord, VerifyReport};
use crate::auth::{Principal, Role};
use crate::gate::HoldReasons;
use crate::store::{Approval, StoredCall, rfc3339};

/// Who is signed in, and what their forms carry.
#[derive(Debug, Clone)]
pub struct Viewer {
    principal: Principal,
    csrf: String,
    /// `[approvals] distinct_approver`.
    distinct_approver: bool,
}

impl Viewer {
    pub fn new(principal: Principal, csrf: String, distinct_approver: bool) -> Self {
        Self {
            principal,
            csrf,
            distinct_approver,
        }
    }

    pub fn principal(&self) -> &Principal {
        &self.principal
    }

    pub fn csrf(&self) -> &str {
        &self.csrf
    }

    pub fn roles_text(&self) -> String {
        roles_of(&self.principal)
    }

    /// Why this principal cannot decide any approval, if it cannot.
    pub fn cannot_decide(&self) -> Option<String> {
        (!self.principal.has(Role::Approver)).then(|| {
            format!(
                "signed in as {} (roles: {}): deciding needs the approver role, so these buttons are disabled, and the API refuses such a decision too",
                self.principal.name,
                self.roles_text()
            )
        })
    }

    /// Whether this viewer may decide `approval`: an approver, and not its requester when
    /// `[approvals] distinct_approver` is set.
    pub fn may_decide(&self, approval: &Approval) -> bool {
        self.cannot_decide().is_none()
            && !(self.distinct_approver && approval.principal == self.principal.name)
    }

    /// Approvers see every approval; anyone else the approvals of their own calls.
    pub fn may_see_approval(&self, approval: &Approval) -> bool {
        self.principal.has(Role::Approver) || approval.principal == self.principal.name
    }

    /// Why this viewer may not approve, and why not deny, `approval`.
    fn blocks(&self, approval: &Approval, hold: &HoldReasons) -> (Option<String>, Option<String>) {
        if let Some(why) = self.cannot_decide() {
            return (Some(why.clone()), Some(why));
        }
        if self.distinct_approver && approval.principal == self.principal.name {
            let why = format!(
                "[approvals] distinct_approver is set and you ({}) requested this call: another approver must decide it",
                self.principal.name
            );
            return (Some(why.clone()), Some(why));
        }
        if approval.approved_by.contains(&self.principal.name) {
            let why = format!(
                "you approved this call already; it needs {} distinct approvers ({} so far), so another approver must approve it too (you may still deny it)",
                hold.quorum.max(2),
                approval.approved_by.len()
            );
            return (Some(why), None);
        }
        (None, None)
    }
}

pub fn roles_of(principal: &Principal) -> String {
    let names = crate::gate::role_names(principal);
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

/// One pending approval as shown.
#[derive(Debug, Clone)]
pub struct Pending {
    /// Its input already redacted.
    pub approval: Approval,
    pub hold: HoldReasons,
    pub preview: Preview,
}

/// What changes the rendering of the list: the approvals and their approvers.
pub fn list_version(approvals: &[Approval]) -> String {
    approvals
        .iter()
        .map(item_version)
        .collect::<Vec<_>>()
        .join(";")
}

fn item_version(approval: &Approval) -> String {
    format!(
        "{}:{}",
        approval.approval_id,
        approval.approved_by.join(",")
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Nav {
    Approvals,
    Calls,
    Audit,
    None,
}

fn layout(title: &str, viewer: Option<&Viewer>, nav: Nav, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · Airlock" }
                link rel="stylesheet" href="/ui/static/console.css";
                script src="/ui/static/console.js" defer {}
            }
            body {
                header.top {
                    a.brand href="/ui" { "Airlock" }
                    @if let Some(viewer) = viewer {
                        nav {
                            a href="/ui" aria-current=[(nav == Nav::Approvals).then_some("page")] { "Approvals" }
                            a href="/ui/calls" aria-current=[(nav == Nav::Calls).then_some("page")] { "Calls" }
                            @if viewer.principal.roles.contains(&Role::Admin) {
                                a href="/ui/audit" aria-current=[(nav == Nav::Audit).then_some("page")] { "Audit" }
                            }
                        }
                        div.who {
                            span #signed-in-as { "Signed in as " strong { (viewer.principal.name) } " (" (viewer.roles_text()) ")" }
                            form method="post" action="/ui/logout" {
                                input type="hidden" name="csrf" value=(viewer.csrf);
                                button.link type="submit" { "Sign out" }
                            }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

/// The sign-in page: one token field (`name="token"`), posted, never in a URL.
pub fn sign_in(error: Option<&str>) -> Markup {
    layout(
        "Sign in",
        None,
        Nav::None,
        html! {
            section.signin {
                h1 { "Approvals console" }
                p { "Paste your Airlock token. It is kept in an HttpOnly cookie for this browser session only." }
                @if let Some(error) = error {
                    p.alert.error role="alert" { (error) }
                }
                form #signin method="post" action="/ui/login" autocomplete="off" {
                    label for="token" { "Token" }
                    input #token type="password" name="token" required autocomplete="off" spellcheck="false";
                    button type="submit" { "Sign in" }
                }
            }
        },
    )
}

pub fn error_page(viewer: Option<&Viewer>, status: StatusCode, message: &str) -> Markup {
    layout(
        "Refused",
        viewer,
        Nav::None,
        html! {
            h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("")) }
            p.alert.error #refusal role="alert" { (message) }
            p { a href="/ui" { "Back to the pending approvals" } }
        },
    )
}

/// `/ui`: the pending approvals (live) and the outcome of a decision just taken.
pub fn console(
    viewer: &Viewer,
    pending: &[Pending],
    more: bool,
    decided: Option<&Approval>,
) -> Markup {
    layout(
        "Approvals",
        Some(viewer),
        Nav::Approvals,
        html! {
            @if let Some(decided) = decided {
                p.alert.ok #decided role="status" {
                    "Approval " code { (decided.approval_id) } " of " code { (decided.tool) } " is "
                    strong { (decided.status.as_str()) }
                    @if decided.status == crate::store::ApprovalStatus::Pending {
                        " (approved by " (decided.approved_by.join(", ")) "; it needs more distinct approvers)"
                    }
                    ". "
                    a href={ "/ui/calls/" (decided.call_id) } { "Follow the call" }
                }
            }
            @if let Some(why) = viewer.cannot_decide() {
                p.alert.info #cannot-decide { (why) "." }
            }
            section #pending {
                h1 { "Pending approvals " span.count #pending-count { (pending.len()) @if more { "+" } } }
                p.live #live-state { "Updates live." }
                (pending_list(viewer, pending, more))
            }
        },
    )
}

/// The list the live updates replace, item by item (`data-version` says when one
/// changed); `more` when further approvals wait than the page holds.
pub fn pending_list(viewer: &Viewer, pending: &[Pending], more: bool) -> Markup {
    html! {
        div #pending-list {
            p #pending-empty hidden[!pending.is_empty()] { "Nothing waits for a decision." }
            @for item in pending {
                (pending_item(viewer, item))
            }
            p.alert.info #pending-more hidden[!more] {
                "More approvals wait than this page holds (the oldest 100, or as many as 8 MiB of arguments): "
                "they appear here as these are decided; to see every one now, use "
                code { "airlock approvals list" } " or " code { "GET /v1/approvals" } "."
            }
        }
    }
}

fn pending_item(viewer: &Viewer, item: &Pending) -> Markup {
    let a = &item.approval;
    let (approve_block, deny_block) = viewer.blocks(a, &item.hold);
    let session = a.session_id.as_deref().unwrap_or("default");
    let arguments = serde_json::to_string_pretty(&a.input).unwrap_or_default();
    html! {
        article.approval data-approval-id=(a.approval_id) data-version=(item_version(a))
            data-created-ms=(a.created_at) data-expires-ms=(a.expires_at) {
            header {
                h2 { code.tool { (a.tool) } }
                span.id { (a.approval_id) }
            }
            dl.facts {
                dt { "Principal" } dd.principal { (a.principal) }
                dt { "Session" } dd.session { (session) }
                dt { "Tool" } dd { code { (a.tool) } }
                dt { "Requested" } dd { time datetime=(rfc3339(a.created_at)) { (rfc3339(a.created_at)) } " · " span.age data-age { } }
                dt { "Expires" } dd { time datetime=(rfc3339(a.expires_at)) { (rfc3339(a.expires_at)) } " · " span.expiry data-expiry { } }
                dt { "Why held" }
                dd.reasons {
                    @if item.hold.reasons.is_empty() {
                        "approval required"
                    } @else {
                        ul { @for reason in &item.hold.reasons { li { (reason) } } }
                    }
                }
                @if item.hold.quorum > 1 {
                    dt { "Quorum" }
                    dd.quorum {
                        (a.approved_by.len()) " of " (item.hold.quorum) " distinct approvers"
                        @if !a.approved_by.is_empty() { ": " (a.approved_by.join(", ")) }
                    }
                }
                dt { "input_sha256" } dd { code.digest { (a.input_sha256) } }
            }
            (preview_block(&item.preview))
            details.arguments open {
                summary { "Arguments" }
                pre.args { (arguments) }
            }
            form.decide method="post" action={ "/ui/approvals/" (a.approval_id) "/decide" } {
                input type="hidden" name="csrf" value=(viewer.csrf);
                input type="hidden" name="input_sha256" value=(a.input_sha256);
                label { "Reason " input type="text" name="reason" maxlength="4096" placeholder="why (recorded in the audit)"; }
                @if item.hold.quorum <= 1 && approve_block.is_none() {
                    label.remember title="later calls of this tool with these same arguments in this session run without asking again, until this approval's expiry or the session's end" {
                        input type="checkbox" name="remember" value="session";
                        " remember for the session"
                    }
                }
                button.approve type="submit" name="decision" value="approve" data-action="approve" disabled[approve_block.is_some()] { "Approve" }
                button.deny type="submit" name="decision" value="deny" data-action="deny" disabled[deny_block.is_some()] { "Deny" }
                @if let Some(why) = approve_block.as_ref().or(deny_block.as_ref()) {
                    p.blocked data-blocked { (why) }
                }
            }
        }
    }
}

fn preview_block(preview: &Preview) -> Markup {
    html! {
        @match preview {
            Preview::Diff { diff, note } => {
                section.preview {
                    h3 { "Diff " span.note { "(" (note) ")" } }
                    @if diff.is_empty() {
                        p { "No change." }
                    } @else {
                        pre.diff {
                            @for line in diff.lines() {
                                span class=(diff_class(line)) { (line) }
                            }
                        }
                    }
                }
            }
            Preview::Command { command, cwd, env_names, stdin } => {
                section.preview {
                    h3 { "Command" }
                    pre.command { (command) }
                    @if let Some(cwd) = cwd { p { "in " code { (cwd) } } }
                    @if !env_names.is_empty() { p { "with environment variables " code { (env_names.join(", ")) } } }
                    @if *stdin { p { "with standard input (see the arguments)" } }
                }
            }
            Preview::Unavailable(why) => {
                section.preview { h3 { "Diff" } p.alert.info { (why) } }
            }
            Preview::Nothing => {}
        }
    }
}

fn diff_class(line: &str) -> &'static str {
    if line.starts_with("+++") || line.starts_with("---") {
        "file"
    } else if line.starts_with('+') {
        "add"
    } else if line.starts_with('-') {
        "del"
    } else if line.starts_with("@@") {
        "hunk"
    } else {
        "ctx"
    }
}

/// The calls page's filters, as asked.
#[derive(Debug, Clone, Default)]
pub struct CallFilters {
    pub tool: Option<String>,
    pub status: Option<String>,
    pub principal: Option<String>,
}

fn call_status(call: &StoredCall) -> String {
    match &call.status {
        Some(status) => status.as_str().to_owned(),
        None => match call.state.as_str() {
            "approved" | "dispatched" => "running".to_owned(),
            other => other.to_owned(),
        },
    }
}

pub fn calls(viewer: &Viewer, asked: &CallFilters, list: &[StoredCall]) -> Markup {
    let admin = viewer.principal.roles.contains(&Role::Admin);
    layout(
        "Calls",
        Some(viewer),
        Nav::Calls,
        html! {
            h1 { "Calls" }
            @if !admin {
                p.alert.info { "Your own calls (an admin sees every principal's)." }
            }
            form.filters method="get" action="/ui/calls" {
                label { "Tool " input type="text" name="tool" value=[asked.tool.as_deref()]; }
                label { "Status "
                    select name="status" {
                        option value="" { "any" }
                        @for status in CALL_STATUSES {
                            option value=(status) selected[asked.status.as_deref() == Some(status)] { (status) }
                        }
                    }
                }
                @if admin {
                    label { "Principal " input type="text" name="principal" value=[asked.principal.as_deref()]; }
                }
                button type="submit" { "Filter" }
            }
            @if list.is_empty() {
                p #no-calls { "No calls match." }
            } @else {
                table.calls {
                    thead { tr { th { "Call" } th { "Tool" } th { "Principal" } th { "Session" } th { "Status" } th { "Duration" } th { "Created" } } }
                    tbody {
                        @for c in list {
                            tr data-call-id=(c.call_id) {
                                td { a href={ "/ui/calls/" (c.call_id) } { (c.call_id) } }
                                td { code { (c.tool) } }
                                td { (c.principal) }
                                td { (c.session_id.as_deref().unwrap_or("default")) }
                                td.status { (call_status(c)) }
                                td { @if let Some(ms) = c.duration_ms { (ms) " ms" } }
                                td { (rfc3339(c.created_at)) }
                            }
                        }
                    }
                }
            }
        },
    )
}

/// One call; `detail` is `GET /v1/calls/{id}`'s answer, `result` its final text
/// (redacted) and whether it is an error.
pub fn call(
    viewer: &Viewer,
    stored: &StoredCall,
    detail: Option<&Value>,
    result: Option<(bool, String)>,
) -> Markup {
    let status = detail
        .and_then(|d| d.get("status"))
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| call_status(stored));
    let arguments = serde_json::to_string_pretty(&stored.input).unwrap_or_default();
    let isolation = detail
        .and_then(|d| d.get("isolation"))
        .map(|i| serde_json::to_string_pretty(i).unwrap_or_default());
    html! {
        (layout("Call", Some(viewer), Nav::Calls, html! {
            h1 { "Call " code { (stored.call_id) } }
            dl.facts #call data-call-final=(if result.is_some() { "true" } else { "false" }) {
                dt { "Tool" } dd { code { (stored.tool) } }
                dt { "Principal" } dd { (stored.principal) }
                dt { "Session" } dd { (stored.session_id.as_deref().unwrap_or("default")) }
                dt { "Status" } dd #call-status { (status) }
                @if let Some(approval) = &stored.approval_id {
                    dt { "Approval" } dd { code { (approval) } }
                }
                @if let Some(ms) = detail.and_then(|d| d.get("duration_ms")).and_then(Value::as_u64) {
                    dt { "Duration" } dd { (ms) " ms" }
                }
                dt { "Created" } dd { (rfc3339(stored.created_at)) }
            }
            details.arguments open {
                summary { "Arguments" }
                pre.args { (arguments) }
            }
            @match &result {
                Some((is_error, text)) => {
                    section.result {
                        h2 { @if *is_error { "Result (error)" } @else { "Result" } }
                        pre #call-result class=(if *is_error { "error" } else { "ok" }) { (text) }
                    }
                }
                None => { p.live { "Not finished yet; this page reloads until it is." } }
            }
            @if let Some(isolation) = isolation {
                details { summary { "Isolation report" } pre { (isolation) } }
            }
        }))
    }
}

/// The audit page's filters, as asked.
#[derive(Debug, Clone, Default)]
pub struct AuditFilters {
    pub kind: Option<String>,
    pub principal: Option<String>,
    pub tool: Option<String>,
    pub session_id: Option<String>,
    pub call_id: Option<String>,
}

pub fn audit(
    viewer: &Viewer,
    asked: &AuditFilters,
    verify: &VerifyReport,
    events: &[&AuditRecord],
    window: usize,
) -> Markup {
    layout(
        "Audit",
        Some(viewer),
        Nav::Audit,
        html! {
            h1 { "Audit log" }
            @if verify.ok {
                p.alert.ok #verify data-ok="true" { "The hash chain verifies: " (verify.records) " records, none edited, inserted, reordered or removed." }
            } @else {
                p.alert.error #verify data-ok="false" {
                    "The hash chain does NOT verify"
                    @if let Some(seq) = verify.first_bad_seq { " from record " (seq) }
                    @if let Some(reason) = &verify.reason { ": " (reason) }
                    " (" (verify.records) " records)."
                }
            }
            form.filters method="get" action="/ui/audit" {
                label { "Kind " input type="text" name="kind" value=[asked.kind.as_deref()]; }
                label { "Principal " input type="text" name="principal" value=[asked.principal.as_deref()]; }
                label { "Tool " input type="text" name="tool" value=[asked.tool.as_deref()]; }
                label { "Session " input type="text" name="session_id" value=[asked.session_id.as_deref()]; }
                label { "Call " input type="text" name="call_id" value=[asked.call_id.as_deref()]; }
                button type="submit" { "Filter" }
            }
            p.note { "Newest first, among the latest " (window) " records that match the session and call filters." }
            table.audit {
                thead { tr { th { "Seq" } th { "Time" } th { "Kind" } th { "Principal" } th { "Session" } th { "Call" } th { "Data" } } }
                tbody {
                    @for e in events {
                        tr data-seq=(e.seq) {
                            td { (e.seq) }
                            td { (e.ts) }
                            td.kind { (e.kind) }
                            td { (e.principal.as_deref().unwrap_or("")) }
                            td { (e.session_id.as_deref().unwrap_or("")) }
                            td { @if let Some(call) = &e.call_id { a href={ "/ui/calls/" (call) } { (call) } } }
                            td { code.data { (e.data.to_string()) } }
                        }
                    }
                }
            }
        },
    )
}
