#!/usr/bin/env python3
"""An example external Airlock tool worker in Python: a tiny CRM.

It serves `airlock.v1.ToolWorker` (and `grpc.health.v1.Health`) with two tools,
`fetch_user_details` and `send_email`, and keeps the promises the Rust workers keep
(crates/worker/src/server.rs):

* every call ends at its deadline (`timeout_ms`, 0 = 30 s, at most 600 s, and never
  after the gRPC deadline) with status DEADLINE_EXCEEDED;
* `Cancel(call_id)` stops a call and answers once it has ended; the call's Execute
  stream then ends with status CANCELLED (or with its result, if that came first);
  a caller that goes away cancels its call, unless the call is detached;
* a detached call sent again with the same call_id joins the first run;
* SIGTERM/SIGINT drains: health turns NOT_SERVING and Watch streams end, new calls
  are refused as UNAVAILABLE with metadata `airlock-not-started: true`, calls in
  flight get a grace period, then the server stops.

The Python stubs are generated at start from the repository's .proto files (found at
../../proto relative to this file, or --proto-dir) into a temporary directory.

Run:  python3 worker.py --listen unix:/tmp/crm.sock
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import importlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import queue
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import grpc

log = logging.getLogger("crm-worker")

GROUP = "crm"
TOOL_WORKER_SERVICE = "airlock.v1.ToolWorker"
# Reported SERVING when listening on plaintext TCP (as the Rust workers do).
INSECURE_PLAINTEXT_SERVICE = "airlock.insecure_plaintext"
# Metadata on an UNAVAILABLE answer: this worker did not start the call.
NOT_STARTED_METADATA = "airlock-not-started"

MAX_MESSAGE_BYTES = 32 * 1024 * 1024
DEFAULT_TIMEOUT = 30.0
MAX_TIMEOUT = 600.0
DRAIN_GRACE = 30.0
CANCEL_GRACE = 5.0
CANCEL_ANSWER_SLACK = 1.0
CLOSE_GRACE = 5.0
LEDGER_TTL = 3600.0
LEDGER_CAPACITY = 10_000

# grpc.health.v1, compiled with the worker's own proto. The file lives outside a
# `grpc/` directory so that its generated module does not shadow the grpc package;
# the proto package (and so the service name on the wire) is grpc.health.v1.
HEALTH_PROTO = """
syntax = "proto3";
package grpc.health.v1;
message HealthCheckRequest { string service = 1; }
message HealthCheckResponse {
  enum ServingStatus {
    UNKNOWN = 0;
    SERVING = 1;
    NOT_SERVING = 2;
    SERVICE_UNKNOWN = 3;
  }
  ServingStatus status = 1;
}
service Health {
  rpc Check(HealthCheckRequest) returns (HealthCheckResponse);
  rpc Watch(HealthCheckRequest) returns (stream HealthCheckResponse);
}
"""


# --------------------------------------------------------------------------- stubs


def generate_stubs(proto_dir: str):
    """Compiles worker.proto and the health proto into a temporary directory and
    imports them. Returns (worker_pb2, worker_pb2_grpc, health_pb2, health_pb2_grpc)."""
    try:
        from grpc_tools import protoc
    except ImportError:
        sys.exit("grpc_tools is missing: python3 -m pip install grpcio grpcio-tools")
    import importlib.resources

    worker_proto = os.path.join(proto_dir, "airlock", "v1", "worker.proto")
    if not os.path.isfile(worker_proto):
        sys.exit(f"no {worker_proto}; pass --proto-dir (the repository's proto/ directory)")
    out = tempfile.mkdtemp(prefix="airlock-python-worker-")
    atexit.register(shutil.rmtree, out, True)
    extra = os.path.join(out, "_src")
    os.makedirs(os.path.join(extra, "airlock_example_health"))
    with open(os.path.join(extra, "airlock_example_health", "health.proto"), "w") as f:
        f.write(HEALTH_PROTO)
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    for include, source in (
        (proto_dir, "airlock/v1/worker.proto"),
        (extra, "airlock_example_health/health.proto"),
    ):
        code = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{include}",
                f"-I{well_known}",
                f"--python_out={out}",
                f"--grpc_python_out={out}",
                source,
            ]
        )
        if code != 0:
            sys.exit(f"protoc failed on {source} (exit {code})")
    sys.path.insert(0, out)
    return (
        importlib.import_module("airlock.v1.worker_pb2"),
        importlib.import_module("airlock.v1.worker_pb2_grpc"),
        importlib.import_module("airlock_example_health.health_pb2"),
        importlib.import_module("airlock_example_health.health_pb2_grpc"),
    )


# --------------------------------------------------------------------------- tools


@dataclass
class Outcome:
    """What a tool returns; becomes an `airlock.v1.ToolResult`."""

    content: list
    is_error: bool = False

    @staticmethod
    def text(text: str) -> "Outcome":
        return Outcome([text])

    @staticmethod
    def json(value: Any) -> "Outcome":
        # One text block holding a JSON document, as the Rust shell/http/db tools do.
        return Outcome([json.dumps(value, separators=(",", ":"), ensure_ascii=False)])

    @staticmethod
    def error(text: str) -> "Outcome":
        return Outcome([text], is_error=True)


class CallContext:
    """What a running tool sees of its call."""

    def __init__(self, call: "Call"):
        self._call = call
        self.call_id = call.call_id
        self.principal = call.principal
        self.session_id = call.session_id
        self.deadline = call.deadline  # time.monotonic() value

    @property
    def cancelled(self) -> bool:
        return self._call.cancel_event.is_set()

    def wait_cancelled(self, seconds: float) -> bool:
        """Sleeps up to `seconds`; True if the call was cancelled meanwhile. The
        worker cancels a call at its deadline, so this also wakes then."""
        return self._call.cancel_event.wait(max(0.0, seconds))

    def progress(self, progress: float, total: float = 0.0, message: str = "") -> None:
        self._call.inbox.put(("progress", (float(progress), float(total), message)))


def validate(schema: dict, arguments: Any) -> Optional[str]:
    """Checks arguments against the small JSON Schema subset used here (object of
    strings: required, additionalProperties false, pattern, maxLength). The
    orchestrator validated already; this is the worker's own, defensive, check."""
    if not isinstance(arguments, dict):
        return "arguments must be a JSON object"
    props = schema["properties"]
    for name in schema.get("required", []):
        if name not in arguments:
            return f"missing required argument {name!r}"
    for name, value in arguments.items():
        spec = props.get(name)
        if spec is None:
            return f"unknown argument {name!r}"
        if not isinstance(value, str):
            return f"argument {name!r} must be a string"
        if "maxLength" in spec and len(value) > spec["maxLength"]:
            return f"argument {name!r} is longer than {spec['maxLength']} characters"
        if "pattern" in spec and not re.fullmatch(spec["pattern"], value):
            return f"argument {name!r} does not match {spec['pattern']}"
    return None


