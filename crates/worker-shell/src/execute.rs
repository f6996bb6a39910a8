//! The `execute_shell` tool.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use airlock_policy::{ToolAnnotations, ToolDefinition, ToolOutcome};
use airlock_sandbox::{Cancel, CommandSpec, OutputSink, PROXY_PORT, RunOutcome, Sandbox, Stream};
use airlock_telemetry::{CallSpan, KeyValue, SpanKind, SpanStart};
use airlock_worker::{CallContext, OutputStream, Tool};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::config::ShellConfig;
use crate::egress::{self, EgressLog, EgressRules};
use crate::workspace;

pub struct ExecuteShell {
    config: ShellConfig,
    sandbox: Arc<Sandbox>,
    /// The egress proxy's rules when the sandboxes have `network = "proxy"`.
    egress: Option<Arc<EgressRules>>,
}

impl ExecuteShell {
    pub fn new(
        config: ShellConfig,
        sandbox: Arc<Sandbox>,
        egress: Option<Arc<EgressRules>>,
    ) -> Self {
        Self {
            config,
            sandbox,
            egress,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Arguments {
    command: Option<String>,
    argv: Option<Vec<String>>,
    cwd: Option<String>,
    stdin: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    timeout_seconds: Option<f64>,
}

/// Sets the sandbox's cancel flag when dropped, so a call whose future is dropped (the
/// caller went away, the deadline passed) still kills its sandbox.
struct CancelOnDrop(Cancel);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

#[airlock_worker::async_trait]
impl Tool for ExecuteShell {
    fn definition(&self) -> ToolDefinition {
        let max = self.config.max_timeout_seconds;
        let network = match self.egress {
            None => "there is no network",
            Some(_) => {
                "the network is only HTTP(S), through a proxy (set in HTTP_PROXY and \
                 HTTPS_PROXY) that reaches the hosts the operator allows; `egress` in the result \
                 lists each attempt, and a refused one's reason"
            }
        };
        ToolDefinition {
            name: "execute_shell".into(),
            title: "Run a shell command".into(),
            description: format!(
                "Run a command in a fresh, isolated Linux sandbox. The session's workspace is \
                 the working directory, at /workspace; /tmp is small and private; {network}. \
                 Give either `command` (run by /bin/sh -c) or `argv`. Returns JSON with \
                 exit_code, signal, stdout, stderr, truncation flags, timed_out, duration_ms, \
                 usage and the isolation report. Output beyond {} KiB per stream is cut.",
                self.config.model_output_bytes / 1024
            ),
            input_schema: json!({
                "type": "object",
                "additionalProperties": false,
                "properties": {
                    "command": {"type": "string", "minLength": 1, "maxLength": 131072,
                        "description": "Shell command line, run as /bin/sh -c '<command>'."},
                    "argv": {"type": "array", "minItems": 1, "maxItems": 4096,
                        "items": {"type": "string", "maxLength": 131072},
                        "description": "Program and arguments, run without a shell."},
                    "cwd": {"type": "string", "maxLength": 4096,
                        "description": "Working directory relative to the workspace (default: its root)."},
                    "stdin": {"type": "string", "maxLength": 1048576, "description": "Text fed to standard input."},
                    "env": {"type": "object", "maxProperties": 64,
                        "additionalProperties": {"type": "string", "maxLength": 4096},
                        "description": format!("Environment variables to set; allowed names: {}.", self.config.allowed_env.join(", "))},
                    "timeout_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": max,
                        "description": format!("Wall-clock limit (default {}, at most {max}).", self.config.timeout_seconds)}
                },
                "oneOf": [{"required": ["command"]}, {"required": ["argv"]}]
            }),
            annotations: ToolAnnotations {
                destructive: true,
                open_world: false,
                ..Default::default()
            },
        }
    }

    async fn execute(&self, arguments: Value, ctx: CallContext) -> ToolOutcome {
        let args: Arguments = match serde_json::from_value(arguments) {
            Ok(a) => a,
            Err(e) => return ToolOutcome::error(format!("invalid arguments: {e}")),
        };
        if let Err(message) = ensure_volume(&self.config, &ctx).await {
            return ToolOutcome::error(message);
        }
        match self.spec(args, &ctx) {
            Ok(spec) => run(&self.config, &self.sandbox, spec, ctx, self.egress.clone()).await,
            Err(message) => ToolOutcome::error(message),
        }
    }
}

/// A call's sandbox timeout — `requested` seconds, at most `[sandbox]
/// max_timeout_seconds`, and never past the worker's own deadline for the call — and its
/// workspace, created if new.
pub(crate) fn timeout_and_workspace(
    config: &ShellConfig,
    ctx: &CallContext,
    requested: f64,
) -> Result<(Duration, std::path::PathBuf), String> {
    let timeout = Duration::from_secs_f64(requested.min(config.max_timeout_seconds as f64)).min(
        ctx.deadline
            .saturating_duration_since(std::time::Instant::now()),
    );
    let workspace = workspace::prepare(
        &config.workspaces_root,
        &ctx.principal,
        ctx.session_id.as_str(),
    )
    .map_err(|e| e.to_string())?;
    Ok((timeout, workspace))
}

/// Mounts the call's workspace volume first when per-workspace quotas are on.
pub(crate) async fn ensure_volume(config: &ShellConfig, ctx: &CallContext) -> Result<(), String> {
    let Some(volumes) = config.volumes.clone() else {
        return Ok(());
    };
    let root = config.workspaces_root.clone();
    let (principal, session) = (ctx.principal.clone(), ctx.session_id.as_str().to_owned());
    // A workspace mounted for an earlier call: three `stat`s, no need to leave this thread.
    if volumes.ready(&root, &principal, &session) {
        return Ok(());
    }
    // Creating a volume runs mkfs and mount in the broker: off the async threads.
    let ensured =
        tokio::task::spawn_blocking(move || volumes.ensure(&root, &principal, &session)).await;
    match ensured {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(format!("the workspace could not be prepared: {e}")),
    }
}

/// The variables that announce the egress proxy; `NO_PROXY` empty, so that nothing
/// goes around it (nothing could: the sandbox has no other way out).
fn proxy_env() -> Vec<(String, String)> {
    let url = format!("http://127.0.0.1:{PROXY_PORT}");
    let mut env: Vec<(String, String)> = ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"]
        .into_iter()
        .map(|name| (name.to_owned(), url.clone()))
        .collect();
    env.extend(["NO_PROXY", "no_proxy"].map(|name| (name.to_owned(), String::new())));
    env
}

/// What a call's sandbox hands over while it runs: output chunks to the call's stream,
/// and (`network = "proxy"`) its listener to the call's proxy.
struct CallSink {
    ctx: CallContext,
    proxy: Option<tokio::sync::oneshot::Sender<std::net::TcpListener>>,
    /// When the sandbox's wall clock (or the call's deadline, if sooner) ends: a slow
    /// reader of the stream is not waited for past it.
    until: std::time::Instant,
    /// The run's cancel: once it is set the stream is not waited for either.
    cancel: Cancel,
}

impl OutputSink for CallSink {
    fn chunk(&mut self, stream: Stream, data: &[u8]) {
        let stream = match stream {
            Stream::Stdout => OutputStream::Stdout,
            Stream::Stderr => OutputStream::Stderr,
        };
        let cancel = &self.cancel;
        self.ctx
            .output_until(stream, data.to_vec(), self.until, || cancel.is_cancelled());
    }

    fn proxy_listener(&mut self, listener: std::net::TcpListener) {
        // A tool that may not use the proxy drops it: its connections are refused.
        if let Some(proxy) = self.proxy.take() {
            let _ = proxy.send(listener);
        }
    }
}

/// The call's proxy: serves the sandbox's listener from when the sandbox hands it over
/// until the run ends, under `rules`.
struct CallProxy {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Option<EgressLog>>,
}

impl CallProxy {
    fn start(
        rules: Arc<EgressRules>,
    ) -> (Self, tokio::sync::oneshot::Sender<std::net::TcpListener>) {
        let (listener_tx, listener_rx) = tokio::sync::oneshot::channel();
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                let listener = listener_rx.await.ok()?;
                Some(egress::serve(listener, rules, stop).await)
            }
        });
        (Self { stop, task }, listener_tx)
    }

    /// Ends every connection and answers what was attempted.
    async fn finish(self) -> Option<EgressLog> {
        self.stop.cancel();
        self.task.await.ok().flatten()
    }
}

