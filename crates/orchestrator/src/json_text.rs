//! JSON text that Airlock writes itself, byte for byte what serde_json's compact writer
//! writes, with strings scanned eight bytes at a time instead of one: for the audit
//! chain's canonical JSON and the HTTP answers that carry results.

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

/// A JSON string, byte for byte as serde_json's compact writer spells it (the audit
/// chain hashes these bytes, so they must never change): `"` `\\` and the controls
/// `\b` `\t` `\n` `\f` `\r` as two-character escapes, the other bytes below 0x20 as
/// `\u00xx` in lowercase hex, everything else as it is.
///
/// serde_json looks every byte up in a table; answering with a 1 MiB result spent a fifth
/// of the orchestrator's CPU there. This skips eight bytes at a time that need no escape
/// (README, "Tool calls over HTTP").
pub fn write_str(text: &str, out: &mut impl JsonOut) {
    out.reserve(text.len() + 2);
    out.put_byte(b'"');
    write_escaped(text, out);
    out.put_byte(b'"');
}

/// `parts` joined by newlines, as one JSON string: what [`write_str`] writes of
/// `parts.join("\n")`, without joining them first (the OpenAI shapes answer a tool's
/// text blocks as one string, and a block may be megabytes).
pub fn write_lines(parts: &[String], out: &mut impl JsonOut) {
    out.reserve(parts.iter().map(|part| part.len() + 2).sum::<usize>() + 2);
    out.put_byte(b'"');
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            push_escape(b'\n', out);
        }
        write_escaped(part, out);
    }
    out.put_byte(b'"');
}

/// The inside of a JSON string: `text` with the bytes that need it escaped.
fn write_escaped(text: &str, out: &mut impl JsonOut) {
    let bytes = text.as_bytes();
    let mut run_start = 0;
    let mut at = 0;
    while let Some(found) = next_escape(bytes, at) {
        out.put(&bytes[run_start..found]);
        push_escape(bytes[found], out);
        at = found + 1;
        run_start = at;
    }
    out.put(&bytes[run_start..]);
}

/// Whether `byte` is written escaped in a JSON string.
fn needs_escape(byte: u8) -> bool {
    byte < 0x20 || byte == b'"' || byte == b'\\'
}

/// The index of the first byte at or after `from` that needs an escape.
fn next_escape(bytes: &[u8], from: usize) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    // Non-zero exactly when some byte of `word` is zero (the classic bit trick: a byte
    // borrows into its high bit only when it was zero, and `!word` keeps bytes that
    // had that bit set already from counting).
    let has_zero = |word: u64| word.wrapping_sub(ONES) & !word & HIGHS;
    // Likewise non-zero exactly when some byte is below 0x20.
    let has_control = |word: u64| word.wrapping_sub(ONES * 0x20) & !word & HIGHS;
    let mut at = from;
    while let Some(chunk) = bytes.get(at..at + 8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let word = u64::from_ne_bytes(word);
        let hit = has_control(word)
            | has_zero(word ^ (ONES * u64::from(b'"')))
            | has_zero(word ^ (ONES * u64::from(b'\\')));
        if hit != 0 {
            // The trick says only that one of the eight needs it: find which.
            return chunk.iter().position(|&b| needs_escape(b)).map(|i| at + i);
        }
        at += 8;
    }
    bytes
        .get(at..)?
        .iter()
        .position(|&b| needs_escape(b))
        .map(|i| at + i)
}

/// The escape of one byte that [`needs_escape`].
fn push_escape(byte: u8, out: &mut impl JsonOut) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let short = match byte {
        b'"' => b'"',
        b'\\' => b'\\',
        0x08 => b'b',
        0x09 => b't',
        0x0a => b'n',
        0x0c => b'f',
        0x0d => b'r',
        _ => {
            out.put(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(byte >> 4)],
                HEX[usize::from(byte & 0xf)],
            ]);
            return;
        }
    };
    out.put(&[b'\\', short]);
}

/// `value` as compact JSON, objects in their map's order: `serde_json::to_vec`'s bytes.
pub fn write_value(value: &Value, out: &mut impl JsonOut) {
    write_json(value, Members::AsStored, out);
}

/// `value` as compact JSON with every object's keys sorted by their UTF-8 bytes, at
/// every depth: the audit chain's canonical JSON.
pub fn write_sorted(value: &Value, out: &mut impl JsonOut) {
    write_json(value, Members::Sorted, out);
}

/// The order an object's members are written in.
#[derive(Debug, Clone, Copy)]
enum Members {
    AsStored,
    Sorted,
}

