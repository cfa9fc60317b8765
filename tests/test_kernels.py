"""The Triton kernels against the torch reference, run on CPU through Triton's interpreter.

Shapes are tiny (the interpreter runs each program in numpy) but hit the edge cases: block sizes
bigger and smaller than the kernels' tiles, contexts crossing block boundaries, shuffled block
tables, GQA groups, cached prefixes, decode tokens inside a prefill batch, splits past the end of a
short context. Inputs are fresh random numbers each run; the seed is printed on failure. Outputs
(and the decode kernel's partials) are allocated NaN-filled, so an element left unwritten fails.
"""
import importlib
import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from engine.layers import paged_attention_torch as ref  # noqa: E402
from engine.layers.fp8 import CUBLAS_ROWS  # noqa: E402 (cuBLAS's block-scaled product's layout)
from kernels import (  # noqa: E402
    decode_attention,
    fp8,
    gemv,
    kv_store,
    prefill_attention,
    rmsnorm,
    silu_mul,
)
from tests.kernel_checks import TOL, assert_close, poison  # noqa: E402,F401 (fixtures)


def _interpreted() -> bool:
    return type(decode_attention._decode_kernel).__name__ == "InterpretedFunction"


if not _interpreted() and not torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] == "1":
    # Imported before TRITON_INTERPRET was set, by an earlier test module: decorate them again.
    for _module in (fp8, kv_store, decode_attention, gemv, prefill_attention, rmsnorm, silu_mul):
        importlib.reload(_module)
if _interpreted():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"  # the kernels were compiled for the GPU already (tests/gpu collected first)
else:
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

HEAD_DIM = 32
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def make_paged_kv(context_lens, block_size, kv_heads, dtype, head_dim=HEAD_DIM, spare_blocks=3):
    """K/V caches as the engine lays them out (layer slices of one big tensor) with each sequence
    on shuffled physical blocks. Slots no sequence owns are NaN, so reading one shows up; table
    entries past a sequence's blocks are random block ids, which must never be followed."""
    need = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(need) + spare_blocks
    width = max(need + [1]) + 2
    big = torch.full((2, 2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    k_cache, v_cache = big[0, 1], big[1, 1]
    physical = torch.randperm(num_blocks).tolist()
    tables = torch.randint(0, num_blocks, (len(context_lens), width), dtype=torch.int32)
    for i, (length, blocks) in enumerate(zip(context_lens, need)):
        mine = [physical.pop() for _ in range(blocks)]
        tables[i, :blocks] = torch.tensor(mine, dtype=torch.int32)
        for j, b in enumerate(mine):
            used = min(block_size, length - j * block_size)
            k_cache[b, :used] = torch.randn(used, kv_heads, head_dim).to(dtype)
            v_cache[b, :used] = torch.randn(used, kv_heads, head_dim).to(dtype)
    big = big.to(DEVICE)
    return big[0, 1], big[1, 1], tables.to(DEVICE)


def random_contexts(batch, block_size, max_blocks=3):
    """Random lengths plus the edges: one token, a full block, one past a block boundary."""
    fixed = [1, block_size, block_size + 1]
    rest = [random.randint(2, max_blocks * block_size) for _ in range(max(batch - len(fixed), 0))]
    lens = (fixed + rest)[:batch]
    random.shuffle(lens)
    return lens


# -- store_kv -----------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size, dtype, slot_dtype", [
    (16, F32, torch.int64), (32, BF16, torch.int32), (64, F16, torch.int64)])
def test_store_kv(block_size, dtype, slot_dtype):
    kv_heads, tokens, num_blocks = 2, 40, 6
    # key/value as strided views of one fused qkv output, as the attention layer produces them.
    qkv = torch.randn(tokens, 3 * kv_heads * HEAD_DIM, device=DEVICE).to(dtype)
    key = qkv[:, kv_heads * HEAD_DIM:2 * kv_heads * HEAD_DIM].view(tokens, kv_heads, HEAD_DIM)
    value = qkv[:, 2 * kv_heads * HEAD_DIM:].view(tokens, kv_heads, HEAD_DIM)
    slots = torch.randperm(num_blocks * block_size)[:tokens].to(slot_dtype)
    slots[torch.rand(tokens) < 0.25] = -1
    slots = slots.to(DEVICE)
    big = torch.full((2, 2, num_blocks, block_size, kv_heads, HEAD_DIM), float("nan"), dtype=dtype, device=DEVICE)
    expected = big.clone()
    kv_store.store_kv(key, value, big[0, 1], big[1, 1], slots)
    ref.store_kv(key, value, expected[0, 1], expected[1, 1], slots)
    torch.testing.assert_close(big, expected, rtol=0, atol=0, equal_nan=True)


