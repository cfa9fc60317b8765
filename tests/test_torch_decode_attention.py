"""The CPU engine's decode attention (SDPA over each KV head's group of query heads) against the
plain reference it replaces, on fresh random caches each run."""
import pytest
import torch

from engine.layers.paged_attention_torch import paged_decode_attention, sdpa_decode_attention


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (9, 3)])
def test_sdpa_decode_matches_the_reference(heads, kv_heads):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    block_size, head_dim, num_blocks = 4, 16, 24
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    lengths = [1, 4, 5, 17, 23]
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:6] for _ in lengths]).to(torch.int32)
    context_lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), heads, head_dim, generator=g)
    expected = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.25)
    got = sdpa_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
