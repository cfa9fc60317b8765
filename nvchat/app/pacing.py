"""What the UI thread spends while chats stream: how often the visible reply is drawn, and when
the garbage collector may walk everything. The engine thread waits for the GIL while the UI
thread runs, so both are the engine's time too."""
from __future__ import annotations

import gc
import time


class DrawPacer:
    """Every draw costs the UI thread a Markdown parse of the reply's last block, a repaint and
    now and then a layout. The cost of a draw grows with the reply (its last paragraph is parsed
    and wrapped again), so a fixed rate is either too slow for a short reply or too costly for a
    long one. The pacer spaces draws so that the UI thread's CPU time, measured between draws
    (everything the thread did: drawing, layout, the KV panel, garbage collection), stays within
    a share of one core: the full rate while that is cheap, fewer draws a second once it is not,
    never fewer than min_hz. While several chats stream the share is smaller: the engine is then
    the busiest, and the user sees only one of them."""

    def __init__(self, max_hz: float, min_hz: float, budget_one: float, budget_many: float,
                 cpu_clock=time.thread_time) -> None:
        self.min_interval, self.max_interval = 1 / max_hz, 1 / min_hz
        self.budget_one, self.budget_many = budget_one, budget_many
        self._cpu_clock = cpu_clock
        self.interval = self.min_interval
        self._last_at: float | None = None
        self._last_cpu = 0.0

    def due(self, now: float) -> bool:
        return self._last_at is None or now - self._last_at >= self.interval - 0.25 * self.min_interval

    def drew(self, now: float, streams: int) -> None:
        """A draw just ended; streams: how many chats are streaming."""
        cpu = self._cpu_clock()
        if self._last_at is not None and now - self._last_at <= 2 * self.max_interval:
            spent = cpu - self._last_cpu
            budget = self.budget_one if streams <= 1 else self.budget_many
            # Half the old interval and half the new estimate: one slow frame (a layout, a
            # garbage collection) stretches the next gap without swinging the rate.
            wanted = 0.5 * self.interval + 0.5 * spent / budget
            self.interval = min(self.max_interval, max(self.min_interval, wanted))
        self._last_at, self._last_cpu = now, cpu

    def reset(self) -> None:
        """Streaming stopped: the next draw is due at once and measures afresh."""
        self.interval = self.min_interval
        self._last_at = None


class FullCollectionDeferral:
    """Keeps the garbage collector's full collections out of the time chats stream.

    The engine froze what existed when it started (engine/llm.py); everything the app built since
    (tabs, replies, Textual's caches) is walked by each full collection, which runs on whichever
    thread allocates when it falls due, most often the UI thread, holding the GIL throughout:
    160-230 ms at a time on the CPU box, every few seconds of 8 streams, each a stall of every
    stream. While chats stream, the oldest generation's threshold is raised so that none falls
    due; young collections still run and free most garbage. When streaming stops the threshold is
    restored and Python runs the deferred collection when it next would. A stream that never
    stops gets one full collection in every max_s seconds, so what waits for it stays bounded.
    """

    def __init__(self, max_s: float = 30.0, clock=time.monotonic) -> None:
        self.max_s = max_s
        self._clock = clock
        self._saved: tuple[int, int, int] | None = None
        self._since = 0.0

    @property
    def deferring(self) -> bool:
        return self._saved is not None

    def start(self) -> None:
        if self._saved is None:
            self._saved = gc.get_threshold()
            self._full_collections = gc.get_stats()[2]["collections"]
            self._since = self._clock()
            gc.set_threshold(self._saved[0], self._saved[1], 1 << 30)

    def tick(self) -> None:
        """Called while streaming: after max_s, lets one full collection through."""
        if self._saved is None:
            return
        if gc.get_threshold()[2] != 1 << 30:  # letting one through: has it run?
            if gc.get_stats()[2]["collections"] != self._full_collections:
                self._full_collections = gc.get_stats()[2]["collections"]
                self._since = self._clock()
                gc.set_threshold(self._saved[0], self._saved[1], 1 << 30)
        elif self._clock() - self._since >= self.max_s:
            gc.set_threshold(*self._saved)

    def stop(self) -> None:
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None
