//! Traces and the audit stream with a real OTLP receiver: the test serves the
//! collector's `TraceService` and `LogsService` over gRPC (tonic) and `POST /v1/traces`
//! and `/v1/logs` over HTTP (`http/protobuf`), decoding with the OpenTelemetry proto
//! definitions (`opentelemetry-proto`). A call made with a W3C `traceparent` yields
//! spans from the orchestrator and the shell worker in the caller's trace, parented as
//! the call went, with the GenAI attributes and without the call's argument values;
//! `[audit] export` delivers each audit record with its `seq` and `hash`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_proto::v1 as pb;
use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::{
    LogsService, LogsServiceServer,
};
use opentelemetry_proto::tonic::collector::logs::v1::{
    ExportLogsServiceRequest, ExportLogsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::logs::v1::LogRecord;
use prost::Message as _;
use serde_json::{Value, json};

use crate::support::{Airlock, signal};

/// What the receiver got, over either protocol.
#[derive(Default)]
struct Received {
    traces: Vec<ExportTraceServiceRequest>,
    logs: Vec<ExportLogsServiceRequest>,
}

/// An OTLP receiver on loopback: gRPC on one port, `http/protobuf` on another.
pub(crate) struct Receiver {
    pub(crate) grpc: String,
    pub(crate) http: String,
    received: Arc<Mutex<Received>>,
    stop: tokio_util::sync::CancellationToken,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[derive(Clone)]
struct Collector(Arc<Mutex<Received>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.lock().unwrap().traces.push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl LogsService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportLogsServiceRequest>,
    ) -> Result<tonic::Response<ExportLogsServiceResponse>, tonic::Status> {
        self.0.lock().unwrap().logs.push(request.into_inner());
        Ok(tonic::Response::new(ExportLogsServiceResponse::default()))
    }
}

async fn http_traces(
    axum::extract::State(collector): axum::extract::State<Collector>,
    body: axum::body::Bytes,
) -> (axum::http::StatusCode, Vec<u8>) {
    match ExportTraceServiceRequest::decode(body) {
        Ok(request) => {
            collector.0.lock().unwrap().traces.push(request);
            (
                axum::http::StatusCode::OK,
                ExportTraceServiceResponse::default().encode_to_vec(),
            )
        }
        Err(_) => (axum::http::StatusCode::BAD_REQUEST, Vec::new()),
    }
}

async fn http_logs(
    axum::extract::State(collector): axum::extract::State<Collector>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> (axum::http::StatusCode, Vec<u8>) {
    assert_eq!(
        headers["content-type"], "application/x-protobuf",
        "OTLP/HTTP binary"
    );
    match ExportLogsServiceRequest::decode(body) {
        Ok(request) => {
            collector.0.lock().unwrap().logs.push(request);
            (
                axum::http::StatusCode::OK,
                ExportLogsServiceResponse::default().encode_to_vec(),
            )
        }
        Err(_) => (axum::http::StatusCode::BAD_REQUEST, Vec::new()),
    }
}

impl Receiver {
    pub(crate) async fn start() -> Self {
        let http = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        Self::start_on(http).await
    }

    /// A receiver whose HTTP side serves on `http`, a listener the test bound earlier
    /// (whose connections waited in its backlog until now).
    pub(crate) async fn start_on(http: tokio::net::TcpListener) -> Self {
        let received = Arc::new(Mutex::new(Received::default()));
        let collector = Collector(received.clone());
        let stop = tokio_util::sync::CancellationToken::new();

        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let grpc_addr = grpc.local_addr().expect("addr");
        let server = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .add_service(LogsServiceServer::new(collector.clone()));
        let stopped = stop.clone();
        tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(grpc);
            let _ = server
                .serve_with_incoming_shutdown(incoming, stopped.cancelled_owned())
                .await;
        });

        let http_addr = http.local_addr().expect("addr");
        let app = axum::Router::new()
            .route("/v1/traces", axum::routing::post(http_traces))
            .route("/v1/logs", axum::routing::post(http_logs))
            .with_state(collector);
        let stopped = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(http, app)
                .with_graceful_shutdown(stopped.cancelled_owned())
                .await;
        });
        Self {
            grpc: format!("http://{grpc_addr}"),
            http: format!("http://{http_addr}"),
            received,
            stop,
        }
    }

    /// Every span received so far, with its service's name.
    fn spans(&self) -> Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)> {
        let received = self.received.lock().unwrap();
        let mut spans = Vec::new();
        for request in &received.traces {
            for resource in &request.resource_spans {
                let service = resource
                    .resource
                    .as_ref()
                    .and_then(|r| text_attribute(&r.attributes, "service.name"))
                    .unwrap_or_default();
                for scope in &resource.scope_spans {
                    for span in &scope.spans {
                        spans.push((service.clone(), span.clone()));
                    }
                }
            }
        }
        spans
    }

    /// Every log record received so far.
    fn log_records(&self) -> Vec<LogRecord> {
        let received = self.received.lock().unwrap();
        received
            .logs
            .iter()
            .flat_map(|r| &r.resource_logs)
            .flat_map(|r| &r.scope_logs)
            .flat_map(|s| s.log_records.clone())
            .collect()
    }

    /// Everything received, as bytes, for a search for what must not be there.
    pub(crate) fn raw(&self) -> Vec<u8> {
        let received = self.received.lock().unwrap();
        let mut raw = Vec::new();
        for request in &received.traces {
            raw.extend(request.encode_to_vec());
        }
        raw
    }

    /// Waits (bounded) until `done` holds for the spans of `trace_id`.
    pub(crate) async fn wait_for_trace(
        &self,
        trace_id: &str,
        what: &str,
        done: impl Fn(&[(String, Span)]) -> bool,
    ) -> Vec<(String, Span)> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let spans: Vec<(String, Span)> = self
                .spans()
                .into_iter()
                .filter(|(_, s)| hex(&s.trace_id) == trace_id)
                .collect();
            if done(&spans) {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not received within 30 s; spans of the trace: {:#?}",
                spans
                    .iter()
                    .map(|(service, s)| format!("{service} {}", s.name))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

pub(crate) type Span = opentelemetry_proto::tonic::trace::v1::Span;

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attribute<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a any_value::Value> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v: &AnyValue| v.value.as_ref())
}