/// Runs one command in a fresh sandbox, streaming its output, and renders the result
/// every shell-run tool returns (execute_shell and the declared command tools alike).
/// With `egress`, the sandbox reaches what those rules allow through the call's own
/// proxy, and the result lists every attempt.
pub(crate) async fn run(
    config: &ShellConfig,
    sandbox: &Arc<Sandbox>,
    mut spec: CommandSpec,
    ctx: CallContext,
    egress: Option<Arc<EgressRules>>,
) -> ToolOutcome {
    let (proxy, proxy_tx) = match egress {
        Some(rules) => {
            spec.env.extend(proxy_env());
            let (proxy, tx) = CallProxy::start(rules);
            (Some(proxy), Some(tx))
        }
        None => (None, None),
    };
    let workspace = spec.workspace.clone();
    let cancel = Cancel::new();
    let guard = CancelOnDrop(cancel.clone());
    let watcher = {
        let token = ctx.cancel.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            token.cancelled().await;
            cancel.cancel();
        })
    };
    let sandbox = sandbox.clone();
    let mut sink = CallSink {
        until: ctx.deadline.min(std::time::Instant::now() + spec.timeout),
        ctx: ctx.clone(),
        proxy: proxy_tx,
        cancel: cancel.clone(),
    };
    // The sandbox's span, a child of the worker's execute span: its isolation level and
    // how the command ended; never the command.
    let (level, network) = (sandbox.report().level.as_str(), sandbox.report().network);
    let span = CallSpan::under_current(|| SpanStart {
        name: "sandbox.run".into(),
        kind: SpanKind::Internal,
        attributes: vec![
            KeyValue::new("airlock.isolation", level),
            KeyValue::new("airlock.sandbox.network", network),
        ],
    });
    let run = tokio::task::spawn_blocking(move || sandbox.run(&spec, &mut sink, &cancel)).await;
    if let Ok(Ok(outcome)) = &run {
        if let Some(code) = outcome.exit_code {
            span.set("process.exit.code", || i64::from(code).into());
        }
        let timed_out = outcome.timed_out;
        span.set("airlock.sandbox.timed_out", || timed_out.into());
        if outcome.exit_code != Some(0) {
            span.fail();
        }
    } else {
        span.fail();
    }
    span.end();
    watcher.abort();
    drop(guard);
    let egress = match proxy {
        Some(proxy) => proxy.finish().await,
        None => None,
    };
    match run {
        Ok(Ok(outcome)) => {
            config.metrics.ran(&outcome);
            render(config, outcome, &workspace, egress)
        }
        Ok(Err(e)) => ToolOutcome::error(format!("the sandbox could not run the command: {e}")),
        Err(e) => ToolOutcome::error(format!("the sandbox thread failed: {e}")),
    }
}

