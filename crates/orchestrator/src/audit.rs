//! The audit log's records, its hash chain, and redaction of secret arguments.
//!
//! Every step of the gate is an [`AuditRecord`] in an append-only log kept by the
//! [`Store`](crate::store::Store). Records are numbered densely from 1 (`seq`) and
//! chained: `hash = SHA-256(prev_hash || canonical JSON of {seq, ts, kind, call_id,
//! principal, session_id, data})` as lowercase hex, where `prev_hash` is the previous
//! record's `hash` and the first record's `prev_hash` is [`GENESIS_HASH`] (64 zeros).
//! The canonical JSON has object keys sorted by their UTF-8 bytes at every depth and
//! no whitespace ([`canonical_json`]); it does not depend on serde_json's
//! `preserve_order` feature.
//!
//! # What `verify` detects
//!
//! The store also keeps an *anchor* (`audit_head`: the last `seq` and `hash`), updated
//! in the same transaction as every append. [`Store::verify`](crate::store::Store::verify)
//! walks the records in `seq` order and reports the first bad one:
//!
//! - a **modified** record (any field, `seq` included): its hash no longer matches;
//! - a **deleted** record in the middle: a gap in `seq` (or, if the later records were
//!   renumbered, a `prev_hash` that no longer matches);
//! - an **inserted** record: a `prev_hash` or `hash` mismatch at the forgery or, for a
//!   forgery whose hashes were recomputed correctly, at the next genuine record
//!   (whose `seq` changed); a forged record appended after the last one is caught by
//!   the anchor;
//! - **reordered** records (swapped `seq`): a hash mismatch at the first moved record;
//! - a **truncated tail** (the last records deleted): the anchor names a later `seq`.
//!
//! Not detectable: someone with write access to the database who rewrites the chain
//! from some record onwards *and* the anchor (the hash is keyless, so anyone can
//! recompute it), or who deletes the tail and moves the anchor back. Detecting that
//! needs the head hash kept somewhere the attacker cannot write (export
//! [`VerifyReport`]'s head periodically, or a keyed MAC).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::json_text::{write_sorted, write_str};

/// The `prev_hash` of the first record: 64 zeros.
pub const GENESIS_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// What replaces a secret value in the audit log.
pub const REDACTED: &str = "[redacted]";

/// Argument names that are always treated as secrets (compared case-insensitively,
/// with `-` and `_` treated alike). A name also counts as secret when one of its words
/// is in [`SECRET_WORDS`] (see [`is_secret_name`]), e.g. `GITHUB_TOKEN`, `db-password`,
/// `Ocp-Apim-Subscription-Key`, `X-Amz-Signature`, `clientSecret`.
pub const DEFAULT_SECRET_FIELDS: &[&str] = &[
    "password",
    "passwd",
    "token",
    "access_token",
    "refresh_token",
    "id_token",
    "auth_token",
    "x_auth_token",
    "api_key",
    "apikey",
    "x_api_key",
    "secret",
    "client_secret",
    "authorization",
    "proxy_authorization",
    "cookie",
    "set_cookie",
    "private_key",
];

/// Words that make a name a secret's when the name holds one as a whole word. Words
/// are split at every character that is not a letter or digit and where a lower-case
/// letter or digit meets an upper-case one (`X-Secret-Key`, `api_key`, `accessToken`
/// all qualify; `max_tokens` and `tokens` do not). `pwd` counts only inside a longer
/// name (`MYSQL_PWD`): alone it is the working directory.
pub const SECRET_WORDS: &[&str] = &[
    "password",
    "passwd",
    "passphrase",
    "secret",
    "secrets",
    "token",
    "key",
    "apikey",
    "auth",
    "oauth",
    "authorization",
    "signature",
    "sig",
    "credential",
    "credentials",
    "cookie",
    "jwt",
    "bearer",
    "privatekey",
];

/// Endings that make a glued-together word secret (`accesstoken`, `clientsecret`).
const SECRET_ENDINGS: &[&str] = &[
    "token",
    "secret",
    "password",
    "passwd",
    "apikey",
    "signature",
    "credential",
    "credentials",
];

/// What an audit event records. The names are a public contract: auditors and SIEM rules
/// match on them, the README lists them, and a test keeps the two the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AuditKind {
    /// A call arrived (its redacted or digested arguments).
    Requested,
    /// Refused before policy: unknown tool, arguments too large.
    Rejected,
    /// Its arguments failed the tool's schema.
    RejectedSchema,
    /// A session budget or the repeated-failure budget refused it (the per-principal rate
    /// limit refuses requests before any call exists: counted in metrics, not audited).
    BudgetExceeded,
    /// Policy denied it.
    Denied,
    /// Answered from the result cache.
    CacheHit,
    /// Held for a human.
    PendingApproval,
    Approved,
    /// One approver approved, and the quorum wants more: the call stays held.
    PartiallyApproved,
    /// The call ran without a new approval, covered by one remembered for its session.
    ApprovalRemembered,
    ApprovalDenied,
    /// Its approval expired undecided.
    Expired,
    /// Its only waiter went away before a decision.
    ApprovalWithdrawn,
    /// The principal lost the right before it ran.
    Revoked,
    /// Claimed by a replica after an approval or a restart.
    Resumed,
    Dispatched,
    Completed,
    PolicyReloaded,
    PolicyReloadFailed,
    PrincipalsReloaded,
    PrincipalsReloadFailed,
    AgentRunStarted,
    AgentRunFinished,
    /// A discovered tool's definition (an external worker's or an MCP server's) was
    /// seen for the first time and pinned by its digest.
    ToolPinned,
    /// A discovered tool's definition differs from its pin: the tool is hidden until an
    /// admin accepts the new one.
    ToolDefinitionChanged,
    /// An admin accepted a changed definition (`airlock tools accept`).
    ToolAccepted,
}

impl AuditKind {
    /// Every kind, in the README's order.
    pub const ALL: [AuditKind; 26] = [
        AuditKind::Requested,
        AuditKind::Rejected,
        AuditKind::RejectedSchema,
        AuditKind::BudgetExceeded,
        AuditKind::Denied,
        AuditKind::CacheHit,
        AuditKind::PendingApproval,
        AuditKind::Approved,
        AuditKind::PartiallyApproved,
        AuditKind::ApprovalRemembered,
        AuditKind::ApprovalDenied,
        AuditKind::Expired,
        AuditKind::ApprovalWithdrawn,
        AuditKind::Revoked,
        AuditKind::Resumed,
        AuditKind::Dispatched,
        AuditKind::Completed,
        AuditKind::PolicyReloaded,
        AuditKind::PolicyReloadFailed,
        AuditKind::PrincipalsReloaded,
        AuditKind::PrincipalsReloadFailed,
        AuditKind::AgentRunStarted,
        AuditKind::AgentRunFinished,
        AuditKind::ToolPinned,
        AuditKind::ToolDefinitionChanged,
        AuditKind::ToolAccepted,
    ];

