"""Tools through MCP in the app, driven by real keystrokes: a real MCP server (tests/mcp_test_server.py,
a subprocess over stdio), the demo model's calls made by the engine itself (the conversation's
tool_choice names the function, so the engine's structured output holds the reply to one call of
it), the approval dialog answered with its keys, the result stored, shown folded and fed back, and
the reply going on."""
from contextlib import asynccontextmanager

import pytest
from textual.widgets import Collapsible, Label

from engine import EngineThread
from nvchat import conversation as conversation_module
from nvchat.app import NvchatApp
from nvchat.app.message_view import ReplyView
from nvchat.app.tool_approval_screen import ToolApprovalScreen
from nvchat.app.tool_views import ToolCallView
from nvchat.mcp_tools import DECLINED
from nvchat.remote_backend import RemoteBackend
from nvchat.server.app import ServerState, create_app
from tests.app.conftest import ENGINE_ARGS, app_settings
from tests.app.helpers import (
    burst,
    idle,
    press_now,
    reopen_the_only_past_conversation,
    send,
    started,
    stored_messages,
    wait_for,
)
from tests.conftest import MCP_TEST_SERVER, force_tool_calls
from tests.serving import serving

SIZE = (110, 36)


@pytest.fixture(scope="module")
def tool_engine(app_model_path):
    """The demo model with room for the tools' instructions (its tokenizer spells text byte by
    byte: the two tools' instructions take about 560 tokens) and several calls."""
    engine = EngineThread(str(app_model_path), **(ENGINE_ARGS | {"max_model_len": 4096})).start()
    yield engine
    engine.shutdown()


@pytest.fixture
def tool_chat(tool_engine, monkeypatch):
    """async with tool_chat(tool, rounds, servers, **settings) as (pilot, app, pane): the app started,
    with replies of 96 tokens, the MCP servers given running (or failed) and the first `rounds`
    replies of each turn calling `tool`. With settings' backend, the app's own remote backend
    talks to it instead of the test engine."""
    @asynccontextmanager
    async def run(tool: str, rounds: int = 1, servers: dict = MCP_TEST_SERVER, **changes):
        force_tool_calls(monkeypatch, tool, rounds)
        settings = app_settings(max_tokens=96, mcp_servers=servers, **changes)
        app = NvchatApp(settings, engine=None if settings.backend else tool_engine)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await tools_ready(pilot, app, *servers)
            yield pilot, app, app.active_pane
    return run


async def tools_ready(pilot, app, *servers: str) -> None:
    await wait_for(pilot, lambda: all(app.tool_rounds.tools.status.get(s) != "starting" for s in servers), 60,
                   "the MCP servers to start")


async def approval(pilot, app) -> ToolApprovalScreen:
    await wait_for(pilot, lambda: isinstance(app.screen, ToolApprovalScreen), 60, "the approval dialog")
    return app.screen


