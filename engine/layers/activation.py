import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import fp8


class SiluAndMul(nn.Module):
    fused = False  # set by the runner with the Triton backend

    def forward(self, x: torch.Tensor, consumer=None) -> torch.Tensor | fp8.QuantizedRows:
        """silu(gate) * up; quantized for consumer (the layer that takes the result) as
        fp8.QuantizedRows, in the same kernel, where it takes them (_Linear.takes_quantized_rows)."""
        if self.fused and consumer is not None and x.dim() == 2 and x.stride(1) == 1 \
                and consumer.takes_quantized_rows(x):
            from kernels.silu_mul import (
                silu_and_mul_fp8,  # start-up: Triton loads only where its kernels run
            )
            return fp8.QuantizedRows(*silu_and_mul_fp8(x, **fp8.CUBLAS_ROWS), x.shape[0])
        if self.fused:
            from kernels.silu_mul import (
                silu_and_mul,  # start-up: Triton loads only where its kernels run
            )
            return silu_and_mul(x)
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
