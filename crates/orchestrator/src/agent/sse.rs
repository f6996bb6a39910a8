//! A small incremental parser for Server-Sent Events, as model providers stream them.
//!
//! Bytes arrive in arbitrary chunks (a line, a multi-byte character or a `\r\n` may be
//! split between two reads); [`SseParser::feed`] keeps the unfinished line and returns the
//! events that are complete. Lines end with `\n`, `\r\n` or `\r`; `:` starts a comment;
//! several `data:` lines are joined with `\n`; a blank line dispatches the event. Memory
//! is bounded: a line or an event over the limit is an error, not an allocation.

/// Longest line, and largest `data` of one event, accepted.
pub const MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("an event of the stream is over {0} bytes")]
    TooLarge(usize),
}

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field; `None` means the default type `message`.
    pub event: Option<String>,
    pub data: String,
}

#[derive(Debug)]
pub struct SseParser {
    line: Vec<u8>,
    event: Option<String>,
    data: String,
    has_data: bool,
    /// The previous chunk ended with `\r`: a leading `\n` belongs to that line end.
    skip_lf: bool,
    limit: usize,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::with_limit(MAX_EVENT_BYTES)
    }
}

impl SseParser {
    pub fn with_limit(limit: usize) -> Self {
        Self {
            line: Vec::new(),
            event: None,
            data: String::new(),
            has_data: false,
            skip_lf: false,
            limit,
        }
    }

    /// Consumes `chunk`; returns the events it completed, in order.
    pub fn feed(&mut self, chunk: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        let mut out = Vec::new();
        let mut rest = chunk;
        if self.skip_lf {
            self.skip_lf = false;
            if let Some(stripped) = rest.strip_prefix(b"\n") {
                rest = stripped;
            }
        }
        while let Some(end) = rest.iter().position(|b| *b == b'\n' || *b == b'\r') {
            self.push_bytes(&rest[..end])?;
            let line = std::mem::take(&mut self.line);
            self.line_done(&line, &mut out)?;
            let terminator = rest[end];
            rest = &rest[end + 1..];
            if terminator == b'\r' {
                match rest.first() {
                    Some(b'\n') => rest = &rest[1..],
                    Some(_) => {}
                    None => self.skip_lf = true,
                }
            }
        }
        self.push_bytes(rest)?;
        Ok(out)
    }

    /// The stream ended: an event that was not followed by a blank line is dispatched.
    pub fn finish(&mut self) -> Result<Option<SseEvent>, SseError> {
        let mut out = Vec::new();
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.line_done(&line, &mut out)?;
        }
        self.line_done(b"", &mut out)?;
        Ok(out.pop())
    }

    fn push_bytes(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        if self.line.len() + bytes.len() > self.limit {
            return Err(SseError::TooLarge(self.limit));
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    fn line_done(&mut self, line: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if line.is_empty() {
            if self.has_data {
                out.push(SseEvent {
                    event: self.event.take(),
                    data: std::mem::take(&mut self.data),
                });
            }
            self.event = None;
            self.data.clear();
            self.has_data = false;
            return Ok(());
        }
        if line.first() == Some(&b':') {
            return Ok(());
        }
        let line = String::from_utf8_lossy(line);
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_ref(), ""),
        };
        match field {
            "event" => self.event = Some(value.to_owned()),
            "data" => {
                if self.data.len() + value.len() + 1 > self.limit {
                    return Err(SseError::TooLarge(self.limit));
                }
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            // `id` and `retry` matter to reconnecting browsers, not to one request.
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(parser: &mut SseParser, chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        for chunk in chunks {
            out.extend(parser.feed(chunk).unwrap());
        }
        out.extend(parser.finish().unwrap());
        out
    }

    #[test]
    fn events_split_anywhere_come_out_whole() {
        let stream = "event: message_start\ndata: {\"type\":\"message_start\"}\n\n: a comment\nevent: ping\ndata: {\"type\": \"ping\"}\r\n\r\ndata: é and more\n\n";
        let expected = vec![
            SseEvent {
                event: Some("message_start".into()),
                data: "{\"type\":\"message_start\"}".into(),
            },
            SseEvent {
                event: Some("ping".into()),
                data: "{\"type\": \"ping\"}".into(),
            },
            SseEvent {
                event: None,
                data: "é and more".into(),
            },
        ];
        let bytes = stream.as_bytes();
        // Every split point, including inside "é" and between "\r" and "\n".
        for at in 0..bytes.len() {
            let mut parser = SseParser::default();
            let got = all(&mut parser, &[&bytes[..at], &bytes[at..]]);
            assert_eq!(got, expected, "split at {at}");
        }
        // One byte at a time.
        let mut parser = SseParser::default();
        let chunks: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(all(&mut parser, &chunks), expected);
    }

    #[test]
    fn multi_line_data_cr_endings_and_fields_without_value() {
        let mut parser = SseParser::default();
        let got = all(
            &mut parser,
            &[b"data: a\rdata:b\rdata\r\revent: x\nid: 7\nretry: 5\n\n"],
        );
        assert_eq!(
            got,
            vec![SseEvent {
                event: None,
                data: "a\nb\n".into()
            }]
        );
    }

    #[test]
    fn an_event_without_a_final_blank_line_is_flushed_at_the_end() {
        let mut parser = SseParser::default();
        assert!(parser.feed(b"data: [DONE]").unwrap().is_empty());
        assert_eq!(parser.finish().unwrap().unwrap().data, "[DONE]");
    }

    #[test]
    fn oversized_lines_are_refused() {
        let mut parser = SseParser::with_limit(16);
        assert!(parser.feed(b"data: 0123456789").is_ok());
        assert_eq!(parser.feed(b"abcdef").unwrap_err(), SseError::TooLarge(16));
        let mut parser = SseParser::with_limit(16);
        let err = parser
            .feed(b"data: 0123456789\ndata: 0123456789\n")
            .unwrap_err();
        assert_eq!(err, SseError::TooLarge(16));
    }
}
