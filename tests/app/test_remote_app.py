"""The app on a remote backend (`--backend URL`): a real `nvchat serve` app on a socket, driven by
real keystrokes; tabs stream at once, the KV panel says why it has no blocks to show, and an
unreachable server is a notification, not a broken app; a server like llama.cpp's (tests/one_slot_server.py)
is named by its model, its tabs queue, and what it does not report shows as unknown."""
import socket

from nvchat.app import NvchatApp
from nvchat.app.app import ONE_AT_A_TIME_NOTE
from nvchat.app.chat_pane import ChatPane
from nvchat.app.kv_panel import NO_BLOCK_STATS, BlockGrid, Counters, KVPanel
from nvchat.app.message_view import ReplyView
from nvchat.remote_backend import RemoteBackend
from nvchat.server.app import ServerState, create_app
from tests.app.conftest import app_settings
from tests.app.helpers import idle, press_now, started, submit_now, wait_for
from tests.one_slot_server import MODEL, REPLY, OneSlotServer
from tests.serving import serving

SIZE = (110, 36)


async def test_tabs_stream_at_once_from_a_server_and_the_kv_panel_says_why_it_is_empty(shared_engine):
    with serving(create_app(ServerState("demo", shared_engine))) as url:
        app = NvchatApp(app_settings(backend=url, max_tokens=120))
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            assert isinstance(app.engine, RemoteBackend) and app.engine.model_name == "demo"
            first = app.active_pane
            await submit_now(pilot, first, "long story")
            await wait_for(pilot, lambda: first.stream is not None)
            await press_now(pilot, "ctrl+t")
            second = app.active_pane
            await submit_now(pilot, second, "another one")
            await wait_for(pilot, lambda: second.stream is not None and second.stream.text, what="the second reply")
            view = first.query(ReplyView).last()
            before = len(view.text)
            await wait_for(pilot, lambda: len(view.text) > before, what="the background tab to grow")
            assert first.busy and second.busy  # both streaming at once

            await press_now(pilot, "f5")
            panel = app.query_one(KVPanel)
            await wait_for(pilot, lambda: panel.query_one(Counters).text == NO_BLOCK_STATS, what="the KV panel's note")
            assert not panel.query_one(BlockGrid).display

            await idle(pilot, first)
            await idle(pilot, second)
            for pane in (first, second):
                reply = pane.conversation.messages[-1]
                assert reply.stats["tokens"] == 120 and reply.stats["finish_reason"] == "length"
                assert reply.stats["prompt_tokens"] > 0
            assert first.conversation.model_name == "demo"
            assert not any(n.severity == "error" for n in app._notifications)


async def test_an_unreachable_server_is_a_notification_and_the_app_stays_usable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    app = NvchatApp(app_settings(backend=url, model="demo"))
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        for attempt in range(2):
            await submit_now(pilot, pane, f"anyone there {attempt}")
            await wait_for(pilot, lambda: any("could not reach" in n.message for n in app._notifications),
                           what="the connection error")
            await idle(pilot, pane)
            app.clear_notifications()
        assert [m.role for m in pane.conversation.messages] == ["user", "user"]  # the words are kept
        await press_now(pilot, "ctrl+t")
        assert len(app.query(ChatPane)) == 2


async def test_a_one_request_server_is_named_by_its_model_says_tabs_queue_and_queues_them():
    server = OneSlotServer(owned_by="llamacpp")
    with serving(server.app) as url:
        app = NvchatApp(app_settings(backend=url, model=None))
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            assert app.sub_title == MODEL  # the server's model, not the URL's last part ("v1")
            assert any(n.message == ONE_AT_A_TIME_NOTE for n in app._notifications)
            first = app.active_pane
            await submit_now(pilot, first, "first")
            await wait_for(pilot, lambda: first.stream is not None and first.stream.text, what="the first reply")
            await press_now(pilot, "ctrl+t")
            second = app.active_pane
            await submit_now(pilot, second, "second")
            await wait_for(pilot, lambda: second.stream is not None, what="the second request")
            server.release()
            await idle(pilot, first)
            await idle(pilot, second)
            for pane in (first, second):
                reply = pane.conversation.messages[-1]
                assert (reply.content, reply.stats["finish_reason"]) == ("".join(REPLY), "stop")
                assert reply.stats["prompt_tokens"] is None
                assert pane.conversation.model_name == MODEL
            footer = second.query(ReplyView).last().query_one("#reply-footer")  # the tab on screen
            await wait_for(pilot, lambda: "prompt size unknown" in str(footer.render()), what="the footer")
            assert server.interrupted == 0 and server.most_at_once == 1
