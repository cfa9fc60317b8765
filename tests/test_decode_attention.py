"""kernels/decode_attention.py's one-launch decode (the last split to finish merges the others) and
its variant that norms, rotates and stores the new token's K/V itself, against the torch
reference, on CPU through Triton's interpreter.

Inputs are fresh random numbers each run; outputs are allocated NaN-filled, so an element left
unwritten fails. Every call shares one counter buffer, checked zeroed after each call, so a
second call in a row would see a counter the first left behind.
"""
import random

import pytest
import torch

from engine.layers import paged_attention_torch as ref
from kernels import decode_attention  # noqa: E402 (after test_kernels chose the interpreter)
from tests.kernel_checks import DecodeStep, assert_close, poison  # noqa: F401 (fixtures)
from tests.test_kernels import DEVICE, make_paged_kv, random_contexts

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _counters():
    return decode_attention.split_counters(torch.device(DEVICE))


def _every_row_moved(batch: int) -> torch.Tensor:
    """A seq_order that starts no sequence in its row's place."""
    return torch.arange(batch, device=DEVICE, dtype=torch.int32).roll(1)


# num_warps: 1 runs a split's whole tiles without position masks and the last one with them, 4 runs
# one masked loop (decode_attention._attend); None is the default launch's, 1 off CUDA.
CASES = [
    # block_size, group, dtype, num_splits, block_n, head_dim, num_warps
    (16, 2, BF16, 12, 16, 32, None),   # more splits than a merge tile holds; short contexts use few
    (16, 1, F32, 5, 16, 32, 4),
    (256, 4, F32, 3, 16, 64, None),    # several splits inside one block
    (32, 3, F16, 4, 16, 32, 4),        # a group that is not a power of two
    (16, 8, BF16, 2, 32, 32, 1),
]


@pytest.mark.parametrize("block_size, group, dtype, num_splits, block_n, head_dim, num_warps", CASES)
def test_one_launch_decode_twice(block_size, group, dtype, num_splits, block_n, head_dim, num_warps, poison):
    """Two calls in a row on the same counters, with other queries and contexts, the second
    starting its sequences out of row order (seq_order), and the two-kernel form (merge_kernel) on
    the same inputs."""
    kv_heads, counters = 2, _counters()
    for call in range(2):
        lens = random_contexts(4, block_size, max_blocks=2 if block_size == 256 else 4)
        k_cache, v_cache, tables = make_paged_kv(lens, block_size, kv_heads, dtype, head_dim)
        q = torch.randn(len(lens), kv_heads * group, head_dim, device=DEVICE).to(dtype)
        context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        scale = head_dim ** -0.5
        want = ref.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale)
        with poison():
            out = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale,
                                                          num_splits, counters=counters, block_n=block_n,
                                                          num_warps=num_warps,
                                                          seq_order=_every_row_moved(len(lens)) if call else None)
        assert_close(out, want, dtype)
        assert (counters == 0).all(), "a counter was left set"
    with poison():
        two = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale,
                                                      num_splits, merge_kernel=True, block_n=block_n,
                                                      num_warps=num_warps)
    assert_close(two, want, dtype)


@pytest.mark.parametrize("from_qkv", [False, True])
def test_programs_attend_for_the_sequences_seq_order_lists(from_qkv, poison):
    """Programs take their sequence from seq_order: listing sequences 2 and 0 twice each (one split,
    so no counter to race on) writes rows 2 and 0, right, and leaves rows 1 and 3 unwritten."""
    lens = [30, 50, 20, 40]
    k_cache, v_cache, tables = make_paged_kv(lens, 16, 2, F32, 32)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    order = torch.tensor([2, 2, 0, 0], dtype=torch.int32, device=DEVICE)
    if from_qkv:
        step = DecodeStep(k_cache, v_cache, tables, context_lens, 4, F32, True, padding=[])
        want = step.reference()[0]
        with poison():
            out = step.run(decode_attention, num_splits=1, seq_order=order)
    else:
        q = torch.randn(len(lens), 4, 32, device=DEVICE)
        want = ref.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.2)
        with poison():
            out = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.2, 1,
                                                          seq_order=order)
    assert_close(out[[0, 2]], want[[0, 2]], F32)
    assert out[[1, 3]].isnan().all()


def test_padding_rows(poison):
    """A CUDA-graph padding row reads one cached token (context 1) or none (context 0, output 0),
    between sequences long enough to use every split."""
    dtype, block_size, kv_heads, group, head_dim = BF16, 16, 2, 2, 32
    lens = [1, 100, 0, 1, 64]
    k_cache, v_cache, tables = make_paged_kv(lens, block_size, kv_heads, dtype, head_dim)
    q = torch.randn(len(lens), kv_heads * group, head_dim, device=DEVICE).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    counters = _counters()
    with poison():
        out = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.2, 6,
                                                      counters=counters, block_n=16)
    assert_close(out, ref.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.2), dtype)
    assert (out[2] == 0).all() and (counters == 0).all()


FROM_QKV_CASES = [
    # heads, kv_heads, head_dim, block_size, dtype, with_norm, num_splits, block_n, num_warps
    (4, 2, 32, 16, BF16, True, 6, 16, None),    # the new token's split is any of several
    (4, 4, 64, 16, F32, True, 1, None, 4),      # group 1, one split
    (8, 2, 32, 32, BF16, False, 3, 16, None),   # Qwen2/Llama: no q/k norm
    (6, 2, 32, 256, F16, True, 4, 16, 4),       # group 3, a block bigger than the context
    (16, 8, 128, 16, BF16, True, 2, 32, None),  # Qwen3-0.6B's heads
]


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, dtype, with_norm, num_splits, block_n, num_warps",
                         FROM_QKV_CASES)
def test_decode_from_qkv(heads, kv_heads, head_dim, block_size, dtype, with_norm, num_splits, block_n, num_warps,
                         poison):
    """Against norm_rope_store's unfused reference followed by the reference attention, with
    padding rows (slot -1, context 1: they store nothing and read their one cached token), the
    sequences started out of row order."""
    lens = [random.randint(2, 5 * 16) for _ in range(3)] + [1, 1] + [block_size + 1]
    random.shuffle(lens)
    k_cache, v_cache, tables = make_paged_kv(lens, block_size, kv_heads, dtype, head_dim)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    step = DecodeStep(k_cache, v_cache, tables, context_lens, heads, dtype, with_norm, padding=[lens.index(1)])
    qkv_before = step.qkv.clone()
    want = step.reference()
    counters = _counters()
    with poison():
        out = step.run(decode_attention, num_splits=num_splits, counters=counters, block_n=block_n,
                       num_warps=num_warps, seq_order=_every_row_moved(len(lens)))
    step.check(out, want)
    assert torch.equal(step.qkv, qkv_before), "qkv is only read"
    assert (counters == 0).all()


def test_caches_of_two_layouts_are_refused():
    """The kernels find a token's K and V at one offset; a V cache laid out otherwise (here each
    block head-major) would be read at the wrong rows, so it is refused, by the prefill attention
    too."""
    from kernels import prefill_attention

    k_cache, v_cache, tables = make_paged_kv([20, 5], 16, 2, F32)
    other = v_cache.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, other strides
    q = torch.randn(2, 4, k_cache.shape[-1], device=DEVICE)
    lens = torch.tensor([20, 5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="one layout"):
        decode_attention.paged_decode_attention(q, k_cache, other, tables, lens, 0.1)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="one layout"):
        prefill_attention.paged_prefill_attention(q, k_cache, other, cu, lens, tables, 0.1)
