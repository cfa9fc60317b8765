"""The Triton backend (attention plus the fused norm, RoPE and SiLU kernels and the one-row GEMV)
gives the same greedy tokens as the torch reference backend (on CPU through TRITON_INTERPRET=1,
which tests/conftest.py sets when there is no GPU)."""
import pytest

from engine import LLM, SamplingParams
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_triton_backend_matches_torch_backend(tiny_qwen3, monkeypatch):
    """Same greedy tokens; and the Triton backend's one-row decode steps take the fused norm + GEMV
    (+ SiLU-mul) kernel for both sublayers' first projections, its four-row steps do not; its
    decode attention starts the sequences longest context first."""
    import kernels.decode_attention
    import kernels.gemv
    fused_calls = set()  # (rows, with SiLU-mul)
    orders = []  # (context lengths, seq_order) of each decode attention call

    def counted(x, *args, silu=False, **kwargs):
        fused_calls.add((x.shape[0], silu))
        return rms_norm_gemv(x, *args, silu=silu, **kwargs)

    def recorded(*args, seq_order=None, **kwargs):
        orders.append((args[11].tolist(), None if seq_order is None else seq_order.tolist()))
        return decode_from_qkv(*args, seq_order=seq_order, **kwargs)

    rms_norm_gemv = kernels.gemv.rms_norm_gemv
    decode_from_qkv = kernels.decode_attention.paged_decode_attention_from_qkv
    monkeypatch.setattr(kernels.gemv, "rms_norm_gemv", counted)
    monkeypatch.setattr(kernels.decode_attention, "paged_decode_attention_from_qkv", recorded)
    block_size = 16
    # Mixed lengths and a shared prefix, so prefill covers cached and uncached contexts.
    shared = random_prompts([40], seed=31)[0]
    prompts = [shared + p for p in random_prompts([3, 20], seed=32)] + random_prompts([1, 35], seed=33)
    runs = {}
    for backend in ("torch", "triton"):
        with LLM(tiny_qwen3, device="cpu", kvcache_block_size=block_size, attention_backend=backend,
                 max_model_len=256, num_kvcache_blocks=64) as llm:
            # Alone, so its decode steps take the one-row GEMV; and then cached for the batch below.
            alone = llm.generate([shared + [7]], GREEDY)[0]["token_ids"]
            runs[backend] = [alone] + [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
            assert llm.stats().prefix_hit_tokens > 0
    assert runs["triton"] == runs["torch"]
    assert fused_calls == {(1, False), (1, True)}
    assert any(len(set(lens)) > 1 for lens, _ in orders)
    assert all(order == sorted(range(len(lens)), key=lambda row: -lens[row]) for lens, order in orders)


def test_triton_backend_rejects_bad_block_sizes(tiny_qwen3):
    with pytest.raises(ValueError, match="power-of-two kvcache_block_size >= 16"):
        LLM(tiny_qwen3, device="cpu", kvcache_block_size=24, attention_backend="triton")
