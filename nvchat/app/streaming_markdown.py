"""A Markdown widget for text that grows many times a second (a reply being generated).

Textual's Markdown costs the UI thread, per append, more than the parsing of the new text: it
builds a new Markdown parser each time, it builds new block widgets for everything it parsed again
(the whole last block) only to copy their content into the blocks it has and drop them, and the
last paragraph's update asks for a layout of the whole screen even when the paragraph kept its
height, which it does on most appends (a line fills over several updates). Appending 20 demo-model
tokens at a time to a reply took 2.7-3.3 ms of CPU each through Markdown.append, 1.7-1.9 ms here.
All of it costs the engine thread too, which waits for the GIL while it runs.
"""
from __future__ import annotations

from markdown_it import MarkdownIt
from textual.await_complete import AwaitComplete
from textual.content import Content
from textual.widgets import Markdown
from textual.widgets._markdown import MarkdownBlock

from nvchat.app.code_block import COPYABLE_BLOCKS

_Paragraph = Markdown.BLOCKS["paragraph_open"]  # MarkdownParagraph, which textual does not export


class QuietResize:
    """For widgets sized by their content that never scroll. When a layout gives a widget a new
    size, Textual's _size_updated also sets its virtual_size, a reactive that asks for another
    layout when it changes: each time a streamed line wraps, the paragraph, the Markdown and the
    reply around it each asked, and the screen was laid out a second time for nothing (5-6 ms on
    the CPU box, after the 10-15 ms of the first). The virtual size is set without that request;
    a widget that does not scroll has no use for it."""

    def _size_updated(self, size, virtual_size, container_size, layout: bool = True) -> bool:
        return super()._size_updated(size, virtual_size, container_size, layout=False)


class GrowingParagraph(QuietResize, _Paragraph):
    def set_content(self, content: Content) -> None:
        old, width = getattr(self, "_content", None), self.content_size.width
        # Same height at the laid-out width: a repaint of this paragraph is all it needs. Content
        # caches its height per width, so the old content's costs nothing.
        if self.is_mounted and width > 0 and isinstance(old, Content) and isinstance(content, Content) \
                and content.get_height(self.styles, width) == old.get_height(self.styles, width):
            self._content = content
            self.update(content, layout=False)
        else:
            super().set_content(content)


class StreamingMarkdown(QuietResize, Markdown):
    BLOCKS = {**COPYABLE_BLOCKS, "paragraph_open": GrowingParagraph}

    def __init__(self, markdown: str | None = None, **kwargs) -> None:
        self._parser = MarkdownIt("gfm-like")  # Markdown's own choice, built once instead of per append
        self._slow: AwaitComplete | None = None  # the latest append left to Markdown.append
        super().__init__(markdown, parser_factory=lambda: self._parser, **kwargs)

    def append(self, markdown: str) -> AwaitComplete:
        """Markdown.append, with a shortcut for the common case: the text still ends in the
        paragraph that the document already ends with. That paragraph takes the content parsed
        for it, as Markdown.append would give it, without block widgets built to carry it."""
        if not markdown or self.lock.is_locked or (self._slow is not None and not self._slow.is_done):
            return self._append_slowly(markdown)  # after what is already under way, in order
        blocks = [child for child in self.children if isinstance(child, MarkdownBlock)]
        last = blocks[-1] if blocks else None
        if not isinstance(last, _Paragraph):
            return self._append_slowly(markdown)
        source = self.source + markdown
        start_line = self._last_parsed_line
        tokens = self._parser.parse("".join(source.splitlines(keepends=True)[start_line:]))
        if [(t.type, t.level) for t in tokens] != [("paragraph_open", 0), ("inline", 1), ("paragraph_close", 0)]:
            return self._append_slowly(markdown)  # parses again: rare, and the general case stays Textual's
        opening, inline = tokens[0], tokens[1]
        self._markdown = source
        self._last_parsed_line = start_line + opening.map[0]
        last.source_range = (start_line + opening.map[0], start_line + opening.map[1])
        last._token = opening
        last.set_content(last._token_to_content(inline))
        return AwaitComplete.nothing()

    def _append_slowly(self, markdown: str) -> AwaitComplete:
        self._slow = super().append(markdown)
        return self._slow
