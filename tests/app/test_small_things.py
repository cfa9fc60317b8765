"""Small things a daily user meets: warnings that name where a bad value came from, focus that can
always be seen, every key in F1, toasts clear of the prompt box, a compact transcript, a KV panel
in the theme's colours."""
from collections import defaultdict

import pytest
from textual.color import Color
from textual.widgets import DataTable
from textual.widgets._toast import Toast

from nvchat.app import NvchatApp
from nvchat.app.kv_panel import BlockGrid, Counters, KVPanel, blocks_per_cell
from nvchat.app.message_view import ReplyView
from tests.app.conftest import app_settings
from tests.app.helpers import idle, send, started, wait_for

SIZE = (110, 36)


async def test_an_unknown_theme_from_the_flag_is_blamed_on_the_flag(idle_engine):
    app = NvchatApp(app_settings(theme="nosuch"), engine=idle_engine, flags=frozenset({"theme"}))
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        [warning] = [n.message for n in app._notifications if "nosuch" in n.message]
        assert warning.startswith("--theme: unknown theme 'nosuch'") and "config.toml" not in warning
        assert app.theme == "nvchat-dark"


async def test_an_unknown_theme_from_config_toml_is_blamed_on_config_toml(idle_engine):
    app = NvchatApp(app_settings(theme="nosuch"), engine=idle_engine)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        assert any(n.message.startswith("config.toml: unknown theme 'nosuch'") for n in app._notifications)


async def test_f1_lists_the_focus_keys_and_c_for_copying_a_code_block(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await pilot.press("f1")
        await pilot.pause()
        table = app.screen.query_one("#help-table", DataTable)
        keys = {str(table.get_row_at(row)[0]): str(table.get_row_at(row)[1]) for row in range(table.row_count)}
        assert keys["Tab"] == "Focus next" and keys["Shift+Tab"] == "Focus previous"
        assert keys["C"] == "Copy code block"
        assert "c copies the focused block" in str(app.screen.query_one("#help-footer").render())


async def test_tab_from_the_box_shows_that_the_transcript_has_the_focus(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        edge = pane.transcript.region.x  # the transcript's left column, its padding
        rows = range(pane.transcript.region.y, pane.transcript.region.bottom)

        def left_column() -> list:
            return [app.screen.get_style_at(edge, y) for y in rows]
        unfocused = left_column()
        await pilot.press("tab")
        assert app.focused is pane.transcript
        await pilot.pause()
        assert left_column() != unfocused
        await pilot.press("shift+tab")
        await pilot.pause()
        assert app.focused is pane.prompt and left_column() == unfocused


async def test_notifications_leave_the_message_box_uncovered(make_app):
    for size in (SIZE, (60, 20)):
        app = make_app()
        async with app.run_test(size=size, notifications=True) as pilot:
            await started(pilot)
            await pilot.press("slash", "n", "o", "s", "u", "c", "h", "enter")  # "Not sent": a warning
            await pilot.press("ctrl+a", "ctrl+k", "slash", "s", "t", "o", "p", "enter")  # "Nothing to stop"
            await wait_for(pilot, lambda: len(app.screen.query(Toast)) >= 2, what="two notifications")
            await pilot.pause(0.5)  # their slide-in
            box = app.screen.find_widget(app.active_pane.prompt).region
            for toast in app.screen.query(Toast):
                assert not app.screen.find_widget(toast).region.overlaps(box)


async def test_f12_makes_the_transcript_compact_and_the_choice_is_kept(make_app, xdg_dirs):
    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "hello")
        await idle(pilot, pane)
        reply = pane.query_one(ReplyView)
        footer = reply.query_one("#reply-footer")
        assert footer.display and "tokens" in str(footer.render())
        rows = reply.outer_size.height
        await pilot.press("f12")
        await pilot.pause()
        assert app.has_class("-compact") and not footer.display
        # One rule above each message, no box: the reply loses its bottom border and its footer.
        assert reply.outer_size.height == rows - 2
        await wait_for(pilot, lambda: "compact_transcript = true" in config_text(xdg_dirs), what="the saved setting")

    again = make_app(max_tokens=4, compact_transcript=True)  # as config.toml now says
    async with again.run_test(size=SIZE) as pilot:
        await started(pilot)
        assert again.has_class("-compact")
        await pilot.press("f12")
        assert not again.has_class("-compact")


def config_text(xdg_dirs) -> str:
    path = xdg_dirs / "config" / "nvchat" / "config.toml"
    return path.read_text() if path.exists() else ""


def kv_panel_backgrounds(app) -> dict[str | None, list[tuple[int, int]]]:
    """Each background colour drawn in the KV panel's region, with the cells (x, y) that have it."""
    region = app.query_one(KVPanel).region
    cells = defaultdict(list)
    for y in range(region.y, region.bottom):
        for x in range(region.x, region.right):
            background = app.screen.get_style_at(x, y).bgcolor
            cells[background.triplet.hex if background and background.triplet else None].append((x, y))
    return cells


@pytest.mark.parametrize("size", [(160, 48), (80, 24)], ids=lambda size: "%dx%d" % size)
@pytest.mark.parametrize("first", ["nvchat-dark", "nvchat-light"])
async def test_the_kv_panel_and_its_graph_take_each_themes_background(idle_engine, first, size):
    # An idle engine's throughput stays 0, so the graph's data never changes: only the theme can
    # make it draw again.
    second = "nvchat-light" if first == "nvchat-dark" else "nvchat-dark"
    app = NvchatApp(app_settings(theme=first), engine=idle_engine)
    async with app.run_test(size=size) as pilot:
        await started(pilot)
        await pilot.press("f5")
        await wait_for(pilot, lambda: app.query_one(Counters).text, what="the KV panel's numbers")
        for theme in (second, first, second):
            app.theme = theme
            surface = Color.parse(app.current_theme.surface).hex.lower()

            def strays():
                return {colour: (cells[0], cells[-1], len(cells)) for colour, cells in kv_panel_backgrounds(app).items()
                        if colour != surface}

            # The repaint lands when the app gets to it, which one pause did not always cover on a
            # loaded 2-core box: wait for it, bounded, so a panel that never repaints still fails.
            try:
                await wait_for(pilot, lambda: not strays(), what=f"the KV panel's repaint in {theme}")
            except AssertionError:
                raise AssertionError(f"in {theme}, cells of the KV panel not on its background {surface}: "
                                     f"{strays()}") from None


@pytest.mark.parametrize("size", [(100, 32), (160, 48)], ids=lambda size: "%dx%d" % size)
async def test_the_kv_panel_opens_with_the_legend_of_its_grid(idle_engine, size):
    # The legend's "1 cell = N blocks" depends on the grid's size, which the panel has only once it
    # is laid out: a legend made on opening was for a grid of no size until the timer's next tick.
    app = NvchatApp(app_settings(), engine=idle_engine)
    async with app.run_test(size=size) as pilot:
        await started(pilot)
        await pilot.press("f5")
        await pilot.pause()
        panel = app.query_one(KVPanel)
        grid = panel.query_one(BlockGrid)
        per_cell = blocks_per_cell(idle_engine.stats().num_blocks, grid.size.width * grid.size.height)
        legend = str(panel.query_one("#kv-legend").render())
        if per_cell > 1:
            assert legend.endswith(f"1 cell = {per_cell} blocks"), (grid.size, legend)
        else:
            assert "1 cell" not in legend, (grid.size, legend)
