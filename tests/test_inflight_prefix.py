"""Prefixes shared by requests in flight: prompts that arrive together, or while another one with
the same prefix is still being prefilled, take its blocks from the prefix cache instead of
computing them again, and get the tokens HF transformers gives each prompt alone."""
import random
import threading

import pytest

from engine import LLM, EngineThread, SamplingParams
from tests.conftest import INJECTED_FAULT, fail_next_launch, hf_greedy, random_prompts

BLOCK = 16
SYSTEM = 48  # three full blocks


class KVReadChecker:
    """Watches every step the engine launches and fails if any sequence attends to a cache slot
    whose K/V no step queued so far (this one included) wrote for the same tokens: each slot
    remembers the sequence and position that last wrote it, and a reader's tokens up to that
    position must equal the writer's. Independent of how the scheduler and block manager decide."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.written: dict[int, tuple] = {}  # slot -> (writer sequence, position)
        self.batch = []
        self.cross_reads = 0  # slots read that another sequence wrote
        schedule, execute = llm.scheduler.schedule, llm.runner.execute

        def spy_schedule():
            self.batch, cut_short = schedule()
            return self.batch, cut_short

        def spy_execute(plan):
            self.check(plan)
            return execute(plan)
        llm.scheduler.schedule, llm.runner.execute = spy_schedule, spy_execute

    def check(self, plan):
        bs = self.llm.block_size
        slots = [s for s in plan.slot_mapping if s >= 0]
        assert len(set(slots)) == len(slots), "two rows of one step write the same slot"
        assert len(self.batch) == plan.num_seqs
        for (seq, n), table in zip(self.batch, plan.block_tables):
            start = seq.num_computed_tokens
            for p in range(start, start + n):
                self.written[table[p // bs] * bs + p % bs] = (seq, p)
        for (seq, n), table, context in zip(self.batch, plan.block_tables, plan.context_lens):
            furthest = {}  # writer -> the furthest position this reader takes from it
            for p in range(context):
                writer = self.written.get(table[p // bs] * bs + p % bs)
                assert writer is not None, f"sequence {seq.seq_id} reads position {p}, which no step wrote"
                other, q = writer
                assert q == p, f"sequence {seq.seq_id} reads position {p} from a slot written for position {q}"
                if other is not seq:
                    furthest[other] = p
                    self.cross_reads += 1
            for other, p in furthest.items():
                assert other.token_ids[:p + 1] == seq.token_ids[:p + 1], \
                    f"sequence {seq.seq_id} reads K/V that sequence {other.seq_id} wrote for other tokens"


def shared_prompts(num, seed, system_len=SYSTEM):
    system = random_prompts([system_len], seed=seed)[0]
    users = random_prompts([5 + 3 * i for i in range(num)], seed=seed + 1)
    return [system + u for u in users]


def run_to_end(llm: LLM, seqs) -> int:
    """Steps until every request ends; returns the prompt tokens the steps computed."""
    prefill = 0
    while llm.has_unfinished():
        llm.step()
        prefill += llm.last_step_tokens[0]
    assert all(s.is_finished for s in seqs)
    return prefill


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("batch_tokens", [4096, 40])
def test_prompts_sharing_a_system_prompt_in_one_call_compute_it_once(tiny_qwen3, overlap, batch_tokens):
    """In one generate call: all in the first step, or (40 tokens a step) the system prompt over
    two steps, with the others admitted only once every block of it is scheduled."""
    prompts = shared_prompts(6, seed=101)
    expected = hf_greedy(tiny_qwen3, prompts, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=BLOCK, max_num_batched_tokens=batch_tokens,
             async_scheduling=overlap) as llm:
        checker = KVReadChecker(llm)
        seqs = [llm.add_request(p, params) for p in prompts]
        computed = run_to_end(llm, seqs)
        stats = llm.stats()
        assert [s.completion_token_ids for s in seqs] == expected
        assert stats.prefix_hit_tokens == 5 * SYSTEM
        assert [s.num_cached_tokens for s in seqs] == [0] + [SYSTEM] * 5
        assert computed == sum(map(len, prompts)) - 5 * SYSTEM
        assert checker.cross_reads > 0
        assert stats.num_free_blocks == stats.num_blocks


def test_a_prompt_sent_while_another_prefills_the_same_prefix_reuses_all_of_it(tiny_qwen3):
    """A long shared prefix prefilled in chunks between a stream's decode tokens: the second prompt,
    sent while the first is mid-prefill, is admitted once the first one's chunks cover the prefix
    (in the step of its last chunk) and computes none of it."""
    system = 100
    prompts = shared_prompts(2, seed=111, system_len=system)
    other = random_prompts([9], seed=112)[0]
    expected = hf_greedy(tiny_qwen3, [other] + prompts, 6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=BLOCK, max_prefill_chunk=24) as llm:
        KVReadChecker(llm)
        stream = llm.add_request(other, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        computed = 0
        while stream.num_completion_tokens == 0:
            llm.step()
            computed += llm.last_step_tokens[0]
        first = llm.add_request(prompts[0], params)
        llm.step()
        computed += llm.last_step_tokens[0]
        assert 0 < first.num_computed_tokens < system
        second = llm.add_request(prompts[1], params)
        computed += run_to_end(llm, [stream, first, second])
        assert [s.completion_token_ids[:6] for s in (stream, first, second)] == expected
        assert second.num_cached_tokens == system // BLOCK * BLOCK
        assert computed == len(other) + sum(map(len, prompts)) - system // BLOCK * BLOCK
        assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_a_prompt_waits_for_the_shared_blocks_another_prompt_is_about_to_compute(tiny_qwen3):
    """While a stream decodes, a long prompt's chunks shrink with its context (full_chunk_context),
    leaving budget for the next prompt in the same step. That prompt shares 150 tokens with it: it
    is held back while the first one's next chunk computes the next shared block, instead of
    computing that block too, and it is admitted with all nine full shared blocks."""
    system = 150
    prompts = shared_prompts(2, seed=151, system_len=system)
    other = random_prompts([7], seed=152)[0]
    expected = hf_greedy(tiny_qwen3, [other] + prompts, 6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=BLOCK, max_num_batched_tokens=256) as llm:
        llm.scheduler.full_chunk_context, llm.scheduler.min_chunk = 64, 16
        KVReadChecker(llm)
        stream = llm.add_request(other, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        computed = 0
        while stream.num_completion_tokens == 0:
            llm.step()
            computed += llm.last_step_tokens[0]
        first, second = (llm.add_request(p, params) for p in prompts)
        llm.step()
        computed += llm.last_step_tokens[0]
        assert 0 < first.num_computed_tokens < system and llm.scheduler.waiting[0] is second
        computed += run_to_end(llm, [stream, first, second])
        assert [s.completion_token_ids[:6] for s in (stream, first, second)] == expected
        assert second.num_cached_tokens == system // BLOCK * BLOCK
        assert computed == len(other) + sum(map(len, prompts)) - system // BLOCK * BLOCK
        assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_tabs_sending_at_once_through_the_engine_thread_compute_the_system_prompt_once(tiny_qwen3):
    prompts = shared_prompts(5, seed=121)
    other = random_prompts([11], seed=122)[0]
    expected = hf_greedy(tiny_qwen3, prompts, 6)
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=BLOCK, max_prefill_chunk=20) as llm:
        checker = KVReadChecker(llm)
        with EngineThread(llm) as engine:
            # A stream decoding meanwhile, so the prompts are prefilled in chunks between its tokens.
            busy = engine.submit(other, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
            next(iter(busy))
            streams = []
            go = threading.Barrier(len(prompts))

            def tab(prompt):
                go.wait()
                streams.append((prompt, engine.submit(prompt, SamplingParams(temperature=0, max_tokens=6))))
            tabs = [threading.Thread(target=tab, args=(p,)) for p in prompts]
            for t in tabs:
                t.start()
            for t in tabs:
                t.join()
            for _, s in streams:
                assert s.wait(60) and s.finish_reason == "length"
            busy.abort()
            assert busy.wait(60)
        by_prompt = {tuple(p): s for p, s in streams}
        assert [by_prompt[tuple(p)].token_ids for p in prompts] == expected
        # Whichever tab came first computed the system prompt; the other four found it.
        assert sorted(s.num_cached_tokens for _, s in streams) == [0] + [SYSTEM] * 4
        assert llm.stats().prefix_hit_tokens == 4 * SYSTEM
        assert checker.cross_reads > 0
        assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_preemption_and_aborts_among_requests_sharing_blocks_in_flight(tiny_qwen3):
    """Two system prompts, requests arriving at random steps and some aborted, in a cache small
    enough to preempt: whoever holds a shared block keeps it valid, nothing reads K/V that was not
    written for its tokens, every finished request gets HF's tokens, and no block leaks."""
    rng = random.Random(7)
    systems = random_prompts([24, 37], seed=131)
    prompts = [systems[i % 2] + u for i, u in enumerate(random_prompts([rng.randint(2, 12) for _ in range(12)],
                                                                         seed=132))]
    expected = hf_greedy(tiny_qwen3, prompts, 24)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4, num_kvcache_blocks=48, max_prefill_chunk=16) as llm:
        checker = KVReadChecker(llm)
        seqs, pending = [], list(range(len(prompts)))
        while pending or llm.has_unfinished():
            while pending and rng.random() < 0.5:
                i = pending.pop(0)
                seqs.append((i, llm.add_request(prompts[i], params)))
            llm.step()
            live = [s for _, s in seqs if not s.is_finished]
            if live and rng.random() < 0.08:
                llm.abort(rng.choice(live))
        stats = llm.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.num_running == stats.num_waiting == 0
        assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0 and checker.cross_reads > 0
    aborted = [s for _, s in seqs if s.finish_reason == "abort"]
    assert 0 < len(aborted) < len(seqs)
    for i, s in seqs:
        if s.finish_reason == "abort":
            assert s.completion_token_ids == expected[i][:s.num_completion_tokens]
        else:
            assert s.completion_token_ids == expected[i]


