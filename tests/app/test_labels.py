"""What a chat shows about itself: its tab's busy marker and its context figure."""
from tests.app.helpers import (
    idle,
    press_now,
    reopen_the_only_past_conversation,
    send,
    started,
    submit_now,
    wait_for,
)

SIZE = (110, 36)


async def test_a_busy_tab_with_a_cut_title_shows_one_ellipsis(make_app):
    app = make_app(max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await submit_now(pilot, pane, "a first message far too long to fit whole in a tab's title")
        title = "a first message far too long to fit who…"  # cut to 40 characters

        def label() -> str:
            return str(app.tabs.get_tab(pane.parent.id).label)

        await wait_for(pilot, lambda: pane.conversation.title == title and label() != "● New chat ▸",
                       what="the chat's title from its first message")
        assert pane.busy and label() == f"● {title} ▸"
        await press_now(pilot, "escape")
        await idle(pilot, pane)
        await wait_for(pilot, lambda: label() == f"● {title}", what="the tab's idle label")


async def test_a_reopened_chat_shows_its_context_at_once(make_app):
    app = make_app(max_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "count me")
        await idle(pilot, pane)
        await send(pilot, "and me")
        await idle(pilot, pane)

    # Not reopened at start-up (restore_tabs): Ctrl+O reopens it.
    fresh = make_app(restore_tabs=False, max_tokens=6)
    async with fresh.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = await reopen_the_only_past_conversation(pilot, fresh)
        await wait_for(pilot, lambda: pane.prompt.border_subtitle, what="the context figure")
        conversation = pane.conversation
        expected = len(fresh.engine.tokenize_chat(conversation.engine_messages(), conversation.settings.enable_thinking))
        assert len(conversation.messages) == 4 and expected > 0
        assert pane.prompt.border_subtitle == f"context {expected} / 512 tokens"
