"""kernels.skinny_linear against the unfused torch layers it replaces (RMSNorm with the residual
add, F.linear, SiLU-mul), on CPU through Triton's interpreter, or on CUDA when present."""
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from engine.layers.norm import RMSNorm  # noqa: E402
from kernels import skinny_linear as skinny  # noqa: E402
from tests.kernel_checks import assert_close, poison, seed  # noqa: E402,F401 (fixtures)

if type(skinny._skinny_linear_kernel).__name__ != "InterpretedFunction" and not torch.cuda.is_available():
    importlib.reload(skinny)  # decorated before TRITON_INTERPRET was set, by an earlier module
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, F32 = torch.bfloat16, torch.float32

# Both inner products: tl.dot tiles, and the broadcast-sum used for one or two rows on GPU.
DOT = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, USE_DOT=True, num_warps=1, num_stages=1)
SUM = dict(BLOCK_M=2, BLOCK_N=8, BLOCK_K=64, USE_DOT=False, num_warps=1, num_stages=1)


def reference(x, weight, bias, norm_weight, eps, residual, gated):
    if norm_weight is not None:
        norm = RMSNorm(x.shape[1], eps).to(x.device)
        norm.weight.data = norm_weight
        x, new_residual = norm(x, residual) if residual is not None else (norm(x), None)
    y = F.linear(x, weight, bias)
    if gated:
        gate, up = y.chunk(2, -1)
        y = (F.silu(gate.float()) * up.float()).to(y.dtype)
    return y if residual is None else (y, new_residual)


@pytest.mark.parametrize("config", [DOT, SUM, None], ids=["dot", "sum", "default"])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("rows, in_features, out_features, mode", [
    (1, 96, 40, "plain"), (3, 64, 48, "bias"), (2, 96, 24, "norm"), (5, 80, 32, "norm+residual"),
    (1, 64, 24, "norm+gated"), (17, 96, 20, "norm+residual+gated"), (4, 200, 16, "plain")])
def test_matches_torch_layers(rows, in_features, out_features, mode, dtype, config, poison):
    x = torch.randn(rows, in_features, device=DEVICE).to(dtype)
    gated = "gated" in mode
    weight = (torch.randn(out_features * (2 if gated else 1), in_features, device=DEVICE) / in_features ** 0.5).to(dtype)
    bias = torch.randn(out_features, device=DEVICE).to(dtype) if mode == "bias" else None
    norm_weight = (1 + 0.1 * torch.randn(in_features, device=DEVICE)).to(dtype) if "norm" in mode else None
    residual = torch.randn(rows, in_features, device=DEVICE).to(dtype) if "residual" in mode else None
    with poison():
        got = skinny.skinny_linear(x, weight, bias, norm_weight=norm_weight, eps=1e-6, residual=residual,
                                   gated=gated, config=config)
    want = reference(x, weight, bias, norm_weight, 1e-6, residual, gated)
    if residual is not None:
        assert_close(got[1], want[1], dtype)
        got, want = got[0], want[0]
    assert_close(got, want, dtype)


def test_strided_rows_and_no_rows(poison):
    """Rows of x may be spaced wider than their length (a slice of a bigger buffer)."""
    big = torch.randn(3, 160, device=DEVICE)
    x = big[:, :96]
    weight = torch.randn(24, 96, device=DEVICE)
    with poison():
        got = skinny.skinny_linear(x, weight, config=DOT)
    assert_close(got, F.linear(x, weight), F32)
    empty = skinny.skinny_linear(x[:0], weight)
    assert empty.shape == (0, 24)
