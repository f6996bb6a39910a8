//! The orchestrator's side of a worker's `Execute` stream (DESIGN §9), read without a
//! second copy of each message.
//!
//! tonic's client copies every DATA frame into one contiguous buffer per message and
//! prost then copies each result's text out of it: for a 1 MiB result, two fresh 1 MiB
//! buffers (large buffers are mappings of their own in the orchestrator, so each is
//! 256 page faults) and two copies. Here the frames a message arrives in are kept as
//! h2 handed them over and the event is decoded straight out of them, so the text is
//! copied once, into its own `String`.
//!
//! What a caller sees is what tonic's client gave: every failure is the same `Status`,
//! made the same way (`Status::from_error` for the channel's and the body's errors,
//! the `grpc-status` of the headers or trailers, the HTTP status when both lack one),
//! since `replicas::never_started` and `dispatch::is_unreachable` read them.

use std::collections::VecDeque;

use airlock_proto::v1 as pb;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use prost::Message;
use tonic::{Code, Status};

use crate::worker_channel::{ORIGIN, RecvBody, WorkerChannel};

/// gRPC's length prefix: a compression flag and a big-endian length.
const PREFIX_BYTES: usize = 5;
/// The method's path (`airlock.v1.ToolWorker/Execute`).
const EXECUTE_PATH: &str = "/airlock.v1.ToolWorker/Execute";

/// Sends `request` to the worker behind `channel` and returns its stream of events
/// once the worker has answered with headers. Messages larger than `max_message_bytes`
/// are refused, either way, before anything of them is kept.
pub async fn open(
    channel: WorkerChannel,
    request: tonic::Request<pb::ExecuteRequest>,
    max_message_bytes: usize,
) -> Result<ExecuteStream, Status> {
    let (metadata, _, message) = request.into_parts();
    let length = message.encoded_len();
    if length > max_message_bytes {
        return Err(too_large("encoded", length, max_message_bytes));
    }
    let mut framed = BytesMut::with_capacity(PREFIX_BYTES + length);
    framed.put_u8(0);
    framed.put_u32(wire_length(length)?);
    message
        .encode(&mut framed)
        .map_err(|e| Status::internal(format!("cannot encode the request: {e}")))?;

    // The metadata carries the trace context and `grpc-timeout`, which the channel
    // bounds the wait for the answer's headers by.
    let mut headers = metadata.into_headers();
    for reserved in ["te", "content-type", "grpc-status", "grpc-message"] {
        headers.remove(reserved);
    }
    headers.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    let mut wire = http::Request::post(format!("{ORIGIN}{EXECUTE_PATH}"))
        .version(http::Version::HTTP_2)
        .body(tonic::body::Body::new(http_body_util::Full::new(
            framed.freeze(),
        )))
        .map_err(|e| Status::internal(format!("cannot build the request: {e}")))?;
    *wire.headers_mut() = headers;

    let response = tower::ServiceExt::oneshot(channel, wire)
        .await
        .map_err(Status::from_error)?;
    refuse_compression(response.headers())?;
    // A trailers-only answer: the worker refused the call before streaming anything.
    let trailers_only = Status::from_header_map(response.headers());
    if let Some(status) = &trailers_only
        && status.code() != Code::Ok
    {
        return Err(status.clone());
    }
    let (head, body) = response.into_parts();
    Ok(ExecuteStream {
        body: trailers_only.is_none().then_some(body),
        http_status: head.status,
        received: Received::default(),
        trailers: None,
        max_message_bytes,
    })
}

/// The events of one call, as the worker sends them, then how the stream ended.
pub struct ExecuteStream {
    /// `None` once the body has ended (or never had messages: a trailers-only answer).
    body: Option<RecvBody>,
    http_status: http::StatusCode,
    /// What has arrived and is not yet decoded.
    received: Received,
    trailers: Option<http::HeaderMap>,
    max_message_bytes: usize,
}

