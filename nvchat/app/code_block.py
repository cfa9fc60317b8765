"""Fenced code blocks in replies that can be copied: focus one (Tab / Shift+Tab, or a click) and
press c, or use the palette's "Copy code block" for the focused or the latest one. The copy goes
to the system clipboard through the terminal (OSC 52, App.copy_to_clipboard)."""
from __future__ import annotations

from textual.binding import Binding
from textual.widgets import Markdown
from textual.widgets._markdown import MarkdownFence


class CopyableFence(MarkdownFence, can_focus=True):
    BINDINGS = [Binding("c", "copy_code", "Copy code")]

    def action_copy_code(self) -> None:
        copy_code(self)


def copy_code(fence: MarkdownFence) -> None:
    fence.app.copy_to_clipboard(fence.code)
    lines = fence.code.count("\n") + (not fence.code.endswith("\n"))
    fence.notify(f"{lines} line{'s' if lines != 1 else ''}" + (f" of {fence.lexer}" if fence.lexer else ""),
                 title="Code copied to the clipboard")


COPYABLE_BLOCKS = {**Markdown.BLOCKS, "fence": CopyableFence, "code_block": CopyableFence}


class ReplyMarkdown(Markdown):
    """A stored reply's Markdown, with copyable code blocks."""

    BLOCKS = COPYABLE_BLOCKS
