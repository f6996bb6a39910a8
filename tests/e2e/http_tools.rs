//! Declared http tools through `airlock up`: a `[[tools]]` entry with `http`, its
//! bearer token read from the environment by the http worker, sent to the server and
//! kept out of everything else: the tool result, the audit, the logs, error messages.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use crate::support::Airlock;

/// A loopback server answering every request with the request line and headers it got
/// (as the body, and the Authorization header again as `X-Echo-Authorization`); a
/// request for `/users/redirect` is sent on to `redirect_to` with the Authorization
/// value in the query, as a careless or hostile server might. Returns its port and the
/// heads it received.
fn echo_server(redirect_to: u16) -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(64) {
            let Ok(mut stream) = stream else { continue };
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let head = String::from_utf8_lossy(&head).into_owned();
            log.lock().expect("lock").push(head.clone());
            let auth = head
                .lines()
                .find_map(|l| {
                    l.split_once(':')
                        .filter(|(n, _)| n.eq_ignore_ascii_case("authorization"))
                        .map(|(_, v)| v.trim().to_owned())
                })
                .unwrap_or_default();
            let _ = if head.starts_with("GET /users/redirect ") {
                write!(
                    stream,
                    "HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:{redirect_to}/steal?auth={}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    auth.replace(' ', "%20")
                )
            } else {
                write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Echo-Authorization: {auth}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{head}",
                    head.len()
                )
            };
        }
    });
    (port, seen)
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

fn random_token() -> String {
    let mut a = RandomState::new().build_hasher();
    a.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos(),
    );
    let b = RandomState::new().build_hasher().finish();
    format!("crm{:016x}{b:016x}", a.finish())
}

/// Every file below `dir` whose bytes hold `needle`.
fn files_holding(dir: &Path, needle: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            found.extend(files_holding(&path, needle));
        } else if kind.is_file()
            && std::fs::read(&path)
                .is_ok_and(|bytes| bytes.windows(needle.len()).any(|w| w == needle))
        {
            found.push(path.display().to_string());
        }
    }
    found
}

#[tokio::test]
async fn a_declared_http_tool_sends_its_secret_and_never_shows_it() {
    let refused = closed_port();
    let (port, seen) = echo_server(refused);
    let closed = closed_port();
    let token = random_token();
    let config = format!(
        r#"
[http]
allow = ["127.0.0.1:{port}", "127.0.0.1:{closed}"]

[[tools]]
name = "fetch_user_details"
description = "Look a user up in the CRM by id."
input_schema = {{ type = "object", properties = {{ user_id = {{ type = "string" }} }}, required = ["user_id"] }}
annotations = {{ read_only = true, idempotent = true }}
http = {{ method = "GET", url = "http://127.0.0.1:{port}/users/{{user_id}}", headers = {{ Authorization = "Bearer ${{env:CRM_TOKEN}}", Accept = "text/plain" }} }}

[[tools]]
name = "fetch_user_offline"
description = "The same CRM lookup, on a server that is down."
input_schema = {{ type = "object", properties = {{ user_id = {{ type = "string" }} }}, required = ["user_id"] }}
http = {{ method = "GET", url = "http://127.0.0.1:{closed}/users/{{user_id}}", headers = {{ Authorization = "Bearer ${{env:CRM_TOKEN}}" }} }}
"#
    );
    let airlock = Airlock::start_with_env(&config, &[("CRM_TOKEN", &token)]).await;

    // The catalog serves the tool as declared.
    let (status, catalog) = airlock.get("/v1/tools").await;
    assert_eq!(status, 200, "{catalog}");
    assert!(
        catalog.to_string().contains("fetch_user_details"),
        "{catalog}"
    );

    let (err, text, call) = airlock
        .call("fetch_user_details", json!({"user_id": "../admin?x=1"}))
        .await;
    assert!(!err && call["status"] == "ok", "{text}\n{call}");
    let heads = seen.lock().expect("lock").clone();
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert!(
        heads[0].starts_with("GET /users/..%2Fadmin%3Fx%3D1 HTTP/1.1\r\n"),
        "the value stays one path segment: {}",
        heads[0]
    );
    assert!(
        heads[0]
            .to_ascii_lowercase()
            .contains(&format!("authorization: bearer {token}")),
        "the server got the real token: {}",
        heads[0]
    );
    let result: Value = serde_json::from_str(&text).expect("JSON result");
    assert_eq!(result["status"], 200, "{result}");
    assert!(
        !text.contains(&token),
        "the tool result holds the token: {text}"
    );
    assert!(
        result["body"]
            .as_str()
            .expect("body")
            .to_ascii_lowercase()
            .contains("authorization: bearer [redacted]"),
        "{result}"
    );
    assert_eq!(
        result["headers"]["x-echo-authorization"],
        "Bearer [redacted]"
    );

    // A redirect carrying the token elsewhere is refused by the egress rules, and the
    // refusal, which names the URL, does not show it either.
    let (err, text, _) = airlock
        .call("fetch_user_details", json!({"user_id": "redirect"}))
        .await;
    assert!(err, "{text}");
    assert!(
        text.contains("stopped at redirect 1") && text.contains("auth=Bearer%20[redacted]"),
        "{text}"
    );
    assert!(!text.contains(&token), "{text}");

    // The server is down: the error says so, without the token.
    let (err, text, _) = airlock
        .call("fetch_user_offline", json!({"user_id": "42"}))
        .await;
    assert!(err, "{text}");
    assert!(
        text.contains(&format!("cannot connect to 127.0.0.1:{closed}")),
        "{text}"
    );
    assert!(!text.contains(&token), "{text}");

    let (status, audit) = airlock.get("/v1/audit?limit=1000").await;
    assert_eq!(status, 200, "{audit}");
    let audit = audit.to_string();
    assert!(audit.contains("fetch_user_details"), "{audit}");
    assert!(
        !audit.contains(&token),
        "the audit holds the token: {audit}"
    );
    let log = airlock.log();
    assert!(log.contains("http worker starting"), "{log}");
    assert!(!log.contains(&token), "the log holds the token:\n{log}");
    let leaks = files_holding(&airlock.data_dir(), token.as_bytes());
    assert!(
        leaks.is_empty(),
        "files in the data dir hold the token: {leaks:?}"
    );
}

#[tokio::test]
async fn a_missing_secret_stops_start_up_naming_the_variable() {
    let port = closed_port();
    let config = format!(
        r#"
[http]
allow = ["127.0.0.1:{port}"]

[[tools]]
name = "fetch_user_details"
description = "Look a user up in the CRM by id."
input_schema = {{ type = "object", properties = {{ user_id = {{ type = "string" }} }}, required = ["user_id"] }}
http = {{ method = "GET", url = "http://127.0.0.1:{port}/users/{{user_id}}", headers = {{ Authorization = "Bearer ${{env:AIRLOCK_E2E_UNSET_TOKEN}}" }} }}
"#
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("airlock.toml");
    std::fs::write(&file, config).expect("write config");
    let output = std::process::Command::new(crate::support::AIRLOCK)
        .args(["serve", "worker", "http", "--data-dir"])
        .arg(dir.path().join("data"))
        .arg("--config")
        .arg(&file)
        .env_remove("AIRLOCK_E2E_UNSET_TOKEN")
        .output()
        .expect("run the http worker");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "[[tools]] fetch_user_details: http.headers.Authorization: the environment variable AIRLOCK_E2E_UNSET_TOKEN is not set"
        ),
        "{stderr}"
    );
}
