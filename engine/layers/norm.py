import torch
from torch import nn

from engine.distributed import collectives


def rms_norm_float32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 x on CPU: the products and sums of the general form below (HF's), bit for
    bit, in fewer calls and temporaries; x * x is x.pow(2) exactly. On CPU each call costs more than
    its arithmetic at a decode step's size, and more again after a quantized product has streamed
    its weights through the caches: torch's own rms_norm makes ~20 calls inside."""
    scale = (x * x).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (x * scale).mul_(weight)


class RMSNorm(nn.Module):
    # Set by the runner when the Triton backend is in use: one fused kernel instead of ~6 ops.
    fused = False
    # Set on a norm whose input is a row-parallel layer's partial sum, left unreduced (see
    # CausalLM.defer_row_parallel_sums): the norm sums it over the ranks, fused with its residual
    # add where the group's fast path can. Consecutive such norms alternate between slots 0 and 1.
    reduce_slot: int | None = None

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.tp = collectives.current_group()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu and x.dtype == torch.float32 == self.weight.dtype:
            return rms_norm_float32(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With a residual, adds it first and returns (normed, new residual), the pre-norm
        transformer's pattern, so the sum is formed once."""
        if self.reduce_slot is not None:
            summed = self.tp.all_reduce_rms_norm(x, residual, self.weight, self.eps, self.reduce_slot)
            if summed is not None:
                return summed
            x = self.tp.all_reduce(x)
        if self.fused:
            from kernels.rmsnorm import (
                rms_norm,  # start-up: Triton loads only where its kernels run
            )
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
