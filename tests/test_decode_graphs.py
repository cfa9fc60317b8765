"""The decode steps' lean feed (engine.runner.decode_graphs): inputs staged at fixed offsets and copied in
once, pending input ids taken from the token buffer on the device, sampling from the staged
settings. On CPU nothing is captured, so DecodeGraphs runs the code its graphs would capture,
eagerly; tests/gpu checks the captured graphs."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.decode_graphs import SAMPLE_GRAPH_ROWS, DecodeGraphs
from tests.conftest import random_prompts
from tests.test_async_scheduling import completions, run


def attach_decode_feed(llm: LLM, buckets=(1, 2, 4, 8)) -> DecodeGraphs:
    """Gives a CPU engine's runner the decode feed that a GPU runner captures. Buckets past
    max_num_seqs make more steps padded ones; the token buffer grows to hold them."""
    runner, config = llm.runner, llm.config
    # What a CPU cache nothing wrote may hold: the graphs' attention must never read it.
    runner.kv_cache.fill_(float("nan"))
    runner.sampled = torch.zeros(max(buckets[-1], config.max_num_seqs), dtype=torch.int64)
    runner.decode_graphs = DecodeGraphs(
        runner.model, buckets=list(buckets), max_blocks_per_seq=-(-config.max_model_len // runner.block_size),
        hidden_size=config.hf_config.hidden_size, sampled=runner.sampled, device=runner.device, dtype=config.dtype,
        sample=True, vocab_size=config.hf_config.vocab_size)
    return runner.decode_graphs


def count_decode_feed_steps(graphs: DecodeGraphs) -> dict:
    counts = {"steps": 0, "kinds": set(), "padded": 0, "fed": 0}
    stage = graphs.stage

    def counted(plan, bucket):
        kind = stage(plan, bucket)
        counts["steps"] += 1
        counts["kinds"].add(kind)
        counts["padded"] += len(plan.input_ids) < bucket
        counts["fed"] += bool(plan.feed_rows)
        return kind
    graphs.stage = counted
    return counts


def record_masked_kinds(graphs: DecodeGraphs, in_place: list[bool] | None = None) -> list[str]:
    """The kinds of sampling graphs.sample_masked samples with, one per call, from now on; and in
    in_place, whether each call's masks were written in the rows mask_rows() gave."""
    kinds = []
    sample_masked = graphs.sample_masked

    def recorded(bucket, kind, rows, masks):
        kinds.append(kind)
        if in_place is not None:
            in_place.append(masks.data_ptr() == graphs._mask_staging[graphs._next_mask][1].data_ptr())
        sample_masked(bucket, kind, rows, masks)
    graphs.sample_masked = recorded
    return kinds


# Streams join as others end (max_num_seqs 5 of 9), so decode batches change rows, buckets and
# padding, with prompt chunks and the steps that end them in between on the general path.
PROMPTS = random_prompts([30, 5, 41, 16, 9, 23, 12, 7, 19], seed=31)
KW = dict(device="cpu", kvcache_block_size=4, max_num_seqs=5, max_num_batched_tokens=32, max_prefill_chunk=16)


def greedy_reference(path, params):
    with LLM(path, **KW) as llm:
        return completions(run(llm, PROMPTS, params)[0])


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_tokens_match_the_general_path(tiny_qwen3, overlap):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 30, 3, 17, 25, 8, 20, 14, 6)]
    want = greedy_reference(tiny_qwen3, params)
    with LLM(tiny_qwen3, async_scheduling=overlap, **KW) as llm:
        counts = count_decode_feed_steps(attach_decode_feed(llm))
        got = completions(run(llm, PROMPTS, params)[0])
    assert got == want
    assert counts["steps"] > 15 and counts["padded"] > 3 and counts["kinds"] == {"greedy"}
    assert counts["fed"] == (counts["steps"] if overlap else 0)


