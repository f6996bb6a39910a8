"""A long session: what a call costs the orchestrator as its session grows.

    python3 crates/airlock/benches/long_session.py target/release/airlock [OTHER_AIRLOCK...]

Starts `airlock up` on a fresh data dir for each binary given (taking turns, ROUNDS
rounds), then makes SEGMENTS x PER sequential `read_file` calls of a SIZE-byte file in one
session, and prints the orchestrator's CPU time (user + system, from /proc) and the wall
time per call for each stretch of PER calls. A per-call cost that grows from stretch to
stretch grows with the session. Every answer is checked.

Environment: SIZE (bytes, default 1 MiB), SEGMENTS (4), PER (100), ROUNDS (2).
Needs only Python's standard library; run it as the user `airlock up` runs as.
"""

import http.client
import json
import os
import random
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time

TICK = os.sysconf("SC_CLK_TCK")
CONFIG = """[orchestrator]
http_listen = "127.0.0.1:0"
grpc_listen = "127.0.0.1:0"

[fs]
max_read_bytes = 2097152

[budgets]
rate_per_minute = 0
max_calls_per_session = 1000000

[approvals]
tools = []
"""


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def orchestrator_pid(launcher):
    for child in open(f"/proc/{launcher}/task/{launcher}/children").read().split():
        cmdline = open(f"/proc/{child}/cmdline", "rb").read().split(b"\0")
        if b"orchestrator" in cmdline:
            return int(child)
    raise RuntimeError("no orchestrator under the launcher")


def run(binary, size, segments, per):
    scratch = tempfile.mkdtemp(prefix="airlock-long-session-")
    data = os.path.join(scratch, "data")
    config = os.path.join(scratch, "airlock.toml")
    open(config, "w").write(CONFIG)
    launcher = subprocess.Popen(
        [binary, "up", "--config", config, "--data-dir", data],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        endpoints = os.path.join(data, "endpoints.json")
        deadline = time.time() + 60
        while not os.path.exists(endpoints):
            if time.time() > deadline or launcher.poll() is not None:
                raise RuntimeError(f"{binary} up did not write {endpoints}")
            time.sleep(0.1)
        time.sleep(0.2)
        listed = json.load(open(endpoints))
        host, port = listed["http"].rsplit("//", 1)[-1].rsplit(":", 1)
        token = open(listed.get("token_file", os.path.join(data, "token"))).read().strip()
        conn = http.client.HTTPConnection(host, int(port))

        def call(path):
            body = json.dumps(
                {
                    "session_id": "long",
                    "wait_ms": 60000,
                    "tool_uses": [
                        {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": path}}
                    ],
                }
            )
            headers = {"Authorization": "Bearer " + token, "content-type": "application/json"}
            for _ in range(100):
                conn.request("POST", "/v1/tool_calls", body, headers)
                answer = conn.getresponse()
                text = answer.read()
                if answer.status != 503:
                    break
                time.sleep(0.1)  # still starting
            if answer.status != 200:
                raise RuntimeError(f"HTTP {answer.status}: {text[:300]!r}")
            return json.loads(text)

        call("missing.txt")  # makes the session's workspace
        random.seed(1)
        text = "".join(random.choice(string.ascii_letters + " \n") for _ in range(size))
        open(os.path.join(data, "workspaces", "local", "long", "f.txt"), "w").write(text)
        orchestrator = orchestrator_pid(launcher.pid)
        stretches = []
        for _ in range(segments):
            cpu0, wall0 = cpu_seconds(orchestrator), time.time()
            for _ in range(per):
                answer = call("f.txt")
                result = answer["tool_results"][0]
                if result["is_error"] or len(result["content"][0]["text"]) != size:
                    raise RuntimeError(f"unexpected answer: {str(answer)[:300]}")
            stretches.append(
                ((cpu_seconds(orchestrator) - cpu0) / per * 1e3, (time.time() - wall0) / per * 1e3)
            )
        return stretches
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=60)
        shutil.rmtree(scratch, ignore_errors=True)


def main():
    binaries = sys.argv[1:]
    if not binaries:
        sys.exit(__doc__)
    size = int(os.environ.get("SIZE", 1 << 20))
    segments = int(os.environ.get("SEGMENTS", 4))
    per = int(os.environ.get("PER", 100))
    for round_ in range(int(os.environ.get("ROUNDS", 2))):
        for binary in binaries:
            stretches = run(os.path.abspath(binary), size, segments, per)
            cells = " | ".join(
                f"calls {i * per + 1}-{(i + 1) * per}: CPU {cpu:.2f} ms, wall {wall:.2f} ms"
                for i, (cpu, wall) in enumerate(stretches)
            )
            print(f"{binary} (round {round_ + 1}): {cells}", flush=True)


if __name__ == "__main__":
    main()
