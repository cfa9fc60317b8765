"""Top-p (nucleus) draws without sorting the vocabulary.

engine.runner.sampler draws a row's token as argmax(p / E) over the tokens its filters keep, E ~
Exp(1). Top-p keeps a token when the probability of the tokens more likely than it is under top_p;
the sampler finds that set by sorting the row (1.4 ms for 64 rows of a 152K vocabulary on an H200,
benchmarks/HISTORY.md 2026-11-28). This kernel gives the same token without the sort:

- j = argmax(p / E) over every token. If j is in the nucleus, no kept token beats it: it is the token.
- Else no token as likely as j or less is in the nucleus (the nucleus is the most likely tokens), so
  the token is argmax(p / E) over the tokens more likely than j. That is the next candidate; repeat.

Each round is one pass over the row that sums the mass above the candidate and finds the next one.
The first candidate is a draw from p, which lands in the nucleus with probability at least top_p,
and each later one likewise within what is left, so most rows take two passes and few a third.
One program per row; each pass reads the row's logits and noise (from L2 after the first).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _top_p_draw_kernel(logits_ptr, noise_ptr, top_p_ptr, out_ptr, vocab, stride_l, stride_n,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_l
    noise_row = noise_ptr + row * stride_n
    top_p = tl.load(top_p_ptr + row)
    cols = tl.arange(0, BLOCK)
    # Pass 1: the row's largest logit m, its softmax denominator z = sum(exp(l - m)) (rescaled as m
    # grows), and the first candidate. argmax(p / E) is argmax(l - log E): no normalization needed.
    m = tl.full([], float("-inf"), tl.float32)
    z = tl.full([], 0.0, tl.float32)
    best_key = tl.full([], float("-inf"), tl.float32)
    best = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        at = start + cols
        inside = at < vocab
        logit = tl.load(logits_row + at, mask=inside, other=float("-inf"))
        noise = tl.load(noise_row + at, mask=inside, other=1.0)
        m_new = tl.maximum(m, tl.max(logit, 0))
        # Until a finite logit is seen, m_new is -inf and there is nothing to sum or rescale.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        z = z * tl.exp(m - shift) + tl.sum(tl.exp(logit - shift), 0)
        m = m_new
        key = logit - tl.log(noise)
        tile_best = tl.max(key, 0)
        tile_at = tl.min(tl.where(key == tile_best, at, vocab), 0)
        take = tile_best > best_key
        best = tl.where(take, tile_at, best)
        best_key = tl.where(take, tile_best, best_key)
    chosen = best
    searching = top_p < 1.0
    while searching:
        # Pass 2+: the mass of the tokens more likely than the candidate, and the best of them.
        pivot = tl.load(logits_row + chosen)
        above_mass = tl.full([], 0.0, tl.float32)
        best_key = tl.full([], float("-inf"), tl.float32)
        best = chosen
        for start in range(0, vocab, BLOCK):
            at = start + cols
            inside = at < vocab
            logit = tl.load(logits_row + at, mask=inside, other=float("-inf"))
            noise = tl.load(noise_row + at, mask=inside, other=1.0)
            above = logit > pivot
            above_mass += tl.sum(tl.where(above, tl.exp(logit - m), 0.0), 0)
            key = tl.where(above, logit - tl.log(noise), float("-inf"))
            tile_best = tl.max(key, 0)
            tile_at = tl.min(tl.where(key == tile_best, at, vocab), 0)
            take = tile_best > best_key
            best = tl.where(take, tile_at, best)
            best_key = tl.where(take, tile_best, best_key)
        # Each round moves to a more likely token, and the most likely has none above it: the loop
        # ends there even where top_p * z is 0 (a top_p under float32's range, a row of -inf).
        searching = (above_mass >= top_p * z) & (best != chosen)
        chosen = tl.where(searching, best, chosen)
    tl.store(out_ptr + row, chosen.to(tl.int64))


def top_p_draw(scaled: torch.Tensor, noise: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """One token per row (int64 [rows]): argmax(p / noise) over the row's top-p nucleus, p the
    softmax of scaled. scaled: float32 [rows, vocab] logits already divided by their temperature
    (-inf for tokens never to be drawn; every row needs a finite one); noise: float32 Exp(1)
    samples, positive, of the same shape; top_p: float32 [rows] in (0, 1], 1 keeping every token.
    A token is in the nucleus when the mass of the tokens strictly more likely than it is under
    top_p, as sampler.filter_top_k_top_p keeps them (which breaks ties by its sort's order)."""
    rows, vocab = scaled.shape
    assert scaled.dtype == torch.float32 and noise.dtype == torch.float32 and noise.shape == scaled.shape
    assert scaled.stride(-1) == 1 and noise.stride(-1) == 1 and top_p.shape == (rows,)
    out = torch.empty(rows, dtype=torch.int64, device=scaled.device)
    if rows:
        block = min(4096, triton.next_power_of_2(vocab))
        _top_p_draw_kernel[(rows,)](scaled, noise, top_p.float().contiguous(), out, vocab, scaled.stride(0),
                                    noise.stride(0), BLOCK=block, num_warps=8 if scaled.is_cuda else 1)
    return out
