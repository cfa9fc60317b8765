"""Qwen3-MoE and block-FP8 weights on a CUDA device (skipped without one; run with TRITON_INTERPRET
unset or 0):
- kernels/fused_moe.py and kernels/fp8.py compiled, at Qwen3-30B-A3B's and Qwen3-8B's shapes in
  bf16, against the torch references, eagerly and replayed from a CUDA graph with new inputs (a
  host sync or a shape taken from the routing fails the capture), and beside rows of NaN and
  infinities (a CUDA graph's padding rows), which must not crash the step;
- the engine on tiny checkpoints in float32, eagerly and with CUDA graphs, against HF transformers
  token for token: a Qwen3-MoE (batches of 1-8 and beyond, prefix hits, preemption), and FP8
  checkpoints, dense and MoE, whose weights stay FP8 on the GPU;
- quantization="fp8" on a float checkpoint, and the benchmark configs' real shapes (random
  weights) building, capturing their graphs and decoding.

Fresh random inputs each run; the seed is printed on failure."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

triton = pytest.importorskip("triton")

from benchmarks.common import CONFIGS  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.layers import fp8 as fp8_layer  # noqa: E402
from engine.layers.fp8 import dequantize_blocks  # noqa: E402
from kernels import fp8, fused_moe  # noqa: E402
from tests.conftest import hf_greedy, random_prompts, save_tiny_hf_model  # noqa: E402
from tests.gpu import thread_stack  # noqa: E402
from tests.kernel_checks import (  # noqa: E402,F401 (fixtures)
    assert_close,
    capture,
    fp8_blocks,
    fp8_dequantized,
    moe_reference,
    poison,
    quantized_rows_reference,
)
from tests.test_fp8_checkpoint import write_fp8_checkpoint  # noqa: E402

if type(fused_moe._route_kernel).__name__ == "InterpretedFunction":
    pytest.skip("kernels were imported under TRITON_INTERPRET=1", allow_module_level=True)

BF16, F32 = torch.bfloat16, torch.float32
HAS_FP8 = torch.cuda.get_device_capability() >= (8, 9)
needs_fp8 = pytest.mark.skipif(not HAS_FP8, reason="needs FP8 (compute capability 8.9 or more)")
needs_cublas_blocks = pytest.mark.skipif(not fp8_layer.cublas_block_scaling(torch.device("cuda")),
                                         reason="cuBLAS's block-scaled FP8 needs a Hopper GPU and CUDA 12.9")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# A fixed KV cache: engines in other test processes share the GPU (see conftest.py).
ENGINE = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=16, num_kvcache_blocks=512)
# Qwen3-30B-A3B's experts: hidden 2048, 768 columns each, 128 of them, 8 chosen a token.
E, H, INTER, TOP_K = 128, 2048, 768, 8


def experts(dtype, e=E, h=H, inter=INTER):
    w13 = (torch.randn(e, 2 * inter, h, device="cuda") / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, device="cuda") / inter ** 0.5).to(dtype)
    return w13, w2


def routing(T, e=E, top_k=TOP_K):
    logits = torch.randn(T, e, device="cuda")
    return fused_moe.route(logits, top_k, True)


# --- kernels ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 3, 8, 9, 200])
def test_route_matches_torch(T, poison):
    logits = torch.randn(T, E, device="cuda")  # float32: bf16's would tie, and ties may order either way
    with poison():
        weights, ids = fused_moe.route(logits, TOP_K, True)
    want_w, want_ids = torch.topk(torch.softmax(logits, -1), TOP_K, -1)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w / want_w.sum(-1, keepdim=True))


def test_route_gives_rows_with_nan_or_infinite_logits_distinct_experts_in_range(poison):
    """A prefill graph's padding rows hold whatever their buffers held; an expert id of E from a
    NaN row crashed the engine's start-up with a device-side assert (in the sort's scatter)."""
    logits = torch.randn(5, E, device="cuda").to(BF16)
    logits[1] = float("nan")
    logits[2, 9] = float("inf")
    logits[3] = float("-inf")
    with poison():
        weights, ids = fused_moe.route(logits, TOP_K, True)
    ids = ids.cpu()
    assert ((ids >= 0) & (ids < E)).all(), ids
    assert all(len(set(row)) == TOP_K for row in ids.tolist())
    assert weights[1:4].isnan().all()
    want_w, want_ids = torch.topk(torch.softmax(logits[[0, 4]].float(), -1), TOP_K, -1)
    torch.testing.assert_close(weights[[0, 4]], want_w / want_w.sum(-1, keepdim=True))


@pytest.mark.parametrize("T", [8, 300])
def test_fused_moe_leaves_finite_rows_alone_beside_rows_of_garbage(T, poison):
    """NaN and infinite rows routed through a router and route(), as a CUDA graph's padding rows
    are: the step runs, and every finite row matches the reference."""
    x = torch.randn(T, H, device="cuda").to(BF16)
    x[1] = float("nan")
    x[T - 2, 7] = float("inf")
    router = (torch.randn(E, H, device="cuda") / H ** 0.5).to(BF16)
    w13, w2 = experts(BF16)
    weights, ids = fused_moe.route(x @ router.T, TOP_K, True)
    with poison():
        out = fused_moe.fused_moe(x, w13, w2, weights, ids)
    torch.cuda.synchronize()  # a device-side assert surfaces here, in this test
    good = [t for t in range(T) if t not in (1, T - 2)]
    assert_close(out[good], moe_reference(x[good], w13, w2, weights[good], ids[good]), BF16)


@pytest.mark.parametrize("T, inter", [(1, INTER), (4, INTER), (8, INTER), (9, INTER), (64, INTER), (1, INTER // 2),
                                      (2, INTER // 2), (8, INTER // 2)])
def test_fused_moe_at_30b_a3b_shapes_in_bf16(T, inter, poison):
    """The GEMV path up to 8 tokens, the grouped GEMMs beyond; the experts' rows whole and in their
    tensor-parallel halves, whose down projection takes every chosen expert in each step."""
    x = torch.randn(T, H, device="cuda").to(BF16)
    w13, w2 = experts(BF16, inter=inter)
    weights, ids = routing(T)
    with poison():
        out = fused_moe.fused_moe(x, w13, w2, weights, ids)
    assert_close(out, moe_reference(x, w13, w2, weights, ids), BF16)


@pytest.mark.parametrize("T", [2, 40])
def test_fused_moe_with_every_token_on_one_expert_and_the_rest_idle(T, poison):
    x = torch.randn(T, H, device="cuda").to(BF16)
    w13, w2 = experts(BF16)
    weights = torch.ones(T, 1, device="cuda")
    ids = torch.full((T, 1), 77, dtype=torch.int32, device="cuda")
    with poison():
        out = fused_moe.fused_moe(x, w13, w2, weights, ids)
    assert_close(out, moe_reference(x, w13, w2, weights, ids), BF16)


@needs_fp8
@pytest.mark.parametrize("T, inter", [(1, INTER), (2, INTER), (8, INTER), (64, INTER), (1, INTER // 2), (5, INTER // 2)])
def test_fused_moe_with_fp8_experts(T, inter, poison):
    """Both paths' tiles at Qwen3-30B-A3B's experts and at their halves under tensor parallelism:
    the GEMV's at one token and at 2-8, the grouped GEMMs' beyond."""
    x = torch.randn(T, H, device="cuda").to(BF16)
    w13, w2 = experts(F32, inter=inter)
    (q13, s13), (q2, s2) = fp8_blocks(w13, (128, 128)), fp8_blocks(w2, (128, 128))
    weights, ids = routing(T)
    with poison():
        out = fused_moe.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, scale_block=(128, 128))
    want = moe_reference(x, fp8_dequantized(q13, s13, (128, 128)), fp8_dequantized(q2, s2, (128, 128)), weights, ids)
    assert_close(out, want, BF16)


@pytest.mark.parametrize("T", [4, 96])
def test_fused_moe_replays_from_a_cuda_graph_with_new_routing(T):
    """Captured once; each replay takes the inputs' new values, the routing included."""
    x = torch.randn(T, H, device="cuda").to(BF16)
    w13, w2 = experts(BF16)
    logits = torch.randn(T, E, device="cuda").to(BF16)

    def step():
        weights, ids = fused_moe.route(logits, TOP_K, True)
        return fused_moe.fused_moe(x, w13, w2, weights, ids)

    graph, out = capture(step)
    for _ in range(3):
        x.copy_(torch.randn(T, H, device="cuda"))
        logits.copy_(torch.randn(T, E, device="cuda"))
        graph.replay()
        assert_close(out, step(), BF16)


