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
        println!("{name:<18} {first_line}");
    }
    Ok(ExitCode::SUCCESS)
}

pub fn call(
    connection: &Connection,
    tool: &str,
    input: &str,
    session: Option<&str>,
    raw: bool,
) -> anyhow::Result<ExitCode> {
    let input: Value = serde_json::from_str(input).context("the arguments are not valid JSON")?;
    if !input.is_object() {
        bail!("the arguments must be a JSON object, e.g. '{{\"path\": \"notes.txt\"}}'");
    }
    let target = Target::resolve(connection)?;
    let mut request =
        json!({"tool_uses": [{"type": "tool_use", "id": "cli", "name": tool, "input": input}]});
    if let Some(session) = session {
        request["session_id"] = json!(session);
    }
    let body = Target::runtime()?.block_on(async {
        let client = reqwest::Client::new();
        target
            .send(
                client
                    .post(format!("{}/v1/tool_calls", target.url))
                    .json(&request),
            )
            .await
    })?;
    if raw {
        println!("{}", serde_json::to_string_pretty(&body)?);
    }
    let Some(result) = body["tool_results"].get(0) else {
        let call = &body["calls"][0];
        let status = call["status"].as_str().unwrap_or("unknown");
        let call_id = call["call_id"].as_str().unwrap_or("?");
        eprintln!("call {call_id} is {status}; fetch it later with GET /v1/calls/{call_id}");
        if let Some(approval) = call["approval_id"].as_str() {
            eprintln!("it waits for a human: airlock approvals approve {approval}");
        }
        return Ok(ExitCode::from(2));
    };
    if !raw {
        for block in result["content"].as_array().into_iter().flatten() {
            println!("{}", block["text"].as_str().unwrap_or_default());
        }
    }
    Ok(if result["is_error"].as_bool().unwrap_or(false) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

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
            let query = if *all { "" } else { "?status=pending" };
            let body = runtime
                .block_on(target.send(client.get(format!("{}/v1/approvals{query}", target.url))))?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&body)?);
                return Ok(ExitCode::SUCCESS);
            }
            let approvals = body["approvals"].as_array().cloned().unwrap_or_default();
            if approvals.is_empty() {
                println!("no {}approvals", if *all { "" } else { "pending " });
            }
            for a in approvals {
                println!(
                    "{}  {:<8} {:<14} by {:<12} session {:<10} expires {}\n    {}",
                    a["approval_id"].as_str().unwrap_or("?"),
                    a["status"].as_str().unwrap_or("?"),
                    a["tool"].as_str().unwrap_or("?"),
                    a["principal"].as_str().unwrap_or("?"),
                    a["session_id"].as_str().unwrap_or("-"),
                    a["expires_at"].as_str().unwrap_or("?"),
                    a["input"],
                );
            }
        }
        ApprovalAction::Approve { id, reason } | ApprovalAction::Deny { id, reason } => {
            let verb = if matches!(action, ApprovalAction::Approve { .. }) {
                "approve"
            } else {
                "deny"
            };
            let body = json!({"reason": reason});
            let url = format!("{}/v1/approvals/{id}/{verb}", target.url);
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
        AuditAction::Tail { limit, session } => {
            let mut url = format!("{}/v1/audit?latest=true&limit={limit}", target.url);
            if let Some(session) = session {
                url.push_str(&format!("&session_id={session}"));
            }
            let body = runtime.block_on(target.send(client.get(url)))?;
            for event in body["events"].as_array().into_iter().flatten() {
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
            Ok(ExitCode::SUCCESS)
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
        let s = |k: &str| data[k].as_str().unwrap_or("?").to_owned();
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
                let text = data["text"].as_str().unwrap_or_default();
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
