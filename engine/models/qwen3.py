"""Qwen3 dense decoder (q/k RMSNorm, GQA, RoPE, SwiGLU), which with two switches is also Qwen2
(attention bias, no q/k norm) and Llama (neither)."""
import torch
from torch import nn

from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention, AttentionMetadata
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    _Linear,
)
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding


def rope_settings(config) -> tuple[float, dict | None]:
    """rope theta and scaling from either transformers 4 (rope_theta, rope_scaling) or 5
    (rope_parameters) style configs."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or params
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


class DecoderAttention(nn.Module):
    # Set by the runner with the Triton backend: q/k norm, RoPE and the K/V store in one kernel.
    fused = False

    def __init__(self, config, max_position: int, qk_norm: bool, bias: bool, rotary: RotaryEmbedding | None = None):
        """rotary: a module to share with the other layers (its tables are the same for all); by
        default the layer builds its own."""
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary = rotary or rotary_embedding(config, self.head_dim, max_position)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions, x, residual, norm: RMSNorm, meta: AttentionMetadata):
        """Attention over norm(x + residual); returns (its output, the new residual)."""
        qkv, residual = self.qkv_proj.norm_forward(norm, x, residual)
        if self.fused:
            o = self.attn.forward_qkv(qkv, positions, self.rotary, self.q_norm, self.k_norm, meta)
            return self.o_proj(o), residual
        # qkv may be in a quantized product's bf16 (engine/layers/quantized.py): RoPE's float32 rows
        # promote q and k back to the model's dtype, and the store converts v.
        dtype = self.attn.dtype
        rows = self.rotary.rows_for_step(positions, meta.rope_rows, dtype)
        heads = self.num_heads
        # q and k side by side in qkv: one RoPE over both where no norm comes between.
        q_and_k = qkv[:, :self.q_size + self.kv_size].view(-1, heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            q_and_k = self.rotary.apply(q_and_k, rows)
            q, k = q_and_k[:, :heads], q_and_k[:, heads:]
        else:
            q_and_k = q_and_k.to(dtype)
            q = self.rotary.apply(self.q_norm(q_and_k[:, :heads]), rows)
            k = self.rotary.apply(self.k_norm(q_and_k[:, heads:]), rows)
        v = qkv[:, self.q_size + self.kv_size:]
        return self.o_proj(self.attn(q, k, v, meta)), residual


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)
        self.act = SiluAndMul()
        self.output_layer = self.down_proj  # whose `reduce` sums the ranks' partial outputs

    def forward(self, x, residual, norm: RMSNorm):
        """The MLP of norm(x + residual); returns (its output, the new residual)."""
        h, residual = self.gate_up_proj.norm_forward(norm, x, residual, self.act, consumer=self.down_proj)
        return self.down_proj(h), residual


def rotary_embedding(config, head_dim: int, max_position: int) -> RotaryEmbedding:
    theta, scaling = rope_settings(config)
    return RotaryEmbedding(head_dim, max_position, theta, scaling)


class DecoderLayer(nn.Module):
    def __init__(self, config, max_position: int, qk_norm: bool, bias: bool, mlp: nn.Module,
                 rotary: RotaryEmbedding | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, max_position, qk_norm, bias, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, positions, x, residual, meta):
        # Each sublayer applies its pre-norm, so that its first projection can take the norm in.
        x, residual = self.self_attn(positions, x, residual, self.input_layernorm, meta)
        return self.mlp(x, residual, self.post_attention_layernorm)


class DecoderModel(nn.Module):
    def __init__(self, config, max_position: int, qk_norm: bool, bias: bool, make_mlp):
        """make_mlp(config, layer index) builds each layer's MLP."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # One set of cos/sin tables for every layer: gathered once a step, and stored once (42 MB a
        # layer at head_dim 128 and 40,960 positions).
        rotary = rotary_embedding(config, head_dim, max_position)
        self.layers = nn.ModuleList(
            DecoderLayer(config, max_position, qk_norm, bias, make_mlp(config, i), rotary)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class CausalLM(nn.Module):
    # checkpoint module name -> (our module name, shard id passed to its weight_loader)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = True
    attention_bias = False

    def __init__(self, config, max_position: int):
        super().__init__()
        bias = getattr(config, "attention_bias", self.attention_bias)
        self.model = DecoderModel(config, max_position, self.qk_norm, bias, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def make_mlp(config, layer_index: int) -> nn.Module:
        return MLP(config)

    def weight_target(self, name: str) -> tuple[str, object]:
        """(our parameter's name, the shard id its layer's weight_loader takes, or None) for a
        checkpoint tensor's name."""
        for ckpt_part, (our_part, shard) in self.packed_modules.items():
            if f".{ckpt_part}." in name:
                return name.replace(ckpt_part, our_part), shard
        return name, None

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.compute_logits(hidden)

    def defer_row_parallel_sums(self) -> None:
        """Leaves the attention's and the MLP's output projections unreduced, and has the norm
        after each sum them over the ranks along with its residual add: one kernel instead of two
        per projection on a tensor-parallel decode step (TPGroup.all_reduce_rms_norm)."""
        layers = self.model.layers
        norms = []
        for i, layer in enumerate(layers):
            layer.self_attn.o_proj.reduce = layer.mlp.output_layer.reduce = False
            after_mlp = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            norms += [layer.post_attention_layernorm, after_mlp]
        for i, norm in enumerate(norms):
            norm.reduce_slot = i % 2

    def quantize(self, method: str, prebuilt: dict | None = None) -> None:
        """Every projection (and expert) to `method`'s weights. prebuilt: with int8 or int4, every
        quantized projection's weight by module name, as a cache holds them
        (engine/checkpoints/weight_cache.py), taken instead of quantizing the loaded weights (a
        KeyError for one it lacks). With int8 or int4 (CPU,
        engine/layers/quantized.py) the LM head goes to int8, or with int4 to int4 where it is tied to
        the embedding, whose float table then settles each row's leading logits (ParallelLMHead).
        Before that recompute, a 4-bit head lost SmolLM2's Paris in the answer's first token; an
        untied head has only its own quantized rows to recompute from, so it keeps 8 bits. With fp8
        (CUDA, engine/layers/fp8.py) the head stays in the model's dtype, as Qwen's FP8 checkpoints
        keep it."""
        for name, module in self.named_modules():
            if hasattr(module, "quantize") and module is not self and module is not self.lm_head:
                if prebuilt is not None and isinstance(module, _Linear):
                    module.quantize(method, prebuilt[name])
                else:
                    module.quantize(method)
        if method == "fp8":
            return
        # A tied head keeps its float table, from which ParallelLMHead recomputes each row's
        # leading logits: there int4 picks the same greedy tokens and reads half of int8's bytes
        # (SmolLM2's head, one row: 12.0 ms in int4 against 19.5 in int8, one thread, loaded 2-core box).
        head_method = "int4" if method == "int4" and self.tie_word_embeddings else "int8"
        self.lm_head.quantize(head_method, tied=self.tie_word_embeddings,
                              prebuilt=prebuilt["lm_head"] if prebuilt is not None else None)
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp) is not MLP:  # a mixture of experts: its products keep their float32
                continue
            for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                # Not where a row-parallel sum would add the ranks' bf16 partial sums.
                proj.keeps_product_dtype = proj.tp_size == 1

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]


class Qwen3ForCausalLM(CausalLM):
    pass


class Qwen2ForCausalLM(CausalLM):
    qk_norm = False
    attention_bias = True


class LlamaForCausalLM(CausalLM):
    qk_norm = False