pub(crate) fn text_attribute(attributes: &[KeyValue], key: &str) -> Option<String> {
    match attribute(attributes, key)? {
        any_value::Value::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

pub(crate) fn int_attribute(attributes: &[KeyValue], key: &str) -> Option<i64> {
    match attribute(attributes, key)? {
        any_value::Value::IntValue(i) => Some(*i),
        _ => None,
    }
}

/// The one span of `service` named `name`.
pub(crate) fn find<'a>(spans: &'a [(String, Span)], service: &str, name: &str) -> &'a Span {
    let found: Vec<&Span> = spans
        .iter()
        .filter(|(s, span)| s == service && span.name == name)
        .map(|(_, span)| span)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one {name:?} span of {service}: {:#?}",
        spans
            .iter()
            .map(|(service, s)| format!("{service} {}", s.name))
            .collect::<Vec<_>>()
    );
    found[0]
}

pub(crate) fn has(spans: &[(String, Span)], service: &str, name: &str) -> bool {
    spans
        .iter()
        .any(|(s, span)| s == service && span.name == name)
}

/// A fresh W3C trace context: (trace id, parent span id, `traceparent`).
pub(crate) fn traceparent() -> (String, String, String) {
    let trace = uuid_hex(32);
    let parent = uuid_hex(16);
    let header = format!("00-{trace}-{parent}-01");
    (trace, parent, header)
}

fn uuid_hex(len: usize) -> String {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).expect("random");
    hex(&bytes)[..len].to_owned()
}

