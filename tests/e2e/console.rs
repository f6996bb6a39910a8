//! The approvals console, `/ui` (DESIGN §14): its headers, sign-in, CSRF and role
//! checks over plain HTTP, then the whole console in headless Chromium driven by
//! Selenium (tests/e2e/console.py), whose decisions are checked here through the API.

use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::{Airlock, listed_approval, principals_config_with_tokens, send_as as send};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/e2e/console.py");
const SCREENSHOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/console.png");
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'";

/// Each principal's token, `<name>-console-token` as [`start_with`] configures it.
const TOKENS: [(&str, &str); 4] = [
    ("alice", "alice-console-token"),
    ("bob", "bob-console-token"),
    ("carol", "carol-console-token"),
    ("root", "root-console-token"),
];

fn token(name: &str) -> &'static str {
    TOKENS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, t)| *t)
        .expect("a test principal")
}

/// An agent (alice), an approver (bob), carol who is both, an admin (root); a requester
/// may not approve their own call.
async fn start() -> Airlock {
    start_with("").await
}

/// [`start`], with `extra` added to `[approvals]`.
async fn start_with(extra: &str) -> Airlock {
    let config = principals_config_with_tokens(
        &[
            ("alice", &["agent"]),
            ("bob", &["approver"]),
            ("carol", &["agent", "approver"]),
            ("root", &["admin"]),
        ],
        "console-token",
        &format!("[approvals]\ndistinct_approver = true\n{extra}\n"),
    );
    Airlock::start_with(&config).await
}

/// A client that keeps redirects as they are (the cookie is on the 303).
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client")
}

fn form(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={}", encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

async fn post_form(
    airlock: &Airlock,
    path: &str,
    cookie: Option<&str>,
    body: String,
    origin: Option<&str>,
) -> reqwest::Response {
    let mut request = client()
        .post(format!("{}{path}", airlock.url))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body);
    if let Some(cookie) = cookie {
        request = request.header("cookie", cookie);
    }
    if let Some(origin) = origin {
        request = request.header("origin", origin);
    }
    request.send().await.expect("send")
}

/// Signs in with `token`: the session cookie as a `Cookie` header value.
async fn sign_in(airlock: &Airlock, token: &str) -> String {
    let response = post_form(airlock, "/ui/login", None, form(&[("token", token)]), None).await;
    assert_eq!(response.status(), 303);
    assert_eq!(response.headers()["location"], "/ui");
    let set_cookie = response.headers()["set-cookie"]
        .to_str()
        .expect("ASCII")
        .to_owned();
    let attributes: Vec<&str> = set_cookie.split(';').map(str::trim).collect();
    for wanted in ["Path=/ui", "HttpOnly", "SameSite=Strict"] {
        assert!(attributes.contains(&wanted), "{set_cookie}");
    }
    let pair = attributes[0];
    assert!(
        !pair.contains(token),
        "the cookie holds the token as typed: {pair}"
    );
    pair.to_owned()
}

async fn page(
    airlock: &Airlock,
    path: &str,
    cookie: Option<&str>,
) -> (u16, String, reqwest::header::HeaderMap) {
    let mut request = client().get(format!("{}{path}", airlock.url));
    if let Some(cookie) = cookie {
        request = request.header("cookie", cookie);
    }
    let response = request.send().await.expect("send");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (status, response.text().await.expect("body"), headers)
}

fn assert_console_headers(headers: &reqwest::header::HeaderMap, what: &str) {
    let header = |name: &str| {
        headers
            .get(name)
            .unwrap_or_else(|| panic!("{what}: no {name} header"))
            .to_str()
            .expect("ASCII")
            .to_owned()
    };
    assert_eq!(header("content-security-policy"), CSP, "{what}");
    assert_eq!(header("x-frame-options"), "DENY", "{what}");
    assert_eq!(header("x-content-type-options"), "nosniff", "{what}");
    assert_eq!(header("referrer-policy"), "no-referrer", "{what}");
    assert_eq!(header("cache-control"), "no-store", "{what}");
}

/// No token, in any spelling the console could leak it in, is in `body`.
fn assert_no_token(body: &str, what: &str) {
    for (_, token) in TOKENS {
        let hex: String = token.bytes().map(|b| format!("{b:02x}")).collect();
        assert!(!body.contains(token), "{what} holds a token");
        assert!(!body.contains(&hex), "{what} holds a token (hex)");
    }
}

