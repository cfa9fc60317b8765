"""StreamingMarkdown: appends that keep the last paragraph's height repaint it without a layout,
and it still grows (and its parent with it) when a line wraps."""
from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.geometry import Region

from nvchat.app.streaming_markdown import GrowingParagraph, StreamingMarkdown


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
        await pilot.pause()
        paragraph = markdown.query_one(GrowingParagraph)
        assert paragraph.size.height == 1 and "hello" in shown_text(paragraph)
        layouts = paragraph._layout_updates

        await markdown.append(" world")  # still one line
        await pilot.pause()
        assert "hello world" in shown_text(paragraph)
        assert paragraph._layout_updates == layouts  # repainted, no layout asked for

        await markdown.append(" and a good deal more text than one line of forty holds")
        await pilot.pause()
        assert paragraph.size.height == 2  # laid out again at its new height
        assert "forty holds" in shown_text(paragraph)
        assert markdown.source == "hello world and a good deal more text than one line of forty holds"