/// The stage that refuses is the span marked failed: a wrong token fails `gate.auth`
/// under the front door (and no call span follows); arguments the schema refuses fail
/// `gate.schema`, the checks before it end ok, and nothing is dispatched. The stages are
/// timed by the gate and handed to the exporter without `tracing`, so this checks the
/// status they carry and that their timestamps nest inside their parent's.
#[tokio::test]
async fn the_stage_that_refuses_a_call_is_its_failed_span() {
    use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
    let receiver = Receiver::start().await;
    let airlock = Airlock::start_with_env(
        "",
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.http.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    )
    .await;
    let orchestrator = "airlock-orchestrator";
    let status = |span: &Span| span.status.as_ref().map_or(0, |s| s.code);
    let error = StatusCode::Error as i32;

    // A token nobody holds.
    let (auth_trace, _, header) = traceparent();
    let refused = reqwest::Client::new()
        .post(format!("{}/v1/tool_calls", airlock.url))
        .bearer_auth("not-a-token-anyone-holds")
        .header("traceparent", &header)
        .json(
            &json!({"tool_uses": [{"type": "tool_use", "id": "t1", "name": "read_file",
            "input": {"path": "a.txt"}}]}),
        )
        .send()
        .await
        .expect("send");
    assert_eq!(refused.status(), 401);
    let spans = receiver
        .wait_for_trace(&auth_trace, "the refused request", |spans| {
            has(spans, orchestrator, "POST /v1/tool_calls") && has(spans, orchestrator, "gate.auth")
        })
        .await;
    let door = find(&spans, orchestrator, "POST /v1/tool_calls");
    let auth = find(&spans, orchestrator, "gate.auth");
    assert_eq!(auth.parent_span_id, door.span_id);
    assert_eq!(status(auth), error, "gate.auth refused the token");
    assert!(
        auth.start_time_unix_nano >= door.start_time_unix_nano
            && auth.end_time_unix_nano <= door.end_time_unix_nano
            && auth.start_time_unix_nano <= auth.end_time_unix_nano,
        "the stage's time lies within the door's"
    );
    assert!(
        !spans
            .iter()
            .any(|(_, s)| s.name.starts_with("execute_tool")),
        "no call after a refused token"
    );

    // Arguments of the wrong type.
    let (schema_trace, _, header) = traceparent();
    let response = airlock
        .request(reqwest::Method::POST, "/v1/tool_calls")
        .header("traceparent", &header)
        .json(
            &json!({"tool_uses": [{"type": "tool_use", "id": "t2", "name": "read_file",
            "input": {"path": 5}}]}),
        )
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.expect("JSON");
    assert_eq!(body["tool_results"][0]["is_error"], true, "{body}");
    let spans = receiver
        .wait_for_trace(&schema_trace, "the refused call", |spans| {
            has(spans, orchestrator, "execute_tool read_file")
                && has(spans, orchestrator, "gate.schema")
                && has(spans, orchestrator, "gate.store")
        })
        .await;
    let call = find(&spans, orchestrator, "execute_tool read_file");
    let admission = find(&spans, orchestrator, "gate.admission");
    let schema = find(&spans, orchestrator, "gate.schema");
    for stage in [admission, schema] {
        assert_eq!(stage.parent_span_id, call.span_id, "{}", stage.name);
        assert!(
            stage.start_time_unix_nano >= call.start_time_unix_nano
                && stage.end_time_unix_nano <= call.end_time_unix_nano,
            "{} lies within the call's span",
            stage.name
        );
    }
    assert_ne!(status(admission), error, "admission let the call in");
    assert_eq!(status(schema), error, "the schema refused the call");
    assert!(schema.start_time_unix_nano >= admission.end_time_unix_nano);
    for later in ["gate.budget", "gate.policy", "gate.dispatch"] {
        assert!(
            !has(&spans, orchestrator, later),
            "{later} after the schema refused the call"
        );
    }
}

