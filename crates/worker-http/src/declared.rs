//! Declarative HTTP tools (DESIGN §11): `[[tools]]` entries with
//! `http = { method, url, headers, body }`, sent through the same client and egress
//! policy as `http_request`.
//!
//! - `method` is a literal method; the model never chooses it.
//! - `url` is an absolute http or https URL whose path and query may hold `{field}`
//!   placeholders; scheme, user info, host and port are literal, so the model cannot
//!   choose where the request goes. Each value is percent-encoded (everything but
//!   letters, digits and `-._~`), so `/`, `?`, `#`, `&`, `=` and `%` in a value stay
//!   data; a value that would still change the path (`.` or `..` as a segment) is
//!   refused.
//! - `headers` values are literal text and secret references, `${env:NAME}` or
//!   `${file:/path}`, which the http worker reads once at start ([`HttpTemplate::resolve`]);
//!   the model, the audit and the logs never see them, and every result and error is
//!   redacted of them, because a server may echo a request's headers back.
//! - `body = "json"` sends the arguments the URL does not use as a JSON object; without
//!   `body` there is none, and every argument must then be used in the URL.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Range;
use std::path::PathBuf;
use std::time::Instant;

pub use airlock_worker::declared::{DeclaredToolError, ToolEntry, ToolNetwork};
use airlock_worker::declared::{check_field, mentions_placeholder, placeholder};
use airlock_worker::{CallContext, Tool, ToolDefinition, ToolOutcome};
use base64::Engine;
use bytes::Bytes;
use http::Method;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::client::{self, Client, Request, Response};
use crate::tools::{self, METHODS};

/// What replaces a secret (or a piece of one) in anything a call returns.
pub const REDACTED: &str = "[redacted]";

/// The `http` table of a `[[tools]]` entry, as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpTable {
    method: String,
    url: String,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    body: Option<BodyKind>,
}

/// What a request carries as its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum BodyKind {
    /// The arguments the URL does not use, as one JSON object.
    Json,
}

/// One piece of the URL template.
#[derive(Debug, Clone, PartialEq)]
enum UrlPart {
    Literal(String),
    /// `{field}`; `in_path`: before the query, where `.` and `..` segments mean
    /// something.
    Field {
        name: String,
        in_path: bool,
    },
}

/// One piece of a header value.
#[derive(Clone, PartialEq)]
enum ValuePart {
    Literal(String),
    Env(String),
    File(PathBuf),
}

/// A checked http tool: everything but its secrets, which only the http worker reads.
/// Every component compiles it at load, so a bad entry stops them all at start.
#[derive(Debug, Clone)]
pub struct HttpTemplate {
    definition: ToolDefinition,
    method: Method,
    url: Vec<UrlPart>,
    /// Path segments of the URL with every field filled in by a plain value: a call
    /// whose URL has fewer lost one to a `.` or `..` segment.
    segments: usize,
    /// Scheme, host and port of the URL: every call's URL must have exactly these, a
    /// second check behind the one on the template's text.
    origin: url::Origin,
    headers: SecretHeaders,
    body: Option<BodyKind>,
    url_fields: BTreeSet<String>,
    timeout: Option<f64>,
}

impl std::fmt::Debug for ValuePart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Literal(text) => write!(f, "{text:?}"),
            Self::Env(name) => write!(f, "${{env:{name}}}"),
            Self::File(path) => write!(f, "${{file:{}}}", path.display()),
        }
    }
}

impl HttpTemplate {
    /// Checks one entry: the common checks, then method, url, headers and body; every
    /// problem is an error naming the tool and the place. No secret is read here.
    pub fn compile(entry: &ToolEntry) -> Result<Self, DeclaredToolError> {
        let invalid = |reason: String| DeclaredToolError::Invalid {
            tool: entry.name.clone(),
            reason,
        };
        let definition = entry.definition()?;
        let properties = entry.properties()?;
        let Some(raw) = &entry.http else {
            return Err(invalid("no http: this entry is the shell worker's".into()));
        };
        if entry.stdin.is_some() || !entry.env.is_empty() || entry.network != ToolNetwork::None {
            return Err(invalid(
                "stdin, env and network are for command tools; an http tool has none".into(),
            ));
        }
        let table: HttpTable = serde_json::from_value(raw.clone())
            .map_err(|e| invalid(format!("http: {e} (it takes method, url, headers, body)")))?;

        let upper = table.method.trim().to_ascii_uppercase();
        if !METHODS.contains(&upper.as_str()) {
            return Err(invalid(format!(
                "http.method {:?} is not supported; use one of {}",
                table.method,
                METHODS.join(", ")
            )));
        }
        let method = Method::from_bytes(upper.as_bytes())
            .map_err(|e| invalid(format!("http.method {:?}: {e}", table.method)))?;

        let (url, segments, origin) =
            compile_url(&table.url).map_err(|e| invalid(format!("http.url: {e}")))?;
        let required: BTreeSet<&str> = entry
            .input_schema
            .get("required")
            .and_then(Value::as_array)
            .map(|list| list.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut url_fields = BTreeSet::new();
        for part in &url {
            if let UrlPart::Field { name, .. } = part {
                check_field(&properties, name, "http.url").map_err(&invalid)?;
                if !required.contains(name.as_str()) {
                    return Err(invalid(format!(
                        "http.url uses {{{name}}}, which input_schema.required must list: a \
                         URL with a part left out would be another URL"
                    )));
                }
                url_fields.insert(name.clone());
            }
        }

        let headers =
            SecretHeaders::compile(&table.headers, "http.headers", |_| None).map_err(&invalid)?;

        if table.body.is_some() && matches!(method, Method::GET | Method::HEAD) {
            return Err(invalid(format!(
                "http.body: a {method} request carries no body; put the fields in the url's \
                 query, or use another method"
            )));
        }
        if table.body.is_none()
            && let Some(unused) = properties.keys().find(|k| !url_fields.contains(*k))
        {
            return Err(invalid(format!(
                "input_schema.properties has {unused:?}, which the url does not use and no \
                 body carries; use it in the url or add body = \"json\""
            )));
        }
        if let Some(t) = entry.timeout_seconds
            && !(t.is_finite() && t > 0.0)
        {
            return Err(invalid("timeout_seconds must be a positive number".into()));
        }
        Ok(Self {
            definition,
            method,
            url,
            segments,
            origin,
            headers,
            body: table.body,
            url_fields,
            timeout: entry.timeout_seconds,
        })
    }

    pub fn name(&self) -> &str {
        &self.definition.name
    }

    /// The environment variables its headers read (so the launcher passes exactly these
    /// to the http worker, whose environment is otherwise an allowlist).
    pub fn env_names(&self) -> Vec<String> {
        self.headers.env_names()
    }

    /// Reads the secrets its headers name, now (the http worker does this once at
    /// start, before it gives up file access). A missing variable, an unreadable file,
    /// an empty secret or one that cannot be a header value is an error naming the
    /// variable or file, never the value.
    pub fn resolve(self) -> Result<ResolvedTemplate, DeclaredToolError> {
        let (headers, redactor) =
            self.headers
                .resolve("http.headers")
                .map_err(|reason| DeclaredToolError::Invalid {
                    tool: self.definition.name.clone(),
                    reason,
                })?;
        Ok(ResolvedTemplate {
            template: self,
            headers,
            redactor,
        })
    }
}

/// Header values that may name secrets, `${env:NAME}` or `${file:/path}`: checked when
/// the config loads, read only by the http worker at its start ([`Self::resolve`]).
/// The declared http tools' headers and the Streamable HTTP MCP servers' share it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SecretHeaders {
    /// Each header as the entry spells its name (for messages), its name, its parts.
    headers: Vec<(String, HeaderName, Vec<ValuePart>)>,
}