@dataclass
class Tool:
    name: str
    title: str
    description: str
    input_schema: dict
    read_only: bool
    destructive: bool
    idempotent: bool
    open_world: bool
    run: Callable[[dict, CallContext], Outcome]


USERS = {
    "alice": {"user_id": "alice", "name": "Alice Martin", "email": "alice@example.com", "plan": "pro"},
    "bob": {"user_id": "bob", "name": "Bob Okafor", "email": "bob@example.com", "plan": "free"},
    "carol_99": {"user_id": "carol_99", "name": "Carol Chen", "email": "carol@example.org", "plan": "enterprise"},
}

USER_ID_PATTERN = "^[a-z0-9_-]{1,64}$"
EMAIL_PATTERN = r"^[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,63}$"

FETCH_USER_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "user_id": {
            "type": "string",
            "pattern": USER_ID_PATTERN,
            "description": "The CRM user id: lower-case letters, digits, '_' or '-', e.g. \"alice\".",
        }
    },
    "required": ["user_id"],
    "additionalProperties": False,
}

SEND_EMAIL_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "to": {
            "type": "string",
            "format": "email",
            "pattern": EMAIL_PATTERN,
            "maxLength": 320,
            "description": "One recipient address, e.g. \"alice@example.com\".",
        },
        "subject": {"type": "string", "maxLength": 200, "description": "The subject line."},
        "body": {"type": "string", "maxLength": 10000, "description": "The plain-text body."},
    },
    "required": ["to", "subject", "body"],
    "additionalProperties": False,
}


