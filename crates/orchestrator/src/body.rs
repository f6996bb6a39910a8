//! The one body reader under the front doors' cap (`[limits] max_request_bytes`), with
//! one overflow behaviour: a body over the cap — by its `Content-Length` or by what
//! arrives — is answered 413, after what was sent has been read and thrown away (up to
//! a bound), so the client gets the answer instead of a reset connection. Nothing over
//! the cap is kept in memory. A body within the cap that does not arrive in time is
//! answered 408, saying so, rather than judged by what arrived of it.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, StatusCode, header};
use http_body_util::BodyExt;

use crate::http_api::ApiError;

/// How much of an oversized body is read and discarded before answering 413.
const DRAIN_BYTES: u64 = 64 * 1024 * 1024;
/// How long that may take.
const DRAIN_TIME: Duration = Duration::from_secs(10);
/// How long a body within the cap may take to arrive, from its first read: a body that
/// trickles in holds a connection and up to the cap of memory for as long as it is let.
const BODY_TIME: Duration = Duration::from_secs(60);

/// The body, whole, or a 413 whose message ends with `advice` (what to send instead).
pub(crate) async fn read_capped(
    headers: &HeaderMap,
    body: Body,
    limit: u64,
    advice: &str,
) -> Result<Vec<u8>, ApiError> {
    let times = Times {
        body: BODY_TIME,
        drain: DRAIN_TIME,
    };
    read_within(headers, body, limit, advice, times).await
}

/// How long a body may take to arrive, and how long the rest of one over the cap is
/// drained for.
#[derive(Clone, Copy)]
struct Times {
    body: Duration,
    drain: Duration,
}

async fn read_within(
    headers: &HeaderMap,
    body: Body,
    limit: u64,
    advice: &str,
    times: Times,
) -> Result<Vec<u8>, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("request body is over the limit of {limit} bytes; {advice}"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut body = body;
    let mut bytes = Vec::new();
    let mut over = declared.is_some_and(|n| n > limit);
    let mut discarded: u64 = 0;
    let started = tokio::time::Instant::now();
    // Reading a body within the cap has `times.body`; once it is over the cap, what is
    // left is drained for at most `times.drain` from then.
    let mut until = started + if over { times.drain } else { times.body };
    loop {
        let frame = match tokio::time::timeout_at(until, body.frame()).await {
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(e))) if !over => {
                return Err(ApiError::bad_request(format!(
                    "cannot read the request body: {e}"
                )));
            }
            Err(_) if !over => {
                return Err(ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "request_timeout",
                    format!(
                        "the request body did not arrive within {} s ({} bytes came); send it at once, or {advice}",
                        times.body.as_secs(),
                        bytes.len()
                    ),
                ));
            }
            Ok(None) | Ok(Some(Err(_))) | Err(_) => break,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let len = u64::try_from(data.len()).unwrap_or(u64::MAX);
        if over {
            discarded = discarded.saturating_add(len);
            if discarded > DRAIN_BYTES {
                break;
            }
        } else if u64::try_from(bytes.len())
            .unwrap_or(u64::MAX)
            .saturating_add(len)
            > limit
        {
            over = true;
            bytes = Vec::new();
            until = tokio::time::Instant::now() + times.drain;
        } else {
            bytes.extend_from_slice(&data);
        }
    }
    if over {
        return Err(too_large());
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::IntoResponse as _;
    use futures::StreamExt as _;

    const SHORT: Times = Times {
        body: Duration::from_millis(200),
        drain: Duration::from_millis(200),
    };

    /// A body that sends `first` and then nothing, without ending.
    fn stalled(first: &'static [u8]) -> Body {
        let chunks =
            futures::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from_static(first))])
                .chain(futures::stream::pending());
        Body::from_stream(chunks)
    }

    /// The status and the error's message, as the client gets them.
    async fn answer(error: ApiError) -> (StatusCode, String) {
        let response = error.into_response();
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn a_body_that_stops_arriving_is_a_timeout_not_a_truncated_body() {
        let headers = HeaderMap::new();
        let read = read_within(
            &headers,
            stalled(b"{\"tool_uses\": ["),
            1024,
            "send less",
            SHORT,
        )
        .await;
        let Err(error) = read else {
            panic!("a stalled body was read as whole");
        };
        let (status, message) = answer(error).await;
        assert_eq!(status, StatusCode::REQUEST_TIMEOUT, "{message}");
        assert!(message.contains("did not arrive within"), "{message}");
        assert!(message.contains("request_timeout"), "{message}");
        // A body that ends in time is read whole.
        let body = Body::from("{\"tool_uses\": []}");
        let read = read_within(&headers, body, 1024, "send less", SHORT).await;
        assert_eq!(read.ok().as_deref(), Some(&b"{\"tool_uses\": []}"[..]));
    }

    #[tokio::test]
    async fn a_body_over_the_cap_is_answered_413_even_when_it_stalls() {
        let headers = HeaderMap::new();
        let read = read_within(&headers, stalled(&[b'x'; 64]), 16, "send less", SHORT).await;
        let Err(error) = read else {
            panic!("a body over the cap was accepted");
        };
        assert_eq!(answer(error).await.0, StatusCode::PAYLOAD_TOO_LARGE);
    }
}
