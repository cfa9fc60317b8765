"""Keys that arrive together: what a user types is sent or stays in the box, never dropped."""
import threading

from nvchat.app.message_view import AlternativesView, QueuedMessageView
from tests.app.helpers import burst, idle, press_now, started, stored_messages, wait_for

SIZE = (110, 36)


def stored_texts(conversation_id) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in stored_messages(conversation_id)]


async def test_text_and_enter_in_one_read_send_the_text(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        burst(app, "hello there")
        await wait_for(pilot, lambda: pane.conversation.messages, what="the message")
        assert pane.conversation.messages[0].content == "hello there"
        assert pane.prompt.text == ""
        assert stored_texts(pane.conversation.id)[0] == ("user", "hello there")
        await idle(pilot, pane)


async def test_a_bracketed_paste_then_enter_sends_the_paste(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        burst(app, " and more", paste="pasted\nlines")
        await wait_for(pilot, lambda: pane.conversation.messages, what="the message")
        assert pane.conversation.messages[0].content == "pasted\nlines and more"
        assert pane.prompt.text == ""
        await idle(pilot, pane)


async def test_messages_sent_while_a_reply_streams_are_queued_then_sent_in_order(make_app):
    app = make_app(max_tokens=150)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        # Two messages in one burst: the first is sent, the second is queued, not left in the box.
        burst(app, "first")
        burst(app, "second")
        await wait_for(pilot, lambda: pane.stream is not None, what="the reply to start")
        burst(app, "third")  # while it streams
        await wait_for(pilot, lambda: len(pane.queued) == 2, what="two queued messages")
        assert pane.prompt.text == ""
        queued = list(pane.transcript.query(QueuedMessageView))
        assert [v.text for v in queued] == ["second", "third"]
        assert all("queued" in v.border_title for v in queued)
        assert pane.transcript.children[-2:] == queued  # at the foot, under the streaming reply
        assert "2 queued" in str(pane.query_one("#chat-status").render())
        assert [m.content for m in pane.conversation.messages] == ["first"]
        await wait_for(pilot, lambda: len(pane.conversation.messages) == 6 and not pane.busy, 90,
                       "the three turns")
        assert [m.content for m in pane.conversation.messages if m.role == "user"] == ["first", "second", "third"]
        assert not pane.queued and not pane.transcript.query(QueuedMessageView)
        assert [m.content for m in pane.conversation.messages if m.role == "user"] == [
            content for role, content in stored_texts(pane.conversation.id) if role == "user"]


async def test_esc_stops_the_reply_and_puts_the_queued_messages_back_in_the_box(make_app):
    app = make_app(max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        burst(app, "first")
        await wait_for(pilot, lambda: pane.stream is not None, what="the reply to start")
        burst(app, "second")
        burst(app, "//fourth")  # sent as "/fourth", back in the box as typed
        burst(app, "half typed", enter=False)
        await wait_for(pilot, lambda: len(pane.queued) == 2 and pane.prompt.text == "half typed",
                       what="the queue and the typed text")
        await press_now(pilot, "escape")
        await idle(pilot, pane)
        assert pane.prompt.text == "second\n//fourth\nhalf typed"
        assert not pane.queued and not pane.transcript.query(QueuedMessageView)
        assert [m.role for m in pane.conversation.messages] == ["user", "assistant"]
        assert pane.conversation.messages[-1].interrupted


async def three_alternatives_streaming(pilot, pane, prompt: str) -> None:
    """Types prompt and asks for alternatives (F6); returns once all three stream."""
    burst(pilot.app, prompt, enter=False)
    await wait_for(pilot, lambda: pane.prompt.text == prompt, what="the typed text")
    await press_now(pilot, "f6")
    await wait_for(pilot, lambda: len(pane.streams) == 3, what="three alternatives streaming")


async def test_a_message_sent_while_alternatives_stream_waits_below_them_until_every_one_is_stored(make_app):
    app = make_app(max_tokens=120)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await three_alternatives_streaming(pilot, pane, "name a colour")
        burst(app, "and another")
        await wait_for(pilot, lambda: len(pane.queued) == 1, what="the queued message")
        alternatives = pane.query_one(AlternativesView)
        children = list(pane.transcript.children)
        assert children[-1] is pane.queued[0] and children.index(alternatives) < len(children) - 1
        assert "1 queued" in str(pane.query_one("#chat-status").render())
        await wait_for(pilot, lambda: len(pane.conversation.messages) == 4 and not pane.busy, 90, "the queued turn")
        user = pane.conversation.messages[0]
        assert len(user.children) == 3
        # Sent after all three were stored, and the chat went on from the first alternative.
        assert pane.conversation.messages[1] is user.children[0]
        assert pane.conversation.messages[2].content == "and another"
        assert not pane.queued and not pane.transcript.query(QueuedMessageView)


async def test_esc_stops_every_alternative_and_puts_the_queue_back_in_the_box(make_app):
    app = make_app(max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await three_alternatives_streaming(pilot, pane, "name a colour")
        await wait_for(pilot, lambda: all(s.num_completion_tokens for s in pane.streams), what="text in each")
        burst(app, "waiting")
        await wait_for(pilot, lambda: len(pane.queued) == 1, what="the queued message")
        await press_now(pilot, "escape")
        await idle(pilot, pane)
        assert pane.prompt.text == "waiting"
        assert not pane.queued and not pane.transcript.query(QueuedMessageView)
        user = pane.conversation.messages[0]
        assert [m.content for m in pane.conversation.messages if m.role == "user"] == ["name a colour"]
        assert len(user.children) == 3 and all(child.interrupted for child in user.children)


async def test_typing_while_the_transcript_has_the_focus_goes_to_the_prompt_box(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await pilot.click("#transcript")  # as a user does to select text, or shift+tab does
        assert app.focused is pane.transcript
        await pilot.press("h", "i", "space")
        assert app.focused is pane.prompt and pane.prompt.text == "hi "
        await pilot.click("#transcript")
        burst(app, "", paste="there", enter=False)
        await wait_for(pilot, lambda: pane.prompt.text == "hi there", what="the paste in the box")
        assert app.focused is pane.prompt
        for _ in range(3):  # Tab from the box: wherever the focus goes, typing still lands in the box
            await pilot.press("tab", "x")
        assert app.focused is pane.prompt and pane.prompt.text == "hi therexxx"


async def test_esc_while_a_turn_is_still_starting_stops_its_reply(make_app):
    app = make_app(max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        gate = threading.Event()
        app.in_background(gate.wait, 10)  # holds the conversation thread: the turn waits to start
        burst(app, "stop me early")
        await wait_for(pilot, lambda: pane.busy, what="the turn")
        assert pane.stream is None
        await press_now(pilot, "escape")
        gate.set()
        await idle(pilot, pane)
        reply = pane.conversation.messages[-1]
        assert reply.role == "assistant" and reply.interrupted
        assert reply.stats["finish_reason"] == "abort" and reply.stats["tokens"] < 400
