"""The chat app driven by real keystrokes against the real demo model on CPU."""
import asyncio
import gc
import threading
import time

import pytest
from textual.widgets import Collapsible, Markdown, TabPane

from nvchat import paths
from nvchat.app import NvchatApp
from nvchat.app.chat_pane import ChatPane
from nvchat.app.events import PromptSubmitted
from nvchat.app.footer import ChatFooter
from nvchat.app.loading_screen import LoadingScreen
from nvchat.app.message_view import ReplyView, ThinkSplitter, UserMessageView
from nvchat.conversation import Message
from nvchat.store import ChatStore, shown_branch
from tests.app.conftest import app_settings
from tests.app.helpers import (
    burst,
    handled,
    idle,
    press_now,
    reopen_the_only_past_conversation,
    run_from_palette,
    send,
    started,
    stored_messages,
    submit_now,
    wait_for,
)

SIZE = (110, 36)


async def test_startup_builds_the_engine_behind_a_loading_screen():
    app = NvchatApp(app_settings())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, LoadingScreen) or app.ready, 30, "the loading screen")
        loading = app._loading or app.screen
        await started(pilot)
        assert "starting the engine thread" in loading.stages and any("KV cache" in s for s in loading.stages)
        assert not isinstance(app.screen, LoadingScreen)
        assert "gibberish" in app.sub_title
        assert len(app.query(ChatPane)) == 1
    with pytest.raises(RuntimeError):  # the app built the engine, so the app shut it down
        app.engine.submit("hello")


async def test_typing_while_the_model_loads_is_kept_for_the_first_chat(monkeypatch):
    from nvchat.app import services as app_module
    loaded = threading.Event()  # holds the start-up until the keys are in
    real_open_backend = app_module.open_backend

    def held_open_backend(*args, **kwargs):
        loaded.wait(30)
        return real_open_backend(*args, **kwargs)

    monkeypatch.setattr(app_module, "open_backend", held_open_backend)
    app = NvchatApp(app_settings())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, LoadingScreen), 30, "the loading screen")
        # q quits only a start that failed: here it is a word's first letter.
        await pilot.press(*"quick", "space", *"qn", "backspace")
        burst(app, "", paste=" pasted", enter=False)
        await wait_for(pilot, lambda: "quick q pasted" in str(app.screen.query_one("#loading-typed").render()),
                       what="the typed text and the paste on the loading screen")
        loaded.set()
        await started(pilot)
        assert app.active_pane.prompt.text == "quick q pasted"
        assert app.focused is app.active_pane.prompt


async def test_bad_model_path_is_reported_on_the_loading_screen(tmp_path):
    app = NvchatApp(app_settings(model=str(tmp_path / "no-such-model")))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, LoadingScreen) and app.screen.error, 30, "the error")
        assert "no-such-model" in app.screen.error
        assert not app.ready
        await pilot.press("q")
    assert app.return_code == 1


async def test_a_failed_start_marks_the_stage_that_failed_and_ctrl_q_reports_it(tmp_path):
    (tmp_path / "config.json").write_text("not JSON")
    app = NvchatApp(app_settings(model=str(tmp_path)))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, LoadingScreen) and app.screen.error, 30, "the error")
        stages = str(app.screen.query_one("#loading-stages").render()).splitlines()
        assert stages[-1] == "  ✗ reading the model config"
        assert all(line.startswith("  ✓ ") for line in stages[:-1])
        await pilot.press("ctrl+q")  # as q: the exit says the start failed, and why
    assert app.return_code == 1


