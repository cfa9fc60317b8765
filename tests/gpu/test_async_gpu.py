"""The overlapped step on a CUDA device (CUDA graphs, pinned copies, events): it gives what the
synchronous step gives. Skipped without one.
Run (one GPU): PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_async_gpu.py
"""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.sequence import PENDING_TOKEN
from tests.conftest import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# A fixed KV cache: no build spends a warmup sizing one. Prefill graphs of 32 to 512 tokens.
ENGINE = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512,
              num_kvcache_blocks=256)


def tokens_of(llm, prompts, params):
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_blocks
    return [(o["token_ids"], o["finish_reason"]) for o in outs]


def test_overlap_matches_the_synchronous_step(tiny_qwen3):
    """Decode graphs and prefill graphs (chunks mixed into decoding), staggered finishes, a second
    round on the prefix cache, and seeded sampling. (HF parity with the overlap on, its default, is
    test_engine_gpu's.)"""
    shared = random_prompts([70], seed=2)[0]
    prompts = random_prompts([5, 33, 70, 129], seed=3) + [shared + [1, 2, 3]]
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 3, 17, 24, 9)]
    seeded = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=20, ignore_eos=True, seed=i)
              for i in range(5)]
    runs = []
    for overlap in (False, True):
        with LLM(tiny_qwen3, max_prefill_chunk=48, prefill_cuda_graphs=True, async_scheduling=overlap,
                 **ENGINE) as llm:
            assert llm.runner.decode_graphs is not None and llm.runner.prefill_graphs is not None
            runs.append((tokens_of(llm, prompts, greedy),
                         tokens_of(llm, [shared + [9], shared + [4, 5]], GREEDY),
                         tokens_of(llm, prompts, seeded)))
            assert llm.stats().prefix_hit_tokens > 0
    assert runs[0] == runs[1]
    assert [len(t) for t, _ in runs[1][0]] == [p.max_tokens for p in greedy]


def test_overlap_with_preemption_on_gpu(tiny_qwen3):
    prompts = random_prompts([60, 50, 70, 40], seed=5)
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)] * 2 + \
             [SamplingParams(temperature=0.7, max_tokens=60, ignore_eos=True, seed=i) for i in range(2)]
    with LLM(tiny_qwen3, async_scheduling=False, **ENGINE) as roomy:
        expected = tokens_of(roomy, prompts, params)
    with LLM(tiny_qwen3, **{**ENGINE, "num_kvcache_blocks": 20}) as tight:
        assert tight.async_scheduling
        assert tokens_of(tight, prompts, params) == expected
        assert tight.stats().num_preemptions > 0


def test_eos_and_aborts_with_tokens_in_flight_on_gpu(tiny_qwen3):
    prompts = random_prompts([12, 19, 26, 33], seed=31)
    with LLM(tiny_qwen3, async_scheduling=False, **ENGINE) as llm:
        reference = [t for t, _ in tokens_of(llm, prompts, GREEDY)]
    # EOS ids that end the first two requests early and never occur in the fourth, which is aborted.
    eos = {t for r in reference[:2] for t in r[4:10] if t not in reference[3]}
    assert eos
    results = []
    for overlap in (False, True):
        with LLM(tiny_qwen3, async_scheduling=overlap, **ENGINE) as llm:
            llm.eos_ids = eos
            seqs = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=24)) for p in prompts]
            for _ in range(8):
                llm.step()
            llm.abort(seqs[3])
            while llm.has_unfinished():
                llm.step()
            assert all(PENDING_TOKEN not in s.token_ids for s in seqs)
            assert llm.stats().num_free_blocks == llm.stats().num_blocks
            results.append([(s.completion_token_ids, s.finish_reason) for s in seqs])
            # The engine serves on after the dropped tokens' K/V writes: a fresh request is exact.
            assert tokens_of(llm, prompts[:1], GREEDY)[0][0] == reference[0]
    assert results[0][:3] == results[1][:3]
    for (tokens, reason), r in zip(results[1][:3], reference):
        stop = next((i for i, t in enumerate(r) if t in eos), None)
        assert (tokens, reason) == ((r, "length") if stop is None else (r[:stop + 1], "stop"))
    assert results[1][3][1] == "abort"
    assert results[1][3][0] == reference[3][:len(results[1][3][0])]
