"""Random interleavings of requests through the real engine, checked after every step.

Each example draws an engine (block size, a KV pool small enough to preempt, small batch and chunk
budgets, the overlap on or off and toggled between steps) and a run of requests: prompts around
block boundaries, some sharing a system prompt, exact duplicates, next turns built on an earlier
request's full text, arriving at random steps, with random max_tokens, EOS tokens, and aborts at
random steps or phases (waiting, mid-prefill, decoding, preempted, with its last token in flight,
after it ended), and launches that fail. After every step the block bookkeeping is checked against
the sequences that hold blocks, and every hashed block against its chain and the K/V the launched
steps wrote (KVReadChecker, which also checks every read). At the end every request's tokens are
checked token by token against HF transformers' own model on the same tiny checkpoint, the pool
must be whole again, and the cache the run left must serve an exact duplicate all of its full
blocks, with the right tokens.

CI runs a fixed set of examples (derandomized), so that whether a change lands never rests on the
draw; ENGINE_FUZZ_EXAMPLES=2000 draws new ones, off CI. A failure prints the example to replay.
"""
import os
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.core.block_manager import CACHED, FREE, SHARED, USED, chain_hash
from engine.core.sequence import PENDING_TOKEN, SequenceStatus
from tests.conftest import INJECTED_FAULT, fail_next_launch
from tests.test_inflight_prefix import KVReadChecker

VOCAB = 211  # the tiny checkpoint's (tests/conftest.py)
MAX_MODEL_LEN = 72
MAX_STEPS = 3000
PHASES = ("waiting", "prefilling", "decoding", "preempted", "last_in_flight", "finished")


@dataclass
class Request:
    kind: str  # "fresh", "system", "duplicate" (of `of`), "next_turn" (of `of`)
    of: int
    length: int  # prompt tokens (fresh), user tokens (system, next_turn)
    system: int
    arrival: int
    max_tokens: int
    ignore_eos: bool
    abort_step: int | None  # steps after its arrival
    abort_phase: str | None


@dataclass
class Scenario:
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_prefill_chunk: int | None
    max_num_seqs: int
    full_chunk_context: int | None  # small: chunks shrink with their context while streams decode
    async_scheduling: bool
    toggle_overlap: float  # chance per step to flip async_scheduling
    systems: list[int]  # system prompt lengths
    eos: list[int]
    fail_steps: list[int]  # steps whose launch fails (the runner raises before queuing anything)
    requests: list[Request]
    token_seed: int


def near_block_boundary(block_size, most):
    return st.one_of(
        st.builds(lambda k, d: max(1, min(most, k * block_size + d)), st.integers(0, most // block_size),
                  st.integers(-1, 1)),
        st.integers(1, most))


@st.composite
def scenarios(draw):
    bs = draw(st.sampled_from([4, 8]))
    num_blocks = draw(st.integers(36 // bs, 80 // bs))  # a few prompts' worth: they preempt each other
    most = num_blocks * bs // 2  # so that most prompts fit the pool (LLM.encode refuses the rest)
    systems = draw(st.lists(near_block_boundary(bs, most), min_size=1, max_size=2))
    n = draw(st.integers(3, 10))
    requests = []
    for i in range(n):
        kind = draw(st.sampled_from(["fresh", "system", "system", "duplicate", "next_turn"] if i else
                                    ["fresh", "system"]))
        abort = draw(st.sampled_from([None, None, None, "step", "phase"]))
        requests.append(Request(
            kind=kind, of=draw(st.integers(0, i - 1)) if i else 0,
            length=draw(near_block_boundary(bs, most)), system=draw(st.integers(0, len(systems) - 1)),
            arrival=draw(st.one_of(st.just(0), st.integers(0, 6), st.integers(0, 25))),
            max_tokens=draw(st.integers(1, 32)), ignore_eos=draw(st.booleans()),
            abort_step=draw(st.integers(0, 12)) if abort == "step" else None,
            abort_phase=draw(st.sampled_from(PHASES)) if abort == "phase" else None))
    return Scenario(
        block_size=bs, num_blocks=num_blocks, max_num_batched_tokens=draw(st.integers(6, 48)),
        max_prefill_chunk=draw(st.one_of(st.none(), st.integers(3, 24))),
        max_num_seqs=draw(st.sampled_from([1, 2, 3, 4, 6, 8])),
        full_chunk_context=draw(st.one_of(st.none(), st.integers(8, 48))), async_scheduling=draw(st.booleans()),
        toggle_overlap=draw(st.sampled_from([0.0, 0.0, 0.15])), systems=systems,
        eos=draw(st.lists(st.integers(0, VOCAB - 1), max_size=10)),
        fail_steps=draw(st.one_of(st.just([]), st.just([]), st.lists(st.integers(0, 15), min_size=1, max_size=2))),
        requests=requests,
        token_seed=draw(st.integers(0, 2**32 - 1)))


class GreedyOracle:
    """HF transformers' own model: a completion is greedy if each of its tokens is the argmax of
    the logits after the tokens before it (one teacher-forced forward per completion). Ties within
    float32 noise between the two implementations are allowed either way."""

    def __init__(self, path):
        import transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def check(self, prompt, completion, what):
        if not completion:
            return
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + completion[:-1]])).logits[0, len(prompt) - 1:]
        best = logits.max(dim=-1).values
        got = logits.gather(1, torch.tensor(completion)[:, None])[:, 0]
        bad = (got < best - 1e-4).nonzero()
        if len(bad):
            j = int(bad[0])
            raise AssertionError(f"{what}: completion token {j} is {completion[j]}, greedy is "
                                 f"{int(logits[j].argmax())} (prompt {len(prompt)} tokens, completion {completion})")


