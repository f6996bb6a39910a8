//! The two http tools: definitions (schemas, descriptions, annotations), argument
//! checks, and the JSON results.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_worker::{CallContext, Tool, ToolAnnotations, ToolDefinition, ToolOutcome, ToolSet};
use base64::Engine;
use bytes::Bytes;
use http::Method;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use serde_json::{Value, json};

use crate::client::{self, Client, Request, Response};
use crate::config::{ConfigError, HttpConfig, Settings};
use crate::declared::{DeclaredHttpTool, ResolvedTemplate};
use crate::html::{self, Flavor};
use crate::resolve::{self, Lookup};

/// Calls give up this long before the call's deadline so their own answer gets back.
const DEADLINE_MARGIN: Duration = Duration::from_millis(200);
/// Methods `http_request` (and a declared http tool) sends.
pub(crate) const METHODS: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];
/// Longest URL accepted.
const MAX_URL_LEN: u64 = 8192;
/// Most headers a caller may set.
const MAX_HEADERS: u64 = 64;
/// Upper bound of `fetch_url`'s `max_length`.
const MAX_PAGE_CHARS: u64 = 1_000_000;

const EGRESS: &str = "Only http and https URLs are fetched. The worker's egress policy \
                      decides which hosts are reachable: internal, loopback, link-local and \
                      other special-purpose addresses are refused however the URL spells them \
                      and wherever DNS or redirects point; a refusal says which rule refused it.";

/// The http tools, `http_request` and `fetch_url`, sharing one validated `config`.
pub fn tools(config: HttpConfig) -> Result<ToolSet, ConfigError> {
    build(config, None, Vec::new())
}

/// [`tools`] and the declared http tools (`[[tools]]` entries with `http`, their
/// secrets already read), all sending through the same client and egress policy.
pub fn tools_with_declared(
    config: HttpConfig,
    declared: Vec<ResolvedTemplate>,
) -> Result<ToolSet, ConfigError> {
    build(config, None, declared)
}

/// [`tools`] with `lookup` answering name lookups instead of the system resolver. Every
/// answer goes through the same checks; it is called once per request hop, and the
/// connection goes to the checked answer.
pub fn tools_with_resolver(
    config: HttpConfig,
    lookup: impl Fn(&str) -> std::io::Result<Vec<IpAddr>> + Send + Sync + 'static,
) -> Result<ToolSet, ConfigError> {
    build(config, Some(Arc::new(lookup)), Vec::new())
}

/// Why the http worker cannot serve what its configuration asks for.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Mcp(#[from] crate::mcp::McpStartError),
}

/// [`tools_with_declared`] and the tools of the Streamable HTTP MCP servers, whose
/// sessions are opened now, through the same client, to list them (see [`crate::mcp`]).
pub async fn tools_with_mcp(
    config: HttpConfig,
    declared: Vec<ResolvedTemplate>,
    servers: Vec<crate::mcp::ResolvedMcpServer>,
) -> Result<ToolSet, StartError> {
    let client = client(config, None)?;
    let mcp = crate::mcp::start(servers, &client).await?;
    Ok(mcp
        .into_iter()
        .fold(with_client(client, declared), ToolSet::with))
}

/// The one client every tool of the worker sends through.
pub(crate) fn client(config: HttpConfig, lookup: Option<Lookup>) -> Result<Client, ConfigError> {
    let settings = Arc::new(config.validate()?);
    Client::new(settings, lookup).map_err(|e| ConfigError::Tls(e.to_string()))
}

pub(crate) fn build(
    config: HttpConfig,
    lookup: Option<Lookup>,
    declared: Vec<ResolvedTemplate>,
) -> Result<ToolSet, ConfigError> {
    Ok(with_client(client(config, lookup)?, declared))
}

