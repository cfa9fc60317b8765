"""A sampling profiler for one thread: where the app's UI thread spends its time while the engine
thread runs beside it.

cProfile does not fit: on Python 3.12+ it hooks every thread (sys.monitoring), and its per-call
cost inflates code made of many small calls (Textual's layout and compositor) relative to the
rest. This samples the target thread's stack from a helper thread every `interval_s` and counts,
per function, the samples in which it was running (self) or on the stack (inclusive). Each sample
takes the GIL, so a profiled run's throughput figures are not the benchmark's.
"""
from __future__ import annotations

import sys
import threading
from collections import Counter

# A UI thread parked in its event loop's poll is idle, not busy.
_IDLE = {("selectors.py", "select")}


def _where(frame) -> tuple[str, str, int]:
    code = frame.f_code
    path = code.co_filename
    short = "/".join(path.rsplit("/", 2)[-2:])
    return short, code.co_name, code.co_firstlineno


class ThreadSampler:
    def __init__(self, thread_id: int, interval_s: float = 0.001) -> None:
        self.thread_id = thread_id
        self.interval_s = interval_s
        self.samples = 0
        self.idle = 0
        self.self_counts: Counter = Counter()
        self.inclusive: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ui-sampler", daemon=True)

    def __enter__(self) -> "ThreadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:
                continue
            top = _where(frame)
            self.samples += 1
            if (top[0].rsplit("/", 1)[-1], top[1]) in _IDLE:
                self.idle += 1
                continue
            self.self_counts[top] += 1
            seen = set()
            while frame is not None:
                where = _where(frame)
                if where not in seen:  # recursion counts a function once per sample
                    seen.add(where)
                    self.inclusive[where] += 1
                frame = frame.f_back

    def report(self, top: int = 30) -> str:
        busy = self.samples - self.idle
        lines = [f"{self.samples} samples of the UI thread every {self.interval_s * 1000:g} ms: "
                 f"{busy} busy ({100 * busy / max(1, self.samples):.0f}%), {self.idle} idle in the event loop's poll",
                 "", "busy %   self %   function (inclusive, by busy samples; the stack's base left out)"]
        # Functions on the stack in nearly every busy sample (the event loop, the benchmark's main) say nothing.
        telling = [(where, n) for where, n in self.inclusive.most_common() if n < 0.98 * busy]
        for where, n in telling[:top]:
            lines.append(f"{100 * n / max(1, busy):6.1f}   {100 * self.self_counts[where] / max(1, busy):6.1f}   "
                         f"{where[0]}:{where[2]} {where[1]}")
        lines += ["", "self %   function (by samples on top of the stack)"]
        for where, n in self.self_counts.most_common(top):
            lines.append(f"{100 * n / max(1, busy):6.1f}   {where[0]}:{where[2]} {where[1]}")
        return "\n".join(lines)


def sample_current_thread(interval_s: float = 0.001) -> ThreadSampler:
    return ThreadSampler(threading.get_ident(), interval_s)
