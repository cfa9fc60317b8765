"""Tensor parallelism on two CUDA devices, with the symmetric-memory all-reduce
(engine/distributed/symm_allreduce.py): its sums against a reference, eagerly and in a CUDA graph, one process
per GPU; and TP=2 engines against TP=1, several at once, after a worker dies, and with NCCL only.
Skipped with fewer than two CUDA devices."""
import contextlib
import multiprocessing
import os
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine import LLM, SamplingParams
from engine.distributed import collectives, symm_allreduce
from tests.conftest import random_prompts
from tests.test_tensor_parallel import _children, kill_worker_mid_decode, step_in_turn

pytestmark = [pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"), pytest.mark.whole_gpu,
              pytest.mark.two_gpus]

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8, num_kvcache_blocks=256)
_RANKS_TIMEOUT_S = 300
_HOST = "127.0.0.1"


# --- one process per GPU ------------------------------------------------------------------------------


def _rank_main(check, rank: int, size: int, port: int, errors: str) -> None:
    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=timedelta(seconds=120))
        group = collectives.create_group(rank, size, store, device, timedelta(seconds=120))
        check(rank, size, group)
        # Every rank's kernels done before any rank releases its flags in destroy().
        group.backend_all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
        group.destroy()
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _on_each_gpu(check, size: int, tmp_path) -> None:
    """Runs check(rank, size, group) in a process per GPU over collectives.create_group's group, and
    fails with the ranks' tracebacks. The store lives here; each rank connects to it."""
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(check, rank, size, store.port, str(tmp_path)))
             for rank in range(size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + _RANKS_TIMEOUT_S
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    reports = "\n".join(f.read_text() for f in sorted(Path(tmp_path).glob("rank*.txt")))
    assert not reports, reports
    assert not hung, f"ranks {hung} did not finish within {_RANKS_TIMEOUT_S} s"
    assert [p.exitcode for p in procs] == [0] * size


# --- the all-reduce itself ----------------------------------------------------------------------------

# Decode sizes from one token to a batch of 256 at Qwen3-32B's hidden size; the last two take
# two-shot at two ranks; a non-multiple of 16 bytes and one past the buffer go to NCCL.
SHAPES = [(1, 1024), (1, 5120), (3, 5120), (16, 5120), (64, 5120), (256, 8192), (1, 7), (520, 8192)]
_TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def _inputs(size: int, shape, dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's input, the same on every rank, so each can compute the reference itself."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(device="cuda", dtype=dtype) for _ in range(size)]


def _reference(inputs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.double() for x in inputs]).sum(0).to(inputs[0].dtype)


def _poison(fast, like: torch.Tensor | None = None) -> None:
    """NaN in this rank's symmetric buffer, and in a freed block of the output's size, which the
    next allocation of that size takes: a result left over from before cannot pass."""
    fast._buffer.view(torch.uint8).fill_(0xFF)  # 0xFFFF is NaN in bf16, 0xFFFFFFFF in float32
    if like is not None:
        torch.full_like(like, float("nan"))


def _same_on_every_rank(group, out: torch.Tensor) -> None:
    parts = group.gather_to_rank0(out.contiguous(), dim=-1)
    if parts is not None:
        for other in parts.chunk(group.size, dim=-1)[1:]:
            assert torch.equal(other, parts.chunk(group.size, dim=-1)[0]), "ranks hold different sums"


def _check_eager_sums(rank: int, size: int, group) -> None:
    fast = group.fast
    assert fast is not None, "the symmetric-memory all-reduce did not set up"
    seed = 0
    for dtype in (torch.bfloat16, torch.float32):
        for shape in SHAPES:
            probe = torch.empty(shape, dtype=dtype, device="cuda")
            kernels = {"auto": group.all_reduce}
            if fast.accepts(probe):
                kernels["one-shot"] = fast.one_shot
                if fast.max_bytes > fast.one_shot_max:
                    kernels["two-shot"] = fast.two_shot
            for name, reduce in kernels.items():
                for _ in range(3):
                    seed += 1
                    inputs = _inputs(size, shape, dtype, seed)
                    x = inputs[rank].clone()
                    _poison(fast, x)
                    out = reduce(x)
                    torch.testing.assert_close(out, _reference(inputs), **_TOL[dtype],
                                               msg=lambda m: f"{name} {dtype} {shape}: {m}")
                    _same_on_every_rank(group, out)


def _check_graph_sums(rank: int, size: int, group) -> None:
    """One graph holding a one-shot, a two-shot and an NCCL all-reduce, replayed on fresh inputs
    with its outputs poisoned, with eager all-reduces on the same buffer in between."""
    fast = group.fast
    assert fast is not None, "the symmetric-memory all-reduce did not set up"
    shapes = [(1, 5120), (256, 8192), (520, 8192)]
    paths = [fast.accepts(torch.empty(s, dtype=torch.bfloat16)) for s in shapes]
    assert paths == [True, True, False]
    xs = [torch.zeros(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    for x in xs:
        group.all_reduce(x.clone())  # warm-up, as the engine runs before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [group.all_reduce(x) for x in xs]
    for replay in range(4):
        inputs = [_inputs(size, s, torch.bfloat16, 1000 + 10 * replay + i) for i, s in enumerate(shapes)]
        for x, per_rank in zip(xs, inputs):
            x.copy_(per_rank[rank])
        _poison(fast)
        for out, x in zip(outs, xs):
            if out.data_ptr() != x.data_ptr():  # NCCL's sum is in place
                out.fill_(float("nan"))
        graph.replay()
        for out, per_rank in zip(outs, inputs):
            torch.testing.assert_close(out, _reference(per_rank), **_TOL[torch.bfloat16])
            _same_on_every_rank(group, out)
        between = _inputs(size, (2, 5120), torch.bfloat16, 5000 + replay)
        torch.testing.assert_close(group.all_reduce(between[rank].clone()), _reference(between),
                                   **_TOL[torch.bfloat16])


def test_fast_all_reduce_sums_eagerly(tmp_path):
    _on_each_gpu(_check_eager_sums, 2, tmp_path)


def test_fast_all_reduce_sums_in_a_cuda_graph(tmp_path):
    _on_each_gpu(_check_graph_sums, 2, tmp_path)


# --- engines ------------------------------------------------------------------------------------------


def _symm_mem_sockets() -> set[Path]:
    """torch's rendezvous sockets, $TMPDIR/symm_mem-PID (it reads these variables in this order)."""
    tmp = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if v in os.environ), "/tmp")
    return set(Path(tmp).glob("symm_mem-*"))


@contextlib.contextmanager
def leaves_nothing_behind():
    """No worker process and no symmetric-memory socket left over. (NCCL's own /dev/shm segments
    are not this module's to check.)"""
    children, sockets = _children(), _symm_mem_sockets()
    yield
    assert _children() - children == set(), "processes left running"
    assert _symm_mem_sockets() - sockets == set(), "symmetric-memory sockets left behind"


def _tokens(llm, prompts, params=GREEDY):
    return [o["token_ids"] for o in llm.generate(prompts, params)]


def _unregistered(name: str) -> bool:
    from torch._C._distributed_c10d import _resolve_process_group
    try:
        _resolve_process_group(name)
    except RuntimeError:
        return True
    return False


@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
def test_tp2_matches_tp1_with_the_fast_all_reduce(tiny_qwen3, eager):
    prompts = random_prompts([1, 7, 16, 33, 100], seed=9)
    with LLM(tiny_qwen3, enforce_eager=eager, **ENGINE) as llm:
        expected = _tokens(llm, prompts)
    with leaves_nothing_behind():
        with LLM(tiny_qwen3, enforce_eager=eager, tensor_parallel_size=2, **ENGINE) as llm:
            assert llm.runner.fast_all_reduce
            name = llm.runner._ranks.group.fast.name
            assert (llm.runner.runner.decode_graphs is None) == eager
            outs = _tokens(llm, prompts)
    assert outs == expected
    assert _unregistered(name) and symm_allreduce._stranded == []


def test_nccl_only_when_asked(tiny_qwen3, monkeypatch):
    prompts = random_prompts([5, 40], seed=10)
    with LLM(tiny_qwen3, **ENGINE) as llm:
        expected = _tokens(llm, prompts)
    monkeypatch.setenv(symm_allreduce.DISABLE_ENV, "nccl")  # workers inherit it at spawn
    with LLM(tiny_qwen3, tensor_parallel_size=2, **ENGINE) as llm:
        assert not llm.runner.fast_all_reduce
        assert _tokens(llm, prompts) == expected


def test_engines_at_once_and_after_each_other(tiny_qwen3, tiny_qwen3_tied):
    """Each engine's workers are fresh processes, while rank 0's process has set up the engines
    before: the second and third rendezvous need the workers to catch up (see symm_allreduce)."""
    prompts = random_prompts([5, 40, 23], seed=11)
    expected = {}
    for path in (tiny_qwen3, tiny_qwen3_tied):
        with LLM(path, **ENGINE) as llm:
            expected[path] = _tokens(llm, prompts)
    with leaves_nothing_behind(), contextlib.ExitStack() as stack:
        a = stack.enter_context(LLM(tiny_qwen3, tensor_parallel_size=2, **ENGINE))
        with LLM(tiny_qwen3_tied, tensor_parallel_size=2, **ENGINE) as b:
            assert a.runner.fast_all_reduce and b.runner.fast_all_reduce
            assert step_in_turn([a, b], prompts, GREEDY) == [expected[tiny_qwen3], expected[tiny_qwen3_tied]]
        assert _tokens(a, prompts) == expected[tiny_qwen3]  # untouched by b's end
        a.shutdown()
        with LLM(tiny_qwen3, tensor_parallel_size=2, **ENGINE) as c:
            assert c.runner.fast_all_reduce
            assert _tokens(c, prompts) == expected[tiny_qwen3]


def _finishes(fn, timeout: float) -> bool:
    done = threading.Event()

    def run():
        fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout)


