"""kv_cache_dtype="fp8": the KV cache kept in e4m3 (no scales). The kernels store what torch's
conversion gives (saturated at +-448, rounded half to even, NaN kept) and attend over the cache as
the torch reference does; the engine gives the same greedy tokens through the Triton kernels (on
CPU, the interpreter) as through the torch backend and over two tensor-parallel ranks, keeps a
quarter of a float32 cache's bytes a token, brings an evicted prefix back from the host tier
unchanged, and keeps the disk blocks of models of other dtypes apart."""
import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from engine import LLM, SamplingParams  # noqa: E402
from engine.layers import paged_attention_torch as ref  # noqa: E402
from engine.layers.rotary import RotaryEmbedding  # noqa: E402
from kernels import decode_attention, kv_store, norm_rope_store, prefill_attention  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402
from tests.kernel_checks import assert_close, poison  # noqa: E402,F401 (fixtures)
from tests.test_kernels import DEVICE, HEAD_DIM, make_paged_kv  # noqa: E402

FP8 = torch.float8_e4m3fn
F32, BF16 = torch.float32, torch.bfloat16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def as_torch_stores(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448, 448).to(FP8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, -0 apart from 0; a NaN's sign is not compared (torch's conversions differ there)."""
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(a.view(torch.uint8)[~nan_a], b.view(torch.uint8)[~nan_b])


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_store_kv_rounds_and_saturates_as_torch_converts(dtype):
    kv_heads, tokens, block_size, num_blocks = 2, 24, 16, 4
    key = (torch.randn(tokens, kv_heads, HEAD_DIM) * 100).to(dtype)
    value = (torch.randn(tokens, kv_heads, HEAD_DIM) * 100).to(dtype)
    # Past the range, near it, e4m3 subnormals (one on the grid, one between), a negative that rounds
    # to -0, and NaN.
    key[0, 0, :7] = torch.tensor([500.0, -1000.0, 447.0, 3 * 2.0 ** -9, 5.4 * 2.0 ** -9, -2.0 ** -12, float("nan")])
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[1:][torch.rand(tokens - 1) < 0.25] = -1
    shape = (num_blocks, block_size, kv_heads, HEAD_DIM)

    def nan_caches(device):  # 0x7F is e4m3's NaN: a slot the store skips keeps it
        return [torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(FP8) for _ in range(2)]

    kernel, torch_backend, expected = nan_caches(DEVICE), nan_caches("cpu"), nan_caches("cpu")
    kv_store.store_kv(key.to(DEVICE), value.to(DEVICE), *kernel, slots.to(DEVICE))
    ref.store_kv(key, value, *torch_backend, slots)
    kept = slots >= 0
    for cache, new in zip(expected, (key, value)):
        cache.view(-1, kv_heads, HEAD_DIM).view(torch.uint8)[slots[kept]] = as_torch_stores(new[kept]).view(torch.uint8)
    for caches in (kernel, torch_backend):
        assert same_bits(caches[0].cpu(), expected[0]) and same_bits(caches[1].cpu(), expected[1])
    stored = kernel[0].view(-1, kv_heads, HEAD_DIM)[slots[0], 0, :7].cpu()
    assert stored[:5].float().tolist() == [448.0, -448.0, 448.0, 3 * 2.0 ** -9, 5 * 2.0 ** -9]
    assert stored[5].view(torch.uint8).item() == 0x80 and stored[6].float().isnan()  # -0, NaN


def test_the_in_graph_store_writes_what_the_plain_store_writes():
    kv_heads, tokens, block_size, num_blocks = 2, 6, 8, 3
    key, value = torch.randn(tokens, kv_heads, HEAD_DIM) * 30, torch.randn(tokens, kv_heads, HEAD_DIM) * 30
    slots = torch.tensor([3, -1, 9, 17, -1, 0])
    shape = (num_blocks, block_size, kv_heads, HEAD_DIM)
    plain = [torch.zeros(shape, dtype=FP8) for _ in range(2)]
    in_graph = [torch.zeros(shape, dtype=FP8) for _ in range(2)]
    ref.store_kv(key, value, *plain, slots)
    ref.store_kv_in_graph(key, value, *in_graph, slots)
    assert same_bits(plain[0], in_graph[0]) and same_bits(plain[1], in_graph[1])


@pytest.mark.parametrize("dtype, with_norm", [(BF16, True), (F32, False)])
def test_norm_rope_store_keeps_in_fp8_what_it_computes_in_the_model_dtype(dtype, with_norm):
    """The same launch into an FP8 cache and into one of the model's dtype: the FP8 cache holds
    the other's values as torch converts them, bit for bit."""
    tokens, heads, kv_heads, head_dim, block_size, num_blocks = 7, 4, 2, 64, 16, 3
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 20).to(dtype).to(DEVICE)
    positions = torch.randint(0, 100, (tokens,), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size)[:tokens].to(DEVICE)
    rope = RotaryEmbedding(head_dim, 128, 1e6).to(DEVICE)
    weights = [(1 + 0.1 * torch.randn(head_dim)).to(dtype).to(DEVICE) for _ in range(2)] if with_norm else [None, None]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    wide = [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(2)]
    narrow = [torch.zeros(shape, dtype=FP8, device=DEVICE) for _ in range(2)]
    for k_cache, v_cache in (wide, narrow):
        norm_rope_store.norm_rope_store(qkv.clone(), positions, rope.cos, rope.sin, k_cache, v_cache, slots, heads,
                                        kv_heads, *weights, eps=1e-6)
    for got, computed in zip(narrow, wide):
        if DEVICE == "cpu":
            assert same_bits(got.cpu(), as_torch_stores(computed.cpu()))
        else:  # two compilations may contract the fp32 arithmetic differently: one e4m3 step apart at most
            torch.testing.assert_close(got.cpu().float(), as_torch_stores(computed.cpu()).float(), rtol=2**-3, atol=2**-9)


