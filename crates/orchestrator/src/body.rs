//! The one body reader under the front doors' cap (`[limits] max_request_bytes`), with
//! one overflow behaviour: a body over the cap — by its `Content-Length` or by what
//! arrives — is answered 413, after what was sent has been read and thrown away (up to
//! a bound), so the client gets the answer instead of a reset connection. Nothing over
//! the cap is kept in memory.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, StatusCode, header};
use http_body_util::BodyExt;

use crate::http_api::ApiError;

/// How much of an oversized body is read and discarded before answering 413.
const DRAIN_BYTES: u64 = 64 * 1024 * 1024;
/// How long that may take.
const DRAIN_TIME: Duration = Duration::from_secs(10);

/// The body, whole, or a 413 whose message ends with `advice` (what to send instead).
pub(crate) async fn read_capped(
    headers: &HeaderMap,
    body: Body,
    limit: u64,
    advice: &str,
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
    let drain_until = tokio::time::Instant::now() + DRAIN_TIME;
    loop {
        let frame = match tokio::time::timeout_at(drain_until, body.frame()).await {
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(e))) if !over => {
                return Err(ApiError::bad_request(format!(
                    "cannot read the request body: {e}"
                )));
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
        } else {
            bytes.extend_from_slice(&data);
        }
    }
    if over {
        return Err(too_large());
    }
    Ok(bytes)
}
