"""Start-up timestamps, for benchmarks/bench_startup.py. With NVCHAT_STARTUP_TRACE naming a file,
nvchat appends a line to it at each stage of its start-up as the stage begins: the front-end's own
marks, then every stage the engine reports through its progress callback, then "ready" (the
backend serves requests; in the app, the first chat is on screen) and, in pipe mode, "first token".
A line is `<time.time()>\\t<stage>`, comparable with the clock of the process that started nvchat.
Without the variable, mark() does nothing."""
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
            f.write(f"{now:.6f}\t{stage}\n")
    except OSError:  # a benchmark's file gone: tracing must never break a start
        pass


def read(path) -> list[tuple[float, str]]:
    """The (time, stage) lines of a trace file, in order."""
    marks = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            when, _, stage = line.rstrip("\n").partition("\t")
            marks.append((float(when), stage))
    return marks
