"""A mixture-of-experts MLP layer (Qwen3-MoE's): each token's top-k experts' SwiGLU MLPs, weighted
by the router and summed, for all the layer's experts at once.

- route: the router's softmax, top-k and (norm_topk_prob) renormalization, one program a token.
- fused_moe, up to GEMV_MAX_TOKENS tokens (a chat-sized decode step): two GEMV-style launches
  that read only the chosen experts' weights. The first runs gate and up of every (token, chosen
  expert) pair with SiLU-mul in its epilogue; the second runs each token's down projections
  and sums them with the router's weights in fp32, so no sort, no per-pair output and no
  combine step. At one token that reads top_k of the experts: Qwen3-30B-A3B's 8 of 128.
- fused_moe, more tokens (prefill, big batches): the (token, expert) pairs sorted by expert, each
  expert's run padded to a multiple of BLOCK_M (align_by_expert, torch ops on the device), and
  one grouped GEMM launch per projection in which every program takes BLOCK_M pairs of one
  expert: gate/up with SiLU-mul, then down scaled by the router's weight, then the top-k rows of
  each token summed.

Nothing here reads a tensor's values on the host or makes a shape from them: the grouped GEMMs'
grids cover the most blocks the pairs can fill, and programs past the last filled block exit; so
a CUDA graph captures a step of a fixed token count. Expert weights are stacked: w13 [E, 2I, H]
(gate's I rows, then up's), w2 [E, H, I]; either may be block-wise FP8 (kernels/fp8.py's layout,
a scale grid per expert). The grouped GEMMs widen an FP8 tile to the activations' dtype and scale
its product; the GEMV path multiplies in fp32, each scale block's scale on the input's columns.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kernels import pdl

GEMV_MAX_TOKENS = 8
# pdl.FIRST at one token only: at 2 and 4 tokens, Qwen3-30B-A3B took 3.593 and 5.361 ms a step with
# these kernels launched with FIRST, 3.501 and 5.162 with them AFTER_WAIT (the dense kernels FIRST
# either way; H200, benchmarks/HISTORY.md, 2026-11-28, session of 22:39).
PDL_FIRST_TOKENS = 1
_FP8 = torch.float8_e4m3fn


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    # One int64 key per expert, so that each of the top_k picks is one max over the row: the
    # probability's bits above (a non-negative float's bits order as the float does), and below
    # them BLOCK_E - 1 - e, so that ties go to the lowest id. A NaN or infinite logit makes every
    # probability of its row NaN (a CUDA graph's padding rows hold whatever their buffers held).
    # Such a row still gets top_k distinct experts in range (the lowest ids, NaN ranking below any
    # probability and above the slots past E), with NaN weights: the expert ids index the weights
    # and the sort, and one past E crashed the sort's scatter with a device-side assert.
    high = tl.where(e < E, tl.where(p == p, p.to(tl.int32, bitcast=True), -1), -2).to(tl.int64)
    keys = (high << 32) | (BLOCK_E - 1 - e).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(keys, axis=0)
        weight = tl.where(best >= 0, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), float("nan"))
        chosen = tl.where(j == i, weight, chosen)
        chosen_ids = tl.where(j == i, (BLOCK_E - 1 - (best & (BLOCK_E - 1))).to(tl.int32), chosen_ids)
        keys = tl.where(keys == best, -3 << 32, keys)  # taken: below every other key
    if RENORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=0)
    tl.store(weights_ptr + t * TOP_K + j, chosen, mask=j < TOP_K)
    tl.store(ids_ptr + t * TOP_K + j, chosen_ids, mask=j < TOP_K)


@triton.jit
def _wait_for_pair(ids_ptr, TOP_K: tl.constexpr, PDL: tl.constexpr):
    """(pair, token, expert) of a gate/up program, after the PDL wait: the ids come from the
    routing kernel before."""
    pdl.wait(PDL)
    pair = tl.program_id(0).to(tl.int64)
    return pair, pair // TOP_K, tl.load(ids_ptr + pair).to(tl.int64)


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w_ptr, ids_ptr, h_ptr, N, K, stride_x, stride_we, stride_wn, stride_h,
                         TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    # One (token, chosen expert) pair and BLOCK_N of the expert's N intermediate columns: gate rows
    # n and up rows N + n against the token's row, then silu(gate) * up.
    pair, token, expert = _wait_for_pair(ids_ptr, TOP_K, PDL)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < N
    gate_at = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn + k[None, :]
    up_at = gate_at + N * stride_wn
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + k < K
        x = tl.load(x_ptr + token * stride_x + k0 + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = n_ok[:, None] & k_ok[None, :]
        acc_gate += tl.load(gate_at + k0, mask=mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_at + k0, mask=mask, other=0.0).to(tl.float32) * x
    _store_silu_mul(h_ptr + pair * stride_h + n, n_ok, tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1))


@triton.jit
def _store_silu_mul(h_ptrs, mask, gate, up):
    # Rounded to the output's dtype where the unfused layers round (each projection's output),
    # then SiLU-mul in fp32, rounded once.
    gate = gate.to(h_ptrs.dtype.element_ty).to(tl.float32)
    up = up.to(h_ptrs.dtype.element_ty).to(tl.float32)
    tl.store(h_ptrs, (gate / (1.0 + tl.exp(-gate)) * up).to(h_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _gate_up_gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, N, K, stride_x, stride_we, stride_wn, stride_se,
                             stride_sn, stride_h, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                             SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    # _gate_up_gemv_kernel for block-FP8 experts. A K step is GROUPS scale blocks of SCALE_K
    # columns. BLOCK_N divides SCALE_N and N, so the program's gate rows share one row of scales
    # and its up rows another: each block's scale multiplies x's SCALE_K columns, one scale load a
    # block, not one multiply a weight.
    pair, token, expert = _wait_for_pair(ids_ptr, TOP_K, PDL)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    group = tl.arange(0, GROUPS)
    kk = group[:, None] * SCALE_K + tl.arange(0, SCALE_K)[None, :]  # [GROUPS, SCALE_K]
    gate_at = w_ptr + expert * stride_we + n[:, None, None].to(tl.int64) * stride_wn + kk[None, :, :]
    up_at = gate_at + N * stride_wn
    gate_s_at = s_ptr + expert * stride_se + (n0 // SCALE_N) * stride_sn
    up_s_at = s_ptr + expert * stride_se + ((n0 + N) // SCALE_N) * stride_sn
    acc_gate = tl.zeros([BLOCK_N, GROUPS, SCALE_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, GROUPS, SCALE_K], dtype=tl.float32)
    for k0 in range(0, K, GROUPS * SCALE_K):
        k_ok = k0 + kk < K
        block_ok = k0 + group * SCALE_K < K
        x = tl.load(x_ptr + token * stride_x + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        gate_scale = tl.load(gate_s_at + k0 // SCALE_K + group, mask=block_ok, other=0.0)
        up_scale = tl.load(up_s_at + k0 // SCALE_K + group, mask=block_ok, other=0.0)
        mask = n_ok[:, None, None] & k_ok[None, :, :]
        acc_gate += tl.load(gate_at + k0, mask=mask, other=0.0).to(tl.float32) * (x * gate_scale[:, None])[None]
        acc_up += tl.load(up_at + k0, mask=mask, other=0.0).to(tl.float32) * (x * up_scale[:, None])[None]
    _store_silu_mul(h_ptr + pair * stride_h + n, n_ok, tl.sum(tl.sum(acc_gate, axis=2), axis=1),
                    tl.sum(tl.sum(acc_up, axis=2), axis=1))


@triton.jit
def _wait_for_token_experts(ids_ptr, topk_w_ptr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, PDL: tl.constexpr):
    """(token, slots, its chosen experts' ids, their router weights) of a down program, after the
    PDL wait."""
    pdl.wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, TOP_K_PAD)
    experts = tl.load(ids_ptr + token * TOP_K + slot, mask=slot < TOP_K, other=0).to(tl.int64)
    gates = tl.load(topk_w_ptr + token * TOP_K + slot, mask=slot < TOP_K, other=0.0)
    return token, slot, experts, gates


@triton.jit
def _expert_step(step, k_tiles, slot, experts, gates, STEP: tl.constexpr):
    """Step `step` of a down program's one loop over (chosen expert, K tile): (slot j, the tile's
    first column, the expert's id, its router weight)."""
    j = step // k_tiles
    k0 = (step - j * k_tiles) * STEP
    return j, k0, tl.sum(tl.where(slot == j, experts, 0)), tl.sum(tl.where(slot == j, gates, 0.0))


@triton.jit
def _down_gemv_kernel(h_ptr, w_ptr, ids_ptr, topk_w_ptr, y_ptr, N, K, stride_h, stride_we, stride_wn, stride_y,
                      TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr):
    pdl.start(PDL)
    # One token and BLOCK_N of the hidden columns: its chosen experts' down projections, each
    # input row scaled by the router's weight, summed in fp32 and rounded once. One loop runs over
    # every (expert, K tile) pair, its experts' ids read before it. Triton does not pipeline a loop
    # without a dot: each step's loads are issued after the last step's products, so a program's
    # steps are DRAM round trips one after another, which takes programs in the thousands (from 2
    # tokens at Qwen3-30B-A3B's experts) to hide.
    token, slot, experts, gates = _wait_for_token_experts(ids_ptr, topk_w_ptr, TOP_K, TOP_K_PAD, PDL)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for step in range(0, TOP_K * k_tiles):
        j, k0, expert, gate = _expert_step(step, k_tiles, slot, experts, gates, BLOCK_K)
        k_ok = k0 + k < K
        h = tl.load(h_ptr + (token * TOP_K + j) * stride_h + k0 + k, mask=k_ok, other=0.0).to(tl.float32) * gate
        w_at = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn + k0 + k[None, :]
        acc += tl.load(w_at, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * h[None, :]
    tl.store(y_ptr + token * stride_y + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_gemv_all_experts_kernel(h_ptr, w_ptr, ids_ptr, topk_w_ptr, y_ptr, N, K, stride_h, stride_we, stride_wn,
                                  stride_y, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    # _down_gemv_kernel with every chosen expert in each step: a step loads K_TILES tiles of
    # BLOCK_K columns of all of them, [TOP_K_PAD, BLOCK_N, BLOCK_K] each, unrolled, so that a
    # program's loads are in flight together where its programs are too few for one expert a step
    # (DOWN_GEMV_TILES says where). The input rows are loaded repeated along BLOCK_N (L1 hits), in
    # the weights' layout: broadcast from [TOP_K_PAD, BLOCK_K] they would change layout through
    # shared memory, behind a barrier, every tile.
    token, slot, experts, gates = _wait_for_token_experts(ids_ptr, topk_w_ptr, TOP_K, TOP_K_PAD, PDL)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)[None, None, :]
    rows_ok = ((slot < TOP_K)[:, None] & (n < N)[None, :])[:, :, None]
    h_at = h_ptr + ((token * TOP_K + slot) * stride_h)[:, None, None] + (n * 0)[None, :, None] + k
    w_at = w_ptr + (experts * stride_we)[:, None, None] + (n.to(tl.int64) * stride_wn)[None, :, None] + k
    gate = gates[:, None, None]
    acc = tl.zeros([TOP_K_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k_step in range(0, K, K_TILES * BLOCK_K):
        for tile in tl.static_range(K_TILES):
            k0 = k_step + tile * BLOCK_K
            mask = rows_ok & (k0 + k < K)
            h = tl.load(h_at + k0, mask=mask, other=0.0).to(tl.float32) * gate
            acc += tl.load(w_at + k0, mask=mask, other=0.0).to(tl.float32) * h
    tl.store(y_ptr + token * stride_y + n, tl.sum(tl.sum(acc, axis=2), axis=0).to(y_ptr.dtype.element_ty),
             mask=n < N)


@triton.jit
def _down_gemv_fp8_kernel(h_ptr, w_ptr, s_ptr, ids_ptr, topk_w_ptr, y_ptr, N, K, stride_h, stride_we, stride_wn,
                          stride_se, stride_sn, stride_y, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
                          BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                          PDL: tl.constexpr):
    pdl.start(PDL)
    # _down_gemv_kernel for block-FP8 experts, in K steps of GROUPS scale blocks as
    # _gate_up_gemv_fp8_kernel takes them: BLOCK_N divides SCALE_N, so the program's rows share a
    # row of scales, and each block's scale multiplies the input's columns with the router's weight.
    token, slot, experts, gates = _wait_for_token_experts(ids_ptr, topk_w_ptr, TOP_K, TOP_K_PAD, PDL)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    group = tl.arange(0, GROUPS)
    kk = group[:, None] * SCALE_K + tl.arange(0, SCALE_K)[None, :]  # [GROUPS, SCALE_K]
    STEP: tl.constexpr = GROUPS * SCALE_K
    k_tiles = tl.cdiv(K, STEP)
    acc = tl.zeros([BLOCK_N, GROUPS, SCALE_K], dtype=tl.float32)
    for step in range(0, TOP_K * k_tiles):
        j, k0, expert, gate = _expert_step(step, k_tiles, slot, experts, gates, STEP)
        k_ok = k0 + kk < K
        block_ok = k0 + group * SCALE_K < K
        scale = tl.load(s_ptr + expert * stride_se + (n0 // SCALE_N) * stride_sn + k0 // SCALE_K + group,
                        mask=block_ok, other=0.0)
        h = tl.load(h_ptr + (token * TOP_K + j) * stride_h + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        w_at = w_ptr + expert * stride_we + n[:, None, None].to(tl.int64) * stride_wn + k0 + kk[None, :, :]
        w = tl.load(w_at, mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0).to(tl.float32)
        acc += w * (h * (scale * gate)[:, None])[None]
    tl.store(y_ptr + token * stride_y + n, tl.sum(tl.sum(acc, axis=2), axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _dot_tile(a, w_ptrs, mask, s_ptrs, s_mask, acc, FP8: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ w for a [BLOCK_K, BLOCK_N] weight tile, an FP8 one converted to a's dtype and
    its product scaled by its columns' block scales."""
    w = tl.load(w_ptrs, mask=mask, other=0.0)
    if FP8:
        w = w.to(a.dtype)
    if IEEE:  # float32 activations: no tf32 rounding
        part = tl.dot(a, w, input_precision="ieee")
    else:
        part = tl.dot(a, w)
    if FP8:
        part = part * tl.load(s_ptrs, mask=s_mask, other=0.0)[None, :]
    return acc + part


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, s_ptr, c_ptr, sorted_ptr, block_expert_ptr, filled_ptr, topk_w_ptr,
                         num_pairs, N, K, stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_c,
                         TOP_K: tl.constexpr, ROWS_ARE_TOKENS: tl.constexpr, SILU: tl.constexpr,
                         WEIGHTED: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    # BLOCK_M pairs of one expert (a block of the sorted pairs) times BLOCK_N of its output
    # columns. Row r of the output is pair r. With ROWS_ARE_TOKENS, a pair's input row is its
    # token's (x); otherwise its own (h). With SILU, N is I and the program also multiplies up's
    # rows I + n, storing silu(gate) * up.
    pdl.wait(PDL)
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    block, pid_n = pid // tiles_n, pid % tiles_n
    if block * BLOCK_M >= tl.load(filled_ptr):
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    pair = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    p_ok = pair < num_pairs  # padding slots hold num_pairs
    if ROWS_ARE_TOKENS:
        row = pair // TOP_K
    else:
        row = pair
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < N
    a_at = a_ptr + row[:, None] * stride_a + k[None, :]
    w_at = w_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]
    s_at = s_ptr + expert * stride_se + (n // SCALE_N) * stride_sn
    up_s_at = s_ptr + expert * stride_se + ((n + N) // SCALE_N) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + k < K
        a = tl.load(a_at + k0, mask=p_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        acc = _dot_tile(a, w_at + k0, w_mask, s_at + k0 // SCALE_K, n_ok, acc, FP8, IEEE)
        if SILU:
            acc_up = _dot_tile(a, w_at + N * stride_wn + k0, w_mask, up_s_at + k0 // SCALE_K, n_ok, acc_up, FP8, IEEE)
    out = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
    if SILU:
        up = acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
        out = out / (1.0 + tl.exp(-out)) * up
    if WEIGHTED:
        out = out * tl.load(topk_w_ptr + pair, mask=p_ok, other=0.0)[:, None]
    tl.store(c_ptr + pair[:, None] * stride_c + n[None, :], out.to(c_ptr.dtype.element_ty),
             mask=p_ok[:, None] & n_ok[None, :])


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, top_k], expert ids int32 [T, top_k]): the top_k
    of softmax(logits) in fp32, largest first, divided by their sum with renormalize."""
    T, E = logits.shape
    if logits.stride(1) != 1 or not 1 <= top_k <= E:
        raise ValueError(f"route takes logits [T, E] contiguous along E and 1 <= top_k <= E; got "
                         f"{tuple(logits.shape)}, top_k {top_k}")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T:
        pdl_mode = pdl.mode(logits.device, T, PDL_FIRST_TOKENS)
        _route_kernel[(T,)](logits, weights, ids, E, logits.stride(0), TOP_K=top_k,
                            BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k),
                            RENORMALIZE=renormalize, PDL=pdl_mode, num_warps=1 if E <= 256 else 4,
                            launch_pdl=pdl_mode > 0)
    return weights, ids


def sorted_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most slots the pairs can fill once each expert's run is padded to a multiple of block_m."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The (token, chosen expert) pairs, numbered token * top_k + j, sorted by expert and each
    expert's run padded to a multiple of block_m: (sorted pair ids int32 [capacity], padding slots
    holding the pair count; the expert of each block of block_m slots, int32, num_experts for the
    blocks past the last filled one; the number of filled slots, a one-element int32 tensor).
    All on the device, in shapes fixed by the pair count: no value comes to the host."""
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded_ends = ((counts + block_m - 1) // block_m * block_m).cumsum(0)
    padded_starts = padded_ends - (counts + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)  # pair ids, grouped by expert, in pair order within one
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    capacity = sorted_capacity(pairs, num_experts, block_m)
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, padded_starts[sorted_experts] + rank_in_expert, order.int())
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True).int()
    return sorted_ids, block_expert, padded_ends[-1:].int()


def _check_weights(x, w, scale, scale_block, name):
    if w.stride(-1) != 1:
        raise ValueError(f"fused_moe needs {name} contiguous along its last dimension")
    if w.dtype == _FP8:
        if scale is None or scale_block is None:
            raise ValueError(f"fused_moe: FP8 {name} needs its block scales and their block shape")
        E, N, K = w.shape
        grid = (E, triton.cdiv(N, scale_block[0]), triton.cdiv(K, scale_block[1]))
        if tuple(scale.shape) != grid or scale.dtype != torch.float32 or scale.stride(-1) != 1:
            raise ValueError(f"fused_moe: {name} {tuple(w.shape)} in blocks of {tuple(scale_block)} takes float32 "
                             f"scales of {grid}; got {tuple(scale.shape)} {scale.dtype}")
        return True, scale, scale_block
    if w.dtype != x.dtype:
        raise ValueError(f"fused_moe: {name} is {w.dtype}, x is {x.dtype}")
    return False, w, (1, 1)  # an unread stand-in for the scales


def grouped_block_m(num_pairs: int, num_experts: int) -> int:
    """Pairs per grouped-GEMM program: few pairs per expert waste most of a big block on padding."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              scale_block: tuple[int, int] | None = None, gemv: bool | None = None, **launch) -> torch.Tensor:
    """sum over j of topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j],
    as [T, H] in x's dtype. x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_weights float32 and
    topk_ids int32, both [T, top_k] (route's output). FP8 weights take float32 scales
    [E, cdiv(rows, scale_n), cdiv(cols, scale_k)] and scale_block (scale_n, scale_k). gemv picks
    the path (default: the GEMV one for up to GEMV_MAX_TOKENS tokens); `launch` (block_m, block_n,
    block_k, all_experts, num_warps, num_stages) overrides the chosen path's tiles, for tests and
    sweeps (all_experts: which of the two unquantized GEMV down kernels runs)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if x.stride(1) != 1 or tuple(w13.shape) != (E, 2 * inter, H) or tuple(w2.shape) != (E, H, inter):
        raise ValueError(f"fused_moe takes x [T, H] contiguous, w13 [E, 2I, H] and w2 [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T or topk_ids.dtype != torch.int32 \
            or topk_weights.dtype != torch.float32 or not topk_ids.is_contiguous() or not topk_weights.is_contiguous():
        raise ValueError("fused_moe takes contiguous topk_weights (float32) and topk_ids (int32), both [T, top_k]")
    if set(launch) - {"block_m", "block_n", "block_k", "all_experts", "num_warps", "num_stages"}:
        raise TypeError(f"fused_moe's launch knobs are block_m, block_n, block_k, all_experts, num_warps, num_stages; "
                        f"got {sorted(launch)}")
    fp8_13, s13, block13 = _check_weights(x, w13, w13_scale, scale_block, "w13")
    fp8_2, s2, block2 = _check_weights(x, w2, w2_scale, scale_block, "w2")
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    if gemv is None:
        gemv = T <= GEMV_MAX_TOKENS
    pdl_mode = pdl.mode(x.device, T, PDL_FIRST_TOKENS)
    if gemv:
        h = torch.empty(T * top_k, inter, dtype=x.dtype, device=x.device)
        _moe_gemv(x, w13, s13, block13, fp8_13, w2, s2, block2, fp8_2, topk_weights, topk_ids, h, out, launch, pdl_mode)
    else:
        _moe_grouped(x, w13, s13, block13, fp8_13, w2, s2, block2, fp8_2, topk_weights, topk_ids, out, launch,
                     pdl_mode)
    return out


def _k_tile(block_k: int, K: int, scale_k: int, fp8: bool) -> int:
    # An FP8 tile stays inside one scale block, so that it needs one scale per weight row.
    block_k = min(block_k, triton.next_power_of_2(K))
    return min(block_k, scale_k) if fp8 else block_k


# Each FP8 GEMV kernel's (block_n, block_k, num_warps) up to a few tokens, the same beyond them, and
# how many tokens are few; block_k is FP8 columns a K step (whole scale blocks). The best of a sweep
# of each kernel alone at Qwen3-30B-A3B's experts, 1 and 8 tokens, in a graph of calls on new
# routings (H200, benchmarks/HISTORY.md, 2026-11-28, session of 19:22; bench_kernels --sweep-moe-fp8
# sets these): gate/up 11.31 and 65.95 us, down 10.85 and 32.00, against 12.34 and 81.39, 12.05 and
# 51.30 for the first tiles tried (2 x 1024 on 2 warps, 4 x 1024 on 2). With those first tiles the
# layer took 26.32 us at one token against 46.60 for the kernels before these, whose tiles were 4
# rows of one 128-column scale block. Down keeps its one-token tiles up to 3 tokens: at 2 they took
# 13.63 us against 22.80, at 4 25.64 against 25.08.
FP8_GEMV_TILES = {"gate_up": ((2, 512, 1), (1, 256, 1), 1), "down": ((8, 1024, 4), (8, 256, 1), 3)}


def _fp8_default_tiles(kernel: str, tokens: int) -> tuple[int, int, int]:
    if _interpreted():  # the interpreter runs programs one by one: fewer, wider ones
        return 32, 128, 1
    few, more, few_tokens = FP8_GEMV_TILES[kernel]
    return few if tokens <= few_tokens else more


def _fp8_tiles(launch: dict, default: tuple[int, int, int], rows: int, K: int, block: tuple[int, int]):
    """(block_n, groups of scale_k columns a K step, num_warps) for an FP8 GEMV kernel: block_n cut
    to a divisor of the scale blocks' rows, so that a program's rows share their scales, and of
    `rows` (gate/up's I, where gate's rows end and up's begin: up's programs then share theirs too).
    block_k is rounded to whole scale blocks, at least one."""
    scale_n, scale_k = block
    block_n = math.gcd(launch.get("block_n") or default[0], scale_n, rows)
    block_k = min(launch.get("block_k") or default[1], triton.next_power_of_2(K))
    return block_n, max(block_k // scale_k, 1), launch.get("num_warps") or default[2]


def _moe_gemv(x, w13, s13, block13, fp8_13, w2, s2, block2, fp8_2, topk_weights, topk_ids, h, out, launch, pdl_mode):
    T, H = x.shape
    inter, top_k = h.shape[1], topk_ids.shape[1]
    num_stages = launch.get("num_stages") or 3
    top_k_pad = triton.next_power_of_2(top_k)
    # gate/up swept at one token on an H200 (benchmarks/HISTORY.md, 2026-11-27), the experts read as
    # a step's layers read them (Qwen3-30B-A3B's, H 2048, I 768): long K tiles pay most, 2 rows x
    # 1,024 on 2 warps 13.8 us against 17.4 with 4 x 256.
    interpreted = _interpreted()  # the interpreter runs programs one by one: fewer, wider ones
    if fp8_13:
        block_n, groups, warps = _fp8_tiles(launch, _fp8_default_tiles("gate_up", T),
                                            inter, H, block13)
        _gate_up_gemv_fp8_kernel[(T * top_k, triton.cdiv(inter, block_n))](
            x, w13, s13, topk_ids, h, inter, H, x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0),
            s13.stride(1), h.stride(0), TOP_K=top_k, BLOCK_N=block_n, GROUPS=groups, SCALE_N=block13[0],
            SCALE_K=block13[1], PDL=pdl_mode, num_warps=warps, num_stages=num_stages, launch_pdl=pdl_mode > 0)
    else:
        block_n = launch.get("block_n") or (32 if interpreted else 2)
        block_k = min(launch.get("block_k") or 2048 // w13.element_size(), triton.next_power_of_2(H))
        _gate_up_gemv_kernel[(T * top_k, triton.cdiv(inter, block_n))](
            x, w13, topk_ids, h, inter, H, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), TOP_K=top_k,
            BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl_mode, num_warps=launch.get("num_warps") or 2,
            num_stages=num_stages, launch_pdl=pdl_mode > 0)
    if fp8_2:
        block_n, groups, warps = _fp8_tiles(launch, _fp8_default_tiles("down", T),
                                            H, inter, block2)
        _down_gemv_fp8_kernel[(T, triton.cdiv(H, block_n))](
            h, w2, s2, topk_ids, topk_weights, out, H, inter, h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0),
            s2.stride(1), out.stride(0), TOP_K=top_k, TOP_K_PAD=top_k_pad, BLOCK_N=block_n, GROUPS=groups,
            SCALE_N=block2[0], SCALE_K=block2[1], PDL=pdl_mode, num_warps=warps, num_stages=num_stages,
            launch_pdl=pdl_mode > 0)
    else:
        all_experts, block_n, block_k, num_warps = _down_tiles(launch, T, inter, w2.element_size())
        block_k = min(block_k, triton.next_power_of_2(inter))
        common = dict(TOP_K=top_k, TOP_K_PAD=top_k_pad, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl_mode,
                      num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl_mode > 0)
        args = (h, w2, topk_ids, topk_weights, out, H, inter, h.stride(0), w2.stride(0), w2.stride(1), out.stride(0))
        if all_experts:
            _down_gemv_all_experts_kernel[(T, triton.cdiv(H, block_n))](
                *args, K_TILES=min(triton.cdiv(inter, block_k), 4), **common)
        else:
            _down_gemv_kernel[(T, triton.cdiv(H, block_n))](*args, **common)


# The unquantized GEMV down kernels' launch, (all_experts, block_n, block_k, num_warps), up to a
# few tokens, the same beyond them, and how many tokens are few; for rows (I, the kernels' K) of
# more than 512 columns, and of at most 512 (the tensor-parallel halves of Qwen3-30B-A3B's
# experts). all_experts picks _down_gemv_all_experts_kernel (a step of every chosen expert, up to 4
# K tiles of block_k) over _down_gemv_kernel (a step of one expert and one tile); block_k counts
# 16-bit columns (float32 weights take half as many). The best of sweeps of the kernels alone at
# Qwen3-30B-A3B's experts, 1-8 tokens, in a graph of calls on new routings (H200,
# benchmarks/HISTORY.md, 2026-11-29, session of 07:02):
# - I 768: one token 8.50 us against 10.67 for the one-expert kernel's 4 rows x 1,024 on 2 warps,
#   whose 512 programs' eight steps are one DRAM round trip after another (Qwen3-30B-A3B batch 1
#   2.426 against 2.511 ms a step). From 2 tokens the programs are many, and one expert a step
#   stays faster: 13.53 against 14.86 us at 2 tokens, 44.03 against 48.07 at 8.
# - I 384: one token 4.72 us against 8.78 for the one-expert kernel's 2 rows x 512 on 4 warps,
#   8 tokens 24.65 against 41.80.
DOWN_GEMV_TILES = {False: ((True, 1, 256, 8), (False, 4, 1024, 2), 1),
                   True: ((True, 2, 128, 8), (True, 1, 128, 4), 1)}


def _down_tiles(launch: dict, tokens: int, inter: int, element_size: int) -> tuple[bool, int, int, int]:
    if _interpreted():  # the interpreter runs programs one by one: fewer, wider ones
        all_experts, block_n, block_k, num_warps = False, 32, 1024, 2
    else:
        few, more, few_tokens = DOWN_GEMV_TILES[inter <= 512]
        all_experts, block_n, block_k, num_warps = few if tokens <= few_tokens else more
    if launch.get("all_experts") is not None:
        all_experts = launch["all_experts"]
    return (all_experts, launch.get("block_n") or block_n,
            launch.get("block_k") or block_k * 2 // element_size, launch.get("num_warps") or num_warps)


def _moe_grouped(x, w13, s13, block13, fp8_13, w2, s2, block2, fp8_2, topk_weights, topk_ids, out, launch, pdl_mode):
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    pairs = T * top_k
    block_m = launch.get("block_m") or grouped_block_m(pairs, E)
    # Untuned, after vLLM's fused-MoE defaults for small and large batches; gate/up's programs
    # take half the columns of down's, since each multiplies gate's and up's rows.
    down_n = launch.get("block_n") or (64 if block_m <= 32 else 128)
    gate_up_n = launch.get("block_n") or 64
    num_warps = launch.get("num_warps") or (4 if block_m <= 32 else 8)
    sorted_ids, block_expert, filled = align_by_expert(topk_ids, E, block_m)
    blocks = sorted_ids.shape[0] // block_m
    ieee = x.dtype == torch.float32
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    common = dict(TOP_K=top_k, BLOCK_M=block_m, IEEE=ieee, PDL=pdl_mode, num_warps=num_warps,
                  num_stages=launch.get("num_stages") or 3, launch_pdl=pdl_mode > 0)
    _grouped_gemm_kernel[(blocks * triton.cdiv(inter, gate_up_n),)](
        x, w13, s13, h, sorted_ids, block_expert, filled, topk_weights, pairs, inter, H, x.stride(0), w13.stride(0),
        w13.stride(1), s13.stride(0), s13.stride(1) if fp8_13 else 0, h.stride(0), ROWS_ARE_TOKENS=True, SILU=True,
        WEIGHTED=False, FP8=fp8_13, SCALE_N=block13[0], SCALE_K=block13[1], BLOCK_N=gate_up_n,
        BLOCK_K=_k_tile(launch.get("block_k") or 64, H, block13[1], fp8_13), **common)
    weighted = torch.empty(pairs, H, dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(blocks * triton.cdiv(H, down_n),)](
        h, w2, s2, weighted, sorted_ids, block_expert, filled, topk_weights, pairs, H, inter, h.stride(0),
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1) if fp8_2 else 0, weighted.stride(0),
        ROWS_ARE_TOKENS=False, SILU=False, WEIGHTED=True, FP8=fp8_2, SCALE_N=block2[0], SCALE_K=block2[1],
        BLOCK_N=down_n, BLOCK_K=_k_tile(launch.get("block_k") or 64, inter, block2[1], fp8_2), **common)
    # Each token's top_k rows summed in a fixed order: the same sum whatever the routing.
    torch.sum(weighted.view(T, top_k, H), dim=1, out=out)
