"""Decode attention over the paged KV cache: one query token per sequence, split-K, one launch.

Each program owns one (sequence, KV head, split): it loads that KV head's K/V tiles once and
attends with every query head of the GQA group at the same time (the group is the M dimension of
the dot products). The context is cut into `num_splits` pieces so that batch 1 with a long context
still puts work on every SM; the split that finishes last merges every split's partial result by
its log-sum-exp, in the same kernel (a batch-1 decode step is launch-bound: a separate merge
kernel cost a launch and a tail per layer). Nothing depends on context_lens on the host: the grid
is fixed by shapes and num_splits, which keeps the whole thing CUDA-graph capturable.

The grid's programs are (sequence, KV head) pairs, KV heads fastest, times splits, and the GPU
starts them in about that order: within each split the sequences in the order `seq_order` lists
them. A big batch has more programs than the GPU holds at once; started in row order, a long
context that happens to start last runs on while the rest of the GPU idles. Started longest
first, the short ones fill in at the end: batch 256 over contexts of 100-2,048 tokens (one split)
took 191 us a layer against 260 over an e4m3 cache and 276 against 321 over bf16 (H200,
benchmarks/HISTORY.md, 2026-11-28, 11:10).

`paged_decode_attention_from_qkv` also does what kernels/norm_rope_store.py does for a decode
step (q/k RMSNorm, RoPE, the K/V store) inside the same kernel, from the raw qkv projection.
"""
import functools
import os

import torch
import triton
import triton.language as tl

from kernels import launch_limits, pdl
from kernels.fp8 import as_cached, fp16_scaled_query
from kernels.norm_rope_store import check_norm_rope_inputs