async def test_send_streams_a_reply_with_footer_and_stores_it(make_app):
    app = make_app(max_tokens=300)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await pilot.press("ctrl+t")
        assert len(app.query(ChatPane)) == 2
        pane = app.active_pane
        # Not send(): Pilot.press waits up to a second for the app to go idle, long enough for
        # the demo model to finish the whole reply on a fast machine.
        await submit_now(pilot, pane, "hello there")
        # The chat turns busy before the prompt is tokenized; its reply view comes with the stream.
        await wait_for(pilot, lambda: pane.query(ReplyView) and pane.query(ReplyView).last().query("#answer"),
                       what="the reply view")
        # Streaming: the reply's Markdown grows over several pump ticks before the reply ends.
        answer = pane.query(ReplyView).last().query_one("#answer", Markdown)
        assert len(await sizes_until_idle(pilot, pane, lambda: len(answer.source))) > 3
        user, reply = pane.conversation.messages
        assert (user.role, user.content) == ("user", "hello there")
        assert reply.role == "assistant" and reply.stats["tokens"] == 300 and reply.stats["finish_reason"] == "length"
        footer = str(pane.query_one("#reply-footer").render())
        assert "300 tokens" in footer and "tok/s" in footer and "TTFT" in footer
        assert [m.role for m in stored_messages(pane.conversation.id)] == ["user", "assistant"]
        assert stored_messages(pane.conversation.id)[1].content == reply.content
        assert "hello there" in str(app.tabs.get_tab(pane.parent.id).label)  # titled after the first message


