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


@pytest.mark.parametrize(("vocab", "rows"), [(49152, 1), (151936, 1), (151936, 64)])
def test_compiled_greedy_tokens_are_torch_argmax(vocab, rows):
    """kernels.temperature_draw.greedy_tokens, bf16 logits with equal maxima in two chunks of a row,
    and (with more rows) a row of NaNs and a row with one NaN, which torch ranks above the rest:
    each row's token is a position of the row (what the decode step samples from garbage logits)."""
    from kernels.temperature_draw import CHUNK, greedy_tokens
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(torch.bfloat16)
    logits[0, [CHUNK + 5, 3 * CHUNK + 1]] = 100.0
    if rows > 2:
        logits[1] = float("nan")
        logits[2, 2 * CHUNK + 3] = float("nan")
    out = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    assert torch.equal(greedy_tokens(logits, out), logits.argmax(-1))
    assert out[0].item() == CHUNK + 5


@pytest.mark.parametrize("rows", [1, 4, 64])
def test_compiled_draw_gives_greedy_rows_their_argmax(rows):
    """temperature_draw with some rows marked greedy, into the `out` given (-1s first): those rows
    take torch.argmax's token, the rest the same draw as without the mask."""
    from kernels.temperature_draw import temperature_draw
    logits = (torch.randn(rows, 151936, device="cuda") * 4).to(torch.bfloat16)
    temps = torch.full((rows,), 0.8, device="cuda")
    greedy = torch.arange(rows, device="cuda") % 2 == 0
    seed = torch.tensor([11], dtype=torch.int64, device="cuda")
    out = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    assert temperature_draw(logits, temps, seed, greedy=greedy, out=out) is out
    assert torch.equal(out, torch.where(greedy, logits.argmax(-1), temperature_draw(logits, temps, seed)))
