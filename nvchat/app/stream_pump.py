"""The stream pump: how streamed tokens reach the screen.

One app-level timer (NvchatApp.PUMP_HZ) drains every active stream with RequestStream.drain(),
which hands over everything since the last draw as one delta. The visible chat appends it to its
reply's MarkdownStream, so it gets at most PUMP_HZ updates a second however fast tokens arrive,
and fewer while drawing is costly (DrawPacer); a chat in a hidden tab only accumulates it, and
draws it when its tab is shown. The engine never posts per-token messages. The UI thread's time
is the engine's too: the engine thread needs the GIL between its GPU waits, so whatever the UI
draws that nobody sees slows generation. Hence also the full garbage collections held back while
chats stream (FullCollectionDeferral), and ChatScreen, whose compositor renders only what an
update shows.
"""
from __future__ import annotations

import time

from textual.app import App

from nvchat.app.chat_pane import ChatPane
from nvchat.app.chat_tabs import ChatTabs
from nvchat.app.frame_stats import FrameStats
from nvchat.app.pacing import DrawPacer, FullCollectionDeferral


class StreamPump:
    def __init__(self, app: App, chats: ChatTabs, hz: float, min_draw_hz: float, ui_cpu_budget_one: float,
                 ui_cpu_budget_many: float) -> None:
        """The pump's timer runs on the app, only while a chat streams. The budgets: the share of a
        core the UI thread aims to stay within while one chat streams, and while several do."""
        self.chats = chats
        self.frame_stats = FrameStats()
        self.draw_pacer = DrawPacer(hz, min_draw_hz, ui_cpu_budget_one, ui_cpu_budget_many)
        self.gc_deferral = FullCollectionDeferral()
        self.streaming: dict[ChatPane, None] = {}  # the panes it drains, in start order
        self._log = app.log
        self.timer = app.set_interval(1 / hz, self.tick, pause=True)

    def start(self, pane: ChatPane) -> None:
        """The pane's reply started streaming: drained from the next tick on."""
        if pane.stream is None:  # stopped and stored already
            return
        self.streaming[pane] = None
        self.timer.resume()

    def forget(self, pane: ChatPane) -> None:
        """The pane's tab closed."""
        self.streaming.pop(pane, None)
        self.defer_full_collections()

    async def tick(self) -> None:
        started = time.perf_counter()
        shown = self.chats.active_chat
        draw = self.draw_pacer.due(started)
        drawing, streams = draw and shown in self.streaming, len(self.streaming)
        if not draw and shown in self.streaming:
            # Hidden chats only accumulate: draining them can wait for the visible one's next draw.
            self.frame_stats.record(started, time.perf_counter())
            return
        for pane in list(self.streaming):
            try:
                ended = await pane.pump(pane is shown, draw)
            except Exception as e:  # one broken pane must not stall the others
                self._log.error(f"pump failed for {pane}: {e!r}")
                ended = True
            if ended:
                self.streaming.pop(pane, None)
        now = time.perf_counter()
        self.frame_stats.record(started, now, drew=drawing)
        if drawing:
            self.draw_pacer.drew(now, streams)
        if self.streaming:
            self.gc_deferral.tick()
        else:
            self.timer.pause()
            self.frame_stats.pause()
            self.draw_pacer.reset()
            self.defer_full_collections()

    def defer_full_collections(self) -> None:
        """From the start of a turn, not of its stream: starting a turn builds the most (its views,
        and in the benchmark 8 tabs' at once), which is when a full collection fell due, a stall
        of 0.2 s before the first token."""
        if self.streaming or any(pane.busy for pane in self.chats.panes):
            self.gc_deferral.start()
        else:
            self.gc_deferral.stop()

    def stop(self) -> None:
        """The app is exiting: full collections are let through again."""
        self.gc_deferral.stop()
