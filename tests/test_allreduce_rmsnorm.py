"""kernels/allreduce_rmsnorm.py on CPU through Triton's interpreter: two ranks in one process,
each with its own buffer and flags, run one after the other. The peer that goes second has, in
effect, already arrived: its slot holds its partial sum and the first rank's flags show it. So
the test checks the data path (the sum of both slots, the residual add and the norm, against the
unfused torch path) and the flag protocol (each rank takes its peers' flags and leaves its own at
theirs), with NaN in every slot and output beforehand. The GPU module runs the ranks
concurrently (tests/gpu/test_allreduce_rmsnorm_gpu.py)."""
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from engine.layers.norm import RMSNorm  # noqa: E402
from tests.kernel_checks import (  # noqa: E402,F401
    AllReduceRanks,
    all_reduce_reference,
    assert_close,
    poison,
)

ar = importlib.import_module("kernels.allreduce_rmsnorm")
if type(ar._all_reduce_rms_norm_kernel).__name__ != "InterpretedFunction":
    if torch.cuda.is_available():
        pytest.skip("the GPU module covers this device", allow_module_level=True)
    ar = importlib.reload(ar)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (3, 48), (ar.MAX_PROGRAMS + 5, 40)])
def test_two_ranks_in_turn(dtype, rows, hidden, poison):
    ranks = AllReduceRanks(ar, 2, rows, hidden, dtype)
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = torch.randn(hidden).to(dtype)
    xs = [torch.randn(rows, hidden).to(dtype) for _ in range(2)]
    residual = torch.randn(rows, hidden).to(dtype)
    programs = min(rows, ar.MAX_PROGRAMS)
    slot = 1
    # Rank 1 has arrived: its slot holds its x and each of rank 0's programs holds its flag.
    ranks.buffers[1][slot * ranks.slot_elems:][:rows * hidden] = xs[1].flatten()
    ranks.flags[0][:programs, 1] = 1
    with poison():
        first = ranks.call(0, xs[0], residual, norm, slot)
    assert ranks.flags[0].sum() == 0, "rank 0 did not take rank 1's flags"
    assert ranks.flags[1][:programs, 0].tolist() == [1] * programs and ranks.flags[1].sum() == programs
    with poison():
        second = ranks.call(1, xs[1], residual, norm, slot)
    assert ranks.flags[1].sum() == 0, "rank 1 did not take rank 0's flags"
    assert ranks.flags[0][:programs, 1].tolist() == [1] * programs
    expected = all_reduce_reference(xs, residual, norm)
    for out, want in zip(first, expected):
        assert_close(out, want, dtype)
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "the ranks hold different results"
    # Slot 0 was never touched: each call site keeps to its slot.
    assert ranks.buffers[0][:rows * hidden].isnan().all()
