"""Products with block-wise FP8 weights: W is e4m3 (torch.float8_e4m3fn) with one float32 scale per
[scale_n, scale_k] tile, W ~= q * scale[n // scale_n, k // scale_k], the layout of Qwen's and
DeepSeek's FP8 checkpoints (`weight_scale_inv`, blocks of [128, 128]). The weights are never
dequantized to memory:

- fp8_gemv, 1 to 8 rows (a chat-sized decode step): bound by the bytes of W it reads, half of
  bf16's. Each program streams a band of W's rows along K once. At one row ("one"), x's run of
  each scale block is scaled in fp32 and multiply-added into the weights converted to fp32; at
  2-8 rows ("dot"), each run of W is converted to x's dtype (exact) and multiplied into all of
  x's rows on the tensor cores, the product scaled by its block's scales in fp32. x keeps its
  dtype (weight-only FP8): its rows are not rounded. rms_norm_fp8_gemv is the one-row kernel with
  the pre-norm RMSNorm (and its residual add) in its prologue, as kernels/gemv.py's rms_norm_gemv.
- fp8_gemm, any number of rows (prefill, big batches): with bf16 or fp16 x, the activations are
  quantized to e4m3 per row and scale_k columns (quantize_activations: a float32 scale each) and
  each K block is one FP8 tensor-core product scaled by both scales, as vLLM and SGLang run these
  checkpoints: twice bf16's tensor-core rate on Hopper. With float32 x, W's tiles are converted
  to float32 and multiplied exactly (input_precision="ieee"): what the tests compare to HF's
  float32 model.
- w8a8_gemv, 1-32 rows already quantized as fp8_gemm quantizes them: W and x both e4m3 into
  the tensor cores, W's rows the MMA's long side, K optionally cut into pieces run by programs of
  their own (a narrow W's bands alone would leave SMs idle) and summed by the last to finish. At
  those rows it streams W faster than cuBLAS's block-scaled product (engine/layers/fp8.py's
  w8a8_launch says where, in how many pieces and on how many warps).
- sum_k_pieces: the float32 partials of one product cut into pieces of K (engine/layers/fp8.py
  runs the pieces through cuBLAS side by side) summed and rounded once.

Each scale multiplies a run of columns inside one scale block (the GEMM's K tile divides scale_k;
the GEMV's tile is GROUPS such runs), so a run needs one scale per weight row. Shapes need not be
multiples of the blocks: the last block of a row or column may be partial (the checkpoint's scale
grid is the ceiling of the shape over the block), except along K in w8a8_gemv.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.gemv import check_norm_inputs, norm_input_tile, wait_then_rstd

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value; torch turns anything beyond it into NaN
MAX_GEMV_ROWS = 8
W8A8_GEMV_ROWS = 32
W8A8_MAX_PIECES = 64
_GEMV_KNOBS = ("kernel", "block_n", "block_k", "num_warps", "num_stages", "unroll")
_DOT_ROWS = 16  # the smallest MMA tile's side: x's rows are padded to it
_GEMM_KNOBS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")


@triton.jit
def _fp8_step_products(w, x, SUM: tl.constexpr):
    """One loop step of _fp8_gemv_one_kernel: W's [BLOCK_N, UNROLL, GROUPS, GROUP_K] FP8 tile times
    x's scaled columns, in fp32, the UNROLL tiles summed; all of the step summed into BLOCK_N
    values where SUM."""
    products = tl.sum(w.to(tl.float32) * x[None], axis=1)
    if SUM:
        products = tl.sum(tl.sum(products, axis=2), axis=1)
    return products


@triton.jit
def _fp8_gemv_one_kernel(x_ptr, res_ptr, nw_ptr, res_out_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_w, stride_s, eps,
                         BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, GROUPS: tl.constexpr, GROUP_K: tl.constexpr,
                         SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, NORM_BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                         RESIDUAL: tl.constexpr, PDL: tl.constexpr, SUM_EACH_STEP: tl.constexpr):
    pdl.start(PDL)
    # One row of x against BLOCK_N rows of W, UNROLL tiles of GROUPS runs of GROUP_K columns a loop
    # step, each run inside one scale block. BLOCK_N divides SCALE_N, so the program's rows share a
    # row of scales: each run's scale multiplies x's run (GROUP_K products shared by the BLOCK_N
    # rows), not every weight, and is one load per run, not one per weight row. The UNROLL tiles
    # are summed into one accumulator as they arrive: more of W in flight for the same registers.
    # That accumulator is a [BLOCK_N, GROUPS, GROUP_K] fp32 tile summed once at the end, or with
    # SUM_EACH_STEP each step's products are summed into BLOCK_N values at once (fp8_gemv says which).
    # NORM is kernels/gemv.py's prologue: every program forms x = RMSNorm(x + residual) itself
    # (one_row_fuses_norm says where that pays).
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    run = tl.arange(0, UNROLL)[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :]  # [UNROLL, GROUPS]
    kk = run[:, :, None] * GROUP_K + tl.arange(0, GROUP_K)[None, None, :]  # the step's columns
    w_at = w_ptr + n[:, None, None, None].to(tl.int64) * stride_w + kk[None, :, :, :]
    s_at = s_ptr + (pid * BLOCK_N // SCALE_N) * stride_s
    STEP: tl.constexpr = UNROLL * GROUPS * GROUP_K
    # The first step of W and its scales before the wait: weights, which no kernel writes.
    w_mask = n_ok[:, None, None, None] & (kk < K)[None]
    w = tl.load(w_at, mask=w_mask, other=0.0)
    scale = tl.load(s_at + run * GROUP_K // SCALE_K, mask=run * GROUP_K < K, other=0.0)
    rstd = tl.sum(wait_then_rstd(x_ptr, res_ptr, res_out_ptr, tl.arange(0, 1), tl.arange(0, 1) < 1, K, 0, 0, eps,
                                 1, NORM_BLOCK_K, NORM, RESIDUAL, PDL), axis=0)
    x = norm_input_tile(x_ptr, res_ptr, nw_ptr, 0, kk, kk < K, kk < K, rstd, 0, 0, NORM, RESIDUAL).to(tl.float32)
    acc = _fp8_step_products(w, x * scale[:, :, None], SUM_EACH_STEP)
    for k0 in range(STEP, K, STEP):
        k = k0 + kk
        w_mask = n_ok[:, None, None, None] & (k < K)[None]
        s_mask = k0 + run * GROUP_K < K
        w = tl.load(w_at + k0, mask=w_mask, other=0.0)
        scale = tl.load(s_at + (k0 + run * GROUP_K) // SCALE_K, mask=s_mask, other=0.0)
        x = norm_input_tile(x_ptr, res_ptr, nw_ptr, 0, k, k < K, k < K, rstd, 0, 0, NORM, RESIDUAL).to(tl.float32)
        acc += _fp8_step_products(w, x * scale[:, :, None], SUM_EACH_STEP)
    y = acc
    if not SUM_EACH_STEP:
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _fp8_gemv_dot_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_s, stride_y,
                         ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP_K: tl.constexpr,
                         SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    # y.T = W @ x.T on the tensor cores, x's rows padded to the 16 an MMA takes: each run of
    # GROUP_K columns (inside one scale block) is converted to x's dtype (exact: e4m3 fits in
    # bf16 and fp16), multiplied into every row of x at once, and its [BLOCK_N, ROWS] product
    # scaled by its rows' scales. GROUPS runs a loop step, so their loads are in flight together.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, ROWS)
    c = tl.arange(0, GROUP_K)
    n_ok, r_ok = n < N, r < M
    w_at = w_ptr + n[:, None].to(tl.int64) * stride_w + c[None, :]
    xt_at = x_ptr + r[None, :] * stride_x + c[:, None]
    s_at = s_ptr + (n // SCALE_N) * stride_s
    pdl.wait(PDL)
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for k0 in range(0, K, GROUPS * GROUP_K):
        for g in tl.static_range(GROUPS):
            kg = k0 + g * GROUP_K
            k_ok = kg + c < K
            w = tl.load(w_at + kg, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            # A run past K (its weights masked to 0) reads the last scale column, not past it.
            scale = tl.load(s_at + tl.minimum(kg, K - 1) // SCALE_K, mask=n_ok, other=0.0)
            xt = tl.load(xt_at + kg, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            if IEEE:  # float32 x: no tf32 rounding
                part = tl.dot(w.to(xt.dtype), xt, input_precision="ieee")
            else:
                part = tl.dot(w.to(xt.dtype), xt)
            acc += part * scale[:, None]
    tl.store(y_ptr + r[None, :] * stride_y + n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=n_ok[:, None] & r_ok[None, :])


@triton.jit
def _w8a8_gemv_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, parts_ptr, arrivals_ptr, M, N, K, pieces, stride_xq,
                      stride_xs_row, stride_xs_group, stride_w, stride_ws, stride_y, ROWS: tl.constexpr,
                      BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, PIECES: tl.constexpr, SCALE_N: tl.constexpr,
                      SCALE_K: tl.constexpr, PDL: tl.constexpr):
    # y.T = W @ x.T with both in e4m3 on the tensor cores: W's rows are the MMA's long side, x's rows
    # (padded to ROWS, at least the 16 an MMA takes) its short one. Compiled for sm_90, four warps
    # multiply e4m3 by wgmma; one or two widen both to fp16 for mma.sync first (exact: every e4m3
    # value is an fp16 one). Each K step is one scale block of both; its fp32 product is scaled by
    # W's block scale (one a program: BLOCK_N divides SCALE_N) times each x row's. GROUPS blocks a
    # loop step keep more of W in flight.
    #
    # With PIECES > 1 the programs along axis 1 each take one piece of K for the same band of W's
    # rows and store their fp32 partial; the band's last program to arrive (its arrivals counter
    # says which) sums the partials in piece order, so the result does not depend on the order the
    # programs ran in, and sets the counter back to zero for the next product.
    band = tl.program_id(0)
    piece = tl.program_id(1)
    n = band * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, ROWS)
    c = tl.arange(0, SCALE_K)
    n_ok, r_ok = n < N, r < M
    piece_k = K // PIECES
    k_first = piece * piece_k
    w_at = w_ptr + n[:, None].to(tl.int64) * stride_w + c[None, :]
    x_at = xq_ptr + r[:, None] * stride_xq + c[None, :]
    xs_at = xs_ptr + r * stride_xs_row
    ws_at = ws_ptr + (band * BLOCK_N // SCALE_N) * stride_ws
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for k0 in range(k_first, k_first + piece_k, GROUPS * SCALE_K):
        for g in tl.static_range(GROUPS):
            kg = k0 + g * SCALE_K
            w = tl.load(w_at + kg, mask=n_ok[:, None], other=0.0)
            xq = tl.load(x_at + kg, mask=r_ok[:, None], other=0.0)
            x_scale = tl.load(xs_at + (kg // SCALE_K) * stride_xs_group, mask=r_ok, other=0.0)
            w_scale = tl.load(ws_at + kg // SCALE_K)
            acc += tl.dot(w, tl.trans(xq)) * (x_scale * w_scale)[None, :]
    if PDL:
        # Once W is read, not at the wait: the grid spans several waves, which the next kernel's
        # programs, launched early, share the SMs with. Graph replays at FP8 batches 2 / 8 / 16
        # took 1.3 / 1.3 / 0.9% less (H200, benchmarks/HISTORY.md, 2026-11-28, 15:26).
        tl.extra.cuda.gdc_launch_dependents()
    out_mask = n_ok[:, None] & r_ok[None, :]
    if PIECES == 1:
        tl.store(y_ptr + r[None, :] * stride_y + n[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = r[None, :] * N + n[:, None]  # parts [PIECES, M, N], contiguous
        tl.store(parts_ptr + piece * M * N + part, acc, mask=out_mask)
        # Every thread's stores are issued before one thread releases them with the arrival; the
        # last arriver's acquire makes the other pieces' stores visible, read past L1 (.cg), which
        # is not coherent across SMs.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + band, 1, sem="acq_rel", scope="gpu")
        if arrived == PIECES - 1:
            tl.debug_barrier()
            total = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
            # pieces is PIECES passed at run time: a loop whose count the compiler does not know
            # stays a loop, one partial in registers at a time.
            for p in tl.range(0, pieces, num_stages=1):
                total += tl.load(parts_ptr + p * M * N + part, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + r[None, :] * stride_y + n[:, None], total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.store(arrivals_ptr + band, 0)


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to e4m3's grid, half to even, in fp32 arithmetic: a step of
    2**(exponent - 3) (three mantissa bits; subnormals below 2**-6 share its step), rounded by
    the add-and-subtract of 1.5 * 2**23. The hardware conversion rounds the same way; Triton
    3.9's interpreter does not (127.2 became 64, not 128: it drops a carry into the exponent),
    and the tests run this kernel there. Converting an on-grid value is exact everywhere. A
    negative value that rounds to zero keeps its sign, as in the hardware's conversion."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = ((v / step + 12582912.0) - 12582912.0) * step
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_code(r):
    """The e4m3 bits of r, a value on e4m3's grid within +-448 or NaN, assembled from r's own bits:
    the interpreter's conversion turns NaN into a number, and this is the same code everywhere."""
    bits = r.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    exponent = ((bits >> 23) & 0xFF) - 127
    normal = ((exponent + 7) << 3) | ((bits >> 20) & 0x7)  # e4m3's exponent bias is 7
    subnormal = (tl.abs(tl.where(r != r, 0.0, r)) * 512.0).to(tl.int32)  # multiples of 2**-9 below 2**-6
    code = tl.where(exponent >= -6, normal, subnormal) | sign
    return tl.where(r != r, 0x7F, code).to(tl.uint8)


