//! One JSON-RPC exchange with a Streamable HTTP MCP server: a POST through the http
//! worker's own client (so through its egress checks), answered by one JSON message
//! or by an event stream (`text/event-stream`) that carries the answer and, before it,
//! the server's notifications and requests.
//!
//! Everything the server sends is untrusted and bounded: one message or one event is
//! at most [`MAX_MESSAGE_BYTES`], and an answer that is neither JSON nor an event
//! stream, or that does not parse, is an error for the request at hand. Every byte
//! the server sends is redacted of the entry's secrets before it is read.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode};
use serde_json::Value;
use url::Url;

use crate::client::{Client, Incoming};
use crate::declared::Redactor;

/// Longest message (or event) a server may send, as on the stdio side.
pub(crate) const MAX_MESSAGE_BYTES: usize = 4 << 20;
/// Longest `Mcp-Session-Id` kept.
const MAX_SESSION_ID: usize = 1024;
/// How much of a refusal's body an error quotes.
const BODY_QUOTE_BYTES: usize = 300;

pub(crate) const SESSION_ID: HeaderName = HeaderName::from_static("mcp-session-id");
pub(crate) const PROTOCOL_VERSION: HeaderName = HeaderName::from_static("mcp-protocol-version");

/// Why an exchange gave no answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum WireError {
    /// The server no longer knows the session (404 to a request that named one): a new
    /// session is started and the request sent once more.
    SessionExpired,
    /// The server answered with a JSON-RPC error.
    Rpc { code: i64, message: String },
    /// Anything else: no connection, a refusal, a non-2xx status, garbage, too big.
    Failed(String),
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::SessionExpired => f.write_str("the server no longer knows the session"),
            Self::Rpc { code, message } => write!(f, "it answered with error {code}: {message}"),
            Self::Failed(reason) => f.write_str(reason),
        }
    }
}

/// Where a server is and what every request to it carries.
pub(crate) struct Endpoint {
    pub url: Url,
    /// The entry's headers, secrets in (marked sensitive).
    pub headers: HeaderMap,
    pub redactor: Redactor,
    pub client: Client,
}

/// The session a request belongs to, once `initialize` made one.
#[derive(Debug, Clone, Default)]
pub(crate) struct SessionHeaders {
    pub id: Option<HeaderValue>,
    pub version: Option<HeaderValue>,
}

/// What one POST brought back.
#[derive(Debug, Default)]
pub(crate) struct Answer {
    /// The `Mcp-Session-Id` of the response, if any.
    pub session_id: Option<HeaderValue>,
    /// The response to the request (`result`), when one was awaited.
    pub result: Option<Value>,
}

