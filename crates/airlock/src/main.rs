//! `airlock`: the launcher (`up`), the component servers (`serve …`) and the CLI clients.
#![forbid(unsafe_code)]

mod client;
mod config;
mod demo;
mod launcher;
mod listen_fds;
mod logging;
mod sandbox_cli;
mod serve;
mod signals;
mod volumes;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "airlock",
    version,
    about = "Runs the tool calls of LLM agents, sandboxed and audited"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where a command finds its configuration and state.
#[derive(Debug, clap::Args, Clone)]
struct Location {
    /// Configuration file (airlock.toml); every key has a default.
    #[arg(long, env = "AIRLOCK_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// State directory: sockets, token, workspaces, store. Default ~/.airlock.
    #[arg(long, env = "AIRLOCK_DATA_DIR", global = true)]
    data_dir: Option<PathBuf>,
}

/// How a client reaches a running Airlock.
#[derive(Debug, clap::Args, Clone)]
struct Connection {
    #[command(flatten)]
    location: Location,
    /// Base URL of the orchestrator's HTTP API (default: from <data_dir>/endpoints.json).
    #[arg(long, env = "AIRLOCK_URL", global = true)]
    url: Option<String>,
    /// Bearer token (default: the token file named in <data_dir>/endpoints.json).
    #[arg(long, env = "AIRLOCK_TOKEN", hide_env_values = true, global = true)]
    token: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start the orchestrator and every worker locally, with embedded defaults.
    Up {
        #[command(flatten)]
        location: Location,
        /// Overrides [orchestrator] http_listen (host:port; port 0 picks a free one).
        #[arg(long, env = "AIRLOCK_HTTP_LISTEN")]
        http_listen: Option<String>,
        /// Overrides [orchestrator] grpc_listen (host:port; port 0 picks a free one).
        #[arg(long, env = "AIRLOCK_GRPC_LISTEN")]
        grpc_listen: Option<String>,
    },
    /// Run one component (for Kubernetes and other supervisors).
    Serve {
        #[command(subcommand)]
        component: serve::Component,
        #[command(flatten)]
        location: Location,
    },
    /// List the tools you may call; review and accept changed tool definitions.
    Tools {
        #[command(subcommand)]
        action: Option<ToolsAction>,
        #[command(flatten)]
        connection: Connection,
        /// Print the raw JSON catalog.
        #[arg(long)]
        json: bool,
        /// Catalog shape with --json: anthropic, openai or mcp.
        #[arg(long, default_value = "anthropic")]
        format: String,
    },
    /// Run one command in the shell worker's sandbox and print the isolation report.
    Sandbox {
        #[command(subcommand)]
        action: SandboxAction,
    },
    /// Human decisions on calls that wait for approval.
    Approvals {
        #[command(subcommand)]
        action: ApprovalAction,
        #[command(flatten)]
        connection: Connection,
    },
    /// Read and check the audit log.
    Audit {
        #[command(subcommand)]
        action: AuditAction,
        #[command(flatten)]
        connection: Connection,
    },
    /// Call one tool: airlock call read_file '{"path": "notes.txt"}'
    Call {
        tool: String,
        /// Arguments as a JSON object.
        #[arg(default_value = "{}")]
        input: String,
        #[command(flatten)]
        connection: Connection,
        /// Session whose workspace the call uses.
        #[arg(long)]
        session: Option<String>,
        /// Print the whole JSON response instead of the result text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        options: client::CallOptions,
    },
    /// Tools for those who write workers.
    Worker {
        #[command(subcommand)]
        action: WorkerAction,
        #[command(flatten)]
        location: Location,
    },
    /// The Cedar policy's view of the catalog.
    Policy {
        #[command(subcommand)]
        action: PolicyAction,
        #[command(flatten)]
        location: Location,
    },
    /// Development certificates for mutual TLS between components.
    Certs {
        #[command(subcommand)]
        action: CertsAction,
    },
    /// Run the agent loop with the configured model provider ([agent] in airlock.toml).
    Agent {
        prompt: String,
        #[command(flatten)]
        connection: Connection,
        /// Session whose workspace the run's calls use (default: a fresh one).
        #[arg(long)]
        session: Option<String>,
        /// Fewer model turns than [agent] max_turns.
        #[arg(long)]
        max_turns: Option<u32>,
        /// Print each event as one JSON line instead.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum ApprovalAction {
    /// Pending approvals (all with --all).
    List {
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// Approve a pending call; it then runs exactly once.
    Approve {
        id: String,
        #[arg(long)]
        reason: Option<String>,
        /// The approval's input_sha256 as listed: refused (409) if the call's input
        /// is not the one it digests.
        #[arg(long)]
        input_sha256: Option<String>,
        /// `session`: later calls of the same tool with the same input in that session
        /// run without a new approval, until this one's expiry or the session's end.
        #[arg(long, value_parser = ["session"])]
        remember: Option<String>,
    },
    /// Deny a pending call.
    Deny {
        id: String,
        #[arg(long)]
        reason: Option<String>,
        /// The approval's input_sha256 as listed: refused (409) if the call's input
        /// is not the one it digests.
        #[arg(long)]
        input_sha256: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum ToolsAction {
    /// The pinned definitions of the tools external workers and MCP servers list, and
    /// the changes that keep a tool hidden until accepted (admin role).
    Pins {
        #[arg(long)]
        json: bool,
    },
    /// Serve a tool whose definition changed since it was pinned, as it is now (admin
    /// role; audited as tool_accepted).
    Accept {
        name: String,
        /// The pending definition's digest, as reviewed (`airlock tools pins --json`):
        /// refused if the definition changed again since.
        #[arg(long)]
        digest: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum AuditAction {
    /// The latest audit events; with --follow, then each event as it is appended.
    Tail {
        #[arg(long, default_value_t = 20)]
        limit: u32,
        #[arg(long)]
        session: Option<String>,
        /// Keep printing events as they are appended, until interrupted.
        #[arg(long)]
        follow: bool,
        /// One JSON object per line: the whole record, with its seq, prev_hash and hash,
        /// so that a consumer can check the chain.
        #[arg(long)]
        json: bool,
    },
    /// Check the hash chain; exits 1 when a record was edited, deleted, inserted or moved.
    Verify,
}

#[derive(Debug, Subcommand)]
enum WorkerAction {
    /// Whether a worker honours the airlock.v1.ToolWorker contract: health, ListTools
    /// (names, descriptions, schemas, what policies can see), and with --call one
    /// Execute, its deadline and Cancel. Dialed as the orchestrator dials (under [tls]).
    Check {
        /// unix:/path.sock, http://host:port (with [tls] insecure_plaintext) or https://host:port.
        endpoint: String,
        /// A tool to call for the Execute and deadline checks.
        #[arg(long)]
        call: Option<String>,
        /// Its arguments as a JSON object.
        #[arg(long, default_value = "{}")]
        input: String,
    },
}

#[derive(Debug, Subcommand)]
enum PolicyAction {
    /// Print the Cedar schema policies are validated against: the embedded one, and an
    /// action for every declared tool ([[tools]], tool_packs) with its typed arguments.
    Schema,
}

#[derive(Debug, Subcommand)]
enum CertsAction {
    /// Write a development CA (ca.crt, ca.key) and a certificate and key per component
    /// (orchestrator, worker-shell, worker-fs, worker-http, worker-db), each with its
    /// name as a DNS SAN. For labs, compose files and tests; production issues its own.
    Init {
        /// Directory to write into (created with mode 0700); existing files are never
        /// overwritten.
        #[arg(long)]
        out: PathBuf,
        /// An extra DNS name or IP address (repeatable): `NAME` for the orchestrator's
        /// certificate (the name callers reach it by), `COMPONENT=NAME` for one
        /// component's (e.g. `worker-fs=fs-1.internal`). Never on every certificate: a
        /// name is an identity.
        #[arg(long = "san")]
        sans: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
enum SandboxAction {
    /// airlock sandbox run [--profile strict|standard] -- <cmd…>
    Run {
        #[command(flatten)]
        location: Location,
        /// Isolation profile: strict (every layer) or standard (no namespaces).
        #[arg(long)]
        profile: Option<String>,
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = logging::init(serve::service(&cli.command).as_ref()) {
        eprintln!("airlock: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Up {
            location,
            http_listen,
            grpc_listen,
        } => launcher::up(
            &location,
            launcher::Listen {
                http: http_listen,
                grpc: grpc_listen,
            },
        ),
        Command::Serve {
            component,
            location,
        } => serve::run(component, &location),
        Command::Sandbox {
            action:
                SandboxAction::Run {
                    location,
                    profile,
                    command,
                },
        } => sandbox_cli::run(&location, profile.as_deref(), &command),
        Command::Approvals { action, connection } => client::approvals(&connection, &action),
        Command::Audit { action, connection } => client::audit(&connection, &action),
        Command::Tools {
            action: Some(action),
            connection,
            ..
        } => client::tool_pins(&connection, &action),
        Command::Tools {
            action: None,
            connection,
            json,
            format,
        } => client::tools(&connection, json, &format),
        Command::Call {
            tool,
            input,
            connection,
            session,
            json,
            options,
        } => client::call(
            &connection,
            &tool,
            &input,
            session.as_deref(),
            json,
            &options,
        ),
        Command::Policy {
            action: PolicyAction::Schema,
            location,
        } => policy_schema(&location),
        Command::Worker {
            action:
                WorkerAction::Check {
                    endpoint,
                    call,
                    input,
                },
            location,
        } => worker_check(&location, &endpoint, call, &input),
        Command::Certs {
            action: CertsAction::Init { out, sans },
        } => certs_init(&out, &sans),
        Command::Agent {
            prompt,
            connection,
            session,
            max_turns,
            json,
        } => client::agent(&connection, &prompt, session.as_deref(), max_turns, json),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("airlock: {}", error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// `airlock policy schema`: the schema as the orchestrator builds it from this config.
fn policy_schema(location: &Location) -> anyhow::Result<ExitCode> {
    use anyhow::Context as _;
    let loaded = config::Loaded::load(location.config.as_deref(), location.data_dir.as_deref())?;
    let mut tools = loaded.tool_extensions()?;
    // External workers' tools, and MCP servers' tools (from the worker that serves
    // them: the shell worker for stdio servers, the http worker for Streamable HTTP
    // ones), come from ListTools, as the orchestrator derives them.
    let mut groups: Vec<(String, String)> = loaded
        .config
        .workers
        .iter()
        .filter(|w| !airlock_policy::authz::BUILT_IN_GROUPS.contains(&w.group.as_str()))
        .map(|w| {
            w.endpoints
                .first()
                .map(|e| (w.group.clone(), e.clone()))
                .with_context(|| format!("worker group {:?} has no endpoints", w.group))
        })
        .collect::<anyhow::Result<_>>()?;
    let mcp: Vec<airlock_policy::McpServerPolicy> = loaded
        .config
        .mcp_servers
        .iter()
        .map(airlock_worker::mcp::McpServerEntry::policy)
        .collect();
    for (group, serves) in [
        (
            "shell",
            airlock_worker::mcp::McpServerEntry::is_stdio as fn(&_) -> bool,
        ),
        ("http", airlock_worker::mcp::McpServerEntry::is_http),
    ] {
        if !loaded.config.mcp_servers.iter().any(serves) {
            continue;
        }
        let endpoint = match loaded.config.workers.iter().find(|w| w.group == group) {
            Some(workers) => workers.endpoints.first().cloned(),
            None => Some(format!("unix:{}", loaded.socket_path(group).display())),
        };
        groups.extend(endpoint.map(|endpoint| (group.to_owned(), endpoint)));
    }
    if !groups.is_empty() {
        let tls = loaded.worker_tls()?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the async runtime")?;
        for (group, endpoint) in groups {
            let listed = runtime
                .block_on(airlock_orchestrator::worker_check::list_tools(
                    &endpoint, &tls,
                ))
                .with_context(|| format!("the {group} worker's tools"))?;
            let external = !airlock_policy::authz::BUILT_IN_GROUPS.contains(&group.as_str());
            for definition in listed {
                let server = mcp.iter().find(|s| s.owns(&definition.name));
                if external || server.is_some() {
                    tools.push(airlock_policy::authz::ToolExtension {
                        group: group.clone(),
                        approval: server.and_then(|s| s.approval_reason(&definition)),
                        definition,
                        network: None,
                    });
                }
            }
        }
    }
    let extensions = airlock_policy::authz::ToolExtensions::new(&tools)?
        .with_shell_network(loaded.config.sandbox.network.as_str());
    print!("{}", airlock_policy::authz::schema_text(&extensions));
    Ok(ExitCode::SUCCESS)
}

/// `airlock worker check`: one line per finding; exit 1 when any failed.
fn worker_check(
    location: &Location,
    endpoint: &str,
    call: Option<String>,
    input: &str,
) -> anyhow::Result<ExitCode> {
    use anyhow::Context as _;
    let loaded = config::Loaded::load(location.config.as_deref(), location.data_dir.as_deref())?;
    let tls = loaded.worker_tls()?;
    let sample = match call {
        Some(tool) => Some(airlock_orchestrator::worker_check::SampleCall {
            tool,
            arguments: serde_json::from_str(input).context("--input is not JSON")?,
        }),
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let findings = runtime.block_on(airlock_orchestrator::worker_check::check(
        endpoint,
        &tls,
        sample.as_ref(),
    ))?;
    for finding in &findings {
        let mark = if finding.ok { "ok  " } else { "FAIL" };
        println!("{mark} {:<9} {}", finding.check, finding.detail);
    }
    Ok(if findings.iter().all(|f| f.ok) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn certs_init(out: &std::path::Path, sans: &[String]) -> anyhow::Result<ExitCode> {
    let written = airlock_tls::devpki::init(out, sans)?;
    for file in &written.files {
        println!("{}", file.display());
    }
    eprintln!(
        "development certificates written (keys mode 0600), one per component, each \
         valid for its own name and every --san"
    );
    Ok(ExitCode::SUCCESS)
}

/// The error and its causes on one line, `outer: inner: …`, like `{:#}` — except that a
/// cause whose text the message before it already holds is left out. Many library errors
/// both interpolate their source into their own message and return it as `source()`, and
/// `{:#}` would then print `…: Operation not permitted (os error 1): Operation not
/// permitted (os error 1)`.
fn error_chain(error: &anyhow::Error) -> String {
    let mut out = String::new();
    let mut previous: Option<String> = None;
    for cause in error.chain() {
        let text = cause.to_string();
        let repeated = previous
            .as_deref()
            .is_some_and(|p| text.is_empty() || p.contains(text.as_str()));
        if !repeated {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        previous = Some(text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    /// An error that both shows its source in its message and returns it as `source()`,
    /// the shape that printed causes twice.
    #[derive(Debug)]
    struct Interpolating(std::io::Error);

    impl std::fmt::Display for Interpolating {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cannot drop capabilities: {}", self.0)
        }
    }

    impl std::error::Error for Interpolating {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    fn eperm() -> std::io::Error {
        std::io::Error::from_raw_os_error(libc::EPERM)
    }

    #[test]
    fn a_source_already_in_the_message_is_printed_once() {
        let error = anyhow::Error::new(Interpolating(eperm()))
            .context("the orchestrator cannot confine itself; refusing to start");
        let printed = error_chain(&error);
        let os = eperm().to_string();
        assert_eq!(
            printed,
            format!(
                "the orchestrator cannot confine itself; refusing to start: \
                 cannot drop capabilities: {os}"
            )
        );
        assert_eq!(printed.matches(os.as_str()).count(), 1, "{printed}");
    }

    #[test]
    fn distinct_causes_are_all_printed_in_order() {
        let error = anyhow::Error::new(eperm())
            .context("cannot create data dir /x")
            .context("cannot start");
        assert_eq!(
            error_chain(&error),
            format!("cannot start: cannot create data dir /x: {}", eperm())
        );
    }

    #[test]
    fn a_single_error_is_its_message() {
        assert_eq!(
            error_chain(&anyhow::anyhow!("no such tool")),
            "no such tool"
        );
    }
}
