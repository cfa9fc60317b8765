"""Decode attention over the paged KV cache: one query token per sequence, split-K.

Each program owns one (sequence, KV head, split): it loads that KV head's K/V tiles once and
attends with every query head of the GQA group at the same time (the group is the M dimension of
the dot products). The context is cut into `num_splits` pieces so that batch 1 with a long context
still puts work on every SM; a second kernel merges the splits' partial results by their
log-sum-exp. Nothing depends on context_lens on the host: the grid is fixed by shapes and
num_splits, which keeps the whole thing CUDA-graph capturable.
"""
import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# A split shorter than this spends more on its fixed cost (load q, write a partial) than it saves.
MIN_SPLIT_TOKENS = 64
MAX_SPLITS = 64


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # Triton's CPU interpreter multiplies bf16 operands as raw bits; it needs fp32.
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


def dot_flags(dtype: torch.dtype) -> dict:
    """The constexprs `_dot` takes: exact fp32 products (no TF32) for fp32 inputs."""
    return dict(PRECISION="ieee" if dtype == torch.float32 else "tf32",
                UPCAST=dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _kv_offsets(block_table_row, pos, valid, stride_b, stride_t, BLOCK_SIZE: tl.constexpr):
    """Offsets of the cache rows holding logical positions `pos` of one sequence. A tile may
    cover part of one block or span several; gathering the block id per position handles both."""
    physical = tl.load(block_table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return physical * stride_b + (pos % BLOCK_SIZE) * stride_t


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ob, stride_oh,
    num_heads, group, head_dim, num_splits,
    BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    ctx = tl.load(context_lens_ptr + seq)
    # Splits share the context evenly, in whole tiles; those past its end run no iteration and
    # leave a neutral partial (lse = -inf, o = 0).
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    head = kv_head * group + g
    g_mask = g < group
    d_mask = d < head_dim
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    table = block_tables_ptr + seq64 * stride_bt
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        valid = pos < end
        kv_mask = valid[:, None] & d_mask[None, :]
        k_rows = _kv_offsets(table, pos, valid, stride_kb, stride_kt, BLOCK_SIZE)
        k = tl.load(k_head + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = _kv_offsets(table, pos, valid, stride_vb, stride_vt, BLOCK_SIZE)
        v = tl.load(v_head + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        tl.store(out_ptr + seq64 * stride_ob + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials are rows of [batch, heads, num_splits] (lse) and [..., head_dim] (o).
        row = (seq64 * num_heads + head) * num_splits + split
        tl.store(part_o_ptr + row[:, None] * head_dim + d[None, :], o, mask=mask)
        tl.store(part_lse_ptr + row, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=g_mask)


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, row_splits_ptr, stride_ob, stride_oh, num_heads,
                         head_dim, num_splits, SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                         PER_ROW: tl.constexpr):
    """Program (i, head) merges output row i: a sequence here, a query token in split prefill.
    num_splits is the partials' split dimension; with PER_ROW, row i used row_splits[i] of them,
    and a row of one split (written straight to out) or none (padding) is left alone."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    used = num_splits
    if PER_ROW:
        used = tl.load(row_splits_ptr + seq)
    if used > 1:
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, BLOCK_D)
        s_mask = s < used
        d_mask = d < head_dim
        row = (seq * num_heads + head) * num_splits + s
        lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
        o = tl.load(part_o_ptr + row[:, None] * head_dim + d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        top = tl.max(lse, 0)
        # An empty context (a padding slot in a captured batch) has every split neutral: output 0.
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp2(lse - top)
        total = tl.sum(w, 0)
        merged = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, merged.to(out_ptr.dtype.element_ty),
                 mask=d_mask)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch: int, kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough splits to give every SM about two programs, but none shorter than MIN_SPLIT_TOKENS
    of the table's capacity. Static in shapes, so a captured graph keeps its grid."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 16
    want = triton.cdiv(2 * sms, batch * kv_heads)
    return max(1, min(want, max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))


def _config(dtype: torch.dtype, head_dim: int, on_gpu: bool):
    """(BLOCK_N, num_warps, num_stages). From `benchmarks/bench_kernels.py --sweep` on an H200
    (bf16, head_dim 128): within 10% of the best of 27 configs at batch 1 (ctx 512, 4096) and
    batch 256 (ctx ~600), where the split count mattered far more."""
    if not on_gpu:
        return 32, 1, 1
    if dtype == torch.float32:
        return 32, 4, 2
    return 64, 4, 2


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None,
                           *, block_n=None, num_warps=None, num_stages=None):
    """q [batch, heads, head_dim] -> [batch, heads, head_dim] in q's dtype: each sequence's query
    attends to all context_lens[i] tokens of its context, read through block_tables[i].
    block_n / num_warps / num_stages override the tuned launch config (tests and benchmarks)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert num_heads % kv_heads == 0, "query heads must be a multiple of KV heads"
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size: power of two >= 16"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = num_heads // kv_heads
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, block_tables.shape[1] * block_size, q.device)
    cfg_n, cfg_warps, cfg_stages = _config(q.dtype, head_dim, q.is_cuda)
    block_n = block_n or cfg_n
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_o = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_o, part_lse,
        scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_heads, group, head_dim, num_splits,
        BLOCK_SIZE=block_size, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=block_n, SPLIT=num_splits > 1,
        **dot_flags(q.dtype),
        num_warps=num_warps or cfg_warps, num_stages=num_stages or cfg_stages)
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            part_o, part_lse, out, context_lens, out.stride(0), out.stride(1), num_heads, head_dim,
            num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_D=block_d, PER_ROW=False,
            num_warps=2 if q.is_cuda else 1)
    return out
