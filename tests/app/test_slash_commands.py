"""Slash commands typed in the app's prompt box, driven by real keystrokes against the demo model."""
from textual.widgets import DataTable

from nvchat.app.bindings import SLASH_ACTIONS
from nvchat.app.chat_pane import ChatPane
from nvchat.app.help_screen import HelpScreen
from nvchat.app.system_prompt_screen import SystemPromptScreen
from nvchat.slash_table import APP, commands_for
from tests.app.helpers import idle, send, started, submit_now, wait_for

SIZE = (110, 36)


def notices(app) -> list[str]:
    return [n.message for n in app._notifications]


def test_every_app_command_has_a_handler():
    # /stats and /pick N have no key of their own (Alt+1 to Alt+4 pick): run_slash_command runs them.
    assert set(SLASH_ACTIONS) | {"stats", "pick"} == {c.name for c in commands_for(APP)}


async def test_new_opens_a_tab_and_help_lists_the_commands(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        first = app.active_pane
        await send(pilot, "/new")
        await wait_for(pilot, lambda: len(app.query(ChatPane)) == 2, what="a second tab")
        assert app.active_pane is not first and app.focused is app.active_pane.prompt
        assert first.prompt.text == "" and not first.conversation.messages, "/new is not sent"

        await send(pilot, "/help")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), what="the help screen")
        table = app.screen.query_one(DataTable)
        commands = {table.get_row_at(i)[2] for i in range(table.row_count)}
        assert {"/new", "/system", "/rename", "/save", "/regenerate", "/quit"} <= commands
        assert "/stats" in str(app.screen.query_one("#help-footer").render())
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, HelpScreen), what="help to close")
        assert app.active_pane.prompt.text == ""


async def test_system_sets_the_prompt_and_without_text_opens_the_editor(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "/system Answer in French.")
        await wait_for(pilot, lambda: pane.conversation.system_prompt == "Answer in French.", what="the system prompt")
        assert "Answer in French." in str(pane.query_one("#system-banner").render())
        assert pane.prompt.text == "" and not pane.conversation.messages

        await send(pilot, "/system")
        await wait_for(pilot, lambda: isinstance(app.screen, SystemPromptScreen), what="the system prompt editor")
        await pilot.press("escape")
        await send(pilot, "/rename Slash test")
        await wait_for(pilot, lambda: pane.conversation.title == "Slash test", what="the new title")


async def test_unknown_command_is_not_sent_and_stays_in_the_box(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "/frobnicate now")
        await wait_for(pilot, lambda: any("/frobnicate" in m for m in notices(app)), what="the notice")
        notice = next(m for m in notices(app) if "/frobnicate" in m)
        assert "/help" in notice and "//" in notice
        assert pane.prompt.text == "/frobnicate now" and not pane.busy and not pane.conversation.messages


async def test_double_slash_sends_a_leading_slash_and_save_stats_edit(make_app, xdg_dirs):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await send(pilot, "//x")
        await wait_for(pilot, lambda: pane.conversation.messages, what="the message")
        assert pane.conversation.messages[0].content == "/x"
        await idle(pilot, pane)

        await send(pilot, "/stats")
        await wait_for(pilot, lambda: pane.query(".stats-note"), what="the stats")
        stats = str(pane.query_one(".stats-note").render())
        assert "prefix cache:" in stats and not any("prefix cache:" in m for m in notices(app))
        assert pane.transcript.children[-1] is pane.query_one(".stats-note")
        last = pane.conversation.messages[-1]
        assert f"last reply: {pane.last_stream.num_completion_tokens} tokens" in stats and last.role == "assistant"

        await send(pilot, "/save chat.md")
        await wait_for(pilot, lambda: (xdg_dirs / "chat.md").exists(), what="the export")
        assert "/x" in (xdg_dirs / "chat.md").read_text()

        await send(pilot, "/edit")
        await wait_for(pilot, lambda: pane.editing, what="edit mode")
        assert pane.prompt.text == "//x", "the message comes back escaped, so Enter resends it as it was"
        await pilot.press("end", "y", "enter")
        await wait_for(pilot, lambda: pane.conversation.messages and pane.conversation.messages[0].content == "/xy",
                       what="the edited message")
        await idle(pilot, pane)
        assert len(pane.conversation.messages) == 2


async def test_stop_runs_while_a_reply_streams_and_regenerate_replaces_it(make_app):
    app = make_app(max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await submit_now(pilot, pane, "tell")
        await wait_for(pilot, lambda: pane.stream is not None and pane.stream.num_completion_tokens > 3)
        await submit_now(pilot, pane, "/stop")
        await idle(pilot, pane)
        stopped = pane.conversation.messages[-1]
        assert stopped.stats["finish_reason"] == "abort" and stopped.stats["tokens"] < 400
        assert pane.prompt.text == "" and len(pane.conversation.messages) == 2

        await send(pilot, "/stop")
        await wait_for(pilot, lambda: any("Nothing to stop" in m for m in notices(app)), what="the notice")
        await submit_now(pilot, pane, "/regenerate")
        await wait_for(pilot, lambda: pane.busy, what="the new reply")
        await submit_now(pilot, pane, "/stop")
        await idle(pilot, pane)
        assert len(pane.conversation.messages) == 2 and pane.conversation.messages[-1] is not stopped


async def test_command_names_complete_with_tab(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        prompt = app.active_pane.prompt
        await pilot.press("/", "r", "e", "g")
        assert prompt.suggestion == "enerate"
        await pilot.press("tab")
        assert prompt.text == "/regenerate" and app.focused is prompt
        await pilot.press("left")
        assert prompt.suggestion == ""


async def test_quit_quits(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await send(pilot, "/quit")
        await wait_for(pilot, lambda: not app.is_running, what="the app to exit")
    assert app.return_code == 0