async def test_an_approved_call_runs_and_its_folded_result_is_fed_back_and_stored(tool_chat):
    async with tool_chat("weather") as (pilot, app, pane):
        await send(pilot, "what is the weather")
        dialog = await approval(pilot, app)
        shown = str(dialog.query_one("#approval-call").render())
        assert shown.startswith("weather(") and '"city": "' in shown
        assert "the tool weather of the MCP server test" in str(dialog.query_one(Label).render())
        assert pane.busy and pane.query_one(ToolCallView)
        await pilot.press("y")
        await idle(pilot, pane, 60)

        user, call, result, answer = stored_messages(pane.conversation.id)
        assert (user.role, call.role, result.role, answer.role) == ("user", "assistant", "tool", "assistant")
        city = call.tool_calls[0]["function"]["arguments"]
        assert result.content in (f"{c}: 21 degrees and sunny" for c in ("Paris", "Oslo")) and result.content[:4] in city
        assert result.tool_calls == call.tool_calls and answer.tool_calls is None and answer.content
        assert answer.stats["finish_reason"] == "length"  # the reply went on after the result
        # Fed back: the continuation's prompt holds the result, in the format the model reads.
        conversation = pane.conversation
        prompt = app.engine.detokenize(conversation._tokenize(conversation.messages[:3],
                                                              conversation._tools(conversation.messages[:3])))
        assert f"<tool_response>\n{result.content}\n</tool_response>" in prompt
        assert answer.stats["prompt_tokens"] > call.stats["prompt_tokens"] and answer.stats["cached_tokens"] > 0
        assert "calls tools" in str(pane.query(ReplyView).first().query_one("#reply-footer").render())
        view = pane.query_one(ToolCallView)
        folded = view.query_one(Collapsible)
        assert folded.collapsed and result.content in str(folded.query_one(".tool-result-text").render())
        # Unfolded from the keyboard: the title takes the focus (Tab reaches it) and Enter toggles it.
        folded.query_one("CollapsibleTitle").focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: not folded.collapsed, what="the result unfolded by Enter on its title")

        # Reopened, the chat shows the call and its result, and its next turn sends them again.
        await pilot.press("ctrl+w")
        await wait_for(pilot, lambda: app.active_pane is not None and app.active_pane is not pane,
                       what="the new chat that replaces the closed one")
        reopened = await reopen_the_only_past_conversation(pilot, app)
        await wait_for(pilot, lambda: reopened.query(ToolCallView), what="the reopened chat's tool call")
        assert reopened.query_one(ToolCallView).query_one(Collapsible).collapsed
        sent = reopened.conversation.engine_messages()
        assert [m["role"] for m in sent][-3:] == ["assistant", "tool", "assistant"]
        assert sent == conversation.engine_messages()


async def test_always_runs_the_tool_again_without_asking(tool_chat):
    async with tool_chat("weather", rounds=2) as (pilot, app, pane):
        await send(pilot, "twice")
        await approval(pilot, app)
        await pilot.press("a")
        await wait_for(pilot, lambda: not isinstance(app.screen, ToolApprovalScreen))
        asked_again = []
        await wait_for(pilot, lambda: asked_again.append(isinstance(app.screen, ToolApprovalScreen)) or not pane.busy,
                       60, "the turn to end")
        assert not any(asked_again)
        roles = [m.role for m in stored_messages(pane.conversation.id)]
        assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert len(pane.query(ToolCallView)) == 2


async def test_a_declined_call_does_not_run_and_the_model_is_told(tool_chat):
    async with tool_chat("weather") as (pilot, app, pane):
        await send(pilot, "no")
        await approval(pilot, app)
        await pilot.press("n")
        await idle(pilot, pane, 60)
        messages = stored_messages(pane.conversation.id)
        assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert messages[2].content == DECLINED.text and messages[2].stats == {"error": True}
        assert pane.query_one(ToolCallView).has_class("-error")


async def test_a_server_that_fails_and_a_tool_that_errors_are_notifications_and_the_chat_goes_on(tool_chat):
    async with tool_chat("broken", servers=MCP_TEST_SERVER | {"gone": {"command": "/nonexistent/mcp-server"}}) as (
            pilot, app, pane):
        await wait_for(pilot, lambda: any(n.title == "An MCP server could not start" and "gone" in n.message
                                          for n in app._notifications), what="the failed server's notification")
        assert [d["function"]["name"] for d in app.tool_rounds.tools.definitions] == ["weather", "broken"]
        await send(pilot, "break it")
        await approval(pilot, app)
        await pilot.press("y")
        await wait_for(pilot, lambda: any(n.title == "The tool failed" and n.message.startswith("broken:")
                                          for n in app._notifications), what="the failed call's notification")
        await idle(pilot, pane, 60)
        messages = stored_messages(pane.conversation.id)
        assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert messages[2].stats == {"error": True} and messages[3].content


async def test_calling_replies_in_a_row_are_bounded_and_the_last_reply_answers(tool_chat, monkeypatch):
    monkeypatch.setattr(conversation_module, "MAX_TOOL_ROUNDS", 2)  # the bound itself: fewer replies to wait for
    async with tool_chat("weather", rounds=100) as (pilot, app, pane):
        await send(pilot, "forever")
        await approval(pilot, app)
        await pilot.press("a")
        await idle(pilot, pane, 120)
        messages = stored_messages(pane.conversation.id)
        calling = [m for m in messages if m.role == "assistant" and m.tool_calls]
        assert len(calling) == 2
        assert messages[-1].role == "assistant" and messages[-1].tool_calls is None and messages[-1].content