impl ExecuteStream {
    /// The next event; `Ok(None)` once the worker has ended the stream with `OK`, the
    /// worker's status if it ended it with another.
    pub async fn message(&mut self) -> Result<Option<pb::ExecuteEvent>, Status> {
        loop {
            if let Some(event) = self.decode_next()? {
                return Ok(Some(event));
            }
            let Some(body) = self.body.as_mut() else {
                return Ok(None);
            };
            match body.frame().await {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => self.received.push(data),
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            self.trailers.get_or_insert_default().extend(trailers);
                        }
                    }
                },
                Some(Err(error)) => {
                    self.body = None;
                    return Err(Status::from_error(error));
                }
                None => return self.ended(),
            }
        }
    }

    /// Reads the stream to its end, after the call's result: the trailers are what
    /// is left, and a stream dropped before them is reset (see `dispatch::read_to_end`).
    pub async fn finish(&mut self) -> Result<(), Status> {
        while self.message().await?.is_some() {}
        Ok(())
    }

    /// The next whole message of what has arrived, if there is one.
    fn decode_next(&mut self) -> Result<Option<pb::ExecuteEvent>, Status> {
        let Some((compressed, length)) = self.received.prefix() else {
            return Ok(None);
        };
        if compressed != 0 {
            self.fail();
            return Err(Status::internal(format!(
                "protocol error: the worker sent a message with compression flag {compressed}, \
                 and no compression was agreed"
            )));
        }
        if length > self.max_message_bytes {
            self.fail();
            return Err(too_large("decoded", length, self.max_message_bytes));
        }
        if self.received.remaining() < PREFIX_BYTES + length {
            return Ok(None);
        }
        self.received.advance(PREFIX_BYTES);
        match pb::ExecuteEvent::decode((&mut self.received).take(length)) {
            Ok(event) => Ok(Some(event)),
            Err(e) => {
                self.fail();
                Err(Status::internal(e.to_string()))
            }
        }
    }

    /// The body has ended: its trailers' `grpc-status`, or what the HTTP status says
    /// when there is none (tonic's mapping, from gRPC's HTTP-to-status table).
    fn ended(&mut self) -> Result<Option<pb::ExecuteEvent>, Status> {
        self.body = None;
        if self.received.has_remaining() {
            self.received = Received::default();
            return Err(Status::internal("Unexpected EOF decoding stream."));
        }
        if let Some(status) = self
            .trailers
            .take()
            .as_ref()
            .and_then(Status::from_header_map)
        {
            return if status.code() == Code::Ok {
                Ok(None)
            } else {
                Err(status)
            };
        }
        let code = match self.http_status {
            http::StatusCode::OK => return Ok(None),
            http::StatusCode::BAD_REQUEST => Code::Internal,
            http::StatusCode::UNAUTHORIZED => Code::Unauthenticated,
            http::StatusCode::FORBIDDEN => Code::PermissionDenied,
            http::StatusCode::NOT_FOUND => Code::Unimplemented,
            http::StatusCode::TOO_MANY_REQUESTS
            | http::StatusCode::BAD_GATEWAY
            | http::StatusCode::SERVICE_UNAVAILABLE
            | http::StatusCode::GATEWAY_TIMEOUT => Code::Unavailable,
            _ => Code::Unknown,
        };
        Err(Status::new(
            code,
            format!(
                "grpc-status header missing, mapped from HTTP status code {}",
                self.http_status.as_u16()
            ),
        ))
    }

    /// A stream that failed is over: nothing more of it is read or kept.
    fn fail(&mut self) {
        self.body = None;
        self.received = Received::default();
    }
}

fn too_large(which: &str, length: usize, limit: usize) -> Status {
    Status::out_of_range(format!(
        "Error, {which} message length too large: found {length} bytes, the limit is: {limit} bytes"
    ))
}

fn wire_length(length: usize) -> Result<u32, Status> {
    u32::try_from(length).map_err(|_| too_large("encoded", length, u32::MAX as usize))
}

/// Only uncompressed messages are agreed (the request offers no `grpc-accept-encoding`).
fn refuse_compression(headers: &http::HeaderMap) -> Result<(), Status> {
    match headers.get("grpc-encoding") {
        None => Ok(()),
        Some(encoding) if encoding.as_bytes() == b"identity" => Ok(()),
        Some(encoding) => Err(Status::unimplemented(format!(
            "Content is compressed with `{}` which isn't supported",
            String::from_utf8_lossy(encoding.as_bytes())
        ))),
    }
}

/// The DATA frames received and not yet decoded, as h2 handed them over: a `Buf`
/// over all of them, which prost decodes from without joining them first.
#[derive(Default)]
struct Received {
    frames: VecDeque<Bytes>,
    remaining: usize,
}

impl Received {
    fn push(&mut self, data: Bytes) {
        if !data.is_empty() {
            self.remaining += data.len();
            self.frames.push_back(data);
        }
    }

    /// The next message's compression flag and length, once its prefix is here (it
    /// may straddle frames).
    fn prefix(&self) -> Option<(u8, usize)> {
        if self.remaining < PREFIX_BYTES {
            return None;
        }
        let mut prefix = [0u8; PREFIX_BYTES];
        let mut filled = 0;
        for frame in &self.frames {
            let take = (PREFIX_BYTES - filled).min(frame.len());
            prefix[filled..filled + take].copy_from_slice(&frame[..take]);
            filled += take;
            if filled == PREFIX_BYTES {
                break;
            }
        }
        let [compressed, length @ ..] = prefix;
        Some((compressed, u32::from_be_bytes(length) as usize))
    }
}

