"""Top-p (nucleus) draws without sorting the vocabulary.

engine.runner.sampler draws a row's token as argmax(p / E) over the tokens its filters keep, E ~
Exp(1). Top-p keeps a token when the probability of the tokens more likely than it is under top_p;
the sampler finds that set by sorting the row (1.5 ms for 64 rows of a 152K vocabulary on an H200,
benchmarks/HISTORY.md 2026-11-28). These kernels give the same token without the sort:

- c0 = argmax(p / E) over every token. If c0 is in the nucleus, no kept token beats it: it is the token.
- Else no token as likely as c0 or less is in the nucleus (the nucleus is the most likely tokens), so
  the token is argmax(p / E) over the tokens more likely than c0: c1, the next candidate; and so on.

argmax(p / E) is argmax(l - log E) for logits l: no normalization needed to find candidates. Each
candidate is a draw from p within what is left, which lands in the nucleus with probability at
least top_p, so most rows stop at c0 and few go past c1.

Each row is split into chunks of CHUNK tokens, one program each, so that one row spreads over many
SMs. The first launch (_chunk_stats) gives each chunk's largest logit, softmax denominator and best
candidate. Each of `rounds` launches (_round) has its programs take the row's state (the current
candidate, whether it is decided, the largest logit and the denominator) one step on from the
chunks' figures of the launch before, all the same way, so they agree; its first chunk's program
stores that state for the next launch, which starts from it instead of computing it again (another
kernel could sum in another order and disagree). Then, for an undecided row, each program gives its
chunk's mass above the candidate and its best token above it. The last launch (_finish, one
program a row) takes the last step; a row still undecided continues alone there, one pass over
its whole row per candidate.
"""
import torch
import triton
import triton.language as tl

CHUNK = 2048
ROUNDS = 4


@triton.jit
def _best(keys, ids, big):
    """(largest key, the smallest id holding it) of a block; `big` is past every id."""
    top = tl.max(keys, 0)
    return top, tl.min(tl.where(keys == top, ids, big), 0)


@triton.jit
def _row_totals(m_ptr, z_ptr, key_ptr, idx_ptr, chunks, C_PAD: tl.constexpr):
    """The row's largest logit m, its softmax denominator relative to m, and c0, from the chunks'
    figures at m_ptr, z_ptr, key_ptr and idx_ptr (each `chunks` long)."""
    c = tl.arange(0, C_PAD)
    inside = c < chunks
    m_c = tl.load(m_ptr + c, mask=inside, other=float("-inf"))
    m = tl.max(m_c, 0)
    z = tl.sum(tl.where(inside, tl.load(z_ptr + c, mask=inside, other=0.0) * tl.exp(m_c - m), 0.0), 0)
    key = tl.load(key_ptr + c, mask=inside, other=float("-inf"))
    idx = tl.load(idx_ptr + c, mask=inside, other=2147483647)
    _, first = _best(key, idx, 2147483647)
    return m, z, first


@triton.jit
def _chain_round(mass_ptr, key_ptr, idx_ptr, chunks, candidate, limit, C_PAD: tl.constexpr):
    """One round's figures for a row: (whether `candidate` is in the nucleus, the next candidate):
    the chunks' masses above it summed, against limit = top_p * z, and their best token above it."""
    c = tl.arange(0, C_PAD)
    inside = c < chunks
    above = tl.sum(tl.load(mass_ptr + c, mask=inside, other=0.0), 0)
    key = tl.load(key_ptr + c, mask=inside, other=float("-inf"))
    idx = tl.load(idx_ptr + c, mask=inside, other=2147483647)
    best_key, best = _best(key, idx, 2147483647)
    # Nothing above the candidate (the most likely token): the candidate stays.
    best = tl.where(best_key == float("-inf"), candidate, best)
    return above < limit, best


@triton.jit
def _keys(logit, noise):
    """log(p / E) up to the row's constant: -inf for a token that may not be drawn, whatever E."""
    return tl.where(logit == float("-inf"), float("-inf"), logit - tl.log(noise))


@triton.jit
def _first_state(m_ptr, z_ptr, key_ptr, idx_ptr, top_p, chunks, C_PAD: tl.constexpr):
    """The row's state from the chunks' figures: (m, z, c0, whether c0 still needs a check)."""
    m, z, first = _row_totals(m_ptr, z_ptr, key_ptr, idx_ptr, chunks, C_PAD)
    return m, z, first, top_p < 1.0


@triton.jit
def _stored_state(state_f_ptr, state_i_ptr):
    return (tl.load(state_f_ptr), tl.load(state_f_ptr + 1), tl.load(state_i_ptr),
            tl.load(state_i_ptr + 1) != 0)


