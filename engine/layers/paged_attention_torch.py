"""Attention over the paged KV cache in plain PyTorch.

This is the reference the Triton kernels are tested against, and (with the SDPA versions at the
end, which tests check against it) the CPU backend. Caches are
[num_blocks, block_size, kv_heads, head_dim] per layer; sequence i's tokens live in the blocks
listed in block_tables[i], in order.
"""
import torch
import torch.nn.functional as F


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def _writable(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache as [slots, kv_heads, head_dim] to index_copy_ into: an FP8 cache's bytes,
    since torch has no FP8 index_copy_ on CPU."""
    flat = cache.view(-1, *cache.shape[2:])
    return flat.view(torch.uint8) if cache.dtype == FP8 else flat


def _as_stored(new: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """new as `cache` keeps it, in _writable's dtype. FP8 saturates at +-448, as the kernels' store
    does."""
    if cache.dtype == FP8:
        return new.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    return new.to(cache.dtype)


def _select(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """flat.index_select(0, index), an FP8 cache's through its bytes: torch's FP8 kernels are few."""
    if flat.dtype == FP8:
        return flat.view(torch.uint8).index_select(0, index).view(FP8)
    return flat.index_select(0, index)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatters key/value [tokens, kv_heads, head_dim] to their slots; slot -1 means skip."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    _writable(k_cache).index_copy_(0, slots, _as_stored(key[keep], k_cache))
    _writable(v_cache).index_copy_(0, slots, _as_stored(value[keep], v_cache))


class StepContext:
    """Where a step's tokens go in the cache and, for a decode step, where each sequence's context
    lies, worked out once on the host for every layer of the step.

    A decode step reads its keys either as one run of consecutive slots (one sequence whose blocks
    are consecutive, as a lone conversation's usually are: a view, nothing copied), or gathered
    slot by slot into [sequences, longest context], with an additive mask over the padding of the
    shorter ones, so that one attention call serves the whole batch."""

    def __init__(self, plan, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                 dtype: torch.dtype):
        # The scheduler gives every token a slot; only the GPU warmup's steps have -1 ("skip").
        self.all_slots_valid = min(plan.slot_mapping) >= 0
        # A one-token step's slot, for a store without an index tensor (engine.models.cpu_decode).
        self.single_slot = plan.slot_mapping[0] if len(plan.slot_mapping) == 1 and self.all_slots_valid else None
        self.run_start = self.slots = self.mask = None
        if not plan.is_decode:
            return
        lens = plan.context_lens
        self.longest = longest = max(lens)
        if len(lens) == 1 and _consecutive(plan.block_tables[0], -(-longest // block_size)):
            self.run_start = plan.block_tables[0][0] * block_size
            return
        device = block_tables.device
        blocks = block_tables[:, :-(-longest // block_size)].long()
        offsets = torch.arange(block_size, device=device)
        slots = (blocks.unsqueeze(-1) * block_size + offsets).view(len(lens), -1)[:, :longest]
        if min(lens) < longest:
            padding = torch.arange(longest, device=device) >= context_lens.unsqueeze(-1)
            # The padding reads the sequence's first slot again: slots past its length may never
            # have been written (the CPU cache starts uninitialised), and a NaN there would
            # survive its zero weight (0 * NaN).
            slots = torch.where(padding, slots[:, :1], slots)
            mask = torch.zeros(padding.shape, dtype=dtype, device=device).masked_fill_(padding, float("-inf"))
            self.mask = mask[:, None, None]  # [sequences, 1, 1, keys]: over every head and query
        self.slots = slots.reshape(-1)


def _consecutive(table, blocks: int) -> bool:
    """Whether the table's first `blocks` block ids run one after another."""
    first = table[0]
    return table[blocks - 1] - first == blocks - 1 and all(table[i] == first + i for i in range(1, blocks - 1))


def store_step_kv(key, value, k_cache, v_cache, meta) -> None:
    """store_kv with the step's context: no mask to compute where every token has a slot."""
    if not meta.context.all_slots_valid:
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        return
    _writable(k_cache).index_copy_(0, meta.slot_mapping, _as_stored(key, k_cache))
    _writable(v_cache).index_copy_(0, meta.slot_mapping, _as_stored(value, v_cache))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    # index_select, not cache[blocks]: a third of the time for a decode step's few blocks on CPU.
    return _select(cache, block_table[:num_blocks]).flatten(0, 1)[:length]


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale):
    """Causal attention for varlen queries. Sequence i's queries are the last
    (cu_seqlens_q[i+1] - cu_seqlens_q[i]) positions of its context_lens[i] tokens, whose K/V are
    all in the cache already (prefix-cached, chunked and plain prefills alike)."""
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for i, length in enumerate(lens):
        qs, qe = cu[i], cu[i + 1]
        if qe == qs:
            continue
        k = gather_context(k_cache, block_tables[i], length).float().repeat_interleave(group, dim=1)
        v = gather_context(v_cache, block_tables[i], length).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), k) * scale
        query_pos = torch.arange(length - (qe - qs), length, device=q.device)
        key_pos = torch.arange(length, device=q.device)
        scores.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """One query per sequence ([batch, heads, head_dim]) at the last position of its context."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_prefill_attention(q, k_cache, v_cache, cu, context_lens, block_tables, scale)


def sdpa_decode_attention(q, k_cache, v_cache, context: StepContext, scale):
    """paged_decode_attention in one call of torch's fused attention for the whole batch (the CPU
    engine's decode). A sequence's one query per head becomes, for each KV head, a short query
    block of the heads that share it, so no causal mask is needed: only the padding's, where
    contexts differ in length. Given 4-D inputs, torch's CPU flash kernel does the rest (1.5x the
    3-D inputs' math path at 500 tokens of context, 2.2x at 4,000)."""
    batch, kv_heads, head_dim = q.shape[0], k_cache.shape[2], k_cache.shape[3]
    longest = context.longest
    if context.run_start is not None:
        start = context.run_start
        k = k_cache.view(-1, kv_heads, head_dim)[start:start + longest]
        v = v_cache.view(-1, kv_heads, head_dim)[start:start + longest]
    else:
        k = _select(k_cache.view(-1, kv_heads, head_dim), context.slots)
        v = _select(v_cache.view(-1, kv_heads, head_dim), context.slots)
    k = k.to(q.dtype).view(batch, longest, kv_heads, head_dim).transpose(1, 2)
    v = v.to(q.dtype).view(batch, longest, kv_heads, head_dim).transpose(1, 2)
    grouped = q.view(batch, kv_heads, -1, head_dim)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=context.mask, scale=scale)
    return out.reshape(batch, -1, head_dim)  # the kernel's output is a transposed view