impl Buf for Received {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        self.frames.front().map_or(&[], |frame| frame.as_ref())
    }

    fn advance(&mut self, count: usize) {
        // Never past the end: prost's reads are bounded by `remaining`, and an advance
        // beyond it stops at the end rather than panicking the orchestrator.
        let mut count = count.min(self.remaining);
        self.remaining -= count;
        while count > 0 {
            let Some(front) = self.frames.front_mut() else {
                return;
            };
            if count < front.len() {
                front.advance(count);
                return;
            }
            count -= front.len();
            self.frames.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use pb::execute_event::Event;

    use super::*;

    /// Every wait in these tests is bounded; none is a measurement.
    const BOUND: Duration = Duration::from_secs(30);

    fn framed(event: &pb::ExecuteEvent) -> Vec<u8> {
        let message = event.encode_to_vec();
        let mut out = vec![0];
        out.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
        out.extend_from_slice(&message);
        out
    }

    fn progress(n: f64) -> pb::ExecuteEvent {
        pb::ExecuteEvent {
            event: Some(Event::Progress(pb::Progress {
                progress: n,
                total: 10.0,
                message: format!("step {n}"),
            })),
        }
    }

    fn result(text: String) -> pb::ExecuteEvent {
        pb::ExecuteEvent {
            event: Some(Event::Result(pb::ToolResult {
                content: vec![text, "second block".into()],
                ..Default::default()
            })),
        }
    }

    fn trailers(code: i32, message: &str) -> http::HeaderMap {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", code.to_string().parse().unwrap());
        if !message.is_empty() {
            trailers.insert("grpc-message", message.parse().unwrap());
        }
        trailers
    }

    /// What the test worker is to answer a request with: headers, DATA frames as
    /// given, then trailers (or none, leaving the stream open).
    struct Answer {
        status: u16,
        headers: Vec<(&'static str, &'static str)>,
        frames: Vec<Vec<u8>>,
        trailers: Option<http::HeaderMap>,
        /// End the stream after the frames without trailers.
        end_without_trailers: bool,
    }

    impl Answer {
        fn ok(frames: Vec<Vec<u8>>) -> Self {
            Self {
                status: 200,
                headers: vec![],
                frames,
                trailers: Some(trailers(0, "")),
                end_without_trailers: false,
            }
        }
    }

    /// The request a test worker received: its head and its body.
    type Seen = (http::request::Parts, Vec<u8>);

    /// A worker on `socket` answering each stream with `answer(its request)`, made
    /// with h2's server so that the frames are exactly those given.
    fn worker<F>(socket: &std::path::Path, answer: F) -> tokio::sync::mpsc::UnboundedReceiver<Seen>
    where
        F: Fn(&http::request::Parts) -> Answer + Send + Sync + 'static,
    {
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        let (seen, requests) = tokio::sync::mpsc::unbounded_channel();
        let answer = std::sync::Arc::new(answer);
        tokio::spawn(async move {
            let (io, _) = listener.accept().await.unwrap();
            let mut connection = h2::server::handshake(io).await.unwrap();
            while let Some(Ok((request, mut respond))) = connection.accept().await {
                let (answer, seen) = (answer.clone(), seen.clone());
                tokio::spawn(async move {
                    let (head, mut body) = request.into_parts();
                    let mut bytes = Vec::new();
                    while let Some(Ok(data)) = body.data().await {
                        let _ = body.flow_control().release_capacity(data.len());
                        bytes.extend_from_slice(&data);
                    }
                    let answer = answer(&head);
                    let _ = seen.send((head, bytes));
                    let mut response = http::Response::builder().status(answer.status);
                    for (name, value) in &answer.headers {
                        response = response.header(*name, *value);
                    }
                    let ends_now = answer.frames.is_empty()
                        && answer.trailers.is_none()
                        && answer.end_without_trailers;
                    let mut send = respond
                        .send_response(response.body(()).unwrap(), ends_now)
                        .unwrap();
                    if ends_now {
                        return;
                    }
                    let last = answer.frames.len();
                    for (i, frame) in answer.frames.into_iter().enumerate() {
                        let end = i + 1 == last
                            && answer.trailers.is_none()
                            && answer.end_without_trailers;
                        send.send_data(Bytes::from(frame), end).unwrap();
                    }
                    match answer.trailers {
                        Some(trailers) => send.send_trailers(trailers).unwrap(),
                        None if answer.end_without_trailers && last == 0 => {
                            send.send_data(Bytes::new(), true).unwrap()
                        }
                        // Left open: the stream lives as long as the worker holds it.
                        None if !answer.end_without_trailers => {
                            tokio::time::sleep(BOUND).await;
                            drop(send);
                        }
                        None => {}
                    }
                });
            }
        });
        requests
    }

    fn request(case: &str) -> tonic::Request<pb::ExecuteRequest> {
        let mut request = tonic::Request::new(pb::ExecuteRequest {
            call_id: "call_1".into(),
            tool: "read_file".into(),
            arguments_json: r#"{"path":"a.txt"}"#.into(),
            principal: "alice".into(),
            session_id: "s1".into(),
            timeout_ms: 5_000,
            trace_context: Default::default(),
            detached: false,
        });
        request.set_timeout(Duration::from_secs(7));
        request
            .metadata_mut()
            .insert("x-case", case.parse().unwrap());
        request
    }

    fn case(head: &http::request::Parts) -> String {
        head.headers
            .get("x-case")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    }

    async fn all(stream: &mut ExecuteStream) -> Result<Vec<pb::ExecuteEvent>, Status> {
        let mut events = Vec::new();
        while let Some(event) = tokio::time::timeout(BOUND, stream.message())
            .await
            .expect("the stream stalled")?
        {
            events.push(event);
        }
        Ok(events)
    }

    /// However the worker cuts its messages into frames — a prefix across two frames,
    /// two messages in one, a message in hundreds — the same events come out, whole,
    /// and multi-byte text cut between frames is put back together. (Cuts of a few
    /// bytes take a short text: h2 itself refuses a flood of tiny DATA frames.)
    #[tokio::test]
    async fn every_cut_of_the_frames_decodes_the_same_events() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("w.sock");
        let events = |lines: usize| {
            vec![
                progress(1.0),
                progress(2.0),
                result("añ€😀 line\n".repeat(lines)),
            ]
        };
        let _requests = worker(&socket, move |head| {
            let case = case(head);
            let (cut, lines) = case.split_once(':').unwrap();
            let stream: Vec<u8> = events(lines.parse().unwrap())
                .iter()
                .flat_map(framed)
                .collect();
            let cut = cut.parse::<usize>().unwrap().min(stream.len());
            Answer::ok(stream.chunks(cut).map(<[u8]>::to_vec).collect())
        });
        let channel = crate::endpoints::unix_channel(socket);
        for (cut, lines) in [
            (1, 3),
            (2, 3),
            (3, 5),
            (5, 5),
            (6, 9),
            (7, 9),
            (4096, 3_000),
            (16_384, 3_000),
            (usize::MAX, 3_000),
        ] {
            let mut opened = open(channel.clone(), request(&format!("{cut}:{lines}")), 1 << 20)
                .await
                .unwrap();
            assert_eq!(
                all(&mut opened).await.unwrap(),
                events(lines),
                "cut every {cut} bytes"
            );
            assert!(opened.received.frames.is_empty());
        }
    }

    /// The request goes out as tonic's client sent it: the method's path, gRPC's
    /// headers, the caller's metadata and deadline, one length-prefixed message.
    #[tokio::test]
    async fn the_request_is_a_grpc_call_with_its_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("w.sock");
        let mut requests = worker(&socket, |_| Answer::ok(vec![framed(&progress(1.0))]));
        let channel = crate::endpoints::unix_channel(socket);
        let sent = request("metadata");
        let message = sent.get_ref().clone();
        let mut opened = open(channel, sent, 1 << 20).await.unwrap();
        assert_eq!(all(&mut opened).await.unwrap(), vec![progress(1.0)]);
        let (head, body) = requests.recv().await.unwrap();
        assert_eq!(head.method, http::Method::POST);
        assert_eq!(head.uri.path(), EXECUTE_PATH);
        assert_eq!(head.headers["content-type"], "application/grpc");
        assert_eq!(head.headers["te"], "trailers");
        assert_eq!(head.headers["x-case"], "metadata");
        assert_eq!(head.headers["grpc-timeout"], "7000000u");
        assert_eq!(body[0], 0);
        let length = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
        assert_eq!(length, body.len() - PREFIX_BYTES);
        assert_eq!(pb::ExecuteRequest::decode(&body[5..]).unwrap(), message);
    }

    /// A message longer than the limit is refused as soon as its prefix is in, while
    /// the worker is still holding the stream open: none of it is waited for or kept.
    #[tokio::test]
    async fn a_message_over_the_limit_is_refused_at_its_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("w.sock");
        let _requests = worker(&socket, |_| {
            let mut prefix = vec![0];
            prefix.extend_from_slice(&(64u32 << 20).to_be_bytes());
            prefix.extend_from_slice(&[0x0a; 100]);
            Answer {
                trailers: None,
                ..Answer::ok(vec![prefix])
            }
        });
        let channel = crate::endpoints::unix_channel(socket);
        let mut opened = open(channel, request("big"), 1 << 20).await.unwrap();
        let refused = all(&mut opened).await.unwrap_err();
        assert_eq!(refused.code(), Code::OutOfRange);
        assert!(refused.message().contains("67108864"), "{refused}");
        assert!(opened.received.frames.is_empty() && opened.body.is_none());
        // Refused, the stream is over.
        assert_eq!(opened.message().await.unwrap(), None);
    }

    /// How a stream ends is the worker's status in its trailers, or in its headers
    /// when it answered with nothing else; without one, the HTTP status; a message cut
    /// short or compressed is this side's error.
    #[tokio::test]
    async fn how_the_worker_ends_the_stream_is_its_status() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("w.sock");
        let _requests = worker(&socket, |head| {
            let event = framed(&progress(1.0));
            match case(head).as_str() {
                "not-found" => Answer {
                    trailers: Some(trailers(5, "no tool named x")),
                    ..Answer::ok(vec![event])
                },
                "trailers-only" => Answer {
                    headers: vec![("grpc-status", "14"), ("grpc-message", "draining")],
                    frames: vec![],
                    trailers: None,
                    end_without_trailers: true,
                    ..Answer::ok(vec![])
                },
                "http-503" => Answer {
                    status: 503,
                    trailers: None,
                    end_without_trailers: true,
                    ..Answer::ok(vec![])
                },
                "cut-short" => Answer {
                    trailers: None,
                    end_without_trailers: true,
                    ..Answer::ok(vec![event[..event.len() - 1].to_vec()])
                },
                "compressed" => {
                    let mut compressed = event;
                    compressed[0] = 1;
                    Answer::ok(vec![compressed])
                }
                "gzip" => Answer {
                    headers: vec![("grpc-encoding", "gzip")],
                    ..Answer::ok(vec![event])
                },
                _ => Answer::ok(vec![event]),
            }
        });
        let channel = crate::endpoints::unix_channel(socket);

        let mut opened = open(channel.clone(), request("not-found"), 1 << 20)
            .await
            .unwrap();
        assert_eq!(opened.message().await.unwrap(), Some(progress(1.0)));
        let status = opened.message().await.unwrap_err();
        assert_eq!(status.code(), Code::NotFound);
        assert_eq!(status.message(), "no tool named x");

        let status = refused_at_open(&channel, "trailers-only").await;
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(status.message(), "draining");

        let status = ended_with(&channel, "http-503").await;
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.message().contains("503"), "{status}");

        let status = ended_with(&channel, "cut-short").await;
        assert_eq!(status.code(), Code::Internal);
        assert!(status.message().contains("EOF"), "{status}");

        assert_eq!(
            ended_with(&channel, "compressed").await.code(),
            Code::Internal
        );
        assert_eq!(
            refused_at_open(&channel, "gzip").await.code(),
            Code::Unimplemented
        );

        let mut opened = open(channel, request("ok"), 1 << 20).await.unwrap();
        assert_eq!(opened.message().await.unwrap(), Some(progress(1.0)));
        tokio::time::timeout(BOUND, opened.finish())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(opened.message().await.unwrap(), None);
    }

    /// The status `case`'s answer is refused with before a stream is opened.
    async fn refused_at_open(channel: &WorkerChannel, case: &str) -> Status {
        match open(channel.clone(), request(case), 1 << 20).await {
            Ok(_) => panic!("{case}: a stream was opened"),
            Err(status) => status,
        }
    }

    /// The status `case`'s stream ends with, once opened and read to its end.
    async fn ended_with(channel: &WorkerChannel, case: &str) -> Status {
        let mut opened = open(channel.clone(), request(case), 1 << 20).await.unwrap();
        all(&mut opened).await.unwrap_err()
    }

    /// A request larger than the limit is refused before anything is sent.
    #[tokio::test]
    async fn a_request_over_the_limit_is_not_sent() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("w.sock");
        let mut requests = worker(&socket, |_| Answer::ok(vec![]));
        let channel = crate::endpoints::unix_channel(socket);
        let Err(status) = open(channel, request("large"), 16).await else {
            panic!("a request over the limit was sent");
        };
        assert_eq!(status.code(), Code::OutOfRange);
        assert!(requests.try_recv().is_err());
    }
}
