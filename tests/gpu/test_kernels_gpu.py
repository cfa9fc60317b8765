"""The Triton kernels against the torch reference on a GPU, at real shapes: head_dim 128, bf16,
block sizes 16..256, contexts up to 8k, batches up to 256, and CUDA-graph capture of decode.

Run with TRITON_INTERPRET unset or 0. Fresh random inputs each run; the seed is printed on failure.
Outputs and split partials are allocated NaN-filled, so an element left unwritten fails.
"""
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

triton = pytest.importorskip("triton")

from engine.layers import paged_attention_torch as ref  # noqa: E402
from kernels import (  # noqa: E402
    decode_attention,
    gemv,
    kv_store,
    prefill_attention,
    rmsnorm,
    silu_mul,
)
from tests.kernel_checks import assert_close, capture, poison  # noqa: E402,F401 (fixtures)

if type(decode_attention._decode_kernel).__name__ == "InterpretedFunction":
    pytest.skip("kernels were imported under TRITON_INTERPRET=1", allow_module_level=True)

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
HEAD_DIM = 128


def make_paged_kv(context_lens, block_size, kv_heads, dtype, width=None, spare_blocks=7):
    """Layer slices of one [2, layers, blocks, ...] cache, sequences on shuffled physical blocks,
    every slot no sequence owns NaN and table entries past a sequence's blocks random."""
    need = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(need) + spare_blocks
    width = width or max(need + [1]) + 1
    big = torch.randn(2, 2, num_blocks, block_size, kv_heads, HEAD_DIM, device="cuda").to(dtype)
    tables = torch.randint(0, num_blocks, (len(context_lens), width), dtype=torch.int32)
    physical = torch.randperm(num_blocks)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    at = 0
    for i, (length, blocks) in enumerate(zip(context_lens, need)):
        mine = physical[at:at + blocks]
        at += blocks
        tables[i, :blocks] = mine.int()
        owned[mine] = True
        if length % block_size:
            owned[mine[-1], length % block_size:] = False
    big[:, :, ~owned.cuda()] = float("nan")
    return big[0, 1], big[1, 1], tables.cuda()


DECODE_CASES = [
    # block_size, kv_heads, group, batch, context range, num_splits, dtype
    (16, 8, 2, 256, (500, 700), None, BF16),      # Qwen3-0.6B, a full decode batch
    (16, 8, 2, 1, (8192, 8192), None, BF16),      # batch 1, long context: many splits
    (32, 8, 4, 8, (1, 8192), None, BF16),
    (64, 4, 8, 32, (1, 3000), 16, BF16),          # short contexts leave splits empty
    (128, 8, 1, 4, (1, 4000), 1, BF16),
    (256, 8, 2, 64, (1, 8192), None, BF16),
    (256, 2, 4, 3, (1, 300), 32, BF16),
    (16, 4, 2, 16, (1, 2048), None, F16),
    (32, 2, 2, 4, (1, 1500), 4, F32),
]


@pytest.mark.parametrize("block_size, kv_heads, group, batch, ctx_range, num_splits, dtype", DECODE_CASES)
def test_decode(block_size, kv_heads, group, batch, ctx_range, num_splits, dtype, poison):
    lens = [random.randint(*ctx_range) for _ in range(batch)]
    k_cache, v_cache, tables = make_paged_kv(lens, block_size, kv_heads, dtype)
    q = torch.randn(batch, kv_heads * group, HEAD_DIM, device="cuda").to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    with poison():
        out = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale, num_splits)
    assert_close(out, ref.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale), dtype)


