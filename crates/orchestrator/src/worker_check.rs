//! `airlock worker check <endpoint>`: whether a worker — in any language — honours the
//! `airlock.v1.ToolWorker` contract as the orchestrator relies on it. Each check is one
//! finding with what was seen, so an implementer learns what to change.
//!
//! The checks: health (`grpc.health.v1` reports `airlock.v1.ToolWorker` serving);
//! `ListTools` (valid names, not a built-in's, a description, an input schema that is
//! valid JSON Schema for an object, arguments policies can see); and, given a sample
//! call, `Execute` (a stream of events that ends with exactly one result), the deadline
//! (a call with a 1 ms budget ends soon after) and `Cancel` (an unknown call is answered
//! as not found, at once).

use std::time::{Duration, Instant};

use airlock_policy::authz::{ToolExtension, ToolExtensions};
use airlock_policy::{ToolDefinition, validate_tool_name};
use airlock_proto::v1 as pb;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::config::WorkerTls;
use crate::endpoints::EndpointSpec;
use crate::worker_channel::WorkerChannel;

/// How long one RPC of the check may take.
const RPC_BOUND: Duration = Duration::from_secs(10);
/// How long after its deadline a call may still be running.
const DEADLINE_GRACE: Duration = Duration::from_secs(5);

/// Why the check could not start at all.
#[derive(Debug, thiserror::Error)]
pub enum WorkerCheckError {
    #[error("endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
}

/// One call to make: a tool of the worker and arguments it accepts.
#[derive(Debug, Clone)]
pub struct SampleCall {
    pub tool: String,
    pub arguments: serde_json::Value,
}

/// One check's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub check: &'static str,
    pub ok: bool,
    pub detail: String,
}

impl Finding {
    fn ok(check: &'static str, detail: impl Into<String>) -> Self {
        Self {
            check,
            ok: true,
            detail: detail.into(),
        }
    }

    fn failed(check: &'static str, detail: impl Into<String>) -> Self {
        Self {
            check,
            ok: false,
            detail: detail.into(),
        }
    }
}

/// Runs every check against `endpoint` (`unix:`, `http://`, `https://`; dialed as the
/// orchestrator dials its workers, under `[tls]`).
pub async fn check(
    endpoint: &str,
    tls: &WorkerTls,
    sample: Option<&SampleCall>,
) -> Result<Vec<Finding>, WorkerCheckError> {
    let replica = dial(endpoint, tls)?;
    let mut findings = vec![health(replica.health()).await];
    let mut client = replica.client();
    findings.extend(check_tools(&mut client).await);
    match sample {
        Some(sample) => {
            findings.push(execute(&mut client, sample).await);
            findings.push(deadline(&mut client, sample).await);
            findings.push(cancel_running(&client, sample).await);
        }
        None => findings.push(Finding::ok(
            "execute",
            "not checked: give --call TOOL --input JSON to run one call",
        )),
    }
    findings.push(cancel(&mut client).await);
    Ok(findings)
}

/// The tools a worker lists (`ListTools`), dialed as [`check`] dials: for `airlock policy
/// schema`, which shows the actions derived from external workers.
pub async fn list_tools(
    endpoint: &str,
    tls: &WorkerTls,
) -> Result<Vec<ToolDefinition>, WorkerCheckError> {
    let bad = |reason: String| WorkerCheckError::Endpoint {
        endpoint: endpoint.to_owned(),
        reason,
    };
    let replica = dial(endpoint, tls)?;
    let answer = tokio::time::timeout(
        RPC_BOUND,
        replica.client().list_tools(pb::ListToolsRequest {}),
    )
    .await
    .map_err(|_| bad(format!("no answer to ListTools within {RPC_BOUND:?}")))?
    .map_err(|status| bad(format!("ListTools failed: {status}")))?;
    answer
        .into_inner()
        .tools
        .into_iter()
        .map(|wire| ToolDefinition::try_from(wire).map_err(|e| bad(e.to_string())))
        .collect()
}

/// One replica at `endpoint`, dialed as the orchestrator dials its workers.
fn dial(endpoint: &str, tls: &WorkerTls) -> Result<crate::replicas::Replica, WorkerCheckError> {
    let bad = |reason: String| WorkerCheckError::Endpoint {
        endpoint: endpoint.to_owned(),
        reason,
    };
    let spec = EndpointSpec::parse(endpoint).map_err(|e| bad(e.to_string()))?;
    let dialer = tls.dialer();
    dialer
        .check(endpoint, &spec)
        .map_err(|e| bad(e.to_string()))?;
    dialer
        .static_replica(&spec, None)
        .ok_or_else(|| bad("a dns:/// name stands for many replicas: give one address".into()))?
        .map_err(|e| bad(e.to_string()))
}

