//! execute_shell through the orchestrator, and the confinement of every component.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::{Airlock, alive, cmdline, descendants, ends_soon, sse_events};

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("result is not JSON ({e}): {text}"))
}

#[tokio::test]
async fn execute_shell_runs_in_the_workspace_with_an_isolation_report() {
    let airlock = Airlock::start().await;
    let (err, text, call) = airlock
        .call_in(
            "sh",
            "execute_shell",
            json!({"command": "echo hi > made.txt; pwd; echo oops >&2; exit 3"}),
        )
        .await;
    assert!(err, "a non-zero exit is an error result");
    let result = parse(&text);
    assert_eq!(result["exit_code"], 3);
    assert_eq!(result["stdout"], "/workspace\n");
    assert_eq!(result["stderr"], "oops\n");
    assert_eq!(result["timed_out"], false);
    assert_eq!(call["status"], "error");
    for key in [
        "stdout_truncated",
        "stderr_truncated",
        "duration_ms",
        "usage",
        "signal",
    ] {
        assert!(result.get(key).is_some(), "{key} missing");
    }
    let isolation = &call["isolation"];
    assert_eq!(
        isolation, &result["isolation"],
        "calls[].isolation repeats the report"
    );
    assert_eq!(isolation["level"], "strict");
    assert_eq!(isolation["seccomp"], "filter");
    assert_eq!(isolation["no_new_privs"], true);
    assert_eq!(isolation["network"], "none");
    assert!(
        isolation["namespaces"]
            .as_array()
            .expect("namespaces")
            .len()
            >= 7,
        "{isolation}"
    );
    assert_eq!(
        std::fs::read_to_string(airlock.workspace("sh").join("made.txt")).expect("file"),
        "hi\n"
    );

    let (err, text, call) = airlock
        .call_in(
            "sh",
            "execute_shell",
            json!({"argv": ["cat"], "stdin": "piped", "env": {"LANG": "C.UTF-8"}}),
        )
        .await;
    assert!(!err, "{text}");
    assert_eq!(parse(&text)["stdout"], "piped");
    assert_eq!(call["status"], "ok");

    let (err, text, _) = airlock
        .call(
            "execute_shell",
            json!({"command": "env", "env": {"LD_PRELOAD": "/x.so"}}),
        )
        .await;
    assert!(err && text.contains("not allowed"), "{text}");
    let (err, text, _) = airlock
        .call(
            "execute_shell",
            json!({"command": "true", "argv": ["true"]}),
        )
        .await;
    assert!(err, "command and argv together are refused: {text}");
    let (err, text, _) = airlock
        .call("execute_shell", json!({"command": "pwd", "cwd": "../.."}))
        .await;
    assert!(err && text.contains(".."), "{text}");
}

#[tokio::test]
async fn the_sandbox_environment_holds_no_secrets() {
    let airlock = Airlock::start().await;
    let (err, text, _) = airlock
        .call(
            "execute_shell",
            json!({"command": "env; cat /proc/1/environ | tr '\\0' '\\n'"}),
        )
        .await;
    assert!(!err, "{text}");
    let result = parse(&text);
    assert_eq!(result["exit_code"], 0, "{result}");
    let stdout = result["stdout"].as_str().expect("stdout");
    // The command's environment is exactly what the sandbox sets (the shell adds PWD).
    let mut variables: Vec<&str> = stdout.lines().collect();
    variables.sort_unstable();
    assert_eq!(
        variables,
        [
            "HOME=/workspace",
            "PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin",
            "PWD=/workspace",
            "TMPDIR=/tmp",
        ],
        "{stdout}"
    );
    // The sandbox's init (pid 1 of its pid namespace) keeps its environment unreadable.
    assert_eq!(
        result["stderr"], "cat: /proc/1/environ: Permission denied\n",
        "{result}"
    );
    assert!(
        !stdout.contains(&airlock.token),
        "the token reached the sandbox"
    );
    assert!(
        !stdout.contains("AIRLOCK_"),
        "airlock variables reached the sandbox: {stdout}"
    );
    assert!(!stdout.contains("RUST_LOG"), "{stdout}");
}