    /// The name stored in `kind` and hashed into the chain.
    pub fn as_str(self) -> &'static str {
        match self {
            AuditKind::Requested => "requested",
            AuditKind::Rejected => "rejected",
            AuditKind::RejectedSchema => "rejected_schema",
            AuditKind::BudgetExceeded => "budget_exceeded",
            AuditKind::Denied => "denied",
            AuditKind::CacheHit => "cache_hit",
            AuditKind::PendingApproval => "pending_approval",
            AuditKind::Approved => "approved",
            AuditKind::PartiallyApproved => "partially_approved",
            AuditKind::ApprovalRemembered => "approval_remembered",
            AuditKind::ApprovalDenied => "approval_denied",
            AuditKind::Expired => "expired",
            AuditKind::ApprovalWithdrawn => "approval_withdrawn",
            AuditKind::Revoked => "revoked",
            AuditKind::Resumed => "resumed",
            AuditKind::Dispatched => "dispatched",
            AuditKind::Completed => "completed",
            AuditKind::PolicyReloaded => "policy_reloaded",
            AuditKind::PolicyReloadFailed => "policy_reload_failed",
            AuditKind::PrincipalsReloaded => "principals_reloaded",
            AuditKind::PrincipalsReloadFailed => "principals_reload_failed",
            AuditKind::AgentRunStarted => "agent_run_started",
            AuditKind::AgentRunFinished => "agent_run_finished",
            AuditKind::ToolPinned => "tool_pinned",
            AuditKind::ToolDefinitionChanged => "tool_definition_changed",
            AuditKind::ToolAccepted => "tool_accepted",
        }
    }
}

impl std::fmt::Display for AuditKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One event to append. The store assigns `seq`, `ts` and the hashes.
#[derive(Debug, Clone, PartialEq)]
pub struct NewAuditEvent {
    pub kind: AuditKind,
    pub call_id: Option<String>,
    pub principal: Option<String>,
    pub session_id: Option<String>,
    /// Event details; arguments in here must already be [`redact`]ed.
    pub data: Value,
}

impl NewAuditEvent {
    /// An event of `kind` with `data` and no call, principal or session.
    pub fn new(kind: AuditKind, data: Value) -> Self {
        Self {
            kind,
            call_id: None,
            principal: None,
            session_id: None,
            data,
        }
    }

    pub fn call_id(mut self, call_id: impl Into<String>) -> Self {
        self.call_id = Some(call_id.into());
        self
    }

    pub fn principal(mut self, principal: impl Into<String>) -> Self {
        self.principal = Some(principal.into());
        self
    }

    pub fn session_id(mut self, session_id: Option<String>) -> Self {
        self.session_id = session_id;
        self
    }
}

/// One stored audit record; serializes to the `GET /v1/audit` item shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// 1, 2, 3, … without gaps.
    pub seq: u64,
    /// RFC 3339 UTC with milliseconds, e.g. `2026-05-20T12:34:56.789Z`.
    pub ts: String,
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    pub data: Value,
    /// Hex SHA-256 of the previous record ([`GENESIS_HASH`] for `seq` 1).
    pub prev_hash: String,
    /// Hex SHA-256 over `prev_hash` and this record (see the module docs).
    pub hash: String,
}

impl AuditRecord {
    /// Whether `hash` matches the record's contents and `prev_hash`.
    pub fn hash_is_valid(&self) -> bool {
        chain_hash(
            &self.prev_hash,
            self.seq,
            &self.ts,
            &self.kind,
            self.call_id.as_deref(),
            self.principal.as_deref(),
            self.session_id.as_deref(),
            &self.data,
        ) == self.hash
    }
}

/// A read of the audit log: records in ascending `seq`, filtered.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct AuditQuery {
    /// Only records of this session.
    #[serde(default)]
    pub session_id: Option<String>,
    /// Only records of this call.
    #[serde(default)]
    pub call_id: Option<String>,
    /// Only records with `seq > after`.
    #[serde(default)]
    pub after: Option<u64>,
    /// At most this many records; 0 means [`AuditQuery::DEFAULT_LIMIT`]; capped at
    /// [`AuditQuery::MAX_LIMIT`].
    #[serde(default)]
    pub limit: usize,
    /// The *last* `limit` matching records (still returned in ascending `seq`), for
    /// `airlock audit tail`; otherwise the first `limit` after `after`.
    #[serde(default)]
    pub latest: bool,
}

impl AuditQuery {
    pub const DEFAULT_LIMIT: usize = 100;
    pub const MAX_LIMIT: usize = 10_000;
    /// The most bytes of event data one page carries (one larger event comes alone):
    /// a `requested` event holds up to `[limits] max_argument_bytes` of arguments, so
    /// a page of `MAX_LIMIT` events could otherwise be tens of gigabytes. A reader goes
    /// on from the last `seq` it got, as with any page.
    pub const PAGE_BYTES: usize = 8 * 1024 * 1024;

    /// The filters after `seq > first`, each an equality its index answers (one
    /// statement per combination, never `(? IS NULL OR …)`, which the planner cannot
    /// use an index for), with `placeholder(n)` naming the n-th parameter; and the
    /// values they take, in order, from parameter `first_value` on.
    pub(crate) fn filters(
        &self,
        first_value: usize,
        placeholder: impl Fn(usize) -> String,
    ) -> (String, Vec<&str>) {
        let mut sql = String::new();
        let mut values = Vec::new();
        for (column, value) in [("session_id", &self.session_id), ("call_id", &self.call_id)] {
            if let Some(value) = value {
                sql.push_str(&format!(
                    " AND {column} = {}",
                    placeholder(first_value + values.len())
                ));
                values.push(value.as_str());
            }
        }
        (sql, values)
    }

    /// The limit to apply: `limit` clamped to `1..=MAX_LIMIT`, 0 meaning the default.
    pub fn effective_limit(&self) -> usize {
        match self.limit {
            0 => Self::DEFAULT_LIMIT,
            n => n.min(Self::MAX_LIMIT),
        }
    }
}

/// One page of the audit log.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AuditPage {
    /// The records, in ascending `seq`.
    pub records: Vec<AuditRecord>,
    /// Whether more records matched the query than this page holds: it was cut by its
    /// `limit` or by [`AuditQuery::PAGE_BYTES`]. Oldest first, they follow the page's last
    /// record (read on with `after` set to its `seq`); with `latest`, they precede its
    /// first.
    pub more: bool,
}

