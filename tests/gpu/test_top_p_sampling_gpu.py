"""kernels.top_p_sampling compiled for the GPU, at real vocabularies (SmolLM2's 49,152, Qwen3's
151,936, Gemma 3's 262,208) and the decode graphs' row counts, with its parallel rounds and without
them, against the float64 reference of what the sampler's sort keeps and draws
(tests/kernel_checks.py). The workspaces start as NaN. Skipped without a CUDA device."""
import pytest
import torch

from tests.kernel_checks import check_top_p_draw, poison  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(("vocab", "rows"), [(49152, 1), (49152, 64), (151936, 1), (151936, 64), (262208, 8)])
@pytest.mark.parametrize("parallel", [True, False], ids=["rounds", "one-program"])
def test_compiled_draw_is_the_sorts_nucleus_draw(vocab, rows, parallel, poison):
    from kernels.top_p_sampling import ROUNDS, top_p_draw
    # From near-uniform rows to peaked ones, top_p from 0.05 to 1.
    spread = torch.linspace(0.2, 16, rows)[:, None]
    scaled = torch.randn(rows, vocab) * spread
    scaled[rows // 2:, : vocab // 3] = float("-inf")  # tokens the adjustments ruled out
    noise = torch.empty(rows, vocab).exponential_()
    top_p = torch.rand(rows) * 0.95 + 0.05
    if rows > 1:
        top_p[-1] = 1.0
    with poison():
        check_top_p_draw(lambda *a: top_p_draw(*a, rounds=ROUNDS if parallel else 0), scaled, noise, top_p, "cuda")
