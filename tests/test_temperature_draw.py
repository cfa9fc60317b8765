"""kernels.temperature_draw, the plain draw with its noise computed where it is used, against the
torch operations it replaces (sampler.draw over exponential_noise's tensor from the same seed):
logits in bf16 and float32, tokens that may not be drawn, rows over several chunks. On CPU through
Triton's interpreter; tests/gpu runs it compiled."""
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from kernels import exponential_noise  # noqa: E402
from kernels import temperature_draw as module  # noqa: E402
from tests.kernel_checks import check_temperature_draw  # noqa: E402

if type(module._chunk_best_kernel).__name__ != "InterpretedFunction" and not torch.cuda.is_available():
    exponential_noise = importlib.reload(exponential_noise)  # imported before TRITON_INTERPRET was set
    module = importlib.reload(module)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [5, 3000, 2 * module.CHUNK + 17])
def test_the_draw_is_the_torch_draw_over_the_same_noise(dtype, vocab):
    rows = 6
    logits = (torch.randn(rows, vocab) * torch.tensor([0.1, 1, 3, 6, 12, 30])[:, None]).to(dtype)
    logits[1, ::3] = float("-inf")  # tokens the adjustments ruled out
    temps = torch.tensor([0.3, 0.7, 1.0, 1.3, 2.0, 0.05])
    check_temperature_draw(module.temperature_draw, exponential_noise.exponential_noise, logits, temps, DEVICE)


def test_the_seed_keys_the_draw_and_is_left_as_it_was():
    rows, vocab = 64, 40
    logits = torch.zeros(rows, vocab, device=DEVICE)  # every token equally likely
    temps = torch.ones(rows, device=DEVICE)
    seed = torch.tensor([123], dtype=torch.int64, device=DEVICE)
    first = module.temperature_draw(logits, temps, seed)
    assert seed.item() == 123
    assert torch.equal(first, module.temperature_draw(logits, temps, seed))
    other = module.temperature_draw(logits, temps, seed + 1)
    assert not torch.equal(first, other)  # 64 uniform draws over 40 tokens, all the same: (1/40)^64
    assert 0 <= first.min().item() and first.max().item() < vocab