@pytest.fixture(scope="module")
def oracle(tiny_qwen3):
    return GreedyOracle(tiny_qwen3)


def check_bookkeeping(llm: LLM, checker: KVReadChecker, seqs, prefixes):
    """The block manager's state against the sequences: reference counts are holders, the free list
    is exactly the unheld blocks, and every hash served names a block whose every slot a launched
    step wrote for that hash's prefix."""
    bm, sched, bs = llm.blocks, llm.scheduler, llm.block_size
    held = {}
    for seq in sched.running:
        assert seq.status == SequenceStatus.RUNNING
        assert len(seq.block_table) * bs >= seq.num_computed_tokens
        assert len(set(seq.block_table)) == len(seq.block_table), f"sequence {seq.seq_id} holds a block twice"
        for b in seq.block_table:
            held[b] = held.get(b, 0) + 1
    for seq in seqs:
        if seq.status != SequenceStatus.RUNNING:
            assert not seq.block_table, f"{seq.status.name} sequence {seq.seq_id} still holds blocks"
        if seq.status == SequenceStatus.WAITING:
            assert seq.num_computed_tokens == 0 and seq in sched.waiting
        if seq.is_finished:
            assert PENDING_TOKEN not in seq.token_ids and seq not in sched.waiting and seq not in sched.running
        assert seq.num_cached_tokens % bs == 0 and seq.num_cached_tokens < seq.num_prompt_tokens
        prev = None
        for i, h in enumerate(seq.block_hashes):  # remember what prefix each hash stands for
            prefix = tuple(seq.token_ids[:(i + 1) * bs])
            assert PENDING_TOKEN not in prefix, f"sequence {seq.seq_id} hashed a block with a token in flight"
            assert h == chain_hash(prev, list(prefix[-bs:])), f"sequence {seq.seq_id}: block {i}'s hash is stale"
            assert prefixes.setdefault(h, prefix) == prefix, "two prefixes with one hash"
            prev = h
    assert len(sched.running) <= llm.config.max_num_seqs
    assert sched.prefix_hit_tokens <= sched.prompt_tokens
    for block in bm.blocks:
        b = block.block_id
        assert block.ref_count == held.get(b, 0), f"block {b}: ref_count {block.ref_count}, held by {held.get(b, 0)}"
        assert (b in bm.free) == (block.ref_count == 0), f"block {b} is free and held, or neither"
        state = (CACHED if block.hash is not None else FREE) if block.ref_count == 0 else \
            (USED if block.ref_count == 1 else SHARED)
        assert bm.states[b] == state
    assert len(bm.free) + len(held) == bm.num_blocks
    for h, b in bm.hash_to_block.items():
        block = bm.blocks[b]
        assert block.hash == h and block.token_ids is not None
        prefix = prefixes[h]
        assert block.token_ids == prefix[-bs:]
        start = len(prefix) - bs
        for offset in range(bs):
            p = start + offset
            writer = checker.written.get(b * bs + offset)
            assert writer is not None, f"block {b} is cached for positions {start}..{start + bs - 1}, never written"
            other, q = writer
            assert q == p, f"block {b} cached for position {p}, its slot written for position {q}"
            assert tuple(other.token_ids[:p + 1]) == prefix[:p + 1], \
                f"block {b} cached for a prefix, written by sequence {other.seq_id} for other tokens"