# Qwen3-8B's projections: qkv, o, gate_up, down.
FP8_SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@needs_fp8
@pytest.mark.parametrize("M", [1, 2, 5, 8])
@pytest.mark.parametrize("N, K", FP8_SHAPES)
def test_fp8_gemv_at_8b_shapes(M, N, K, poison):
    q, scales = fp8_blocks(torch.randn(N, K, device="cuda") / K ** 0.5, (128, 128))
    x = torch.randn(M, K, device="cuda").to(BF16)
    with poison():
        y = fp8.fp8_gemv(x, q, scales, (128, 128))
    assert_close(y, (x.float() @ fp8_dequantized(q, scales, (128, 128)).T).to(BF16), BF16)


# Both GEMV kernels, tiles of one and several scale blocks of columns (the one-row kernel's widest
# is bench_kernels' sweep's), bands of 1-8 and 16-64 weight rows.
FP8_GEMV_LAUNCHES = [dict(kernel="one", block_n=1, block_k=2048, num_warps=4),
                     dict(kernel="one", block_n=8, block_k=512, num_warps=2),
                     dict(kernel="one", block_n=4, block_k=128, num_warps=2),
                     dict(kernel="one", block_n=8, block_k=256, num_warps=1, unroll=2),
                     dict(kernel="dot", block_n=16, block_k=512, num_stages=5),
                     dict(kernel="dot", block_n=64, block_k=128, num_stages=3)]


