//! Default limits pinned by the design; every one is configurable.

use serde::{Deserialize, Serialize};

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;
pub const GIB: u64 = 1024 * MIB;

/// Request and per-call limits enforced at the orchestrator and the workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Each worker's memory ceiling (DESIGN §16), enforced by the kernel as the
    /// worker's `RLIMIT_DATA`; 0 sets none (e.g. where the pod's cgroup limits it).
    pub worker_memory_bytes: u64,
    /// Largest accepted HTTP request body.
    pub max_request_bytes: u64,
    /// Largest accepted arguments object of one tool call (serialized JSON).
    pub max_argument_bytes: u64,
    /// Most tool uses accepted in one request.
    pub max_tool_uses_per_request: usize,
    /// Deadline of one call when the tool does not say otherwise.
    pub default_call_timeout_ms: u64,
    /// Upper bound of any call's deadline.
    pub max_call_timeout_ms: u64,
    /// How long `POST /v1/tool_calls` waits for results when `wait_ms` is absent.
    pub default_wait_ms: u64,
    /// How long an MCP `tools/call` waits for a call held for approval before it answers
    /// the `isError` result naming the approval. Kept below the usual MCP client request
    /// timeouts (5 s in openai-agents, 60 s in MCP Inspector), so the client reads how to
    /// approve instead of timing out and abandoning the call.
    pub mcp_wait_ms: u64,
    /// Connections each front door (HTTP, gRPC) holds open at once; more wait in the
    /// listen backlog until one closes. Lowered at start when the file-descriptor limit
    /// cannot hold both front doors' connections.
    pub max_connections: usize,
    /// How long a connection may take to deliver what the server waits for before it is
    /// closed. HTTP: a complete request head, counted from when the connection is ready
    /// for one (just accepted, or its previous response sent), so one timer closes slow
    /// headers and idle keep-alive connections alike. gRPC: the client's HTTP/2 preface,
    /// counted from accept. 0 turns the timeout off.
    pub header_read_timeout_ms: u64,
    /// Bytes of finished calls' results the orchestrator keeps in memory to answer
    /// `GET /v1/calls/{id}` and late waiters (DESIGN §15); older calls are answered from
    /// the store. Whatever the call rate, memory for results stays under this.
    pub result_memory_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            worker_memory_bytes: GIB,
            max_request_bytes: 10 * MIB,
            max_argument_bytes: 4 * MIB,
            max_tool_uses_per_request: 64,
            default_call_timeout_ms: 30_000,
            max_call_timeout_ms: 600_000,
            default_wait_ms: 60_000,
            mcp_wait_ms: 3_000,
            max_connections: 1024,
            header_read_timeout_ms: 10_000,
            result_memory_bytes: 64 * MIB,
        }
    }
}