impl SecretHeaders {
    /// Checks each header of `raw`: a valid name the worker does not set itself (nor
    /// one `reserved` gives a reason for), and a value of literal text and secret
    /// references. Errors start with `place.<name>`.
    pub fn compile(
        raw: &BTreeMap<String, String>,
        place: &str,
        reserved: impl Fn(&HeaderName) -> Option<&'static str>,
    ) -> Result<Self, String> {
        let mut headers = Vec::with_capacity(raw.len());
        for (name, value) in raw {
            let place = format!("{place}.{name}");
            let header_name = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| {
                format!("{place}: not a valid HTTP header name; use letters, digits and '-'")
            })?;
            if client::forbidden_header(&header_name) {
                return Err(format!(
                    "{place}: the worker sets this header itself (or it belongs to the \
                     connection); remove it"
                ));
            }
            if let Some(reason) = reserved(&header_name) {
                return Err(format!("{place}: {reason}; remove it"));
            }
            let parts = compile_value(value).map_err(|e| format!("{place}: {e}"))?;
            headers.push((name.clone(), header_name, parts));
        }
        Ok(Self { headers })
    }

    /// The environment variables the values read.
    pub fn env_names(&self) -> Vec<String> {
        self.headers
            .iter()
            .flat_map(|(_, _, parts)| parts)
            .filter_map(|part| match part {
                ValuePart::Env(name) => Some(name.clone()),
                _ => None,
            })
            .collect()
    }

    /// Reads the secrets the values name, now (the http worker does this once at
    /// start, before it gives up file access): the headers, those holding a secret
    /// marked sensitive, and the redactor of every secret read. A missing variable, an
    /// unreadable file, an empty secret or one that cannot be a header value is an
    /// error naming the variable or file, never the value.
    pub(crate) fn resolve(&self, place: &str) -> Result<(HeaderMap, Redactor), String> {
        let mut headers = HeaderMap::new();
        let mut secrets = Vec::new();
        for (name, header_name, parts) in &self.headers {
            let mut value = String::new();
            let mut secret = false;
            for part in parts {
                let (text, what) = match part {
                    ValuePart::Literal(text) => {
                        value.push_str(text);
                        continue;
                    }
                    ValuePart::Env(var) => (
                        std::env::var(var).map_err(|e| {
                            format!(
                                "{place}.{name}: the environment variable {var} {}",
                                match e {
                                    std::env::VarError::NotPresent => "is not set",
                                    std::env::VarError::NotUnicode(_) => "is not valid UTF-8",
                                }
                            )
                        })?,
                        format!("the environment variable {var}"),
                    ),
                    // One trailing line break is what editors and `echo` leave.
                    ValuePart::File(path) => (
                        std::fs::read_to_string(path)
                            .map(|text| {
                                text.strip_suffix('\n')
                                    .map(|t| t.strip_suffix('\r').unwrap_or(t).to_owned())
                                    .unwrap_or(text)
                            })
                            .map_err(|e| {
                                format!(
                                    "{place}.{name}: cannot read the secret file {}: {}",
                                    path.display(),
                                    e.kind()
                                )
                            })?,
                        format!("the secret file {}", path.display()),
                    ),
                };
                if text.is_empty() {
                    return Err(format!("{place}.{name}: {what} is empty"));
                }
                value.push_str(&text);
                secrets.push(Secret(text.into_bytes()));
                secret = true;
            }
            let mut header_value = HeaderValue::from_str(&value).map_err(|_| {
                format!(
                    "{place}.{name}: the value (with its secrets) contains a line break or \
                     control character"
                )
            })?;
            header_value.set_sensitive(secret);
            headers.append(header_name.clone(), header_value);
        }
        Ok((headers, Redactor::new(&secrets)))
    }
}

/// The URL template's parts, how many path segments it has once filled in, and its
/// scheme, host and port.
fn compile_url(raw: &str) -> Result<(Vec<UrlPart>, usize, url::Origin), String> {
    let scheme_end = ["http://", "https://"]
        .iter()
        .find(|s| {
            raw.get(..s.len())
                .is_some_and(|p| p.eq_ignore_ascii_case(s))
        })
        .map(|s| s.len())
        .ok_or("must be an absolute http:// or https:// URL")?;
    // The authority ends at the first '/', '?', '#' or '\' (where the URL parser's ends
    // too: it takes '\' for '/' in http and https URLs).
    let authority_end = raw[scheme_end..]
        .find(['/', '?', '#', '\\'])
        .map_or(raw.len(), |i| scheme_end + i);
    // The parser skips every '/' and '\' after the scheme (and drops tabs and line
    // breaks anywhere), so after an empty authority or a '\' the host would be read
    // from what follows: a placeholder there would let the model choose the host.
    let authority = &raw[scheme_end..authority_end];
    if authority.chars().all(|c| matches!(c, '\t' | '\n' | '\r')) {
        return Err(
            "no host between the scheme and the path (the URL parser would read the host from \
             the path); write https://host/…, so that the model cannot choose the host"
                .into(),
        );
    }
    if raw[authority_end..].starts_with('\\') {
        return Err(
            "a '\\' where the host ends (the URL parser reads it as '/' and may read the host \
             from what follows); write '/', so that the model cannot choose the host"
                .into(),
        );
    }
    if raw[..authority_end].contains(['{', '}']) {
        return Err(
            "a placeholder (or brace) in the scheme, user info, host or port; only the path \
             and query may hold {field}, so that the model cannot choose the host"
                .into(),
        );
    }
    if raw.contains('#') {
        return Err("a fragment (#…) is never sent; remove it".into());
    }
    let mut parts = Vec::new();
    let mut rest = &raw[authority_end..];
    let mut literal = raw[..authority_end].to_owned();
    let mut in_query = false;
    while let Some(start) = rest.find(['{', '}']) {
        let end = rest[start..].find('}').map(|e| start + e);
        let field = end.and_then(|end| placeholder(&rest[start..=end]));
        let (Some(end), Some(field)) = (end, field) else {
            return Err(format!(
                "{:?} is not a {{field}} placeholder (a field name of letters, digits and _)",
                &rest[start..end.map_or(rest.len(), |e| e + 1)]
            ));
        };
        in_query |= rest[..start].contains('?');
        literal.push_str(&rest[..start]);
        parts.push(UrlPart::Literal(std::mem::take(&mut literal)));
        parts.push(UrlPart::Field {
            name: field.to_owned(),
            in_path: !in_query,
        });
        rest = &rest[end + 1..];
    }
    literal.push_str(rest);
    parts.push(UrlPart::Literal(literal));
    let sample = fill(&parts, |_| Ok("x".to_owned()))?;
    let url = crate::resolve::parse_url(&sample).map_err(|e| e.to_string())?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err("user info (user:password@) in the URL; send credentials in headers".into());
    }
    if url.host().is_none() {
        return Err("the URL has no host".into());
    }
    Ok((parts, segment_count(&url), url.origin()))
}

