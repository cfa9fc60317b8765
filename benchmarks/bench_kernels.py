"""Times each Triton kernel against its torch-eager equivalent at Qwen3-0.6B shapes (16 query heads,
8 KV heads, head_dim 128, hidden 1024, intermediate 3072, bf16) and prints a table; JSON goes to
--out. The mixture-of-experts kernels run at Qwen3-30B-A3B's experts (128 of hidden 2048 and 768
columns, 8 chosen a token) against a loop over the chosen experts with cuBLAS (HF transformers'
way), and the FP8 GEMV and GEMM at Qwen3-8B's projections against cuBLAS in bf16, the bf16
Triton GEMV and torch._scaled_mm (FP8 with a scale per row of x and of W, not per block); "fp8
linear" is the engine's FP8 product (engine/layers/fp8.py: cuBLAS's block-scaled FP8 from 2 rows
where it runs) against bf16 cuBLAS and kernels/fp8.py's Triton dispatch.

Times are medians from triton.testing.do_bench, per call. 'eager' launches every call from Python,
as an uncaptured engine step does; 'graph' replays a CUDA graph of the calls, as the engine's
captured decode step does, so launch overhead drops out. Decode calls rotate over distinct
per-layer caches, as one decode step does, so that K/V come from HBM rather than L2; bandwidth is
bytes of K/V read / graph time, against the H200's 4.25 TB/s.

    python benchmarks/bench_kernels.py [--out benchmarks/out/kernels.json] [--sweep]

--sweep also times the decode and prefill kernels over launch configs (tile size, warps, stages,
split count), which is how their defaults were chosen; --sweep-decode-only and --sweep-prefill-only
time one of them, over an e4m3 cache with --kv-cache-dtype fp8. --decode-launches only compares the ways a
decode step's attention can launch (see run_decode_launches), with PDL on and off. --moe-fp8 runs
only the mixture-of-experts and FP8 rows, --adjust-logits only the adjusted sampling's logits
adjustments, --draws only the sampling draws' kernels, --w8a8 only the W8A8 GEMV's launches against the
engine's FP8 product (run_w8a8); --sweep-moe-fp8 times those kernels over launch configs, the
fused MoE's FP8 GEMV kernels one at a time included (give it --sweep-budget 600);
--sweep-moe-down times the unquantized fused MoE's GEMV down launches (DOWN_GEMV_TILES). Without
CUDA (TRITON_INTERPRET=1) it runs tiny shapes once, as a smoke test of this script, and times
nothing meaningful (Triton 3.9's interpreter gets bf16 tl.dot wrong, so the grouped MoE path's and
the FP8 GEMV's and GEMM's smoke diffs at several rows are garbage there).
"""
import argparse
import datetime
import itertools
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.layers.activation import SiluAndMul  # noqa: E402
from engine.layers import fp8 as fp8_layer  # noqa: E402
from engine.layers.fp8 import quantize_blocks  # noqa: E402
from engine.layers.paged_attention_torch import store_kv_in_graph as torch_store_kv_in_graph  # noqa: E402
from engine.layers.norm import RMSNorm  # noqa: E402
from engine.layers.rotary import RotaryEmbedding  # noqa: E402
from engine.options import KV_CACHE_DTYPES  # noqa: E402
from engine.runner.decode_graphs import adjust_logits_torch  # noqa: E402
from kernels import fp8 as fp8_kernels  # noqa: E402
from engine.runner.sampler import _beyond_top_k, _draw_from, draw  # noqa: E402
from kernels.adjust_logits import adjust_logits  # noqa: E402
from kernels import fused_moe  # noqa: E402
from kernels.decode_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_from_qkv,
    split_counters,
)
from kernels.exponential_noise import exponential_noise  # noqa: E402
from kernels.gemv import gemv  # noqa: E402
from kernels.norm_rope_store import norm_rope_store  # noqa: E402
from kernels.prefill_attention import paged_prefill_attention, plan_on_device  # noqa: E402
from kernels.rmsnorm import rms_norm  # noqa: E402
from kernels.silu_mul import silu_and_mul  # noqa: E402
from kernels.temperature_draw import temperature_draw  # noqa: E402
from kernels.top_p_sampling import top_p_draw  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 16, 8, 128, 1024, 3072
DTYPE = torch.bfloat16
PEAK_BYTES_PER_S = 4.25e12
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SMOKE = not CUDA


# -- timing -------------------------------------------------------------------------------------

def time_eager(fn, calls=1):
    """Median ms per call of fn (which makes `calls` calls)."""
    if SMOKE:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3 / calls
    import triton.testing  # start-up: the CPU smoke run never loads Triton's GPU benchmarking
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") / calls


def time_graph(fn, calls=1):
    """Median ms per call of a CUDA graph replaying fn's `calls` calls."""
    if SMOKE:
        return None
    import triton.testing  # start-up: the CPU smoke run never loads Triton's GPU benchmarking
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median") / calls
    del graph
    return ms


def us(ms):
    return None if ms is None else round(ms * 1e3, 2)


# -- torch-eager equivalents --------------------------------------------------------------------

def torch_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Batched, graph-capturable eager decode: gather each sequence's blocks, mask, SDPA."""
    k = k_cache[block_tables.long()].flatten(1, 2).transpose(1, 2)  # [batch, kv_heads, len, dim]
    v = v_cache[block_tables.long()].flatten(1, 2).transpose(1, 2)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < context_lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                         enable_gqa=True)
    return out[:, :, 0]


def torch_prefill_one(q, k_cache, v_cache, block_table, context_len, scale):
    """One sequence's prefill in eager torch: gather its K/V, SDPA with a bottom-right causal mask."""
    blocks = (context_len + k_cache.shape[1] - 1) // k_cache.shape[1]
    k = k_cache[block_table[:blocks].long()].flatten(0, 1)[:context_len].transpose(0, 1)[None]
    v = v_cache[block_table[:blocks].long()].flatten(0, 1)[:context_len].transpose(0, 1)[None]
    qt = q.transpose(0, 1)[None]
    if q.shape[0] == context_len:
        out = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(context_len - q.shape[0], context_len, device=q.device)
        mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


# -- setups -------------------------------------------------------------------------------------

def paged_cache(lens, block_size, layers, dtype=None):
    """[2, layers, blocks, block_size, kv_heads, dim] in dtype (DTYPE by default) with each sequence
    on shuffled blocks."""
    need = [(n + block_size - 1) // block_size for n in lens]
    total = sum(need)
    cache = torch.randn(2, layers, total, block_size, KV_HEADS, HEAD_DIM, device=DEVICE).to(dtype or DTYPE)
    physical = torch.randperm(total)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for i, blocks in enumerate(need):
        tables[i, :blocks] = physical[at:at + blocks].int()
        at += blocks
    return cache, tables.to(DEVICE)


def kv_label(kv_dtype) -> str:
    """" kv=fp8" in a case's name for an e4m3 cache; nothing for the model's dtype."""
    return " kv=fp8" if kv_dtype == torch.float8_e4m3fn else ""


def decode_setup(lens, block_size, kv_dtype=None):
    kv_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * (kv_dtype or DTYPE).itemsize
    layers = 1 if SMOKE else max(2, min(28, math.ceil(256e6 / kv_bytes)))
    cache, tables = paged_cache(lens, block_size, layers, kv_dtype)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, device=DEVICE).to(DTYPE)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    # The order the engine starts the sequences in (StepPlan.longest_first).
    order = torch.argsort(context_lens, descending=True, stable=True).to(torch.int32)
    return dict(q=q, cache=cache, tables=tables, context_lens=context_lens, order=order, layers=layers,
                kv_bytes=kv_bytes)


