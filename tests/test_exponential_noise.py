"""kernels.exponential_noise, the sampling graphs' Exp(1) noise, against torch's own exponential_:
the same law (a two-sample Kolmogorov-Smirnov distance), every element written, the same seed the
same noise, and the seed left as it was. On CPU through Triton's interpreter."""
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from kernels import exponential_noise as module  # noqa: E402
from tests.kernel_checks import poison  # noqa: E402,F401 (fixtures)

if type(module._exponential_kernel).__name__ != "InterpretedFunction" and not torch.cuda.is_available():
    module = importlib.reload(module)  # imported before TRITON_INTERPRET was set: decorate it again
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _seed() -> torch.Tensor:
    return torch.randint(0, 2**62, (1,), dtype=torch.int64).to(DEVICE)


def test_noise_follows_the_law_of_torchs_exponential():
    n = 1 << 18
    ours = module.exponential_noise((64, n // 64), _seed()).flatten().cpu().double()
    theirs = torch.empty(n, dtype=torch.float64).exponential_()
    # Two-sample KS distance: the critical value at a one-in-a-million false alarm is
    # sqrt(-ln(5e-7) / 2) * sqrt(2 / n) = 0.0076 for n = 2^18 on each side.
    both = torch.cat([ours, theirs])
    order = both.argsort()
    steps = torch.where(order < n, 1.0 / n, -1.0 / n)[None]
    distance = steps.cumsum(-1).abs().max().item()
    assert distance < 0.0076, distance
    assert abs(ours.mean().item() - 1) < 0.01 and abs(ours.var().item() - 1) < 0.03
    assert ours.min().item() >= module.SMALLEST and torch.isfinite(ours).all()
    # Neighbours (the next token of a row, the next row) uncorrelated.
    grid = ours.view(64, -1)
    for a, b in ((grid[:, :-1], grid[:, 1:]), (grid[:-1], grid[1:])):
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(corr) < 0.015, corr


def test_the_same_seed_gives_the_same_noise_in_every_element(poison):
    seed = _seed()
    before = seed.clone()
    with poison():
        first = module.exponential_noise((3, 1_001), seed)
        again = module.exponential_noise((3, 1_001), seed)
        other = module.exponential_noise((3, 1_001), seed + 1)
    assert not first.isnan().any()  # every element written
    assert torch.equal(first, again) and torch.equal(seed, before)
    assert (first == other).float().mean().item() < 0.01
    assert module.exponential_noise((0, 5), seed).shape == (0, 5)
