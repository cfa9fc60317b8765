"""A tiny MCP server for the tests, written with the official SDK: `python mcp_test_server.py`
serves over stdio, `python mcp_test_server.py http` over streamable HTTP on a port of 127.0.0.1
that the system picks, which it prints once its socket listens.

Its tools' schemas take no keys beyond their parameters (additionalProperties false, as strict
function tools' do), so that a call the engine holds to its schema ends with its arguments rather
than running on with keys the model makes up.

With NVCHAT_TEST_GATE naming a file in its environment, weather answers only once that file exists
(or after a minute): a test holds a call running for as long as it looks at the app meanwhile."""
import os
import socket
import sys
import time
from typing import Literal

import anyio
import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.tools import Tool

GATE = os.environ.get("NVCHAT_TEST_GATE")
GATE_PATIENCE_S = 60.0


async def weather(city: Literal["Paris", "Oslo"]) -> str:
    """Today's weather in a city."""
    if GATE:
        deadline = time.monotonic() + GATE_PATIENCE_S
        while not os.path.exists(GATE) and time.monotonic() < deadline:
            await anyio.sleep(0.02)  # the poll's interval
    return f"{city}: 21 degrees and sunny"


def broken(part: Literal["disk"]) -> str:
    """A tool that always fails."""
    raise RuntimeError(f"the {part} is on fire")


def closed(tool: Tool) -> Tool:
    tool.parameters["additionalProperties"] = False
    return tool


server = MCPServer("nvchat-test-tools", tools=[closed(Tool.from_function(fn)) for fn in (weather, broken)])

if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        # Bound here and handed to uvicorn, so that no other process can take the port between
        # its choice and the bind, and a client may connect as soon as the port is printed.
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        print(listener.getsockname()[1], flush=True)
        app = server.streamable_http_app(host="127.0.0.1")
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])
    else:
        server.run()
