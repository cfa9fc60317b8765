"""A tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it.

Each rank holds a partial sum x of a row-parallel layer's output. The kernel copies its x into its
own slot of a buffer that every peer can read (CUDA symmetric memory: `buffer_ptrs[r]` is rank r's
buffer, mapped into this process), meets the same-numbered program of every peer at a barrier of
flags in peer memory, then sums the slots of all ranks row by row, adds the residual and normalizes,
as `rms_norm(sum, weight, eps, residual)` would. One launch instead of an all-reduce kernel and a
norm kernel: at batch 1 a decode step of a 64-layer model makes 128 of these.

The barrier: program b of rank r sets flag [b, r] at every peer (waiting, if that flag is still
set, until the peer has taken the previous one), then takes flag [b, p] from its own flags for
every peer p. Taking a flag clears it, so the flags need no reset between calls and a CUDA graph
replays them as they are. Release/acquire at system scope orders the slot's data before the flag.

A rank writes its slot again only after a later barrier with every peer, so each call site
alternates between two slots (`slot`): a peer still reading the slot of the call before the last
has necessarily stopped, since it has reached the barrier of the call in between.
"""
import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.rmsnorm import add_rms_norm_row

MAX_PROGRAMS = 32  # each owns one row of flags; rows are shared out among them


@triton.jit
def _barrier(flag_ptrs, rank, program, WORLD: tl.constexpr):
    tl.debug_barrier()  # every thread's slot writes happen before the flags below
    for peer in tl.static_range(WORLD):
        if peer != rank:
            theirs = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32)) + program * WORLD + rank
            while tl.atomic_cas(theirs, 0, 1, sem="release", scope="sys") != 0:
                pass
    mine = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32)) + program * WORLD
    for peer in tl.static_range(WORLD):
        if peer != rank:
            while tl.atomic_cas(mine + peer, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()


@triton.jit
def _all_reduce_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, buffer_ptrs, flag_ptrs,
                                rank, rows, n_cols, slot_offset, eps,
                                stride_x, stride_r, stride_o, stride_ro,
                                WORLD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    program = tl.program_id(0)
    if PDL:  # x comes from the kernel before
        tl.extra.cuda.gdc_wait()
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    mine = tl.load(buffer_ptrs + rank).to(tl.pointer_type(dtype)) + slot_offset
    for row in range(program, rows, programs):
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask)
        tl.store(mine + row * n_cols + cols, x, mask=mask)
    _barrier(flag_ptrs, rank, program, WORLD)
    if PDL:
        # The next kernel may launch and load its weights while the slots are summed, but not
        # while this one waits at the barrier: its programs would wait on this one and could fill
        # every SM, leaving none for the kernels that open the barrier when a peer has died
        # (symm_allreduce.SymmAllReduce.abort).
        tl.extra.cuda.gdc_launch_dependents()
    for row in range(program, rows, programs):
        total = tl.zeros([BLOCK], tl.float32)
        # Every rank adds the slots in rank order, so every rank gets the same bits.
        for peer in tl.static_range(WORLD):
            theirs = tl.load(buffer_ptrs + peer).to(tl.pointer_type(dtype)) + slot_offset
            total += tl.load(theirs + row * n_cols + cols, mask=mask, other=0.0, volatile=True).to(tl.float32)
        # Rounded as the all-reduce's output would be, then the add and norm of kernels/rmsnorm.py.
        add_rms_norm_row(total.to(dtype), res_ptr + row * stride_r, w_ptr, out_ptr + row * stride_o,
                         res_out_ptr + row * stride_ro, cols, mask, n_cols, eps, True)


def all_reduce_rms_norm(x, residual, weight, eps, *, buffer_ptrs, flag_ptrs, rank, slot_offset):
    """(rms_norm(sum over ranks of x + residual) * weight, sum + residual) for x, residual
    [rows, hidden] of one dtype. Collective: every rank calls it with the same shapes and slot.

    buffer_ptrs / flag_ptrs: int64 [world] tensors on x's device, every rank's buffer and flag
    addresses as this process maps them; each buffer holds this call's slot, rows x hidden
    elements of x's dtype from element slot_offset, and each flag area MAX_PROGRAMS x world int32,
    zeroed before the first call on every rank."""
    rows, hidden = x.shape
    assert x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()
    assert residual.shape == x.shape and residual.dtype == x.dtype
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(hidden)
        pdl_mode = pdl.mode(x.device)  # its trigger comes after its barrier
        _all_reduce_rms_norm_kernel[(min(rows, MAX_PROGRAMS),)](
            x, residual, weight, out, res_out, buffer_ptrs, flag_ptrs, rank, rows, hidden, slot_offset, eps,
            x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0),
            WORLD=buffer_ptrs.shape[0], BLOCK=block, PDL=pdl_mode, num_warps=min(max(block // 256, 1), 8),
            launch_pdl=pdl_mode > 0)
    return out, res_out