def in_phase(seq, phase) -> bool:
    if phase == "waiting":
        return seq.status == SequenceStatus.WAITING and seq.num_preemptions == 0
    if phase == "preempted":
        return seq.status == SequenceStatus.WAITING and seq.num_preemptions > 0
    if phase == "prefilling":
        return seq.status == SequenceStatus.RUNNING and 0 < seq.num_computed_tokens < seq.num_prompt_tokens
    if phase == "decoding":
        return seq.status == SequenceStatus.RUNNING and seq.num_completion_tokens > 0
    if phase == "last_in_flight":
        return seq.token_ids[-1] == PENDING_TOKEN and seq.num_tokens >= seq.max_num_tokens
    return seq.is_finished  # "finished": an abort after the end changes nothing


def phase_of(seq) -> str:
    return next((p for p in PHASES[:-1] if in_phase(seq, p)), "finished" if seq.is_finished else "other")


def build_prompt(req: Request, rng, systems, prompts, seqs):
    if req.kind == "fresh":
        return [rng.randrange(VOCAB) for _ in range(req.length)]
    if req.kind == "system":
        return systems[req.system] + [rng.randrange(VOCAB) for _ in range(req.length)]
    if req.kind == "duplicate":
        return list(prompts[req.of])
    # A next turn: the earlier request's prompt and completion, then a new message.
    earlier = seqs[req.of]
    return earlier.token_ids + [rng.randrange(VOCAB) for _ in range(max(1, req.length // 3))]


def fits(llm, prompt) -> bool:
    return len(prompt) < llm.config.max_model_len and -(-(len(prompt) + 1) // llm.block_size) <= llm.blocks.num_blocks


def run_scenario(model_path, oracle, sc: Scenario):
    rng = random.Random(sc.token_seed)
    systems = [[rng.randrange(VOCAB) for _ in range(n)] for n in sc.systems]
    with LLM(model_path, device="cpu", kvcache_block_size=sc.block_size, num_kvcache_blocks=sc.num_blocks,
             max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=sc.max_num_batched_tokens,
             max_prefill_chunk=sc.max_prefill_chunk, max_num_seqs=sc.max_num_seqs,
             async_scheduling=sc.async_scheduling) as llm:
        if sc.full_chunk_context is not None:
            llm.scheduler.full_chunk_context, llm.scheduler.min_chunk = sc.full_chunk_context, 2
        llm.eos_ids = set(sc.eos)
        checker = KVReadChecker(llm)
        execute = llm.runner.execute  # the checker's, which records what each launched step writes
        prefixes = {}
        prompts, seqs, arrived_at = {}, {}, {}
        streamed, finished_by_output, aborted_by_us, admitted = {}, set(), set(), set()
        todo = list(range(len(sc.requests)))
        step = 0
        while todo or llm.has_unfinished():
            assert step < MAX_STEPS, "the engine stopped making progress"
            for i in list(todo):
                req = sc.requests[i]
                if req.arrival > step:
                    continue
                if req.kind in ("duplicate", "next_turn") and req.of not in seqs:
                    if req.of not in todo:  # the earlier one was skipped: so is this one
                        todo.remove(i)
                    continue
                if req.kind == "next_turn" and not seqs[req.of].is_finished:
                    continue
                todo.remove(i)
                prompt = build_prompt(req, rng, systems, prompts, seqs)
                if not fits(llm, prompt):
                    event("a prompt too long for the engine, skipped")
                    continue
                params = SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=req.ignore_eos)
                prompts[i], arrived_at[i] = prompt, step
                seqs[i] = llm.add_request(prompt, params)
                streamed[i] = []
            if not llm.has_unfinished():  # idle until the next arrival
                step = max(step + 1, min((sc.requests[i].arrival for i in todo), default=step))
                continue
            for i, seq in seqs.items():
                req = sc.requests[i]
                due = req.abort_step is not None and step - arrived_at[i] == req.abort_step
                if (due or req.abort_phase and in_phase(seq, req.abort_phase)) and i not in aborted_by_us:
                    was_finished, reason = seq.is_finished, seq.finish_reason
                    event(f"abort {'at a step' if due else req.abort_phase} while {phase_of(seq)}")
                    llm.abort(seq)
                    aborted_by_us.add(i)
                    assert seq.is_finished and PENDING_TOKEN not in seq.token_ids
                    if was_finished:
                        assert seq.finish_reason == reason, "an abort after the end changed how it ended"
            by_seq = {id(s): i for i, s in seqs.items()}
            if step in sc.fail_steps:
                fail_next_launch(llm)
            try:
                outputs = llm.step()
            except RuntimeError as e:
                assert str(e) == INJECTED_FAULT
                event("a step failed")
                outputs = []
            llm.runner.execute = execute  # a step that launched nothing leaves the fault armed
            for out in outputs:
                i = by_seq[id(out.seq)]
                assert i not in finished_by_output, f"request {i} got output after it finished"
                streamed[i] += out.new_token_ids
                if out.finished:
                    finished_by_output.add(i)
            if sc.toggle_overlap and rng.random() < sc.toggle_overlap:
                llm.async_scheduling = not llm.async_scheduling
            check_bookkeeping(llm, checker, list(seqs.values()), prefixes)
            admitted.update(i for i, seq in seqs.items() if seq.status == SequenceStatus.RUNNING
                            or seq.num_preemptions or seq.num_completion_tokens)
            # Counted once per request, at its first admission; a hit never covers a prompt's last token.
            assert llm.scheduler.prompt_tokens == sum(seqs[i].num_prompt_tokens for i in admitted)
            assert llm.scheduler.prefix_hit_tokens == sum(seqs[i].num_cached_tokens for i in admitted)
            step += 1

        stats = llm.stats()
        event(f"preemptions: {min(stats.num_preemptions, 3)}{'+' if stats.num_preemptions >= 3 else ''}")
        event(f"prefix hits: {bool(stats.prefix_hit_tokens)}")
        event(f"cross-sequence reads: {bool(checker.cross_reads)}")
        for seq in seqs.values():
            event(f"finish: {seq.finish_reason}")
        assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
        assert stats.num_running == stats.num_waiting == 0
        assert stats.prefix_hit_tokens <= stats.prompt_tokens
        for i, seq in seqs.items():
            req = sc.requests[i]
            what = f"request {i} ({req.kind}, {seq.finish_reason})"
            completion = seq.completion_token_ids
            assert seq.is_finished and streamed[i] == completion, what
            assert (i in finished_by_output) == (seq.finish_reason not in ("abort", "error")), what
            assert seq.num_tokens <= seq.max_num_tokens, what
            oracle.check(prompts[i], completion, what)
            stops = [] if req.ignore_eos else [j for j, t in enumerate(completion) if t in llm.eos_ids]
            if seq.finish_reason == "stop":
                assert stops == [len(completion) - 1], what
            else:
                assert not stops, f"{what}: ran past an EOS token"
            if seq.finish_reason == "length" and seq.num_tokens < seq.max_num_tokens:
                # Cut short: alone, it outgrew the whole pool (its last token needs no slot yet).
                assert seq.num_tokens == sc.num_blocks * sc.block_size + 1, what
            if seq.finish_reason == "abort":
                assert i in aborted_by_us, what
            if seq.finish_reason == "error":  # its token was in flight when a launch failed
                assert sc.fail_steps, what

        # The cache the run left serves only what it holds: a prompt run again reuses cached blocks
        # and gets greedy tokens; run once more right after, it finds every full block of its prompt.
        done = [i for i in seqs if seqs[i].finish_reason != "abort"]
        for i in rng.sample(done, min(2, len(done))):
            prompt = prompts[i]
            params = SamplingParams(temperature=0, max_tokens=sc.requests[i].max_tokens, ignore_eos=True)
            for again in range(2):
                seq = llm.add_request(prompt, params)
                seqs[("again", i, again)] = seq
                while llm.has_unfinished():
                    llm.step()
                    check_bookkeeping(llm, checker, list(seqs.values()), prefixes)
                oracle.check(prompt, seq.completion_token_ids, f"request {i} run again")
            full = (len(prompt) - 1) // sc.block_size
            # Holds unless the second run had to evict the first run's prompt blocks.
            if sc.num_blocks - full >= -(-seq.max_num_tokens // sc.block_size) - full:
                assert seq.num_cached_tokens == full * sc.block_size, "a duplicate missed cached blocks"
        assert llm.stats().num_free_blocks == sc.num_blocks
    return stats


EXPLORE = os.environ.get("ENGINE_FUZZ_EXAMPLES")


@settings(max_examples=int(EXPLORE or 100), deadline=None, derandomize=not EXPLORE,
          database=None, print_blob=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sc=scenarios())
def test_random_interleavings_keep_tokens_and_blocks_right(tiny_qwen3, oracle, sc):
    run_scenario(tiny_qwen3, oracle, sc)