def decode_fns(s, **cfg):
    q, cache, tables, lens, layers = s["q"], s["cache"], s["tables"], s["context_lens"], s["layers"]
    scale = HEAD_DIM ** -0.5

    def triton_step():
        return [paged_decode_attention(q, cache[0, i], cache[1, i], tables, lens, scale, seq_order=s["order"], **cfg)
                for i in range(layers)]

    def torch_step():
        return [torch_decode(q, cache[0, i], cache[1, i], tables, lens, scale) for i in range(layers)]

    return triton_step, torch_step


def decode_cases():
    if SMOKE:
        return [("b1_ctx64", [64]), ("b4_ctx~40", [random.randint(30, 50) for _ in range(4)])]
    # Batch 32 over 8 KV heads is past the batch at which the default launch turns to one-warp
    # programs, and still split (decode_attention.one_warp_programs). Batch 256 over 100-2048 is
    # bench_throughput's spread of contexts in one batch, where the longest-first order pays.
    return [("b1_ctx512", [512]), ("b1_ctx4096", [4096]),
            ("b32_ctx~2000", [random.randint(1500, 2500) for _ in range(32)]),
            ("b256_ctx~600", [random.randint(550, 650) for _ in range(256)]),
            ("b256_ctx100-2048", [random.randint(100, 2048) for _ in range(256)])]