fn with_client(client: Client, declared: Vec<ResolvedTemplate>) -> ToolSet {
    let mut set = ToolSet::new("http");
    for template in declared {
        set = set.with(DeclaredHttpTool::new(template, client.clone()));
    }
    // The built-ins go in last: a declared tool can never take a built-in's name (the
    // entry check refuses it), and if one did, the built-in would still win.
    set.with(HttpTool {
        kind: Kind::Request,
        client: client.clone(),
    })
    .with(HttpTool {
        kind: Kind::Fetch,
        client,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Request,
    Fetch,
}

struct HttpTool {
    kind: Kind,
    client: Client,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestArgs {
    method: String,
    url: String,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    body: Option<String>,
    #[serde(default)]
    timeout_seconds: Option<f64>,
    #[serde(default)]
    max_response_bytes: Option<u64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum Format {
    #[default]
    Markdown,
    Text,
    Raw,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FetchArgs {
    url: String,
    #[serde(default)]
    format: Format,
    #[serde(default)]
    start_index: Option<u64>,
    #[serde(default)]
    max_length: Option<u64>,
}

/// A call ready to go out, and how long it may take.
struct Prepared {
    request: Request,
    budget: Duration,
    budget_source: &'static str,
    fetch: Option<FetchArgs>,
}

fn parse<T: serde::de::DeserializeOwned>(tool: &str, arguments: Value) -> Result<T, String> {
    serde_json::from_value(arguments)
        .map_err(|e| format!("invalid arguments for {tool}: {e}; check the tool's input schema"))
}

fn header_reason(name: &str) -> &'static str {
    match name {
        "host" => "the worker sets Host from the url",
        "content-length" => "the worker sets it from the body",
        "accept-encoding" => {
            "the worker asks for gzip only and decodes it itself, within the size limit"
        }
        "user-agent" => "the worker sends a fixed User-Agent",
        "expect" => "the worker sends the body directly",
        "x-http-method-override" | "x-http-method" | "x-method-override" => {
            "it would make the server treat the request as another method; set `method` instead"
        }
        _ => "it is a hop-by-hop or proxy header that belongs to the connection, not the request",
    }
}

fn request_headers(raw: &BTreeMap<String, String>) -> Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    for (name, value) in raw {
        let n = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| {
            format!(
                "header name {name:?} is not a valid HTTP header name; use letters, digits and '-'"
            )
        })?;
        if client::forbidden_header(&n) {
            return Err(format!(
                "header {name:?} cannot be set by the caller: {}; remove it from headers",
                header_reason(n.as_str())
            ));
        }
        let v = HeaderValue::from_str(value).map_err(|_| {
            format!("value of header {name:?} contains a line break or control character; send it on one line")
        })?;
        headers.append(n, v);
    }
    Ok(headers)
}

fn response_headers(headers: &HeaderMap) -> Value {
    let mut map: BTreeMap<String, String> = BTreeMap::new();
    for (name, value) in headers {
        let v = String::from_utf8_lossy(value.as_bytes());
        map.entry(name.as_str().to_owned())
            .and_modify(|e| {
                e.push_str(", ");
                e.push_str(&v);
            })
            .or_insert_with(|| v.into_owned());
    }
    json!(map)
}

fn content_type(resp: &Response) -> Option<String> {
    resp.headers
        .get(header::CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

impl HttpTool {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Request => "http_request",
            Kind::Fetch => "fetch_url",
        }
    }

    fn describe(&self) -> (&'static str, String, Value, ToolAnnotations) {
        let s = self.client.settings();
        let max_timeout = s.timeout.as_secs_f64();
        match self.kind {
            Kind::Request => (
                "HTTP request",
                format!(
                    "Send one HTTP request and return a JSON object with `status`, `headers`, \
                     `body`, `body_encoding` (\"text\", or \"base64\" for binary bodies), \
                     `truncated`, `final_url` and `duration_ms`. Redirects are followed (at most \
                     {}), each one re-checked. The body is cut at `max_response_bytes` (default \
                     and maximum {}) and then `truncated` is true and `note` says where. Host, \
                     Content-Length, User-Agent, Accept-Encoding and hop-by-hop headers are set \
                     by the worker and cannot be given, nor can method-override headers \
                     (X-HTTP-Method-Override and the like). Request bodies up to {} bytes. Timeout \
                     `timeout_seconds` (default and maximum {max_timeout}). Any status code, \
                     4xx and 5xx included, is a normal result. To read a web page, prefer \
                     fetch_url. {EGRESS}",
                    s.max_redirects, s.max_response_bytes, s.max_request_body_bytes
                ),
                json!({
                    "type": "object",
                    "properties": {
                        "method": {
                            "type": "string",
                            "enum": METHODS,
                            "description": "HTTP method.",
                        },
                        "url": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": MAX_URL_LEN,
                            "description": "Absolute http:// or https:// URL, e.g. \"https://api.example.com/v1/items?page=2\".",
                        },
                        "headers": {
                            "type": "object",
                            "maxProperties": MAX_HEADERS,
                            "additionalProperties": { "type": "string" },
                            "description": "Request headers, e.g. {\"Accept\": \"application/json\", \"Authorization\": \"Bearer ...\"}.",
                        },
                        "body": {
                            "type": "string",
                            "description": "Request body (UTF-8 text, e.g. JSON); set Content-Type in headers.",
                        },
                        "timeout_seconds": {
                            "type": "number",
                            "exclusiveMinimum": 0,
                            "maximum": max_timeout,
                            "description": "Give up after this many seconds, redirects and body included.",
                        },
                        "max_response_bytes": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": s.max_response_bytes,
                            "description": "Return at most this many bytes of the response body.",
                        },
                    },
                    "required": ["method", "url"],
                    "additionalProperties": false,
                }),
                ToolAnnotations {
                    read_only: false,
                    destructive: false,
                    idempotent: false,
                    open_world: true,
                },
            ),
            Kind::Fetch => (
                "Fetch URL",
                format!(
                    "Fetch a web page or text document with GET and return a JSON object whose \
                     `content` is the page as readable markdown (default), plain text, or the \
                     raw decoded source (`format`: \"markdown\" | \"text\" | \"raw\"). HTML is \
                     converted (headings, links, lists, tables, code; scripts and styles \
                     dropped) after decoding its declared charset. Long content is paged: at \
                     most `max_length` characters (default {}) from `start_index` (default 0); \
                     when more follows, `truncated` is true and `next_start_index` is where to \
                     continue. Also returns `status`, `final_url` (after redirects), \
                     `content_type` and `total_chars`. Binary content is refused; use \
                     http_request for it. Reads at most {} bytes. {EGRESS}",
                    s.fetch_default_length, s.max_response_bytes
                ),
                json!({
                    "type": "object",
                    "properties": {
                        "url": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": MAX_URL_LEN,
                            "description": "Absolute http:// or https:// URL of the page.",
                        },
                        "format": {
                            "type": "string",
                            "enum": ["markdown", "text", "raw"],
                            "default": "markdown",
                            "description": "markdown: readable markdown; text: plain text; raw: the source as served (decoded to text).",
                        },
                        "start_index": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "Character offset to start at, from next_start_index of the previous call (default 0).",
                        },
                        "max_length": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": MAX_PAGE_CHARS,
                            "description": "Maximum number of characters to return.",
                        },
                    },
                    "required": ["url"],
                    "additionalProperties": false,
                }),
                ToolAnnotations {
                    read_only: true,
                    destructive: false,
                    idempotent: true,
                    open_world: true,
                },
            ),
        }
    }

    /// Parses and checks the arguments; nothing touches the network yet.
    fn prepare(&self, arguments: Value, ctx: &CallContext) -> Result<Prepared, String> {
        let s = self.client.settings();
        let tool = self.name();
        let (request, timeout_seconds, fetch) = match self.kind {
            Kind::Request => {
                let args: RequestArgs = parse(tool, arguments)?;
                let upper = args.method.trim().to_ascii_uppercase();
                if !METHODS.contains(&upper.as_str()) {
                    return Err(format!(
                        "method {:?} is not supported; use one of {}",
                        args.method,
                        METHODS.join(", ")
                    ));
                }
                let method = Method::from_bytes(upper.as_bytes())
                    .map_err(|e| format!("invalid method {:?}: {e}", args.method))?;
                let headers = request_headers(&args.headers)?;
                let body = Bytes::from(args.body.unwrap_or_default());
                if body.len() as u64 > s.max_request_body_bytes {
                    return Err(format!(
                        "body is {} bytes; the limit is {} bytes (max_request_body_bytes); send less",
                        body.len(),
                        s.max_request_body_bytes
                    ));
                }
                let max_bytes = args
                    .max_response_bytes
                    .unwrap_or(s.max_response_bytes)
                    .clamp(1, s.max_response_bytes);
                let url = resolve::parse_url(&args.url).map_err(|e| e.to_string())?;
                let request = Request {
                    method,
                    url,
                    headers,
                    body,
                    max_bytes,
                };
                (request, args.timeout_seconds, None)
            }
            Kind::Fetch => {
                let args: FetchArgs = parse(tool, arguments)?;
                let url = resolve::parse_url(&args.url).map_err(|e| e.to_string())?;
                let mut headers = HeaderMap::new();
                headers.insert(
                    header::ACCEPT,
                    HeaderValue::from_static(
                        "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.8",
                    ),
                );
                let request = Request {
                    method: Method::GET,
                    url,
                    headers,
                    body: Bytes::new(),
                    max_bytes: s.max_response_bytes,
                };
                (request, None, Some(args))
            }
        };
        let (budget, budget_source) = call_budget(s, timeout_seconds, "timeout_seconds", ctx)?;
        Ok(Prepared {
            request,
            budget,
            budget_source,
            fetch,
        })
    }

    fn fetch_result(
        &self,
        resp: &Response,
        args: &FetchArgs,
        url: &str,
        started: Instant,
    ) -> Result<Value, String> {
        let ct = content_type(resp);
        let media = html::media_type(ct.as_deref());
        let is_html =
            html::is_html(media.as_deref()) || (media.is_none() && looks_like_html(&resp.body));
        let text = if is_html || media.as_deref().is_some_and(html::is_textual) {
            html::decode(&resp.body, ct.as_deref(), resp.truncated)
        } else {
            html::body_text(&resp.body, ct.as_deref(), resp.truncated).ok_or_else(|| {
                format!(
                    "fetch_url returns text, but {} answered with {} ({} bytes, status {}); use http_request to get it base64-encoded",
                    resp.final_url,
                    media.as_deref().unwrap_or("binary content"),
                    resp.body.len(),
                    resp.status.as_u16()
                )
            })?
        };
        let converted = |flavor| {
            html::html_to(&text, flavor, Some(&resp.final_url)).map_err(|e| {
                format!(
                    "{} answered with a page that cannot be converted: {e}; use format \"raw\" to get its source",
                    resp.final_url
                )
            })
        };
        let content = match (args.format, is_html) {
            (Format::Markdown, true) => converted(Flavor::Markdown)?,
            (Format::Text, true) => converted(Flavor::Text)?,
            _ => text.clone(),
        };
        let total = content.chars().count() as u64;
        let start = args.start_index.unwrap_or(0);
        if start > 0 && start >= total {
            return Err(format!(
                "start_index {start} is past the end of the content ({total} characters); use a smaller start_index"
            ));
        }
        let max_len = args
            .max_length
            .unwrap_or(self.client.settings().fetch_default_length)
            .clamp(1, MAX_PAGE_CHARS);
        let page: String = content
            .chars()
            .skip(usize::try_from(start).unwrap_or(usize::MAX))
            .take(usize::try_from(max_len).unwrap_or(usize::MAX))
            .collect();
        let returned = page.chars().count() as u64;
        let next = start + returned;
        let more = next < total;
        let mut out = json!({
            "url": url,
            "final_url": resp.final_url.as_str(),
            "status": resp.status.as_u16(),
            "content_type": ct,
            "format": match args.format { Format::Markdown => "markdown", Format::Text => "text", Format::Raw => "raw" },
            "content": page,
            "start_index": start,
            "returned_chars": returned,
            "total_chars": total,
            "truncated": more,
            "body_truncated": resp.truncated,
            "duration_ms": started.elapsed().as_millis() as u64,
        });
        let mut notes = Vec::new();
        if more {
            out["next_start_index"] = json!(next);
            notes.push(format!(
                "content continues: call fetch_url again with start_index={next} to read the next part"
            ));
        }
        notes.extend(resp.notes.iter().cloned());
        if !notes.is_empty() {
            out["note"] = json!(notes.join("; "));
        }
        Ok(out)
    }
}

