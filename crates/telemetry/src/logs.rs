//! An OTLP logs client for streams of records Airlock builds itself (the audit log's
//! `[audit] export`): one `ExportLogsServiceRequest` per batch, over `http/protobuf`
//! (`POST <endpoint>/v1/logs`) or `grpc` (`LogsService/Export`).
//!
//! It does not go through the OpenTelemetry SDK's log pipeline: the caller keeps the
//! queue, so that what is sent, retried, counted and dropped is decided in one place.

use std::time::Duration;

use opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest;
use opentelemetry_proto::tonic::collector::logs::v1::logs_service_client::LogsServiceClient;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::logs::v1::{LogRecord, ResourceLogs, ScopeLogs, SeverityNumber};
use opentelemetry_proto::tonic::resource::v1::Resource;
use prost::Message as _;

use crate::{Protocol, TelemetryError};

/// One log record to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// When the event happened.
    pub time_unix_nano: u64,
    /// `event.name`, e.g. `airlock.audit`.
    pub event_name: String,
    /// The record's body (Airlock sends the audit record's JSON).
    pub body: String,
    pub attributes: Vec<(String, Attribute)>,
}

/// An attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Attribute {
    Text(String),
    Int(i64),
}

/// Why a batch was not accepted; the caller retries or drops it.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("cannot reach the OTLP logs endpoint {endpoint}: {reason}")]
    Unreachable { endpoint: String, reason: String },
    #[error("the OTLP logs endpoint {endpoint} refused the batch: {reason}")]
    Refused { endpoint: String, reason: String },
}

/// Where records go.
#[derive(Debug, Clone)]
pub struct LogsClient {
    target: Target,
    endpoint: String,
    resource: Resource,
    scope: InstrumentationScope,
}

#[derive(Debug, Clone)]
enum Target {
    Http {
        client: reqwest::Client,
        url: String,
    },
    Grpc(LogsServiceClient<tonic::transport::Channel>),
}

impl LogsClient {
    /// A client for `endpoint` (the collector's base URL, `http://host:port`; the
    /// `http/protobuf` path `/v1/logs` is added), sending as `service_name` under the
    /// instrumentation scope `scope`. Needs the async runtime (the gRPC channel's
    /// worker starts on it).
    pub fn new(
        endpoint: &str,
        protocol: Protocol,
        timeout: Duration,
        service_name: &str,
        scope: &str,
    ) -> Result<Self, TelemetryError> {
        crate::export::check_endpoint("[audit] export.endpoint", endpoint)?;
        let base = endpoint.trim().trim_end_matches('/');
        let target = match protocol {
            Protocol::HttpProtobuf => Target::Http {
                client: reqwest::Client::builder()
                    .timeout(timeout)
                    .no_proxy()
                    .build()
                    .map_err(|e| TelemetryError::Exporter(e.to_string()))?,
                url: format!("{base}/v1/logs"),
            },
            Protocol::Grpc => {
                let channel = tonic::transport::Endpoint::from_shared(base.to_owned())
                    .map_err(|e| TelemetryError::Variable {
                        variable: "[audit] export.endpoint",
                        value: endpoint.to_owned(),
                        reason: e.to_string(),
                    })?
                    .timeout(timeout)
                    .connect_timeout(timeout)
                    .connect_lazy();
                Target::Grpc(LogsServiceClient::new(channel))
            }
        };
        Ok(Self {
            target,
            endpoint: base.to_owned(),
            resource: Resource {
                attributes: vec![text("service.name", service_name)],
                dropped_attributes_count: 0,
                entity_refs: Vec::new(),
            },
            scope: InstrumentationScope {
                name: scope.to_owned(),
                version: String::new(),
                attributes: Vec::new(),
                dropped_attributes_count: 0,
            },
        })
    }

    /// Sends one batch; `Ok` once the collector accepted it.
    pub async fn send(&self, records: &[Record]) -> Result<(), SendError> {
        let request = self.request(records);
        match &self.target {
            Target::Http { client, url } => {
                let response = client
                    .post(url)
                    .header(http::header::CONTENT_TYPE, "application/x-protobuf")
                    .body(request.encode_to_vec())
                    .send()
                    .await
                    .map_err(|e| SendError::Unreachable {
                        endpoint: url.clone(),
                        reason: error_chain(&e),
                    })?;
                let status = response.status();
                if status.is_success() {
                    return Ok(());
                }
                let body = response.bytes().await.unwrap_or_default();
                Err(SendError::Refused {
                    endpoint: url.clone(),
                    reason: format!(
                        "HTTP {status}: {}",
                        String::from_utf8_lossy(&body[..body.len().min(512)])
                    ),
                })
            }
            Target::Grpc(client) => {
                let mut client = client.clone();
                match client.export(request).await {
                    Ok(_) => Ok(()),
                    Err(status) if status.code() == tonic::Code::Unavailable => {
                        Err(SendError::Unreachable {
                            endpoint: self.endpoint.clone(),
                            reason: status.message().to_owned(),
                        })
                    }
                    Err(status) => Err(SendError::Refused {
                        endpoint: self.endpoint.clone(),
                        reason: format!("{:?}: {}", status.code(), status.message()),
                    }),
                }
            }
        }
    }

    fn request(&self, records: &[Record]) -> ExportLogsServiceRequest {
        let observed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        let log_records = records
            .iter()
            .map(|r| LogRecord {
                time_unix_nano: r.time_unix_nano,
                observed_time_unix_nano: observed,
                severity_number: SeverityNumber::Info as i32,
                severity_text: "INFO".to_owned(),
                body: Some(AnyValue {
                    value: Some(any_value::Value::StringValue(r.body.clone())),
                }),
                attributes: r
                    .attributes
                    .iter()
                    .map(|(key, value)| match value {
                        Attribute::Text(v) => text(key, v),
                        Attribute::Int(v) => KeyValue {
                            key: key.clone(),
                            value: Some(AnyValue {
                                value: Some(any_value::Value::IntValue(*v)),
                            }),
                        },
                    })
                    .collect(),
                dropped_attributes_count: 0,
                flags: 0,
                trace_id: Vec::new(),
                span_id: Vec::new(),
                event_name: r.event_name.clone(),
            })
            .collect();
        ExportLogsServiceRequest {
            resource_logs: vec![ResourceLogs {
                resource: Some(self.resource.clone()),
                scope_logs: vec![ScopeLogs {
                    scope: Some(self.scope.clone()),
                    log_records,
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            }],
        }
    }
}

fn text(key: &str, value: &str) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value.to_owned())),
        }),
    }
}

/// An error and its sources, on one line (reqwest's own message says little).
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
