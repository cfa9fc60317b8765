"""The C operations of a CPU decode step (engine/layers/native/decode_ops.c) against the torch code
they replace, on fresh random inputs each run, with their outputs poisoned (NaN) beforehand."""
import pytest
import torch
import torch.nn.functional as F

from engine.layers import native_cpu
from engine.layers.norm import rms_norm_float32
from engine.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(native_cpu.native_kernels() is None,
                                reason=f"no native kernels: {native_cpu.unavailable_reason()}")
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def poisoned(*shape) -> torch.Tensor:
    return torch.full(shape, float("nan"))


@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 64), (3, 20)])
@pytest.mark.parametrize("adds", [True, False])
def test_add_rms_norm_matches_the_torch_norm(rows, dim, adds):
    x, residual, weight = torch.randn(rows, dim), torch.randn(rows, dim) * 3, torch.randn(dim)
    expected_residual = residual + x if adds else residual.clone()
    out = poisoned(rows, dim)
    native_cpu.add_rms_norm(x if adds else None, residual, weight, 1e-5, out)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, rms_norm_float32(expected_residual, weight, 1e-5), **TOLERANCE)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 2, 128)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_rotates_q_and_k_and_stores_k_and_v_at_the_slots(heads, kv_heads, head_dim, qk_norm):
    rows, num_slots = 4, 64
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (rows,))
    cos, sin = rotary.rows(positions, torch.float32)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    q_norm, k_norm = (torch.randn(head_dim), torch.randn(head_dim)) if qk_norm else (None, None)
    slots = torch.randperm(num_slots)[:rows]
    k_cache, v_cache, q_out = poisoned(num_slots, kv_heads, head_dim), poisoned(num_slots, kv_heads, head_dim), \
        poisoned(rows, heads, head_dim)
    native_cpu.rope_store(qkv, heads, kv_heads, head_dim, cos.reshape(rows, head_dim).contiguous(),
                          sin.reshape(rows, head_dim).contiguous(), q_norm, k_norm, 1e-6, slots, k_cache, v_cache, q_out)

    q = qkv[:, :heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(rows, kv_heads, head_dim)
    if qk_norm:
        q, k = rms_norm_float32(q, q_norm, 1e-6), rms_norm_float32(k, k_norm, 1e-6)
    torch.testing.assert_close(q_out, RotaryEmbedding.apply(q, (cos, sin)), **TOLERANCE)
    torch.testing.assert_close(k_cache[slots], RotaryEmbedding.apply(k, (cos, sin)), **TOLERANCE)
    torch.testing.assert_close(v_cache[slots], v, rtol=0, atol=0)
    others = torch.ones(num_slots, dtype=torch.bool)
    others[slots] = False
    assert k_cache[others].isnan().all() and v_cache[others].isnan().all(), "only the rows' slots are written"


@pytest.mark.parametrize("rows,heads,kv_heads,head_dim", [(1, 9, 3, 64), (4, 9, 3, 64), (3, 8, 8, 16), (2, 16, 2, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_matches_sdpa_over_each_rows_slots(rows, heads, kv_heads, head_dim, threads):
    num_slots = 600
    lengths = torch.randint(1, 300, (rows,))
    width = int(lengths.max())
    # Each row's keys at scattered slots; the table past a row's length, and every slot no row
    # reads, hold garbage that must not reach the output.
    slot_table = torch.stack([torch.randperm(num_slots)[:width] for _ in range(rows)])
    k_cache, v_cache = poisoned(num_slots, kv_heads, head_dim), poisoned(num_slots, kv_heads, head_dim)
    for r in range(rows):
        used = slot_table[r, :lengths[r]]
        k_cache[used] = torch.randn(len(used), kv_heads, head_dim)
        v_cache[used] = torch.randn(len(used), kv_heads, head_dim)
    q, scale = torch.randn(rows, heads, head_dim), head_dim ** -0.5
    out = poisoned(rows, heads * head_dim)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native_cpu.decode_attention(q, k_cache, v_cache, slot_table, lengths, scale, out)
    finally:
        torch.set_num_threads(previous)
    for r in range(rows):
        used = slot_table[r, :lengths[r]]
        keys = k_cache[used].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)  # [heads, length, dim]
        values = v_cache[used].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        expected = F.scaled_dot_product_attention(q[r][:, None], keys, values, scale=scale)  # [heads, 1, dim]
        torch.testing.assert_close(out[r], expected.reshape(-1), **TOLERANCE)


@pytest.mark.parametrize("rows,n", [(1, 1536), (3, 40)])
def test_silu_mul_matches_torch(rows, n):
    gate_up = torch.randn(rows, 2 * n) * 4
    gate_up[0, :4] = torch.tensor([-200.0, -88.0, 90.0, 200.0])  # past where e^-x is clamped
    out = poisoned(rows, n)
    native_cpu.silu_mul(gate_up, out)
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(out, F.silu(gate) * up, **TOLERANCE)
