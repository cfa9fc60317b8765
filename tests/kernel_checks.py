"""What the CPU (interpreter) and GPU kernel test modules share: fresh seeds, poisoned outputs,
and the closeness check."""
import random

import pytest
import torch

TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 3e-2)}


@pytest.fixture(autouse=True)
def seed():
    """Fresh random inputs on every run; the seed is printed, so pytest shows it on a failure."""
    value = random.SystemRandom().randrange(2**31)
    random.seed(value)
    torch.manual_seed(value)
    print(f"torch seed {value}")
    return value


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