impl Endpoint {
    /// POSTs `message`. When it is a request (`expect` holds its id), reads the answer:
    /// the response's `result`, with every other message that arrives first handed to
    /// `on_message`. A notification's answer is not read.
    pub(crate) async fn post(
        &self,
        session: &SessionHeaders,
        message: &Value,
        expect: Option<&Value>,
        on_message: &mut (dyn FnMut(Value) + Send),
    ) -> Result<Answer, WireError> {
        let body = serde_json::to_vec(message)
            .map_err(|e| WireError::Failed(format!("cannot encode the request: {e}")))?;
        let mut headers = self.headers.clone();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(
            header::ACCEPT,
            HeaderValue::from_static("application/json, text/event-stream"),
        );
        headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        if let Some(id) = &session.id {
            headers.insert(SESSION_ID, id.clone());
        }
        if let Some(version) = &session.version {
            headers.insert(PROTOCOL_VERSION, version.clone());
        }
        let response = self
            .client
            .open(Method::POST, &self.url, &headers, Bytes::from(body))
            .await
            .map_err(|e| self.failed(e.to_string()))?;
        let (parts, mut incoming) = response.into_parts();
        let session_id = match parts.headers.get(SESSION_ID) {
            Some(id) if valid_session_id(id) => Some(id.clone()),
            Some(_) => {
                return Err(self.failed(format!(
                    "its {SESSION_ID} is not 1 to {MAX_SESSION_ID} visible ASCII characters"
                )));
            }
            None => None,
        };
        if parts.status == StatusCode::NOT_FOUND && session.id.is_some() {
            return Err(WireError::SessionExpired);
        }
        if !parts.status.is_success() {
            let quoted = self.quote(&mut incoming).await;
            let redirect = if parts.status.is_redirection() {
                "; redirects are not followed: give the server's final URL in the entry"
            } else {
                ""
            };
            return Err(self.failed(format!(
                "it answered HTTP {}{redirect}{quoted}",
                parts.status
            )));
        }
        let Some(id) = expect else {
            return Ok(Answer {
                session_id,
                result: None,
            });
        };
        let kind = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| {
                v.split(';')
                    .next()
                    .unwrap_or_default()
                    .trim()
                    .to_ascii_lowercase()
            })
            .unwrap_or_default();
        if let Some(encoding) = parts
            .headers
            .get(header::CONTENT_ENCODING)
            .filter(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"))
        {
            return Err(self.failed(format!(
                "it answered in content-encoding {:?}, not the identity asked for",
                String::from_utf8_lossy(encoding.as_bytes())
            )));
        }
        let result =
            match kind.as_str() {
                "application/json" => self.read_json(&mut incoming, id, on_message).await,
                "text/event-stream" => self.read_stream(&mut incoming, id, on_message).await,
                "" if parts.status == StatusCode::ACCEPTED => Err(self
                    .failed("it answered 202 Accepted to a request, without the response".into())),
                other => Err(self.failed(format!(
                    "it answered with content type {other:?}, neither application/json nor \
                 text/event-stream"
                ))),
            }?;
        Ok(Answer {
            session_id,
            result: Some(result),
        })
    }

    /// The server's text, redacted of every secret.
    fn failed(&self, reason: String) -> WireError {
        WireError::Failed(self.redactor.text(&reason))
    }

    /// The start of a refusal's body, for its error.
    async fn quote(&self, incoming: &mut Incoming) -> String {
        let mut body = Vec::new();
        while body.len() < BODY_QUOTE_BYTES {
            match incoming.chunk().await {
                Some(Ok(data)) => body.extend_from_slice(&data),
                _ => break,
            }
        }
        // A body cut here may end with the start of a secret, which no longer matches
        // the whole secret: `truncated` redacts such a start too.
        let clean = if body.len() >= BODY_QUOTE_BYTES {
            body.truncate(BODY_QUOTE_BYTES);
            self.redactor.truncated(&body)
        } else {
            self.redactor.bytes(&body)
        };
        let text = String::from_utf8_lossy(&clean).trim().to_owned();
        if text.is_empty() {
            String::new()
        } else {
            format!(": {text}")
        }
    }

    /// A JSON answer: one message (or a batch of them), at most [`MAX_MESSAGE_BYTES`].
    async fn read_json(
        &self,
        incoming: &mut Incoming,
        id: &Value,
        on_message: &mut (dyn FnMut(Value) + Send),
    ) -> Result<Value, WireError> {
        let mut body = Vec::new();
        while let Some(chunk) = incoming.chunk().await {
            let chunk = chunk.map_err(|e| self.failed(format!("its answer broke off: {e}")))?;
            if body.len() + chunk.len() > MAX_MESSAGE_BYTES {
                return Err(self.failed(format!(
                    "its answer is longer than {MAX_MESSAGE_BYTES} bytes, the most one message may be"
                )));
            }
            body.extend_from_slice(&chunk);
        }
        let messages = match self.parse(&body)? {
            Value::Array(batch) => batch,
            message => vec![message],
        };
        let mut answer = None;
        for message in messages {
            if answer.is_none() && is_response_to(&message, id) {
                answer = Some(message);
            } else {
                on_message(message);
            }
        }
        match answer {
            Some(message) => self.result(message),
            None => Err(self.failed("its JSON answer holds no response to the request".into())),
        }
    }

