"""Tools from MCP servers, for the chats: the servers config.toml lists, their tools as OpenAI
function tools (which the engine renders in the model's own format, or a remote backend sends as
`tools`), and calls to them.

    [mcp_servers.files]            # a server started as a subprocess, spoken to over stdio
    command = "uvx"
    args = ["mcp-server-filesystem", "/home/me/notes"]
    env = { LOG_LEVEL = "warning" }  # optional, added to nvchat's environment
    [mcp_servers.search]           # a server reached over streamable HTTP
    url = "http://localhost:8000/mcp"
    headers = { Authorization = "Bearer ..." }  # optional

McpTools runs every session on a thread of its own, with its own asyncio loop and the official SDK's
async client: nothing waits on a server on the caller's thread (the app's UI thread). A server that
fails to start, and every later change, is reported through `report` from that thread; the others
serve on. A stdio server's stderr goes to a log file (data_dir/mcp/NAME.log), not the terminal.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from nvchat import paths

# How long a server may take to start and list its tools, and a call to answer.
STARTUP_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 120.0
_SERVER_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")
_NOT_A_FUNCTION_NAME = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True)
class McpServerSpec:
    name: str
    command: str | None = None  # stdio: the program and its arguments
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None  # streamable HTTP
    headers: dict[str, str] = field(default_factory=dict)


def _string_table(value, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{where} must be a table of strings")
    return dict(value)


def server_specs(table) -> list[McpServerSpec]:
    """config.toml's [mcp_servers] as specs; ValueError names the server and key that is wrong."""
    if not isinstance(table, dict):
        raise ValueError("mcp_servers must be a table of servers ([mcp_servers.NAME])")
    specs = []
    for name, server in table.items():
        where = f"mcp_servers.{name}"
        if not _SERVER_NAME.fullmatch(name):
            raise ValueError(f"{where}: a server's name is 1 to 32 letters, digits, underscores or dashes")
        if not isinstance(server, dict):
            raise ValueError(f"{where} must be a table with command (stdio) or url (streamable HTTP)")
        unknown = set(server) - {"command", "args", "env", "url", "headers"}
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (known: command, args, env, url, "
                             "headers)")
        command, url = server.get("command"), server.get("url")
        if (command is None) == (url is None):
            raise ValueError(f"{where} needs either command (a stdio server) or url (streamable HTTP), not both")
        if command is not None:
            args = server.get("args", [])
            if not isinstance(command, str) or not command:
                raise ValueError(f"{where}.command must be a program to run")
            if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                raise ValueError(f"{where}.args must be a list of strings")
            if "headers" in server:
                raise ValueError(f"{where}: headers are for a url server")
            specs.append(McpServerSpec(name, command=command, args=tuple(args),
                                       env=_string_table(server.get("env", {}), f"{where}.env")))
        else:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"{where}.url must be an http:// or https:// URL")
            if "args" in server or "env" in server:
                raise ValueError(f"{where}: args and env are for a command server")
            specs.append(McpServerSpec(name, url=url,
                                       headers=_string_table(server.get("headers", {}), f"{where}.headers")))
    return specs


@dataclass(frozen=True)
class ToolResult:
    text: str
    error: bool = False  # the tool reported an error, or could not be called


DECLINED = ToolResult("The user declined to run this tool.", error=True)


async def run_call(tools: McpTools | None, call: dict) -> ToolResult:
    """Runs an OpenAI-form tool call (from the loop of whoever awaits it) with the servers' tools."""
    if tools is None:
        return ToolResult("No MCP server is configured.", error=True)
    function = call["function"]
    return await asyncio.wrap_future(tools.call(function["name"], function.get("arguments") or "{}"))


@dataclass(frozen=True)
class _Tool:
    server: str
    mcp_name: str
    definition: dict  # as an OpenAI function tool, named as the model sees it


