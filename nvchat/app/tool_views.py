"""A tool call in the transcript: the tool and its arguments, what became of it (waiting for the
user's approval, running, declined), and its result, folded."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Collapsible, Static

from nvchat.conversation import Message, call_summary


class ToolCallView(Vertical):
    """One call of a reply. Live, it starts with the call alone and takes its result by
    show_result(); built from a stored "tool" message, it shows both at once."""

    def __init__(self, call: dict, message: Message | None = None) -> None:
        super().__init__(classes="message tool-call")
        self.call = call
        self.message = message  # the stored "tool" message with the result, once there is one
        self.border_title = "tool"

    def compose(self) -> ComposeResult:
        yield Static(Content.assemble(("⚙ ", "bold"), (call_summary(self.call), "bold")), classes="tool-call-summary")
        yield Static("", id="tool-status")
        if self.message is not None:
            yield self._result(self.message)

    def on_mount(self) -> None:
        self.query_one("#tool-status").display = False

    def set_status(self, text: str) -> None:
        status = self.query_one("#tool-status", Static)
        status.update(text)
        status.display = bool(text)

    async def show_result(self, message: Message) -> None:
        self.message = message
        self.set_status("")
        await self.mount(self._result(message))

    def _result(self, message: Message) -> Collapsible:
        error = bool(message.stats and message.stats.get("error"))
        if error:
            self.add_class("-error")
        lines = message.content.count("\n") + 1
        title = f"{'error' if error else 'result'} ({lines} line{'s' if lines != 1 else ''}): {message.content[:60]!r}"
        return Collapsible(Static(Content(message.content), classes="tool-result-text"), title=title, collapsed=True)
