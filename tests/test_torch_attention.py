"""The CPU engine's attention (torch's fused SDPA: for decode over each KV head's group of query
heads, for prefill with the KV heads shared through enable_gqa) against the plain reference it
replaces, on fresh random caches each run."""
import pytest
import torch

from engine.layers.paged_attention_torch import (
    paged_decode_attention,
    paged_prefill_attention,
    sdpa_decode_attention,
    sdpa_prefill_attention,
)


def _caches(g, kv_heads, num_blocks=24, block_size=4, head_dim=16):
    return (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g),
            torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g))


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (9, 3)])
def test_sdpa_decode_matches_the_reference(heads, kv_heads):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    k_cache, v_cache = _caches(g, kv_heads)
    lengths = [1, 4, 5, 17, 23]
    tables = torch.stack([torch.randperm(24, generator=g)[:6] for _ in lengths]).to(torch.int32)
    context_lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), heads, 16, generator=g)
    expected = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.25)
    got = sdpa_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (9, 3)])
def test_sdpa_prefill_matches_the_reference(heads, kv_heads):
    """Whole prompts (causal), chunks after a cached prefix (masked), one query, and an empty row."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    k_cache, v_cache = _caches(g, kv_heads)
    queries_and_lengths = [(5, 5), (3, 17), (1, 9), (0, 4), (23, 23), (8, 20)]
    tables = torch.stack([torch.randperm(24, generator=g)[:6] for _ in queries_and_lengths]).to(torch.int32)
    context_lens = torch.tensor([length for _, length in queries_and_lengths], dtype=torch.int32)
    cu = torch.tensor([0] + [n for n, _ in queries_and_lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, 16, generator=g)
    expected = paged_prefill_attention(q, k_cache, v_cache, cu, context_lens, tables, 0.25)
    got = sdpa_prefill_attention(q, k_cache, v_cache, cu, context_lens, tables, 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
