"""The app's own Textual messages, in one place so the widgets that post them and the app that
handles them agree on one vocabulary. Tokens never travel as messages: the app's stream pump
drains them (see app.py)."""
from __future__ import annotations

from textual.message import Message
from textual.widget import Widget


class PromptSubmitted(Message):
    """The user pressed the send key in a prompt box."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class SlashCommandSubmitted(Message):
    """The user sent a line naming a slash command (nvchat.slash_table) from a prompt box."""

    def __init__(self, name: str, arg: str) -> None:
        super().__init__()
        self.name = name
        self.arg = arg


class ScrollTranscript(Message):
    """The prompt box's page keys: scroll its chat's transcript by a page (-1 up, 1 down)."""

    def __init__(self, pages: int) -> None:
        super().__init__()
        self.pages = pages


class ReplyStarted(Message):
    """A chat pane has a new stream for the app's pump to drain."""

    def __init__(self, pane: Widget) -> None:  # a ChatPane
        super().__init__()
        self.pane = pane


class ChatStateChanged(Message):
    """A chat's title or busy state changed: its tab label needs redrawing."""

    def __init__(self, pane: Widget) -> None:  # a ChatPane
        super().__init__()
        self.pane = pane