async fn health(mut client: HealthClient<WorkerChannel>) -> Finding {
    let request = HealthCheckRequest {
        service: "airlock.v1.ToolWorker".to_owned(),
    };
    match tokio::time::timeout(RPC_BOUND, client.check(request)).await {
        Err(_) => Finding::failed("health", format!("no answer within {RPC_BOUND:?}")),
        Ok(Err(status)) => Finding::failed(
            "health",
            format!(
                "grpc.health.v1.Health/Check(\"airlock.v1.ToolWorker\") failed: {status}; serve the health service and report this service as SERVING"
            ),
        ),
        Ok(Ok(response)) if response.get_ref().status == ServingStatus::Serving as i32 => {
            Finding::ok("health", "airlock.v1.ToolWorker is SERVING")
        }
        Ok(Ok(response)) => Finding::failed(
            "health",
            format!(
                "airlock.v1.ToolWorker reported status {} instead of SERVING",
                response.get_ref().status
            ),
        ),
    }
}

type Client = pb::tool_worker_client::ToolWorkerClient<WorkerChannel>;

async fn check_tools(client: &mut Client) -> Vec<Finding> {
    let answer = tokio::time::timeout(RPC_BOUND, client.list_tools(pb::ListToolsRequest {})).await;
    let response = match answer {
        Err(_) => return vec![Finding::failed("list_tools", "no answer")],
        Ok(Err(status)) => return vec![Finding::failed("list_tools", status.to_string())],
        Ok(Ok(response)) => response.into_inner(),
    };
    let mut findings = Vec::new();
    if response.tools.is_empty() {
        findings.push(Finding::failed("list_tools", "the worker lists no tools"));
    }
    let group = if response.group.is_empty() {
        "external".to_owned()
    } else {
        response.group.clone()
    };
    let mut extensions = Vec::new();
    for wire in response.tools {
        let name = wire.name.clone();
        let definition = match ToolDefinition::try_from(wire) {
            Ok(definition) => definition,
            Err(e) => {
                findings.push(Finding::failed("tool", format!("`{name}`: {e}")));
                continue;
            }
        };
        let problems = tool_problems(&definition);
        if problems.is_empty() {
            findings.push(Finding::ok("tool", format!("`{name}`")));
        } else {
            findings.push(Finding::failed(
                "tool",
                format!("`{name}`: {}", problems.join("; ")),
            ));
        }
        extensions.push(ToolExtension {
            group: group.clone(),
            definition,
            approval: None,
            network: None,
        });
    }
    match ToolExtensions::new(&extensions) {
        Ok(checked) => {
            let schema = airlock_policy::authz::schema_text(&checked);
            let hidden: Vec<&str> = schema
                .lines()
                .filter(|line| line.contains(": not in context: "))
                .map(str::trim)
                .collect();
            findings.push(Finding::ok(
                "policy",
                if hidden.is_empty() {
                    "every argument is visible to Cedar policies".to_owned()
                } else {
                    format!("policies cannot see: {}", hidden.join(", "))
                },
            ));
        }
        Err(e) => findings.push(Finding::failed("policy", e.to_string())),
    }
    findings
}

/// What the orchestrator would refuse in one definition.
fn tool_problems(definition: &ToolDefinition) -> Vec<String> {
    let mut problems = Vec::new();
    if let Err(e) = validate_tool_name(&definition.name) {
        problems.push(e.to_string());
    }
    if airlock_policy::tool::BUILT_IN_TOOLS.contains(&definition.name.as_str()) {
        problems.push("the name of a built-in tool".to_owned());
    }
    if definition.description.trim().is_empty() {
        problems.push("no description: it is what the model reads to choose the tool".into());
    }
    let schema = &definition.input_schema;
    if let Err(e) = jsonschema::meta::validate(schema) {
        problems.push(format!("input_schema is not valid JSON Schema: {e}"));
    } else if let Err(e) = jsonschema::validator_for(schema) {
        problems.push(format!("input_schema cannot be compiled: {e}"));
    }
    if schema.get("type").and_then(serde_json::Value::as_str) != Some("object") {
        problems.push("input_schema must have \"type\": \"object\"".into());
    }
    problems
}

fn request(sample: &SampleCall, call_id: &str, timeout_ms: u64) -> pb::ExecuteRequest {
    pb::ExecuteRequest {
        call_id: call_id.to_owned(),
        tool: sample.tool.clone(),
        arguments_json: sample.arguments.to_string(),
        principal: "worker-check".to_owned(),
        session_id: "worker-check".to_owned(),
        timeout_ms,
        trace_context: Default::default(),
        detached: false,
    }
}

/// The events of one Execute, until the stream ends or the bound passes.
async fn events(
    client: &mut Client,
    request: pb::ExecuteRequest,
    bound: Duration,
) -> Result<Vec<pb::execute_event::Event>, String> {
    let run = async {
        let mut stream = client
            .execute(request)
            .await
            .map_err(|status| format!("Execute failed: {status}"))?
            .into_inner();
        let mut seen = Vec::new();
        loop {
            match stream.message().await {
                Ok(Some(event)) => match event.event {
                    Some(event) => seen.push(event),
                    None => return Err("an ExecuteEvent with no event set".to_owned()),
                },
                Ok(None) => return Ok(seen),
                Err(status) if status.code() == tonic::Code::DeadlineExceeded => {
                    return Ok(seen);
                }
                Err(status) => return Err(format!("the stream failed: {status}")),
            }
        }
    };
    tokio::time::timeout(bound, run)
        .await
        .unwrap_or_else(|_| Err(format!("the stream did not end within {bound:?}")))
}

