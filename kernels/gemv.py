"""y = x @ W.T for one row of x: a batch-1 decode step's projections.

At batch 1 a small model's projections read 4-13 MB of weights each, too little for cuBLAS's
kernels to reach the copy bandwidth: in a CUDA graph on the H200 they ran Qwen3-0.6B's four
projections at 5.2-12.6 us each (0.33-2.1 TB/s; the 1024-row o projection was the worst). Here each
program owns a band of only a few of W's rows and streams it once along K, so even the 1024-row
projections spread over every SM with many loads in flight. It also beat or tied cuBLAS on every
projection of the 1.7B, 4B and 8B shapes (8B: 99 against 108 us per layer; bench_gemv). With
more rows, cuBLAS's tiles reuse each weight load across the rows and win (RESULTS.md), so this
kernel takes one row only. Taking the MLP's SiLU-mul into the down projection's GEMV saved its
launch but slowed the GEMV more (each program applied it to the whole row): dropped.
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


def launch_config(N: int, K: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages), from a sweep of Qwen3-0.6B's projections (RESULTS.md):
    a row per program for the 1024-row ones, so that they too fill the GPU; two rows beyond."""
    if N <= 2048:
        return 1, 1024, 8, 3
    return 2, 512, 2, 3


def gemv(x: torch.Tensor, weight: torch.Tensor, *, block_n: int | None = None, block_k: int | None = None,
         num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x: [1, K]; weight: [N, K], contiguous along K. Returns [1, N] in x's dtype. A launch knob left
    None comes from launch_config (the others are for tests and sweeps)."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gemv takes x [1, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("gemv needs x and weight contiguous along K")
    N, K = weight.shape
    given = (block_n, block_k, num_warps, num_stages)
    block_n, block_k, num_warps, num_stages = (g or c for g, c in zip(given, launch_config(N, K)))
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, weight, out, N, K, weight.stride(0), BLOCK_N=block_n,
                                             BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out
