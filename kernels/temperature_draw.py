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

The same two launches with the logits themselves as keys are an argmax: rows marked greedy take it
in a draw, and greedy_tokens takes it for every row, as torch.argmax does (the first of equal
maxima, a NaN above everything).
"""
import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.exponential_noise import exp1

CHUNK = 4096


@triton.jit
def _ranked(key):
    """float32 keys as int32 in the order torch's argmax ranks them: the int32 of a float's bits,
    negative ones with their magnitude bits flipped, -0.0 with +0.0, and every NaN above +inf.
    In integers the ranking is exact whatever the compiler assumes of NaN, and a row's maximum
    always has a position (a float max over NaNs may match none)."""
    bits = key.to(tl.int32, bitcast=True)
    ranked = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ranked = tl.where(ranked == -1, 0, ranked)
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FFFFFFF, ranked)


@triton.jit
def _first_best(ranked, at, none):
    """(the largest of `ranked`, its first position in `at`); none: a position beyond them all."""
    best = tl.max(ranked, 0)
    return best, tl.min(tl.where(ranked == best, at, none), 0)


@triton.jit
def _chunk_best_kernel(logits_ptr, temps_ptr, greedy_ptr, seed_ptr, key_ptr, idx_ptr, vocab, chunks, stride_l,
                       CHUNK: tl.constexpr, DRAW: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk): the chunk's best key and its first position. The key is the logit
    itself (argmax), or with DRAW, for rows not greedy, the noisy key of the draw."""
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    at = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = at < vocab
    pdl.wait(PDL)  # the logits come from the kernel before, the seed from an earlier one
    logit = tl.load(logits_ptr + row * stride_l + at, mask=inside, other=float("-inf")).to(tl.float32)
    key = logit
    if DRAW:
        noise = exp1(tl.load(seed_ptr), row * vocab + at)
        noisy = logit / tl.load(temps_ptr + row)
        # A token that may not be drawn (-inf) stays out whatever its noise.
        noisy = tl.where(noisy == float("-inf"), float("-inf"), noisy - tl.log(noise))
        key = tl.where(tl.load(greedy_ptr + row) != 0, logit, noisy)
    best, first = _first_best(_ranked(key), at, vocab)
    tl.store(key_ptr + row * chunks + chunk, best)
    tl.store(idx_ptr + row * chunks + chunk, first)


@triton.jit
def _row_best_kernel(key_ptr, idx_ptr, out_ptr, chunks, C_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_PAD)
    inside = c < chunks
    pdl.wait(PDL)
    key = tl.load(key_ptr + row * chunks + c, mask=inside, other=-2147483647)
    idx = tl.load(idx_ptr + row * chunks + c, mask=inside, other=2147483647)
    # The chunks' first positions rise with the chunks: the first best chunk holds the row's first.
    _, first = _first_best(key, idx, 2147483647)
    tl.store(out_ptr + row, first.to(tl.int64))


def _best(logits, out, temps=None, greedy=None, seed=None):
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    assert out.dtype == torch.int64 and out.shape == (rows,) and out.is_contiguous()
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    keys = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)  # int32 keys, as _ranked orders them
    ids = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    draw = temps is not None
    mode = pdl.mode(logits.device, rows)
    _chunk_best_kernel[(rows, chunks)](logits, temps if draw else logits, greedy if draw else logits,
                                       seed if draw else logits, keys, ids, vocab, chunks, logits.stride(0),
                                       CHUNK=CHUNK, DRAW=draw, PDL=mode, num_warps=8 if logits.is_cuda else 1,
                                       launch_pdl=mode > 0)
    _row_best_kernel[(rows,)](keys, ids, out, chunks, C_PAD=triton.next_power_of_2(chunks), PDL=mode,
                              num_warps=4 if logits.is_cuda else 1, launch_pdl=mode > 0)
    return out


def temperature_draw(logits: torch.Tensor, temps: torch.Tensor, seed: torch.Tensor, greedy: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row (int64 [rows]): argmax(softmax(logits / temps) / E) with E =
    exponential_noise(logits.shape, seed), without storing E or the scaled logits; rows that
    `greedy` (bool [rows]) marks take their argmax instead. logits: [rows, vocab], any float dtype,
    -inf for tokens never to be drawn (every row needs a finite one); temps: float32 [rows],
    positive; seed: int64 [1] on logits' device, read, not changed. out: int64 [rows] to write the
    tokens into (a new tensor if None), returned."""
    rows, vocab = logits.shape
    # The noise's offsets are int32 (kernels.exponential_noise).
    assert temps.shape == (rows,) and (greedy is None or greedy.shape == (rows,)) and rows * vocab < 2**31
    greedy = torch.zeros(rows, dtype=torch.bool, device=logits.device) if greedy is None else greedy
    return _best(logits, out, temps.float().contiguous(), greedy.contiguous(), seed)


def greedy_tokens(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.argmax(logits, -1) in two launches that spread each row over CHUNK-wide programs
    (torch's takes a launch and a memset, and 8.8 µs for a row of 151,936 bf16 logits on an
    H200): the first position of each row's largest logit, or of its first NaN. out: as for
    temperature_draw."""
    return _best(logits, out)
