"""kernels/fused_moe.py against the torch reference, on CPU through Triton's interpreter: the
router's top-k, the expert sort, and both expert paths (GEMV for a few tokens, grouped GEMM for
more) with bf16-free dtypes (the interpreter's bf16 tl.dot is wrong, see test_fused_gemv), with
experts no token chose, every token on one expert, and FP8 weights with block scales.

Inputs are fresh random numbers each run (the seed is printed on failure); outputs and the
intermediate activations are allocated NaN-filled, so an element left unwritten fails.
"""
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from kernels import fused_moe  # noqa: E402
from tests.kernel_checks import (  # noqa: E402,F401
    assert_close,
    fp8_blocks,
    fp8_dequantized,
    moe_reference,
    poison,
)

if type(fused_moe._route_kernel).__name__ != "InterpretedFunction":
    if torch.cuda.is_available() or os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("the GPU runs tests/gpu/test_moe_fp8_gpu.py", allow_module_level=True)
    importlib.reload(fused_moe)  # imported before TRITON_INTERPRET was set: decorate them again

F32, F16 = torch.float32, torch.float16
# Small tiles so that the tiny shapes still take several tiles along N and K, the last one partial.
GEMV = dict(block_n=32, block_k=32)
GROUPED = dict(block_m=16, block_n=16, block_k=16)


def experts(E, H, inter, dtype):
    w13 = (torch.randn(E, 2 * inter, H) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, inter) / inter ** 0.5).to(dtype)
    return w13, w2


def random_routing(T, E, top_k):
    """Distinct experts per token, weights summing to one, as route() returns them."""
    ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)]).int()
    weights = torch.softmax(torch.randn(T, top_k), -1)
    return weights, ids


