from engine import LLM, SamplingParams
from tests.conftest import random_prompts


def test_preempted_requests_resume_with_no_token_lost_or_repeated(tiny_qwen3):
    prompts = random_prompts([30, 22, 41, 12, 27, 35], seed=21)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4) as roomy:
        expected = [o["token_ids"] for o in roomy.generate(prompts, params)]
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4, num_kvcache_blocks=40) as tight:
        outs = tight.generate(prompts, params)
        stats = tight.stats()
    assert stats.num_preemptions > 0
    assert [o["token_ids"] for o in outs] == expected
    assert all(len(o["token_ids"]) == 40 for o in outs)
    assert stats.num_free_blocks == stats.num_blocks


def test_seeded_sampling_survives_preemption(tiny_qwen3):
    prompts = random_prompts([30, 22, 41, 12], seed=22)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=30, ignore_eos=True, seed=i)
              for i in range(4)]
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4) as roomy:
        expected = [o["token_ids"] for o in roomy.generate(prompts, params)]
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4, num_kvcache_blocks=30) as tight:
        outs = tight.generate(prompts, params)
        assert tight.stats().num_preemptions > 0
    assert [o["token_ids"] for o in outs] == expected


def test_a_sequence_that_outgrows_the_whole_cache_ends_with_length(tiny_qwen3):
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4, num_kvcache_blocks=5) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 5 * 4 - 3 + 1  # the last token needs no slot yet
        assert llm.stats().num_free_blocks == 5
