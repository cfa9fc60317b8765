"""kernels/fp8.py against the torch reference, on CPU through Triton's interpreter: the FP8 GEMV
(1-8 rows), the activations' quantization, the W8A8 GEMV of 1-32 quantized rows, and the FP8 GEMM
with activations quantized (W8A8) or not (float32, exact), on shapes whose edge blocks are
partial; and engine/layers/fp8.py's quantizer against the checkpoint format's definition and its
rules for which kernel takes a product.

Inputs are fresh random numbers each run (the seed is printed on failure); outputs are allocated
NaN-filled, so an element left unwritten fails.
"""
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from kernels import fp8  # noqa: E402
from tests.kernel_checks import (  # noqa: E402,F401
    assert_close,
    fp8_blocks,
    fp8_dequantized,
    norm_gemv_reference,
    poison,
    quantized_rows_reference,
    round_toward_zero,
)

if type(fp8._fp8_gemv_one_kernel).__name__ != "InterpretedFunction":
    if torch.cuda.is_available() or os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("the GPU runs tests/gpu/test_moe_fp8_gpu.py", allow_module_level=True)
    importlib.reload(fp8)  # imported before TRITON_INTERPRET was set: decorate them again

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def weights(N, K, block):
    return fp8_blocks(torch.randn(N, K) / K ** 0.5, block)


# (block_n, block_k, unroll, num_warps) of the one-row kernel: tiles of one run inside a scale block,
# and of several runs (GROUPS > 1), one or several tiles a loop step (the last step partly past K);
# block_n at 32 is cut to the scale block's 16 rows. The last two sum each step's products at once
# (fp8.one_row_sums_each_step), in one step of all of K and in two.
ONE_ROW = [(8, 16, 1, 4), (4, 64, 1, 4), (32, 128, 1, 4), (8, 16, 2, 4), (4, 32, 4, 4), (16, 1024, 1, 1),
           (16, 512, 1, 1)]


@pytest.mark.parametrize("block, dtype", [((16, 32), F32), ((64, 16), BF16), ((16, 32), F16)])
def test_one_row_gemv_matches_the_dequantized_product(block, dtype, poison):
    N, K = 70, 1000  # neither a multiple of either block side
    q, scales = weights(N, K, block)
    x = torch.randn(1, K).to(dtype)
    want = round_toward_zero(x.float() @ fp8_dequantized(q, scales, block).T, dtype)
    assert {fp8.one_row_sums_each_step(n, k, w) for n, k, _, w in ONE_ROW} == {False, True}
    for block_n, block_k, unroll, num_warps in ONE_ROW:
        with poison():
            y = fp8.fp8_gemv(x, q, scales, block, kernel="one", block_n=block_n, block_k=block_k, unroll=unroll,
                             num_warps=num_warps)
        assert_close(y, want, dtype)


# Triton 3.9's interpreter gets bf16 tl.dot wrong (tests/test_fused_gemv.py): the tensor-core
# kernel runs here in fp32 and fp16, and in bf16 in tests/gpu/test_moe_fp8_gpu.py.
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_one_row_gemv_takes_the_norm_in(dtype, with_residual, poison):
    """rms_norm_fp8_gemv against the unfused chain (tests/test_fused_gemv.py's reference) over the
    dequantized weight: the RMSNorm of x + residual formed in every program, the new residual
    stored once. Launches of several steps and of one, and the default; 70 rows leave the last band
    short."""
    block, N, K = (16, 32), 70, 1000
    q, scales = weights(N, K, block)
    x = torch.randn(1, K).to(dtype)
    residual = torch.randn(1, K).to(dtype) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(K)).to(dtype)
    want_y, want_h = norm_gemv_reference(x, residual, norm_weight, fp8_dequantized(q, scales, block), False, 1e-6,
                                         rounding=round_toward_zero)
    for launch in [dict(block_n=8, block_k=16, unroll=2, num_warps=4), dict(block_n=16, block_k=1024, num_warps=1),
                   {}]:
        with poison():
            y, h = fp8.rms_norm_fp8_gemv(x, residual, norm_weight, 1e-6, q, scales, block, **launch)
        assert_close(y, want_y, dtype)
        if with_residual:
            assert torch.equal(h, want_h)
        else:
            assert h is x


