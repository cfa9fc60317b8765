"""kernels.top_p_sampling compiled for the GPU, at real vocabularies (SmolLM2's 49,152 and Qwen3's
151,936) and the decode graphs' row counts, against the float64 reference of what the sampler's sort
keeps and draws (tests/kernel_checks.py). Skipped without a CUDA device."""
import pytest
import torch

from tests.kernel_checks import check_top_p_draw, seed  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("vocab", [49152, 151936])
@pytest.mark.parametrize("rows", [1, 64])
def test_compiled_draw_is_the_sorts_nucleus_draw(vocab, rows):
    from kernels.top_p_sampling import top_p_draw
    # From near-uniform rows to peaked ones, top_p from 0.05 to 1.
    spread = torch.linspace(0.2, 16, rows)[:, None]
    scaled = torch.randn(rows, vocab) * spread
    scaled[rows // 2:, : vocab // 3] = float("-inf")  # tokens the adjustments ruled out
    noise = torch.empty(rows, vocab).exponential_()
    top_p = torch.rand(rows) * 0.95 + 0.05
    if rows > 1:
        top_p[-1] = 1.0
    check_top_p_draw(top_p_draw, scaled, noise, top_p, "cuda")
