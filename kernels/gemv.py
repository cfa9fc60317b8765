"""y = x @ W.T for 1 to 8 rows of x: the projections of a chat-sized decode step, optionally with
the pre-norm RMSNorm (and its residual add) taken into the prologue and SwiGLU's SiLU-mul into the
epilogue.

At batch 1 a small model's projections read 4-13 MB of weights each, too little for cuBLAS's
kernels to reach the copy bandwidth: in a CUDA graph on the H200 they ran Qwen3-0.6B's four
projections at 5.2-12.6 us each (0.33-2.1 TB/s; the 1024-row o projection was the worst). Here each
program owns a band of only a few of W's rows and streams it once along K, so even the 1024-row
projections spread over every SM with many loads in flight. It also beat or tied cuBLAS on every
projection of the 1.7B, 4B and 8B shapes (8B: 99 against 108 us per layer; bench_gemv).

Two to eight rows (two to eight chat streams) must load each weight tile once and use it for every
row. Two kernels do that, each best somewhere (bench_gemv --rows-sweep, on an H100 and an H200):
- _gemv_rows_dot_kernel puts a [BLOCK_N, BLOCK_K] weight tile against x's rows (padded to the 16
  an MMA takes) on the tensor cores: the arithmetic is free, and x comes in once per tile. Its
  tiles need 16+ weight rows each, so a 1024-row projection gets only 64 programs.
- _gemv_rows_fma_kernel is the one-row kernel with a row axis: 1-2 weight rows per program, so
  the 1024-row projections fill the GPU, but every row costs FMAs and an x tile from L1. It wins
  there for up to 4 rows.

A batch-1 decode step is 149 kernels of a few us each at Qwen3-0.6B's shape (profile_step, H200),
so launches, not bytes, set its time. Two fusions and PDL cut that:
- NORM: every program reads all of x's row(s) anyway (K is the hidden size), so each forms
  h = x + residual, its RMS and the normalized, weighted input itself, rounding where the RMSNorm
  kernel (kernels/rmsnorm.py) rounds; program 0 also stores h as the new residual. The pre-norm
  RMSNorm kernel before the qkv and gate_up projections goes.
- SILU: a program computes gate row n and up row N + n of a merged [2N, K] weight and stores
  silu(gate) * up at column n, gate and up rounded to the output's dtype first as the unfused
  GEMV's output is, then in fp32 and rounded once (kernels/silu_mul.py). Only its own two rows:
  an earlier try that put SiLU-mul into the down projection's prologue had every program apply it
  to the whole row, and lost more than the launch it saved.
- PDL (kernels/pdl.py): a program loads its first weight tile(s), which no kernel writes, before
  waiting on the kernel before, so they stream in while that one finishes.
What pays (bench_gemv --fused, 28 layers' projections in a graph, H200): PDL, 22.5 -> 16.6 µs per
layer at one row. With PDL the fusions are a wash at one row
(16.6 either way) and slower at 2-8 rows (the fused row kernels read x, the residual and the norm
weight again in every program); without PDL (GPUs before Hopper) they save 2.9 µs per layer at
one row. So the engine fuses at one row, and at two only where K is short, through the FMA kernel
(fuses_norm says where and why).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels import launch_limits, pdl


@triton.jit
def _h_tile(x_ptr, res_ptr, rows, cols, mask, stride_x, stride_r, RESIDUAL: tl.constexpr):
    """x (+ residual) at [rows, cols], rounded to x's dtype as torch's `x + residual` is."""
    h = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    if RESIDUAL:
        r = tl.load(res_ptr + rows * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return h


@triton.jit
def wait_then_rstd(x_ptr, res_ptr, res_out_ptr, r, r_ok, K, stride_x, stride_r, eps,
                   ROWS: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                   PDL: tl.constexpr):
    """Waits for the kernel before (with PDL); then, with NORM, returns 1/RMS of each row r of
    h = x (+ residual), program 0 storing h at res_out_ptr ([M, K] contiguous)."""
    pdl.wait(PDL)
    rstd = tl.full([ROWS], 1.0, tl.float32)
    if NORM:
        k_stored = tl.where(tl.program_id(0) == 0, K, 0)  # program 0 stores h
        k = tl.arange(0, BLOCK_K)
        sum_sq = tl.zeros([ROWS], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            mask = r_ok[:, None] & (kk < K)[None, :]
            h = _h_tile(x_ptr, res_ptr, r[:, None], kk[None, :], mask, stride_x, stride_r, RESIDUAL)
            if RESIDUAL:
                tl.store(res_out_ptr + r[:, None] * K + kk[None, :], h, mask=r_ok[:, None] & (kk < k_stored)[None, :])
            hf = h.to(tl.float32)
            sum_sq += tl.sum(hf * hf, 1)
        rstd = tl.rsqrt(sum_sq / K + eps)
    return rstd


@triton.jit
def norm_input_tile(x_ptr, res_ptr, nw_ptr, rows, cols, mask, k_ok, rstd, stride_x, stride_r,
                    NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """The GEMV's input at [rows, cols] in x's dtype: x, or with NORM the RMSNorm of h = x
    (+ residual) times the norm's weight (rstd broadcast like rows)."""
    h = _h_tile(x_ptr, res_ptr, rows, cols, mask, stride_x, stride_r, RESIDUAL)
    if NORM:
        # Normalized h is cast back to its dtype before the weight multiply, like the torch module.
        normed = (h.to(tl.float32) * rstd).to(h.dtype).to(tl.float32)
        nw = tl.load(nw_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
        h = (normed * nw).to(h.dtype)
    return h


@triton.jit
def _store(y_ptr, offsets, mask, y, y_up, SILU: tl.constexpr):
    """Stores y, or with SILU silu(y) * y_up, each rounded to y's dtype first (the unfused GEMV's
    output), then computed in fp32 and rounded once."""
    if SILU:
        gate = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        up = y_up.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot(w, xt, acc, IEEE: tl.constexpr):
    if IEEE:  # float32 weights: no tf32 rounding
        acc = tl.dot(w, xt, acc, input_precision="ieee")
    else:
        acc = tl.dot(w, xt, acc)
    return acc


@triton.jit
def _products(w, x, SUM: tl.constexpr, K_AXIS: tl.constexpr):
    """One K step of a GEMV: W's tile times x's row(s) in fp32, K along K_AXIS, summed along K
    where SUM."""
    products = w.to(tl.float32) * x
    if SUM:
        products = tl.sum(products, axis=K_AXIS)
    return products


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, res_out_ptr, w_ptr, y_ptr, N, K, stride_w, eps,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                 SILU: tl.constexpr, PDL: tl.constexpr, SUM_EACH_STEP: tl.constexpr):
    pdl.start(PDL)
    # One row of x, as a [1, BLOCK_K] tile against [BLOCK_N, BLOCK_K] of W. SUM_EACH_STEP sums
    # each step's products into BLOCK_N values as they are formed; otherwise they accumulate in
    # a [BLOCK_N, BLOCK_K] fp32 tile, summed once at the end (_launch says which launches take
    # which).
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    r = tl.arange(0, 1)
    k = tl.arange(0, BLOCK_K)[None, :]
    w_at = w_ptr + n[:, None] * stride_w + k
    w = tl.load(w_at, mask=n_ok[:, None] & (k < K), other=0.0)
    if SILU:
        w_up = tl.load(w_at + N * stride_w, mask=n_ok[:, None] & (k < K), other=0.0)
    rstd = wait_then_rstd(x_ptr, res_ptr, res_out_ptr, r, r < 1, K, 0, 0, eps, 1, BLOCK_K, NORM, RESIDUAL, PDL)
    rows, rstd = r[:, None], rstd[:, None]
    x = norm_input_tile(x_ptr, res_ptr, nw_ptr, rows, k, k < K, k < K, rstd, 0, 0, NORM, RESIDUAL).to(tl.float32)
    acc = _products(w, x, SUM_EACH_STEP, 1)
    acc_up = acc
    if SILU:
        acc_up = _products(w_up, x, SUM_EACH_STEP, 1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + k
        mask = n_ok[:, None] & (kk < K)
        x = norm_input_tile(x_ptr, res_ptr, nw_ptr, rows, kk, kk < K, kk < K, rstd, 0, 0, NORM, RESIDUAL).to(tl.float32)
        acc += _products(tl.load(w_at + k0, mask=mask, other=0.0), x, SUM_EACH_STEP, 1)
        if SILU:
            acc_up += _products(tl.load(w_at + k0 + N * stride_w, mask=mask, other=0.0), x, SUM_EACH_STEP, 1)
    if not SUM_EACH_STEP:
        acc, acc_up = tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)
    _store(y_ptr, n, n_ok, acc, acc_up, SILU)


