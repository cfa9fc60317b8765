"""kernels/fed_tokens.py against the torch operations it replaces in the decode graphs, on CPU through
Triton's interpreter (tests/gpu/test_fed_tokens_gpu.py runs it compiled): fresh random rows each
run, some fed from the token buffer, into an output filled with -1 first."""
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from kernels import fed_tokens as module  # noqa: E402
from tests.kernel_checks import check_fed_tokens  # noqa: E402

if type(module._fed_tokens_kernel).__name__ != "InterpretedFunction" and not torch.cuda.is_available():
    module = importlib.reload(module)  # imported before TRITON_INTERPRET was set
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 3, 16, 40, 300])
def test_fed_tokens_are_the_torch_ones(rows):
    check_fed_tokens(module.fed_tokens, rows, 64, DEVICE)


def test_no_rows():
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert module.fed_tokens(empty, torch.zeros(4, dtype=torch.int64, device=DEVICE), empty, empty).numel() == 0


def test_int32_rows_are_refused():
    """The kernel reads each index as int64: an int32 feed_from would be read two entries at a time."""
    rows = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(AssertionError, match="int64"):
        module.fed_tokens(rows.int(), torch.zeros(4, dtype=torch.int64, device=DEVICE), rows, rows.clone())
