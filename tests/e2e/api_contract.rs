//! The public contract as third-party clients see it: the 401 challenge on `/v1` and
//! `/mcp`, gRPC server reflection for v1 and v1alpha clients (grpcio-reflection), the
//! OpenAPI document (openapi-spec-validator, and the router's own route table), and
//! OpenAI strict mode (the openai and openai-agents packages' own strict checks, then
//! strict-style calls with `null` optionals).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::support::Airlock;

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/e2e/api_contract.py"
);
const PIP_FIX: &str = "python3 -m pip install grpcio grpcio-reflection openai openai-agents openapi-spec-validator jsonschema";

/// Fails (never skips) when python3 or a package the check needs is missing, naming the
/// fix.
async fn require_python(modules: &[&str]) {
    let imports = modules
        .iter()
        .map(|m| format!("import {m}"))
        .collect::<Vec<_>>()
        .join("; ");
    let probe = tokio::process::Command::new("python3")
        .args(["-c", &imports])
        .output()
        .await;
    match probe {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!(
            "a Python package this test drives Airlock with is missing ({imports}); install them with: {PIP_FIX}\n{}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => {
            panic!("python3 is not available ({e}); install Python 3.10+ and then: {PIP_FIX}")
        }
    }
}

/// Runs `api_contract.py <args>` and returns the JSON it printed.
async fn script(airlock: &Airlock, args: &[&str]) -> Value {
    let mut command = tokio::process::Command::new("python3");
    command
        .arg(SCRIPT)
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(300), command.output())
        .await
        .expect("api_contract.py did not finish within 300 s")
        .expect("run python3 api_contract.py");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "api_contract.py {} failed ({}):\nstdout: {stdout}\nstderr: {stderr}\nairlock log:\n{}",
        args[0],
        output.status,
        airlock.log()
    );
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("api_contract.py printed no JSON ({e}): {stdout}\n{stderr}"))
}

/// The auth-params of a `Bearer` challenge (`realm="x", error="y"`); panics on anything
/// that is not well-formed RFC 7235 syntax with quoted values.
fn challenge_params(header: &str) -> Vec<(String, String)> {
    let rest = header
        .strip_prefix("Bearer ")
        .unwrap_or_else(|| panic!("not a Bearer challenge with parameters: {header:?}"));
    let mut params = Vec::new();
    let mut rest = rest.trim_start();
    while !rest.is_empty() {
        let (name, after) = rest
            .split_once("=\"")
            .unwrap_or_else(|| panic!("malformed auth-param in {header:?}"));
        let (value, after) = after
            .split_once('"')
            .unwrap_or_else(|| panic!("unterminated quoted-string in {header:?}"));
        params.push((name.trim().to_owned(), value.to_owned()));
        rest = after
            .trim_start()
            .strip_prefix(',')
            .unwrap_or(after)
            .trim_start();
    }
    params
}

fn param<'a>(params: &'a [(String, String)], name: &str) -> Option<&'a str> {
    params
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// Sends `request` and returns (status, challenge params, JSON error message).
async fn unauthorized(request: reqwest::RequestBuilder) -> (u16, Vec<(String, String)>, String) {
    let response = request.send().await.expect("send");
    let status = response.status().as_u16();
    let header = response
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().expect("ASCII challenge").to_owned())
        .unwrap_or_default();
    let body: Value = response.json().await.expect("JSON error body");
    assert_eq!(body["error"]["code"], "unauthorized", "{body}");
    let message = body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    (status, challenge_params(&header), message)
}