fn write_json<O: JsonOut>(value: &Value, members: Members, out: &mut O) {
    match value {
        Value::Object(map) => {
            let write_member = |i: usize, key: &str, item: &Value, out: &mut O| {
                if i > 0 {
                    out.put_byte(b',');
                }
                write_str(key, out);
                out.put_byte(b':');
                write_json(item, members, out);
            };
            out.put_byte(b'{');
            match members {
                Members::AsStored => {
                    for (i, (key, item)) in map.iter().enumerate() {
                        write_member(i, key, item, out);
                    }
                }
                Members::Sorted => {
                    let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                    entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                    for (i, (key, item)) in entries.into_iter().enumerate() {
                        write_member(i, key, item, out);
                    }
                }
            }
            out.put_byte(b'}');
        }
        Value::Array(items) => {
            out.put_byte(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.put_byte(b',');
                }
                write_json(item, members, out);
            }
            out.put_byte(b']');
        }
        Value::String(text) => write_str(text, out),
        Value::Null => out.put(b"null"),
        Value::Bool(true) => out.put(b"true"),
        Value::Bool(false) => out.put(b"false"),
        Value::Number(number) => out.put_number(number),
    }
}

/// Where JSON text is written: one growing buffer (`Vec<u8>`: the audit chain's
/// canonical JSON, small answers) or an answer of bounded chunks ([`ChunkedBody`]).
pub trait JsonOut {
    fn put(&mut self, bytes: &[u8]);
    fn put_byte(&mut self, byte: u8);
    /// Room for about `additional` more bytes: a hint, which a writer may ignore.
    fn reserve(&mut self, additional: usize);
    /// `number` as serde_json writes it.
    fn put_number(&mut self, number: &serde_json::Number) {
        let mut text = Vec::new();
        // Writing a number into a `Vec` cannot fail.
        let _ = serde_json::to_writer(&mut text, number);
        self.put(&text);
    }
}

impl JsonOut for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
    fn put_byte(&mut self, byte: u8) {
        self.push(byte);
    }
    fn reserve(&mut self, additional: usize) {
        Vec::reserve(self, additional);
    }
    fn put_number(&mut self, number: &serde_json::Number) {
        // Writing a number into a `Vec` cannot fail.
        let _ = serde_json::to_writer(self, number);
    }
}

/// Canonical JSON hashed as it is written, without building its text: the digests that
/// name "this exact call" ([`crate::budget::call_digest`]).
impl JsonOut for sha2::Sha256 {
    fn put(&mut self, bytes: &[u8]) {
        sha2::Digest::update(self, bytes);
    }
    fn put_byte(&mut self, byte: u8) {
        sha2::Digest::update(self, [byte]);
    }
    fn reserve(&mut self, _additional: usize) {}
}

/// The most a chunk of a [`ChunkedBody`] holds: half the C allocator's mmap threshold
/// (`airlock_sandbox::heap`), so that no chunk is a mapping of its own.
pub const CHUNK_BYTES: usize = 64 * 1024;

/// An answer written as chunks of at most [`CHUNK_BYTES`], sent one after the other
/// with the whole length announced (`Content-Length`).
///
/// A 1 MiB result written into one buffer made that buffer a fresh mapping of its own
/// (the orchestrator maps every buffer of 128 KiB or more, `airlock_sandbox::heap`),
/// and the kernel zeroed and faulted in each of its 260-odd pages on every such answer:
/// page faults were a fifth of the orchestrator's CPU for 1 MiB reads. Chunks are heap
/// blocks, and the buffers of chunks already sent are reused from a bounded pool
/// ([`FREE_CHUNKS`]; README, "Tool calls over HTTP").
#[derive(Debug)]
pub struct ChunkedBody {
    sealed: std::collections::VecDeque<bytes::Bytes>,
    open: Vec<u8>,
    /// Bytes not yet handed to the connection.
    remaining: usize,
}

impl Default for ChunkedBody {
    fn default() -> Self {
        Self {
            sealed: std::collections::VecDeque::new(),
            // Most answers are small: room for one without growing.
            open: Vec::with_capacity(256),
            remaining: 0,
        }
    }
}

impl ChunkedBody {
    fn seal(&mut self) {
        let full = std::mem::replace(&mut self.open, PooledChunk::take());
        self.sealed
            .push_back(bytes::Bytes::from_owner(PooledChunk(full)));
    }

    /// The chunks as written (for tests: what the connection would be handed).
    #[cfg(test)]
    pub fn chunks(&self) -> Vec<&[u8]> {
        let mut all: Vec<&[u8]> = self.sealed.iter().map(|chunk| &chunk[..]).collect();
        all.push(&self.open);
        all
    }
}

