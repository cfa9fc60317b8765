"""Pilot helpers for the app tests: each waits for a state the app reaches, never for a time."""
import asyncio
import time

from textual import events
from textual.command import CommandInput, CommandList, CommandPalette
from textual.keys import _character_to_key

from nvchat import paths
from nvchat.app import NvchatApp
from nvchat.app.chat_pane import ChatPane
from nvchat.conversation import Message
from nvchat.store import ChatStore

# How long a wait may take before it counts as a hang. Generous: a passing test never waits this
# long, and the app's replies slow many times over on a loaded 2-core box (30 s for a 400-token
# reply timed out with two test runs beside other work).
PATIENCE_S = 60.0


async def wait_for(pilot, condition, timeout: float = PATIENCE_S, what: str = "condition") -> None:
    """Lets the app run until condition() holds (bounded, so a hang fails instead of stalling CI)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.02)  # the poll's interval, not a wait for anything


async def handled(pilot, *widgets, timeout: float = PATIENCE_S) -> None:
    """Until each widget (the app by default) has handled every message queued on it so far: a
    callback queued behind them has run. Pilot.pause() does this for the whole screen and then also
    waits for the process to go idle, which it never does while the engine generates (so each
    pause costs its one-second cap)."""
    done = []
    for widget in widgets or (pilot.app,):
        event = asyncio.Event()
        if widget.call_later(event.set):  # False: the widget is gone, nothing is left to handle
            done.append(event.wait())
    try:
        await asyncio.wait_for(asyncio.gather(*done), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for the app to handle its messages") from None


async def started(pilot) -> NvchatApp:
    app = pilot.app
    await wait_for(pilot, lambda: app.ready, 2 * PATIENCE_S, "the engine and store to start")
    # Drained: what the first chat's start queued (its tab's activation, the footer's new keys) is
    # handled before a test's first key or snapshot.
    await pilot.pause()
    return app


async def idle(pilot, pane, timeout: float = 2 * PATIENCE_S) -> None:
    await wait_for(pilot, lambda: not pane.busy, timeout, "the reply to finish and be stored")


async def type_text(pilot, text: str) -> None:
    """Types text into the focused widget, key by key."""
    await pilot.press(*["space" if ch == " " else ch for ch in text])


async def send(pilot, text: str) -> None:
    """Types text into the active chat's prompt box and presses Enter."""
    await type_text(pilot, text)
    await pilot.press("enter")


async def press_now(pilot, key: str) -> None:
    """Presses a key while the engine is generating. Pilot.press waits after each key for the
    process to go idle, which it does not while the engine thread computes (so each key would
    cost Pilot's one-second cap); the key event itself takes the same path. Returns once the app
    has handled it: the app's keys are priority bindings, whose actions have then run (a key the
    app passes on reaches the focused widget after that: wait for its effect)."""
    pilot.app.simulate_key(key)
    await handled(pilot)


async def submit_now(pilot, pane, text: str) -> None:
    """Sends text from the chat's prompt box as press_now would press Enter; returns once the box has
    taken the key (the app passes Enter on to it)."""
    pane.prompt.text = text
    await press_now(pilot, "enter")
    await handled(pilot, pane.prompt)


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


async def run_from_palette(pilot, query: str, command: str) -> None:
    """Types query into the command palette that is open with nothing typed yet (Ctrl+P's, or the
    one a command opens), and presses Enter once the list's highlighted entry is `command`. The
    palette gathers its matches on a worker, a batch at a time: Enter before they are listed picks
    nothing, or another command."""
    app = pilot.app

    def fresh_palette() -> bool:
        return isinstance(app.screen, CommandPalette) and not app.screen.query_one(CommandInput).value

    def highlighted() -> str | None:
        if not isinstance(app.screen, CommandPalette):
            return None
        listed = app.screen.query_one(CommandList)
        return None if listed.highlighted is None else listed.get_option_at_index(listed.highlighted).hit.text

    await wait_for(pilot, fresh_palette, what="the command palette")
    await pilot.press(*["space" if ch == " " else ch for ch in query])
    await wait_for(pilot, lambda: highlighted() == command, what=f"{command!r} listed first for {query!r}")
    await pilot.press("enter")


async def reopen_the_only_past_conversation(pilot, app):
    """Ctrl+O, then Enter on the one stored conversation; returns the tab it opens in (beside the
    new chat the app starts with), once it is the one shown."""
    open_before = list(app.query(ChatPane))
    await pilot.press("ctrl+o")
    await wait_for(pilot, lambda: app.screen.query("#conversations-table")
                   and app.screen.query_one("#conversations-table").row_count == 1)
    await pilot.press("enter")
    # The new pane is in the DOM before its tab is made the active one.
    await wait_for(pilot, lambda: len(app.query(ChatPane)) == 2 and app.active_pane is not None
                   and app.active_pane not in open_before, what="the conversation's tab, shown")
    return app.active_pane


def stored_messages(conversation_id: int) -> list[Message]:
    """The conversation's messages as the store holds them, read through a connection of their own."""
    store = ChatStore(paths.database_file())
    try:
        return store.load_messages(conversation_id)
    finally:
        store.close()
