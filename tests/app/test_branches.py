"""Branches and alternatives, driven by real keystrokes against the real demo model on CPU: editing
any message or regenerating any reply adds a branch beside it (nothing is replaced, in the store
either), ◀ 2/3 ▶ marks a message with siblings, F8/F9 and /branch show them, and the transcript,
the export and the next turn follow the branch shown. F6 and /alt N ask for several replies at
once, side by side, and the one picked becomes the branch shown."""
from nvchat import paths
from nvchat.app.chat_pane import ChatPane
from nvchat.app.message_view import AlternativesView, ReplyView, UserMessageView
from nvchat.conversation import Conversation
from nvchat.store import ChatStore, shown_branch
from tests.app.helpers import idle, send, started, stored_messages, wait_for

SIZE = (140, 40)


def transcript(pane: ChatPane) -> list[tuple[str, str, str]]:
    """(role, text, title) of each entry the transcript shows, in order."""
    rows = []
    for view in pane.transcript.children:
        if isinstance(view, (UserMessageView, ReplyView)):
            role = "user" if isinstance(view, UserMessageView) else "assistant"
            rows.append((role, view.message.content if view.message else None, str(view.border_title)))
    return rows


async def test_regenerating_keeps_the_old_reply_as_a_branch_and_f8_f9_switch_between_them(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "roll the dice")
        await idle(pilot, pane)
        first = pane.conversation.messages[-1]
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: pane.conversation.messages[-1] is not first and not pane.busy,
                       what="the regenerated reply")
        second = pane.conversation.messages[-1]
        assert [m.role for m in pane.conversation.messages] == ["user", "assistant"]
        assert transcript(pane) == [("user", "roll the dice", "you"), ("assistant", second.content, "assistant  ◀ 2/2 ▶")]
        rows = stored_messages(pane.conversation.id)
        assert [(r.role, r.content) for r in rows] == [("user", "roll the dice"), ("assistant", first.content),
                                                       ("assistant", second.content)]
        assert rows[1].parent_id == rows[2].parent_id == rows[0].id  # siblings: nothing was replaced

        await pilot.press("f8")
        await wait_for(pilot, lambda: pane.conversation.messages[-1] is first, what="the first reply shown")
        assert transcript(pane)[-1] == ("assistant", first.content, "assistant  ◀ 1/2 ▶")
        assert first.content in pane.conversation.to_markdown() and second.content not in pane.conversation.to_markdown()
        reopened = shown_branch(stored_messages(pane.conversation.id))
        assert reopened[-1].content == first.content  # reopens on it
        await pilot.press("f9")
        await wait_for(pilot, lambda: pane.conversation.messages[-1] is second, what="the second reply shown")
        assert transcript(pane)[-1] == ("assistant", second.content, "assistant  ◀ 2/2 ▶")


async def test_editing_an_earlier_message_makes_a_branch_that_the_next_turn_and_the_export_follow(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "first question")
        await idle(pilot, pane)
        await send(pilot, "second question")
        await idle(pilot, pane)
        old_branch = list(pane.conversation.messages)
        # Alt+Up from none selects the last message; three more reach the first.
        await pilot.press("alt+up", "alt+up", "alt+up", "alt+up")
        assert pane.cursor == 0 and pane.query(UserMessageView).first().has_class("-selected")
        assert "message 1 of 4 selected" in str(pane.query_one("#chat-status").render())
        await pilot.press("f3")
        assert pane.editing and pane.prompt.text == "first question"
        assert "editing message 1" in str(pane.query_one("#chat-status").render())
        await pilot.press("ctrl+u")  # clears the line
        await send(pilot, "first question again")
        await wait_for(pilot, lambda: pane.conversation.messages[0].content == "first question again" and not pane.busy,
                       what="the edited turn")
        assert [m.role for m in pane.conversation.messages] == ["user", "assistant"]
        assert transcript(pane)[0] == ("user", "first question again", "you  ◀ 2/2 ▶")
        assert pane.cursor is None
        # The next turn follows the branch shown.
        await send(pilot, "third question")
        await idle(pilot, pane)
        new_branch = list(pane.conversation.messages)
        assert [m.content for m in new_branch[::2]] == ["first question again", "third question"]
        rows = stored_messages(pane.conversation.id)
        assert len(rows) == 8 and [r.content for r in shown_branch(rows)] == [m.content for m in new_branch]

        # F8 with nothing selected: the latest message that has siblings, the first one.
        await pilot.press("f8")
        await wait_for(pilot, lambda: pane.conversation.messages == old_branch, what="the old branch")
        assert [row[1] for row in transcript(pane)] == [m.content for m in old_branch]
        assert transcript(pane)[0][2] == "you  ◀ 1/2 ▶"
        markdown = pane.conversation.to_markdown()
        assert "second question" in markdown and "third question" not in markdown
        await send(pilot, "/branch 2")
        await wait_for(pilot, lambda: pane.conversation.messages == new_branch, what="branch 2 again")

        # Reopened, the conversation shows the branch shown last; history search finds every branch.
        store = ChatStore(paths.database_file())
        try:
            again = Conversation.load(app.engine, store, pane.conversation.id, app.settings)
            assert [m.content for m in again.messages] == [m.content for m in new_branch]
            again.release()
        finally:
            store.close()
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: app.screen.query("#conversations-table"), what="the history")
        await pilot.press(*"second", "space", *"question")
        table = app.screen.query_one("#conversations-table")
        await wait_for(pilot, lambda: table.row_count == 1, what="the conversation found by a word of the other branch")