/// The result of checking the whole chain; serializes to the `GET /v1/audit/verify`
/// shape `{"ok", "records", "first_bad_seq"?, "reason"?}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyReport {
    pub ok: bool,
    /// How many records were read.
    pub records: u64,
    /// The first record (by `seq`) that is missing, altered or out of place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_bad_seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The chain hash of one record (see the module docs), lowercase hex.
#[allow(clippy::too_many_arguments, reason = "one argument per hashed field")]
pub fn chain_hash(
    prev_hash: &str,
    seq: u64,
    ts: &str,
    kind: &str,
    call_id: Option<&str>,
    principal: Option<&str>,
    session_id: Option<&str>,
    data: &Value,
) -> String {
    // The canonical JSON of the body `{seq, ts, kind, call_id, principal, session_id,
    // data}`, written field by field in its keys' sorted order rather than built as a map
    // and sorted: the same bytes, without copying `data` (every event is hashed once as
    // it is appended, and again by every verification).
    let mut body = Vec::with_capacity(256);
    body.extend_from_slice(b"{\"call_id\":");
    write_optional_str(call_id, &mut body);
    body.extend_from_slice(b",\"data\":");
    write_sorted(data, &mut body);
    body.extend_from_slice(b",\"kind\":");
    write_str(kind, &mut body);
    body.extend_from_slice(b",\"principal\":");
    write_optional_str(principal, &mut body);
    body.extend_from_slice(b",\"seq\":");
    // An integer: its decimal digits, as serde_json writes it.
    body.extend_from_slice(seq.to_string().as_bytes());
    body.extend_from_slice(b",\"session_id\":");
    write_optional_str(session_id, &mut body);
    body.extend_from_slice(b",\"ts\":");
    write_str(ts, &mut body);
    body.push(b'}');
    let mut hasher = Sha256::new();
    hasher.update(prev_hash.as_bytes());
    hasher.update(&body);
    hex_lower(&hasher.finalize())
}

/// Lower-case hex of `bytes`, as `hex::encode` writes it. Written as bytes into a buffer
/// of the right size: `hex::encode` collects one `char` at a time (some 800 instructions
/// for a SHA-256 digest), and a call's audit events and digests take a dozen of them.
pub fn hex_lower(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = vec![0u8; bytes.len() * 2];
    for (pair, &byte) in text.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(byte >> 4)];
        pair[1] = DIGITS[usize::from(byte & 0x0f)];
    }
    // Every byte pushed is an ASCII digit or letter.
    String::from_utf8(text).unwrap_or_default()
}

/// A JSON string, or `null` for `None`.
fn write_optional_str(value: Option<&str>, out: &mut Vec<u8>) {
    match value {
        Some(text) => write_str(text, out),
        None => out.extend_from_slice(b"null"),
    }
}

/// SHA-256 (hex) of the canonical JSON of `value`: equal for equal values, however their
/// keys were ordered.
pub fn value_sha256(value: &Value) -> String {
    let mut text = Vec::new();
    write_sorted(value, &mut text);
    hex_lower(&Sha256::digest(&text))
}

