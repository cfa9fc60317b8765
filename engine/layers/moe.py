"""A mixture-of-experts MLP (Qwen3-MoE's sparse block): a router picks each token's top-k experts,
whose SwiGLU MLPs run and are summed with the router's weights.

On CUDA the routing and the experts run in kernels/fused_moe.py: a handful of launches per layer,
whatever the number of experts, with no host sync and no shape taken from the routing, so decode
steps capture in CUDA graphs like a dense model's. On CPU it is plain torch, expert by expert as HF
transformers computes it.

Tensor parallelism splits every expert's intermediate dimension, as a dense MLP's is split: each
rank holds all experts, gate/up column-parallel and down row-parallel, and the ranks' partial
outputs are summed like a row-parallel projection's. Every rank then does the same share of every
token's work whatever the routing (splitting whole experts over the ranks leaves a rank idle
whenever a step's tokens pick few of its experts, and needs the tokens sent to the ranks holding
their experts), and a batch-1 decode step reads 1/tp of each chosen expert on every rank.
"""
import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import collectives
from engine.layers import fp8
from engine.layers.weights import copy_into, narrow, shape_of


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, top_k], expert ids int32 [T, top_k]): the top_k of softmax(logits)
    taken in float32, divided by their sum with renormalize (the checkpoint's norm_topk_prob)."""
    if logits.is_cuda:
        from kernels.fused_moe import (
            route as route_kernel,  # start-up: Triton loads only where its kernels run
        )
        return route_kernel(logits.contiguous(), top_k, renormalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.int()


class Router(nn.Module):
    """The router's linear layer, [num_experts, hidden], whole on every rank."""
    # Set by the runner with the Triton backend: 1-8 rows take the Triton GEMV, as the
    # projections do (engine/layers/linear.py).
    fused = False

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2 and 1 <= x.shape[0] <= 8 and x.stride(1) == 1:
            from kernels.gemv import (
                gemv,  # start-up: Triton loads only where its kernels run
            )
            return gemv(x, self.weight)
        return F.linear(x, self.weight)


class FusedMoE(nn.Module):
    """The experts of one layer, stacked: w13 [E, 2I, H] (each expert's gate rows, then its up
    rows) and w2 [E, H, I], I being this rank's share of the intermediate dimension. In FP8 (built
    inside fp8.building, or after quantize("fp8")) each has float32 block scales beside it."""

    # False where the next layer sums the ranks' partial outputs itself (RMSNorm.reduce_slot).
    reduce = True

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.tp = collectives.current_group()
        if intermediate_size % self.tp.size:
            raise ValueError(f"the experts' intermediate size ({intermediate_size}) is not divisible by "
                             f"tensor_parallel_size ({self.tp.size})")
        inter = intermediate_size // self.tp.size
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, inter
        self.scale_block = fp8.current_block()
        dtype = fp8.FP8 if self.scale_block else None
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=dtype), requires_grad=False)
        if self.scale_block:
            for name in ("w13", "w2"):
                grid = fp8.scale_grid(getattr(self, name).shape, self.scale_block)
                setattr(self, f"{name}_scale_inv", nn.Parameter(torch.empty(grid, dtype=torch.float32),
                                                                requires_grad=False))
        else:
            self.register_parameter("w13_scale_inv", None)
            self.register_parameter("w2_scale_inv", None)
        self._loaded: set[tuple[str, int, str]] = set()  # (parameter, expert, which) the checkpoint gave

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: tuple[int, str]) -> None:
        """One expert's gate_proj, up_proj or down_proj (shard_id: (expert, "gate" | "up" |
        "down")), or its FP8 scales: this rank's rows of gate and up, its columns of down."""
        expert, which = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"is expert {expert}, but the config has {self.num_experts} experts")
        inter, rank = self.intermediate_size, self.tp.rank
        # (dimension split over the ranks, where this rank's part goes in the stacked weight)
        dim, at = (1, 0) if which == "down" else (0, 0 if which == "gate" else inter)
        start, size = rank * inter, inter
        scales = param is self.w13_scale_inv or param is self.w2_scale_inv
        if scales:
            block = self.scale_block[dim]
            at, count = fp8.scale_span(at, size, block, param.shape[dim + 1], "this rank's part of the experts")
            start, _ = fp8.scale_span(start, size, block, shape_of(loaded)[dim], "the checkpoint's scales")
            size = count
        elif self.scale_block and not fp8.is_fp8(loaded):
            raise ValueError("stored unquantized in a block-FP8 checkpoint; nvchat keeps every expert of such a "
                             "checkpoint in FP8 (quantization='none' loads it dequantized)")
        if shape_of(loaded)[dim] < start + size:
            raise ValueError(f"has {shape_of(loaded)[dim]} {('rows', 'columns')[dim]}, need {start + size}")
        copy_into(param.data[expert].narrow(dim, at, size), narrow(loaded, dim, start, size))
        self._loaded.add((next(n for n, p in self.named_parameters() if p is param), expert, which))

    def missing_weights(self) -> list[str]:
        """The experts' weights no checkpoint tensor has filled, as checkpoint-style names."""
        missing = []
        for name, param in self.named_parameters():
            kind = "weight_scale_inv" if name.endswith("_scale_inv") else "weight"
            parts = ("down",) if name.startswith("w2") else ("gate", "up")
            missing += [f"{e}.{which}_proj.{kind}" for e in range(self.num_experts) for which in parts
                        if (name, e, which) not in self._loaded]
        return missing

    def quantize(self, method: str) -> None:
        """"fp8": e4m3 with block scales per expert. The CPU quantizations (int8, int4) leave the
        experts in their dtype: torch's quantized CPU kernels take one 2-D weight a call."""
        if method != "fp8":
            return
        self.scale_block = fp8.DEFAULT_BLOCK
        for name in ("w13", "w2"):
            q, scale = fp8.quantize_blocks(getattr(self, name).data, self.scale_block)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_scale_inv", nn.Parameter(scale, requires_grad=False))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of the experts' weighted sum for each row of x [T, H], summed over the
        ranks unless `reduce` is off."""
        if x.is_cuda:
            from kernels.fused_moe import (
                fused_moe,  # start-up: Triton loads only where its kernels run
            )
            y = fused_moe(x.contiguous(), self.w13, self.w2, topk_weights, topk_ids, w13_scale=self.w13_scale_inv,
                          w2_scale=self.w2_scale_inv, scale_block=self.scale_block)
        else:
            y = self._forward_torch(x, topk_weights, topk_ids)
        return self.tp.all_reduce(y) if self.reduce else y

    def _forward_torch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # As HF transformers' Qwen3MoeExperts: expert by expert, over the tokens that chose it (the
        # tensors' shapes come from the routing: CPU only). The router's weights are rounded to x's
        # dtype first, as HF rounds them. FP8 weights never reach here: on CPU they load dequantized.
        out = torch.zeros_like(x)
        weights = topk_weights.to(x.dtype)
        for expert in torch.unique(topk_ids).tolist():
            tokens, slot = torch.where(topk_ids == expert)
            gate, up = F.linear(x[tokens], self.w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[expert]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y)
        return out
