"""The KV panel's block grid redraws only the rows that changed, and still shows what a freshly
drawn grid shows."""
from textual.app import App, ComposeResult
from textual.geometry import Region

from nvchat.app.kv_panel import BlockGrid, BlockOwner, PanelData
from tests.app.test_parts import snapshot

WIDTH, HEIGHT = 8, 4


class Grids(App):
    CSS = "BlockGrid { width: %d; height: %d; }" % (WIDTH, HEIGHT)

    def compose(self) -> ComposeResult:
        yield BlockGrid(id="updated")
        yield BlockGrid(id="fresh")


def drawn(grid: BlockGrid) -> list[list[tuple[str, str]]]:
    strips = grid.render_lines(Region(0, 0, WIDTH, HEIGHT))
    return [[(segment.text, segment.style.color.triplet.hex) for segment in strip] for strip in strips]


async def test_an_updated_grid_draws_what_a_fresh_one_does():
    chats = {7: BlockOwner("seven", "#ff0000"), 9: BlockOwner("nine", "#00ff00")}
    before = snapshot(bytes([2] * 3 + [0] * 29), {7: [0, 1, 2]})
    after = snapshot(bytes([2] * 3 + [0] * 13 + [2] * 2 + [0] * 14), {7: [0, 1, 2], 9: [16, 17]})  # row 2 changes
    app = Grids()
    async with app.run_test(size=(40, 10)) as pilot:
        updated, fresh = app.query_one("#updated", BlockGrid), app.query_one("#fresh", BlockGrid)
        updated.show(PanelData(before, chats, list(chats.values())))
        await pilot.pause()  # the refresh handled and drawn: the next show() redraws from this frame
        first = drawn(updated)
        assert first[0][0] == ("███", "#ff0000")

        updated.show(PanelData(after, chats, list(chats.values())))
        fresh.show(PanelData(after, chats, list(chats.values())))
        await pilot.pause()  # both refreshes handled and drawn
        assert drawn(updated) == drawn(fresh)
        assert drawn(updated)[2][0] == ("██", "#00ff00") and drawn(updated)[:2] == first[:2]
