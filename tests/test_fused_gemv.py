"""kernels.gemv's fusions against the torch reference, on CPU through Triton's interpreter: the
pre-norm RMSNorm (with and without the residual add) in the GEMV's prologue, SiLU-mul in its
epilogue, in each of the three GEMV kernels, for 1-8 rows.

The reference is the unfused chain: the RMSNorm module's arithmetic, x @ W.T rounded to x's dtype,
then silu(gate) * up in fp32 rounded once. Inputs are fresh random numbers each run (the seed is
printed on failure); outputs are allocated NaN-filled, so an element left unwritten fails. Shapes
are tiny (the interpreter runs each program in numpy), with N and K off the blocks' multiples.
"""
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from kernels import gemv, rmsnorm  # noqa: E402
from tests.kernel_checks import (  # noqa: E402,F401
    assert_close,
    norm_gemv_reference,
    poison,
    round_toward_zero,
)

if type(gemv._gemv_kernel).__name__ != "InterpretedFunction":
    if torch.cuda.is_available() or os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("the GPU runs tests/gpu/test_fused_gemv_gpu.py", allow_module_level=True)
    # Imported before TRITON_INTERPRET was set, by an earlier test module: decorate them again.
    importlib.reload(gemv)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
EPS = 1e-6


def inputs(M, N, K, dtype, with_residual):
    x = torch.randn(M, K).to(dtype)
    residual = torch.randn(M, K).to(dtype) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(K)).to(dtype)
    weight = (torch.randn(N, K) / K ** 0.5).to(dtype)
    return x, residual, norm_weight, weight


def check(launch, M, N, K, dtype, with_residual, silu, poison):
    x, residual, norm_weight, weight = inputs(M, N, K, dtype, with_residual)
    # Rounded where the kernel rounds, and as the interpreter rounds (bf16: toward zero). With torch's
    # round-to-nearest, bf16 SiLU-mul drifted by up to five roundings' bias, a few percent: once in
    # 20 draws past the 3e-2 tolerance.
    want_y, want_h = norm_gemv_reference(x, residual, norm_weight, weight, silu, EPS, rounding=round_toward_zero)
    with poison():
        y, h = gemv.rms_norm_gemv(x, residual, norm_weight, EPS, weight, silu=silu, **launch)
    assert_close(y, want_y, dtype)
    if with_residual:
        assert torch.equal(h, want_h)  # one fp32 add, rounded as the interpreter rounds
    else:
        assert h is x


# Launches: (kernel, block_n, block_k) forced, or the default launch_config; block_k 32 splits K=100
# into four tiles (the last one partial), 64 covers K=48 in one.
ONE = [dict(kernel="one", block_n=1, block_k=64), dict(kernel="one", block_n=4, block_k=32), {}]
FMA = [dict(kernel="fma", block_n=1, block_k=64, num_warps=2), dict(kernel="fma", block_n=4, block_k=32, num_warps=2)]
DOT = [dict(kernel="dot", block_n=16, block_k=32, num_warps=2)]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("silu", [False, True])
def test_one_row(dtype, with_residual, silu, poison):
    for launch, (N, K) in zip(ONE, [(38, 100), (74, 48), (40, 100)]):
        check(launch, 1, N, K, dtype, with_residual, silu, poison)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("M", [2, 3, 8])
@pytest.mark.parametrize("silu", [False, True])
def test_rows_fma(dtype, M, silu, poison):
    for launch, (N, K), with_residual in zip(FMA, [(38, 100), (74, 48)], [True, M == 3]):
        check(launch, M, N, K, dtype, with_residual, silu, poison)


# Triton 3.9's interpreter gets bf16 tl.dot wrong (test_kernels.test_gemv_rows): the tensor-core
# kernel runs here in fp32 and fp16, and in bf16 in tests/gpu/test_fused_gemv_gpu.py.
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("M", [2, 5, 8])
@pytest.mark.parametrize("silu", [False, True])
def test_rows_dot(dtype, M, silu, poison):
    check(DOT[0], M, 70, 100, dtype, M != 5, silu, poison)


@pytest.mark.parametrize("M", [1, 4, 8])
def test_default_launch(M, poison):
    """Each row count through launch_config's choice, the merged gate_up shape with SiLU-mul."""
    check({}, M, 2 * 40, 64, F32, True, True, poison)
    check({}, M, 48, 64, F32, True, False, poison)


def test_plain_gemv_with_silu(poison):
    x, _, _, weight = inputs(3, 64, 48, F32, False)
    gate, up = (x @ weight.T).chunk(2, -1)
    with poison():
        out = gemv.gemv(x, weight, silu=True)
    assert_close(out, torch.nn.functional.silu(gate) * up, F32)


def test_bad_input_is_named():
    x, residual, norm_weight, weight = inputs(2, 7, 16, F32, True)
    with pytest.raises(ValueError, match="even number of rows"):
        gemv.rms_norm_gemv(x, residual, norm_weight, EPS, weight, silu=True)
    with pytest.raises(ValueError, match="norm weight"):
        gemv.rms_norm_gemv(x, residual, norm_weight.to(BF16), EPS, weight)
    with pytest.raises(ValueError, match="residual like x"):
        gemv.rms_norm_gemv(x, residual[:1], norm_weight, EPS, weight)
    with pytest.raises(TypeError, match="launch knobs"):
        gemv.gemv(x, weight, block_m=4)


def test_unfused_kernels_agree_with_fused(poison):
    """The engine's two paths for one row: kernels.rmsnorm then the GEMV, and the fused kernel."""
    x, residual, norm_weight, weight = inputs(1, 40, 64, BF16, True)
    normed, h = rmsnorm.rms_norm(x, weight=norm_weight, eps=EPS, residual=residual)
    with poison():
        y, fused_h = gemv.rms_norm_gemv(x, residual, norm_weight, EPS, weight)
    assert_close(fused_h, h, BF16)
    assert_close(y, gemv.gemv(normed, weight), BF16)
