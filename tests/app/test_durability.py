"""Replies are stored while they stream; one that does not end on its own is kept, marked
interrupted, shown as such when reopened, and can be regenerated (the interrupted one stays, as a
branch)."""
from nvchat.app.message_view import ReplyView
from tests.app.helpers import (
    burst,
    idle,
    press_now,
    reopen_the_only_past_conversation,
    started,
    stored_messages,
    wait_for,
)

SIZE = (110, 36)


async def test_a_reply_is_stored_as_it_streams_and_a_stopped_one_reopens_marked_interrupted(make_app):
    app = make_app(max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        burst(app, "keep this")
        await wait_for(pilot, lambda: pane.stream is not None, what="the reply")
        # Stored while it streams: an incomplete row, before the reply ends.
        await wait_for(pilot, lambda: len(stored_messages(pane.conversation.id)) == 2, what="the reply's first save")
        partial = stored_messages(pane.conversation.id)[1]
        assert pane.stream is not None and not pane.stream.finished
        assert partial.role == "assistant" and partial.content and not partial.complete
        await press_now(pilot, "escape")
        await idle(pilot, pane)
        reply = pane.conversation.messages[-1]
        assert reply.interrupted and reply.stats["finish_reason"] == "abort"
        rows = stored_messages(pane.conversation.id)
        assert len(rows) == 2 and rows[1].id == partial.id  # the saved row, finished in place
        assert rows[1].content == reply.content and rows[1].content.startswith(partial.content)
        assert not rows[1].complete
        view = pane.query(ReplyView).last()
        footer = str(view.query_one("#reply-footer").render())
        assert view.has_class("-interrupted") and footer.endswith(" · stopped (Ctrl+R regenerates)")
        assert "interrupted" not in footer  # said once, not "stopped · interrupted"
        conversation_id = pane.conversation.id

    # Not reopened at start-up (restore_tabs): Ctrl+O reopens it.
    fresh = make_app(restore_tabs=False, max_tokens=8)
    async with fresh.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = await reopen_the_only_past_conversation(pilot, fresh)
        assert pane.conversation.id == conversation_id and pane.conversation.messages[-1].interrupted
        view = pane.query_one(ReplyView)
        assert view.has_class("-interrupted") and "interrupted" in view.border_title
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not pane.busy and not pane.conversation.messages[-1].interrupted,
                       what="the regenerated reply")
        rows = stored_messages(conversation_id)
        assert [(r.role, r.complete) for r in rows] == [("user", True), ("assistant", False), ("assistant", True)]
        assert rows[1].parent_id == rows[2].parent_id == rows[0].id
        assert not pane.query(ReplyView).last().has_class("-interrupted")