/// JSON text with object keys sorted (by UTF-8 bytes) at every depth and no
/// whitespace; strings and numbers as serde_json writes them.
pub fn canonical_json(value: &Value) -> String {
    let mut out = Vec::new();
    write_sorted(value, &mut out);
    // serde_json writes valid UTF-8: the lossy fallback is never taken.
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// Walks records in `seq` order and remembers the first break in the chain.
#[derive(Debug)]
pub(crate) struct ChainVerifier {
    records: u64,
    expected_seq: u64,
    prev_hash: String,
    bad: Option<(u64, String)>,
}

impl Default for ChainVerifier {
    fn default() -> Self {
        Self {
            records: 0,
            expected_seq: 1,
            prev_hash: GENESIS_HASH.to_owned(),
            bad: None,
        }
    }
}

impl ChainVerifier {
    /// Checks the next record; `Err(reason)` for a row that could not even be decoded
    /// (e.g. `data` that is not JSON) at `seq`.
    pub(crate) fn push(&mut self, row: Result<AuditRecord, (u64, String)>) {
        self.records += 1;
        if self.bad.is_some() {
            return;
        }
        let record = match row {
            Ok(record) => record,
            Err((seq, reason)) => {
                self.bad = Some((seq, reason));
                return;
            }
        };
        if record.seq != self.expected_seq {
            let reason = if record.seq > self.expected_seq {
                format!(
                    "record {} is missing (the next record is {})",
                    self.expected_seq, record.seq
                )
            } else {
                format!(
                    "record {} appears out of order after {}",
                    record.seq,
                    self.expected_seq - 1
                )
            };
            self.bad = Some((self.expected_seq.min(record.seq.max(1)), reason));
            return;
        }
        if record.prev_hash != self.prev_hash {
            self.bad = Some((
                record.seq,
                format!(
                    "record {} does not follow record {}: its prev_hash differs from that record's hash (a record was deleted, inserted or moved)",
                    record.seq,
                    record.seq - 1
                ),
            ));
            return;
        }
        if !record.hash_is_valid() {
            self.bad = Some((
                record.seq,
                format!(
                    "record {} was modified: its contents do not match its hash",
                    record.seq
                ),
            ));
            return;
        }
        self.prev_hash = record.hash;
        self.expected_seq += 1;
    }

    /// The report, given the anchor (`audit_head`) read in the same snapshot:
    /// `None` when the anchor row is missing.
    pub(crate) fn finish(self, head: Option<(u64, String)>) -> VerifyReport {
        let bad = |seq: Option<u64>, reason: String| VerifyReport {
            ok: false,
            records: self.records,
            first_bad_seq: seq,
            reason: Some(reason),
        };
        if let Some((seq, reason)) = self.bad.clone() {
            return bad(Some(seq), reason);
        }
        let last = self.expected_seq - 1;
        match head {
            None => bad(
                Some(last + 1),
                "the audit head anchor is missing (it was deleted)".to_owned(),
            ),
            Some((head_seq, _)) if head_seq > last => bad(
                Some(last + 1),
                format!(
                    "the log ends at record {last} but the head anchor names record {head_seq}: records were deleted from the end"
                ),
            ),
            Some((head_seq, _)) if head_seq < last => bad(
                Some(head_seq + 1),
                format!(
                    "records after {head_seq} were added outside the store (the head anchor names record {head_seq})"
                ),
            ),
            Some((_, head_hash)) if head_hash != self.prev_hash => bad(
                Some(last),
                format!("record {last} does not match the head anchor's hash"),
            ),
            Some(_) => VerifyReport {
                ok: true,
                records: self.records,
                first_bad_seq: None,
                reason: None,
            },
        }
    }
}

/// A copy of `input` fit for the audit log and for approvers: the value of every
/// property that is a secret is replaced with `"[redacted]"`, and secrets written
/// inline in any string are cut out of it.
///
/// A property is a secret when its schema (found through `properties`, `items`,
/// `prefixItems`, `additionalProperties` and the subschemas of `allOf`/`anyOf`/
/// `oneOf`) has `"writeOnly": true` or `"x-airlock-secret": true`, or when its key
/// is a secret's name ([`is_secret_name`]). Header lists given as
/// `[{"name": "Authorization", "value": …}]` or `[["Authorization", …]]` have the
/// values of secret names redacted. In every string (see [`redact_text`]): URL
/// user-info, `name=value` pairs (query strings, forms, shell assignments,
/// `--name=value`), `--name value` flags, `Name: value` header lines, `"name": value`
/// pairs of embedded JSON, bearer tokens, SQL `PASSWORD '…'` literals and PEM private
/// keys, each where the name is a secret's.
pub fn redact(input: &Value, schema: &Value, extra_secret_fields: &[String]) -> Value {
    let extra: Vec<String> = extra_secret_fields
        .iter()
        .map(|name| normalize_key(name))
        .collect();
    redact_value(input, &[schema], &extra)
}

/// Whether a property, header, query parameter or variable name is a secret's by name
/// alone: one of [`DEFAULT_SECRET_FIELDS`] or `extra_secret_fields` (case-insensitive,
/// `-` = `_`), or a name with a word of [`SECRET_WORDS`] in it.
pub fn is_secret_name(name: &str, extra_secret_fields: &[String]) -> bool {
    let extra: Vec<String> = extra_secret_fields
        .iter()
        .map(|name| normalize_key(name))
        .collect();
    secret_by_name(name, &extra)
}

fn normalize_key(key: &str) -> String {
    key.trim().to_ascii_lowercase().replace('-', "_")
}

fn secret_by_name(key: &str, extra: &[String]) -> bool {
    let normalized = normalize_key(key);
    if DEFAULT_SECRET_FIELDS.contains(&normalized.as_str()) || extra.contains(&normalized) {
        return true;
    }
    let words = name_words(key);
    let compound = words.len() > 1;
    words.iter().any(|word| {
        SECRET_WORDS.contains(&word.as_str())
            || (compound && word == "pwd")
            || SECRET_ENDINGS
                .iter()
                .any(|end| word.len() > end.len() && word.ends_with(end))
    })
}

/// The lower-cased words of a name: split at non-alphanumerics and at each lower-case
/// letter or digit followed by an upper-case letter (`XApiKey` → `xapi`, `key`).
fn name_words(name: &str) -> Vec<String> {
    let mut words = Vec::new();
    for part in name.split(|c: char| !c.is_alphanumeric()) {
        let mut word = String::new();
        let mut previous_lower = false;
        for c in part.chars() {
            if c.is_uppercase() && previous_lower && !word.is_empty() {
                words.push(std::mem::take(&mut word));
            }
            previous_lower = c.is_lowercase() || c.is_ascii_digit();
            word.extend(c.to_lowercase());
        }
        if !word.is_empty() {
            words.push(word);
        }
    }
    words
}

fn schema_marks_secret(schema: &Value) -> bool {
    schema.get("writeOnly") == Some(&Value::Bool(true))
        || schema.get("x-airlock-secret") == Some(&Value::Bool(true))
}

/// The schema itself plus the subschemas that also apply to the same value.
fn applicable<'a>(schemas: &[&'a Value], out: &mut Vec<&'a Value>) {
    for schema in schemas {
        if !schema.is_object() {
            continue;
        }
        out.push(schema);
        for combinator in ["allOf", "anyOf", "oneOf"] {
            if let Some(Value::Array(subs)) = schema.get(combinator) {
                let subs: Vec<&Value> = subs.iter().collect();
                applicable(&subs, out);
            }
        }
    }
}

fn redact_value(value: &Value, schemas: &[&Value], extra: &[String]) -> Value {
    let mut all = Vec::new();
    applicable(schemas, &mut all);
    if all.iter().any(|s| schema_marks_secret(s)) {
        return Value::String(REDACTED.to_owned());
    }
    match value {
        Value::Object(map) => {
            if let Some(redacted) = redact_name_value_pair(map, extra) {
                return redacted;
            }
            let mut out = serde_json::Map::new();
            for (key, val) in map {
                let mut child: Vec<&Value> = Vec::new();
                for schema in &all {
                    match schema.get("properties").and_then(|p| p.get(key)) {
                        Some(prop) => child.push(prop),
                        None => {
                            if let Some(additional) = schema.get("additionalProperties") {
                                child.push(additional);
                            }
                        }
                    }
                }
                let redacted = if secret_by_name(key, extra) {
                    Value::String(REDACTED.to_owned())
                } else {
                    redact_value(val, &child, extra)
                };
                out.insert(key.clone(), redacted);
            }
            Value::Object(out)
        }
        Value::Array(items) => {
            // `[name, value]` header pairs.
            if let [Value::String(name), secret] = items.as_slice()
                && !secret.is_object()
                && !secret.is_array()
                && secret_by_name(name, extra)
            {
                return Value::Array(vec![
                    Value::String(name.clone()),
                    Value::String(REDACTED.to_owned()),
                ]);
            }
            let out = items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    let mut child: Vec<&Value> = Vec::new();
                    for schema in &all {
                        let prefix = schema
                            .get("prefixItems")
                            .and_then(|p| p.as_array())
                            .and_then(|p| p.get(i));
                        match prefix {
                            Some(prefix) => child.push(prefix),
                            None => {
                                if let Some(items_schema) = schema.get("items") {
                                    child.push(items_schema);
                                }
                            }
                        }
                    }
                    redact_value(item, &child, extra)
                })
                .collect();
            Value::Array(out)
        }
        Value::String(text) => Value::String(redact_text(text, extra)),
        other => other.clone(),
    }
}

/// `{"name": "Authorization", "value": "…"}` (also `key`/`header`) → value redacted.
fn redact_name_value_pair(map: &serde_json::Map<String, Value>, extra: &[String]) -> Option<Value> {
    let name = ["name", "key", "header"]
        .iter()
        .find_map(|k| map.get(*k).and_then(Value::as_str))?;
    if !map.contains_key("value") || !secret_by_name(name, extra) {
        return None;
    }
    let mut out = map.clone();
    out.insert("value".into(), Value::String(REDACTED.to_owned()));
    Some(Value::Object(out))
}