@needs_fp8
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_fp8_gemv_kernels_and_tiles(dtype, poison):
    """At Qwen3-8B's down projection (12288 columns: 96 scale blocks) and an N that is not a
    multiple of any band; float32 x takes the tensor cores' exact (ieee) path."""
    for N, K in [(4096, 12288), (1000, 4096)]:
        q, scales = fp8_blocks(torch.randn(N, K, device="cuda") / K ** 0.5, (128, 128))
        w = fp8_dequantized(q, scales, (128, 128))
        for launch in FP8_GEMV_LAUNCHES:
            M = 1 if launch["kernel"] == "one" else 7
            x = torch.randn(M, K, device="cuda").to(dtype)
            with poison():
                y = fp8.fp8_gemv(x, q, scales, (128, 128), **launch)
            assert_close(y, (x.float() @ w.T).to(dtype), dtype)


@needs_fp8
@pytest.mark.parametrize("M", [9, 64, 1000])
@pytest.mark.parametrize("N, K", FP8_SHAPES)
def test_fp8_gemm_at_8b_shapes(M, N, K, poison):
    """W8A8 in bf16 against the reference that quantizes the activations the same way; float32
    (exact) against the dequantized product."""
    q, scales = fp8_blocks(torch.randn(N, K, device="cuda") / K ** 0.5, (128, 128))
    w = fp8_dequantized(q, scales, (128, 128))
    x = torch.randn(M, K, device="cuda")
    with poison():
        y = fp8.fp8_gemm(x.to(BF16), q, scales, (128, 128))
    xq, xs = quantized_rows_reference(x.to(BF16), 128)
    assert_close(y, ((xq.float() * xs.repeat_interleave(128, 1)[:, :K]) @ w.T).to(BF16), BF16)
    with poison():
        exact = fp8.fp8_gemm(x, q, scales, (128, 128))
    assert_close(exact, x @ w.T, F32)


@needs_fp8
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_fp8_gemm_tiles_fit_the_registers(dtype):
    """No spill at the prefill's tile: a spilling kernel makes the driver keep local memory for every
    thread the card holds (tests/gpu/thread_stack.py), ~4.9 GiB of an H100 for float32's first tiles."""
    q, scales = fp8_blocks(torch.randn(4096, 4096, device="cuda") / 64, (128, 128))
    x = torch.randn(1000, 4096, device="cuda").to(dtype)
    torch.cuda.synchronize()
    thread_stack.reset_stack()
    before = thread_stack.stack_bytes()
    fp8.fp8_gemm(x, q, scales, (128, 128))
    torch.cuda.synchronize()
    assert thread_stack.stack_bytes() == before


