"""What the CPU (interpreter) and GPU kernel test modules share: poisoned outputs and the closeness
check (every test's fresh seed is tests/conftest.py's)."""
import random

import pytest
import torch

TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 3e-2)}


@pytest.fixture
def poison(monkeypatch):
    """Within `with poison():`, every float tensor torch.empty/empty_like makes is NaN-filled."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    class Poisoned:
        def __enter__(self):
            monkeypatch.setattr(torch, "empty", lambda *a, **k: nan_fill(empty(*a, **k)))
            monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan_fill(empty_like(*a, **k)))

        def __exit__(self, *exc):
            monkeypatch.setattr(torch, "empty", empty)
            monkeypatch.setattr(torch, "empty_like", empty_like)

    return Poisoned


def assert_close(out, expected, dtype):
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert not out.isnan().any(), "an output element was left unwritten (NaN)"
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


def norm_rope_store_reference(qkv, positions, rope, k_cache, v_cache, slots, heads, kv_heads, q_norm, k_norm):
    """kernels.norm_rope_store's unfused equivalent: the q/k norm modules, the rotary module's
    forward in fp32 rounded once (the kernel's contract), and store_kv. Returns q; stores k/v."""
    from engine.layers import paged_attention_torch as ref
    head_dim = rope.cos.shape[-1]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k = q.reshape(-1, heads, head_dim), k.reshape(-1, kv_heads, head_dim)
    v = v.reshape(-1, kv_heads, head_dim)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    rq, rk = rope(positions, q.float(), k.float())
    ref.store_kv(rk.to(q.dtype), v, k_cache, v_cache, slots)
    return rq.to(q.dtype)


def run_norm_rope_store(kernel, qkv, positions, rope, caches, slots, heads, kv_heads, q_norm, k_norm):
    """Runs the kernel on qkv and layer 1 of caches, and its reference on copies. Returns (q,
    reference q, reference caches); checks that q is the promised view of qkv."""
    expected = caches.clone()
    with torch.no_grad():
        want_q = norm_rope_store_reference(qkv.clone(), positions, rope, expected[0, 1], expected[1, 1], slots,
                                           heads, kv_heads, q_norm, k_norm)
    norms = (q_norm.weight, k_norm.weight) if q_norm is not None else (None, None)
    got_q = kernel(qkv, positions, rope.cos, rope.sin, caches[0, 1], caches[1, 1], slots, heads, kv_heads,
                   *norms, 1e-6)
    head_dim = rope.cos.shape[-1]
    assert got_q.data_ptr() == qkv.data_ptr() and got_q.stride() == (qkv.stride(0), head_dim, 1)
    return got_q, want_q, expected


def capture(step):
    """A CUDA graph of step() and its output, with the kernels compiled first, on a side stream
    as torch asks, so that no compilation lands inside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


class AllReduceRanks:
    """Ranks of kernels/allreduce_rmsnorm.py within one process: each rank's buffer (two slots of
    rows x hidden, NaN-filled) and flags, and the pointer tables every rank shares."""

    def __init__(self, kernels, world: int, rows: int, hidden: int, dtype, device="cpu"):
        self.kernels = kernels  # kernels.allreduce_rmsnorm, interpreted or compiled
        self.world, self.slot_elems = world, rows * hidden
        self.buffers = [torch.full((2 * rows * hidden,), float("nan"), dtype=dtype, device=device)
                        for _ in range(world)]
        self.flags = [torch.zeros(kernels.MAX_PROGRAMS, world, dtype=torch.int32, device=device) for _ in range(world)]
        self.buffer_ptrs = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64, device=device)

    def call(self, rank: int, x, residual, norm, slot: int):
        return self.kernels.all_reduce_rms_norm(x, residual, norm.weight, norm.eps, buffer_ptrs=self.buffer_ptrs,
                                                flag_ptrs=self.flag_ptrs, rank=rank,
                                                slot_offset=slot * self.slot_elems)


def all_reduce_reference(xs, residual, norm):
    """The unfused path: an all-reduce's output (the sum rounded to the dtype), then the norm."""
    total = torch.stack([x.float() for x in xs]).sum(0).to(xs[0].dtype)
    return norm(total, residual)


