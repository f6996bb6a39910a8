//! The gRPC front door and the workers' gRPC services, as a client sees them.

use airlock_proto::v1 as pb;
use airlock_proto::v1::orchestrator_client::OrchestratorClient;
use airlock_proto::v1::tool_worker_client::ToolWorkerClient;
use tonic::Request;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::support::Airlock;

fn authed<T>(message: T, token: &str) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("metadata"),
    );
    request
}

async fn orchestrator_channel(airlock: &Airlock) -> Channel {
    Endpoint::from_shared(airlock.grpc.clone())
        .expect("endpoint")
        .connect()
        .await
        .expect("connect")
}

async fn unix_channel(path: std::path::PathBuf) -> Channel {
    Endpoint::from_static("http://worker.invalid")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .expect("connect to worker socket")
}

#[tokio::test]
async fn list_and_call_tools_over_grpc() {
    let airlock = Airlock::start().await;
    let mut client = OrchestratorClient::new(orchestrator_channel(&airlock).await);

    let unauthenticated = client
        .list_tools(Request::new(pb::OrchestratorListToolsRequest {}))
        .await;
    assert_eq!(
        unauthenticated.expect_err("no token").code(),
        tonic::Code::Unauthenticated
    );
    let wrong = client
        .list_tools(authed(pb::OrchestratorListToolsRequest {}, "alk_wrong"))
        .await;
    assert_eq!(
        wrong.expect_err("wrong token").code(),
        tonic::Code::Unauthenticated
    );

    let tools = client
        .list_tools(authed(pb::OrchestratorListToolsRequest {}, &airlock.token))
        .await
        .expect("list tools")
        .into_inner()
        .tools;
    let read = tools
        .iter()
        .find(|t| t.name == "read_file")
        .expect("read_file listed");
    assert!(read.read_only);
    let schema: serde_json::Value =
        serde_json::from_str(&read.input_schema_json).expect("schema JSON");
    assert_eq!(schema["type"], "object");

    let request = pb::CallToolsRequest {
        session_id: "grpc".into(),
        tool_uses: vec![
            pb::ToolUse {
                id: "w".into(),
                name: "write_file".into(),
                input_json: r#"{"path":"g.txt","content":"via grpc"}"#.into(),
            },
            pb::ToolUse {
                id: "bad".into(),
                name: "read_file".into(),
                input_json: r#"{"path": 1}"#.into(),
            },
            pb::ToolUse {
                id: "junk".into(),
                name: "read_file".into(),
                input_json: "{oops".into(),
            },
        ],
        wait_ms: None,
    };
    let response = client
        .call_tools(authed(request, &airlock.token))
        .await
        .expect("call")
        .into_inner();
    assert_eq!(response.calls.len(), 3);
    assert_eq!(response.tool_results[0].tool_use_id, "w");
    assert!(
        !response.tool_results[0].is_error,
        "{:?}",
        response.tool_results[0]
    );
    assert_eq!(response.calls[0].status, "ok");
    assert!(response.tool_results[1].is_error);
    assert!(response.tool_results[1].content[0].contains("/path"));
    assert!(response.tool_results[2].is_error);
    assert_eq!(
        std::fs::read_to_string(airlock.workspace("grpc").join("g.txt")).expect("file"),
        "via grpc"
    );

    let bad_session = pb::CallToolsRequest {
        session_id: "../x".into(),
        tool_uses: vec![pb::ToolUse {
            id: "a".into(),
            name: "read_file".into(),
            input_json: "{}".into(),
        }],
        wait_ms: None,
    };
    let err = client
        .call_tools(authed(bad_session, &airlock.token))
        .await
        .expect_err("bad session");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    // Streaming one call: started, then completed with the result.
    let stream_request = pb::CallToolStreamRequest {
        session_id: "grpc".into(),
        tool_use: Some(pb::ToolUse {
            id: "s".into(),
            name: "read_file".into(),
            input_json: r#"{"path":"g.txt"}"#.into(),
        }),
    };
    let mut stream = client
        .call_tool_stream(authed(stream_request, &airlock.token))
        .await
        .expect("stream")
        .into_inner();
    let mut saw_started = false;
    let mut completed = None;
    while let Some(event) = stream.message().await.expect("event") {
        match event.event {
            Some(pb::call_event::Event::Started(_)) => saw_started = true,
            Some(pb::call_event::Event::Completed(c)) => completed = Some(c),
            _ => {}
        }
    }
    assert!(saw_started);
    let completed = completed.expect("completed event");
    assert_eq!(completed.result.expect("result").content[0], "via grpc");
}

#[tokio::test]
async fn every_grpc_server_serves_health_and_reflection() {
    let airlock = Airlock::start().await;
    let worker = unix_channel(airlock.data_dir().join("sockets/fs.sock")).await;
    let orchestrator = orchestrator_channel(&airlock).await;
    for (name, channel, service) in [
        (
            "orchestrator",
            orchestrator.clone(),
            "airlock.v1.Orchestrator",
        ),
        ("fs worker", worker.clone(), "airlock.v1.ToolWorker"),
    ] {
        let mut health = HealthClient::new(channel.clone());
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("{name} health: {e}"))
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "{name}");

        use tonic_reflection::pb::v1::ServerReflectionRequest;
        use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
        let mut reflection = ServerReflectionClient::new(channel);
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut responses = reflection
            .server_reflection_info(tokio_stream::iter(vec![request]))
            .await
            .unwrap_or_else(|e| panic!("{name} reflection: {e}"))
            .into_inner();
        let response = responses
            .message()
            .await
            .expect("reflection message")
            .expect("a response");
        let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
            panic!("{name}: unexpected reflection response");
        };
        let services: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        assert!(
            services.contains(&service.to_owned()),
            "{name} reflection lists {services:?}"
        );
    }

    // The worker's own ListTools names its group and tools with annotations.
    let mut tool_worker = ToolWorkerClient::new(worker);
    let listed = tool_worker
        .list_tools(pb::ListToolsRequest {})
        .await
        .expect("ListTools")
        .into_inner();
    assert_eq!(listed.group, "fs");
    let delete = listed
        .tools
        .iter()
        .find(|t| t.name == "delete_path")
        .expect("delete_path");
    assert!(delete.annotations.expect("annotations").destructive);
}
