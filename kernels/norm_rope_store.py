"""Per-head q/k RMSNorm, neox RoPE and the paged KV-cache store, fused into one kernel.

Between the fused qkv projection and attention, a decoder layer would otherwise launch four
kernels: rms_norm on q, rms_norm on k (Qwen3's q_norm/k_norm), a rotary kernel, and store_kv. Each moves a
few KB, so a batch-1 decode step pays launch and tail latency for them (~1.3-1.9 us per tiny
kernel on an H200), times four, times every layer. This kernel does all of it in one launch,
reading each q/k/v element once.

Numerics follow the unfused path: the norm squares and sums in fp32, rounds the normalized x to
qkv's dtype before the weight multiply (as engine.layers.norm.RMSNorm does) and rounds the
product again (the norm module's output); the rotation is computed in fp32 and rounded once
(the torch module rounds after each bf16 op; the difference is within bf16 tolerance).
"""
import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8 import as_cached


@triton.jit
def _norm_rope(ptrs, mask, w_ptr, j, jm, cos1, sin1, cos2, sin2, half, eps, HAS_NORM: tl.constexpr):
    """Rows of heads at `ptrs` (first halves; shape [rows, BLOCK_HALF]) normed and rotated, in
    fp32, rounded to the input dtype at the points the unfused path rounds."""
    dtype = ptrs.dtype.element_ty
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + half, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        w1 = tl.load(w_ptr + j, mask=jm, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + j, mask=jm, other=0.0).to(tl.float32)
        sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        rstd = tl.rsqrt(sq / (2 * half) + eps)[:, None]
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    # rotate_half(x) = [-x2, x1]
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


@triton.jit
def _norm_rope_store_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                            k_cache_ptr, v_cache_ptr, slot_ptr,
                            stride_t, stride_cos, stride_sin,
                            stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                            num_heads, num_kv_heads, group, half, eps,
                            HAS_NORM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            BLOCK_G: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    # One program per (token, kv head): the kv head and the q heads that share it. Batch-1
    # decode then still spreads over num_kv_heads SMs instead of one.
    token = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    pdl.wait(PDL)  # qkv, positions and slots come from earlier kernels; q and the caches are written
    head_dim = 2 * half
    row = qkv_ptr + token * stride_t

    pos = tl.load(pos_ptr + token).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    jm = j < half
    cos1 = tl.load(cos_ptr + pos * stride_cos + j, mask=jm, other=0.0)
    cos2 = tl.load(cos_ptr + pos * stride_cos + half + j, mask=jm, other=0.0)
    sin1 = tl.load(sin_ptr + pos * stride_sin + j, mask=jm, other=0.0)
    sin2 = tl.load(sin_ptr + pos * stride_sin + half + j, mask=jm, other=0.0)

    # q: normed, rotated and written back in place, for every token (padding ones included:
    # harmless, and it keeps the q output fully defined).
    g = tl.arange(0, BLOCK_G)[:, None]
    qm = (g < group) & jm
    q_ptrs = row + (kvh * group + g) * head_dim + j
    q1, q2 = _norm_rope(q_ptrs, qm, qw_ptr, j, jm, cos1, sin1, cos2, sin2, half, eps, HAS_NORM)
    tl.store(q_ptrs, q1.to(qkv_ptr.dtype.element_ty), mask=qm)
    tl.store(q_ptrs + half, q2.to(qkv_ptr.dtype.element_ty), mask=qm)

    # k and v only ever go to the cache; a padding token (slot -1) needs neither.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        k_ptrs = row + (num_heads + kvh) * head_dim + j
        k1, k2 = _norm_rope(k_ptrs, jm, kw_ptr, j, jm, cos1, sin1, cos2, sin2, half, eps, HAS_NORM)
        kc = k_cache_ptr + block * stride_kcb + offset * stride_kct + kvh * stride_kch + j
        # Via qkv's dtype first, so a cache of another dtype sees what the unfused path stored.
        tl.store(kc, as_cached(k1.to(qkv_ptr.dtype.element_ty), k_cache_ptr), mask=jm)
        tl.store(kc + half, as_cached(k2.to(qkv_ptr.dtype.element_ty), k_cache_ptr), mask=jm)

        v_ptrs = row + (num_heads + num_kv_heads + kvh) * head_dim + j
        vc = v_cache_ptr + block * stride_vcb + offset * stride_vct + kvh * stride_vch + j
        tl.store(vc, as_cached(tl.load(v_ptrs, mask=jm), v_cache_ptr), mask=jm)
        tl.store(vc + half, as_cached(tl.load(v_ptrs + half, mask=jm), v_cache_ptr), mask=jm)


