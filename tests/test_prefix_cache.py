"""Prefix-cache hits give the same tokens as computing everything."""
from engine import LLM, SamplingParams
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_shared_system_prompt_is_computed_once(tiny_qwen3):
    system = random_prompts([48], seed=11)[0]
    users = random_prompts([5, 9, 20], seed=12)
    prompts = [system + u for u in users]
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=16) as cold:
        expected = [cold.generate([p], GREEDY)[0]["token_ids"] for p in prompts]
        # Each solo run after the first found the 48-token system prompt (3 blocks) cached.
        assert cold.stats().prefix_hit_tokens == 2 * 48
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=16) as warm:
        warm.generate([system + [1]], GREEDY)
        before = warm.stats().prefix_hit_tokens
        outs = warm.generate(prompts, GREEDY)
        assert [o["token_ids"] for o in outs] == expected
        assert warm.stats().prefix_hit_tokens - before == 3 * 48
        assert warm.stats().num_free_blocks == warm.stats().num_blocks


def test_second_turn_reuses_first_turn_prompt_and_completion(tiny_qwen3):
    turn1 = random_prompts([37], seed=13)[0]
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=8) as llm:
        reply = llm.generate([turn1], GREEDY)[0]["token_ids"]
        turn2 = turn1 + reply + random_prompts([6], seed=14)[0]
        before = llm.stats().prefix_hit_tokens
        second = llm.generate([turn2], GREEDY)[0]["token_ids"]
        hits = llm.stats().prefix_hit_tokens - before
        # Every full block of turn 1's prompt and reply is a hit; the last partial one is not
        # (its final slot was never written: the last sampled token has no KV yet).
        assert hits == ((len(turn1) + len(reply) - 1) // 8) * 8
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=8) as fresh:
        assert fresh.generate([turn2], GREEDY)[0]["token_ids"] == second


def test_fully_cached_prompt_still_computes_its_last_token(tiny_qwen3):
    prompt = random_prompts([32], seed=15)[0]  # exactly 4 blocks of 8
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=8) as llm:
        first = llm.generate([prompt], GREEDY)[0]["token_ids"]
        before = llm.stats().prefix_hit_tokens
        again = llm.generate([prompt], GREEDY)[0]["token_ids"]
        assert again == first
        # The last block is recomputed into a fresh block rather than rewritten while cached.
        assert llm.stats().prefix_hit_tokens - before == 24


def test_cached_blocks_are_counted_and_reused(tiny_qwen3):
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4, num_kvcache_blocks=64) as llm:
        llm.generate([list(range(1, 20))], GREEDY)
        s = llm.stats()
        assert s.num_free_blocks == 64 and s.num_cached_blocks > 0 and s.num_running == 0