@needs_fp8
def test_fp8_linear_replays_from_a_cuda_graph():
    """kernels/fp8.py's dispatch, and the layer's (cuBLAS from 2 rows where it runs, rows padded)."""
    q, scales = fp8_blocks(torch.randn(4096, 4096, device="cuda") / 64, (128, 128))
    for linear in (fp8.fp8_linear, fp8_layer.linear):
        for rows in (1, 2, 5, 8, 48):
            x = torch.randn(rows, 4096, device="cuda").to(BF16)
            graph, out = capture(lambda x=x, linear=linear: linear(x, q, scales, (128, 128)))
            x.copy_(torch.randn(rows, 4096, device="cuda"))
            graph.replay()
            assert torch.equal(out, linear(x, q, scales, (128, 128)))


def _w8a8_reference(x, q, scales, block):
    """x quantized per row and block[1] columns, times the dequantized weight, rounded to x's dtype."""
    K = x.shape[1]
    xq, xs = quantized_rows_reference(x, block[1])
    return ((xq.float() * xs.repeat_interleave(block[1], 1)[:, :K]) @ fp8_dequantized(q, scales, block).T).to(x.dtype)


@needs_cublas_blocks
@pytest.mark.parametrize("M", [2, 5, 8, 13, 100, 1000])
@pytest.mark.parametrize("N, K", FP8_SHAPES)
def test_fp8_linear_beyond_one_row_matches_the_w8a8_reference(M, N, K, poison):
    """block_scaled_mm (the W8A8 GEMV where w8a8_launch says so, at 2-13 rows here but for down,
    cuBLAS otherwise), rows not a multiple of 4 too: their padding rows must not reach the output."""
    q, scales = fp8_blocks(torch.randn(N, K, device="cuda") / K ** 0.5, (128, 128))
    x = torch.randn(M, K, device="cuda").to(BF16)
    assert fp8_layer.cublas_takes(x, q, scales, (128, 128))
    with poison():
        y = fp8_layer.linear(x, q, scales, (128, 128))
    assert_close(y, _w8a8_reference(x, q, scales, (128, 128)), BF16)


@needs_cublas_blocks
@pytest.mark.parametrize("N, K", [(24576, 4096), (6144, 4096), (4096, 4096), (5120, 2048)])
def test_one_row_after_a_norm_goes_where_it_runs_fastest_and_as_beside_another_row(N, K, poison, monkeypatch):
    """A decode step of one row at Qwen3-8B's shapes and Qwen3-30B-A3B's qkv. Where W has a band of
    64 rows for every SM (gate/up, 24576 x 4096; on an H200 not qkv's or o_proj's shapes) the norm
    hands its row over quantized, to the W8A8 GEMV, whose product of a row is then the same alone as
    beside another row; elsewhere the row stays in bf16 for the one-row FP8 GEMV (engine/layers/fp8.py's
    w8a8_launch says why; tests/test_fp8_kernels.py holds the rule at 132 SMs), which takes the norm
    in where K is at most 2,048 (kernels.fp8.one_row_fuses_norm), storing the same new residual."""
    from engine.layers.linear import ColumnParallelLinear
    from engine.layers.norm import RMSNorm
    layer, norm = ColumnParallelLinear(K, N), RMSNorm(K)
    layer.weight = torch.nn.Parameter((torch.randn(N, K, device="cuda") / K ** 0.5).to(BF16), requires_grad=False)
    layer.quantize("fp8")
    norm.weight = torch.nn.Parameter((1 + 0.1 * torch.randn(K, device="cuda")).to(BF16), requires_grad=False)
    layer.fused = norm.fused = True
    fused_calls = []
    monkeypatch.setattr(fp8, "rms_norm_fp8_gemv", _counting(fp8.rms_norm_fp8_gemv, "rms_norm_fp8_gemv", fused_calls))
    x, residual = torch.randn(2, K, device="cuda").to(BF16), torch.randn(2, K, device="cuda").to(BF16)
    handed_over = N // 64 >= _sms()
    assert layer.takes_quantized_rows(x[:1]) == handed_over and layer.takes_quantized_rows(x)
    with poison():
        one, one_residual = layer.norm_forward(norm, x[:1], residual[:1])
    assert len(fused_calls) == (not handed_over and K <= 2048)
    two, two_residual = layer.norm_forward(norm, x, residual)
    normed = norm(x[:1], residual[:1])[0]
    assert torch.equal(one_residual, two_residual[:1])
    if handed_over:
        assert torch.equal(one, two[:1])
        assert_close(one, _w8a8_reference(normed, layer.weight, layer.weight_scale_inv, (128, 128)), BF16)
    else:
        want = (normed.float() @ fp8_dequantized(layer.weight, layer.weight_scale_inv, (128, 128)).T).to(BF16)
        assert_close(one, want, BF16)


