"""kernels.exponential_noise compiled for the GPU, on 2^24 draws: the Exp(1) law against its own
CDF (one-sample Kolmogorov-Smirnov), the small values that decide rare tokens (counts below 1e-4
and 1e-6 against binomial bounds), and the streams of two consecutive seeds uncorrelated element by
element. Skipped without a CUDA device."""
import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

N = 1 << 24


def _draw(seed: int) -> torch.Tensor:
    from kernels.exponential_noise import exponential_noise
    return exponential_noise((64, N // 64), torch.tensor([seed], dtype=torch.int64, device="cuda")).flatten().double()


def test_compiled_noise_follows_exp1_down_to_its_smallest_values():
    seed = torch.randint(0, 2**62, (1,)).item()
    print(f"noise seed {seed}")
    e = _draw(seed)
    assert torch.isfinite(e).all() and e.min().item() > 0
    cdf = 1 - torch.exp(-e.sort().values)
    grid = torch.arange(1, N + 1, device="cuda", dtype=torch.float64) / N
    distance = torch.maximum((grid - cdf).abs(), (grid - 1 / N - cdf).abs()).max().item()
    # The one-sample critical value at a one-in-a-million false alarm: sqrt(-ln(5e-7) / 2) / sqrt(N).
    assert distance < 2.76 / math.sqrt(N), distance
    for below in (1e-4, 1e-6):
        expected = N * (1 - math.exp(-below))
        count = (e < below).sum().item()
        assert abs(count - expected) < 6 * math.sqrt(expected) + 1, (below, count, expected)


def test_consecutive_seeds_give_uncorrelated_streams():
    seed = torch.randint(0, 2**62, (1,)).item()
    a, b = _draw(seed), _draw(seed + 1)
    for lag in (0, 1, 64):
        corr = torch.corrcoef(torch.stack([a[lag:], b[:N - lag]]))[0, 1].item()
        assert abs(corr) < 6 / math.sqrt(N), (lag, corr)