@pytest.mark.parametrize("block_size, group, dtype, num_splits", [(16, 2, BF16, 4), (32, 4, F32, 1), (16, 1, F32, 3)])
def test_decode_attention_over_an_fp8_cache(block_size, group, dtype, num_splits, poison):
    kv_heads = 2
    lens = [1, block_size, block_size + 1, random.randint(2, 3 * block_size)]
    k_cache, v_cache, tables = make_paged_kv(lens, block_size, kv_heads, FP8)
    q = torch.randn(len(lens), kv_heads * group, HEAD_DIM, device=DEVICE).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM ** -0.5
    with poison():
        out = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale, num_splits)
    assert_close(out, ref.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale), dtype)


def test_decode_attention_over_an_fp8_cache_keeps_a_nan_query_nan():
    """The fp16 products clamp q into fp16's range: a NaN (a model gone wrong upstream) must come
    out NaN for its head, as over a bf16 cache, not as a finite answer; the other heads are kept."""
    k_cache, v_cache, tables = make_paged_kv([40, 7], 16, 2, FP8)
    q = torch.randn(2, 4, HEAD_DIM, device=DEVICE).to(BF16)
    q[0, 1, 5] = float("nan")
    context_lens = torch.tensor([40, 7], dtype=torch.int32, device=DEVICE)
    out = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, HEAD_DIM ** -0.5)
    assert out[0, 1].isnan().all()
    nan = torch.zeros(2, 4, dtype=torch.bool, device=DEVICE)
    nan[0, 1] = True
    assert not out[~nan].isnan().any()


