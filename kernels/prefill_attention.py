"""Causal varlen attention over the paged KV cache, for every kind of prefill step.

Sequence i's queries are the last q_len_i positions of its context_lens[i] tokens, and all of its
K/V, new tokens included, are read from the cache through its block table. So one kernel serves
plain prefill (q_len == context), prefix-cached and chunked prefill (q_len < context) and decode
tokens mixed into a prefill batch (q_len == 1).

A program owns BLOCK_Q queries of one sequence and all query heads of one KV head: the rows of its
tiles are (query, head-in-group) pairs, so each K/V tile is loaded once per GQA group. When the
queries are too few to fill the GPU (a short turn after a long cached prefix), the keys are also
split over programs and merged by log-sum-exp, as in decode.
"""
import torch
import triton
import triton.language as tl

from kernels.decode_attention import LOG2E, _dot, _kv_offsets, _merge_splits_kernel, _sm_count, dot_flags

# When the keys are split, into this many pieces. On an H200 (bf16, 50 queries after a 2048-token
# cached prefix, eager) 16 and 32 splits took 52 us and no split 81 us, but 2, 4 and 8 splits took
# 128-139 us, for reasons not yet pinned down; so it is all or nothing.
SPLITS = 16
MIN_SPLIT_CONTEXT = 1024  # block-table capacity below which the keys are never split
PARTIALS_BUDGET = 64 << 20  # bytes of fp32 partials a split launch may allocate


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, q_pos, table, k_head, v_head, lo, hi, qk_scale,
                  stride_kb, stride_kt, stride_vb, stride_vt,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr):
    """Online softmax over keys [lo, hi). Without CAUSAL every key in the range is visible to
    every row, so the scores skip the causal mask."""
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        pos = start + n
        valid = pos < hi
        kv_mask = valid[:, None] & d_mask[None, :]
        k_rows = _kv_offsets(table, pos, valid, stride_kb, stride_kt, BLOCK_SIZE)
        k = tl.load(k_head + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
        if CAUSAL:
            s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A split can show a row only masked keys; a finite stand-in keeps exp2 away from -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = _kv_offsets(table, pos, valid, stride_vb, stride_vt, BLOCK_SIZE)
        v = tl.load(v_head + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    cu_seqlens_ptr, context_lens_ptr, block_tables_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    num_heads, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # Query tiles run last-first: the causal ones nearest the end of a sequence are the longest.
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)

    r = tl.arange(0, BLOCK_M)
    qi = q_tile * BLOCK_Q + r // GROUP_PAD
    g = r % GROUP_PAD
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    row_mask = (qi < q_len) & (g < GROUP)
    q_pos = ctx - q_len + qi
    token = (q_start + qi).to(tl.int64)
    head = kv_head * GROUP + g
    q = tl.load(q_ptr + (token * stride_qt + head * stride_qh)[:, None] + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    # Keys past the tile's last query are masked for every row: stop there. Keys up to its first
    # query are visible to every row: whole tiles of those skip the causal mask.
    hi = ctx - q_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    full = (ctx - q_len + q_tile * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    # This split's share of [0, hi), in whole tiles; splits past the end get none.
    chunk = tl.cdiv(tl.cdiv(hi, num_splits), BLOCK_N) * BLOCK_N
    lo = tl.minimum(split * chunk, hi)
    hi = tl.minimum(lo + chunk, hi)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, table, k_head, v_head, lo, tl.minimum(hi, full),
                                  qk_scale, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N,
                                  BLOCK_D, HEAD_DIM, False, PRECISION, UPCAST)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, table, k_head, v_head, tl.maximum(lo, full), hi,
                                  qk_scale, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N,
                                  BLOCK_D, HEAD_DIM, True, PRECISION, UPCAST)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = row_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # Partial rows of [tokens, heads, num_splits], merged by decode's merge kernel.
        part = (token * num_heads + head) * num_splits + split
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=row_mask)
    else:
        tl.store(out_ptr + (token * stride_ot + head * stride_oh)[:, None] + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)


def _config(dtype: torch.dtype, head_dim: int, on_gpu: bool, rows: int):
    """(rows per tile, BLOCK_N, num_warps, num_stages); rows are queries x padded group. From
    `benchmarks/bench_kernels.py --sweep` on an H200 (bf16, head_dim 128)."""
    if not on_gpu:
        return 32, 32, 1, 1
    if dtype == torch.float32 or head_dim > 128:
        return 64, 32, 4, 2
    if rows <= 64:  # short queries (decode tokens, small chunks): smaller tiles waste less
        return 64, 64, 4, 2
    return 128, 128, 8, 2


def default_num_splits(programs: int, max_context: int, partial_bytes_per_split: int, device) -> int:
    """SPLITS when the queries alone leave SMs idle (a short turn after a long cached prefix) and
    the context may be long, else 1. Host ints only: no sync."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 16
    if programs >= sms or max_context < MIN_SPLIT_CONTEXT or SPLITS * partial_bytes_per_split > PARTIALS_BUDGET:
        return 1
    return SPLITS


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                            max_seqlen_q=None, *, num_splits=None, block_m=None, block_n=None,
                            num_warps=None, num_stages=None):
    """q [tokens, heads, head_dim] (sequences packed by cu_seqlens_q) -> [tokens, heads, head_dim] in
    q's dtype. context_lens[i] >= q_len_i. max_seqlen_q, if given, must be >= every q_len_i; without
    it the host reads cu_seqlens_q (a sync). num_splits (keys split over that many programs, then
    merged) defaults to 1 unless the queries are too few to fill the GPU. block_m / block_n /
    num_warps / num_stages override the tuned launch config (tests and benchmarks)."""
    tokens, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    batch = cu_seqlens_q.shape[0] - 1
    assert num_heads % kv_heads == 0, "query heads must be a multiple of KV heads"
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size: power of two >= 16"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if tokens == 0 or batch == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    cfg_m, cfg_n, cfg_warps, cfg_stages = _config(q.dtype, head_dim, q.is_cuda, max_seqlen_q * group_pad)
    # tl.dot wants at least 16 rows.
    block_q = max(16 // group_pad, (block_m or cfg_m) // group_pad, 1)
    q_tiles = triton.cdiv(max_seqlen_q, block_q)
    if num_splits is None:
        num_splits = default_num_splits(q_tiles * batch * kv_heads, block_tables.shape[1] * block_size,
                                        tokens * num_heads * head_dim * 4, q.device)
    if num_splits > 1:
        part_o = torch.empty((tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    block_d = triton.next_power_of_2(head_dim)
    _prefill_kernel[(q_tiles, batch, kv_heads * num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse, cu_seqlens_q, context_lens, block_tables,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        num_heads, num_splits,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        BLOCK_M=block_q * group_pad, BLOCK_D=block_d, BLOCK_N=block_n or cfg_n, SPLIT=num_splits > 1,
        **dot_flags(q.dtype), num_warps=num_warps or cfg_warps, num_stages=num_stages or cfg_stages)
    if num_splits > 1:
        # Rows of tokens instead of sequences: the same layout decode's merge reads.
        _merge_splits_kernel[(tokens, num_heads)](
            part_o, part_lse, out, out.stride(0), out.stride(1), num_heads, head_dim, num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=2 if q.is_cuda else 1)
    return out
