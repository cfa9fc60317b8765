"""kernels/warm_start.py and kernels/compile_worker.py on CPU: Triton's cache key, computed on a
thread while the engine loads a model, is what the first kernel launch then uses; the compile
workers answer every job, a bad one with its error, and stop when told or when dropped. Their
compiles for a GPU, and the rehearsal that finds them, run in tests/gpu/test_compile_ahead_gpu.py."""
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.warm_start import CompileWorkers, compile_worker_count, hash_triton_in_background

ROOT = Path(__file__).resolve().parents[1]


def test_the_thread_leaves_tritons_cache_key_computed_for_the_first_launch():
    cache = pytest.importorskip("triton.runtime.cache")
    cache.triton_key.cache_clear()
    thread = hash_triton_in_background()
    thread.join()
    assert thread.daemon and cache.triton_key.cache_info().currsize == 1
    misses = cache.triton_key.cache_info().misses
    assert cache.triton_key().startswith(__import__("triton").__version__)
    assert cache.triton_key.cache_info().misses == misses  # found, not hashed again


def test_a_compile_worker_answers_bad_jobs_with_their_error_and_goes_on():
    pytest.importorskip("triton")
    jobs = [json.dumps({"function": "kernels.rmsnorm:no_such_kernel", "specialization": "{}"}),
            "not json",
            json.dumps({"function": "kernels.rmsnorm:_rms_norm_kernel", "specialization": json.dumps({"name": "x"})})]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="0")  # the JIT functions a GPU start has
    out = subprocess.run([sys.executable, "-m", "kernels.compile_worker", "cuda", "90", "32"], input="\n".join(jobs) + "\n",
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    replies = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["compiled"] for r in replies] == [False, False, False]
    assert "no_such_kernel" in replies[0]["error"]
    assert replies[1]["error"].startswith("JSONDecodeError")
    assert replies[2]["error"] == "ValueError: the specialization is x's, not kernels.rmsnorm._rms_norm_kernel's"


def test_compile_workers_stop_when_closed_and_when_dropped():
    workers = CompileWorkers(2, ("cuda", 90, 32))
    processes = list(workers.processes)
    assert all(p.poll() is None for p in processes)
    workers.close()
    assert all(p.poll() is not None for p in processes)
    workers = CompileWorkers(1, ("cuda", 90, 32))
    process = workers.processes[0]
    del workers
    gc.collect()
    assert process.poll() is not None


def test_half_the_cores_compile_two_to_eight_workers():
    assert 2 <= compile_worker_count() <= 8
