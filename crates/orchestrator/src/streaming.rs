//! `POST /v1/tool_calls?stream=true`: Server-Sent Events while the calls run.
//!
//! Events: `call.started` `{tool_use_id, call_id}`, `call.output`
//! `{call_id, stream: "stdout"|"stderr", data}`, `call.progress`
//! `{call_id, progress, total?, message}`, `call.pending_approval`
//! `{call_id, approval_id}`, `call.completed` `{call: {…calls[] entry}, tool_result}`,
//! then the stream ends. Closing the stream cancels the calls that are still running
//! (their sandboxes are killed).

use std::convert::Infallible;
use std::sync::Arc;

use airlock_policy::{CallStatus, SessionId};
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::Stream;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::auth::Principal;
use crate::dispatch::WorkerEvent;
use crate::gate::Gate;
use crate::wire::{self, ProposedCall};

/// Cancels, when dropped, every call of the stream that has not finished.
struct CancelUnfinished {
    gate: Arc<Gate>,
    call_ids: Vec<String>,
}

impl Drop for CancelUnfinished {
    fn drop(&mut self) {
        for call_id in &self.call_ids {
            let running = self
                .gate
                .watch(call_id)
                .is_some_and(|rx| !rx.borrow().status.is_final());
            if running {
                self.gate.cancel(call_id);
            }
        }
    }
}

struct GuardedStream<S> {
    inner: S,
    _guard: CancelUnfinished,
}

impl<S: Stream + Unpin> Stream for GuardedStream<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.inner).poll_next(cx)
    }
}

fn event(name: &str, data: Value) -> Result<Event, Infallible> {
    Ok(Event::default().event(name).data(data.to_string()))
}

pub fn tool_calls(
    gate: Arc<Gate>,
    principal: &Principal,
    session: &SessionId,
    session_named: bool,
    calls: Vec<ProposedCall>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>> + use<>> {
    let (out, rx) = mpsc::channel::<Result<Event, Infallible>>(256);
    let mut call_ids = Vec::new();
    let mut tasks = Vec::new();
    for call in calls {
        let (events_tx, mut events_rx) = mpsc::channel::<WorkerEvent>(256);
        let mut state = match call.into_tool_use() {
            Ok(tool_use) => {
                gate.submit(principal, session, session_named, tool_use, Some(events_tx))
            }
            Err((id, name, message)) => gate.reject(principal, id, name, message),
        };
        let first = state.borrow().clone();
        call_ids.push(first.call_id.clone());
        let out = out.clone();
        tasks.push(tokio::spawn(async move {
            let call_id = first.call_id.clone();
            let _ = out.send(event("call.started", json!({"tool_use_id": first.tool_use_id, "call_id": call_id}))).await;
            let mut announced_pending = false;
            loop {
                let record = state.borrow().clone();
                if record.status == CallStatus::PendingApproval && !announced_pending {
                    announced_pending = true;
                    let _ = out
                        .send(event("call.pending_approval", json!({"call_id": call_id, "approval_id": record.approval_id})))
                        .await;
                }
                if record.status.is_final() {
                    while let Ok(worker_event) = events_rx.try_recv() {
                        let _ = out.send(worker_event_sse(&call_id, worker_event)).await;
                    }
                    let tool_result = record.result.as_ref().map(|o| wire::anthropic_result(&record.tool_use_id, o));
                    let _ = out
                        .send(event("call.completed", json!({"call": wire::call_summary(&record), "tool_result": tool_result})))
                        .await;
                    return;
                }
                tokio::select! {
                    changed = state.changed() => if changed.is_err() { return },
                    Some(worker_event) = events_rx.recv() => {
                        if out.send(worker_event_sse(&call_id, worker_event)).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }));
    }
    drop(out);
    let stream = GuardedStream {
        inner: tokio_stream::wrappers::ReceiverStream::new(rx),
        _guard: CancelUnfinished { gate, call_ids },
    };
    Sse::new(stream).keep_alive(KeepAlive::default())
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