/// The JSON result of `http_request` (and of a declared http tool).
pub(crate) fn request_result(resp: &Response, started: Instant) -> Value {
    let ct = content_type(resp);
    let (body, encoding) = match html::body_text(&resp.body, ct.as_deref(), resp.truncated) {
        Some(text) => (text, "text"),
        None => (
            base64::engine::general_purpose::STANDARD.encode(&resp.body),
            "base64",
        ),
    };
    let mut out = json!({
        "status": resp.status.as_u16(),
        "headers": response_headers(&resp.headers),
        "body": body,
        "body_encoding": encoding,
        "body_bytes": resp.body.len(),
        "truncated": resp.truncated,
        "final_url": resp.final_url.as_str(),
        "redirects": resp.redirects,
        "duration_ms": started.elapsed().as_millis() as u64,
    });
    if !resp.notes.is_empty() {
        out["note"] = json!(resp.notes.join("; "));
    }
    out
}

/// How long one call may take: `[http] timeout_ms`, less when `timeout_seconds` (named
/// `source` in messages) or the call's deadline says so, and which of them decided.
pub(crate) fn call_budget(
    s: &Settings,
    timeout_seconds: Option<f64>,
    source: &'static str,
    ctx: &CallContext,
) -> Result<(Duration, &'static str), String> {
    let mut budget = s.timeout;
    let mut budget_source = "[http] timeout_ms";
    if let Some(t) = timeout_seconds {
        if !t.is_finite() || t <= 0.0 {
            return Err(format!("{source} must be a positive number, got {t}"));
        }
        let wanted = Duration::from_secs_f64(t.min(s.timeout.as_secs_f64()));
        if wanted < budget {
            budget = wanted;
            budget_source = source;
        }
    }
    let left = ctx
        .deadline
        .saturating_duration_since(Instant::now())
        .saturating_sub(DEADLINE_MARGIN);
    if left < budget {
        budget = left;
        budget_source = "the call's deadline";
    }
    Ok((budget, budget_source))
}

