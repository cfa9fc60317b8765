"""The dense decoder's decode step (qwen3.py) on CPU, as one loop over its layers.

In eager PyTorch a small model's decode step spends more time in Python and in the dispatcher than
in its arithmetic: SmolLM2-135M's int4 step made ~8,500 operator calls, and its products were under
half of the step's time (issue 31). Here each layer's tensors are taken out of its modules once,
and a step makes only the calls its arithmetic needs: no module calls, the step's RoPE rows and
cache positions worked out once for every layer, one attention call for the whole batch. The
arithmetic is the modules' own, op for op, so a step's result equals DecoderModel.forward's bit
for bit (test_cpu_fast_paths); that forward stays the reference and runs every other step
(prompts, chunks)."""
import functools

import torch
import torch.nn.functional as F

from engine.layers import native_cpu
from engine.layers.attention import AttentionMetadata
from engine.layers.linear import _Linear
from engine.layers.quantized import NativeInt8Weight, Q4_1Weight
from engine.layers.norm import RMSNorm, rms_norm_float32
from engine.models.qwen3 import MLP, CausalLM, DecoderAttention, DecoderLayer


def _product(linear: _Linear):
    """x -> the layer's product, as _Linear.forward computes it on one rank."""
    quantized, bias = linear.quantized, linear.bias
    if quantized is None:
        return functools.partial(F.linear, weight=linear.weight, bias=bias)
    multiply = quantized.product if linear.keeps_product_dtype else quantized
    if bias is None:
        return multiply
    return lambda x: multiply(x) + bias


def _norm(norm: RMSNorm):
    """x -> norm(x), as RMSNorm computes it on CPU."""
    weight = norm.weight
    if weight.dtype == torch.float32:
        return functools.partial(rms_norm_float32, weight=weight, eps=norm.eps)
    return norm._norm


class _Layer:
    __slots__ = (
        "attn",
        "down",
        "gate_up",
        "head_dim",
        "heads",
        "input_norm",
        "k_heads",
        "k_norm",
        "k_slots",
        "kv_heads",
        "o",
        "post_norm",
        "q_norm",
        "qk_size",
        "qkv",
        "v_heads",
        "v_slots",
    )

    def __init__(self, layer: DecoderLayer):
        attention = layer.self_attn
        self.attn = attention.attn
        self.input_norm, self.post_norm = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
        self.qkv, self.o = _product(attention.qkv_proj), _product(attention.o_proj)
        self.gate_up, self.down = _product(layer.mlp.gate_up_proj), _product(layer.mlp.down_proj)
        self.q_norm = _norm(attention.q_norm) if attention.q_norm is not None else None
        self.k_norm = _norm(attention.k_norm) if attention.k_norm is not None else None
        self.heads, self.kv_heads, self.head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        self.qk_size = attention.q_size + attention.kv_size
        # Views of the layer's cache: by slot [slots, kv_heads, head_dim], and by head
        # [1, kv_heads, slots, head_dim], as attention reads a run of consecutive slots.
        k_cache, v_cache = self.attn.k_cache, self.attn.v_cache
        self.k_slots = k_cache.view(-1, self.kv_heads, self.head_dim)
        self.v_slots = v_cache.view(-1, self.kv_heads, self.head_dim)
        self.k_heads, self.v_heads = self.k_slots.transpose(0, 1)[None], self.v_slots.transpose(0, 1)[None]


