"""How the scheduler mixes a long prompt's prefill into decoding streams."""
from engine import LLM, SamplingParams
from tests.conftest import random_prompts

DECODE = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_mixed_steps_keep_every_stream_decoding_within_the_chunk_budget(tiny_qwen3):
    chunk = 24
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=8, max_prefill_chunk=chunk) as llm:
        streams = [llm.add_request(p, DECODE) for p in random_prompts([5, 6, 7, 8, 9], seed=3)]
        while any(s.num_completion_tokens == 0 for s in streams):
            llm.step()
        long = llm.add_request(random_prompts([100], seed=4)[0], SamplingParams(max_tokens=1))
        mixed_steps = 0
        while not long.is_finished:
            before = [s.num_completion_tokens for s in streams]
            llm.step()
            prefill, decode = llm.last_step_tokens
            assert decode == len(streams), "a stream missed a step while the prompt was prefilled"
            assert [s.num_completion_tokens for s in streams] == [n + 1 for n in before]
            # The decode tokens count against the chunk, so the step stays within it.
            assert prefill + decode <= chunk
            # With the overlap on, the prompt's token lands one step after its last chunk ran.
            mixed_steps += prefill > 0
        assert mixed_steps == -(-100 // (chunk - len(streams)))


def test_prompts_keep_a_quarter_of_the_chunk_when_many_streams_decode(tiny_qwen3):
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=8, max_prefill_chunk=8, max_num_seqs=32) as llm:
        streams = [llm.add_request(p, DECODE) for p in random_prompts([3] * 12, seed=5)]
        while any(s.num_completion_tokens == 0 for s in streams):
            llm.step()
        llm.add_request(random_prompts([30], seed=6)[0], SamplingParams(max_tokens=1))
        llm.step()
        assert llm.last_step_tokens == (2, 12)