/// `text` with the secrets written inline in it replaced by `[redacted]`, each rule
/// applied anywhere in the text (a URL, a command line, a file's content, SQL):
///
/// - URL user-info: `scheme://user:password@host` keeps the user; an `http(s)` URL
///   whose user-info has no password (`https://<token>@host`) loses all of it;
/// - `"name": value` and `'name': value` (JSON, Python, YAML flow) with a secret name;
/// - `name=value` after the start, white space, `?`, `&`, `;`, `,`, a quote or a
///   bracket, with a secret name: query strings and forms (`?access_token=…`), shell
///   assignments (`PGPASSWORD=… psql`, `export API_KEY=…`), `--password=…` flags,
///   `password = '…'` in SQL or config text;
/// - `--name value` (and `-name value`) flags with a secret name, and `-u`/`--user
///   user:password` (the part after the colon), glued (`-uadmin:pw`) or with `=`
///   (`--user=admin:pw`) too;
/// - the passwords some clients take in a flag of their own: `mysql -p<password>` (and
///   `mysqldump`, `mysqladmin`, `mariadb`), `sshpass -p <password>`, `redis-cli -a
///   <password>`;
/// - `Name: value` header lines with a secret name (`Authorization: …`,
///   `X-Api-Key: …`, `Cookie: …`), up to the end of the line or a quote;
/// - `Bearer <token>`;
/// - SQL `PASSWORD '…'` and `IDENTIFIED BY '…'` literals;
/// - PEM private keys (`-----BEGIN … PRIVATE KEY-----` to its `END` line).
///
/// Values in quotes keep their quotes. The rules are deliberately wide: a value that
/// did not need hiding costs an approver a look at the real call, a secret that leaks
/// into the append-only audit log cannot be taken back.
pub fn redact_text(text: &str, extra: &[String]) -> String {
    let Some(rules) = TEXT_RULES.as_ref() else {
        // The patterns are constants and compile; should they ever not, nothing is shown
        // rather than a secret.
        return REDACTED.to_owned();
    };
    if text.is_empty() {
        return String::new();
    }
    let secret = |name: &str| secret_by_name(name.trim_start_matches('-'), extra);
    let quoted = |value: &str| -> String {
        match value.chars().next() {
            Some(q @ ('"' | '\'')) if value.len() >= 2 && value.ends_with(q) => {
                format!("{q}{REDACTED}{q}")
            }
            _ => REDACTED.to_owned(),
        }
    };
    let mut out = rules
        .pem
        .replace_all(
            text,
            format!("-----BEGIN $kind-----{REDACTED}-----END $kind-----"),
        )
        .into_owned();
    out = redact_url_userinfo(&out);
    out = rules
        .json_pair
        .replace_all(&out, |c: &regex::Captures<'_>| {
            if secret(&c["name"]) {
                format!("{}{}", &c["head"], quoted(&c["value"]))
            } else {
                c[0].to_owned()
            }
        })
        .into_owned();
    out = rules
        .assignment
        .replace_all(&out, |c: &regex::Captures<'_>| {
            if secret(&c["name"]) {
                format!("{}{}{}", &c["pre"], &c["name"], &c["eq"]) + &quoted(&c["value"])
            } else {
                c[0].to_owned()
            }
        })
        .into_owned();
    out = rules
        .flag
        .replace_all(&out, |c: &regex::Captures<'_>| {
            let flag = &c["flag"];
            let value = &c["value"];
            let head = format!("{}{flag}{}", &c["pre"], &c["sp"]);
            if matches!(flag, "-u" | "--user") {
                return match value.split_once(':') {
                    Some((user, _)) => format!("{head}{user}:{REDACTED}"),
                    None => c[0].to_owned(),
                };
            }
            if secret(flag) {
                head + &quoted(value)
            } else {
                c[0].to_owned()
            }
        })
        .into_owned();
    out = rules
        .glued_user
        .replace_all(&out, |c: &regex::Captures<'_>| {
            format!("{}{}:{REDACTED}", &c["head"], &c["user"])
        })
        .into_owned();
    out = rules
        .tool_password
        .replace_all(&out, |c: &regex::Captures<'_>| {
            format!("{}{}", &c["head"], quoted(&c["value"]))
        })
        .into_owned();
    out = rules
        .header_line
        .replace_all(&out, |c: &regex::Captures<'_>| {
            if secret(&c["name"]) {
                format!("{}{}{}{REDACTED}", &c["pre"], &c["name"], &c["sep"])
            } else {
                c[0].to_owned()
            }
        })
        .into_owned();
    out = rules
        .sql_password
        .replace_all(&out, |c: &regex::Captures<'_>| {
            format!("{}{}", &c["head"], quoted(&c["value"]))
        })
        .into_owned();
    rules
        .bearer
        .replace_all(&out, format!("${{scheme}}${{sp}}{REDACTED}"))
        .into_owned()
}

/// The compiled patterns of [`redact_text`].
struct TextRules {
    pem: regex::Regex,
    json_pair: regex::Regex,
    assignment: regex::Regex,
    flag: regex::Regex,
    glued_user: regex::Regex,
    tool_password: regex::Regex,
    header_line: regex::Regex,
    sql_password: regex::Regex,
    bearer: regex::Regex,
}

/// A quoted value (escapes allowed) or a bare one up to a delimiter.
const VALUE: &str = r#"(?:"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[^\s&;"'`|<>),}\]]+)"#;

