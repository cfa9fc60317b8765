"""What Triton does before a start's kernels can run, started early or spread over processes.

Before it looks a kernel up in its cache, Triton hashes its own compiler sources and libtriton
(~500 MB): the key of every cached kernel. That took 0.38 s of a `nvchat -p` start on the H200
machine (cProfile, 80fe0bd), all of it before the warm-up's first kernel. The hash is computed
once per process (functools.lru_cache) and reads files, which releases the GIL, so a thread can
compute it while the engine builds and loads the model.

A start with Triton's cache empty (a fresh machine, or new kernel code) compiles every kernel
specialization its steps use; uncompiled_launches() and CompileWorkers below find them and compile
them in other processes.
"""
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import weakref
from pathlib import Path


def _import_and_hash() -> None:
    try:
        from triton.runtime.cache import (
            triton_key,  # start-up: Triton's import is part of what this thread takes off the caller
        )
    except ImportError:  # a Triton that keys its cache otherwise: the first launch does its own work
        return
    triton_key()


def hash_triton_in_background() -> threading.Thread:
    """Starts importing Triton and computing its cache key on a daemon thread; join() the thread
    before the first kernel launch, so that the launch does not compute the key a second time."""
    thread = threading.Thread(target=_import_and_hash, name="triton-key", daemon=True)
    thread.start()
    return thread


# --- compiling a start's kernels in other processes ----------------------------------------
#
# A fresh machine's first start compiled its ~30 kernel specializations one after another as the
# warm-up reached each launch: 11-12 s of a 24 s start (SmolLM2, H200). Triton 3.6 holds the GIL
# for most of a compile: 32 small compiles took 4.77 s on one thread, 2.56 s on 4 or 16 threads
# and 0.49 s in 16 processes (H200 machine, 16 cores). So the runner starts CompileWorkers early,
# rehearses its warm-up inside uncompiled_launches() to learn which specializations it needs (every
# launch that would compile is noted and skipped: Triton's jit_cache_hook stands in for the
# compile), and has the workers compile them into Triton's disk cache, where the warm-up's launches
# find them.


class PendingCompile:
    """One kernel specialization a rehearsal skipped: its JIT function and Triton's description of
    its arguments and options (the JSON that JITFunction.preload takes)."""

    def __init__(self, jit_function, specialization: str):
        self.jit_function = jit_function
        self.specialization = specialization

    def job(self) -> str:
        fn = self.jit_function.fn
        function = f"{fn.__module__}:{fn.__qualname__}"
        return json.dumps({"function": function, "specialization": self.specialization}) + "\n"


@contextlib.contextmanager
def uncompiled_launches():
    """Within the block, on this thread only, a Triton launch that would compile first is skipped:
    the kernel does not run and its output is left as it was. Yields the list of PendingCompile it
    fills, one per distinct specialization. Whatever reads a skipped kernel's output within the
    block reads garbage, so run only work whose values do not matter, and that takes no index from
    a kernel's output. Launches of kernels compiled earlier in the process still run."""
    from triton import (
        knobs,  # start-up: Triton's import stays on the hashing thread until a kernel is needed
    )

    pending: list[PendingCompile] = []
    seen: set[tuple[int, str]] = set()
    rehearsing = threading.get_ident()
    outer = knobs.runtime.jit_cache_hook

    def skip_and_note(*, key, fn, compile, **rest):
        if threading.get_ident() != rehearsing:
            return outer(key=key, fn=fn, compile=compile, **rest) if outer is not None else None
        jit_function = fn.jit_function
        if (id(jit_function), key) not in seen:
            seen.add((id(jit_function), key))
            pending.append(PendingCompile(jit_function, compile["specialization_data"]))
        return True

    knobs.runtime.jit_cache_hook = skip_and_note
    try:
        yield pending
    finally:
        knobs.runtime.jit_cache_hook = outer


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()
        for stream in (process.stdin, process.stdout):
            stream.close()


class CompileWorkers:
    """Processes (kernels/compile_worker.py) that compile Triton kernels for a GPU target they are
    given, without a GPU of their own. Started before they are needed: each first imports torch and
    Triton (1-2 s), which overlaps the model's loading. close() stops them; so does the object's
    collection, or the interpreter's exit."""

    def __init__(self, count: int, target: tuple[str, int | str, int]):
        """target: Triton's GPUTarget as (backend, arch, warp_size), ("cuda", 90, 32) for an H100."""
        # The package's parent on the path, so that the workers import these kernels from a source
        # tree too; no GPU visible, so that nothing in them can make a CUDA context.
        source_root = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")
        self.processes = [
            subprocess.Popen([sys.executable, "-m", "kernels.compile_worker", *map(str, target)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                             text=True)
            for _ in range(count)]
        self._finalizer = weakref.finalize(self, _stop, self.processes)

    def compile(self, pending: list[PendingCompile]) -> int:
        """Compiles every pending specialization, for the GPU this process uses, into Triton's disk
        cache; returns how many compiled. A specialization that fails, or whose worker died, is
        left to the launch that needs it: that launch compiles it again and raises any error where
        it belongs."""
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        for item in pending:
            jobs.put(item.job())
        compiled = [0] * len(self.processes)

        def feed(i: int, process: subprocess.Popen) -> None:
            while True:
                try:
                    job = jobs.get_nowait()
                except queue.Empty:
                    return
                try:
                    process.stdin.write(job)
                    process.stdin.flush()
                    reply = process.stdout.readline()
                except OSError:  # the worker died: the other workers take the rest
                    return
                if not reply:
                    return
                compiled[i] += json.loads(reply).get("compiled", False)

        feeders = [threading.Thread(target=feed, args=(i, p), name=f"triton-compile-{i}")
                   for i, p in enumerate(self.processes)]
        for thread in feeders:
            thread.start()
        for thread in feeders:
            thread.join()
        return sum(compiled)

    def close(self) -> None:
        self._finalizer()


def compile_worker_count() -> int:
    """Workers for a start's compiles: half this process's cores (the main process goes on with its
    own work meanwhile), 2 to 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(2, min(8, cores // 2))