# -- decode -------------------------------------------------------------------------------------

DECODE_CASES = [
    # block_size, group, dtype, num_splits, block_n (None: the default)
    (16, 1, F32, 1, None),
    (16, 2, BF16, 4, 64),      # a tile spans four blocks
    (32, 4, F16, 3, None),
    (64, 8, F32, 5, 16),       # a tile is a quarter block; short contexts leave splits empty
    (64, 2, BF16, None, None),  # default split count
    (32, 8, BF16, 1, 32),
    (16, 4, F32, 7, 16),
    (32, 3, F16, 2, 16),       # a group that is not a power of two
]


@pytest.mark.parametrize("block_size, group, dtype, num_splits, block_n", DECODE_CASES)
def test_decode_attention(block_size, group, dtype, num_splits, block_n, poison):
    kv_heads = 2
    lens = random_contexts(5, block_size)
    k_cache, v_cache, tables = make_paged_kv(lens, block_size, kv_heads, dtype)
    q = torch.randn(len(lens), kv_heads * group, HEAD_DIM, device=DEVICE).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM ** -0.5
    with poison():
        out = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale,
                                                      num_splits, block_n=block_n)
    assert_close(out, ref.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale), dtype)


def test_decode_head_dim_64_and_padding_slot(poison):
    """head_dim 64, and a zero-length context (a CUDA-graph padding slot) that must give zeros."""
    dtype, block_size, kv_heads, group, head_dim = BF16, 16, 1, 2, 64
    lens = [0, 40, 3]
    k_cache, v_cache, tables = make_paged_kv(lens, block_size, kv_heads, dtype, head_dim)
    q = torch.randn(3, kv_heads * group, head_dim, device=DEVICE).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    with poison():
        out = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.125, 4)
    assert_close(out, ref.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.125), dtype)
    assert (out[0] == 0).all()


def test_default_split_counts_are_static():
    cpu = torch.device("cpu")
    assert decode_attention.default_num_splits(256, 8, 4096, cpu) == 1
    assert decode_attention.default_num_splits(1, 8, 64, cpu) == 1
    many = decode_attention.default_num_splits(1, 8, 8192, cpu)
    assert 1 < many <= decode_attention.MAX_SPLITS


def test_one_warp_programs_split_to_about_eight_a_sm_and_small_batches_keep_four_warps():
    """Off CUDA the split counts assume 16 SMs."""
    cpu = torch.device("cpu")
    # Batch 1 over 8 KV heads: 8 (sequence, KV head) pairs for 16 SMs, four warps split to 3 a SM.
    assert not decode_attention.one_warp_programs(1, 8, cpu)
    assert decode_attention.default_num_splits(1, 8, 8192, cpu) == 6
    assert decode_attention.default_num_splits(1, 8, 256, cpu) == 4  # never under 64 tokens a split
    assert decode_attention.default_num_splits(1, 5, 8192, cpu) == 9  # at most 3 a SM: 48 // 5, not 10
    # Batch 2 has a pair for every SM: one warp, split to 8 a SM.
    assert decode_attention.one_warp_programs(2, 8, cpu)
    assert decode_attention.default_num_splits(2, 8, 8192, cpu) == 8
    assert decode_attention.default_num_splits(4, 8, 8192, cpu) == 4
    # Four pairs a SM is the most that still split (two each: eight programs a SM), the bound that
    # sizes split_counters; past it two splits would make more than eight a SM, so one each.
    assert decode_attention.default_num_splits(8, 8, 8192, cpu) == 2
    assert decode_attention.default_num_splits(13, 5, 8192, cpu) == 1
    assert decode_attention.default_num_splits(12, 8, 8192, cpu) == 1
    assert decode_attention.default_num_splits(256, 8, 1024, cpu) == 1


def _units(items):
    return [tuple(items[i:i + prefill_attention.ITEM_FIELDS]) for i in range(0, len(items), prefill_attention.ITEM_FIELDS)]


def _tile_splits(units):
    """{(sequence, query tile): splits}, after checking each tile lists its splits 0..n-1 once."""
    tiles = {}
    for seq, t, split, n in units:
        tiles.setdefault((seq, t, n), []).append(split)
    assert len({(seq, t) for seq, t, _ in tiles}) == len(tiles), "a tile with two split counts"
    for (seq, t, n), splits in tiles.items():
        assert sorted(splits) == list(range(n))
    return {(seq, t): n for seq, t, n in tiles}


