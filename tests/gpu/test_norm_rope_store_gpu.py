"""kernels/norm_rope_store.py on a GPU at real shapes (Qwen3's 16 q / 8 kv heads of 128, bf16,
1 and 256 tokens, block sizes 16 and 256), against the unfused torch path, plus CUDA-graph capture.

Run with TRITON_INTERPRET unset or 0. Fresh random inputs each run; the seed is printed on failure.
Caches are NaN-filled layer slices, so a store to a padding token's slot, or anywhere but the
token's slot, fails.
"""
import importlib
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

triton = pytest.importorskip("triton")

from engine.layers.norm import RMSNorm  # noqa: E402
from engine.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.kernel_checks import (  # noqa: E402
    assert_close,
    capture,
    norm_rope_store_reference,
    run_norm_rope_store,
)

nrs = importlib.import_module("kernels.norm_rope_store")
if type(nrs._norm_rope_store_kernel).__name__ == "InterpretedFunction":
    pytest.skip("kernels were imported under TRITON_INTERPRET=1", allow_module_level=True)

BF16 = torch.bfloat16
MAX_POS = 40960




def make_case(tokens, heads, kv_heads, head_dim, block_size, with_norm):
    num_blocks = 2 * tokens // block_size + 8
    width = (heads + 2 * kv_heads) * head_dim
    wide = torch.randn(tokens, width + 2 * head_dim, device="cuda").to(BF16)
    qkv = wide[:, head_dim:head_dim + width]
    positions = torch.randint(0, MAX_POS, (tokens,), device="cuda")
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    if tokens > 1:
        slots[torch.rand(tokens, device="cuda") < 0.1] = -1
    caches = torch.full((2, 2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=BF16, device="cuda")
    rope = RotaryEmbedding(head_dim, MAX_POS, 1e6).cuda()
    norms = (None, None)
    if with_norm:
        norms = tuple(RMSNorm(head_dim, 1e-6).cuda() for _ in range(2))
        for n in norms:
            n.weight.data = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(BF16)
    return wide, qkv, positions, slots, caches, rope, norms


CASES = [
    # tokens, heads, kv_heads, head_dim, block_size, with_norm
    (1, 16, 8, 128, 16, True),     # Qwen3-0.6B batch-1 decode
    (256, 16, 8, 128, 16, True),
    (256, 16, 8, 128, 256, False),  # Qwen2/Llama: no q/k norm
    (1, 32, 4, 128, 256, True),    # group 8
    (256, 32, 32, 64, 16, True),   # group 1, head_dim 64
    (256, 28, 4, 128, 32, False),  # group 7
]


@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim, block_size, with_norm", CASES)
def test_norm_rope_store(tokens, heads, kv_heads, head_dim, block_size, with_norm):
    wide, qkv, positions, slots, caches, rope, (q_norm, k_norm) = make_case(
        tokens, heads, kv_heads, head_dim, block_size, with_norm)
    slots = slots.int() if random.random() < 0.5 else slots
    wide_before = wide.clone()
    got_q, want_q, expected = run_norm_rope_store(nrs.norm_rope_store, qkv, positions, rope, caches, slots, heads,
                                                  kv_heads, q_norm, k_norm)
    assert_close(got_q, want_q, BF16)
    untouched = torch.ones(wide.shape[1], dtype=torch.bool, device="cuda")
    untouched[head_dim:head_dim + heads * head_dim] = False
    assert torch.equal(wide[:, untouched], wide_before[:, untouched])
    torch.testing.assert_close(caches[0], expected[0], rtol=3e-2, atol=3e-2, equal_nan=True)
    torch.testing.assert_close(caches[1], expected[1], rtol=0, atol=0, equal_nan=True)


def test_cuda_graph():
    """Captured once, replayed with other inputs, positions and slots (padding included): nothing
    may depend on their values on the host."""
    tokens, heads, kv_heads, head_dim, block_size = 8, 16, 8, 128, 16
    wide, qkv, positions, slots, caches, rope, (q_norm, k_norm) = make_case(
        tokens, heads, kv_heads, head_dim, block_size, True)

    def step():
        return nrs.norm_rope_store(qkv, positions, rope.cos, rope.sin, caches[0, 1], caches[1, 1], slots,
                                   heads, kv_heads, q_norm.weight, k_norm.weight, 1e-6)

    graph, q = capture(step)

    _, qkv_b, positions_b, slots_b, _, _, _ = make_case(tokens, heads, kv_heads, head_dim, block_size, True)
    slots_b[0] = -1
    qkv.copy_(qkv_b)
    positions.copy_(positions_b)
    slots.copy_(slots_b)
    caches.fill_(float("nan"))
    expected = caches.clone()
    with torch.no_grad():
        want_q = norm_rope_store_reference(qkv.clone(), positions, rope, expected[0, 1], expected[1, 1], slots,
                                           heads, kv_heads, q_norm, k_norm)
    graph.replay()
    assert_close(q, want_q, BF16)
    torch.testing.assert_close(caches, expected, rtol=3e-2, atol=3e-2, equal_nan=True)
