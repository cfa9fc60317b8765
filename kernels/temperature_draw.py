"""The plain draw at a temperature in two launches, its noise never stored.

engine.runner.sampler.draw takes a row's token as argmax(p / E), p the softmax of the logits over the
row's temperature and E ~ Exp(1). In torch operations that is a float32 copy of the logits divided
by the temperatures, a softmax, a [rows, vocab] tensor of noise (kernels.exponential_noise), the
division and the argmax: each a pass over rows x vocab floats. argmax(p / E) is argmax(l / T - log E)
(the softmax's shift and scale leave the order alone), and exponential_noise's E at a flat index is a
function of (seed, index) that a kernel can compute where it needs it. So each program here reads
a chunk of a row's logits once, in their own dtype, and keeps the chunk's best; a second launch
picks each row's best chunk. The tokens are the ones the torch operations draw from
exponential_noise(shape, seed), up to float32 rounding between near-equal keys.
"""
import torch
import triton
import triton.language as tl

from kernels.exponential_noise import exp1

CHUNK = 4096


@triton.jit
def _chunk_best_kernel(logits_ptr, temps_ptr, seed_ptr, key_ptr, idx_ptr, vocab, chunks, stride_l,
                       CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    at = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = at < vocab
    logit = tl.load(logits_ptr + row * stride_l + at, mask=inside, other=float("-inf")).to(tl.float32)
    noise = exp1(tl.load(seed_ptr), row * vocab + at)
    key = logit / tl.load(temps_ptr + row)
    # A token that may not be drawn (-inf) stays out whatever its noise.
    key = tl.where(key == float("-inf"), float("-inf"), key - tl.log(noise))
    best = tl.max(key, 0)
    tl.store(key_ptr + row * chunks + chunk, best)
    tl.store(idx_ptr + row * chunks + chunk, tl.min(tl.where(key == best, at, vocab), 0))


@triton.jit
def _row_best_kernel(key_ptr, idx_ptr, out_ptr, chunks, C_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_PAD)
    inside = c < chunks
    key = tl.load(key_ptr + row * chunks + c, mask=inside, other=float("-inf"))
    idx = tl.load(idx_ptr + row * chunks + c, mask=inside, other=2147483647)
    best = tl.max(key, 0)
    tl.store(out_ptr + row, tl.min(tl.where(key == best, idx, 2147483647), 0).to(tl.int64))


def temperature_draw(logits: torch.Tensor, temps: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """One token per row (int64 [rows]): argmax(softmax(logits / temps) / E) with E =
    exponential_noise(logits.shape, seed), without storing E or the scaled logits. logits: [rows,
    vocab], any float dtype, -inf for tokens never to be drawn (every row needs a finite one);
    temps: float32 [rows], positive; seed: int64 [1] on logits' device, read, not changed."""
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1 and temps.shape == (rows,) and rows * vocab < 2**31
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    keys = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    ids = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    warps = 8 if logits.is_cuda else 1
    _chunk_best_kernel[(rows, chunks)](logits, temps.float().contiguous(), seed, keys, ids, vocab, chunks,
                                       logits.stride(0), CHUNK=CHUNK, num_warps=warps)
    _row_best_kernel[(rows,)](keys, ids, out, chunks, C_PAD=triton.next_power_of_2(chunks),
                              num_warps=4 if logits.is_cuda else 1)
    return out
