#!/usr/bin/env python3
"""Drives deploy/compose/compose.yaml for real and checks what the system promises.

    deploy/compose/test-compose.py        (as root, after deploy/docker/build-images.sh)

Starts PostgreSQL, two orchestrators, three fs, two shell, an http and a db worker as
containers on private Docker networks (a project of its own, removed at the end with its
volumes), then proves, with loads bounded in count and time:

- no container is privileged: each runs as 65532 on a read-only root, no capability,
  no_new_privs, Docker's seccomp filter;
- calls spread over all three fs replicas, through either orchestrator;
- `docker-compose up --scale fs=1`, then `fs=3`, under load, loses no read-only call;
- `docker kill` of an fs worker under load loses no read-only call;
- `docker network disconnect` of an fs worker ejects it (no call goes there) and it is
  re-admitted when connected again;
- a call held for approval on one orchestrator, which is then killed, runs exactly once
  when approved through the other (and stays run once when the first comes back);
- a rolling restart of every fs and shell worker under load fails no call;
- from inside a sandbox no other container, no worker port and no key is reachable, and
  every service still serves afterwards.

Needs docker, docker-compose, the images airlock:dev and airlock-shell:dev, and what
deploy/compose/prepare.sh needs (PostgreSQL installed on this machine). Only the Python
standard library. Exits non-zero when a check fails.
"""

import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
COMPOSE_FILE = os.path.join(HERE, "compose.yaml")
PROJECT = f"airlockcompose{os.getpid()}"
SESSION = "compose"
READ_FILE = "shared.txt"
# Every load stops at whichever comes first.
LOAD_MAX_CALLS = 4000
LOAD_MAX_SECONDS = 240
WAIT_SECONDS = 90


class CheckFailed(Exception):
    pass


def expect(condition, message):
    if not condition:
        raise CheckFailed(message)