class DecodeStep:
    """One decode step's inputs for kernels/decode_attention.py's from-qkv kernel, over paged caches
    that hold every sequence's context: qkv rows (a column slice of a wider tensor), positions
    (the last of each context), the slot of that position, and the norms and rotary tables. Rows in
    `padding` get slot -1; every other row's newest slot is NaN, so attending before storing the
    new K/V shows up."""

    def __init__(self, k_cache, v_cache, tables, context_lens, heads, dtype, with_norm, padding=(), max_pos=1024):
        from engine.layers.norm import RMSNorm
        from engine.layers.rotary import RotaryEmbedding
        device = k_cache.device
        _, block_size, kv_heads, head_dim = k_cache.shape
        self.k_cache, self.v_cache, self.tables, self.context_lens = k_cache, v_cache, tables, context_lens
        self.heads, self.kv_heads, self.dtype = heads, kv_heads, dtype
        last = context_lens.long() - 1
        self.positions = last.clone()
        self.slots = tables.long().gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size
        for i in range(len(context_lens)):
            if i in padding:
                self.slots[i] = -1
            else:
                k_cache.view(-1, kv_heads, head_dim)[self.slots[i]] = float("nan")
                v_cache.view(-1, kv_heads, head_dim)[self.slots[i]] = float("nan")
        width = (heads + 2 * kv_heads) * head_dim
        wide = torch.randn(len(context_lens), width + 2 * head_dim, device=device).to(dtype)
        self.qkv = wide[:, head_dim:head_dim + width]
        self.rope = RotaryEmbedding(head_dim, max_pos, 1e6).to(device)
        self.q_norm = self.k_norm = None
        if with_norm:
            self.q_norm, self.k_norm = (RMSNorm(head_dim, 1e-6).to(device) for _ in range(2))
            for n in (self.q_norm, self.k_norm):
                n.weight.data = (1 + 0.1 * torch.randn(head_dim, device=device)).to(dtype)
        self.scale = head_dim ** -0.5

    def run(self, kernels, **kw):
        """The kernel's output (kernels: the decode_attention module); stores into the caches."""
        weights = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        return kernels.paged_decode_attention_from_qkv(
            self.qkv, self.positions, self.rope.cos, self.rope.sin, *weights, 1e-6, self.k_cache, self.v_cache,
            self.slots, self.tables, self.context_lens, self.scale, **kw)

    def reference(self):
        """(output, k cache, v cache) of norm_rope_store's unfused reference and the reference
        attention, on copies of the caches."""
        from engine.layers import paged_attention_torch as ref
        k, v = self.k_cache.clone(), self.v_cache.clone()
        with torch.no_grad():
            q = norm_rope_store_reference(self.qkv.clone(), self.positions, self.rope, k, v, self.slots, self.heads,
                                          self.kv_heads, self.q_norm, self.k_norm)
        return ref.paged_decode_attention(q, k, v, self.tables, self.context_lens, self.scale), k, v

    def check(self, out, want):
        """out against reference()'s (output, k cache, v cache)."""
        want_out, want_k, want_v = want
        assert_close(out, want_out, self.dtype)
        rtol, atol = TOL[self.dtype]
        torch.testing.assert_close(self.k_cache, want_k, rtol=rtol, atol=atol, equal_nan=True)
        torch.testing.assert_close(self.v_cache, want_v, rtol=0, atol=0, equal_nan=True)


def round_toward_zero(t, dtype):
    """t rounded to dtype as Triton's interpreter rounds fp32 to bf16: toward zero (it drops the low
    16 bits). Other dtypes round to nearest there, as torch does."""
    if dtype != torch.bfloat16:
        return t.to(dtype)
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact: low bits are 0


def norm_gemv_reference(x, residual, norm_weight, weight, silu, eps, rounding=None):
    """What kernels.gemv.rms_norm_gemv must equal: the RMSNorm module's arithmetic (kernels.rmsnorm's
    contract, itself checked against torch in test_kernels), the product rounded to x's dtype, then
    SiLU-mul in fp32 rounded once. Returns (y, new residual). rounding(fp32 tensor, dtype) rounds at
    each of those steps: torch's round-to-nearest unless given (round_toward_zero for the interpreter)."""
    to = rounding or (lambda t, dtype: t.to(dtype))
    h = x if residual is None else to(x.float() + residual.float(), x.dtype)
    hf = h.float()
    normed = to(hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps), h.dtype)
    normed = to(norm_weight.float() * normed.float(), h.dtype)
    y = to(normed.float() @ weight.float().T, x.dtype)
    if silu:
        gate, up = y.float().chunk(2, -1)
        y = to(torch.nn.functional.silu(gate) * up, x.dtype)
    return y, h


# --- block-FP8 weights and mixture-of-experts: references written apart from engine/layers/fp8.py ---