def check(T, E, H, inter, top_k, dtype, gemv, poison, ids=None, **launch):
    x = torch.randn(T, H).to(dtype)
    w13, w2 = experts(E, H, inter, dtype)
    weights, random_ids = random_routing(T, E, top_k)
    ids = random_ids if ids is None else ids
    with poison():
        out = fused_moe.fused_moe(x, w13, w2, weights, ids, gemv=gemv, **{**(GEMV if gemv else GROUPED), **launch})
    assert_close(out, moe_reference(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("E, top_k, renormalize", [(8, 2, True), (6, 3, False), (10, 1, True)])
def test_route_takes_the_top_k_of_the_softmax(E, top_k, renormalize, poison):
    logits = torch.randn(5, E)
    with poison():
        weights, ids = fused_moe.route(logits, top_k, renormalize)
    probs = torch.softmax(logits, -1)
    want_weights, want_ids = torch.topk(probs, top_k, -1)
    if renormalize:
        want_weights = want_weights / want_weights.sum(-1, keepdim=True)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights)


def test_route_gives_rows_with_nan_or_infinite_logits_distinct_experts_in_range(poison):
    """A CUDA graph's padding rows carry whatever their buffers held: NaN, infinities. Their
    experts must still index the weights (an id of E crashed the sort with a device-side
    assert); their weights are NaN, and the other rows are routed as ever."""
    E, top_k = 128, 8
    logits = torch.randn(7, E)
    logits[1] = float("nan")
    logits[2, 5] = float("nan")
    logits[3, 7] = float("inf")
    logits[4] = float("-inf")
    logits[5, :3] = float("-inf")  # finite elsewhere: an ordinary row
    logits[6, :20] = float("inf")
    with poison():
        weights, ids = fused_moe.route(logits, top_k, True)
    assert ((ids >= 0) & (ids < E)).all(), ids
    assert all(len(set(row)) == top_k for row in ids.tolist())
    bad = [1, 2, 3, 4, 6]
    assert weights[bad].isnan().all()
    want_weights, want_ids = torch.topk(torch.softmax(logits[[0, 5]], -1), top_k, -1)
    assert torch.equal(ids[[0, 5]].long(), want_ids)
    torch.testing.assert_close(weights[[0, 5]], want_weights / want_weights.sum(-1, keepdim=True))


@pytest.mark.parametrize("T, dtype", [(1, F32), (5, F16)])
def test_gemv_path_matches_the_reference(T, dtype, poison):
    check(T, E=6, H=48, inter=40, top_k=2, dtype=dtype, gemv=True, poison=poison)


@pytest.mark.parametrize("block_k, block_n", [(16, 32), (64, 8), (8, 32)])
def test_gemv_down_with_every_chosen_expert_in_each_step(block_k, block_n, poison):
    """The down kernel that takes every chosen expert in each step: top 3 (a fourth slot of
    padding) at once; K (40) in 3 tiles of 16 unrolled, the last one partial, in one tile of 64, or
    in 5 tiles of 8, two steps of at most 4."""
    check(2, E=7, H=48, inter=40, top_k=3, dtype=F32, gemv=True, poison=poison, block_k=block_k, block_n=block_n,
          all_experts=True)


@pytest.mark.parametrize("T, E, top_k, dtype", [(9, 6, 2, F32), (20, 4, 3, F16)])
def test_grouped_path_matches_the_reference(T, E, top_k, dtype, poison):
    check(T, E=E, H=48, inter=40, top_k=top_k, dtype=dtype, gemv=False, poison=poison)


@pytest.mark.parametrize("gemv", [True, False])
def test_every_token_on_the_same_experts_and_most_experts_idle(gemv, poison):
    """Experts 5 and 2 take every token (all of their rows in a few blocks, the last one partial);
    the other six take none."""
    T = 5 if gemv else 21
    ids = torch.tensor([[5, 2]] * T, dtype=torch.int32)
    check(T, E=8, H=32, inter=24, top_k=2, dtype=F32, gemv=gemv, poison=poison, ids=ids)


def test_one_expert_per_token_all_on_one_expert(poison):
    ids = torch.full((17, 1), 3, dtype=torch.int32)
    check(17, E=4, H=32, inter=24, top_k=1, dtype=F32, gemv=False, poison=poison, ids=ids)


@pytest.mark.parametrize("gemv, block, launch", [
    (True, (32, 16), GEMV), (True, (16, 32), GEMV), (True, (32, 16), {}), (True, (128, 128), {}),
    (False, (16, 32), GROUPED), (False, (32, 16), GROUPED)])
def test_fp8_experts_match_the_dequantized_reference(gemv, block, launch, poison):
    """Block-FP8 experts; 40 and 48 are not multiples of every block side, so edge blocks are
    partial, and gate's and up's rows meet inside a block where block_n is 32. The GEMV path takes
    K steps of whole scale blocks (several, or one where the tile asked for is narrower than a
    block), its programs' rows cut to share their scales, in the tiles asked for and in its own."""
    T, E, H, inter, top_k = (3 if gemv else 19), 5, 48, 40, 2
    x = torch.randn(T, H)
    w13, w2 = experts(E, H, inter, F32)
    (q13, s13), (q2, s2) = fp8_blocks(w13, block), fp8_blocks(w2, block)
    weights, ids = random_routing(T, E, top_k)
    with poison():
        out = fused_moe.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, scale_block=block, gemv=gemv,
                                  **launch)
    want = moe_reference(x, fp8_dequantized(q13, s13, block), fp8_dequantized(q2, s2, block), weights, ids)
    assert_close(out, want, F32)


@pytest.mark.parametrize("gemv, T, E", [(True, 6, 128), (False, 20, 32)])
def test_rows_of_garbage_leave_the_other_rows_alone(gemv, T, E, poison):
    """Rows of which some are NaN or infinite, as a CUDA graph's padding rows can be, routed to 8
    experts through a router and route(): the step runs (the sort's scatter raised on an expert id
    of E), and every finite row is exact. (Fewer experts on the grouped path: the interpreter
    takes ~0.1 s a program.)"""
    H, inter, top_k = 32, 16, 8
    x = torch.randn(T, H)
    x[1] = float("nan")
    x[T - 2, 3] = float("inf")
    router = torch.randn(E, H)
    w13, w2 = experts(E, H, inter, F32)
    weights, ids = fused_moe.route(x @ router.T, top_k, True)
    with poison():
        out = fused_moe.fused_moe(x, w13, w2, weights, ids, gemv=gemv, **(GEMV if gemv else GROUPED))
    good = [t for t in range(T) if t not in (1, T - 2)]
    assert_close(out[good], moe_reference(x[good], w13, w2, weights[good], ids[good]), F32)


