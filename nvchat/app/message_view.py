"""Transcript entries: the user's messages as plain text, the assistant's as Markdown with its
Qwen3 <think> section folded away and a footer of numbers. A message with siblings (edits of it,
other replies in its place) says which of them it is in its title, ◀ 2/3 ▶; alternatives being
chosen from stand side by side (or stacked, where the transcript is narrow).

A reply being generated grows through MarkdownStream.write into a StreamingMarkdown, so each
update parses only the new tail of the document rather than re-rendering the reply.
"""
from __future__ import annotations

import asyncio

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message as TextualMessage
from textual.widgets import Collapsible, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from nvchat.app.code_block import ReplyMarkdown
from nvchat.app.streaming_markdown import QuietResize, StreamingMarkdown
from nvchat.conversation import Message, split_thinking

_FINISH_NOTES = {"abort": "stopped", "length": "hit max tokens", "error": "failed", "tool_calls": "calls tools"}
_INTERRUPTED_REASONS = ("abort", "error")


def footer_text(stats: dict | None, interrupted: bool = False) -> str:
    """A reply's numbers in one line, from Conversation's stats dict (live or stored). A reply saved
    mid-stream whose app never stored its end has no numbers."""
    if stats is None:
        return "interrupted: nvchat stopped before this reply ended (Ctrl+R regenerates)" if interrupted else ""
    parts = [f"{stats.get('tokens') or 0} tokens"]
    if stats.get("tokens_per_s"):
        parts.append(f"{stats['tokens_per_s']:.1f} tok/s")
    if stats.get("ttft_s") is not None:
        parts.append(f"TTFT {stats['ttft_s'] * 1000:.0f} ms")
    if stats.get("prompt_tokens"):
        cached = stats.get("cached_tokens")
        if cached is None:  # a server that reports the prompt's size and not what it had cached
            parts.append(f"prompt {stats['prompt_tokens']} (cached unknown)")
        else:
            # What the engine's prefix cache held of this prompt: most of it, for a branch or a
            # next turn of a long chat, whose earlier part was computed before.
            parts.append(f"{cached} of {stats['prompt_tokens']} prompt tokens from the cache")
    elif "prompt_tokens" in stats and stats["prompt_tokens"] is None:  # a server that reports no usage
        parts.append("prompt size unknown")
    reason = stats.get("finish_reason") or ""
    if interrupted:
        # One word for it: "stopped" or "failed" where the numbers say which, else "interrupted".
        word = _FINISH_NOTES[reason] if reason in _INTERRUPTED_REASONS else "interrupted"
        parts.append(f"{word} (Ctrl+R regenerates)")
    elif reason in _FINISH_NOTES:
        parts.append(_FINISH_NOTES[reason])
    return " · ".join(parts)


class ThinkSplitter:
    """Routes streamed text to the thinking or the answer side as <think> tags go by. A chunk may
    end half-way through a tag, so a possible tag prefix is held back until the next chunk."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self) -> None:
        self.in_think = False
        self._held = ""

    def feed(self, text: str) -> list[tuple[bool, str]]:
        """(is_thinking, text) pieces, in order."""
        pieces: list[tuple[bool, str]] = []
        buf = self._held + text
        while True:
            tag = self.CLOSE if self.in_think else self.OPEN
            at = buf.find(tag)
            if at < 0:
                break
            if at:
                pieces.append((self.in_think, buf[:at]))
            self.in_think = not self.in_think
            buf = buf[at + len(tag):]
        keep = next((n for n in range(min(len(tag) - 1, len(buf)), 0, -1) if tag.startswith(buf[-n:])), 0)
        self._held = buf[len(buf) - keep:] if keep else ""
        rest = buf[:len(buf) - keep]
        if rest:
            pieces.append((self.in_think, rest))
        return pieces

    def flush(self) -> list[tuple[bool, str]]:
        held, self._held = self._held, ""
        return [(self.in_think, held)] if held else []


def branch_title(base: str, which: int, of: int) -> str:
    """A message's title with its place among its siblings, where it has any."""
    return f"{base}  ◀ {which}/{of} ▶" if of > 1 else base


class BranchMarks:
    """What a transcript entry shows of its place in the conversation's tree, and whether it is the
    message selected (Alt+Up/Down) for the keys that act on one."""

    base_title = ""

    def mark_branch(self, which: int, of: int, selected: bool) -> None:
        self.border_title = branch_title(self.base_title, which, of)
        self.set_class(selected, "-selected")


class UserMessageView(BranchMarks, Static):
    base_title = "you"

    def __init__(self, message: Message) -> None:
        super().__init__(Content(message.content), classes="message user")
        self.message: Message | None = message
        self.border_title = self.base_title


class QueuedMessageView(Static):
    """A message sent while its chat was replying: waits, dimmed, at the foot of the transcript
    and goes out when the reply ends (ChatPane's queue)."""

    def __init__(self, text: str) -> None:
        super().__init__(Content(text), classes="message user")
        self.text = text
        self.border_title = "you · queued"