LOG2E = 1.4426950408889634
# A split shorter than this spends more on its fixed cost (load q, write a partial) than it saves.
MIN_SPLIT_TOKENS = 64
MAX_SPLITS = 64
# Four-warp programs a SM that default_num_splits splits a launch into: what measured best. With the
# early block ids (bf16 launches) it is also the most that fit; without them four fit. As launched
# at Qwen3-0.6B's shape (head_dim and num_heads multiples of 16, which Triton specializes) the
# from-qkv kernel compiles for sm90 to 114 registers a thread and 38,912 bytes of shared memory, 152
# registers with its first tile's block ids loaded before the wait, and 108 over an e4m3 cache (read
# on an H200 with the GPU machines' Triton 3.6; Triton 3.9 and its ptxas flags give 108, 145 and
# 126). So a SM holds four of its programs, and three with the early block ids (168 registers is the
# most with which three 128-thread programs fit a SM's 65,536). Against four (H200, bench_latency,
# benchmarks/HISTORY.md, 2026-11-29, before the early block ids), three took batch 8 at 512 context
# from 1.193-1.197 to 1.153-1.156 ms a step and at 4096 from 1.990-1.994 to 1.956-1.959, batch 4 at
# 4096 from 1.401-1.405 to 1.419-1.423, and left batches 1 and 2 within 1%; two took batches 4 and 8
# at 4096 to 1.53 and 2.18. Over an e4m3 cache four against three (session of 03:27): batches 2 / 4
# / 8 at 4096 1.118 / 1.329 / 1.827 against 1.148 / 1.425 / 1.928 ms, batch 8 at 512 1.195 against
# 1.150; one count serves both contexts, and three stays.
FOUR_WARP_PROGRAMS_PER_SM = 3
# Partials the last split merges at a time (at most); bounds its registers whatever num_splits is.
MERGE_TILE = 16


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
def _split_range(ctx, split, num_splits, BLOCK_N: tl.constexpr):
    """[start, end) of this split's share of the context, in whole tiles, and how many splits
    have a share at all (the same for every split of a sequence). Splits past the end get none."""
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)
    used = tl.cdiv(ctx, tl.maximum(chunk, 1))
    return start, end, used


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, table, k_head, v_head, lo, hi, qk_scale, stride_cb, stride_ct, head_dim,
                  first, first_blocks,
                  BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, WHOLE: tl.constexpr, FIRST_KNOWN: tl.constexpr):
    """The online softmax's state after the tiles of positions [lo, hi). WHOLE: hi - lo is a
    multiple of BLOCK_N, so no tile needs a mask over its positions (a fifth of the loop's
    instructions over a bf16 cache, compiled for sm90). FIRST_KNOWN (masked tiles only): first_blocks
    holds the block ids of the tile at position `first`, which the caller loaded before its wait."""
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < head_dim
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + n
        if WHOLE:
            kv_mask = d_mask[None, :]
            # K and V lie at the same offsets of their caches (one layout): the rows are found once.
            rows = _kv_offsets(table, pos, True, stride_cb, stride_ct, BLOCK_SIZE)
        else:
            valid = pos < hi
            kv_mask = valid[:, None] & d_mask[None, :]
            if FIRST_KNOWN:
                # Tiles step from `first` by whole tiles: only the first has positions before first + BLOCK_N.
                in_first = pos < first + BLOCK_N
                block = tl.load(table + pos // BLOCK_SIZE, mask=valid & ~in_first, other=0)
                block = tl.where(in_first, first_blocks, block)
                rows = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct
            else:
                rows = _kv_offsets(table, pos, valid, stride_cb, stride_ct, BLOCK_SIZE)
        # An FP8 cache's tiles widen to q's dtype for the dot, fp16 or float32 (exact: every e4m3
        # value is an fp16 one).
        k = tl.load(k_head + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
        if not WHOLE:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if v_head.dtype.element_ty.is_fp8():
            # Triton would move the widening after the tile's trip through shared memory (one
            # byte a value), and V's dot operand, which runs along the tokens, would then come
            # back one byte at a time: there is no transposing ldmatrix for 8 bits. A product
            # with a 1 that Triton cannot see is 1 (the body runs only when lo < hi) changes no
            # value and keeps the widening here, so the tile goes through shared memory as fp16
            # and comes back by ldmatrix.trans (benchmarks/HISTORY.md, 2026-11-28, 07:05: batch
            # 8 at 4096 context 33.7 against 41.0 us a layer on an H200). It costs one packed
            # multiply per two values; a where() would unpack each pair, select each half and
            # pack them again (HISTORY, 08:18: 5% slower at batch 256).
            v = v * (hi > lo).to(v.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend(q, table, k_head, v_head, start, end, qk_scale,
            stride_cb, stride_ct, head_dim, first_blocks,
            BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, UNMASKED_WHOLE: tl.constexpr,
            FIRST_KNOWN: tl.constexpr):
    """The group's queries against positions [start, end): (normalized output, max, sum), base 2.
    UNMASKED_WHOLE: the whole tiles run without position masks, the last, partial one (if any)
    with them. That pays in one-warp programs (H200: batch 32 at ~2000 context over an e4m3 cache
    58.6 against 64.8 us); in four-warp ones the second loop cost more than the masks (batch 1 at
    512 over bf16 8.4 against 7.8), so they run one masked loop."""
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    if k_head.dtype.element_ty.is_fp8() and q.dtype == tl.bfloat16:
        # Over an e4m3 cache the products run in fp16 (fp16_scaled_query's docstring says why).
        q = fp16_scaled_query(q, qk_scale)
        qk_scale = 1.0
    whole_end = start
    if UNMASKED_WHOLE:
        # A split past the context's end has end < start: no tiles at all.
        whole_end += tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, table, k_head, v_head, start, whole_end, qk_scale,
                                      stride_cb, stride_ct, head_dim, start, first_blocks, BLOCK_SIZE, BLOCK_D,
                                      BLOCK_N, PRECISION, UPCAST, True, FIRST_KNOWN)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, table, k_head, v_head, whole_end, end, qk_scale, stride_cb,
                                  stride_ct, head_dim, start, first_blocks, BLOCK_SIZE, BLOCK_D, BLOCK_N, PRECISION,
                                  UPCAST, False, FIRST_KNOWN)
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None], m_i, l_i


@triton.jit
def _merge(part_o_ptr, part_lse_ptr, first_row, group, head_dim, num_splits, used,
           GROUP_M: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_TILE: tl.constexpr):
    """The group's output from the first `used` splits' partials: each split's output weighted by
    its share of the softmax mass, 2**lse. [GROUP_M, BLOCK_D] fp32."""
    gm = tl.arange(0, GROUP_M)
    st = tl.arange(0, SPLIT_TILE)
    d = tl.arange(0, BLOCK_D)
    g_mask = gm < group
    d_mask = d < head_dim
    m = tl.full([GROUP_M], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_M], tl.float32)
    acc = tl.zeros([GROUP_M, BLOCK_D], tl.float32)
    for s0 in range(0, used, SPLIT_TILE):
        s = s0 + st
        mask = g_mask[:, None] & (s < used)[None, :]
        rows = (first_row + gm)[:, None] * num_splits + s[None, :]
        # .cg: other SMs wrote these during this kernel; read them from L2, never a stale L1 line.
        lse = tl.load(part_lse_ptr + rows, mask=mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_o_ptr + rows[:, :, None] * head_dim + d[None, None, :],
                    mask=mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 1))
        # All-empty so far (-inf): weigh against 0 instead, so no -inf - -inf.
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - ref)
        w = tl.exp2(lse - ref[:, None])
        total = total * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        m = m_new
    return acc / tl.where(total > 0, total, 1.0)[:, None]