def prefill_setup(context, queries, block_size):
    cache, tables = paged_cache([context], block_size, 1)
    q = torch.randn(queries, HEADS, HEAD_DIM, device=DEVICE).to(DTYPE)
    cu = torch.tensor([0, queries], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([context], dtype=torch.int32, device=DEVICE)
    visible = sum(range(context - queries + 1, context + 1))
    flops = 4 * HEAD_DIM * HEADS * visible
    return dict(q=q, k=cache[0, 0], v=cache[1, 0], cu=cu, lens=lens, tables=tables, context=context,
                queries=queries, flops=flops)


def prefill_fns(s, **cfg):
    scale = HEAD_DIM ** -0.5

    # Planned here, outside any graph capture: planning reads the lengths on the host.
    work = plan_on_device(s["q"], s["k"], s["cu"], s["lens"], num_splits=cfg.pop("num_splits", None),
                          block_m=cfg.get("block_m"))

    def triton_call():
        return paged_prefill_attention(s["q"], s["k"], s["v"], s["cu"], s["lens"], s["tables"], scale,
                                       work=work, **cfg)

    def torch_call():
        return torch_prefill_one(s["q"], s["k"], s["v"], s["tables"][0], s["context"], scale)

    return triton_call, torch_call


def prefill_cases():
    if SMOKE:
        return [("prompt_64", 64, 64), ("q8_after_64_cached", 72, 8)]
    return [("prompt_2048", 2048, 2048), ("q50_after_2048_cached", 2098, 50)]


def fused_cases():
    tokens = [1, 4] if SMOKE else [1, 256, 2048]
    for t in tokens:
        x = torch.randn(t, HIDDEN, device=DEVICE).to(DTYPE)
        res = torch.randn(t, HIDDEN, device=DEVICE).to(DTYPE)
        norm = RMSNorm(HIDDEN).to(DEVICE)
        norm.fused = False  # the engine's layers can route to these kernels; the baseline is torch
        norm.weight.data = (1 + 0.1 * torch.randn(HIDDEN, device=DEVICE)).to(DTYPE)
        yield ("rmsnorm+residual", f"tokens={t}", lambda x=x, r=res, n=norm: rms_norm(x, n.weight, n.eps, r),
               lambda x=x, r=res, n=norm: n(x, r))
    rope = RotaryEmbedding(HEAD_DIM, 40960, 1e6).to(DEVICE)
    q_norm, k_norm = RMSNorm(HEAD_DIM).to(DEVICE).to(DTYPE), RMSNorm(HEAD_DIM).to(DEVICE).to(DTYPE)
    for t in tokens:
        qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEVICE).to(DTYPE)
        cache = torch.zeros(2, t // 16 + 1, 16, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        slots = torch.randperm(cache.shape[1] * 16, device=DEVICE)[:t]
        pos = torch.randint(0, 4096, (t,), device=DEVICE)

        def unfused(qkv=qkv, cache=cache, slots=slots, pos=pos):
            q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
            q, k = rope(pos, q_norm(q.reshape(-1, HEADS, HEAD_DIM)), k_norm(k.reshape(-1, KV_HEADS, HEAD_DIM)))
            # The torch backend's store in a CUDA graph: store_kv's boolean mask waits for the GPU.
            torch_store_kv_in_graph(k, v.reshape(-1, KV_HEADS, HEAD_DIM), cache[0], cache[1], slots)

        yield ("q/k norm+rope+kv store", f"tokens={t}",
               lambda qkv=qkv, cache=cache, slots=slots, pos=pos: norm_rope_store(
                   qkv, pos, rope.cos, rope.sin, cache[0], cache[1], slots, HEADS, KV_HEADS,
                   q_norm.weight, k_norm.weight, q_norm.eps),
               unfused)
    act = SiluAndMul()
    act.fused = False
    for t in tokens:
        x = torch.randn(t, 2 * INTERMEDIATE, device=DEVICE).to(DTYPE)
        yield ("silu_and_mul", f"tokens={t}", lambda x=x: silu_and_mul(x), lambda x=x: act(x))
    # The adjusted sampling graphs' logits adjustments: 64 rows, a quarter of them with a token
    # mask, a logit_bias entry and a repetition penalty from their counts (bench_structured's batch).
    for vocab in [2048] if SMOKE else [49152, 151936]:
        args = adjust_logits_args(64, vocab)
        yield ("adjust logits", f"rows=64 vocab={vocab}", lambda a=args: adjust_logits(*a),
               lambda a=args: adjust_logits_torch(*a))


def temperature_draw_cases():
    """The plain draw at a temperature (kernels/temperature_draw.py) against the torch operations
    the "sample" graphs ran before it (sampler.draw: the float32 copy, the softmax, exponential_noise's
    tensor, the division and the argmax), over bf16 logits ~ N(0, 2^2)."""
    for vocab, rows in [(2048, 4)] if SMOKE else itertools.product([49152, 151936], [1, 8, 64]):
        logits = (torch.randn(rows, vocab, device=DEVICE) * 2).to(DTYPE)
        temps = torch.full((rows,), 0.7, device=DEVICE)
        seed = torch.tensor([1], dtype=torch.int64, device=DEVICE)
        yield ("temperature draw", f"rows={rows} vocab={vocab}",
               lambda x=logits, t=temps, s=seed: temperature_draw(x, t, s),
               lambda x=logits, t=temps, s=seed: draw(x, t[:, None], None, None,
                                                      noise=lambda shape, s=s: exponential_noise(shape, s)))


def top_p_cases():
    """The top-p draw (kernels/top_p_sampling.py) against the sort that the sampler's filter ran
    before it (sampler._filter_sorted, the softmax, the noise's division and the argmax): top_p
    0.9 (and 0.5, which more rows reject their first candidates at) over logits ~ N(0, 2^2), the
    noise drawn beforehand for both, so that a case replays the same candidates every call."""
    cases = [(2048, 4, 0.9)] if SMOKE else [(v, r, 0.9) for v in (49152, 151936) for r in (1, 8, 64)] + [
        (151936, 1, 0.5), (151936, 64, 0.5)]
    for vocab, rows, p in cases:
        scaled = torch.randn(rows, vocab, device=DEVICE) * 2
        noise = torch.empty_like(scaled).exponential_()
        top_p = torch.full((rows, 1), p, device=DEVICE)
        every_rank = _beyond_top_k(torch.zeros(rows, dtype=torch.int64, device=DEVICE), vocab)
        yield ("top-p draw", f"rows={rows} vocab={vocab} top_p={p}",
               lambda s=scaled, n=noise, p=top_p: top_p_draw(s, n, p[:, 0]),
               lambda s=scaled, n=noise, p=top_p, r=every_rank: _draw_from(s, None, None, (r, p), (), None,
                                                                            lambda shape, n=n: n))


def adjust_logits_args(rows, vocab):
    """kernels.adjust_logits' arguments for `rows` rows, every fourth one adjusted (its own slot
    and mask row, one bias entry); slot 0 and mask row 0 neutral, as the decode graphs keep them."""
    slots, words = rows // 4 + 1, -(-vocab // 32)
    adjusted = torch.arange(rows, device=DEVICE) % 4 == 0
    slot = torch.where(adjusted, torch.arange(rows, device=DEVICE) // 4 + 1, 0)
    masks = torch.randint(-2**31, 2**31 - 1, (slots, words), dtype=torch.int32, device=DEVICE)
    counts = torch.randint(0, 2, (slots, vocab), dtype=torch.int32, device=DEVICE)
    seen = torch.rand(slots, vocab, device=DEVICE) < 0.05
    bias_ids = torch.zeros(slots, 64, dtype=torch.int64, device=DEVICE)
    bias_values = torch.zeros(slots, 64, device=DEVICE)
    masks[0], counts[0], seen[0] = -1, 0, False
    bias_ids[1:, 0], bias_values[1:, 0] = 2, -100.0
    per_row = torch.zeros(rows, device=DEVICE)
    return (torch.randn(rows, vocab, device=DEVICE).to(DTYPE), slot, slot, masks, counts, seen, per_row + 1.1,
            per_row, per_row, bias_ids, bias_values, torch.zeros(rows, 4, dtype=torch.int64, device=DEVICE),
            torch.zeros(rows, dtype=torch.bool, device=DEVICE))


# -- mixture of experts and FP8 ------------------------------------------------------------------

# Qwen3-30B-A3B's experts; the smoke run's are tiny.
MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, MOE_TOP_K = (8, 64, 32, 2) if SMOKE else (128, 2048, 768, 8)
# Qwen3-8B's qkv, o, gate_up and down projections (N, K).
FP8_SHAPES = [(96, 64), (64, 128)] if SMOKE else [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
FP8_BLOCK = (32, 32) if SMOKE else (128, 128)
HAS_FP8 = SMOKE or torch.cuda.get_device_capability() >= (8, 9)


def moe_loop(x, w13, w2, weights, ids):
    """The baseline: each expert some token chose, a cuBLAS GEMM pair over its tokens, as HF
    transformers' Qwen3MoeExperts runs (its shapes come from the routing: eager only)."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tokens, slot = torch.where(ids == e)
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, -1)
        out.index_add_(0, tokens, F.linear(F.silu(gate) * up, w2[e]) * weights[tokens, slot, None].to(x.dtype))
    return out


def moe_setup(tokens, fp8=False):
    w13 = (torch.randn(MOE_EXPERTS, 2 * MOE_INTER, MOE_HIDDEN, device=DEVICE) / MOE_HIDDEN ** 0.5).to(DTYPE)
    w2 = (torch.randn(MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, device=DEVICE) / MOE_INTER ** 0.5).to(DTYPE)
    x = torch.randn(tokens, MOE_HIDDEN, device=DEVICE).to(DTYPE)
    weights, ids = fused_moe.route(torch.randn(tokens, MOE_EXPERTS, device=DEVICE), MOE_TOP_K, True)
    s = dict(x=x, w13=w13, w2=w2, weights=weights, ids=ids, scales={})
    if fp8:
        (q13, s13), (q2, s2) = quantize_blocks(w13, FP8_BLOCK), quantize_blocks(w2, FP8_BLOCK)
        s.update(q13=q13, q2=q2, scales=dict(w13_scale=s13, w2_scale=s2, scale_block=FP8_BLOCK))
    chosen = len(ids.unique())  # distinct experts the tokens chose: what a step reads
    s["bytes"] = chosen * 3 * MOE_HIDDEN * MOE_INTER * (1 if fp8 else DTYPE.itemsize)
    return s


def moe_tokens():
    return [1, 12] if SMOKE else [1, 4, 8, 64, 512, 4096]


def run_moe():
    rows = []
    for fp8 in ((False, True) if HAS_FP8 else (False,)):
        for t in moe_tokens():
            s = moe_setup(t, fp8)
            w13, w2 = (s["q13"], s["q2"]) if fp8 else (s["w13"], s["w2"])

            def fused(s=s, w13=w13, w2=w2):
                return fused_moe.fused_moe(s["x"], w13, w2, s["weights"], s["ids"], **s["scales"])

            def loop(s=s):
                return moe_loop(s["x"], s["w13"], s["w2"], s["weights"], s["ids"])

            t_graph = time_graph(fused)
            note = f"max|diff| vs loop {max_diff(fused(), loop()):.1e}" + (" (FP8 rounding)" if fp8 else "")
            if t_graph is not None:
                note += f"; {s['bytes'] / (t_graph * 1e-3) / 1e9:.0f} GB/s of chosen experts"
            rows.append(row("fused moe" + (" fp8" if fp8 else ""), f"tokens={t} E={MOE_EXPERTS} k={MOE_TOP_K}",
                            time_eager(fused), time_eager(loop), t_graph, None, note))
            print_row(rows[-1])
            del s
    return rows


def fp8_setup(N, K):
    w = (torch.randn(N, K, device=DEVICE) / K ** 0.5).to(DTYPE)
    q, scales = quantize_blocks(w, FP8_BLOCK)
    # torch._scaled_mm's FP8: W per output row (x is quantized per row in the timed call).
    w_row_scale = (w.float().abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
    w_rows = (w.float() / w_row_scale).to(torch.float8_e4m3fn)
    return dict(w=w, q=q, scales=scales, w_rows=w_rows, w_row_scale=w_row_scale.T.contiguous())


def scaled_mm(x, s):
    """torch._scaled_mm with x quantized per row (part of the call, as fp8_gemm's is)."""
    x_scale = (x.float().abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
    xq = (x.float() / x_scale).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, s["w_rows"].t(), scale_a=x_scale, scale_b=s["w_row_scale"], out_dtype=DTYPE)


def run_fp8():
    if not HAS_FP8:
        print("FP8 rows skipped: the GPU has no FP8 (compute capability below 8.9)")
        return []
    rows = []
    for N, K in FP8_SHAPES:
        s = fp8_setup(N, K)
        fp8_bytes = N * K * (1 + 4 / (FP8_BLOCK[0] * FP8_BLOCK[1]))
        for m in ([1, 8] if SMOKE else [1, 2, 4, 8]):
            x = torch.randn(m, K, device=DEVICE).to(DTYPE)
            ours = lambda x=x, s=s: fp8_kernels.fp8_gemv(x, s["q"], s["scales"], FP8_BLOCK)  # noqa: E731
            want = x.float() @ (s["w"].float()).T
            t_graph = time_graph(ours)
            note = f"max|diff| vs bf16 {max_diff(ours(), want):.1e}"
            if t_graph is not None:
                note += f"; {fp8_bytes / (t_graph * 1e-3) / 1e9:.0f} GB/s"
            for name, base in (("bf16 cuBLAS", lambda x=x, s=s: F.linear(x, s["w"])),
                               ("bf16 Triton gemv", lambda x=x, s=s: gemv(x, s["w"])),
                               ("_scaled_mm rowwise", lambda x=x, s=s: scaled_mm(x, s))):
                rows.append(row("fp8 gemv", f"{N}x{K} m={m} vs {name}", time_eager(ours), time_eager(base), t_graph,
                                time_graph(base), note))
                print_row(rows[-1])
        for m in ([12] if SMOKE else [16, 64, 512, 4096]):
            x = torch.randn(m, K, device=DEVICE).to(DTYPE)
            ours = lambda x=x, s=s: fp8_kernels.fp8_gemm(x, s["q"], s["scales"], FP8_BLOCK)  # noqa: E731
            t_graph = time_graph(ours)
            note = f"max|diff| vs bf16 {max_diff(ours(), x.float() @ s['w'].float().T):.1e}"
            if t_graph is not None:
                note += f"; {2 * m * N * K / (t_graph * 1e-3) / 1e12:.0f} TFLOP/s"
            for name, base in (("bf16 cuBLAS", lambda x=x, s=s: F.linear(x, s["w"])),
                               ("_scaled_mm rowwise", lambda x=x, s=s: scaled_mm(x, s))):
                rows.append(row("fp8 gemm", f"{N}x{K} m={m} vs {name}", time_eager(ours), time_eager(base), t_graph,
                                time_graph(base), note))
                print_row(rows[-1])
        for m in ([8] if SMOKE else [2, 4, 8, 16, 64, 256, 512, 4096]):
            x = torch.randn(m, K, device=DEVICE).to(DTYPE)
            ours = lambda x=x, s=s: fp8_layer.linear(x, s["q"], s["scales"], FP8_BLOCK)  # noqa: E731
            path = "cuBLAS" if fp8_layer.cublas_takes(x, s["q"], s["scales"], FP8_BLOCK) else "Triton"
            t_graph = time_graph(ours)
            note = f"{path}; max|diff| vs bf16 {max_diff(ours(), x.float() @ s['w'].float().T):.1e}"
            triton_fp8 = lambda x=x, s=s: fp8_kernels.fp8_linear(x, s["q"], s["scales"], FP8_BLOCK)  # noqa: E731
            for name, base in (("bf16 cuBLAS", lambda x=x, s=s: F.linear(x, s["w"])), ("Triton fp8", triton_fp8)):
                rows.append(row("fp8 linear", f"{N}x{K} m={m} vs {name}", time_eager(ours), time_eager(base), t_graph,
                                time_graph(base), note))
                print_row(rows[-1])
        del s
    return rows


# Products a graph replays per timing in run_w8a8, rotating over W8A8_COPIES copies of W: more
# bytes than the H200's 50 MB L2 at every shape, so W streams from HBM as in a decode step.
W8A8_PRODUCTS, W8A8_COPIES = 20, 4


def _block_scaled_whole(x, q, scales):
    """cuBLAS's block-scaled FP8 product of QuantizedRows x, whole (no pieces of K)."""
    return F.scaled_mm(x.q, q.t(), x.scales, F.ScalingType.BlockWise1x128, scales.t(),
                       F.ScalingType.BlockWise128x128, output_dtype=DTYPE)[:x.rows]


def run_w8a8():
    """kernels/fp8.py's W8A8 GEMV in each launch (wWpP: W warps, K whole or in P pieces) against
    engine/layers/fp8.py's block_scaled_mm (the engine's product from 2 rows: the launch w8a8_launch
    picks, or cuBLAS) and cuBLAS's block-scaled product whole, at Qwen3-8B's projections and 1-16
    rows quantized as the engine hands them over (QuantizedRows: blocks of 128 x 128, in the smoke
    run too), and at one row Qwen3-32B's qkv and gate/up and Qwen3-30B-A3B's qkv; at one row also
    the one-row FP8 GEMV, the engine's path there where w8a8_launch picks none. Graph us a
    product, PDL as the engine launches. What w8a8_launch's rule was read from."""
    if not HAS_FP8:
        print("W8A8 rows skipped: the GPU has no FP8 (compute capability below 8.9)")
        return []
    cublas = CUDA and fp8_layer.cublas_block_scaling(torch.device(DEVICE))
    arrivals = torch.zeros(16384, dtype=torch.int32, device=DEVICE)
    out = []
    qwen3_8b = [(N, K, [1, 2, 8, 16]) for N, K in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))]
    # One row only: Qwen3-32B's qkv and gate/up, Qwen3-30B-A3B's qkv (w8a8_launch's one-row rule).
    one_row = [(10240, 5120, [1]), (51200, 5120, [1]), (5120, 2048, [1])]
    for N, K, row_counts in ([(96, 512, [1, 2])] if SMOKE else qwen3_8b + one_row):
        copies = [quantize_blocks((torch.randn(N, K, device=DEVICE) / K ** 0.5).to(DTYPE), fp8_layer.DEFAULT_BLOCK)
                  for _ in range(1 if SMOKE else W8A8_COPIES)]
        for m in row_counts:
            x_bf16 = torch.randn(m, K, device=DEVICE).to(DTYPE)
            x = fp8_layer.QuantizedRows(*fp8_kernels.quantize_activations(x_bf16, **fp8_layer.CUBLAS_ROWS), m)
            products = {}
            if cublas:
                chosen = fp8_layer.w8a8_launch_on(m, N, K, torch.device(DEVICE))
                choice = "cuBLAS" if chosen is None else f"w{chosen.num_warps}p{chosen.pieces}"
                if m > 1 or chosen is not None:  # otherwise one row runs the one-row GEMV
                    products[f"block_scaled_mm ({choice})"] = lambda q, s: fp8_layer.block_scaled_mm(x, q, s)
                products["cuBLAS whole"] = lambda q, s: _block_scaled_whole(x, q, s)
            if m == 1:
                products["one-row GEMV"] = lambda q, s: fp8_kernels.fp8_gemv(x_bf16, q, s, fp8_layer.DEFAULT_BLOCK)
            for warps, pieces in itertools.product((2, 4), (1, 2, 4, 8)):
                if K % (pieces * fp8_layer.DEFAULT_BLOCK[1]) == 0 and K // pieces >= 256:
                    launch = dict(pieces=pieces, num_warps=warps, groups=1 if pieces > 1 else 2, arrivals=arrivals)
                    products[f"w{warps}p{pieces}"] = lambda q, s, launch=launch: fp8_kernels.w8a8_gemv(
                        x.q, x.scales, m, q, s, fp8_layer.DEFAULT_BLOCK, **launch)
            times = {}
            for name, product in products.items():
                calls = W8A8_PRODUCTS if not SMOKE else 1
                times[name] = us(timed_graph(lambda product=product: [product(*copies[i % len(copies)])
                                                                        for i in range(calls)], calls))
            print(f"w8a8 {N}x{K} m={m}: " + "  ".join(f"{name} {t}" for name, t in times.items()), flush=True)
            out.append(dict(N=N, K=K, rows=m, us=times))
        del copies
    return out


def _fp8_gemv_configs(m):
    """The FP8 GEMV's candidates: at one row the FMA kernel's bands of 1-8 weight rows by 256-2048
    columns, one or two such tiles a loop step (at most 8192 weights a tile: the fp32
    accumulator's registers), and the tensor-core kernel's; at 8 rows the tensor-core kernel's."""
    dot = [dict(kernel="dot", block_n=n, block_k=k, num_warps=4, num_stages=st)
           for n, k, st in itertools.product((16, 32, 64), (128, 256, 512), (3, 4, 5)) if n * k <= 16384]
    if m > 1:
        return dot
    one = [dict(kernel="one", block_n=n, block_k=k, num_warps=w, num_stages=3, unroll=u)
           for n, k, w, u in itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048), (1, 2, 4), (1, 2))
           if n * k <= 8192 and n * k * u <= 16384]
    return one + [c for c in dot if c["block_n"] <= 32 and c["block_k"] >= 256 and c["num_stages"] >= 4]


