"""Tool calls in the plain REPL: the MCP servers config.toml lists (nvchat/mcp_tools.py), offered
to its conversations as in the app.

A reply that calls tools prints each call and asks before running it: y (once), a (always for this
tool, until nvchat exits) or n. The result, or the refusal, is stored as a "tool" message and printed
folded to a few lines; once every call has one, the reply goes on. Ctrl-C at the question refuses
the call and ends the turn there. What the servers report (ready, failed) arrives on the MCP thread
and is printed before the next prompt, never into a line being typed or a reply streaming.
"""
from __future__ import annotations

import threading

from prompt_toolkit import PromptSession

from nvchat.conversation import Conversation, call_summary
from nvchat.mcp_tools import DECLINED, McpTools, ToolResult, run_call, server_specs

SHOWN_RESULT_LINES = 4
YES, ALWAYS, NO = "y", "a", "n"
_ANSWERS = {"y": YES, "yes": YES, "a": ALWAYS, "always": ALWAYS, "n": NO, "no": NO}


class ReplTools:
    def __init__(self, mcp_servers: dict, input=None, output=None) -> None:
        self.tools: McpTools | None = None
        self.always_allowed: set[str] = set()
        self._specs = server_specs(mcp_servers)
        self._reports: list[str] = []
        self._reports_lock = threading.Lock()
        self.asking: str | None = None  # the tool a question waits on
        # Its own session: the answers stay out of the message history.
        self._question = PromptSession(input=input, output=output)

    def start(self) -> McpTools | None:
        """Starts the servers' sessions (they connect on the MCP thread); None where none is listed."""
        if self._specs:
            self.tools = McpTools(self._specs, self._report).start()
        return self.tools

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()

    def _report(self, kind: str, server: str, text: str) -> None:
        line = (f"[MCP server {server} could not start: {text}; the chat goes on without its tools]"
                if kind == "failed" else f"[MCP tools ready: {server}: {text}]")
        with self._reports_lock:
            self._reports.append(line)

    def take_reports(self) -> list[str]:
        with self._reports_lock:
            reports, self._reports = self._reports, []
        return reports

    async def run_calls(self, conversation: Conversation, say) -> bool:
        """Asks about, runs and stores each call the last reply made; say(text) prints a line.
        False when the user stopped (Ctrl-C or Ctrl-D at a question): the turn ends there."""
        for call in conversation.pending_tool_calls:
            name = call["function"]["name"]
            say(f"[tool call: {call_summary(call)}]")
            choice = ALWAYS if name in self.always_allowed else await self._ask(name)
            if choice is None:
                conversation.add_tool_result(call, DECLINED.text, DECLINED.error)
                say("[not run; the turn ends here]")
                return False
            if choice == ALWAYS:
                self.always_allowed.add(name)
            result = DECLINED if choice == NO else await run_call(self.tools, call)
            conversation.add_tool_result(call, result.text, result.error)
            say(folded(result))
        return True

    async def _ask(self, name: str) -> str | None:
        server = self.tools.server_of(name) if self.tools is not None else None
        question = f"run {name}" + (f" (server {server})" if server else "") + "? [y]es, [a]lways, [n]o: "
        self.asking = name
        try:
            while True:
                try:
                    answer = await self._question.prompt_async(question, handle_sigint=False)
                except (KeyboardInterrupt, EOFError):
                    return None
                choice = _ANSWERS.get(answer.strip().lower())
                if choice is not None:
                    return choice
        finally:
            self.asking = None


def folded(result: ToolResult) -> str:
    """A result as the REPL prints it: its first lines, and how many more there are."""
    if result == DECLINED:
        return "[declined]"
    lines = result.text.splitlines() or [""]
    head = "\n".join("  " + line for line in lines[:SHOWN_RESULT_LINES])
    more = len(lines) - SHOWN_RESULT_LINES
    label = "[the tool failed]" if result.error else "[result]"
    return f"{label}\n{head}" + (f"\n  … {more} more lines (/save writes them all)" if more > 0 else "")