#[tokio::test]
async fn a_401_says_where_the_token_is_and_offers_no_oauth() {
    let airlock = Airlock::start().await;
    let client = airlock.http();
    let mcp_list = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"});
    for (label, path) in [("/v1", "/v1/tools"), ("/mcp", "/mcp")] {
        let url = format!("{}{path}", airlock.url);
        let request = |r: reqwest::RequestBuilder| {
            if path == "/mcp" {
                r.header("accept", "application/json, text/event-stream")
                    .json(&mcp_list)
            } else {
                r
            }
        };
        let method = if path == "/mcp" {
            reqwest::Method::POST
        } else {
            reqwest::Method::GET
        };

        // No credentials: no error code (RFC 6750 §3.1), but a realm and where the token is.
        let (status, params, message) =
            unauthorized(request(client.request(method.clone(), &url))).await;
        assert_eq!(status, 401, "{label}");
        assert_eq!(
            param(&params, "realm"),
            Some("airlock"),
            "{label}: {params:?}"
        );
        assert_eq!(param(&params, "error"), None, "{label}: {params:?}");
        let description = param(&params, "error_description").unwrap_or_default();
        for needle in ["<data_dir>/token", "AIRLOCK_TOKEN", "no OAuth"] {
            assert!(
                description.contains(needle),
                "{label}: {description:?} lacks {needle}"
            );
            assert!(
                message.contains(needle),
                "{label}: {message:?} lacks {needle}"
            );
        }
        // Nothing that would send an MCP host looking for an authorization server.
        assert_eq!(param(&params, "resource_metadata"), None, "{label}");

        // A token that is wrong, or a credential under another scheme: invalid_token.
        for request_with_credential in [
            client
                .request(method.clone(), &url)
                .bearer_auth("alk_wrong"),
            client
                .request(method.clone(), &url)
                .header("authorization", format!("Basic {}", airlock.token)),
        ] {
            let (status, params, message) = unauthorized(request(request_with_credential)).await;
            assert_eq!(status, 401, "{label}");
            assert_eq!(param(&params, "realm"), Some("airlock"), "{label}");
            assert_eq!(
                param(&params, "error"),
                Some("invalid_token"),
                "{label}: {params:?}"
            );
            assert!(
                param(&params, "error_description").is_some_and(|d| d.contains("<data_dir>/token")),
                "{label}: {params:?}"
            );
            assert!(message.contains("<data_dir>/token"), "{label}: {message}");
        }
    }
    // An MCP host that probes for OAuth anyway finds no metadata.
    let probe = client
        .get(format!(
            "{}/.well-known/oauth-protected-resource",
            airlock.url
        ))
        .send()
        .await
        .expect("send");
    assert_eq!(probe.status(), 404);
}

#[tokio::test]
async fn a_401_with_configured_principals_points_at_the_configuration() {
    let token = "alk_configured_principal_token";
    let digest = hex_digest(token);
    let airlock = Airlock::start_with(&format!(
        "[[principals]]\nname = \"ci\"\ntoken_sha256 = \"{digest}\"\nroles = [\"agent\"]\n"
    ))
    .await;
    let (status, params, _) =
        unauthorized(airlock.http().get(format!("{}/v1/tools", airlock.url))).await;
    assert_eq!(status, 401);
    let description = param(&params, "error_description").unwrap_or_default();
    assert!(description.contains("[[principals]]"), "{description}");
    assert!(!description.contains("<data_dir>/token"), "{description}");
    let listed = airlock
        .http()
        .get(format!("{}/v1/tools", airlock.url))
        .bearer_auth(token)
        .send()
        .await
        .expect("send");
    assert_eq!(listed.status(), 200);
}

fn hex_digest(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[tokio::test]
async fn grpc_reflection_v1alpha_and_v1_list_exactly_the_served_services() {
    require_python(&[
        "grpc",
        "grpc_reflection.v1alpha.proto_reflection_descriptor_database",
    ])
    .await;
    let airlock = Airlock::start().await;
    let orchestrator = airlock
        .grpc
        .strip_prefix("http://")
        .expect("http:// gRPC endpoint")
        .to_owned();
    let fs_worker = format!(
        "unix:{}",
        airlock.data_dir().join("sockets/fs.sock").display()
    );
    let common = [
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    ];
    for (label, target, service, methods) in [
        (
            "orchestrator",
            orchestrator.as_str(),
            "airlock.v1.Orchestrator",
            &[
                "CallToolStream",
                "CallTools",
                "DecideApproval",
                "ListApprovals",
                "ListTools",
            ][..],
        ),
        (
            "fs worker",
            fs_worker.as_str(),
            "airlock.v1.ToolWorker",
            &["Execute", "ListTools"][..],
        ),
    ] {
        let out = script(&airlock, &["reflection", target]).await;
        let expected: BTreeSet<String> = common
            .iter()
            .copied()
            .chain([service])
            .map(str::to_owned)
            .collect();
        for version in ["v1alpha", "v1"] {
            let listed: BTreeSet<String> =
                serde_json::from_value(out[version].clone()).expect("service names");
            assert_eq!(listed, expected, "{label}, reflection {version}");
        }
        // grpcio-reflection resolved every listed service's descriptor over v1alpha.
        let resolved: Vec<String> =
            serde_json::from_value(out["methods"][service].clone()).expect("methods");
        for method in methods {
            assert!(
                resolved.iter().any(|m| m == method),
                "{label}: {method} not in {resolved:?}"
            );
        }
        let health: Vec<String> =
            serde_json::from_value(out["methods"]["grpc.health.v1.Health"].clone())
                .expect("health methods");
        assert!(health.iter().any(|m| m == "Check"), "{label}: {health:?}");
    }
}

#[tokio::test]
async fn openapi_is_valid_3_1_and_documents_every_served_route() {
    require_python(&["openapi_spec_validator"]).await;
    let airlock = Airlock::start().await;
    let out = script(&airlock, &["openapi", &airlock.url, &airlock.token]).await;
    assert_eq!(out["openapi"], "3.1.0");
    let routes = airlock_orchestrator::http_route_table();
    assert!(
        routes.iter().any(|(_, p)| *p == "/v1/audit/verify"),
        "{routes:?}"
    );
    for (method, path) in &routes {
        let documented: Vec<String> = out["paths"]
            .get(*path)
            .map(|m| serde_json::from_value(m.clone()).expect("methods"))
            .unwrap_or_default();
        let method_name = method.as_str().to_ascii_lowercase();
        assert!(
            documented.contains(&method_name),
            "{method} {path} is served but not in /openapi.json ({documented:?})"
        );
        // The table is what the router serves: each route answers as itself, not with
        // the fallback's "no such endpoint".
        let concrete = path
            .replace("{call_id}", "call_missing")
            .replace("{approval_id}", "appr_missing");
        let mut request = airlock.request(method.clone(), &concrete);
        if *method == reqwest::Method::POST {
            request = request.json(&json!({}));
        }
        let response = request.send().await.expect("send");
        let status = response.status().as_u16();
        let text = response.text().await.expect("body");
        assert!(
            status != 405 && !text.contains("no such endpoint"),
            "{method} {path} is in the route table but not served: {status} {text}"
        );
    }
}

/// A loopback HTTP server that answers every request with the request's own head.
fn echo_server() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(16) {
            let Ok(mut stream) = stream else { continue };
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                head.len()
            );
            let _ = stream.write_all(&head);
        }
    });
    port
}

