"""Qwen3-MoE: Qwen3's decoder with a sparse mixture-of-experts block in place of the MLP (in every
layer but those `mlp_only_layers` and `decoder_sparse_step` keep dense), as HF transformers'
Qwen3MoeForCausalLM lays it out: no shared expert, the router's top-k renormalized when the
checkpoint's norm_topk_prob says so."""
import re

from torch import nn

from engine.layers.moe import FusedMoE, Router, route
from engine.layers.norm import RMSNorm
from engine.models.qwen3 import MLP, CausalLM

# model.layers.N.mlp.experts.E.{gate,up,down}_proj.{weight,weight_scale_inv}
_EXPERT_TENSOR = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv)")


class SparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = bool(config.norm_topk_prob)
        self.gate = Router(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.output_layer = self.experts  # whose `reduce` sums the ranks' partial outputs

    def forward(self, x, residual, norm: RMSNorm):
        """The experts' weighted sum for norm(x + residual); returns (it, the new residual)."""
        if residual is None:
            x, residual = norm(x), x
        else:
            x, residual = norm(x, residual)
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, weights, ids), residual


class Qwen3MoeForCausalLM(CausalLM):
    @staticmethod
    def make_mlp(config, layer_index: int) -> nn.Module:
        sparse = (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
                  and config.num_experts > 0 and (layer_index + 1) % getattr(config, "decoder_sparse_step", 1) == 0)
        return SparseMoeBlock(config) if sparse else MLP(config)

    def weight_target(self, name: str) -> tuple[str, object]:
        m = _EXPERT_TENSOR.fullmatch(name)
        if m:
            prefix, expert, which, kind = m.groups()
            stacked = "w2" if which == "down" else "w13"
            return f"{prefix}.{stacked}{'_scale_inv' if kind == 'weight_scale_inv' else ''}", (int(expert), which)
        return super().weight_target(name)
