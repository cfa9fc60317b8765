"""Weight-only quantization on CPU (quantization="int8" or "int4"): close to the float model, not
equal to it."""
import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.layers.quantized import quantize, quantize_rows
from tests.conftest import random_prompts

# Relative error allowed for one product, and for the logits of a tiny random model (two layers of
# large random weights, which 4 bits a group fit worst: real checkpoints fare far better).
PRODUCT_ERROR = {"int8": 0.01, "int4": 0.1}
LOGITS_ERROR = {"int8": 0.06, "int4": 0.6}


def test_int8_rows_are_within_half_a_step():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    w = torch.randn(96, 64, generator=g) * torch.rand(96, 1, generator=g)  # rows of different scales
    q, scales = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    # Half a step of rounding (1/254 of the row's largest value) plus the bf16 scale's own (1/256).
    row_error = (q.float() * scales.float()[:, None] - w).abs().amax(dim=1)
    assert (row_error <= w.abs().amax(dim=1) * (1 / 254 + 1 / 256)).all()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_product_is_close_to_float(method):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    # 401 rows (not a multiple of 16) and 40 of x: int4's error then varies little from draw to draw
    # (3,000 draws: mean 0.078, sd 0.001, max 0.082); with 100 x 10 its sd was 0.0036 and 100,000
    # draws reached 0.097 of the 0.1 bound.
    w = torch.randn(401, 64, generator=g) * torch.rand(401, 1, generator=g)
    x = torch.randn(2, 20, 64, generator=g)
    y, expected = quantize(w, method)(x), F.linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (2, 20, 401)
    assert (y - expected).norm() / expected.norm() < PRODUCT_ERROR[method]


def test_int4_recovers_weights_already_on_a_4_bit_grid():
    """A Q4_1-style weight (a scale and a minimum per 32) comes back up to bf16 rounding."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    steps = torch.randint(0, 16, (32, 2, 32), generator=g).float()
    steps[..., 0], steps[..., 1] = 0, 15  # each group spans its whole grid
    w = (steps * torch.rand(32, 2, 1, generator=g) + torch.randn(32, 2, 1, generator=g)).view(32, 64)
    x = torch.randn(3, 64, generator=g)
    y, expected = quantize(w, "int4")(x), F.linear(x, w)
    assert (y - expected).norm() / expected.norm() < 0.01


def _prefill_logits(path, prompts, **kwargs):
    """The engine's logits for each prompt's last position, caught on their way to the sampler."""
    with LLM(path, device="cpu", kvcache_block_size=8, **kwargs) as llm:
        caught, compute = [], llm.runner.model.compute_logits
        llm.runner.model.compute_logits = lambda hidden: caught.append(compute(hidden)) or caught[-1]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
        return caught[0]


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_tied"])
def test_quantized_logits_stay_close_to_hf(request, fixture, method):
    import transformers
    path = request.getfixturevalue(fixture)
    # Eight prompts, not one: one prompt's error swings from 0.02 to 0.08 (int8) with the prompt, while
    # eight together stayed within 0.021-0.039 over 150 draws, so the bound below tests the rounding
    # rather than the luck of the draw.
    prompts = random_prompts([37] * 8, seed=int(torch.randint(0, 2**31, ())))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor(prompts)).logits[:, -1]
    exact = _prefill_logits(path, prompts)
    assert (exact - expected).norm() / expected.norm() < 1e-5
    error = (_prefill_logits(path, prompts, quantization=method) - expected).norm() / expected.norm()
    assert 1e-5 < error < LOGITS_ERROR[method], error  # moved by the rounding, but only a little


def test_bad_quantization_is_named(tiny_qwen3):
    with pytest.raises(ValueError, match="unsupported quantization 'int3'"):
        LLM(tiny_qwen3, device="cpu", quantization="int3")


def test_auto_quantization_keeps_files_not_stored_in_4_bits_exact(tiny_qwen3, tmp_path):
    """"auto" picks int4 only for a GGUF file whose layers are all stored in 4 bits or fewer (the
    bundled SmolLM2: test_smollm2); a safetensors checkpoint, or a GGUF file with a layer in
    more bits, keeps the weights as HF computes them, as "none" does everywhere."""
    from engine.config import EngineConfig
    from engine.options import EngineOptions
    from tests.gguf_files import write_tiny_gguf

    def resolved(model, quantization):
        return EngineConfig.create(model, EngineOptions(device="cpu", quantization=quantization)).quantization

    mixed = write_tiny_gguf(tmp_path / "mixed.gguf")  # Q5 to F16 layers among the Q4 ones
    assert resolved(mixed, "auto") is None
    assert resolved(tiny_qwen3, "auto") is None
    assert resolved(tiny_qwen3, "none") is None
    assert resolved(tiny_qwen3, "int8") == "int8"