@needs_cublas_blocks
@pytest.mark.parametrize("M, N, K", [(17, 4096, 4096), (24, 6144, 4096), (32, 4096, 12288), (100, 4096, 12288),
                                     (128, 2560, 4096), (64, 1024, 3072)])
def test_fp8_products_in_pieces_of_k_give_the_whole_products(M, N, K, poison, monkeypatch):
    """block_scaled_mm's pieces of K, on streams of their own, summed: within one bf16 rounding of
    the product cuBLAS makes whole, eagerly and replayed from a CUDA graph (fork and join
    captured), and near the W8A8 reference."""
    device = torch.device("cuda")
    assert fp8_layer.k_pieces(M, N, K, device) > 1 and fp8_layer.w8a8_launch(M, N, K, _sms()) is None
    q, scales = fp8_blocks(torch.randn(N, K, device="cuda") / K ** 0.5, (128, 128))
    x = torch.randn(M, K, device="cuda").to(BF16)
    with poison():
        pieces = fp8_layer.linear(x, q, scales, (128, 128))
    graph, out = capture(lambda: fp8_layer.linear(x, q, scales, (128, 128)))
    x.copy_(torch.randn(M, K, device="cuda"))
    graph.replay()
    assert torch.equal(out, fp8_layer.linear(x, q, scales, (128, 128)))
    monkeypatch.setattr(fp8_layer, "pieces_for", lambda *shape: 1)
    whole = fp8_layer.linear(x, q, scales, (128, 128))
    assert not out.isnan().any() and not pieces.isnan().any()
    assert ((out.float() - whole.float()).abs() <= whole.float().abs() / 128 + 1e-6).all()
    assert_close(out, _w8a8_reference(x, q, scales, (128, 128)), BF16)


def _sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


