"""Text typed in a chat's prompt box and not sent is kept with the conversation: stored once typing
pauses, and at once when its tab closes, another tab is shown or the app quits; back in the box
when the conversation is reopened; cleared once sent.

A key's effect is waited for before the next step relies on it: Pilot.press returns once the app
looks idle, which a loaded machine's starved process looks like before the key has reached the
prompt box, and the app's keys (Ctrl+W, Ctrl+T, Ctrl+Q) act as soon as the app reads them."""
import pytest

from nvchat import paths
from nvchat.app import NvchatApp
from nvchat.app.chat_pane import ChatPane
from nvchat.store import ChatStore
from tests.app.conftest import app_settings
from tests.app.helpers import (
    PATIENCE_S,
    burst,
    handled,
    reopen_the_only_past_conversation,
    send,
    started,
    wait_for,
)

SIZE = (110, 36)


class CountingStore(ChatStore):
    """The real store, counting its draft writes."""

    def __init__(self):
        super().__init__()
        self.draft_writes: list[str] = []

    def set_draft(self, conversation_id: int, text: str) -> None:
        self.draft_writes.append(text)
        super().set_draft(conversation_id, text)


def stored_conversations():
    store = ChatStore(paths.database_file())
    try:
        return store.list_conversations()
    finally:
        store.close()


async def type_text(pilot, pane, text: str) -> None:
    """Types text into the chat's box, key by key, and returns once the box holds it."""
    expected = pane.prompt.text + text
    await pilot.press(*["space" if ch == " " else ch for ch in text])
    await wait_for(pilot, lambda: pane.prompt.text == expected, what=f"{text!r} in the box")


async def replied(pilot, pane, messages: int) -> None:
    """Until the chat holds `messages` messages and is idle: the turn that Enter started has ended
    (waiting for idle alone could pass before the chat has taken the Enter)."""
    await wait_for(pilot, lambda: len(pane.conversation.messages) == messages and not pane.busy, 2 * PATIENCE_S,
                   f"{messages} messages and the reply stored")


@pytest.fixture
def no_debounced_saves(monkeypatch):
    """Only the closing tab, the switch or the quit can have stored the draft."""
    monkeypatch.setattr(ChatPane, "DRAFT_SAVE_DELAY_S", 3600)


async def test_a_draft_left_in_a_closed_tab_is_back_when_the_chat_is_reopened_and_sending_clears_it(
        make_app, no_debounced_saves):
    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "first question")
        await replied(pilot, pane, 2)
        await type_text(pilot, pane, "half a thought")
        await pilot.press("ctrl+j")
        await wait_for(pilot, lambda: pane.prompt.text == "half a thought\n", what="the new line")
        await type_text(pilot, pane, "and a second line")
        await pilot.press("ctrl+w")
        await wait_for(pilot, lambda: [c.draft for c in stored_conversations()] == ["half a thought\nand a second line"],
                       what="the closed tab's draft in the store")

    # Not reopened at start-up (restore_tabs): Ctrl+O reopens it.
    fresh = make_app(restore_tabs=False, max_tokens=4)
    async with fresh.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = await reopen_the_only_past_conversation(pilot, fresh)
        assert pane.prompt.text == "half a thought\nand a second line"
        await wait_for(pilot, lambda: pane.prompt.has_focus, what="the reopened chat's box focused")
        assert pane.prompt.cursor_location == pane.prompt.document.end
        await type_text(pilot, pane, " done")
        await pilot.press("enter")
        await replied(pilot, pane, 4)
        assert pane.conversation.messages[-2].content == "half a thought\nand a second line done"
        assert [c.draft for c in stored_conversations()] == [""]

    again = make_app(restore_tabs=False, max_tokens=4)
    async with again.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = await reopen_the_only_past_conversation(pilot, again)
        assert pane.prompt.text == ""


async def test_a_new_chats_draft_survives_quitting_and_is_found_with_ctrl_o(make_app, no_debounced_saves):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await type_text(pilot, app.active_pane, "never lose these words")
        assert stored_conversations() == []
        await pilot.press("ctrl+q")
    [row] = stored_conversations()
    assert (row.draft, row.num_messages) == ("never lose these words", 0)

    fresh = make_app(restore_tabs=False)
    async with fresh.run_test(size=SIZE) as pilot:
        await started(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: fresh.screen.query("#conversations-table")
                       and fresh.screen.query_one("#conversations-table").row_count == 1, what="the list")
        title = fresh.screen.query_one("#conversations-table").get_row_at(0)[0]
        assert str(title) == "New chat  ✎ draft"
        await pilot.press("escape")
        await wait_for(pilot, lambda: not fresh.screen.query("#conversations-table"), what="the list closed")
        pane = await reopen_the_only_past_conversation(pilot, fresh)
        assert pane.prompt.text == "never lose these words"


async def test_switching_tabs_stores_the_draft_of_the_chat_left(make_app, no_debounced_saves):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        first = app.active_pane
        await type_text(pilot, first, "for later")
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: app.active_pane is not first, what="the new tab")
        await wait_for(pilot, lambda: [c.draft for c in stored_conversations()] == ["for later"],
                       what="the draft of the chat left")
        assert first.conversation.id == stored_conversations()[0].id


async def test_typing_that_never_pauses_is_still_stored_every_so_often(shared_engine, monkeypatch):
    monkeypatch.setattr(ChatPane, "DRAFT_SAVE_DELAY_S", 3600)
    monkeypatch.setattr(ChatPane, "DRAFT_SAVE_MAX_WAIT_S", 0.2)
    store = CountingStore()
    app = NvchatApp(app_settings(), engine=shared_engine, store=store)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            pane = app.active_pane
            await type_text(pilot, pane, "a")
            # The chat has seen the change (it bubbles from the box through its container), so the
            # longest a save waits counts from before the pause.
            for widget in (pane.prompt, pane.prompt.parent, pane):
                await handled(pilot, widget)
            # Timed on purpose: the behaviour is a time limit. Typing goes on past the longest a save
            # waits (0.2 s); a loaded machine only makes the pause longer, which the test allows.
            await pilot.pause(0.3)
            await type_text(pilot, pane, "b")
            await wait_for(pilot, lambda: store.draft_writes, what="a save while typing goes on")
            assert store.draft_writes == ["ab"]
    finally:
        store.close()


async def test_typing_stores_the_draft_once_it_pauses_not_per_key_and_f3_keeps_it(shared_engine, monkeypatch):
    monkeypatch.setattr(ChatPane, "DRAFT_SAVE_DELAY_S", 0.3)
    store = CountingStore()
    app = NvchatApp(app_settings(max_tokens=4), engine=shared_engine, store=store)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            pane = app.active_pane
            # In one read, as a terminal delivers fast typing: keys pressed one by one can lie further
            # apart than the pause a save waits for on a loaded machine.
            burst(app, "twelve chars", enter=False)
            await wait_for(pilot, lambda: store.draft_writes, what="the draft's save once typing paused")
            assert store.draft_writes == ["twelve chars"]
            await pilot.press("enter")
            await replied(pilot, pane, 2)
            assert store.draft_writes == ["twelve chars", ""]
            # While F3 edits the last message, the draft it put aside is what the chat keeps.
            await type_text(pilot, pane, "kept")
            await pilot.press("f3")
            assert pane.prompt.text == "twelve chars"
            await pilot.press("ctrl+w")
            await wait_for(pilot, lambda: store.draft_writes[-1:] == ["kept"], what="the kept draft's save")
            assert store.get_conversation(pane.conversation.id).draft == "kept"
    finally:
        store.close()
