//! The batch span processor: ended spans wait in a bounded queue, and one thread, at a
//! lower priority than the threads that serve calls, exports them in whole batches.
//!
//! Airlock's own rather than the SDK's `BatchSpanProcessor`, for what that one cost a
//! traced call (docs/decisions.md, "Traces"): its thread handed every batch to the
//! exporter's runtime and waited for the answer (two threads woken per export); and when
//! a full batch was signalled, it exported the spans that had arrived since in a second,
//! small request — half of its exports were a tenth of a batch, each paying a whole
//! request's fixed cost. Here the thread that waits for a batch is the one that sends it,
//! on a current-thread runtime of its own, and a batch leaves when it is full, when the
//! schedule delay has passed since the last export, or when asked (flush, shutdown).
//!
//! The standard `OTEL_BSP_*` variables keep their meaning: `OTEL_BSP_MAX_QUEUE_SIZE`
//! spans may wait (more are dropped, never waited for: a call does not slow down
//! because the collector does), `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` go in one request,
//! `OTEL_BSP_SCHEDULE_DELAY` is the longest a span waits for a batch to fill, and
//! `OTEL_BSP_EXPORT_TIMEOUT` bounds an export.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::SpanData;

use crate::TelemetryError;

/// Spans per export unless `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` says otherwise (the
/// specification's default is 512). Each batch is handed to the exporter as a vector of
/// `SpanData` allocated afresh; at 512 that vector was over 128 KiB, a buffer the
/// orchestrator's allocator maps on its own and unmaps when freed
/// (crates/sandbox/src/heap.rs), so every export took page faults for a fresh mapping
/// (about 0.8 more a call than untraced). At 256 the vector comes from the heap.
pub(crate) const EXPORT_BATCH_SPANS: usize = 256;

/// The niceness of the export thread: spans yield the CPU to calls.
const EXPORT_NICENESS: i32 = 10;

/// The `OTEL_BSP_*` settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    /// `OTEL_BSP_MAX_QUEUE_SIZE` (2 048): spans waiting at most.
    pub max_queue: usize,
    /// `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` ([`EXPORT_BATCH_SPANS`]), at most `max_queue`.
    pub max_batch: usize,
    /// `OTEL_BSP_SCHEDULE_DELAY` (5 000 ms): the longest a span waits for its batch.
    pub delay: Duration,
    /// `OTEL_BSP_EXPORT_TIMEOUT` (30 000 ms): the longest one export may take.
    pub timeout: Duration,
}

impl BatchSettings {
    /// From the variables `var` looks up; a value that is not a positive whole number
    /// stops the start, naming the variable (rather than batching differently).
    pub(crate) fn from_lookup(
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, TelemetryError> {
        let number = |variable: &'static str, default: u64| -> Result<u64, TelemetryError> {
            let Some(value) = var(variable).filter(|v| !v.trim().is_empty()) else {
                return Ok(default);
            };
            match value.trim().parse::<u64>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(TelemetryError::Variable {
                    variable,
                    value,
                    reason: "must be a whole number above 0".to_owned(),
                }),
            }
        };
        let size = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
        let max_queue = size(number("OTEL_BSP_MAX_QUEUE_SIZE", 2_048)?);
        let max_batch = size(number(
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
            EXPORT_BATCH_SPANS as u64,
        )?);
        Ok(Self {
            max_queue,
            // The specification: a batch larger than the queue is the queue.
            max_batch: max_batch.min(max_queue),
            delay: Duration::from_millis(number("OTEL_BSP_SCHEDULE_DELAY", 5_000)?),
            timeout: Duration::from_millis(number("OTEL_BSP_EXPORT_TIMEOUT", 30_000)?),
        })
    }
}

/// The queue and the thread that empties it.
#[derive(Debug)]
pub(crate) struct Batcher {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Debug)]
struct Shared {
    settings: BatchSettings,
    queue: Mutex<Queue>,
    /// Wakes the export thread: a batch is full, or a flush or the shutdown is asked.
    wake: Condvar,
    /// Wakes those waiting for a flush or the shutdown to be done.
    done: Condvar,
}

#[derive(Debug, Default)]
struct Queue {
    spans: Vec<SpanData>,
    /// Spans dropped because the queue was full (the first one is logged).
    dropped: u64,
    /// Flushes asked for, and how many of them the thread has done: a flush is done
    /// once every span queued before it has been exported.
    flushes_asked: u64,
    flushes_done: u64,
    shutdown: bool,
    stopped: bool,
}

