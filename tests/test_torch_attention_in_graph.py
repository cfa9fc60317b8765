"""The torch backend's CUDA-graph variants (no host syncs, fixed shapes) against the ops they stand
in for, on CPU, where they run the same torch code: the K/V store with skipped rows (some, all,
none), and decode attention over whole tables whose entries past a sequence's blocks are junk."""
import pytest
import torch

from engine.layers.paged_attention_torch import (
    paged_decode_attention,
    sdpa_decode_attention_in_graph,
    store_kv,
    store_kv_in_graph,
)


def _generator():
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))


@pytest.mark.parametrize("skipped", ["some", "all", "none", "first"])
def test_the_graph_store_writes_what_store_kv_writes(skipped):
    g = _generator()
    tokens, num_blocks, block_size, kv_heads, head_dim = 9, 6, 4, 2, 8
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    skip = {"some": torch.rand(tokens, generator=g) < 0.4, "all": torch.ones(tokens, dtype=torch.bool),
            "none": torch.zeros(tokens, dtype=torch.bool), "first": torch.arange(tokens) < 3}[skipped]
    slots[skip] = -1
    key = torch.randn(tokens, kv_heads, head_dim, generator=g)
    # v as the model hands it over: a view of the qkv projection's rows.
    value = torch.randn(tokens, 3 * kv_heads * head_dim, generator=g)[:, -kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    caches = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    expected = caches.clone()
    store_kv(key, value, expected[0], expected[1], slots)
    store_kv_in_graph(key, value, caches[0], caches[1], slots)
    assert torch.equal(caches, expected)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (9, 3), (4, 4)])
def test_the_graph_decode_matches_the_reference_past_junk_table_entries(heads, kv_heads):
    g = _generator()
    num_blocks, block_size, head_dim, width = 20, 4, 16, 6
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    lengths = [1, 4, 5, 17, 24]
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in lengths]).to(torch.int32)
    for row, length in enumerate(lengths):  # past its blocks, a row of the graph's table holds anything
        used = -(-length // block_size)
        tables[row, used:] = torch.randint(-2**31, 2**31 - 1, (width - used,), generator=g, dtype=torch.int64).int()
    context_lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), heads, head_dim, generator=g)
    expected = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.25)
    # Every slot no sequence's context covers holds NaN, as a CPU cache nothing wrote may.
    covered = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for row, length in enumerate(lengths):
        for position in range(length):
            covered[tables[row, position // block_size].item() * block_size + position % block_size] = True
    for cache in (k_cache, v_cache):
        cache.view(num_blocks * block_size, -1)[~covered] = float("nan")
    got = sdpa_decode_attention_in_graph(q, k_cache, v_cache, tables, context_lens, 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