def check_norm_rope_inputs(qkv, cos, sin, k_cache, v_cache, q_norm_weight, k_norm_weight, head_dim) -> bool:
    """The layout every kernel that norms and rotates q/k from a qkv row needs (this one and
    kernels.decode_attention's from-qkv kernel); returns whether q and k are normed."""
    assert (q_norm_weight is None) == (k_norm_weight is None), "q and k norms come together"
    for t in (qkv, cos, sin, k_cache, v_cache):
        assert t.stride(-1) == 1, "the last dimension must be contiguous"
    has_norm = q_norm_weight is not None
    if has_norm:
        assert q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()
        assert q_norm_weight.numel() == head_dim == k_norm_weight.numel()
    return has_norm


def norm_rope_store(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                    q_norm_weight=None, k_norm_weight=None, eps=1e-6) -> torch.Tensor:
    """From a fused qkv projection [tokens, (num_heads + 2 * num_kv_heads) * head_dim] (q heads,
    then k heads, then v heads; rows may be strided), in one launch:

    - q heads: RMSNorm'd by q_norm_weight [head_dim] (if given), rotated by the fp32 cos/sin
      caches [max_pos, head_dim] at `positions` [tokens], and written back IN PLACE into qkv;
    - k heads: normed by k_norm_weight (if given), rotated, and stored into k_cache
      [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping[t]
      (= block * block_size + offset; -1 skips the token);
    - v heads: stored unchanged into v_cache at the same slot.

    qkv's k and v columns are only read, never written. Padding tokens' q is still normed and
    rotated. Returns q as a view of qkv, [tokens, num_heads, head_dim] with strides
    (qkv.stride(0), head_dim, 1). Equivalent to q_norm/k_norm, RotaryEmbedding and store_kv in
    turn; no host sync, so it is CUDA-graph capturable.
    """
    tokens, width = qkv.shape
    assert num_heads % num_kv_heads == 0
    head_dim = width // (num_heads + 2 * num_kv_heads)
    assert width == (num_heads + 2 * num_kv_heads) * head_dim and head_dim % 2 == 0
    assert k_cache.shape[1:] == v_cache.shape[1:] and tuple(k_cache.shape[2:]) == (num_kv_heads, head_dim)
    has_norm = check_norm_rope_inputs(qkv, cos, sin, k_cache, v_cache, q_norm_weight, k_norm_weight, head_dim)
    # as_strided, not view: view would give a one-token q contiguous strides, not qkv's.
    q = qkv.as_strided((tokens, num_heads, head_dim), (qkv.stride(0), head_dim, 1), qkv.storage_offset())
    if tokens == 0:
        return q
    group, half = num_heads // num_kv_heads, head_dim // 2
    qw, kw = (q_norm_weight, k_norm_weight) if has_norm else (cos, cos)  # placeholders, never read
    pdl_mode = pdl.mode(qkv.device, tokens)
    _norm_rope_store_kernel[(tokens, num_kv_heads)](
        qkv, positions, cos, sin, qw, kw,
        k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_heads, num_kv_heads, group, half, eps,
        HAS_NORM=has_norm, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_G=triton.next_power_of_2(group), BLOCK_HALF=triton.next_power_of_2(half), PDL=pdl_mode,
        num_warps=2 if group * head_dim >= 1024 else 1, launch_pdl=pdl_mode > 0)
    return q