def _fp8_gemm_configs(m):
    if m <= 256:
        tiles = itertools.product((32, 64), (64, 128), (4,), (3, 4))
        extra = [(128, 128, 8, 3), (128, 64, 8, 3), (64, 128, 8, 3), (64, 64, 8, 4)]
    else:
        tiles = itertools.product((128,), (128, 256), (8,), (3, 4))
        extra = [(64, 128, 4, 4), (64, 256, 8, 3)]
    return [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st) for bm, bn, w, st in list(tiles) + extra]


def gb_per_s(weight_bytes: float, ms: float | None) -> str:
    """The weights' bytes a call over its time, for the sweeps' lines ("" for a launch that did not run)."""
    return f"{weight_bytes / (ms * 1e-3) / 1e9:6.0f} GB/s" if ms else ""


def sweep_moe_fp8(budget_s):
    """Launch configs, graph-timed, in order of what they decide: the FP8 GEMV (1 and 8 rows) and
    GEMM (256 and 4096 rows) at Qwen3-8B's qkv, gate_up and down projections, then the fused MoE
    (GEMV path at 1 and 8 tokens, grouped at 64 and 512; one config for both of its launches),
    then its FP8 GEMV kernels one at a time (sweep_moe_fp8_gemv). Each case prints its default's
    time and its best 8 (with the GB/s of the weights a call reads); cases, or the rest of one,
    past budget_s seconds are skipped, and say so."""
    out = []
    deadline = time.perf_counter() + budget_s

    def report(name, configs, call, weight_bytes):
        if time.perf_counter() > deadline:
            print(f"\nsweep {name}: skipped, past the {budget_s:.0f} s budget", flush=True)
            return
        default_ms = timed_graph(lambda: call({}), 1)
        results = []
        for cfg in configs[:2] if SMOKE else configs:
            if time.perf_counter() > deadline:
                print(f"  (budget spent: {len(results)} of {len(configs)} configs timed)", flush=True)
                break
            results.append((cfg, timed_graph(lambda cfg=cfg: call(cfg), 1)))
        results.sort(key=lambda r: float("inf") if r[1] is None else r[1])
        print(f"\nsweep {name} (graph us/call): default {us(default_ms)} us {gb_per_s(weight_bytes, default_ms)}; "
              f"best 8 of {len(results)}:", flush=True)
        for cfg, ms in results[:8]:
            print(f"  {us(ms)!s:>9} {gb_per_s(weight_bytes, ms)}  {cfg}", flush=True)
        out.append(dict(case=name, default_us=us(default_ms),
                        results=[dict(cfg, us=us(ms)) for cfg, ms in results]))

    if HAS_FP8:
        shapes = FP8_SHAPES[:1] if SMOKE else [(6144, 4096), (24576, 4096), (4096, 12288)]
        for N, K in shapes:
            s = fp8_setup(N, K)
            fp8_bytes = N * K * (1 + 4 / (FP8_BLOCK[0] * FP8_BLOCK[1]))
            for m in (1, 8):
                x = torch.randn(m, K, device=DEVICE).to(DTYPE)
                report(f"fp8 gemv {N}x{K} m={m}", _fp8_gemv_configs(m),
                       lambda cfg, x=x, s=s: fp8_kernels.fp8_gemv(x, s["q"], s["scales"], FP8_BLOCK, **cfg), fp8_bytes)
            del s
        for N, K in shapes[1:] or shapes:
            s = fp8_setup(N, K)
            for m in ([12] if SMOKE else [256, 4096]):
                x = torch.randn(m, K, device=DEVICE).to(DTYPE)
                report(f"fp8 gemm {N}x{K} m={m}", _fp8_gemm_configs(m),
                       lambda cfg, x=x, s=s: fp8_kernels.fp8_gemm(x, s["q"], s["scales"], FP8_BLOCK, **cfg),
                       N * K)
            del s
    for t in ([1, 12] if SMOKE else [1, 8, 64, 512]):
        s = moe_setup(t)
        if t <= fused_moe.GEMV_MAX_TOKENS:
            grid = itertools.product((2, 4, 8, 16), (128, 256, 512, 1024), (2, 4))
            configs = [dict(block_n=n, block_k=k, num_warps=w, num_stages=3) for n, k, w in grid]
        else:
            grid = itertools.product((16, 32, 64), (64, 128), (64, 128), (4, 8))
            configs = [dict(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=3) for m, n, k, w in grid]
        report(f"fused moe tokens={t}", configs, lambda cfg, s=s: fused_moe.fused_moe(
            s["x"], s["w13"], s["w2"], s["weights"], s["ids"], **cfg), s["bytes"])
        del s
    if HAS_FP8:
        out += sweep_moe_fp8_gemv(deadline)
    return out