async fn execute(client: &mut Client, sample: &SampleCall) -> Finding {
    let call_id = format!("call_check_{}", std::process::id());
    match events(
        client,
        request(sample, &call_id, 30_000),
        Duration::from_secs(40),
    )
    .await
    {
        Err(e) => Finding::failed("execute", e),
        Ok(events) => {
            let results = events
                .iter()
                .filter(|e| matches!(e, pb::execute_event::Event::Result(_)))
                .count();
            let last_is_result = matches!(events.last(), Some(pb::execute_event::Event::Result(_)));
            if results == 1 && last_is_result {
                Finding::ok(
                    "execute",
                    format!(
                        "`{}`: {} event(s), ending with one result",
                        sample.tool,
                        events.len()
                    ),
                )
            } else {
                Finding::failed(
                    "execute",
                    format!(
                        "`{}`: {results} result(s) in {} event(s); the stream must end with exactly one result",
                        sample.tool,
                        events.len()
                    ),
                )
            }
        }
    }
}

async fn deadline(client: &mut Client, sample: &SampleCall) -> Finding {
    let call_id = format!("call_check_deadline_{}", std::process::id());
    let started = Instant::now();
    let mut request = tonic::Request::new(request(sample, &call_id, 1));
    request.set_timeout(Duration::from_millis(1) + DEADLINE_GRACE);
    let answer = tokio::time::timeout(
        DEADLINE_GRACE + RPC_BOUND,
        events(client, request.into_inner(), DEADLINE_GRACE + RPC_BOUND),
    )
    .await;
    let took = started.elapsed();
    match answer {
        Ok(Ok(_)) | Ok(Err(_)) if took <= DEADLINE_GRACE + Duration::from_secs(1) => Finding::ok(
            "deadline",
            format!(
                "a call with timeout_ms = 1 ended after {} ms",
                took.as_millis()
            ),
        ),
        _ => Finding::failed(
            "deadline",
            format!(
                "a call with timeout_ms = 1 was still running after {} ms; enforce timeout_ms with your own timer and answer DEADLINE_EXCEEDED",
                took.as_millis()
            ),
        ),
    }
}

/// Cancels the sample call while it runs (or just after it ended): `Cancel` must answer,
/// and the call's stream must end, within the grace.
async fn cancel_running(client: &Client, sample: &SampleCall) -> Finding {
    let call_id = format!("call_check_cancel_{}", std::process::id());
    let mut running = client.clone();
    let request = request(sample, &call_id, 30_000);
    let stream =
        tokio::spawn(
            async move { events(&mut running, request, DEADLINE_GRACE + RPC_BOUND).await },
        );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let started = Instant::now();
    let answer = tokio::time::timeout(
        RPC_BOUND,
        client.clone().cancel(pb::CancelRequest {
            call_id: call_id.clone(),
        }),
    )
    .await;
    let ended = tokio::time::timeout(DEADLINE_GRACE, stream).await;
    let took = started.elapsed().as_millis();
    match (answer, ended) {
        (Err(_), _) => Finding::failed("cancel", "no answer to Cancel of a running call"),
        (Ok(Err(status)), _) => Finding::failed("cancel", format!("Cancel failed: {status}")),
        (_, Err(_)) => Finding::failed(
            "cancel",
            format!("the call's stream was still open {took} ms after Cancel"),
        ),
        (Ok(Ok(response)), Ok(_)) => {
            let response = response.into_inner();
            if response.found && !response.stopped {
                Finding::failed(
                    "cancel",
                    "Cancel found the call but answered before it had stopped",
                )
            } else {
                Finding::ok(
                    "cancel",
                    format!(
                        "a running call was cancelled (found: {}) and its stream ended within {took} ms",
                        response.found
                    ),
                )
            }
        }
    }
}

async fn cancel(client: &mut Client) -> Finding {
    let request = pb::CancelRequest {
        call_id: format!("call_check_unknown_{}", std::process::id()),
    };
    match tokio::time::timeout(RPC_BOUND, client.cancel(request)).await {
        Err(_) => Finding::failed("cancel", "no answer to Cancel of an unknown call"),
        Ok(Err(status)) => Finding::failed("cancel", format!("Cancel failed: {status}")),
        Ok(Ok(response)) if !response.get_ref().found => {
            Finding::ok("cancel", "an unknown call is answered as not found")
        }
        Ok(Ok(_)) => Finding::failed("cancel", "an unknown call was reported as found"),
    }
}
