"""SwiGLU's activation: silu(gate) * up in one pass."""
import torch
import triton
import triton.language as tl

from kernels import pdl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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
        pdl_on = pdl.enabled(x.device)
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=block, PDL=pdl_on, num_warps=4, launch_pdl=pdl_on)
    return out
