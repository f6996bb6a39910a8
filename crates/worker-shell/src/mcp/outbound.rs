//! What the worker writes to a stdio MCP server, bounded in memory and in time.
//!
//! The server's stdin is a pipe (64 KiB on Linux). rmcp writes every outgoing message
//! (an answer to one of the server's requests, a call, a notification) from a task of
//! its own, spawned without limit, each waiting for the writer's lock; and it answers
//! some requests (`ping`) by itself. A server that stops reading its stdin while it
//! keeps sending requests would therefore have their answers pile up in the worker for
//! as long as it likes. Two bounds stop that:
//!
//! - at most [`MAX_WAITING_MESSAGES`] messages wait to be written: with that many
//!   waiting, nothing more is read from the server (whose own writes then block on its
//!   full stdout), so what it sends cannot make the queue grow;
//! - a write that makes no progress for [`STDIN_STALL_SECONDS`] gives the server up: the
//!   write fails, so does every one after it, the session stops reading, and the
//!   server's sandbox is killed. The calls waiting on it, and the exit report, name the
//!   cause.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use airlock_sandbox::Cancel;
use rmcp::service::{RxJsonRpcMessage, ServiceRole, TxJsonRpcMessage};
use rmcp::transport::Transport;
use tokio::io::AsyncWrite;
use tokio::sync::Notify;
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;

use super::lock;

/// How long a write to a server's stdin may make no progress before the server is
/// given up: what nginx allows between two writes to a client (`send_timeout`), twice
/// the default call timeout, so a server busy with one call for a while is not stopped
/// for the messages queued behind it.
pub(super) const STDIN_STALL_SECONDS: u64 = 60;
/// Most messages that wait to be written to one server before the worker stops reading
/// from it. Each is a small answer (about 1 KiB with its task) or a call whose arguments
/// the caller holds anyway; a server that reads its stdin has a handful at most.
pub(super) const MAX_WAITING_MESSAGES: usize = 256;

/// What the writer and the transport of one server share with its instance.
pub(super) struct Outbound {
    server: String,
    stall_limit: Duration,
    max_waiting: usize,
    /// Messages handed to the transport and not yet written (nor failed).
    waiting: AtomicUsize,
    /// Of those, answers to the server's own requests: only while one waits does a
    /// write that makes no progress count against the stall limit. A server busy with a
    /// long call while the next call's message waits for room in its stdin is working,
    /// not refusing to read; one that keeps asking and never reads the answers is not.
    answers_waiting: AtomicUsize,
    /// Woken whenever one of them is done.
    done: Notify,
    /// Since when the write at hand has made no progress.
    stalled_since: Mutex<Option<Instant>>,
    /// Why the server was given up, once it was.
    failure: OnceLock<String>,
    /// Cancelled when the server is given up: the session stops reading from it.
    given_up: CancellationToken,
    /// Kills the server's sandbox.
    sandbox: Cancel,
}

impl Outbound {
    pub(super) fn new(server: String, sandbox: Cancel) -> Arc<Self> {
        Self::with_limits(
            server,
            sandbox,
            Duration::from_secs(STDIN_STALL_SECONDS),
            MAX_WAITING_MESSAGES,
        )
    }

    fn with_limits(
        server: String,
        sandbox: Cancel,
        stall_limit: Duration,
        max_waiting: usize,
    ) -> Arc<Self> {
        Arc::new(Self {
            server,
            stall_limit,
            max_waiting,
            waiting: AtomicUsize::new(0),
            answers_waiting: AtomicUsize::new(0),
            done: Notify::new(),
            stalled_since: Mutex::new(None),
            failure: OnceLock::new(),
            given_up: CancellationToken::new(),
            sandbox,
        })
    }

    /// The error every call of a given-up server gets: the cause and the fix.
    pub(super) fn failure(&self) -> Option<&str> {
        self.failure.get().map(String::as_str)
    }

