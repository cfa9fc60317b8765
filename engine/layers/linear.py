"""Linear layers split across tensor-parallel ranks.

Column-parallel layers split the output features (each rank computes its own heads or MLP
columns); row-parallel layers split the input features and all-reduce the partial sums. Each
layer has a weight_loader that copies only this rank's slice of a checkpoint tensor into one of
its parameters.
"""
import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import collectives
from engine.layers import fp8
from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.quantized import quantize
from engine.layers.weights import copy_into, narrow, shape_of


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fused: bool) -> torch.Tensor:
    # A chat-sized decode step (1-8 rows): the Triton GEMV beats cuBLAS there (kernels/gemv.py).
    if fused and bias is None and x.dim() == 2 and 1 <= x.shape[0] <= 8 and x.stride(1) == 1:
        from kernels.gemv import (
            gemv,  # start-up: Triton loads only where its kernels run
        )
        return gemv(x, weight)
    return F.linear(x, weight, bias)


class _Linear(nn.Module):
    fused = False  # set by the runner with the Triton backend
    quantized = None  # the weight in fewer bits, after quantize (engine/layers/quantized.py)
    # Set by a model whose every use of this layer's output takes a quantized product's bf16 as it
    # comes (a residual add that promotes it, RoPE, SiLU-mul, the next quantized product): no cast
    # to float32 and back around each product.
    keeps_product_dtype = False

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int):
        super().__init__()
        self.tp = collectives.current_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.tp_dim = tp_dim
        # (block_n, block_k) while the weight is FP8 with block scales (engine/layers/fp8.py), else None.
        self.scale_block = fp8.current_block()
        weight_dtype = fp8.FP8 if self.scale_block else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=weight_dtype), requires_grad=False)
        if self.scale_block:
            grid = fp8.scale_grid((out_features, in_features), self.scale_block)
            self.weight_scale_inv = nn.Parameter(torch.empty(grid, dtype=torch.float32), requires_grad=False)
        else:
            self.register_parameter("weight_scale_inv", None)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if param.dim() == 1 and self.tp_dim == 1:  # a row-parallel bias is whole on every rank
            copy_into(param, loaded)
            return
        size = self.weight.shape[self.tp_dim]
        self._load_part(param, loaded, self.tp_dim, 0, self.tp_rank * size, size)

    def _load_part(self, param: nn.Parameter, loaded, dim: int, at: int, start: int, size: int) -> None:
        """Copies rows (along dim) [start, start + size) of the checkpoint tensor into rows
        [at, at + size) of param, counted in the weight's rows; an FP8 weight's scales take the
        blocks those rows fall in."""
        if param is self.weight_scale_inv:
            block = self.scale_block[dim]
            at, count = fp8.scale_span(at, size, block, param.shape[dim], "this rank's part")
            start, _ = fp8.scale_span(start, size, block, shape_of(loaded)[dim], "the checkpoint's scales")
            size = count
        elif param is self.weight and self.scale_block and not fp8.is_fp8(loaded):
            raise ValueError("stored unquantized in a block-FP8 checkpoint; nvchat keeps every projection of "
                             "such a checkpoint in FP8 (quantization='none' loads it dequantized)")
        if shape_of(loaded)[dim] < start + size:
            raise ValueError(f"has {shape_of(loaded)[dim]} {('rows', 'columns')[dim]}, need {start + size}")
        copy_into(param.data.narrow(dim, at, size), narrow(loaded, dim, start, size))

    def quantize(self, method: str, prebuilt=None) -> None:
        """Swaps the float weight for its quantized form: for "fp8", e4m3 with block scales
        (engine/layers/fp8.py); otherwise a CPU quantized weight (engine/layers/quantized.py), or
        prebuilt, that weight as a cache holds it (quantized.quantize)."""
        if method == "fp8":
            self.scale_block = fp8.DEFAULT_BLOCK
            q, scale = fp8.quantize_blocks(self.weight.data, self.scale_block)
            self.weight = nn.Parameter(q, requires_grad=False)
            self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
            return
        self.quantized = quantize(self.weight.data, method, prebuilt)
        self.weight = None

    def _multiply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized is not None:
            y = self.quantized.product(x) if self.keeps_product_dtype else self.quantized(x)
            return y if bias is None else y + bias
        if self.scale_block:
            y = fp8.linear(x, self.weight, self.weight_scale_inv, self.scale_block)
            return y if bias is None else y + bias
        return _project(x, self.weight, bias, self.fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._multiply(x, self.bias)

    def norm_forward(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
                     act: SiluAndMul | None = None,
                     consumer: "_Linear | None" = None) -> tuple[torch.Tensor | fp8.QuantizedRows, torch.Tensor]:
        """act(self(norm(x + residual))) and the new residual x + residual (x itself without one):
        a pre-norm sublayer's first projection. On a Triton decode step of one row it is one kernel,
        the norm in the GEMV's prologue and SiLU-mul in its epilogue (kernels.gemv.rms_norm_gemv).
        Before a block-scaled FP8 product the norm quantizes its output itself, as act does for
        `consumer`, the layer that takes its output (fp8.QuantizedRows)."""
        if self._fuses_norm(norm, x, residual, act):
            if self.scale_block:
                from kernels.fp8 import (
                    rms_norm_fp8_gemv,  # start-up: Triton loads only where its kernels run
                )
                return rms_norm_fp8_gemv(x, residual, norm.weight, norm.eps, self.weight, self.weight_scale_inv,
                                         self.scale_block)
            from kernels.gemv import (
                rms_norm_gemv,  # start-up: Triton loads only where its kernels run
            )
            return rms_norm_gemv(x, residual, norm.weight, norm.eps, self.weight, silu=act is not None)
        if norm.quantizes(x, residual) and self.takes_quantized_rows(x):
            x, residual = norm.forward_quantized(x, residual)
        elif residual is None:
            x, residual = norm(x), x
        else:
            x, residual = norm(x, residual)
        y = self(x)
        return (y if act is None else act(y, consumer)), residual

    def takes_quantized_rows(self, x: torch.Tensor) -> bool:
        """Whether the product of x [rows, ...] (its width aside: a SiLU-mul's input is twice its
        output's) runs through fp8.block_scaled_mm (cuBLAS's block-scaled FP8 product, or where
        fp8.w8a8_launch says so the W8A8 GEMV), so that the kernel making this layer's input may
        hand it over as fp8.QuantizedRows (fp8.block_scaled_mm_takes: one row only where the W8A8 GEMV runs it)."""
        return (self.scale_block is not None and self.quantized is None and x.dim() == 2
                and fp8.cublas_takes(x, self.weight, self.weight_scale_inv, self.scale_block)
                and fp8.block_scaled_mm_takes(x.shape[0], *self.weight.shape, x.device))

    def _fuses_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
                    act: SiluAndMul | None) -> bool:
        # Not with a CPU-quantized weight or a bias (Qwen2's qkv), nor where the norm also sums the
        # ranks' partial outputs (tensor parallel, reduce_slot).
        if not (self.fused and norm.fused and (act is None or act.fused) and self.quantized is None
                and self.bias is None and norm.reduce_slot is None and x.dim() == 2
                and x.stride(1) == 1 and x.dtype == norm.weight.dtype
                and (residual is None or residual.dtype == x.dtype and residual.stride(1) == 1)):
            return False
        if self.scale_block:
            # A block-FP8 weight at one row, where the one-row FP8 GEMV would take the normed row in
            # bf16 anyway (not where the norm hands it over quantized to the W8A8 GEMV), K short enough
            # (kernels.fp8.one_row_fuses_norm), and no SiLU-mul after it.
            from kernels import fp8 as fp8_kernels  # start-up: Triton loads only where its kernels run
            return (act is None and x.shape[0] == 1 and fp8_kernels.one_row_fuses_norm(x.shape[1])
                    and not self.takes_quantized_rows(x))
        if x.shape[0] == 1:
            return True
        # Which row counts and shapes fuse is kernels.gemv.fuses_norm's measured rule.
        from kernels import gemv, pdl  # start-up: Triton loads only where its kernels run
        return gemv.fuses_norm(x.shape[0], *self.weight.shape, pdl.supported(x.device))


class ColumnParallelLinear(_Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        tp = collectives.current_group().size
        super().__init__(in_features, _divide(out_features, tp, "output features"), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (gate and up of the MLP)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        self._load_part(param, loaded, 0, offset, self.tp_rank * size, size)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one matmul. With fewer KV heads than ranks, KV heads are
    replicated: each rank holds the one KV head its query heads attend to."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = collectives.current_group().size
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "number of attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "number of KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp, num_kv_heads, "tensor_parallel_size over KV heads")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, out * tp, bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, (self.tp_rank // self.kv_replicas) * kv_size
        self._load_part(param, loaded, 0, offset, start, size)


class RowParallelLinear(_Linear):
    # False where the next layer sums the ranks' partial outputs itself (RMSNorm.reduce_slot).
    reduce = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        tp = collectives.current_group().size
        super().__init__(_divide(in_features, tp, "input features"), out_features, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, on rank 0, so the all-reduce does not count it tp_size times.
        bias = self.bias if self.tp_rank == 0 else None
        y = self._multiply(x, bias)
        return self.tp.all_reduce(y) if self.reduce else y