@needs_fp8
@pytest.mark.parametrize("M", [1, 2, 7, 16, 31, 32])
@pytest.mark.parametrize("N, K", [(24576, 4096), (16400, 1024), (6144, 4096), (4096, 12288)])
def test_w8a8_gemv_matches_the_reference_and_replays(M, N, K, poison):
    """kernels/fp8.py's W8A8 GEMV at Qwen3-8B's shapes and at one whose last band of W's rows is
    partial, launched as block_scaled_mm would launch it (where cuBLAS would run it, in 4 pieces on
    4 warps): against the W8A8 reference, the padding rows NaN and kept out, the counters zero after
    every launch, the same bits from the layer and from a second launch, and replayed from a CUDA
    graph on new rows."""
    chosen = fp8_layer.w8a8_launch(M, N, K, _sms())
    launch = dict(chosen._asdict() if chosen else dict(pieces=4, num_warps=4, groups=1),
                  arrivals=torch.zeros(N // 64 + 1, dtype=torch.int32, device="cuda"))
    q, scales = fp8_blocks(torch.randn(N, K, device="cuda") / K ** 0.5, (128, 128))
    x = torch.randn(M, K, device="cuda").to(BF16)
    xq, xs = fp8.quantize_activations(x, **fp8_layer.CUBLAS_ROWS)
    xq[M:] = float("nan")
    xs[M:] = float("nan")
    with poison():
        y = fp8.w8a8_gemv(xq, xs, M, q, scales, (128, 128), **launch)
    assert_close(y, _w8a8_reference(x, q, scales, (128, 128)), BF16)
    assert not launch["arrivals"].any()
    assert torch.equal(fp8.w8a8_gemv(xq, xs, M, q, scales, (128, 128), **launch), y)
    if chosen:
        assert torch.equal(fp8_layer.linear(fp8_layer.QuantizedRows(xq, xs, M), q, scales, (128, 128)), y)
    graph, out = capture(lambda: fp8.w8a8_gemv(xq, xs, M, q, scales, (128, 128), **launch))
    x2 = torch.randn(M, K, device="cuda").to(BF16)
    xq[:M], xs[:M] = fp8.quantize_activations(x2, 128)
    graph.replay()
    assert_close(out, _w8a8_reference(x2, q, scales, (128, 128)), BF16)
    graph.replay()
    assert torch.equal(out, fp8.w8a8_gemv(xq, xs, M, q, scales, (128, 128), **launch))
    assert not launch["arrivals"].any()


@needs_fp8
@pytest.mark.parametrize("N, K", [(4096, 768), (1536, 1664), (1000, 4096)])
def test_fp8_linear_keeps_what_cublas_multiplies_wrongly_on_triton(N, K, poison):
    """K not a multiple of 512 (cuBLAS answered 15-56% off there) and N not a multiple of 16."""
    q, scales = fp8_blocks(torch.randn(N, K, device="cuda") / K ** 0.5, (128, 128))
    x = torch.randn(24, K, device="cuda").to(BF16)
    assert not fp8_layer.cublas_takes(x, q, scales, (128, 128))
    with poison():
        y = fp8_layer.linear(x, q, scales, (128, 128))
    assert_close(y, _w8a8_reference(x, q, scales, (128, 128)), BF16)


# --- the engine on tiny checkpoints, against HF -----------------------------------------------------


@pytest.mark.parametrize("eager", [False, True])
def test_tiny_moe_matches_hf_in_float32(tiny_qwen3_moe, eager):
    """Batches of 1 (GEMV path) and of 12 (grouped path), with a prefix hit."""
    prompts = random_prompts([5, 16, 17, 40, 90], seed=21)
    prompts += [prompts[-1][:48] + own for own in random_prompts([3, 7], seed=22)]
    expected = hf_greedy(tiny_qwen3_moe, prompts, GREEDY.max_tokens)
    with LLM(tiny_qwen3_moe, **ENGINE, enforce_eager=eager) as llm:
        assert (llm.runner.decode_graphs is None) == eager
        assert [o["token_ids"] for o in llm.generate(prompts[:1], GREEDY)] == expected[:1]
        assert [o["token_ids"] for o in llm.generate(prompts * 2, GREEDY)] == expected * 2
        assert llm.stats().prefix_hit_tokens > 0


def test_tiny_moe_survives_preemption(tiny_qwen3_moe):
    prompts = random_prompts([60, 50, 70, 40], seed=23)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = hf_greedy(tiny_qwen3_moe, prompts, 60)
    with LLM(tiny_qwen3_moe, **dict(ENGINE, num_kvcache_blocks=20)) as tight:
        assert [o["token_ids"] for o in tight.generate(prompts, params)] == expected
        assert tight.stats().num_preemptions > 0


@needs_fp8
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("eager", [False, True])
def test_fp8_checkpoint_stays_fp8_and_matches_hf_in_float32(tmp_path, arch, eager):
    """Float32 activations take the FP8 kernels' exact paths (no activation rounding), so the
    tokens are HF's on the dequantized weights."""
    path = write_fp8_checkpoint(tmp_path, (16, 32), arch=arch)
    prompts = random_prompts([5, 17, 40, 9, 30, 12, 8, 20, 33], seed=24)
    expected = hf_dequantized_greedy(path, prompts, GREEDY.max_tokens)
    with LLM(path, **ENGINE, enforce_eager=eager) as llm:
        assert llm.config.quantization == "fp8"
        layer = llm.runner.model.model.layers[0]
        assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
        if arch == "qwen3_moe":
            assert layer.mlp.experts.w13.dtype == torch.float8_e4m3fn
        assert [o["token_ids"] for o in llm.generate(prompts[:1], GREEDY)] == expected[:1]
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY)] == expected


