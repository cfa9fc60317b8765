"""kernels.fed_tokens compiled for the GPU, at the decode graphs' bucket sizes, against the torch
operations it replaces (tests/kernel_checks.py). Skipped without a CUDA device."""
import pytest
import torch

from tests.kernel_checks import check_fed_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("rows", [1, 2, 8, 64, 256])
def test_compiled_fed_tokens_are_the_torch_ones(rows):
    from kernels.fed_tokens import fed_tokens
    check_fed_tokens(fed_tokens, rows, 512, "cuda")
