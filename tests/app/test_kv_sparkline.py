"""The KV panel's sparkline draws what Textual's Sparkline draws for the same data, cell by cell."""
import random

import pytest
from textual.app import App, ComposeResult
from textual.geometry import Region
from textual.widgets import Sparkline

from nvchat.app.kv_panel import ThroughputSparkline

WIDTH, HEIGHT = 38, 3


class Sparklines(App):
    CSS = "Sparkline { width: %d; height: %d; }" % (WIDTH, HEIGHT)

    def compose(self) -> ComposeResult:
        yield Sparkline([], id="textual")
        yield ThroughputSparkline([], id="ours")


def cells(widget) -> list[list[tuple[str, str | None, str | None]]]:
    """Each cell's character and its foreground and background colours."""
    rows = []
    for strip in widget.render_lines(Region(0, 0, WIDTH, HEIGHT)):
        row = []
        for segment in strip:
            style = segment.style
            fg = style.color.triplet.hex if style and style.color and style.color.triplet else None
            bg = style.bgcolor.triplet.hex if style and style.bgcolor and style.bgcolor.triplet else None
            row += [(ch, fg if ch != " " else None, bg) for ch in segment.text]
        rows.append(row)
    return rows


SERIES = [[], [5.0], [0.0] * 80, [float(i) for i in range(80)], [1.0, 9.0] * 5] + [
    [random.Random(seed).uniform(0, 5000) for _ in range(80)] for seed in range(3)]


@pytest.mark.parametrize("data", SERIES)
async def test_draws_what_textuals_sparkline_draws(data):
    app = Sparklines()
    async with app.run_test(size=(50, 10)) as pilot:
        theirs, ours = app.query_one("#textual", Sparkline), app.query_one("#ours", ThroughputSparkline)
        theirs.data, ours.data = data, data
        await pilot.pause()  # the new data handled (and the widgets' cached lines dropped) before drawing
        assert cells(ours) == cells(theirs)
