"""Weight-only int8 for CPU (`LLM(..., quantization="int8")`): each projection keeps its weight as
int8 with one scale per output row, and multiplies through torch's int8 weight kernel with bf16
activations. A batch-1 decode step reads a quarter of float32's bytes; the logits move away from
the float model's by the rounding (not bit-exact against HF)."""
import torch

QUANTIZATIONS = ("int8",)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: weight ~= q * scales[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(torch.bfloat16)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # The kernel wants 2-D activations in the scales' dtype; with float32 ones it is ~5x slower.
    rows = x.reshape(-1, x.shape[-1]).to(scales.dtype).contiguous()
    y = torch._weight_int8pack_mm(rows, q, scales)
    return y.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])
