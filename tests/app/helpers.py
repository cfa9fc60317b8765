"""Pilot helpers for the app tests."""
import time

from textual import events
from textual.keys import _character_to_key

from nvchat.app import NvchatApp
from nvchat.app.chat_pane import ChatPane


async def wait_for(pilot, condition, timeout: float = 20.0, what: str = "condition") -> None:
    """Lets the app run until condition() holds (bounded, so a hang fails instead of stalling CI)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.02)


async def started(pilot) -> NvchatApp:
    app = pilot.app
    await wait_for(pilot, lambda: app.ready, 60, "the engine and store to start")
    await pilot.pause()
    return app


async def idle(pilot, pane, timeout: float = 30.0) -> None:
    await wait_for(pilot, lambda: not pane.busy, timeout, "the reply to finish and be stored")


async def send(pilot, text: str) -> None:
    """Types text into the active chat's prompt box and presses Enter."""
    await pilot.press(*["space" if ch == " " else ch for ch in text])
    await pilot.press("enter")


async def press_now(pilot, *keys: str) -> None:
    """Presses keys while the engine is generating. Pilot.press waits after each key for the
    process to go idle, which it does not while the engine thread computes (so each key would
    cost Pilot's one-second cap); the key events themselves take the same path."""
    for key in keys:
        pilot.app.simulate_key(key)
        await pilot.pause(0.05)


async def submit_now(pilot, pane, text: str) -> None:
    pane.prompt.text = text
    await press_now(pilot, "enter")


def burst(app, text: str = "", *, paste: str | None = None, enter: bool = True) -> None:
    """Delivers a paste and keys as the terminal driver does for one read: every event is queued
    on the app before it handles the first (Pilot.press instead lets the app go idle between keys,
    which hides races between the app's queue and the focused widget's)."""
    if paste is not None:
        app.post_message(events.Paste(paste))
    for ch in text:
        app.post_message(events.Key(_character_to_key(ch), ch))
    if enter:
        app.post_message(events.Key("enter", "\r"))


async def reopen_the_only_past_conversation(pilot, app):
    """Ctrl+O, then Enter on the one stored conversation; returns the tab it opens in (beside the
    new chat the app starts with)."""
    await pilot.press("ctrl+o")
    await wait_for(pilot, lambda: app.screen.query("#conversations-table")
                   and app.screen.query_one("#conversations-table").row_count == 1)
    await pilot.press("enter")
    await wait_for(pilot, lambda: len(app.query(ChatPane)) == 2, what="the conversation's tab")
    return app.active_pane