#[tokio::test]
async fn strict_openai_tools_pass_the_openai_packages_and_null_optionals_run() {
    require_python(&["agents.strict_schema", "openai", "jsonschema", "pydantic"]).await;
    let port = echo_server();
    let airlock = Airlock::start_with(&format!("[http]\nallow = [\"127.0.0.1:{port}\"]\n")).await;

    for query in ["format=anthropic&strict=true", "format=openai&strict=maybe"] {
        let (status, body) = airlock.get(&format!("/v1/tools?{query}")).await;
        assert_eq!(status, 400, "{query}: {body}");
    }

    let out = script(
        &airlock,
        &["strict", &airlock.url, &airlock.token, &port.to_string()],
    )
    .await;
    let checked: BTreeSet<String> = serde_json::from_value(out["checked"].clone()).expect("names");
    for tool in [
        "execute_shell",
        "http_request",
        "fetch_url",
        "read_file",
        "edit_file",
        "write_file",
        "list_directory",
        "search_files",
        "query_database",
        "execute_sql",
        "list_databases",
    ] {
        assert!(
            checked.contains(tool),
            "{tool} was not checked: {checked:?}"
        );
    }
    let results = &out["results"];
    let ok = |label: &str| -> String {
        let r = &results[label];
        assert_eq!(r["status"], "ok", "{label}: {r}");
        r["content"].as_str().expect("content").to_owned()
    };
    ok("write");
    assert_eq!(ok("read_all"), "one\ntwo\nthree\n");
    let from_2 = ok("read_from_2");
    assert!(
        from_2.starts_with('[') && from_2.contains("two\nthree"),
        "{from_2}"
    );
    let diff = ok("edit");
    assert!(diff.contains("-two") && diff.contains("+2"), "{diff}");
    assert!(ok("list").contains("a.txt"));

    let shell: Value = serde_json::from_str(&ok("shell_env")).expect("shell JSON");
    assert_eq!(shell["stdout"], "C.UTF-8|/workspace\n", "{shell}");
    let shell: Value = serde_json::from_str(&ok("shell_argv")).expect("shell JSON");
    assert_eq!(shell["stdout"], "via stdin", "{shell}");
    // The strict variant cannot say "command or argv"; the gate still enforces it.
    let neither = &results["shell_neither"];
    assert_eq!(neither["status"], "error", "{neither}");
    assert!(
        neither["content"]
            .as_str()
            .is_some_and(|c| c.contains("oneOf")),
        "{neither}"
    );

    let http: Value = serde_json::from_str(&ok("http")).expect("http JSON");
    assert_eq!(http["status"], 200, "{http}");
    let echoed = http["body"].as_str().expect("body").to_ascii_lowercase();
    assert!(echoed.contains("x-airlock-strict: yes"), "{echoed}");
    assert!(ok("query").contains("one"));
}
