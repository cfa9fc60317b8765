"""Start-up timestamps, for benchmarks/bench_startup.py. With NVCHAT_STARTUP_TRACE naming a file,
nvchat appends a line to it at each stage of its start-up as the stage begins: the front-end's own
marks, then every stage the engine reports through its progress callback, then "ready" (the
backend serves requests; in the app, the first chat is on screen) and, in pipe mode, "first token".
A line is `<time.time()>\\t<stage>\\t<peak RSS so far, kB>`: the time comparable with the clock of
the process that started nvchat, the peak (VmHWM) empty where /proc does not give it. Without the
variable, mark() does nothing."""
import os
import time

TRACE_ENV = "NVCHAT_STARTUP_TRACE"
_path = os.environ.get(TRACE_ENV) or None


def mark(stage: str) -> None:
    if _path is None:
        return
    now = time.time()
    try:
        with open(_path, "a", encoding="utf-8") as f:
            f.write(f"{now:.6f}\t{stage}\t{_peak_rss_kb()}\n")
    except OSError:  # a benchmark's file gone: tracing must never break a start
        pass


def _peak_rss_kb() -> str:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return line.split()[1]
    except OSError:  # not Linux
        pass
    return ""


def read(path) -> list[tuple[float, str, int | None]]:
    """The (time, stage, peak RSS so far in kB) lines of a trace file, in order; the peak is None
    where the line has none (nvchat before it recorded one, or no /proc)."""
    marks = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            when, stage, *peak = line.rstrip("\n").split("\t")
            marks.append((float(when), stage, int(peak[0]) if peak and peak[0] else None))
    return marks
