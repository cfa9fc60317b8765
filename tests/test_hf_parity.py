"""Greedy completions match HF transformers' own Qwen3 token for token, in float32."""
import pytest

from engine import LLM, SamplingParams
from tests.conftest import hf_greedy, random_prompts, save_tiny_hf_model

LENGTHS = [1, 7, 16, 17, 33, 64, 90]
NEW_TOKENS = 24


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_tied"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_matches_hf_batched(request, fixture, block_size):
    path = request.getfixturevalue(fixture)
    prompts = random_prompts(LENGTHS, seed=block_size)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    with LLM(path, device="cpu", kvcache_block_size=block_size) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o["token_ids"] for o in outs] == expected
        assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_chunked_prefill_matches_hf(tiny_qwen3):
    """Prompts prefilled in small chunks, mixed with other sequences' decode steps."""
    prompts = random_prompts([70, 5, 41], seed=7)
    expected = hf_greedy(tiny_qwen3, prompts, NEW_TOKENS)
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=8, max_num_batched_tokens=24, max_prefill_chunk=13) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o["token_ids"] for o in outs] == expected


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_other_architectures_match_hf(tmp_path, arch):
    save_tiny_hf_model(tmp_path, tie=False, arch=arch)
    prompts = random_prompts([9, 30], seed=3)
    expected = hf_greedy(tmp_path, prompts, 12)
    with LLM(tmp_path, device="cpu", kvcache_block_size=8) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o["token_ids"] for o in outs] == expected
