//! Shell egress through the allowlisting proxy (`[sandbox] network = "proxy"`, DESIGN
//! §12). A mirror of the test's own (a simple package index with a wheel built here and
//! a git repository over HTTP) and a forbidden server that counts connections listen on
//! the host's loopback, which a sandbox's own network namespace cannot reach: `pip
//! install` and `git clone` get to the mirror through the proxy, every other way out
//! fails — directly, or through the proxy by another host, port, IP literal, a name that
//! resolves to a loopback address, SNI or Host that differ from the target, UDP, raw
//! and IPv6 sockets — and the forbidden server sees no connection at all.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::{Airlock, up_refused};

const SERVERS: &str = include_str!("egress_servers.py");
const PROBE: &str = include_str!("egress_probe.py");
/// Fetches `argv[1]` with the standard library (which honours the proxy variables) and
/// prints the status, or what went wrong.
const FETCH: &str = "import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=10).status)
except Exception as e:
    print('failed:', e)
    sys.exit(1)
";

/// The mirror and the forbidden server (tests/e2e/egress_servers.py), killed on drop.
struct Servers {
    dir: tempfile::TempDir,
    child: Child,
    mirror: u16,
    forbidden: u16,
}

impl Servers {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let ports = dir.path().join("ports.json");
        let root = dir.path().join("srv");
        std::fs::create_dir(&root).expect("server dir");
        let child = Command::new("python3")
            .arg("-c")
            .arg(SERVERS)
            .arg(&root)
            .arg(&ports)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("python3 for the mirror (tests/e2e/egress_servers.py)");
        let deadline = Instant::now() + Duration::from_secs(30);
        let ports: Value = loop {
            if let Ok(text) = std::fs::read_to_string(&ports) {
                break serde_json::from_str(&text).expect("ports");
            }
            assert!(Instant::now() < deadline, "the mirror did not start");
            std::thread::sleep(Duration::from_millis(50));
        };
        let port = |name: &str| u16::try_from(ports[name].as_u64().expect("port")).expect("port");
        Self {
            mirror: port("mirror"),
            forbidden: port("forbidden"),
            dir,
            child,
        }
    }

    /// Connections the forbidden server accepted.
    fn forbidden_connections(&self) -> u64 {
        std::fs::read_to_string(self.dir.path().join("srv/forbidden-connections"))
            .expect("counter")
            .trim()
            .parse()
            .expect("count")
    }

    fn config(&self) -> String {
        format!(
            r#"
[sandbox]
network = "proxy"

[sandbox.egress]
allow = ["mirror.test:{mirror}", "*.example"]
hosts = {{ "mirror.test" = "127.0.0.1", "rebind.example" = "127.0.0.1", "forbidden.test" = "127.0.0.1" }}

# The proxy narrowed for one tool, and a tool that asks for no network at all.
[[tools]]
name = "fetch_narrowed"
description = "Fetches one URL through the proxy; only *.example hosts."
command = ["python3", "-c", '''{FETCH}''', "{{url}}"]
network = "proxy"
egress_allow = ["*.example"]
annotations = {{ read_only = true }}
[tools.input_schema]
type = "object"
required = ["url"]
properties = {{ url = {{ type = "string", maxLength = 200 }} }}

[[tools]]
name = "fetch_offline"
description = "Fetches one URL, with no network."
command = ["python3", "-c", '''{FETCH}''', "{{url}}"]
annotations = {{ read_only = true }}
[tools.input_schema]
type = "object"
required = ["url"]
properties = {{ url = {{ type = "string", maxLength = 200 }} }}
"#,
            mirror = self.mirror
        )
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `argv` with `execute_shell`: the parsed result and the call's entry.
async fn shell(airlock: &Airlock, argv: &[&str], timeout_seconds: u64) -> (Value, Value) {
    let (_, text, call) = airlock
        .call_in(
            "egress",
            "execute_shell",
            json!({"argv": argv, "timeout_seconds": timeout_seconds}),
        )
        .await;
    let result: Value = serde_json::from_str(&text).unwrap_or_else(|_| json!({"text": text}));
    (result, call)
}

/// The attempts of a result's `egress` record for `host`.
fn attempts<'a>(result: &'a Value, host: &str) -> Vec<&'a Value> {
    result["egress"]["attempts"]
        .as_array()
        .or_else(|| result["egress"].as_array())
        .into_iter()
        .flatten()
        .filter(|a| a["host"] == host)
        .collect()
}