@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_cuda_graph(num_splits):
    """Captured once, replayed with other context lengths and block tables of the same shapes
    (a zero-length padding slot included): the grid and split count must not depend on them."""
    batch, kv_heads, group, block_size, width = 8, 8, 2, 16, 256
    lens_a = [random.randint(1, 4000) for _ in range(batch)]
    lens_b = [0] + [random.randint(1, width * block_size) for _ in range(batch - 1)]
    k_cache, v_cache, tables_a = make_paged_kv(lens_a + lens_b, block_size, kv_heads, BF16, width=width)
    q = torch.randn(batch, kv_heads * group, HEAD_DIM, device="cuda").to(BF16)
    tables = tables_a[:batch].clone()
    context_lens = torch.tensor(lens_a, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5

    def step():
        return decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale, num_splits)

    graph, out = capture(step)
    graph.replay()
    assert_close(out, ref.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale), BF16)
    tables.copy_(tables_a[batch:])
    context_lens.copy_(torch.tensor(lens_b, dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    graph.replay()
    assert_close(out, ref.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale), BF16)
    assert (out[0] == 0).all()


PREFILL_CASES = [
    # block_size, kv_heads, group, [(context, queries)], num_splits, dtype
    (16, 8, 2, [(2048, 2048)], None, BF16),                                        # a plain prompt
    (16, 8, 2, [(2098, 50), (600, 1), (601, 1), (300, 300), (4096, 512)], None, BF16),  # mixed step
    (16, 8, 2, [(2098, 50)], None, BF16),            # a short turn after a cached prefix: split keys
    (32, 4, 4, [(8192, 512), (33, 33), (1000, 1), (129, 97)], None, BF16),  # a chunk of an 8k prompt
    (64, 4, 8, [(1500, 700), (65, 1), (64, 64), (7, 0), (1, 1)], 3, BF16),
    (128, 8, 1, [(3000, 1000), (257, 1)], None, BF16),
    (256, 8, 2, [(8192, 1024), (511, 511), (256, 1), (2000, 17)], None, BF16),
    (256, 8, 2, [(8192, 30), (5000, 1), (300, 2)], 16, BF16),  # splits past short contexts
    (16, 8, 2, [(1024, 700), (99, 1)], None, F16),
    (64, 2, 2, [(700, 300), (65, 65), (40, 1)], 4, F32),
]


@pytest.mark.parametrize("block_size, kv_heads, group, shapes, num_splits, dtype", PREFILL_CASES)
def test_prefill(block_size, kv_heads, group, shapes, num_splits, dtype, poison):
    shapes = random.sample(shapes, len(shapes))
    lens = [c for c, _ in shapes]
    q_lens = torch.tensor([n for _, n in shapes])
    k_cache, v_cache, tables = make_paged_kv(lens, block_size, kv_heads, dtype)
    cu = torch.zeros(len(shapes) + 1, dtype=torch.int32)
    cu[1:] = q_lens.cumsum(0)
    q = torch.randn(int(cu[-1]), kv_heads * group, HEAD_DIM, device="cuda").to(dtype)
    cu = cu.cuda()
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    with poison():
        out = prefill_attention.paged_prefill_attention(q, k_cache, v_cache, cu, context_lens, tables, scale,
                                                        num_splits=num_splits)
    assert_close(out, ref.paged_prefill_attention(q, k_cache, v_cache, cu, context_lens, tables, scale), dtype)


@pytest.mark.parametrize("block_size", [16, 256])
def test_store_kv(block_size):
    tokens, kv_heads, num_blocks = 4096, 8, 8192 // block_size * 4
    qkv = torch.randn(tokens, 4 * kv_heads * HEAD_DIM, device="cuda").to(BF16)
    key = qkv[:, 2 * kv_heads * HEAD_DIM:3 * kv_heads * HEAD_DIM].view(tokens, kv_heads, HEAD_DIM)
    value = qkv[:, 3 * kv_heads * HEAD_DIM:].view(tokens, kv_heads, HEAD_DIM)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    slots[torch.rand(tokens, device="cuda") < 0.1] = -1
    big = torch.full((2, 2, num_blocks, block_size, kv_heads, HEAD_DIM), float("nan"), dtype=BF16, device="cuda")
    expected = big.clone()
    kv_store.store_kv(key, value, big[0, 1], big[1, 1], slots.int())
    ref.store_kv(key, value, expected[0, 1], expected[1, 1], slots)
    torch.testing.assert_close(big, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape, with_residual", [((2048, 1024), True), ((1, 1024), True), ((2048 * 16, 128), False)])
def test_rms_norm(shape, with_residual, poison):
    x = torch.randn(*shape, device="cuda").to(BF16)
    weight = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(BF16)
    residual = torch.randn(*shape, device="cuda").to(BF16) if with_residual else None
    with poison():
        got = rmsnorm.rms_norm(x, weight, 1e-6, residual)
    h = x + residual if with_residual else x
    want = weight * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16)
    if with_residual:
        assert_close(got[1], h, BF16)
        got = got[0]
    assert_close(got, want, BF16)


def test_silu_and_mul(poison):
    x = torch.randn(2048, 2 * 3072, device="cuda").to(BF16)
    with poison():
        out = silu_mul.silu_and_mul(x)
    gate, up = x.float().chunk(2, -1)
    assert_close(out, (torch.nn.functional.silu(gate) * up).to(BF16), BF16)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("N, K", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (2048, 2048)])
def test_gemv(M, N, K, poison):
    """Qwen3-0.6B's decode projections at batches 1-8, in each launch shape (both row kernels)."""
    x = torch.randn(M, K, device="cuda").to(BF16)
    weight = (torch.randn(N, K, device="cuda") / K ** 0.5).to(BF16)
    with poison():
        out = gemv.gemv(x, weight)
    assert_close(out, (x.float() @ weight.float().T).to(BF16), BF16)