class CpuDecode:
    """Runs decode steps of a dense CausalLM whose layers all use the torch attention backend.
    Built once the KV cache is allocated: it keeps views of it."""

    def __init__(self, model: CausalLM):
        decoder = model.model
        self.embedding = decoder.embed_tokens.weight
        self.rotary = decoder.layers[0].self_attn.rotary
        self.layers = [_Layer(layer) for layer in decoder.layers]
        self.final_norm = _norm(decoder.norm)
        self.final_norm_weight, self.final_norm_eps = decoder.norm.weight, decoder.norm.eps
        self.dtype = self.embedding.dtype
        self.native_layers = self._native_layers(model)
        self.native = self.native_layers is not None

    @staticmethod
    def _native_layers(model: CausalLM) -> list["_NativeLayer"] | None:
        """The layers as the C step takes them, where it can run the model: float32 norms and
        embedding, every product a native kernel's (Q4_1Weight, NativeInt8Weight) without a bias,
        Llama's or Qwen3's attention. None otherwise, and for float32 weights, which keep torch's operations,
        whose rounding HF's model shares: with them a step equals HF's token for token."""
        if native_cpu.native_kernels() is None:
            return None
        decoder = model.model
        norms = [p for name, p in model.named_parameters() if "norm" in name]
        if not all(t.dtype == torch.float32 for t in [*norms, decoder.embed_tokens.weight]):
            return None
        linears = [m for m in model.modules() if isinstance(m, _Linear)]
        if not linears or not all(isinstance(m.quantized, (Q4_1Weight, NativeInt8Weight)) and m.bias is None
                                  for m in linears):
            return None
        return [_NativeLayer(layer) for layer in decoder.layers]

    @staticmethod
    def supports(model) -> bool:
        """A dense decoder of this module's classes, on one rank, every layer sharing one RoPE."""
        if not isinstance(model, CausalLM) or model.model.embed_tokens.tp_size != 1:
            return False
        rotary = model.model.layers[0].self_attn.rotary
        return all(type(layer) is DecoderLayer and type(layer.self_attn) is DecoderAttention
                   and type(layer.mlp) is MLP and not layer.self_attn.fused and layer.self_attn.rotary is rotary
                   for layer in model.model.layers)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states of a decode step, one row per sequence."""
        if self.native:
            return self._native_step(input_ids, positions, meta)
        context = meta.context
        batch = input_ids.shape[0]
        cos, sin = self.rotary.rows_for_step(positions, meta.rope_rows, self.dtype)
        slot = context.single_slot
        slots = meta.slot_mapping
        # Where the keys are: a run of consecutive slots of the one sequence, or gathered.
        start = context.run_start
        end = start + context.longest if start is not None else None
        gather, mask, longest = context.slots, context.mask, context.longest
        x = F.embedding(input_ids, self.embedding)
        residual = None
        for layer in self.layers:
            heads, kv_heads, head_dim = layer.heads, layer.kv_heads, layer.head_dim
            if residual is None:
                residual = x
            else:
                residual = x + residual
            qkv = layer.qkv(layer.input_norm(residual))
            # RoPE as RotaryEmbedding.apply, over q and k together where no norm comes between.
            q_and_k = qkv[:, :layer.qk_size].view(batch, heads + kv_heads, head_dim)
            if layer.q_norm is None:
                halves = q_and_k.view(batch, heads + kv_heads, 2, head_dim // 2)
                q_and_k = (halves * cos + halves.flip(2) * sin).view(batch, heads + kv_heads, head_dim)
                q, k = q_and_k[:, :heads], q_and_k[:, heads:]
            else:
                q_and_k = q_and_k.to(self.dtype)
                q, k = layer.q_norm(q_and_k[:, :heads]), layer.k_norm(q_and_k[:, heads:])
                q, k = self.rotary.apply(q, (cos, sin)), self.rotary.apply(k, (cos, sin))
            v = qkv[:, layer.qk_size:].view(batch, kv_heads, head_dim)
            # The K/V store, as paged_attention_torch.store_step_kv.
            if slot is not None:
                layer.k_slots[slot:slot + 1] = k
                layer.v_slots[slot:slot + 1] = v
            else:
                layer.k_slots.index_copy_(0, slots, k)
                layer.v_slots.index_copy_(0, slots, v.to(self.dtype))
            # Attention, as paged_attention_torch.sdpa_decode_attention.
            if start is not None:
                keys, values = layer.k_heads[:, :, start:end], layer.v_heads[:, :, start:end]
            else:
                keys = layer.k_slots.index_select(0, gather).view(batch, longest, kv_heads, head_dim).transpose(1, 2)
                values = layer.v_slots.index_select(0, gather).view(batch, longest, kv_heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(q.view(batch, kv_heads, -1, head_dim), keys, values, attn_mask=mask,
                                               scale=layer.attn.scale)
            x = layer.o(o.reshape(batch, heads * head_dim))
            residual = x + residual
            gate, up = layer.gate_up(layer.post_norm(residual)).chunk(2, -1)
            x = layer.down(F.silu(gate) * up)
        return self.final_norm(x + residual)

    def _native_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step in C: nine calls a layer (four of them the quantized products), made straight on the
        tensors' addresses: the Python between them was a fifth of a SmolLM2 step's time. The same
        arithmetic as __call__'s in another order of rounding."""
        context = meta.context
        batch = input_ids.shape[0]
        first = self.layers[0]
        heads, kv_heads, head_dim = first.heads, first.kv_heads, first.head_dim
        cos, sin = self.rotary.rows_for_step(positions, meta.rope_rows, torch.float32)
        cos, sin = cos.reshape(batch, head_dim).contiguous(), sin.reshape(batch, head_dim).contiguous()
        slots = meta.slot_mapping.long()
        if context.run_start is not None:  # one sequence, its keys in a run of slots
            table = torch.arange(context.run_start, context.run_start + context.longest).view(1, -1)
        else:
            table = context.slots.view(batch, context.longest)
        lengths = meta.context_lens.long()
        residual = F.embedding(input_ids, self.embedding)  # a new tensor: added to in place below
        hidden, x, out = torch.empty_like(residual), torch.empty_like(residual), torch.empty_like(residual)
        queries = torch.empty(batch, heads, head_dim)
        attended = torch.empty(batch, heads * head_dim)
        layer0 = self.native_layers[0]
        qkv = torch.empty(batch, layer0.qkv[1][-1])
        gate_up = torch.empty(batch, layer0.gate_up[1][-1])
        activated = torch.empty(batch, layer0.gate_up[1][-1] // 2)
        kernels, threads, dim = native_cpu.native_kernels(), torch.get_num_threads(), residual.shape[1]
        norm, rope_store, attention, silu_mul = (kernels.add_rms_norm, kernels.rope_store, kernels.decode_attention,
                                                 kernels.silu_mul)
        p_residual, p_hidden, p_x, p_queries, p_attended, p_qkv, p_gate_up, p_activated = (
            t.data_ptr() for t in (residual, hidden, x, queries, attended, qkv, gate_up, activated))
        p_cos, p_sin, p_slots, p_table, p_lengths = (t.data_ptr() for t in (cos, sin, slots, table, lengths))
        width, activated_width = table.shape[1], activated.shape[1]
        added = None  # the residual's addend: none before the first layer, then each layer's output
        for layer in self.native_layers:
            norm(added, p_residual, layer.input_norm, layer.eps, p_hidden, batch, dim)
            gemv, weight = layer.qkv
            gemv(p_hidden, batch, dim, *weight, p_qkv, threads, 1)
            rope_store(p_qkv, batch, heads, kv_heads, head_dim, p_cos, p_sin, layer.q_norm, layer.k_norm,
                       layer.qk_eps, p_slots, layer.k_cache, layer.v_cache, p_queries)
            if attention(p_queries, batch, heads, kv_heads, head_dim, layer.k_cache, layer.v_cache, p_table, width,
                         p_lengths, layer.scale, p_attended, threads) != 0:
                raise MemoryError("the attention kernel could not allocate its scores")
            gemv, weight = layer.o
            gemv(p_attended, batch, heads * head_dim, *weight, p_x, threads, 1)
            norm(p_x, p_residual, layer.post_norm, layer.eps, p_hidden, batch, dim)
            gemv, weight = layer.gate_up
            gemv(p_hidden, batch, dim, *weight, p_gate_up, threads, 1)
            silu_mul(p_gate_up, batch, activated_width, p_activated)
            gemv, weight = layer.down
            gemv(p_activated, batch, activated_width, *weight, p_x, threads, 1)
            added = p_x
        norm(added, p_residual, self.final_norm_weight.data_ptr(), self.final_norm_eps, out.data_ptr(), batch, dim)
        return out


class _NativeLayer:
    """A layer's addresses and sizes as the C step passes them: a product's C function and its
    weight's arguments (Q4_1's nibbles, scales and minimums, or int8's values and row scales, then
    out_features), the norms' weights (0 for none: Llama has no q/k norm), the caches."""
    __slots__ = ("down", "eps", "gate_up", "input_norm", "k_cache", "k_norm", "o", "post_norm", "q_norm",
                 "qk_eps", "qkv", "scale", "v_cache")

    def __init__(self, layer: DecoderLayer):
        attention = layer.self_attn

        kernels = native_cpu.native_kernels()

        def product(linear: _Linear) -> tuple[object, tuple[int, ...]]:
            q = linear.quantized
            if isinstance(q, Q4_1Weight):
                return kernels.q4_1_gemv, (q.nibbles.data_ptr(), q.scales.data_ptr(), q.minimums.data_ptr(),
                                           q.out_features)
            return kernels.q8_gemv, (q.q.data_ptr(), q.scales.data_ptr(), q.out_features)
        self.qkv, self.o = product(attention.qkv_proj), product(attention.o_proj)
        self.gate_up, self.down = product(layer.mlp.gate_up_proj), product(layer.mlp.down_proj)
        self.input_norm = layer.input_layernorm.weight.data_ptr()
        self.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        self.eps = layer.input_layernorm.eps
        self.q_norm = attention.q_norm.weight.data_ptr() if attention.q_norm is not None else None
        self.k_norm = attention.k_norm.weight.data_ptr() if attention.k_norm is not None else None
        self.qk_eps = attention.q_norm.eps if attention.q_norm is not None else 0.0
        self.k_cache, self.v_cache = attention.attn.k_cache.data_ptr(), attention.attn.v_cache.data_ptr()
        self.scale = attention.attn.scale
