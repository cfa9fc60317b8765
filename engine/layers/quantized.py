"""Weight-only quantization for CPU (`LLM(..., quantization="int8" | "int4")`): the projections
(and the LM head, in int8: CausalLM.quantize) keep their weights in fewer bits and multiply
through torch's CPU kernels for them, with bf16 activations. A batch-1 decode step is bound by the
bytes of weight it reads, a quarter (int8) or an eighth (int4) of float32's. The logits move away
from the float model's by the rounding: not bit-exact against HF.

- int8: symmetric, one scale per output row.
- int4: asymmetric, a scale and a minimum per 32 weights of a row, as GGUF's Q4_1 stores them, so
  a Q4_1 file's projections come back on their own grid (up to bf16 rounding of the scales)."""
import torch
import torch.nn.functional as F

INT4_GROUP = 32


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: weight ~= q * scales[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(torch.bfloat16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    # The kernels want 2-D bf16 activations; with float32 ones the int8 kernel is ~5x slower.
    return x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()


class Int8Weight:
    def __init__(self, weight: torch.Tensor):
        self.q, self.scales = quantize_rows(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(_rows(x), self.q, self.scales)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.q.shape[0])


class Int4Weight:
    def __init__(self, weight: torch.Tensor):
        rows, cols = weight.shape
        if cols % INT4_GROUP:
            raise ValueError(f"int4 needs input features in multiples of {INT4_GROUP}, this layer has {cols}")
        self.out_features = rows
        padded = rows + (-rows % 16)  # the packing kernel takes rows in multiples of 16
        w = F.pad(weight.float(), (0, 0, 0, padded - rows)).view(padded, cols // INT4_GROUP, INT4_GROUP)
        low = w.amin(-1)
        scale = ((w.amax(-1) - low) / 15).clamp(min=1e-12)
        q = torch.round((w - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.view(padded, cols), 1)
        # The kernel computes (q - 8) * scale + zero: zero is the group's value at q = 8.
        self.scales_and_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(_rows(x), self.packed, INT4_GROUP, self.scales_and_zeros)
        return y[:, :self.out_features].to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def quantize(weight: torch.Tensor, method: str):
    """A callable x -> x @ weight.T, in `method`'s bits."""
    return {"int8": Int8Weight, "int4": Int4Weight}[method](weight)