def run(*argv, check=True, capture=True, timeout=300):
    done = subprocess.run(argv, capture_output=capture, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise CheckFailed(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout if capture else ""


class System:
    """The Compose project: its containers, addresses and front doors."""

    def __init__(self, state):
        self.state = state
        self.env_file = os.path.join(state, "compose.env")
        self.tokens = {}
        with open(os.path.join(state, "principals.env")) as f:
            for line in f:
                name, _, value = line.strip().partition("=")
                self.tokens[name] = value
        self.agent = self.tokens["AIRLOCK_AGENT_TOKEN"]
        self.approver = self.tokens["AIRLOCK_APPROVER_TOKEN"]

    def compose(self, *args, timeout=300):
        return run("docker-compose", "--env-file", self.env_file, "-f", COMPOSE_FILE, "-p", PROJECT,
                   *args, timeout=timeout)

    def containers(self, service):
        out = run("docker", "ps", "-q", "--no-trunc",
                  "--filter", f"label=com.docker.compose.project={PROJECT}",
                  "--filter", f"label=com.docker.compose.service={service}")
        return sorted(out.split())

    def all_containers(self):
        out = run("docker", "ps", "-aq", "--no-trunc", "--filter", f"label=com.docker.compose.project={PROJECT}")
        return out.split()

    def inspect(self, cid):
        return json.loads(run("docker", "inspect", cid))[0]

    def ip(self, cid, network="backend"):
        nets = self.inspect(cid)["NetworkSettings"]["Networks"]
        net = nets.get(f"{PROJECT}_{network}")
        return net["IPAddress"] if net else ""

    def front(self, service):
        (cid,) = self.containers(service)
        ip = self.ip(cid, "front")
        expect(ip, f"{service} has no address on the front network")
        return ip

    def logs(self, service, tail=40):
        return self.compose("logs", "--no-color", f"--tail={tail}", service)


class Front:
    """One orchestrator's HTTP front door, one keep-alive connection per thread."""

    def __init__(self, system, service):
        self.system = system
        self.service = service
        self.host = system.front(service)
        self.local = threading.local()

    def request(self, method, path, body=None, token=None, timeout=120):
        for attempt in (0, 1):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = http.client.HTTPConnection(self.host, 7070, timeout=timeout)
                self.local.conn = conn
            headers = {"content-type": "application/json"}
            if token:
                headers["authorization"] = f"Bearer {token}"
            try:
                conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
                response = conn.getresponse()
                data = response.read()
                return response.status, (json.loads(data) if data else None)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                # A keep-alive connection the server closed while idle: once more, fresh.
                conn.close()
                self.local.conn = None
                if attempt == 1:
                    return 0, {"transport": str(e)}
            except OSError as e:
                conn.close()
                self.local.conn = None
                return 0, {"transport": str(e)}
        return 0, None

    def call(self, tool, input, session=SESSION, wait_ms=None):
        body = {"session_id": session, "tool_uses": [{"type": "tool_use", "id": "t", "name": tool, "input": input}]}
        if wait_ms is not None:
            body["wait_ms"] = wait_ms
        status, answer = self.request("POST", "/v1/tool_calls", body, token=self.system.agent)
        return Outcome(status, answer)

    def readyz(self):
        status, body = self.request("GET", "/readyz", timeout=10)
        return body if status in (200, 503) and isinstance(body, dict) else {}

    def replicas(self, group):
        return self.readyz().get("replicas", {}).get(group, [])


class Outcome:
    def __init__(self, status, answer):
        self.http_status = status
        self.answer = answer or {}
        calls = self.answer.get("calls") or [{}]
        results = self.answer.get("tool_results") or [{}]
        self.status = calls[0].get("status", "?")
        self.call_id = calls[0].get("call_id", "")
        self.approval_id = calls[0].get("approval_id", "")
        self.replica = calls[0].get("replica", "") or ""
        self.is_error = results[0].get("is_error", True) if results[0] else True
        content = results[0].get("content", "") if results[0] else ""
        self.text = content if isinstance(content, str) else json.dumps(content)

    @property
    def ok(self):
        return self.http_status == 200 and self.status == "ok" and not self.is_error

    def __repr__(self):
        return f"<{self.http_status} {self.status} error={self.is_error} replica={self.replica} {self.text[:200]!r}>"


class Load:
    """Read-only calls from several threads until stopped, bounded in count and time."""

    def __init__(self, fronts, threads=6, tools=(("read_file", {"path": READ_FILE}),)):
        self.fronts = fronts
        self.tools = tools
        self.stop_flag = threading.Event()
        self.lock = threading.Lock()
        self.results = []
        self.count = 0
        self.deadline = time.monotonic() + LOAD_MAX_SECONDS
        self.threads = [threading.Thread(target=self.worker, args=(i,), daemon=True) for i in range(threads)]
        for t in self.threads:
            t.start()

    def worker(self, index):
        front = self.fronts[index % len(self.fronts)]
        n = 0
        while not self.stop_flag.is_set() and time.monotonic() < self.deadline:
            with self.lock:
                if self.count >= LOAD_MAX_CALLS:
                    return
                self.count += 1
            tool, input = self.tools[n % len(self.tools)]
            n += 1
            outcome = front.call(tool, input)
            with self.lock:
                self.results.append((time.monotonic(), front.service, outcome))

    def served_since(self, t0):
        with self.lock:
            return sum(1 for t, _, _ in self.results if t >= t0)

    def wait_for_calls(self, n, since=0.0, timeout=60):
        deadline = time.monotonic() + timeout
        while self.served_since(since) < n:
            expect(time.monotonic() < deadline, f"the load made fewer than {n} calls in {timeout} s")
            time.sleep(0.05)

    def stop(self):
        self.stop_flag.set()
        for t in self.threads:
            t.join(timeout=150)
        failed = [(s, o) for _, s, o in self.results if not o.ok]
        expect(not failed, f"{len(failed)} of {len(self.results)} calls failed, e.g. {failed[:3]}")
        expect(self.results, "the load made no call")
        return self.results


def wait_until(what, predicate, timeout=WAIT_SECONDS):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.2)
    raise CheckFailed(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def serving(front, group):
    return sorted(r["endpoint"] for r in front.replicas(group) if r.get("state") == "serving")


def endpoint_ips(endpoints):
    return sorted(re.sub(r"^[a-z]+://", "", e).rsplit(":", 1)[0] for e in endpoints)


def wait_serving(system, fronts, group, service):
    """Until every front door sees exactly the service's running containers as serving."""

    def matched():
        want = sorted(system.ip(c) for c in system.containers(service))
        return all(endpoint_ips(serving(f, group)) == want for f in fronts) and want

    return wait_until(f"{group} replicas {service} serving on every orchestrator", matched)


def replica_ip(outcome):
    return endpoint_ips([outcome.replica])[0] if outcome.replica else ""


# --- the checks -------------------------------------------------------------------------

def t_hardening(system, fronts):
    cids = system.all_containers()
    expect(len(cids) == 10, f"expected 10 containers, found {len(cids)}")
    for cid in cids:
        info = system.inspect(cid)
        name = info["Name"].lstrip("/")
        host = info["HostConfig"]
        expect(host["Privileged"] is False, f"{name} is privileged")
        expect(not host.get("CapAdd"), f"{name} adds capabilities {host.get('CapAdd')}")
        expect("ALL" in (host.get("CapDrop") or []), f"{name} does not drop ALL capabilities")
        expect(host["ReadonlyRootfs"] is True, f"{name} has a writable root")
        expect(info["Config"]["User"] == "65532:65532", f"{name} runs as {info['Config']['User']!r}")
        expect(any(o.startswith("no-new-privileges") for o in host.get("SecurityOpt") or []),
               f"{name} lacks no-new-privileges")
        expect(not any("seccomp" in o or "apparmor" in o for o in host.get("SecurityOpt") or []),
               f"{name} changes the seccomp or AppArmor profile: {host.get('SecurityOpt')}")
        expect(host.get("NetworkMode") != "host" and host.get("PidMode") != "host", f"{name} shares a host namespace")
        pid = info["State"]["Pid"]
        status = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":\t" in line)
        expect(status["Uid"].split()[0] == "65532", f"{name}'s process runs as uid {status['Uid']}")
        expect(status["CapEff"].strip() == "0000000000000000", f"{name} has capabilities {status['CapEff']}")
        expect(status["NoNewPrivs"].strip() == "1", f"{name} lacks no_new_privs")
        expect(status["Seccomp"].strip() == "2", f"{name} has no seccomp filter")
    print(f"    {len(cids)} containers: 65532, read-only root, CapEff 0, no_new_privs, seccomp filter, not privileged")


def t_spread(system, fronts):
    want = sorted(system.ip(c) for c in system.containers("fs"))
    expect(len(want) == 3, f"{len(want)} fs containers, not 3")
    load = Load(fronts, threads=6)
    load.wait_for_calls(150)
    results = load.stop()
    seen = {}
    for _, service, o in results:
        seen.setdefault(replica_ip(o), set()).add(service)
    expect(sorted(seen) == want, f"calls went to {sorted(seen)}, the fs replicas are {want}")
    for ip, services in sorted(seen.items()):
        expect(services == {"orchestrator-a", "orchestrator-b"}, f"{ip} was used only through {services}")
    counts = {ip: sum(1 for _, _, o in results if replica_ip(o) == ip) for ip in want}
    print(f"    {len(results)} reads through both orchestrators, by replica: {counts}")


def t_db_and_http(system, fronts):
    for front in fronts:
        # The db worker reaches its database on the PostgreSQL service over verified TLS.
        tables = front.call("list_tables", {"database": "sandbox"})
        expect(tables.ok, f"list_tables through {front.service}: {tables}")
        # The http worker has a way out, but not to another container: private addresses
        # are refused by the worker itself, before any connection.
        for target in ("http://postgres:5432/", f"http://{system.ip(system.containers('fs')[0])}:50051/"):
            fetched = front.call("http_request", {"method": "GET", "url": target})
            expect(fetched.status == "error" and fetched.is_error and "private-use address" in fetched.text,
                   f"http_request GET {target} through {front.service}: {fetched}")
    print("    list_tables answered through both orchestrators; GETs to postgres and an fs worker refused "
          "as private-use addresses")


def t_scale(system, fronts):
    load = Load(fronts, threads=6)
    load.wait_for_calls(30)
    system.compose("up", "-d", "--no-recreate", "--scale", "fs=1", "fs")
    expect(len(system.containers("fs")) == 1, "fs is not down to 1 container")
    wait_serving(system, fronts, "fs", "fs")
    t1 = time.monotonic()
    load.wait_for_calls(30, since=t1)
    system.compose("up", "-d", "--no-recreate", "--scale", "fs=3", "fs")
    expect(len(system.containers("fs")) == 3, "fs is not back to 3 containers")
    wait_serving(system, fronts, "fs", "fs")
    t3 = time.monotonic()
    load.wait_for_calls(90, since=t3)
    results = load.stop()
    after = {replica_ip(o) for t, _, o in results if t >= t3}
    want = sorted(system.ip(c) for c in system.containers("fs"))
    expect(sorted(after) == want, f"back at 3, calls went to {sorted(after)}, not to all of {want}")
    print(f"    {len(results)} reads, none failed, through fs 3 -> 1 -> 3; after: {sorted(after)} of {want}")


def t_kill(system, fronts):
    victim = system.containers("fs")[0]
    victim_ip = system.ip(victim)
    load = Load(fronts, threads=8)
    load.wait_for_calls(40)
    # Calls are in flight on every replica all the time at this concurrency.
    run("docker", "kill", victim)
    t_kill = time.monotonic()
    wait_until("the killed replica to leave serving",
               lambda: all(victim_ip not in endpoint_ips(serving(f, "fs")) for f in fronts))
    load.wait_for_calls(60, since=t_kill)
    results = load.stop()
    before = sum(1 for t, _, o in results if t < t_kill and replica_ip(o) == victim_ip)
    expect(before > 0, "no call had gone to the victim before the kill")
    late = [o for t, _, o in results if t > t_kill + 1 and replica_ip(o) == victim_ip]
    expect(not late, f"calls still went to the killed replica: {late[:3]}")
    run("docker", "start", victim)
    wait_serving(system, fronts, "fs", "fs")
    print(f"    {len(results)} reads, none failed; {before} served by {victim_ip} before SIGKILL")


def t_disconnect(system, fronts):
    victim = system.containers("fs")[1]
    victim_ip = system.ip(victim)
    network = f"{PROJECT}_backend"
    load = Load(fronts, threads=6)
    load.wait_for_calls(30)
    run("docker", "network", "disconnect", network, victim)
    t_cut = time.monotonic()
    try:
        wait_until("the disconnected replica to be ejected",
                   lambda: all(victim_ip not in endpoint_ips(serving(f, "fs")) for f in fronts), timeout=60)
        t_ejected = time.monotonic()
        load.wait_for_calls(60, since=t_ejected)
        results = load.stop()
        late = [o for t, _, o in results if t > t_ejected + 0.5 and replica_ip(o) == victim_ip]
        expect(not late, f"calls went to the disconnected replica after its ejection: {late[:3]}")
        states = {f.service: [(r["endpoint"], r["state"]) for r in f.replicas("fs")] for f in fronts}
    finally:
        # Compose put the service's name on the container as a network alias; a
        # connection made by hand must give it again, or Docker's DNS leaves it out.
        run("docker", "network", "connect", "--alias", "fs", network, victim)
    wait_serving(system, fronts, "fs", "fs")
    print(f"    ejected {t_ejected - t_cut:.1f} s after the cut; {len(results)} reads, none failed; "
          f"states then: {states}; re-admitted at {system.ip(victim)} once connected")


def approve(front, approval_id):
    status, body = front.request("POST", f"/v1/approvals/{approval_id}/approve", {"reason": "compose test"},
                                 token=front.system.approver)
    expect(status == 200, f"approving {approval_id} through {front.service}: {status} {body}")


def wait_call(front, call_id, timeout_ms=60000):
    status, body = front.request("GET", f"/v1/calls/{call_id}?wait_ms={timeout_ms}", token=front.system.agent)
    expect(status == 200, f"GET /v1/calls/{call_id} through {front.service}: {status} {body}")
    return body


def t_approval_failover(system, fronts):
    a, b = fronts
    session = "failover"
    workspace = os.path.join(system.state, "workspaces", "agent", session)
    held = a.call("execute_shell", {"command": "echo ran >> once.txt; wc -l < once.txt"}, session=session, wait_ms=0)
    expect(held.status == "pending_approval" and held.approval_id, f"the shell call was not held: {held}")
    (orchestrator_a,) = system.containers("orchestrator-a")
    run("docker", "kill", orchestrator_a)
    status, body = b.request("GET", "/v1/approvals?status=pending", token=system.approver)
    expect(status == 200, f"listing approvals through orchestrator-b: {status} {body}")
    expect(any(p["approval_id"] == held.approval_id for p in body["approvals"]),
           "orchestrator-b does not list the approval orchestrator-a created")
    approve(b, held.approval_id)
    body = wait_call(b, held.call_id)
    expect(body.get("status") == "ok", f"the approved call reads {body.get('status')}: {body}")
    run("docker", "start", orchestrator_a)
    a.host = system.front("orchestrator-a")
    a.local = threading.local()
    wait_until("orchestrator-a ready again", lambda: a.readyz().get("status") == "ready")
    body_a = wait_call(a, held.call_id)
    expect(body_a.get("status") == "ok", f"orchestrator-a reads the call as {body_a.get('status')}")
    status, audit = b.request("GET", f"/v1/audit?call_id={held.call_id}", token=system.approver)
    expect(status == 200, f"the call's audit through orchestrator-b: {status} {audit}")
    kinds = [e["kind"] for e in audit["events"]]
    for kind in ("pending_approval", "approved", "dispatched", "completed"):
        expect(kinds.count(kind) == 1, f"the call's audit has {kinds.count(kind)} {kind} events: {kinds}")
    with open(os.path.join(workspace, "once.txt")) as f:
        lines = f.read().splitlines()
    expect(lines == ["ran"], f"the call ran {len(lines)} times: {lines}")
    for front in fronts:
        status, verify = front.request("GET", "/v1/audit/verify", token=system.approver)
        expect(status == 200 and verify.get("ok") is True, f"audit verify through {front.service}: {verify}")
    print(f"    held on orchestrator-a, which was killed; approved on orchestrator-b; ran once; "
          f"audit verifies on both ({verify.get('records')} records)")


def t_rolling_restart(system, fronts):
    load = Load(fronts, threads=6, tools=(("read_file", {"path": READ_FILE}), ("list_directory", {"path": "."})))
    load.wait_for_calls(30)
    restarted = 0
    for service, group in (("fs", "fs"), ("shell", "shell")):
        for cid in system.containers(service):
            # SIGTERM: NOT_SERVING at once, calls in flight finish, exit 0, start again.
            run("docker", "restart", "-t", "25", cid, timeout=60)
            code = system.inspect(cid)["State"]
            expect(code["Running"], f"{cid[:12]} did not come back: {code}")
            wait_serving(system, fronts, group, service)
            restarted += 1
            load.wait_for_calls(10, since=time.monotonic())
    results = load.stop()
    print(f"    {restarted} workers restarted one at a time; {len(results)} calls, none failed")


SANDBOX_PROBE = r"""
import json, socket
def attempt(label, family, kind, address):
    try:
        s = socket.socket(family, kind)
    except OSError as e:
        return [label, "socket", e.errno, e.strerror]
    try:
        s.settimeout(3)
        s.connect(address)
        return [label, "connected", 0, ""]
    except OSError as e:
        return [label, "connect", e.errno, str(e)]
    finally:
        s.close()
targets = json.loads(TARGETS)
out = [attempt(l, getattr(socket, f), getattr(socket, k), tuple(a) if isinstance(a, list) else a) for l, f, k, a in targets]
for label, family, kind in [("packet", "AF_PACKET", "SOCK_RAW"), ("netlink", "AF_NETLINK", "SOCK_RAW")]:
    try:
        socket.socket(getattr(socket, family), getattr(socket, kind)).close()
        out.append([label, "created", 0, ""])
    except OSError as e:
        out.append([label, "socket", e.errno, e.strerror])
for path in ["/etc/airlock/tls/worker-shell.key", "/etc/airlock/airlock.toml", "/proc/1/environ"]:
    try:
        open(path, "rb").read(1)
        out.append([path, "read", 0, ""])
    except OSError as e:
        out.append([path, "open", e.errno, e.strerror])
print(json.dumps(out))
"""


def t_sandbox_reach(system, fronts):
    a = fronts[0]
    targets = [
        ["postgres by name", "AF_INET", "SOCK_STREAM", ["postgres", 5432]],
        ["fs by name", "AF_INET", "SOCK_STREAM", ["fs", 50051]],
        ["own worker port", "AF_INET", "SOCK_STREAM", ["127.0.0.1", 50051]],
        ["Docker DNS", "AF_INET", "SOCK_DGRAM", ["127.0.0.11", 53]],
        ["loopback v6", "AF_INET6", "SOCK_STREAM", ["::1", 50051]],
    ]
    for service, port in (("fs", 50051), ("shell", 50051), ("db", 50051), ("http", 50051), ("postgres", 5432),
                          ("orchestrator-a", 7070), ("orchestrator-b", 7071)):
        for cid in system.containers(service):
            targets.append([f"{service} {system.ip(cid)}:{port}", "AF_INET", "SOCK_STREAM", [system.ip(cid), port]])
    script = f"TARGETS = {json.dumps(json.dumps(targets))}\n" + SANDBOX_PROBE
    held = a.call("execute_shell", {"argv": ["python3", "-c", script]}, session="reach", wait_ms=0)
    expect(held.status == "pending_approval", f"the probe was not held: {held}")
    approve(a, held.approval_id)
    body = wait_call(a, held.call_id)
    expect(body.get("status") == "ok", f"the probe call: {body}")
    result = body["tool_result"]
    content = result["content"]
    shell = json.loads(content[0]["text"] if isinstance(content, list) else content)
    expect(shell.get("exit_code") == 0, f"the probe failed: {shell}")
    attempts = json.loads(shell["stdout"])
    expect(len(attempts) == len(targets) + 5, f"{len(attempts)} attempts reported, {len(targets) + 5} made")
    for label, step, errno, why in attempts:
        expect(step in ("socket", "open") and errno in (1, 13),
               f"from the sandbox, {label}: {step} {errno} {why} (wanted EPERM or EACCES before any packet)")
    isolation = body.get("isolation") or result.get("isolation") or {}
    # Unchanged: every service still serves.
    for front in fronts:
        ready = front.readyz()
        for group, service in (("fs", "fs"), ("shell", "shell"), ("http", "http"), ("db", "db")):
            want = sorted(system.ip(c) for c in system.containers(service))
            expect(endpoint_ips(serving(front, group)) == want, f"{group} is not all serving after the probe: {ready}")
    print(f"    {len(attempts)} attempts, each refused with EPERM/EACCES: "
          f"{sorted({a[0].split(' ')[0] for a in attempts})}")
    print(f"    isolation: {json.dumps(isolation, sort_keys=True)}")


CHECKS = [
    ("no container is privileged; each is 65532, read-only, without capabilities", t_hardening),
    ("calls spread over all three fs replicas through both orchestrators", t_spread),
    ("the db worker reaches PostgreSQL over TLS; the http worker reaches no other container", t_db_and_http),
    ("docker-compose up --scale fs=1, then fs=3, under load loses no read-only call", t_scale),
    ("docker kill of an fs worker under load loses no read-only call", t_kill),
    ("docker network disconnect of an fs worker ejects it; connected again, it is re-admitted", t_disconnect),
    ("a held call's orchestrator killed: approved through the other, it runs exactly once", t_approval_failover),
    ("a rolling restart of the fs and shell workers under load fails no call", t_rolling_restart),
    ("from inside a sandbox no container, worker port or key is reachable", t_sandbox_reach),
]


def main():
    if os.geteuid() != 0:
        sys.exit("test-compose: run as root: prepare.sh hands files to uid 65532 and the test reads /proc of containers")
    for tool in ("docker", "docker-compose"):
        if shutil.which(tool) is None:
            sys.exit(f"test-compose: {tool} not found: install the Docker engine and Compose (apt-get install docker-compose)")
    state = tempfile.mkdtemp(prefix="airlock-compose-")
    os.chmod(state, 0o755)
    run(os.path.join(HERE, "prepare.sh"), state, capture=False)
    system = System(state)
    passed = failed = 0
    try:
        workspace = os.path.join(state, "workspaces", "agent", SESSION)
        os.makedirs(workspace)
        with open(os.path.join(workspace, READ_FILE), "w") as f:
            f.write("one file, three replicas\n" * 2600)  # 65 KiB
        for path in (os.path.join(state, "workspaces", "agent"), workspace, os.path.join(workspace, READ_FILE)):
            os.chown(path, 65532, 65532)
        print("--- docker-compose up")
        system.compose("up", "-d", "--scale", "fs=3", "--scale", "shell=2", timeout=600)
        fronts = [Front(system, "orchestrator-a"), Front(system, "orchestrator-b")]
        for group, service in (("fs", "fs"), ("shell", "shell"), ("http", "http"), ("db", "db")):
            wait_serving(system, fronts, group, service)
        # Ready: every group has answered ListTools, so its tools are in the catalog.
        for front in fronts:
            wait_until(f"{front.service} ready", lambda: front.readyz().get("status") == "ready")
        print("    up: postgres, orchestrator-a, orchestrator-b, fs x3, shell x2, http, db")
        for title, check in CHECKS:
            print(f"--- {title}", flush=True)
            try:
                check(system, fronts)
                print("    ok", flush=True)
                passed += 1
            except Exception as e:  # noqa: BLE001 - every failure is reported, then the next check runs
                failed += 1
                print(f"    FAIL: {e}", flush=True)
                if not isinstance(e, CheckFailed):
                    traceback.print_exc()
                for service in ("orchestrator-a", "orchestrator-b", "fs"):
                    print(f"    --- log of {service}:\n" + system.logs(service, tail=15), flush=True)
    except Exception as e:  # noqa: BLE001
        failed += 1
        print(f"    FAIL: {e}", flush=True)
        traceback.print_exc()
        for service in ("postgres", "orchestrator-a", "orchestrator-b", "fs", "shell", "http", "db"):
            try:
                print(f"    --- log of {service}:\n" + system.logs(service, tail=30), flush=True)
            except Exception:  # noqa: BLE001
                pass
    finally:
        try:
            system.compose("down", "-v", "--remove-orphans", "-t", "5", timeout=300)
        finally:
            shutil.rmtree(state, ignore_errors=True)
    print(f"compose: {passed} passed, {failed} failed")
    sys.exit(0 if failed == 0 else 1)


if __name__ == "__main__":
    main()
