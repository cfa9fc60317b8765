"""The FP8 products' activations handed over already quantized (engine/layers/fp8.py QuantizedRows):
a pre-norm sublayer's first projection and the MLP's down projection, through _Linear.norm_forward,
with the quantizing RMSNorm and SiLU-mul kernels against the same layers with the hand-over off, on
CPU through Triton's interpreter (where both sum in one order, so the results are equal bit for
bit). cuBLAS's block-scaled FP8 product does not run on CPU: its stand-in dequantizes both operands
and multiplies in float32, after checking the layout cuBLAS requires (rows a multiple of 4, the
activations' scales laid out by column). The same stand-in checks how a product cut into pieces
of K (fp8._product_in_k_pieces) hands each piece its columns and scales."""
import contextlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from engine.layers import fp8  # noqa: E402
from engine.layers.activation import SiluAndMul  # noqa: E402
from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear, _Linear  # noqa: E402
from engine.layers.norm import RMSNorm  # noqa: E402
from tests.kernel_checks import round_toward_zero  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("the GPU runs cuBLAS itself: tests/gpu/test_moe_fp8_gpu.py", allow_module_level=True)

BF16 = torch.bfloat16
HIDDEN, INTER = 512, 1024


def _block_scaled_product(q, weight_t, x_scales, x_scaling, weight_scales_t, w_scaling, output_dtype):
    rows, k = q.shape
    assert rows % 4 == 0 and x_scales.shape == (rows, k // 128) and x_scales.stride() == (1, rows)
    x = q.float() * x_scales.repeat_interleave(128, 1)
    w = fp8.dequantize_blocks(weight_t.t(), weight_scales_t.t(), (128, 128))
    return (x @ w.t()).to(output_dtype)


@pytest.fixture
def cpu_cublas(monkeypatch):
    """block_scaled_mm's path on CPU: the stand-in product, and cublas_takes without its device check."""
    monkeypatch.setattr(F, "scaled_mm", _block_scaled_product)
    monkeypatch.setattr(fp8, "cublas_takes", lambda x, weight, scale, block: (
        x.dtype == BF16 and tuple(block) == (128, 128) and weight.shape[1] % 512 == 0 and weight.shape[0] % 16 == 0))


def _sublayers():
    """An MLP's gate/up and down projections in FP8, its pre-norm, and SiLU-mul, as the Triton
    backend sets them up (fused kernels)."""
    gate_up, down = MergedColumnParallelLinear(HIDDEN, [INTER, INTER]), RowParallelLinear(INTER, HIDDEN)
    for layer in (gate_up, down):
        layer.weight = torch.nn.Parameter((torch.randn(layer.weight.shape) / layer.weight.shape[1] ** 0.5).to(BF16),
                                          requires_grad=False)
        layer.quantize("fp8")
    norm = RMSNorm(HIDDEN)
    norm.weight.data = (1 + 0.1 * torch.randn(HIDDEN)).to(BF16)
    act = SiluAndMul()
    norm.fused = act.fused = True
    return gate_up, down, norm, act


@pytest.mark.parametrize("rows, with_residual", [(2, False), (5, True), (8, True)])
def test_the_handed_over_rows_give_the_products_of_the_unfused_path(cpu_cublas, monkeypatch, rows, with_residual):
    """The sublayer's output and its new residual, with the hand-over and without; rows that are
    not a multiple of 4 make the kernels write padding rows."""
    gate_up, down, norm, act = _sublayers()
    x = (2 * torch.randn(rows, HIDDEN)).to(BF16)
    residual = torch.randn(rows, HIDDEN).to(BF16) if with_residual else None
    hidden, new_residual = gate_up.norm_forward(norm, x, residual, act, consumer=down)
    assert isinstance(hidden, fp8.QuantizedRows) and hidden.rows == rows
    out = down(hidden)
    monkeypatch.setattr(_Linear, "takes_quantized_rows", lambda self, x: False)
    plain_hidden, plain_residual = gate_up.norm_forward(norm, x, residual, act, consumer=down)
    assert isinstance(plain_hidden, torch.Tensor)
    assert out.shape == (rows, HIDDEN) and torch.equal(out, down(plain_hidden))
    assert torch.equal(new_residual, plain_residual)
    if residual is None:
        assert new_residual is x
    else:  # x + residual, rounded to bf16 as the interpreter rounds
        assert torch.equal(new_residual, round_toward_zero(x.float() + residual.float(), BF16))


def test_one_row_and_summing_norms_keep_the_plain_path(cpu_cublas):
    """One row runs the FP8 GEMV, which takes bf16 rows; a norm that sums the ranks' partial outputs
    (tensor parallelism) must see them unquantized."""
    gate_up, down, norm, act = _sublayers()
    x = torch.randn(4, HIDDEN).to(BF16)
    assert gate_up.takes_quantized_rows(x) and norm.quantizes(x, x)
    assert not gate_up.takes_quantized_rows(x[:1])
    norm.reduce_slot = 0
    assert not norm.quantizes(x, x)


class _Stream:
    """Stands in for a CUDA stream on CPU, where everything runs in order."""

    def wait_stream(self, other):
        pass


@pytest.mark.parametrize("rows, n, k, pieces", [(5, 256, 2048, 2), (8, 200, 3072, 3), (3, 128, 4096, 4)])
def test_a_product_in_pieces_of_k_is_the_whole_product(monkeypatch, rows, n, k, pieces):
    """fp8._product_in_k_pieces on CPU: each piece takes its own columns of the activations, their
    scales' groups and W's piece of scales (the stand-in checks cuBLAS's layout and shapes), and the
    float32 partials summed are the whole product rounded once."""
    def piece_product(q, weight_t, x_scales, x_recipe, x_swizzle, w_scales, w_recipe, w_swizzle, bias, dtype,
                      contraction, fast_accum, *, out):
        assert len(x_scales) == len(w_scales) == 1 and dtype == torch.float32
        assert w_scales[0].shape == (k // 128 // pieces, -(-n // 128)) and q.shape[1] == k // pieces
        return out.copy_(_block_scaled_product(q, weight_t, x_scales[0], None, w_scales[0], None, dtype))

    monkeypatch.setattr(torch.ops.aten, "_scaled_mm_v2", type("Op", (), {"out": staticmethod(piece_product)}))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(fp8, "_streams", lambda device, count: [_Stream() for _ in range(count)])
    q, scale = fp8.quantize_blocks(torch.randn(n, k) / k ** 0.5)
    from kernels.fp8 import quantize_activations
    x = fp8.QuantizedRows(*quantize_activations(torch.randn(rows, k).to(BF16), **fp8.CUBLAS_ROWS), rows)
    got = fp8._product_in_k_pieces(x, q, scale, pieces)
    whole = _block_scaled_product(x.q, q.t(), x.scales, None, scale.t(), None, torch.float32)[:rows]
    assert got.shape == (rows, n) and got.dtype == BF16
    # One rounding of float32 sums taken in another order: within a bf16 step of the whole.
    assert ((got.float() - whole).abs() <= whole.abs() / 128 + 1e-6).all()