def fetch_user_details(args: dict, ctx: CallContext) -> Outcome:
    user = USERS.get(args["user_id"])
    if user is None:
        return Outcome.error(f"no user {args['user_id']}")
    return Outcome.json(user)


_outbox_lock = threading.Lock()


def send_email(args: dict, ctx: CallContext) -> Outcome:
    ctx.progress(0, 1, f"connecting to the mail server for {args['to']}")
    # Simulated mail-server latency (SEND_DELAY_MS, default 0); a cancel or the
    # deadline during it means nothing is sent.
    delay = float(os.environ.get("SEND_DELAY_MS", "0") or 0) / 1000.0
    if ctx.wait_cancelled(delay) or ctx.cancelled:
        return Outcome.error("cancelled before sending; no email was sent")
    message_id = f"msg_{uuid.uuid4().hex}"
    line = json.dumps(
        {
            "message_id": message_id,
            "to": args["to"],
            "subject": args["subject"],
            "body": args["body"],
            "call_id": ctx.call_id,
            "principal": ctx.principal,
            "session_id": ctx.session_id,
            "sent_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        },
        ensure_ascii=False,
    )
    outbox = os.environ.get("OUTBOX", "./outbox.jsonl")
    try:
        with _outbox_lock, open(outbox, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return Outcome.error(f"the email was not sent: cannot write the outbox: {e.strerror}")
    return Outcome.json({"sent": True, "message_id": message_id})


TOOLS = {
    t.name: t
    for t in [
        Tool(
            name="fetch_user_details",
            title="Fetch CRM user details",
            description=(
                "Look up one customer in the CRM by their user id. Use it when you need a "
                "customer's name, email address or subscription plan, for example before "
                "writing to them; do not guess these. Returns a JSON object "
                "{\"user_id\", \"name\", \"email\", \"plan\"}, or an error \"no user <id>\" "
                "when the id is unknown. Read-only: it changes nothing."
            ),
            input_schema=FETCH_USER_SCHEMA,
            read_only=True,
            destructive=False,
            idempotent=True,
            open_world=False,
            run=fetch_user_details,
        ),
        Tool(
            name="send_email",
            title="Send an email",
            description=(
                "Send one plain-text email to one recipient. Use it only when the user has "
                "asked for a message to be sent, with the exact recipient, subject and "
                "body settled; look the address up with fetch_user_details rather than "
                "guessing it. Sending cannot be undone. Returns a JSON object "
                "{\"sent\": true, \"message_id\"}; on an error nothing was sent."
            ),
            input_schema=SEND_EMAIL_SCHEMA,
            read_only=False,
            destructive=True,
            idempotent=False,
            open_world=True,
            run=send_email,
        ),
    ]
}

SEGMENT = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def valid_segment(value: str) -> bool:
    """The orchestrator's rule for principals and session ids."""
    return bool(SEGMENT.fullmatch(value)) and value not in (".", "..")


# --------------------------------------------------------------------------- calls


@dataclass
class Final:
    """How a call ended: a ToolResult, or a gRPC status (CANCELLED, DEADLINE_EXCEEDED)."""

    result: Any = None  # pb.ToolResult
    code: Optional[grpc.StatusCode] = None
    details: str = ""


@dataclass(eq=False)  # hashed by identity (kept in a set)
class Call:
    call_id: str
    tool: Tool
    arguments: dict
    principal: str
    session_id: str
    timeout: float
    detached: bool
    deadline: float = 0.0
    started: float = field(default_factory=time.monotonic)
    # Everything the driver reacts to: ("progress", ...), ("result", Outcome),
    # ("cancel", None). One queue, so that a cancel wakes the driver at once.
    inbox: queue.Queue = field(default_factory=queue.Queue)
    # What the (first) caller's Execute stream sends: ("event", pb) or ("final", Final).
    out: queue.Queue = field(default_factory=queue.Queue)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    tool_done: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    final: Optional[Final] = None

    def cancel(self) -> None:
        if not self.cancel_event.is_set():
            self.cancel_event.set()
            self.inbox.put(("cancel", None))


class ToolWorkerService:
    def __init__(self, pb, pb_grpc):
        self.pb = pb
        self.lock = threading.Lock()
        self.draining = threading.Event()
        self.running: dict = {}  # call_id -> Call (calls with an id, until they end)
        self.ledger: dict = {}  # call_id -> Call (detached calls, for replays)
        self.in_flight: set = set()
        self.in_flight_changed = threading.Condition(self.lock)

        servicer = self

        class Servicer(pb_grpc.ToolWorkerServicer):
            def ListTools(self, request, context):
                return servicer.list_tools(request, context)

            def Execute(self, request, context):
                try:
                    yield from servicer.execute(request, context)
                except Exception:  # a bug here must not surface as a bare exception
                    log.exception("execute failed")
                    context.set_code(grpc.StatusCode.INTERNAL)
                    context.set_details("internal error in the worker")

            def Cancel(self, request, context):
                return servicer.cancel(request, context)

        self.servicer = Servicer()

    # ListTools ---------------------------------------------------------------

    def list_tools(self, request, context):
        pb = self.pb
        return pb.ListToolsResponse(
            group=GROUP,
            tools=[
                pb.ToolDefinition(
                    name=t.name,
                    title=t.title,
                    description=t.description,
                    input_schema_json=json.dumps(t.input_schema, separators=(",", ":")),
                    annotations=pb.ToolAnnotations(
                        read_only=t.read_only,
                        destructive=t.destructive,
                        idempotent=t.idempotent,
                        open_world=t.open_world,
                    ),
                )
                for t in TOOLS.values()
            ],
        )

    # Execute -----------------------------------------------------------------

    def execute(self, request, context):
        tool = TOOLS.get(request.tool)
        if tool is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(f"tool {request.tool!r} is not served here")
            return
        try:
            arguments = json.loads(request.arguments_json)
        except (ValueError, RecursionError) as e:
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(f"arguments are not valid JSON: {e}")
            return
        if not isinstance(arguments, dict):
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details("arguments must be a JSON object")
            return
        if not valid_segment(request.principal):
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details("principal is empty or not a valid name segment")
            return
        session_id = request.session_id or "default"
        if not valid_segment(session_id):
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details("session_id is not a valid name segment")
            return

        call_id = request.call_id
        with self.lock:
            existing = self.ledger.get(call_id) if call_id else None
            if existing is not None and existing.detached:
                replay = existing
            else:
                replay = None
                if self.draining.is_set():
                    context.set_trailing_metadata(((NOT_STARTED_METADATA, "true"),))
                    context.set_code(grpc.StatusCode.UNAVAILABLE)
                    context.set_details("the worker is draining; the call was not started")
                    return
            if replay is None:
                requested = request.timeout_ms / 1000.0 if request.timeout_ms else DEFAULT_TIMEOUT
                timeout = min(requested, MAX_TIMEOUT)
                remaining = context.time_remaining()
                if remaining is not None:
                    timeout = min(timeout, max(remaining, 0.0))
                call = Call(
                    call_id=call_id,
                    tool=tool,
                    arguments=arguments,
                    principal=request.principal,
                    session_id=session_id,
                    timeout=timeout,
                    detached=request.detached,
                )
                call.deadline = call.started + timeout
                if call_id:
                    self.running[call_id] = call
                    if request.detached:
                        self._ledger_add(call)
                self.in_flight.add(call)
        if replay is not None:
            log.info("call %s: repeated call id, joining the original run", call_id)
            replay.done.wait()
            yield from self._finish(replay.final, context)
            return

        log.debug("call %s: execute %s", call_id, tool.name)
        if not call.detached:
            # The RPC ending before the call (caller gone, RPC cancelled) cancels it.
            if not context.add_callback(call.cancel):
                call.cancel()
        threading.Thread(target=self._drive, args=(call,), daemon=True, name=f"call-{call_id}").start()
        while True:
            kind, item = call.out.get()
            if kind == "event":
                yield item
            else:
                yield from self._finish(item, context)
                return

    def _finish(self, final: Final, context):
        if final.result is not None:
            yield self.pb.ExecuteEvent(result=final.result)
        else:
            context.set_code(final.code)
            context.set_details(final.details)

    def _ledger_add(self, call: Call) -> None:
        if len(self.ledger) >= LEDGER_CAPACITY:
            now = time.monotonic()
            for k in [k for k, c in self.ledger.items() if now - c.started >= LEDGER_TTL]:
                del self.ledger[k]
        if len(self.ledger) < LEDGER_CAPACITY:
            self.ledger[call.call_id] = call

    def _run_tool(self, call: Call) -> None:
        ctx = CallContext(call)
        try:
            # Validated again here: the worker does not rely on the orchestrator.
            problem = validate(call.tool.input_schema, call.arguments)
            outcome = Outcome.error(f"invalid arguments: {problem}") if problem else call.tool.run(call.arguments, ctx)
        except Exception:  # a tool's bug is an is_error result, never an escape
            log.exception("call %s: tool %s failed", call.call_id, call.tool.name)
            outcome = Outcome.error(f"internal error in tool {call.tool.name}")
        finally:
            call.tool_done.set()
        call.inbox.put(("result", outcome))

    def _drive(self, call: Call) -> None:
        """Runs one call: forwards its events, then its answer; ends it at the
        deadline or on cancel (the tool gets CANCEL_GRACE to notice)."""
        pb = self.pb
        threading.Thread(target=self._run_tool, args=(call,), daemon=True).start()
        final = None
        while final is None:
            remaining = call.deadline - time.monotonic()
            try:
                kind, item = call.inbox.get(timeout=max(remaining, 0.0)) if remaining > 0 else (None, None)
            except queue.Empty:
                kind, item = None, None
            if kind == "progress":
                progress, total, message = item
                call.out.put(("event", pb.ExecuteEvent(progress=pb.Progress(progress=progress, total=total, message=message))))
            elif kind == "result":
                final = Final(result=pb.ToolResult(is_error=item.is_error, content=item.content))
            elif kind == "cancel":
                call.tool_done.wait(CANCEL_GRACE)
                final = Final(code=grpc.StatusCode.CANCELLED, details="the call was cancelled")
            else:  # the deadline
                call.cancel()
                call.tool_done.wait(CANCEL_GRACE)
                ms = int(call.timeout * 1000)
                final = Final(
                    code=grpc.StatusCode.DEADLINE_EXCEEDED,
                    details=f"the call did not finish within {ms} ms and was stopped",
                )
        call.final = final
        outcome = "result" if final.result is not None else final.code.name
        log.info("call %s: %s ended: %s", call.call_id, call.tool.name, outcome)
        with self.lock:
            if call.call_id and self.running.get(call.call_id) is call:
                del self.running[call.call_id]
            self.in_flight.discard(call)
            self.in_flight_changed.notify_all()
        call.done.set()
        call.out.put(("final", final))

    # Cancel ------------------------------------------------------------------

    def cancel(self, request, context):
        pb = self.pb
        if not request.call_id:
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details("call_id is required")
            return pb.CancelResponse()
        with self.lock:
            call = self.running.get(request.call_id) or self.ledger.get(request.call_id)
        if call is None:
            return pb.CancelResponse(found=False, stopped=False)
        call.cancel()
        stopped = call.done.wait(CANCEL_GRACE + CANCEL_ANSWER_SLACK)
        log.info("call %s: cancel requested, stopped=%s", request.call_id, stopped)
        return pb.CancelResponse(found=True, stopped=stopped)

    # Drain -------------------------------------------------------------------

    def drain(self, grace: float) -> None:
        self.draining.set()
        deadline = time.monotonic() + grace
        with self.lock:
            log.info("draining %d call(s), grace %.0f s", len(self.in_flight), grace)
            while self.in_flight and time.monotonic() < deadline:
                self.in_flight_changed.wait(deadline - time.monotonic())
            if self.in_flight:
                log.warning("drain grace over: cancelling %d call(s)", len(self.in_flight))
                for call in list(self.in_flight):
                    call.cancel()
                end = time.monotonic() + CANCEL_GRACE
                while self.in_flight and time.monotonic() < end:
                    self.in_flight_changed.wait(end - time.monotonic())
        log.info("drained")


# --------------------------------------------------------------------------- health


class HealthService:
    """grpc.health.v1: Check and Watch; a draining worker answers NOT_SERVING and
    ends every Watch stream (the orchestrator's cue to send calls elsewhere)."""

    def __init__(self, hpb, hpb_grpc, statuses: dict):
        self.hpb = hpb
        self.statuses = dict(statuses)  # service name -> ServingStatus value
        self.changed = threading.Condition()
        self.draining = False
        health = self

        class Servicer(hpb_grpc.HealthServicer):
            def Check(self, request, context):
                with health.changed:
                    status = health.statuses.get(request.service)
                if status is None:
                    context.set_code(grpc.StatusCode.NOT_FOUND)
                    context.set_details(f"unknown service {request.service!r}")
                    return hpb.HealthCheckResponse()
                return hpb.HealthCheckResponse(status=status)

            def Watch(self, request, context):
                unknown = hpb.HealthCheckResponse.SERVICE_UNKNOWN
                last = None
                while context.is_active():
                    with health.changed:
                        status = health.statuses.get(request.service, unknown)
                        draining = health.draining
                        if status == last and not draining:
                            health.changed.wait(1.0)  # wakes on a change, or to re-check is_active
                            continue
                    if draining:
                        yield hpb.HealthCheckResponse(status=hpb.HealthCheckResponse.NOT_SERVING)
                        return
                    last = status
                    yield hpb.HealthCheckResponse(status=status)

        self.servicer = Servicer()

    def start_draining(self) -> None:
        with self.changed:
            not_serving = self.hpb.HealthCheckResponse.NOT_SERVING
            self.statuses[""] = not_serving
            self.statuses[TOOL_WORKER_SERVICE] = not_serving
            self.draining = True
            self.changed.notify_all()


# --------------------------------------------------------------------------- main


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description="Example Airlock tool worker (CRM) in Python")
    parser.add_argument("--listen", required=True, help="unix:/path.sock or host:port (no TLS)")
    parser.add_argument("--proto-dir", default=os.path.join(here, "..", "..", "proto"))
    parser.add_argument("--drain-grace", type=float, default=DRAIN_GRACE, help="seconds in-flight calls may run on after SIGTERM")
    parser.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    opts = parser.parse_args()
    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    pb, pb_grpc, hpb, hpb_grpc = generate_stubs(os.path.abspath(opts.proto_dir))

    listen = opts.listen
    if listen.startswith("http://"):
        listen = listen[len("http://"):]
    is_unix = listen.startswith("unix:")
    if is_unix:
        path = listen[len("unix:"):]
        if not path:
            sys.exit("--listen unix: needs a path")
        path = os.path.abspath(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.remove(path)  # a stale socket from an earlier run
        except FileNotFoundError:
            pass
        listen = f"unix:{path}"

    serving = hpb.HealthCheckResponse.SERVING
    statuses = {"": serving, TOOL_WORKER_SERVICE: serving}
    if not is_unix:
        statuses[INSECURE_PLAINTEXT_SERVICE] = serving
    workers = ToolWorkerService(pb, pb_grpc)
    health = HealthService(hpb, hpb_grpc, statuses)

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="rpc"),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_ToolWorkerServicer_to_server(workers.servicer, server)
    hpb_grpc.add_HealthServicer_to_server(health.servicer, server)
    # Owner-only socket: only the orchestrator running as the same user connects.
    old_umask = os.umask(0o177) if is_unix else None
    try:
        port = server.add_insecure_port(listen)
    finally:
        if old_umask is not None:
            os.umask(old_umask)
    if not is_unix and port == 0:
        sys.exit(f"cannot bind {listen}")
    server.start()
    if is_unix:
        os.chmod(listen[len("unix:"):], 0o600)
        bound = listen
    else:
        bound = f"{listen.rsplit(':', 1)[0]}:{port}"
        log.warning("serving plaintext TCP without TLS: use it only on a trusted network")
    log.info("crm worker serving %s on %s (tools: %s)", GROUP, bound, ", ".join(TOOLS))

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(3600):
        pass
    log.info("shutdown requested: NOT_SERVING, taking no new calls, draining those in flight")
    health.start_draining()
    workers.drain(opts.drain_grace)
    server.stop(CLOSE_GRACE).wait()
    if is_unix:
        try:
            os.remove(listen[len("unix:"):])
        except OSError:
            pass
    log.info("stopped")


if __name__ == "__main__":
    main()
