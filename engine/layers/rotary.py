import math

import torch
from torch import nn


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1's rope scaling: long wavelengths slowed by `factor`, short ones kept, and a smooth
    blend in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, blended, out)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves), as Qwen and Llama checkpoints expect; cos/sin are
    precomputed in float32 for every position up to max_position."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_scaled(inv_freq, scaling)
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {rope_type!r}")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.register_buffer("_half_signs", torch.tensor([-1.0, 1.0]).view(2, 1), persistent=False)

    def rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin rows of a step's positions, shaped [tokens, 1, 2, head_dim / 2] to broadcast
        over heads and the two halves, in dtype; sin's first half negated, so that apply's flip of
        the halves is rotate_half. Gathered once a step for every layer (rows_for_step)."""
        t, half = positions.shape[0], self.cos.shape[-1] // 2
        cos = self.cos[positions].view(t, 1, 2, half)
        sin = self.sin[positions].view(t, 1, 2, half) * self._half_signs
        return cos.to(dtype), sin.to(dtype)

    def rows_for_step(self, positions: torch.Tensor, step_rows: dict, dtype: torch.dtype):
        """rows(), gathered by the first layer of a step that uses this module and kept in
        step_rows (the step's AttentionMetadata.rope_rows) for the others."""
        rows = step_rows.get(self)
        if rows is None:
            rows = step_rows[self] = self.rows(positions, dtype)
        return rows

    @staticmethod
    def apply(x: torch.Tensor, rows) -> torch.Tensor:
        """x [tokens, heads, head_dim], rotated: x * cos + rotate_half(x) * sin, the same products
        and sum as HF's (negating a factor is exact), in four ops instead of nine. A strided x (a
        slice of the fused qkv) is fine; the result is new, in the dtype x and the rows promote to."""
        cos, sin = rows
        t, h, d = x.shape
        halves = x.view(t, h, 2, d // 2)
        return (halves * cos + halves.flip(2) * sin).view(t, h, d)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        rows = self.rows(positions, q.dtype)
        return self.apply(q, rows), self.apply(k, rows)
