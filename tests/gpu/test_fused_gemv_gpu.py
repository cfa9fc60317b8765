"""kernels.gemv's fused RMSNorm prologue and SiLU-mul epilogue on a GPU at Qwen3-0.6B's shapes in
bf16 against the unfused chain, and a captured decode-like chain of the GEMV, RMSNorm and SiLU-mul
kernels launched with programmatic dependent launch (kernels/pdl.py) against the same kernels run
eagerly without it.

Run with TRITON_INTERPRET unset or 0. Fresh random inputs each run; the seed is printed on failure.
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

triton = pytest.importorskip("triton")

from kernels import gemv, pdl, rmsnorm, silu_mul  # noqa: E402
from tests.kernel_checks import assert_close, capture, norm_gemv_reference, poison  # noqa: E402,F401 (fixtures)

if type(gemv._gemv_kernel).__name__ == "InterpretedFunction":
    pytest.skip("kernels were imported under TRITON_INTERPRET=1", allow_module_level=True)

BF16 = torch.bfloat16
EPS = 1e-6
HIDDEN, QKV, INTER = 1024, 4096, 3072  # Qwen3-0.6B


def weights(n, k):
    return (torch.randn(n, k, device="cuda") / k ** 0.5).to(BF16)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("N, silu", [(QKV, False), (2 * INTER, True), (1024, False), (2048, True)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_gemv(M, N, silu, with_residual, poison):
    """Each kernel launch_config picks for 1-8 rows (qkv and gate_up; and 1024- and 2048-row
    weights, which take the other configs)."""
    x = torch.randn(M, HIDDEN, device="cuda").to(BF16)
    residual = torch.randn(M, HIDDEN, device="cuda").to(BF16) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(BF16)
    weight = weights(N, HIDDEN)
    want_y, want_h = norm_gemv_reference(x, residual, norm_weight, weight, silu, EPS)
    with poison():
        y, h = gemv.rms_norm_gemv(x, residual, norm_weight, EPS, weight, silu=silu)
    assert_close(y, want_y, BF16)
    assert torch.equal(h, want_h)


def decode_chain(x, layers, final_norm):
    """Qwen3-0.6B-shaped layers with q standing in for attention's output: each sublayer's
    pre-norm fused into its first projection on even layers, and its own kernel (as on prefill
    steps) on odd ones."""
    residual = None
    for i, (n1, w_qkv, w_o, n2, w_gate_up, w_down) in enumerate(layers):
        if i % 2 == 0:
            qkv, residual = gemv.rms_norm_gemv(x, residual, n1, EPS, w_qkv)
            x = gemv.gemv(qkv[:, :2048], w_o)
            act, residual = gemv.rms_norm_gemv(x, residual, n2, EPS, w_gate_up, silu=True)
        else:
            normed, residual = rmsnorm.rms_norm(x, n1, EPS, residual)
            x = gemv.gemv(gemv.gemv(normed, w_qkv)[:, :2048], w_o)
            normed, residual = rmsnorm.rms_norm(x, n2, EPS, residual)
            act = silu_mul.silu_and_mul(gemv.gemv(normed, w_gate_up))
        x = gemv.gemv(act, w_down)
    return rmsnorm.rms_norm(x, final_norm, EPS, residual)[0]


@pytest.mark.parametrize("M", [1, 2, 8])
def test_pdl_chain_in_cuda_graph(M, monkeypatch):
    """Replayed with new inputs, the captured chain gives exactly what the same kernels give
    eagerly without PDL: a kernel that read its input before the one producing it had finished
    would read the last replay's."""
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0+ (and NVCHAT_PDL unset)")
    norm = lambda: (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(BF16)  # noqa: E731
    layers = [(norm(), weights(QKV, HIDDEN), weights(HIDDEN, 2048), norm(), weights(2 * INTER, HIDDEN),
               weights(HIDDEN, INTER)) for _ in range(4)]
    final_norm = norm()
    x = torch.randn(M, HIDDEN, device="cuda").to(BF16)
    graph, out = capture(lambda: decode_chain(x, layers, final_norm))
    for _ in range(5):
        x.copy_(torch.randn(M, HIDDEN, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        with monkeypatch.context() as m:
            m.setenv("NVCHAT_PDL", "0")
            want = decode_chain(x, layers, final_norm)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