@pytest.mark.parametrize("chunk", [120, 56])
def test_prefill_work_covers_every_tile_once_and_fits_one_pass(chunk):
    # A chunk of a long prompt mixed with 8 decode tokens, 132 programs, 64 queries a tile.
    q_lens, ctx = [1] * 8 + [chunk], [random.randint(50, 400) for _ in range(8)] + [8192]
    items, token_splits, most = prefill_attention.plan_work(q_lens, ctx, 64, 8, 132)
    units = _units(items)
    splits = _tile_splits(units)
    assert set(splits) == {(s, 0) for s in range(8)} | {(8, t) for t in range(-(-chunk // 64))}
    assert all(splits[s, 0] == 1 for s in range(8))  # a few hundred keys: never split
    # The decode tokens' units count against the programs: every unit runs in one pass...
    assert len(units) * 8 <= 132
    # ...and the chunk takes the programs they leave.
    assert min(n for (seq, _), n in splits.items() if seq == 8) >= 3
    assert most == max(splits.values()) <= prefill_attention.MAX_SPLITS
    assert token_splits == [1] * 8 + [splits[8, i // 64] for i in range(chunk)]
    # Heaviest first: the first unit has the most keys per split.
    keys = {(s, t): min(ctx[s], ctx[s] - q_lens[s] + (t + 1) * 64) for s, t in splits}
    assert keys[units[0][:2]] / units[0][3] == max(keys[k] / n for k, n in splits.items())


def test_prefill_work_with_more_tiles_than_programs_splits_nothing():
    q_lens = [1] * 40
    items, token_splits, most = prefill_attention.plan_work(q_lens, [random.randint(500, 5000) for _ in q_lens],
                                                            64, 8, 132)
    assert most == 1 and token_splits == [1] * 40 and len(_units(items)) == 40


def test_prefill_work_split_cap_and_forced_splits():
    assert prefill_attention.split_cap(100) == prefill_attention.split_cap(128)  # one graph bucket
    assert prefill_attention.split_cap(8192) == 1
    # Thousands of query tokens fill the GPU unsplit.
    _, token_splits, most = prefill_attention.plan_work([4096], [4096], 64, 8, 132)
    assert most == 1 and set(token_splits) == {1}
    items, token_splits, most = prefill_attention.plan_work([3, 0, 5], [10, 7, 5], 4, 2, 4, num_splits=3)
    assert most == 3 and token_splits == [3] * 8 and len(_units(items)) == 3 * 3  # tiles: 1 + 0 + 2


# -- prefill ------------------------------------------------------------------------------------

PREFILL_CASES = [
    # block_size, group, dtype, block_m (rows per tile), block_n, num_splits (keys split, then merged)
    (16, 1, F32, 16, 32, 1),      # K tiles span blocks
    (32, 2, BF16, 32, 16, 3),
    (64, 4, F16, None, 16, 1),    # K tiles are part of a block
    (16, 8, BF16, 64, 64, 2),
    (64, 2, F32, 32, 64, 5),      # splits past the end of short contexts
    (32, 3, F32, None, None, None),  # a group that is not a power of two
    (16, 2, F32, 16, 16, 4),
]


@pytest.mark.parametrize("block_size, group, dtype, block_m, block_n, num_splits", PREFILL_CASES)
def test_prefill_attention(block_size, group, dtype, block_m, block_n, num_splits, poison):
    kv_heads = 2
    b = block_size
    # (context, queries): plain prefill, cached prefix, a chunk in the middle of a long prompt,
    # decode tokens mixed in, an empty entry, and a one-token prompt.
    shapes = [(b + 9, b + 9), (2 * b + 3, 13), (3 * b, 21), (b + 1, 1), (2 * b, 1), (7, 0), (1, 1)]
    random.shuffle(shapes)
    lens = [c for c, _ in shapes]
    q_lens = torch.tensor([n for _, n in shapes])
    k_cache, v_cache, tables = make_paged_kv(lens, block_size, kv_heads, dtype)
    cu = torch.zeros(len(shapes) + 1, dtype=torch.int32)
    cu[1:] = q_lens.cumsum(0)
    q = torch.randn(int(cu[-1]), kv_heads * group, HEAD_DIM, device=DEVICE).to(dtype)
    cu = cu.to(DEVICE)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM ** -0.5
    with poison():
        out = prefill_attention.paged_prefill_attention(q, k_cache, v_cache, cu, context_lens, tables, scale,
                                                        num_splits=num_splits, block_m=block_m, block_n=block_n)
    expected = ref.paged_prefill_attention(q, k_cache, v_cache, cu, context_lens, tables, scale)
    assert_close(out, expected, dtype)


def test_prefill_attention_replays_a_padded_work_list(poison):
    """As a CUDA graph replays it: the work list sits in a buffer longer than the step's items (the
    rest is stale garbage), the partials have the bucket's split dimension, and padding sequences
    and tokens have no work."""
    block_size, kv_heads, group, dtype = 16, 2, 2, F32
    shapes = [(40, 1), (3 * block_size + 5, 23), (90, 1), (0, 0), (0, 0)]  # the last two: padding slots
    lens = [c for c, _ in shapes]
    q_lens = [n for _, n in shapes]
    k_cache, v_cache, tables = make_paged_kv([max(c, 1) for c in lens], block_size, kv_heads, dtype)
    padded_tokens = sum(q_lens) + 6
    cu = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(shapes))], dtype=torch.int32)
    q = torch.randn(padded_tokens, kv_heads * group, HEAD_DIM, device=DEVICE).to(dtype)
    block_q, programs = prefill_attention.launch_shape(dtype, HEAD_DIM, group, torch.device(DEVICE), padded_tokens)
    items, token_splits, _ = prefill_attention.plan_work(q_lens, lens, block_q, kv_heads, programs, num_splits=3)
    n = len(items) // prefill_attention.ITEM_FIELDS
    rows = torch.randint(0, 4, (n + 7, prefill_attention.ITEM_FIELDS), dtype=torch.int32)
    rows[:n] = torch.tensor(items, dtype=torch.int32).view(n, -1)
    work = prefill_attention.PrefillWork(
        rows.to(DEVICE), torch.tensor([n], dtype=torch.int32, device=DEVICE),
        torch.tensor(token_splits + [0] * 6, dtype=torch.int32, device=DEVICE), prefill_attention.MAX_SPLITS)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM ** -0.5
    with poison():
        out = prefill_attention.paged_prefill_attention(q, k_cache, v_cache, cu.to(DEVICE), context_lens, tables,
                                                        scale, work=work)
    real = sum(q_lens)
    expected = ref.paged_prefill_attention(q[:real], k_cache, v_cache, cu[:4].to(DEVICE), context_lens[:3],
                                           tables[:3], scale)
    assert_close(out[:real], expected, dtype)


# -- fused elementwise ops ----------------------------------------------------------------------

def rms_norm_ref(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    h = x.float()
    normed = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)


@pytest.mark.parametrize("dtype, w_dtype, hidden, with_residual", [
    (F32, F32, 64, False), (BF16, BF16, 96, True), (F16, F16, 128, True), (BF16, F32, 64, False),
    (BF16, BF16, 32, False)])
def test_rms_norm(dtype, w_dtype, hidden, with_residual, poison):
    x = torch.randn(2, 5, hidden, device=DEVICE).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(w_dtype)
    residual = torch.randn(2, 5, hidden, device=DEVICE).to(dtype) if with_residual else None
    with poison():
        got = rmsnorm.rms_norm(x, weight, 1e-6, residual)
    want = rms_norm_ref(x, weight, 1e-6, residual)
    if with_residual:
        assert_close(got[1], want[1], dtype)
        got, want = got[0], want[0]
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype, d", [(F32, 48), (BF16, 64), (F16, 2100)])
def test_silu_and_mul(dtype, d, poison):
    x = torch.randn(3, 2, 2 * d, device=DEVICE).to(dtype)
    with poison():
        out = silu_mul.silu_and_mul(x)
    gate, up = x.float().chunk(2, -1)
    assert_close(out, (torch.nn.functional.silu(gate) * up).to(dtype), dtype)


def _same_quantized(got, want):
    """Equal bit for bit (padding rows and NaN-poisoned leftovers included), scales in one layout."""
    (q, scales), (want_q, want_scales) = got, want
    assert q.shape == want_q.shape and scales.shape == want_scales.shape and scales.stride() == want_scales.stride()
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_scales)


def _near_reference(got, reference):
    """The real rows dequantized are within e4m3's rounding (half a step: a sixteenth of the value,
    or half the subnormal step) of the kernel's bf16 values, which are within bf16's tolerance of
    the torch result."""
    q, scales = got
    rows, cols = reference.shape
    group_scales = scales[:rows].repeat_interleave(128, 1)[:, :cols]
    values = q[:rows].float() * group_scales
    rtol, atol = TOL[BF16]
    bound = (reference.float().abs() * rtol + atol) * (1 + 1 / 16) + reference.float().abs() / 16 \
        + group_scales * 2 ** -10
    assert ((values - reference.float()).abs() <= bound).all()


@pytest.mark.parametrize("rows, hidden, with_residual", [(5, 256, True), (3, 384, False), (8, 128, True)])
def test_rms_norm_fp8_is_rms_norm_then_quantized(rows, hidden, with_residual, poison):
    """One launch gives what rms_norm followed by quantize_activations gives, bit for bit in the
    interpreter (a GPU may sum a wide row in another order: rms_norm_fp8's docstring), with the
    residual sum; near the torch reference."""
    x = (3 * torch.randn(rows, hidden, device=DEVICE)).to(BF16)
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(BF16)
    residual = torch.randn(rows, hidden, device=DEVICE).to(BF16) if with_residual else None
    with poison():
        got = rmsnorm.rms_norm_fp8(x, weight, 1e-6, residual, **CUBLAS_ROWS)
        unfused = rmsnorm.rms_norm(x, weight, 1e-6, residual)
    want = rms_norm_ref(x, weight, 1e-6, residual)
    if with_residual:
        assert torch.equal(got[1], unfused[1])
        got, unfused, want = got[0], unfused[0], want[0]
    _same_quantized(got, fp8.quantize_activations(unfused, **CUBLAS_ROWS))
    _near_reference(got, want)


@pytest.mark.parametrize("rows, d", [(3, 300), (6, 1100)])
def test_silu_and_mul_fp8_is_silu_and_mul_then_quantized(rows, d, poison):
    """As the norm's: a last group cut short (300 = 2 x 128 + 44), and rows of several programs."""
    x = (2 * torch.randn(rows, 2 * d, device=DEVICE)).to(BF16)
    with poison():
        got = silu_mul.silu_and_mul_fp8(x, **CUBLAS_ROWS)
        unfused = silu_mul.silu_and_mul(x)
    _same_quantized(got, fp8.quantize_activations(unfused, **CUBLAS_ROWS))
    gate, up = x.float().chunk(2, -1)
    _near_reference(got, (torch.nn.functional.silu(gate) * up).to(BF16))


def test_package_is_lazy_and_not_hf_kernels():
    import kernels
    assert not hasattr(kernels, "__version__")
    assert kernels.silu_and_mul is silu_mul.silu_and_mul


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("N, K", [(48, 64), (37, 100), (300, 96)])
def test_gemv(dtype, N, K, poison):
    """One and several weight rows per program (forced), and the default launch, with rows and K
    that are not multiples of the blocks."""
    x = torch.randn(1, K, device=DEVICE).to(dtype)
    weight = (torch.randn(N, K, device=DEVICE) / K ** 0.5).to(dtype)
    want = (x.float() @ weight.float().T).to(dtype)
    for block_n, block_k in ((1, 64), (4, 32)):
        with poison():
            out = gemv.gemv(x, weight, kernel="one", block_n=block_n, block_k=block_k)
        assert_close(out, want, dtype)
    with poison():
        assert_close(gemv.gemv(x, weight), want, dtype)


# Triton 3.9's interpreter gets bf16 tl.dot wrong (the same 16x16 product is right in fp16 and
# fp32), so the tensor-core kernel is checked here in fp32 and fp16, and in bf16 on a GPU.
@pytest.mark.parametrize("dtype, kernels", [(F32, ("fma", "dot")), (F16, ("fma", "dot")), (BF16, ("fma",))])
@pytest.mark.parametrize("M", [2, 3, 5, 8])
@pytest.mark.parametrize("N, K", [(48, 64), (37, 100)])
def test_gemv_rows(dtype, kernels, M, N, K, poison):
    """2-8 rows of x through both row kernels, with one or several weight rows per program, row
    counts that pad to the kernel's, and N and K that are not multiples of the blocks."""
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    weight = (torch.randn(N, K, device=DEVICE) / K ** 0.5).to(dtype)
    want = (x.float() @ weight.float().T).to(dtype)
    launches = {"fma": ((1, 64), (4, 32)), "dot": ((16, 32), (32, 64))}
    for kernel in kernels:
        for block_n, block_k in launches[kernel]:
            with poison():
                out = gemv.gemv(x, weight, kernel=kernel, block_n=block_n, block_k=block_k, num_warps=2)
            assert_close(out, want, dtype)


def test_gemv_takes_one_to_eight_rows():
    with pytest.raises(ValueError, match="M <= 8"):
        gemv.gemv(torch.randn(9, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv(torch.randn(2, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE), kernel="one")
