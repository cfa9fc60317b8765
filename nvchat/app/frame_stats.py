"""Timing of the app's stream pump, for the UI benchmark: how far apart its ticks land, how long
each spends draining streams and rendering, and how many of them drew the visible reply."""
import statistics
from collections import deque


class FrameStats:
    def __init__(self, keep: int = 20_000) -> None:
        self.intervals: deque[float] = deque(maxlen=keep)  # seconds between tick starts
        self.durations: deque[float] = deque(maxlen=keep)  # seconds inside the tick
        self._last_start: float | None = None
        self.draws = 0

    def record(self, start: float, end: float, drew: bool = False) -> None:
        if self._last_start is not None:
            self.intervals.append(start - self._last_start)
        self._last_start = start
        self.durations.append(end - start)
        self.draws += drew

    def pause(self) -> None:
        """The pump stopped (nothing streaming): the gap to its next tick is not a frame."""
        self._last_start = None

    def reset(self) -> None:
        self.draws = 0
        self.intervals.clear()
        self.durations.clear()
        self._last_start = None

    @staticmethod
    def percentile(values, q: float) -> float:
        if not values:
            return 0.0
        if len(values) == 1:
            return values[0]
        return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, round(q) - 1))]