/// Literal text and `${env:NAME}` / `${file:/path}` references of one header value.
fn compile_value(raw: &str) -> Result<Vec<ValuePart>, String> {
    let mut parts = Vec::new();
    let mut rest = raw;
    while let Some(start) = rest.find("${") {
        let end = rest[start..]
            .find('}')
            .map(|e| start + e)
            .ok_or("an unclosed ${…}; write ${env:NAME} or ${file:/path}")?;
        let literal = &rest[..start];
        if mentions_placeholder(literal) {
            return Err(
                "a {field} placeholder; header values are the operator's, never the model's".into(),
            );
        }
        if !literal.is_empty() {
            parts.push(ValuePart::Literal(literal.to_owned()));
        }
        let reference = &rest[start + 2..end];
        if let Some(var) = reference.strip_prefix("env:") {
            let valid = !var.is_empty()
                && !var.starts_with(|c: char| c.is_ascii_digit())
                && var.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(format!(
                    "${{env:{var}}}: a variable name is letters, digits and _"
                ));
            }
            parts.push(ValuePart::Env(var.to_owned()));
        } else if let Some(path) = reference.strip_prefix("file:") {
            if !path.starts_with('/') {
                return Err(format!("${{file:{path}}}: the path must be absolute"));
            }
            parts.push(ValuePart::File(PathBuf::from(path)));
        } else {
            return Err(format!(
                "${{{reference}}} is not a secret reference; write ${{env:NAME}} or ${{file:/path}}"
            ));
        }
        rest = &rest[end + 1..];
    }
    if mentions_placeholder(rest) {
        return Err(
            "a {field} placeholder; header values are the operator's, never the model's".into(),
        );
    }
    if !rest.is_empty() {
        parts.push(ValuePart::Literal(rest.to_owned()));
    }
    Ok(parts)
}

/// The URL text with each field replaced by `value(name)` (already encoded).
fn fill(
    parts: &[UrlPart],
    mut value: impl FnMut(&UrlPart) -> Result<String, String>,
) -> Result<String, String> {
    let mut out = String::new();
    for part in parts {
        match part {
            UrlPart::Literal(text) => out.push_str(text),
            field @ UrlPart::Field { .. } => out.push_str(&value(field)?),
        }
    }
    Ok(out)
}

fn segment_count(url: &url::Url) -> usize {
    url.path_segments().map_or(0, Iterator::count)
}

/// Every byte but ASCII letters, digits and `-._~` as `%XX`: a value can add neither a
/// path segment, a query parameter, a fragment nor an escape of its own.
pub fn percent_encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// One secret's bytes; never printed.
#[derive(Clone)]
struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

/// Replaces every secret, and the encodings a server is likely to echo it in, with
/// [`REDACTED`]: as the bytes spell it, and as their JSON string escapes (`\/`,
/// `\u0074`, a surrogate pair…) decode to it, which any JSON parser on the model's side
/// would do.
#[derive(Clone, Default)]
pub(crate) struct Redactor {
    /// Longest first, so a secret that contains another is replaced whole.
    needles: Vec<Needle>,
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Redactor({} forms)", self.needles.len())
    }
}

impl Redactor {
    fn new(secrets: &[Secret]) -> Self {
        let mut needles = BTreeSet::new();
        for Secret(bytes) in secrets {
            needles.insert(bytes.clone());
            needles.insert(
                base64::engine::general_purpose::STANDARD
                    .encode(bytes)
                    .into_bytes(),
            );
            needles.insert(
                base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .encode(bytes)
                    .into_bytes(),
            );
            if let Ok(text) = std::str::from_utf8(bytes) {
                needles.insert(percent_encode(text).into_bytes());
                // As it appears inside a JSON string.
                if let Ok(json) = serde_json::to_string(text) {
                    let inner = json.strip_prefix('"').and_then(|j| j.strip_suffix('"'));
                    if let Some(inner) = inner {
                        needles.insert(inner.as_bytes().to_vec());
                    }
                }
            }
        }
        let mut needles: Vec<Needle> = needles
            .into_iter()
            .filter(|n| !n.is_empty())
            .map(Needle::new)
            .collect();
        needles.sort_by_key(|n| std::cmp::Reverse(n.len()));
        Self { needles }
    }

    pub(crate) fn bytes(&self, haystack: &[u8]) -> Vec<u8> {
        let mut out = haystack.to_vec();
        for needle in &self.needles {
            out = replace_all(&out, needle, REDACTED.as_bytes());
        }
        // Without a backslash there is no escape, and the bytes are what they decode to.
        if !self.needles.is_empty() && out.contains(&b'\\') {
            out = self.unescaped(out);
        }
        out
    }

