"""Engine-level checks on a CUDA device: skipped without one.

The tiny float32 engines most tests need are built once for the module (one with CUDA graphs, one
eager), with a fixed KV cache so that no build spends a warmup on sizing it (test_memory_gpu.py
does that). Run (one GPU):
    PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_engine_gpu.py
"""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.model_runner import _TokenReadback
from tests.conftest import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# max_num_batched_tokens 512: prefill graphs of 32 to 512 tokens, the largest step these prompts make.
FP32 = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def engines(tiny_qwen3):
    """{enforce_eager: LLM}: float32 engines on the tiny model, prompt chunks of at most 48 tokens
    beside decoding streams, prefill graphs for the graphed one."""
    made = {eager: LLM(tiny_qwen3, enforce_eager=eager, max_prefill_chunk=48, num_kvcache_blocks=256, **FP32)
            for eager in (False, True)}
    assert made[False].runner.decode_graphs is not None and made[False].runner.prefill_graphs is not None
    assert made[True].runner.decode_graphs is None and made[True].runner.prefill_graphs is None
    yield made
    for llm in made.values():
        llm.shutdown()


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_triton_backend_with_cuda_graphs_matches_hf_in_float32(tiny_qwen3, block_size):
    prompts = random_prompts([1, 15, 16, 17, 100, 300], seed=block_size)
    expected = hf_greedy(tiny_qwen3, prompts, 24)
    with LLM(tiny_qwen3, kvcache_block_size=block_size, num_kvcache_blocks=max(64, 2048 // block_size),
             **FP32) as llm:
        assert llm.runner.decode_graphs is not None
        outs = llm.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in outs] == expected, f"block_size={block_size}"


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
def test_chat_sized_batches_match_hf_in_float32_with_graphs_and_eagerly(tiny_qwen3, engines, batch, eager):
    """1-8 streams decoding together run the Triton GEMV's row kernels (padded to a graph's bucket
    with graphs, at their own count eagerly)."""
    prompts = random_prompts([5 + 11 * i for i in range(batch)], seed=100 + batch)
    expected = hf_greedy(tiny_qwen3, prompts, 24)
    outs = engines[eager].generate(prompts, GREEDY)
    assert [o["token_ids"] for o in outs] == expected, f"batch {batch}, enforce_eager={eager}"


def test_cuda_graphs_match_eager(engines):
    """Decode graphs, and prefill graphs for small and mixed steps: prompts that arrive while two
    others decode, prefilled in chunks beside them, and a second round that hits the prefix cache."""
    shared = random_prompts([70], seed=2)[0]
    prompts = random_prompts([5, 33, 70, 129], seed=3) + [shared + [1, 2, 3]]
    runs = []
    for eager in (True, False):
        llm = engines[eager]
        hits = llm.stats().prefix_hit_tokens
        seqs = [llm.add_request(p, GREEDY) for p in prompts[:2]]
        for _ in range(3):
            llm.step()
        seqs += [llm.add_request(p, GREEDY) for p in prompts[2:]]
        while llm.has_unfinished():
            llm.step()
        second = [o["token_ids"] for o in llm.generate([shared + [9], shared + [4, 5]], GREEDY)]
        assert llm.stats().prefix_hit_tokens > hits
        runs.append(([s.completion_token_ids for s in seqs], second))
    assert runs[0] == runs[1]


def test_sampling_graphs_draw_within_the_settings_and_afresh_each_replay(engines):
    """The captured sampling: top_k=1 and a tiny temperature must give the greedy tokens, through
    the filtering and plain sampling graphs, beside greedy rows; identical unseeded requests must
    differ (the graph's noise is new every replay; top_p alone takes the "top_p" graph); seeded ones
    (sampled outside the graphs) must repeat."""
    prompts = random_prompts([7, 20, 33, 12, 5, 40], seed=8)
    force = [SamplingParams(temperature=0.8, top_k=1, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=1e-4, max_tokens=24, ignore_eos=True), GREEDY]
    llm = engines[False]
    graphs = llm.runner.decode_graphs
    assert {kind for _, kind in graphs.sample_graphs} == {
        "greedy", "sample", "filter", "narrow_filter", "top_p",
        "adjusted_greedy", "adjusted_sample", "adjusted_filter", "adjusted_narrow_filter", "adjusted_top_p"}
    greedy = [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
    forced = [o["token_ids"] for o in llm.generate(prompts, [force[i % 3] for i in range(len(prompts))])]
    assert forced == greedy
    # Every row at top_k=1: the "narrow_filter" graph, which ranks each row's 64 largest logits only.
    assert [o["token_ids"] for o in llm.generate(prompts, force[0])] == greedy
    free = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True)
    draws = [o["token_ids"] for o in llm.generate([prompts[0]] * 4, free)]
    assert len({tuple(d) for d in draws}) > 1
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True, seed=3)
    repeats = [o["token_ids"] for o in llm.generate([prompts[1]] * 3, seeded)]
    assert repeats[0] == repeats[1] == repeats[2]


def test_torch_backend_on_cuda_matches_triton(tiny_qwen3, engines):
    """The torch backend eagerly and with decode graphs (tests/gpu/test_dtype_matrix_gpu.py holds
    both against HF in every dtype)."""
    prompts = random_prompts([9, 40, 77], seed=4)
    triton = [o["token_ids"] for o in engines[True].generate(prompts, GREEDY)]
    for eager in (True, False):
        with LLM(tiny_qwen3, attention_backend="torch", enforce_eager=eager, num_kvcache_blocks=256, **FP32) as llm:
            assert (llm.runner.decode_graphs is None) == eager and llm.runner.prefill_graphs is None
            assert [o["token_ids"] for o in llm.generate(prompts, GREEDY)] == triton, f"enforce_eager={eager}"


def test_preemption_on_gpu(tiny_qwen3, engines):
    prompts = random_prompts([60, 50, 70, 40], seed=5)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = [o["token_ids"] for o in engines[False].generate(prompts, params)]
    with LLM(tiny_qwen3, num_kvcache_blocks=20, **FP32) as tight:
        outs = tight.generate(prompts, params)
        assert tight.stats().num_preemptions > 0
    assert [o["token_ids"] for o in outs] == expected


def test_reading_tokens_after_a_later_step_reused_their_buffer_raises():
    readback = _TokenReadback(4)
    tokens = torch.arange(4, device="cuda")
    first, second = readback.queue(tokens), readback.queue(tokens + 10)
    assert first.tolist() == [0, 1, 2, 3]
    third = readback.queue(tokens + 20)
    with pytest.raises(RuntimeError, match="reused their buffer"):
        first.tolist()
    assert second.tolist() == [10, 11, 12, 13] and third.tolist() == [20, 21, 22, 23]


def test_quantization_on_cuda_is_refused_by_name(tiny_qwen3):
    with pytest.raises(ValueError, match="quantization='int4' runs on CPU only"):
        LLM(tiny_qwen3, device="cuda", quantization="int4")