#[tokio::test]
async fn a_command_that_outlives_its_timeout_is_killed() {
    let airlock = Airlock::start().await;
    let started = Instant::now();
    let (err, text, call) = airlock
        .call(
            "execute_shell",
            json!({"command": "echo start; sleep 30; echo never", "timeout_seconds": 1}),
        )
        .await;
    assert!(err);
    let result = parse(&text);
    // Only the 1 s timeout can end a command that sleeps 30 s before its last line.
    assert_eq!(result["timed_out"], true, "{result}");
    assert_eq!(result["stdout"], "start\n");
    assert_eq!(call["status"], "timeout");
    eprintln!(
        "a 1 s timeout answered after {:?} (measured, not asserted)",
        started.elapsed()
    );
}

#[tokio::test]
async fn cancelling_a_call_kills_its_sandbox() {
    let airlock = Airlock::start().await;
    let marker = format!("airlock-cancel-{}", std::process::id());
    let body = json!({"wait_ms": 0, "tool_uses": [{"type": "tool_use", "id": "long", "name": "execute_shell",
        "input": {"command": format!("sleep 60 # {marker}"), "timeout_seconds": 120}}]});
    let (status, response) = airlock.post("/v1/tool_calls", &body).await;
    assert_eq!(status, 200);
    assert_eq!(response["calls"][0]["status"], "running", "{response}");
    assert!(
        response["tool_results"]
            .as_array()
            .expect("array")
            .is_empty()
    );
    let call_id = response["calls"][0]["call_id"]
        .as_str()
        .expect("call_id")
        .to_owned();

    // Wait until the sandboxed sleep is running somewhere below the launcher.
    airlock.wait_started(&marker, "the sandboxed command").await;
    let (status, cancelled) = airlock
        .post(&format!("/v1/calls/{call_id}/cancel"), &json!({}))
        .await;
    assert_eq!(status, 200);
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    airlock
        .wait_gone(&marker, "the sandbox survived the cancellation")
        .await;
}

#[tokio::test]
async fn output_streams_over_grpc_while_the_command_runs() {
    use airlock_proto::v1 as pb;
    let airlock = Airlock::start().await;
    let mut client = airlock.grpc_client().await;
    let mut request = tonic::Request::new(pb::CallToolStreamRequest {
        session_id: "stream".into(),
        tool_use: Some(pb::ToolUse {
            id: "s".into(),
            name: "execute_shell".into(),
            input_json: json!({"command": RELEASED_BY_THE_TEST, "timeout_seconds": 60}).to_string(),
        }),
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", airlock.token)
            .parse()
            .expect("metadata"),
    );
    let mut stream = client
        .call_tool_stream(request)
        .await
        .expect("stream")
        .into_inner();
    // The command cannot finish before the test has seen its first line: the file it
    // waits for is created only then. Output held back until the end never arrives.
    let go = airlock.workspace("stream").join("go");
    let mut released = false;
    let mut completed = false;
    for _ in 0..10_000 {
        let event = tokio::time::timeout(Duration::from_secs(90), stream.message())
            .await
            .expect("the stream went quiet")
            .expect("event");
        let Some(event) = event else { break };
        match event.event {
            Some(pb::call_event::Event::Output(chunk)) if chunk.data.contains("first") => {
                assert!(!completed, "output after completion");
                if !released {
                    std::fs::write(&go, "").expect("release the command");
                    released = true;
                }
            }
            Some(pb::call_event::Event::Completed(done)) => {
                assert!(
                    released,
                    "the call completed before its first output was streamed: {done:?}"
                );
                completed = true;
                let result = done.result.expect("result");
                let shell = parse(&result.content[0]);
                assert_eq!(shell["stdout"], "first\nsecond\n", "{shell}");
                assert_eq!(shell["exit_code"], 0, "{shell}");
            }
            _ => {}
        }
    }
    assert!(
        released && completed,
        "released {released}, completed {completed}"
    );
}

/// Prints `first`, then waits (bounded by its timeout) for the file `go` the test creates
/// once it has received that line, then prints `second`.
const RELEASED_BY_THE_TEST: &str =
    "echo first; while [ ! -e go ]; do sleep 0.05; done; echo second";

#[tokio::test]
async fn every_long_running_component_is_confined() {
    let airlock = Airlock::start().await;
    let processes: Vec<(u32, String)> = descendants(airlock.pid())
        .into_iter()
        .map(|p| (p, cmdline(p)))
        .collect();
    let mut checked = 0;
    for (pid, cmd) in &processes {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
                .unwrap_or_default()
                .to_owned()
        };
        if cmd.contains("serve orchestrator")
            || cmd.contains("serve worker fs")
            || cmd.contains("serve worker http")
            || cmd.contains("serve worker db")
        {
            assert_eq!(field("NoNewPrivs:"), "1", "{cmd}");
            assert_eq!(field("Seccomp:"), "2", "{cmd}");
            assert_eq!(field("CapEff:"), "0000000000000000", "{cmd}");
            assert_eq!(field("CapBnd:"), "0000000000000000", "{cmd}");
            checked += 1;
        } else if cmd.contains("serve worker shell") {
            // The shell worker may exec (into sandboxes) but holds no capability beyond
            // CAP_SETFCAP (needed to map root into a user namespace) and no bounding set.
            assert_eq!(field("NoNewPrivs:"), "1", "{cmd}");
            assert_eq!(field("Seccomp:"), "2", "{cmd}");
            let eff = u64::from_str_radix(&field("CapEff:"), 16).expect("hex");
            assert_eq!(eff & !(1 << 31), 0, "shell worker capabilities: {eff:x}");
            assert_eq!(field("CapBnd:"), "0000000000000000", "{cmd}");
            checked += 1;
        }
    }
    assert_eq!(
        checked, 5,
        "orchestrator and the fs, shell, http and db workers: {processes:?}"
    );
}