def fp8_blocks(weight, block):
    """weight [..., N, K] -> (e4m3 values, float32 scales [..., ceil(N/bn), ceil(K/bk)]) as Qwen's
    FP8 checkpoints hold them: each block's largest magnitude at 448."""
    *lead, n, k = weight.shape
    grid = (-(-n // block[0]), -(-k // block[1]))
    rows = torch.arange(n, device=weight.device) // block[0]
    cols = torch.arange(k, device=weight.device) // block[1]
    block_of = (rows[:, None] * grid[1] + cols[None, :]).expand(*weight.shape).reshape(*lead, n * k)
    amax = torch.zeros(*lead, grid[0] * grid[1], device=weight.device).scatter_reduce_(
        -1, block_of, weight.abs().float().reshape(*lead, n * k), "amax")
    scales = (amax / 448).clamp(min=1e-12).view(*lead, *grid)
    q = (weight.float() / fp8_scales_per_weight(scales, n, k, block)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scales


def fp8_scales_per_weight(scales, n, k, block):
    """Each weight's scale: the scale of the block its row and column fall in."""
    rows, cols = torch.arange(n, device=scales.device) // block[0], torch.arange(k, device=scales.device) // block[1]
    return scales[..., rows, :][..., cols]


def fp8_dequantized(q, scales, block):
    return q.float() * fp8_scales_per_weight(scales.float(), *q.shape[-2:], block)


def quantized_rows_reference(x, group):
    """Activations quantized per row and `group` columns: (e4m3 values, float32 scales)."""
    m, k = x.shape
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scales = xf.abs().amax(-1).clamp(min=1e-10) / 448
    q = (xf / scales[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, -1)[:, :k]
    return q, scales


def moe_reference(x, w13, w2, topk_weights, topk_ids):
    """Token by token, each chosen expert's SwiGLU MLP in fp32, rounded to x's dtype where the
    fused kernels round (gate and up, silu(gate) * up; the grouped path also rounds each expert's
    down projection, the GEMV path not: one rounding of difference), weighted and summed in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    to = lambda t: t.to(x.dtype).float()  # noqa: E731
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = x[t].float() @ w13[e].float().T
            gate, up = to(gate_up[:inter]), to(gate_up[inter:])
            h = to(torch.nn.functional.silu(gate) * up)
            out[t] += to(h @ w2[e].float().T) * topk_weights[t, j].float()
    return out.to(x.dtype)


def adjust_logits_inputs(dtype, device, rows=9, vocab=None, slots=5, mask_rows=4):
    """kernels.adjust_logits' arguments, random, with every case the decode graphs stage: neutral
    rows (slot 0, mask row 0; rows 0 and 2 have no mask), penalties, logit_bias (slot 1 names a
    token twice), token masks, bans on the odd rows, and on row 3 bans that would leave it no
    token; logits are a column slice of a wider tensor."""
    from engine.runner.decode_graphs import BAN_WIDTH, BIAS_WIDTH
    vocab = vocab or random.randrange(1500, 2600)
    words = -(-vocab // 32)
    wide = torch.randn(rows, vocab + 37, dtype=torch.float32) * 4
    logits = wide[:, 5:5 + vocab].to(dtype)
    counts = torch.randint(0, 3, (slots, vocab), dtype=torch.int32) * (torch.rand(slots, vocab) < 0.05)
    prompt_seen = torch.rand(slots, vocab) < 0.05
    bias_ids = torch.zeros(slots, BIAS_WIDTH, dtype=torch.int64)
    bias_values = torch.zeros(slots, BIAS_WIDTH)
    counts[0], prompt_seen[0] = 0, False  # slot 0: the rows without penalties or bias
    for s in range(1, slots):
        n = random.randrange(0, 6)
        bias_ids[s, :n] = torch.randint(0, vocab, (n,))
        bias_values[s, :n] = torch.randn(n) * 5
    bias_ids[1, 6], bias_values[1, 6] = bias_ids[1, 0], 2.5  # one token named twice: the two add up
    masks = torch.randint(-2**31, 2**31 - 1, (mask_rows, words), dtype=torch.int32)
    masks[0] = -1  # row 0 allows every token
    slot = torch.tensor([random.randrange(slots) for _ in range(rows)])
    slot[:3] = torch.tensor([0, 1, 2])
    mask_row = torch.tensor([random.randrange(mask_rows) for _ in range(rows)])
    mask_row[0] = 0
    repetition = torch.where(torch.rand(rows) < 0.3, 1.0, 1 + torch.rand(rows))
    frequency = torch.where(torch.rand(rows) < 0.3, 0.0, torch.rand(rows))
    presence = torch.where(torch.rand(rows) < 0.3, 0.0, torch.rand(rows) - 0.5)
    banned = torch.zeros(rows, BAN_WIDTH, dtype=torch.int64)
    ban = torch.zeros(rows, dtype=torch.bool)
    for r in range(1, rows, 2):  # bans as staged: a row's ids, its first repeated to the width
        ids = random.sample(range(vocab), random.randrange(1, BAN_WIDTH + 1))
        banned[r] = torch.tensor(ids + [ids[0]] * (BAN_WIDTH - len(ids)))
        ban[r] = True
    # Row 3's mask allows only its banned tokens: the bans would leave it nothing, so they do not apply.
    mask_row[3] = mask_rows - 1
    masks[mask_rows - 1] = 0
    for t in banned[3].tolist():
        masks[mask_rows - 1, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    args = (logits, slot, mask_row, masks, counts, prompt_seen, repetition, frequency, presence, bias_ids,
            bias_values, banned, ban)
    return tuple(a.to(device) for a in args)


# Float32 sums differ from float64's by far less than this share of a row's mass.
MASS_SLACK = 1e-4


def top_p_reference(scaled: torch.Tensor, noise: torch.Tensor, top_p: torch.Tensor):
    """(tokens, mass of the tokens strictly more likely than each token) in float64: the token is
    argmax(p / noise) over the tokens whose mass above is under top_p (all of them at top_p 1)."""
    p = scaled.double().softmax(-1)
    order = p.sort(-1, descending=True)
    ranked = order.values
    # The mass strictly above each rank: the cumsum before the first rank of its value.
    before = ranked.cumsum(-1) - ranked
    first_of_value = torch.searchsorted(-ranked, -ranked, side="left")
    above_ranked = before.gather(-1, first_of_value)
    above = torch.empty_like(p).scatter_(-1, order.indices, above_ranked)
    kept = (above < top_p.double()[:, None]) | (top_p[:, None] >= 1)
    keys = torch.where(kept, p / noise.double(), -1.0)
    return keys.argmax(-1), above, keys


def check_top_p_draw(top_p_draw, scaled, noise, top_p, device):
    """top_p_draw's tokens for these CPU tensors (run on device) against top_p_reference's; returns them."""
    got = top_p_draw(scaled.to(device), noise.to(device), top_p.to(device)).cpu()
    want, above, keys = top_p_reference(scaled, noise, top_p)
    assert got.dtype == torch.int64 and got.shape == want.shape
    for row in range(scaled.shape[0]):
        g, w = got[row].item(), want[row].item()
        if g == w:
            continue
        # Only where float32 could see it otherwise: the two tokens' keys all but tied, or either
        # one's mass above within rounding of top_p.
        tied = abs(keys[row, g] - keys[row, w]) <= 1e-5 * keys[row, w]
        on_edge = any(abs(above[row, t] - top_p[row]) < MASS_SLACK for t in (g, w))
        assert tied or on_edge, f"row {row}: drew {g}, the nucleus draw is {w} (top_p {top_p[row].item()})"
    return got


def check_temperature_draw(temperature_draw, exponential_noise, logits, temps, device):
    """temperature_draw's tokens for these CPU tensors (run on device) against the torch draw over
    exponential_noise's tensor from the same seed: argmax(softmax(logits / temps) / E). A token may
    differ only where float32 could order the two tokens' keys either way."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(device)
    got = temperature_draw(logits.to(device), temps.to(device), seed).cpu()
    noise = exponential_noise(tuple(logits.shape), seed).cpu().double()
    keys = (logits.double() / temps.double()[:, None]).log_softmax(-1).exp() / noise
    want = keys.argmax(-1)
    assert got.dtype == torch.int64 and got.shape == want.shape
    for row in range(logits.shape[0]):
        g, w = got[row].item(), want[row].item()
        if g != w:
            assert abs(keys[row, g] - keys[row, w]) <= 1e-5 * keys[row, w], f"row {row}: drew {g}, the draw is {w}"
    return got


def check_fed_tokens(fed_tokens, rows: int, buffer_rows: int, device: str) -> None:
    """fed_tokens against torch.where over index_select, some rows fed from random rows of a token
    buffer of buffer_rows, the rest staged, into an output of -1s."""
    sampled = torch.randint(0, 150_000, (buffer_rows,), device=device)
    staged = torch.randint(0, 150_000, (rows,), device=device)
    feed_from = torch.where(torch.rand(rows, device=device) < 0.5,
                            torch.randint(0, buffer_rows, (rows,), device=device), -1)
    want = torch.where(feed_from >= 0, sampled.index_select(0, feed_from.clamp(min=0)), staged)
    out = torch.full((rows,), -1, dtype=torch.int64, device=device)
    assert fed_tokens(feed_from, sampled, staged, out) is out
    assert torch.equal(out, want)