/// A `/v1` call of execute_shell under the caller's trace, exported over
/// `http/protobuf`: the front door's span is the child of the caller's span; the
/// gate's stages, the worker's execute span (service `airlock-worker-shell`, through
/// the trace context in the gRPC metadata) and the sandbox's run follow as the call
/// went; the GenAI and Airlock attributes are set; the command's text appears in no
/// exported byte; the JSON log lines of the call carry its trace id.
#[tokio::test]
async fn a_v1_call_is_one_trace_from_the_front_door_to_the_sandbox() {
    let receiver = Receiver::start().await;
    let airlock = Airlock::start_with_env(
        "",
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.http.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ("AIRLOCK_LOG_FORMAT", "json"),
        ],
    )
    .await;
    let (trace_id, parent_id, header) = traceparent();
    // The argument's value is a marker that must reach no span.
    let marker = format!("argument-value-{}", uuid_hex(12));
    let body = json!({
        "tool_uses": [{"type": "tool_use", "id": "toolu_trace_1", "name": "execute_shell",
            "input": {"command": format!("echo {marker}")}}],
    });
    let response = airlock
        .request(reqwest::Method::POST, "/v1/tool_calls")
        .header("traceparent", &header)
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.expect("JSON");
    let result = &body["tool_results"][0];
    assert_eq!(result["is_error"], false, "{body}");
    let call_id = body["calls"][0]["call_id"]
        .as_str()
        .expect("call id")
        .to_owned();
    let level = body["calls"][0]["isolation"]["level"]
        .as_str()
        .map(str::to_owned);

    let orchestrator = "airlock-orchestrator";
    let shell = "airlock-worker-shell";
    let spans = receiver
        .wait_for_trace(&trace_id, "the call's spans", |spans| {
            has(spans, orchestrator, "POST /v1/tool_calls")
                && has(spans, orchestrator, "execute_tool execute_shell")
                && has(spans, shell, "execute_tool execute_shell")
                && has(spans, shell, "sandbox.run")
        })
        .await;

    let door = find(&spans, orchestrator, "POST /v1/tool_calls");
    assert_eq!(
        hex(&door.parent_span_id),
        parent_id,
        "the caller's span is the parent"
    );
    assert_eq!(
        text_attribute(&door.attributes, "http.route").as_deref(),
        Some("/v1/tool_calls")
    );
    assert_eq!(
        int_attribute(&door.attributes, "http.response.status_code"),
        Some(200)
    );
    let call = find(&spans, orchestrator, "execute_tool execute_shell");
    assert_eq!(call.parent_span_id, door.span_id);
    for (key, value) in [
        ("gen_ai.operation.name", "execute_tool"),
        ("gen_ai.tool.name", "execute_shell"),
        ("gen_ai.tool.call.id", "toolu_trace_1"),
        ("airlock.call_id", call_id.as_str()),
        ("airlock.status", "ok"),
    ] {
        assert_eq!(
            text_attribute(&call.attributes, key).as_deref(),
            Some(value),
            "{key} on the call's span"
        );
    }
    // Every stage of a call that needs no approval, under the call's span (the last
    // store write, which records the call's end, included).
    for stage in [
        "gate.admission",
        "gate.schema",
        "gate.budget",
        "gate.policy",
        "gate.cache",
        "gate.dispatch",
        "gate.store",
    ] {
        assert!(
            spans.iter().any(|(s, span)| s == orchestrator
                && span.name == stage
                && span.parent_span_id == call.span_id),
            "no {stage} span under the call's"
        );
    }
    let auth = find(&spans, orchestrator, "gate.auth");
    assert_eq!(
        auth.parent_span_id, door.span_id,
        "authentication is in the door"
    );
    let dispatch = find(&spans, orchestrator, "gate.dispatch");
    let execute = find(&spans, shell, "execute_tool execute_shell");
    assert_eq!(
        execute.parent_span_id, dispatch.span_id,
        "the worker's span continues the dispatch (trace context in the gRPC metadata)"
    );
    assert_eq!(
        text_attribute(&execute.attributes, "gen_ai.tool.name").as_deref(),
        Some("execute_shell")
    );
    assert_eq!(
        text_attribute(&execute.attributes, "airlock.call_id").as_deref(),
        Some(call_id.as_str())
    );
    assert_eq!(
        text_attribute(&execute.attributes, "airlock.status").as_deref(),
        Some("ok")
    );
    let sandbox = find(&spans, shell, "sandbox.run");
    assert_eq!(sandbox.parent_span_id, execute.span_id);
    assert_eq!(
        int_attribute(&sandbox.attributes, "process.exit.code"),
        Some(0)
    );
    let isolation = text_attribute(&sandbox.attributes, "airlock.isolation");
    assert!(
        matches!(isolation.as_deref(), Some("strict" | "standard")),
        "{isolation:?}"
    );
    if let Some(level) = level {
        assert_eq!(isolation.as_deref(), Some(level.as_str()));
    }
    assert_eq!(
        text_attribute(&call.attributes, "airlock.isolation"),
        isolation,
        "the call's span has the sandbox's level"
    );

    // The command (the argument's value) is in the result, and in no exported span.
    assert!(result.to_string().contains(&marker));
    let raw = receiver.raw();
    assert!(!raw.is_empty());
    assert!(
        !raw.windows(marker.len()).any(|w| w == marker.as_bytes()),
        "an argument's value was exported in a span"
    );

    // The call's log line carries its trace and span ids.
    let log = airlock.log();
    let finished: Value = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|l| {
            l["fields"]["message"] == "call finished" && l["fields"]["call_id"] == call_id.as_str()
        })
        .unwrap_or_else(|| panic!("no JSON 'call finished' line for {call_id}:\n{log}"));
    assert_eq!(finished["trace_id"], trace_id.as_str(), "{finished}");
    assert_eq!(
        finished["span_id"],
        hex(&call.span_id).as_str(),
        "{finished}"
    );
}