class ReplyView(BranchMarks, QuietResize, Vertical):
    """An assistant reply: stored (built whole), or live: fed by receive() and end(), and drawn,
    in batches, by catch_up(). A live reply in a hidden tab only accumulates: it is drawn once,
    whole, when its tab is shown."""

    base_title = "assistant"

    def __init__(self, message: Message | None = None, title: str | None = None) -> None:
        super().__init__(classes="message assistant")
        self.message = message
        if title is not None:
            self.base_title = title
        self.border_title = self.base_title
        self._thinking_md: Markdown | None = None
        self._answer_md: Markdown | None = None
        self._streams: dict[bool, MarkdownStream] = {}
        self._splitter = ThinkSplitter()
        self._footer = Static("" if message is not None else "generating…", id="reply-footer")
        self.text = ""
        self._unrendered = ""
        self._end_stats: dict | None = None  # the reply's numbers once it ended, until drawn
        # Built from a stored message: each Markdown widget and the text it must hold. A Markdown
        # takes its text when it mounts, some time after compose.
        self._built: list[tuple[Markdown, str]] = []
        # The pump and a tab switch can both catch up; one at a time keeps the pieces in order.
        self._drawing = asyncio.Lock()

    def compose(self) -> ComposeResult:
        if self.message is not None:
            # Built whole from the stored message. A live reply that was stored before its hidden
            # tab was shown is composed here too, and what it received is all in the message.
            self._unrendered, self._end_stats = "", None
            thinking, answer = split_thinking(self.message.content)
            if thinking:
                thinking_md = ReplyMarkdown(thinking)
                self._built.append((thinking_md, thinking))
                yield Collapsible(thinking_md, title="Thinking", collapsed=True)
            self._answer_md = ReplyMarkdown(answer, id="answer")
            self._built.append((self._answer_md, answer))
            yield self._answer_md
            yield self._footer
            if self.message.interrupted:
                self._mark_interrupted()
            self._footer.update(footer_text(self.message.stats, self.message.interrupted))
        else:
            self.add_class("-live")
            self._answer_md = StreamingMarkdown(id="answer")
            yield self._answer_md
            yield self._footer

    def receive(self, text: str) -> None:
        """Takes new text without drawing it (cheap: a hidden tab's reply just accumulates)."""
        self.text += text
        self._unrendered += text

    def end(self, stats: dict) -> None:
        """The reply is complete (everything was received); its footer shows at the next catch_up()."""
        self._end_stats = stats

    @property
    def behind(self) -> bool:
        """Received text or an ending that is not drawn yet, or a stored message's text that its
        Markdown widgets have not taken yet."""
        if self._unrendered or self._end_stats is not None:
            return True
        if self._built:
            if any(md.source != text for md, text in self._built):
                return True
            self._built = []
        return False

    async def catch_up(self) -> None:
        """Draws what arrived since the last call: appends it to the Markdown as one update and,
        once the reply has ended, flushes the Markdown streams and shows the footer."""
        if self._answer_md is None:
            # Not composed yet: a hidden tab's turn mounts its view only when the tab is shown, and a
            # pump tick can land between the switch and that mount. Everything stays behind for the
            # catch-up that follows the mount.
            return
        async with self._drawing:
            # Both taken before any await: the ending is only drawn with the last text it came after.
            text, self._unrendered = self._unrendered, ""
            stats, self._end_stats = self._end_stats, None
            for thinking, piece in self._splitter.feed(text):
                await self._write_piece(thinking, piece)
            if stats is None:
                return
            for thinking, piece in self._splitter.flush():
                await self._write_piece(thinking, piece)
            for stream in self._streams.values():
                await stream.stop()
            self._streams.clear()
            self.remove_class("-live")
            interrupted = stats.get("finish_reason") in _INTERRUPTED_REASONS
            if interrupted:
                self._mark_interrupted()
            self._footer.update(footer_text(stats, interrupted))

    def _mark_interrupted(self) -> None:
        self.add_class("-interrupted")
        if "interrupted" not in self.base_title:
            self.base_title += " · interrupted"
        self.border_title = self.base_title

    async def _write_piece(self, thinking: bool, piece: str) -> None:
        if thinking and self._thinking_md is None:
            self._thinking_md = StreamingMarkdown()
            await self.mount(Collapsible(self._thinking_md, title="Thinking", collapsed=True), before=self._answer_md)
        stream = self._streams.get(thinking)
        if stream is None:
            stream = self._streams[thinking] = Markdown.get_stream(self._thinking_md if thinking else self._answer_md)
        await stream.write(piece)


class AlternativesView(Vertical):
    """Several replies to one prompt generated at once (F6, /alt N), numbered, side by side where
    each gets MIN_COLUMN_WIDTH columns, else stacked, until one is picked (Alt+N, /pick N, a click)."""

    MIN_COLUMN_WIDTH = 36
    message = None  # stands for no one stored message (ChatPane._sync_views)

    class Picked(TextualMessage):
        def __init__(self, number: int) -> None:
            super().__init__()
            self.number = number

    def __init__(self, count: int, side_by_side: bool) -> None:
        super().__init__(classes="alternatives" + (" -side-by-side" if side_by_side else ""))
        self.replies = [ReplyView(title=f"{n} · Alt+{n} picks") for n in range(1, count + 1)]

    def compose(self) -> ComposeResult:
        yield from self.replies

    @property
    def messages(self) -> list[Message]:
        return [view.message for view in self.replies if view.message is not None]

    @property
    def behind(self) -> bool:
        return any(view.behind for view in self.replies)

    async def catch_up(self) -> None:
        for view in self.replies:
            await view.catch_up()

    def mark_shown(self, message: Message | None) -> None:
        """Which alternative the conversation goes on from if none is picked."""
        for view in self.replies:
            view.set_class(message is not None and view.message is message, "-shown")

    def on_click(self, event: events.Click) -> None:
        widget = event.widget
        while widget is not None and widget is not self:
            if widget in self.replies:
                event.stop()
                self.post_message(self.Picked(self.replies.index(widget) + 1))
                return
            widget = widget.parent
