import torch
from torch import nn

from engine.distributed import collectives
from engine.layers import fp8


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

    def quantizes(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether forward_quantized can run on these inputs: the Triton kernel, one dtype, and no
        sum over the ranks' partial outputs, which forward fuses with the norm (reduce_slot) and
        forward_quantized does not do."""
        return (self.fused and self.reduce_slot is None and x.dim() == 2 and x.stride(1) == 1
                and x.dtype == self.weight.dtype and x.shape[1] % fp8.CUBLAS_ROWS["group"] == 0
                and (residual is None or residual.dtype == x.dtype and residual.stride(1) == 1))

    def forward_quantized(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """forward's result with the normed rows quantized for a block-scaled FP8 product
        (fp8.QuantizedRows), in one kernel; the residual, with one, as forward returns it, and
        without one x itself, as a sublayer's residual."""
        from kernels.rmsnorm import (
            rms_norm_fp8,  # start-up: Triton loads only where its kernels run
        )
        out = rms_norm_fp8(x, self.weight, self.eps, residual, **fp8.CUBLAS_ROWS)
        if residual is None:
            return fp8.QuantizedRows(*out, x.shape[0]), x
        (q, scales), summed = out
        return fp8.QuantizedRows(q, scales, x.shape[0]), summed

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