    /// [`Self::bytes`] for a body cut at the size limit: a secret cut in two leaves its
    /// start at the end, which is redacted too — spelled as it is, or with JSON escapes;
    /// an escape the cut leaves unfinished could be spelling the secret's next
    /// character, so it goes too.
    pub(crate) fn truncated(&self, haystack: &[u8]) -> Vec<u8> {
        let mut out = self.bytes(haystack);
        let mut cut = self
            .needles
            .iter()
            .filter_map(|needle| {
                (1..needle.len())
                    .rev()
                    .find(|&n| out.ends_with(&needle.bytes[..n]))
            })
            .max()
            .map(|n| out.len() - n);
        if !self.needles.is_empty() && out.contains(&b'\\') {
            let escaped = self.escaped_cut(&out);
            cut = match (cut, escaped) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        if let Some(at) = cut {
            out.truncate(at);
            out.extend_from_slice(REDACTED.as_bytes());
        }
        out
    }

    pub(crate) fn text(&self, text: &str) -> String {
        String::from_utf8_lossy(&self.bytes(text.as_bytes())).into_owned()
    }

    /// `raw` with every needle its JSON escapes decode to replaced: the whole spelling,
    /// from the start of the escape of the match's first byte to the end of its last
    /// one's. One pass over `raw`, every needle's matcher fed each decoded byte, so the
    /// work is linear in `raw` however a server arranges its near-matches.
    fn unescaped(&self, raw: Vec<u8>) -> Vec<u8> {
        let longest = self.needles.first().map_or(0, Needle::len);
        let mut matched = vec![0; self.needles.len()];
        // Where the escape of each of the last `longest` decoded bytes starts: a match's
        // raw start, without keeping a map of the whole body.
        let mut starts = VecDeque::with_capacity(longest);
        // Sorted and disjoint. A match ends no earlier than any before it, so it can
        // overlap only the last few, which it absorbs.
        let mut ranges: Vec<Range<usize>> = Vec::new();
        for unit in Unescape::new(&raw) {
            for &byte in unit.bytes() {
                if starts.len() == longest {
                    starts.pop_front();
                }
                starts.push_back(unit.raw.start);
                for (needle, m) in self.needles.iter().zip(&mut matched) {
                    *m = needle.step(*m, byte);
                    if *m < needle.len() {
                        continue;
                    }
                    *m = 0;
                    let first = starts
                        .len()
                        .checked_sub(needle.len())
                        .and_then(|i| starts.get(i));
                    let Some(&first) = first else {
                        continue;
                    };
                    let mut range = first..unit.raw.end;
                    while let Some(last) = ranges.last().filter(|last| last.end > range.start) {
                        range.start = range.start.min(last.start);
                        ranges.pop();
                    }
                    ranges.push(range);
                }
            }
        }
        if ranges.is_empty() {
            return raw;
        }
        let mut out = Vec::with_capacity(raw.len());
        let mut at = 0;
        for range in ranges {
            out.extend_from_slice(&raw[at..range.start]);
            out.extend_from_slice(REDACTED.as_bytes());
            at = range.end;
        }
        out.extend_from_slice(&raw[at..]);
        out
    }

    /// Where a needle's start, spelled with JSON escapes, ends `raw` (a cut body): the
    /// raw offset to redact from, or `None`. An escape the end cuts off may be spelling
    /// any character, so it counts as the start of every needle.
    fn escaped_cut(&self, raw: &[u8]) -> Option<usize> {
        let longest = self.needles.first().map_or(0, Needle::len);
        let mut tail: VecDeque<(u8, usize)> = VecDeque::with_capacity(longest);
        let mut unfinished = None;
        for unit in Unescape::new(raw) {
            if unit.is_lone_backslash() && is_cut_escape(&raw[unit.raw.start..]) {
                // It runs to the end: nothing after it decodes on its own.
                unfinished = Some(unit.raw.start);
                break;
            }
            for &byte in unit.bytes() {
                if tail.len() == longest {
                    tail.pop_front();
                }
                tail.push_back((byte, unit.raw.start));
            }
        }
        let shortest = if unfinished.is_some() { 0 } else { 1 };
        let decoded: Vec<u8> = tail.iter().map(|&(byte, _)| byte).collect();
        let n = self
            .needles
            .iter()
            .filter_map(|needle| {
                (shortest..needle.len())
                    .rev()
                    .find(|&n| decoded.ends_with(&needle.bytes[..n]))
            })
            .max()?;
        match n {
            0 => unfinished,
            n => tail
                .len()
                .checked_sub(n)
                .and_then(|i| tail.get(i))
                .map(|&(_, start)| start),
        }
    }
}

/// One form of a secret to find, with its KMP table: finding it takes time linear in
/// the haystack, which a remote server chose, whatever near-matches it holds.
#[derive(Clone)]
struct Needle {
    bytes: Vec<u8>,
    /// `border[i]`: the length of the longest proper prefix of `bytes[..=i]` that also
    /// ends it.
    border: Vec<usize>,
}

impl Needle {
    fn new(bytes: Vec<u8>) -> Self {
        let mut border = vec![0; bytes.len()];
        let mut k = 0;
        for i in 1..bytes.len() {
            while k > 0 && bytes[i] != bytes[k] {
                k = border[k - 1];
            }
            if bytes[i] == bytes[k] {
                k += 1;
            }
            border[i] = k;
        }
        Self { bytes, border }
    }

    fn len(&self) -> usize {
        self.bytes.len()
    }

    /// How many of the needle's first bytes end the text once `byte` follows a text
    /// that `matched` of them ended; [`Self::len`] is a match.
    fn step(&self, mut matched: usize, byte: u8) -> usize {
        loop {
            if self.bytes.get(matched) == Some(&byte) {
                return matched + 1;
            }
            match matched.checked_sub(1).and_then(|i| self.border.get(i)) {
                Some(&shorter) => matched = shorter,
                None => return 0,
            }
        }
    }
}

/// `haystack` with `needle` replaced by `with`, leftmost first, matches not overlapping.
fn replace_all(haystack: &[u8], needle: &Needle, with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len());
    let mut matched = 0;
    for &byte in haystack {
        out.push(byte);
        matched = needle.step(matched, byte);
        if matched == needle.len() {
            // The match's bytes are the last pushed: none of an earlier `with`.
            out.truncate(out.len() - matched);
            out.extend_from_slice(with);
            matched = 0;
        }
    }
    out
}

/// A piece of raw text and the bytes a JSON parser reads it as: a valid escape and the
/// UTF-8 of its character, or any other byte (a backslash that starts no valid escape
/// too) as itself.
struct Unit {
    raw: Range<usize>,
    decoded: [u8; 4],
    len: usize,
}

impl Unit {
    fn bytes(&self) -> &[u8] {
        &self.decoded[..self.len]
    }

    fn is_lone_backslash(&self) -> bool {
        self.raw.len() == 1 && self.bytes() == b"\\"
    }
}

/// The [`Unit`]s of a raw text, front to back, as a JSON parser reads a string's text.
struct Unescape<'a> {
    raw: &'a [u8],
    at: usize,
}

impl<'a> Unescape<'a> {
    fn new(raw: &'a [u8]) -> Self {
        Self { raw, at: 0 }
    }
}

impl Iterator for Unescape<'_> {
    type Item = Unit;

    fn next(&mut self) -> Option<Unit> {
        let start = self.at;
        let rest = self.raw.get(start..)?;
        let &first = rest.first()?;
        let mut decoded = [first, 0, 0, 0];
        let escaped = if first == b'\\' { escape(rest) } else { None };
        let (len, raw_len) = match escaped {
            Some((c, raw_len)) => (c.encode_utf8(&mut decoded).len(), raw_len),
            None => (1, 1),
        };
        self.at = start + raw_len;
        Some(Unit {
            raw: start..self.at,
            decoded,
            len,
        })
    }
}

/// The character a valid JSON escape at the start of `raw` stands for, and the escape's
/// length.
fn escape(raw: &[u8]) -> Option<(char, usize)> {
    let c = match raw.get(1)? {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => return unicode_escape(raw),
        _ => return None,
    };
    Some((c, 2))
}

