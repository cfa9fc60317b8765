"""SwiGLU's activation: silu(gate) * up in one pass."""
import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8 import FP8_MAX, activation_buffers, store_row_groups


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x):
    """x [..., 2 * d] -> silu(x[..., :d]) * x[..., d:] as a new [..., d] tensor in x's dtype,
    computed in fp32 and rounded once."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    assert x2.stride(-1) == 1
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    block = min(triton.next_power_of_2(d), 1024)
    if x2.shape[0]:
        pdl_mode = pdl.mode(x.device, x2.shape[0])
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=block, PDL=pdl_mode, num_warps=4, launch_pdl=pdl_mode > 0)
    return out


@triton.jit
def _silu_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, rows, stride_x, stride_q, stride_s_row, stride_s_group, d,
                         BLOCK: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    live_cols = tl.where(row < rows, d, 0)  # the rest are padding rows of the quantized output
    first_group = tl.program_id(1) * (BLOCK // GROUP)
    cols = first_group * GROUP + tl.arange(0, BLOCK)
    mask = cols < live_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    # Rounded to x's dtype first: the values silu_and_mul would return.
    out = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    store_row_groups(out, q_ptr + row * stride_q, s_ptr + row * stride_s_row, first_group, d, live_cols, stride_s_group,
                     GROUP, BLOCK, FP8_MAX)


def silu_and_mul_fp8(x, *, group: int, pad_rows_to: int = 1, scales_by_column: bool = False):
    """silu_and_mul's output quantized as kernels.fp8.quantize_activations(out, group, pad_rows_to=...,
    scales_by_column=...) quantizes it, bit for bit, in one launch: (e4m3 rows, scales). x [rows, 2 * d]."""
    rows, width = x.shape
    d = width // 2
    assert x.stride(1) == 1 and group & (group - 1) == 0
    q, scales = activation_buffers(rows, d, group, pad_rows_to, scales_by_column, x.device)
    block = max(min(triton.next_power_of_2(d), 1024), group)  # whole groups: a program's are its own
    if q.shape[0]:
        pdl_mode = pdl.mode(x.device, rows)
        _silu_mul_fp8_kernel[(q.shape[0], triton.cdiv(d, block))](
            x, q, scales, rows, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1), d, BLOCK=block,
            GROUP=group, FP8_MAX=FP8_MAX, PDL=pdl_mode, num_warps=4, launch_pdl=pdl_mode > 0)
    return q, scales
