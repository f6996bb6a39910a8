//! The worker runtime over a real Unix socket: deadlines, cancellation, drain.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed expectation is a failed test"
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use airlock_proto::v1 as pb;
use airlock_proto::v1::tool_worker_client::ToolWorkerClient;
use airlock_worker::{
    BoundListener, CallContext, ListenAddr, Tool, ToolAnnotations, ToolDefinition, ToolOutcome,
    ToolSet, WorkerServer, WorkerSettings,
};
use tokio::sync::oneshot;
use tonic::transport::{Channel, Endpoint, Uri};

/// Sleeps for `millis`, reporting progress, unless cancelled first. With `until` (a
/// file path) it runs until that file exists instead: the test decides when it ends.
struct Sleeper {
    cancelled: Arc<AtomicBool>,
    finished: Arc<AtomicUsize>,
}

#[airlock_worker::async_trait]
impl Tool for Sleeper {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition {
            name: "sleep".into(),
            title: "Sleep".into(),
            description: "Sleeps".into(),
            input_schema: serde_json::json!({"type": "object"}),
            annotations: ToolAnnotations {
                read_only: true,
                ..Default::default()
            },
        }
    }

    async fn execute(&self, arguments: serde_json::Value, ctx: CallContext) -> ToolOutcome {
        let millis = arguments["millis"].as_u64().unwrap_or(0);
        let until = arguments["until"].as_str().map(std::path::PathBuf::from);
        ctx.progress(0.0, Some(1.0), "starting");
        let released = async {
            match &until {
                // A bounded wait on the file; the 10 ms pause only paces the poll.
                Some(file) => {
                    for _ in 0..6000 {
                        if file.exists() {
                            return true;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    false
                }
                None => {
                    tokio::time::sleep(Duration::from_millis(millis)).await;
                    true
                }
            }
        };
        tokio::select! {
            released = released => {
                self.finished.fetch_add(1, Ordering::SeqCst);
                match until {
                    Some(_) if released => ToolOutcome::text("released"),
                    Some(_) => ToolOutcome::error("never released"),
                    None => ToolOutcome::text(format!("slept {millis} ms")),
                }
            }
            _ = ctx.cancel.cancelled() => {
                self.cancelled.store(true, Ordering::SeqCst);
                ToolOutcome::error("cancelled")
            }
        }
    }
}

struct Harness {
    _dir: tempfile::TempDir,
    socket: std::path::PathBuf,
    cancelled: Arc<AtomicBool>,
    finished: Arc<AtomicUsize>,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

async fn start(settings: WorkerSettings) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("w.sock");
    let cancelled = Arc::new(AtomicBool::new(false));
    let finished = Arc::new(AtomicUsize::new(0));
    let tools = ToolSet::new("test").with(Sleeper {
        cancelled: cancelled.clone(),
        finished: finished.clone(),
    });
    let listener = BoundListener::bind(&ListenAddr::Unix(socket.clone())).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        WorkerServer::new(tools, settings)
            .serve(listener, async move {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    Harness {
        _dir: dir,
        socket,
        cancelled,
        finished,
        stop: Some(stop),
        server,
    }
}

async fn client(socket: &std::path::Path) -> ToolWorkerClient<Channel> {
    ToolWorkerClient::new(client_channel(socket).await)
}

fn request(millis: u64, timeout_ms: u64) -> pb::ExecuteRequest {
    pb::ExecuteRequest {
        call_id: "c1".into(),
        tool: "sleep".into(),
        arguments_json: format!("{{\"millis\": {millis}}}"),
        principal: "tester".into(),
        session_id: "s1".into(),
        timeout_ms,
        trace_context: Default::default(),
        detached: false,
    }
}

async fn result_of(
    client: &mut ToolWorkerClient<Channel>,
    req: pb::ExecuteRequest,
) -> Result<pb::ToolResult, tonic::Status> {
    let stream = client.execute(req).await?.into_inner();
    result_from(stream).await
}

/// The result at the end of a call's event stream.
async fn result_from(
    mut stream: tonic::Streaming<pb::ExecuteEvent>,
) -> Result<pb::ToolResult, tonic::Status> {
    while let Some(event) = stream.message().await? {
        if let Some(pb::execute_event::Event::Result(r)) = event.event {
            return Ok(r);
        }
    }
    Err(tonic::Status::unknown("no result"))
}

/// Starts a call and returns its event stream once the tool runs: its first event, the
/// tool's "starting" progress, has arrived (within a generous bound).
async fn running(
    client: &mut ToolWorkerClient<Channel>,
    req: pb::ExecuteRequest,
) -> tonic::Streaming<pb::ExecuteEvent> {
    let mut stream = client.execute(req).await.unwrap().into_inner();
    let first = tokio::time::timeout(Duration::from_secs(20), stream.message())
        .await
        .expect("the tool never started")
        .unwrap()
        .expect("the stream ended before the tool started");
    match first.event {
        Some(pb::execute_event::Event::Progress(p)) => assert_eq!(p.message, "starting"),
        other => panic!("the first event is not the tool's progress: {other:?}"),
    }
    stream
}

/// A request for a call that runs until the file `until` exists.
fn held_request(call_id: &str, until: &std::path::Path) -> pb::ExecuteRequest {
    pb::ExecuteRequest {
        call_id: call_id.into(),
        arguments_json: serde_json::json!({ "until": until }).to_string(),
        ..request(0, 0)
    }
}

/// Polls `done` until it holds, within a generous bound (the pause only paces the poll).
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_call_streams_progress_then_one_result() {
    let h = start(WorkerSettings::default()).await;
    let mut c = client(&h.socket).await;
    let mut stream = c.execute(request(10, 0)).await.unwrap().into_inner();
    let mut kinds = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        kinds.push(match event.event.unwrap() {
            pb::execute_event::Event::Progress(_) => "progress",
            pb::execute_event::Event::Output(_) => "output",
            pb::execute_event::Event::Result(r) => {
                assert_eq!(r.content, vec!["slept 10 ms".to_owned()]);
                "result"
            }
        });
    }
    assert_eq!(kinds, vec!["progress", "result"]);
}

#[tokio::test]
async fn the_workers_own_timer_answers_deadline_exceeded() {
    let h = start(WorkerSettings::default()).await;
    let mut c = client(&h.socket).await;
    // The tool would sleep 30 s; the 200 ms deadline answers first and stops it.
    let err = result_of(&mut c, request(30_000, 200)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err}");
    // The tool saw the cancellation, and never finished its sleep.
    wait_until("the tool never saw the cancellation", || {
        h.cancelled.load(Ordering::SeqCst)
    })
    .await;
    assert_eq!(h.finished.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn the_configured_maximum_caps_a_requested_deadline() {
    let settings = WorkerSettings {
        max_timeout: Duration::from_millis(200),
        ..WorkerSettings::default()
    };
    let h = start(settings).await;
    let mut c = client(&h.socket).await;
    let err = result_of(&mut c, request(30_000, 60_000))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded);
}

#[tokio::test]
async fn a_caller_that_goes_away_cancels_the_call() {
    let h = start(WorkerSettings::default()).await;
    let mut c = client(&h.socket).await;
    let stream = running(&mut c, request(30_000, 0)).await;
    drop(stream);
    drop(c);
    wait_until("the tool never saw the cancellation", || {
        h.cancelled.load(Ordering::SeqCst)
    })
    .await;
    assert_eq!(h.finished.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn shutdown_drains_in_flight_calls_and_refuses_new_ones() {
    let h = start(WorkerSettings::default()).await;
    let mut c = client(&h.socket).await;
    // The in-flight call runs until the test releases it, so the drain is observed
    // while it is certainly still running.
    let release = h.socket.with_file_name("release");
    let stream = running(&mut c, held_request("in-flight", &release)).await;
    let in_flight = tokio::spawn(result_from(stream));
    let mut h = h;
    h.stop.take().unwrap().send(()).unwrap();
    // A new call is refused while the old call runs: probe until the drain has begun
    // (a probe accepted before it began runs to its end like any call).
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut accepted = 0;
    loop {
        let refused = match tokio::net::UnixStream::connect(&h.socket).await {
            Err(e) => Some(format!("connect: {e}")),
            Ok(_) => {
                let mut probe = request(1, 0);
                probe.call_id = format!("probe-{accepted}");
                match tokio::time::timeout(Duration::from_secs(5), result_of(&mut c, probe)).await {
                    Err(_) => Some("a call never answered".to_owned()),
                    Ok(Err(status)) => Some(format!("a call: {status}")),
                    Ok(Ok(_)) => None,
                }
            }
        };
        if let Some(how) = refused {
            eprintln!("refused ({how}) after {accepted} accepted probe call(s)");
            break;
        }
        accepted += 1;
        assert!(Instant::now() < deadline, "new calls were still accepted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Nor does the connection the in-flight call uses take a new call.
    let mut late = request(1, 0);
    late.call_id = "late".into();
    let late = tokio::time::timeout(Duration::from_secs(5), result_of(&mut c, late)).await;
    assert!(
        !matches!(late, Ok(Ok(_))),
        "a new call ran during the drain"
    );
    assert!(!in_flight.is_finished(), "the in-flight call ended early");
    assert_eq!(
        h.finished.load(Ordering::SeqCst),
        accepted,
        "only the accepted probes finished"
    );
    std::fs::write(&release, "").unwrap();
    let result = tokio::time::timeout(Duration::from_secs(20), in_flight)
        .await
        .expect("the in-flight call finished")
        .unwrap()
        .expect("the in-flight call succeeded");
    assert_eq!(result.content, vec!["released".to_owned()]);
    assert!(
        !h.cancelled.load(Ordering::SeqCst),
        "the drain cancelled nothing"
    );
    tokio::time::timeout(Duration::from_secs(20), h.server)
        .await
        .expect("server stopped")
        .unwrap();
}

#[tokio::test]
async fn drain_grace_cancels_calls_that_run_too_long() {
    let settings = WorkerSettings {
        drain_grace: Duration::from_millis(200),
        ..WorkerSettings::default()
    };
    let mut h = start(settings).await;
    let mut c = client(&h.socket).await;
    let stream = running(&mut c, request(60_000, 0)).await;
    let in_flight = tokio::spawn(result_from(stream));
    h.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), h.server)
        .await
        .expect("server stopped after grace")
        .unwrap();
    assert!(
        h.cancelled.load(Ordering::SeqCst),
        "the long call was cancelled"
    );
    assert_eq!(h.finished.load(Ordering::SeqCst), 0);
    let _ = in_flight.await;
}

#[tokio::test]
async fn unknown_tools_and_bad_requests_are_refused() {
    let h = start(WorkerSettings::default()).await;
    let mut c = client(&h.socket).await;
    let mut bad = request(1, 0);
    bad.tool = "nope".into();
    assert_eq!(
        c.execute(bad).await.unwrap_err().code(),
        tonic::Code::NotFound
    );
    let mut bad = request(1, 0);
    bad.arguments_json = "[1]".into();
    assert_eq!(
        c.execute(bad).await.unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    let mut bad = request(1, 0);
    bad.principal = "../root".into();
    assert_eq!(
        c.execute(bad).await.unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    let listed = c
        .list_tools(pb::ListToolsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.group, "test");
    assert_eq!(listed.tools[0].name, "sleep");
}

#[tokio::test]
async fn a_repeated_call_id_joins_the_original_run() {
    let h = start(WorkerSettings::default()).await;
    let mut c = client(&h.socket).await;
    let mut first = request(300, 0);
    first.call_id = "same".into();
    first.detached = true;
    let mut second = first.clone();
    second.arguments_json = "{\"millis\": 1}".into();
    // The first run is under way before the second request arrives.
    let a = tokio::spawn(result_from(running(&mut c, first).await));
    let b = result_of(&mut c, second).await.unwrap();
    assert_eq!(
        b.content,
        vec!["slept 300 ms".to_owned()],
        "the second request got the first run's answer"
    );
    assert_eq!(a.await.unwrap().unwrap().content, b.content);
    assert_eq!(h.finished.load(Ordering::SeqCst), 1, "the tool ran once");
}

#[tokio::test]
async fn a_detached_call_survives_its_caller_and_can_be_fetched_again() {
    let h = start(WorkerSettings::default()).await;
    let mut c = client(&h.socket).await;
    let mut req = request(400, 0);
    req.call_id = "durable".into();
    req.detached = true;
    let stream = running(&mut c, req.clone()).await;
    drop(stream);
    drop(c);
    let mut c = client(&h.socket).await;
    let result = result_of(&mut c, req).await.unwrap();
    assert_eq!(result.content, vec!["slept 400 ms".to_owned()]);
    assert!(
        !h.cancelled.load(Ordering::SeqCst),
        "a detached call is not cancelled by a disconnect"
    );
    assert_eq!(h.finished.load(Ordering::SeqCst), 1);
}

/// Waits for the call's first event (its "starting" progress): the tool is running.
async fn started(
    client: &mut ToolWorkerClient<Channel>,
    req: pb::ExecuteRequest,
) -> tonic::Streaming<pb::ExecuteEvent> {
    let mut stream = client.execute(req).await.unwrap().into_inner();
    let first = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("the call started")
        .unwrap()
        .expect("an event");
    assert!(matches!(
        first.event,
        Some(pb::execute_event::Event::Progress(_))
    ));
    stream
}

#[tokio::test]
async fn cancel_stops_detached_and_attached_calls_and_answers_after_they_ended() {
    for detached in [true, false] {
        let h = start(WorkerSettings::default()).await;
        let mut c = client(&h.socket).await;
        let mut req = request(60_000, 0);
        req.call_id = format!("cancel-me-{detached}");
        req.detached = detached;
        let mut stream = started(&mut c, req.clone()).await;
        let answer = c
            .cancel(pb::CancelRequest {
                call_id: req.call_id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(answer.found && answer.stopped, "{answer:?}");
        // The answer came after the tool had ended, not merely after it was told to.
        assert!(h.cancelled.load(Ordering::SeqCst), "detached: {detached}");
        let end = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect("the stream ended");
        assert_eq!(
            end.unwrap_err().code(),
            tonic::Code::Cancelled,
            "detached: {detached}"
        );
        assert_eq!(h.finished.load(Ordering::SeqCst), 0);
        // Cancelling again, or an id the worker never ran, changes nothing.
        let again = c
            .cancel(pb::CancelRequest {
                call_id: req.call_id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            again.found, detached,
            "a detached call stays known: {again:?}"
        );
        let unknown = c
            .cancel(pb::CancelRequest {
                call_id: "never-ran".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!unknown.found);
        assert_eq!(
            c.cancel(pb::CancelRequest {
                call_id: String::new()
            })
            .await
            .unwrap_err()
            .code(),
            tonic::Code::InvalidArgument
        );
    }
}

#[tokio::test]
async fn cancelling_a_call_that_already_finished_keeps_its_result() {
    let h = start(WorkerSettings::default()).await;
    let mut c = client(&h.socket).await;
    let mut req = request(1, 0);
    req.call_id = "done".into();
    req.detached = true;
    let result = result_of(&mut c, req.clone()).await.unwrap();
    assert_eq!(result.content, vec!["slept 1 ms".to_owned()]);
    let answer = c
        .cancel(pb::CancelRequest {
            call_id: "done".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(answer.found && answer.stopped);
    assert!(!h.cancelled.load(Ordering::SeqCst));
    // A repeated Execute still gets the original answer.
    let again = result_of(&mut c, req).await.unwrap();
    assert_eq!(again.content, result.content);
}

/// SIGTERM's drain (DESIGN §9): health says NOT_SERVING at once and the health stream
/// ends; a new call is refused as not started (so the orchestrator may send it
/// elsewhere); the call in flight runs to its end; then the server stops.
#[tokio::test]
async fn a_draining_worker_refuses_new_calls_and_finishes_those_in_flight() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

    let mut h = start(WorkerSettings::default()).await;
    let mut c = client(&h.socket).await;
    let mut health = HealthClient::new(client_channel(&h.socket).await);
    let mut watch = health
        .watch(HealthCheckRequest {
            service: "airlock.v1.ToolWorker".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);

    let release = h._dir.path().join("release");
    let mut held = request(0, 0);
    held.arguments_json = serde_json::json!({"until": release}).to_string();
    let in_flight = tokio::spawn(result_from(running(&mut c, held).await));

    h.stop.take().unwrap().send(()).unwrap();
    let said = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("health answers at once")
        .unwrap()
        .unwrap();
    assert_eq!(said.status, ServingStatus::NotServing as i32);
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(m) = watch.message().await.unwrap() {
            assert_eq!(m.status, ServingStatus::NotServing as i32);
        }
    })
    .await;
    assert!(ended.is_ok(), "the health stream ends during the drain");

    let mut fresh = request(1, 0);
    fresh.call_id = "c2".into();
    let refused = c.execute(fresh).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        refused
            .metadata()
            .get(airlock_proto::NOT_STARTED_METADATA)
            .is_some(),
        "marked as not started: {refused:?}"
    );
    assert!(!h.server.is_finished(), "the worker waits for its call");

    std::fs::write(&release, "").unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), in_flight)
        .await
        .expect("the call in flight finishes")
        .unwrap()
        .unwrap();
    assert!(!result.is_error, "{result:?}");
    assert_eq!(h.finished.load(Ordering::SeqCst), 1);
    assert!(!h.cancelled.load(Ordering::SeqCst));
    tokio::time::timeout(Duration::from_secs(15), h.server)
        .await
        .expect("the worker stops once drained")
        .unwrap();
}

async fn client_channel(socket: &std::path::Path) -> Channel {
    let path = socket.to_path_buf();
    Endpoint::from_static("http://w.invalid")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .unwrap()
}
