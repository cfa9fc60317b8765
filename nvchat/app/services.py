"""What the chats run on, and its start-up and shutdown: the backend (the in-process engine or a
remote server), the conversation store, and the conversation thread.

- A start-up thread builds whatever the app was not handed, reporting each stage to the UI thread
  (the loading screen), which learns the result when it is ready.
- One conversation thread runs everything that tokenizes or touches SQLite, in order.
- At exit, replies still running are stopped and stored as far as they got, what each chat had
  typed is stored, queued writes finish, and then what the app started is shut down, all off the
  UI thread. SIGTERM and SIGHUP quit as Ctrl+Q does, so they get the same.
"""
from __future__ import annotations

import asyncio
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

from engine import RequestStream
from engine.backend import Backend
from nvchat import startup_trace
from nvchat.backend import open_backend
from nvchat.conversation import Conversation
from nvchat.settings import Settings
from nvchat.store import ChatStore

# Asked to end (a shutdown, a closed terminal): quit as Ctrl+Q does, so replies in flight are
# stored as far as they got, rather than die with only their last periodic save.
QUIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP) if hasattr(signal, "SIGHUP") else (signal.SIGTERM,)


def quit_on_signals(quit: Callable[[], object]) -> Callable[[], None]:
    """Has the running loop call quit on QUIT_SIGNALS; returns what undoes that."""
    loop = asyncio.get_running_loop()
    handled = []
    for number in QUIT_SIGNALS:
        try:
            loop.add_signal_handler(number, quit)
        except (NotImplementedError, RuntimeError, ValueError):  # no such handlers here (Windows, a thread)
            continue
        handled.append(number)

    def undo() -> None:
        for number in handled:
            loop.remove_signal_handler(number)

    return undo


def store_partial_reply(conversation: Conversation, stream: RequestStream, show: bool = True) -> None:
    """A reply cut short (its tab closed, the app quit), stored as far as it got once its stream ends."""
    stream.wait(5)
    conversation.finish_reply(stream, show)


class ChatServices:
    def __init__(self, settings: Settings, engine: Backend | None = None, store: ChatStore | None = None):
        """engine / store: already running ones to use (and leave running), e.g. shared by tests;
        by default they are built from settings at start-up and shut down at exit."""
        self.settings = settings
        self.engine = engine  # None until start-up has built it
        self.store = store
        self._owns_engine = engine is None
        self._owns_store = store is None
        self.closing = False  # the app is exiting: start-up reports nothing more to it
        self._conversation_thread = ThreadPoolExecutor(1, thread_name_prefix="nvchat-conversations")
        self._call_from_thread: Callable | None = None

    def in_background(self, fn, *args) -> asyncio.Future:
        """Runs fn on the conversation thread. Shielded: a caller that goes away (a closed tab, app
        exit) does not cancel a write that was already queued."""
        return asyncio.shield(asyncio.wrap_future(self._conversation_thread.submit(fn, *args)))

    # --- start-up ------------------------------------------------------------------------------------

    def start(self, call_from_thread: Callable, *, progress: Callable[[str], None],
              ready: Callable[[], Awaitable[None]], failed: Callable[[str], None]) -> None:
        """Builds what was not handed in, off the UI thread. progress(stage), ready() (engine and store
        are set) and failed(reason) run on the UI thread, through call_from_thread."""
        self._call_from_thread = call_from_thread
        # A daemon thread, not a Textual thread worker: quitting during a long model load must not
        # wait for the load (Textual joins its workers' executor on exit).
        threading.Thread(target=self._build, args=(progress, ready, failed), name="nvchat-start", daemon=True).start()

    def _to_ui(self, callback, *args) -> None:
        """call_from_thread, skipped once the app is closing (its loop may never run the call)."""
        if self.closing:
            return
        try:
            self._call_from_thread(callback, *args)
        except RuntimeError:
            pass

    def _build(self, progress, ready, failed) -> None:
        def report(stage: str) -> None:
            self._to_ui(progress, stage)

        def begin(stage: str) -> None:  # a stage of its own; open_backend marks the engine's
            startup_trace.mark(stage)
            report(stage)

        engine, store = self.engine, self.store
        try:
            if engine is None:
                if self.settings.uses_demo_model:
                    begin("preparing the demo model")
                engine = open_backend(self.settings, report)
                begin("connecting to the server" if self.settings.backend else "starting the engine thread")
                engine.start()
            if store is None:
                begin("opening the conversation store")
                store = ChatStore()
        except Exception as e:  # shown on the loading screen rather than as a traceback
            detail = str(e) if isinstance(e, (ValueError, OSError, RuntimeError)) else f"{type(e).__name__}: {e}"
            if engine is not None and self._owns_engine:
                engine.shutdown()
            self._to_ui(failed, detail or type(e).__name__)
            return
        if self.closing:
            self._close(engine, store, [])
            return
        self._to_ui(self._started, engine, store, ready)

    async def _started(self, engine: Backend, store: ChatStore, ready) -> None:
        # Set on the UI thread: an exit before this point closes what the start-up thread built there.
        self.engine, self.store = engine, store
        await ready()

    # --- shutdown ------------------------------------------------------------------------------------

    async def close(self, live: list[tuple[Conversation, list[RequestStream]]],
                    drafts: list[tuple[Conversation, str]], then: Callable[[], None] | None = None) -> None:
        """The app is exiting: stops the replies still running (keeping their text), stores what each
        chat had typed and not sent, runs then (on the conversation thread, after those writes), lets
        queued writes finish and the conversations go (another process may write them now), then
        shuts down what the app started, off the UI thread. A start-up still under way closes what it
        builds itself."""
        self.closing = True
        await asyncio.to_thread(self._close, self.engine, self.store, live, drafts, then)

    def _close(self, engine: Backend | None, store: ChatStore | None,
               live: list[tuple[Conversation, list[RequestStream]]], drafts: list[tuple[Conversation, str]] = (),
               then: Callable[[], None] | None = None) -> None:
        for _, streams in live:
            for stream in streams:
                stream.abort()
        for conversation, streams in live:
            for i, stream in enumerate(streams):
                self._conversation_thread.submit(store_partial_reply, conversation, stream, i == 0)
        for conversation, text in drafts:
            self._conversation_thread.submit(conversation.save_draft, text)
            self._conversation_thread.submit(conversation.release)
        if then is not None:
            self._conversation_thread.submit(then)
        self._conversation_thread.shutdown(wait=True)
        if engine is not None and self._owns_engine:
            engine.shutdown()
        if store is not None and self._owns_store:
            store.close()