/// Sends `request` within `budget`, or says why it did not come back: cancelled, timed
/// out (naming what set the budget), or the client's error.
pub(crate) async fn send_within(
    client: &Client,
    request: Request,
    budget: Duration,
    budget_source: &'static str,
    ctx: &CallContext,
    tool: &str,
) -> Result<Response, String> {
    let url = request.url.to_string();
    let work = client.send(request);
    tokio::select! {
        biased;
        () = ctx.cancel.cancelled() => Err(format!("{tool} to {url} was cancelled")),
        r = tokio::time::timeout(budget, work) => match r {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "{tool} to {url} timed out after {:.1} s ({budget_source}); the server did not answer in time; retry later{}",
                budget.as_secs_f64(),
                if budget_source == "timeout_seconds" {
                    format!(" or with a larger timeout_seconds (at most {})", client.settings().timeout.as_secs_f64())
                } else {
                    String::new()
                }
            )),
        },
    }
}

fn looks_like_html(body: &[u8]) -> bool {
    let head = String::from_utf8_lossy(&body[..body.len().min(512)]).to_ascii_lowercase();
    let head = head.trim_start();
    head.starts_with("<!doctype html") || head.starts_with("<html")
}

#[airlock_worker::async_trait]
impl Tool for HttpTool {
    fn definition(&self) -> ToolDefinition {
        let (title, description, input_schema, annotations) = self.describe();
        ToolDefinition {
            name: self.name().to_owned(),
            title: title.to_owned(),
            description,
            input_schema,
            annotations,
        }
    }