@pytest.mark.parametrize("M, block, dtype", [(2, (16, 32), F32), (5, (64, 16), F16), (8, (32, 16), F32)])
def test_tensor_core_gemv_matches_the_dequantized_product(M, block, dtype, poison):
    """Runs of 16 and 32 columns, one and several a loop step, 16 and 32 weight rows a program."""
    N, K = 70, 100
    q, scales = weights(N, K, block)
    x = torch.randn(M, K).to(dtype)
    want = x.float() @ fp8_dequantized(q, scales, block).T
    for block_n, block_k in ((16, 16), (32, 64)):
        with poison():
            y = fp8.fp8_gemv(x, q, scales, block, kernel="dot", block_n=block_n, block_k=block_k)
        assert_close(y, want.to(dtype), dtype)


@pytest.mark.parametrize("M", [1, 3, 8])
def test_gemv_default_launch_matches_the_dequantized_product(M, poison):
    """gemv_launch_config's choice for each row count, at a width that takes several loop steps."""
    block = (32, 32)
    q, scales = weights(40, 2600, block)
    x = torch.randn(M, 2600)
    with poison():
        y = fp8.fp8_gemv(x, q, scales, block)
    assert_close(y, x @ fp8_dequantized(q, scales, block).T, F32)


def test_quantize_activations_matches_the_reference(poison):
    x = torch.randn(5, 80) * torch.logspace(-3, 3, 5)[:, None]  # rows of very different magnitudes
    x[2, 32:64] = 0.0  # a group of zeros: scale floored, values zero
    with poison():
        q, scales = fp8.quantize_activations(x, 32)
    want_q, want_scales = quantized_rows_reference(x, 32)
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), want_q.float())


@pytest.mark.parametrize("M", [1, 5, 8])
def test_quantize_activations_pads_rows_and_lays_scales_by_column(M, poison):
    """The layout of cuBLAS's block-scaled product: rows padded to a multiple of 4 (zeros) and the
    scales stored column by column."""
    x = torch.randn(M, 300) * 10
    with poison():
        q, scales = fp8.quantize_activations(x, 128, pad_rows_to=4, scales_by_column=True)
    rows = -(-M // 4) * 4
    assert q.shape == (rows, 300) and scales.shape == (rows, 3) and scales.stride() == (1, rows)
    want_q, want_scales = quantized_rows_reference(x, 128)
    torch.testing.assert_close(scales[:M], want_scales, rtol=1e-6, atol=0)
    assert torch.equal(q[:M].float(), want_q.float())
    assert not q[M:].float().any() and scales[M:].isfinite().all() and (scales[M:] > 0).all()


@pytest.mark.parametrize("M, block", [(1, (16, 32)), (17, (32, 16)), (40, (16, 32))])
def test_gemm_in_float32_is_the_exact_dequantized_product(M, block, poison):
    N, K = 70, 100
    q, scales = weights(N, K, block)
    x = torch.randn(M, K)
    with poison():
        y = fp8.fp8_gemm(x, q, scales, block, block_m=16, block_n=32)
    assert_close(y, x @ fp8_dequantized(q, scales, block).T, F32)


@pytest.mark.parametrize("M, dtype", [(9, F16), (33, BF16)])
def test_gemm_with_quantized_activations_matches_the_reference(M, dtype, poison):
    """W8A8: x quantized per row and 32 columns, each K block one e4m3 product scaled by both."""
    block = (16, 32)
    N, K = 50, 100
    q, scales = weights(N, K, block)
    x = torch.randn(M, K).to(dtype)
    with poison():
        y = fp8.fp8_gemm(x, q, scales, block, block_m=16, block_n=16)
    xq, x_scales = quantized_rows_reference(x, 32)
    x_dequant = xq.float() * x_scales.repeat_interleave(32, 1)[:, :K]
    want = x_dequant @ fp8_dequantized(q, scales, block).T
    assert_close(y, round_toward_zero(want, dtype), dtype)
    # And within FP8's rounding of the unquantized product: activations lose ~3 of 8 bits.
    exact = x.float() @ fp8_dequantized(q, scales, block).T
    assert (y.float() - exact).abs().max() < 0.1 * exact.abs().max()


def test_linear_takes_the_gemv_up_to_8_rows_and_the_gemm_beyond(monkeypatch, poison):
    block = (16, 32)
    q, scales = weights(40, 64, block)
    calls = []
    for name in ("fp8_gemv", "fp8_gemm"):
        real = getattr(fp8, name)
        monkeypatch.setattr(fp8, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    for rows in (1, 8, 9):
        x = torch.randn(rows, 64)
        with poison():
            y = fp8.fp8_linear(x, q, scales, block)
        assert_close(y, x @ fp8_dequantized(q, scales, block).T, F32)
    assert calls == ["fp8_gemv", "fp8_gemv", "fp8_gemm"]


@pytest.mark.parametrize("shape, block", [((70, 100), (16, 32)), ((3, 130, 48), (128, 128))])
def test_engine_quantizer_writes_the_checkpoint_format(shape, block):
    """engine.layers.fp8.quantize_blocks against the format's definition: the same scales, and
    values that dequantize back to within e4m3's rounding (3 mantissa bits)."""
    from engine.layers.fp8 import dequantize_blocks, quantize_blocks
    w = torch.randn(shape)
    q, scales = quantize_blocks(w, block)
    want_q, want_scales = fp8_blocks(w, block)
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), want_q.float())
    back = dequantize_blocks(q, scales, block)
    assert torch.equal(back, fp8_dequantized(want_q, want_scales, block))
    assert ((back - w).abs() <= w.abs() / 16 + 2 ** -9 * scales.max()).all()


