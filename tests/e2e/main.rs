//! Black-box tests: start `airlock up` on a temp data dir and drive it over HTTP and
//! gRPC exactly as a user would.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed expectation is a failed test"
)]

mod adversarial;
mod adversarial_paths;
mod adversarial_policy;
mod adversarial_service;
mod adversarial_workers;
mod agent;
mod api_contract;
mod as_user;
mod bound_approvals;
mod claims;
mod cli;
mod console;
mod declared_tools;
mod egress;
mod external_workers;
mod front_doors;
mod fs_tools;
mod gate;
mod grpc_api;
mod held_calls;
mod http_api;
mod http_tools;
mod mcp;
mod mcp_http;
mod mcp_servers;
mod mtls;
mod net_db;
mod observability;
mod ordinary_user;
mod replicas;
mod shell;
mod spread;
mod supervision;
mod support;
mod traces;
mod traversal;
mod workspace_quota;
