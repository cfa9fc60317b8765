"""The past-conversations screen finds conversations by words in their titles and messages."""
from textual.widgets import DataTable

from nvchat import paths
from nvchat.app.conversations_screen import _when
from nvchat.store import ChatStore
from tests.app.helpers import started, wait_for

SIZE = (110, 36)


def stored_conversations() -> dict[str, int]:
    store = ChatStore(paths.database_file())
    ids = {}
    for title, question, answer in (("Llamas", "what do llamas eat?", "grass, mostly"),
                                    ("Kernels", "why is my Triton kernel slow?", "uncoalesced loads"),
                                    ("Soup", "a recipe please", "simmer onions with thyme")):
        ids[title] = store.create_conversation(title, "", "demo")
        store.add_message(ids[title], "user", question)
        store.add_message(ids[title], "assistant", answer)
    store.close()
    return ids


async def test_typing_filters_past_conversations_and_enter_reopens_the_match(make_app):
    ids = stored_conversations()
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: app.screen.query(DataTable) and app.screen.query_one(DataTable).row_count == 3)
        table = app.screen.query_one(DataTable)

        def shown():
            return sorted(int(key.value) for key in table.rows)

        await pilot.press(*"onion")  # in a reply only
        await wait_for(pilot, lambda: shown() == [ids["Soup"]], what="the search by message text")
        for _ in range(5):
            await pilot.press("backspace")
        await pilot.press(*"kern")  # a title prefix
        await wait_for(pilot, lambda: shown() == [ids["Kernels"]], what="the search by title")
        await pilot.press(*"el slow")  # every word must match
        await wait_for(pilot, lambda: shown() == [ids["Kernels"]], what="two words")
        await pilot.press(*" zebra")
        await wait_for(pilot, lambda: shown() == [], what="no match")
        assert "zebra" in str(app.screen.query_one("#conversations-empty").render())
        for _ in range(6):
            await pilot.press("backspace")
        await wait_for(pilot, lambda: shown() == [ids["Kernels"]], what="the match again")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.active_pane.conversation.id == ids["Kernels"], what="the reopened match")
        assert [m.content for m in app.active_pane.conversation.messages] == ["why is my Triton kernel slow?",
                                                                              "uncoalesced loads"]


def screen_text(app) -> str:
    return "\n".join("".join(segment.text for segment in strip) for strip in app.screen._compositor.render_strips())


async def test_a_long_title_and_model_path_leave_the_date_in_view(make_app):
    store = ChatStore(paths.database_file())
    model = "/home/someone/models/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf"
    store.create_conversation("Write a long story about a dragon and a…", "", model)
    [row] = store.list_conversations()
    store.close()
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: app.screen.query(DataTable) and app.screen.query_one(DataTable).row_count == 1)
        await wait_for(pilot, lambda: "Write a long" in screen_text(app), what="the row drawn")
        shown = screen_text(app)
        assert _when(row.updated_at) in shown
        assert "/home/someone" not in shown  # a model file is named without its directories


async def test_a_long_title_is_cut_so_that_the_model_column_fits_at_160_columns(make_app):
    store = ChatStore(paths.database_file())
    model = "/home/someone/models/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf"
    title = "A question about paged attention, prefix caching and CUDA graphs, renamed to something long " * 2
    conversation_id = store.create_conversation(title, "", model)
    store.set_draft(conversation_id, "unsent")
    [row] = store.list_conversations()
    store.close()
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await started(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: app.screen.query(DataTable) and app.screen.query_one(DataTable).row_count == 1)
        await pilot.pause()
        shown = screen_text(app)
        assert "qwen2.5-0.5b-instruct-q4_k_m.gguf" in shown and _when(row.updated_at) in shown
        assert "A question about paged attention" in shown and "…  ✎ draft" in shown
