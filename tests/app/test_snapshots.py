"""SVG snapshots of screens that look the same every run (pytest --snapshot-update regenerates
them under __snapshots__/; review the SVGs before committing)."""
import pytest

from nvchat import paths
from nvchat.app import NvchatApp
from nvchat.app.kv_panel import BlockGrid, Counters, KVPanel, blocks_per_cell
from nvchat.app.message_view import ReplyView
from nvchat.app.open_tabs import OpenTabs, save_open_tabs, tabs_file
from nvchat.app.prompt_input import PromptInput
from nvchat.store import ChatStore
from tests.app.conftest import app_settings
from tests.app.helpers import started, wait_for

SIZE = (100, 32)


def settle(*keys: str):
    async def run_before(pilot) -> None:
        await started(pilot)
        pilot.app.query_one(PromptInput).cursor_blink = False  # a blinking cursor is a coin toss
        await pilot.press(*keys)
        panels = pilot.app.screen.query(KVPanel)  # none under a dialog
        await wait_for(pilot, lambda: all(not panel.display or panel_settled(panel) for panel in panels),
                       what="the KV panel's numbers and the legend of its grid")
    return run_before


def panel_settled(panel: KVPanel) -> bool:
    grid = panel.query_one(BlockGrid)
    if not panel.query_one(Counters).text or grid.data is None or not grid.size:
        return False
    per_cell = blocks_per_cell(grid.data.snapshot.num_blocks, grid.size.width * grid.size.height)
    legend = str(panel.query_one("#kv-legend").render())
    return legend.endswith(f"1 cell = {per_cell} blocks") if per_cell > 1 else "1 cell" not in legend


def test_empty_chat(snap_compare, idle_engine):
    assert snap_compare(NvchatApp(app_settings(), engine=idle_engine), terminal_size=SIZE, run_before=settle())


def test_help_screen(snap_compare, idle_engine):
    app = NvchatApp(app_settings(keys={"regenerate": "ctrl+g"}), engine=idle_engine)
    assert snap_compare(app, terminal_size=SIZE, run_before=settle("f1"))


def test_kv_panel_of_an_idle_engine(snap_compare, idle_engine):
    app = NvchatApp(app_settings(), engine=idle_engine)
    assert snap_compare(app, terminal_size=SIZE, run_before=settle("f5"))


def test_light_theme(snap_compare, idle_engine):
    app = NvchatApp(app_settings(theme="paper"), engine=idle_engine)
    assert snap_compare(app, terminal_size=SIZE, run_before=settle("f5"))


REPLY = """A **paged KV cache** keeps each sequence's keys and values in fixed-size blocks:

- blocks are allocated as the sequence grows, so no memory is reserved for tokens never generated;
- sequences that share a prefix share its blocks.

```python
blocks = [manager.allocate() for _ in range(tokens // block_size)]
```"""
TURNS = (("What is a paged KV cache?", REPLY, dict(tokens=61, tokens_per_s=41.3, ttft_s=0.094, prompt_tokens=38,
                                                    cached_tokens=32, finish_reason="stop")),
         ("thanks", "You're welcome.", dict(tokens=5, tokens_per_s=38.0, ttft_s=0.051, prompt_tokens=105,
                                            cached_tokens=96, finish_reason="stop")))


def stored_chat_open_at_start() -> None:
    """A two-turn chat in the store, reopened at start-up as the one open tab."""
    store = ChatStore(paths.database_file())
    conversation_id = store.create_conversation("Paged KV cache", "You are a helpful assistant.", "demo")
    for question, answer, stats in TURNS:
        store.add_message(conversation_id, "user", question)
        store.add_message(conversation_id, "assistant", answer, stats)
    store.close()
    save_open_tabs(tabs_file(paths.database_file()), OpenTabs([conversation_id], 0))


def settle_transcript(compact: bool):
    async def run_before(pilot) -> None:
        app = await started(pilot)
        app.query_one(PromptInput).cursor_blink = False
        if compact:
            await pilot.press("f12")
        await wait_for(pilot, lambda: app.active_pane.prompt.border_subtitle, what="the context figure")
        transcript = app.active_pane.transcript

        def drawn() -> bool:
            replies = transcript.query(ReplyView)
            return (len(replies) == len(TURNS) and not any(reply.behind for reply in replies)
                    and (transcript.max_scroll_y == 0 or transcript.is_vertical_scroll_end))
        await wait_for(pilot, drawn, what="the replies drawn and a long transcript at its end")
        await pilot.pause()  # and every message queued meanwhile handled: a loaded CPU falls behind
    return run_before


@pytest.mark.parametrize("size", [(160, 48), (80, 24)], ids=["160x48", "80x24"])
@pytest.mark.parametrize("theme", ["nvchat-dark", "nvchat-light"])
@pytest.mark.parametrize("compact", [False, True], ids=["default", "compact"])
def test_transcript(snap_compare, idle_engine, compact, theme, size):
    stored_chat_open_at_start()
    app = NvchatApp(app_settings(theme=theme), engine=idle_engine)
    assert snap_compare(app, terminal_size=size, run_before=settle_transcript(compact))
