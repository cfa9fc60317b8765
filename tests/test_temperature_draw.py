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


def test_greedy_rows_take_their_argmax_in_a_draw():
    """Rows that `greedy` marks take torch.argmax's token, the others the draw's, written into the
    `out` given (filled with -1 first, so a row left unwritten shows)."""
    rows, vocab = 5, 2 * module.CHUNK + 9
    logits = torch.randn(rows, vocab, device=DEVICE).to(torch.bfloat16)
    temps = torch.full((rows,), 0.8, device=DEVICE)
    greedy = torch.tensor([True, False, True, False, False], device=DEVICE)
    seed = torch.tensor([7], dtype=torch.int64, device=DEVICE)
    out = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    got = module.temperature_draw(logits, temps, seed, greedy=greedy, out=out)
    assert got is out
    drawn = module.temperature_draw(logits, temps, seed)
    want = torch.where(greedy, logits.argmax(-1), drawn)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_tokens_are_torch_argmax(dtype):
    """Fresh random rows over several chunks, and rows built to test the rules: ties between
    chunks and inside one (the first wins), every token ruled out (-inf: token 0), NaNs (the first
    NaN, as if the largest; a row of nothing else: token 0), a maximum in the vocabulary's last,
    partial chunk, -0.0 tying with +0.0."""
    rows, vocab = 10, 2 * module.CHUNK + 17
    logits = torch.randn(rows, vocab) * 4
    logits[1, [5, module.CHUNK + 3, 2 * module.CHUNK + 1]] = 50.0  # equal maxima in three chunks
    logits[2, [module.CHUNK + 8, module.CHUNK + 9]] = 50.0  # two in one chunk
    logits[3] = float("-inf")
    logits[4, [module.CHUNK + 2, 40]] = float("nan")
    logits[4, 7] = 1e4
    logits[5, -1] = 1e4
    logits[6, module.CHUNK - 1] = 1e4
    logits[7] = float("nan")
    logits[8] = -1.0
    logits[8, [3, 2 * module.CHUNK]] = torch.tensor([-0.0, 0.0])
    logits = logits.to(dtype).to(DEVICE)
    out = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    got = module.greedy_tokens(logits, out)
    assert got is out and torch.equal(got.cpu(), logits.cpu().argmax(-1))
    assert got[1:9].tolist() == [5, module.CHUNK + 8, 0, 40, vocab - 1, module.CHUNK - 1, 0, 3]
    assert torch.equal(module.greedy_tokens(logits[:, :100]).cpu(), logits[:, :100].cpu().argmax(-1))