    /// An event stream: messages until the response to the request.
    async fn read_stream(
        &self,
        incoming: &mut Incoming,
        id: &Value,
        on_message: &mut (dyn FnMut(Value) + Send),
    ) -> Result<Value, WireError> {
        let mut parser = SseParser::new(MAX_MESSAGE_BYTES);
        let mut events = Vec::new();
        loop {
            let Some(chunk) = incoming.chunk().await else {
                return Err(
                    self.failed("its event stream ended before the response to the request".into())
                );
            };
            let chunk =
                chunk.map_err(|e| self.failed(format!("its event stream broke off: {e}")))?;
            parser
                .feed(&chunk, &mut events)
                .map_err(|e| self.failed(e))?;
            for data in events.drain(..) {
                // An event without JSON (a keep-alive, a priming event) is not a message.
                let Ok(message) = self.parse(&data) else {
                    continue;
                };
                if is_response_to(&message, id) {
                    return self.result(message);
                }
                on_message(message);
            }
        }
    }

    /// A message's JSON, read after its secrets are taken out — from the bytes, and
    /// again from every decoded string: JSON may spell a secret with escapes (`\/`,
    /// `\u0074`) that only decoding turns back into it.
    fn parse(&self, bytes: &[u8]) -> Result<Value, WireError> {
        let clean = self.redactor.bytes(bytes);
        let mut message: Value = serde_json::from_slice(&clean).map_err(|e| {
            let start = String::from_utf8_lossy(&clean[..clean.len().min(80)]).into_owned();
            WireError::Failed(format!(
                "it answered with something that is not JSON ({e}): {start:?}"
            ))
        })?;
        self.redact_strings(&mut message);
        Ok(message)
    }

