"""Tool calls in the app: the MCP servers config.toml lists (nvchat/mcp_tools.py), started with the
app and offered to every chat, and what happens when a reply calls one of their tools.

Each call is shown in the transcript and runs only once the user approves it in a dialog (once,
always for this tool until nvchat exits, or not); its result, or the refusal, is stored as a "tool"
message and shown folded, and once every call of the reply has one the reply goes on. How many
calling replies may follow one another is bounded by the conversation (MAX_TOOL_ROUNDS). A server
that fails to start, and a call that fails, are notifications; the chat goes on.

The servers' sessions live on the MCP thread; this module only awaits their futures.
"""
from __future__ import annotations

import asyncio

from textual.app import App

from nvchat.app.chat_pane import ChatPane
from nvchat.app.tool_approval_screen import ALWAYS, DENY, ToolApprovalScreen
from nvchat.conversation import Message
from nvchat.mcp_tools import DECLINED, McpTools, run_call, server_specs


class ToolRounds:
    def __init__(self, app: App, mcp_servers: dict) -> None:
        self.app = app
        self.tools: McpTools | None = None
        self.always_allowed: set[str] = set()  # tools the user let run without asking, until exit
        self._specs = server_specs(mcp_servers)

    def start(self) -> McpTools | None:
        """Starts the servers' sessions (they connect on the MCP thread); the toolbox, or None
        where config.toml lists no server."""
        if self._specs:
            self.tools = McpTools(self._specs, self._report_from_thread).start()
        return self.tools

    async def close(self) -> None:
        if self.tools is not None:
            await asyncio.to_thread(self.tools.close)

    def _report_from_thread(self, kind: str, server: str, text: str) -> None:
        try:
            self.app.call_from_thread(self._report, kind, server, text)
        except RuntimeError:  # the app has stopped: nobody to tell
            pass

    def _report(self, kind: str, server: str, text: str) -> None:
        if kind == "failed":
            self.app.notify(f"{server}: {text}. The chats go on without its tools.",
                            title="An MCP server could not start", severity="error", timeout=15)
        else:
            self.app.notify(f"{server}: {text}", title="MCP tools ready", timeout=5)

    async def run(self, pane: ChatPane, message: Message) -> None:
        """The reply `message` called tools: each is shown, approved or not, run, and its result
        stored; then the reply goes on."""
        for call in pane.conversation.pending_tool_calls:
            view = await pane.show_tool_call(call)
            if pane.stop_requested:
                pane.end_tool_round()
                return
            name = call["function"]["name"]
            if name in self.always_allowed:
                choice = ALWAYS
            else:
                if pane in self.app.tabs.panes:  # the dialog asks about the chat it shows
                    self.app.tabs.show(pane)
                view.set_status("waiting for your approval")
                pane.show_tool_approval(name)
                server = self.tools.server_of(name) if self.tools is not None else None
                choice = await self.app.push_screen(ToolApprovalScreen(call, pane.conversation.title, server),
                                                    wait_for_dismiss=True)
            if choice == ALWAYS:
                self.always_allowed.add(name)
            if choice == DENY:
                result = DECLINED
            else:
                view.set_status("running…")
                pane.show_tool_running(name)
                result = await run_call(self.tools, call)
                if result.error:
                    self.app.notify(f"{name}: {result.text}", title="The tool failed", severity="warning",
                                    timeout=8)
            try:
                stored = await pane.background(pane.conversation.add_tool_result, call, result.text, result.error)
            except Exception as e:
                self.app.notify(f"The tool's result could not be stored: {e}", title="Storage error",
                                severity="error", timeout=10)
                pane.end_tool_round()
                return
            await view.show_result(stored)
        if pane.stop_requested:
            pane.end_tool_round()
        else:
            pane.continue_after_tools()
