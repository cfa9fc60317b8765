"""A conversation longer than max_model_len keeps going: its oldest turns are left out of the prompt."""
from textual.widgets import Static

from nvchat import paths
from nvchat.store import ChatStore
from tests.app.helpers import (
    burst,
    idle,
    reopen_the_only_past_conversation,
    started,
    wait_for,
)

SIZE = (110, 36)


async def test_a_conversation_past_max_model_len_leaves_out_its_oldest_turns(make_app):
    app = make_app(max_tokens=24)  # the shared engine's max_model_len is 512
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        conversation = pane.conversation
        for turn in range(6):
            burst(app, f"turn {turn}: " + "words to fill the context " * 5)
            await wait_for(pilot, lambda: len(conversation.messages) == 2 * turn + 2 and not pane.busy,
                           what=f"turn {turn}'s reply")
            assert pane.prompt.border_subtitle.startswith("context ") and "/ 512 tokens" in pane.prompt.border_subtitle
        assert not [n for n in app._notifications if n.severity == "error"]
        assert len(conversation.messages) == 12
        assert conversation.left_out > 0 and conversation.messages[conversation.left_out].role == "user"
        prompt_tokens = [m.stats["prompt_tokens"] for m in conversation.messages if m.role == "assistant"]
        assert max(prompt_tokens) <= 512 - 24
        notes = pane.query(".context-note")
        assert len(notes) == 1 and "512 tokens" in str(notes.first(Static).render())


async def test_one_message_too_long_for_the_model_stays_in_the_box(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        burst(app, "a short one")
        await wait_for(pilot, lambda: pane.conversation.messages, what="the first turn")
        await idle(pilot, pane)
        burst(app, "x" * 700)  # the byte-level demo tokenizer: > 512 tokens on its own
        await wait_for(pilot, lambda: any("too long" in n.message for n in app._notifications), what="the notice")
        assert pane.prompt.text == "x" * 700 and not pane.busy
        assert len(pane.conversation.messages) == 2


async def test_page_keys_in_the_prompt_box_scroll_the_transcript(make_app):
    store = ChatStore(paths.database_file())
    cid = store.create_conversation("Long", "", "demo")
    for turn in range(4):
        store.add_message(cid, "user", f"question {turn}")
        store.add_message(cid, "assistant", "\n\n".join(f"paragraph {i} of answer {turn}" for i in range(12)))
    store.close()
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = await reopen_the_only_past_conversation(pilot, app)
        transcript = pane.transcript
        await wait_for(pilot, lambda: transcript.max_scroll_y > 0 and transcript.scroll_y == transcript.max_scroll_y,
                       what="the transcript at its end")
        bottom = transcript.scroll_y
        await pilot.press("pageup")
        await wait_for(pilot, lambda: transcript.scroll_y < bottom, what="a page up")
        assert app.focused is pane.prompt
        await pilot.press("pagedown")
        await wait_for(pilot, lambda: transcript.scroll_y == bottom, what="back at the end")