@needs_fp8
def test_fp8_checkpoint_with_quantization_none_loads_dequantized(tmp_path):
    path = write_fp8_checkpoint(tmp_path, (16, 32))
    prompts = random_prompts([5, 17], seed=25)
    expected = hf_dequantized_greedy(path, prompts, GREEDY.max_tokens)
    with LLM(path, **ENGINE, quantization="none") as llm:
        assert llm.runner.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY)] == expected


def hf_dequantized_greedy(path, prompts, max_new_tokens):
    """HF's greedy tokens on an FP8 checkpoint's dequantized weights. Where CUDA is visible HF
    would run the FP8 weights through Hugging Face's `kernels` package (absent on the GPU machines);
    dequantize=True loads them dequantized, as HF does on a CPU-only machine."""
    from transformers import FineGrainedFP8Config
    return hf_greedy(path, prompts, max_new_tokens, quantization_config=FineGrainedFP8Config(dequantize=True))


def _prefill_logits(llm, prompts):
    caught, compute = [], llm.runner.model.compute_logits
    llm.runner.model.compute_logits = lambda hidden: caught.append(compute(hidden)) or caught[-1]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    llm.runner.model.compute_logits = compute
    return caught[0].float()


def _dequantized_weights(model) -> dict[tuple[str, str], torch.Tensor]:
    """Every FP8 weight of the model (projections and experts), dequantized to bf16."""
    found = {}
    for name, module in model.named_modules():
        for weight in ("weight", "w13", "w2"):
            q = getattr(module, weight, None)
            if isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn:
                scale = getattr(module, f"{weight}_scale_inv")
                found[name, weight] = dequantize_blocks(q, scale, module.scale_block, BF16)
    return found


@needs_fp8
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_quantization_fp8_keeps_the_logits_close(tmp_path, arch):
    """quantization="fp8" on a bf16 run: every projection (and expert) in FP8, the head not. The
    oracle is the bf16 run on the FP8 weights dequantized, which holds the weights' rounding and
    nothing else. The FP8 kernels add the prefill GEMM's activations rounded to e4m3 in groups of
    128: the same 3 mantissa bits as the weights', so an error about as large (0.123 and 0.096 of
    the logits against the weights' 0.121 and 0.123 at these seeds, H100), well under 1.5x."""
    save_tiny_hf_model(tmp_path, tie=False, arch=arch, seed=7)
    prompts = random_prompts([37] * 8, seed=26)
    settings = dict(ENGINE, dtype="bfloat16", enforce_eager=True)
    with LLM(tmp_path, **settings, quantization="fp8") as llm:
        model = llm.runner.model
        mlp = model.model.layers[1].mlp
        assert (mlp.experts.w13 if arch == "qwen3_moe" else mlp.down_proj.weight).dtype == torch.float8_e4m3fn
        assert model.model.layers[1].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
        assert model.lm_head.weight.dtype == BF16
        got = _prefill_logits(llm, prompts)
        dequantized = _dequantized_weights(model)
    with LLM(tmp_path, **settings) as llm:
        unquantized = _prefill_logits(llm, prompts)
    with LLM(tmp_path, **settings) as llm:  # a fresh engine: the prompts' blocks are not cached
        modules = dict(llm.runner.model.named_modules())
        for (name, weight), value in dequantized.items():
            getattr(modules[name], weight).data.copy_(value)
        rounded_weights = _prefill_logits(llm, prompts)
    weights_error = ((rounded_weights - unquantized).norm() / unquantized.norm()).item()
    kernels_error = ((got - rounded_weights).norm() / rounded_weights.norm()).item()
    print(f"{arch}: FP8 weights' rounding {weights_error:.4f}, FP8 kernels on top {kernels_error:.4f}")
    assert 1e-4 < weights_error and 1e-4 < kernels_error < 1.5 * weights_error


def _counting(kernel, name: str, calls: list[str]):
    def counted(*args, **kwargs):
        calls.append(name)
        return kernel(*args, **kwargs)
    return counted


