"""What Triton does once per process before its first kernel can run, started early.

Before it looks a kernel up in its cache, Triton hashes its own compiler sources and libtriton
(~500 MB): the key of every cached kernel. That took 0.38 s of a `nvchat -p` start on the H200
machine (cProfile, 80fe0bd), all of it before the warm-up's first kernel. The hash is computed
once per process (functools.lru_cache) and reads files, which releases the GIL, so a thread can
compute it while the engine builds and loads the model.
"""
import threading


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