async def test_alternatives_come_side_by_side_and_the_one_picked_becomes_the_branch_shown(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        before = app.engine.stats()
        # A prompt no other test of the shared engine sends, so that its first sample computes it.
        await pilot.press(*"name", "space", *"a", "space", *"river")
        await pilot.press("f6")
        await wait_for(pilot, lambda: pane.query(AlternativesView), what="the alternatives")
        view = pane.query_one(AlternativesView)
        assert len(view.replies) == 3 and view.has_class("-side-by-side")
        await idle(pilot, pane)
        messages = pane.conversation.messages
        user = messages[0]
        assert [m.role for m in messages] == ["user", "assistant"] and len(user.children) == 3
        assert [v.message for v in view.replies] == user.children
        assert messages[-1] is user.children[0]  # until one is picked, the chat goes on from the first
        rows = stored_messages(pane.conversation.id)
        assert [r.parent_id for r in rows[1:]] == [rows[0].id] * 3
        # One request for three samples: the prompt was computed once (past the system prompt's
        # blocks, which earlier tests left in the shared engine's cache), and the other two took its full blocks from the cache (each has
        # its first token by then, so a block ending the prompt is full too); the footers say so, as
        # the engine counted it.
        after = app.engine.stats()
        stats = [m.stats for m in user.children]
        assert after.prompt_tokens - before.prompt_tokens == sum(s["prompt_tokens"] for s in stats)
        assert after.prefix_hit_tokens - before.prefix_hit_tokens == sum(s["cached_tokens"] for s in stats)
        prompt, block = stats[0]["prompt_tokens"], after.block_size
        first, *forks = [s["cached_tokens"] for s in stats]
        assert first < prompt // block * block and forks == [prompt // block * block] * 2
        footers = [str(v.query_one("#reply-footer").render()) for v in view.replies]
        assert f"{prompt // block * block} of {prompt} prompt tokens from the cache" in footers[1]

        await pilot.press("alt+2")
        await wait_for(pilot, lambda: not pane.query(AlternativesView), what="the pick")
        assert pane.conversation.messages[-1] is user.children[1]
        assert transcript(pane)[-1] == ("assistant", user.children[1].content, "assistant  ◀ 2/3 ▶")
        assert shown_branch(stored_messages(pane.conversation.id))[-1].content == user.children[1].content

        # /alt N beside the last reply: more siblings of it.
        await send(pilot, "/alt 2")
        await wait_for(pilot, lambda: pane.query(AlternativesView), what="two more alternatives")
        assert len(pane.query_one(AlternativesView).replies) == 2
        await idle(pilot, pane)
        assert len(user.children) == 5
        await send(pilot, "/pick 2")
        await wait_for(pilot, lambda: not pane.query(AlternativesView), what="the second pick")
        assert pane.conversation.messages[-1] is user.children[4]
        assert transcript(pane)[-1][2] == "assistant  ◀ 5/5 ▶"


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def test_a_branch_deep_in_a_chat_prefills_only_what_is_new_and_its_footer_says_so(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        for text in ("first question", "second question", "third question"):
            await send(pilot, text)
            await idle(pilot, pane)
        conversation = pane.conversation
        # The prompt the third turn sent: the engine computed (and cached) all of it then.
        earlier = app.engine.tokenize_chat(conversation.engine_messages(conversation.messages[:5]))
        await pilot.press("alt+up", "alt+up", "f3", "ctrl+u")
        assert pane._edit_index == 4
        before = app.engine.stats()
        await send(pilot, "third question, asked again")
        await wait_for(pilot, lambda: len(conversation.messages) == 6 and not pane.busy, what="the branch's reply")
        after = app.engine.stats()
        reply = conversation.messages[-1]
        prompt, cached = reply.stats["prompt_tokens"], reply.stats["cached_tokens"]
        branch_prompt = app.engine.tokenize_chat(conversation.engine_messages(conversation.messages[:5]))
        assert prompt == len(branch_prompt)
        # Everything the branch shares with the earlier turns came from the prefix cache, in whole
        # blocks (the engine always computes a prompt's last token): only the new part was prefilled.
        shared = common_prefix(earlier, branch_prompt)
        block = after.block_size
        assert shared > prompt // 2
        assert min(shared, prompt - 1) // block * block <= cached <= prompt - 1
        assert after.prefix_hit_tokens - before.prefix_hit_tokens == cached
        assert after.prompt_tokens - before.prompt_tokens == prompt
        footer = str(pane.query(ReplyView).last().query_one("#reply-footer").render())
        assert f"{cached} of {prompt} prompt tokens from the cache" in footer