#[tokio::test]
async fn the_sandbox_cannot_leave_setid_files_in_the_workspace() {
    let airlock = Airlock::start().await;
    let script = "cp /usr/bin/id x; chmod 4755 x; echo chmod=$?; chmod 2755 x; echo chgrp=$?; \
                  perl -e 'use Fcntl; sysopen(F, \"y\", O_CREAT|O_WRONLY, 06755) or print \"open=$!\\n\"'; \
                  chmod 755 x; echo plain=$?";
    let (_, text, _) = airlock
        .call_in("setid", "execute_shell", json!({"command": script}))
        .await;
    let result = parse(&text);
    let stdout = result["stdout"].as_str().expect("stdout");
    assert!(
        stdout.contains("chmod=1") && stdout.contains("chgrp=1"),
        "{stdout}"
    );
    assert!(stdout.contains("open=Operation not permitted"), "{stdout}");
    assert!(
        stdout.contains("plain=0"),
        "ordinary modes still work: {stdout}"
    );
    use std::os::unix::fs::PermissionsExt;
    for entry in std::fs::read_dir(airlock.workspace("setid"))
        .expect("workspace")
        .flatten()
    {
        let mode = entry.metadata().expect("metadata").permissions().mode();
        assert_eq!(mode & 0o6000, 0, "{:?} has mode {mode:o}", entry.path());
    }
}

