"""A modal editor for one chat's system prompt (or the default for new chats)."""
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, TextArea


class SystemPromptScreen(ModalScreen[str | None]):
    """Dismisses with the new prompt text, or None when cancelled."""

    CSS_PATH = Path(__file__).with_name("system_prompt_screen.tcss")
    BINDINGS = [Binding("ctrl+s", "save", "Save"), Binding("escape", "cancel", "Cancel")]

    def __init__(self, heading: str, text: str, default: str) -> None:
        super().__init__()
        self.heading = heading
        self.initial_text = text
        self.default = default

    def compose(self) -> ComposeResult:
        with Vertical(id="system-box"):
            yield Label(self.heading, id="system-heading")
            yield Label("Chats that share a system prompt share its KV-cache blocks.", id="system-hint")
            yield TextArea(self.initial_text, id="system-text", soft_wrap=True)
            with Horizontal(id="system-buttons"):
                yield Button("Save  ^s", id="save", variant="primary")
                yield Button("Use default", id="default")
                yield Button("Cancel  esc", id="cancel")

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        elif event.button.id == "default":
            self.query_one(TextArea).text = self.default
        else:
            self.action_cancel()

    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)
