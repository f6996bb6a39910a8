//! `POST /v1/tool_calls?stream=true`: Server-Sent Events while the calls run.
//!
//! Events: `call.started` `{tool_use_id, call_id}`, `call.output`
//! `{call_id, stream: "stdout"|"stderr", data}`, `call.progress`
//! `{call_id, progress, total?, message}`, `call.pending_approval`
//! `{call_id, approval_id}`, `call.completed` `{call: {…calls[] entry}, tool_result}`,
//! then the stream ends. Closing the stream cancels the calls that are still running
//! (their sandboxes are killed): each call's task ends when the stream is gone, and its
//! [`CallHandle`] cancels the call when dropped unfinished.

use std::convert::Infallible;

use airlock_policy::CallStatus;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::Stream;
use serde_json::json;
use tokio::sync::mpsc;

use crate::dispatch::WorkerEvent;
use crate::service::{CallHandle, Update};
use crate::wire;

fn event(name: &str, data: serde_json::Value) -> Result<Event, Infallible> {
    Ok(Event::default().event(name).data(data.to_string()))
}

/// The SSE answer for calls admitted with [`crate::service::OnDrop::Cancel`] and their
/// events.
pub fn tool_calls(
    handles: Vec<CallHandle>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>> + use<>> {
    let (out, rx) = mpsc::channel::<Result<Event, Infallible>>(256);
    for handle in handles {
        tokio::spawn(follow(handle, out.clone()));
    }
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).keep_alive(KeepAlive::default())
}

/// Streams one call's events until it ends or the client goes away.
async fn follow(mut handle: CallHandle, out: mpsc::Sender<Result<Event, Infallible>>) {
    let first = handle.record();
    let call_id = first.call_id.clone();
    let _ = out
        .send(event(
            "call.started",
            json!({"tool_use_id": first.tool_use_id, "call_id": call_id}),
        ))
        .await;
    let mut announced_pending = false;
    loop {
        let update = tokio::select! {
            update = handle.next() => update,
            // The client went away: dropping the handle cancels the call.
            () = out.closed() => return,
        };
        match update {
            Update::Event(worker_event) => {
                if out
                    .send(worker_event_sse(&call_id, worker_event))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Update::Changed(record) => {
                if record.status == CallStatus::PendingApproval && !announced_pending {
                    announced_pending = true;
                    let _ = out
                        .send(event(
                            "call.pending_approval",
                            json!({"call_id": call_id, "approval_id": record.approval_id}),
                        ))
                        .await;
                }
            }
            Update::Final(record) => {
                // Written from the record: the result's text is not copied into a
                // `Value` first.
                let mut data = Vec::with_capacity(256);
                wire::write_call_completed(&record, &mut data);
                let data = String::from_utf8(data)
                    .unwrap_or_else(|bad| String::from_utf8_lossy(bad.as_bytes()).into_owned());
                let _ = out
                    .send(Ok(Event::default().event("call.completed").data(data)))
                    .await;
                return;
            }
        }
    }
}

fn worker_event_sse(call_id: &str, worker_event: WorkerEvent) -> Result<Event, Infallible> {
    match worker_event {
        WorkerEvent::Output { stream, data } => event(
            "call.output",
            json!({"call_id": call_id, "stream": stream, "data": String::from_utf8_lossy(&data)}),
        ),
        WorkerEvent::Progress {
            progress,
            total,
            message,
        } => event(
            "call.progress",
            json!({"call_id": call_id, "progress": progress, "total": total, "message": message}),
        ),
    }
}
