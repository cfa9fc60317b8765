"""y = x @ W.T for 1 to 8 rows of x: the projections of a chat-sized decode step.

At batch 1 a small model's projections read 4-13 MB of weights each, too little for cuBLAS's
kernels to reach the copy bandwidth: in a CUDA graph on the H200 they ran Qwen3-0.6B's four
projections at 5.2-12.6 us each (0.33-2.1 TB/s; the 1024-row o projection was the worst). Here each
program owns a band of only a few of W's rows and streams it once along K, so even the 1024-row
projections spread over every SM with many loads in flight. It also beat or tied cuBLAS on every
projection of the 1.7B, 4B and 8B shapes (8B: 99 against 108 us per layer; bench_gemv). Taking
the MLP's SiLU-mul into the down projection's GEMV saved its launch but slowed the GEMV more (each
program applied it to the whole row): dropped.

Two to eight rows (two to eight chat streams) must load each weight tile once and use it for every
row. Two kernels do that, each best somewhere (bench_gemv --rows-sweep, RESULTS.md tenth session):
- _gemv_rows_dot_kernel puts a [BLOCK_N, BLOCK_K] weight tile against x's rows (padded to the 16
  an MMA takes) on the tensor cores: the arithmetic is free, and x comes in once per tile. Its
  tiles need 16+ weight rows each, so a 1024-row projection gets only 64 programs.
- _gemv_rows_fma_kernel is the one-row kernel with a row axis: 1-2 weight rows per program, so
  the 1024-row projections fill the GPU, but every row costs FMAs and an x tile from L1. It wins
  there for up to 4 rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_ok = kk < K
        w = tl.load(w_ptr + n[:, None] * stride_w + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + kk, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_rows_fma_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, ROWS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Each weight tile is loaded once and multiplied into every row of x: the rows cost x's reads
    # (from L1; x is a few KB) and FMAs, not more weight traffic.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, ROWS)
    n_ok, r_ok = n < N, r < M
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_ok = kk < K
        w = tl.load(w_ptr + n[:, None] * stride_w + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + r[:, None] * stride_x + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    y = tl.sum(acc, axis=2)
    tl.store(y_ptr + r[:, None] * N + n[None, :], y.to(y_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_rows_dot_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, ROWS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    # y.T = W @ x.T on the tensor cores, x's rows padded to the 16 an MMA takes: each weight tile
    # meets every row of x in one instruction stream.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, ROWS)
    n_ok, r_ok = n < N, r < M
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_ok = kk < K
        w = tl.load(w_ptr + n[:, None] * stride_w + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_ptr + r[None, :] * stride_x + kk[:, None], mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE:  # float32 weights: no tf32 rounding
            acc = tl.dot(w, xt, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    tl.store(y_ptr + r[None, :] * N + n[:, None], acc.to(y_ptr.dtype.element_ty), mask=r_ok[None, :] & n_ok[:, None])


MAX_ROWS = 8
_DOT_ROWS = 16  # the smallest MMA tile's side: x's rows are padded to it


def launch_config(N: int, K: int, rows: int = 1) -> tuple[str, int, int, int, int]:
    """(kernel, block_n, block_k, num_warps, num_stages) from sweeps of Qwen3-0.6B's projections
    (one row on an H200, 2-8 rows on an H100; RESULTS.md): "one" (the one-row kernel), "fma" or
    "dot" (the row kernels)."""
    if rows == 1:
        # A weight row per program for the 1024-row projections, so that they too fill the GPU.
        return ("one", 1, 1024, 8, 3) if N <= 2048 else ("one", 2, 512, 2, 3)
    if N <= 2048 and rows <= 4:
        return "fma", 1 if rows == 2 else 2, 1024, 4, 3
    if N <= 2048:
        return "dot", 16, 512, 4, 3
    return "dot", 32, 256, 4, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, *, kernel: str | None = None, block_n: int | None = None,
         block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x: [M, K] with 1 <= M <= MAX_ROWS; weight: [N, K], both contiguous along K. Returns [M, N] in
    x's dtype. A launch knob left None comes from launch_config (the others are for tests and
    sweeps; kernel "one" takes one row only)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gemv takes x [M <= {MAX_ROWS}, K] and weight [N, K]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("gemv needs x and weight contiguous along K")
    (M, K), N = x.shape, weight.shape[0]
    given = (kernel, block_n, block_k, num_warps, num_stages)
    kernel, block_n, block_k, num_warps, num_stages = (g or c for g, c in zip(given, launch_config(N, K, M)))
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, block_n),)
    launch = dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    if kernel == "one":
        if M != 1:
            raise ValueError(f"the one-row kernel takes one row; got {M}")
        _gemv_kernel[grid](x, weight, out, N, K, weight.stride(0), **launch)
    elif kernel == "fma":
        rows = triton.next_power_of_2(max(M, 2))
        _gemv_rows_fma_kernel[grid](x, weight, out, M, N, K, x.stride(0), weight.stride(0), ROWS=rows, **launch)
    elif kernel == "dot":
        _gemv_rows_dot_kernel[grid](x, weight, out, M, N, K, x.stride(0), weight.stride(0), ROWS=_DOT_ROWS,
                                    IEEE=x.dtype == torch.float32, **launch)
    else:
        raise ValueError(f"unknown gemv kernel {kernel!r}")
    return out
