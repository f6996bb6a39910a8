//! The CLI clients: `airlock tools`, `airlock call`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::Connection;
use crate::config::Loaded;

/// Where to send requests and with which token.
struct Target {
    url: String,
    token: String,
}

impl Target {
    /// `--url`/`--token` (or `AIRLOCK_URL`/`AIRLOCK_TOKEN`), else `<data_dir>/endpoints.json`.
    fn resolve(connection: &Connection) -> anyhow::Result<Self> {
        let from_dir = || -> anyhow::Result<(String, Option<PathBuf>)> {
            let loaded = Loaded::load(
                connection.location.config.as_deref(),
                connection.location.data_dir.as_deref(),
            )?;
            let path = loaded.data_dir.join("endpoints.json");
            let text = std::fs::read_to_string(&path).with_context(|| {
                format!("cannot read {}; is `airlock up` running? Otherwise set AIRLOCK_URL and AIRLOCK_TOKEN", path.display())
            })?;
            let endpoints: Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", path.display()))?;
            let url = endpoints["http"]
                .as_str()
                .context("endpoints.json has no \"http\"")?
                .to_owned();
            Ok((url, endpoints["token_file"].as_str().map(PathBuf::from)))
        };
        let (url, token_file) = match &connection.url {
            Some(url) => (url.clone(), None),
            None => from_dir()?,
        };
        let token = match (&connection.token, token_file) {
            (Some(token), _) => token.clone(),
            (None, Some(file)) => std::fs::read_to_string(&file)
                .with_context(|| format!("cannot read token file {}", file.display()))?
                .trim()
                .to_owned(),
            (None, None) => bail!("no token: pass --token or set AIRLOCK_TOKEN"),
        };
        Ok(Self {
            url: url.trim_end_matches('/').to_owned(),
            token,
        })
    }

    fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the async runtime")
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> anyhow::Result<Value> {
        let response = request
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("cannot reach {}", self.url))?;
        let status = response.status();
        let body: Value = response.json().await.context("the response is not JSON")?;
        if !status.is_success() {
            let message = body["error"]["message"].as_str().unwrap_or("no message");
            bail!("{status}: {message}");
        }
        Ok(body)
    }
}

pub fn tools(connection: &Connection, raw: bool, format: &str) -> anyhow::Result<ExitCode> {
    let target = Target::resolve(connection)?;
    let body = Target::runtime()?.block_on(async {
        let client = reqwest::Client::new();
        target
            .send(client.get(format!("{}/v1/tools?format={format}", target.url)))
            .await
    })?;
    if raw {
        println!("{}", serde_json::to_string_pretty(&body)?);
        return Ok(ExitCode::SUCCESS);
    }
    for tool in body["tools"].as_array().into_iter().flatten() {
        let name = tool["name"]
            .as_str()
            .or_else(|| tool["function"]["name"].as_str())
            .unwrap_or("?");
        let description = tool["description"]
            .as_str()
            .or_else(|| tool["function"]["description"].as_str())
            .unwrap_or_default();
        let first_line = description.lines().next().unwrap_or_default();
        // An MCP server writes its tools' names and descriptions: shown, never obeyed
        // by the terminal.
        println!("{:<18} {}", shown(name), shown(first_line));
    }
    Ok(ExitCode::SUCCESS)
}