@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
def test_worker_killed_mid_decode_raises_and_leaves_the_gpu_usable(tiny_qwen3, eager):
    """A kernel waiting on the dead worker must be released: the caller gets a WorkerError, its
    GPU syncs, and the next engines run, the fast path included."""
    prompts = random_prompts([8, 30], seed=12)
    with LLM(tiny_qwen3, **ENGINE) as llm:
        expected = _tokens(llm, prompts)
    long = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
    with leaves_nothing_behind():
        with LLM(tiny_qwen3, enforce_eager=eager, tensor_parallel_size=2, **ENGINE) as llm:
            assert llm.runner.fast_all_reduce
            [pid] = llm.runner.worker_pids
            seqs = [llm.add_request(p, long) for p in prompts]
            kill_worker_mid_decode(llm, pid, seqs[0], timeout=60)
            assert llm.runner.broken
    assert _finishes(lambda: torch.cuda.synchronize(0), 30), "cuda:0 still runs a kernel waiting on the dead rank"
    assert symm_allreduce._stranded == []
    with LLM(tiny_qwen3, **ENGINE) as llm:
        assert _tokens(llm, prompts) == expected
    with LLM(tiny_qwen3, tensor_parallel_size=2, **ENGINE) as llm:
        assert llm.runner.fast_all_reduce
        assert _tokens(llm, prompts) == expected
