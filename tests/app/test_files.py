"""Files in the prompt: /file PATH and the file picker add a text file's contents to the message
being written, named and fenced, with its token count; a missing, binary or too-long file is a
notification that says so, and nothing typed is lost."""
from textual.widgets import DirectoryTree

from nvchat.app.file_picker_screen import FilePickerScreen
from tests.app.helpers import idle, started, type_text, wait_for

SIZE = (110, 36)


def notices(app, title: str) -> list[str]:
    return [n.message for n in app._notifications if n.title == title]


async def test_slash_file_adds_the_file_named_and_fenced_and_it_is_sent_with_the_message(make_app, xdg_dirs):
    (xdg_dirs / "notes.py").write_text("def add(a, b):\n    return a + b\n")
    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await type_text(pilot, "/file notes.py")
        await pilot.press("enter")
        block = "notes.py:\n```py\ndef add(a, b):\n    return a + b\n```\n"
        await wait_for(pilot, lambda: pane.prompt.text == block, what="the file in the box")
        [added] = notices(app, "File added to the message")
        tokens = int(added.removeprefix("notes.py (").removesuffix(" tokens)"))
        assert 10 < tokens < 200  # the demo model's tokenizer: a few characters a token
        await type_text(pilot, "what does it do?")
        await pilot.press("enter")
        await idle(pilot, pane)
        assert pane.conversation.messages[0].content == block + "what does it do?"


async def test_a_file_named_by_its_absolute_path_is_sent_as_a_message_not_read_as_a_command(make_app, xdg_dirs):
    path = xdg_dirs / "notes.txt"
    path.write_text("hello\n")
    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await type_text(pilot, f"/file {path}")
        await pilot.press("enter")
        await wait_for(pilot, lambda: "hello" in pane.prompt.text, what="the file in the box")
        assert pane.prompt.text == f"/{path}:\n```txt\nhello\n```\n", "escaped as a leading / is (//)"
        await pilot.press("enter")
        await idle(pilot, pane)
        assert pane.conversation.messages[0].content == f"{path}:\n```txt\nhello\n```"


async def test_a_missing_a_binary_and_a_too_long_file_are_refused_with_the_reason(make_app, xdg_dirs):
    (xdg_dirs / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (xdg_dirs / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (xdg_dirs / "book.txt").write_text("many words " * 2000)  # far past the 512-token context
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        for name, reason in (("nowhere.txt", "no such file"), ("image.png", "is a binary file"),
                             ("latin1.txt", "is not UTF-8 text"), ("book.txt", "can't fit the model's 512-token")):
            await type_text(pilot, f"/file {name}")
            await pilot.press("enter")
            await wait_for(pilot, lambda: any(name in m for m in notices(app, "File not added")), what=name)
            assert reason in next(m for m in notices(app, "File not added") if name in m)
            await wait_for(pilot, lambda: pane.prompt.text == f"/file {name}", what="the command back in the box")
            pane.prompt.clear()
        assert not pane.conversation.messages


async def test_the_file_picker_adds_the_chosen_file_at_the_cursor(make_app, xdg_dirs):
    (xdg_dirs / "picked.md").write_text("# Title\n")
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = app.active_pane
        await type_text(pilot, "see this")
        await pilot.press(*["left"] * 5)
        app.action_pick_file()  # as the palette's "Add a file" does
        await wait_for(pilot, lambda: isinstance(app.screen, FilePickerScreen) and app.screen.query(DirectoryTree),
                       what="the picker")
        tree = app.screen.query_one(DirectoryTree)
        await wait_for(pilot, lambda: any(str(n.data.path).endswith("picked.md") for n in tree.root.children),
                       what="the directory listed")
        node = next(n for n in tree.root.children if str(n.data.path).endswith("picked.md"))
        tree.move_cursor(node)
        await pilot.press("enter")
        await wait_for(pilot, lambda: "# Title" in pane.prompt.text, what="the file in the box")
        assert pane.prompt.text == "see\npicked.md:\n```md\n# Title\n```\n this"
