"""Causal varlen attention over the paged KV cache, for every kind of prefill step.

Sequence i's queries are the last q_len_i positions of its context_lens[i] tokens, and all of its
K/V, new tokens included, are read from the cache through its block table. So one kernel serves
plain prefill (q_len == context), prefix-cached and chunked prefill (q_len < context) and decode
tokens mixed into a prefill batch (q_len == 1).

A unit of work is BLOCK_Q queries of one sequence, all query heads of one KV head (the rows of its
tiles are (query, head-in-group) pairs, so each K/V tile is loaded once per GQA group), and one
split of the keys those queries see. The host lists the units of a step (`plan_work`), heaviest
first, and a fixed number of programs walks the list. So a CUDA graph captured for a bucket of
steps runs exactly the units of the step it replays: a padding slot or a decode token costs no
idle programs, and a long key range is split (then merged by log-sum-exp) only where the queries
alone would leave SMs idle, such as a prompt chunk or a short turn after a long cached prefix.
"""
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import launch_limits, pdl
from kernels.decode_attention import (
    LOG2E,
    _dot,
    _kv_offsets,
    _merge_splits_kernel,
    _sm_count,
    dot_flags,
    same_layout,
)
from kernels.fp8 import fp16_scaled_query

MAX_SPLITS = 16
# A split shorter than this costs more in its fixed work (load Q, write a partial) than it saves.
MIN_SPLIT_KEYS = 128
# Split partials are fp32 rows of [tokens, heads, splits]: a step of many tokens has tiles enough
# to fill the GPU unsplit, so its split cap shrinks to keep the partials near this many token rows.
PARTIAL_TOKEN_ROWS = 2048
ITEM_FIELDS = 4  # a work item: (sequence, query tile, split, splits of that tile)
# Steps of at most this many query tokens get the small-step launch config (see launch_config).
SMALL_STEP_TOKENS = 128


