"""The CPU engine's attention (torch's fused SDPA: for decode over each KV head's group of query
heads, for prefill with the KV heads shared through enable_gqa) against the plain reference it
replaces, on fresh random caches each run."""
import pytest
import torch

from engine.core.step_plan import StepPlan
from engine.layers.paged_attention_torch import (
    StepContext,
    paged_decode_attention,
    paged_prefill_attention,
    sdpa_decode_attention,
    sdpa_prefill_attention,
)


def _caches(g, kv_heads, num_blocks=24, block_size=4, head_dim=16):
    return (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g),
            torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g))


def _decode_context(tables, lengths, block_size=4):
    plan = StepPlan(input_ids=[0] * len(lengths), positions=[n - 1 for n in lengths],
                    slot_mapping=[0] * len(lengths), cu_seqlens_q=list(range(len(lengths) + 1)),
                    context_lens=lengths, block_tables=tables, sample_rows=[], sample_params=[], is_decode=True)
    tensor = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)
    context = StepContext(plan, tensor, torch.tensor(lengths, dtype=torch.int32), block_size, torch.float32)
    return tensor, context


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (9, 3)])
@pytest.mark.parametrize("lengths", [[1, 4, 5, 17, 23], [23, 23], [9]])
def test_sdpa_decode_matches_the_reference(heads, kv_heads, lengths):
    """Scattered blocks, gathered into one padded batch (masked where lengths differ, or not).
    Slots no sequence has written hold NaN, as an uninitialised cache may: none may be read."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    k_cache, v_cache = _caches(g, kv_heads)
    # Descending block ids: a lone sequence's blocks are never one consecutive run here.
    tables = [sorted(torch.randperm(24, generator=g)[:-(-n // 4)].tolist(), reverse=True) for n in lengths]
    written = torch.zeros(24 * 4, dtype=torch.bool)
    for table, n in zip(tables, lengths):
        written[[table[p // 4] * 4 + p % 4 for p in range(n)]] = True
    k_cache.view(-1, kv_heads, 16)[~written] = float("nan")
    v_cache.view(-1, kv_heads, 16)[~written] = float("nan")
    tensor, context = _decode_context(tables, lengths)
    assert context.run_start is None and (context.mask is None) == (min(lengths) == max(lengths))
    q = torch.randn(len(lengths), heads, 16, generator=g)
    expected = paged_decode_attention(q, k_cache, v_cache, tensor, torch.tensor(lengths), 0.25)
    got = sdpa_decode_attention(q, k_cache, v_cache, context, 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [1, 4, 6, 23])
def test_sdpa_decode_reads_one_sequence_in_consecutive_blocks_in_place(length):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    k_cache, v_cache = _caches(g, 3)
    first = int(torch.randint(0, 24 - 6, (), generator=g))
    tensor, context = _decode_context([list(range(first, first + -(-length // 4)))], [length])
    assert context.run_start == first * 4 and context.slots is None
    q = torch.randn(1, 9, 16, generator=g)
    expected = paged_decode_attention(q, k_cache, v_cache, tensor, torch.tensor([length]), 0.25)
    torch.testing.assert_close(sdpa_decode_attention(q, k_cache, v_cache, context, 0.25), expected,
                               rtol=1e-5, atol=1e-5)


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