@pytest.mark.parametrize("pieces, padded, rows, n", [(2, 8, 5, 96), (3, 4, 4, 1000), (4, 12, 9, 2048)])
def test_sum_k_pieces_adds_the_pieces_in_order_and_rounds_once(pieces, padded, rows, n, poison):
    """A product's float32 partials over pieces of K summed piece by piece for the real rows only
    (the padding rows' partials are NaN here and must not reach the output), rounded to bf16 as the
    interpreter rounds."""
    parts = torch.randn(pieces, padded, n) * 10
    parts[:, rows:] = float("nan")
    with poison():
        got = fp8.sum_k_pieces(parts, rows)
    want = parts[0, :rows].clone()
    for piece in range(1, pieces):
        want += parts[piece, :rows]
    assert got.dtype == BF16 and torch.equal(got, round_toward_zero(want, BF16))


@pytest.mark.parametrize("rows, N, K, by_column", [(1, 96, 256, True), (5, 130, 384, True), (17, 64, 512, True),
                                                (32, 200, 128, True), (6, 64, 512, False)])
def test_w8a8_gemv_matches_the_quantized_reference(rows, N, K, by_column, poison):
    """Rows quantized as block_scaled_mm hands them over (padded to a multiple of 4, scales laid out
    by column) or laid out by row, against W in 128 x 128 blocks, the last block of rows partial and
    K in one or two blocks a loop step: the product of both dequantized, rounded once to bf16
    (within its last bit: the sums run in another order). The padding rows are NaN here; no output
    row but the real ones is written."""
    block = (128, 128)
    q, scales = weights(N, K, block)
    xq, xs = fp8.quantize_activations(torch.randn(rows, K), 128, pad_rows_to=4, scales_by_column=by_column)
    assert (xs.stride(0) == 1) == by_column
    xq[rows:] = float("nan")
    xs[rows:] = float("nan")
    with poison():
        y = fp8.w8a8_gemv(xq, xs, rows, q, scales, block)
    want = (xq[:rows].float() * xs[:rows].repeat_interleave(128, 1)) @ fp8_dequantized(q, scales, block).T
    assert y.dtype == BF16 and y.shape == (rows, N) and not y.isnan().any()
    torch.testing.assert_close(y.float(), round_toward_zero(want, BF16).float(), rtol=2 ** -7,
                               atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("rows, N, K, pieces", [(4, 96, 1024, 8), (3, 200, 512, 2), (16, 64, 256, 2)])
def test_w8a8_gemv_in_pieces_of_k_sums_them_in_order_and_resets_its_counters(rows, N, K, pieces, poison):
    """K cut into pieces run by programs of their own, the last of each band summing the partials:
    the same bf16 result as the sums of the pieces' exact products taken in piece order (within
    the last bit), every band's counter zero again afterwards, and the same result a second time
    through the same counters."""
    block = (128, 128)
    q, scales = weights(N, K, block)
    xq, xs = fp8.quantize_activations(torch.randn(rows, K), 128, pad_rows_to=4, scales_by_column=True)
    arrivals = torch.zeros(16, dtype=torch.int32)
    with poison():
        y = fp8.w8a8_gemv(xq, xs, rows, q, scales, block, block_n=16, pieces=pieces, arrivals=arrivals)
    assert torch.equal(arrivals, torch.zeros_like(arrivals))
    x = xq[:rows].float() * xs[:rows].repeat_interleave(128, 1)
    w = fp8_dequantized(q, scales, block)
    width = K // pieces
    want = sum(x[:, p * width:(p + 1) * width] @ w[:, p * width:(p + 1) * width].T for p in range(pieces))
    assert y.dtype == BF16 and y.shape == (rows, N) and not y.isnan().any()
    torch.testing.assert_close(y.float(), round_toward_zero(want, BF16).float(), rtol=2 ** -7,
                               atol=1e-3 * want.abs().max().item())
    again = fp8.w8a8_gemv(xq, xs, rows, q, scales, block, block_n=16, pieces=pieces, arrivals=arrivals)
    assert torch.equal(again, y) and torch.equal(arrivals, torch.zeros_like(arrivals))


@pytest.mark.parametrize("rows, N, K, launch", [
    (2, 6144, 4096, (4, 4, 1)), (16, 4096, 4096, (4, 4, 1)), (8, 24576, 4096, (1, 4, 2)),  # Qwen3-8B
    (4, 1024, 1024, (4, 4, 1)), (4, 1024, 768, (2, 4, 1)), (4, 1024, 640, (1, 4, 2)),  # pieces: 256+ columns
    (1, 24576, 4096, (1, 4, 2)), (1, 10240, 5120, (1, 4, 2)), (1, 8448, 4096, (1, 4, 2)),  # one row: whole
    (1, 8384, 4096, None), (1, 6144, 4096, None), (1, 4096, 4096, None), (1, 5120, 2048, None),  # one-row GEMV
    (1, 24576, 12288, None),
    (8, 512, 384, (1, 4, 2)), (2, 10240, 5120, (2, 4, 1)), (2, 4096, 8192, (4, 4, 1)),
    (2, 4096, 12288, None), (16, 5120, 25600, None),  # down: cuBLAS
    (17, 24576, 4096, (1, 2, 2)), (32, 16384, 12288, (1, 2, 2)),  # 17-32 rows: a wide W whole
    (17, 6144, 4096, None), (32, 16383, 4096, None), (33, 24576, 4096, None), (0, 24576, 4096, None),
])
def test_w8a8_gemv_takes_the_rows_shapes_and_launches_it_measured_faster_at(rows, N, K, launch):
    """engine/layers/fp8.py's rule on an H200 (132 SMs): 1-16 rows with K up to 8192 on four warps
    in the fewest pieces of K (at most 4, each at least 256 columns) that make two programs an SM
    (one row whole, where W's bands of 64 rows are at least one an SM),
    17-32 rows whole on two warps against a W of 16,384 rows or more (gate and up), otherwise
    cuBLAS, or at one row the one-row GEMV (benchmarks/HISTORY.md, 2026-11-28, 13:49 and 15:26)."""
    from engine.layers.fp8 import w8a8_launch
    assert w8a8_launch(rows, N, K, 132) == launch


@pytest.mark.parametrize("rows, N, K, pieces", [
    (64, 4096, 12288, 3), (32, 4096, 12288, 3), (16, 4096, 12288, 1), (2, 4096, 12288, 1),  # down
    (2, 4096, 4096, 2), (128, 4096, 4096, 2), (129, 4096, 4096, 1), (256, 4096, 12288, 1),  # o_proj
    (64, 6144, 4096, 2), (64, 24576, 4096, 1),  # qkv, gate/up
    (32, 5120, 25600, 2), (16, 5120, 25600, 1), (2, 5120, 8192, 2), (64, 10240, 5120, 1),  # Qwen3-32B
    (64, 2560, 4096, 4), (64, 1024, 3072, 3), (64, 1024, 12288, 4),  # never more than 4 pieces
    (64, 4000, 4096, 2), (64, 2560, 9728, 1),  # N not a multiple of 128; K = 19 x 512
])
def test_products_are_cut_where_the_pieces_measured_faster(rows, N, K, pieces):
    """The cuts engine/layers/fp8.py's pieces_for makes on an H200 (132 SMs): those measured faster
    than cuBLAS's whole product (benchmarks/HISTORY.md, 2026-11-28, 12:22), and the products left
    whole where pieces measured slower or cannot be cut into multiples of 512."""
    from engine.layers.fp8 import pieces_for
    assert pieces_for(rows, N, K, 132) == pieces


def test_bad_input_is_named():
    q, scales = weights(40, 64, (16, 32))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="float32 scales"):
        fp8.fp8_gemv(x, q, scales[:, :1], (16, 32))
    with pytest.raises(ValueError, match="1 to 8 rows"):
        fp8.fp8_gemv(torch.randn(9, 64), q, scales, (16, 32))
    with pytest.raises(ValueError, match="one-row kernel takes one row"):
        fp8.fp8_gemv(x, q, scales, (16, 32), kernel="one")
    with pytest.raises(ValueError, match="power of two"):
        fp8.fp8_gemv(x, q, scales, (16, 32), block_k=48)
    with pytest.raises(ValueError, match="at least 16 columns"):
        fp8.fp8_gemv(x, q, scales, (16, 32), kernel="dot", block_k=8)
    with pytest.raises(ValueError, match="unroll must be a power of two"):
        fp8.fp8_gemv(x[:1], q, scales, (16, 32), kernel="one", unroll=3)
    with pytest.raises(ValueError, match="dot kernel takes no unroll"):
        fp8.fp8_gemv(x, q, scales, (16, 32), kernel="dot", unroll=2)
    norm_weight = torch.ones(64)
    with pytest.raises(ValueError, match="only the one-row kernel takes the norm in"):
        fp8.rms_norm_fp8_gemv(x[:1], None, norm_weight, 1e-6, q, scales, (16, 32), kernel="dot")
    with pytest.raises(ValueError, match="contiguous norm weight"):
        fp8.rms_norm_fp8_gemv(x[:1], None, norm_weight.to(BF16), 1e-6, q, scales, (16, 32))
    xq, xs = fp8.quantize_activations(torch.randn(4, 128), 128)
    w8, w8_scales = weights(64, 128, (128, 128))
    with pytest.raises(ValueError, match=r"1 to min\(P, 32\) rows"):
        fp8.w8a8_gemv(xq, xs, 5, w8, w8_scales, (128, 128))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        fp8.w8a8_gemv(xq, xs, 4, w8, w8_scales, (128, 128), block_n=48)
    with pytest.raises(ValueError, match="groups at least 1"):
        fp8.w8a8_gemv(xq, xs, 4, w8, w8_scales, (128, 128), groups=0)
    with pytest.raises(ValueError, match="power of two of pieces"):
        fp8.w8a8_gemv(xq, xs, 4, w8, w8_scales, (128, 128), pieces=2)  # K = 128: one block
    xq, xs = fp8.quantize_activations(torch.randn(4, 256), 128)
    w8, w8_scales = weights(64, 256, (128, 128))
    with pytest.raises(ValueError, match="takes arrivals"):
        fp8.w8a8_gemv(xq, xs, 4, w8, w8_scales, (128, 128), pieces=2)
    with pytest.raises(ValueError, match="takes arrivals"):
        fp8.w8a8_gemv(xq, xs, 4, w8, w8_scales, (128, 128), pieces=2, arrivals=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="takes arrivals"):  # one counter for each of 4 bands of 16 rows
        fp8.w8a8_gemv(xq, xs, 4, w8, w8_scales, (128, 128), block_n=16, pieces=2,
                      arrivals=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="rows <= P"):
        fp8.sum_k_pieces(torch.zeros(2, 4, 8), 5)
    with pytest.raises(ValueError, match="contiguous float32 parts"):
        fp8.sum_k_pieces(torch.zeros(2, 4, 8, dtype=BF16), 4)
    with pytest.raises(ValueError, match="float8_e4m3fn weight"):
        fp8.fp8_gemm(x, q.float(), scales, (16, 32))
    with pytest.raises(TypeError, match="launch knobs"):
        fp8.fp8_gemm(x, q, scales, (16, 32), block_q=4)
