"""RMSNorm, optionally with the residual add fused in front (the pre-norm block's pattern)."""
import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8 import FP8_MAX, activation_buffers, store_row_groups


@triton.jit
def _add_rms_norm(x, res_ptr, w_ptr, res_out_ptr, cols, mask, n_cols, eps, HAS_RESIDUAL: tl.constexpr):
    """One row: with a residual, stores x + residual at res_out_ptr; returns RMSNorm of that (or
    of x) times the weight, in float32. Pointers are the row's starts."""
    if HAS_RESIDUAL:
        # Rounded to the residual stream's dtype before use, as torch's `x + residual` is.
        h = (x.to(tl.float32) + tl.load(res_ptr + cols, mask=mask, other=0.0).to(tl.float32)) \
            .to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + cols, h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    # Normalized x is cast back to its dtype before the weight multiply, like the torch module.
    normed = (hf * rstd).to(h.dtype).to(tl.float32)
    return normed * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def add_rms_norm_row(x, res_ptr, w_ptr, out_ptr, res_out_ptr, cols, mask, n_cols, eps, HAS_RESIDUAL: tl.constexpr):
    """One row: with a residual, stores x + residual at res_out_ptr; stores RMSNorm of that (or
    of x) times the weight at out_ptr. Pointers are the row's starts."""
    y = _add_rms_norm(x, res_ptr, w_ptr, res_out_ptr, cols, mask, n_cols, eps, HAS_RESIDUAL)
    tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    add_rms_norm_row(x, res_ptr + row * stride_r, w_ptr, out_ptr + row * stride_o, res_out_ptr + row * stride_ro,
                     cols, mask, n_cols, eps, HAS_RESIDUAL)


def rms_norm(x, weight, eps, residual=None):
    """engine.layers.norm.RMSNorm's forward over the last dim of x [..., hidden]: returns the
    normed tensor, or with a residual (normed, x + residual). Outputs are new tensors, with torch's
    type promotion of (weight, x) and (x, residual)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    h_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, h_dtype), device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        res_out = torch.empty(x.shape, dtype=h_dtype, device=x.device)
        ro2 = res_out.view(-1, hidden)
    else:
        r2 = ro2 = x2  # unused
    assert x2.stride(-1) == 1 and r2.stride(-1) == 1 and weight.is_contiguous()
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(hidden)
        pdl_mode = pdl.mode(x.device, rows)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out2, ro2, x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
            hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, PDL=pdl_mode,
            num_warps=min(max(block // 256, 1), 8), launch_pdl=pdl_mode > 0)
    return out if residual is None else (out, res_out)


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, rows,
                         stride_x, stride_r, stride_q, stride_ro, stride_s_row, stride_s_group, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                         FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    live_cols = tl.where(row < rows, n_cols, 0)  # the rest are padding rows of the quantized output
    cols = tl.arange(0, BLOCK)
    mask = cols < live_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    y = _add_rms_norm(x, res_ptr + row * stride_r, w_ptr, res_out_ptr + row * stride_ro, cols, mask, n_cols, eps,
                      HAS_RESIDUAL)
    # Rounded to x's dtype first, as rms_norm returns its values, then quantized as quantize_activations would.
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    store_row_groups(y, q_ptr + row * stride_q, s_ptr + row * stride_s_row, 0, n_cols, live_cols, stride_s_group,
                     GROUP, BLOCK, FP8_MAX)


def rms_norm_fp8(x, weight, eps, residual=None, *, group: int, pad_rows_to: int = 1, scales_by_column: bool = False):
    """rms_norm's output quantized as kernels.fp8.quantize_activations(out, group, pad_rows_to=...,
    scales_by_column=...) quantizes it, in one launch: returns (e4m3 rows, scales), or with a
    residual ((e4m3 rows, scales), x + residual). x [rows, hidden], weight and residual in x's
    dtype; hidden a multiple of group. The e4m3 codes and scales are rms_norm's quantized, except
    where the row's sum of squares, added in another order (the groups' reshape gives the row
    another layout across threads), rounds its rstd differently: one e4m3 step at a rounding tie,
    in 1-26 codes of 4,000 rows at hidden 4096-8192 on an H200, none at 2048 (benchmarks/HISTORY.md,
    2026-11-28, 11:10)."""
    rows, hidden = x.shape
    assert weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype), "one dtype"
    assert hidden % group == 0 and x.stride(1) == 1 and weight.is_contiguous()
    q, scales = activation_buffers(rows, hidden, group, pad_rows_to, scales_by_column, x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        r, ro = residual, res_out
    else:
        r = ro = x  # unused
    if q.shape[0]:
        block = triton.next_power_of_2(hidden)
        pdl_mode = pdl.mode(x.device, rows)
        _rms_norm_fp8_kernel[(q.shape[0],)](
            x, r, weight, q, scales, ro, rows, x.stride(0), r.stride(0), q.stride(0), ro.stride(0),
            scales.stride(0), scales.stride(1), hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            GROUP=group, FP8_MAX=FP8_MAX, PDL=pdl_mode, num_warps=min(max(block // 256, 1), 8), launch_pdl=pdl_mode > 0)
    return (q, scales) if residual is None else ((q, scales), res_out)