def test_the_cpu_engine_reads_no_slot_it_has_not_written(tiny_qwen3):
    """The CPU runner's cache starts uninitialised; batched decode pads the shorter contexts and
    must not read their padding from slots nothing wrote. NaN in every slot at the start changes
    no token."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 30, 3, 17, 25, 8, 20, 14, 6)]
    want = greedy_reference(tiny_qwen3, params)
    with LLM(tiny_qwen3, **KW) as llm:
        llm.runner.kv_cache.fill_(float("nan"))
        assert completions(run(llm, PROMPTS, params)[0]) == want


def test_each_kind_of_sampling_graph_picks_what_the_settings_force(tiny_qwen3):
    """top_k=1 leaves only the argmax, and a tiny temperature makes the softmax one-hot: both must
    give the greedy tokens, through the filtering and the plain sampling code, mixed with greedy
    rows in one batch."""
    force = [SamplingParams(temperature=0.8, top_k=1, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=1e-4, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    params = [force[i % 3] for i in range(len(PROMPTS))]
    want = greedy_reference(tiny_qwen3, [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * len(PROMPTS))
    with LLM(tiny_qwen3, **KW) as llm:
        counts = count_decode_feed_steps(attach_decode_feed(llm))
        got = completions(run(llm, PROMPTS, params)[0])
    assert got == want
    assert {"filter", "sample"} <= counts["kinds"]
    with LLM(tiny_qwen3, **KW) as llm:
        counts = count_decode_feed_steps(attach_decode_feed(llm))
        run(llm, PROMPTS, [force[1]] * len(PROMPTS))
    assert counts["kinds"] == {"sample"}
    # A top_k past int32 (SamplingParams takes any) keeps every token, as on the general path.
    huge = SamplingParams(temperature=1e-4, top_k=2**40, max_tokens=20, ignore_eos=True)
    with LLM(tiny_qwen3, **KW) as llm:
        counts = count_decode_feed_steps(attach_decode_feed(llm))
        assert completions(run(llm, PROMPTS, [huge] * len(PROMPTS))[0]) == want
    assert counts["kinds"] == {"filter"}


def test_seeded_rows_sample_on_the_runner_and_match(tiny_qwen3):
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=18, ignore_eos=True, seed=i)
              for i in range(len(PROMPTS))]
    with LLM(tiny_qwen3, **KW) as llm:
        want = completions(run(llm, PROMPTS, params)[0])
    with LLM(tiny_qwen3, **KW) as llm:
        counts = count_decode_feed_steps(attach_decode_feed(llm))
        got = completions(run(llm, PROMPTS, params)[0])
    assert got == want and counts["kinds"] == {None}


def test_sampled_rows_stay_within_top_k():
    """The filtering kind on its own: every row's token is one of its top_k logits, and fresh
    draws differ (the noise is new every step)."""
    vocab, rows = 50, 4
    graphs = DecodeGraphs(_Logits(vocab), buckets=[rows], max_blocks_per_seq=1, hidden_size=vocab,
                          sampled=torch.zeros(rows, dtype=torch.int64), device=torch.device("cpu"),
                          dtype=torch.float32, sample=True, vocab_size=vocab)
    params = [SamplingParams(temperature=1.5, top_k=k) for k in (1, 3, 5, 10)]
    plan = _decode_plan(rows, params)
    draws = set()
    for _ in range(20):
        graphs.hidden.copy_(torch.randn(rows, vocab))
        assert graphs.stage(plan, rows) == "filter"
        graphs._sample(rows, "filter")
        top = graphs.hidden.topk(10, dim=-1).indices
        for row, p in enumerate(params):
            assert graphs.sampled[row].item() in top[row, :p.top_k].tolist()
        draws.add(tuple(graphs.sampled.tolist()))
    assert len(draws) > 1


def test_a_rehearsal_with_its_kernel_launches_skipped_takes_no_index_from_their_outputs(monkeypatch):
    """ModelRunner._compile_ahead rehearses with every launch of a kernel not compiled yet skipped
    (kernels/warm_start.py): its output keeps what it held. On a GPU the argmax and the draws are
    such kernels, and the adjusted kinds index the token counts by their tokens. Here they write
    nothing, as skipped launches, into a token buffer of garbage, and where they make their own
    output it holds tokens past the vocabulary: every kind still rehearses at every bucket (on CPU
    an index past the counts raises), and no count moves."""
    from engine.runner import decode_graphs

    vocab, rows = 50, 4

    def garbage(rows):
        return torch.full((rows,), 10**6, dtype=torch.int64)

    monkeypatch.setattr(decode_graphs, "_argmax", lambda logits, out=None: garbage(len(logits)) if out is None else out)
    monkeypatch.setattr(decode_graphs, "draw", lambda logits, *args, **kwargs: garbage(len(logits)))
    monkeypatch.setattr(decode_graphs, "_draw_from", lambda scaled, *args, **kwargs: garbage(len(scaled)))
    graphs = DecodeGraphs(_RandomLogits(vocab), buckets=[1, rows], max_blocks_per_seq=1, hidden_size=vocab,
                          sampled=garbage(rows), device=torch.device("cpu"), dtype=torch.float32, sample=True,
                          vocab_size=vocab)
    graphs.rehearse()
    assert not graphs.counts.any()


def test_the_staged_bytes_read_back_as_the_plan():
    rows, bucket, width = 3, 4, 5
    graphs = DecodeGraphs(_Logits(8), buckets=[bucket], max_blocks_per_seq=width, hidden_size=8,
                          sampled=torch.zeros(bucket, dtype=torch.int64), device=torch.device("cpu"),
                          dtype=torch.float32, sample=True, vocab_size=8)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_p=0.9),
              SamplingParams(temperature=0.7, top_k=4)]
    plan = _decode_plan(rows, params)
    plan.block_tables = [[7], [1, 2, 3], [4, 5, 6, 8, 9]]
    plan.context_lens = [22, 40, 22]
    for staging in graphs._staging:  # what other buckets' steps may have left there
        staging.fill_(0xFF)
    plan.feed_rows, plan.feed_from = [0, 2], [1, 0]
    assert graphs.stage(plan, bucket) == "filter"
    v = graphs.views[bucket]
    assert v["input_ids"].tolist() == plan.input_ids + [0]
    assert v["positions"].tolist() == plan.positions + [0]
    assert v["slot_mapping"].tolist() == plan.slot_mapping + [-1]
    assert v["feed_from"].tolist() == [1, -1, 0, -1]
    assert v["context_lens"].tolist() == plan.context_lens + [1]
    # Longest context first, ties in row order, then the padding row at its own index.
    assert v["attention_order"].tolist() == [1, 0, 2, 3]
    assert v["temperatures"].tolist() == pytest.approx([1.0, 0.5, 0.7, 1.0])
    assert v["top_p"].tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0])
    assert v["top_k"].tolist() == [0, 0, 4, 0]
    assert v["greedy"].tolist() == [True, False, False, True]
    assert [v["block_tables"][r, :len(t)].tolist() for r, t in enumerate(plan.block_tables)] == plan.block_tables
    assert v["block_tables"][rows, 0].item() == 0  # the padding row's one cached token is in block 0
    assert SAMPLE_GRAPH_ROWS >= bucket
    # A tensor-parallel worker's plan has no sampling settings: its rows sample nothing.
    plan.sample_params = []
    assert graphs.stage(plan, bucket) is None
    assert v["input_ids"].tolist() == plan.input_ids + [0]
    assert v["greedy"].tolist() == [True] * bucket and v["top_k"].tolist() == [0] * bucket


class _Logits(torch.nn.Module):
    """Hidden states are the logits: enough of a model for the sampling code."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def compute_logits(self, hidden):
        return hidden


class _RandomLogits(_Logits):
    """A forward pass whose hidden states, the logits, are random."""

    def forward(self, input_ids, positions, meta):
        return torch.randn(len(input_ids), self.vocab)


def _decode_plan(rows, params):
    from engine.core.step_plan import StepPlan
    return StepPlan(input_ids=[10 + r for r in range(rows)], positions=[20 + r for r in range(rows)],
                    slot_mapping=[30 + r for r in range(rows)], cu_seqlens_q=list(range(rows + 1)),
                    context_lens=[21 + r for r in range(rows)], block_tables=[[r] for r in range(rows)],
                    sample_rows=list(range(rows)), sample_params=params, is_decode=True)
