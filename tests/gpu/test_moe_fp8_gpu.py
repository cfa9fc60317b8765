"""Qwen3-MoE and block-FP8 weights on a CUDA device (skipped without one; run with TRITON_INTERPRET
unset or 0):
- kernels/fused_moe.py and kernels/fp8.py compiled, at Qwen3-30B-A3B's and Qwen3-8B's shapes in
  bf16, against the torch references, eagerly and replayed from a CUDA graph with new inputs (a
  host sync or a shape taken from the routing fails the capture);
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
from kernels import fp8, fused_moe  # noqa: E402
from tests.conftest import hf_greedy, random_prompts, save_tiny_hf_model  # noqa: E402
from tests.kernel_checks import (  # noqa: E402,F401 (fixtures)
    assert_close,
    capture,
    fp8_blocks,
    fp8_dequantized,
    moe_reference,
    poison,
    quantized_rows_reference,
    seed,
)
from tests.test_fp8_checkpoint import write_fp8_checkpoint  # noqa: E402

if type(fused_moe._route_kernel).__name__ == "InterpretedFunction":
    pytest.skip("kernels were imported under TRITON_INTERPRET=1", allow_module_level=True)

BF16, F32 = torch.bfloat16, torch.float32
HAS_FP8 = torch.cuda.get_device_capability() >= (8, 9)
needs_fp8 = pytest.mark.skipif(not HAS_FP8, reason="needs FP8 (compute capability 8.9 or more)")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=16, gpu_memory_utilization=0.3)
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


@pytest.mark.parametrize("T", [1, 4, 8, 9, 64])
def test_fused_moe_at_30b_a3b_shapes_in_bf16(T, poison):
    """The GEMV path up to 8 tokens, the grouped GEMMs beyond."""
    x = torch.randn(T, H, device="cuda").to(BF16)
    w13, w2 = experts(BF16)
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
@pytest.mark.parametrize("T", [1, 8, 64])
def test_fused_moe_with_fp8_experts(T, poison):
    x = torch.randn(T, H, device="cuda").to(BF16)
    w13, w2 = experts(F32)
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
def test_fp8_linear_replays_from_a_cuda_graph():
    q, scales = fp8_blocks(torch.randn(4096, 4096, device="cuda") / 64, (128, 128))
    for rows in (1, 8, 48):
        x = torch.randn(rows, 4096, device="cuda").to(BF16)
        graph, out = capture(lambda x=x: fp8.fp8_linear(x, q, scales, (128, 128)))
        x.copy_(torch.randn(rows, 4096, device="cuda"))
        graph.replay()
        assert torch.equal(out, fp8.fp8_linear(x, q, scales, (128, 128)))


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


@needs_fp8
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_quantization_fp8_keeps_the_logits_close(tmp_path, arch):
    """quantization="fp8" on a bf16 run: every projection (and expert) in FP8, the head not; the
    last position's logits of 8 prompts within 10% of bf16's (e4m3 keeps 3 mantissa bits)."""
    save_tiny_hf_model(tmp_path, tie=False, arch=arch, seed=7)
    prompts = random_prompts([37] * 8, seed=26)
    settings = dict(ENGINE, dtype="bfloat16", enforce_eager=True)
    with LLM(tmp_path, **settings) as llm:
        expected = _prefill_logits(llm, prompts)
    with LLM(tmp_path, **settings, quantization="fp8") as llm:
        model = llm.runner.model
        mlp = model.model.layers[1].mlp
        assert (mlp.experts.w13 if arch == "qwen3_moe" else mlp.down_proj.weight).dtype == torch.float8_e4m3fn
        assert model.model.layers[1].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
        assert model.lm_head.weight.dtype == BF16
        got = _prefill_logits(llm, prompts)
    error = (got - expected).norm() / expected.norm()
    assert 1e-4 < error < 0.1, error


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tiny_moe_over_two_gpus_matches_hf(tiny_qwen3_moe):
    """Each GPU holds half of every expert's columns; graphs on, one stream and twelve."""
    prompts = random_prompts([5, 16, 40, 90, 7, 22, 31, 12, 60, 3, 18, 44], seed=28)
    expected = hf_greedy(tiny_qwen3_moe, prompts, GREEDY.max_tokens)
    with LLM(tiny_qwen3_moe, **ENGINE, tensor_parallel_size=2) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts[:1], GREEDY)] == expected[:1]
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY)] == expected


# --- the benchmark configs' real shapes --------------------------------------------------------------


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "qwen3-8b-fp8"])
def test_benchmark_shapes_build_capture_and_decode(shape):
    """Random weights in the real shapes: the KV cache sized around the warmup, the graphs
    captured, and a few steps at batch 1 and 12 with nothing NaN (the logits' argmax in range)."""
    if shape.endswith("fp8") and not HAS_FP8:
        pytest.skip("needs FP8")
    with LLM(str(CONFIGS / shape), load_format="random", dtype="bfloat16", max_model_len=1024, max_num_seqs=32,
             max_num_batched_tokens=2048, gpu_memory_utilization=0.9) as llm:
        assert llm.runner.decode_graphs is not None
        if shape.endswith("fp8"):
            assert llm.config.quantization == "fp8"
        outs = llm.generate(random_prompts([50] * 12, vocab=151936, seed=27), GREEDY)
        assert all(len(o["token_ids"]) == GREEDY.max_tokens for o in outs)
        assert all(0 <= t < 151936 for o in outs for t in o["token_ids"])