@triton.jit
def _gemv_rows_fma_kernel(x_ptr, res_ptr, nw_ptr, res_out_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_r,
                          stride_w, eps, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr,
                          SUM_EACH_STEP: tl.constexpr):
    pdl.start(PDL)
    # Each weight tile is loaded once and multiplied into every row of x: the rows cost x's reads
    # (from L1; x is a few KB) and FMAs, not more weight traffic. The products of a step are
    # [ROWS, BLOCK_N, BLOCK_K], summed as _gemv_kernel's are (SUM_EACH_STEP, or once at the end).
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, ROWS)
    n_ok, r_ok = n < N, r < M
    k = tl.arange(0, BLOCK_K)[None, :]
    w_at = w_ptr + n[:, None] * stride_w + k
    w = tl.load(w_at, mask=n_ok[:, None] & (k < K), other=0.0)
    if SILU:
        w_up = tl.load(w_at + N * stride_w, mask=n_ok[:, None] & (k < K), other=0.0)
    rstd = wait_then_rstd(x_ptr, res_ptr, res_out_ptr, r, r_ok, K, stride_x, stride_r, eps, ROWS, BLOCK_K,
                          NORM, RESIDUAL, PDL)
    rows, rows_ok, rstd = r[:, None], r_ok[:, None], rstd[:, None]
    x = norm_input_tile(x_ptr, res_ptr, nw_ptr, rows, k, rows_ok & (k < K), k < K, rstd, stride_x, stride_r,
                        NORM, RESIDUAL).to(tl.float32)[:, None, :]
    acc = _products(w[None, :, :], x, SUM_EACH_STEP, 2)
    acc_up = acc
    if SILU:
        acc_up = _products(w_up[None, :, :], x, SUM_EACH_STEP, 2)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + k
        mask = n_ok[:, None] & (kk < K)
        x = norm_input_tile(x_ptr, res_ptr, nw_ptr, rows, kk, rows_ok & (kk < K), kk < K, rstd, stride_x, stride_r,
                            NORM, RESIDUAL).to(tl.float32)[:, None, :]
        acc += _products(tl.load(w_at + k0, mask=mask, other=0.0)[None, :, :], x, SUM_EACH_STEP, 2)
        if SILU:
            acc_up += _products(tl.load(w_at + k0 + N * stride_w, mask=mask, other=0.0)[None, :, :], x,
                                SUM_EACH_STEP, 2)
    if not SUM_EACH_STEP:
        acc, acc_up = tl.sum(acc, axis=2), tl.sum(acc_up, axis=2)
    _store(y_ptr, rows * N + n[None, :], rows_ok & n_ok[None, :], acc, acc_up, SILU)


