"""Transcript entries: the user's messages as plain text, the assistant's as Markdown with its
Qwen3 <think> section folded away and a footer of numbers.

A reply being generated grows through MarkdownStream.write into a StreamingMarkdown, so each
update parses only the new tail of the document rather than re-rendering the reply.
"""
from __future__ import annotations

import asyncio

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Collapsible, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from nvchat.app.code_block import ReplyMarkdown
from nvchat.app.streaming_markdown import QuietResize, StreamingMarkdown
from nvchat.conversation import Message, split_thinking

_FINISH_NOTES = {"abort": "stopped", "length": "hit max tokens", "error": "failed"}
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
        parts.append(f"prompt {stats['prompt_tokens']} ({stats.get('cached_tokens') or 0} cached)")
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


class UserMessageView(Static):
    def __init__(self, message: Message) -> None:
        super().__init__(Content(message.content), classes="message user")
        self.message: Message | None = message
        self.border_title = "you"


class QueuedMessageView(Static):
    """A message sent while its chat was replying: waits, dimmed, at the foot of the transcript
    and goes out when the reply ends (ChatPane's queue)."""

    def __init__(self, text: str) -> None:
        super().__init__(Content(text), classes="message user")
        self.text = text
        self.border_title = "you · queued"


class ReplyView(QuietResize, Vertical):
    """An assistant reply: stored (built whole), or live: fed by receive() and end(), and drawn,
    in batches, by catch_up(). A live reply in a hidden tab only accumulates: it is drawn once,
    whole, when its tab is shown."""

    def __init__(self, message: Message | None = None) -> None:
        super().__init__(classes="message assistant")
        self.message = message
        self.border_title = "assistant"
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
        self.border_title = "assistant · interrupted"

    async def _write_piece(self, thinking: bool, piece: str) -> None:
        if thinking and self._thinking_md is None:
            self._thinking_md = StreamingMarkdown()
            await self.mount(Collapsible(self._thinking_md, title="Thinking", collapsed=True), before=self._answer_md)
        stream = self._streams.get(thinking)
        if stream is None:
            stream = self._streams[thinking] = Markdown.get_stream(self._thinking_md if thinking else self._answer_md)
        await stream.write(piece)