def test_align_by_expert_at_128_experts_top_8_and_thousands_of_tokens():
    """The sort at Qwen3-30B-A3B's routing and a prefill's token count, spread and skewed (every
    token on the same 8 experts, as the warmup's identical tokens route): every pair once, each
    block one expert's, nothing indexed past the capacity (CPU indexing raises where the GPU's
    asserts)."""
    T, E, top_k = 4096, 128, 8
    spread = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)]).int()
    skewed = (torch.arange(top_k, dtype=torch.int32) + 60).repeat(T, 1)
    for ids in (spread, skewed):
        pairs = T * top_k
        block_m = fused_moe.grouped_block_m(pairs, E)
        sorted_ids, block_expert, filled = fused_moe.align_by_expert(ids, E, block_m)
        filled = int(filled)
        assert filled <= sorted_ids.shape[0] == fused_moe.sorted_capacity(pairs, E, block_m)
        real = sorted_ids[sorted_ids < pairs].long()
        assert torch.equal(real.sort().values, torch.arange(pairs))
        blocks = sorted_ids[:filled].view(-1, block_m).long()
        experts_of = torch.where(blocks < pairs, ids.flatten().long()[blocks.clamp(max=pairs - 1)], -1)
        owner = block_expert[:filled // block_m].long()
        assert ((experts_of == owner[:, None]) | (experts_of == -1)).all()
        assert ((owner >= 0) & (owner < E)).all() and (block_expert[filled // block_m:] == E).all()


@pytest.mark.parametrize("block_m", [4, 16])
def test_align_by_expert_groups_and_pads_each_experts_pairs(block_m):
    T, E, top_k = 11, 7, 2
    _, ids = random_routing(T, E, top_k)
    ids[:, 0] = 4  # one expert takes every token's first choice
    sorted_ids, block_expert, filled = fused_moe.align_by_expert(ids, E, block_m)
    pairs = T * top_k
    assert sorted_ids.shape[0] == fused_moe.sorted_capacity(pairs, E, block_m)
    filled = int(filled)
    flat = ids.flatten().tolist()
    assert filled % block_m == 0 and sorted(p for p in sorted_ids.tolist() if p < pairs) == list(range(pairs))
    assert all(p == pairs for p in sorted_ids[filled:].tolist())
    for b in range(filled // block_m):
        block = sorted_ids[b * block_m:(b + 1) * block_m].tolist()
        real = [p for p in block if p < pairs]
        assert real, "a filled block with no pair"
        assert all(flat[p] == int(block_expert[b]) for p in real)
        assert real == sorted(real) and block[:len(real)] == real  # padding only at a run's end
    assert (block_expert[filled // block_m:] == E).all()
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    assert filled == int(((counts + block_m - 1) // block_m * block_m).sum())


def test_bad_input_is_named():
    x = torch.randn(3, 16)
    w13, w2 = experts(4, 16, 8, F32)
    weights, ids = random_routing(3, 4, 2)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe.fused_moe(x, w13, w2, weights, ids.long())
    with pytest.raises(ValueError, match=r"w13 \[E, 2I, H\]"):
        fused_moe.fused_moe(x, w13[:, :15], w2, weights, ids)
    with pytest.raises(ValueError, match="needs its block scales"):
        fused_moe.fused_moe(x, w13.to(torch.float8_e4m3fn), w2, weights, ids)
    with pytest.raises(TypeError, match="launch knobs"):
        fused_moe.fused_moe(x, w13, w2, weights, ids, block_q=4)
