"""The C int8 kernel (engine/layers/native/quantized_gemv.c) against torch references, on fresh
random inputs each run, its output poisoned beforehand: the same arithmetic done in float64
(activations split into two int8 parts per group of 32, integer dot products), and the float
product of the weight it holds. Skipped where the kernels do not build (no C compiler, not x86-64
with AVX2)."""

import pytest
import torch

from engine.layers import native_cpu
from engine.layers.quantized import INT4_GROUP, Int8Weight, NativeInt8Weight, int8_class, quantize, quantize_rows
from tests.test_q4_1_kernel import check_split_int8_arithmetic, split_activations, split_int8_cases

needs_kernel = pytest.mark.skipif(native_cpu.native_kernels() is None,
                                  reason=f"no native kernel: {native_cpu.unavailable_reason()}")


def reference(x: torch.Tensor, weight: NativeInt8Weight, two_parts: bool = True, size: bool = False) -> torch.Tensor:
    """What the kernel computes, in float64: x split per group into two int8 parts, high + low /
    256 in units of amax / 127 (each rounded half to even, the low part kept to -127..127; the high
    part alone without two_parts), times the int8 values, in units of each row's scale. With size,
    the same sum of absolute values: the scale of the kernel's float32 rounding."""
    parts, scale = split_activations(x, two_parts, lowest=-127)
    q = weight.by_row().double().view(weight.out_features, -1, INT4_GROUP)  # [N, G, 32]
    scales = weight.scales[:weight.out_features].double()
    if size:
        parts, q, scales = parts.abs(), q.abs(), scales.abs()
    dots = torch.einsum("mgi,ngi->mng", parts, q)
    return (dots * (scale.double() / 256)[:, None]).sum(-1) * scales


@needs_kernel
@split_int8_cases
def test_the_kernel_does_its_split_int8_arithmetic_exactly(n, k, rows, threads, two_parts):
    check_split_int8_arithmetic(
        NativeInt8Weight, lambda x, w, out, two_parts: native_cpu.q8_product(
            x, w.q, w.scales, w.out_features, out=out, two_parts=two_parts),
        reference, n, k, rows, threads, two_parts)


@needs_kernel
def test_negative_weights_meet_the_lowest_activation_parts_without_overflow():
    # Every weight -127 against activations whose low parts sit at the ends of their range: the
    # signs move onto the activations, where a -128 would have wrapped.
    k = 64
    weight = NativeInt8Weight(torch.full((4, k), -1.0))
    # With 127 the group's largest value its unit is 1: x.5 rounds to the even neighbour above it,
    # leaving -0.5, a low part of -128 before the kernel keeps it to -127.
    x = torch.tensor([[127.0] + [3.5, 5.5, -2.5, -6.5] * 7 + [1.0, 2.0, 3.0] + [0.0] * 32])
    got = weight.kernel_product(x)
    want = reference(x, weight)
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    # Each such value is off by 1/256 of the unit (the low part's -128 kept to -127); a wrapped one
    # would be off by hundreds.
    assert torch.allclose(got.double(), x.double() @ (-torch.ones(4, k, dtype=torch.float64)).T, rtol=2e-3)


@needs_kernel
def test_the_layout_holds_quantize_rows_values_and_the_products_match_the_weight():
    w = torch.randn(301, 640)
    weight = NativeInt8Weight(w)
    q, scales = quantize_rows(w)
    assert torch.equal(weight.by_row(), q)
    assert torch.equal(weight.scales[:301], scales.float()) and (weight.scales[301:] == 0).all()
    exact = q.double() * scales.double()[:, None]
    x = torch.randn(7, 640)
    got = weight.kernel_product(x)
    assert got.dtype == torch.float32 and got.shape == (7, 301)
    # The activations' two int8 parts hold each to 2^-16 of its group's largest value.
    assert ((got.double() - x.double() @ exact.T).norm() / (x.double() @ exact.T).norm()).item() < 1e-4
    assert torch.allclose(weight.expanded().double(), exact, rtol=1e-6, atol=1e-6)
    many = torch.randn(weight.expanded_rows + 3, 640)  # past expanded_rows: float32 GEMM on the expansion
    assert torch.allclose(weight.product(many).double(), many.double() @ exact.T, rtol=1e-4, atol=1e-4)
    index = torch.tensor([[0, 300], [5, 4]])
    assert torch.allclose(weight.rows(index).double(), exact[index], rtol=1e-6, atol=1e-6)


@needs_kernel
def test_int8_weights_take_the_kernel_where_their_rows_are_whole_groups():
    assert int8_class(576) is NativeInt8Weight and type(quantize(torch.randn(8, 64), "int8")) is NativeInt8Weight
    assert int8_class(48) is Int8Weight and type(quantize(torch.randn(8, 48), "int8")) is Int8Weight