@triton.jit
def _step(mass_ptr, key_ptr, idx_ptr, chunks, candidate, undecided, limit, C_PAD: tl.constexpr):
    """The state one step on: (candidate, undecided) after the check of a round's figures. A row
    decided before keeps its candidate whatever the figures hold (its slot was not written)."""
    accepted, following = _chain_round(mass_ptr, key_ptr, idx_ptr, chunks, candidate, limit, C_PAD)
    moves = undecided & ~accepted
    return tl.where(moves, following, candidate), moves


@triton.jit
def _state_after(m_row_ptr, mass_ptr, key_ptr, idx_ptr, state_f_row, state_i_row, top_p, chunks, stride_r,
                 DONE: tl.constexpr, C_PAD: tl.constexpr):
    """The row's state (m, z, candidate, undecided) once the chunks' figures of rounds 0..DONE are
    stored: from round 0's alone, or the state round DONE - 1 stored taken one step on by round
    DONE's. mass_ptr, key_ptr, idx_ptr: the row's figures, slot 0."""
    if DONE == 0:
        m, z, candidate, undecided = _first_state(m_row_ptr, mass_ptr, key_ptr, idx_ptr, top_p, chunks, C_PAD)
    else:
        before = (DONE - 1) * 2
        m, z, candidate, undecided = _stored_state(state_f_row + before, state_i_row + before)
        slot = DONE * stride_r
        candidate, undecided = _step(mass_ptr + slot, key_ptr + slot, idx_ptr + slot, chunks, candidate,
                                     undecided, top_p * z, C_PAD)
    return m, z, candidate, undecided