impl ExecuteShell {
    fn spec(&self, args: Arguments, ctx: &CallContext) -> Result<CommandSpec, String> {
        let argv = match (args.command, args.argv) {
            (Some(command), None) => vec!["/bin/sh".to_owned(), "-c".to_owned(), command],
            (None, Some(argv)) if !argv.is_empty() => argv,
            (Some(_), Some(_)) => return Err("give either command or argv, not both".into()),
            _ => {
                return Err(
                    "give command (a shell command line) or argv (a program and its arguments)"
                        .into(),
                );
            }
        };
        if argv.iter().any(|a| a.contains('\0')) {
            return Err("arguments may not contain NUL bytes".into());
        }
        let cwd = match &args.cwd {
            Some(cwd) => workspace::checked_cwd(cwd)?,
            None => None,
        };
        for name in args.env.keys() {
            if !self
                .config
                .allowed_env
                .iter()
                .any(|allowed| allowed == name)
            {
                return Err(format!(
                    "environment variable {name:?} is not allowed; allowed names: {}",
                    self.config.allowed_env.join(", ")
                ));
            }
        }
        let requested = args
            .timeout_seconds
            .unwrap_or(self.config.timeout_seconds as f64);
        if !(requested.is_finite() && requested > 0.0) {
            return Err("timeout_seconds must be a positive number".into());
        }
        let (timeout, workspace) = timeout_and_workspace(&self.config, ctx, requested)?;
        Ok(CommandSpec {
            argv,
            workspace,
            cwd,
            stdin: args.stdin.unwrap_or_default().into_bytes(),
            env: args.env.into_iter().collect(),
            timeout,
        })
    }
}