#[tokio::test]
async fn tool_calls_stream_server_sent_events_and_closing_cancels() {
    let airlock = Airlock::start().await;
    let body = json!({"session_id": "sse", "tool_uses": [{"type": "tool_use", "id": "s1", "name": "execute_shell",
        "input": {"command": RELEASED_BY_THE_TEST, "timeout_seconds": 60}}]});
    let mut response = airlock
        .request(reqwest::Method::POST, "/v1/tool_calls?stream=true")
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .expect("type")
            .starts_with("text/event-stream")
    );
    // The command finishes only after the test has read its first line from the stream
    // (see RELEASED_BY_THE_TEST): a stream that held output back would never get there.
    let go = airlock.workspace("sse").join("go");
    let mut text = String::new();
    let mut released = false;
    for _ in 0..10_000 {
        let chunk = tokio::time::timeout(Duration::from_secs(90), response.chunk())
            .await
            .expect("the stream went quiet")
            .expect("read the stream");
        let Some(chunk) = chunk else { break };
        text.push_str(&String::from_utf8_lossy(&chunk));
        if !released {
            let events = sse_events(&text);
            assert!(
                !events.iter().any(|(name, _)| name == "call.completed"),
                "the call completed before its first output was streamed: {text}"
            );
            if events
                .iter()
                .any(|(name, data)| name == "call.output" && data["data"] == "first\n")
            {
                std::fs::write(&go, "").expect("release the command");
                released = true;
            }
        }
    }
    assert!(released, "no output event for the first line: {text}");
    let events = sse_events(&text);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names.first(), Some(&"call.started"), "{text}");
    assert_eq!(names.last(), Some(&"call.completed"), "{text}");
    let outputs: Vec<&Value> = events
        .iter()
        .filter(|(name, _)| name == "call.output")
        .map(|(_, data)| &data["data"])
        .collect();
    assert_eq!(outputs, [&json!("first\n"), &json!("second\n")], "{text}");
    let (_, completed) = events.last().expect("completed");
    assert_eq!(completed["call"]["status"], "ok", "{completed}");

    // Closing the stream cancels the call and kills its sandbox.
    let marker = format!("airlock-sse-{}", std::process::id());
    let body = json!({"tool_uses": [{"type": "tool_use", "id": "s2", "name": "execute_shell",
        "input": {"command": format!("sleep 60 # {marker}"), "timeout_seconds": 120}}]});
    let response = airlock
        .request(reqwest::Method::POST, "/v1/tool_calls?stream=true")
        .json(&body)
        .send()
        .await
        .expect("send");
    airlock.wait_started(&marker, "the streamed command").await;
    drop(response);
    airlock
        .wait_gone(&marker, "closing the stream did not kill the sandbox")
        .await;
    let (status, _) = airlock.post("/v1/tool_calls?stream=maybe", &body).await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn closing_a_grpc_call_stream_kills_its_sandbox() {
    use airlock_proto::v1 as pb;
    let airlock = Airlock::start().await;
    let marker = format!("airlock-grpc-close-{}", std::process::id());
    let mut client = airlock.grpc_client().await;
    let mut request = tonic::Request::new(pb::CallToolStreamRequest {
        session_id: "grpc-close".into(),
        tool_use: Some(pb::ToolUse {
            id: "s".into(),
            name: "execute_shell".into(),
            input_json: json!({"command": format!("sleep 60 # {marker}"), "timeout_seconds": 120})
                .to_string(),
        }),
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", airlock.token)
            .parse()
            .expect("metadata"),
    );
    let mut stream = client
        .call_tool_stream(request)
        .await
        .expect("stream")
        .into_inner();
    let started = stream
        .message()
        .await
        .expect("event")
        .expect("started event");
    assert!(matches!(
        started.event,
        Some(pb::call_event::Event::Started(_))
    ));
    airlock.wait_started(&marker, "the streamed command").await;
    drop(stream);
    drop(client);
    airlock
        .wait_gone(&marker, "closing the gRPC stream did not kill the sandbox")
        .await;
}

/// A file moved to another directory of the sandbox with rename(2) — Python's
/// `os.rename`, git's and pip's own stores — stays a rename: no layer of the worker's
/// own confinement below the sandbox's rules refuses it with EXDEV (coreutils' `mv`
/// would hide that by copying).
#[tokio::test]
async fn renames_across_directories_work_in_the_sandbox() {
    let airlock = Airlock::start().await;
    let program = "import os\n\
        os.makedirs('d', exist_ok=True)\n\
        open('g', 'w').write('1')\n\
        os.rename('g', 'd/g')\n\
        os.makedirs('a/b', exist_ok=True)\n\
        open('a/b/t', 'w').write('2')\n\
        os.rename('a/b/t', 'd/t')\n\
        os.rename('d', 'e')\n\
        print(sorted(os.listdir('e')))";
    let (err, text, _) = airlock
        .call("execute_shell", json!({"argv": ["python3", "-c", program]}))
        .await;
    assert!(!err, "{text}");
    let result: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(result["stdout"], "['g', 't']\n", "{result}");
    // ...and still only inside it: the host's /etc is not the sandbox's to move into.
    let (err, text, _) = airlock
        .call(
            "execute_shell",
            json!({"argv": ["python3", "-c", "import os; open('x','w').write('1'); os.rename('x', '/etc/x')"]}),
        )
        .await;
    assert!(err, "{text}");
    assert!(!std::path::Path::new("/etc/x").exists());
}

/// The pid namespace links (`pid:[…]`) of the shell worker's waiting pre-built
/// sandboxes (its children named `airlock-ready`), by pid.
fn waiting_sandboxes(airlock: &Airlock) -> Vec<(u32, String)> {
    descendants(airlock.pid())
        .into_iter()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .is_ok_and(|c| c.trim() == "airlock-ready")
        })
        .filter_map(|p| {
            let ns = std::fs::read_link(format!("/proc/{p}/ns/pid")).ok()?;
            Some((p, ns.to_string_lossy().into_owned()))
        })
        .collect()
}

