"""A conversation longer than max_model_len keeps going: its oldest turns are left out of the prompt."""
from textual.widgets import Static

from tests.app.helpers import burst, idle, started, wait_for

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
