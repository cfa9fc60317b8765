"""kernels/launch_limits.py on a real card. The limits are the ones Triton checks launches against.
The launches the GEMV (plain and with the RMSNorm and SiLU-mul fused) and the attention kernels
(decode with its merged splits, prefill) choose for this card in each dtype, and for a smaller one
(an RTX 4090's 99 KiB of shared memory per block, passed off as this card's limits), compile to
no more shared memory than the card has and than their estimates say (the estimates must err
high: that is what lets a pure function on CPU choose for a card it has never seen), and compute
what the torch reference computes.

Run (one GPU): PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_launch_limits_gpu.py
"""
import contextlib
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

triton = pytest.importorskip("triton")

from triton.runtime import driver  # noqa: E402

from engine.layers import paged_attention_torch as ref  # noqa: E402
from kernels import decode_attention, gemv, launch_limits, prefill_attention  # noqa: E402
from tests.gpu.test_kernels_gpu import make_paged_kv  # noqa: E402
from tests.kernel_checks import assert_close, norm_gemv_reference  # noqa: E402

if type(gemv._gemv_kernel).__name__ == "InterpretedFunction":
    pytest.skip("kernels were imported under TRITON_INTERPRET=1", allow_module_level=True)

GEMV_KERNELS = {gemv._gemv_kernel: "one", gemv._gemv_rows_fma_kernel: "fma", gemv._gemv_rows_dot_kernel: "dot"}
HEAD_DIM = 128


def test_the_limits_are_the_ones_triton_checks_launches_against():
    limits = launch_limits.device_limits(torch.device("cuda"))
    props = driver.active.utils.get_device_properties(torch.cuda.current_device())
    assert (limits.max_shared_mem, limits.max_registers) == (props["max_shared_mem"], props["max_num_regs"])
    if any(name in limits.name for name in ("H100", "H200")):
        assert limits.max_shared_mem == launch_limits.H100.max_shared_mem == 232_448


@contextlib.contextmanager
def launches_of(*jit_functions):
    """Records (JIT function, launch keyword arguments, compiled kernel) for every launch of the
    given Triton kernels within the block."""
    seen = []
    for fn in jit_functions:
        def spy(*args, _run=fn.run, _fn=fn, **kwargs):
            compiled = _run(*args, **kwargs)
            seen.append((_fn, kwargs, compiled))
            return compiled
        fn.run = spy  # fn[grid](...) calls self.run
    try:
        yield seen
    finally:
        for fn in jit_functions:
            del fn.run


def estimate(fn, kw, dtype, group) -> int:
    """The launch's shared-memory estimate, from the configuration it was launched with."""
    if fn in GEMV_KERNELS:
        config = (GEMV_KERNELS[fn], kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"], kw["num_stages"])
        return gemv.shared_memory(config, kw.get("ROWS", 1), kw["SILU"], kw["NORM"], dtype.itemsize)
    if fn is decode_attention._decode_kernel:
        config = (kw["BLOCK_N"], kw["num_warps"], kw["num_stages"], kw["SPLIT_TILE"])
        return decode_attention.shared_memory(config, group, HEAD_DIM, dtype.itemsize)
    config = prefill_attention.LaunchConfig(kw["BLOCK_Q"], kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"],
                                            kw["num_stages"], 1)
    return prefill_attention.shared_memory(config, HEAD_DIM, dtype.itemsize)


# This card in every dtype (the float32 and float16 paths of the fused GEMV and the decode merge
# against torch too); the smaller card in float32, whose attention launches shrink there, and in
# bfloat16, whose GEMV launches do (float32's are 128 wide: they fit as tuned).
CARDS = [(None, torch.float32), (None, torch.float16), (None, torch.bfloat16), (launch_limits.RTX_4090, torch.float32),
         (launch_limits.RTX_4090, torch.bfloat16)]


@pytest.mark.parametrize("card, dtype", CARDS, ids=[f"{'this-card' if c is None else 'rtx-4090'}-{str(d)[6:]}"
                                                    for c, d in CARDS])
def test_the_chosen_launches_fit_the_card_and_their_estimates(card, dtype, monkeypatch):
    limits = launch_limits.device_limits(torch.device("cuda"))
    if card is not None:
        limits = card
        monkeypatch.setattr(launch_limits, "device_limits", lambda device: card if device.type == "cuda" else None)
    kernels = [*GEMV_KERNELS, decode_attention._decode_kernel, prefill_attention._prefill_kernel]
    with launches_of(*kernels) as seen:
        # SmolLM2's gate_up (whose float32 launch once failed) and down shapes, at each kernel's row counts.
        for n, k, rows in [(3072, 576, 1), (3072, 576, 2), (3072, 576, 8), (576, 1536, 3), (576, 1536, 8)]:
            x = torch.randn(rows, k, device="cuda").to(dtype)
            w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
            assert_close(gemv.gemv(x, w), (x.float() @ w.float().T).to(dtype), dtype)
        x, residual = (torch.randn(1, 576, device="cuda").to(dtype) for _ in range(2))
        norm_weight = (1 + 0.1 * torch.randn(576, device="cuda")).to(dtype)
        w = (torch.randn(3072, 576, device="cuda") / 24).to(dtype)
        y, h = gemv.rms_norm_gemv(x, residual, norm_weight, 1e-6, w, silu=True)
        want_y, want_h = norm_gemv_reference(x, residual, norm_weight, w, True, 1e-6)
        assert_close(y, want_y, dtype)
        assert torch.equal(h, want_h)

        # Attention at a GQA group of 8 (the decode merge's widest tile) over a few hundred keys.
        kv_heads, group = 2, 8
        lens = [random.randint(200, 700) for _ in range(3)]
        k_cache, v_cache, tables = make_paged_kv(lens, 16, kv_heads, dtype)
        context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(3, kv_heads * group, HEAD_DIM, device="cuda").to(dtype)
        assert_close(decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens,
                                                             HEAD_DIM ** -0.5),
                     ref.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, HEAD_DIM ** -0.5), dtype)
        # A prefill step past the small-step tiles: its biggest launch.
        q_lens = [lens[0], 50, 1]
        cu = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
        q = torch.randn(sum(q_lens), kv_heads * group, HEAD_DIM, device="cuda").to(dtype)
        assert_close(prefill_attention.paged_prefill_attention(q, k_cache, v_cache, cu, context_lens, tables,
                                                               HEAD_DIM ** -0.5),
                     ref.paged_prefill_attention(q, k_cache, v_cache, cu, context_lens, tables, HEAD_DIM ** -0.5), dtype)
    assert {fn for fn, _, _ in seen} == set(kernels)
    for fn, kw, compiled in seen:
        shared = compiled.metadata.shared
        what = f"{fn.fn.__name__} {dtype} on {limits.name}: {shared} bytes of shared memory"
        assert shared <= limits.max_shared_mem, f"{what}, past the card's {limits.max_shared_mem}"
        assert shared <= estimate(fn, kw, dtype, group), f"{what}, past the estimate {estimate(fn, kw, dtype, group)}"
