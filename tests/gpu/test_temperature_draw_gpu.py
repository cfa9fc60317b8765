"""kernels.temperature_draw compiled for the GPU, at SmolLM2's and Qwen3's vocabularies and the decode
graphs' row counts, against the torch draw over exponential_noise's tensor from the same seed
(tests/kernel_checks.py). Skipped without a CUDA device."""
import pytest
import torch

from tests.kernel_checks import check_temperature_draw

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(("vocab", "rows"), [(49152, 1), (49152, 64), (151936, 1), (151936, 64)])
def test_compiled_draw_is_the_torch_draw_over_the_same_noise(vocab, rows):
    from kernels.exponential_noise import exponential_noise
    from kernels.temperature_draw import temperature_draw
    logits = (torch.randn(rows, vocab) * torch.linspace(0.5, 12, rows)[:, None]).to(torch.bfloat16)
    logits[rows // 2:, : vocab // 4] = float("-inf")
    temps = torch.rand(rows) * 1.5 + 0.1
    check_temperature_draw(temperature_draw, exponential_noise, logits, temps, "cuda")