def _error_text(error: BaseException) -> str:
    """An exception's message, looking inside the exception groups that anyio's task groups raise."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def result_text(result) -> str:
    """An MCP CallToolResult as text for the model: its text content, other content named."""
    parts = []
    for block in result.content:
        if getattr(block, "type", None) == "text":
            parts.append(block.text)
        else:
            parts.append(f"[{getattr(block, 'type', 'unknown')} content: {getattr(block, 'mime_type', '')}]".strip())
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


class McpTools:
    """The configured servers' sessions and tools. report(kind, server, text) is called on the MCP
    thread: kind "ready" (text: the tools' names) or "failed" (text: why)."""

    def __init__(self, specs: list[McpServerSpec], report: Callable[[str, str, str], None],
                 log_dir: Path | None = None):
        self.specs = specs
        self.report = report
        self.log_dir = log_dir or paths.data_dir() / "mcp"
        self.status: dict[str, str] = {spec.name: "starting" for spec in specs}  # "ready", "failed: ..."
        self._tools: dict[str, _Tool] = {}  # by the name the model sees
        self._sessions: dict[str, object] = {}  # server -> its ClientSession
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread: threading.Thread | None = None

    # --- what callers read and call, from any thread -----------------------------------------------

    @property
    def definitions(self) -> list[dict]:
        """The tools of every server that is up, as OpenAI function tools."""
        with self._lock:
            return [tool.definition for tool in self._tools.values()]

    def server_of(self, name: str) -> str | None:
        """The server whose tool the model calls `name`."""
        with self._lock:
            tool = self._tools.get(name)
        return tool.server if tool is not None else None

    def call(self, name: str, arguments: str) -> Future:
        """Runs the tool the model calls `name` with arguments (JSON text); the future's result is a
        ToolResult, an error one where the call could not be made or the tool failed."""
        with self._lock:
            tool = self._tools.get(name)
        future: Future
        if tool is None or self._loop is None:
            future = Future()
            future.set_result(ToolResult(f"There is no tool named {name!r}.", error=True))
            return future
        return asyncio.run_coroutine_threadsafe(self._call(tool, arguments), self._loop)

    def start(self) -> McpTools:
        self._thread = threading.Thread(target=self._run, name="nvchat-mcp", daemon=True)
        self._thread.start()
        self._started.wait()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Ends every session (a stdio server's process with it)."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop has ended already
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the MCP thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._started.set()
        servers = [asyncio.create_task(self._serve(spec)) for spec in self.specs]
        await self._stop.wait()
        await asyncio.gather(*servers, return_exceptions=True)

    async def _serve(self, spec: McpServerSpec) -> None:
        """Connects, lists the tools, and holds the session open until close()."""
        # start-up: the SDK (and its HTTP client) loads only where a server is configured
        from contextlib import AsyncExitStack

        import anyio
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client
        from mcp.client.streamable_http import (
            create_mcp_http_client,
            streamable_http_client,
        )

        log = None
        try:
            async with AsyncExitStack() as stack:
                if spec.url is not None:
                    client = await stack.enter_async_context(create_mcp_http_client(headers=spec.headers or None))
                    read, write = await stack.enter_async_context(streamable_http_client(spec.url, http_client=client))
                else:
                    self.log_dir.mkdir(parents=True, exist_ok=True)
                    log = stack.enter_context(open(self.log_dir / f"{spec.name}.log", "a"))
                    parameters = StdioServerParameters(command=spec.command, args=list(spec.args),
                                                       env=spec.env or None)
                    read, write = await stack.enter_async_context(stdio_client(parameters, errlog=log))
                session = await stack.enter_async_context(ClientSession(read, write))
                # Only around requests: a cancel scope must not enclose the entry of the
                # transports' own task groups, which stay open after it.
                with anyio.fail_after(STARTUP_TIMEOUT_S):
                    await session.initialize()
                    listed = (await session.list_tools()).tools
                names = self._add_tools(spec.name, session, listed)
                self.status[spec.name] = "ready"
                self.report("ready", spec.name, ", ".join(names) or "no tools")
                await self._stop.wait()
                with self._lock:
                    self._forget(spec.name)
        except Exception as e:
            with self._lock:
                self._forget(spec.name)
            why = (f"it did not answer within {STARTUP_TIMEOUT_S:.0f} s" if isinstance(e, TimeoutError)
                   else _error_text(e))
            if log is not None:
                why += f" (its log: {self.log_dir / (spec.name + '.log')})"
            self.status[spec.name] = f"failed: {why}"
            self.report("failed", spec.name, why)

    def _add_tools(self, server: str, session, listed) -> list[str]:
        names = []
        with self._lock:
            self._sessions[server] = session
            for tool in listed:
                name = _NOT_A_FUNCTION_NAME.sub("_", tool.name)[:64]
                if name in self._tools:  # two servers' tools of one name: the later one says whose it is
                    name = f"{server}_{name}"[:64]
                definition = {"type": "function", "function": {
                    "name": name, "description": tool.description or "",
                    "parameters": tool.input_schema or {"type": "object", "properties": {}}}}
                self._tools[name] = _Tool(server, tool.name, definition)
                names.append(name)
        return names

    def _forget(self, server: str) -> None:
        self._sessions.pop(server, None)
        for name in [n for n, tool in self._tools.items() if tool.server == server]:
            del self._tools[name]

    async def _call(self, tool: _Tool, arguments: str) -> ToolResult:
        try:
            values = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ToolResult(f"The arguments are not JSON: {e}", error=True)
        if not isinstance(values, dict):
            return ToolResult("The arguments must be a JSON object.", error=True)
        with self._lock:
            session = self._sessions.get(tool.server)
        if session is None:
            return ToolResult(f"The MCP server {tool.server!r} is not running.", error=True)
        try:
            result = await session.call_tool(tool.mcp_name, values, read_timeout_seconds=CALL_TIMEOUT_S)
        except Exception as e:
            return ToolResult(f"The call failed: {_error_text(e)}", error=True)
        if not hasattr(result, "content"):  # a result type this client does not ask for (input requests)
            return ToolResult(f"The tool answered with a {type(result).__name__}, which nvchat cannot use.",
                              error=True)
        return ToolResult(result_text(result), error=bool(result.is_error))