@triton.jit
def fp16_scaled_query(q, qk_scale):
    """q * qk_scale in fp16, for products against an e4m3 cache: Hopper widens e4m3 to fp16 in one
    instruction and to bf16 in several (every e4m3 value is an fp16 one). The product is formed in
    fp32, clamped into fp16's range (a NaN stays NaN) and rounded once, to fp16's 11 bits: within
    fp16's normal range (magnitudes from 2**-14) that moves each scaled query element by at most
    2**-11 of itself, an eighth of a bf16 rounding step, and scaling first keeps queries of up to
    65504 / qk_scale in range."""
    return tl.clamp(q.to(tl.float32) * qk_scale, -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float16)


@triton.jit
def as_cached(x, cache_ptr):
    """x as a KV cache of cache_ptr's element type keeps it: an e4m3 cache (no scale) saturates at
    +-448 (FP8_MAX), keeps NaN, and rounds half to even, as torch's conversion does."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        bounded = tl.clamp(x.to(tl.float32), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        return _e4m3_code(_round_to_e4m3(bounded)).to(tl.float8e4nv, bitcast=True)
    else:
        return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def store_row_groups(v, q_row_ptr, s_row_ptr, first_group, n_cols, live_cols, stride_s_group,
                     GROUP: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
    """Stores v [BLOCK] (float32), one row's columns from first_group * GROUP on, as
    quantize_activations does: each group of GROUP columns in e4m3 at q_row_ptr, scaled so that its
    largest magnitude maps to FP8_MAX, its float32 scale at s_row_ptr + group * stride_s_group.
    Columns from n_cols on are not stored; from live_cols on (n_cols, or 0 for a padding row) they
    count as zeros. For kernels that produce the activations and quantize them in the same pass, so
    no launch reads them back to do it."""
    cols = first_group * GROUP + tl.arange(0, BLOCK)
    v = tl.where(cols < live_cols, v, 0.0)
    groups = tl.reshape(v, (BLOCK // GROUP, GROUP))
    scale = tl.maximum(tl.max(tl.abs(groups), axis=1), 1e-10) / FP8_MAX
    q = _round_to_e4m3(tl.clamp(groups / scale[:, None], -FP8_MAX, FP8_MAX))
    tl.store(q_row_ptr + cols, tl.reshape(q, (BLOCK,)).to(q_row_ptr.dtype.element_ty), mask=cols < n_cols)
    group = first_group + tl.arange(0, BLOCK // GROUP)
    tl.store(s_row_ptr + group * stride_s_group, scale, mask=group * GROUP < n_cols)


def activation_buffers(rows: int, cols: int, group: int, pad_rows_to: int, scales_by_column: bool,
                       device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (e4m3 [P, cols], float32 scales [P, cdiv(cols, group)]) for quantized activations, P =
    rows rounded up to a multiple of pad_rows_to; scales_by_column lays the scales out column by
    column (stride (1, P)), as cuBLAS's block-scaled product reads them."""
    padded = triton.cdiv(rows, pad_rows_to) * pad_rows_to
    groups = triton.cdiv(cols, group)
    q = torch.empty(padded, cols, dtype=FP8, device=device)
    if scales_by_column:
        return q, torch.empty(groups, padded, dtype=torch.float32, device=device).t()
    return q, torch.empty(padded, groups, dtype=torch.float32, device=device)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_s_row, stride_s_group,
                          GROUP: tl.constexpr, GROUPS: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    # GROUPS groups of GROUP columns of one row, each scaled by its own largest magnitude. Rows from
    # M on are padding: zeros, with the smallest scale.
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    first_group = tl.program_id(1) * GROUPS
    k = first_group * GROUP + tl.arange(0, GROUPS * GROUP)
    live_k = tl.where(row < M, K, 0)  # a padding row loads no column
    x = tl.load(x_ptr + row * stride_x + k, mask=k < live_k, other=0.0).to(tl.float32)
    store_row_groups(x, q_ptr + row * stride_q, s_ptr + row * stride_s_row, first_group, K, live_k, stride_s_group,
                     GROUP, GROUPS * GROUP, FP8_MAX)


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_s_ptr, w_ptr, w_s_ptr, c_ptr, M, N, K, stride_a, stride_as, stride_w, stride_ws,
                     stride_c, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, QUANT_A: tl.constexpr,
                     IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    pdl.wait(PDL)
    # Programs in groups of GROUP_M row tiles walk the column tiles together, so that the weight
    # tiles they share are read from L2.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = m < M, n < N
    a_at = a_ptr + m[:, None].to(tl.int64) * stride_a + k[None, :]
    w_at = w_ptr + n[None, :].to(tl.int64) * stride_w + k[:, None]  # W's tile, transposed: [BLOCK_K, BLOCK_N]
    w_s_at = w_s_ptr + (n // SCALE_N) * stride_ws
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + k < K
        a = tl.load(a_at + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_at + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        w_scale = tl.load(w_s_at + k0 // SCALE_K, mask=n_ok, other=0.0)
        if QUANT_A:
            a_scale = tl.load(a_s_ptr + m * stride_as + k0 // SCALE_K, mask=m_ok, other=0.0)
            acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
        elif IEEE:  # float32 activations: no tf32 rounding
            acc += tl.dot(a, w.to(a.dtype), input_precision="ieee") * w_scale[None, :]
        else:
            acc += tl.dot(a, w.to(a.dtype)) * w_scale[None, :]
    tl.store(c_ptr + m[:, None].to(tl.int64) * stride_c + n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_block: tuple[int, int], what: str):
    N, K = weight.shape
    scale_n, scale_k = scale_block
    if x.dim() != 2 or x.shape[1] != K or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{what} takes x [M, K] and weight [N, K], contiguous along K; got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    if weight.dtype != FP8:
        raise ValueError(f"{what} takes a {FP8} weight, got {weight.dtype}")
    grid = (triton.cdiv(N, scale_n), triton.cdiv(K, scale_k))
    if tuple(scale.shape) != grid or scale.dtype != torch.float32 or scale.stride(1) != 1:
        raise ValueError(f"{what}: a weight of {(N, K)} in blocks of {tuple(scale_block)} takes float32 scales of "
                         f"{grid}, contiguous along K; got {tuple(scale.shape)} {scale.dtype}")
    if scale_k & (scale_k - 1) or scale_n < 1:
        raise ValueError(f"{what} takes blocks whose K side is a power of two, got {tuple(scale_block)}")


def _knobs(launch: dict, names: tuple[str, ...], what: str) -> None:
    if set(launch) - set(names):
        raise TypeError(f"{what}'s launch knobs are {names}; got {sorted(launch)}")


def gemv_launch_config(N: int, K: int, rows: int) -> tuple[str, int, int, int, int, int]:
    """(kernel, block_n, block_k, num_warps, num_stages, unroll), from bench_kernels --sweep-moe-fp8
    at Qwen3-8B's projections on an H100 (benchmarks/RESULTS.md), and a sweep with unroll on an
    H200 (benchmarks/HISTORY.md, 2026-11-27). One row: "one", the FMA kernel, 8 weight rows of 4096
    FP8 columns a step on 4 warps, each step summed at once (Qwen3-8B-FP8's qkv, o and down: a
    batch-1 step of 2.818-2.825 ms against 2.898-2.900 with 4 rows of 1024 on 2 warps, H200, 2026-11-29;
    those took 18.7 / 30.3 us at 6144x4096 / 4096x12288 on the H100, against 20.3 / 42.7 for 2
    rows), or 1 row of 2048 where N <= 2048; from 16,384 weight
    rows (gate and up, LM heads) 8 rows of two 256-column tiles a step on one warp (H200: 27.6
    against 32.4 us at 24576x4096, 154.9 against 183.2 at 151936x4096; no better on the shorter
    projections). 2-8 rows: "dot", the tensor cores (the FMA kernel at 8 rows was bound by its
    multiply-adds), with 64 weight rows a program where N makes at least 96 programs of them and
    32 otherwise, so that every SM has work (8 rows: 30.3 / 53.8 / 52.6 us, against 42.3 / 131.9
    / 75.4 for 16 rows)."""
    if rows == 1:
        if N <= 2048:
            return "one", 1, 2048, 4, 3, 1
        return ("one", 8, 256, 1, 3, 2) if N >= 16384 else ("one", 8, 4096, 4, 3, 1)
    return ("dot", 64, 128, 4, 3, 1) if N >= 96 * 64 else ("dot", 32, 512, 4, 3, 1)


# A pre-norm sublayer's first FP8 product of one row takes the norm into the one-row GEMV where
# it has at most this many columns (one_row_fuses_norm).
FUSED_NORM_K = 2048


def one_row_fuses_norm(K: int) -> bool:
    """Whether the engine runs a pre-norm sublayer's first FP8 product of one row, K columns, as
    rms_norm_fp8_gemv rather than the RMSNorm kernel before fp8_gemv. Every program forms the norm
    over all of K itself after the PDL wait, x and the residual from L2, before it can multiply:
    at Qwen3-30B-A3B-FP8's qkv (5120 x 2048) that costs less than the norm's launch saves, batch 1
    2.381-2.384 ms a step against 2.410-2.415; at Qwen3-8B-FP8's (6144 x 4096, 768 programs) more,
    2.934-2.937 against 2.817-2.830 (H200, benchmarks/HISTORY.md, 2026-11-29, session of 15:30).
    gate/up (24576 x 4096) with SiLU-mul taken in as well, in place of the W8A8 GEMV, lost 0.39 ms
    or more at every launch tried, so gate and up stay apart."""
    return K <= FUSED_NORM_K


def one_row_sums_each_step(block_n: int, block_k: int, num_warps: int) -> bool:
    """Whether the one-row kernel sums each step's products at once rather than into a [block_n,
    block_k] fp32 tile: where that tile would take more than 64 registers a thread. 8 rows x 4096
    on 4 warps (256 a thread), summed, made Qwen3-8B-FP8's batch 1 2.818-2.825 ms a step against
    2.898-2.900 with 4 rows x 1024 on 2 warps kept as a tile (64 a thread); summing that smaller
    launch each step took 3.066 against 2.895 (H200, benchmarks/HISTORY.md, 2026-11-29, sessions
    of 10:39 and 11:56)."""
    return block_n * block_k > 64 * 32 * num_warps


def _power_of_two(value: int, what: str) -> int:
    if value < 1 or value & (value - 1):
        raise ValueError(f"fp8_gemv's {what} must be a power of two, got {value}")
    return value


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_block: tuple[int, int],
             **launch) -> torch.Tensor:
    """x [M, K] (1 <= M <= 8) @ dequantized(weight).T, as [M, N] in x's dtype. weight: [N, K] e4m3;
    scale: float32 [cdiv(N, scale_n), cdiv(K, scale_k)]. `launch` (kernel "one" or "dot",
    block_n, block_k, num_warps, num_stages, unroll) overrides gemv_launch_config; "one" takes one
    row, its block_n is cut to a divisor of scale_n, and it loads `unroll` tiles of block_k
    columns a loop step ("dot" takes unroll 1)."""
    return _fp8_gemv(x, None, None, 0.0, weight, scale, scale_block, launch)[0]


def rms_norm_fp8_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, scale: torch.Tensor, scale_block: tuple[int, int],
                      **launch) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.gemv.rms_norm_gemv with an FP8 weight, one row: engine.layers.norm.RMSNorm's forward
    (x, residual) followed by fp8_gemv(normed, weight, scale, scale_block) as one kernel. Returns
    (that product, the new residual x + residual, or x without one)."""
    check_norm_inputs(x, residual, norm_weight, "rms_norm_fp8_gemv")
    return _fp8_gemv(x, residual, norm_weight, eps, weight, scale, scale_block, launch)


def _fp8_gemv(x, residual, norm_weight, eps, weight, scale, scale_block, launch):
    what = "fp8_gemv" if norm_weight is None else "rms_norm_fp8_gemv"
    _check(x, weight, scale, scale_block, what)
    _knobs(launch, _GEMV_KNOBS, what)
    M, K = x.shape
    N = weight.shape[0]
    if not 1 <= M <= MAX_GEMV_ROWS:
        raise ValueError(f"{what} takes 1 to {MAX_GEMV_ROWS} rows, got {M}")
    scale_n, scale_k = scale_block
    kernel, block_n, block_k, num_warps, num_stages, unroll = (launch.get(name) or c for name, c in
                                                               zip(_GEMV_KNOBS, gemv_launch_config(N, K, M)))
    block_n, block_k = _power_of_two(block_n, "block_n"), _power_of_two(block_k, "block_k")
    unroll = _power_of_two(unroll, "unroll")
    block_k = min(block_k, triton.next_power_of_2(K))  # not wider than the row (tiny test models)
    group_k = min(block_k, scale_k)  # a run of columns inside one scale block
    norm, has_residual = norm_weight is not None, residual is not None
    if norm and (kernel != "one" or M != 1):
        raise ValueError(f"{what}: only the one-row kernel takes the norm in; got {M} rows and kernel {kernel!r}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    pdl_mode = pdl.mode(x.device, M)
    common = dict(GROUPS=block_k // group_k, GROUP_K=group_k, SCALE_N=scale_n, SCALE_K=scale_k, PDL=pdl_mode,
                  num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl_mode > 0)
    if kernel == "one":
        if M != 1:
            raise ValueError(f"{what}'s one-row kernel takes one row; got {M}")
        if "block_n" not in launch and _interpreted():
            block_n = max(block_n, 32)  # the interpreter runs programs one by one: fewer, wider ones
        block_n = math.gcd(block_n, scale_n)  # the program's rows share a row of scales
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if has_residual else x
        # Unused pointers stand in for the inputs a variant does not read.
        res, nw = (residual if has_residual else x), (norm_weight if norm else x)
        _fp8_gemv_one_kernel[(triton.cdiv(N, block_n),)](
            x, res, nw, res_out, weight, scale, out, N, K, weight.stride(0), scale.stride(0), eps, BLOCK_N=block_n,
            UNROLL=unroll, NORM_BLOCK_K=min(triton.next_power_of_2(K), 512 * num_warps), NORM=norm,
            RESIDUAL=has_residual, SUM_EACH_STEP=one_row_sums_each_step(block_n, block_k, num_warps),
            **common)
        return out, res_out
    if kernel == "dot":
        if unroll != 1:
            raise ValueError(f"fp8_gemv's dot kernel takes no unroll; got {unroll}")
        if group_k < 16:
            raise ValueError(f"fp8_gemv's dot kernel takes runs of at least 16 columns (an MMA's K); got "
                             f"block_k {block_k} with scale blocks of {tuple(scale_block)}")
        block_n = max(block_n, 16)  # an MMA's smallest side
        _fp8_gemv_dot_kernel[(triton.cdiv(N, block_n),)](
            x, weight, scale, out, M, N, K, x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
            ROWS=_DOT_ROWS, BLOCK_N=block_n, IEEE=x.dtype == torch.float32, **common)
        return out, x
    raise ValueError(f"unknown fp8_gemv kernel {kernel!r}")


def w8a8_gemv(q: torch.Tensor, scales: torch.Tensor, rows: int, weight: torch.Tensor, scale: torch.Tensor,
              scale_block: tuple[int, int], *, block_n: int = 64, num_warps: int = 2, num_stages: int = 3,
              groups: int = 2, pieces: int = 1, arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """The first `rows` (1 to W8A8_GEMV_ROWS) of activations quantized as quantize_activations
    writes them (q e4m3 [P, K], float32 scales [P, K / scale_k] in either layout, groups of scale_k
    columns) @ dequantized(weight).T, as bf16 [rows, N]: both sides e4m3 into the tensor cores
    (the kernel says how), W streamed once. K must be a multiple of scale_k. The launch defaults are the best mean of a
    sweep over Qwen3-8B's projections at 8 rows (H200, benchmarks/HISTORY.md, 2026-11-28, 13:49).

    pieces (a power of two up to W8A8_MAX_PIECES, dividing K into multiples of scale_k): K is cut
    into that many pieces, each run by programs of its own, so that a narrow W still fills the
    GPU; their float32 partials are summed in piece order by the last program of each band of
    block_n rows. That takes `arrivals`: int32 counters, one per band, all zero before the launch,
    and zero again after it. Products that share them must not run at the same time."""
    _check(q, weight, scale, scale_block, "w8a8_gemv")
    N, K = weight.shape
    scale_n, scale_k = scale_block
    P = q.shape[0]
    if q.dtype != FP8 or not 1 <= rows <= min(P, W8A8_GEMV_ROWS) or K % scale_k \
            or scales.shape != (P, K // scale_k) or scales.dtype != torch.float32:
        raise ValueError(f"w8a8_gemv takes 1 to min(P, {W8A8_GEMV_ROWS}) rows of P {FP8} activation rows with "
                         f"float32 scales [P, K / {scale_k}], K a multiple of {scale_k}; got {rows} of "
                         f"{tuple(q.shape)} {q.dtype}, scales {tuple(scales.shape)} {scales.dtype}")
    if block_n < 16 or block_n & (block_n - 1) or scale_n % block_n or scale_k < 32 or groups < 1:
        raise ValueError(f"w8a8_gemv's block_n must be a power of two of at least 16 (an MMA's side) dividing "
                         f"the scale blocks' {scale_n} rows, their K side at least 32, and groups at least 1; got "
                         f"block_n {block_n}, blocks {tuple(scale_block)}, groups {groups}")
    bands = triton.cdiv(N, block_n)
    if pieces < 1 or pieces & (pieces - 1) or pieces > W8A8_MAX_PIECES or K % (pieces * scale_k):
        raise ValueError(f"w8a8_gemv cuts K into a power of two of pieces up to {W8A8_MAX_PIECES}, each a multiple "
                         f"of {scale_k} columns; got {pieces} pieces of K {K}")
    if pieces > 1 and (arrivals is None or arrivals.dtype != torch.int32 or arrivals.device != q.device
                       or arrivals.dim() != 1 or arrivals.numel() < bands):
        raise ValueError(f"w8a8_gemv in {pieces} pieces takes arrivals: int32 counters on {q.device}, at least one "
                         f"for each of its {bands} bands of {block_n} rows; got "
                         f"{None if arrivals is None else (arrivals.dtype, tuple(arrivals.shape), str(arrivals.device))}")
    if (K // pieces) % (groups * scale_k):
        groups = 1
    out = torch.empty(rows, N, dtype=torch.bfloat16, device=q.device)
    parts = torch.empty(pieces, rows, N, dtype=torch.float32, device=q.device) if pieces > 1 else out
    pdl_mode = pdl.mode(q.device)  # its trigger comes after its K loop
    _w8a8_gemv_kernel[(bands, pieces)](
        q, scales, weight, scale, out, parts, arrivals if pieces > 1 else out, rows, N, K, pieces, q.stride(0),
        scales.stride(0), scales.stride(1), weight.stride(0), scale.stride(0), out.stride(0),
        ROWS=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, GROUPS=groups, PIECES=pieces, SCALE_N=scale_n,
        SCALE_K=scale_k, PDL=pdl_mode, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl_mode > 0)
    return out


def quantize_activations(x: torch.Tensor, group: int, *, pad_rows_to: int = 1,
                         scales_by_column: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [P, K], float32 scales [P, cdiv(K, group)]), P = M rounded up to a multiple of
    pad_rows_to: each row's groups of `group` columns scaled so that their largest magnitude maps to
    448; x ~= q * scale. Rows from M on are zeros. scales_by_column: as activation_buffers."""
    if x.dim() != 2 or x.stride(1) != 1 or group & (group - 1) or pad_rows_to < 1:
        raise ValueError(f"quantize_activations takes x [M, K] contiguous along K, a power-of-two group and "
                         f"pad_rows_to >= 1; got {tuple(x.shape)}, group {group}, pad_rows_to {pad_rows_to}")
    M, K = x.shape
    q, scales = activation_buffers(M, K, group, pad_rows_to, scales_by_column, x.device)
    rows, groups = scales.shape
    if rows:
        # A program quantizes up to 1024 columns of a row (8 of Qwen's groups of 128).
        per_program = max(1, min(triton.next_power_of_2(groups), 1024 // group))
        pdl_mode = pdl.mode(x.device, M)
        _quantize_rows_kernel[(rows, triton.cdiv(groups, per_program))](
            x, q, scales, M, K, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1), GROUP=group,
            GROUPS=per_program, FP8_MAX=FP8_MAX, PDL=pdl_mode, num_warps=4, launch_pdl=pdl_mode > 0)
    return q, scales


@triton.jit
def _sum_k_pieces_kernel(parts_ptr, out_ptr, numel, stride_piece, PIECES: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.start(PDL)
    pdl.wait(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    acc = tl.load(parts_ptr + i, mask=ok, other=0.0)
    for piece in tl.static_range(1, PIECES):
        acc += tl.load(parts_ptr + piece * stride_piece + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_k_pieces(parts: torch.Tensor, rows: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """parts [pieces, P, N] (float32, contiguous): one product's partial sums over pieces of K.
    Returns their sum over the pieces, in piece order, for the first `rows` rows: [rows, N] in
    dtype, rounded once."""
    if parts.dim() != 3 or not parts.is_contiguous() or parts.dtype != torch.float32 or not 0 <= rows <= parts.shape[1]:
        raise ValueError(f"sum_k_pieces takes contiguous float32 parts [pieces, P, N] and rows <= P; got "
                         f"{parts.dtype} {tuple(parts.shape)}, rows {rows}")
    pieces, padded, n = parts.shape
    out = torch.empty(rows, n, dtype=dtype, device=parts.device)
    numel = rows * n  # a piece's first rows rows lie first in it
    if numel:
        block = 1024
        pdl_mode = pdl.mode(parts.device, rows)
        _sum_k_pieces_kernel[(triton.cdiv(numel, block),)](
            parts, out, numel, padded * n, PIECES=pieces, BLOCK=block, PDL=pdl_mode, num_warps=4,
            launch_pdl=pdl_mode > 0)
    return out


def gemm_launch_config(M: int, N: int, scale_k: int, ieee: bool = False) -> tuple[int, int, int, int, int, int]:
    """(block_m, block_n, block_k, group_m, num_warps, num_stages), not yet swept (bench_kernels
    --sweep-moe-fp8 times candidates at 256 and 4096 rows): from 257 rows the tile of Triton's FP8
    matmul tutorial and vLLM's block-FP8 kernel on Hopper. Fewer rows (decode steps of many
    streams) read W in as many programs as its column tiles make, so those tiles are narrower:
    32 and 64 columns make 128 programs of Qwen3-8B's 4096-row projections for the H100's 132
    SMs, where 64 and 128 made 64, idling half of them on a step bound by W's bytes.

    ieee (float32 activations, multiplied exactly on the CUDA cores, not the tensor cores): the dot's
    operands sit in registers, and the 128 x 128 x 128 tile spilled 20,048 bytes a thread on an H100,
    for which the driver then kept ~4.9 GiB of local memory. Tiles of 64 x 64 x 32 hold them."""
    if ieee:
        return min(64, max(16, triton.next_power_of_2(M))), 64, min(32, scale_k), 8, 4, 3
    block_k = min(128, scale_k)
    if M <= 64:
        return max(16, triton.next_power_of_2(M)), 32, block_k, 8, 4, 4
    if M <= 256:
        return 64, 64, block_k, 8, 4, 3
    return 128, 128, block_k, 8, 8, 3


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_block: tuple[int, int], *,
             quantize_input: bool | None = None, **launch) -> torch.Tensor:
    """x [M, K] @ dequantized(weight).T as [M, N] in x's dtype, for any M. quantize_input (default:
    x is bf16 or fp16) quantizes x per row and scale_k columns and multiplies on the FP8 tensor
    cores; otherwise W's tiles are converted to x's dtype. `launch` (block_m, block_n, block_k,
    group_m, num_warps, num_stages) overrides gemm_launch_config."""
    _check(x, weight, scale, scale_block, "fp8_gemm")
    _knobs(launch, _GEMM_KNOBS, "fp8_gemm")
    M, K = x.shape
    N = weight.shape[0]
    scale_n, scale_k = scale_block
    if quantize_input is None:
        quantize_input = x.dtype in (torch.bfloat16, torch.float16)
    ieee = not quantize_input and x.dtype == torch.float32
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    block_m, block_n, block_k, group_m, num_warps, num_stages = (
        launch.get(name) or c for name, c in zip(_GEMM_KNOBS, gemm_launch_config(M, N, scale_k, ieee)))
    block_k = min(block_k, scale_k)
    if scale_k % block_k:
        raise ValueError(f"fp8_gemm's block_k ({block_k}) must divide the scale block's K side ({scale_k})")
    if quantize_input:
        a, a_scale = quantize_activations(x, scale_k)
    else:
        a, a_scale = x, scale  # a_scale is not read
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    pdl_mode = pdl.mode(x.device, M)
    _fp8_gemm_kernel[grid](
        a, a_scale, weight, scale, out, M, N, K, a.stride(0), a_scale.stride(0), weight.stride(0), scale.stride(0),
        out.stride(0), SCALE_N=scale_n, SCALE_K=scale_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=group_m, QUANT_A=quantize_input, IEEE=ieee, PDL=pdl_mode, num_warps=num_warps,
        num_stages=num_stages, launch_pdl=pdl_mode > 0)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_block: tuple[int, int]) -> torch.Tensor:
    """x [..., K] @ dequantized(weight).T: the GEMV for 1-8 rows, the GEMM otherwise."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if 1 <= rows.shape[0] <= MAX_GEMV_ROWS:
        y = fp8_gemv(rows, weight, scale, scale_block)
    else:
        y = fp8_gemm(rows, weight, scale, scale_block)
    return y.view(*x.shape[:-1], weight.shape[0])
