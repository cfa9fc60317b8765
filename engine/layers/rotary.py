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

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, -1)
        return torch.cat([-x2, x1], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k
