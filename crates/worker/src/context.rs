//! What a tool sees of the call it is running.

use std::time::Instant;

use airlock_policy::SessionId;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The longest progress message passed on, in characters.
pub const MAX_PROGRESS_CHARS: usize = 1000;

/// Which output stream a chunk belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputStream {
    Stdout,
    Stderr,
}

/// An event a running tool emits before its final result.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolEvent {
    Progress {
        progress: f64,
        total: Option<f64>,
        message: String,
    },
    Output {
        stream: OutputStream,
        data: Vec<u8>,
    },
}

/// The context of one call: who it runs for, until when, and a way to report progress.
#[derive(Debug, Clone)]
pub struct CallContext {
    pub call_id: String,
    /// Validated path segment naming the principal the call runs for.
    pub principal: String,
    pub session_id: SessionId,
    /// When the worker's own timer ends the call.
    pub deadline: Instant,
    /// Cancelled when the caller goes away, the deadline passes or the worker drains
    /// past its grace period.
    pub cancel: CancellationToken,
    events: mpsc::Sender<ToolEvent>,
}

impl CallContext {
    pub fn new(
        call_id: String,
        principal: String,
        session_id: SessionId,
        deadline: Instant,
        cancel: CancellationToken,
        events: mpsc::Sender<ToolEvent>,
    ) -> Self {
        Self {
            call_id,
            principal,
            session_id,
            deadline,
            cancel,
            events,
        }
    }

    /// Reports progress. Never blocks the tool: when the caller is slow, events are
    /// dropped rather than stalling the call.
    /// The message is cut to [`MAX_PROGRESS_CHARS`]: a progress line is a status, and
    /// what a tool (or an MCP server it relays) sends here queues per call.
    pub fn progress(&self, progress: f64, total: Option<f64>, message: impl Into<String>) {
        let mut message = message.into();
        if let Some((cut, _)) = message.char_indices().nth(MAX_PROGRESS_CHARS) {
            message.truncate(cut);
        }
        let _ = self.events.try_send(ToolEvent::Progress {
            progress,
            total,
            message,
        });
    }

    /// Streams a chunk of output; waits when the caller is slow so no output is lost.
    pub async fn output(&self, stream: OutputStream, data: Vec<u8>) {
        let _ = self.events.send(ToolEvent::Output { stream, data }).await;
    }

    /// A blocking-context variant of [`CallContext::output`], for tools that run on a
    /// blocking thread (the sandbox's output pump): waits while the caller is slow, but
    /// not past `until` nor once `stop()` says the run is over, so that a slow reader
    /// never holds up the thread that enforces the tool's own wall clock. A chunk not
    /// sent by then is left out of the stream (the final result still holds the output,
    /// within its caps); returns whether it was sent.
    pub fn output_until(
        &self,
        stream: OutputStream,
        data: Vec<u8>,
        until: Instant,
        stop: impl Fn() -> bool,
    ) -> bool {
        /// How often a full stream is tried again.
        const RETRY: std::time::Duration = std::time::Duration::from_millis(5);
        let mut event = ToolEvent::Output { stream, data };
        loop {
            match self.events.try_send(event) {
                Ok(()) => return true,
                Err(mpsc::error::TrySendError::Closed(_)) => return false,
                Err(mpsc::error::TrySendError::Full(back)) => {
                    if Instant::now() >= until || stop() {
                        return false;
                    }
                    event = back;
                    std::thread::sleep(RETRY);
                }
            }
        }
    }
}