@triton.jit
def _chunk_stats_kernel(logits_ptr, noise_ptr, m_ptr, z_ptr, key_ptr, idx_ptr, vocab,
                        stride_l, stride_n, stride_m, stride_s, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    at = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = at < vocab
    logit = tl.load(logits_ptr + row * stride_l + at, mask=inside, other=float("-inf"))
    noise = tl.load(noise_ptr + row * stride_n + at, mask=inside, other=1.0)
    m = tl.max(logit, 0)
    # A chunk of tokens that may never be drawn (all -inf) has nothing to sum.
    z = tl.sum(tl.exp(logit - tl.where(m == float("-inf"), 0.0, m)), 0)
    key, best = _best(_keys(logit, noise), at, vocab)
    tl.store(m_ptr + row * stride_m + chunk, m)
    out = row * stride_s + chunk
    tl.store(z_ptr + out, z)
    tl.store(key_ptr + out, key)
    tl.store(idx_ptr + out, best)


@triton.jit
def _round_kernel(logits_ptr, noise_ptr, top_p_ptr, m_ptr, mass_ptr, key_ptr, idx_ptr, state_f_ptr, state_i_ptr,
                  vocab, chunks, stride_l, stride_n, stride_m, stride_s, stride_r, stride_st,
                  ROUND: tl.constexpr, CHUNK: tl.constexpr, C_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    stats = row * stride_s
    top_p = tl.load(top_p_ptr + row)
    m, z, candidate, undecided = _state_after(m_ptr + row * stride_m, mass_ptr + stats, key_ptr + stats,
                                              idx_ptr + stats, state_f_ptr + row * stride_st,
                                              state_i_ptr + row * stride_st, top_p, chunks, stride_r,
                                              ROUND - 1, C_PAD)
    if chunk == 0:
        here = row * stride_st + (ROUND - 1) * 2
        tl.store(state_f_ptr + here, m)
        tl.store(state_f_ptr + here + 1, z)
        tl.store(state_i_ptr + here, candidate)
        tl.store(state_i_ptr + here + 1, undecided.to(tl.int32))
    if undecided:
        pivot = tl.load(logits_ptr + row * stride_l + candidate)
        at = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = at < vocab
        logit = tl.load(logits_ptr + row * stride_l + at, mask=inside, other=float("-inf"))
        above = logit > pivot
        noise = tl.load(noise_ptr + row * stride_n + at, mask=inside & above, other=1.0)
        mass = tl.sum(tl.where(above, tl.exp(logit - m), 0.0), 0)
        key, best = _best(tl.where(above, _keys(logit, noise), float("-inf")), at, vocab)
        out = stats + ROUND * stride_r + chunk
        tl.store(mass_ptr + out, mass)
        tl.store(key_ptr + out, key)
        tl.store(idx_ptr + out, best)


@triton.jit
def _finish_kernel(logits_ptr, noise_ptr, top_p_ptr, out_ptr, m_ptr, mass_ptr, key_ptr, idx_ptr, state_f_ptr,
                   state_i_ptr, vocab, chunks, stride_l, stride_n, stride_m, stride_s, stride_r, stride_st,
                   ROUNDS: tl.constexpr, C_PAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    stats = row * stride_s
    top_p = tl.load(top_p_ptr + row)
    m, z, candidate, searching = _state_after(m_ptr + row * stride_m, mass_ptr + stats, key_ptr + stats,
                                              idx_ptr + stats, state_f_ptr + row * stride_st,
                                              state_i_ptr + row * stride_st, top_p, chunks, stride_r,
                                              ROUNDS, C_PAD)
    limit = top_p * z
    # Undecided after the rounds: one pass over the row per candidate, in this program.
    logits_row = logits_ptr + row * stride_l
    noise_row = noise_ptr + row * stride_n
    cols = tl.arange(0, BLOCK)
    while searching:
        pivot = tl.load(logits_row + candidate)
        mass = tl.zeros([BLOCK], tl.float32)
        keys = tl.full([BLOCK], float("-inf"), tl.float32)
        ids = tl.zeros([BLOCK], tl.int32) + vocab
        for start in range(0, vocab, BLOCK):
            at = start + cols
            inside = at < vocab
            logit = tl.load(logits_row + at, mask=inside, other=float("-inf"))
            above = logit > pivot
            noise = tl.load(noise_row + at, mask=inside & above, other=1.0)
            mass += tl.where(above, tl.exp(logit - m), 0.0)
            key = tl.where(above, _keys(logit, noise), float("-inf"))
            # Per lane: a later tile's key replaces only a strictly larger one, so ties keep the first id.
            take = key > keys
            ids = tl.where(take, at, ids)
            keys = tl.where(take, key, keys)
        best_key, best = _best(keys, ids, vocab)
        # Each step moves to a more likely token, and the most likely has none above it: the loop
        # ends there even where limit is 0 (a top_p under float32's range, a row of -inf).
        searching = (tl.sum(mass, 0) >= limit) & (best_key > float("-inf"))
        candidate = tl.where(searching, best, candidate)
    tl.store(out_ptr + row, candidate.to(tl.int64))


def top_p_draw(scaled: torch.Tensor, noise: torch.Tensor, top_p: torch.Tensor, rounds: int = ROUNDS) -> torch.Tensor:
    """One token per row (int64 [rows]): argmax(p / noise) over the row's top-p nucleus, p the
    softmax of scaled. scaled: float32 [rows, vocab] logits already divided by their temperature
    (-inf for tokens never to be drawn; every row needs a finite one); noise: float32 Exp(1)
    samples, positive, of the same shape; top_p: float32 [rows] in (0, 1], 1 keeping every token.
    A token is in the nucleus when the mass of the tokens strictly more likely than it is under
    top_p, as sampler.filter_top_k_top_p keeps them (which breaks ties by its sort's order).
    rounds: the parallel rounds before an undecided row continues in one program (tests vary it)."""
    rows, vocab = scaled.shape
    assert scaled.dtype == torch.float32 and noise.dtype == torch.float32 and noise.shape == scaled.shape
    assert scaled.stride(-1) == 1 and noise.stride(-1) == 1 and top_p.shape == (rows,)
    assert vocab + 2 * max(CHUNK, 4096) < 2**31 and rounds >= 0  # token ids and offsets in int32
    out = torch.empty(rows, dtype=torch.int64, device=scaled.device)
    if rows == 0:
        return out
    top_p = top_p.float().contiguous()
    chunks = triton.cdiv(vocab, CHUNK)
    device = scaled.device
    # The chunks' figures per row and slot: slot 0 _chunk_stats' denominators, best keys and
    # tokens; slot r round r's masses above its candidate and best keys and tokens above it.
    m = torch.empty((rows, chunks), dtype=torch.float32, device=device)
    mass = torch.empty((rows, rounds + 1, chunks), dtype=torch.float32, device=device)
    keys = torch.empty_like(mass)
    ids = torch.empty((rows, rounds + 1, chunks), dtype=torch.int32, device=device)
    # The row's state after each round: (m, z) and (candidate, undecided).
    state_f = torch.empty((rows, max(rounds, 1), 2), dtype=torch.float32, device=device)
    state_i = torch.empty((rows, max(rounds, 1), 2), dtype=torch.int32, device=device)
    strides = (scaled.stride(0), noise.stride(0), m.stride(0), mass.stride(0))
    c_pad = triton.next_power_of_2(chunks)
    warps = 4 if scaled.is_cuda else 1
    _chunk_stats_kernel[(rows, chunks)](scaled, noise, m, mass, keys, ids, vocab, *strides, CHUNK=CHUNK,
                                        num_warps=warps)
    for r in range(1, rounds + 1):
        _round_kernel[(rows, chunks)](scaled, noise, top_p, m, mass, keys, ids, state_f, state_i, vocab, chunks,
                                      *strides, mass.stride(1), state_f.stride(0), ROUND=r, CHUNK=CHUNK,
                                      C_PAD=c_pad, num_warps=warps)
    _finish_kernel[(rows,)](scaled, noise, top_p, out, m, mass, keys, ids, state_f, state_i, vocab, chunks,
                            *strides, mass.stride(1), state_f.stride(0), ROUNDS=rounds, C_PAD=c_pad,
                            BLOCK=4096 if scaled.is_cuda else 1024, num_warps=8 if scaled.is_cuda else 1)
    return out
