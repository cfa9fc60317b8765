"""Linear layers for few-row inputs (decode steps), with the RMSNorm in front and SwiGLU behind.

At a handful of rows a linear layer is a pass over its weight matrix, and the time should be the
weight bytes over the memory bandwidth. On an H200 cuBLAS reached about a quarter of that for the
Qwen3-0.6B shapes at batch 1 (a 12.6 MB gate_up matrix took 10.3 us), and the small kernels around
each matmul (residual add + RMSNorm before, SiLU-mul after) cost 1.2-1.9 us each. This kernel
streams W once per BLOCK_N output rows and folds those neighbours in:

- NORM: the input is (x + residual) RMS-normed with a weight, as engine.layers.norm.RMSNorm does.
  Every program computes the row's RMS itself (the row is a few KB and comes from L2); the
  programs of the first column tile also write x + residual out, the next layer's residual.
- GATED: W holds gate rows then up rows (MergedColumnParallelLinear); a program reads the matching
  rows of both and writes silu(gate) * up, so the [rows, 2 * inter] product never exists.

The rounding follows the unfused torch path (each intermediate rounded to the model dtype where
torch would round it), so the two agree to the usual bf16 tolerance.
"""
import torch
import triton
import triton.language as tl

from kernels.decode_attention import _dot, dot_flags

# Inputs with more rows than this go to cuBLAS: from here on its tiles reuse each weight tile
# across enough rows to be bandwidth-bound too.
MAX_ROWS = 16


@triton.jit
def _load_input(x_ptr, res_ptr, rows, cols, mask, stride_xm, stride_rm, RESIDUAL: tl.constexpr, h_dtype):
    """x (+ residual) tile, rounded to the residual stream's dtype as torch's `x + residual` is."""
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    if RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(h_dtype)
    return x


@triton.jit
def _times_w(a, w, USE_DOT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a [M, K] times w [N, K] transposed, in fp32."""
    if USE_DOT:
        return _dot(a, tl.trans(w), PRECISION, UPCAST)
    return tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _skinny_linear_kernel(
    x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, res_out_ptr,
    M, N, K, up_offset, eps,
    stride_xm, stride_rm, stride_wn, stride_om, stride_rom,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    out_mask = outs < N
    rows = rows.to(tl.int64)
    outs = outs.to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    w_dtype = w_ptr.dtype.element_ty
    h_dtype = res_out_ptr.dtype.element_ty

    if NORM:
        sum_sq = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + kk
            mask = row_mask[:, None] & (cols < K)[None, :]
            h = _load_input(x_ptr, res_ptr, rows, cols, mask, stride_xm, stride_rm, RESIDUAL, h_dtype)
            if RESIDUAL and pid_n == 0:
                tl.store(res_out_ptr + rows[:, None] * stride_rom + cols[None, :], h, mask=mask)
            hf = h.to(tl.float32)
            sum_sq += tl.sum(hf * hf, 1)
        rstd = tl.rsqrt(sum_sq / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + kk
        col_mask = cols < K
        mask = row_mask[:, None] & col_mask[None, :]
        a = _load_input(x_ptr, res_ptr, rows, cols, mask, stride_xm, stride_rm, RESIDUAL, h_dtype)
        if NORM:
            # RMSNorm's two roundings: the normalized x back to its dtype, then weight * x.
            normed = (a.to(tl.float32) * rstd[:, None]).to(a.dtype)
            nw = tl.load(norm_w_ptr + cols, mask=col_mask, other=0.0)
            a = nw[None, :].to(tl.float32) * normed.to(tl.float32)
        a = a.to(w_dtype)
        w_mask = out_mask[:, None] & col_mask[None, :]
        w = tl.load(w_ptr + outs[:, None] * stride_wn + cols[None, :], mask=w_mask, other=0.0)
        acc += _times_w(a, w, USE_DOT, PRECISION, UPCAST)
        if GATED:
            w_up = tl.load(w_ptr + (outs + up_offset)[:, None] * stride_wn + cols[None, :], mask=w_mask, other=0.0)
            acc_up += _times_w(a, w_up, USE_DOT, PRECISION, UPCAST)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + outs, mask=out_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        # torch rounds the gate_up product before SiLU-mul, which then runs in fp32.
        gate = acc.to(w_dtype).to(tl.float32)
        up = acc_up.to(w_dtype).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows[:, None] * stride_om + outs[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & out_mask[None, :])


def default_config(rows: int, out_features: int, in_features: int, on_gpu: bool) -> dict:
    """Tile sizes and warps. From `benchmarks/bench_kernels.py --skinny-sweep` on an H200 (bf16)."""
    if not on_gpu:
        return dict(BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=16, BLOCK_K=32, USE_DOT=True,
                    num_warps=1, num_stages=1)
    if rows <= 2:
        return dict(BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=8, BLOCK_K=256, USE_DOT=False,
                    num_warps=4, num_stages=3)
    return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, USE_DOT=True, num_warps=4, num_stages=3)


def skinny_linear(x, weight, bias=None, *, norm_weight=None, eps=1e-6, residual=None, gated=False,
                  config=None):
    """x [rows, in] @ weight[out, in].T (+ bias) for few rows.

    norm_weight: first RMS-normalize the input (x + residual, when a residual is given) with
    this weight and eps. gated: weight is [2 * out, in], gate rows then up rows, and the result
    is silu(gate) * up, [rows, out]. Returns the output, or (output, x + residual) when a
    residual is given. config overrides the tuned tiles (tests and benchmarks)."""
    rows, in_features = x.shape
    assert x.stride(-1) == 1 and weight.is_contiguous(), "x's rows and weight must be contiguous"
    assert not (gated and bias is not None), "a gated projection with a bias is not supported"
    assert residual is None or norm_weight is not None, "the residual add belongs to the norm"
    out_features = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        res_out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    else:
        residual = res_out = x  # unused
    if rows:
        cfg = config or default_config(rows, out_features, in_features, x.is_cuda)
        cfg = dict(cfg)
        num_warps, num_stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        grid = (triton.cdiv(out_features, cfg["BLOCK_N"]), triton.cdiv(rows, cfg["BLOCK_M"]))
        _skinny_linear_kernel[grid](
            x, residual, norm_weight if norm_weight is not None else weight, weight,
            bias if bias is not None else weight, out, res_out,
            rows, out_features, in_features, out_features, eps,
            x.stride(0), residual.stride(0), weight.stride(0), out.stride(0), res_out.stride(0),
            NORM=norm_weight is not None, RESIDUAL=res_out is not x, GATED=gated, HAS_BIAS=bias is not None,
            **cfg, **dot_flags(weight.dtype), num_warps=num_warps, num_stages=num_stages)
    return out if res_out is x else (out, res_out)
