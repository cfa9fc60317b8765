"""kernels/allreduce_rmsnorm.py on one GPU with two ranks at once. Each rank's calls are captured
in a CUDA graph (two call sites, slots 0 and 1) and the two graphs replay on two streams, so the
ranks really meet at the flag barrier, round after round, as the engine's decode graphs do.
(Graph replays, unlike eager launches, never allocate: a device allocation could wait for the
first rank's kernel, which waits for the second.) Against the unfused path at Qwen3-32B's hidden
size (one token, and more rows than programs) and a float32 shape, with fresh inputs each round
and outputs poisoned. Two GPUs run it inside the TP=2 engine tests (tests/gpu/test_tp_gpu.py)."""
import importlib
import time

import pytest
import torch

# Whole-GPU: the ranks spin on a flag barrier, so they must not wait behind other processes' kernels.
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"), pytest.mark.whole_gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine.layers.norm import RMSNorm  # noqa: E402
from tests.kernel_checks import AllReduceRanks, all_reduce_reference, assert_close  # noqa: E402

ar = importlib.import_module("kernels.allreduce_rmsnorm")
if type(ar._all_reduce_rms_norm_kernel).__name__ == "InterpretedFunction":
    pytest.skip("kernels were imported under TRITON_INTERPRET=1", allow_module_level=True)

_HANG_S = 30.0
SITES = 2  # call sites per graph, alternating slots


def _wait(stream: torch.cuda.Stream) -> None:
    """Fails, rather than hanging the run, if the ranks never meet."""
    done = torch.cuda.Event()
    done.record(stream)
    deadline = time.monotonic() + _HANG_S
    while not done.query():
        assert time.monotonic() < deadline, "the ranks' kernels did not finish: the barrier hangs"
        time.sleep(0.001)


@pytest.mark.parametrize("rows,hidden,dtype", [(1, 5120, torch.bfloat16), (40, 5120, torch.bfloat16),
                                               (3, 1024, torch.float32)])
def test_two_ranks_at_once(rows, hidden, dtype):
    ranks = AllReduceRanks(ar, 2, rows, hidden, dtype, "cuda")
    norm = RMSNorm(hidden, 1e-6).cuda()
    norm.weight.data = torch.randn(hidden, device="cuda").to(dtype)
    xs = [[torch.zeros(rows, hidden, device="cuda", dtype=dtype) for _ in range(2)] for _ in range(SITES)]
    residuals = [torch.zeros(rows, hidden, device="cuda", dtype=dtype) for _ in range(SITES)]
    # Compile outside the capture, one rank at a time: each finds its peer's flags already set.
    for rank in (0, 1):
        ranks.flags[rank][: min(rows, ar.MAX_PROGRAMS), 1 - rank] = 1
        ranks.call(rank, xs[0][rank], residuals[0], norm, 0)
    torch.cuda.synchronize()
    for flags in ranks.flags:
        flags.zero_()
    streams = [torch.cuda.Stream() for _ in range(2)]
    graphs, outs = [], []
    for rank, stream in enumerate(streams):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs.append([ranks.call(rank, xs[site][rank], residuals[site], norm, site % 2) for site in range(SITES)])
        graphs.append(graph)
    for _ in range(4):
        for site in range(SITES):
            for x in xs[site]:
                x.copy_(torch.randn(rows, hidden, device="cuda").to(dtype))
            residuals[site].copy_(torch.randn(rows, hidden, device="cuda").to(dtype))
        for per_rank in outs:
            for pair in per_rank:
                for t in pair:
                    t.fill_(float("nan"))
        torch.cuda.synchronize()
        for graph, stream in zip(graphs, streams):
            with torch.cuda.stream(stream):
                graph.replay()
        for stream in streams:
            _wait(stream)
        for site in range(SITES):
            expected = all_reduce_reference(xs[site], residuals[site], norm)
            for out, want in zip(outs[0][site], expected):
                assert_close(out, want, dtype)
            assert all(torch.equal(a, b) for a, b in zip(outs[0][site], outs[1][site])), \
                "the ranks hold different results"
    assert all(f.sum() == 0 for f in ranks.flags), "a flag was left set"