    /// The cause, in a few words, once the server was given up.
    pub(super) fn cause(&self) -> Option<String> {
        self.failure().map(|_| {
            format!(
                "stopped reading its stdin for {} s",
                self.stall_limit.as_secs()
            )
        })
    }

    /// How long the write at hand has made no progress, if one is waiting.
    pub(super) fn stalled_for(&self) -> Option<Duration> {
        (*lock(&self.stalled_since)).map(|since| since.elapsed())
    }

    /// Wraps the pipe to the server's stdin.
    pub(super) fn writer<W>(self: &Arc<Self>, pipe: W) -> StallWriter<W> {
        StallWriter {
            pipe,
            outbound: self.clone(),
            stall: None,
        }
    }

    /// Wraps the session's transport.
    pub(super) fn transport<T>(self: &Arc<Self>, inner: T) -> Bounded<T> {
        Bounded {
            inner,
            outbound: self.clone(),
        }
    }

    /// Gives the server up (once): later writes fail at once, the session stops
    /// reading, and the sandbox is killed.
    fn give_up(&self) {
        let secs = self.stall_limit.as_secs();
        let message = format!(
            "the MCP server {} stopped reading its stdin for {secs} s while messages to it \
             waited, so it was stopped; the next call starts it again. A stdio MCP server \
             must keep reading its stdin while it works: calls, cancellations and the \
             answers to its own requests arrive there",
            self.server
        );
        if self.failure.set(message).is_ok() {
            tracing::warn!(
                server = %self.server,
                stalled_seconds = secs,
                "the MCP server stopped reading its stdin; stopping it"
            );
            self.given_up.cancel();
            self.sandbox.cancel();
        }
    }

    fn error(&self) -> io::Error {
        io::Error::new(
            io::ErrorKind::BrokenPipe,
            self.failure()
                .unwrap_or("the MCP server stopped reading its stdin"),
        )
    }

    fn set_stalled(&self, since: Option<Instant>) {
        *lock(&self.stalled_since) = since;
    }
}

/// Counts a message as waiting while it lives (and as an answer, if it is one).
struct Waiting {
    outbound: Arc<Outbound>,
    answer: bool,
}

impl Waiting {
    fn new(outbound: &Arc<Outbound>, answer: bool) -> Self {
        outbound.waiting.fetch_add(1, Ordering::SeqCst);
        if answer {
            outbound.answers_waiting.fetch_add(1, Ordering::SeqCst);
        }
        Self {
            outbound: outbound.clone(),
            answer,
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.answer {
            self.outbound.answers_waiting.fetch_sub(1, Ordering::SeqCst);
        }
        self.outbound.waiting.fetch_sub(1, Ordering::SeqCst);
        self.outbound.done.notify_waiters();
    }
}

/// The pipe to a server's stdin: a write (or flush) that stays pending for the stall
/// limit fails, and gives the server up.
pub(super) struct StallWriter<W> {
    pipe: W,
    outbound: Arc<Outbound>,
    /// Runs while a write is pending; dropped when one makes progress.
    stall: Option<Pin<Box<Sleep>>>,
}

impl<W> StallWriter<W> {
    fn watch<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match poll {
            Poll::Ready(result) => {
                if self.stall.take().is_some() {
                    self.outbound.set_stalled(None);
                }
                Poll::Ready(result)
            }
            Poll::Pending => {
                let outbound = &self.outbound;
                let stall = self.stall.get_or_insert_with(|| {
                    outbound.set_stalled(Some(Instant::now()));
                    Box::pin(tokio::time::sleep(outbound.stall_limit))
                });
                match stall.as_mut().poll(cx) {
                    Poll::Pending => Poll::Pending,
                    // Stalled with none of the server's questions unanswered: it is busy
                    // (a long call) and our next call waits for room. Looked at again
                    // after another stall limit.
                    Poll::Ready(()) if outbound.answers_waiting.load(Ordering::SeqCst) == 0 => {
                        stall
                            .as_mut()
                            .reset(tokio::time::Instant::now() + outbound.stall_limit);
                        if stall.as_mut().poll(cx).is_ready() {
                            cx.waker().wake_by_ref();
                        }
                        Poll::Pending
                    }
                    Poll::Ready(()) => {
                        outbound.give_up();
                        Poll::Ready(Err(outbound.error()))
                    }
                }
            }
        }
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for StallWriter<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.outbound.failure().is_some() {
            return Poll::Ready(Err(this.outbound.error()));
        }
        let poll = Pin::new(&mut this.pipe).poll_write(cx, buf);
        this.watch(cx, poll)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.outbound.failure().is_some() {
            return Poll::Ready(Err(this.outbound.error()));
        }
        let poll = Pin::new(&mut this.pipe).poll_flush(cx);
        this.watch(cx, poll)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().pipe).poll_shutdown(cx)
    }
}

