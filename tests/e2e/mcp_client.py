#!/usr/bin/env python3
"""Drive Airlock's /mcp endpoint with the official MCP Python SDK (PyPI `mcp`).

Usage: mcp_client.py <base_url> <token> [session_id [workspace_dir]]

Lists the tools, calls `execute_shell` with a command that prints, waits and prints
(asking for progress), sends arguments that violate the schema, calls an unknown tool,
and abandons a long call once it runs. The command's wait ends when the file it waits for
appears in the session's workspace (`workspace_dir`, the host path): this client creates
it on receiving the progress notification for the first line, so the call can finish
only if that notification was streamed while the command ran. Prints one JSON object on stdout,
`{"<mode>": {...}}`, for tests/e2e/mcp.rs to check; with the SDK's 2.x API (`mcp.Client`)
both "auto" (2026-07-28, no handshake) and "legacy" (initialize handshake) run, with the
1.x API (`ClientSession`) only "legacy". Exits 3 when the SDK is not installed.
"""

import asyncio
import json
import sys
import time

try:
    import mcp  # noqa: F401
    from importlib.metadata import version as _dist_version

    SDK_VERSION = _dist_version("mcp")
    import anyio
except ImportError as e:  # pragma: no cover - the Rust test reports this
    print(
        json.dumps({"error": f"the MCP Python SDK is not installed ({e}); run: python3 -m pip install mcp"}),
    )
    sys.exit(3)


CANCEL_MARKER = "cancel-me"
WORKSPACE = sys.argv[4] if len(sys.argv) > 4 else None


def shell_command(release):
    """Prints `a`, waits (bounded by the call's timeout) for the file `release`, prints `b`."""
    return f"echo a; while [ ! -e {release} ]; do sleep 0.05; done; echo b"


def wire(model):
    """A model in its JSON wire form (camelCase keys), whatever the SDK's attribute names."""
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def text_of(result):
    return "\n".join(block.get("text", "") for block in wire(result).get("content", []))


def is_error(result):
    return bool(wire(result).get("isError"))


def tool_summary(tool):
    t = wire(tool)
    return {
        "name": t.get("name"),
        "title": t.get("title"),
        "description": t.get("description"),
        "input_schema_type": (t.get("inputSchema") or {}).get("type"),
        "annotations": t.get("annotations"),
    }


async def exercise(list_tools, call_tool, mode):
    """The checks, given the SDK's list and call functions."""
    out = {"sdk_version": SDK_VERSION}
    listed = await list_tools()
    out["tools"] = [tool_summary(t) for t in listed.tools]

    progress = []
    release = f"release-{mode}"
    released = {"on_progress": None}

    async def on_progress(value, total, message):
        progress.append({"progress": value, "total": total, "message": message})
        if released["on_progress"] is None and message and "[stdout] a" in message:
            # The first line arrived while the command waits: let it finish.
            if WORKSPACE is not None:
                open(f"{WORKSPACE}/{release}", "w").close()
            released["on_progress"] = len(progress)

    shell = await call_tool(
        "execute_shell", {"command": shell_command(release), "timeout_seconds": 60}, on_progress
    )
    out["shell"] = {"is_error": is_error(shell), "text": text_of(shell), "meta": wire(shell).get("_meta")}
    out["progress"] = progress
    out["released_at_progress"] = released["on_progress"]

    bad = await call_tool("execute_shell", {"command": 5}, None)
    out["schema_error"] = {"is_error": is_error(bad), "text": text_of(bad)}

    unknown = await call_tool("no_such_tool", {}, None)
    out["unknown_tool"] = {"is_error": is_error(unknown), "text": text_of(unknown)}

    # Give up on a long call once it runs (its first line came as progress): the SDK
    # closes its response stream (2026-07-28) or sends notifications/cancelled (earlier
    # revisions); Airlock must cancel the call.
    started = time.monotonic()
    finished = False
    running = anyio.Event()

    async def on_running(value, total, message):
        if message and "[stdout] running" in message:
            running.set()

    async def long_call():
        nonlocal finished
        command = f"echo running; sleep 20; echo {CANCEL_MARKER}"
        await call_tool("execute_shell", {"command": command}, on_running)
        finished = True

    async with anyio.create_task_group() as group:
        group.start_soon(long_call)
        with anyio.fail_after(60):
            await running.wait()
        group.cancel_scope.cancel()
    out["cancel"] = {"finished": finished, "waited_s": round(time.monotonic() - started, 2)}
    return out


async def run_v2(url, headers):
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    timeout = httpx2.Timeout(30.0, read=300.0)
    async with httpx2.AsyncClient(headers=headers, timeout=timeout) as http:
        runs = {}
        # "auto" negotiates the newest revision (server/discover, no handshake);
        # "legacy" does the initialize handshake that most MCP hosts still use.
        for mode in ("auto", "legacy"):
            async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:

                async def call(name, args, on_progress):
                    return await client.call_tool(name, args, progress_callback=on_progress)

                out = await exercise(client.list_tools, call, mode)
                out["protocol_version"] = client.protocol_version
                runs[mode] = out
        return runs


async def run_v1(url, headers):
    from datetime import timedelta

    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async with streamablehttp_client(url, headers=headers, timeout=30, sse_read_timeout=300) as (
        read,
        write,
        _session_id,
    ):
        async with ClientSession(read, write, read_timeout_seconds=timedelta(seconds=120)) as session:
            init = await session.initialize()

            async def call(name, args, on_progress):
                return await session.call_tool(name, args, progress_callback=on_progress)

            out = await exercise(session.list_tools, call, "legacy")
            out["protocol_version"] = init.protocolVersion
            return {"legacy": out}


async def main():
    if len(sys.argv) < 3:
        print("usage: mcp_client.py <base_url> <token> [session_id [workspace_dir]]", file=sys.stderr)
        sys.exit(2)
    base, token = sys.argv[1].rstrip("/"), sys.argv[2]
    session = sys.argv[3] if len(sys.argv) > 3 else None
    url = f"{base}/mcp" + (f"?session_id={session}" if session else "")
    headers = {"Authorization": f"Bearer {token}"}
    try:
        from mcp import Client  # noqa: F401

        runner = run_v2
    except ImportError:
        runner = run_v1
    out = await asyncio.wait_for(runner(url, headers), timeout=120)
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