/// The gRPC front door and `/mcp` take the caller's `traceparent` too (here exported
/// over gRPC); a call without one gets a trace of its own.
#[tokio::test]
async fn grpc_and_mcp_calls_join_the_callers_trace() {
    let receiver = Receiver::start().await;
    let airlock = Airlock::start_with_env(
        "",
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.grpc.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    )
    .await;
    let (is_error, _, call) = airlock
        .call("write_file", json!({"path": "t.txt", "content": "traced"}))
        .await;
    assert!(!is_error, "{call}");

    // gRPC: the traceparent in the request's metadata.
    let (grpc_trace, grpc_parent, header) = traceparent();
    let mut client = airlock.grpc_client().await;
    let mut request = tonic::Request::new(pb::CallToolsRequest {
        session_id: String::new(),
        tool_uses: vec![pb::ToolUse {
            id: "toolu_grpc".into(),
            name: "read_file".into(),
            input_json: r#"{"path":"t.txt"}"#.into(),
        }],
        wait_ms: None,
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", airlock.token)
            .parse()
            .expect("metadata"),
    );
    request
        .metadata_mut()
        .insert("traceparent", header.parse().expect("metadata"));
    let response = client.call_tools(request).await.expect("call").into_inner();
    assert!(!response.tool_results[0].is_error, "{response:?}");

    // MCP: the traceparent on the POST.
    let (mcp_trace, mcp_parent, header) = traceparent();
    let answer = airlock
        .http()
        .post(format!("{}/mcp", airlock.url))
        .bearer_auth(&airlock.token)
        .header("Accept", "application/json, text/event-stream")
        .header("MCP-Protocol-Version", "2025-06-18")
        .header("traceparent", &header)
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "read_file", "arguments": {"path": "t.txt"}}}))
        .send()
        .await
        .expect("send");
    assert_eq!(answer.status(), 200);
    let text = answer.text().await.expect("body");
    assert!(text.contains("traced"), "{text}");

    // Without one: a trace of its own, with a root front-door span.
    let (_, _, untraced) = airlock.call("read_file", json!({"path": "t.txt"})).await;
    assert_eq!(untraced["status"], "ok");
    let untraced_id = untraced["call_id"].as_str().expect("call id").to_owned();

    let orchestrator = "airlock-orchestrator";
    let fs = "airlock-worker-fs";
    for (trace_id, parent_id, door) in [
        (
            &grpc_trace,
            &grpc_parent,
            "airlock.v1.Orchestrator/CallTools",
        ),
        (&mcp_trace, &mcp_parent, "POST /mcp"),
    ] {
        let spans = receiver
            .wait_for_trace(trace_id, door, |spans| {
                has(spans, orchestrator, door)
                    && has(spans, orchestrator, "execute_tool read_file")
                    && has(spans, fs, "execute_tool read_file")
            })
            .await;
        let front = find(&spans, orchestrator, door);
        assert_eq!(&hex(&front.parent_span_id), parent_id, "{door}");
        let call = find(&spans, orchestrator, "execute_tool read_file");
        assert_eq!(call.parent_span_id, front.span_id, "{door}");
        assert_eq!(
            text_attribute(&call.attributes, "gen_ai.tool.name").as_deref(),
            Some("read_file")
        );
        let dispatch = find(&spans, orchestrator, "gate.dispatch");
        let execute = find(&spans, fs, "execute_tool read_file");
        assert_eq!(execute.parent_span_id, dispatch.span_id, "{door}");
    }
    // The gRPC span is named after the RPC.
    let grpc_spans = receiver.wait_for_trace(&grpc_trace, "grpc", |_| true).await;
    let rpc = find(
        &grpc_spans,
        orchestrator,
        "airlock.v1.Orchestrator/CallTools",
    );
    assert_eq!(
        text_attribute(&rpc.attributes, "rpc.method").as_deref(),
        Some("CallTools")
    );
    let mcp_spans = receiver.wait_for_trace(&mcp_trace, "mcp", |_| true).await;
    let mcp_call = find(&mcp_spans, orchestrator, "execute_tool read_file");
    assert_eq!(
        text_attribute(&mcp_call.attributes, "gen_ai.tool.call.id").as_deref(),
        Some("mcp-1")
    );

    // The call without a traceparent: its own trace, whose front door is a root.
    let deadline = Instant::now() + Duration::from_secs(30);
    let own = loop {
        let spans = receiver.spans();
        let call = spans.iter().find(|(s, span)| {
            s == orchestrator
                && span.name == "execute_tool read_file"
                && text_attribute(&span.attributes, "airlock.call_id").as_deref()
                    == Some(untraced_id.as_str())
        });
        if let Some((_, call)) = call {
            break call.clone();
        }
        assert!(Instant::now() < deadline, "the untraced call's span");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let own_trace = hex(&own.trace_id);
    assert_ne!(own_trace, grpc_trace);
    assert_ne!(own_trace, mcp_trace);
    let own_spans = receiver
        .wait_for_trace(&own_trace, "own trace", |s| {
            has(s, orchestrator, "POST /v1/tool_calls")
        })
        .await;
    let root = find(&own_spans, orchestrator, "POST /v1/tool_calls");
    assert!(root.parent_span_id.is_empty(), "a root span");
}