@triton.jit
def _gemv_rows_dot_kernel(x_ptr, res_ptr, nw_ptr, res_out_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_r,
                          stride_w, eps, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr,
                          IEEE: tl.constexpr):
    pdl.start(PDL)
    # y.T = W @ x.T on the tensor cores, x's rows padded to the 16 an MMA takes: each weight tile
    # meets every row of x in one instruction stream.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, ROWS)
    n_ok, r_ok = n < N, r < M
    k = tl.arange(0, BLOCK_K)
    w_at = w_ptr + n[:, None] * stride_w + k[None, :]
    w = tl.load(w_at, mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
    if SILU:
        w_up = tl.load(w_at + N * stride_w, mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
    rstd = wait_then_rstd(x_ptr, res_ptr, res_out_ptr, r, r_ok, K, stride_x, stride_r, eps, ROWS, BLOCK_K,
                          NORM, RESIDUAL, PDL)
    rows, rows_ok, rstd, kt = r[None, :], r_ok[None, :], rstd[None, :], k[:, None]
    xt = norm_input_tile(x_ptr, res_ptr, nw_ptr, rows, kt, rows_ok & (kt < K), kt < K, rstd, stride_x, stride_r,
                         NORM, RESIDUAL)
    acc = _dot(w, xt, tl.zeros([BLOCK_N, ROWS], dtype=tl.float32), IEEE)
    acc_up = acc
    if SILU:
        acc_up = _dot(w_up, xt, tl.zeros([BLOCK_N, ROWS], dtype=tl.float32), IEEE)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + kt
        mask = n_ok[:, None] & (k0 + k < K)[None, :]
        xt = norm_input_tile(x_ptr, res_ptr, nw_ptr, rows, kk, rows_ok & (kk < K), kk < K, rstd, stride_x, stride_r,
                             NORM, RESIDUAL)
        acc = _dot(tl.load(w_at + k0, mask=mask, other=0.0), xt, acc, IEEE)
        if SILU:
            acc_up = _dot(tl.load(w_at + k0 + N * stride_w, mask=mask, other=0.0), xt, acc_up, IEEE)
    _store(y_ptr, rows * N + n[:, None], rows_ok & n_ok[:, None], acc, acc_up, SILU)


MAX_ROWS = 8
_LAUNCH_KNOBS = ("kernel", "block_n", "block_k", "num_warps", "num_stages")
_DOT_ROWS = 16  # the smallest MMA tile's side: x's rows are padded to it
_FLOAT32_DOT_BLOCK_K = 128


# One-row projections on GPUs with PDL whose weight takes at most this many columns and rows (the
# LM head does not) give each program all of K for at most WHOLE_BAND_ELEMENTS of W (32 KB in bf16, 64 KB in float32);
# two-row projections of at most 2,048 rows do too, 2 rows of W a program.
WHOLE_BAND_K = 4096
WHOLE_BAND_N = 16384
WHOLE_BAND_ELEMENTS = 16384
# Two-row qkv and gate/up projections (more than 2,048 rows) of K at most this many columns take
# the pre-norm, and gate/up SiLU-mul, into the FMA kernel on GPUs with PDL (fuses_norm).
TWO_ROW_FUSED_K = 1024


def fuses_norm(rows: int, N: int, K: int, whole_band: bool) -> bool:
    """Whether the engine runs a pre-norm sublayer's first projection of `rows` rows against W [N, K]
    (gate and up stacked with SiLU-mul) as rms_norm_gemv, rather than the RMSNorm kernel (and SiLU-mul
    kernel) beside gemv; whole_band: the GPU has PDL, as launch_config takes it.

    One row always. At 2-8 rows the fused tensor-core row kernel lost 5-7 µs per layer to the norm
    and SiLU-mul kernels beside the plain GEMVs (bench_gemv --fused, H200), and at two rows takes
    255 registers and spills on sm90. At two rows through the FMA kernel, K in one step (62-63
    registers on sm90, none spilled), Qwen3-0.6B's qkv and gate/up fused took batch 2 to 0.828-0.830 ms a
    step against 0.834-0.836 at 512 context and 1.068-1.069 against 1.091-1.093 at 4096, and
    SmolLM2-135M's gate/up 0.582-0.585 against 0.625-0.627; batches 1 and 4 unchanged. The same
    launch unfused took 0.6B's batch 2 to 0.859, and fused at 3-4 rows it made batch 4 1.278
    against 0.944. SmolLM2-135M's 960-row qkv fused was slower at 512 context and faster at 4096
    (0.5885 against 0.585-0.586, 0.747-0.748 against 0.755-0.756), so weights of at most 2,048
    rows keep the kernels apart, as does K beyond 1,024, not measured (H200, benchmarks/HISTORY.md,
    2026-11-29, session of 14:30, calls 1, 2 and 4)."""
    return rows == 1 or (whole_band and rows == 2 and N > 2048 and K <= TWO_ROW_FUSED_K)


def _tuned_config(N: int, K: int, rows: int, silu: bool, whole_band: bool, norm: bool) -> tuple[str, int, int, int, int]:
    """From sweeps of Qwen3-0.6B's projections in bf16 (one row and, with PDL, 2-8 rows on an
    H200; bench_gemv's sweeps), and at one row of Qwen3-30B-A3B's too (H200, 2026-11-27)."""
    if whole_band and rows == 1 and K <= WHOLE_BAND_K and N <= WHOLE_BAND_N:
        # Each program loads its whole band of W, all of K, before the PDL wait, so that with
        # pdl.FIRST the projection's weights stream in while the kernels before it run; fewer,
        # larger programs than below. Qwen3-0.6B batch 1 0.712 against 0.722-0.724 ms a step with
        # these launches, Qwen3-30B-A3B 2.565 against 2.582 (H200, benchmarks/HISTORY.md,
        # 2026-11-28, session of 22:39). Compiled for sm90 as launched (N and K multiples of 16,
        # which Triton specializes; Triton 3.9), the tiles (up to 16,384 elements) take 122-162
        # registers at Qwen3-30B-A3B's qkv and o, 0.6B's down and 8B's qkv and o, and 64-72 at
        # 0.6B's others, none spilled (tests/test_sm90_codegen.py checks).
        # They go to GPUs that have PDL, with it turned on or not (NVCHAT_PDL=0 must run the same
        # launches: tests/gpu compares the two bit for bit); other GPUs keep the ones below.
        block_n = 8 if silu or N > 2048 else 4
        while block_n > 1 and block_n * triton.next_power_of_2(K) * (2 if silu else 1) > WHOLE_BAND_ELEMENTS:
            block_n //= 2
        return "one", block_n, WHOLE_BAND_K, 8 if silu else 4, 1
    if whole_band and rows == 2 and N <= 2048 and K <= WHOLE_BAND_K:
        # The same for two rows through the FMA kernel: one step of all of K, its products summed at
        # once, the two rows' [2, 2, 4096] products held for one step only. Qwen3-0.6B batch 2 (its
        # o and down) 0.835 ms a step against 0.882 with the 3-4-row launch below (tiles of 1,024,
        # summed at the end); at 4 rows this launch, through a trial switch, took 0.990 against
        # 0.945, so 3-4 rows keep that one (H200, benchmarks/HISTORY.md, 2026-11-29, session of 11:56).
        config = "fma", 2, WHOLE_BAND_K, 4, 3
    elif norm and rows == 2 and fuses_norm(rows, N, K, whole_band):
        config = "fma", 4, TWO_ROW_FUSED_K, 4, 3  # fuses_norm says why
    elif rows == 1:
        # Wider weights, and GPUs without PDL: a weight row per program for the 1024-row
        # projections, so that they too fill the GPU.
        # Taller weights: 4 rows of 2,048 on 4 warps (SiLU's gate and up: 4 rows each of 512 on
        # 2). At one row in a graph, against 2 rows of 512 on 2 warps: 0.6B's qkv 3.9 us against
        # 4.8, its LM head 70.6 against 94.3; 30B-A3B's qkv 8.1 against 8.4 (benchmarks/HISTORY.md).
        if N <= 2048:
            config = ("one", 1, 1024, 8, 3)
        else:
            config = ("one", 8, 512, 2, 3) if silu else ("one", 4, 2048, 4, 3)
    elif N <= 2048 and rows <= 4:
        config = "fma", 2, 1024, 4, 3
    elif N <= 2048:
        # 5-8 rows (2-4 took the FMA kernel above): five stages, where the isolated sweep (bench_gemv)
        # put three first. Decode steps with these and the 32 x 128 tiles below: Qwen3-0.6B batch 8
        # 1.109 ms against 1.161-1.169 at 512 context and 1.867 against 1.927-1.930 at 4096,
        # Qwen3-30B-A3B batch 8 7.671 against 8.001 (H200, benchmarks/HISTORY.md, 2026-11-29,
        # session of 13:22).
        config = "dot", 16, 512, 4, 5
    elif rows > 4 and K <= 1024:
        # Narrower K tiles at 5-8 rows only where K is short (0.6B's qkv and gate/up): Qwen3-8B batch
        # 8 with them at K 4,096-12,288 took 5.318 ms against 4.755, and 0.6B batches 2 and 4 lost
        # 0.27 and 0.25 ms (benchmarks/HISTORY.md, session of 13:22, calls 1 and 4).
        config = "dot", 32, 128, 4, 4
    else:
        config = "dot", 32, 512, 4, 4 if N <= 4096 else 3
    kernel, block_n, *rest = config
    if silu:
        block_n = max(block_n // 2, _DOT_ROWS if kernel == "dot" else 1)
    return kernel, block_n, *rest


def shared_memory(config: tuple[str, int, int, int, int], rows: int, silu: bool, norm: bool, itemsize: int) -> int:
    """An upper estimate of a launch's shared memory in bytes (kernels/launch_limits.py says how it
    counts): each pipeline stage holds a weight tile (gate and up with silu) and an input tile (x
    padded to the kernel's rows; with norm, x and the residual, and the norm's weight)."""
    kernel, block_n, block_k, _, num_stages = config
    weight = block_n * block_k * (2 if silu else 1)
    x_rows = {"one": 1, "fma": triton.next_power_of_2(max(rows, 2)), "dot": _DOT_ROWS}[kernel]
    x = x_rows * block_k
    if norm:
        x = 2 * x + block_k
    return num_stages * (weight + x) * itemsize


@functools.cache  # every launch asks: the search stays off the decode step's host path
def launch_config(N: int, K: int, rows: int = 1, silu: bool = False, *, dtype: torch.dtype = torch.bfloat16,
                  norm: bool = False, limits: launch_limits.DeviceLimits | None = None, whole_band: bool = False
                  ) -> tuple[str, int, int, int, int]:
    """(kernel, block_n, block_k, num_warps, num_stages): "one" (the one-row kernel), "fma" or "dot"
    (the row kernels). N counts W's rows; with silu a program takes block_n rows each of gate and
    up (the tuned launches halve block_n for it, keeping the weight per program); norm: the RMSNorm
    prologue (two rows take their own launch with it: fuses_norm); whole_band: the GPU has PDL
    (_tuned_config says what changes). The tuned configuration, block_k no wider than K's power of
    two; with `limits`, the first of it and its fallbacks (fewer stages, then narrower block_k, then
    fewer rows) whose shared memory fits them (on an RTX 4090, bf16's 2-8 row launches of a
    2049-4096-row weight drop from 4 stages to 2). The dot kernel takes float32 at most 128 wide."""
    kernel, block_n, block_k, num_warps, num_stages = _tuned_config(N, K, rows, silu, whole_band, norm)
    if kernel == "dot" and dtype.itemsize == 4:
        # A float32 [block_n, 512] tile against x's 16 rows spills registers (780 spilled values at
        # block_n 16 on an H100, a 3,120-byte CUDA stack for every thread the card holds).
        block_k = min(block_k, _FLOAT32_DOT_BLOCK_K)
    block_k = min(block_k, triton.next_power_of_2(K))
    if limits is None:
        return kernel, block_n, block_k, num_warps, num_stages
    candidates = ((kernel, n, k, num_warps, stages)
                  for n in launch_limits.halvings(block_n, _DOT_ROWS if kernel == "dot" else 1)
                  for k in launch_limits.halvings(block_k, min(block_k, 64))
                  for stages in launch_limits.stages_down(num_stages))
    return launch_limits.first_fit(f"the {kernel} GEMV ({N} x {K}, {rows} rows, {dtype})", candidates,
                                   lambda c: shared_memory(c, rows, silu, norm, dtype.itemsize), lambda c: c[3],
                                   limits)


def gemv(x: torch.Tensor, weight: torch.Tensor, *, silu: bool = False, **launch) -> torch.Tensor:
    """x: [M, K] with 1 <= M <= MAX_ROWS; weight: [N, K], both contiguous along K. Returns x @ W.T
    as [M, N] in x's dtype; with silu, W is gate and up stacked ([2 * inter, K]) and it returns
    silu(x @ gate.T) * (x @ up.T) as [M, inter]. `launch` (kernel, block_n, block_k, num_warps,
    num_stages; for tests and sweeps) overrides launch_config; kernel "one" takes one row only."""
    return _launch(x, None, None, 0.0, weight, silu, launch)[0]


def rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, *, silu: bool = False, **launch) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.layers.norm.RMSNorm's forward (x, residual) followed by gemv(normed, weight, silu=silu)
    as one kernel: returns (that product, the new residual x + residual, or x without one). x,
    residual and norm_weight share a dtype."""
    check_norm_inputs(x, residual, norm_weight, "rms_norm_gemv")
    return _launch(x, residual, norm_weight, eps, weight, silu, launch)


def check_norm_inputs(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, what: str) -> None:
    """A fused norm's inputs: a contiguous norm weight [K] of x's dtype, and a residual like x."""
    if norm_weight.shape != (x.shape[-1],) or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous():
        raise ValueError(f"{what} takes a contiguous norm weight [{x.shape[-1]}] of x's dtype {x.dtype}; "
                         f"got {tuple(norm_weight.shape)} {norm_weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"{what} takes a residual like x {tuple(x.shape)} {x.dtype}, contiguous along K; got "
                         f"{tuple(residual.shape)} {residual.dtype}")


def _launch(x, residual, norm_weight, eps, weight, silu, launch):
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gemv takes x [M <= {MAX_ROWS}, K] and weight [N, K]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("gemv needs x and weight contiguous along K")
    if silu and weight.shape[0] % 2:
        raise ValueError(f"gemv with silu takes gate and up stacked, an even number of rows; got {weight.shape[0]}")
    if set(launch) - set(_LAUNCH_KNOBS):
        raise TypeError(f"gemv's launch knobs are {_LAUNCH_KNOBS}; got {sorted(launch)}")
    (M, K), rows_w = x.shape, weight.shape[0]
    norm, has_residual = norm_weight is not None, residual is not None
    config = launch_config(rows_w, K, M, silu, dtype=x.dtype, norm=norm, limits=launch_limits.device_limits(x.device),
                           whole_band=pdl.supported(x.device))
    kernel, block_n, block_k, num_warps, num_stages = (launch.get(name) or c for name, c in zip(_LAUNCH_KNOBS, config))
    if "block_n" not in launch and os.environ.get("TRITON_INTERPRET") == "1":
        # Triton's CPU interpreter runs the programs one by one in numpy: a few wide ones take a
        # fraction of the time of many narrow ones (the tests check the GPU's blocks explicitly).
        block_n = max(block_n, 32)
    block_k = min(block_k, triton.next_power_of_2(K))  # not wider than the row (tiny test models)
    N = rows_w // 2 if silu else rows_w
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if has_residual else x
    # Unused pointers stand in for the inputs a variant does not read.
    res, nw = (residual if has_residual else x), (norm_weight if norm else x)
    pdl_mode = pdl.mode(x.device, M)
    consts = dict(BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm, RESIDUAL=has_residual, SILU=silu, PDL=pdl_mode,
                  num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl_mode > 0)
    grid = (triton.cdiv(N, block_n),)
    if kernel == "one":
        if M != 1:
            raise ValueError(f"the one-row kernel takes one row; got {M}")
        # Launches whose one step covers all of K sum their products at once: at batch 1, Qwen3-0.6B
        # 0.606 ms a step against 0.658 with the tile, Qwen3-8B 4.255 against 4.361, Qwen3-30B-A3B
        # 2.338 against 2.426-2.429. Launches of several steps keep the tile: summing each step of
        # 8B's gate/up alone took 4.399 against 4.358-4.360 (H200, benchmarks/HISTORY.md,
        # 2026-11-29, sessions of 10:39 and 11:56).
        _gemv_kernel[grid](x, res, nw, res_out, weight, out, N, K, weight.stride(0), eps,
                           SUM_EACH_STEP=block_k >= K, **consts)
    elif kernel == "fma":
        _gemv_rows_fma_kernel[grid](x, res, nw, res_out, weight, out, M, N, K, x.stride(0), res.stride(0),
                                    weight.stride(0), eps, ROWS=triton.next_power_of_2(max(M, 2)),
                                    SUM_EACH_STEP=block_k >= K, **consts)
    elif kernel == "dot":
        _gemv_rows_dot_kernel[grid](x, res, nw, res_out, weight, out, M, N, K, x.stride(0), res.stride(0),
                                    weight.stride(0), eps, ROWS=_DOT_ROWS, IEEE=x.dtype == torch.float32, **consts)
    else:
        raise ValueError(f"unknown gemv kernel {kernel!r}")
    return out, res_out
