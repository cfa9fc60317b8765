from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """What attention needs to find each token's sequence in the paged cache, built by the runner
    once per step and shared by every layer."""

    slot_mapping: torch.Tensor  # [tokens]: cache slot each new token's K/V goes to
    context_lens: torch.Tensor  # [seqs]: tokens in cache for each sequence after this step
    block_tables: torch.Tensor  # [seqs, max_blocks]
    cu_seqlens_q: torch.Tensor  # [seqs + 1]: query token offsets
    max_seqlen_q: int
    is_decode: bool  # exactly one query token per sequence
    # A decode step's rows in the order its attention starts them (StepPlan.longest_first), int32
    # [seqs]; None: in row order.
    seq_order: torch.Tensor | None = None
    # Prefill with the triton backend: the step's work list (kernels.prefill_attention.PrefillWork),
    # planned on the host from the step plan; None plans it inside the kernel call (a sync).
    prefill_work: object | None = None
    # With the torch backend: where the step's context lies in the cache, worked out once on the
    # host for every layer (paged_attention_torch.StepContext).
    context: object | None = None
    # Each rotary module's cos/sin rows for the step's positions, gathered by the first layer that
    # needs them (RotaryEmbedding.rows_for_step).
    rope_rows: dict = field(default_factory=dict)


class Attention(nn.Module):
    """Writes this step's K/V into the layer's cache, then attends over the cached context with
    whichever backend the engine picked (torch, triton or flash_attn)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = None  # set by the runner
        self.k_cache = self.v_cache = torch.empty(0)
        # The model's dtype (the runner builds the model under it as torch's default): what q and k
        # are computed in, whichever dtype the cache keeps them in.
        self.dtype = torch.get_default_dtype()

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        self.backend.store(k, v, self.k_cache, self.v_cache, meta)
        return self.attend(q, meta)

    def forward_qkv(self, qkv, positions, rotary, q_norm, k_norm, meta: AttentionMetadata) -> torch.Tensor:
        """From the fused qkv projection, with a backend that has the fused kernels (triton): q/k
        RMSNorm (if the model has them), RoPE, the K/V store, and attention. A decode step does it
        all in the attention kernel; any other step runs norm_rope_store, then attention."""
        norms = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None else (None, None, 0.0)
        b = self.backend
        if meta.is_decode:
            o = b.decode_from_qkv(qkv, positions, rotary.cos, rotary.sin, *norms, self.k_cache, self.v_cache,
                                  meta.slot_mapping, meta.block_tables, meta.context_lens, self.scale,
                                  seq_order=meta.seq_order)
            return o.reshape(-1, self.num_heads * self.head_dim)
        q = b.norm_rope_store(qkv, positions, rotary.cos, rotary.sin, self.k_cache, self.v_cache, meta.slot_mapping,
                              self.num_heads, self.num_kv_heads, *norms)
        return self.attend(q, meta)

    def attend(self, q, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over the cache, which already holds this step's K/V."""
        q = q.view(-1, self.num_heads, self.head_dim)
        b = self.backend
        if meta.is_decode:
            o = b.decode(q, self.k_cache, self.v_cache, meta, self.scale)
        else:
            o = b.prefill(q, self.k_cache, self.v_cache, meta, self.scale)
        return o.reshape(-1, self.num_heads * self.head_dim)