static TEXT_RULES: std::sync::LazyLock<Option<TextRules>> = std::sync::LazyLock::new(|| {
    let build = || -> Result<TextRules, regex::Error> {
        Ok(TextRules {
            pem: regex::Regex::new(
                r"(?s)-----BEGIN (?P<kind>[A-Z0-9 ]*PRIVATE KEY)-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\z)",
            )?,
            json_pair: regex::Regex::new(&format!(
                r#"(?P<head>["'](?P<name>[^"'\r\n]{{1,128}})["']\s*:\s*)(?P<value>{VALUE})"#
            ))?,
            assignment: regex::Regex::new(&format!(
                r#"(?P<pre>^|[\s?&;,"'(\[{{])(?P<name>-{{0,2}}[A-Za-z_][A-Za-z0-9_.\-\[\]]*)(?P<eq>[ \t]*=[ \t]*)(?P<value>{VALUE})"#
            ))?,
            flag: regex::Regex::new(
                r#"(?P<pre>^|\s)(?P<flag>--?[A-Za-z][A-Za-z0-9_\-]*)(?P<sp>[ \t]+)(?P<value>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[^\s\-][^\s]*)"#,
            )?,
            // `-uadmin:pw`, `--user=admin:pw`, `-u=admin:pw` (`-u admin:pw` is a flag).
            glued_user: regex::Regex::new(
                r#"(?P<head>(?:^|\s)(?:-u=?|--user=))(?P<user>[^\s:'"]+):(?P<value>[^\s'"]+)"#,
            )?,
            tool_password: regex::Regex::new(&format!(
                r#"(?P<head>\b(?:(?:mysql|mysqldump|mysqladmin|mariadb|mariadb-dump)\b[^\n;|&]*?\s-p|sshpass(?:\s+-[A-Za-z])*?\s+-p\s*|redis-cli\b[^\n;|&]*?\s-a\s+))(?P<value>{VALUE})"#
            ))?,
            header_line: regex::Regex::new(
                r#"(?m)(?P<pre>^|[\s"'])(?P<name>[A-Za-z][A-Za-z0-9_\-]*)(?P<sep>:[ \t]*)(?P<value>[^\s"'][^\r\n"']*)"#,
            )?,
            sql_password: regex::Regex::new(
                r#"(?i)(?P<head>\b(?:password|identified\s+by)\s+)(?P<value>'(?:[^']|'')*'|"[^"]*")"#,
            )?,
            bearer: regex::Regex::new(r"(?i)\b(?P<scheme>bearer)(?P<sp>\s+)[A-Za-z0-9._~+/=\-]+")?,
        })
    };
    match build() {
        Ok(rules) => Some(rules),
        Err(e) => {
            tracing::error!(error = %e, "redaction patterns do not compile; strings are redacted whole");
            None
        }
    }
});