/// How many chunk buffers wait for the next answers: 2 MiB resident at most, enough for
/// two 1 MiB answers in flight. Beyond it a buffer is freed.
const POOLED_CHUNKS: usize = 32;

/// Chunk buffers given back by answers already sent. A freed 64 KiB block lay at the top
/// of its heap, which glibc trims past 128 KiB free, so the next answer faulted its
/// pages in afresh all the same; kept here they stay warm.
static FREE_CHUNKS: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

/// A sealed chunk: its buffer goes back to [`FREE_CHUNKS`] when the connection has
/// written and dropped it.
struct PooledChunk(Vec<u8>);

impl PooledChunk {
    /// An empty buffer of [`CHUNK_BYTES`], warm from the pool when there is one.
    fn take() -> Vec<u8> {
        FREE_CHUNKS
            .lock()
            .ok()
            .and_then(|mut free| free.pop())
            .unwrap_or_else(|| Vec::with_capacity(CHUNK_BYTES))
    }
}

impl AsRef<[u8]> for PooledChunk {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for PooledChunk {
    fn drop(&mut self) {
        let mut buffer = std::mem::take(&mut self.0);
        // Only buffers of a chunk's size (a small answer's last chunk is smaller), and
        // none while another thread panicked holding the lock.
        if !(CHUNK_BYTES..2 * CHUNK_BYTES).contains(&buffer.capacity()) {
            return;
        }
        buffer.clear();
        if let Ok(mut free) = FREE_CHUNKS.lock()
            && free.len() < POOLED_CHUNKS
        {
            free.push(buffer);
        }
    }
}

impl JsonOut for ChunkedBody {
    fn put(&mut self, mut bytes: &[u8]) {
        self.remaining += bytes.len();
        while !bytes.is_empty() {
            let room = CHUNK_BYTES - self.open.len();
            if room == 0 {
                self.seal();
                continue;
            }
            let (now, rest) = bytes.split_at(bytes.len().min(room));
            self.open.extend_from_slice(now);
            bytes = rest;
        }
    }
    fn put_byte(&mut self, byte: u8) {
        self.put(&[byte]);
    }
    fn reserve(&mut self, additional: usize) {
        // Grow the open chunk up to its bound, never past it.
        let room = CHUNK_BYTES - self.open.len();
        self.open.reserve(additional.min(room));
    }
}

impl http_body::Body for ChunkedBody {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let chunk = match this.sealed.pop_front() {
            Some(chunk) => chunk,
            None if this.open.is_empty() => return std::task::Poll::Ready(None),
            None => bytes::Bytes::from_owner(PooledChunk(std::mem::take(&mut this.open))),
        };
        this.remaining -= chunk.len();
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.remaining as u64)
    }
}

