"""The three ways to run paged attention, behind one small interface the Attention layer calls."""
import importlib.util
import os

import torch
import torch.nn.functional as F

from engine.layers import paged_attention_torch as torch_ref
from engine.options import ATTENTION_BACKENDS


class TorchBackend:
    """Attention in torch ops. A step the runner prepares carries a StepContext, worked out on the
    host. Its prefill reads context lengths on the host, so only decode steps run in CUDA graphs,
    whose metadata has no step context: they take a variant of each op that reads nothing on the
    host (as does the graph's warmup run before capture). That variant gathers a whole table's
    width of K/V for every row, so its graphs stop at max_graph_rows rows: at 4K context
    Qwen3-0.6B's layer gathers 16 MiB a row."""

    name = "torch"
    max_graph_rows = 64

    def setup(self, dtype, head_dim, num_heads, kv_heads, device) -> None:
        self._dtype = dtype

    @staticmethod
    def plan_prefill(q_lens, context_lens, bucket_tokens):
        return None

    def step_context(self, plan, inputs: dict, block_size: int) -> torch_ref.StepContext:
        return torch_ref.StepContext(plan, inputs["block_tables"], inputs["context_lens"], block_size, self._dtype)

    @staticmethod
    def store(key, value, k_cache, v_cache, meta) -> None:
        if meta.context is None:
            return torch_ref.store_kv_in_graph(key, value, k_cache, v_cache, meta.slot_mapping)
        return torch_ref.store_step_kv(key, value, k_cache, v_cache, meta)

    @staticmethod
    def prefill(q, k_cache, v_cache, meta, scale):
        return torch_ref.sdpa_prefill_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, scale)

    @staticmethod
    def decode(q, k_cache, v_cache, meta, scale):
        if meta.context is None:
            return torch_ref.sdpa_decode_attention_in_graph(q, k_cache, v_cache, meta.block_tables,
                                                            meta.context_lens, scale)
        return torch_ref.sdpa_decode_attention(q, k_cache, v_cache, meta.context, scale)


class _KernelBackend:
    """What the Triton and flash-attn backends share: no host-side step context, and K/V written
    by the Triton store kernel."""

    @staticmethod
    def step_context(plan, inputs: dict, block_size: int) -> None:
        return None

    def store(self, k, v, k_cache, v_cache, meta) -> None:
        self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)


class TritonBackend(_KernelBackend):
    name = "triton"
    max_graph_rows = None  # decode graphs of any size the runner captures

    def __init__(self):
        # start-up: Triton loads only where its kernels run
        from kernels import decode_attention, prefill_attention
        from kernels.kv_store import store_kv
        from kernels.norm_rope_store import norm_rope_store
        self.store_kv = store_kv
        self.norm_rope_store = norm_rope_store
        self._decode = decode_attention
        self._prefill = prefill_attention.paged_prefill_attention
        self._work = prefill_attention  # its work-list planner and format
        self._counters = None

    def setup(self, dtype, head_dim, num_heads, kv_heads, device) -> None:
        """Keeps the model's attention shapes, so the runner can plan each step's work list on the
        host for the prefill kernel's launch, and allocates the decode kernel's split counters:
        once, before any graph capture, shared by every layer (each call leaves them zeroed)."""
        self._shape = (dtype, head_dim, num_heads // kv_heads, device)
        self._kv_heads = kv_heads
        self._counters = self._decode.split_counters(torch.device(device))

    def decode(self, q, k_cache, v_cache, meta, scale):
        return self._decode.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                                   seq_order=meta.seq_order, counters=self._counters)

    def decode_from_qkv(self, qkv, positions, cos, sin, q_norm_weight, k_norm_weight, eps, k_cache, v_cache,
                        slot_mapping, block_tables, context_lens, scale, seq_order=None):
        """A decode step's q/k norm, RoPE, K/V store and attention in one kernel, from the fused
        qkv projection; [batch, heads, head_dim]."""
        return self._decode.paged_decode_attention_from_qkv(
            qkv, positions, cos, sin, q_norm_weight, k_norm_weight, eps, k_cache, v_cache, slot_mapping,
            block_tables, context_lens, scale, seq_order=seq_order, counters=self._counters)

    def plan_prefill(self, q_lens, context_lens, bucket_tokens):
        """(items, token_splits, max_splits) of a prefill step; bucket_tokens is the token count of
        the CUDA graph it replays in (or its own), which fixes the kernel's tiles and split cap."""
        block_q, programs = self._work.launch_shape(*self._shape, bucket_tokens)
        return self._work.plan_work(q_lens, context_lens, block_q, self._kv_heads, programs,
                                    cap=self._work.split_cap(bucket_tokens))

    def prefill_inputs(self, planned) -> list[tuple[str, list[int], torch.dtype]]:
        """A planned work list as int32 step inputs, for the runner's one host->device copy."""
        items, token_splits, _ = planned
        return [("prefill_items", items, torch.int32),
                ("prefill_count", [len(items) // self._work.ITEM_FIELDS], torch.int32),
                ("token_splits", token_splits, torch.int32)]

    def prefill_work(self, inputs: dict, planned):
        """The kernel's PrefillWork over the step inputs that prefill_inputs added."""
        return self._work.PrefillWork(inputs["prefill_items"].view(-1, self._work.ITEM_FIELDS),
                                      inputs["prefill_count"], inputs["token_splits"], planned[2])

    def prefill(self, q, k_cache, v_cache, meta, scale):
        return self._prefill(q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                             scale, work=meta.prefill_work)


class FlashAttnBackend(_KernelBackend):
    """flash-attn's paged KV API; its block size must be a multiple of 256. K/V are written with our
    Triton store kernel, since flash-attn reads but does not write the paged cache here."""

    name = "flash_attn"
    max_graph_rows = None

    def __init__(self):
        # optional: the flash-attn package (nvchat[flash-attn])
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from kernels.kv_store import store_kv
        self.store_kv = store_kv
        self._varlen, self._with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def setup(self, dtype, head_dim, num_heads, kv_heads, device) -> None:
        pass

    plan_prefill = TorchBackend.plan_prefill

    def prefill(self, q, k_cache, v_cache, meta, scale):
        cu_k = F.pad(meta.context_lens.cumsum(0, dtype=meta.context_lens.dtype), (1, 0))
        return self._varlen(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=cu_k,
                            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=int(meta.context_lens.max()),
                            softmax_scale=scale, causal=True, block_table=meta.block_tables)

    def decode(self, q, k_cache, v_cache, meta, scale):
        out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                 block_table=meta.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def default_backend(device_type: str) -> str:
    if device_type == "cuda":
        return "triton"
    return "torch"


def make_backend(name: str, device_type: str, block_size: int):
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' on CPU needs TRITON_INTERPRET=1 (set it before starting)")
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"attention_backend='triton' needs a power-of-two kvcache_block_size >= 16, got {block_size}")
        return TritonBackend()
    if not flash_attn_available():
        raise ValueError("attention_backend='flash_attn' needs the flash-attn package (pip install 'nvchat[flash-attn]')")
    if device_type != "cuda":
        raise ValueError("attention_backend='flash_attn' runs on CUDA only")
    if block_size % 256:
        raise ValueError(f"attention_backend='flash_attn' needs kvcache_block_size to be a multiple of 256, got {block_size}")
    return FlashAttnBackend()