async def test_with_a_remote_backend_the_tools_go_as_openai_tools(tool_engine, tool_chat):
    with serving(create_app(ServerState("demo", tool_engine))) as url:
        async with tool_chat("weather", backend=url) as (pilot, app, pane):
            assert isinstance(app.engine, RemoteBackend)
            await send(pilot, "remote weather")
            await approval(pilot, app)
            await pilot.press("y")
            await idle(pilot, pane, 60)
            roles = [m.role for m in stored_messages(pane.conversation.id)]
            assert roles == ["user", "assistant", "tool", "assistant"]


async def test_a_call_from_a_chat_in_a_hidden_tab_shows_that_chat_with_the_dialog(tool_chat, tmp_path):
    gate = tmp_path / "gate"  # the weather call runs until this file exists
    servers = {"test": MCP_TEST_SERVER["test"] | {"env": {"NVCHAT_TEST_GATE": str(gate)}}}
    # Two calls a turn. The first is approved in view; while it runs, a new tab hides its chat, so
    # the second is written, and asks for approval, in a hidden tab whatever the engine's pace.
    async with tool_chat("weather", rounds=2, servers=servers) as (pilot, app, calling):
        try:
            await send(pilot, "weather in the background")
            await approval(pilot, app)
            await pilot.press("y")
            status = calling.query_one("#chat-status")
            await wait_for(pilot, lambda: str(status.render()).startswith("running weather…"),
                           what="the first call running")
            await press_now(pilot, "ctrl+t")
            await wait_for(pilot, lambda: app.active_pane is not calling, what="the new tab")
        finally:
            gate.touch()
        await approval(pilot, app)
        assert app.active_pane is calling
        # The reply that ended hidden is drawn before its call.
        views = [v for v in calling.transcript.children if isinstance(v, (ReplyView, ToolCallView))]
        assert [type(v) for v in views] == [ReplyView, ToolCallView] * 2
        await pilot.press("y")
        await idle(pilot, calling, 60)
        views = [v for v in calling.transcript.children if isinstance(v, (ReplyView, ToolCallView))]
        assert [type(v) for v in views] == [ReplyView, ToolCallView] * 2 + [ReplyView]
        assert views[3].message is calling.conversation.messages[4]


async def test_the_status_line_says_which_tool_waits_or_runs_and_how_many_messages_are_queued(tool_chat, tmp_path):
    gate = tmp_path / "gate"  # the weather call runs until this file exists
    servers = {"test": MCP_TEST_SERVER["test"] | {"env": {"NVCHAT_TEST_GATE": str(gate)}}}
    async with tool_chat("weather", servers=servers) as (pilot, app, pane):
        def status() -> str:
            return str(pane.query_one("#chat-status").render())

        try:
            # Typed ahead in one read: the first is sent, the second waits for the turn to end.
            burst(app, "what is the weather")
            burst(app, "and tomorrow")
            await wait_for(pilot, lambda: len(pane.queued) == 1, what="the queued message")
            await approval(pilot, app)
            assert status() == "the model calls weather: approve or decline it · 1 queued to send next"
            await pilot.press("y")
            await wait_for(pilot, lambda: status().startswith("running weather…") and pane.prompt.has_focus,
                           what="the call running and the box focused again")
            burst(app, "and the day after")
            await wait_for(pilot, lambda: len(pane.queued) == 2, what="a second queued message")
            assert status() == ("running weather… · 2 queued to send next · Esc stops after it and puts them "
                                "back in the box")
            await press_now(pilot, "escape")
            assert status() == "running weather… stopping after it"
            assert pane.prompt.text == "and tomorrow\nand the day after" and not pane.queued
        finally:
            gate.touch()
        await idle(pilot, pane, 60)
        assert [m.role for m in stored_messages(pane.conversation.id)] == ["user", "assistant", "tool"]
        assert status() == ""
