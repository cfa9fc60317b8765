"""A small terminal (60x20, a split pane): every dialog fits on screen with its buttons in view, and
the KV panel leaves the chat room."""
import pytest
from textual.widgets import Button, Input

from nvchat.app.kv_panel import KVPanel
from tests.app.helpers import started

SMALL = (60, 20)


def fully_shown(app, widget) -> bool:
    geometry = app.screen.find_widget(widget)
    return app.screen.region.contains_region(geometry.region) and geometry.clip.contains_region(geometry.region)


@pytest.mark.parametrize("key, box", [("f1", "#help-box"), ("f7", "#sampling-box"), ("f4", "#system-box"),
                                      ("ctrl+o", "#conversations-box"), ("f2", "#rename-box")])
async def test_dialogs_fit(make_app, key, box):
    app = make_app()
    async with app.run_test(size=SMALL) as pilot:
        await started(pilot)
        await pilot.press(key)
        await pilot.pause()
        assert fully_shown(app, app.screen.query_one(box))
        for button in app.screen.query(Button):
            assert fully_shown(app, button), button.id


async def test_every_sampling_field_comes_into_view_when_focused(make_app):
    app = make_app()
    async with app.run_test(size=SMALL) as pilot:
        await started(pilot)
        await pilot.press("f7")
        for field in app.screen.query(Input):
            field.focus()
            await pilot.pause()
            assert fully_shown(app, field), field.id
        app.screen.query_one("#sampling-max_tokens", Input).focus()
        await pilot.press("ctrl+u", "0", "ctrl+s")  # a bad max tokens: named under the fields
        error = app.screen.query_one("#sampling-error")
        assert "Max tokens per reply must be" in str(error.render()) and fully_shown(app, error)


async def test_the_kv_panel_leaves_the_chat_two_thirds_of_a_narrow_terminal(make_app):
    app = make_app()
    async with app.run_test(size=SMALL) as pilot:
        await started(pilot)
        await pilot.press("f5")
        await pilot.pause()
        assert app.query_one(KVPanel).outer_size.width <= SMALL[0] // 3
        assert app.active_pane.outer_size.width >= SMALL[0] * 2 // 3
