"""Each chat's own sampling, set in a dialog, used for its replies and kept with the conversation.

Each key's effect (a field focused, a value typed, the dialog shown or gone) is waited for before the
next key: Pilot.press returns once the app looks idle, which a loaded machine's starved process looks
like before the key has been handled, and a key reaches whichever field has the focus when the app
reads it."""
from textual.widgets import Input

from nvchat.app.sampling_screen import SamplingScreen
from tests.app.helpers import burst, started, type_text, wait_for

SIZE = (110, 36)


def field(app, name: str) -> Input:
    return app.screen.query_one(f"#sampling-{name}", Input)


async def dialog_shown(pilot) -> SamplingScreen:
    """Until the sampling dialog is up with its first field focused, ready for typing."""
    app = pilot.app
    await wait_for(pilot, lambda: isinstance(app.screen, SamplingScreen) and app.screen.query(Input)
                   and field(app, "temperature").has_focus, what="the sampling dialog")
    return app.screen


async def tab_to(pilot, name: str, tabs: int) -> None:
    """Presses Tab `tabs` times, each once the one before has moved the focus; the field `name` has
    it then."""
    app = pilot.app
    for _ in range(tabs):
        focused = app.focused
        await pilot.press("tab")
        await wait_for(pilot, lambda: app.focused is not focused, what="the focus moved by Tab")
    assert field(app, name).has_focus


async def type_into(pilot, name: str, text: str) -> None:
    """Types text into the focused field `name`; returns once the field has taken every key."""
    app = pilot.app
    await pilot.press(*text)
    await wait_for(pilot, lambda: field(app, name).value.endswith(text), what=f"{text!r} typed into {name}")


async def test_a_chats_sampling_is_set_in_a_dialog_used_and_kept(make_app):
    app = make_app(max_tokens=24, temperature=0.8)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await pilot.press("f7")
        dialog = await dialog_shown(pilot)
        values = {i.id: i.value for i in dialog.query(Input)}
        # config.toml's values, and nvchat's fallbacks where it sets none (the demo model recommends none)
        assert values == {"sampling-temperature": "0.8", "sampling-top_p": "0.95", "sampling-top_k": "20",
                          "sampling-max_tokens": "24", "sampling-min_p": "0.0", "sampling-repetition_penalty": "1.1",
                          "sampling-presence_penalty": "0.0", "sampling-frequency_penalty": "0.0"}
        await type_into(pilot, "temperature", "0")  # a focused field's text is selected: typing replaces it
        await tab_to(pilot, "max_tokens", 3)
        await type_into(pilot, "max_tokens", "5")
        assert (field(app, "temperature").value, field(app, "max_tokens").value) == ("0", "5")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: pane.conversation.sampling == {"temperature": 0.0, "max_tokens": 5},
                       what="the chat's sampling")
        assert pane.conversation.id is not None  # stored, with the conversation
        await wait_for(pilot, lambda: pane.prompt.has_focus, what="the box focused again")
        burst(app, "short and greedy")
        await wait_for(pilot, lambda: len(pane.conversation.messages) == 2 and not pane.busy, what="the reply")
        assert pane.conversation.messages[1].stats["tokens"] == 5

        # A bad value is named and the dialog stays; another chat keeps the defaults.
        await pilot.press("f7")
        await dialog_shown(pilot)
        assert field(app, "max_tokens").value == "5"
        await tab_to(pilot, "top_p", 1)
        await type_into(pilot, "top_p", "1.5")
        assert field(app, "top_p").value == "1.5"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: str(app.screen.query_one("#sampling-error").render())
                       == "Top-p must be in (0, 1], got 1.5", what="the error named")
        assert isinstance(app.screen, SamplingScreen)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, SamplingScreen), what="the dialog cancelled")
        assert pane.conversation.sampling == {"temperature": 0.0, "max_tokens": 5}
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: app.active_pane is not pane and app.active_pane.prompt.has_focus,
                       what="the new chat, ready for typing")
        other = app.active_pane
        burst(app, "a default reply")
        await wait_for(pilot, lambda: len(other.conversation.messages) == 2 and not other.busy, what="its reply")
        assert other.conversation.messages[1].stats["tokens"] == 24
        conversation_id = pane.conversation.id

    fresh = make_app(max_tokens=24)
    async with fresh.run_test(size=SIZE) as pilot:
        await started(pilot)

        def listed() -> int | None:
            tables = fresh.screen.query("#conversations-table")
            return tables.first().row_count if tables else None

        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: listed() == 2, what="both conversations listed")
        await pilot.press(*"greedy")
        await wait_for(pilot, lambda: listed() == 1, what="the search for a message's word")
        await pilot.press("enter")
        await wait_for(pilot, lambda: fresh.active_pane is not None
                       and fresh.active_pane.conversation.id == conversation_id, what="the reopened chat")
        reopened = fresh.active_pane
        assert reopened.conversation.sampling == {"temperature": 0.0, "max_tokens": 5}
        replaced = reopened.conversation.messages[-1]
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: reopened.conversation.messages[-1] is not replaced and not reopened.busy,
                       what="a regenerated reply")
        assert reopened.conversation.messages[-1].stats["tokens"] == 5


async def test_slash_sampling_with_values_sets_them_without_the_dialog(make_app):
    app = make_app(max_tokens=24, temperature=0.8)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await type_text(pilot, "/sampling max-tokens=3 temperature=0")
        await pilot.press("enter")
        await wait_for(pilot, lambda: pane.conversation.sampling == {"max_tokens": 3, "temperature": 0.0},
                       what="the chat's sampling")
        assert not isinstance(app.screen, SamplingScreen)
        for typed, reason in (("/sampling top_p=1.5", "top_p must be in (0, 1], got 1.5"),
                              ("/sampling warmth=2", "not 'warmth=2'")):
            await type_text(pilot, typed)
            await pilot.press("enter")
            await wait_for(pilot, lambda: any(reason in n.message for n in app._notifications
                                              if n.title == "Sampling not changed"), what=reason)
        assert pane.conversation.sampling == {"max_tokens": 3, "temperature": 0.0}
        burst(app, "short")
        await wait_for(pilot, lambda: len(pane.conversation.messages) == 2 and not pane.busy, what="the reply")
        assert pane.conversation.messages[1].stats["tokens"] == 3
        await type_text(pilot, "/sampling reset")
        await pilot.press("enter")
        await wait_for(pilot, lambda: pane.conversation.sampling == {}, what="the chat's own values gone")