fn render(
    config: &ShellConfig,
    outcome: RunOutcome,
    workspace: &std::path::Path,
    egress: Option<EgressLog>,
) -> ToolOutcome {
    let cap = config.model_output_bytes;
    let (stdout, stdout_cut) = clip(&outcome.stdout, cap);
    let (stderr, stderr_cut) = clip(&outcome.stderr, cap);
    let mut isolation = serde_json::to_value(&outcome.isolation).unwrap_or(Value::Null);
    if let Some(report) = isolation.as_object_mut() {
        let quota = config.volumes.as_ref().map(|v| v.quota());
        report.insert(
            "workspace_quota".into(),
            quota.map_or(
                Value::Null,
                |q| json!({"bytes": q.bytes, "inodes": q.inodes}),
            ),
        );
    }
    // Whether the command left its workspace without room: its own stderr says
    // "No space left on device"; this says why, in one place the model can read.
    let workspace_full = airlock_worker::volumes::is_exhausted(workspace);
    let mut body = json!({
        "exit_code": outcome.exit_code,
        "signal": outcome.signal,
        "stdout": stdout,
        "stderr": stderr,
        "stdout_truncated": outcome.stdout_truncated || stdout_cut,
        "stderr_truncated": outcome.stderr_truncated || stderr_cut,
        "timed_out": outcome.timed_out,
        "duration_ms": outcome.duration.as_millis() as u64,
        "usage": outcome.usage,
        "isolation": isolation,
        "workspace_full": workspace_full,
    });
    if workspace_full {
        body["note"] = Value::String(airlock_worker::volumes::WORKSPACE_FULL.to_owned());
    }
    // Every attempt through the proxy: in the result for the model, and in the isolation
    // report, which the orchestrator audits with the call's completion.
    if let Some(log) = egress {
        let record = json!({"attempts": log.attempts, "dropped": log.dropped});
        body["egress"] = record.clone();
        if let Some(report) = isolation.as_object_mut() {
            report.insert("egress".into(), record);
        }
    }
    ToolOutcome {
        is_error: outcome.exit_code != Some(0),
        content: vec![body.to_string()],
        isolation: Some(isolation),
        timed_out: outcome.timed_out,
    }
}

/// The first `cap` bytes as text (never cutting a UTF-8 sequence in half), and whether
/// it was cut.
fn clip(bytes: &[u8], cap: usize) -> (String, bool) {
    let cut = bytes.len() > cap;
    let mut end = bytes.len().min(cap);
    // Step back over continuation bytes so the cut falls on a character boundary.
    while cut && end > 0 && bytes.get(end).is_some_and(|b| b & 0xC0 == 0x80) {
        end -= 1;
    }
    (String::from_utf8_lossy(&bytes[..end]).into_owned(), cut)
}

#[cfg(test)]
mod tests {
    use super::clip;

    #[test]
    fn clip_respects_char_boundaries() {
        assert_eq!(clip(b"hello", 10), ("hello".to_owned(), false));
        assert_eq!(clip(b"hello", 3), ("hel".to_owned(), true));
        let text = "é".repeat(3); // 6 bytes
        assert_eq!(clip(text.as_bytes(), 3), ("é".to_owned(), true));
        assert_eq!(clip(&[0xff, 0x41], 10).0, "\u{fffd}A");
    }
}
