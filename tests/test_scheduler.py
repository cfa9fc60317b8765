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


def test_chunks_shrink_as_the_context_before_them_grows(tiny_qwen3):
    chunk = 32
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=8, max_prefill_chunk=chunk) as llm:
        llm.scheduler.full_chunk_context = 64
        llm.scheduler.min_chunk = 16
        streams = [llm.add_request(p, DECODE) for p in random_prompts([5, 6], seed=7)]
        while any(s.num_completion_tokens == 0 for s in streams):
            llm.step()
        long = llm.add_request(random_prompts([200], seed=8)[0], SamplingParams(max_tokens=1))
        chunks = []
        while long.num_computed_tokens < long.num_prompt_tokens:
            before = long.num_computed_tokens
            llm.step()
            chunks.append((before, long.num_computed_tokens - before))
        # Up to 64 - 32 tokens of context a chunk is whole (less the two decode tokens); after it,
        # chunk x context stays within 32 x 64, down to the 16-token floor.
        assert chunks[0] == (0, chunk - 2)
        for context, n in chunks[1:]:
            assert n == min(200 - context, chunk - 2, max(16, chunk * 64 // (context + chunk)))
        assert chunks[-1][1] < chunk - 2