/// `airlock tools pins` and `airlock tools accept <name>`.
pub fn tool_pins(connection: &Connection, action: &crate::ToolsAction) -> anyhow::Result<ExitCode> {
    use crate::ToolsAction;
    let target = Target::resolve(connection)?;
    let runtime = Target::runtime()?;
    let client = reqwest::Client::new();
    match action {
        ToolsAction::Pins { json } => {
            let body = runtime
                .block_on(target.send(client.get(format!("{}/v1/tools/pins", target.url))))?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&body)?);
                return Ok(ExitCode::SUCCESS);
            }
            for pin in body["pins"].as_array().into_iter().flatten() {
                let short = |digest: &Value| {
                    digest
                        .as_str()
                        .map(|d| d.chars().take(12).collect::<String>())
                        .unwrap_or_default()
                };
                // Names and definitions come from a worker or an MCP server: escaped.
                let tool = pin["tool"]
                    .as_str()
                    .unwrap_or("?")
                    .escape_debug()
                    .to_string();
                match pin.get("pending").filter(|p| !p.is_null()) {
                    Some(pending) => println!(
                        "{tool:<32} HIDDEN  pinned {} changed to {} since {}: review with --json, then `airlock tools accept {tool} --digest <its pending digest>`",
                        short(&pin["pinned"]["digest"]),
                        short(&pending["digest"]),
                        pin["pending_since"].as_str().unwrap_or("?"),
                    ),
                    None => {
                        println!(
                            "{tool:<32} served  pinned {} ({})",
                            short(&pin["pinned"]["digest"]),
                            pin["accepted_by"].as_str().map_or(
                                "first seen".to_owned(),
                                |by| format!("accepted by {}", by.escape_debug())
                            ),
                        )
                    }
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        ToolsAction::Accept { name, digest } => {
            airlock_policy::validate_tool_name(name)?;
            let url = format!("{}/v1/tools/{}/accept", target.url, encoded(name));
            let request = match digest {
                Some(digest) => client
                    .post(url)
                    .json(&serde_json::json!({"digest": digest})),
                None => client.post(url),
            };
            let body = runtime.block_on(target.send(request))?;
            println!(
                "accepted {name}: pinned to digest {}; it is served as its worker lists it now",
                body["pin"]["pinned"]["digest"].as_str().unwrap_or("?"),
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// How often, at most, `airlock call` asks again while it follows a call: each
/// `GET /v1/calls/{id}?wait_ms=` waits this long for the call to end, so a long wait is
/// a few requests, not one that idles for an hour behind some proxy's timeout.
const FOLLOW_CHUNK_MS: u64 = 60_000;

/// Exit status of `airlock call` when the call has no result yet because `--wait` ran
/// out (it is still held for approval or still running): `EX_TEMPFAIL` of sysexits.h,
/// "try again later", distinct from the exit codes a shell command passes through.
const EXIT_NO_RESULT_YET: u8 = 75;
/// Exit status for a command that ran out of time, as `timeout(1)` reports it.
const EXIT_TIMED_OUT: u8 = 124;

/// `airlock call` options beyond the tool, its arguments, `--session` and `--json`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CallOptions {
    /// Stop waiting after this many seconds and exit 75 if the call has no result yet
    /// (it goes on: approve it later, fetch it with GET /v1/calls/{call_id}). Default:
    /// wait until it ends; a call held for approval ends when decided or expired.
    #[arg(long, value_name = "SECONDS")]
    pub wait: Option<f64>,
}

/// `airlock call <tool> '<json>'`. The request asks for `wait_ms: 0`, so it answers as
/// soon as the gate has checked the call: a held call is announced at once on stderr
/// with its approval id and the command that approves it, and then followed with
/// `GET /v1/calls/{id}?wait_ms=` until it ends (or `--wait` runs out). The result is
/// printed for a human (see [`Printer`]); `--json` prints the whole response in the
/// shape of `POST /v1/tool_calls`.
pub fn call(
    connection: &Connection,
    tool: &str,
    input: &str,
    session: Option<&str>,
    raw: bool,
    options: &CallOptions,
) -> anyhow::Result<ExitCode> {
    let input: Value = serde_json::from_str(input).context("the arguments are not valid JSON")?;
    if !input.is_object() {
        bail!("the arguments must be a JSON object, e.g. '{{\"path\": \"notes.txt\"}}'");
    }
    let deadline = match options.wait {
        None => None,
        Some(s) if s.is_finite() && s >= 0.0 => {
            Some(std::time::Instant::now() + std::time::Duration::from_secs_f64(s.min(1e9)))
        }
        Some(_) => bail!("--wait takes a number of seconds, 0 or more"),
    };
    let target = Target::resolve(connection)?;
    let mut request = json!({
        "wait_ms": 0,
        "tool_uses": [{"type": "tool_use", "id": "cli", "name": tool, "input": input}],
    });
    if let Some(session) = session {
        request["session_id"] = json!(session);
    }
    let printer = Printer::new();
    Target::runtime()?.block_on(async {
        let client = reqwest::Client::new();
        let body = target
            .send(
                client
                    .post(format!("{}/v1/tool_calls", target.url))
                    .json(&request),
            )
            .await?;
        let mut call = body["calls"][0].clone();
        let mut result = body["tool_results"].get(0).cloned();
        let call_id = call["call_id"].as_str().unwrap_or("?").to_owned();
        let mut announced = false;
        while result.is_none() {
            let status = call["status"].as_str().unwrap_or("unknown").to_owned();
            let approval = call["approval_id"].as_str().map(str::to_owned);
            if let (Some(approval), false) = (&approval, announced) {
                announced = true;
                let approve = approval_command(connection, "approve", approval);
                let deny = approval_command(connection, "deny", approval);
                let until = if deadline.is_some() {
                    "until --wait runs out"
                } else {
                    "Ctrl-C stops waiting, the call stays pending"
                };
                printer.note(&format!(
                    "airlock: call {call_id} ({tool}) is waiting for approval {approval}\n\
                     airlock: approve it with: {approve}\n\
                     airlock: or deny it with: {deny}\n\
                     airlock: waiting for the decision ({until})…\n"
                ));
            }
            let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                let mut message = format!(
                    "airlock: stopped waiting; call {call_id} is still {status}. It goes on: \
                     fetch it with GET /v1/calls/{call_id}\n"
                );
                if let Some(approval) = &approval {
                    message.push_str(&format!(
                        "airlock: it runs once approved: {}\n",
                        approval_command(connection, "approve", approval)
                    ));
                }
                printer.note(&message);
                if raw {
                    printer.out(&pretty(
                        &json!({"tool_results": [], "calls": [without_result(&call)]}),
                    ));
                }
                return Ok(ExitCode::from(EXIT_NO_RESULT_YET));
            }
            let wait_ms = left.map_or(FOLLOW_CHUNK_MS, |l| {
                (l.as_millis() as u64).clamp(1, FOLLOW_CHUNK_MS)
            });
            let url = format!(
                "{}/v1/calls/{}?wait_ms={wait_ms}",
                target.url,
                encoded(&call_id)
            );
            let detail = target
                .send(client.get(url))
                .await
                .with_context(|| format!("while waiting for call {call_id}"))?;
            result = detail.get("tool_result").cloned();
            call = without_result(&detail);
        }
        let result = result.unwrap_or(Value::Null);
        if raw {
            printer.out(&pretty(&json!({"tool_results": [result], "calls": [call]})));
            return Ok(exit_for(&result, None));
        }
        Ok(printer.result(&result))
    })
}

/// A `calls[]` entry from a `GET /v1/calls/{id}` body (which adds `tool` and
/// `tool_result`), so `--json` always prints the shape of `POST /v1/tool_calls`.
fn without_result(detail: &Value) -> Value {
    let mut call = detail.clone();
    if let Some(object) = call.as_object_mut() {
        object.remove("tool_result");
        object.remove("tool");
    }
    call
}

fn pretty(value: &Value) -> String {
    let mut text = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    text.push('\n');
    text
}

/// The exact command that decides `approval`, with the connection flags this
/// invocation was given on its command line (never the token itself).
fn approval_command(connection: &Connection, verb: &str, approval: &str) -> String {
    let mut words = vec![
        "airlock".to_owned(),
        "approvals".to_owned(),
        verb.to_owned(),
        approval.to_owned(),
    ];
    // A flag whose value came from the environment needs no repeating: the approver's
    // shell has the same variable.
    let from_flag = |var: &str, value: &str| std::env::var(var).ok().as_deref() != Some(value);
    if let Some(dir) = &connection.location.data_dir {
        let dir = dir.display().to_string();
        if from_flag("AIRLOCK_DATA_DIR", &dir) {
            words.extend(["--data-dir".to_owned(), dir]);
        }
    }
    if let Some(config) = &connection.location.config {
        let config = config.display().to_string();
        if from_flag("AIRLOCK_CONFIG", &config) {
            words.extend(["--config".to_owned(), config]);
        }
    }
    if let Some(url) = &connection.url
        && from_flag("AIRLOCK_URL", url)
    {
        words.extend(["--url".to_owned(), url.clone()]);
    }
    if let Some(token) = &connection.token
        && from_flag("AIRLOCK_TOKEN", token)
    {
        words.extend(["--token".to_owned(), "<token>".to_owned()]);
    }
    words
        .iter()
        .map(|w| shell_word(w))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `word` quoted for a POSIX shell when it needs it.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./:=@%+,".contains(c));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// The exit status for a final `tool_result`: a command's own status when the result
/// is a command's (`exit_code`, 128 + signal, 124 when it timed out), else 1 for an
/// error result and 0 otherwise.
fn exit_for(result: &Value, shell: Option<&ShellResult>) -> ExitCode {
    let is_error = result["is_error"].as_bool().unwrap_or(true);
    let shell = shell.cloned().or_else(|| ShellResult::from_result(result));
    if let Some(shell) = shell {
        if shell.timed_out {
            return ExitCode::from(EXIT_TIMED_OUT);
        }
        if let Some(signal) = shell.signal {
            return ExitCode::from(u8::try_from(128 + signal.clamp(0, 127)).unwrap_or(255));
        }
        if let Some(code) = shell.exit_code {
            return ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(255));
        }
    }
    if is_error {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// The parts of a command's result (`execute_shell`, or any tool answering the same
/// shape) that `airlock call` prints apart.
#[derive(Debug, Clone)]
struct ShellResult {
    stdout: String,
    stderr: String,
    exit_code: Option<i64>,
    signal: Option<i64>,
    timed_out: bool,
    stdout_truncated: bool,
    stderr_truncated: bool,
}

impl ShellResult {
    /// Recognised by shape — one text block holding an object with string `stdout` and
    /// `stderr` and an `exit_code` key — not by tool name, so tools of one's own that
    /// answer like `execute_shell` print like it.
    fn from_result(result: &Value) -> Option<Self> {
        let blocks = result["content"].as_array()?;
        let [block] = blocks.as_slice() else {
            return None;
        };
        let value: Value = serde_json::from_str(block["text"].as_str()?).ok()?;
        let object = value.as_object()?;
        if !object.contains_key("exit_code") {
            return None;
        }
        Some(Self {
            stdout: object.get("stdout")?.as_str()?.to_owned(),
            stderr: object.get("stderr")?.as_str()?.to_owned(),
            exit_code: object.get("exit_code").and_then(Value::as_i64),
            signal: object.get("signal").and_then(Value::as_i64),
            timed_out: object
                .get("timed_out")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            stdout_truncated: object
                .get("stdout_truncated")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            stderr_truncated: object
                .get("stderr_truncated")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        })
    }

    /// One line for stderr when the command did not simply succeed.
    fn summary(&self) -> Option<String> {
        let mut parts = Vec::new();
        if self.timed_out {
            parts.push("timed out".to_owned());
        }
        if let Some(signal) = self.signal {
            parts.push(format!("killed by signal {signal}"));
        } else if let Some(code) = self.exit_code.filter(|c| *c != 0) {
            parts.push(format!("exit code {code}"));
        } else if self.exit_code.is_none() && !self.timed_out {
            parts.push("no exit code".to_owned());
        }
        if self.stdout_truncated {
            parts.push("stdout truncated".to_owned());
        }
        if self.stderr_truncated {
            parts.push("stderr truncated".to_owned());
        }
        (!parts.is_empty()).then(|| format!("airlock: command {}\n", parts.join(", ")))
    }
}

/// Writes what `airlock call` prints. Text bound for a terminal has its control
/// characters escaped (all of C0 but newline and tab, DEL, and C1; a carriage return
/// only when no newline follows it): a tool's output is whatever the command or the web
/// page produced, and raw escape sequences could rewrite the screen, set the window
/// title or the clipboard. Output redirected to a file or a pipe is written unchanged,
/// so `airlock call … > out.txt` keeps the command's output as it was.
struct Printer {
    stdout_tty: bool,
    stderr_tty: bool,
}

impl Printer {
    fn new() -> Self {
        use std::io::IsTerminal;
        Self {
            stdout_tty: std::io::stdout().is_terminal(),
            stderr_tty: std::io::stderr().is_terminal(),
        }
    }

    fn out(&self, text: &str) {
        use std::io::Write;
        let text = if self.stdout_tty {
            for_terminal(text)
        } else {
            std::borrow::Cow::Borrowed(text)
        };
        let mut stdout = std::io::stdout().lock();
        // A closed pipe (`| head`) is the reader's choice, not an error of the call.
        let _ = stdout.write_all(text.as_bytes());
        let _ = stdout.flush();
    }

    fn note(&self, text: &str) {
        use std::io::Write;
        let text = if self.stderr_tty {
            for_terminal(text)
        } else {
            std::borrow::Cow::Borrowed(text)
        };
        let mut stderr = std::io::stderr().lock();
        let _ = stderr.write_all(text.as_bytes());
        let _ = stderr.flush();
    }

    /// Prints a final `tool_result` for a human and returns the exit status: a command's
    /// stdout to stdout and stderr to stderr (plus a summary line when it failed), a
    /// JSON document pretty-printed, other text as it is.
    fn result(&self, result: &Value) -> ExitCode {
        if let Some(shell) = ShellResult::from_result(result) {
            self.out(&shell.stdout);
            self.note(&shell.stderr);
            if let Some(summary) = shell.summary() {
                self.note(&summary);
            }
            return exit_for(result, Some(&shell));
        }
        for block in result["content"].as_array().into_iter().flatten() {
            let text = block["text"].as_str().unwrap_or_default();
            match serde_json::from_str::<Value>(text) {
                Ok(document @ (Value::Object(_) | Value::Array(_))) => {
                    self.out(&pretty(&document));
                }
                _ => {
                    let mut line = text.to_owned();
                    if !line.ends_with('\n') {
                        line.push('\n');
                    }
                    self.out(&line);
                }
            }
        }
        exit_for(result, None)
    }
}

/// `text` with its control characters escaped for a terminal (see [`Printer`]).
fn for_terminal(text: &str) -> std::borrow::Cow<'_, str> {
    let needs = |c: char, next: Option<char>| {
        c.is_control() && c != '\n' && c != '\t' && !(c == '\r' && next == Some('\n'))
    };
    let mut chars = text.chars().peekable();
    let mut clean = true;
    while let Some(c) = chars.next() {
        if needs(c, chars.peek().copied()) {
            clean = false;
            break;
        }
    }
    if clean {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if needs(c, chars.peek().copied()) {
            let code = u32::from(c);
            if code < 0x80 {
                out.push_str(&format!("\\x{code:02x}"));
            } else {
                out.push_str(&format!("\\u{{{code:x}}}"));
            }
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Most pages `airlock approvals list` reads (100 approvals each).
const MAX_APPROVAL_PAGES: usize = 10_000;

/// `airlock approvals list|approve|deny`.
pub fn approvals(
    connection: &Connection,
    action: &crate::ApprovalAction,
) -> anyhow::Result<ExitCode> {
    use crate::ApprovalAction;
    let target = Target::resolve(connection)?;
    let runtime = Target::runtime()?;
    let client = reqwest::Client::new();
    match action {
        ApprovalAction::List { all, json } => {
            let status = if *all { "" } else { "status=pending&" };
            // The server answers a page at a time; every page is fetched, in order, and
            // each is printed as it arrives (`--json` prints them as one list).
            let printer = Printer::new();
            let mut listed = Vec::new();
            let mut count = 0usize;
            let mut after: Option<String> = None;
            for _ in 0..MAX_APPROVAL_PAGES {
                let cursor = after
                    .as_deref()
                    .map(|c| format!("&after={}", encoded(c)))
                    .unwrap_or_default();
                let url = format!("{}/v1/approvals?{status}limit=100{cursor}", target.url);
                let body = runtime.block_on(target.send(client.get(url)))?;
                let approvals = body["approvals"].as_array().cloned().unwrap_or_default();
                count += approvals.len();
                if *json {
                    listed.extend(approvals);
                } else {
                    // Tool names and inputs come from a model: escaped like `airlock call`
                    // output.
                    for a in approvals {
                        printer.out(&format!(
                            "{}  {:<8} {:<14} by {:<12} session {:<10} expires {}\n    {}\n    input_sha256 {}\n",
                            a["approval_id"].as_str().unwrap_or("?"),
                            a["status"].as_str().unwrap_or("?"),
                            a["tool"].as_str().unwrap_or("?"),
                            a["principal"].as_str().unwrap_or("?"),
                            a["session_id"].as_str().unwrap_or("-"),
                            a["expires_at"].as_str().unwrap_or("?"),
                            a["input"],
                            a["input_sha256"].as_str().unwrap_or("?"),
                        ));
                    }
                }
                match body["next_cursor"].as_str() {
                    // A cursor that does not move would page forever.
                    Some(next) if after.as_deref() == Some(next) => {
                        bail!("the server answered the same page twice (cursor {next})")
                    }
                    Some(next) => after = Some(next.to_owned()),
                    None => {
                        after = None;
                        break;
                    }
                }
            }
            if after.is_some() {
                bail!("more than {MAX_APPROVAL_PAGES} pages of approvals; decide some first");
            }
            if *json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({"approvals": listed}))?
                );
                return Ok(ExitCode::SUCCESS);
            }
            if count == 0 {
                println!("no {}approvals", if *all { "" } else { "pending " });
            }
        }
        ApprovalAction::Approve {
            id,
            reason,
            input_sha256,
            ..
        }
        | ApprovalAction::Deny {
            id,
            reason,
            input_sha256,
        } => {
            let (verb, remember) = match action {
                ApprovalAction::Approve { remember, .. } => ("approve", remember.as_deref()),
                _ => ("deny", None),
            };
            let body =
                json!({"reason": reason, "input_sha256": input_sha256, "remember": remember});
            let url = format!("{}/v1/approvals/{}/{verb}", target.url, encoded(id));
            let decided = runtime.block_on(target.send(client.post(url).json(&body)))?;
            println!(
                "{} {} (call {})",
                decided["approval_id"].as_str().unwrap_or(id),
                decided["status"].as_str().unwrap_or("?"),
                decided["call_id"].as_str().unwrap_or("?")
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `airlock audit tail|verify`.
pub fn audit(connection: &Connection, action: &crate::AuditAction) -> anyhow::Result<ExitCode> {
    use crate::AuditAction;
    let target = Target::resolve(connection)?;
    let runtime = Target::runtime()?;
    let client = reqwest::Client::new();
    match action {
        AuditAction::Tail {
            limit,
            session,
            follow,
            json,
        } => {
            let session = session
                .as_ref()
                .map(|s| format!("&session_id={}", encoded(s)))
                .unwrap_or_default();
            let url = format!("{}/v1/audit?latest=true&limit={limit}{session}", target.url);
            let body = runtime.block_on(target.send(client.get(url)))?;
            let mut last_seq = 0;
            for event in body["events"].as_array().into_iter().flatten() {
                last_seq = print_audit_event(event, *json).max(last_seq);
            }
            if !*follow {
                return Ok(ExitCode::SUCCESS);
            }
            // Polled rather than pushed: `after` is the store's own cursor, so nothing
            // appended between two polls is missed, whichever replica appended it.
            runtime.block_on(async {
                loop {
                    let url = format!(
                        "{}/v1/audit?after={last_seq}&limit={AUDIT_FOLLOW_PAGE}{session}",
                        target.url
                    );
                    let body = target.send(client.get(url)).await?;
                    for event in body["events"].as_array().into_iter().flatten() {
                        last_seq = print_audit_event(event, *json).max(last_seq);
                    }
                    // A page cut short by its byte budget still has more after it.
                    if body["next_after"].is_null() {
                        tokio::time::sleep(AUDIT_FOLLOW_POLL).await;
                    }
                }
            })
        }
        AuditAction::Verify => {
            let report = runtime
                .block_on(target.send(client.get(format!("{}/v1/audit/verify", target.url))))?;
            let ok = report["ok"].as_bool().unwrap_or(false);
            if ok {
                println!(
                    "audit log intact: {} records, hash chain valid",
                    report["records"]
                );
                Ok(ExitCode::SUCCESS)
            } else {
                println!(
                    "audit log TAMPERED: first bad record {} ({})",
                    report["first_bad_seq"],
                    report["reason"].as_str().unwrap_or("no reason given")
                );
                Ok(ExitCode::FAILURE)
            }
        }
    }
}

/// Events asked for per poll of `audit tail --follow`.
const AUDIT_FOLLOW_PAGE: usize = 500;
/// How long `audit tail --follow` waits when it has caught up.
const AUDIT_FOLLOW_POLL: std::time::Duration = std::time::Duration::from_millis(250);

/// Prints one audit event (a JSON line, or a line for people) and returns its seq.
fn print_audit_event(event: &serde_json::Value, json: bool) -> u64 {
    use std::io::Write;
    if json {
        println!("{event}");
    } else {
        println!(
            "{:>6} {} {:<18} {:<10} {} {}",
            event["seq"],
            event["ts"].as_str().unwrap_or("?"),
            event["kind"].as_str().unwrap_or("?"),
            event["principal"].as_str().unwrap_or("-"),
            event["call_id"].as_str().unwrap_or("-"),
            event["data"],
        );
    }
    // A consumer reading a pipe sees each event as it comes.
    let _ = std::io::stdout().flush();
    event["seq"].as_u64().unwrap_or(0)
}

/// `airlock agent "<prompt>"`: posts to `/v1/agent/runs` and prints the events as they
/// arrive — the model's text as it streams, each tool call and result on one line.
/// Exits 1 when the run fails.
pub fn agent(
    connection: &Connection,
    prompt: &str,
    session: Option<&str>,
    max_turns: Option<u32>,
    raw: bool,
) -> anyhow::Result<ExitCode> {
    use airlock_orchestrator::agent::sse::SseParser;
    use std::io::Write;

    let target = Target::resolve(connection)?;
    let mut body = json!({"prompt": prompt});
    if let Some(session) = session {
        body["session_id"] = json!(session);
    }
    if let Some(n) = max_turns {
        body["max_turns"] = json!(n);
    }
    Target::runtime()?.block_on(async {
        let client = reqwest::Client::new();
        let mut response = client
            .post(format!("{}/v1/agent/runs", target.url))
            .bearer_auth(&target.token)
            .json(&body)
            .send()
            .await
            .with_context(|| format!("cannot reach {}", target.url))?;
        let status = response.status();
        if !status.is_success() {
            let body: Value = response.json().await.unwrap_or(Value::Null);
            let message = body["error"]["message"].as_str().unwrap_or("no message");
            bail!("{status}: {message}");
        }
        let mut parser = SseParser::default();
        let mut printer = AgentPrinter::default();
        let mut stdout = std::io::stdout();
        loop {
            let chunk = response
                .chunk()
                .await
                .context("the event stream broke off")?;
            let events = match &chunk {
                Some(chunk) => parser.feed(chunk)?,
                None => parser.finish()?.into_iter().collect(),
            };
            for event in events {
                let data: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
                let kind = event.event.unwrap_or_default();
                if raw {
                    println!("{}", json!({"kind": kind, "data": data}));
                } else {
                    printer.print(&kind, &data);
                }
                let _ = stdout.flush();
                match kind.as_str() {
                    "run.completed" => return Ok(ExitCode::SUCCESS),
                    "run.failed" => return Ok(ExitCode::FAILURE),
                    _ => {}
                }
            }
            if chunk.is_none() {
                bail!("the event stream ended before the run did");
            }
        }
    })
}

/// Turns agent events into readable lines.
#[derive(Default)]
struct AgentPrinter {
    /// Model text was printed without its line ending yet.
    mid_line: bool,
}

/// `text` for a terminal: control characters but newlines and tabs escaped (`\u{1b}`),
/// so that text from a model, a provider or an MCP server cannot move the cursor,
/// retitle the window or rewrite what was printed before.
fn shown(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() && !matches!(c, '\n' | '\t') {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    out
}

fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() > max {
        let cut: String = flat.chars().take(max).collect();
        format!("{cut}…")
    } else {
        flat
    }
}

impl AgentPrinter {
    fn end_line(&mut self) {
        if self.mid_line {
            println!();
            self.mid_line = false;
        }
    }

    fn print(&mut self, kind: &str, data: &Value) {
        // The model and the provider write these: escape sequences are shown, not
        // obeyed by the operator's terminal.
        let s = |k: &str| shown(data[k].as_str().unwrap_or("?"));
        match kind {
            "run.started" => {
                eprintln!(
                    "[run {} · session {} · {} {}]",
                    s("run_id"),
                    s("session_id"),
                    s("provider"),
                    s("model")
                );
            }
            "model.text" => {
                let text = shown(data["text"].as_str().unwrap_or_default());
                print!("{text}");
                self.mid_line = !text.ends_with('\n');
            }
            "tool.call" => {
                self.end_line();
                let input = if data["input"].is_null() {
                    format!("(invalid arguments: {})", s("input_error"))
                } else {
                    data["input"].to_string()
                };
                println!("→ {} {}", s("name"), one_line(&input, 200));
            }
            "tool.pending_approval" => {
                self.end_line();
                println!(
                    "… {} waits for approval: airlock approvals approve {}",
                    s("name"),
                    s("approval_id")
                );
            }
            "tool.result" => {
                self.end_line();
                let mark = if data["is_error"].as_bool().unwrap_or(true) {
                    "✗"
                } else {
                    "✓"
                };
                println!(
                    "{mark} {} {}: {}",
                    s("name"),
                    s("status"),
                    one_line(data["text"].as_str().unwrap_or_default(), 200)
                );
            }
            "run.completed" => {
                self.end_line();
                let truncated = if data["truncated"].as_bool().unwrap_or(false) {
                    " · output cut off at max_tokens"
                } else {
                    ""
                };
                eprintln!(
                    "[completed: {} · {} turns · {} tool calls · {} in / {} out tokens{truncated}]",
                    s("stop_reason"),
                    data["turns"],
                    data["tool_calls"],
                    data["usage"]["input_tokens"],
                    data["usage"]["output_tokens"],
                );
            }
            "run.failed" => {
                self.end_line();
                eprintln!(
                    "airlock: agent run failed ({}): {}",
                    s("reason"),
                    s("message")
                );
            }
            _ => {}
        }
    }
}

/// `text` as one URL path segment or query value: every byte but the unreserved ones
/// (RFC 3986) percent-encoded, so that an id or a session given on the command line
/// cannot add a path segment or a query parameter (`apr_x/approve?` as the id of a
/// `deny` would otherwise have approved).
fn encoded(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_and_sessions_go_into_urls_encoded() {
        assert_eq!(super::encoded("apr_0a-Z.~"), "apr_0a-Z.~");
        assert_eq!(super::encoded("apr_x/approve?"), "apr_x%2Fapprove%3F");
        assert_eq!(super::encoded("s&limit=1"), "s%26limit%3D1");
        assert_eq!(super::encoded("é"), "%C3%A9");
    }

    #[test]
    fn text_from_servers_is_shown_not_obeyed() {
        assert_eq!(super::shown("a\u{1b}]0;x\u{7}b"), "a\\u{1b}]0;x\\u{7}b");
        assert_eq!(super::shown("line\n\tnext"), "line\n\tnext");
        assert_eq!(super::shown("\r\u{9b}2J"), "\\r\\u{9b}2J");
    }

    use super::*;

    #[test]
    fn control_characters_are_escaped_for_a_terminal_and_text_is_kept() {
        assert!(matches!(
            for_terminal("plain\ttext\nand more\r\n"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(
            for_terminal("\u{1b}]0;title\u{7}\u{1b}[31mred"),
            "\\x1b]0;title\\x07\\x1b[31mred"
        );
        assert_eq!(
            for_terminal("a\rb\u{7f}\u{9b}c\u{0}"),
            "a\\x0db\\x7f\\u{9b}c\\x00"
        );
        assert_eq!(for_terminal("é — ok"), "é — ok");
    }

    fn shell_result(body: Value, is_error: bool) -> Value {
        json!({"type": "tool_result", "tool_use_id": "cli", "is_error": is_error,
               "content": [{"type": "text", "text": body.to_string()}]})
    }

    #[test]
    fn a_commands_status_becomes_the_exit_status() {
        let base =
            json!({"stdout": "", "stderr": "", "exit_code": 0, "signal": null, "timed_out": false});
        let with = |patch: Value| {
            let mut body = base.clone();
            for (k, v) in patch.as_object().unwrap() {
                body[k] = v.clone();
            }
            body
        };
        let code = |body: Value, is_error| exit_for(&shell_result(body, is_error), None);
        assert_eq!(code(base.clone(), false), ExitCode::SUCCESS);
        assert_eq!(code(with(json!({"exit_code": 3})), true), ExitCode::from(3));
        assert_eq!(
            code(with(json!({"exit_code": null, "signal": 9})), true),
            ExitCode::from(137)
        );
        assert_eq!(
            code(
                with(json!({"exit_code": null, "signal": 9, "timed_out": true})),
                true
            ),
            ExitCode::from(124)
        );
        let plain = json!({"type": "tool_result", "is_error": true, "content": [{"type": "text", "text": "denied by policy"}]});
        assert_eq!(exit_for(&plain, None), ExitCode::FAILURE);

        let failed = ShellResult::from_result(&shell_result(
            with(json!({"exit_code": 2, "stdout_truncated": true})),
            true,
        ))
        .unwrap();
        assert_eq!(
            failed.summary().as_deref(),
            Some("airlock: command exit code 2, stdout truncated\n")
        );
        let ok = ShellResult::from_result(&shell_result(base, false)).unwrap();
        assert_eq!(ok.summary(), None);
        // A JSON object without the shape of a command's result is not one.
        assert!(ShellResult::from_result(&shell_result(json!({"rows": []}), false)).is_none());
    }

    #[test]
    fn printed_commands_quote_what_a_shell_would_split() {
        assert_eq!(shell_word("apr_0123abc"), "apr_0123abc");
        assert_eq!(shell_word("/tmp/data dir"), "'/tmp/data dir'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word("<token>"), "'<token>'");
        assert_eq!(shell_word(""), "''");
    }
}