@triton.jit
def _store_out(x, out_ptr, seq64, first_head, group, head_dim, stride_ob, stride_oh,
               ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    mask = (r < group)[:, None] & (d < head_dim)[None, :]
    tl.store(out_ptr + seq64 * stride_ob + (first_head + r)[:, None] * stride_oh + d[None, :],
             x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_partial(o, m_i, l_i, part_o_ptr, part_lse_ptr, first_row, split, group, head_dim, num_splits,
                   GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """Partials are rows of [batch, heads, num_splits] (lse) and [..., head_dim] (o)."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < group
    row = (first_row + g) * num_splits + split
    tl.store(part_o_ptr + row[:, None] * head_dim + d[None, :], o, mask=g_mask[:, None] & (d < head_dim)[None, :])
    tl.store(part_lse_ptr + row, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=g_mask)


@triton.jit
def _finish(o, m_i, l_i, seq64, kv_head, split, used, out_ptr, part_o_ptr, part_lse_ptr, counters_ptr,
            stride_ob, stride_oh, num_heads, group, head_dim, num_splits,
            GROUP_PAD: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_TILE: tl.constexpr,
            SPLIT: tl.constexpr, MERGE_HERE: tl.constexpr):
    """Writes the group's output: straight to out when one split holds the whole context, else as
    a partial that the last split to finish merges (MERGE_HERE) or the merge kernel does."""
    first_head = kv_head * group
    first_row = seq64 * num_heads + first_head
    if not SPLIT:
        _store_out(o, out_ptr, seq64, first_head, group, head_dim, stride_ob, stride_oh, GROUP_PAD, BLOCK_D)
    elif not MERGE_HERE:
        _store_partial(o, m_i, l_i, part_o_ptr, part_lse_ptr, first_row, split, group, head_dim, num_splits,
                       GROUP_PAD, BLOCK_D)
    elif used <= 1:
        # The whole context is split 0's (or empty: a padding row, whose output is then 0).
        if split == 0:
            _store_out(o, out_ptr, seq64, first_head, group, head_dim, stride_ob, stride_oh, GROUP_PAD, BLOCK_D)
    elif split < used:
        _store_partial(o, m_i, l_i, part_o_ptr, part_lse_ptr, first_row, split, group, head_dim, num_splits,
                       GROUP_PAD, BLOCK_D)
        # Which split merges must not depend on timing. Each of the `used` splits with a share
        # adds 1 to its (sequence, KV head)'s counter exactly once, so exactly one of them gets
        # used - 1 back, whatever order they run in, and only once every other one has stored its
        # partial. The barrier before the add orders all of this program's threads' partial stores
        # before it; the add's release publishes them at GPU scope, its acquire (seen by the last
        # one) makes every other split's partials visible, and the barrier after it extends that
        # to all of the last one's threads. Splits without a share (`used` is the same for all of
        # a sequence's splits) neither count nor get merged.
        # The last one resets the counter, which nothing else in this launch touches again, so
        # the next launch (the next layer, the next graph replay) starts from zero: launches on a
        # stream run in order, and with PDL the next one's accesses come after its wait, which
        # holds until this grid has finished.
        counter = counters_ptr + seq64 * (num_heads // group) + kv_head
        tl.debug_barrier()
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        if arrived == used - 1:
            merged = _merge(part_o_ptr, part_lse_ptr, first_row, group, head_dim, num_splits, used,
                            GROUP_M, BLOCK_D, SPLIT_TILE)
            _store_out(merged, out_ptr, seq64, first_head, group, head_dim, stride_ob, stride_oh, GROUP_M, BLOCK_D)
            tl.store(counter, 0)


@triton.jit
def _program_pair(order_ptr, kv_heads, ORDERED: tl.constexpr):
    """(sequence, KV head) of this program. The grid's first axis runs over the pairs, KV heads
    fastest, which is about the order the GPU starts programs in: a sequence's KV heads side by
    side, and with ORDERED the sequences in the order order_ptr lists them (each split in turn:
    splits are the grid's second axis)."""
    pair = tl.program_id(0)
    seq = pair // kv_heads
    if ORDERED:
        seq = tl.load(order_ptr + seq)
    return seq.to(tl.int64), pair % kv_heads


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, order_ptr, out_ptr, part_o_ptr, part_lse_ptr, counters_ptr,
    qk_scale,
    stride_qb, stride_qh, stride_cb, stride_ct, stride_ch,
    stride_bt, stride_ob, stride_oh,
    num_heads, group, head_dim, num_splits,
    BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_TILE: tl.constexpr, SPLIT: tl.constexpr, MERGE_HERE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, UNMASKED_WHOLE: tl.constexpr, ORDERED: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    split = tl.program_id(1)
    pdl.wait(PDL)  # everything below reads or writes what earlier kernels write
    seq64, kv_head = _program_pair(order_ptr, num_heads // group, ORDERED)

    ctx = tl.load(context_lens_ptr + seq64)
    start, end, used = _split_range(ctx, split, num_splits, BLOCK_N)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + seq64 * stride_qb + (kv_head * group + g)[:, None] * stride_qh + d[None, :],
                mask=(g < group)[:, None] & (d < head_dim)[None, :], other=0.0)
    o, m_i, l_i = _attend(q, block_tables_ptr + seq64 * stride_bt, k_ptr + kv_head * stride_ch,
                          v_ptr + kv_head * stride_ch, start, end, qk_scale, stride_cb, stride_ct, head_dim, 0,
                          BLOCK_SIZE, GROUP_PAD, BLOCK_D, BLOCK_N, PRECISION, UPCAST, UNMASKED_WHOLE, False)
    _finish(o, m_i, l_i, seq64, kv_head, split, used, out_ptr, part_o_ptr, part_lse_ptr, counters_ptr,
            stride_ob, stride_oh, num_heads, group, head_dim, num_splits,
            GROUP_PAD, GROUP_M, BLOCK_D, SPLIT_TILE, SPLIT, MERGE_HERE)


@triton.jit
def _norm_rope(x, x_partner, w, w_partner, d, cos, sin, head_dim, eps, HAS_NORM: tl.constexpr):
    """Rows of heads x [rows, BLOCK_D] (loaded, with each element's rotation partner x_partner)
    RMSNorm'd by w and rotated (neox), in fp32, rounded to x's dtype where kernels/norm_rope_store.py
    rounds (its docstring says why)."""
    dtype = x.dtype
    x = x.to(tl.float32)
    x_partner = x_partner.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / head_dim + eps)[:, None]
        x = ((x * rstd).to(dtype).to(tl.float32) * w[None, :]).to(dtype).to(tl.float32)
        x_partner = ((x_partner * rstd).to(dtype).to(tl.float32) * w_partner[None, :]).to(dtype).to(tl.float32)
    # rotate_half(x) = [-x2, x1]: the first half takes minus its partner in the second.
    sign = tl.where(d < head_dim // 2, -1.0, 1.0)[None, :]
    return x * cos[None, :] + sign * x_partner * sin[None, :]


@triton.jit
def _decode_from_qkv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, slot_ptr,
    k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, order_ptr, out_ptr, part_o_ptr, part_lse_ptr, counters_ptr,
    qk_scale, eps,
    stride_t, stride_cos, stride_sin, stride_cb, stride_ct, stride_ch,
    stride_bt, stride_ob, stride_oh,
    num_heads, num_kv_heads, group, head_dim, num_splits,
    BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_TILE: tl.constexpr, SPLIT: tl.constexpr, HAS_NORM: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, UNMASKED_WHOLE: tl.constexpr, ORDERED: tl.constexpr,
    PDL: tl.constexpr, EARLY_TABLE: tl.constexpr,
):
    pdl.start(PDL)
    # The step's inputs (seq_order among them) are read before the PDL wait, while the qkv
    # projection still runs: they were copied in before the step's first kernel (kernels/pdl.py
    # says why that is safe).
    seq64, kv_head = _program_pair(order_ptr, num_kv_heads, ORDERED)
    split = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + seq64)
    start, end, used = _split_range(ctx, split, num_splits, BLOCK_N)
    row = qkv_ptr + seq64 * stride_t
    pos = tl.load(pos_ptr + seq64).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    half = head_dim // 2
    partner = tl.where(d < half, d + half, d - half)
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d_mask, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_sin + d, mask=d_mask, other=0.0)
    table = block_tables_ptr + seq64 * stride_bt
    # The split's first tile's block ids, a step input too, so that its K/V loads after the wait
    # need no trip to the table first: at batch 1 and 512 context a four-warp split is one tile.
    # One-warp launches (UNMASKED_WHOLE) have many tiles a split and leave it. So does a cache of
    # another dtype: over e4m3 it measured level (benchmarks/HISTORY.md, 2026-11-29, session of
    # 03:27).
    first_pos = start + tl.arange(0, BLOCK_N)
    first_blocks = tl.zeros([BLOCK_N], tl.int32)
    if EARLY_TABLE:
        first_blocks = tl.load(table + first_pos // BLOCK_SIZE, mask=first_pos < end, other=0)
    # The new token is the context's last position: only the split whose range holds it stores its
    # K/V (a padding row has slot -1 and stores nothing, reading whatever its table points at, as
    # with the separate store).
    has_new = (start <= ctx - 1) & (ctx - 1 < end)
    slot = tl.load(slot_ptr + seq64, mask=has_new, other=-1).to(tl.int64)
    stores_new = has_new & (slot >= 0)
    # The norms' weights are weights: read before the wait too.
    qw = tl.zeros([BLOCK_D], tl.float32)
    qw_partner = qw
    kw = qw
    kw_partner = qw
    if HAS_NORM:
        qw = tl.load(qw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
        qw_partner = tl.load(qw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
        kw = tl.load(kw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
        kw_partner = tl.load(kw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
    pdl.wait(PDL)  # everything below reads or writes what the kernel before writes or reads

    # Every split with a share of the context norms and rotates the group's q heads itself: a few
    # hundred bytes, cheaper than a launch that would do it once. The splits past the context's
    # end (most of them at short contexts) load nothing. The new token's k and v rows load with
    # q's, and its slot before the wait, so the split that stores them waits for one round of
    # loads, not three (slot, k row, v row, one after another): on an H200 at batch 1 and 512
    # context it takes 0.32 µs from q to attending against 1.44, and the step 0.657 ms against
    # 0.672 (benchmarks/HISTORY.md, 2026-11-29, session of 05:09).
    g = tl.arange(0, GROUP_PAD)[:, None]
    q_heads = tl.where(split < tl.maximum(used, 1), group, 0)
    q_rows = row + (kv_head * group + g) * head_dim
    q_mask = (g < q_heads) & d_mask[None, :]
    q_x = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0)
    q_x_partner = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0)
    k_row = row + (num_heads + kv_head) * head_dim + tl.zeros([1, 1], tl.int32)  # one row of heads
    new_width = tl.where(stores_new, head_dim, 0)  # the new token's row, or nothing
    k_x = tl.load(k_row + d[None, :], mask=d[None, :] < new_width, other=0.0)
    k_x_partner = tl.load(k_row + partner[None, :], mask=d[None, :] < new_width, other=0.0)
    v_new = tl.load(row + (num_heads + num_kv_heads + kv_head) * head_dim + d, mask=d < new_width)
    q = _norm_rope(q_x, q_x_partner, qw, qw_partner, d, cos, sin, head_dim, eps,
                   HAS_NORM).to(qkv_ptr.dtype.element_ty)

    k_head = k_ptr + kv_head * stride_ch
    v_head = v_ptr + kv_head * stride_ch
    # The barrier makes the new token's stores visible to all of the split's threads before they
    # read the cache. No other program reads that slot in a decode step: it lies in the sequence's
    # own last block, which no other sequence holds until it is full.
    if has_new:
        if stores_new:
            block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            k_new = _norm_rope(k_x, k_x_partner, kw, kw_partner, d, cos, sin, head_dim, eps, HAS_NORM)
            # Via qkv's dtype first, so a cache of another dtype sees what the unfused path stored.
            k_new = as_cached(k_new.to(qkv_ptr.dtype.element_ty), k_ptr)
            slot_row = block * stride_cb + offset * stride_ct
            tl.store(k_head + slot_row + d[None, :], k_new, mask=d_mask[None, :])
            tl.store(v_head + slot_row + d, as_cached(v_new, v_ptr), mask=d_mask)
        tl.debug_barrier()

    o, m_i, l_i = _attend(q, table, k_head, v_head, start, end, qk_scale,
                          stride_cb, stride_ct, head_dim, first_blocks,
                          BLOCK_SIZE, GROUP_PAD, BLOCK_D, BLOCK_N, PRECISION, UPCAST, UNMASKED_WHOLE, EARLY_TABLE)
    _finish(o, m_i, l_i, seq64, kv_head, split, used, out_ptr, part_o_ptr, part_lse_ptr, counters_ptr,
            stride_ob, stride_oh, num_heads, group, head_dim, num_splits,
            GROUP_PAD, GROUP_M, BLOCK_D, SPLIT_TILE, SPLIT, True)


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, row_splits_ptr, stride_ob, stride_oh, num_heads,
                         head_dim, num_splits, SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                         PER_ROW: tl.constexpr, PDL: tl.constexpr):
    """Program (i, head) merges output row i: a sequence here, a query token in split prefill.
    num_splits is the partials' split dimension; with PER_ROW, row i used row_splits[i] of them,
    and a row of one split (written straight to out) or none (padding) is left alone."""
    pdl.start(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pdl.wait(PDL)
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


def same_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether one offset finds a token's K in k_cache and its V in v_cache, as the attention
    kernels assume (the engine's caches are the two halves of one tensor)."""
    return k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 16


def one_warp_programs(batch: int, kv_heads: int, device: torch.device) -> bool:
    """Whether a launch runs one-warp programs over 32-token tiles: when the batch holds a
    (sequence, KV head) pair for every SM. One warp reduces the softmax's rows without a trip
    through shared memory between warps; over an e4m3 cache, bound by instructions per token, that
    took batch 256 at ~600 context from 131 to 110 us and batch 32 at ~2000 from 81 to 58 (H200,
    benchmarks/HISTORY.md, 2026-11-28, 09:56). Smaller batches keep four warps, which were faster
    there than one warp split to about eight programs a SM: batch 2 at 4096 context 15.6 against
    18.6 us, batch 8 at 512 11.1 against 12.2. Batch 8 at 4096 over e4m3 was the exception (one
    warp 32.0 against 36.1 with 16-18 splits); a launch fixed by shapes cannot see the context."""
    return batch * kv_heads >= _sms(device)


def default_num_splits(batch: int, kv_heads: int, max_context: int, device: torch.device) -> int:
    """Static in shapes, so a captured graph keeps its grid; never a split shorter than
    MIN_SPLIT_TOKENS of the table's capacity. The grid is fixed by the table's capacity, not the
    context, so one count serves both short contexts and the long ones a conversation grows into.

    Four-warp programs: at most FOUR_WARP_PROGRAMS_PER_SM a SM (its comment says why).
    One-warp programs (one_warp_programs): about eight a SM, never more. Batch 128 at ~1000 context
    took 105 us with one split against 110 with two and 116 with four; batch 32 at ~2000 66, 71 and
    66 with three, six and twelve (H200, e4m3 cache)."""
    sms = _sms(device)
    cap = min(max_context // MIN_SPLIT_TOKENS, MAX_SPLITS)
    if one_warp_programs(batch, kv_heads, device):
        want = 8 * sms // (batch * kv_heads)
    else:
        want = FOUR_WARP_PROGRAMS_PER_SM * sms // (batch * kv_heads)
    return max(1, min(want, cap))


def split_counters(device: torch.device) -> torch.Tensor:
    """A zeroed counter buffer big enough for every call that default_num_splits splits (those
    have batch * kv_heads <= 4 * SMs) on `device`. Every call leaves it zeroed again, so one buffer
    serves all layers and steps of an engine: allocate it once, outside any graph capture."""
    return torch.zeros(max(4096, 4 * _sms(device)), dtype=torch.int32, device=device)


def shared_memory(config: tuple[int, int, int, int], group: int, head_dim: int, itemsize: int) -> int:
    """An upper estimate of a launch's shared memory in bytes (kernels/launch_limits.py says how it
    counts): per stage of the attention loop a K and a V tile, q and the probabilities on their
    way into the dots, and per stage of the last split's merge a tile of fp32 partial outputs.
    Over an FP8 cache the staged tiles take one byte an element, which leaves room for the V tile
    widened on its way into the second dot."""
    block_n, _, num_stages, split_tile = config
    block_d = triton.next_power_of_2(head_dim)
    group_pad = max(16, triton.next_power_of_2(group))
    attend = (num_stages * 2 * block_n * block_d + group_pad * (block_d + block_n)) * itemsize
    merge = num_stages * triton.next_power_of_2(group) * split_tile * (block_d + 1) * 4
    return attend + merge


@functools.cache  # every launch asks: the search stays off the decode step's host path
def launch_config(dtype: torch.dtype, head_dim: int, group: int, limits: launch_limits.DeviceLimits | None,
                  kv_dtype: torch.dtype | None = None, one_warp: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, num_warps, num_stages, merge tile). Four-warp programs take the tuned configuration
    from `benchmarks/bench_kernels.py --sweep` on an H200 (bf16, head_dim 128): within 10% of the
    best of 27 configs at batch 1 (ctx 512, 4096) and batch 256 (ctx ~600), where the split count
    mattered far more. One-warp programs (one_warp_programs says when) take 32-token tiles, two
    stages: of one-warp tiles of 16, 32 and 64 tokens, 32 was fastest at batches 32 to 256 over
    both caches, by 6-25%, and three stages within 2% of two (H200, benchmarks/HISTORY.md,
    2026-11-28, 09:56). A cache of one-byte elements (kv_dtype FP8) takes the same tiles: with V
    widened before shared memory (`_attend_tiles`), 128-token tiles were slower than 64-token ones
    everywhere but batch 1 at ctx 4096 (H200, HISTORY, 2026-11-28, 07:05); kv_dtype only names the
    cache in the error when nothing fits. With `limits` (a GPU's), the first of it and its
    fallbacks (a narrower merge tile, fewer stages, then narrower K/V tiles) whose shared memory
    fits them; None (Triton's CPU interpreter) gives small tiles, which it runs faster."""
    if limits is None:
        return 32, 1, 1, MERGE_TILE
    if one_warp:
        block_n, num_warps, num_stages = 32, 1, 2
    else:
        block_n, num_warps, num_stages = (32, 4, 2) if dtype == torch.float32 else (64, 4, 2)
    candidates = ((n, num_warps, stages, tile) for n in launch_limits.halvings(block_n, 16)
                  for stages in launch_limits.stages_down(num_stages)
                  for tile in launch_limits.halvings(MERGE_TILE, 2))
    kv = "" if kv_dtype in (None, dtype) else f", {kv_dtype} cache"
    return launch_limits.first_fit(f"decode attention (head_dim {head_dim}, group {group}, {dtype}{kv})", candidates,
                                   lambda c: shared_memory(c, group, head_dim, dtype.itemsize), lambda c: c[1],
                                   limits)


def _launch_args(batch, num_heads, kv_heads, head_dim, block_size, block_tables, dtype, kv_dtype, device,
                 num_splits, counters, block_n, num_warps, num_stages, merge_kernel=False):
    """(num_splits, partial buffers, counters, constexprs and launch options) shared by both entry points."""
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, block_tables.shape[1] * block_size, device)
    group = num_heads // kv_heads
    cfg_n, cfg_warps, cfg_stages, merge_tile = launch_config(
        dtype, head_dim, group, launch_limits.device_limits(device), kv_dtype,
        one_warp_programs(batch, kv_heads, device))
    if num_splits > 1:
        part_o = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
        if merge_kernel:
            counters = part_lse  # unused
        elif counters is None:
            counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)
        else:
            assert counters.dtype == torch.int32 and counters.numel() >= batch * kv_heads, \
                "counters: int32, one per (sequence, KV head)"
    else:
        part_o = part_lse = counters = block_tables  # unused
    meta = dict(BLOCK_SIZE=block_size, GROUP_PAD=max(16, triton.next_power_of_2(group)),
                GROUP_M=triton.next_power_of_2(group), BLOCK_D=triton.next_power_of_2(head_dim),
                BLOCK_N=block_n or cfg_n, SPLIT_TILE=min(merge_tile, triton.next_power_of_2(num_splits)),
                SPLIT=num_splits > 1, **dot_flags(dtype), PDL=pdl.mode(device, batch),
                UNMASKED_WHOLE=(num_warps or cfg_warps) == 1,
                num_warps=num_warps or cfg_warps, num_stages=num_stages or cfg_stages)
    return num_splits, part_o, part_lse, counters, meta


def _order_arg(seq_order, context_lens):
    """The kernels' order_ptr: seq_order, or a placeholder they never read."""
    if seq_order is None:
        return context_lens
    assert seq_order.dtype == torch.int32 and seq_order.shape == context_lens.shape and seq_order.stride(0) == 1, \
        "seq_order: int32, contiguous, one entry per sequence"
    return seq_order


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None,
                           *, seq_order=None, counters=None, merge_kernel=False, block_n=None, num_warps=None,
                           num_stages=None):
    """q [batch, heads, head_dim] -> [batch, heads, head_dim] in q's dtype: each sequence's query
    attends to all context_lens[i] tokens of its context, read through block_tables[i].

    seq_order: int32 [batch] listing every sequence once, in the order their programs start (the
    engine lists the longest contexts first: the module's docstring says why); None: row order. A
    sequence listed twice would race on its split counter (left set for the next call), one left
    out would have no output written.
    counters: int32 zeros, at least batch * kv_heads of them (split_counters makes one), which
    the call leaves zeroed; None allocates them per call. merge_kernel merges the splits in a
    second kernel instead, as before they merged in the first (for benchmarks to compare).
    block_n / num_warps / num_stages override the tuned launch config (tests and benchmarks)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert num_heads % kv_heads == 0, "query heads must be a multiple of KV heads"
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size: power of two >= 16"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert same_layout(k_cache, v_cache), "k_cache and v_cache: one shape and one layout"
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    num_splits, part_o, part_lse, counters, meta = _launch_args(
        batch, num_heads, kv_heads, head_dim, block_size, block_tables, q.dtype, k_cache.dtype, q.device, num_splits,
        counters, block_n, num_warps, num_stages, merge_kernel)
    _decode_kernel[(kv_heads * batch, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, _order_arg(seq_order, context_lens), out, part_o, part_lse,
        counters,
        scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_heads, num_heads // kv_heads, head_dim, num_splits,
        MERGE_HERE=not merge_kernel, ORDERED=seq_order is not None, launch_pdl=meta["PDL"] > 0, **meta)
    if num_splits > 1 and merge_kernel:
        _merge_splits_kernel[(batch, num_heads)](
            part_o, part_lse, out, context_lens, out.stride(0), out.stride(1), num_heads, head_dim,
            num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_D=meta["BLOCK_D"], PER_ROW=False,
            PDL=meta["PDL"], num_warps=2 if q.is_cuda else 1, launch_pdl=meta["PDL"] > 0)
    return out


def paged_decode_attention_from_qkv(qkv, positions, cos, sin, q_norm_weight, k_norm_weight, eps,
                                    k_cache, v_cache, slot_mapping, block_tables, context_lens, scale,
                                    num_splits=None, *, seq_order=None, counters=None, block_n=None, num_warps=None,
                                    num_stages=None):
    """A decode step's attention from the fused qkv projection [batch, (heads + 2 * kv_heads) *
    head_dim] (rows may be strided): what norm_rope_store and then paged_decode_attention do, in
    one launch. q/k are RMSNorm'd by q_norm_weight/k_norm_weight [head_dim] (None: no norm) and
    rotated by cos/sin [max_pos, head_dim] at positions [batch]; the new k and v are stored into
    the caches at slot_mapping (-1: not stored), which must be the slot of each sequence's last
    context position, context_lens[i] - 1. qkv is only read (q is not written back).
    Returns [batch, heads, head_dim] in qkv's dtype. seq_order, counters: as for
    paged_decode_attention; seq_order is read before the PDL wait, as the step's other inputs are,
    so no kernel before this one in the step may write it."""
    batch, width = qkv.shape
    _, block_size, kv_heads, head_dim = k_cache.shape
    num_heads = width // head_dim - 2 * kv_heads
    assert num_heads > 0 and width == (num_heads + 2 * kv_heads) * head_dim and num_heads % kv_heads == 0
    assert head_dim % 2 == 0 and block_size >= 16 and block_size & (block_size - 1) == 0
    has_norm = check_norm_rope_inputs(qkv, cos, sin, k_cache, v_cache, q_norm_weight, k_norm_weight, head_dim)
    assert same_layout(k_cache, v_cache), "k_cache and v_cache: one shape and one layout"
    out = torch.empty((batch, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if batch == 0:
        return out
    num_splits, part_o, part_lse, counters, meta = _launch_args(
        batch, num_heads, kv_heads, head_dim, block_size, block_tables, qkv.dtype, k_cache.dtype, qkv.device,
        num_splits, counters, block_n, num_warps, num_stages)
    qw, kw = (q_norm_weight, k_norm_weight) if has_norm else (cos, cos)  # placeholders, never read
    _decode_from_qkv_kernel[(kv_heads * batch, num_splits)](
        qkv, positions, cos, sin, qw, kw, slot_mapping,
        k_cache, v_cache, block_tables, context_lens, _order_arg(seq_order, context_lens), out, part_o, part_lse,
        counters, scale * LOG2E, eps,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_heads, kv_heads, num_heads // kv_heads, head_dim, num_splits,
        HAS_NORM=has_norm, ORDERED=seq_order is not None,
        EARLY_TABLE=not meta["UNMASKED_WHOLE"] and k_cache.dtype == qkv.dtype, launch_pdl=meta["PDL"] > 0, **meta)
    return out