@pytest.mark.parametrize("block_size, group, dtype", [(16, 2, BF16), (32, 1, F32)])
def test_prefill_attention_over_an_fp8_cache(block_size, group, dtype, poison):
    kv_heads, b = 2, block_size
    shapes = [(b + 9, b + 9), (2 * b + 3, 13), (b + 1, 1), (1, 1)]  # plain, cached prefix, decode, one token
    random.shuffle(shapes)
    lens = [c for c, _ in shapes]
    k_cache, v_cache, tables = make_paged_kv(lens, block_size, kv_heads, FP8)
    cu = torch.zeros(len(shapes) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([n for _, n in shapes]).cumsum(0)
    q = torch.randn(int(cu[-1]), kv_heads * group, HEAD_DIM, device=DEVICE).to(dtype)
    cu = cu.to(DEVICE)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM ** -0.5
    with poison():
        out = prefill_attention.paged_prefill_attention(q, k_cache, v_cache, cu, context_lens, tables, scale)
    assert_close(out, ref.paged_prefill_attention(q, k_cache, v_cache, cu, context_lens, tables, scale), dtype)


def test_prefill_attention_over_an_fp8_cache_keeps_a_nan_query_nan():
    """As the decode attention's: a NaN in one query token's head comes out NaN for that token and
    head alone, though the fp16 products clamp q into fp16's range."""
    shapes = [(40, 40), (23, 7)]  # a whole prompt, then 7 tokens after a cached prefix
    k_cache, v_cache, tables = make_paged_kv([c for c, _ in shapes], 16, 2, FP8)
    cu = torch.tensor([0, 40, 47], dtype=torch.int32, device=DEVICE)
    q = torch.randn(47, 4, HEAD_DIM, device=DEVICE).to(BF16)
    q[43, 2, 9] = float("nan")  # the second sequence's fourth token, query head 2
    context_lens = torch.tensor([40, 23], dtype=torch.int32, device=DEVICE)
    out = prefill_attention.paged_prefill_attention(q, k_cache, v_cache, cu, context_lens, tables, HEAD_DIM ** -0.5)
    assert out[43, 2].isnan().all()
    nan = torch.zeros(47, 4, dtype=torch.bool, device=DEVICE)
    nan[43, 2] = True
    assert not out[~nan].isnan().any()


@pytest.mark.skipif(DEVICE != "cpu", reason="a CPU engine's Triton backend runs under the interpreter; "
                                           "tests/gpu/test_fp8_kv_cache_gpu.py is the CUDA engine's")
def test_the_engine_gives_the_same_tokens_through_triton_and_torch(tiny_qwen3):
    """float32 model, FP8 cache: both backends attend over the same e4m3 values, so the greedy
    tokens agree, through prefix hits, mixed batches and the fused decode kernel."""
    shared = random_prompts([40], seed=41)[0]
    prompts = [shared + p for p in random_prompts([3, 20], seed=42)] + random_prompts([1, 35], seed=43)
    runs, bytes_per_token = {}, {}
    for backend in ("torch", "triton"):
        with LLM(tiny_qwen3, device="cpu", kvcache_block_size=16, attention_backend=backend, kv_cache_dtype="fp8",
                 max_model_len=256, num_kvcache_blocks=64) as llm:
            assert llm.config.kv_dtype == FP8
            alone = llm.generate([shared + [7]], GREEDY)[0]["token_ids"]
            runs[backend] = [alone] + [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
            assert llm.stats().prefix_hit_tokens > 0
            bytes_per_token[backend] = llm.config.kv_bytes_per_token
    assert runs["triton"] == runs["torch"]
    with LLM(tiny_qwen3, device="cpu", max_model_len=256, num_kvcache_blocks=8) as llm:
        assert llm.config.kv_dtype == F32
        assert bytes_per_token["torch"] * 4 == llm.config.kv_bytes_per_token
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=16, kv_cache_dtype="fp8", tensor_parallel_size=2,
             max_model_len=256, num_kvcache_blocks=64) as llm:
        assert llm.generate(prompts, GREEDY)[0]["token_ids"] == runs["torch"][1]


def test_disk_blocks_of_an_fp8_cache_stay_apart_from_another_model_dtypes(tiny_qwen3, tmp_path):
    """An FP8 cache's blocks depend on the model's dtype too: a bfloat16 engine finds none of a
    float32 engine's on disk, and a second float32 engine finds them all."""
    options = dict(device="cpu", kvcache_block_size=8, max_model_len=256, num_kvcache_blocks=32,
                   kv_cache_dtype="fp8", disk_cache_dir=str(tmp_path))
    prompt = random_prompts([70], seed=46)[0]
    with LLM(tiny_qwen3, dtype="float32", **options) as llm:
        first = llm.generate([prompt], GREEDY)[0]["token_ids"]
    with LLM(tiny_qwen3, dtype="bfloat16", **options) as llm:
        llm.generate([prompt], GREEDY)
        assert llm.stats().disk_hit_tokens == 0
    with LLM(tiny_qwen3, dtype="float32", **options) as llm:
        assert llm.generate([prompt], GREEDY)[0]["token_ids"] == first
        assert llm.stats().disk_hit_tokens == (len(prompt) - 1) // 8 * 8


def test_an_evicted_prefix_comes_back_from_the_host_tier_unchanged(tiny_qwen3):
    block = 8
    small = dict(device="cpu", kvcache_block_size=block, num_kvcache_blocks=24, max_model_len=256,
                 kv_cache_dtype="fp8")
    long_prompt = random_prompts([120], seed=44)[0]
    with LLM(tiny_qwen3, **small) as llm:
        cold = llm.generate([long_prompt], GREEDY)[0]["token_ids"]
    # 2 layers x 2 KV heads x 16 dims x (K, V) x 1 byte a token.
    with LLM(tiny_qwen3, host_cache_gib=64 * block * 128 / 2**30, **small) as llm:
        assert llm.generate([long_prompt], GREEDY)[0]["token_ids"] == cold
        for other in random_prompts([60] * 4, seed=45):
            llm.generate([other], GREEDY)
        assert llm.blocks.lookup_prefix(llm.make_sequence(long_prompt)) == []
        before = llm.stats().host_hit_tokens
        assert llm.generate([long_prompt], GREEDY)[0]["token_ids"] == cold
        assert llm.stats().host_hit_tokens - before == (len(long_prompt) - 1) // block * block


def test_bad_kv_cache_dtypes_are_named():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM("unused", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs attention_backend 'triton' or 'torch'"):
        LLM("unused", kv_cache_dtype="fp8", attention_backend="flash_attn")
