"""Asks whether a tool call the model made may run: once, always (for this tool, until nvchat
exits), or not."""
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

from nvchat.conversation import call_summary

ONCE, ALWAYS, DENY = "once", "always", "deny"


class ToolApprovalScreen(ModalScreen[str]):
    """Dismissed with ONCE, ALWAYS or DENY."""

    CSS_PATH = Path(__file__).with_name("tool_approval_screen.tcss")
    BINDINGS = [Binding("y", "choose('once')", "Run once"), Binding("a", "choose('always')", "Always"),
                Binding("n", "choose('deny')", "Don't run"), Binding("escape", "choose('deny')", "Don't run")]

    def __init__(self, call: dict, chat_title: str, server: str | None = None) -> None:
        super().__init__()
        self.call = call
        self.chat_title = chat_title
        self.server = server

    def compose(self) -> ComposeResult:
        name = self.call["function"]["name"]
        with Vertical(id="approval-box"):
            server = f" of the MCP server {self.server}" if self.server else ""
            yield Label(f"In “{self.chat_title}”, the model wants to run the tool {name}{server}:")
            yield Static(call_summary(self.call), id="approval-call")
            with Horizontal(id="approval-buttons"):
                yield Button("Run once (y)", id="once", variant="primary")
                yield Button(f"Always run {name} (a)", id="always")
                yield Button("Don't run (n)", id="deny", variant="error")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id)

    def action_choose(self, choice: str) -> None:
        self.dismiss(choice)