/// The session's transport, with the waiting messages bounded: it reads nothing from
/// the server while [`MAX_WAITING_MESSAGES`] wait to be written, and nothing at all
/// once the server is given up (the session then ends as on the server's EOF).
pub(super) struct Bounded<T> {
    inner: T,
    outbound: Arc<Outbound>,
}

impl<R, T> Transport<R> for Bounded<T>
where
    R: ServiceRole,
    T: Transport<R, Error = io::Error>,
{
    type Error = io::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<R>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let answer = matches!(
            item,
            rmcp::model::JsonRpcMessage::Response(_) | rmcp::model::JsonRpcMessage::Error(_)
        );
        let waiting = Waiting::new(&self.outbound, answer);
        let send = match self.outbound.failure() {
            None => Ok(self.inner.send(item)),
            Some(_) => Err(self.outbound.error()),
        };
        async move {
            let _waiting = waiting;
            send?.await
        }
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<R>> {
        let outbound = &self.outbound;
        loop {
            let done = outbound.done.notified();
            if outbound.given_up.is_cancelled() {
                return None;
            }
            if outbound.waiting.load(Ordering::SeqCst) < outbound.max_waiting {
                break;
            }
            tokio::select! {
                () = outbound.given_up.cancelled() => return None,
                () = done => {}
            }
        }
        tokio::select! {
            biased;
            () = outbound.given_up.cancelled() => None,
            message = self.inner.receive() => message,
        }
    }

    fn close(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.inner.close()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

    use super::*;
    use rmcp::transport::async_rw::AsyncRwTransport;
    use rmcp::{RoleClient, ServiceExt};
    use serde_json::{Value, json};
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    use tokio::net::unix::pipe;

    #[tokio::test]
    async fn a_write_nobody_reads_fails_after_the_stall_limit_and_gives_the_server_up() {
        let sandbox = Cancel::new();
        let outbound =
            Outbound::with_limits("deaf".into(), sandbox.clone(), Duration::from_secs(1), 8);
        let (sender, _receiver) = pipe::pipe().unwrap();
        let mut writer = outbound.writer(sender);
        let chunk = vec![b'x'; 4096];
        // A write that makes no progress while none of the server's questions waits for
        // its answer is a busy server: not given up.
        let filled = loop {
            match tokio::time::timeout(Duration::from_millis(2500), writer.write_all(&chunk)).await
            {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => panic!("a busy server was given up: {e}"),
                Err(_) => break true,
            }
        };
        assert!(filled && outbound.failure().is_none() && !sandbox.is_cancelled());
        // With an answer of ours waiting, the same stall (running since the pipe filled)
        // gives it up, at the latest one stall limit later.
        let _answer = Waiting::new(&outbound, true);
        let error = loop {
            match tokio::time::timeout(Duration::from_secs(10), writer.write_all(&chunk)).await {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => break e,
                Err(_) => panic!("a write to a full pipe did not fail within 10 s"),
            }
        };
        assert!(
            error
                .to_string()
                .contains("the MCP server deaf stopped reading its stdin for 1 s"),
            "{error}"
        );
        assert!(outbound.failure().is_some());
        assert!(sandbox.is_cancelled(), "the server's sandbox is killed");
        // Every later write fails at once.
        assert!(writer.write_all(b"more").await.is_err());
    }

    #[tokio::test]
    async fn a_slow_reader_that_keeps_reading_is_not_given_up() {
        let sandbox = Cancel::new();
        let outbound = Outbound::with_limits(
            "slow".into(),
            sandbox.clone(),
            Duration::from_millis(500),
            8,
        );
        let (sender, mut receiver) = pipe::pipe().unwrap();
        let mut writer = outbound.writer(sender);
        let reader = tokio::spawn(async move {
            let mut buf = vec![0; 16 << 10];
            let mut total = 0;
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                match receiver.read(&mut buf).await {
                    Ok(0) | Err(_) => return total,
                    Ok(n) => total += n,
                }
            }
        });
        // Far more than the pipe holds, written over several stall limits.
        let data = vec![b'y'; 256 << 10];
        writer.write_all(&data).await.unwrap();
        drop(writer);
        assert_eq!(reader.await.unwrap(), data.len());
        assert!(outbound.failure().is_none());
        assert!(!sandbox.is_cancelled());
    }

    /// A server that answers `initialize`, then never reads its stdin again and sends
    /// `ping` after `ping`: the session stops reading from it once the answers queue
    /// up (so what it gets to send stays bounded), then gives it up at the stall limit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_flooding_requests_without_reading_is_held_back_then_given_up() {
        let sandbox = Cancel::new();
        let outbound =
            Outbound::with_limits("deaf".into(), sandbox.clone(), Duration::from_secs(2), 16);
        let (to_server, server_stdin) = pipe::pipe().unwrap();
        let (mut server_stdout, from_server) = pipe::pipe().unwrap();
        let sent = Arc::new(AtomicUsize::new(0));
        let counter = sent.clone();
        let server = tokio::spawn(async move {
            let mut stdin = tokio::io::BufReader::new(server_stdin);
            let mut line = String::new();
            stdin.read_line(&mut line).await.unwrap();
            let request: Value = serde_json::from_str(&line).unwrap();
            let answer = json!({"jsonrpc": "2.0", "id": request["id"], "result": {
                "protocolVersion": request["params"]["protocolVersion"],
                "capabilities": {},
                "serverInfo": {"name": "deaf", "version": "1"}}});
            server_stdout
                .write_all(format!("{answer}\n").as_bytes())
                .await
                .unwrap();
            for id in 1u64.. {
                let ping = format!("{{\"jsonrpc\":\"2.0\",\"id\":{id},\"method\":\"ping\"}}\n");
                if server_stdout.write_all(ping.as_bytes()).await.is_err() {
                    break;
                }
                counter.fetch_add(1, Ordering::SeqCst);
            }
            // Held, unread, until the flood ends.
            drop(stdin);
        });
        let transport = outbound.transport(AsyncRwTransport::<RoleClient, _, _>::new(
            from_server,
            outbound.writer(to_server),
        ));
        let service = ().serve(transport).await.unwrap();
        tokio::time::timeout(Duration::from_secs(30), service.waiting())
            .await
            .expect("the session with a server that does not read its stdin did not end")
            .unwrap();
        let failure = outbound.failure().expect("the server was given up");
        assert!(
            failure.contains("the MCP server deaf stopped reading its stdin for 2 s"),
            "{failure}"
        );
        assert!(sandbox.is_cancelled(), "the server's sandbox is killed");
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the flood ends once the session is gone")
            .unwrap();
        // What fits in the two pipes, the reader's buffer and the bounded queue: a few
        // thousand pings of 40 bytes. Unbounded, two seconds of flooding are hundreds of
        // thousands.
        let pings = sent.load(Ordering::SeqCst);
        assert!(pings < 10_000, "the server got to send {pings} pings");
    }
}
