//! `POST /v1/agent/runs`: `{"prompt": str, "session_id"?: str, "max_turns"?: int}` →
//! Server-Sent Events of the run (`event: <kind>`, `data: <json>`). Closing the stream
//! cancels the run and its calls in flight.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::Value;
use tokio::sync::mpsc;

use super::{AgentError, AgentEvent, RunRequest};
use crate::auth::{Principal, Role};
use crate::http_api::{ApiError, HttpState, read_json, require_role};

/// A comment line this often keeps proxies from closing a quiet stream.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// Parses the body of `POST /v1/agent/runs`.
pub fn parse_request(body: &Value) -> Result<RunRequest, String> {
    let Some(object) = body.as_object() else {
        return Err("the request body must be a JSON object".into());
    };
    if let Some(key) = object
        .keys()
        .find(|k| !["prompt", "session_id", "max_turns"].contains(&k.as_str()))
    {
        return Err(format!(
            "unknown field {key:?}; the body takes prompt, session_id and max_turns"
        ));
    }
    let prompt = match object.get("prompt") {
        Some(Value::String(p)) if !p.trim().is_empty() => p.clone(),
        Some(Value::String(_)) => return Err("prompt must not be empty".into()),
        Some(_) => return Err("prompt must be a string".into()),
        None => return Err("prompt is required".into()),
    };
    let session_id = match object.get("session_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => {
            Some(airlock_policy::SessionId::parse(s).map_err(|e| format!("session_id: {e}"))?)
        }
        Some(_) => return Err("session_id must be a string".into()),
    };
    let max_turns = match object.get("max_turns") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|n| *n > 0)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or("max_turns must be a positive integer")?,
        ),
    };
    Ok(RunRequest {
        prompt,
        session_id,
        max_turns,
    })
}

/// The HTTP answer to a run that could not start.
pub fn start_error(e: &AgentError) -> ApiError {
    if let AgentError::TooManyRuns { .. } = e {
        return ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_runs",
            e.to_string(),
        );
    }
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "agent_unavailable",
        e.to_string(),
    )
}

/// One SSE frame.
pub fn frame(event: &AgentEvent) -> Bytes {
    Bytes::from(format!("event: {}\ndata: {}\n\n", event.kind, event.data))
}

pub async fn start_run(
    State(state): State<HttpState>,
    axum::Extension(principal): axum::Extension<Principal>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    require_role(&principal, Role::Agent)?;
    let body = read_json(&headers, body, state.gate.limits().max_request_bytes).await?;
    let request = parse_request(&body)
        .map_err(|m| ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", m))?;
    let mut events = super::start(state.gate.clone(), &state.agent, principal, request)
        .map_err(|e| start_error(&e))?;
    let (bytes_tx, bytes_rx) = mpsc::channel::<Result<Bytes, Infallible>>(64);
    tokio::spawn(async move {
        let mut keep_alive = tokio::time::interval(KEEP_ALIVE);
        keep_alive.tick().await;
        loop {
            let chunk = tokio::select! {
                event = events.recv() => match event {
                    Some(event) => frame(&event),
                    None => return,
                },
                _ = keep_alive.tick() => Bytes::from_static(b": keep-alive\n\n"),
                // The client went away while the run was quiet (a tool call running).
                _ = bytes_tx.closed() => return,
            };
            // The client went away: dropping `events` cancels the run.
            if bytes_tx.send(Ok(chunk)).await.is_err() {
                return;
            }
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(bytes_rx);
    let mut response = Body::from_stream(stream).into_response();
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bodies_are_checked() {
        let ok =
            parse_request(&json!({"prompt": "hi", "session_id": "s1", "max_turns": 3})).unwrap();
        assert_eq!(ok.prompt, "hi");
        assert_eq!(ok.session_id.unwrap().as_str(), "s1");
        assert_eq!(ok.max_turns, Some(3));
        for (body, needle) in [
            (json!([]), "JSON object"),
            (json!({}), "prompt is required"),
            (json!({"prompt": ""}), "must not be empty"),
            (json!({"prompt": 1}), "must be a string"),
            (json!({"prompt": "x", "session_id": "../x"}), "session_id"),
            (json!({"prompt": "x", "max_turns": 0}), "max_turns"),
            (json!({"prompt": "x", "max_turns": "3"}), "max_turns"),
            (json!({"prompt": "x", "model": "y"}), "unknown field"),
        ] {
            let err = parse_request(&body).unwrap_err();
            assert!(err.contains(needle), "{body}: {err}");
        }
    }

    #[test]
    fn frames_are_sse() {
        let f = frame(&AgentEvent::new("run.started", json!({"a": 1})));
        assert_eq!(&f[..], b"event: run.started\ndata: {\"a\":1}\n\n");
    }
}
