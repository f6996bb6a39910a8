# A Streamable HTTP MCP server built with the official MCP Python SDK (PyPI `mcp`), for
# tests/e2e/mcp_http.rs: `lookup` is read-only; `deploy` is not, reports progress three
# times and appends to a marker file each time it runs; `wait` sleeps (read-only), so
# that the test can kill the server in the middle of a call.
#
#   python3 mcp_http_server.py PORT MARKER_FILE
import asyncio
import sys

port = int(sys.argv[1])
marker = sys.argv[2]

try:
    # The SDK's 2.x API.
    from mcp.server.mcpserver import Context, MCPServer

    server = MCPServer("weather")
    run = lambda: server.run(transport="streamable-http", host="127.0.0.1", port=port)
except ImportError:
    # 1.x.
    from mcp.server.fastmcp import Context, FastMCP

    server = FastMCP("weather", host="127.0.0.1", port=port)
    run = lambda: server.run(transport="streamable-http")
from mcp.types import ToolAnnotations


@server.tool(description="Today's weather in a city.",
             annotations=ToolAnnotations(readOnlyHint=True, openWorldHint=False))
def lookup(city: str) -> str:
    return f"{city}: sunny, 21 C"


@server.tool(description="Deploys a service.",
             annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True))
async def deploy(service: str, ctx: Context) -> str:
    for step in (1, 2, 3):
        await ctx.report_progress(step, 3, f"deploy step {step}")
        await asyncio.sleep(0.1)
    with open(marker, "a") as f:
        f.write(service + "\n")
    return f"deployed {service}"


@server.tool(description="Waits, then answers.", annotations=ToolAnnotations(readOnlyHint=True))
async def wait(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "waited"


run()
