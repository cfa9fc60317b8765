"""A decode step's input tokens in one launch: each row's token is either staged by the host or,
for a row whose sequence sampled it in the step before, taken from the token buffer on the device
(the host has not read it yet). In torch operations that is a compare, a clamp, an index_select, a
where and a copy, five launches at the head of every decode graph (~7 µs of a 0.7 ms batch-1 step
under torch.profiler on an H200, benchmarks/HISTORY.md, 2026-11-29)."""
import torch
import triton
import triton.language as tl


BLOCK = 128


@triton.jit(do_not_specialize=["rows"])  # one binary for every bucket size
def _fed_tokens_kernel(feed_from_ptr, sampled_ptr, staged_ptr, out_ptr, rows, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = r < rows
    source = tl.load(feed_from_ptr + r, mask=inside, other=-1)
    fed = tl.load(sampled_ptr + tl.maximum(source, 0), mask=inside & (source >= 0))
    staged = tl.load(staged_ptr + r, mask=inside & (source < 0))
    tl.store(out_ptr + r, tl.where(source >= 0, fed, staged), mask=inside)


def fed_tokens(feed_from: torch.Tensor, sampled: torch.Tensor, staged: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = sampled[feed_from[i]] where feed_from[i] >= 0, else staged[i]; returns out. feed_from:
    int64 [rows], -1 or a row of sampled; sampled, staged and out: int64, out and staged [rows]."""
    rows = out.shape[0]
    # The kernel reads feed_from as int64: int32 entries would be read in pairs, and past the buffer.
    assert feed_from.shape == staged.shape == (rows,), "feed_from, staged and out: one entry a row"
    assert feed_from.dtype == sampled.dtype == staged.dtype == out.dtype == torch.int64, "fed_tokens takes int64 only"
    assert all(t.is_contiguous() for t in (feed_from, sampled, staged, out))
    if rows:
        _fed_tokens_kernel[(triton.cdiv(rows, BLOCK),)](feed_from, sampled, staged, out, rows, BLOCK=BLOCK,
                                                        num_warps=1)
    return out
