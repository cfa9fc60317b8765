"""kernels/norm_rope_store.py against the unfused torch path (q_norm/k_norm RMSNorm modules, the
RotaryEmbedding module, paged_attention_torch.store_kv), on CPU through Triton's interpreter.

The rotation reference is the module's own forward run in fp32 and rounded once, which is what
the kernel promises. Caches are layer slices of a NaN-filled
tensor, so a store to a padding token's slot, or to any slot but the token's, shows up; qkv is a
column slice of a wider tensor, so its row stride is not its width.
"""
import importlib
import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from engine.layers.norm import RMSNorm  # noqa: E402
from engine.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.kernel_checks import assert_close, run_norm_rope_store  # noqa: E402

# By module path: the package's lazy exports may one day name the function the same.
nrs = importlib.import_module("kernels.norm_rope_store")


def _interpreted() -> bool:
    return type(nrs._norm_rope_store_kernel).__name__ == "InterpretedFunction"


if not _interpreted() and not torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] == "1":
    nrs = importlib.reload(nrs)  # imported before TRITON_INTERPRET was set: decorate it again
if _interpreted():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
MAX_POS = 512




def make_case(tokens, heads, kv_heads, head_dim, block_size, dtype, with_norm, slot_dtype=torch.int64):
    width = (heads + 2 * kv_heads) * head_dim
    wide = torch.randn(tokens, width + 3 * head_dim).to(dtype).to(DEVICE)
    qkv = wide[:, head_dim:head_dim + width]
    positions = torch.randint(0, MAX_POS, (tokens,)).to(DEVICE)
    num_blocks = (tokens + block_size - 1) // block_size + 2
    # Distinct slots scattered over the blocks; with several tokens, some padding (-1) and some not.
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    if tokens > 1:
        real = slots.clone()
        slots[torch.rand(tokens) < 0.25] = -1
        pad = random.randrange(tokens)
        slots[pad] = -1
        slots[pad - 1] = real[pad - 1]
    caches = torch.full((2, 3, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    rope = RotaryEmbedding(head_dim, MAX_POS, 1e6).to(DEVICE)
    norms = (None, None)
    if with_norm:
        norms = tuple(RMSNorm(head_dim, 1e-6).to(DEVICE) for _ in range(2))
        for n in norms:
            n.weight.data = (1 + 0.1 * torch.randn(head_dim)).to(dtype).to(DEVICE)
    return wide, qkv, positions, slots.to(slot_dtype).to(DEVICE), caches, rope, norms


CASES = [
    # tokens, heads, kv_heads, head_dim, block_size, dtype, with_norm, slot dtype
    (5, 4, 4, 64, 16, F32, True, torch.int64),       # group 1
    (17, 4, 2, 128, 32, BF16, True, torch.int32),    # group 2
    (17, 8, 2, 64, 16, BF16, False, torch.int64),    # group 4, Qwen2/Llama: no q/k norm
    (5, 8, 1, 128, 32, F32, False, torch.int64),     # group 8
    (1, 16, 2, 128, 16, BF16, True, torch.int64),    # group 8, one decode token
    (5, 16, 8, 128, 16, BF16, True, torch.int64),    # Qwen3-0.6B's heads
    (5, 6, 2, 64, 32, F16, True, torch.int32),       # group 3
]


@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim, block_size, dtype, with_norm, slot_dtype", CASES)
def test_norm_rope_store(tokens, heads, kv_heads, head_dim, block_size, dtype, with_norm, slot_dtype):
    wide, qkv, positions, slots, caches, rope, (q_norm, k_norm) = make_case(
        tokens, heads, kv_heads, head_dim, block_size, dtype, with_norm, slot_dtype)
    wide_before = wide.clone()
    got_q, want_q, expected = run_norm_rope_store(nrs.norm_rope_store, qkv, positions, rope, caches, slots, heads,
                                                  kv_heads, q_norm, k_norm)
    q_cols = heads * head_dim
    assert_close(got_q, want_q, dtype)
    # Only qkv's q columns are written: its k/v columns and the wider tensor's others stay.
    untouched = torch.ones(wide.shape[1], dtype=torch.bool)
    untouched[head_dim:head_dim + q_cols] = False
    assert torch.equal(wide[:, untouched], wide_before[:, untouched])
    # Padding tokens' slots, and every slot no token maps to, keep their NaN.
    rtol, atol = {F32: (1e-4, 1e-5), F16: (3e-3, 3e-3), BF16: (3e-2, 3e-2)}[dtype]
    torch.testing.assert_close(caches[0], expected[0], rtol=rtol, atol=atol, equal_nan=True)
    torch.testing.assert_close(caches[1], expected[1], rtol=0, atol=0, equal_nan=True)


def test_zero_tokens():
    wide, qkv, positions, slots, caches, rope, _ = make_case(0, 4, 2, 64, 16, BF16, False)
    q = nrs.norm_rope_store(qkv, positions, rope.cos, rope.sin, caches[0, 1], caches[1, 1], slots, 4, 2)
    assert q.shape == (0, 4, 64) and caches.isnan().all()
