"""How often the visible reply is drawn while chats stream.

Every draw costs the UI thread a Markdown parse of the reply's last block, a repaint and now and
then a layout, and the engine thread waits for the GIL while it runs. The cost of a draw grows
with the reply (its last paragraph is parsed and wrapped again), and so does the engine's loss,
so a fixed rate is either too slow for a short reply or too costly for a long one. DrawPacer
spaces draws so that the UI thread's CPU time, measured between draws (everything the thread did:
drawing, layout, the KV panel, garbage collection), stays within a share of one core: the full
rate while that is cheap, fewer draws a second once it is not, never fewer than min_hz. While
several chats stream the share is smaller: the engine is then the busiest, and the user sees
only one of them.
"""
from __future__ import annotations

import time


class DrawPacer:
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
