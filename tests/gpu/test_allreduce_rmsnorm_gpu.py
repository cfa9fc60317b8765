"""kernels/allreduce_rmsnorm.py on one GPU with two ranks at once: each rank's kernel on its own
stream, so the two really meet at the flag barrier, over several rounds that alternate slots, at
Qwen3-32B's hidden size (one token, and more rows than programs) and a float32 shape. Against the
unfused path, with fresh inputs each round and outputs poisoned. The two-GPU version runs inside
the TP=2 engine tests (tests/gpu/test_tp_gpu.py)."""
import importlib
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine.layers.norm import RMSNorm  # noqa: E402
from tests.kernel_checks import AllReduceRanks, all_reduce_reference, assert_close, poison, seed  # noqa: E402,F401

ar = importlib.import_module("kernels.allreduce_rmsnorm")
if type(ar._all_reduce_rms_norm_kernel).__name__ == "InterpretedFunction":
    pytest.skip("kernels were imported under TRITON_INTERPRET=1", allow_module_level=True)

_HANG_S = 30.0


def _wait(event: torch.cuda.Event) -> None:
    """Fails, rather than hanging the run, if the ranks never meet."""
    deadline = time.monotonic() + _HANG_S
    while not event.query():
        assert time.monotonic() < deadline, "the ranks' kernels did not finish: the barrier hangs"
        time.sleep(0.001)


@pytest.mark.parametrize("rows,hidden,dtype", [(1, 5120, torch.bfloat16), (40, 5120, torch.bfloat16),
                                               (3, 1024, torch.float32)])
def test_two_ranks_at_once(rows, hidden, dtype, poison):
    ranks = AllReduceRanks(ar, 2, rows, hidden, dtype, "cuda")
    norm = RMSNorm(hidden, 1e-6).cuda()
    norm.weight.data = torch.randn(hidden, device="cuda").to(dtype)
    rounds = [([torch.randn(rows, hidden, device="cuda").to(dtype) for _ in range(2)],
               torch.randn(rows, hidden, device="cuda").to(dtype)) for _ in range(6)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    results = []
    with poison():
        for i, (xs, residual) in enumerate(rounds):
            per_rank = []
            for rank, stream in enumerate(streams):
                with torch.cuda.stream(stream):
                    per_rank.append(ranks.call(rank, xs[rank], residual, norm, slot=i % 2))
            results.append(per_rank)
    for stream in streams:
        done = torch.cuda.Event()
        done.record(stream)
        _wait(done)
    for (xs, residual), (first, second) in zip(rounds, results):
        for out, want in zip(first, all_reduce_reference(xs, residual, norm)):
            assert_close(out, want, dtype)
        assert all(torch.equal(a, b) for a, b in zip(first, second)), "the ranks hold different results"
    assert all(f.sum() == 0 for f in ranks.flags), "a flag was left set"