# Routings a timed graph of sweep_moe_fp8_gemv cycles through: each call chooses other experts, so
# that they stream from HBM (one token's 8 of Qwen3-30B-A3B's FP8 experts, 37.7 MB, fit in L2).
MOE_ROUTINGS = 16


def sweep_moe_fp8_gemv(deadline):
    """The fused MoE's FP8 GEMV kernels, one at a time: each kernel's tiles (kernels/fused_moe.py's
    FP8_GEMV_TILES, one kernel's set for the sweep at every token count, the other's left as they are)
    at 1, 2, 4 and 8 tokens, at 3 stages, then the best four tiles at 2-8 stages (num_stages is one
    knob for both kernels). Graph us of the whole layer a call, MOE_ROUTINGS calls on new routings;
    the GB/s are of the chosen experts' weights, both kernels'."""
    out = []
    s = moe_setup(1, fp8=True)
    q13, q2, scales = s["q13"], s["q2"], s["scales"]
    del s
    grid = [(n, k, w) for n, k, w in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (1, 2, 4))
            if n * k <= 16384]
    for t in ([1] if SMOKE else [1, 2, 4, 8]):
        x = torch.randn(t, MOE_HIDDEN, device=DEVICE).to(DTYPE)
        routings = [fused_moe.route(torch.randn(t, MOE_EXPERTS, device=DEVICE), MOE_TOP_K, True)
                    for _ in range(1 if SMOKE else MOE_ROUTINGS)]
        chosen = sum(len(ids.unique()) for _, ids in routings) / len(routings)
        weight_bytes = chosen * 3 * MOE_HIDDEN * MOE_INTER

        def layer_ms(launch):
            return timed_graph(lambda: [fused_moe.fused_moe(x, q13, q2, *routing, **scales, **launch)
                                        for routing in routings], len(routings))

        for name in fused_moe.FP8_GEMV_TILES:
            if time.perf_counter() > deadline:
                print(f"\nsweep fp8 moe {name} tokens={t}: skipped, past the budget", flush=True)
                continue
            kept = fused_moe.FP8_GEMV_TILES[name]
            results = []
            try:
                default_ms = layer_ms({})
                for tiles in grid[:2] if SMOKE else grid:
                    if time.perf_counter() > deadline:
                        break
                    fused_moe.FP8_GEMV_TILES[name] = (tiles, tiles, 1)
                    results.append((tiles, 3, layer_ms({})))
                results.sort(key=lambda r: float("inf") if r[2] is None else r[2])
                for tiles, _, _ in results[:4]:
                    fused_moe.FP8_GEMV_TILES[name] = (tiles, tiles, 1)
                    for stages in (2, 4, 6, 8):
                        results.append((tiles, stages, layer_ms({"num_stages": stages})))
            finally:
                fused_moe.FP8_GEMV_TILES[name] = kept
            results.sort(key=lambda r: float("inf") if r[2] is None else r[2])
            print(f"\nsweep fp8 moe {name} tokens={t} (graph us a layer, the other kernel's tiles as they are): "
                  f"default {us(default_ms)} us {gb_per_s(weight_bytes, default_ms)}; best 8 of {len(results)} "
                  "((block_n, block_k, warps), stages):", flush=True)
            for tiles, stages, ms in results[:8]:
                print(f"  {us(ms)!s:>9} {gb_per_s(weight_bytes, ms)}  {tiles} {stages}", flush=True)
            out.append(dict(case=f"fp8 moe {name} tokens={t}", default_us=us(default_ms),
                            results=[dict(tiles=tiles, num_stages=stages, us=us(ms)) for tiles, stages, ms in results]))
    return out