#[tokio::test]
async fn pip_and_git_reach_the_mirror_through_the_proxy_and_nothing_else_does() {
    let servers = Servers::start();
    let airlock = Airlock::start_with(&servers.config()).await;
    let index = format!("http://mirror.test:{}/simple/", servers.mirror);

    // pip install from the mirror, through the proxy the environment announces.
    let (result, _) = shell(
        &airlock,
        &[
            "python3",
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-cache-dir",
            "--no-input",
            "--target",
            "/workspace/site",
            "--index-url",
            &index,
            // pip refuses a plain-HTTP index unless told to trust it; the mirror is a
            // loopback server of the test's own.
            "--trusted-host",
            "mirror.test",
            "demo-pkg",
        ],
        120,
    )
    .await;
    assert_eq!(result["exit_code"], 0, "{result}");
    assert_eq!(result["isolation"]["network"], "proxy", "{result}");
    let mirror = attempts(&result, "mirror.test");
    assert!(!mirror.is_empty(), "{result}");
    assert!(mirror.iter().all(|a| a["verdict"] == "allowed"), "{result}");
    assert!(
        mirror
            .iter()
            .any(|a| a["bytes_received"].as_u64().unwrap_or(0) > 0),
        "{result}"
    );
    let (result, _) = shell(
        &airlock,
        &[
            "python3",
            "-c",
            "import sys; sys.path.insert(0, '/workspace/site'); import demo_pkg; print(demo_pkg.GREETING)",
        ],
        30,
    )
    .await;
    assert_eq!(result["stdout"], "hello from the mirror\n", "{result}");

    // git clone over HTTP from the mirror.
    let repo = format!("http://mirror.test:{}/repo.git", servers.mirror);
    let (result, _) = shell(&airlock, &["git", "clone", "-q", &repo, "clone"], 120).await;
    assert_eq!(result["exit_code"], 0, "{result}");
    let readme = airlock.workspace("egress").join("clone/README");
    assert_eq!(
        std::fs::read_to_string(&readme).ok().as_deref(),
        Some("cloned through the proxy\n")
    );

    // A flood of bounded connections, most of them garbage or left half-open: the
    // proxy refuses what it must, and the next call's proxy works as before.
    let flood = "import socket\n\
        socks = []\n\
        for i in range(200):\n\
        \x20   try:\n\
        \x20       s = socket.create_connection(('127.0.0.1', 3128), timeout=2)\n\
        \x20       s.sendall(b'GARBAGE ' * (i % 7) + (b'\\r\\n\\r\\n' if i % 2 else b''))\n\
        \x20       socks.append(s)\n\
        \x20   except OSError:\n\
        \x20       pass\n\
        print(len(socks))\n";
    let (result, _) = shell(&airlock, &["python3", "-c", flood], 60).await;
    assert_eq!(result["exit_code"], 0, "{result}");

    // Every other way out, as an attacker would try it.
    let orchestrator = airlock
        .url
        .rsplit(':')
        .next()
        .expect("port")
        .trim_end_matches('/')
        .to_owned();
    let (result, call) = shell(
        &airlock,
        &[
            "python3",
            "-c",
            PROBE,
            &servers.mirror.to_string(),
            &servers.forbidden.to_string(),
            &orchestrator,
            &airlock.data_dir().join("sockets").to_string_lossy(),
        ],
        120,
    )
    .await;
    assert_eq!(result["exit_code"], 0, "{result}");
    let probe: Value = serde_json::from_str(result["stdout"].as_str().expect("stdout"))
        .unwrap_or_else(|e| panic!("probe output: {e}: {result}"));
    let said = |name: &str| probe[name].as_str().unwrap_or_default().to_owned();
    for name in [
        "direct-forbidden",
        "direct-orchestrator",
        "direct-outside",
        "udp",
        "raw",
        "inet6",
        "worker-socket-shell",
        "worker-socket-fs",
        "worker-socket-http",
        "worker-socket-db",
    ] {
        assert!(said(name).starts_with("error"), "{name}: {probe}");
    }
    // The workers' sockets exist on the host (the probe's refusal is not a wrong path).
    for group in ["shell", "fs", "http", "db"] {
        let socket = airlock.data_dir().join(format!("sockets/{group}.sock"));
        assert!(socket.exists(), "{}", socket.display());
    }
    for name in [
        "connect-forbidden",
        "connect-other-port",
        "connect-ip-literal",
        "connect-rebind",
        "connect-orchestrator",
        "plain-forbidden",
    ] {
        assert!(said(name).starts_with("HTTP/1.1 403"), "{name}: {probe}");
    }
    assert!(said("host-mismatch").starts_with("HTTP/1.1 4"), "{probe}");
    assert!(said("not-http").starts_with("HTTP/1.1 4"), "{probe}");
    // The tunnel is opened, but a ClientHello naming another host ends it: a fatal TLS
    // access_denied alert (record type 0x15, level 2, description 49) or a close.
    let sni = said("sni-mismatch");
    assert!(sni.starts_with("HTTP/1.1 200"), "{probe}");
    assert!(
        sni.ends_with("after hello: closed")
            || (sni.contains("after hello: 1503") && sni.ends_with("0231")),
        "{probe}"
    );
    assert!(
        said("plain-allowed").starts_with("HTTP/1.") && said("plain-allowed").contains(" 200 "),
        "{probe}"
    );
    // A refusal says which rule refused it.
    assert!(
        said("connect-forbidden").contains("forbidden.test"),
        "{probe}"
    );
    assert!(said("connect-rebind").contains("127.0.0.1"), "{probe}");

    // The forbidden server never saw a connection, and the call's record and its audit
    // event list the refusals.
    assert_eq!(servers.forbidden_connections(), 0);
    let refused = attempts(&result, "forbidden.test");
    assert!(!refused.is_empty(), "{result}");
    assert!(
        refused
            .iter()
            .all(|a| a["verdict"] == "refused"
                && a["reason"].as_str().is_some_and(|r| !r.is_empty())),
        "{result}"
    );
    let call_id = call["call_id"].as_str().expect("call id");
    let (status, audit) = airlock.get("/v1/audit?limit=1000").await;
    assert_eq!(status, 200);
    let completed = audit["events"]
        .as_array()
        .expect("events")
        .iter()
        .find(|e| e["kind"] == "completed" && e["call_id"] == call_id)
        .cloned()
        .expect("the probe's completed event");
    assert!(
        completed.to_string().contains("forbidden.test"),
        "{completed}"
    );
    // A declared tool's egress_allow narrows the worker's list: the mirror, which
    // execute_shell reached above, is refused to it; a tool without network = "proxy"
    // reaches nothing at all.
    let mirror_url = format!("http://mirror.test:{}/simple/", servers.mirror);
    let (err, text, _) = airlock
        .call_in("egress", "fetch_narrowed", json!({"url": mirror_url}))
        .await;
    assert!(err, "{text}");
    let result: Value = serde_json::from_str(&text).expect("result");
    assert!(
        result["stdout"]
            .as_str()
            .unwrap_or_default()
            .contains("403"),
        "{result}"
    );
    let narrowed = attempts(&result, "mirror.test");
    assert!(
        narrowed.iter().any(|a| a["verdict"] == "refused"
            && a["reason"]
                .as_str()
                .is_some_and(|r| r.contains("egress_allow"))),
        "{result}"
    );
    let (err, text, _) = airlock
        .call_in("egress", "fetch_offline", json!({"url": mirror_url}))
        .await;
    assert!(err, "{text}");
    let result: Value = serde_json::from_str(&text).expect("result");
    assert!(
        result["stdout"]
            .as_str()
            .unwrap_or_default()
            .starts_with("failed:"),
        "{result}"
    );
    assert!(result.get("egress").is_none(), "{result}");

    let (status, verify) = airlock.get("/v1/audit/verify").await;
    assert_eq!(status, 200);
    assert_eq!(verify["ok"], true, "{verify}");
}

#[test]
fn bad_egress_settings_stop_the_start() {
    let dir = tempfile::tempdir().expect("temp dir");
    for (section, expected) in [
        (
            "[sandbox]\nnetwork = \"everywhere\"\n",
            "network = \"everywhere\"",
        ),
        (
            "[sandbox]\nnetwork = \"proxy\"\n[sandbox.egress]\nallow = [\"exa mple.com\"]\n",
            "exa mple.com",
        ),
        (
            "[sandbox]\nnetwork = \"proxy\"\n[sandbox.egress]\nhosts = { \"mirror.test\" = \"not-an-address\" }\n",
            "not-an-address",
        ),
    ] {
        let config = dir.path().join("airlock.toml");
        std::fs::write(
            &config,
            format!(
                "[orchestrator]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n{section}"
            ),
        )
        .expect("config");
        let log = up_refused(&config, &dir.path().join("data"));
        assert!(log.contains(expected), "{section}: {log}");
    }
}
