"""SVG snapshots of screens that look the same every run (pytest --snapshot-update regenerates
them under __snapshots__/; review the SVGs before committing)."""
from nvchat.app import NvchatApp
from nvchat.app.kv_panel import Counters, KVPanel
from nvchat.app.prompt_input import PromptInput
from tests.app.conftest import app_settings
from tests.app.helpers import started, wait_for

SIZE = (100, 32)


def settle(*keys: str):
    async def run_before(pilot) -> None:
        await started(pilot)
        pilot.app.query_one(PromptInput).cursor_blink = False  # a blinking cursor is a coin toss
        await pilot.press(*keys)
        panels = pilot.app.screen.query(KVPanel)  # none under a dialog
        await wait_for(pilot, lambda: all(not panel.display or panel.query_one(Counters).text for panel in panels),
                       what="the KV panel's numbers")
    return run_before


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