    async fn execute(&self, arguments: Value, ctx: CallContext) -> ToolOutcome {
        let started = Instant::now();
        let tool = self.name();
        let prepared = match self.prepare(arguments, &ctx) {
            Ok(p) => p,
            Err(message) => return ToolOutcome::error(message),
        };
        let url = prepared.request.url.to_string();
        let sent = send_within(
            &self.client,
            prepared.request,
            prepared.budget,
            prepared.budget_source,
            &ctx,
            tool,
        )
        .await;
        let outcome = match sent {
            Ok(resp) => match &prepared.fetch {
                None => ToolOutcome::json(&request_result(&resp, started)),
                Some(args) => match self.fetch_result(&resp, args, &url, started) {
                    Ok(v) => ToolOutcome::json(&v),
                    Err(message) => ToolOutcome::error(message),
                },
            },
            Err(message) => ToolOutcome::error(message),
        };
        tracing::debug!(
            tool,
            call_id = %ctx.call_id,
            is_error = outcome.is_error,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "http call finished"
        );
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The policies see each tool as this worker defines it: every argument typed in
    /// `context.arguments` (or left out on purpose), and the annotations as the Cedar
    /// schema's action groups.
    #[test]
    fn the_policy_sees_every_tool_as_this_worker_defines_it() {
        let problems: Vec<String> = tools(HttpConfig::default())
            .unwrap()
            .definitions()
            .iter()
            .flat_map(airlock_policy::authz::check_tool)
            .collect();
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn two_tools_with_strict_schemas() {
        let set = tools(HttpConfig::default()).unwrap();
        assert_eq!(set.group(), "http");
        let defs = set.definitions();
        assert_eq!(defs.len(), 2);
        for d in &defs {
            assert_eq!(d.input_schema["additionalProperties"], false, "{}", d.name);
            assert!(d.annotations.open_world);
            assert!(!d.annotations.destructive);
        }
        let fetch = set.get("fetch_url").unwrap().definition();
        assert!(fetch.annotations.read_only);
        let req = set.get("http_request").unwrap().definition();
        assert!(!req.annotations.read_only);
        assert_eq!(req.input_schema["required"], json!(["method", "url"]));
    }

    #[test]
    fn header_checks() {
        let h = |pairs: &[(&str, &str)]| {
            request_headers(
                &pairs
                    .iter()
                    .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
                    .collect(),
            )
        };
        assert!(h(&[("Accept", "application/json"), ("X-Api-Key", "k")]).is_ok());
        let e = h(&[("Host", "evil")]).unwrap_err();
        assert!(
            e.contains("\"Host\" cannot be set") && e.contains("Host from the url"),
            "{e}"
        );
        assert!(
            h(&[("Transfer-Encoding", "chunked")])
                .unwrap_err()
                .contains("hop-by-hop")
        );
        assert!(
            h(&[("X-A", "a\r\nInjected: 1")])
                .unwrap_err()
                .contains("line break")
        );
        assert!(
            h(&[("bad header", "x")])
                .unwrap_err()
                .contains("not a valid")
        );
        for name in [
            "X-HTTP-Method-Override",
            "x-http-method",
            " X-Method-Override ",
        ] {
            let e = h(&[("Accept", "*/*"), (name, "DELETE")]).unwrap_err();
            assert!(e.contains("another method"), "{name}: {e}");
        }
    }
}