    /// Redacts every string of `value`, keys included (serde_json's nesting limit of 128
    /// bounds the recursion).
    fn redact_strings(&self, value: &mut Value) {
        match value {
            Value::String(text) => {
                let clean = self.redactor.text(text);
                if clean != *text {
                    *text = clean;
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|item| self.redact_strings(item)),
            Value::Object(map) => {
                let entries = std::mem::take(map);
                for (key, mut item) in entries {
                    self.redact_strings(&mut item);
                    map.insert(self.redactor.text(&key), item);
                }
            }
            _ => {}
        }
    }

    /// The `result` of a response, or its error.
    fn result(&self, mut message: Value) -> Result<Value, WireError> {
        if let Some(error) = message.get("error") {
            let code = error.get("code").and_then(Value::as_i64).unwrap_or(0);
            let text = error
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("no message");
            return Err(WireError::Rpc {
                code,
                message: text.chars().take(1000).collect(),
            });
        }
        match message.get_mut("result").map(Value::take) {
            Some(result @ Value::Object(_)) => Ok(result),
            _ => Err(self.failed("its response has no result object".into())),
        }
    }
}

/// Whether `message` is the response (result or error) to the request `id`.
fn is_response_to(message: &Value, id: &Value) -> bool {
    message.get("method").is_none()
        && message.get("id") == Some(id)
        && (message.get("result").is_some() || message.get("error").is_some())
}

/// A session id as the specification allows them: visible ASCII.
fn valid_session_id(id: &HeaderValue) -> bool {
    let bytes = id.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_SESSION_ID
        && bytes.iter().all(|b| (0x21..=0x7e).contains(b))
}

/// Server-sent events, bounded: each event's data (the lines of one event, joined) is
/// at most `max` bytes, and so is a line still being read.
pub(crate) struct SseParser {
    max: usize,
    line: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
    event: Option<Vec<u8>>,
    /// The last byte ended a line with `\r`: a `\n` right after it ends nothing more.
    after_cr: bool,
}

impl SseParser {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            max,
            line: Vec::new(),
            data: Vec::new(),
            has_data: false,
            event: None,
            after_cr: false,
        }
    }

    /// Reads `chunk`; the data of each event it completes goes to `out`. An event (or
    /// line) longer than the limit is an error: the stream cannot be read further.
    pub(crate) fn feed(&mut self, chunk: &[u8], out: &mut Vec<Vec<u8>>) -> Result<(), String> {
        for &byte in chunk {
            if std::mem::take(&mut self.after_cr) && byte == b'\n' {
                continue;
            }
            match byte {
                b'\n' => self.end_line(out),
                b'\r' => {
                    self.after_cr = true;
                    self.end_line(out);
                }
                _ => {
                    self.line.push(byte);
                    if self.line.len() + self.data.len() > self.max {
                        return Err(format!(
                            "it sent an event longer than {} bytes, the most one message may be",
                            self.max
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn end_line(&mut self, out: &mut Vec<Vec<u8>>) {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            let event = self.event.take();
            let data = std::mem::take(&mut self.data);
            // Only `message` events (the default type) carry JSON-RPC messages.
            if std::mem::take(&mut self.has_data)
                && event.as_deref().is_none_or(|e| e == b"message")
            {
                out.push(data);
            }
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (field, value) = match line.iter().position(|b| *b == b':') {
            Some(i) => {
                let value = &line[i + 1..];
                (&line[..i], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (&line[..], &[][..]),
        };
        match field {
            b"data" => {
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
            }
            b"event" => self.event = Some(value.to_vec()),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(parser: &mut SseParser, chunks: &[&[u8]]) -> Vec<String> {
        let mut out = Vec::new();
        for chunk in chunks {
            parser.feed(chunk, &mut out).unwrap();
        }
        out.into_iter()
            .map(|d| String::from_utf8(d).unwrap())
            .collect()
    }

    #[test]
    fn sse_events_are_split_however_the_bytes_arrive() {
        let stream = b": keep-alive\r\n\r\nid: 1\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\nevent: ping\ndata: x\n\ndata:{\"b\":2}\n\nretry: 10\ndata: partial";
        let whole = events(&mut SseParser::new(1000), &[stream]);
        assert_eq!(
            whole,
            vec!["{\"a\":\n1}".to_owned(), "{\"b\":2}".to_owned()]
        );
        let mut parser = SseParser::new(1000);
        let pieces: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(events(&mut parser, &pieces), whole);
        let mut split = SseParser::new(1000);
        assert_eq!(
            events(&mut split, &[b"data: 1\r", b"\ndata: 2\r", b"\r"]),
            vec!["1\n2".to_owned()]
        );
    }

    #[test]
    fn an_oversize_event_is_refused_before_it_is_read_whole() {
        let mut parser = SseParser::new(16);
        let mut out = Vec::new();
        parser.feed(b"data: 0123456789\n", &mut out).unwrap();
        let e = parser.feed(b"data: 0123456789\n\n", &mut out).unwrap_err();
        assert!(e.contains("longer than 16 bytes"), "{e}");
        assert!(out.is_empty());
        let mut endless = SseParser::new(16);
        assert!(endless.feed(&[b'x'; 17], &mut out).is_err());
    }

    #[test]
    fn responses_are_matched_by_id() {
        let id = serde_json::json!(3);
        assert!(is_response_to(
            &serde_json::json!({"jsonrpc": "2.0", "id": 3, "result": {}}),
            &id
        ));
        assert!(!is_response_to(
            &serde_json::json!({"jsonrpc": "2.0", "id": 3, "method": "ping"}),
            &id
        ));
        assert!(!is_response_to(
            &serde_json::json!({"jsonrpc": "2.0", "id": "3", "result": {}}),
            &id
        ));
        assert!(valid_session_id(&HeaderValue::from_static("abc-123")));
        assert!(!valid_session_id(&HeaderValue::from_static("a b")));
    }
}