@needs_fp8
@pytest.mark.parametrize("eager", [False, True])
def test_norm_and_silu_quantize_for_the_fp8_products_as_the_products_would(tmp_path, monkeypatch, eager):
    """Where cuBLAS's block-scaled product runs (shapes whose K is a multiple of 512, from 2 rows),
    the RMSNorm and SiLU-mul kernels hand it their output quantized (fp8.QuantizedRows). At this
    width (hidden 512) both norm kernels sum a row in one order, so the rows and scales are those
    the product would make itself, and the logits are equal bit for bit, prompts and decode steps
    (CUDA graphs or eager) alike; at 4096 and wider a rare code moves one e4m3 step
    (kernels.rmsnorm.rms_norm_fp8 says why)."""
    if not fp8_layer.cublas_block_scaling(torch.device("cuda")):
        pytest.skip("cuBLAS's block-scaled FP8 product needs a Hopper GPU and CUDA 12.9")
    from engine.layers.linear import _Linear
    from kernels import rmsnorm, silu_mul

    save_tiny_hf_model(tmp_path, tie=False, seed=8, hidden_size=512, intermediate_size=1024, head_dim=128)
    prompts = random_prompts([37, 5, 60, 12, 23, 9], seed=29)
    settings = dict(ENGINE, dtype="bfloat16", quantization="fp8", enforce_eager=eager)
    calls = []
    for module, name in ((rmsnorm, "rms_norm_fp8"), (silu_mul, "silu_and_mul_fp8")):
        monkeypatch.setattr(module, name, _counting(getattr(module, name), name, calls))

    def run():
        with LLM(tmp_path, **settings) as llm:
            logits = _prefill_logits(llm, prompts)
            tokens = [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
        return logits, tokens

    fused = run()
    assert {"rms_norm_fp8", "silu_and_mul_fp8"} <= set(calls)
    calls.clear()
    monkeypatch.setattr(_Linear, "takes_quantized_rows", lambda self, x: False)
    unfused = run()
    assert not calls
    assert torch.equal(fused[0], unfused[0]) and fused[1] == unfused[1]


@pytest.mark.whole_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.two_gpus
def test_tiny_moe_over_two_gpus_matches_hf(tiny_qwen3_moe):
    """Each GPU holds half of every expert's columns; graphs on, one stream and twelve."""
    prompts = random_prompts([5, 16, 40, 90, 7, 22, 31, 12, 60, 3, 18, 44], seed=28)
    expected = hf_greedy(tiny_qwen3_moe, prompts, GREEDY.max_tokens)
    with LLM(tiny_qwen3_moe, **ENGINE, tensor_parallel_size=2) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts[:1], GREEDY)] == expected[:1]
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY)] == expected


# --- the benchmark configs' real shapes --------------------------------------------------------------


# The 30B-A3B's KV cache is sized by gpu_memory_utilization, from what the device has free: a
# whole-GPU turn. The 8B FP8's is fixed, so that it shares the GPU (test_memory_gpu.py sizes it).
@pytest.mark.parametrize("shape, kv", [pytest.param("qwen3-30b-a3b", dict(gpu_memory_utilization=0.9),
                                                    marks=pytest.mark.whole_gpu),
                                       ("qwen3-8b-fp8", dict(num_kvcache_blocks=64))])
def test_benchmark_shapes_build_capture_and_decode(shape, kv):
    """Random weights in the real shapes: the KV cache made, the graphs captured, and a few steps at
    batch 1 and 12 with nothing NaN (the logits' argmax in range)."""
    if shape.endswith("fp8") and not HAS_FP8:
        pytest.skip("needs FP8")
    with LLM(str(CONFIGS / shape), load_format="random", dtype="bfloat16", max_model_len=1024, max_num_seqs=32,
             max_num_batched_tokens=2048, **kv) as llm:
        assert llm.runner.decode_graphs is not None
        if shape.endswith("fp8"):
            assert llm.config.quantization == "fp8"
        outs = llm.generate(random_prompts([50] * 12, vocab=151936, seed=27), GREEDY)
        assert all(len(o["token_ids"]) == GREEDY.max_tokens for o in outs)
        assert all(0 <= t < 151936 for o in outs for t in o["token_ids"])
