"""The prompt box's Textual events (messages, in Textual's word), in one place so the box that posts
them and the chat pane and app that handle them agree on one vocabulary. A chat pane's own events,
which carry the pane, are ChatPane.ReplyStarted and ChatPane.StateChanged, defined on it as Textual
defines a widget's. Tokens never travel as messages: the app's stream pump drains them
(stream_pump.py)."""
from __future__ import annotations

from textual.message import Message


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
