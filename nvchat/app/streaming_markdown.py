"""A Markdown widget for text that grows many times a second (a reply being generated).

Textual's Markdown costs the UI thread, per append, more than the parsing of the new text: it
builds a new Markdown parser each time, and the last paragraph's update asks for a layout of the
whole screen even when the paragraph kept its height, which it does on most appends (a line fills
over several ticks). Both cost the engine thread too, which waits for the GIL while they run.
"""
from __future__ import annotations

from markdown_it import MarkdownIt
from textual.content import Content
from textual.widgets import Markdown


class GrowingParagraph(Markdown.BLOCKS["paragraph_open"]):  # MarkdownParagraph, which textual does not export
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


class StreamingMarkdown(Markdown):
    BLOCKS = {**Markdown.BLOCKS, "paragraph_open": GrowingParagraph}

    def __init__(self, markdown: str | None = None, **kwargs) -> None:
        parser = MarkdownIt("gfm-like")  # Markdown's own choice, built once instead of per append
        super().__init__(markdown, parser_factory=lambda: parser, **kwargs)
