"""A conversation another process writes opens read-only, with a note, and becomes writable here,
with what that process wrote, when shown again after it let go (the two-process run with real
nvchat processes is in test_real_terminal.py)."""
from nvchat import paths
from nvchat.store import ChatStore
from tests.app.helpers import idle, reopen_the_only_past_conversation, send, started, wait_for

SIZE = (110, 36)


async def test_a_conversation_held_by_another_writer_opens_read_only_and_is_written_once_let_go(make_app):
    other = ChatStore(paths.database_file())  # another process's store: its own lock on the file
    conversation_id = other.create_conversation("Written elsewhere", "", "demo")
    question = other.add_message(conversation_id, "user", "asked elsewhere")
    other.add_message(conversation_id, "assistant", "answered elsewhere", parent_id=question)
    lock = other.lock_for_writing(conversation_id)
    app = make_app(max_tokens=8)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            pane = await reopen_the_only_past_conversation(pilot, app)
            assert pane.conversation.read_only and pane.prompt.read_only
            status = str(pane.query_one("#chat-status").render())
            assert status.startswith("Read-only: this conversation is open in another nvchat")
            await pilot.press(*"mine", "enter", "ctrl+r")
            assert pane.prompt.text == "" and not pane.busy
            await wait_for(pilot, lambda: any("open in another nvchat" in n.message for n in app._notifications),
                           what="the refusal of Ctrl+R")
            assert len(other.load_messages(conversation_id)) == 2

            # The other writer adds a turn and lets go; shown again, the tab is writable, read anew.
            follow_up = other.add_message(conversation_id, "user", "asked again elsewhere",
                                          parent_id=other.load_messages(conversation_id)[-1].id)
            lock.release()
            await pilot.press("ctrl+pageup", "ctrl+pagedown")
            await wait_for(pilot, lambda: not pane.prompt.read_only, what="the tab to become writable")
            assert [m.content for m in pane.conversation.messages] == ["asked elsewhere", "answered elsewhere",
                                                                     "asked again elsewhere"]
            assert "Read-only" not in str(pane.query_one("#chat-status").render())
            await pilot.press("ctrl+r")  # answers the other writer's last message, under it
            await idle(pilot, pane)
            rows = other.load_messages(conversation_id)
            assert [(r.role, r.parent_id) for r in rows[2:]] == [("user", rows[1].id), ("assistant", follow_up)]
            await send(pilot, "mine now")
            await idle(pilot, pane)
            assert other.lock_for_writing(conversation_id) is None  # this app writes it now
    finally:
        lock.release()
        other.close()
