"""The C int4 kernel (engine/layers/native/quantized_gemv.c) against torch references, on fresh random
inputs each run, its output poisoned beforehand: the same arithmetic done in float64 (activations
split into two int8 parts per group of 32, integer dot products), and the float product of the
weight it holds. Skipped where the kernel does not build (no C compiler, not x86-64 with AVX2)."""
import os
import subprocess
import sys

import pytest
import torch

from engine.layers import native_cpu
from engine.layers.quantized import INT4_GROUP, Int4Weight, Int8Weight, Q4_1Weight, int4_class
from tests.test_cpu_fast_paths import int4_tiny_qwen3

needs_kernel = pytest.mark.skipif(native_cpu.native_q4_1() is None,
                                  reason=f"no native kernel: {native_cpu.unavailable_reason()}")


def split_activations(x: torch.Tensor, two_parts: bool, lowest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The C kernels' activations in float64: per group of 32, 256 * high + low in units of amax /
    127 / 256 (each part rounded half to even, as the kernels' float32 steps do; low kept to lowest
    .. 127; the high part alone without two_parts), [rows, G, 32], and each group's amax / 127."""
    rows, k = x.shape
    groups = x.view(rows, k // INT4_GROUP, INT4_GROUP)
    scale = groups.abs().amax(-1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    scaled = groups * inverse[..., None]
    high = torch.round(scaled)
    low = torch.round((scaled - high) * 256).clamp(lowest, 127) if two_parts else torch.zeros_like(high)
    return (256 * high + low).double(), scale


def reference(x: torch.Tensor, weight: Q4_1Weight, two_parts: bool = True, size: bool = False) -> torch.Tensor:
    """What the kernel computes, in float64: x split per group into two int8 parts, high + low /
    256 in units of amax / 127 (each rounded half to even, as the kernel's float32 steps do; the
    high part alone without two_parts), times the nibbles, scaled, plus each group's minimum times
    the group's sum of x. With size, the same sum of absolute values: the scale of the kernel's
    float32 rounding."""
    groups = x.view(x.shape[0], -1, INT4_GROUP).double()
    parts, scale = split_activations(x, two_parts, lowest=-128)
    nibbles, scales, minimums = weight.by_row()
    q = torch.cat([nibbles & 15, nibbles >> 4], -1).double()  # [N, G, 32]
    scales, minimums = scales.double(), minimums.double()
    if size:
        parts, groups, scales, minimums = parts.abs(), groups.abs(), scales.abs(), minimums.abs()
    dots = torch.einsum("mgi,ngi->mng", parts, q)
    xs = scale.double() / 256
    return (dots * scales[None] * xs[:, None] + minimums[None] * groups.sum(-1)[:, None]).sum(-1)


def expanded_reference(weight: Q4_1Weight) -> torch.Tensor:
    """The weight as floats, unpacked value by value from GGUF's Q4_1 byte order."""
    nibbles, scales, minimums = weight.by_row()
    n, groups, _ = nibbles.shape
    out = torch.empty(n, groups, INT4_GROUP, dtype=torch.float64)
    for j in range(16):
        out[..., j] = (nibbles[..., j] & 15).double()
        out[..., j + 16] = (nibbles[..., j] >> 4).double()
    return (out * scales.double()[..., None] + minimums.double()[..., None]).view(n, -1)


def split_int8_cases(test):
    """The cases of a split-int8 arithmetic test (this kernel's and the int8 one's, in
    tests/test_q8_kernel.py): weights of n rows by k columns, `rows` activation rows, on 1 and 2
    threads, with and without the low parts."""
    for mark in (pytest.mark.parametrize("rows", [1, 2, 3, 8, 9]),
                 pytest.mark.parametrize("n, k", [(1, 32), (3, 64), (4, 32), (5, 96), (17, 576), (64, 1536)]),
                 pytest.mark.parametrize("threads", [1, 2]),
                 pytest.mark.parametrize("two_parts", [True, False])):
        test = mark(test)
    return test


def check_split_int8_arithmetic(make_weight, product, reference, n, k, rows, threads, two_parts):
    """product(x, weight, out, two_parts) of a weight of fresh random values against reference(x,
    weight, two_parts), on `threads` threads, into an output poisoned with NaN, to 1e-5 of
    reference(x, weight, two_parts, size=True)."""
    torch.set_num_threads(threads)
    try:
        weight = make_weight(torch.randn(n, k) * torch.rand(n, 1) * 3)
        x = torch.randn(rows, k) * torch.rand(rows, 1) * 5
        x[0, :INT4_GROUP] = 0.0  # a group of zeros: scale 0, nothing divided by it
        out = torch.full((rows, n), float("nan"))
        got = product(x, weight, out, two_parts)
    finally:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    want = reference(x, weight, two_parts)
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    # The kernel rounds each group's terms to float32 and sums them in float32: its error scales
    # with the terms' absolute values, which can cancel to a much smaller result.
    assert ((got.double() - want).abs() <= 1e-5 * reference(x, weight, two_parts, size=True)).all()


@needs_kernel
@split_int8_cases
def test_the_kernel_does_its_split_int8_arithmetic_exactly(n, k, rows, threads, two_parts):
    check_split_int8_arithmetic(
        Q4_1Weight, lambda x, w, out, two_parts: native_cpu.q4_1_product(
            x, w.nibbles, w.scales, w.minimums, w.out_features, out=out, two_parts=two_parts),
        reference, n, k, rows, threads, two_parts)


@needs_kernel
def test_the_product_is_the_float_product_of_the_weight_it_holds():
    w = torch.randn(300, 640)
    weight = Q4_1Weight(w)
    x = torch.randn(7, 640)
    exact = x.double() @ expanded_reference(weight).T
    got = weight.kernel_product(x)
    assert got.dtype == torch.float32 and got.shape == (7, 300)
    # The activations' two int8 parts hold each to 2^-16 of its group's largest value. The weights'
    # minimums (about -2 here) weigh every value of a group alike, so the parts' rounding adds up
    # over a group instead of averaging out: the relative error runs about 5e-5, and past 1e-4 in
    # one draw of 30,000.
    assert ((got.double() - exact).norm() / exact.norm()).item() < 2e-4
    # The quantized weight is within half a step of the float one, plus the float16 rounding of the
    # step and the minimum (2^-11 of each; the step counts up to 15 times).
    _, scales, minimums = weight.by_row()
    step = scales.double().repeat_interleave(INT4_GROUP, -1)
    minimum = minimums.double().abs().repeat_interleave(INT4_GROUP, -1)
    bound = step / 2 + (15 * step + minimum) * 2**-11 + 1e-6
    assert ((expanded_reference(weight) - w.double()).abs() <= bound).all()


@needs_kernel
def test_the_expansion_and_the_many_row_product_match_the_weights_values():
    weight = Q4_1Weight(torch.randn(70, 96))
    assert torch.allclose(weight.expanded().double(), expanded_reference(weight), rtol=1e-6, atol=1e-6)
    x = torch.randn(weight.expanded_rows + 3, 96)  # past expanded_rows: float32 GEMM on the expansion
    assert torch.allclose(weight.product(x).double(), x.double() @ expanded_reference(weight).T, rtol=1e-4,
                          atol=1e-4)


@needs_kernel
def test_a_weight_on_the_q4_1_grid_keeps_its_values():
    q = torch.randint(0, 16, (8, 4, INT4_GROUP))
    q[..., 0], q[..., 1] = 0, 15  # each group spans the grid, so its scale and minimum are exact
    # float16 values, as Q4_1 stores its scales and minimums
    scale, minimum = (torch.rand(8, 4, 1) + 0.5).half().float(), torch.randn(8, 4, 1).half().float()
    w = (q * scale + minimum).view(8, -1)
    weight = Q4_1Weight(w)
    assert torch.equal(weight.by_row()[0], (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8))
    assert torch.allclose(expanded_reference(weight), w.double(), atol=1e-5)


@needs_kernel
def test_int4_weights_take_the_kernel_where_it_builds():
    assert int4_class() is Q4_1Weight


def test_without_the_kernels_int4_and_int8_weights_take_torchs():
    code = ("from engine.layers import native_cpu, quantized;"
            "print(native_cpu.unavailable_reason(), quantized.int4_class().__name__, quantized.int8_class(576).__name__)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, native_cpu.DISABLE_VARIABLE: "0"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [f"{native_cpu.DISABLE_VARIABLE}=0", Int4Weight.__name__, Int8Weight.__name__]


@needs_kernel
def test_a_tied_int4_head_ranks_with_one_int8_an_activation_and_its_projections_take_two():
    model = int4_tiny_qwen3(tied=True)
    assert model.lm_head.quantized.precise_activations is False
    assert model.model.layers[0].mlp.down_proj.quantized.precise_activations is True


@needs_kernel
def test_a_build_replaces_the_builds_of_other_sources(tmp_path):
    stale = tmp_path / "native" / "cpu_kernels-0000000000000000.so"
    stale.parent.mkdir()
    stale.write_bytes(b"an older build")
    assert native_cpu.native_q4_1(tmp_path) is not None
    assert not stale.exists() and len(list((tmp_path / "native").glob("cpu_kernels-*.so"))) == 1
