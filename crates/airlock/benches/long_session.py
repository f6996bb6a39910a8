"""A long session: what a call costs the orchestrator as its session grows.

    python3 crates/airlock/benches/long_session.py target/release/airlock [OTHER_AIRLOCK...]

Starts `airlock up` on a fresh data dir for each binary given (taking turns, ROUNDS
rounds), then makes SEGMENTS x PER sequential `read_file` calls of a SIZE-byte file in one
session, and prints the orchestrator's CPU time (user + system, from /proc) and the wall
time per call for each stretch of PER calls. A per-call cost that grows from stretch to
stretch grows with the session. Every answer is checked. For the orchestrator and the
fs worker it also prints their minor page faults and CPU per call over all the calls,
and the fs worker's anonymous memory (smaps_rollup) before its first call, right after
the last and IDLE seconds later.

Environment: SIZE (bytes, default 1 MiB), SEGMENTS (4), PER (100), ROUNDS (2), IDLE (6),
LINES (unset: random letters, spaces and line ends; set: lines of 63 letters and a line end).
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


def stat_fields(pid):
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()


def cpu_seconds(pid):
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / TICK


def minor_faults(pid):
    return int(stat_fields(pid)[7])


def anonymous_mib(pid):
    for line in open(f"/proc/{pid}/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no Anonymous line in /proc/{pid}/smaps_rollup")


def component_pid(launcher, *words):
    for child in open(f"/proc/{launcher}/task/{launcher}/children").read().split():
        cmdline = open(f"/proc/{child}/cmdline", "rb").read().split(b"\0")
        if all(word in cmdline for word in words):
            return int(child)
    raise RuntimeError(f"no {b' '.join(words)!r} under the launcher")


def orchestrator_pid(launcher):
    return component_pid(launcher, b"orchestrator")


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
        fs_worker = component_pid(launcher.pid, b"worker", b"fs")
        fs_before = anonymous_mib(fs_worker)

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
        if os.environ.get("LINES"):
            text = (("x" * 63 + "\n") * (size // 64 + 1))[:size]
        else:
            text = "".join(random.choice(string.ascii_letters + " \n") for _ in range(size))
        open(os.path.join(data, "workspaces", "local", "long", "f.txt"), "w").write(text)
        orchestrator = orchestrator_pid(launcher.pid)
        watched = {"orchestrator": orchestrator, "fs worker": fs_worker}
        start = {name: (minor_faults(pid), cpu_seconds(pid)) for name, pid in watched.items()}
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
        calls = segments * per
        costs = {
            name: (
                (minor_faults(pid) - start[name][0]) / calls,
                (cpu_seconds(pid) - start[name][1]) / calls * 1e3,
            )
            for name, pid in watched.items()
        }
        fs_after = anonymous_mib(fs_worker)
        time.sleep(float(os.environ.get("IDLE", 6)))
        memory = (fs_before, fs_after, anonymous_mib(fs_worker))
        return stretches, costs, memory
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
            stretches, costs, memory = run(os.path.abspath(binary), size, segments, per)
            cells = " | ".join(
                f"calls {i * per + 1}-{(i + 1) * per}: CPU {cpu:.2f} ms, wall {wall:.2f} ms"
                for i, (cpu, wall) in enumerate(stretches)
            )
            print(f"{binary} (round {round_ + 1}): {cells}", flush=True)
            per_call = ", ".join(
                f"{name} {faults:.1f} faults and {cpu:.2f} ms CPU a call"
                for name, (faults, cpu) in costs.items()
            )
            before, after, idle = memory
            print(
                f"  {per_call}; fs worker anonymous memory {before:.1f} MiB before the first "
                f"call, {after:.1f} after the last, {idle:.1f} once idle",
                flush=True,
            )


if __name__ == "__main__":
    main()
