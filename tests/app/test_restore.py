"""Restarting the app reopens the chats that were open, in tab order, with what each had typed and
not sent, and shows the one that had the focus."""
from nvchat import paths
from nvchat.app.open_tabs import tabs_file
from tests.app.helpers import idle, send, started, type_text, wait_for

SIZE = (110, 36)


async def test_a_restart_reopens_the_open_chats_in_order_with_their_drafts_and_focus(make_app):
    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await send(pilot, "first chat")
        await idle(pilot, app.active_pane)
        await type_text(pilot, "unsent one")
        await pilot.press("ctrl+t")
        await type_text(pilot, "only a draft")  # a chat with no message yet
        await pilot.press("ctrl+t")
        await send(pilot, "third chat")
        await idle(pilot, app.active_pane)
        await pilot.press("ctrl+t")  # an empty chat, never stored
        await pilot.press("alt+left", "alt+left")
        await wait_for(pilot, lambda: app.active_pane is app.tabs.panes[1], what="the second tab shown")
        before = [(p.conversation.title, [m.content for m in p.conversation.messages]) for p in app.tabs.panes]
        await pilot.press("ctrl+q")

    fresh = make_app(max_tokens=4)
    async with fresh.run_test(size=SIZE) as pilot:
        await started(pilot)
        panes = fresh.tabs.panes
        assert [(p.conversation.title, [m.content for m in p.conversation.messages]) for p in panes] == before
        assert [p.prompt.text for p in panes] == ["unsent one", "only a draft", "", ""]
        assert fresh.active_pane is panes[1] and panes[1].prompt.has_focus
        assert [m.content for m in panes[0].conversation.messages][0] == "first chat"
        # The restored chats go on where they were: a turn in the first lands after its messages.
        await pilot.press("alt+left")
        await wait_for(pilot, lambda: fresh.active_pane is panes[0], what="the first tab shown")
        await pilot.press("enter")
        await idle(pilot, panes[0])
        assert [m.content for m in panes[0].conversation.messages if m.role == "user"] == ["first chat", "unsent one"]


async def test_closed_chats_are_not_reopened_and_restore_tabs_off_starts_with_a_new_chat(make_app):
    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await send(pilot, "kept")
        await idle(pilot, app.active_pane)
        await pilot.press("ctrl+t")
        await send(pilot, "closed")
        await idle(pilot, app.active_pane)
        await pilot.press("ctrl+w")
        await wait_for(pilot, lambda: len(app.tabs.panes) == 1, what="the tab to close")

    fresh = make_app(max_tokens=4)
    async with fresh.run_test(size=SIZE) as pilot:
        await started(pilot)
        assert [p.conversation.title for p in fresh.tabs.panes] == ["kept"]

    off = make_app(max_tokens=4, restore_tabs=False)
    async with off.run_test(size=SIZE) as pilot:
        await started(pilot)
        [pane] = off.tabs.panes
        assert pane.conversation.id is None and not pane.conversation.messages


async def test_an_unreadable_list_of_open_tabs_is_a_warning_and_a_new_chat(make_app):
    path = tabs_file(paths.database_file())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        [pane] = app.tabs.panes
        assert pane.conversation.id is None
        assert any(str(path) in n.message and n.severity == "warning" for n in app._notifications)
