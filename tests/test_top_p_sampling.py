"""kernels.top_p_sampling, the top-p draw without a sort, against a float64 reference of what the
sampler's sort keeps and draws: fresh random rows of several shapes of distribution, tokens that
may never be drawn (-inf), rows spanning several tiles, top_p of 1. On CPU through Triton's
interpreter; tests/gpu runs the same checks compiled."""
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from engine.runner.sampler import _draw_from  # noqa: E402
from kernels import top_p_sampling as module  # noqa: E402
from tests.kernel_checks import check_top_p_draw, poison  # noqa: E402,F401 (fixtures)

if type(module._finish_kernel).__name__ != "InterpretedFunction" and not torch.cuda.is_available():
    module = importlib.reload(module)  # imported before TRITON_INTERPRET was set: decorate it again
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("vocab", [7, 1000, 9000])
@pytest.mark.parametrize("rounds", [0, 1, 2, module.ROUNDS])
def test_the_draw_is_the_sorts_nucleus_draw_for_the_same_noise(vocab, rounds, poison):
    """With any number of parallel rounds: rows that none decides continue in one program. The
    workspaces start as NaN, so a figure read from a slot no round wrote shows."""
    rows = 12
    # From near-uniform rows (a nucleus of most of the vocabulary) to peaked ones (a few tokens).
    spread = torch.tensor([0.1, 0.5, 1, 2, 3, 4, 6, 8, 10, 12, 16, 20])[:, None]
    scaled = torch.randn(rows, vocab) * spread
    noise = torch.empty(rows, vocab).exponential_()
    top_p = torch.rand(rows) * 0.98 + 0.01
    with poison():
        check_top_p_draw(lambda *a: module.top_p_draw(*a, rounds=rounds), scaled, noise, top_p, DEVICE)


def test_chunks_of_tokens_that_may_not_be_drawn_are_passed_over():
    rows, vocab = 4, 3 * module.CHUNK + 5
    scaled = torch.randn(rows, vocab) * 3
    scaled[:, : 2 * module.CHUNK] = float("-inf")  # whole chunks ruled out, as a grammar's mask can
    scaled[1, 2 * module.CHUNK + 7:] = float("-inf")  # one row left with seven tokens
    noise = torch.empty(rows, vocab).exponential_()
    got = check_top_p_draw(module.top_p_draw, scaled, noise, torch.tensor([0.9, 0.5, 1.0, 0.3]), DEVICE)
    assert torch.isfinite(scaled.gather(1, got[:, None])).all()


def test_tokens_that_may_not_be_drawn_never_are_and_top_p_one_keeps_every_other():
    rows, vocab = 8, 600
    scaled = torch.randn(rows, vocab) * 2
    banned = torch.rand(rows, vocab) < 0.7
    banned[:, 0] = False  # every row keeps a token it may draw
    scaled = scaled.masked_fill(banned, float("-inf"))
    noise = torch.empty(rows, vocab).exponential_()
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 0.99, 0.2, 1.0, 0.75])
    got = check_top_p_draw(module.top_p_draw, scaled, noise, top_p, DEVICE)
    assert not banned.gather(1, got[:, None]).any()
    # top_p 1 is the plain draw over all tokens.
    plain = (scaled.softmax(-1) / noise).argmax(-1)
    assert torch.equal(got[top_p >= 1], plain[top_p >= 1])


def test_a_token_holding_more_than_top_p_is_drawn_whatever_the_noise():
    rows, vocab = 16, 300
    scaled = torch.randn(rows, vocab)
    favourite = torch.randint(0, vocab, (rows,))
    scaled[torch.arange(rows), favourite] = 12.0  # ~97% of each row's mass
    noise = torch.empty(rows, vocab).exponential_()
    got = check_top_p_draw(module.top_p_draw, scaled, noise, torch.full((rows,), 0.9), DEVICE)
    assert torch.equal(got, favourite)


def test_a_top_p_that_float32_rounds_to_zero_keeps_the_most_likely_token():
    """SamplingParams takes any top_p above 0; 1e-50 is 0 in float32, where the sort still keeps
    the first token. So must the kernel (and end), as for a row with no token it may draw."""
    rows, vocab = 3, 500
    scaled = torch.randn(rows, vocab) * 2
    scaled[2] = float("-inf")
    noise = torch.empty(rows, vocab).exponential_()
    top_p = torch.tensor([1e-50, 1e-50, 0.5], dtype=torch.float64).float()
    assert top_p[0].item() == 0.0
    got = module.top_p_draw(scaled.to(DEVICE), noise.to(DEVICE), top_p.to(DEVICE)).cpu()
    assert got[:2].tolist() == scaled[:2].argmax(-1).tolist()
    assert 0 <= got[2].item() < vocab


def test_the_samplers_top_p_filter_is_the_kernel_with_greedy_rows_beside_it():
    """_draw_from with filters (None, top_p) draws each sampled row with the kernel and the same
    noise, and gives greedy rows their argmax."""
    rows, vocab = 6, 500
    scaled = (torch.randn(rows, vocab) * 3).to(DEVICE)
    noise = torch.empty(rows, vocab).exponential_().to(DEVICE)
    top_p = torch.tensor([0.3, 0.6, 0.8, 0.9, 0.95, 1.0], device=DEVICE)
    greedy = torch.tensor([False, True, False, False, False, True], device=DEVICE)
    greedy_tokens = scaled.argmax(-1)
    got = _draw_from(scaled, greedy_tokens, greedy, (None, top_p[:, None]), (), None, lambda shape: noise.clone())
    want = torch.where(greedy, greedy_tokens, module.top_p_draw(scaled, noise, top_p))
    assert torch.equal(got, want)