def sdpa_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale):
    """paged_prefill_attention through torch's fused attention, a sequence at a time (the CPU
    engine's prefill). Given 4-D inputs its CPU flash kernel takes the causal mask, or a boolean
    one for queries after a cached prefix, and the KV heads' sharing (enable_gqa) without
    materialising the scores: ~6x the reference's speed for a 1,500-token prompt."""
    out = torch.empty_like(q)
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for i, length in enumerate(lens):
        qs, qe = cu[i], cu[i + 1]
        if qe == qs:
            continue
        k = gather_context(k_cache, block_tables[i], length).to(q.dtype).transpose(0, 1)[None]
        v = gather_context(v_cache, block_tables[i], length).to(q.dtype).transpose(0, 1)[None]
        queries = q[qs:qe].transpose(0, 1)[None]
        if qe - qs == length:  # no cached prefix: plain causal
            mask = None
        else:  # the queries are the last positions: each sees the keys up to its own
            query_pos = torch.arange(length - (qe - qs), length, device=q.device)
            mask = torch.arange(length, device=q.device)[None, :] <= query_pos[:, None]
        attended = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, is_causal=mask is None,
                                                  scale=scale, enable_gqa=True)
        out[qs:qe] = attended[0].transpose(0, 1)
    return out


# --- For CUDA graphs: no host syncs, shapes fixed by the inputs' ----------------------------------


def store_kv_in_graph(key, value, k_cache, v_cache, slot_mapping) -> None:
    """store_kv without reading anything on the host, so a CUDA graph can capture it (store_kv's
    boolean mask counts the kept rows on the host). Every row writes: a skipped row (slot -1)
    writes what the first kept row writes, where it writes it, or, when no row is kept, slot 0's
    own contents back to slot 0. Writes to one slot then carry equal bytes, whichever lands last."""
    if slot_mapping.shape[0] == 0:
        return
    rows = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
    keep = slot_mapping >= 0
    first_kept = torch.where(keep, rows, slot_mapping.shape[0]).amin() % slot_mapping.shape[0]
    source = torch.where(keep, rows, first_kept)
    slots = slot_mapping.index_select(0, source).clamp(min=0)
    any_kept = keep.any()
    for new, cache in ((key, k_cache), (value, v_cache)):
        flat = _writable(cache)
        kept = torch.where(any_kept, _as_stored(new, cache).index_select(0, source), flat.index_select(0, slots))
        flat.index_copy_(0, slots, kept)


def sdpa_decode_attention_in_graph(q, k_cache, v_cache, block_tables, context_lens, scale):
    """sdpa_decode_attention for a CUDA graph: every sequence reads its table's whole width (the
    graph's fixed shape) and masks the positions past its context, all in one batched call. Those
    positions read the sequence's first slot again, as StepContext's padding does: table entries
    past a sequence's blocks may hold anything, and slots past its context may never have been
    written, where a NaN would survive its zero weight (0 * NaN). A sequence of context 0 would
    attend to nothing (NaN); the decode graphs pad with context 1."""
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    width = block_tables.shape[1]
    positions = torch.arange(width * block_size, device=q.device)
    blocks = block_tables.clamp(0, num_blocks - 1).long()
    slots = (blocks[:, :, None] * block_size + positions[:block_size]).view(batch, -1)
    visible = positions[None, :] < context_lens[:, None]
    slots = torch.where(visible, slots, slots[:, :1]).flatten()
    k = _select(k_cache.view(-1, num_kv_heads, head_dim), slots)
    v = _select(v_cache.view(-1, num_kv_heads, head_dim), slots)
    k = k.to(q.dtype).view(batch, width * block_size, num_kv_heads, head_dim).transpose(1, 2)
    v = v.to(q.dtype).view(batch, width * block_size, num_kv_heads, head_dim).transpose(1, 2)
    grouped = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim)