def split_cap(tokens: int) -> int:
    """The most splits a step of `tokens` query tokens may use. Equal for every step size a
    power of two bounds alike, so a CUDA graph bucket's partials fit every step it replays."""
    return max(1, min(MAX_SPLITS, PARTIAL_TOKEN_ROWS // triton.next_power_of_2(max(tokens, 1))))


@dataclass
class PrefillWork:
    """A step's work list on the device. items: [rows >= count, ITEM_FIELDS] int32; count: [1]
    int32, the items in use; token_splits: [tokens] int32, the splits of each query token's tile
    (0 for padding); max_splits: the partial buffers' split dimension (>= every tile's splits)."""

    items: torch.Tensor
    count: torch.Tensor
    token_splits: torch.Tensor
    max_splits: int


def plan_work(q_lens: list[int], context_lens: list[int], block_q: int, kv_heads: int, num_programs: int, *,
              cap: int | None = None, num_splits: int | None = None) -> tuple[list[int], list[int], int]:
    """The units of one step, on the host: (items flattened, token_splits, max splits used).

    Without num_splits, a tile gets one split per whole share of keys (at least one, at most cap,
    by default split_cap of the step's tokens; no share shorter than MIN_SPLIT_KEYS). The share is
    sized so that the units fit one pass of the programs where they can: on an H200 a 120-query
    chunk over 8K keys took 46 us in 8 splits (128 units on 132 programs) and 78 us in 9, whose
    last 12 units ran as a second pass. Tiles shorter than a share (decode tokens mixed into the
    step) still take a unit each, so the share is spread over the rest of the programs: counted
    in the share instead, 8 decode tokens beside a 56-query chunk at 8K keys pushed 28 of 160
    units into a second pass and the call took 50 us against 31 for the chunk alone. num_splits
    forces every tile's count (tests and sweeps). Items run heaviest first, so the programs that
    walk the list in strides finish close together."""
    tiles = []  # (keys the tile's last query sees, sequence, query tile, first token, tokens)
    first = 0
    for seq, (q_len, ctx) in enumerate(zip(q_lens, context_lens)):
        for t in range(triton.cdiv(q_len, block_q)):
            end = min((t + 1) * block_q, q_len)
            tiles.append((ctx - q_len + end, seq, t, first + t * block_q, end - t * block_q))
        first += q_len
    cap = cap or split_cap(first)
    share = _split_share([t[0] for t in tiles], max(num_programs // kv_heads, 1))
    tiles = [(num_splits or max(1, min(cap, int(t[0] // share))), *t) for t in tiles]
    tiles.sort(key=lambda t: -t[1] / t[0])  # keys per unit
    items, token_splits, most = [], [0] * first, 1
    for splits, keys, seq, t, start, n in tiles:
        most = max(most, splits)
        for split in range(splits):
            items += (seq, t, split, splits)
        token_splits[start:start + n] = [splits] * n
    return items, token_splits, most


def _split_share(keys: list[int], slots: int) -> float:
    """Keys per split such that the tiles' units, one at least per tile, fit `slots` (units per KV
    head in one pass) where the tile count allows. Each round gives the tiles found shorter than
    the share their one unit and spreads the rest over the slots left; the share only grows."""
    total = sum(keys)
    share = max(total / slots, MIN_SPLIT_KEYS)
    while True:
        light = [k for k in keys if k < share]
        left = slots - len(light)
        if left <= 0:
            return share
        wider = max((total - sum(light)) / left, MIN_SPLIT_KEYS)
        if wider <= share:
            return share
        share = wider


@dataclass(frozen=True)
class LaunchConfig:
    block_q: int  # queries per tile
    block_m: int  # rows per tile: queries x the GQA group padded to a power of two
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    per_sm: int  # programs per SM


def shared_memory(config: LaunchConfig, head_dim: int, itemsize: int) -> int:
    """An upper estimate of a launch's shared memory in bytes (kernels/launch_limits.py says how it
    counts): per stage a K and a V tile, and q and the probabilities on their way into the dots."""
    block_d = triton.next_power_of_2(head_dim)
    per_stage = 2 * config.block_n * block_d
    return (config.num_stages * per_stage + config.block_m * (block_d + config.block_n)) * itemsize


def _tiles(rows: int, group: int) -> tuple[int, int]:
    """(queries, rows) of a tile of about `rows` rows: whole padded GQA groups, 16 rows at least
    (tl.dot wants them)."""
    group_pad = triton.next_power_of_2(group)
    block_q = max(16 // group_pad, rows // group_pad, 1)
    return block_q, block_q * group_pad


@functools.cache  # every launch and every step's plan ask: the search stays off the host path
def launch_config(dtype: torch.dtype, head_dim: int, group: int, tokens: int,
                  limits: launch_limits.DeviceLimits | None, block_m: int | None = None) -> LaunchConfig:
    """The launch for a step of `tokens` query tokens (a CUDA graph's bucket size, or the eager
    step's own count). Tuned by sweeps on an H200 (bf16, head_dim 128, 16/8 heads):
    - Big steps: 128 x 128 tiles were best or within 7% for a 120-query chunk over 2K and 8K keys
      and a 50-query turn after 2K cached keys (`benchmarks/bench_kernels.py --sweep-prefill-only`).
      Such a program fills an SM's shared memory, hence one per SM.
    - Steps of at most SMALL_STEP_TOKENS, a prompt chunk beside decoding streams or a short turn:
      64 x 64 tiles at two programs per SM hide more of the paged loads' latency, and a decode
      token's tile wastes half as many rows. A 56-query chunk beside 8 decode tokens took 26 us
      instead of 44 at 4K keys; a 32-query one 30 instead of 53 at 8K (both with decode tokens at
      300 keys); a 50-query turn after 2K cached keys 19 instead of 20.
    With `limits` (a GPU's), the first of the tuned launch and its fallbacks (fewer stages, then
    fewer keys, then fewer rows per tile) whose shared memory fits them; None (Triton's CPU
    interpreter) gives small tiles, which it runs faster. block_m overrides the rows (tests)."""
    if limits is None:
        rows, block_n, num_warps, num_stages, per_sm = 32, 32, 1, 1, 1
    elif dtype == torch.float32:
        # Exact float32 dots run on the CUDA cores with their operands in registers: 64-row tiles
        # on 4 warps spilled 7,136 bytes a thread on an H100, local memory the driver then keeps
        # for every thread the card holds (~1.8 GiB). Half the rows on twice the warps hold them.
        rows, block_n, num_warps, num_stages, per_sm = 32, 32, 8, 2, 2
    elif head_dim > 128:
        rows, block_n, num_warps, num_stages, per_sm = 64, 32, 4, 2, 2
    elif tokens <= SMALL_STEP_TOKENS:
        rows, block_n, num_warps, num_stages, per_sm = 64, 64, 4, 3, 2
    else:
        rows, block_n, num_warps, num_stages, per_sm = 128, 128, 8, 2, 1
    rows = block_m or rows
    if limits is None:
        return LaunchConfig(*_tiles(rows, group), block_n, num_warps, num_stages, per_sm)
    candidates = (LaunchConfig(*_tiles(m, group), n, num_warps, stages, per_sm)
                  for m in launch_limits.halvings(rows, rows if block_m else 16)
                  for n in launch_limits.halvings(block_n, 16)
                  for stages in launch_limits.stages_down(num_stages))
    return launch_limits.first_fit(f"prefill attention (head_dim {head_dim}, group {group}, {dtype})", candidates,
                                   lambda c: shared_memory(c, head_dim, dtype.itemsize), lambda c: c.num_warps,
                                   limits)


def launch_shape(dtype: torch.dtype, head_dim: int, group: int, device: torch.device, tokens: int,
                 block_m: int | None = None) -> tuple[int, int]:
    """(queries per tile, programs) that paged_prefill_attention uses for a step of `tokens` query
    tokens: what the host needs to plan the step's work list."""
    config = launch_config(dtype, head_dim, group, tokens, launch_limits.device_limits(device), block_m)
    return config.block_q, _programs(config, device)


def _programs(config: LaunchConfig, device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) * config.per_sm


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, q_pos, table, k_head, v_head, lo, hi, qk_scale,
                  stride_cb, stride_ct,
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
        # K and V lie at the same offsets of their caches (one layout): the rows are found once.
        rows = _kv_offsets(table, pos, valid, stride_cb, stride_ct, BLOCK_SIZE)
        # An FP8 cache's tiles widen to q's dtype for the dot, fp16 or float32 (exact: every e4m3
        # value is an fp16 one).
        k = tl.load(k_head + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
        if CAUSAL:
            s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A split can show a row only masked keys; a finite stand-in keeps exp2 away from -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    cu_seqlens_ptr, context_lens_ptr, block_tables_ptr, items_ptr, count_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt,
    num_heads, kv_heads, max_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    pdl.start(PDL)
    pdl.wait(PDL)  # it reads only what earlier kernels write (q, the caches, the work list)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    g = r % GROUP_PAD
    units = tl.load(count_ptr) * kv_heads
    # Over an e4m3 cache bf16 queries go into the products as fp16, already scaled (decode
    # attention's reason: the tiles widen to fp16 in one instruction, to bf16 in several).
    FP16_PRODUCTS: tl.constexpr = k_ptr.dtype.element_ty.is_fp8() and q_ptr.dtype.element_ty == tl.bfloat16
    score_scale = qk_scale
    if FP16_PRODUCTS:
        score_scale = 1.0
    # Units are (item, KV head) pairs, item-major: every head of the heaviest items goes first.
    for unit in range(tl.program_id(0), units, tl.num_programs(0)):
        item = items_ptr + (unit // kv_heads) * 4
        kv_head = unit % kv_heads
        seq = tl.load(item)
        q_tile = tl.load(item + 1)
        split = tl.load(item + 2)
        num_splits = tl.load(item + 3)
        q_start = tl.load(cu_seqlens_ptr + seq)
        q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
        ctx = tl.load(context_lens_ptr + seq)

        qi = q_tile * BLOCK_Q + r // GROUP_PAD
        row_mask = (qi < q_len) & (g < GROUP)
        q_pos = ctx - q_len + qi
        token = (q_start + qi).to(tl.int64)
        head = kv_head * GROUP + g
        q = tl.load(q_ptr + (token * stride_qt + head * stride_qh)[:, None] + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        if FP16_PRODUCTS:
            q = fp16_scaled_query(q, qk_scale)

        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        k_head = k_ptr + kv_head * stride_ch
        v_head = v_ptr + kv_head * stride_ch
        # Keys past the tile's last query are masked for every row: stop there. Keys up to its
        # first query are visible to every row: whole tiles of those skip the causal mask.
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
                                      score_scale, stride_cb, stride_ct, BLOCK_SIZE, BLOCK_N,
                                      BLOCK_D, HEAD_DIM, False, PRECISION, UPCAST)
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, table, k_head, v_head, tl.maximum(lo, full), hi,
                                      score_scale, stride_cb, stride_ct, BLOCK_SIZE, BLOCK_N,
                                      BLOCK_D, HEAD_DIM, True, PRECISION, UPCAST)

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        mask = row_mask[:, None] & d_mask[None, :]
        if num_splits > 1:
            # Partial rows of [tokens, heads, max_splits], merged by the merge kernel.
            part = (token * num_heads + head) * max_splits + split
            tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=mask)
            tl.store(part_lse_ptr + part, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=row_mask)
        else:
            tl.store(out_ptr + (token * stride_ot + head * stride_oh)[:, None] + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=mask)


def plan_on_device(q, k_cache, cu_seqlens_q, context_lens, *, num_splits=None, block_m=None, num_programs=None,
                   cap=None) -> PrefillWork:
    """The work list of a paged_prefill_attention call with these inputs, planned from the device
    tensors (reading them is a sync: plan before capturing a graph). For callers without a step
    plan on the host: tests and benchmarks (num_programs and cap override the launch's program
    count and the split cap, for sweeps)."""
    num_heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    block_q, programs = launch_shape(q.dtype, head_dim, num_heads // kv_heads, q.device, q.shape[0], block_m)
    cu = cu_seqlens_q.tolist()
    items, token_splits, most = plan_work([b - a for a, b in zip(cu, cu[1:])], context_lens.tolist(), block_q,
                                          kv_heads, num_programs or programs, cap=cap, num_splits=num_splits)
    token_splits += [0] * (q.shape[0] - len(token_splits))
    rows = torch.tensor(items or [0] * ITEM_FIELDS, dtype=torch.int32).view(-1, ITEM_FIELDS)
    return PrefillWork(rows.to(q.device), torch.tensor([len(items) // ITEM_FIELDS], dtype=torch.int32).to(q.device),
                       torch.tensor(token_splits, dtype=torch.int32).to(q.device), most)


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, *,
                            work: PrefillWork | None = None, num_splits=None, num_programs=None,
                            block_m=None, block_n=None, num_warps=None, num_stages=None):
    """q [tokens, heads, head_dim] (sequences packed by cu_seqlens_q) -> [tokens, heads, head_dim] in
    q's dtype. context_lens[i] >= q_len_i.

    work: the step's work list, planned on the host by plan_work with launch_shape's block_q and
    programs for q's token count (the engine builds it from its step plan: no sync, and a CUDA
    graph replays whatever list its buffers hold). Without it the list is planned here from
    cu_seqlens_q and context_lens, which reads them on the host (a sync); num_splits then forces
    every tile's split count. block_m / block_n /
    num_warps / num_stages / num_programs override the tuned launch config (tests and benchmarks;
    with work given, block_m must match the one it was planned with)."""
    tokens, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert num_heads % kv_heads == 0, "query heads must be a multiple of KV heads"
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size: power of two >= 16"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert same_layout(k_cache, v_cache), "k_cache and v_cache: one shape and one layout"
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if tokens == 0 or cu_seqlens_q.shape[0] < 2:
        return out
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    config = launch_config(q.dtype, head_dim, group, tokens, launch_limits.device_limits(q.device), block_m)
    block_q, programs = config.block_q, _programs(config, q.device)
    if work is None:
        work = plan_on_device(q, k_cache, cu_seqlens_q, context_lens, num_splits=num_splits, block_m=block_m)
    # Eagerly the list is exact; in a graph its buffer is the bucket's bound and every program runs.
    programs = min(num_programs or programs, work.items.shape[0] * kv_heads)
    split = work.max_splits > 1
    if split:
        part_o = torch.empty((tokens, num_heads, work.max_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((tokens, num_heads, work.max_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    block_d = triton.next_power_of_2(head_dim)
    pdl_mode = pdl.mode(q.device)
    _prefill_kernel[(programs,)](
        q, k_cache, v_cache, out, part_o, part_lse, cu_seqlens_q, context_lens, block_tables,
        work.items, work.count, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_heads, kv_heads, work.max_splits,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        BLOCK_M=block_q * group_pad, BLOCK_D=block_d, BLOCK_N=block_n or config.block_n,
        **dot_flags(q.dtype), PDL=pdl_mode, num_warps=num_warps or config.num_warps,
        num_stages=num_stages or config.num_stages,
        launch_pdl=pdl_mode > 0)
    if split:
        # Rows of tokens instead of sequences, each merging the splits of its own tile.
        _merge_splits_kernel[(tokens, num_heads)](
            part_o, part_lse, out, work.token_splits, out.stride(0), out.stride(1), num_heads, head_dim,
            work.max_splits, SPLITS_PAD=triton.next_power_of_2(work.max_splits), BLOCK_D=block_d, PER_ROW=True,
            PDL=pdl_mode, num_warps=2 if q.is_cuda else 1, launch_pdl=pdl_mode > 0)
    return out
