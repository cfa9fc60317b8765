"""Neox-style rotary embedding (rotate halves) applied to q and k in place."""
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, token, num_heads, cos1, sin1, cos2, sin2, half,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (j < half)
    first = x_ptr + token * stride_t + h * stride_h + j
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x) = [-x2, x1]
    tl.store(first, (x1 * cos1 - x2 * sin1).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * cos2 + x1 * sin2).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
                   num_q_heads, num_k_heads, half,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    jm = j < half
    cos1 = tl.load(cos_ptr + pos * stride_cos + j, mask=jm, other=0.0)
    cos2 = tl.load(cos_ptr + pos * stride_cos + half + j, mask=jm, other=0.0)
    sin1 = tl.load(sin_ptr + pos * stride_sin + j, mask=jm, other=0.0)
    sin2 = tl.load(sin_ptr + pos * stride_sin + half + j, mask=jm, other=0.0)
    _rotate(q_ptr, stride_qt, stride_qh, token, num_q_heads, cos1, sin1, cos2, sin2, half,
            BLOCK_HQ, BLOCK_HALF)
    _rotate(k_ptr, stride_kt, stride_kh, token, num_k_heads, cos1, sin1, cos2, sin2, half,
            BLOCK_HK, BLOCK_HALF)


def apply_rotary(q, k, positions, cos, sin):
    """Rotates q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] IN PLACE by the
    fp32 cos/sin caches [max_pos, head_dim] at `positions` [tokens], as
    engine.layers.rotary.RotaryEmbedding does (but in fp32, rounded once). q and k may be strided
    views (e.g. of a fused qkv output) as long as head_dim is contiguous. Returns (q, k)."""
    tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert head_dim % 2 == 0
    half = head_dim // 2
    if tokens:
        _rotary_kernel[(tokens,)](
            q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), sin.stride(0), num_q_heads, num_k_heads, half,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_k_heads),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4)
    return q, k