/// `scheme://user:password@host…` → `scheme://user:[redacted]@host…`, and
/// `http(s)://token@host…` → `http(s)://[redacted]@host…`, anywhere in the text.
fn redact_url_userinfo(text: &str) -> String {
    if !text.contains("://") || !text.contains('@') {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find("://") {
        let (head, tail) = rest.split_at(pos + 3);
        out.push_str(head);
        let scheme: String = head[..pos]
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<String>()
            .to_ascii_lowercase();
        let authority_end = tail
            .find(|c: char| matches!(c, '/' | '?' | '#' | '"' | '\'') || c.is_whitespace())
            .unwrap_or(tail.len());
        let authority = &tail[..authority_end];
        match authority.rfind('@') {
            Some(at) => {
                let userinfo = &authority[..at];
                match userinfo.find(':') {
                    Some(colon) => {
                        out.push_str(&userinfo[..colon + 1]);
                        out.push_str(REDACTED);
                        out.push_str(&authority[at..]);
                    }
                    // A bare user name in an http URL is how tokens ride along
                    // (`https://<token>@github.com/…`); elsewhere it is a user name
                    // (`ssh://git@…`, `postgres://app@…`).
                    None if matches!(scheme.as_str(), "http" | "https") && at > 0 => {
                        out.push_str(REDACTED);
                        out.push_str(&authority[at..]);
                    }
                    None => out.push_str(authority),
                }
            }
            None => out.push_str(authority),
        }
        rest = &tail[authority_end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn hex_is_written_as_the_hex_crate_writes_it() {
        let every_byte: Vec<u8> = (0..=255).collect();
        assert_eq!(hex_lower(&every_byte), hex::encode(&every_byte));
        assert_eq!(hex_lower(&[]), "");
        let digest = Sha256::digest(b"airlock");
        assert_eq!(hex_lower(&digest), hex::encode(digest));
        assert_eq!(hex_lower(&[0x0f, 0xa0]), "0fa0");
    }

    /// The README's table of event kinds is the auditors' contract: exactly the kinds
    /// the code writes, in the same order, each named once.
    #[test]
    fn the_readme_lists_every_audit_kind() {
        let readme = include_str!("../../../README.md");
        let table: Vec<&str> = readme
            .lines()
            .skip_while(|l| !l.starts_with("| kind | when |"))
            .skip(2)
            .take_while(|l| l.starts_with("| `"))
            .flat_map(|l| {
                let first = l.split('|').nth(1).unwrap_or("");
                first
                    .split(',')
                    .map(|k| k.trim().trim_matches('`'))
                    .collect::<Vec<_>>()
            })
            .collect();
        let kinds: Vec<&str> = AuditKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(table, kinds);
    }

    #[test]
    fn canonical_json_sorts_keys_at_every_depth() {
        let value = json!({"b": 1, "a": {"z": [1, {"y": 2, "x": "é\n"}], "c": null}});
        assert_eq!(
            canonical_json(&value),
            r#"{"a":{"c":null,"z":[1,{"x":"é\n","y":2}]},"b":1}"#
        );
    }

    #[test]
    fn chain_hash_is_stable_and_field_sensitive() {
        let data = json!({"tool": "read_file"});
        let h = chain_hash(
            GENESIS_HASH,
            1,
            "t",
            "requested",
            Some("c"),
            None,
            None,
            &data,
        );
        assert_eq!(h.len(), 64);
        assert_eq!(
            h,
            chain_hash(
                GENESIS_HASH,
                1,
                "t",
                "requested",
                Some("c"),
                None,
                None,
                &data
            )
        );
        assert_ne!(
            h,
            chain_hash(
                GENESIS_HASH,
                2,
                "t",
                "requested",
                Some("c"),
                None,
                None,
                &data
            )
        );
        assert_ne!(
            h,
            chain_hash(
                GENESIS_HASH,
                1,
                "t",
                "requested",
                None,
                Some("c"),
                None,
                &data
            )
        );
    }

    /// The chain hash is written field by field; it must stay the hash of the canonical
    /// JSON of the body as a map, which every existing chain was built with.
    #[test]
    fn chain_hash_is_the_hash_of_the_canonical_body() {
        let data =
            json!({"tool": "read_file", "arguments": {"path": "a\"\\b\u{1}é", "n": [1, 2.5, -3]}});
        let fields = [
            (
                1,
                "2026-01-01T00:00:00Z",
                "requested",
                Some("call_1"),
                Some("bob"),
                None,
            ),
            (u64::MAX, "t", "k\n", None, None, Some("s\u{2028}")),
            (7, "", "", Some(""), Some("p"), Some("q")),
        ];
        for (seq, ts, kind, call_id, principal, session_id) in fields {
            let opt = |v: Option<&str>| v.map_or(Value::Null, Value::from);
            let body = json!({
                "seq": seq,
                "ts": ts,
                "kind": kind,
                "call_id": opt(call_id),
                "principal": opt(principal),
                "session_id": opt(session_id),
                "data": data,
            });
            let mut hasher = Sha256::new();
            hasher.update(GENESIS_HASH.as_bytes());
            hasher.update(canonical_json(&body).as_bytes());
            assert_eq!(
                chain_hash(
                    GENESIS_HASH,
                    seq,
                    ts,
                    kind,
                    call_id,
                    principal,
                    session_id,
                    &data
                ),
                hex::encode(hasher.finalize())
            );
        }
    }

    fn record(seq: u64, prev: &str) -> AuditRecord {
        let data = json!({"n": seq});
        let hash = chain_hash(prev, seq, "t", "k", None, None, None, &data);
        AuditRecord {
            seq,
            ts: "t".into(),
            kind: "k".into(),
            call_id: None,
            principal: None,
            session_id: None,
            data,
            prev_hash: prev.into(),
            hash,
        }
    }

    fn chain(n: u64) -> Vec<AuditRecord> {
        let mut prev = GENESIS_HASH.to_owned();
        (1..=n)
            .map(|seq| {
                let r = record(seq, &prev);
                prev = r.hash.clone();
                r
            })
            .collect()
    }

    fn run(records: Vec<AuditRecord>, head: Option<(u64, String)>) -> VerifyReport {
        let mut verifier = ChainVerifier::default();
        for r in records {
            verifier.push(Ok(r));
        }
        verifier.finish(head)
    }

    #[test]
    fn verifier_accepts_a_good_chain_and_an_empty_one() {
        let records = chain(5);
        let head = Some((5, records[4].hash.clone()));
        let report = run(records, head);
        assert!(report.ok, "{report:?}");
        assert_eq!(report.records, 5);
        assert!(run(Vec::new(), Some((0, GENESIS_HASH.into()))).ok);
    }

    #[test]
    fn verifier_finds_gaps_edits_and_truncation() {
        let records = chain(5);
        let head = Some((5, records[4].hash.clone()));

        let mut gap = records.clone();
        gap.remove(2);
        assert_eq!(run(gap, head.clone()).first_bad_seq, Some(3));

        let mut edited = records.clone();
        edited[3].data = json!({"n": 99});
        assert_eq!(run(edited, head.clone()).first_bad_seq, Some(4));

        let mut truncated = records.clone();
        truncated.pop();
        assert_eq!(run(truncated, head.clone()).first_bad_seq, Some(5));

        let extra = record(6, &records[4].hash);
        let mut appended = records.clone();
        appended.push(extra);
        assert_eq!(run(appended, head.clone()).first_bad_seq, Some(6));

        assert_eq!(run(records, None).first_bad_seq, Some(6));
    }

    #[test]
    fn redacts_schema_marked_and_named_secrets() {
        let schema = json!({
            "type": "object",
            "properties": {
                "user": {"type": "string"},
                "pin": {"type": "string", "writeOnly": true},
                "nested": {"type": "object", "properties": {
                    "code": {"type": "string", "x-airlock-secret": true},
                    "keep": {"type": "string"}
                }},
                "list": {"type": "array", "items": {"type": "object", "properties": {
                    "otp": {"type": "string", "writeOnly": true}
                }}}
            }
        });
        let input = json!({
            "user": "ann",
            "pin": "1234",
            "Password": "hunter2",
            "nested": {"code": "42", "keep": "visible", "API-Key": "k"},
            "list": [{"otp": "9", "n": 1}],
            "env": {"GITHUB_TOKEN": "ghp", "HOME": "/root", "MY_CUSTOM": "x"},
            "max_tokens": 5
        });
        let out = redact(&input, &schema, &["my_custom".to_owned()]);
        assert_eq!(
            out,
            json!({
                "user": "ann",
                "pin": REDACTED,
                "Password": REDACTED,
                "nested": {"code": REDACTED, "keep": "visible", "API-Key": REDACTED},
                "list": [{"otp": REDACTED, "n": 1}],
                "env": {"GITHUB_TOKEN": REDACTED, "HOME": "/root", "MY_CUSTOM": REDACTED},
                "max_tokens": 5
            })
        );
    }

    #[test]
    fn redacts_header_maps_lists_and_url_passwords() {
        let schema = json!({"type": "object"});
        let input = json!({
            "method": "POST",
            "url": "https://bob:s3cret@example.com/x?y=1",
            "headers": {"Authorization": "Bearer abc", "Accept": "text/plain"},
            "header_list": [{"name": "x-api-key", "value": "k"}, {"name": "Accept", "value": "a"}],
            "pairs": [["Cookie", "session=1"], ["Accept", "b"]],
            "sql": "connect postgres://u:pw@db:5432/x and https://plain.example/",
        });
        let out = redact(&input, &schema, &[]);
        assert_eq!(
            out,
            json!({
                "method": "POST",
                "url": "https://bob:[redacted]@example.com/x?y=1",
                "headers": {"Authorization": REDACTED, "Accept": "text/plain"},
                "header_list": [{"name": "x-api-key", "value": REDACTED}, {"name": "Accept", "value": "a"}],
                "pairs": [["Cookie", REDACTED], ["Accept", "b"]],
                "sql": "connect postgres://u:[redacted]@db:5432/x and https://plain.example/",
            })
        );
    }

    #[test]
    fn redacts_through_combinators_and_additional_properties() {
        let schema = json!({
            "allOf": [{"properties": {"a": {"writeOnly": true}}}],
            "properties": {"m": {"type": "object", "additionalProperties": {"x-airlock-secret": true}}}
        });
        let out = redact(&json!({"a": 1, "b": 2, "m": {"k": "v"}}), &schema, &[]);
        assert_eq!(out, json!({"a": REDACTED, "b": 2, "m": {"k": REDACTED}}));
        assert!(is_secret_name("Proxy-Authorization", &[]));
        assert!(!is_secret_name("tokens", &[]));
    }

    #[test]
    fn secret_names_are_found_by_their_words() {
        for name in [
            "Ocp-Apim-Subscription-Key",
            "X-Secret-Key",
            "x-goog-api-key",
            "X-Amz-Security-Token",
            "X-Amz-Signature",
            "X-Amz-Credential",
            "sig",
            "X-Auth",
            "Authorization",
            "Cookie",
            "accessToken",
            "clientSecret",
            "XApiKey",
            "APIKEY",
            "PGPASSWORD",
            "MYSQL_PWD",
            "AWS_SECRET_ACCESS_KEY",
            "private-token",
            "--password",
            "user[password]",
        ] {
            assert!(is_secret_name(name, &[]), "{name}");
        }
        for name in [
            "max_tokens",
            "tokens",
            "PWD",
            "path",
            "author",
            "monkey",
            "Accept",
            "X-Request-Id",
            "session_id",
            "GIT_AUTHOR_NAME",
            "timeout_seconds",
        ] {
            assert!(!is_secret_name(name, &[]), "{name}");
        }
    }

    #[test]
    fn redacts_inline_secrets_in_urls_commands_and_text() {
        let r = |text: &str| redact_text(text, &[]);
        // Query strings and forms.
        assert_eq!(
            r("https://api.test/v1?access_token=abc123&page=2"),
            "https://api.test/v1?access_token=[redacted]&page=2"
        );
        // A bare value runs to a delimiter; `#` is not one (it may be part of a secret
        // in a command), so a fragment after a secret goes with it.
        assert_eq!(
            r("https://x.test/?page=1&api_key=K1;sig=S2#top"),
            "https://x.test/?page=1&api_key=[redacted];sig=[redacted]"
        );
        assert_eq!(
            r("https://s3.test/o?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=ff00&X-Amz-Date=1"),
            "https://s3.test/o?X-Amz-Credential=[redacted]&X-Amz-Signature=[redacted]&X-Amz-Date=1"
        );
        assert_eq!(
            r("grant_type=password&client_secret=cs&password=hunter2&username=ann"),
            "grant_type=password&client_secret=[redacted]&password=[redacted]&username=ann"
        );
        // URL user-info.
        assert_eq!(
            r("git clone https://ghp_abc@github.com/o/r.git"),
            "git clone https://[redacted]@github.com/o/r.git"
        );
        assert_eq!(
            r("ssh://git@github.com/o/r and postgres://app:pw@db/x"),
            "ssh://git@github.com/o/r and postgres://app:[redacted]@db/x"
        );
        // Shell assignments and flags.
        assert_eq!(
            r("PGPASSWORD=s3cr3t psql -h db -U app"),
            "PGPASSWORD=[redacted] psql -h db -U app"
        );
        assert_eq!(
            r("export GITHUB_TOKEN='ghp x'; env API_KEY=\"k k\" run"),
            "export GITHUB_TOKEN='[redacted]'; env API_KEY=\"[redacted]\" run"
        );
        assert_eq!(
            r("mysql --password=hunter2 --user=root db"),
            "mysql --password=[redacted] --user=root db"
        );
        assert_eq!(
            r("tool --api-key abc --token 'x y' --verbose -n 3"),
            "tool --api-key [redacted] --token '[redacted]' --verbose -n 3"
        );
        assert_eq!(
            r("curl -u admin:pa55 https://x.test/"),
            "curl -u admin:[redacted] https://x.test/"
        );
        // The forms a credential takes glued to its flag, or in a client's own flag.
        for (given, redacted) in [
            (
                "curl -uadmin:pa55 https://x.test/",
                "curl -uadmin:[redacted] https://x.test/",
            ),
            ("curl --user=admin:pa55 x", "curl --user=admin:[redacted] x"),
            ("mysql -u root -pS3cret db", "mysql -u root -p[redacted] db"),
            (
                "mysqldump -h db -p'a b' app > dump.sql",
                "mysqldump -h db -p'[redacted]' app > dump.sql",
            ),
            (
                "sshpass -p hunter2 ssh host",
                "sshpass -p [redacted] ssh host",
            ),
            (
                "sshpass -e -p'pw x' ssh host",
                "sshpass -e -p'[redacted]' ssh host",
            ),
            (
                "redis-cli -h cache -a s3cr3t ping",
                "redis-cli -h cache -a [redacted] ping",
            ),
            // What is not a password stays: a prompt, a port, another tool's -p.
            ("mysql -p -u root db", "mysql -p -u root db"),
            ("mysql -P3306 -h db", "mysql -P3306 -h db"),
            ("mkdir -p a/b && ls -a", "mkdir -p a/b && ls -a"),
            (
                "curl -u admin https://x.test/",
                "curl -u admin https://x.test/",
            ),
        ] {
            assert_eq!(r(given), redacted, "{given}");
        }
        // Header lines and bearer tokens.
        assert_eq!(
            r("curl -H 'Authorization: Bearer eyJ.a.b' -H 'Accept: */*' https://x.test/"),
            "curl -H 'Authorization: [redacted]' -H 'Accept: */*' https://x.test/"
        );
        assert_eq!(
            r("curl -H \"X-Secret-Key:abc\" -H 'Ocp-Apim-Subscription-Key: k2' x"),
            "curl -H \"X-Secret-Key:[redacted]\" -H 'Ocp-Apim-Subscription-Key: [redacted]' x"
        );
        assert_eq!(
            r("send it with bearer abc.def-123"),
            "send it with bearer [redacted]"
        );
        assert_eq!(
            r("db:\n  password: hunter2\n  host: db\n"),
            "db:\n  password: [redacted]\n  host: db\n"
        );
        // Embedded JSON, SQL and keys.
        assert_eq!(
            r(r#"{"user":"ann","password":"p\"w","apiKey": "k","n":1,"token":42}"#),
            r#"{"user":"ann","password":"[redacted]","apiKey": "[redacted]","n":1,"token":[redacted]}"#
        );
        assert_eq!(
            r("ALTER ROLE app WITH PASSWORD 'it''s'; CREATE USER b IDENTIFIED BY \"x\""),
            "ALTER ROLE app WITH PASSWORD '[redacted]'; CREATE USER b IDENTIFIED BY \"[redacted]\""
        );
        assert_eq!(
            r("k = '-----BEGIN OPENSSH PRIVATE KEY-----\nb3Bl\n-----END OPENSSH PRIVATE KEY-----'"),
            "k = '-----BEGIN OPENSSH PRIVATE KEY-----[redacted]-----END OPENSSH PRIVATE KEY-----'"
        );
        // Ordinary text is left alone.
        for plain in [
            "ls -la /workspace && echo done",
            "https://example.com/a?page=2&sort=asc",
            "SELECT name FROM customers WHERE id = ?",
            "max_tokens=5 tokens=3 PWD=/root",
            "Content-Type: application/json",
            "the key to success",
        ] {
            assert_eq!(r(plain), plain);
        }
        // Through `redact`, every string of the input is checked.
        let out = redact(
            &json!({"command": "PGPASSWORD=x psql", "headers": {"X-Secret-Key": "v", "Accept": "a"}, "url": "https://h.test/?token=t"}),
            &json!({"type": "object"}),
            &[],
        );
        assert_eq!(
            out,
            json!({"command": "PGPASSWORD=[redacted] psql", "headers": {"X-Secret-Key": REDACTED, "Accept": "a"}, "url": "https://h.test/?token=[redacted]"})
        );
    }
}
