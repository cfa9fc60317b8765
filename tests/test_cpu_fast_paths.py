"""The CPU engine's lean forms against the plain arithmetic they stand for, on fresh random inputs:
RMSNorm as one call, RoPE by flipping halves, the K/V store without a mask, and the quantized
products' two routes (the kernels for few rows, the expanded weight for many) and the LM head's
recomputed leaders. Bit for bit where the arithmetic is the same; within a stated rounding where
it is not."""
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from engine import LLM, SamplingParams
from engine.core.step_plan import StepPlan
from engine.layers import native_cpu, quantized
from engine.layers.embedding import ParallelLMHead
from engine.layers.norm import RMSNorm
from engine.layers.paged_attention_torch import StepContext, store_kv, store_step_kv
from engine.layers.quantized import Int4Weight, Int8Weight, int4_class, int8_class, quantize, unpack_int4
from engine.layers.rotary import RotaryEmbedding
from engine.models.cpu_decode import CpuDecode
from engine.models.qwen3 import Qwen3ForCausalLM
from tests.conftest import random_prompts, save_tiny_hf_model


def _generator():
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_cpu_rms_norm_is_the_plain_formula_bit_for_bit(rows):
    g = _generator()
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    x = torch.randn(rows, 576, generator=g) * 4
    plain = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))
    assert torch.equal(norm(x), plain)
    residual = torch.randn(rows, 576, generator=g)
    normed, summed = norm(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(normed, norm(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_by_flipped_halves_is_rotate_half_bit_for_bit(dtype):
    g = _generator()
    rope = RotaryEmbedding(64, 2048, 10000.0)
    positions = torch.randint(0, 2048, (13,), generator=g)
    # A strided q, as the fused qkv's slice is.
    qkv = torch.randn(13, 20 * 64, generator=g).to(dtype)
    q = qkv[:, :9 * 64].view(13, 9, 64)
    cos = rope.cos[positions].unsqueeze(1).to(dtype)
    sin = rope.sin[positions].unsqueeze(1).to(dtype)
    rotated_half = torch.cat([-q[..., 32:], q[..., :32]], dim=-1)
    assert torch.equal(rope.apply(q, rope.rows(positions, dtype)), q * cos + rotated_half * sin)


def test_rope_rows_are_gathered_once_a_step():
    rope = RotaryEmbedding(64, 128, 10000.0)
    step_rows, positions = {}, torch.tensor([3, 7])
    first = rope.rows_for_step(positions, step_rows, torch.float32)
    assert rope.rows_for_step(positions, step_rows, torch.float32) is first


def _plan(slots, lengths, is_decode):
    return StepPlan(input_ids=[0] * len(slots), positions=[0] * len(slots), slot_mapping=slots,
                    cu_seqlens_q=[0, len(slots)], context_lens=lengths, block_tables=[[0]] * len(lengths),
                    sample_rows=[], sample_params=[], is_decode=is_decode)


class _Meta:
    def __init__(self, slots, lengths):
        self.slot_mapping = torch.tensor(slots)
        self.context = StepContext(_plan(slots, lengths, False), torch.zeros(1, 1, dtype=torch.int32),
                                   torch.tensor(lengths), 4, torch.float32)


@pytest.mark.parametrize("slots", [[5, 0, 17, 9], [5, -1, 17, -1]])
def test_step_store_writes_what_the_masked_store_writes(slots):
    g = _generator()
    key, value = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    caches = torch.randn(2, 6, 4, 2, 8, generator=g)
    expected = caches.clone()
    meta = _Meta(slots, [20])
    assert meta.context.all_slots_valid == (min(slots) >= 0)
    # A quantized product's bf16 value is converted on the way in.
    store_kv(key, value.bfloat16().float(), expected[0], expected[1], meta.slot_mapping)
    store_step_kv(key, value.bfloat16(), caches[0], caches[1], meta)
    assert torch.equal(caches, expected)


@pytest.mark.parametrize("rows", [16, 48, 176, 416])
def test_int4_unpacking_recovers_the_packed_values(rows):
    """Whole blocks of rows and a shorter last one, in whatever layout this CPU's torch packs."""
    q = torch.randint(0, 16, (rows, 96), dtype=torch.int32, generator=_generator())
    unpacked = unpack_int4(torch._convert_weight_to_int4pack_for_cpu(q, 1), rows, 96)
    assert unpacked.dtype == torch.uint8 and torch.equal(unpacked, q.to(torch.uint8))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_expanded_weight_is_what_the_kernel_multiplies_by(method):
    """torch's kernels round their float32 sums to bf16 once: the expanded weight's float32 product
    of the same bf16 rows lands within that rounding (2**-8 of each value, plus a hair at zero).
    (The C kernel's int4 weights: tests/test_q4_1_kernel.py.)"""
    g = _generator()
    w = torch.randn(401, 128, generator=g) * torch.rand(401, 1, generator=g)
    weight = {"int8": Int8Weight, "int4": Int4Weight}[method](w)
    x = torch.randn(3, 128, generator=g).bfloat16()
    kernel = weight.product(x)
    assert kernel.dtype == torch.bfloat16 and kernel.shape == (3, 401)
    expected = F.linear(x.float(), weight.expanded())
    assert ((kernel.float() - expected).abs() <= expected.abs() * 2**-8 + 1e-4 * expected.abs().max()).all()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_many_rows_multiply_by_the_expanded_weight_in_float32(method):
    g = _generator()
    weight = quantize(torch.randn(96, 64, generator=g), method)
    x = torch.randn(weight.expanded_rows, 64, generator=g)
    y = weight.product(x)
    assert y.dtype == torch.float32 and torch.equal(y, F.linear(x, weight.expanded()))
    # And the module's call, in x's shape and dtype, takes the same route.
    assert torch.equal(weight(x.view(2, -1, 64)), y.view(2, -1, 96))


@pytest.mark.parametrize("tied", [True, False])
def test_quantized_lm_head_settles_a_near_tie_in_float32(tied, monkeypatch):
    """Two tokens 0.03 apart at 25, one bf16 value in torch's int8 kernel's output (the head's where
    the C kernels do not build; theirs is float32). The head recomputes its leaders in float32 (from
    the float table when tied, else from the int8 rows), so argmax finds the larger, and the
    leaders' logits are those products."""
    monkeypatch.setattr(quantized, "int8_class", lambda in_features: Int8Weight)
    g = _generator()
    head = ParallelLMHead(300, 64)
    weight = torch.randn(300, 64, generator=g) / 64
    # Rows 7 and 200 on one int8 grid (a row's largest weight 1, so the same scale), one step apart
    # at feature 1, which with feature 0 alone is all that hidden[0] holds (in values bf16 keeps):
    # 24 and 24 + 3.8125 / 127 in float32, 23.998 and 24.028 in int8, both 24.0 in bf16.
    steps = torch.randint(-100, 101, (64,), generator=g)
    steps[0], steps[1] = 127, 0
    weight[7] = steps / 127
    steps[1] = 1
    weight[200] = steps / 127
    hidden = torch.stack([torch.zeros(64), torch.randn(64, generator=g)])
    hidden[0, 0], hidden[0, 1] = 24, 3.8125
    head.weight.data = weight.clone()
    head.quantize("int8", tied=tied)
    assert head.quantized.product(hidden.bfloat16())[0, [7, 200]].unique().numel() == 1  # tied in bf16
    logits = head.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits[0].argmax() == 200
    exact = weight[[7, 200]] if tied else head.quantized.rows(torch.tensor([7, 200]))
    torch.testing.assert_close(logits[0, [7, 200]], exact @ hidden[0], rtol=1e-6, atol=1e-5)


def _run_steps(path, prompts, quantization, fast, block_size=4):
    """Greedy tokens and every step's logits, with decode steps in CpuDecode's torch operations or in
    the modules."""
    with LLM(path, device="cpu", kvcache_block_size=block_size, quantization=quantization) as llm:
        assert llm.runner._cpu_decode is not None
        llm.runner._cpu_decode.native = False
        if not fast:
            llm.runner._cpu_decode = None
        caught, compute = [], llm.runner.model.compute_logits
        llm.runner.model.compute_logits = lambda hidden: caught.append(compute(hidden)) or caught[-1]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    return [o["token_ids"] for o in outs], caught


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_cpu_decode_equals_the_model_forward_bit_for_bit(tmp_path, arch, quantization):
    """Qwen3's q/k norms, Llama's plain attention, Qwen2's qkv bias; float32 and both quantized
    forms; a batch of contexts of different lengths (gathered, masked) and a lone sequence (read in
    place from consecutive blocks)."""
    save_tiny_hf_model(tmp_path, tie=arch == "llama", arch=arch)
    seed = int(torch.randint(0, 2**31, ()))
    for prompts in (random_prompts([5, 30, 17], seed=seed), random_prompts([9], seed=seed)):
        fast_tokens, fast_logits = _run_steps(tmp_path, prompts, quantization, fast=True)
        tokens, logits = _run_steps(tmp_path, prompts, quantization, fast=False)
        assert fast_tokens == tokens
        assert len(fast_logits) == len(logits) == 10
        assert all(torch.equal(a, b) for a, b in zip(fast_logits, logits))


@pytest.mark.skipif(native_cpu.native_kernels() is None, reason=f"no native kernels: {native_cpu.unavailable_reason()}")
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_native_decode_step_matches_the_torch_step(tmp_path, arch, monkeypatch):
    """Every decode step's hidden states from the C step against CpuDecode's torch operations from
    the same cache, int4 and int8 weights (Qwen3's q/k norms, Llama's plain attention). Not bit for
    bit: C rounds the norms, RoPE and attention in another order."""
    save_tiny_hf_model(tmp_path, tie=arch == "llama", arch=arch)
    native_step, compared = CpuDecode._native_step, []

    def both(self, input_ids, positions, meta):
        native = native_step(self, input_ids, positions, meta)
        self.native = False
        try:
            reference = CpuDecode.__call__(self, input_ids, positions, meta)
        finally:
            self.native = True
        compared.append((native.shape[0], meta.context.run_start is not None))
        torch.testing.assert_close(native, reference, rtol=2e-3, atol=2e-3)
        return native
    monkeypatch.setattr(CpuDecode, "_native_step", both)
    seed = int(torch.randint(0, 2**31, ()))
    for quantization in ("int4", "int8"):
        compared.clear()
        for prompts in (random_prompts([5, 30, 17], seed=seed), random_prompts([9], seed=seed)):
            with LLM(tmp_path, device="cpu", kvcache_block_size=4, quantization=quantization) as llm:
                assert llm.runner._cpu_decode.native
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        assert (3, False) in compared and (1, True) in compared, "a gathered batch and a lone sequence in a run"
    with LLM(tmp_path, device="cpu", kvcache_block_size=4) as llm:
        assert not llm.runner._cpu_decode.native, "float32 weights keep torch's operations (HF's rounding)"


@pytest.mark.skipif(native_cpu.native_kernels() is None, reason=f"no native kernels: {native_cpu.unavailable_reason()}")
def test_a_qkv_bias_keeps_the_torch_step(tmp_path):
    save_tiny_hf_model(tmp_path, tie=False, arch="qwen2")
    with LLM(tmp_path, device="cpu", quantization="int4") as llm:
        assert llm.runner._cpu_decode is not None and not llm.runner._cpu_decode.native


def test_int4_tied_head_greedy_picks_float32s_leader():
    """The int4 head's logits move by 4-bit rounding; the leaders it recomputes from the float
    table carry float32's own products, so argmax is float32's."""
    g = _generator()
    head = ParallelLMHead(300, 64)
    weight = torch.randn(300, 64, generator=g) / 8
    head.weight.data = weight.clone()
    head.quantize("int4", tied=True)
    hidden = torch.randn(8, 64, generator=g)
    logits, exact = head.compute_logits(hidden), hidden @ weight.T
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    leaders = exact.argmax(-1, keepdim=True)
    torch.testing.assert_close(logits.gather(1, leaders), exact.gather(1, leaders), rtol=1e-6, atol=1e-5)


def int4_tiny_qwen3(tied: bool) -> Qwen3ForCausalLM:
    """A one-layer Qwen3 (vocabulary 256, hidden 64) of normal random weights, quantized to int4,
    its LM head tied to the embedding or not."""
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(config, 64)
    for p in model.parameters():
        p.data.normal_()
    model.quantize("int4")
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_int4_models_quantize_the_head_to_int4_only_where_it_is_tied(tied):
    model = int4_tiny_qwen3(tied)
    assert type(model.lm_head.quantized) is (int4_class() if tied else int8_class(64))
    assert (model.lm_head.weight is not None) == tied


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_head_multiplies_many_rows_through_its_kernel(method):
    """Rows enough for a projection to expand its weight: the head's products stay the kernel's."""
    g = _generator()
    head = ParallelLMHead(320, 64)
    head.weight.data = torch.randn(320, 64, generator=g)
    head.quantize(method, tied=True)  # the engine's int4 heads are tied ones
    hidden = torch.randn(200, 64, generator=g)
    kernel = head.quantized.kernel_product(hidden).float()
    logits = head.compute_logits(hidden)
    leaders = kernel.topk(head.LEADERS, dim=-1).indices  # as the head picks them
    others = torch.ones_like(logits, dtype=torch.bool).scatter_(1, leaders, False)
    assert torch.equal(logits[others], kernel[others])
