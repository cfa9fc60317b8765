"""Weight-only int8 on CPU (quantization="int8"): close to the float model, not equal to it."""
import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.layers.int8 import int8_linear, quantize_rows
from tests.conftest import random_prompts


def test_quantized_rows_multiply_close_to_float():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    w = torch.randn(96, 64, generator=g) * torch.rand(96, 1, generator=g)  # rows of different scales
    x = torch.randn(5, 64, generator=g)
    q, scales = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    # Half a step of rounding (1/254 of the row's largest value) plus the bf16 scale's own (1/256).
    row_error = (q.float() * scales.float()[:, None] - w).abs().amax(dim=1)
    assert (row_error <= w.abs().amax(dim=1) * (1 / 254 + 1 / 256)).all()
    y, expected = int8_linear(x, q, scales), F.linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (5, 96)
    assert (y - expected).norm() / expected.norm() < 0.02


def _prefill_logits(path, prompt, **kwargs):
    """The engine's logits for the prompt's last position, caught on their way to the sampler."""
    with LLM(path, device="cpu", kvcache_block_size=8, **kwargs) as llm:
        caught, compute = [], llm.runner.model.compute_logits
        llm.runner.model.compute_logits = lambda hidden: caught.append(compute(hidden)) or caught[-1]
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        return caught[0][-1]


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_tied"])
def test_int8_logits_stay_close_to_hf(request, fixture):
    import transformers
    path = request.getfixturevalue(fixture)
    prompt = random_prompts([37], seed=int(torch.randint(0, 1000, ())))[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    int8 = _prefill_logits(path, prompt, quantization="int8")
    exact = _prefill_logits(path, prompt)
    assert (exact - expected).norm() / expected.norm() < 1e-5
    error = (int8 - expected).norm() / expected.norm()
    assert 1e-5 < error < 0.05, error  # moved by the rounding, but only a little


def test_bad_quantization_is_named(tiny_qwen3):
    with pytest.raises(ValueError, match="unsupported quantization 'int4'"):
        LLM(tiny_qwen3, device="cpu", quantization="int4")