/// Waits until the shell worker has `n` pre-built sandboxes waiting.
async fn wait_for_waiting(airlock: &Airlock, n: usize) -> Vec<(u32, String)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let waiting = waiting_sandboxes(airlock);
        if waiting.len() == n {
            return waiting;
        }
        assert!(
            Instant::now() < deadline,
            "{} pre-built sandboxes waiting, not {n}: {waiting:?}",
            waiting.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `[sandbox] prebuilt` (default 2): the shell worker keeps sandboxes pre-built, a call
/// runs in one of them — its namespaces are that waiting process's — and the next call
/// in another; nothing of one call (its /tmp) is seen by the next; none is left when
/// Airlock stops. (No per-workspace volume here: a volume mounted after an entry was
/// built sends the call to a fresh sandbox, see the sandbox crate's tests.)
#[tokio::test]
async fn each_call_runs_in_a_pre_built_sandbox_of_its_own() {
    let mut airlock =
        Airlock::start_with("[sandbox]\nworkspace_bytes = 0\nworkspace_inodes = 0\n").await;
    let script = "readlink /proc/self/ns/pid /proc/self/ns/net /proc/self/ns/mnt; ls /tmp; \
                  echo secret > /tmp/left-behind";
    let mut seen = Vec::new();
    // The first call starts the pool; the next two must each take a waiting entry.
    for round in 0..3 {
        let waiting = if round > 0 {
            wait_for_waiting(&airlock, 2).await
        } else {
            Vec::new()
        };
        let (err, text, _) = airlock
            .call_in("pool", "execute_shell", json!({"command": script}))
            .await;
        assert!(!err, "{text}");
        let result = parse(&text);
        let stdout = result["stdout"].as_str().expect("stdout").to_owned();
        let lines: Vec<&str> = stdout.lines().collect();
        // Three namespace links, and an empty /tmp: no earlier call's file in it.
        assert_eq!(lines.len(), 3, "{stdout}");
        assert_eq!(result["isolation"]["level"], "strict");
        if round > 0 {
            assert!(
                waiting.iter().any(|(_, ns)| ns == lines[0]),
                "call {round} ran in {} and not in a waiting sandbox: {waiting:?}",
                lines[0]
            );
            // That entry is gone: used once, then destroyed with the call (after the
            // answer when init reported it early: the teardown is off the call's path).
            let used: Vec<u32> = waiting
                .iter()
                .filter(|(_, ns)| ns == lines[0])
                .map(|(p, _)| *p)
                .collect();
            for pid in used {
                assert!(ends_soon(pid).await, "the entry {pid} outlived its call");
            }
        }
        seen.push(lines.iter().map(|l| l.to_string()).collect::<Vec<_>>());
    }
    for kind in 0..3 {
        let mut links: Vec<&String> = seen.iter().map(|s| &s[kind]).collect();
        links.sort();
        links.dedup();
        assert_eq!(links.len(), 3, "calls shared a namespace: {seen:?}");
    }
    let waiting = wait_for_waiting(&airlock, 2).await;
    airlock.stop();
    for (pid, _) in waiting {
        assert!(!alive(pid), "the pre-built sandbox {pid} outlived Airlock");
    }
}

/// `[sandbox] prebuilt = 0`: every sandbox is built for its call, none waits.
#[tokio::test]
async fn prebuilt_zero_keeps_no_sandbox_waiting() {
    let airlock = Airlock::start_with("[sandbox]\nprebuilt = 0\n").await;
    let (err, text, _) = airlock
        .call_in("nopool", "execute_shell", json!({"command": "true"}))
        .await;
    assert!(!err, "{text}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(waiting_sandboxes(&airlock), Vec::new());
}
