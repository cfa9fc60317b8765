"""n > 1: one prompt prefilled once, then n samples that share its KV blocks and draw from their
own seed streams."""
import pytest

from engine import LLM, EngineThread, SamplingParams
from engine.core.sequence import SequenceStatus

PROMPT = list(range(20, 60))  # 40 tokens: two full blocks of 16 and a partial one


def test_n_samples_share_the_prompts_blocks_and_draw_different_seeded_samples(tiny_qwen3):
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=6, ignore_eos=True)
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=16) as llm:
        first = llm.add_request(PROMPT, params)
        samples = [first, *first.forks]
        prefilled = 0
        shared = None
        while llm.has_unfinished():
            llm.step()
            prefilled += llm.last_step_tokens[0]
            if shared is None and all(s.status == SequenceStatus.RUNNING and s.block_table for s in samples):
                # All three are running: the prompt's two full blocks are the same blocks in each.
                shared = [[llm.blocks.blocks[b].ref_count for b in s.block_table[:2]] for s in samples]
                assert len({tuple(s.block_table[:2]) for s in samples}) == 1
                assert len({s.block_table[2] for s in samples}) == 3  # the partial block is each one's own
        stats = llm.stats()
        alone = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True))[0]
    assert shared == [[3, 3]] * 3
    assert stats.prefix_hit_tokens == 2 * 32  # each fork found the prompt's two full blocks cached
    # The prompt ran once; each fork ran only the partial block's 8 tokens and its own first token.
    assert prefilled == 40 + 2 * 9
    outs = [s.completion_token_ids for s in samples]
    assert len({tuple(o) for o in outs}) == 3 and all(len(o) == 6 for o in outs)
    assert outs[0] == alone["token_ids"]  # sample 0 draws from the seed itself, as n=1 does


def test_n_samples_are_reproducible_and_reported_per_sample(tiny_qwen3):
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=5, ignore_eos=True, logprobs=1)
    with LLM(tiny_qwen3, device="cpu") as llm:
        runs = [llm.generate([PROMPT, PROMPT[:7]], params) for _ in range(2)]
    assert runs[0] == runs[1]
    for result in runs[0]:
        assert len(result["samples"]) == 3 and result["token_ids"] == result["samples"][0]["token_ids"]
        assert all(len(s["logprobs"]) == 5 and s["finish_reason"] == "length" for s in result["samples"])
    single = SamplingParams(temperature=1.0, seed=5, max_tokens=5, ignore_eos=True)
    with LLM(tiny_qwen3, device="cpu") as llm:
        assert llm.generate([PROMPT], single)[0]["samples"] is None


def test_n_above_max_num_seqs_is_refused(tiny_qwen3):
    with LLM(tiny_qwen3, device="cpu", max_num_seqs=4) as llm:
        with pytest.raises(ValueError, match="max_num_seqs"):
            llm.add_request(PROMPT, SamplingParams(n=5))


def test_a_full_batch_runs_forks_without_exceeding_max_num_seqs_rows(tiny_qwen3):
    """Forks hold their places: a step never samples more rows than max_num_seqs."""
    with LLM(tiny_qwen3, device="cpu", max_num_seqs=4) as llm:
        rows = []
        execute = llm.runner.execute

        def spy(plan):
            rows.append(len(plan.sample_rows))
            return execute(plan)
        llm.runner.execute = spy
        outs = llm.generate([PROMPT, PROMPT[5:], PROMPT[9:]],
                            [SamplingParams(n=3, seed=1, max_tokens=4, ignore_eos=True)] * 3)
    assert max(rows) <= 4
    assert all(len(s["token_ids"]) == 4 for o in outs for s in o["samples"])


def test_aborting_the_first_sample_before_its_prompt_is_done_leaves_the_others_running(tiny_qwen3):
    with LLM(tiny_qwen3, device="cpu", max_num_batched_tokens=16) as llm:  # the prompt takes 3 steps
        first = llm.add_request(PROMPT, SamplingParams(n=3, seed=2, max_tokens=4, ignore_eos=True))
        forks = list(first.forks)
        llm.step()
        llm.abort(first)
        while llm.has_unfinished():
            llm.step()
    assert first.finish_reason == "abort"
    assert [f.finish_reason for f in forks] == ["length", "length"]
    assert all(len(f.completion_token_ids) == 4 for f in forks)


def test_engine_thread_streams_each_sample_and_aborts_one_alone(tiny_qwen3):
    with EngineThread(tiny_qwen3, device="cpu") as engine:
        with pytest.raises(ValueError, match="submit_n"):
            engine.submit(PROMPT, SamplingParams(n=2))
        streams = engine.submit_n(PROMPT, SamplingParams(n=3, seed=3, max_tokens=40, ignore_eos=True, logprobs=0))
        assert [s.sample_index for s in streams] == [0, 1, 2]
        streams[1].abort()
        for s in streams:
            assert s.wait(60)
    assert streams[1].finish_reason == "abort"
    for s in (streams[0], streams[2]):
        assert s.finish_reason == "length" and len(s.token_ids) == 40 and len(s.logprobs) == 40


def test_each_samples_stream_reports_the_prompt_tokens_it_took_from_the_cache(tiny_qwen3):
    with EngineThread(tiny_qwen3, device="cpu", kvcache_block_size=16) as engine:
        before = engine.stats()
        streams = engine.submit_n(PROMPT, SamplingParams(temperature=1.0, n=3, seed=2, max_tokens=4, ignore_eos=True))
        for stream in streams:
            stream.wait()
        after = engine.stats()
    # The first computed the prompt; each fork found its two full blocks cached, as the engine counts.
    assert [s.num_cached_tokens for s in streams] == [0, 32, 32]
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == sum(s.num_cached_tokens for s in streams)
