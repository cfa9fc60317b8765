"""kernels/decode_attention.py's one-launch decode (the last split merges) and its from-qkv variant
on a GPU at real shapes (head_dim 128, bf16, Qwen3's 8 KV heads), where the splits of a sequence
really race: called twice on the same counters, and captured in a CUDA graph of four layers with
PDL on (where the GPU has it), replayed several times with new inputs.

Run with TRITON_INTERPRET unset or 0. Fresh random inputs each run; the seed is printed on failure.
Outputs and split partials are allocated NaN-filled, so an element left unwritten, or a partial
merged before it was written, fails.
"""
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

triton = pytest.importorskip("triton")

from engine.layers import paged_attention_torch as ref  # noqa: E402
from kernels import decode_attention, pdl  # noqa: E402
from tests.gpu.test_kernels_gpu import make_paged_kv  # noqa: E402
from tests.kernel_checks import DecodeStep, assert_close, capture, poison  # noqa: E402,F401 (fixtures)

if type(decode_attention._decode_kernel).__name__ == "InterpretedFunction":
    pytest.skip("kernels were imported under TRITON_INTERPRET=1", allow_module_level=True)

BF16, F32 = torch.bfloat16, torch.float32
HEAD_DIM = 128

CASES = [
    # block_size, kv_heads, group, batch, context range, num_splits, dtype
    (16, 8, 2, 1, (512, 512), None, BF16),      # Qwen3-0.6B batch-1 decode
    (16, 8, 2, 1, (8192, 8192), None, BF16),    # every split has a share
    (16, 8, 2, 8, (1, 4096), None, BF16),
    (256, 8, 2, 4, (1, 8192), None, BF16),
    (16, 4, 4, 2, (1, 3000), 64, BF16),         # more splits than a merge tile
    (32, 8, 1, 16, (1, 2000), None, BF16),
    (16, 2, 8, 3, (100, 5000), 24, F32),
    (16, 8, 2, 24, (1, 3000), None, F32),       # one-warp programs (a pair for every SM), split
]


@pytest.mark.parametrize("block_size, kv_heads, group, batch, ctx_range, num_splits, dtype", CASES)
def test_one_launch_decode(block_size, kv_heads, group, batch, ctx_range, num_splits, dtype, poison):
    counters = decode_attention.split_counters(torch.device("cuda"))
    for _ in range(2):
        lens = [random.randint(*ctx_range) for _ in range(batch)]
        k_cache, v_cache, tables = make_paged_kv(lens, block_size, kv_heads, dtype)
        q = torch.randn(batch, kv_heads * group, HEAD_DIM, device="cuda").to(dtype)
        context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        with poison():
            out = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, HEAD_DIM ** -0.5,
                                                          num_splits, counters=counters)
        assert_close(out, ref.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, HEAD_DIM ** -0.5),
                     dtype)
        assert (counters == 0).all()


@pytest.mark.parametrize("batch, ctx_range", [(2, (1, 4096)), (24, (1, 3000)), (256, (500, 700))])
def test_one_launch_decode_over_an_fp8_cache(batch, ctx_range, poison):
    """bf16 queries over an e4m3 cache in four-warp programs (batch 2) and one-warp ones (8 KV
    heads: a (sequence, KV head) pair for every SM of an H100 or H200), split and not."""
    counters = decode_attention.split_counters(torch.device("cuda"))
    lens = [random.randint(*ctx_range) for _ in range(batch)]
    # Made in bf16 and then narrowed: CUDA cannot fill e4m3 slots by a boolean mask. NaN stays NaN.
    k_cache, v_cache, tables = make_paged_kv(lens, 16, 8, BF16)
    k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    q = torch.randn(batch, 16, HEAD_DIM, device="cuda").to(BF16)
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    with poison():
        out = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, HEAD_DIM ** -0.5,
                                                      counters=counters)
    assert_close(out, ref.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, HEAD_DIM ** -0.5), BF16)
    assert (counters == 0).all()


@pytest.mark.parametrize("block_size, batch, ctx_range", [(16, 1, (512, 512)), (16, 8, (1, 4096)),
                                                          (256, 4, (1, 8192)), (16, 64, (1, 2000))])
def test_decode_from_qkv(block_size, batch, ctx_range, poison):
    lens = [random.randint(*ctx_range) for _ in range(batch)]
    k_cache, v_cache, tables = make_paged_kv(lens, block_size, 8, BF16)
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    step = DecodeStep(k_cache, v_cache, tables, context_lens, 16, BF16, True, padding=[batch - 1] if batch > 1 else [],
                      max_pos=8192)
    want = step.reference()
    counters = decode_attention.split_counters(torch.device("cuda"))
    with poison():
        out = step.run(decode_attention, counters=counters)
    step.check(out, want)
    assert (counters == 0).all()


def test_cuda_graph_of_layers_with_pdl():
    """Four layers, each the from-qkv kernel then the plain one on the same cache (a torch op
    between), on one counter buffer, captured once with PDL on where the GPU has it, and replayed
    five times with new caches, tables, contexts (a padding row of context 1 included) and qkv."""
    layers, batch, kv_heads, heads, block_size, width = 4, 4, 8, 16, 16, 128
    assert pdl.enabled(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    counters = decode_attention.split_counters(torch.device("cuda"))
    num_blocks = batch * width + 8
    caches = torch.empty(2, layers, num_blocks, block_size, kv_heads, HEAD_DIM, dtype=BF16, device="cuda")
    tables = torch.empty(layers, batch, width, dtype=torch.int32, device="cuda")
    context_lens = torch.empty(layers, batch, dtype=torch.int32, device="cuda")

    def new_steps():
        """Fresh values in the captured tensors; qkv, positions and slots in the steps' own."""
        caches.normal_()
        steps = []
        for layer in range(layers):
            tables[layer].copy_(torch.randperm(num_blocks, device="cuda")[:batch * width].view(batch, width))
            lens = [1] + [random.randint(2, width * block_size) for _ in range(batch - 1)]
            context_lens[layer].copy_(torch.tensor(lens))
            steps.append(DecodeStep(caches[0, layer], caches[1, layer], tables[layer], context_lens[layer], heads,
                                    BF16, True, padding=[0], max_pos=width * block_size))
        return steps

    captured = new_steps()

    def forward():
        outs = []
        for s in captured:
            o = s.run(decode_attention, counters=counters)
            q = (o * 1.5).to(BF16)
            outs.append((o, decode_attention.paged_decode_attention(q, s.k_cache, s.v_cache, s.tables, s.context_lens,
                                                                    s.scale, counters=counters)))
        return outs

    graph, outs = capture(forward)
    for _ in range(5):
        for s, fresh in zip(captured, new_steps()):
            s.qkv.copy_(fresh.qkv)
            s.positions.copy_(fresh.positions)
            s.slots.copy_(fresh.slots)
        wants = [s.reference() for s in captured]
        graph.replay()
        for s, want, (o, o2) in zip(captured, wants, outs):
            s.check(o, want)
            q = (want[0] * 1.5).to(BF16)
            assert_close(o2, ref.paged_decode_attention(q, want[1], want[2], s.tables, s.context_lens, s.scale), BF16)
        assert (counters == 0).all()