/// `\uXXXX`, or the surrogate pair `\uD83D\uDE00` of a character beyond the BMP; a
/// lone surrogate is no character.
fn unicode_escape(raw: &[u8]) -> Option<(char, usize)> {
    let unit = hex4(raw.get(2..6)?)?;
    if !(0xD800..0xDC00).contains(&unit) {
        return char::from_u32(unit).map(|c| (c, 6));
    }
    if raw.get(6..8)? != b"\\u" {
        return None;
    }
    let low = hex4(raw.get(8..12)?)?;
    if !(0xDC00..0xE000).contains(&low) {
        return None;
    }
    char::from_u32(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)).map(|c| (c, 12))
}

/// Four hex digits, either case.
fn hex4(digits: &[u8]) -> Option<u32> {
    digits
        .iter()
        .try_fold(0, |n, &d| Some(n * 16 + char::from(d).to_digit(16)?))
}

/// Whether `rest`, which runs to the end of the text, is an escape the end cut off: `\`,
/// `\u` and fewer than four hex digits, or a high surrogate's escape and none or the
/// start of the low one's.
fn is_cut_escape(rest: &[u8]) -> bool {
    let short_hex = |digits: &[u8]| digits.len() < 4 && digits.iter().all(u8::is_ascii_hexdigit);
    if rest == b"\\" {
        return true;
    }
    let Some(after) = rest.strip_prefix(b"\\u") else {
        return false;
    };
    if short_hex(after) {
        return true;
    }
    let (Some(high), Some(low)) = (after.get(..4).and_then(hex4), after.get(4..)) else {
        return false;
    };
    if !(0xD800..0xDC00).contains(&high) {
        return false;
    }
    match low {
        [] | [b'\\'] => true,
        [b'\\', b'u', digits @ ..] => short_hex(digits),
        _ => false,
    }
}

/// An [`HttpTemplate`] with its secrets read: only the http worker holds one.
pub struct ResolvedTemplate {
    template: HttpTemplate,
    /// Header values with their secrets in, those marked sensitive.
    headers: HeaderMap,
    redactor: Redactor,
}

impl std::fmt::Debug for ResolvedTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResolvedTemplate")
            .field("template", &self.template)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("redactor", &self.redactor)
            .finish()
    }
}

/// A declared http tool as the http worker serves it.
pub(crate) struct DeclaredHttpTool {
    resolved: ResolvedTemplate,
    client: Client,
}

impl std::fmt::Debug for DeclaredHttpTool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeclaredHttpTool")
            .field("resolved", &self.resolved)
            .finish_non_exhaustive()
    }
}

/// The text of one URL argument, or why it cannot be one.
fn argument_text(arguments: &Value, field: &str) -> Result<String, String> {
    match arguments.get(field) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Number(n)) => Ok(n.to_string()),
        Some(Value::Bool(b)) => Ok(b.to_string()),
        None | Some(Value::Null) => Err(format!(
            "argument {field:?} is required: the url is built from it"
        )),
        Some(_) => Err(format!(
            "argument {field:?} must be a string, number or boolean: it goes into the url"
        )),
    }
}

impl DeclaredHttpTool {
    pub(crate) fn new(resolved: ResolvedTemplate, client: Client) -> Self {
        Self { resolved, client }
    }

    /// The request for one call's arguments; nothing touches the network yet.
    fn request(&self, arguments: &Value) -> Result<Request, String> {
        let t = &self.resolved.template;
        let s = self.client.settings();
        let built = fill(&t.url, |part| {
            let UrlPart::Field { name, in_path } = part else {
                return Ok(String::new());
            };
            let text = argument_text(arguments, name)?;
            if *in_path && (text.is_empty() || text == "." || text == "..") {
                return Err(format!(
                    "argument {name:?} is {text:?}, which as part of the url's path would \
                     name another path; pass the value itself"
                ));
            }
            Ok(percent_encode(&text))
        })?;
        let url = crate::resolve::parse_url(&built).map_err(|e| e.to_string())?;
        // The template's check makes this impossible; should a spelling slip past it,
        // the secret headers still never go to a host the arguments chose.
        if url.origin() != t.origin || !url.username().is_empty() || url.password().is_some() {
            return Err(
                "the arguments would change the url's scheme, host or port; the tool only \
                 reaches the host its url names"
                    .into(),
            );
        }
        if segment_count(&url) != t.segments {
            return Err(
                "the arguments would change the url's path (a '.' or '..' segment); pass the \
                 values themselves"
                    .into(),
            );
        }
        let mut headers = self.resolved.headers.clone();
        let body = match t.body {
            None => Bytes::new(),
            Some(BodyKind::Json) => {
                let object: Map<String, Value> = arguments
                    .as_object()
                    .map(|o| {
                        o.iter()
                            .filter(|(k, _)| !t.url_fields.contains(*k))
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect()
                    })
                    .unwrap_or_default();
                if !headers.contains_key(header::CONTENT_TYPE) {
                    headers.insert(
                        header::CONTENT_TYPE,
                        HeaderValue::from_static("application/json"),
                    );
                }
                Bytes::from(serde_json::to_vec(&object).map_err(|e| e.to_string())?)
            }
        };
        if body.len() as u64 > s.max_request_body_bytes {
            return Err(format!(
                "the arguments make a {} byte body; the limit is {} bytes \
                 ([http] max_request_body_bytes); send less",
                body.len(),
                s.max_request_body_bytes
            ));
        }
        Ok(Request {
            method: t.method.clone(),
            url,
            headers,
            body,
            max_bytes: s.max_response_bytes,
        })
    }

    /// `resp` with every secret taken out of its headers and body, before anything is
    /// built from them (a binary body is base64-encoded afterwards).
    fn redact(&self, mut resp: Response) -> Response {
        let redactor = &self.resolved.redactor;
        resp.body = if resp.truncated {
            redactor.truncated(&resp.body)
        } else {
            redactor.bytes(&resp.body)
        };
        let mut headers = HeaderMap::with_capacity(resp.headers.len());
        for (name, value) in &resp.headers {
            let cleaned = redactor.bytes(value.as_bytes());
            let value = HeaderValue::from_bytes(&cleaned)
                .unwrap_or_else(|_| HeaderValue::from_static(REDACTED));
            headers.append(name.clone(), value);
        }
        resp.headers = headers;
        resp
    }
}

#[airlock_worker::async_trait]
impl Tool for DeclaredHttpTool {
    fn definition(&self) -> ToolDefinition {
        self.resolved.template.definition.clone()
    }