async def test_escape_stops_the_reply(make_app):
    app = make_app(max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await pilot.press(*"tell")
        # Not Pilot.press: it would wait up to a second for the app to go idle, and the reply
        # could end before Esc reaches it.
        await press_now(pilot, "enter")
        await wait_for(pilot, lambda: pane.stream is not None and pane.stream.num_completion_tokens > 3)
        await press_now(pilot, "escape")
        await idle(pilot, pane)
        reply = pane.conversation.messages[-1]
        assert reply.stats["finish_reason"] == "abort"
        assert 3 < reply.stats["tokens"] < 400 and reply.content
        assert "stopped" in str(pane.query_one("#reply-footer").render())
        assert stored_messages(pane.conversation.id)[-1].stats["finish_reason"] == "abort"


async def test_edit_and_resend_the_last_message(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "frist draft")
        await idle(pilot, pane)
        await pilot.press("f3")
        assert pane.editing and pane.prompt.text == "frist draft"
        pane.prompt.clear()
        await send(pilot, "second draft")
        await wait_for(pilot, lambda: pane.conversation.messages[0].content == "second draft" and not pane.busy,
                       what="the resent turn")
        assert [(m.role, m.content) for m in pane.conversation.messages][0] == ("user", "second draft")
        assert len(pane.conversation.messages) == 2
        assert [str(v.message.content) for v in pane.query(UserMessageView)] == ["second draft"]
        # Stored as a branch beside the first draft, which stays.
        rows = stored_messages(pane.conversation.id)
        assert [r.content for r in shown_branch(rows)][0] == "second draft"
        assert [r.content for r in rows if r.role == "user"] == ["frist draft", "second draft"]


async def test_editing_the_last_message_keeps_the_draft_in_the_box(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "first")
        await idle(pilot, pane)
        await pilot.press(*"half")  # a draft, not sent
        await pilot.press("f3")
        assert pane.editing and pane.prompt.text == "first"
        await pilot.press("escape")  # edit cancelled: the draft is back
        assert not pane.editing and pane.prompt.text == "half"
        await pilot.press("f3", "backspace", "backspace", "enter")  # resends "fir"
        await wait_for(pilot, lambda: pane.conversation.messages[0].content == "fir", what="the resent turn")
        await wait_for(pilot, lambda: pane.prompt.text == "half", what="the draft back in the box")
        await idle(pilot, pane)


async def test_newline_keys_do_not_send(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await pilot.press("a", "ctrl+j", "b", "shift+enter", "c")
        assert pane.prompt.text == "a\nb\nc" and not pane.busy
        await pilot.press("enter")
        await wait_for(pilot, lambda: pane.conversation.messages, what="the message")
        assert pane.conversation.messages[0].content == "a\nb\nc"
        await idle(pilot, pane)


async def test_background_tab_keeps_receiving_tokens(make_app):
    app = make_app(max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        first = app.active_pane
        await submit_now(pilot, first, "long story")
        await wait_for(pilot, lambda: first.stream is not None)
        await press_now(pilot, "ctrl+t")
        second = app.active_pane
        assert second is not first and app.active_pane is second
        await submit_now(pilot, second, "another one")
        await wait_for(pilot, lambda: second.stream is not None)
        view = first.query(ReplyView).last()
        before = len(view.text)
        await wait_for(pilot, lambda: len(view.text) > before + 20, what="the background tab to grow")
        assert first.busy and second.busy  # both generating at once
        await idle(pilot, first)
        await idle(pilot, second)
        assert first.conversation.messages[-1].stats["tokens"] == 400
        assert len(view.text) == len(first.conversation.messages[-1].content)


async def test_a_turn_started_in_a_hidden_tab_mounts_its_views_when_shown(make_app):
    """The benchmark's way of starting turns in background tabs (a PromptSubmitted posted to a hidden
    pane): nothing is mounted there until the tab is shown, then the transcript shows each message
    once, whether the reply was stored meanwhile or is still streaming."""
    app = make_app(max_tokens=300)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        hidden = app.active_pane
        await press_now(pilot, "ctrl+t")
        assert app.active_pane is not hidden

        def views():
            return [(type(v).__name__, v.message.content if v.message else None)
                    for v in hidden.transcript.children if isinstance(v, (UserMessageView, ReplyView))]

        hidden.post_message(PromptSubmitted("first question"))
        await wait_for(pilot, lambda: hidden.stream is not None, what="the hidden tab's reply")
        assert views() == []
        await idle(pilot, hidden)
        assert views() == []
        await press_now(pilot, "ctrl+pageup")
        assert app.active_pane is hidden
        first_reply = hidden.conversation.messages[-1]
        # The tab's activation mounts them, a message after the switch.
        first_turn = [("UserMessageView", "first question"), ("ReplyView", first_reply.content)]
        await wait_for(pilot, lambda: views() == first_turn, what="the first turn's views, once each")
        shown_reply = hidden.query(ReplyView).last()
        assert shown_reply.text == first_reply.content
        await wait_for(pilot, lambda: not shown_reply.behind, what="the stored reply to be drawn")
        drawn, received = drawn_and_received(shown_reply)
        assert drawn == received  # drawn once: the stored message, not it and the text received live

        await press_now(pilot, "ctrl+pagedown")
        hidden.post_message(PromptSubmitted("second question"))
        await wait_for(pilot, lambda: hidden.stream is not None, what="the second reply")
        await press_now(pilot, "ctrl+pageup")
        await wait_for(pilot, lambda: len(views()) >= 4, what="the second turn's views")
        live = hidden.query(ReplyView).last()
        assert views()[:3] == [*first_turn, ("UserMessageView", "second question")]
        assert len(views()) == 4  # the reply's view, live or already stored, mounted once
        await idle(pilot, hidden)
        assert len(views()) == 4 and views()[3] == ("ReplyView", hidden.conversation.messages[-1].content)
        assert live.text == hidden.conversation.messages[-1].content


@pytest.fixture(params=[False, True], ids=["", "slow-markdown-mount"])
def slow_markdown_mount(request, monkeypatch):
    """As on a loaded machine: a Markdown widget takes its text when it mounts, well after its view
    composed. A view counted itself drawn at compose, so a test that waited for it to be drawn read
    an empty Markdown (the CI flake of issue 21)."""
    if request.param:
        mount = Markdown._on_mount

        async def late_mount(self, event):
            await asyncio.sleep(0.3)  # the slow mount this fixture injects, not a wait for anything
            await mount(self, event)

        monkeypatch.setattr(Markdown, "_on_mount", late_mount)


async def test_a_pump_tick_that_sees_a_tab_shown_before_its_views_mount_loses_nothing(make_app, slow_markdown_mount):
    """The app's pump reads the active tab on each tick, so one tick can treat a tab as shown after
    the switch but before its TabActivated handler mounted the turn's views. That tick, even the
    one that ends the reply, must neither draw into the unmounted view nor drop the turn."""
    app = make_app(max_tokens=40)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        hidden = app.active_pane
        await press_now(pilot, "ctrl+t")
        hidden.post_message(PromptSubmitted("a question"))
        await wait_for(pilot, lambda: hidden in app.pump.streaming, what="the hidden tab's reply")
        app.pump.timer.pause()  # this test plays the pump's ticks itself
        await wait_for(pilot, lambda: hidden.stream.finished, what="the reply's last token")
        assert await hidden.pump(shown=True, draw=True)
        await idle(pilot, hidden)
        app.pump.timer.resume()
        reply = hidden.conversation.messages[-1]
        assert reply.role == "assistant" and reply.stats["tokens"] == 40
        await press_now(pilot, "ctrl+pageup")
        await wait_for(pilot, lambda: len(hidden.query(ReplyView)) == 1, what="the reply's view")
        view = hidden.query(ReplyView).last()
        await wait_for(pilot, lambda: not view.behind, what="the reply to be drawn")
        assert view.text == reply.content
        assert view.query_one("#answer", Markdown).source == reply.content


async def sizes_until_idle(pilot, pane: ChatPane, size) -> list[int]:
    """Each size(), as it changes, until the chat's turn ends."""
    sizes = [size()]
    while pane.busy:
        await wait_for(pilot, lambda: size() != sizes[-1] or not pane.busy, what="the reply to grow or end")
        if (now := size()) != sizes[-1]:
            sizes.append(now)
    return sizes


def drawn_and_received(view: ReplyView) -> tuple[tuple[str, str], tuple[str, str]]:
    """(thinking, answer) as the view's Markdown widgets show them, and as its received text splits."""
    splitter = ThinkSplitter()
    pieces = splitter.feed(view.text) + splitter.flush()
    received = tuple("".join(text for thinking, text in pieces if thinking == side) for side in (True, False))
    thinking = view.query(Collapsible)
    drawn = (thinking.first().query_one(Markdown).source if thinking else "",
             view.query_one("#answer", Markdown).source)
    return drawn, received


async def test_the_visible_reply_streams_whole_while_other_chats_stream(make_app):
    app = make_app(max_tokens=300)
    gc_threshold = gc.get_threshold()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        for _ in range(2):
            await submit_now(pilot, app.active_pane, "keep the engine busy")
            await press_now(pilot, "ctrl+t")
        pane = app.active_pane
        await submit_now(pilot, pane, "and this one I watch")
        # The reply's view mounts its parts after the stream starts: wait for them too.
        await wait_for(pilot, lambda: pane.stream is not None and pane.query(ReplyView)
                       and pane.query(ReplyView).last().query("#answer"), what="the watched reply to start")
        started_at, draws = time.perf_counter(), app.pump.frame_stats.draws
        view = pane.query(ReplyView).last()
        answer = view.query_one("#answer", Markdown)
        sizes = await sizes_until_idle(pilot, pane, lambda: len(answer.source))
        elapsed, draws = time.perf_counter() - started_at, app.pump.frame_stats.draws - draws
        assert len(sizes) > 3  # it grew as it streamed, not once at the end
        drawn, received = drawn_and_received(view)
        assert drawn == received and len(view.text) == len(pane.conversation.messages[-1].content)
        assert "300 tokens" in str(view.query_one("#reply-footer").render())
        # Batched: never more than PUMP_HZ updates a second. The pump's ticks keep to a fixed schedule
        # (Textual skips the ones it missed), so the window holds at most elapsed * PUMP_HZ + 1 of
        # them, plus one tick that was due before started_at but ran, on a busy loop, after it.
        assert draws <= app.PUMP_HZ * elapsed + 2, (draws, elapsed)
        for other in app.tabs.panes[:2]:
            await idle(pilot, other)
        await wait_for(pilot, lambda: not app.pump.streaming, what="the pump to stop")
        # Full collections are deferred only while chats are busy.
        await wait_for(pilot, lambda: gc.get_threshold() == gc_threshold, what="full collections to be let through")


def footer_keys(app) -> dict[str, bool]:
    """The footer's keys by action: enabled or not."""
    from textual.widgets._footer import FooterKey
    return {key.action: not key.has_class("-disabled") for key in app.query(FooterKey)}


def footer_updates(app) -> list[None]:
    """Grows by one each time the footer has brought its keys up to date with the bindings."""
    footer = app.query_one(ChatFooter)
    update, updates = footer._update_keys, []

    async def counted() -> None:
        await update()
        updates.append(None)

    footer._update_keys = counted  # what ChatFooter.bindings_changed schedules, looked up on the instance
    return updates


async def test_the_footer_enables_the_keys_a_reply_needs_and_keeps_its_keys_otherwise(make_app):
    from textual.widgets._footer import FooterKey
    app = make_app(max_tokens=200)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "first")
        await idle(pilot, pane)
        await wait_for(pilot, lambda: (footer_keys(app)["stop_reply"], footer_keys(app)["regenerate"]) == (False, True),
                       what="Esc disabled and Ctrl+R enabled after the reply")
        keys = set(app.query(FooterKey))
        await submit_now(pilot, pane, "second")
        await wait_for(pilot, lambda: footer_keys(app)["stop_reply"], what="Esc to be enabled")
        assert footer_keys(app)["regenerate"] is False
        updates = footer_updates(app)
        app.refresh_bindings()  # nothing changed: the same keys stay
        await wait_for(pilot, lambda: updates, what="the footer to take the refresh")
        assert set(app.query(FooterKey)) == keys
        await press_now(pilot, "escape")
        await idle(pilot, pane)
        await wait_for(pilot, lambda: not footer_keys(app)["stop_reply"], what="Esc to be disabled")
        assert footer_keys(app)["regenerate"] is True
        assert set(app.query(FooterKey)) == keys
        await press_now(pilot, "ctrl+t")  # another chat: still the same keys, enabled as it needs
        await wait_for(pilot, lambda: app.active_pane is not pane and footer_keys(app)["regenerate"] is False,
                       what="the new chat's keys")
        assert footer_keys(app)["stop_reply"] is False


class DeferralAtReplyStart(NvchatApp):
    """Notes whether full collections were already held back when a reply's stream started
    (this handler runs before NvchatApp's own)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.deferring_at_reply_start: list[bool] = []

    def on_chat_pane_reply_started(self, event) -> None:
        self.deferring_at_reply_start.append(self.pump.gc_deferral.deferring)


async def test_full_collections_wait_from_the_start_of_a_turn_until_its_reply_is_stored(shared_engine):
    app = DeferralAtReplyStart(app_settings(max_tokens=40), engine=shared_engine)
    gc_threshold = gc.get_threshold()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "hello")
        await wait_for(pilot, lambda: app.deferring_at_reply_start, what="the reply to start")
        assert app.deferring_at_reply_start == [True]  # building the turn's views is deferred too
        await idle(pilot, pane)
        await wait_for(pilot, lambda: not app.pump.gc_deferral.deferring, what="the deferral to end")
        assert gc.get_threshold() == gc_threshold


@pytest.mark.parametrize("drawn_first", [True, False], ids=["hidden-mid-reply", "hidden-throughout"])
async def test_a_reply_that_ends_in_a_hidden_tab_shows_whole_once_shown(make_app, drawn_first):
    app = make_app(max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        first = app.active_pane
        await submit_now(pilot, first, "long story")
        # The reply's view, once mounted with its parts (the stream is claimed before it mounts).
        await wait_for(pilot, lambda: first.stream is not None and first.query(ReplyView)
                       and first.query(ReplyView).last().query("#answer"), what="the reply's view")
        view = first.query(ReplyView).last()
        if drawn_first:
            answer = view.query_one("#answer", Markdown)
            await wait_for(pilot, lambda: len(answer.source) > 10, what="the reply to be drawn while shown")
        await press_now(pilot, "ctrl+t")
        assert app.active_pane is not first and first.busy  # hidden mid-reply
        await idle(pilot, first)
        # Hidden, it received the whole reply and stored it, but drew none of what came after.
        stored = first.conversation.messages[-1]
        assert stored.stats["tokens"] == 400 and len(view.text) == len(stored.content)
        drawn, received = drawn_and_received(view)
        assert len(drawn[0]) + len(drawn[1]) < len(received[0]) + len(received[1])
        assert str(view.query_one("#reply-footer").render()) == "generating…"
        await pilot.press("alt+left")
        assert app.active_pane is first
        # Its footer is the last thing the catch-up draws.
        await wait_for(pilot, lambda: drawn_and_received(view)[0] == drawn_and_received(view)[1]
                       and "400 tokens" in str(view.query_one("#reply-footer").render()),
                       what="the whole reply and its footer to be drawn")
        footer = str(view.query_one("#reply-footer").render())
        assert "400 tokens" in footer and "tok/s" in footer and "hit max tokens" in footer
        assert not view.has_class("-live")


async def test_tab_keys_cycle_rename_and_close(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await pilot.press("ctrl+t", "ctrl+t")
        ids = [tab.id for tab in app.tabs.query(TabPane)]
        assert app.tabs.active == ids[2]
        await pilot.press("alt+right")
        assert app.tabs.active == ids[0]
        await pilot.press("alt+left")
        assert app.tabs.active == ids[2]
        await pilot.press("f2")
        await pilot.press(*"renamed", "enter")  # the old title starts selected, so typing replaces it
        await wait_for(pilot, lambda: app.active_pane.conversation.title == "renamed")
        assert "renamed" in str(app.tabs.get_tab(ids[2]).label)
        await pilot.press("ctrl+w")
        await wait_for(pilot, lambda: [tab.id for tab in app.tabs.query(TabPane)] == ids[:2], what="the tab to close")


async def test_switching_theme_in_the_palette_persists(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        assert app.theme == "nvchat-dark"
        await pilot.press("ctrl+p")
        await run_from_palette(pilot, "theme", "Theme")
        await run_from_palette(pilot, "paper", "paper")  # the themes' own palette, which Theme opens
        await wait_for(pilot, lambda: app.theme == "paper", what="the theme to change")
        config = paths.config_file()
        await wait_for(pilot, lambda: config.exists() and 'theme = "paper"' in config.read_text(),
                       what="the theme to be saved")


async def test_kv_panel_shows_numbers_that_change(make_app):
    app = make_app(max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        counters, grid = app.query_one("#kv-counters"), app.query_one("#kv-grid")
        await pilot.press("f5")
        assert app.query_one("#kv-panel").display
        before = str(counters.render())
        assert "blocks" in before and "GiB" in before and "prefix" in before
        pane = app.active_pane
        await submit_now(pilot, pane, "fill the cache")
        await wait_for(pilot, lambda: pane.stream is not None and pane.stream.num_completion_tokens > 40)
        request = pane.stream.request_id

        def panel_shows_the_request() -> bool:
            data = grid.data
            return data is not None and request in data.snapshot.block_holders and request in data.owners

        await wait_for(pilot, panel_shows_the_request, what="the panel to show the reply's blocks")
        assert grid.data.owners[request].color == pane.color  # coloured as its tab
        assert "running  1 ·" in str(counters.render()) or not pane.busy
        await idle(pilot, pane)
        await wait_for(pilot, lambda: str(counters.render()) != before, what="the counters to change")
        await pilot.press("f5")
        assert not app.query_one("#kv-panel").display


async def test_keys_remapped_in_the_config_file(make_app):
    paths.config_file().parent.mkdir(parents=True, exist_ok=True)
    paths.config_file().write_text('[keys]\nnew_tab = "ctrl+n"\nkv_panel = "f8"\n')
    from nvchat.settings import load_settings
    keys = load_settings().keys
    app = make_app(keys=keys)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await pilot.press("ctrl+n")
        assert len(app.query(ChatPane)) == 2
        await pilot.press("ctrl+t")
        assert len(app.query(ChatPane)) == 2  # the old key no longer opens one
        await pilot.press("f8")
        assert app.query_one("#kv-panel").display


async def test_prompt_longer_than_the_model_becomes_a_notification(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        pane.prompt.text = "x" * 700  # the byte-level demo tokenizer: > max_model_len=512 tokens
        await pilot.press("enter")
        await wait_for(pilot, lambda: app._notifications, what="a notification")
        notice = list(app._notifications)[-1]
        assert notice.severity == "error" and "too long" in notice.message
        assert pane.conversation.messages == [] and not pane.busy
        assert pane.prompt.text == "x" * 700  # given back for editing


async def test_reopen_a_past_conversation_in_a_fresh_app(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "remember me")
        await idle(pilot, pane)
        written = [(m.role, m.content) for m in pane.conversation.messages]
        conversation_id = pane.conversation.id

    # Not reopened at start-up (restore_tabs): Ctrl+O reopens it.
    fresh = make_app(restore_tabs=False)
    async with fresh.run_test(size=SIZE) as pilot:
        await started(pilot)
        reopened = await reopen_the_only_past_conversation(pilot, fresh)
        assert reopened.conversation.id == conversation_id
        assert [(m.role, m.content) for m in reopened.conversation.messages] == written
        assert str(reopened.query_one(UserMessageView).render()) == "remember me"
        reply = reopened.query_one(ReplyView)
        assert reply.query_one("#answer", Markdown).source == written[1][1]
        assert "tokens" in str(reply.query_one("#reply-footer").render())
        # ...and it carries on from there.
        await send(pilot, "and again")
        await idle(pilot, reopened)
        assert len(reopened.conversation.messages) == 4


async def test_export_to_markdown(make_app, xdg_dirs):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "export me")
        await idle(pilot, pane)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: any(n.title == "Exported to Markdown" for n in app._notifications))
        files = list(xdg_dirs.glob("nvchat-*.md"))
        assert len(files) == 1
        text = files[0].read_text()
        assert "## User\n\nexport me" in text and pane.conversation.messages[1].content in text


async def test_quitting_mid_reply_keeps_completed_messages(make_app):
    app = make_app(max_tokens=150)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "one")
        await idle(pilot, pane)
        await submit_now(pilot, pane, "two")
        await wait_for(pilot, lambda: pane.stream is not None and pane.stream.num_completion_tokens > 3)
        conversation_id = pane.conversation.id
        await press_now(pilot, "ctrl+q")
    # A reply's last state change can arrive once the screens are gone (seen on a fast GPU).
    app.on_chat_pane_state_changed(ChatPane.StateChanged(pane))
    store = ChatStore(paths.database_file())
    try:
        rows = store.load_messages(conversation_id)
    finally:
        store.close()
    assert [(r.role, r.content) for r in rows][:3] == [("user", "one"), ("assistant", rows[1].content), ("user", "two")]
    assert rows[1].stats["finish_reason"] == "length"
    assert len(rows) == 4 and rows[3].stats["finish_reason"] == "abort"  # the reply cut short, as far as it got
    assert rows[1].complete and not rows[3].complete


async def test_system_prompt_override_for_one_chat(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await pilot.press("f4")
        await wait_for(pilot, lambda: app.screen.query("#system-text"))
        editor = app.screen.query_one("#system-text")
        editor.text = "You are a pirate."
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: pane.conversation.system_prompt == "You are a pirate.")
        assert "pirate" in str(pane.query_one("#system-banner").render())
        await pilot.press("ctrl+t")
        assert app.active_pane.conversation.system_prompt == app.settings.system_prompt  # others keep the default


async def test_help_screen_lists_remapped_keys(make_app):
    app = make_app(keys={"regenerate": "ctrl+g"})
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await pilot.press("f1")
        table = app.screen.query_one("#help-table")
        rows = [table.get_row_at(i) for i in range(table.row_count)]
        assert ["Ctrl+G", "Regenerate", "/regenerate", "regenerate"] in [[str(c) for c in row] for row in rows]
        await pilot.press("escape")
        assert not app.screen.query("#help-table")


async def test_thinking_is_folded_away(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        pane.conversation.messages += [Message("user", "why"),
                                       Message("assistant", "<think>pondering</think>\n\nBecause.", {"tokens": 5})]
        await pane._sync_views()
        fold = pane.query_one(Collapsible)
        assert fold.collapsed and fold.query_one(Markdown).source == "pondering"
        assert pane.query(ReplyView).last().query_one("#answer", Markdown).source == "Because."


async def scroll_wheel(pilot, widget, event_class, times: int) -> None:
    """Turns the mouse wheel over widget; returns once it has scrolled (it does not animate a wheel)."""
    for _ in range(times):
        widget.post_message(event_class(widget, 2, 2, 0, 0, 0, False, False, False))
    await handled(pilot, widget)


async def test_transcript_follows_the_reply_until_scrolled_up(make_app):
    from textual.events import MouseScrollDown, MouseScrollUp
    app = make_app(max_tokens=420)
    async with app.run_test(size=(50, 18)) as pilot:
        await started(pilot)
        pane = app.active_pane
        transcript = pane.transcript
        await submit_now(pilot, pane, "go")
        await wait_for(pilot, lambda: transcript.max_scroll_y > 4 and pane.stream is not None, what="a tall reply")
        # Following: it scrolls to each new end once the new lines are laid out.
        await wait_for(pilot, lambda: transcript.scroll_y == transcript.max_scroll_y, what="the view at the end")
        await scroll_wheel(pilot, transcript, MouseScrollUp, 3)
        held = transcript.scroll_y
        grown = transcript.max_scroll_y
        assert held < grown
        await wait_for(pilot, lambda: transcript.max_scroll_y > grown + 1 or not pane.busy, what="more lines")
        assert transcript.scroll_y == held  # left where the user put it
        await scroll_wheel(pilot, transcript, MouseScrollDown, 40)  # back to the bottom...
        bottom = transcript.max_scroll_y
        await wait_for(pilot, lambda: transcript.max_scroll_y > bottom + 1 or not pane.busy, what="more lines")
        grown = transcript.max_scroll_y
        await wait_for(pilot, lambda: transcript.scroll_y >= grown, what="the view to follow again")
        await idle(pilot, pane)


async def test_closing_a_tab_mid_reply_keeps_what_it_said(make_app):
    app = make_app(max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await submit_now(pilot, pane, "cut me off")
        await wait_for(pilot, lambda: pane.stream is not None and pane.stream.num_completion_tokens > 3)
        await press_now(pilot, "ctrl+w")
        await wait_for(pilot, lambda: pane not in app.query(ChatPane), what="the tab to close")
        assert len(app.query(ChatPane)) == 1  # a fresh chat takes the last tab's place
        # The reply's text may be stored mid-stream first (no numbers yet); its end follows.
        conversation_id = pane.conversation.id
        await wait_for(pilot, lambda: len(rows := stored_messages(conversation_id)) == 2 and rows[1].stats is not None,
                       what="the partial reply to be stored with its end")
        assert stored_messages(conversation_id)[1].stats["finish_reason"] == "abort"


async def test_default_system_prompt_from_the_palette(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await pilot.press("ctrl+p")
        await run_from_palette(pilot, "default system", "Default system prompt")
        await wait_for(pilot, lambda: app.screen.query("#system-text"), what="the editor")
        app.screen.query_one("#system-text").text = "Be brief."
        await pilot.press("ctrl+s")
        config = paths.config_file()
        await wait_for(pilot, lambda: config.exists() and 'system_prompt = "Be brief."' in config.read_text())
        await pilot.press("ctrl+t")
        assert app.active_pane.conversation.system_prompt == "Be brief."


async def test_engine_failure_becomes_a_notification(make_app, monkeypatch):
    app = make_app(max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        runner = app.engine.llm.runner
        real_execute = runner.execute

        def failing_execute(plan):  # fault injection: the next forward pass fails, once
            monkeypatch.setattr(runner, "execute", real_execute)
            raise RuntimeError("injected GPU fault")

        monkeypatch.setattr(runner, "execute", failing_execute)
        await send(pilot, "this reply will break")
        await wait_for(pilot, lambda: not pane.busy, what="the reply to end")
        await wait_for(pilot, lambda: any("injected GPU fault" in n.message for n in app._notifications),
                       what="an error notification")
        notice = next(n for n in app._notifications if "injected GPU fault" in n.message)
        assert notice.severity == "error"
        # The app and the engine carry on: the next message gets a reply.
        await send(pilot, "and now?")
        await wait_for(pilot, lambda: not pane.busy, what="the next reply")
        assert pane.conversation.messages[-1].role == "assistant"
        assert pane.conversation.messages[-1].stats["finish_reason"] == "length"
