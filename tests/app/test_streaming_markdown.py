"""StreamingMarkdown: appends that keep the last paragraph's height repaint it without a layout,
it still grows (and its parent with it) when a line wraps, and appends build the blocks Textual's
Markdown builds."""
import random

import pytest
from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.geometry import Region
from textual.widgets import Markdown
from textual.widgets._markdown import MarkdownBlock

from nvchat.app.code_block import CopyableFence
from nvchat.app.streaming_markdown import GrowingParagraph, StreamingMarkdown
from tests.app.helpers import wait_for


class OneMarkdown(App):
    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield StreamingMarkdown()


def shown_text(widget) -> str:
    strips = widget.render_lines(Region(0, 0, widget.size.width, widget.size.height))
    return "\n".join(strip.text.rstrip() for strip in strips)


async def test_appends_repaint_in_place_and_wrapping_grows_the_paragraph():
    app = OneMarkdown()
    async with app.run_test(size=(40, 12)) as pilot:
        markdown = app.query_one(StreamingMarkdown)
        await markdown.append("hello")
        await pilot.pause()  # laid out and drawn, as every pause below: what the assertions after it read
        paragraph = markdown.query_one(GrowingParagraph)
        assert paragraph.size.height == 1 and "hello" in shown_text(paragraph)
        layouts = paragraph._layout_updates

        await markdown.append(" world")  # still one line
        await pilot.pause()
        assert "hello world" in shown_text(paragraph)
        assert paragraph._layout_updates == layouts  # repainted, no layout asked for

        around = markdown._layout_updates
        await markdown.append(" and a good deal more text than one line of forty holds")
        await wait_for(pilot, lambda: paragraph.size.height == 2, what="the paragraph's second line")
        await pilot.pause()  # and any layout the new height asks for after that, which the count below must see
        assert paragraph.size.height == 2  # laid out again at its new height
        assert markdown._layout_updates == around + 1  # for the paragraph; its own new size asked for none
        assert "forty holds" in shown_text(paragraph)
        assert markdown.source == "hello world and a good deal more text than one line of forty holds"


class TwoMarkdowns(App):
    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Markdown(id="textual")
            yield StreamingMarkdown(id="streaming")


# nvchat's block classes, by the Textual kind they stand for.
_KINDS = {GrowingParagraph: "MarkdownParagraph", CopyableFence: "MarkdownFence"}


def blocks(markdown) -> list:
    """Each block as it stands: its kind, where its source lies, and the content it shows."""
    return [(_KINDS.get(type(block), type(block).__name__), block.source_range,
             str(block._content), [(s.start, s.end, str(s.style)) for s in block._content.spans])
            for block in markdown.query(MarkdownBlock)]


REPLY = ("Here is a *start* of a reply with `code` and a [link](http://x.y) that goes on for a while "
         "and then a second line\nof the same paragraph.\n\nA new paragraph **bold\nacross lines** ends.\n\n"
         "- a list\n- of items\n\n1. numbered\n2. too\n\n# A heading\n\n```python\nprint('fenced')\n```\n\n"
         "> quoted\n\nLast words, with a trailing `backtick and [bracket without end")


@pytest.mark.parametrize("seed", range(4))
async def test_appends_build_what_textuals_markdown_builds(seed):
    rng = random.Random(seed)
    text = REPLY if seed % 2 == 0 else "".join(rng.choice("ab `*_[]()#-\n>1.") for _ in range(600))
    chunks, at = [], 0
    while at < len(text):
        size = rng.randint(1, 30)
        chunks.append(text[at:at + size])
        at += size
    app = TwoMarkdowns()
    async with app.run_test(size=(60, 40)) as pilot:
        textual, streaming = app.query_one("#textual", Markdown), app.query_one("#streaming", StreamingMarkdown)
        for chunk in chunks:
            await textual.append(chunk)
            await streaming.append(chunk)
            assert streaming.source == textual.source
        await pilot.pause()  # both widgets' last blocks mounted and updated
        assert blocks(streaming) == blocks(textual)
