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

/// Sleeps for `millis`, reporting progress, unless cancelled first.
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
        ctx.progress(0.0, Some(1.0), "starting");
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(millis)) => {
                self.finished.fetch_add(1, Ordering::SeqCst);
                ToolOutcome::text(format!("slept {millis} ms"))
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
    let path = socket.to_path_buf();
    let channel = Endpoint::from_static("http://w.invalid")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .unwrap();
    ToolWorkerClient::new(channel)
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
    let mut stream = client.execute(req).await?.into_inner();
    while let Some(event) = stream.message().await? {
        if let Some(pb::execute_event::Event::Result(r)) = event.event {
            return Ok(r);
        }
    }
    Err(tonic::Status::unknown("no result"))
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
    let started = Instant::now();
    let err = result_of(&mut c, request(30_000, 200)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the call was not stopped"
    );
    // The tool saw the cancellation.
    tokio::time::sleep(Duration::from_millis(100)).await;
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
    let stream = c.execute(request(30_000, 0)).await.unwrap().into_inner();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(stream);
    drop(c);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !h.cancelled.load(Ordering::SeqCst) {
        assert!(
            Instant::now() < deadline,
            "the tool never saw the cancellation"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn shutdown_drains_in_flight_calls_and_refuses_new_ones() {
    let h = start(WorkerSettings::default()).await;
    let mut c = client(&h.socket).await;
    let in_flight = tokio::spawn({
        let mut c = c.clone();
        async move { result_of(&mut c, request(700, 0)).await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let mut h = h;
    h.stop.take().unwrap().send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A new connection is refused while the old call finishes.
    let fresh = tokio::net::UnixStream::connect(&h.socket).await;
    let new_call_refused = match fresh {
        Err(_) => true,
        Ok(_) => result_of(&mut c, request(10, 0)).await.is_err(),
    };
    assert!(new_call_refused, "a new call was accepted during the drain");
    let result = in_flight.await.unwrap().expect("in-flight call finished");
    assert_eq!(result.content, vec!["slept 700 ms".to_owned()]);
    tokio::time::timeout(Duration::from_secs(10), h.server)
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
    let in_flight = tokio::spawn(async move { result_of(&mut c, request(60_000, 0)).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    h.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), h.server)
        .await
        .expect("server stopped after grace")
        .unwrap();
    assert!(
        h.cancelled.load(Ordering::SeqCst),
        "the long call was cancelled"
    );
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
    let a = tokio::spawn({
        let mut c = c.clone();
        async move { result_of(&mut c, first).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
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
    let stream = c.execute(req.clone()).await.unwrap().into_inner();
    tokio::time::sleep(Duration::from_millis(50)).await;
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