/// The value of the first `name="csrf"` field in `body`.
fn csrf(body: &str) -> String {
    let at =
        body.find(r#"name="csrf" value=""#).expect("a csrf field") + r#"name="csrf" value=""#.len();
    body[at..].split('"').next().expect("value").to_owned()
}

async fn propose(airlock: &Airlock, who: &str, session: &str, tool: &str, input: Value) -> Value {
    let body = json!({"session_id": session, "wait_ms": 0,
        "tool_uses": [{"type": "tool_use", "id": "t1", "name": tool, "input": input}]});
    let (status, body, _) = send(
        airlock,
        token(who),
        reqwest::Method::POST,
        "/v1/tool_calls",
        Some(body),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let call = body["calls"][0].clone();
    assert_eq!(call["status"], "pending_approval", "{body}");
    call
}

async fn approval(airlock: &Airlock, approval_id: &str) -> Value {
    listed_approval(airlock, token("root"), approval_id).await
}

/// Headers, sign-in, the cookie, CSRF, origin and role checks, and the live stream,
/// over plain HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn console_headers_sign_in_csrf_and_roles() {
    let mut airlock = start().await;

    // Signed out: the sign-in page, with the console's headers; the script too.
    let (status, body, headers) = page(&airlock, "/ui", None).await;
    assert_eq!(status, 200);
    assert!(body.contains(r#"name="token""#), "{body}");
    assert!(
        body.contains(r#"<script src="/ui/static/console.js" defer>"#),
        "{body}"
    );
    assert_console_headers(&headers, "the sign-in page");
    let (status, script, headers) = page(&airlock, "/ui/static/console.js", None).await;
    assert_eq!(status, 200);
    assert!(script.contains("EventSource"), "{script}");
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/javascript")
    );
    assert_console_headers(&headers, "console.js");
    // A token in the URL signs nobody in.
    let (_, body, _) = page(&airlock, &format!("/ui?token={}", token("bob")), None).await;
    assert!(!body.contains("Signed in as"), "{body}");

    // A wrong token: 401, and the page does not repeat it.
    let response = post_form(
        &airlock,
        "/ui/login",
        None,
        form(&[("token", "not-a-token-xyz")]),
        None,
    )
    .await;
    assert_eq!(response.status(), 401);
    assert!(response.headers().get("set-cookie").is_none());
    let body = response.text().await.unwrap();
    assert!(
        body.contains("not valid") && !body.contains("not-a-token-xyz"),
        "{body}"
    );
    // Another site's sign-in form is refused.
    let response = post_form(
        &airlock,
        "/ui/login",
        None,
        form(&[("token", token("bob"))]),
        Some("http://evil.example"),
    )
    .await;
    assert_eq!(response.status(), 403);

    // A pending write_file, seen by the approver with its buttons (DESIGN §14 names).
    let held = propose(
        &airlock,
        "alice",
        "s1",
        "write_file",
        json!({"path": "a.txt", "content": "hi\n"}),
    )
    .await;
    let approval_id = held["approval_id"].as_str().unwrap();
    let bob = sign_in(&airlock, token("bob")).await;
    let (status, body, headers) = page(&airlock, "/ui", Some(&bob)).await;
    assert_eq!(status, 200);
    assert_console_headers(&headers, "the console");
    assert!(body.contains("Signed in as <strong>bob</strong>"), "{body}");
    assert!(
        body.contains(&format!(r#"data-approval-id="{approval_id}""#)),
        "{body}"
    );
    assert!(body.contains(r#"data-action="approve""#) && body.contains(r#"data-action="deny""#));
    assert!(body.contains(r#"name="reason""#));
    assert!(body.contains("+hi"), "the diff of a new file: {body}");
    assert_no_token(&body, "the console page");
    let bob_csrf = csrf(&body);

    // The live list: Server-Sent Events authenticated by the cookie.
    let (status, body, _) = page(&airlock, "/ui/events", None).await;
    assert_eq!(status, 401, "{body}");
    let mut stream = client()
        .get(format!("{}/ui/events", airlock.url))
        .header("cookie", &bob)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    assert!(
        stream.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let mut seen = String::new();
    while !seen.contains(approval_id) {
        let chunk = tokio::time::timeout(Duration::from_secs(30), stream.chunk())
            .await
            .expect("a pending event within 30 s")
            .unwrap()
            .expect("the stream stays open");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(seen.starts_with("event: pending\n"), "{seen}");
    assert_no_token(&seen, "the event stream");
    drop(stream);

    let decide = format!("/ui/approvals/{approval_id}/decide");
    let digest = approval(&airlock, approval_id).await["input_sha256"]
        .as_str()
        .unwrap()
        .to_owned();
    // Without the CSRF token, or from another origin: refused, nothing decided.
    let response = post_form(
        &airlock,
        &decide,
        Some(&bob),
        form(&[("decision", "approve")]),
        None,
    )
    .await;
    assert_eq!(response.status(), 403);
    let response = post_form(
        &airlock,
        &decide,
        Some(&bob),
        form(&[("csrf", &bob_csrf), ("decision", "approve")]),
        Some("http://evil.example"),
    )
    .await;
    assert_eq!(response.status(), 403);
    // Another digest than the input's: 409, nothing decided.
    let response = post_form(
        &airlock,
        &decide,
        Some(&bob),
        form(&[
            ("csrf", &bob_csrf),
            ("decision", "approve"),
            ("input_sha256", &"0".repeat(64)),
        ]),
        None,
    )
    .await;
    assert_eq!(response.status(), 409);
    assert!(
        response
            .text()
            .await
            .unwrap()
            .contains("not the one this page showed")
    );
    // An agent-only token signs in but cannot decide, even with its own CSRF token.
    let alice = sign_in(&airlock, token("alice")).await;
    let (_, body, _) = page(&airlock, "/ui", Some(&alice)).await;
    assert!(body.contains("deciding needs the approver role"), "{body}");
    let response = post_form(
        &airlock,
        &decide,
        Some(&alice),
        form(&[("csrf", &csrf(&body)), ("decision", "approve")]),
        None,
    )
    .await;
    assert_eq!(response.status(), 403);
    assert!(response.text().await.unwrap().contains("approver role"));
    assert_eq!(approval(&airlock, approval_id).await["status"], "pending");

    // The approver approves with the digest the page carried: the call runs.
    let response = post_form(
        &airlock,
        &decide,
        Some(&bob),
        form(&[
            ("csrf", &bob_csrf),
            ("decision", "approve"),
            ("reason", "fine"),
            ("input_sha256", &digest),
        ]),
        None,
    )
    .await;
    assert_eq!(response.status(), 303);
    assert_eq!(
        response.headers()["location"],
        format!("/ui?decided={approval_id}")
    );
    let decided = approval(&airlock, approval_id).await;
    assert_eq!(
        (
            decided["status"].as_str(),
            decided["decided_by"].as_str(),
            decided["reason"].as_str()
        ),
        (Some("approved"), Some("bob"), Some("fine"))
    );
    let call_id = held["call_id"].as_str().unwrap();
    let (_, detail, _) = send(
        &airlock,
        token("alice"),
        reqwest::Method::GET,
        &format!("/v1/calls/{call_id}?wait_ms=30000"),
        None,
    )
    .await;
    assert_eq!(detail["status"], "ok", "{detail}");
    let (status, body, _) = page(&airlock, &format!("/ui/calls/{call_id}"), Some(&bob)).await;
    assert_eq!(status, 200);
    assert!(body.contains(r#"<dd id="call-status">ok</dd>"#), "{body}");

    // The calls page filters; an unknown status is a 400; the audit is the admin's.
    let (status, body, _) = page(&airlock, "/ui/calls?status=bogus", Some(&bob)).await;
    assert_eq!(status, 400, "{body}");
    let root = sign_in(&airlock, token("root")).await;
    let (status, body, _) = page(
        &airlock,
        "/ui/calls?tool=write_file&status=ok&principal=alice",
        Some(&root),
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        body.contains(&format!(r#"data-call-id="{call_id}""#)),
        "{body}"
    );
    let (_, body, _) = page(&airlock, "/ui/calls?status=denied", Some(&root)).await;
    assert!(
        !body.contains(&format!(r#"data-call-id="{call_id}""#)),
        "{body}"
    );
    let (status, body, _) = page(&airlock, "/ui/audit", Some(&bob)).await;
    assert_eq!(status, 403, "{body}");
    let (status, body, headers) = page(
        &airlock,
        "/ui/audit?kind=approved&principal=alice&tool=write_file",
        Some(&root),
    )
    .await;
    assert_eq!(status, 200);
    assert_console_headers(&headers, "the audit page");
    assert!(body.contains(r#"id="verify" data-ok="true""#), "{body}");
    assert_eq!(body.matches("<td class=\"kind\">").count(), 1, "{body}");
    assert!(body.contains("<td class=\"kind\">approved</td>"), "{body}");
    assert_no_token(&body, "the audit page");

    // Signing out forgets the cookie.
    let (_, body, _) = page(&airlock, "/ui", Some(&root)).await;
    let response = post_form(
        &airlock,
        "/ui/logout",
        Some(&root),
        form(&[("csrf", &csrf(&body))]),
        None,
    )
    .await;
    assert_eq!(response.status(), 303);
    assert!(
        response.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );

    // A console left open does not hold up a stop: its live stream ends with it.
    let mut stream = client()
        .get(format!("{}/ui/events", airlock.url))
        .header("cookie", &bob)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let first = stream.chunk().await.unwrap().expect("the first event");
    assert!(first.starts_with(b"event: pending\n"));
    let status = tokio::task::block_in_place(|| airlock.stop());
    assert!(status.success(), "airlock up exited with {status}");
    loop {
        match tokio::time::timeout(Duration::from_secs(30), stream.chunk()).await {
            Ok(Ok(Some(_))) => continue,
            Ok(Ok(None) | Err(_)) => break,
            Err(_) => panic!("the live stream outlived the orchestrator"),
        }
    }
}

/// The item of `approval_id` in a console page.
fn item<'a>(body: &'a str, approval_id: &str) -> &'a str {
    let start = body
        .find(&format!(r#"data-approval-id="{approval_id}""#))
        .unwrap_or_else(|| panic!("no item {approval_id} in {body}"));
    let end = body[start..].find("</article>").expect("the item's end") + start;
    &body[start..end]
}

/// What the approver is shown beside the arguments: an edit_file's diff from its dry
/// run against the file as it is (which the dry run leaves as it is), a dry run that
/// fails saying so, a secret in a file or the arguments redacted in the diff too, and an
/// execute_shell's argv quoted for the shell.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn console_shows_diffs_from_dry_runs_with_secrets_redacted() {
    let airlock = start().await;
    let workspace = airlock
        .data_dir()
        .join("workspaces")
        .join("alice")
        .join("s1");
    std::fs::create_dir_all(&workspace).unwrap();
    std::fs::write(workspace.join("edit.txt"), "alpha\nbeta\ngamma\n").unwrap();
    std::fs::write(
        workspace.join(".env"),
        "MODE=dev\nAPI_KEY=sk-live-old-4242\n",
    )
    .unwrap();

    let edit = propose(
        &airlock,
        "alice",
        "s1",
        "edit_file",
        json!({"path": "edit.txt", "edits": [{"old_text": "beta", "new_text": "BETA"}]}),
    )
    .await;
    let failing = propose(
        &airlock,
        "alice",
        "s1",
        "edit_file",
        json!({"path": "edit.txt", "edits": [{"old_text": "no such text", "new_text": "x"}]}),
    )
    .await;
    let secret = propose(
        &airlock,
        "alice",
        "s1",
        "write_file",
        json!({"path": ".env", "content": "MODE=prod\nAPI_KEY=sk-live-new-9999\n"}),
    )
    .await;
    let shell = propose(
        &airlock,
        "alice",
        "s1",
        "execute_shell",
        json!({"argv": ["printf", "%s\\n", "it's here"], "cwd": "sub"}),
    )
    .await;

    let bob = sign_in(&airlock, token("bob")).await;
    let (status, body, _) = page(&airlock, "/ui", Some(&bob)).await;
    assert_eq!(status, 200);

    let shown = item(&body, edit["approval_id"].as_str().unwrap());
    assert!(
        shown.contains("dry run: 1 edit (1 replacement) would change edit.txt"),
        "{shown}"
    );
    for line in [
        r#"<span class="file">--- a/edit.txt</span>"#,
        r#"<span class="ctx"> alpha</span>"#,
        r#"<span class="del">-beta</span>"#,
        r#"<span class="add">+BETA</span>"#,
    ] {
        assert!(shown.contains(line), "{line} in {shown}");
    }
    assert_eq!(
        std::fs::read_to_string(workspace.join("edit.txt")).unwrap(),
        "alpha\nbeta\ngamma\n"
    );

    let shown = item(&body, failing["approval_id"].as_str().unwrap());
    assert!(
        shown.contains("the dry run fails, so the call would fail too"),
        "{shown}"
    );
    assert!(!shown.contains(r#"class="diff""#), "{shown}");

    let shown = item(&body, secret["approval_id"].as_str().unwrap());
    assert!(
        shown.contains(r#"<span class="del">-MODE=dev</span>"#),
        "{shown}"
    );
    assert!(
        shown.contains(r#"<span class="add">+MODE=prod</span>"#),
        "{shown}"
    );
    assert!(shown.contains("API_KEY=[redacted]"), "{shown}");
    assert!(
        !body.contains("sk-live-old-4242") && !body.contains("sk-live-new-9999"),
        "a secret is in the page"
    );

    let shown = item(&body, shell["approval_id"].as_str().unwrap());
    assert!(
        shown.contains(r#"<pre class="command">printf '%s\n' 'it'\''s here'</pre>"#),
        "{shown}"
    );
    assert!(shown.contains("<code>sub</code>"), "{shown}");

    // The requester sees its own approvals, but no preview: a preview reads the file as
    // it is now, which policy may forbid the requester to read.
    let alice = sign_in(&airlock, token("alice")).await;
    let (status, body, _) = page(&airlock, "/ui", Some(&alice)).await;
    assert_eq!(status, 200);
    let shown = item(&body, edit["approval_id"].as_str().unwrap());
    assert!(
        shown.contains("shown only to those who may decide"),
        "{shown}"
    );
    assert!(!body.contains(r#"class="diff""#), "no diff for alice");
    assert!(
        !body.contains("alpha") && !body.contains("MODE=dev"),
        "a file's current text is in alice's page"
    );

    // carol is an approver too, but under distinct_approver not of her own call: no
    // preview of it either.
    let own = airlock.data_dir().join("workspaces/carol/s1");
    std::fs::create_dir_all(&own).unwrap();
    std::fs::write(own.join("mine.txt"), "carol's text\n").unwrap();
    let carols = propose(
        &airlock,
        "carol",
        "s1",
        "edit_file",
        json!({"path": "mine.txt", "edits": [{"old_text": "text", "new_text": "TEXT"}]}),
    )
    .await;
    let carol = sign_in(&airlock, token("carol")).await;
    let (_, body, _) = page(&airlock, "/ui", Some(&carol)).await;
    let shown = item(&body, carols["approval_id"].as_str().unwrap());
    assert!(
        shown.contains("shown only to those who may decide"),
        "{shown}"
    );
    assert!(!shown.contains("carol's text"), "{shown}");
    let theirs = item(&body, edit["approval_id"].as_str().unwrap());
    assert!(
        theirs.contains(r#"class="diff""#),
        "alice's call: carol may decide it"
    );
}

/// More pending approvals than a page holds: the console says so (and the count says
/// "+") instead of silently showing the oldest page as if it were all, and the notice
/// goes once the backlog fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_larger_than_a_page_is_announced() {
    let airlock = start().await;
    // 101 held calls of alice's, in two requests (at most 64 calls each) and two
    // sessions (a session's budget is 100 calls).
    let mut calls = Vec::new();
    for (first, count) in [(0, 64), (64, 37)] {
        let uses: Vec<Value> = (first..first + count)
            .map(|i| {
                json!({"type": "tool_use", "id": format!("t{i}"), "name": "write_file",
                "input": {"path": format!("f{i}.txt"), "content": "x"}})
            })
            .collect();
        let (status, body, _) = send(
            &airlock,
            token("alice"),
            reqwest::Method::POST,
            "/v1/tool_calls",
            Some(
                json!({"session_id": format!("backlog-{first}"), "wait_ms": 0, "tool_uses": uses}),
            ),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        calls.extend(body["calls"].as_array().expect("calls").iter().cloned());
    }
    // `wait_ms: 0` answers once the gate has checked each call, but waits for that at
    // most some seconds: on a loaded machine a call may still be on its way to being
    // held. Each is waited for (bounded) until it is, and must then be held.
    assert_eq!(calls.len(), 101);
    for call in &calls {
        let call_id = call["call_id"].as_str().expect("call id");
        let mut status = call["status"].as_str().unwrap_or_default().to_owned();
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while status == "running" && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let (_, now, _) = send(
                &airlock,
                token("alice"),
                reqwest::Method::GET,
                &format!("/v1/calls/{call_id}?wait_ms=0"),
                None,
            )
            .await;
            status = now["status"].as_str().unwrap_or_default().to_owned();
        }
        assert_eq!(status, "pending_approval", "{call}");
    }
    let shown = |body: &str| {
        let notice = body.find(r#"id="pending-more""#).expect("the notice");
        let tag = &body[body[..notice].rfind('<').expect("tag")..];
        !tag[..tag.find('>').expect("tag end")].contains("hidden")
    };
    let cookie = sign_in(&airlock, token("bob")).await;
    let (status, body, _) = page(&airlock, "/ui", Some(&cookie)).await;
    assert_eq!(status, 200);
    assert_eq!(body.matches("data-approval-id=").count(), 100, "one page");
    assert!(shown(&body), "the notice is shown");
    assert!(
        body.contains(r#"id="pending-count">100+<"#),
        "the count says more"
    );

    // One decided: 100 left, all on the page, the notice hidden.
    let (_, listed, _) = send(
        &airlock,
        token("bob"),
        reqwest::Method::GET,
        "/v1/approvals?status=pending&limit=1",
        None,
    )
    .await;
    let first = listed["approvals"][0]["approval_id"]
        .as_str()
        .expect("approval id")
        .to_owned();
    let (status, body, _) = send(
        &airlock,
        token("bob"),
        reqwest::Method::POST,
        &format!("/v1/approvals/{first}/deny"),
        Some(json!({"reason": "backlog test"})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let (_, body, _) = page(&airlock, "/ui", Some(&cookie)).await;
    assert_eq!(body.matches("data-approval-id=").count(), 100);
    assert!(
        body.contains(r#"id="pending-count">100<"#),
        "the count is exact"
    );
    assert!(!shown(&body), "the notice is hidden");
}

/// A principal holds at most 8 live views (`/ui/events`) at once: the 9th is refused
/// with 429, another principal's is not, and closing one makes room again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn live_views_are_bounded_per_principal() {
    let airlock = start().await;
    let alice = sign_in(&airlock, token("alice")).await;
    let bob = sign_in(&airlock, token("bob")).await;
    let open = |cookie: String| {
        let url = format!("{}/ui/events", airlock.url);
        async move {
            client()
                .get(url)
                .header("cookie", cookie)
                .send()
                .await
                .expect("send")
        }
    };
    let mut streams = Vec::new();
    for _ in 0..8 {
        let stream = open(alice.clone()).await;
        assert_eq!(stream.status(), 200);
        streams.push(stream);
    }
    let refused = open(alice.clone()).await;
    assert_eq!(refused.status(), 429);
    let text = refused.text().await.expect("body");
    assert!(text.contains("8 live views are open for alice"), "{text}");
    assert_eq!(open(bob.clone()).await.status(), 200, "bob has his own");
    drop(streams.pop());
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let again = open(alice.clone()).await;
        if again.status() == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a closed view was not given back: {}",
            again.status()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Under a quorum the console lists the approvers so far, and tells an approver who
/// already approved why approving again is disabled; a second approver completes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn console_explains_a_quorum_where_it_blocks() {
    let airlock = start_with("quorum = { write_file = 2 }").await;
    let held = propose(
        &airlock,
        "alice",
        "s1",
        "write_file",
        json!({"path": "q.txt", "content": "q\n"}),
    )
    .await;
    let approval_id = held["approval_id"].as_str().unwrap();
    let bob = sign_in(&airlock, token("bob")).await;
    let (_, body, _) = page(&airlock, "/ui", Some(&bob)).await;
    let shown = item(&body, approval_id);
    assert!(shown.contains("0 of 2 distinct approvers"), "{shown}");
    assert!(
        !shown.contains(r#"name="remember""#),
        "no remembering under a quorum: {shown}"
    );
    let response = post_form(
        &airlock,
        &format!("/ui/approvals/{approval_id}/decide"),
        Some(&bob),
        form(&[
            ("csrf", &csrf(&body)),
            ("decision", "approve"),
            ("reason", "one of two"),
        ]),
        None,
    )
    .await;
    assert_eq!(response.status(), 303);

    let (_, body, _) = page(&airlock, &format!("/ui?decided={approval_id}"), Some(&bob)).await;
    assert!(body.contains("it needs more distinct approvers"), "{body}");
    let shown = item(&body, approval_id);
    assert!(shown.contains("1 of 2 distinct approvers: bob"), "{shown}");
    assert!(
        shown.contains(r#"data-action="approve" disabled"#),
        "{shown}"
    );
    assert!(!shown.contains(r#"data-action="deny" disabled"#), "{shown}");
    assert!(
        shown.contains("you approved this call already; it needs 2 distinct approvers (1 so far)"),
        "{shown}"
    );
    // Forced anyway: 409, and the approval still waits for a second approver.
    let response = post_form(
        &airlock,
        &format!("/ui/approvals/{approval_id}/decide"),
        Some(&bob),
        form(&[("csrf", &csrf(&body)), ("decision", "approve")]),
        None,
    )
    .await;
    assert_eq!(response.status(), 409);
    assert!(
        response
            .text()
            .await
            .unwrap()
            .contains("you approved this call already")
    );
    assert_eq!(approval(&airlock, approval_id).await["status"], "pending");

    let carol = sign_in(&airlock, token("carol")).await;
    let (_, body, _) = page(&airlock, "/ui", Some(&carol)).await;
    assert!(!item(&body, approval_id).contains("disabled"), "{body}");
    let response = post_form(
        &airlock,
        &format!("/ui/approvals/{approval_id}/decide"),
        Some(&carol),
        form(&[("csrf", &csrf(&body)), ("decision", "approve")]),
        None,
    )
    .await;
    assert_eq!(response.status(), 303);
    let decided = approval(&airlock, approval_id).await;
    assert_eq!(decided["status"], "approved", "{decided}");
    assert_eq!(decided["approved_by"], json!(["bob", "carol"]));
}

/// "Remember for the session" in the console approves like `{"remember": "session"}`:
/// the identical call later in the session runs without a new approval.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn console_remembers_an_approval_for_the_session() {
    let airlock = start().await;
    let input = json!({"path": "r.txt", "content": "r\n"});
    let held = propose(&airlock, "alice", "s1", "write_file", input.clone()).await;
    let approval_id = held["approval_id"].as_str().unwrap();
    let bob = sign_in(&airlock, token("bob")).await;
    let (_, body, _) = page(&airlock, "/ui", Some(&bob)).await;
    assert!(
        item(&body, approval_id).contains(r#"name="remember" value="session""#),
        "{body}"
    );
    let response = post_form(
        &airlock,
        &format!("/ui/approvals/{approval_id}/decide"),
        Some(&bob),
        form(&[
            ("csrf", &csrf(&body)),
            ("decision", "approve"),
            ("remember", "session"),
        ]),
        None,
    )
    .await;
    assert_eq!(response.status(), 303);
    let (_, detail, _) = send(
        &airlock,
        token("alice"),
        reqwest::Method::GET,
        &format!(
            "/v1/calls/{}?wait_ms=30000",
            held["call_id"].as_str().unwrap()
        ),
        None,
    )
    .await;
    assert_eq!(detail["status"], "ok", "{detail}");

    let body = json!({"session_id": "s1", "wait_ms": 30000,
        "tool_uses": [{"type": "tool_use", "id": "t2", "name": "write_file", "input": input}]});
    let (status, again, _) = send(
        &airlock,
        token("alice"),
        reqwest::Method::POST,
        "/v1/tool_calls",
        Some(body),
    )
    .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["calls"][0]["status"], "ok", "{again}");
    assert!(again["calls"][0].get("approval_id").is_none(), "{again}");
}

/// Fails, naming the fix, when the browser, its driver or Selenium is missing.
async fn require_browser() {
    for path in [CHROMIUM, CHROMEDRIVER] {
        assert!(
            std::path::Path::new(path).exists(),
            "{path} is missing: the console test drives headless Chromium; install it with: apt-get install chromium chromium-driver"
        );
    }
    let probe = tokio::process::Command::new("python3")
        .args(["-c", "import selenium"])
        .output()
        .await
        .expect("python3 runs");
    assert!(
        probe.status.success(),
        "Selenium for Python is missing; install it with: python3 -m pip install selenium\n{}",
        String::from_utf8_lossy(&probe.stderr)
    );
}

/// The console in headless Chromium: sign in, a write_file's diff arriving live,
/// approve and see the call complete, deny with a reason, markup and script in
/// arguments shown as text and run nothing, an agent token's buttons disabled and a
/// forced click refused, distinct_approver explained. Then checked through the API.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn console_in_a_real_browser() {
    require_browser().await;
    let airlock = start().await;
    // The file the first write_file replaces, in alice's session s1.
    let workspace = airlock
        .data_dir()
        .join("workspaces")
        .join("alice")
        .join("s1");
    std::fs::create_dir_all(&workspace).unwrap();
    std::fs::write(
        workspace.join("notes.txt"),
        "line one\nline two\nline three\n",
    )
    .unwrap();

    let shots = tempfile::tempdir().unwrap();
    let screenshot = shots.path().join("console.png");
    let config = json!({
        "url": airlock.url,
        "chromium": CHROMIUM,
        "chromedriver": CHROMEDRIVER,
        "screenshot": screenshot,
        "tokens": TOKENS.iter().map(|(n, t)| (n.to_string(), json!(t))).collect::<serde_json::Map<_, _>>(),
    });
    let mut command = tokio::process::Command::new("python3");
    command
        .arg(SCRIPT)
        .arg(config.to_string())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(300), command.output())
        .await
        .expect("console.py did not finish within 300 s")
        .expect("run python3 console.py");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "console.py failed ({}):\nstdout: {stdout}\nstderr: {stderr}\nairlock log:\n{}",
        output.status,
        airlock.log()
    );
    let out: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("console.py printed no JSON ({e}): {stdout}"));
    let png = std::fs::read(&screenshot).expect("the screenshot");
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "not a screenshot"
    );
    // `AIRLOCK_UPDATE_SCREENSHOT=1` refreshes the README's picture.
    if std::env::var_os("AIRLOCK_UPDATE_SCREENSHOT").is_some() {
        std::fs::write(SCREENSHOT, &png).unwrap();
    }

    // Approved in the browser: the approval names bob and his reason, the call ran.
    let approved = &out["approved"];
    let decided = approval(&airlock, approved["approval_id"].as_str().unwrap()).await;
    assert_eq!(decided["status"], "approved", "{decided}");
    assert_eq!(decided["decided_by"], "bob");
    assert_eq!(decided["reason"], "looks right");
    let call_id = approved["call_id"].as_str().unwrap();
    let (_, detail, _) = send(
        &airlock,
        token("alice"),
        reqwest::Method::GET,
        &format!("/v1/calls/{call_id}?wait_ms=30000"),
        None,
    )
    .await;
    assert_eq!(detail["status"], "ok", "{detail}");
    assert_eq!(
        std::fs::read_to_string(workspace.join("notes.txt")).unwrap(),
        "line one\nline 2 changed\nline three\n"
    );

    // Denied in the browser: the reason is on the approval and in the audit.
    let denied = &out["denied"];
    let denied_id = denied["approval_id"].as_str().unwrap();
    let decided = approval(&airlock, denied_id).await;
    assert_eq!(
        (
            decided["status"].as_str(),
            decided["decided_by"].as_str(),
            decided["reason"].as_str()
        ),
        (Some("denied"), Some("bob"), Some("not this file"))
    );
    let (_, events, _) = send(
        &airlock,
        token("root"),
        reqwest::Method::GET,
        &format!("/v1/audit?call_id={}", denied["call_id"].as_str().unwrap()),
        None,
    )
    .await;
    let denial = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "approval_denied")
        .expect("an approval_denied event")
        .clone();
    assert_eq!(denial["data"]["reason"], "not this file", "{denial}");
    assert_eq!(denial["data"]["decided_by"], "bob");
    assert!(!workspace.join("other.txt").exists());

    // The forced click of the agent-only token decided nothing; carol's own call waits.
    for held in out["xss"].as_array().unwrap().iter().chain([&out["own"]]) {
        let id = held["approval_id"].as_str().unwrap();
        assert_eq!(approval(&airlock, id).await["status"], "pending", "{id}");
    }
    assert_eq!(out["forced"]["approval_id"], out["xss"][0]["approval_id"]);
}
