#!/usr/bin/env python3
"""Calls held for approval over Airlock's /mcp, driven by the official MCP Python SDK.

Usage: mcp_held.py <timeout|abandon> <base_url> <token> <session_id>

- timeout: calls `write_file` (held for approval) with a client request timeout of
  CLIENT_TIMEOUT_S, below Airlock's old 60 s wait and above its MCP wait, as MCP hosts
  do (openai-agents waits 5 s, MCP Inspector 60 s). Reports whether the client got
  Airlock's answer or timed out, the answer's text and `_meta`, and the progress
  messages.
- abandon: calls `write_file`, waits for the progress notification that names the
  approval, then gives up on the request (the SDK closes the response stream in the
  2026-07-28 revision, sends notifications/cancelled in earlier ones). Reports the
  approval id it saw.

Prints one JSON object `{"<mode>": {...}}` with a run for each negotiation mode the SDK
offers ("auto" and "legacy" with the 2.x API, "legacy" with 1.x). Exits 3 when the SDK
is not installed.
"""

import asyncio
import json
import re
import sys

try:
    import anyio
    import mcp  # noqa: F401
except ImportError as e:  # pragma: no cover - the Rust test reports this
    print(json.dumps({"error": f"the MCP Python SDK is not installed ({e}); run: python3 -m pip install mcp"}))
    sys.exit(3)

CLIENT_TIMEOUT_S = 20.0
# How long `abandon` waits for the progress notification naming the approval.
PROGRESS_BOUND_S = 60.0
APPROVAL = re.compile(r"apr_[0-9a-f]+")


def wire(model):
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


async def held_until_timeout(call_tool, path):
    progress = []

    async def on_progress(value, total, message):
        progress.append(message)

    out = {"progress": progress}
    try:
        result = await call_tool("write_file", {"path": path, "content": "held"}, on_progress, CLIENT_TIMEOUT_S)
    except Exception as e:  # the SDK's timeout error differs between versions
        out["client_error"] = f"{type(e).__name__}: {e}"
        return out
    body = wire(result)
    out["is_error"] = bool(body.get("isError"))
    out["text"] = "\n".join(block.get("text", "") for block in body.get("content", []))
    out["meta"] = body.get("_meta")
    return out


async def held_then_abandoned(call_tool, path):
    seen = anyio.Event()
    out = {"approval_id": None, "finished": False}

    async def on_progress(value, total, message):
        found = APPROVAL.search(message or "")
        if found and out["approval_id"] is None:
            out["approval_id"] = found.group(0)
            seen.set()

    async with anyio.create_task_group() as group:

        async def request():
            await call_tool("write_file", {"path": path, "content": "abandoned"}, on_progress, 300.0)
            out["finished"] = True
            seen.set()

        group.start_soon(request)
        with anyio.move_on_after(PROGRESS_BOUND_S):
            await seen.wait()
        # The host gives up on the call: its only waiter goes away.
        group.cancel_scope.cancel()
    return out


async def run_v2(url, headers, exercise):
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    timeout = httpx2.Timeout(30.0, read=300.0)
    async with httpx2.AsyncClient(headers=headers, timeout=timeout) as http:
        runs = {}
        for mode in ("auto", "legacy"):
            async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:

                async def call(name, args, on_progress, timeout_s):
                    return await client.call_tool(
                        name, args, read_timeout_seconds=timeout_s, progress_callback=on_progress
                    )

                runs[mode] = await exercise(call, f"{mode}.txt")
        return runs


async def run_v1(url, headers, exercise):
    from datetime import timedelta

    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async with streamablehttp_client(url, headers=headers, timeout=30, sse_read_timeout=300) as (
        read,
        write,
        _session_id,
    ):
        async with ClientSession(read, write) as session:
            await session.initialize()

            async def call(name, args, on_progress, timeout_s):
                return await session.call_tool(
                    name,
                    args,
                    read_timeout_seconds=timedelta(seconds=timeout_s),
                    progress_callback=on_progress,
                )

            return {"legacy": await exercise(call, "legacy.txt")}


async def main():
    if len(sys.argv) != 5 or sys.argv[1] not in ("timeout", "abandon"):
        print("usage: mcp_held.py <timeout|abandon> <base_url> <token> <session_id>", file=sys.stderr)
        sys.exit(2)
    what, base, token, session = sys.argv[1], sys.argv[2].rstrip("/"), sys.argv[3], sys.argv[4]
    url = f"{base}/mcp?session_id={session}"
    headers = {"Authorization": f"Bearer {token}"}
    exercise = held_until_timeout if what == "timeout" else held_then_abandoned
    try:
        from mcp import Client  # noqa: F401

        runner = run_v2
    except ImportError:
        runner = run_v1
    out = await asyncio.wait_for(runner(url, headers, exercise), timeout=240)
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