/// An `application/json` answer of the JSON `write` writes into its body (the answers
/// that carry tool results: what `axum::Json` answers, headers included).
pub fn json_response(write: impl FnOnce(&mut ChunkedBody)) -> Response {
    let mut body = ChunkedBody::default();
    write(&mut body);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        axum::body::Body::new(body),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt as _;
    use serde_json::json;

    /// A large answer is written as chunks no larger than `CHUNK_BYTES` (each one a heap
    /// block, not a mapping of its own), which together are the bytes a single buffer
    /// holds, and the body announces their whole length.
    fn free_chunks() -> usize {
        FREE_CHUNKS.lock().unwrap().len()
    }

    #[tokio::test]
    async fn a_large_answer_is_written_in_bounded_chunks() {
        let line = "a line of text with a \"quote\", a tab\t and é\n";
        let value = json!({
            "text": line.repeat(30_000),
            "blocks": [line.repeat(2_000), "\u{1}", 7, 2.5, null, true],
        });
        let mut whole = Vec::new();
        write_value(&value, &mut whole);
        let mut chunked = ChunkedBody::default();
        write_value(&value, &mut chunked);
        let chunks = chunked.chunks();
        assert!(chunks.len() > 10, "{} chunks", chunks.len());
        assert!(
            chunks.iter().all(|chunk| chunk.len() <= CHUNK_BYTES),
            "{:?}",
            chunks.iter().map(|chunk| chunk.len()).collect::<Vec<_>>()
        );
        assert_eq!(chunks.concat(), whole);
        let hint = http_body::Body::size_hint(&chunked);
        assert_eq!(hint.exact(), Some(whole.len() as u64));
        let sent = chunked.collect().await.unwrap().to_bytes();
        assert_eq!(sent, whole);
        // The chunks' buffers went back to the pool when the body was dropped, which
        // keeps no more than its bound however many answers are sent.
        assert!(free_chunks() > 0);
        for _ in 0..3 {
            let mut body = ChunkedBody::default();
            write_value(&value, &mut body);
            drop(body.collect().await.unwrap());
        }
        let pooled = free_chunks();
        assert!((1..=POOLED_CHUNKS).contains(&pooled), "{pooled}");
        // A small answer is one chunk.
        let mut small = ChunkedBody::default();
        write_value(&json!({"ok": 1}), &mut small);
        assert_eq!(small.chunks(), vec![&b"{\"ok\":1}"[..]]);
    }

    /// Strings written as serde_json writes them, for every byte that is escaped, at
    /// every position of an eight-byte word, and for random text: the audit chain hashes
    /// these bytes.
    #[test]
    fn strings_are_written_as_serde_json_writes_them() {
        let same = |text: &str| {
            let mut ours = Vec::new();
            crate::json_text::write_str(text, &mut ours);
            assert_eq!(
                String::from_utf8(ours).unwrap(),
                serde_json::to_string(text).unwrap(),
                "{text:?}"
            );
        };
        same("");
        same("plain text that needs nothing");
        same("é ü 漢字 🙂 \u{7f} \u{80} \u{2028}");
        for byte in (0u8..0x20).chain([b'"', b'\\', b'/', 0x7f]) {
            for before in 0..20 {
                for after in [0, 1, 7, 8, 9] {
                    let text = format!(
                        "{}{}{}",
                        "a".repeat(before),
                        char::from(byte),
                        "b".repeat(after)
                    );
                    same(&text);
                }
            }
        }
        // Random text from a fixed seed: ASCII-heavy with controls, quotes, backslashes
        // and multi-byte characters in runs of every length.
        let alphabet: Vec<char> = "abcXYZ019 \"\\\n\t\r\u{0}\u{1}\u{1f}\u{8}\u{c}é漢🙂\u{7f}"
            .chars()
            .collect();
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..2000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = usize::try_from(state % 70).unwrap();
            let text: String = (0..len)
                .map(|i| {
                    let pick = (state >> (i % 50)) ^ (i as u64).wrapping_mul(0x2545_f491);
                    alphabet[usize::try_from(pick % alphabet.len() as u64).unwrap()]
                })
                .collect();
            same(&text);
        }
        // Long runs between escapes, as a file's lines are.
        same(&"line of text 0123456789 the quick brown fox\n".repeat(500));
    }

    /// Blocks written as one string are the blocks joined by newlines, written as one.
    #[test]
    fn lines_are_the_blocks_joined_by_newlines() {
        for parts in [
            vec![],
            vec![String::new()],
            vec!["one".to_owned()],
            vec![
                "a\"b".to_owned(),
                String::new(),
                "\n\u{1}é".to_owned(),
                "tail\\".to_owned(),
            ],
        ] {
            let mut ours = Vec::new();
            write_lines(&parts, &mut ours);
            assert_eq!(
                String::from_utf8(ours).unwrap(),
                serde_json::to_string(&parts.join("\n")).unwrap(),
                "{parts:?}"
            );
        }
    }

    #[test]
    fn values_are_written_as_serde_json_writes_them() {
        for value in [
            json!(null),
            json!(true),
            json!([]),
            json!({}),
            json!({"b": 1, "a": [1, -2, 3.5, 1e300, u64::MAX, i64::MIN, 0.1], "c": {"d": null}}),
            json!({"content": [{"type": "text", "text": "line 1\nline \"2\"\t\u{1}é🙂"}], "is_error": false}),
            json!([[[["deep"]]], {"x\ny": "key with a newline"}]),
        ] {
            let mut ours = Vec::new();
            write_value(&value, &mut ours);
            assert_eq!(
                String::from_utf8(ours).unwrap(),
                serde_json::to_string(&value).unwrap()
            );
        }
    }

    #[test]
    fn sorted_writes_keys_in_byte_order_at_every_depth() {
        // Inserted out of order (serde_json keeps insertion order in this workspace).
        let value = json!({"b": 1, "a": {"z": [1, {"y": 2, "x": "é\n"}], "c": null}, "B": true});
        let mut sorted = Vec::new();
        write_sorted(&value, &mut sorted);
        assert_eq!(
            String::from_utf8(sorted).unwrap(),
            r#"{"B":true,"a":{"c":null,"z":[1,{"x":"é\n","y":2}]},"b":1}"#
        );
    }

    #[tokio::test]
    async fn the_answer_is_json() {
        let value = json!({"text": "a\nb", "n": 1});
        let response = json_response(|body| write_value(&value, body));
        assert_eq!(response.status(), axum::http::StatusCode::OK);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        assert_eq!(body, serde_json::to_vec(&value).unwrap());
    }
}