@pytest.mark.parametrize("overlap", [False, True])
def test_blocks_of_a_step_that_never_launched_are_not_served_from_the_cache(tiny_qwen3, overlap):
    """The step whose schedule registered the system prompt's last block, and let a second prompt
    take it, fails before it is queued: that block's hash goes, both prompts recompute, and the
    blocks an earlier step did compute stay cached."""
    prompts = shared_prompts(2, seed=141)
    expected = hf_greedy(tiny_qwen3, prompts, 6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=BLOCK, max_num_batched_tokens=40,
             async_scheduling=overlap) as llm:
        checker = KVReadChecker(llm)
        first, second = (llm.add_request(p, params) for p in prompts)
        llm.step()  # the first prompt's first 40 tokens: blocks 0 and 1 registered and queued
        assert first.num_computed_tokens == 40 and len(llm.blocks.hash_to_block) == 2
        fail_next_launch(llm)
        with pytest.raises(RuntimeError, match=INJECTED_FAULT):
            llm.step()  # block 2 registered, the second prompt admitted on all three: never queued
        assert second.num_cached_tokens == SYSTEM
        assert len(llm.blocks.hash_to_block) == 2
        assert not llm.scheduler.running and [s.num_computed_tokens for s in llm.scheduler.waiting] == [0, 0]
        run_to_end(llm, [first, second])
        assert [first.completion_token_ids, second.completion_token_ids] == expected
        assert checker.cross_reads > 0
        assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_same_step_sharing_with_the_triton_kernels_in_a_mixed_step(tiny_qwen3):
    """The Triton path (fused q/k-norm + RoPE + K/V store, then the prefill kernel over the work
    list; interpreted on CPU): in a step that also decodes a stream, the second prompt attends to
    the shared blocks that the first prompt's tokens write earlier in each layer of that step."""
    prompts = shared_prompts(2, seed=161, system_len=32)
    other = random_prompts([5], seed=162)[0]
    expected = hf_greedy(tiny_qwen3, [other] + prompts, 2)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=BLOCK, attention_backend="triton", max_model_len=128,
             num_kvcache_blocks=32) as llm:
        checker = KVReadChecker(llm)
        stream = llm.add_request(other, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        while stream.num_completion_tokens == 0:
            llm.step()
        seqs = [llm.add_request(p, params) for p in prompts]
        llm.step()
        assert llm.last_step_tokens == (len(prompts[0]) + len(prompts[1]) - 32, 1)
        run_to_end(llm, [stream, *seqs])
        assert [s.completion_token_ids[:2] for s in (stream, *seqs)] == expected
        assert seqs[1].num_cached_tokens == 32 and checker.cross_reads > 0
        assert llm.stats().num_free_blocks == llm.stats().num_blocks
