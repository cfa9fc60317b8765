"""Each chat's own sampling, set in a dialog, used for its replies and kept with the conversation."""
from textual.widgets import Input

from nvchat.app.sampling_screen import SamplingScreen
from tests.app.helpers import burst, idle, started, wait_for

SIZE = (110, 36)


async def test_a_chats_sampling_is_set_in_a_dialog_used_and_kept(make_app):
    app = make_app(max_tokens=24, temperature=0.8)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await pilot.press("f7")
        assert isinstance(app.screen, SamplingScreen)
        values = {i.id: i.value for i in app.screen.query(Input)}
        # config.toml's values, and nvchat's fallbacks where it sets none (the demo model recommends none)
        assert values == {"sampling-temperature": "0.8", "sampling-top_p": "0.95", "sampling-top_k": "20",
                          "sampling-max_tokens": "24", "sampling-min_p": "0.0", "sampling-repetition_penalty": "1.1",
                          "sampling-presence_penalty": "0.0", "sampling-frequency_penalty": "0.0"}
        await pilot.press("0", "tab", "tab", "tab", "5", "ctrl+s")
        await wait_for(pilot, lambda: pane.conversation.sampling == {"temperature": 0.0, "max_tokens": 5},
                       what="the chat's sampling")
        assert pane.conversation.id is not None  # stored, with the conversation
        burst(app, "short and greedy")
        await wait_for(pilot, lambda: len(pane.conversation.messages) == 2 and not pane.busy, what="the reply")
        assert pane.conversation.messages[1].stats["tokens"] == 5

        # A bad value is named and the dialog stays; another chat keeps the defaults.
        await pilot.press("f7")
        assert app.screen.query_one("#sampling-max_tokens", Input).value == "5"
        await pilot.press("tab", "1", ".", "5", "ctrl+s")
        assert isinstance(app.screen, SamplingScreen)
        assert str(app.screen.query_one("#sampling-error").render()) == "Top-p must be in (0, 1], got 1.5"
        await pilot.press("escape")
        assert pane.conversation.sampling == {"temperature": 0.0, "max_tokens": 5}
        await pilot.press("ctrl+t")
        other = app.active_pane
        burst(app, "a default reply")
        await wait_for(pilot, lambda: len(other.conversation.messages) == 2 and not other.busy, what="its reply")
        assert other.conversation.messages[1].stats["tokens"] == 24
        conversation_id = pane.conversation.id

    fresh = make_app(max_tokens=24)
    async with fresh.run_test(size=SIZE) as pilot:
        await started(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: fresh.screen.query("#conversations-table")
                       and fresh.screen.query_one("#conversations-table").row_count == 2)
        await pilot.press(*"greedy", "enter")
        await wait_for(pilot, lambda: fresh.active_pane.conversation.id == conversation_id, what="the reopened chat")
        reopened = fresh.active_pane
        assert reopened.conversation.sampling == {"temperature": 0.0, "max_tokens": 5}
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not reopened.busy and reopened.conversation.messages[-1].stats["tokens"] == 5,
                       what="a regenerated 5-token reply")
        await idle(pilot, reopened)