impl Batcher {
    /// Starts the export thread; `exporter` runs on `runtime` (current-thread, driven by
    /// that thread alone while it exports).
    pub(crate) fn start<E>(
        exporter: E,
        runtime: tokio::runtime::Runtime,
        settings: BatchSettings,
    ) -> Result<Self, TelemetryError>
    where
        E: Export + Send + 'static,
    {
        let shared = Arc::new(Shared {
            settings,
            queue: Mutex::new(Queue {
                spans: Vec::with_capacity(settings.max_batch),
                ..Queue::default()
            }),
            wake: Condvar::new(),
            done: Condvar::new(),
        });
        let thread = std::thread::Builder::new()
            .name("airlock-otlp".to_owned())
            .spawn({
                let shared = shared.clone();
                move || {
                    // On Linux a nice value belongs to a thread: `who` = 0 is the calling
                    // thread, not the whole process. Failing to lower it costs calls some
                    // latency, never correctness, so it is not an error.
                    let _ = rustix::process::setpriority_process(None, EXPORT_NICENESS);
                    let mut exporter = exporter;
                    export_loop(&shared, &mut exporter, &runtime);
                    shared.lock().stopped = true;
                    shared.done.notify_all();
                    // The runtime is dropped here, on this thread, outside any runtime.
                }
            })
            .map_err(|e| {
                TelemetryError::Exporter(format!("cannot start the export thread: {e}"))
            })?;
        Ok(Self {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues an ended span; never blocks on the exporter. A span not sampled is not
    /// exported (the SDK calls every processor for every span that records).
    pub(crate) fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        let settings = &self.shared.settings;
        let mut queue = self.shared.lock();
        if queue.shutdown || queue.spans.len() >= settings.max_queue {
            queue.dropped += 1;
            let first = queue.dropped == 1 && !queue.shutdown;
            drop(queue);
            if first {
                tracing::warn!(
                    max_queue = settings.max_queue,
                    "spans are being dropped: the trace exporter cannot keep up (raise OTEL_BSP_MAX_QUEUE_SIZE or check the collector)"
                );
            }
            return;
        }
        queue.spans.push(span);
        // Only the span that fills a batch wakes the thread; the others wait for it or
        // for the schedule delay, which the thread keeps itself.
        let full = queue.spans.len() == settings.max_batch;
        drop(queue);
        if full {
            self.shared.wake.notify_one();
        }
    }

    /// Exports every span queued so far; waits at most `timeout`.
    pub(crate) fn flush(&self, timeout: Duration) -> OTelSdkResult {
        let mut queue = self.shared.lock();
        queue.flushes_asked += 1;
        let asked = queue.flushes_asked;
        self.shared.wake.notify_one();
        let deadline = Instant::now() + timeout;
        while queue.flushes_done < asked && !queue.stopped {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Err(OTelSdkError::Timeout(timeout));
            };
            queue = self.shared.wait(&self.shared.done, queue, left);
        }
        Ok(())
    }

    /// [`Batcher::flush`] bounded by `OTEL_BSP_EXPORT_TIMEOUT`, as one export is: what a
    /// flush waits for is the export thread's next export.
    pub(crate) fn force_flush(&self) -> OTelSdkResult {
        self.flush(self.shared.settings.timeout)
    }

    /// Exports what is left and stops the thread; waits at most `timeout`.
    pub(crate) fn shutdown(&self, timeout: Duration) -> OTelSdkResult {
        let mut queue = self.shared.lock();
        if queue.shutdown {
            return Err(OTelSdkError::AlreadyShutdown);
        }
        queue.shutdown = true;
        self.shared.wake.notify_one();
        let deadline = Instant::now() + timeout;
        while !queue.stopped {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                // The thread is left to finish its export; the process is ending.
                return Err(OTelSdkError::Timeout(timeout));
            };
            queue = self.shared.wait(&self.shared.done, queue, left);
        }
        drop(queue);
        let thread = match self.thread.lock() {
            Ok(mut t) => t.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(thread) = thread
            && thread.join().is_err()
        {
            return Err(OTelSdkError::InternalFailure(
                "the export thread panicked".to_owned(),
            ));
        }
        Ok(())
    }
}

impl Shared {
    /// The queue, also after a panic elsewhere while it was held (it holds plain data).
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn wait<'a>(
        &self,
        condvar: &Condvar,
        queue: MutexGuard<'a, Queue>,
        timeout: Duration,
    ) -> MutexGuard<'a, Queue> {
        match condvar.wait_timeout(queue, timeout) {
            Ok((queue, _)) => queue,
            Err(poisoned) => poisoned.into_inner().0,
        }
    }
}

