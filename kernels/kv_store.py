"""Writes new tokens' K/V into the paged cache."""
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8 import as_cached


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                     num_heads, head_dim,
                     BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    token = tl.program_id(0)
    pdl.wait(PDL)  # every program waits, even one that stores nothing (kernels/pdl.py says why)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    # int64 because a whole layer's cache can pass 2**31 elements.
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    t = token.to(tl.int64)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kct + h * stride_kch + d,
             as_cached(k, k_cache_ptr), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct + h * stride_vch + d,
             as_cached(v, v_cache_ptr), mask=mask)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatters key/value [tokens, kv_heads, head_dim] into k_cache/v_cache
    [num_blocks, block_size, kv_heads, head_dim] at slot_mapping[t] (= block * block_size + offset);
    slot -1 means skip. In place; no host sync, so it is CUDA-graph capturable."""
    tokens, num_heads, head_dim = key.shape
    if tokens == 0:
        return
    for t in (key, value, k_cache, v_cache):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    pdl_mode = pdl.mode(key.device, tokens)
    _store_kv_kernel[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), PDL=pdl_mode, num_warps=4 if num_heads * head_dim >= 1024 else 1,
        launch_pdl=pdl_mode > 0)
