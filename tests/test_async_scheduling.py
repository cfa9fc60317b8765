"""The overlapped step (async_scheduling) gives exactly what the synchronous one gives: the same
tokens, text, finish reasons and prefix-cache commits, no token past a finish, and no leaked block.
On CPU the same code path runs as on CUDA; only the waiting is trivial."""
import random

import pytest

from engine import LLM, SamplingParams
from engine.core.sequence import PENDING_TOKEN, Sequence
from engine.core.step_plan import plan_step
from tests.conftest import INJECTED_FAULT, fail_next_launch, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(llm: LLM, prompts, params, add_at=None):
    """Steps the engine by hand until every request ends; returns each request's sequence and the
    step outputs it got, checking that nothing is reported after a request's finish."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs = {s.seq_id: [] for s in seqs}
    while llm.has_unfinished():
        for out in llm.step():
            got = outputs[out.seq.seq_id]
            assert not (got and got[-1].finished), "output after the request finished"
            got.append(out)
    for s in seqs:
        got = outputs[s.seq_id]
        assert got[-1].finished and sum(o.finished for o in got) == 1
        assert [t for o in got for t in o.new_token_ids] == s.completion_token_ids
        assert PENDING_TOKEN not in s.token_ids
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_blocks
    return seqs, outputs


def completions(seqs):
    return [(s.completion_token_ids, s.finish_reason) for s in seqs]


def both_ways(path, prompts, params, **kwargs):
    results = []
    for overlap in (False, True):
        with LLM(path, device="cpu", async_scheduling=overlap, **kwargs) as llm:
            assert llm.async_scheduling is overlap
            results.append(completions(run(llm, prompts, params)[0]))
    return results


def record_plans(llm: LLM) -> list:
    """Every step plan the engine hands its runner from now on, in order."""
    plans, execute = [], llm.runner.execute

    def spy(plan):
        plans.append(plan)
        return execute(plan)
    llm.runner.execute = spy
    return plans


def test_overlap_is_the_default_and_decode_inputs_come_from_the_device(tiny_qwen3):
    with LLM(tiny_qwen3, device="cpu") as llm:
        assert llm.async_scheduling
        plans = record_plans(llm)
        seqs = [llm.add_request(p, GREEDY) for p in random_prompts([5, 9], seed=1)]
        assert llm.step() == []  # the prefill is in flight: nothing settled yet
        assert seqs[0].token_ids[-1] == PENDING_TOKEN
        outs = llm.step()  # launches the first decode, then settles the prefill
        assert [o.seq for o in outs] == seqs and all(s.token_ids[-1] == PENDING_TOKEN for s in seqs)
    decode = plans[1]
    assert decode.is_decode and decode.feed_rows == [0, 1] and decode.feed_from == [0, 1]
    assert decode.input_ids == [PENDING_TOKEN, PENDING_TOKEN]
    assert [o.new_token_ids[0] for o in outs] == [s.token_ids[-2] for s in seqs]


def test_greedy_tokens_match_with_chunked_prefill_and_staggered_finishes(tiny_qwen3):
    prompts = random_prompts([70, 5, 41, 16, 33], seed=7)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 9, 24, 17)]
    sync, overlap = both_ways(tiny_qwen3, prompts, params, kvcache_block_size=8, max_num_batched_tokens=24,
                              max_prefill_chunk=13)
    assert overlap == sync
    assert [len(tokens) for tokens, _ in overlap] == [1, 2, 9, 24, 17]


def test_sampled_seeded_tokens_match(tiny_qwen3):
    prompts = random_prompts([30, 22, 41, 12, 8], seed=22)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=30, ignore_eos=True, seed=1),
              SamplingParams(temperature=0.6, max_tokens=25, ignore_eos=True, seed=2),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.3, top_p=0.5, max_tokens=30, ignore_eos=True, seed=3),
              SamplingParams(temperature=1.0, top_k=5, max_tokens=7, ignore_eos=True, seed=4)]
    sync, overlap = both_ways(tiny_qwen3, prompts, params, kvcache_block_size=4, max_prefill_chunk=16)
    assert overlap == sync


def test_preemption_with_tokens_in_flight_loses_and_repeats_nothing(tiny_qwen3):
    prompts = random_prompts([30, 22, 41, 12, 27, 35], seed=21)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 3 + \
             [SamplingParams(temperature=0.8, top_k=30, max_tokens=40, ignore_eos=True, seed=i) for i in range(3)]
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4, async_scheduling=False) as roomy:
        expected = completions(run(roomy, prompts, params)[0])
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4, num_kvcache_blocks=40) as tight:
        got = completions(run(tight, prompts, params)[0])
        assert tight.stats().num_preemptions > 0
    assert got == expected


def test_a_sequence_that_outgrows_the_cache_keeps_its_token_in_flight(tiny_qwen3):
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4, num_kvcache_blocks=5) as llm:
        (seq,), _ = run(llm, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert seq.finish_reason == "length" and seq.num_completion_tokens == 5 * 4 - 3 + 1


def eos_at(reference: list[int], want) -> int | None:
    """An index i of reference where want(i) holds and reference[i] appears nowhere before it."""
    return next((i for i, t in enumerate(reference) if want(i) and t not in reference[:i]), None)


@pytest.mark.parametrize("overlap", [False, True])
def test_eos_ends_a_sequence_and_the_token_after_it_is_dropped(tiny_qwen3, overlap):
    prompts = random_prompts([12, 19, 26], seed=31)
    with LLM(tiny_qwen3, device="cpu", async_scheduling=False) as llm:
        reference = [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
    ends = [eos_at(r, lambda i: 3 <= i < 20) for r in reference]
    assert all(e is not None for e in ends)
    with LLM(tiny_qwen3, device="cpu", async_scheduling=overlap) as llm:
        llm.eos_ids = {r[e] for r, e in zip(reference, ends)}
        params = SamplingParams(temperature=0, max_tokens=24)
        seqs, _ = run(llm, prompts, params)
    for seq, r in zip(seqs, reference):
        stop = next(i for i, t in enumerate(r) if t in llm.eos_ids)
        assert seq.finish_reason == "stop" and seq.completion_token_ids == r[:stop + 1]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_dropped_tokens_slot_is_never_in_a_cached_block(tiny_qwen3, overlap):
    """A sequence ends by EOS exactly where its last token fills a block: the overlapped step after
    it writes that token's K/V into the block, which must still not be committed, so a second turn
    hits the same blocks as without the overlap and gives the tokens a fresh engine gives."""
    block = 8
    prompt = random_prompts([13], seed=41)[0]
    with LLM(tiny_qwen3, device="cpu", async_scheduling=False) as llm:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        reference = llm.generate([prompt], params)[0]["token_ids"]
    end = eos_at(reference, lambda i: (len(prompt) + i + 1) % block == 0)
    assert end is not None
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=block, async_scheduling=overlap) as llm:
        llm.eos_ids = {reference[end]}
        (first,), _ = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=40))
        turn1 = prompt + first.completion_token_ids
        assert first.finish_reason == "stop" and len(turn1) % block == 0
        # Only the blocks before the last one hold committed hashes (this engine ran nothing else).
        assert sum(b.hash is not None for b in llm.blocks.blocks) == len(turn1) // block - 1
        turn2 = turn1 + random_prompts([6], seed=42)[0]
        before = llm.stats().prefix_hit_tokens
        (second,), _ = run(llm, [turn2], GREEDY)
        assert llm.stats().prefix_hit_tokens - before == len(turn1) - block
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=block) as fresh:
        assert fresh.generate([turn2], GREEDY)[0]["token_ids"] == second.completion_token_ids


def test_length_finishes_run_no_extra_token(tiny_qwen3):
    """A token that is the last by length is known before it lands: its sequence is not run again."""
    prompts = random_prompts([9, 14, 3, 20], seed=51)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 5, 12, 7)]
    tokens_run = []
    for overlap in (False, True):
        with LLM(tiny_qwen3, device="cpu", async_scheduling=overlap) as llm:
            total = 0
            seqs = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
            while llm.has_unfinished():
                llm.step()
                total += sum(llm.last_step_tokens)
            assert [s.num_completion_tokens for s in seqs] == [1, 5, 12, 7]
            tokens_run.append(total)
    assert tokens_run[0] == tokens_run[1]


def test_random_aborts_leak_no_blocks(tiny_qwen3):
    rng = random.Random(5)
    prompts = random_prompts([rng.randint(3, 40) for _ in range(12)], seed=61)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4, async_scheduling=False) as llm:
        expected = [o["token_ids"] for o in llm.generate(prompts, params)]
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4, num_kvcache_blocks=60, max_prefill_chunk=16) as llm:
        seqs, streamed = [], {}
        pending = list(range(len(prompts)))
        while pending or llm.has_unfinished():
            if pending and rng.random() < 0.4:
                i = pending.pop(0)
                seqs.append((i, llm.add_request(prompts[i], params)))
                streamed[seqs[-1][1].seq_id] = []
            for out in llm.step():
                streamed[out.seq.seq_id] += out.new_token_ids
            live = [s for _, s in seqs if not s.is_finished]
            if live and rng.random() < 0.15:
                victim = rng.choice(live)
                llm.abort(victim)
                assert PENDING_TOKEN not in victim.token_ids
        stats = llm.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.num_running == stats.num_waiting == 0
        assert stats.num_preemptions > 0
    aborted = [s for _, s in seqs if s.finish_reason == "abort"]
    assert 0 < len(aborted) < len(seqs)
    for i, s in seqs:
        assert streamed[s.seq_id] == s.completion_token_ids
        if s.finish_reason == "abort":
            assert s.completion_token_ids == expected[i][:s.num_completion_tokens]
        else:
            assert s.completion_token_ids == expected[i]


def test_stop_strings_and_streamed_text_match(demo_model_path):
    prompts = ["Tell me a story", "stop test", "x"]
    with LLM(demo_model_path, device="cpu", max_model_len=512, async_scheduling=False) as llm:
        free = [o["text"] for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))]
    stops = [text[6:9] for text in free]
    runs = []
    for overlap in (False, True):
        with LLM(demo_model_path, device="cpu", max_model_len=512, async_scheduling=overlap) as llm:
            params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[s]) for s in stops]
            seqs = [llm.add_request(p, sp, stream=True) for p, sp in zip(prompts, params)]
            texts = {s.seq_id: "" for s in seqs}
            while llm.has_unfinished():
                for out in llm.step():
                    texts[out.seq.seq_id] += out.new_text
            runs.append([(texts[s.seq_id], s.finish_reason, s.completion_token_ids) for s in seqs])
    assert runs[0] == runs[1]
    for (text, reason, _), full, stop in zip(runs[1], free, stops):
        assert reason == "stop" and text == full[:full.index(stop)]


def test_turning_the_overlap_off_between_steps(tiny_qwen3):
    prompts = random_prompts([10, 30], seed=71)
    with LLM(tiny_qwen3, device="cpu", async_scheduling=False) as llm:
        expected = [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
    with LLM(tiny_qwen3, device="cpu") as llm:
        seqs = [llm.add_request(p, GREEDY) for p in prompts]
        for _ in range(5):
            llm.step()
        llm.async_scheduling = False
        llm.step()
        assert all(PENDING_TOKEN not in s.token_ids for s in seqs)
        while llm.has_unfinished():
            llm.step()
    assert [s.completion_token_ids for s in seqs] == expected


def test_a_failed_step_ends_the_sequences_with_tokens_in_flight(tiny_qwen3):
    with LLM(tiny_qwen3, device="cpu") as llm:
        seqs = [llm.add_request(p, GREEDY) for p in random_prompts([10, 12], seed=81)]
        for _ in range(3):
            llm.step()
        fail_next_launch(llm)
        with pytest.raises(RuntimeError, match=INJECTED_FAULT):
            llm.step()
        assert [s.finish_reason for s in seqs] == ["error", "error"]
        assert all(PENDING_TOKEN not in s.token_ids for s in seqs) and not llm.has_unfinished()
        assert llm.stats().num_free_blocks == llm.stats().num_blocks
        prompt = random_prompts([7], seed=82)[0]
        again = llm.generate([prompt], GREEDY)[0]["token_ids"]
    with LLM(tiny_qwen3, device="cpu", async_scheduling=False) as fresh:
        assert fresh.generate([prompt], GREEDY)[0]["token_ids"] == again


def test_a_step_that_fails_right_after_the_overlap_is_turned_off_loses_no_reported_token(tiny_qwen3):
    """Found by tests/test_engine_fuzz.py: the first step after the overlap was turned off settled
    the step in flight before scheduling, so when its own launch then failed, the tokens it had
    just appended were never reported by any step() (a stream would miss them)."""
    with LLM(tiny_qwen3, device="cpu") as llm:
        seqs = [llm.add_request(p, GREEDY) for p in random_prompts([10, 12], seed=83)]
        reported = {s.seq_id: [] for s in seqs}
        for _ in range(3):
            for out in llm.step():
                reported[out.seq.seq_id] += out.new_token_ids
        llm.async_scheduling = False
        fail_next_launch(llm)
        with pytest.raises(RuntimeError, match=INJECTED_FAULT):
            llm.step()
        for s in seqs:
            assert reported[s.seq_id] == s.completion_token_ids
            assert s.finish_reason == "error"  # as when a step fails with the overlap on: its tokens were in flight
        assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_a_pending_token_inside_a_prefill_chunk_is_fed_from_the_device():
    """A sequence preempted while its token was sampled, and taken back in one chunk: the pending
    token is the chunk's last row, and it comes from the step in flight."""
    params = SamplingParams(temperature=0)
    decoding = Sequence([1, 2, 3, PENDING_TOKEN], params, block_size=4)
    recomputed = Sequence([4, 5, 6, 7, 8, PENDING_TOKEN], params, block_size=4)
    decoding.block_table.extend([0])
    decoding.num_computed_tokens = 3
    recomputed.block_table.extend([1, 2])
    plan = plan_step([(decoding, 1), (recomputed, 6)], 4, pending={recomputed: 0, decoding: 3})
    assert plan.input_ids == [PENDING_TOKEN, 4, 5, 6, 7, 8, PENDING_TOKEN]
    assert plan.feed_rows == [0, 6] and plan.feed_from == [3, 0] and plan.sample_rows == [0, 6]
    # A chunk that stops short of the pending token needs nothing from the device.
    plan = plan_step([(recomputed, 3)], 4, pending={recomputed: 0})
    assert plan.feed_rows == [] and plan.sample_rows == []
    with pytest.raises(RuntimeError, match="no step in flight"):
        plan_step([(decoding, 1)], 4, pending={})
