"""A small terminal (60x20, a split pane): every dialog fits on screen with its buttons in view, and
the KV panel leaves the chat room."""
import pytest
from textual.errors import NoWidget
from textual.widgets import Button, Input

from nvchat.app.kv_panel import KVPanel
from tests.app.helpers import started, wait_for

SMALL = (60, 20)


def fully_shown(app, widget) -> bool:
    try:
        geometry = app.screen.find_widget(widget)
    except NoWidget:  # not laid out yet
        return False
    return app.screen.region.contains_region(geometry.region) and geometry.clip.contains_region(geometry.region)


@pytest.mark.parametrize("key, box", [("f1", "#help-box"), ("f7", "#sampling-box"), ("f4", "#system-box"),
                                      ("ctrl+o", "#conversations-box"), ("f2", "#rename-box")])
async def test_dialogs_fit(make_app, key, box):
    app = make_app()
    async with app.run_test(size=SMALL) as pilot:
        await started(pilot)
        await pilot.press(key)
        await wait_for(pilot, lambda: app.screen.query(box) and fully_shown(app, app.screen.query_one(box)),
                       what=f"{box} laid out in view")
        for button in app.screen.query(Button):
            assert fully_shown(app, button), button.id


async def test_every_sampling_field_comes_into_view_when_focused(make_app):
    app = make_app()
    async with app.run_test(size=SMALL) as pilot:
        await started(pilot)
        await pilot.press("f7")
        for field in app.screen.query(Input):
            field.focus()
            await wait_for(pilot, lambda: fully_shown(app, field), what=f"{field.id} scrolled into view")
        app.screen.query_one("#sampling-max_tokens", Input).focus()
        await pilot.press("ctrl+u", "0", "ctrl+s")  # a bad max tokens: named under the fields
        error = app.screen.query_one("#sampling-error")
        assert "Max tokens per reply must be" in str(error.render()) and fully_shown(app, error)


async def test_the_kv_panel_leaves_the_chat_two_thirds_of_a_narrow_terminal(make_app):
    app = make_app()
    async with app.run_test(size=SMALL) as pilot:
        await started(pilot)
        await pilot.press("f5")
        await wait_for(pilot, lambda: app.query_one(KVPanel).size.width, what="the panel laid out")
        assert app.query_one(KVPanel).outer_size.width <= SMALL[0] // 3
        assert app.active_pane.outer_size.width >= SMALL[0] * 2 // 3