/// `[audit] export` over `http/protobuf` and over gRPC: every record appended after the
/// start arrives once, in order, with the `seq`, `hash` and `prev_hash` of the log (so
/// the chain can be checked by the receiver), the whole record as the body.
#[tokio::test]
async fn audit_export_sends_each_appended_record_with_its_seq_and_hash() {
    for protocol in ["http/protobuf", "grpc"] {
        let receiver = Receiver::start().await;
        let endpoint = match protocol {
            "grpc" => &receiver.grpc,
            _ => &receiver.http,
        };
        let airlock = Airlock::start_with(&format!(
            "[audit]\nexport = {{ endpoint = \"{endpoint}\", protocol = \"{protocol}\" }}\n"
        ))
        .await;
        let (is_error, _, call) = airlock
            .call("write_file", json!({"path": "a.txt", "content": "x"}))
            .await;
        assert!(!is_error, "{call}");
        let call_id = call["call_id"].as_str().expect("call id").to_owned();
        let (status, audit) = airlock
            .get(&format!("/v1/audit?call_id={call_id}&limit=100"))
            .await;
        assert_eq!(status, 200);
        let expected: Vec<Value> = audit["events"].as_array().expect("events").clone();
        assert!(expected.len() >= 2, "{audit}");

        let deadline = Instant::now() + Duration::from_secs(30);
        let by_seq: HashMap<i64, LogRecord> = loop {
            let records: HashMap<i64, LogRecord> = receiver
                .log_records()
                .into_iter()
                .map(|r| {
                    (
                        int_attribute(&r.attributes, "airlock.audit.seq").expect("seq"),
                        r,
                    )
                })
                .collect();
            if expected
                .iter()
                .all(|e| records.contains_key(&e["seq"].as_i64().expect("seq")))
            {
                break records;
            }
            assert!(
                Instant::now() < deadline,
                "{protocol}: the call's audit records did not arrive within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        for event in &expected {
            let seq = event["seq"].as_i64().expect("seq");
            let record = &by_seq[&seq];
            assert_eq!(record.event_name, "airlock.audit");
            assert_eq!(
                text_attribute(&record.attributes, "airlock.audit.hash").as_deref(),
                event["hash"].as_str(),
                "{protocol}: seq {seq}"
            );
            assert_eq!(
                text_attribute(&record.attributes, "airlock.audit.prev_hash").as_deref(),
                event["prev_hash"].as_str()
            );
            assert_eq!(
                text_attribute(&record.attributes, "airlock.audit.kind").as_deref(),
                event["kind"].as_str()
            );
            assert_eq!(
                text_attribute(&record.attributes, "airlock.call_id").as_deref(),
                Some(call_id.as_str())
            );
            let Some(any_value::Value::StringValue(body)) =
                record.body.as_ref().and_then(|b| b.value.as_ref())
            else {
                panic!("a string body")
            };
            let body: Value = serde_json::from_str(body).expect("JSON body");
            assert_eq!(&body, event, "{protocol}: the whole record");
        }
        // Each record once: seqs are unique among everything received.
        let records = receiver.log_records();
        let mut seqs: Vec<i64> = records
            .iter()
            .map(|r| int_attribute(&r.attributes, "airlock.audit.seq").expect("seq"))
            .collect();
        let count = seqs.len();
        seqs.sort_unstable();
        seqs.dedup();
        assert_eq!(seqs.len(), count, "{protocol}: no record sent twice");
        let resource_ok = receiver.received.lock().unwrap().logs.iter().all(|r| {
            r.resource_logs.iter().all(|rl| {
                rl.resource
                    .as_ref()
                    .and_then(|r| text_attribute(&r.attributes, "service.name"))
                    .as_deref()
                    == Some("airlock-orchestrator")
            })
        });
        assert!(resource_ok, "the orchestrator's service name");
    }
}

/// A collector that does not answer holds no call up and loses no record: calls
/// succeed, the failures are counted and logged naming the endpoint, the exporter reads
/// no further ahead than `max_queue`, and once a collector answers at the endpoint every
/// record since the start arrives, without a gap — those appended before the
/// orchestrator was killed and restarted too (the cursor is in the store).
#[tokio::test]
async fn a_collector_that_is_down_costs_neither_calls_nor_records() {
    // Bound now, accepting nothing until the receiver starts on it: connections wait in
    // the backlog and each send times out.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
    let airlock = Airlock::start_with(&format!(
        "[audit]\nexport = {{ endpoint = \"{endpoint}\", max_queue = 3, timeout_ms = 500 }}\n"
    ))
    .await;
    let mut calls = Vec::new();
    let call = async |i: usize, client: &reqwest::Client| -> Option<String> {
        let body = json!({"tool_uses": [{"type": "tool_use", "id": format!("t{i}"),
            "name": "write_file", "input": {"path": format!("f{i}.txt"), "content": "x"}}]});
        let answer: Value = client
            .post(format!("{}/v1/tool_calls", airlock.url))
            .bearer_auth(&airlock.token)
            .json(&body)
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        (answer["tool_results"][0]["is_error"] == false).then(|| {
            answer["calls"][0]["call_id"]
                .as_str()
                .expect("call id")
                .to_owned()
        })
    };
    for i in 0..5 {
        calls.push(call(i, airlock.http()).await.expect("the call succeeds"));
    }
    let metric = async |name: &str| -> f64 {
        let metrics = airlock
            .http()
            .get(format!("{}/metrics", airlock.url))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    // The queue holds what the first read found, up to `max_queue`: a read that lands
    // while the first call is still being recorded finds fewer, and (the collector
    // failing) the exporter reads no more until they are sent. The exact bound is the
    // unit test's (`a_collector_that_is_down_holds_the_cursor_and_nothing_is_dropped`).
    while metric("airlock_audit_export_failures_total").await < 1.0
        || metric("airlock_audit_export_queue").await < 1.0
    {
        assert!(
            Instant::now() < deadline,
            "failures were not counted within 30 s:\n{}",
            airlock.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let queued = metric("airlock_audit_export_queue").await;
    assert!(
        (1.0..=3.0).contains(&queued),
        "read ahead no further than max_queue: {queued} queued of the five calls' records"
    );
    assert_eq!(metric("airlock_audit_exported_total").await, 0.0);
    let log = airlock.log();
    assert!(
        log.contains("[audit] export: cannot send audit records"),
        "the failure is logged:\n{log}"
    );
    assert!(log.contains(&endpoint), "naming the endpoint:\n{log}");

    // The orchestrator dies with its queue unsent; the launcher starts another, which
    // must resume from where the collector last accepted (nowhere yet).
    let first = airlock.process("serve orchestrator");
    signal(first, rustix::process::Signal::KILL);
    let client = reqwest::Client::new();
    let mut i = 5;
    while calls.len() < 7 {
        if let Some(id) = call(i, &client).await {
            calls.push(id);
            i += 1;
        } else {
            assert!(
                Instant::now() < deadline + Duration::from_secs(30),
                "the orchestrator did not come back:\n{}",
                airlock.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_ne!(airlock.process("serve orchestrator"), first);

    let mut expected = Vec::new();
    for id in &calls {
        let (status, audit) = airlock
            .get(&format!("/v1/audit?call_id={id}&limit=100"))
            .await;
        assert_eq!(status, 200);
        for event in audit["events"].as_array().expect("events") {
            expected.push(event["seq"].as_i64().expect("seq"));
        }
    }
    let receiver =
        Receiver::start_on(tokio::net::TcpListener::from_std(listener).expect("listener")).await;
    let deadline = Instant::now() + Duration::from_secs(90);
    let received = loop {
        let received: std::collections::BTreeSet<i64> = receiver
            .log_records()
            .iter()
            .map(|r| int_attribute(&r.attributes, "airlock.audit.seq").expect("seq"))
            .collect();
        if expected.iter().all(|seq| received.contains(seq)) {
            break received;
        }
        assert!(
            Instant::now() < deadline,
            "records were lost: expected {expected:?}, received {received:?}\n{}",
            airlock.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (first_seq, last_seq) = (
        *received.first().expect("some"),
        *received.last().expect("some"),
    );
    assert_eq!(
        i64::try_from(received.len()).expect("count"),
        last_seq - first_seq + 1,
        "no gap in what arrived: {received:?}"
    );
}