/// What exports a batch. The batch is lent, not given: the exporter empties it and the
/// export thread fills the same vector again, so that no batch-sized buffer is allocated
/// and freed per export (a free of that size makes glibc consolidate and trim the heap,
/// and a trim is an IPI to every CPU the process runs on).
pub(crate) trait Export {
    /// Sends the spans in `batch` and leaves it empty.
    fn export(&self, batch: &mut Vec<SpanData>) -> impl Future<Output = OTelSdkResult>;
    fn shutdown(&mut self) -> OTelSdkResult;
}

/// What the thread does, until the shutdown: wait for a reason to export, take the
/// spans out of the queue (never holding the lock while exporting), export them in
/// batches of at most `max_batch`.
fn export_loop<E: Export>(shared: &Shared, exporter: &mut E, runtime: &tokio::runtime::Runtime) {
    let settings = shared.settings;
    let mut last_export = Instant::now();
    let mut failing = false;
    let mut batch: Vec<SpanData> = Vec::with_capacity(settings.max_batch);
    loop {
        // An exporter that kept the vector leaves an empty one: its capacity comes
        // before the lock is taken.
        batch.reserve(settings.max_batch);
        let mut queue = shared.lock();
        loop {
            let asked = queue.shutdown || queue.flushes_done < queue.flushes_asked;
            let due = last_export + settings.delay;
            let now = Instant::now();
            if asked || queue.spans.len() >= settings.max_batch || now >= due {
                break;
            }
            queue = shared.wait(&shared.wake, queue, due - now);
        }
        let everything = queue.shutdown || queue.flushes_done < queue.flushes_asked;
        let flushes_asked = queue.flushes_asked;
        let shutdown = queue.shutdown;
        // A full batch leaves alone, and what came after it waits for the next one. At
        // the delay everything leaves, which is at most a batch; asked (a flush, the
        // shutdown), everything leaves too, in as many batches as it takes.
        let mut rest = Vec::new();
        if queue.spans.len() <= settings.max_batch {
            std::mem::swap(&mut queue.spans, &mut batch);
        } else if !everything {
            batch.extend(queue.spans.drain(..settings.max_batch));
        } else {
            rest = std::mem::take(&mut queue.spans);
            queue.spans.reserve(settings.max_batch);
        }
        drop(queue);
        last_export = Instant::now();
        loop {
            if batch.is_empty() {
                if rest.is_empty() {
                    break;
                }
                batch.extend(rest.drain(..rest.len().min(settings.max_batch)));
            }
            let result = runtime.block_on(async {
                match tokio::time::timeout(settings.timeout, exporter.export(&mut batch)).await {
                    Ok(result) => result,
                    Err(_) => Err(OTelSdkError::Timeout(settings.timeout)),
                }
            });
            // Whatever the exporter did, these spans are done with (sent or dropped).
            batch.clear();
            // One line when exports start failing and one when they recover, not one
            // per batch: a collector that is down must not flood the log.
            match result {
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "cannot export spans; dropping them until the collector answers");
                }
                Ok(()) if failing => {
                    failing = false;
                    tracing::info!("spans are exported again");
                }
                _ => {}
            }
        }
        if everything {
            shared.lock().flushes_done = flushes_asked;
            shared.done.notify_all();
        }
        if shutdown {
            let _entered = runtime.enter();
            if let Err(e) = exporter.shutdown() {
                tracing::debug!(error = %e, "the exporter's shutdown");
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId};
    use opentelemetry::{InstrumentationScope, trace::TraceState};
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use std::collections::HashMap;
    use std::time::SystemTime;

    /// Records the size of each batch; `gate` (when set) holds every export until it
    /// is opened.
    #[derive(Debug, Clone, Default)]
    struct Recorder {
        batches: Arc<Mutex<Vec<usize>>>,
        gate: Option<Arc<tokio::sync::Semaphore>>,
    }

    impl Export for Recorder {
        async fn export(&self, batch: &mut Vec<SpanData>) -> OTelSdkResult {
            if let Some(gate) = &self.gate {
                let _ = gate.acquire().await;
            }
            self.batches.lock().unwrap().push(batch.len());
            batch.clear();
            Ok(())
        }

        fn shutdown(&mut self) -> OTelSdkResult {
            Ok(())
        }
    }

    impl Recorder {
        /// A recorder whose exports wait until the returned gate gets permits.
        fn held() -> (Self, Arc<tokio::sync::Semaphore>) {
            let gate = Arc::new(tokio::sync::Semaphore::new(0));
            let recorder = Self {
                gate: Some(gate.clone()),
                ..Self::default()
            };
            (recorder, gate)
        }

        fn batches(&self) -> Vec<usize> {
            self.batches.lock().unwrap().clone()
        }

        /// The batches once they hold `spans` spans in all (or after 10 s).
        fn wait_for(&self, spans: usize) -> Vec<usize> {
            let deadline = Instant::now() + Duration::from_secs(10);
            while self.batches().iter().sum::<usize>() < spans && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            self.batches()
        }
    }

    fn span(sampled: bool) -> SpanData {
        let flags = if sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        SpanData {
            span_context: SpanContext::new(
                TraceId::from(7),
                SpanId::from(9),
                flags,
                false,
                TraceState::default(),
            ),
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: "gate.policy".into(),
            start_time: SystemTime::now(),
            end_time: SystemTime::now(),
            attributes: Vec::new(),
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: InstrumentationScope::builder("airlock").build(),
        }
    }

    fn settings(max_queue: usize, max_batch: usize, delay: Duration) -> BatchSettings {
        BatchSettings {
            max_queue,
            max_batch,
            delay,
            timeout: Duration::from_secs(10),
        }
    }

    /// A batcher exporting to `recorder` on a runtime of its own.
    fn started(recorder: &Recorder, settings: BatchSettings) -> Batcher {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        Batcher::start(recorder.clone(), runtime, settings).unwrap()
    }

    /// A batch's vector stays under the size from which the orchestrator's allocator maps
    /// a buffer on its own (glibc's initial mmap threshold, which the orchestrator fixes:
    /// crates/sandbox/src/heap.rs); the specification's 512 spans would not.
    #[test]
    fn a_batch_of_spans_is_served_from_the_heap() {
        const MMAP_THRESHOLD_BYTES: usize = 128 * 1024;
        let span = std::mem::size_of::<SpanData>();
        assert!(
            EXPORT_BATCH_SPANS * span < MMAP_THRESHOLD_BYTES,
            "{EXPORT_BATCH_SPANS} spans of {span} bytes"
        );
        assert!(
            512 * span >= MMAP_THRESHOLD_BYTES,
            "the default batch of 512 spans of {span} bytes fits under the threshold: the \
             default of Airlock's own is no longer needed"
        );
    }

    /// Ten spans with batches of four and a long delay: two full batches leave on their
    /// own, and nothing else until a flush sends the last two. No small batch follows a
    /// full one.
    #[test]
    fn full_batches_leave_whole_and_the_rest_waits() {
        let recorder = Recorder::default();
        let batcher = started(&recorder, settings(64, 4, Duration::from_secs(600)));
        for _ in 0..10 {
            batcher.on_end(span(true));
        }
        assert_eq!(recorder.wait_for(8), [4, 4]);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            recorder.batches(),
            [4, 4],
            "the last two wait for their batch"
        );
        batcher.flush(Duration::from_secs(10)).unwrap();
        assert_eq!(recorder.batches(), [4, 4, 2]);
        batcher.shutdown(Duration::from_secs(10)).unwrap();
    }

    /// A batch that does not fill leaves after the schedule delay.
    #[test]
    fn a_partial_batch_leaves_after_the_delay() {
        let recorder = Recorder::default();
        let batcher = started(&recorder, settings(64, 16, Duration::from_millis(50)));
        for _ in 0..3 {
            batcher.on_end(span(true));
        }
        assert_eq!(recorder.wait_for(3), [3]);
        batcher.shutdown(Duration::from_secs(10)).unwrap();
    }

    /// An exporter that does not answer never holds a call up: spans beyond the queue
    /// are dropped, and what is kept is bounded by the queue and the batch in flight.
    #[test]
    fn a_full_queue_drops_spans_rather_than_waiting() {
        let (recorder, gate) = Recorder::held();
        let batcher = started(&recorder, settings(8, 4, Duration::from_secs(600)));
        // The exporter is held until the permits below: had `on_end` waited for it,
        // this loop would never end.
        for _ in 0..1_000 {
            batcher.on_end(span(true));
        }
        let dropped = batcher.shared.lock().dropped;
        // At most one batch taken by the stuck export plus a full queue are kept.
        assert!(dropped >= 1_000 - 4 - 8, "{dropped} dropped");
        gate.add_permits(1_000);
        batcher.flush(Duration::from_secs(10)).unwrap();
        let exported: usize = recorder.batches().iter().sum();
        assert_eq!(exported as u64 + dropped, 1_000);
        assert!(recorder.batches().iter().all(|&b| b <= 4));
        batcher.shutdown(Duration::from_secs(10)).unwrap();
    }

    /// A flush asked of the processor waits at most `OTEL_BSP_EXPORT_TIMEOUT` for an
    /// export that does not end, then says it timed out; the spans are still exported
    /// once the exporter answers.
    #[test]
    fn a_forced_flush_waits_the_export_timeout() {
        let (recorder, gate) = Recorder::held();
        let timeout = Duration::from_millis(100);
        let batcher = started(
            &recorder,
            settings(64, 16, Duration::from_secs(600)).with_timeout(timeout),
        );
        batcher.on_end(span(true));
        assert!(
            matches!(batcher.force_flush(), Err(OTelSdkError::Timeout(t)) if t == timeout),
            "the flush was not bounded by the export timeout"
        );
        gate.add_permits(1);
        assert_eq!(recorder.wait_for(1), [1]);
        batcher.shutdown(Duration::from_secs(10)).unwrap();
    }

    /// The shutdown exports what is left, stops the thread, and spans after it are
    /// dropped; a second shutdown says so.
    #[test]
    fn the_shutdown_exports_what_is_left() {
        let recorder = Recorder::default();
        let batcher = started(&recorder, settings(64, 16, Duration::from_secs(600)));
        for _ in 0..3 {
            batcher.on_end(span(true));
        }
        batcher.on_end(span(false));
        batcher.shutdown(Duration::from_secs(10)).unwrap();
        assert_eq!(
            recorder.batches(),
            [3],
            "the unsampled span is not exported"
        );
        batcher.on_end(span(true));
        assert_eq!(recorder.batches(), [3]);
        assert!(matches!(
            batcher.shutdown(Duration::from_secs(1)),
            Err(OTelSdkError::AlreadyShutdown)
        ));
        assert!(
            batcher.thread.lock().unwrap().is_none(),
            "the thread was joined"
        );
    }

    /// The standard variables, their defaults, and values that stop the start.
    #[test]
    fn batch_settings_come_from_the_standard_variables() {
        let lookup = |vars: &[(&str, &str)]| {
            let vars: HashMap<String, String> = vars
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            BatchSettings::from_lookup(|name| vars.get(name).cloned())
        };
        assert_eq!(
            lookup(&[]).unwrap(),
            settings(2_048, EXPORT_BATCH_SPANS, Duration::from_secs(5))
                .with_timeout(Duration::from_secs(30))
        );
        let set = lookup(&[
            ("OTEL_BSP_MAX_QUEUE_SIZE", "100"),
            ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "512"),
            ("OTEL_BSP_SCHEDULE_DELAY", " 250 "),
            ("OTEL_BSP_EXPORT_TIMEOUT", "2000"),
        ])
        .unwrap();
        assert_eq!(
            set,
            settings(100, 100, Duration::from_millis(250)).with_timeout(Duration::from_secs(2)),
            "a batch is at most the queue"
        );
        for (variable, value) in [
            ("OTEL_BSP_SCHEDULE_DELAY", "0"),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "-1"),
            ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "1e3"),
            ("OTEL_BSP_EXPORT_TIMEOUT", "5s"),
        ] {
            let e = lookup(&[(variable, value)]).unwrap_err().to_string();
            assert!(e.starts_with(&format!("{variable}=\"{value}\"")), "{e}");
        }
    }

    impl BatchSettings {
        fn with_timeout(mut self, timeout: Duration) -> Self {
            self.timeout = timeout;
            self
        }
    }
}