    async fn execute(&self, arguments: Value, ctx: CallContext) -> ToolOutcome {
        let started = Instant::now();
        let tool = self.resolved.template.name();
        let redactor = &self.resolved.redactor;
        let outcome = match self.request(&arguments) {
            Err(message) => ToolOutcome::error(redactor.text(&message)),
            Ok(request) => {
                let budget = tools::call_budget(
                    self.client.settings(),
                    self.resolved.template.timeout,
                    "[[tools]] timeout_seconds",
                    &ctx,
                );
                match budget {
                    Err(message) => ToolOutcome::error(message),
                    Ok((budget, source)) => {
                        match tools::send_within(&self.client, request, budget, source, &ctx, tool)
                            .await
                        {
                            Ok(resp) => {
                                let result = tools::request_result(&self.redact(resp), started);
                                // Anything else built from the response (final_url,
                                // notes) is redacted as text.
                                let text = serde_json::to_string(&result).unwrap_or_default();
                                ToolOutcome::text(redactor.text(&text))
                            }
                            Err(message) => ToolOutcome::error(redactor.text(&message)),
                        }
                    }
                }
            }
        };
        tracing::debug!(
            tool,
            call_id = %ctx.call_id,
            is_error = outcome.is_error,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "declared http call finished"
        );
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::Arc;

    fn entry(http: Value, schema: Value) -> ToolEntry {
        ToolEntry {
            name: "fetch_user_details".into(),
            title: None,
            description: "Look a user up in the CRM.".into(),
            input_schema: schema,
            annotations: Default::default(),
            approval: None,
            command: None,
            stdin: None,
            timeout_seconds: None,
            env: BTreeMap::new(),
            network: ToolNetwork::None,
            egress_allow: None,
            http: Some(http),
        }
    }

    fn user_schema() -> Value {
        json!({
            "type": "object",
            "properties": {"user_id": {"type": "string"}},
            "required": ["user_id"],
        })
    }

    fn compile_err(http: Value, schema: Value) -> String {
        HttpTemplate::compile(&entry(http, schema))
            .unwrap_err()
            .to_string()
    }

    fn tool(http: Value, schema: Value) -> DeclaredHttpTool {
        let resolved = HttpTemplate::compile(&entry(http, schema))
            .unwrap()
            .resolve()
            .unwrap();
        let settings = Arc::new(crate::HttpConfig::default().validate().unwrap());
        DeclaredHttpTool::new(resolved, Client::new(settings, None).unwrap())
    }

    #[test]
    fn placeholders_never_reach_scheme_userinfo_host_or_port() {
        for url in [
            "http://{user_id}/users",
            "http://api.{user_id}.example.com/",
            "http://example.com:{user_id}/",
            "http://{user_id}@example.com/",
            "{user_id}://example.com/",
            "http://example.com{user_id}",
            "http://example.com{user_id}/x",
            // The URL parser skips any run of '/' and '\' after the scheme, so the
            // first segment would become the host.
            "https:///{user_id}/v1",
            "https://\\/{user_id}/v1",
            "https://\\{user_id}/v1",
            "https://\t/{user_id}/v1",
            "https:////{user_id}/v1",
            "https://@/{user_id}/v1",
        ] {
            let e = compile_err(json!({"method": "GET", "url": url}), user_schema());
            assert!(
                e.starts_with("[[tools]] fetch_user_details: http.url: ")
                    && (e.contains("so that the model cannot choose the host")
                        || e.contains("absolute http")),
                "{url}: {e}"
            );
        }
        let e = compile_err(
            json!({"method": "GET", "url": "http://u:p@example.com/{user_id}"}),
            user_schema(),
        );
        assert!(e.contains("user info"), "{e}");
        let e = compile_err(
            json!({"method": "GET", "url": "ftp://example.com/{user_id}"}),
            user_schema(),
        );
        assert!(e.contains("absolute http:// or https://"), "{e}");
    }

    #[test]
    fn a_call_never_reaches_another_host_than_the_templates() {
        // Should a template spelling slip past the load check (as `https:///{field}` once
        // did), the built URL is still compared with the template's scheme, host and port.
        let mut tool = tool(
            json!({"method": "GET", "url": "https://crm.example.com/{user_id}/v1"}),
            user_schema(),
        );
        let ok = tool.request(&json!({"user_id": "evil.example"})).unwrap();
        assert_eq!(ok.url.as_str(), "https://crm.example.com/evil.example/v1");
        for prefix in ["https:///", "https://\\", "http://crm.example.com:8080@"] {
            tool.resolved.template.url = vec![
                UrlPart::Literal(prefix.into()),
                UrlPart::Field {
                    name: "user_id".into(),
                    in_path: true,
                },
                UrlPart::Literal("/v1".into()),
            ];
            // As such a template would count them: the field is taken for the host.
            tool.resolved.template.segments = 1;
            let e = tool
                .request(&json!({"user_id": "evil.example"}))
                .unwrap_err();
            assert!(
                e.contains("would change the url's scheme, host or port"),
                "{prefix}: {e}"
            );
        }
    }

    #[test]
    fn a_field_the_schema_lacks_is_named() {
        let e = compile_err(
            json!({"method": "GET", "url": "https://crm.example.com/users/{uid}"}),
            user_schema(),
        );
        assert!(
            e.starts_with("[[tools]] fetch_user_details: http.url names the field \"uid\"")
                && e.contains("it has: user_id"),
            "{e}"
        );
        let optional = json!({"type": "object", "properties": {"user_id": {"type": "string"}}});
        let e = compile_err(
            json!({"method": "GET", "url": "https://crm.example.com/users/{user_id}"}),
            optional,
        );
        assert!(e.contains("input_schema.required must list"), "{e}");
        let e = compile_err(
            json!({"method": "GET", "url": "https://crm.example.com/users/{user-id}"}),
            user_schema(),
        );
        assert!(e.contains("is not a {field} placeholder"), "{e}");
    }

    #[test]
    fn unknown_keys_methods_bodies_and_headers_are_start_up_errors() {
        let url = "https://crm.example.com/users/{user_id}";
        let e = compile_err(
            json!({"method": "GET", "url": url, "query": {}}),
            user_schema(),
        );
        assert!(
            e.starts_with("[[tools]] fetch_user_details: http: unknown field `query`"),
            "{e}"
        );
        let e = compile_err(json!({"url": url}), user_schema());
        assert!(e.contains("missing field `method`"), "{e}");
        for method in ["FETCH", "get /x", "CONNECT", "TRACE"] {
            let e = compile_err(json!({"method": method, "url": url}), user_schema());
            assert!(
                e.contains("is not supported; use one of GET"),
                "{method}: {e}"
            );
        }
        let e = compile_err(
            json!({"method": "GET", "url": url, "body": "json"}),
            user_schema(),
        );
        assert!(e.contains("a GET request carries no body"), "{e}");
        let e = compile_err(
            json!({"method": "POST", "url": url, "body": "form"}),
            user_schema(),
        );
        assert!(e.contains("unknown variant `form`"), "{e}");
        let two = json!({"type": "object", "required": ["user_id"],
            "properties": {"user_id": {"type": "string"}, "note": {"type": "string"}}});
        let e = compile_err(json!({"method": "POST", "url": url}), two.clone());
        assert!(
            e.contains("\"note\", which the url does not use and no body carries"),
            "{e}"
        );
        assert!(
            HttpTemplate::compile(&entry(
                json!({"method": "post", "url": url, "body": "json"}),
                two
            ))
            .is_ok()
        );
        for (headers, expected) in [
            (
                json!({"X-User": "{user_id}"}),
                "header values are the operator's",
            ),
            (
                json!({"Host": "evil"}),
                "the worker sets this header itself",
            ),
            (json!({"X-Key": "${ENV:K}"}), "is not a secret reference"),
            (
                json!({"X-Key": "${env:BAD-NAME}"}),
                "a variable name is letters",
            ),
            (json!({"X-Key": "${file:relative}"}), "must be absolute"),
            (json!({"X-Key": "${env:K"}), "an unclosed"),
        ] {
            let e = compile_err(
                json!({"method": "GET", "url": url, "headers": headers}),
                user_schema(),
            );
            assert!(e.contains(expected), "{headers}: {e}");
        }
    }

    #[test]
    fn a_missing_secret_names_the_variable_or_file_and_never_a_value() {
        let var = "AIRLOCK_TEST_SECRET_THAT_IS_NOT_SET";
        let template = HttpTemplate::compile(&entry(
            json!({"method": "GET", "url": "https://crm.example.com/users/{user_id}",
                   "headers": {"Authorization": format!("Bearer ${{env:{var}}}")}}),
            user_schema(),
        ))
        .unwrap();
        assert_eq!(template.env_names(), vec![var.to_owned()]);
        let e = template.resolve().unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "[[tools]] fetch_user_details: http.headers.Authorization: the environment variable {var} is not set"
            )
        );
        let e = HttpTemplate::compile(&entry(
            json!({"method": "GET", "url": "https://crm.example.com/users/{user_id}",
                   "headers": {"X-Key": "${file:/nonexistent/airlock/key}"}}),
            user_schema(),
        ))
        .unwrap()
        .resolve()
        .unwrap_err()
        .to_string();
        assert!(
            e.ends_with("cannot read the secret file /nonexistent/airlock/key: entity not found"),
            "{e}"
        );
        // A secret that cannot be a header value: the error names the header, not it.
        let dir = std::env::temp_dir().join(format!("airlock-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        std::fs::write(&file, "s3cr3t-line-one\ns3cr3t-line-two\n").unwrap();
        let e = HttpTemplate::compile(&entry(
            json!({"method": "GET", "url": "https://crm.example.com/users/{user_id}",
                   "headers": {"X-Key": format!("${{file:{}}}", file.display())}}),
            user_schema(),
        ))
        .unwrap()
        .resolve()
        .unwrap_err()
        .to_string();
        assert!(e.contains("line break") && !e.contains("s3cr3t"), "{e}");
        // One trailing newline is dropped; the value is sent, and Debug never shows it.
        std::fs::write(&file, "s3cr3t-value\n").unwrap();
        let resolved = HttpTemplate::compile(&entry(
            json!({"method": "GET", "url": "https://crm.example.com/users/{user_id}",
                   "headers": {"X-Key": format!("k=${{file:{}}}", file.display())}}),
            user_schema(),
        ))
        .unwrap()
        .resolve()
        .unwrap();
        assert_eq!(resolved.headers["x-key"], "k=s3cr3t-value");
        assert!(resolved.headers["x-key"].is_sensitive());
        let debug = format!("{resolved:?}");
        assert!(!debug.contains("s3cr3t"), "{debug}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn url_values_are_percent_encoded_and_cannot_change_its_structure() {
        let t = tool(
            json!({"method": "GET", "url": "https://crm.example.com/users/{user_id}/detail?v=1&q={user_id}"}),
            user_schema(),
        );
        for (value, encoded) in [
            ("../admin?x=1", "..%2Fadmin%3Fx%3D1"),
            ("a#frag", "a%23frag"),
            ("%2e%2e", "%252e%252e"),
            ("john smith", "john%20smith"),
            ("zoë/日本", "zo%C3%AB%2F%E6%97%A5%E6%9C%AC"),
            ("a&b=c", "a%26b%3Dc"),
            ("x\\y", "x%5Cy"),
            ("..", ""),
        ] {
            let request = t.request(&json!({"user_id": value}));
            if encoded.is_empty() {
                let e = request.unwrap_err();
                assert!(e.contains("would name another path"), "{value}: {e}");
                continue;
            }
            let url = request.unwrap().url;
            assert_eq!(url.host_str(), Some("crm.example.com"), "{value}");
            assert_eq!(
                url.as_str(),
                format!("https://crm.example.com/users/{encoded}/detail?v=1&q={encoded}"),
                "{value}"
            );
        }
        for value in [".", ""] {
            assert!(t.request(&json!({"user_id": value})).is_err(), "{value:?}");
        }
        // "." next to literal text in one segment still cannot make a ".." segment.
        let t = tool(
            json!({"method": "GET", "url": "https://crm.example.com/users/.{user_id}/x"}),
            user_schema(),
        );
        assert!(t.request(&json!({"user_id": "."})).is_err());
        let url = t.request(&json!({"user_id": "x"})).unwrap().url;
        assert_eq!(url.path(), "/users/.x/x");
        // In the query, a dot is data.
        let t = tool(
            json!({"method": "GET", "url": "https://crm.example.com/users?id={user_id}"}),
            user_schema(),
        );
        let url = t.request(&json!({"user_id": ".."})).unwrap().url;
        assert_eq!(url.as_str(), "https://crm.example.com/users?id=..");
        assert!(t.request(&json!({"user_id": ["a"]})).is_err());
        assert!(t.request(&json!({})).is_err());
    }

    #[test]
    fn the_json_body_holds_the_arguments_the_url_does_not() {
        let schema = json!({"type": "object", "required": ["user_id"],
            "properties": {"user_id": {"type": "string"}, "note": {"type": "string"}, "n": {"type": "integer"}}});
        let t = tool(
            json!({"method": "POST", "url": "https://crm.example.com/users/{user_id}/notes", "body": "json"}),
            schema,
        );
        let request = t
            .request(&json!({"user_id": "42", "note": "hi", "n": 3}))
            .unwrap();
        assert_eq!(request.method, Method::POST);
        assert_eq!(request.headers[header::CONTENT_TYPE], "application/json");
        let body: Value = serde_json::from_slice(&request.body).unwrap();
        assert_eq!(body, json!({"note": "hi", "n": 3}));
        assert_eq!(
            t.definition(),
            HttpTemplate::compile(&entry(
                json!({"method": "POST", "url": "https://crm.example.com/users/{user_id}/notes", "body": "json"}),
                json!({"type": "object", "required": ["user_id"],
                    "properties": {"user_id": {"type": "string"}, "note": {"type": "string"}, "n": {"type": "integer"}}}),
            ))
            .unwrap()
            .definition,
            "the worker serves exactly the entry's definition"
        );
    }

    #[test]
    fn redaction_covers_the_secret_its_encodings_and_a_cut_end() {
        let secret = "tok/en+v4lue=\"x\"";
        let r = Redactor::new(&[Secret(secret.as_bytes().to_vec())]);
        let b64 = base64::engine::general_purpose::STANDARD.encode(secret);
        let text = format!(
            "a {secret} b {b64} c {} d {}",
            percent_encode(secret),
            serde_json::to_string(secret).unwrap()
        );
        let out = r.text(&text);
        assert_eq!(
            out, "a [redacted] b [redacted] c [redacted] d \"[redacted]\"",
            "{out}"
        );
        let cut = r.truncated(format!("body: {}", &secret[..6]).as_bytes());
        assert_eq!(String::from_utf8(cut).unwrap(), "body: [redacted]");
        assert_eq!(r.truncated(b"body: t"), b"body: [redacted]".to_vec());
        assert_eq!(format!("{:?}", Secret(b"x".to_vec())), "[redacted]");
    }

    fn redactor(secret: &[u8]) -> Redactor {
        Redactor::new(&[Secret(secret.to_vec())])
    }

    #[test]
    fn a_secret_spelled_with_json_escapes_is_redacted_whole() {
        let r = redactor(b"tok/en");
        for (body, expected) in [
            // PHP's encoder writes every '/' as '\/'.
            (r#"{"echo":"tok\/en"}"#, r#"{"echo":"[redacted]"}"#),
            (r#"{"echo":"\u0074ok/en"}"#, r#"{"echo":"[redacted]"}"#),
            (r#"{"echo":"t\u006Fk/en"}"#, r#"{"echo":"[redacted]"}"#),
            (r#"{"echo":"t\u006fk/en"}"#, r#"{"echo":"[redacted]"}"#),
            (r#"\u0074\u006F\u006b\/\u0065n"#, "[redacted]"),
            (
                r#"a tok\/en, b \u0074ok/en."#,
                "a [redacted], b [redacted].",
            ),
            // An escaped backslash is a backslash: what follows it is no escape.
            (r#"tok\\/en \\u0074ok/en"#, r#"tok\\/en \\u0074ok/en"#),
        ] {
            assert_eq!(r.text(body), expected, "{body}");
        }
        // Quotes, backslashes and control characters escaped another way than
        // serde_json's.
        let r = redactor(b"a\"b\\c\td");
        assert_eq!(r.text(r#"x a\u0022b\u005Cc\u0009d y"#), "x [redacted] y");
        assert_eq!(r.text(r#"x a\"b\\c\td y"#), "x [redacted] y");
    }

    #[test]
    fn a_surrogate_pair_spells_a_character_beyond_the_bmp() {
        let r = redactor("k\u{1F600}y".as_bytes());
        assert_eq!(r.text(r#"["k\ud83d\ude00y"]"#), r#"["[redacted]"]"#);
        assert_eq!(r.text(r#"["k\uD83D\uDE00y"]"#), r#"["[redacted]"]"#);
        // A lone surrogate is no character, and no secret.
        assert_eq!(r.text(r#"["k\ud83dy"]"#), r#"["k\ud83dy"]"#);
    }

    #[test]
    fn an_escape_at_the_secrets_edge_goes_whole() {
        let r = redactor(b"tok/en");
        assert_eq!(r.text(r#"x\u0074ok/e\u006Ey"#), "x[redacted]y");
        assert_eq!(r.text(r#"xtok\/e\u006e\/"#), r#"x[redacted]\/"#);
        // The secret starts inside the two bytes "\u00e9" decodes to: the escape goes
        // whole, never half of it.
        let r = redactor(b"\xA9ok");
        assert_eq!(r.bytes(br"caf\u00e9ok!"), b"caf[redacted]!".to_vec());
    }

    #[test]
    fn many_overlapping_near_matches_are_handled() {
        // Every position of the body starts a near-match, which a naive matcher would
        // compare with the whole secret: the KMP matcher reads each decoded byte once.
        let secret = format!("{}x", "t".repeat(1000));
        let r = redactor(secret.as_bytes());
        let body = format!("{}x", r"\u0074".repeat(100_000));
        let expected = format!("{}[redacted]", r"\u0074".repeat(99_000));
        assert!(r.bytes(body.as_bytes()) == expected.as_bytes());
        let plain = format!("\\/{}", "t".repeat(1_000_000));
        assert!(r.bytes(plain.as_bytes()) == plain.as_bytes());
        // A match found after a longer partial one.
        let r = redactor(b"abac");
        assert_eq!(r.text(r"ab\u0061b\u0061c!"), "ab[redacted]!");
        assert_eq!(r.text("abababac!"), "abab[redacted]!");
    }

    #[test]
    fn a_body_without_a_backslash_is_returned_byte_for_byte() {
        let r = redactor(b"tok/en");
        let body: Vec<u8> = (0..=255u8)
            .filter(|&b| b != b'\\')
            .cycle()
            .take(4096)
            .collect();
        assert_eq!(r.bytes(&body), body);
        assert_eq!(r.truncated(&body), body);
        assert_eq!(Redactor::default().bytes(br"tok\/en"), br"tok\/en".to_vec());
    }

    #[test]
    fn invalid_and_cut_escapes_stand_for_themselves() {
        let r = redactor(b"tok/en");
        for body in [
            r"\u12",
            r#"\u12""#,
            r"\u12G4",
            r"\x",
            r"\",
            r"a\",
            r"\\\",
            r"\ud83d",
            r"\ud83d\u",
            r"\ud83d\ud83d",
            r"\udc00",
            r"\u{74}",
        ] {
            assert_eq!(r.text(body), body, "{body}");
            let _ = r.truncated(body.as_bytes());
        }
        assert_eq!(r.bytes(b"\\u00\xff\\\xff"), b"\\u00\xff\\\xff".to_vec());
        assert_eq!(r.text(r"tok\/en\u12"), r"[redacted]\u12");
        assert_eq!(r.text(r"\u0074ok/en\"), r"[redacted]\");
        assert_eq!(r.text(r"\utok\/en"), r"\u[redacted]");
    }

    #[test]
    fn an_escaped_secret_cut_at_the_end_is_redacted() {
        let r = redactor(b"tok/en");
        for body in [
            r"body: tok\/e",
            r"body: \u0074o",
            r"body: \u0074ok\/",
            // Cut inside the escape of the secret's next character, or of its first.
            r"body: tok\",
            r"body: tok\u00",
            r"body: \u007",
        ] {
            assert_eq!(r.truncated(body.as_bytes()), b"body: [redacted]", "{body}");
        }
        let r = redactor("k\u{1F600}y".as_bytes());
        assert_eq!(r.truncated(br"x: k\ud83d\ude"), b"x: [redacted]".to_vec());
        assert_eq!(r.truncated(br"x: k\ud83d"), b"x: [redacted]".to_vec());
        assert_eq!(r.truncated(br"x: k\ud83d\ude00"), b"x: [redacted]".to_vec());
        // Nothing of a secret at the end: only an unfinished escape goes.
        assert_eq!(r.truncated(br"x: a\/b"), br"x: a\/b".to_vec());
        assert_eq!(r.truncated(br"x: z\u00"), b"x: z[redacted]".to_vec());
    }
}
