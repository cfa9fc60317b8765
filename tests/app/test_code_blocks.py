"""Code blocks in replies are copied with a key on the focused block, or from the palette."""
from nvchat import paths
from nvchat.app.code_block import CopyableFence
from nvchat.store import ChatStore
from tests.app.helpers import run_from_palette, started, wait_for

SIZE = (110, 40)
REPLY = ("Two ways:\n\n```python\nprint('first')\nprint('again')\n```\n\nor in the shell:\n\n"
         "```sh\necho second\n```\n\nDone.")


def a_stored_conversation_with_code() -> None:
    store = ChatStore(paths.database_file())
    cid = store.create_conversation("Code please", "", "demo")
    store.add_message(cid, "user", "show me code")
    store.add_message(cid, "assistant", REPLY, {"tokens": 20, "finish_reason": "stop"})
    store.close()


async def open_the_stored_conversation(pilot, app):
    await pilot.press("ctrl+o")
    await wait_for(pilot, lambda: app.screen.query("#conversations-table")
                   and app.screen.query_one("#conversations-table").row_count == 1)
    await pilot.press("enter")
    await wait_for(pilot, lambda: len(app.active_pane.query(CopyableFence)) == 2, what="the code blocks")


async def test_c_on_a_focused_code_block_copies_it(make_app):
    a_stored_conversation_with_code()
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await open_the_stored_conversation(pilot, app)
        await pilot.press("shift+tab")  # from the prompt box back to the latest code block
        assert isinstance(app.focused, CopyableFence) and app.focused.code == "echo second"
        await pilot.press("shift+tab")
        assert app.focused.code == "print('first')\nprint('again')"
        await pilot.press("c")
        assert app.clipboard == "print('first')\nprint('again')"
        assert any(n.title == "Code copied to the clipboard" and "2 lines of python" in n.message
                   for n in app._notifications)
        await pilot.press("o", "k")  # other keys are typing: they go to the prompt box
        assert app.focused is app.active_pane.prompt and app.active_pane.prompt.text == "ok"


async def test_the_palette_copies_the_latest_code_block(make_app):
    a_stored_conversation_with_code()
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await open_the_stored_conversation(pilot, app)
        await pilot.press("ctrl+p")
        await run_from_palette(pilot, "copy code", "Copy code block")
        await wait_for(pilot, lambda: app.clipboard == "echo second", what="the copy")