def sweep_moe_down(budget_s):
    """The fused MoE's unquantized GEMV down kernels (kernels/fused_moe.py's DOWN_GEMV_TILES): each
    launch, (all_experts, block_n, block_k, num_warps), at 1, 2, 4 and 8 tokens, over the experts'
    full rows (I) and their tensor-parallel halves (I / 2), gate/up's launch as it is. Graph us of
    the whole layer a call, MOE_ROUTINGS calls on new routings; the GB/s are of the chosen experts'
    weights, both kernels'. Launches past budget_s seconds are skipped, and say so."""
    out = []
    deadline = time.perf_counter() + budget_s
    grid = [(True, n, k, w) for n, k, w in itertools.product((1, 2, 4), (128, 256, 512, 1024), (2, 4, 8))
            if 8 * n * k <= 16384]
    grid += [(False, n, k, w) for n, k, w in itertools.product((2, 4, 8), (256, 512, 1024), (1, 2, 4))
             if n * k <= 8192]
    for inter in (MOE_INTER, MOE_INTER // 2):
        short = inter <= 512
        # block_k past the rows' power of two is clipped to it: each launch once.
        widest = 1 << (inter - 1).bit_length()
        launches = list(dict.fromkeys((a, n, min(k, widest), w) for a, n, k, w in grid))
        w13 = (torch.randn(MOE_EXPERTS, 2 * inter, MOE_HIDDEN, device=DEVICE) / MOE_HIDDEN ** 0.5).to(DTYPE)
        w2 = (torch.randn(MOE_EXPERTS, MOE_HIDDEN, inter, device=DEVICE) / inter ** 0.5).to(DTYPE)
        for t in ([1] if SMOKE else [1, 2, 4, 8]):
            if time.perf_counter() > deadline:
                print(f"\nsweep moe down I={inter} tokens={t}: skipped, past the {budget_s:.0f} s budget", flush=True)
                continue
            x = torch.randn(t, MOE_HIDDEN, device=DEVICE).to(DTYPE)
            routings = [fused_moe.route(torch.randn(t, MOE_EXPERTS, device=DEVICE), MOE_TOP_K, True)
                        for _ in range(1 if SMOKE else MOE_ROUTINGS)]
            chosen = sum(len(ids.unique()) for _, ids in routings) / len(routings)
            weight_bytes = chosen * 3 * MOE_HIDDEN * inter * DTYPE.itemsize

            def layer_ms():
                return timed_graph(lambda: [fused_moe.fused_moe(x, w13, w2, *routing) for routing in routings],
                                   len(routings))

            kept = fused_moe.DOWN_GEMV_TILES[short]
            results = []
            try:
                default_ms = layer_ms()
                for tiles in launches[:2] if SMOKE else launches:
                    if time.perf_counter() > deadline:
                        break
                    fused_moe.DOWN_GEMV_TILES[short] = (tiles, tiles, 1)
                    results.append((tiles, layer_ms()))
            finally:
                fused_moe.DOWN_GEMV_TILES[short] = kept
            results.sort(key=lambda r: float("inf") if r[1] is None else r[1])
            print(f"\nsweep moe down I={inter} tokens={t} (graph us a layer, gate/up's launch as it is): default "
                  f"{us(default_ms)} us {gb_per_s(weight_bytes, default_ms)}; best 8 of {len(results)} of "
                  f"{len(launches)} ((all_experts, block_n, block_k, warps)):", flush=True)
            for tiles, ms in results[:8]:
                print(f"  {us(ms)!s:>9} {gb_per_s(weight_bytes, ms)}  {tiles}", flush=True)
            out.append(dict(case=f"moe down I={inter} tokens={t}", default_us=us(default_ms),
                            results=[dict(tiles=tiles, us=us(ms)) for tiles, ms in results]))
        del w13, w2
    return out


# -- runs ---------------------------------------------------------------------------------------

def row(kernel, case, tri_eager, torch_eager, tri_graph=None, torch_graph=None, note=""):
    def ratio(a, b):
        return None if a is None or b is None else round(b / a, 2)
    return dict(kernel=kernel, case=case, triton_us=us(tri_eager), torch_us=us(torch_eager),
                speedup=ratio(tri_eager, torch_eager), triton_graph_us=us(tri_graph),
                torch_graph_us=us(torch_graph), graph_speedup=ratio(tri_graph, torch_graph), note=note)


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def run_decode(block_size):
    rows = []
    for name, lens in decode_cases():
        s = decode_setup(lens, block_size)
        tri, ref = decode_fns(s)
        err = max_diff(tri()[0], ref()[0])
        t_g = time_graph(tri, s["layers"])
        note = f"max|diff| {err:.1e}"
        if t_g is not None:
            bw = s["kv_bytes"] / (t_g * 1e-3)
            note += f"; {bw / 1e9:.0f} GB/s = {100 * bw / PEAK_BYTES_PER_S:.0f}% of 4.25 TB/s" \
                    f"; x28 layers {28 * t_g:.3f} ms"
        rows.append(row("decode attention", f"{name} bs={block_size}", time_eager(tri, s["layers"]),
                        time_eager(ref, s["layers"]), t_g, time_graph(ref, s["layers"]), note))
        print_row(rows[-1])
        del s
    return rows


def run_prefill(block_size):
    rows = []
    for name, context, queries in prefill_cases():
        s = prefill_setup(context, queries, block_size)
        tri, ref = prefill_fns(s)
        err = max_diff(tri(), ref())
        t, t_g = time_eager(tri), timed_graph(tri, 1) if CUDA else None
        # The engine runs prefill eagerly; the graph times show the GPU time without launch overhead.
        rate = s["flops"] / ((t_g or t) * 1e-3) / 1e12
        rows.append(row("prefill attention", f"{name} bs={block_size}", t, time_eager(ref),
                        t_g, timed_graph(ref, 1) if CUDA else None,
                        note=f"max|diff| {err:.1e}; {rate:.0f} TFLOP/s"))
        print_row(rows[-1])
    return rows


def run_fused(only=None):
    rows = []
    for kernel, case, tri, ref in itertools.chain(fused_cases(), top_p_cases(), temperature_draw_cases()):
        if only is not None and kernel not in ((only,) if isinstance(only, str) else only):
            continue
        rows.append(row(kernel, case, time_eager(tri), time_eager(ref), time_graph(tri), time_graph(ref)))
        print_row(rows[-1])
    return rows


def sweep_decode(block_size, budget_s, kv_dtype=None):
    """Launch configs, then split counts, of the decode attention over a cache of kv_dtype (DTYPE
    by default), each case within its share of budget_s."""
    out = []
    cases = decode_cases()
    for name, lens in cases:
        start = time.monotonic()
        deadline = start + 0.6 * budget_s / len(cases)  # the rest is for the split counts
        s = decode_setup(lens, block_size, kv_dtype)
        results = []
        for block_n, warps, stages in itertools.product((64, 32, 128), (4, 1, 2, 8), (2, 1, 3)):
            if time.monotonic() > deadline:
                print("  sweep time budget spent")
                break
            cfg = dict(block_n=block_n, num_warps=warps, num_stages=stages)
            results.append((cfg, timed_graph(decode_fns(s, **cfg)[0], s["layers"])))
        best = min((r for r in results if r[1] is not None), key=lambda r: r[1], default=(None, None))[0] or {}
        for splits in (1, 2, 4, 8, 16, 32, 64):
            for cfg in ({}, best) if time.monotonic() < start + budget_s / len(cases) else ():
                full = dict(cfg, num_splits=splits)
                results.append((full, timed_graph(decode_fns(s, **full)[0], s["layers"])))
        results.sort(key=lambda r: float("inf") if r[1] is None else r[1])
        print(f"\nsweep decode {name} bs={block_size}{kv_label(kv_dtype)} (graph us/call), best 12 of {len(results)}:")
        for cfg, ms in results[:12]:
            print(f"  {us(ms)!s:>9}  {cfg}")
        by_split = {(c["num_splits"], len(c) > 1): us(ms) for c, ms in results if "num_splits" in c}
        print("  by num_splits (default cfg / best cfg):",
              {n: (by_split.get((n, False)), by_split.get((n, True))) for n in sorted({k[0] for k in by_split})})
        out.append(dict(case=name, block_size=block_size, kv_cache_dtype=str(kv_dtype or DTYPE),
                        results=[dict(cfg, us=us(ms)) for cfg, ms in results]))
        del s
    return out


def chunk_cases():
    """A prompt chunk mixed into decode steps (what the streaming benchmark's p99 waits on), and a
    short turn after a cached prefix."""
    if SMOKE:
        return [("q8_after_64", 64, 8)]
    return [("chunk_q64_ctx8192", 8192, 64), ("chunk_q32_ctx8192", 8192, 32), ("chunk_q120_ctx8192", 8192, 120),
            ("chunk_q120_ctx2048", 2048, 120), ("q50_after_2048_cached", 2098, 50)]


def sweep_prefill(block_size, kv_dtype=None):
    """Launch configs x key splits for few queries over many keys, over a cache of kv_dtype (DTYPE
    by default). Each call reads its own layer's cache (4 of them, past the L2), as an engine step
    does."""
    out = []
    tiles = [(128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 4, 2), (128, 128, 8, 3), (128, 64, 8, 3),
             (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 2), (64, 32, 4, 3), (32, 64, 4, 3)]
    if SMOKE:
        tiles = tiles[:1]
    configs = [dict(block_m=m, block_n=n, num_warps=w, num_stages=st, num_splits=sp)
               for sp in ((1, 4) if SMOKE else (None, 1, 4, 8, 16)) for m, n, w, st in tiles]
    layers = 1 if SMOKE else 4
    scale = HEAD_DIM ** -0.5
    for name, context, queries in chunk_cases():
        cache, tables = paged_cache([context], block_size, layers, kv_dtype)
        q = torch.randn(queries, HEADS, HEAD_DIM, device=DEVICE).to(DTYPE)
        cu = torch.tensor([0, queries], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor([context], dtype=torch.int32, device=DEVICE)
        flops = 4 * HEAD_DIM * HEADS * sum(range(context - queries + 1, context + 1))

        def call(cfg):
            cfg = dict(cfg)
            work = plan_on_device(q, cache[0, 0], cu, lens, num_splits=cfg.pop("num_splits", None),
                                  block_m=cfg.get("block_m"))
            return lambda: [paged_prefill_attention(q, cache[0, i], cache[1, i], cu, lens, tables, scale, work=work,
                                                    **cfg) for i in range(layers)]

        results = [(cfg, timed_graph(call(cfg), layers)) for cfg in configs]
        default_ms = timed_graph(call({}), layers)
        results.sort(key=lambda r: float("inf") if r[1] is None else r[1])
        print(f"\nsweep prefill {name} bs={block_size}{kv_label(kv_dtype)} (graph us/call, {layers} layers rotated; "
              f"default config {us(default_ms)} us):")
        for cfg, ms in results[:12]:
            rate = f"{flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s" if ms else ""
            print(f"  {us(ms)!s:>9}  {rate:>12}  {cfg}")
        out.append(dict(case=name, block_size=block_size, kv_cache_dtype=str(kv_dtype or DTYPE),
                        default_us=us(default_ms), results=[dict(cfg, us=us(ms)) for cfg, ms in results]))
    return out


def sweep_prefill_occupancy(block_size):
    """Few queries over 8K keys with more programs than SMs and more splits than the default cap:
    whether several programs per SM hide the latency of the paged K/V loads."""
    out = []
    tiles = [(128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (32, 64, 4, 2)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 4
    layers = 4
    scale = HEAD_DIM ** -0.5
    for name, context, queries in [("chunk_q64_ctx8192", 8192, 64), ("chunk_q32_ctx8192", 8192, 32),
                                   ("chunk_q120_ctx8192", 8192, 120)]:
        cache, tables = paged_cache([context], block_size, layers)
        q = torch.randn(queries, HEADS, HEAD_DIM, device=DEVICE).to(DTYPE)
        cu = torch.tensor([0, queries], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor([context], dtype=torch.int32, device=DEVICE)
        results = []
        for (m, n, w, st), per_sm, cap in itertools.product(tiles, (1, 2, 4), (16, 32, 64)):
            work = plan_on_device(q, cache[0, 0], cu, lens, block_m=m, num_programs=sms * per_sm, cap=cap)
            cfg = dict(block_m=m, block_n=n, num_warps=w, num_stages=st, num_programs=sms * per_sm)

            def call(work=work, cfg=cfg):
                return [paged_prefill_attention(q, cache[0, i], cache[1, i], cu, lens, tables, scale, work=work, **cfg)
                        for i in range(layers)]
            results.append((dict(cfg, cap=cap, splits=work.max_splits), timed_graph(call, layers)))
        results.sort(key=lambda r: float("inf") if r[1] is None else r[1])
        print(f"\nsweep prefill occupancy {name} bs={block_size} (graph us/call, {layers} layers rotated):")
        for cfg, ms in results[:10]:
            print(f"  {us(ms)!s:>9}  {cfg}")
        out.append(dict(case=name, results=[dict(cfg, us=us(ms)) for cfg, ms in results]))
    return out


def run_decode_launches(block_sizes, kv_dtype=None):
    """A decode step's attention part at batch 1..8 and contexts 512 and 4096, in a CUDA graph of 28
    layers rotating over 4 layer caches, three ways: 'split+merge' (norm_rope_store, the split
    kernel, a merge kernel: three launches a layer, as before), 'one-launch' (norm_rope_store, then
    the split kernel whose last split merges: two) and 'from-qkv' (one kernel does it all: one);
    'attn' rows time the attention kernel(s) alone. Each with PDL on and off (NVCHAT_PDL). kv_dtype:
    the caches' dtype (DTYPE by default; torch.float8_e4m3fn for an FP8 cache)."""
    layers, rotate = 28, 4
    rope = RotaryEmbedding(HEAD_DIM, 8192, 1e6).to(DEVICE)
    q_norm, k_norm = RMSNorm(HEAD_DIM).to(DEVICE).to(DTYPE), RMSNorm(HEAD_DIM).to(DEVICE).to(DTYPE)
    norms = (q_norm.weight, k_norm.weight, q_norm.eps)
    counters = split_counters(torch.device(DEVICE))
    scale = HEAD_DIM ** -0.5
    rows = []
    for bs, ctx, batch in itertools.product(block_sizes, [64, 128] if SMOKE else [512, 4096],
                                            [1, 2] if SMOKE else [1, 2, 4, 8]):
        lens = [ctx] * batch
        cache, tables = paged_cache(lens, bs, rotate, kv_dtype)
        context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        positions = (context_lens - 1).long()
        slots = tables.long().gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
        qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEVICE).to(DTYPE)
        q = torch.randn(batch, HEADS, HEAD_DIM, device=DEVICE).to(DTYPE)

        def norm_rope(i):
            return norm_rope_store(qkv, positions, rope.cos, rope.sin, cache[0, i], cache[1, i], slots, HEADS,
                                   KV_HEADS, *norms)

        variants = {
            "split+merge": lambda i: paged_decode_attention(norm_rope(i), cache[0, i], cache[1, i], tables,
                                                            context_lens, scale, merge_kernel=True),
            "one-launch": lambda i: paged_decode_attention(norm_rope(i), cache[0, i], cache[1, i], tables,
                                                           context_lens, scale, counters=counters),
            "from-qkv": lambda i: paged_decode_attention_from_qkv(
                qkv, positions, rope.cos, rope.sin, *norms, cache[0, i], cache[1, i], slots, tables, context_lens,
                scale, counters=counters),
            "attn split+merge": lambda i: paged_decode_attention(q, cache[0, i], cache[1, i], tables, context_lens,
                                                                 scale, merge_kernel=True),
            "attn one-launch": lambda i: paged_decode_attention(q, cache[0, i], cache[1, i], tables, context_lens,
                                                                scale, counters=counters),
        }
        qkv_in, outs = qkv.clone(), {}
        for name, fn in variants.items():
            qkv.copy_(qkv_in)  # norm_rope_store rotates q in place
            outs[name] = fn(0).float()
        case = f"b{batch}_ctx{ctx} bs={bs}" + kv_label(kv_dtype)
        for pdl_on in ("1", "0"):
            os.environ["NVCHAT_PDL"] = pdl_on
            for name, fn in variants.items():
                t = time_graph(lambda fn=fn: [fn(i % rotate) for i in range(layers)], layers)
                base = "attn split+merge" if name.startswith("attn") else "split+merge"
                note = f"max|diff| vs {base} {max_diff(outs[name], outs[base]):.1e}"
                if t is not None:
                    note += f"; x28 layers {28 * t * 1e3:.1f} us"
                r = dict(kernel=f"decode {name}", case=f"{case} pdl={pdl_on}", triton_us=None, torch_us=None,
                         speedup=None, triton_graph_us=us(t), torch_graph_us=None, graph_speedup=None, note=note)
                rows.append(r)
                print_row(r)
        os.environ.pop("NVCHAT_PDL")
        del cache
    return rows


def timed_graph(fn, calls):
    try:
        return time_graph(fn, calls) if CUDA else time_eager(fn, calls)
    except Exception as e:  # a config that does not compile (shared memory) is just skipped
        print(f"  skipped: {type(e).__name__}: {str(e)[:120]}")
        return None


COLUMNS = [("kernel", 18), ("case", 32), ("triton_us", 10), ("torch_us", 10), ("speedup", 8),
           ("triton_graph_us", 16), ("torch_graph_us", 15), ("graph_speedup", 14), ("note", 0)]


def print_header():
    print(" | ".join(f"{c:<{w}}" if w else c for c, w in COLUMNS))
    print("-+-".join("-" * (w or 30) for _, w in COLUMNS))


def print_row(r):
    print(" | ".join(f"{'' if r[c] is None else r[c]!s:<{w}}" if w else str(r[c]) for c, w in COLUMNS), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/out/kernels.json")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configs")
    parser.add_argument("--sweep-budget", type=float, default=150,
                        help="seconds the decode sweep (split evenly over its cases) or --sweep-moe-fp8 may take")
    parser.add_argument("--sweep-occupancy-only", action="store_true",
                        help="only the prefill occupancy sweep (programs per SM x split cap), then exit")
    parser.add_argument("--sweep-decode-only", action="store_true",
                        help="only the decode sweep (launch configs, then split counts), then exit")
    parser.add_argument("--sweep-prefill-only", action="store_true",
                        help="only the prefill sweep (few queries over many keys), then exit")
    parser.add_argument("--decode-launches", action="store_true",
                        help="only the decode launch comparison (split+merge, one-launch, from-qkv; PDL on/off), then exit")
    parser.add_argument("--block-sizes", default="16,256", help="KV cache block sizes for the attention cases")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="with --decode-launches and the attention sweeps: the caches in the "
                             "model's dtype or in e4m3")
    parser.add_argument("--moe-fp8", action="store_true", help="only the mixture-of-experts and FP8 rows, then exit")
    parser.add_argument("--w8a8", action="store_true",
                        help="only the W8A8 GEMV's launches against the engine's FP8 product and cuBLAS, then exit")
    parser.add_argument("--sweep-moe-fp8", action="store_true",
                        help="only the mixture-of-experts and FP8 launch-config sweeps, then exit")
    parser.add_argument("--sweep-moe-down", action="store_true",
                        help="only the sweep of the unquantized fused MoE's GEMV down launches, then exit")
    parser.add_argument("--adjust-logits", action="store_true",
                        help="only the adjusted sampling's logits adjustments (kernels/adjust_logits.py), then exit")
    parser.add_argument("--draws", action="store_true",
                        help="only the sampling draws' kernels (top-p without a sort, the temperature draw) against "
                             "the torch operations they replace, then exit")
    args = parser.parse_args()
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None
    torch.manual_seed(0)
    random.seed(0)
    device = torch.cuda.get_device_name() if CUDA else "cpu (TRITON_INTERPRET smoke run)"
    import triton  # start-up: as triton.testing above
    meta = dict(date=datetime.date.today().isoformat(), device=device, torch=torch.__version__,
                triton=triton.__version__, command=" ".join([Path(sys.executable).name] + sys.argv))
    print(f"{meta['date']}  {device}  torch {meta['torch']}  triton {meta['triton']}")
    print(f"command: {meta['command']}\n")
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result = dict(meta, rows=[])

    def save():
        out_path.write_text(json.dumps(result, indent=1))

    if args.adjust_logits:
        print_header()
        result["rows"] = run_fused(only="adjust logits")
        save()
        return
    if args.draws:
        print_header()
        result["rows"] = run_fused(only=("top-p draw", "temperature draw"))
        save()
        return
    if args.moe_fp8:
        print_header()
        result["rows"] = run_moe() + run_fp8()
        save()
        return
    if args.w8a8:
        result["w8a8"] = run_w8a8()
        save()
        return
    if args.sweep_moe_fp8:
        result["sweep_moe_fp8"] = sweep_moe_fp8(args.sweep_budget)
        save()
        return
    if args.sweep_moe_down:
        result["sweep_moe_down"] = sweep_moe_down(args.sweep_budget)
        save()
        return
    if args.decode_launches:
        print_header()
        result["rows"] = run_decode_launches(block_sizes, kv_dtype)
        save()
        return
    if args.sweep_occupancy_only:
        result["sweep_occupancy"] = sweep_prefill_occupancy(block_sizes[0])
        save()
        return
    if args.sweep_decode_only:
        result["sweep_decode"] = sweep_decode(block_sizes[0], args.sweep_budget, kv_dtype)
        save()
        return
    if args.sweep_prefill_only:
        result["sweep_prefill"] = sweep_prefill(block_sizes[0], kv_dtype)
        save()
        return
    if args.sweep:
        result["sweep_decode"] = sweep_decode(block_sizes[0], args.sweep_budget, kv_dtype)
        save()
        result["sweep_prefill"] = sweep_prefill(block_sizes[0], kv_dtype)
        save()
        print()
    print_header()
    for bs in block_sizes:
        result["rows"] += run_decode(bs)
        save()
    for bs in block_sizes:
        result["rows"] += run_prefill(bs)
        save()
    result["rows"] += run_fused()
    save()
    result["rows"] += run_moe() + run_fp8()
    save()
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
