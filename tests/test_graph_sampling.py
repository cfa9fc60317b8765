"""Penalties, min_p, logit_bias, min_tokens and structured output's masks sampled by the decode graphs'
adjusted kinds (engine.runner.decode_graphs), against the eager Sampler. On CPU nothing is captured, so
DecodeGraphs runs the code its graphs capture, eagerly: the same ops, so the same tokens, exactly,
for greedy rows and (with the same random state) for sampled ones. tests/gpu checks the captured
graphs."""
import math
import random
from array import array

import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutput
from engine.core.step_plan import SampleContext, StepPlan
from engine.runner.decode_graphs import ADJUSTED, DecodeGraphs
from engine.runner.sampler import Sampler
from tests.conftest import save_tiny_hf_model
from tests.test_async_scheduling import completions, run
from tests.test_decode_graphs import (
    KW,
    PROMPTS,
    attach_decode_feed,
    count_decode_feed_steps,
)


def count_builds(graphs: DecodeGraphs) -> list:
    """The sequences' slots built, one entry per build (the spy keeps the real build)."""
    built = []
    build = graphs._build_counts

    def counted():
        built.extend(slot for slot, *_ in graphs._builds)
        build()
    graphs._build_counts = counted
    return built


def chat_params(eos: int) -> list[SamplingParams]:
    """A mix like the app's and the server's: recommended sampling's repetition penalty, the
    OpenAI penalties, min_p, logit_bias, min_tokens (with the end of sequence pushed up so that it
    would come at once without the ban), and plain rows beside them."""
    common = dict(temperature=0, max_tokens=24)
    return [SamplingParams(repetition_penalty=1.1, ignore_eos=True, **common),
            SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, ignore_eos=True, **common),
            SamplingParams(ignore_eos=True, **common),
            SamplingParams(repetition_penalty=1.8, min_p=0.2, ignore_eos=True, **common),
            SamplingParams(logit_bias={9: 2.0, 11: -1.5, 200: 1.0}, ignore_eos=True, **common),
            SamplingParams(min_tokens=6, logit_bias={eos: 100.0}, **common),
            SamplingParams(presence_penalty=-1.0, frequency_penalty=0.7, repetition_penalty=0.8, ignore_eos=True,
                           **common),
            SamplingParams(min_p=0.3, ignore_eos=True, **common),
            SamplingParams(repetition_penalty=1.3, logit_bias={5: 3.0}, ignore_eos=True, **common)]


EOS = 7


@pytest.fixture(scope="module")
def tiny_with_eos(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-eos")
    save_tiny_hf_model(path, tie=False, eos_token_id=EOS)
    return path


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_rows_with_penalties_bias_and_bans_match_the_eager_sampler_in_the_graph(tiny_with_eos, overlap):
    eos = EOS
    params = chat_params(eos)
    with LLM(tiny_with_eos, async_scheduling=overlap, **KW) as llm:
        want = completions(run(llm, PROMPTS, params)[0])
    with LLM(tiny_with_eos, async_scheduling=overlap, **KW) as llm:
        assert llm.eos_ids == {eos}
        graphs = attach_decode_feed(llm)
        counts = count_decode_feed_steps(graphs)
        built = count_builds(graphs)
        got = completions(run(llm, PROMPTS, params)[0])
    assert got == want
    # The min_tokens row ends as soon as its bias on the end of sequence is let through.
    tokens, reason = want[5]
    assert reason == "stop" and tokens[-1] == eos and eos not in tokens[:-1] and len(tokens) > 6
    assert counts["kinds"] == {ADJUSTED + "greedy"} and counts["steps"] > 15 and counts["padded"] > 3
    # Counted once per sequence with a penalty or a bias (7 of 9), as it took its slot; not per step.
    assert len(built) == 7


def test_preempted_sequences_keep_counts_that_match_their_tokens(tiny_qwen3):
    """A preempted sequence recomputes its prompt and tokens and samples its next token on the
    runner: its slot's counts still cover exactly its tokens, so they take that token and go on."""
    prompts = PROMPTS[:6]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.5,
                             frequency_penalty=0.3 * (i % 2)) for i in range(len(prompts))]
    tight = dict(KW, num_kvcache_blocks=40, max_num_seqs=6)
    with LLM(tiny_qwen3, **dict(KW, max_num_seqs=6)) as roomy:
        want = completions(run(roomy, prompts, params)[0])
    with LLM(tiny_qwen3, **tight) as llm:
        graphs = attach_decode_feed(llm)
        built = count_builds(graphs)
        got = completions(run(llm, prompts, params)[0])
        assert llm.stats().num_preemptions > 0
    assert got == want
    assert len(built) == len(prompts)


def test_a_step_sampled_on_the_runner_leaves_no_stale_counts(tiny_with_eos):
    """A request with logprobs sends every step it is in to the eager Sampler; the other rows'
    counts miss those steps' tokens, so they are built again when the graph samples them next."""
    params = chat_params(EOS)
    params[2] = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    with LLM(tiny_with_eos, **KW) as llm:
        want = completions(run(llm, PROMPTS, params)[0])
    with LLM(tiny_with_eos, **KW) as llm:
        graphs = attach_decode_feed(llm)
        counts = count_decode_feed_steps(graphs)
        got = completions(run(llm, PROMPTS, params)[0])
    assert got == want
    assert {None, ADJUSTED + "greedy"} <= counts["kinds"]


class _Logits(torch.nn.Module):
    """Hidden states are the logits."""

    def compute_logits(self, hidden):
        return hidden


def sampling_graphs(vocab: int, buckets: list[int]) -> DecodeGraphs:
    """Decode graphs on CPU whose hidden states are the logits, sampling `vocab` tokens."""
    return DecodeGraphs(_Logits(), buckets=buckets, max_blocks_per_seq=1, hidden_size=vocab,
                        sampled=torch.zeros(max(buckets), dtype=torch.int64), device=torch.device("cpu"),
                        dtype=torch.float32, sample=True, vocab_size=vocab)


class _Stream:
    """One sequence, decoding: its tokens so far, and the next one's context."""

    def __init__(self, seq_id: int, prompt: list[int], params: SamplingParams, eos: int):
        self.seq_id, self.tokens, self.params, self.num_prompt = seq_id, list(prompt), params, len(prompt)
        self.eos = eos

    def context(self) -> SampleContext | None:
        p = self.params
        if p.plain:
            return None
        end = len(self.tokens)
        banned = (self.eos,) if p.min_tokens and end - self.num_prompt < p.min_tokens else ()
        return SampleContext(self.tokens if p.has_penalties else None, self.num_prompt, banned,
                             p.structured_output is not None, end - 1, self.seq_id)


def _step_plan(streams: list[_Stream]) -> StepPlan:
    rows = len(streams)
    contexts = [s.context() for s in streams]
    return StepPlan(input_ids=[s.tokens[-1] for s in streams], positions=[len(s.tokens) - 1 for s in streams],
                    slot_mapping=[-1] * rows, cu_seqlens_q=list(range(rows + 1)),
                    context_lens=[len(s.tokens) for s in streams], block_tables=[[0]] * rows,
                    sample_rows=list(range(rows)), sample_params=[s.params for s in streams], is_decode=True,
                    sample_contexts=contexts if any(contexts) else [],
                    defer_sampling=any(c is not None and c.constrained for c in contexts))


def _stage_random_step(graphs, streams: list[_Stream], rows: int, vocab: int, device="cpu"):
    """Plans and stages the streams' decode step in graphs, and writes random logits as its
    hidden states (which _Logits passes on as they are): (plan, kind, logits)."""
    plan = _step_plan(streams)
    kind = graphs.stage(plan, rows)
    logits = torch.randn(rows, vocab, device=device) * 4
    graphs.hidden[:rows] = logits
    graphs.input_ids[:rows] = torch.tensor(plan.input_ids, device=device)
    return plan, kind, logits


def _random_params(rng: random.Random, vocab: int, eos: int) -> SamplingParams:
    temperature = rng.choice([0, 0, 0.7, 1.3])
    kw = dict(temperature=temperature, max_tokens=1000, top_k=rng.choice([0, 0, 5]) if temperature else 0,
              top_p=rng.choice([1.0, 1.0, 0.8]) if temperature else 1.0)
    extra = rng.choice(["none", "rep", "freq", "all", "min_p", "bias", "min_tokens"])
    if extra in ("rep", "all"):
        kw["repetition_penalty"] = rng.choice([1.1, 1.7, 0.6])
    if extra in ("freq", "all"):
        kw["frequency_penalty"], kw["presence_penalty"] = rng.uniform(-2, 2), rng.uniform(-2, 2)
    if extra in ("min_p", "all"):
        kw["min_p"] = rng.choice([0.05, 0.3])
    if extra in ("bias", "all"):
        kw["logit_bias"] = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randint(1, 5))}
    if extra == "min_tokens":
        kw["min_tokens"], kw["logit_bias"] = rng.randint(1, 8), {eos: 50.0}
    return SamplingParams(**kw)


@pytest.mark.parametrize("sampled", [False, True])
def test_the_adjusted_kinds_give_the_eager_samplers_tokens_as_rows_come_and_go(sampled):
    """Many steps of a batch whose streams come and go (more of them over time than the graphs have
    slots, so slots are taken back and rebuilt), on fresh random logits every step: the graph's
    tokens are the eager Sampler's, exactly, greedy and, from the same random state, sampled."""
    vocab, bucket, eos = 96, 4, 3
    rng = random.Random(7 + sampled)
    graphs = sampling_graphs(vocab, [1, 2, bucket])
    eager = Sampler(torch.device("cpu"))
    built = count_builds(graphs)
    streams, next_id, kinds = [], 0, set()
    for step in range(160):
        # Streams end and new ones join; the batch keeps 1, 2 or 4 rows (a bucket's worth, so
        # that the draws' noise has the same shape as the eager Sampler's), in a shuffled order.
        rows = rng.choice([1, 2, bucket])
        streams = [s for s in streams if rng.random() > 0.08][:rows]
        while len(streams) < rows:
            params = _random_params(rng, vocab, eos)
            if not sampled:
                params.temperature = 0
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            streams.append(_Stream(next_id, prompt + [rng.randrange(vocab)] * rng.randint(0, 3), params, eos))
            next_id += 1
        rng.shuffle(streams)
        plan, kind, logits = _stage_random_step(graphs, streams, rows, vocab)
        kinds.add(kind)
        torch.manual_seed(step)
        want, _ = eager.sample(logits, plan.sample_params, plan.sample_positions, plan.sample_contexts or None,
                               torch.tensor(plan.input_ids))
        torch.manual_seed(step)
        graphs.sample(rows, kind)
        got = graphs.sampled[:rows]
        assert got.tolist() == want.tolist(), (step, kind)
        for s, token in zip(streams, got.tolist()):
            s.tokens.append(token)
    adjusted = {k for k in kinds if k.startswith(ADJUSTED)}
    assert adjusted == ({ADJUSTED + "filter", ADJUSTED + "narrow_filter", ADJUSTED + "sample", ADJUSTED + "greedy"}
                        if sampled else {ADJUSTED + "greedy"})
    assert next_id > bucket + 10 and len(built) < 2 * next_id  # slots were reused, not rebuilt each step


def _random_masks(rng: random.Random, rows: int, vocab: int) -> torch.Tensor:
    """Packed token masks as the grammars give them ([rows, ceil(vocab / 32)] int32), each allowing
    a few tokens (sometimes one: a forced token), the bits past the vocabulary set."""
    words = torch.zeros(rows, -(-vocab // 32), dtype=torch.int32)
    for row in range(rows):
        for token in rng.sample(range(vocab), rng.choice([1, 3, 20])):
            words[row, token // 32] |= torch.tensor(1 << (token % 32)).to(torch.int32)
    if vocab % 32:
        words[:, -1] |= torch.tensor(-1 << (vocab % 32), dtype=torch.int32)
    return words


@pytest.mark.parametrize("sampled", [False, True])
def test_rows_under_structured_output_sample_in_the_graph_with_their_masks(sampled):
    """As above, with a third of the streams under structured output: the graph samples the step
    once the constrained rows' masks are copied in (sample_masked), and its tokens are the eager
    Sampler's given the same masks, in the same batches as rows with penalties, bans and none."""
    vocab, bucket, eos = 80, 4, 3
    rng = random.Random(11 + sampled)
    graphs = sampling_graphs(vocab, [1, 2, bucket])
    eager = Sampler(torch.device("cpu"))
    constraint = StructuredOutput(regex="[a-z]+")  # the grammar itself is not used: the masks are given
    streams, next_id, kinds, masked_steps = [], 0, set(), 0
    for step in range(120):
        rows = rng.choice([1, 2, bucket])
        streams = [s for s in streams if rng.random() > 0.1][:rows]
        while len(streams) < rows:
            params = _random_params(rng, vocab, eos)
            if not sampled:
                params.temperature = 0
            if rng.random() < 0.35:
                params.structured_output = constraint
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            streams.append(_Stream(next_id, prompt, params, eos))
            next_id += 1
        rng.shuffle(streams)
        plan, kind, logits = _stage_random_step(graphs, streams, rows, vocab)
        kinds.add(kind)
        constrained = [row for row, s in enumerate(streams) if s.params.structured_output is not None]
        # A constrained row may be left out: its sequence ended, nothing reads its token.
        given = [row for row in constrained if rng.random() > 0.1]
        masks = _random_masks(rng, len(given), vocab)
        torch.manual_seed(step)
        want, _ = eager.sample(logits, plan.sample_params, plan.sample_positions, plan.sample_contexts or None,
                               torch.tensor(plan.input_ids), (given, masks) if constrained else None)
        torch.manual_seed(step)
        if constrained:
            assert plan.defer_sampling and graphs.masked_rows == len(constrained) and kind is not None
            graphs.sample_masked(rows, kind, given, masks)
            masked_steps += 1
        else:
            assert graphs.masked_rows == 0
            graphs.sample(rows, kind)
        got = graphs.sampled[:rows]
        assert got.tolist() == want.tolist(), (step, kind)
        for s, token in zip(streams, got.tolist()):
            s.tokens.append(token)
    assert masked_steps > 40
    assert {k for k in kinds if k.startswith(ADJUSTED)} == (
        {ADJUSTED + "filter", ADJUSTED + "narrow_filter", ADJUSTED + "sample", ADJUSTED + "greedy"} if sampled
        else {ADJUSTED + "greedy"})


def test_rows_with_neutral_settings_come_out_of_the_adjustment_bit_for_bit():
    vocab, rows = 64, 4
    graphs = sampling_graphs(vocab, [rows])
    streams = [_Stream(0, [1, 2, 2, 9], SamplingParams(temperature=0.8, repetition_penalty=1.4, min_tokens=2), 5)]
    streams += [_Stream(i, [3, 4, 5], SamplingParams(temperature=t), 5) for i, t in ((1, 0), (2, 1.0), (3, 0.5))]
    plan = _step_plan(streams)
    assert graphs.stage(plan, rows) == ADJUSTED + "sample"
    graphs.input_ids[:rows] = torch.tensor(plan.input_ids)
    graphs._build_counts()
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16)
    logits[1, 7] = -math.inf
    adjusted = graphs._adjust(logits, graphs.views[rows])
    assert torch.equal(adjusted[1:], logits[1:].float())
    assert not torch.equal(adjusted[0], logits[0].float())
    assert adjusted[0, 5] == -math.inf  # min_tokens' ban


def test_history_is_copied_only_when_read():
    tokens = [4, 5, 6, 7]
    context = SampleContext(tokens, 2, history_len=3, seq_id=1)
    tokens.append(8)  # the sequence grows on; its context still means the tokens before the input
    assert context.history == array("q", [4, 5, 6]) and context.num_history == 3


def test_the_adjusted_settings_are_staged_per_row_with_neutral_padding():
    vocab, rows, bucket = 64, 3, 4
    graphs = sampling_graphs(vocab, [bucket])
    for staging in graphs._staging:  # what other steps may have left there
        staging.fill_(0x7F)
    streams = [_Stream(0, [1, 2], SamplingParams(temperature=0, repetition_penalty=1.3, min_tokens=3), 5),
               _Stream(1, [3], SamplingParams(temperature=0), 5),
               _Stream(2, [4, 4], SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=-0.25,
                                                 min_p=0.5, logit_bias={9: 1.0}), 5)]
    plan = _step_plan(streams)
    # 70 is past the vocabulary: the ban skips it, as the eager Sampler does.
    plan.sample_contexts[0].banned = (5, 70, 6)
    assert graphs.stage(plan, bucket) == ADJUSTED + "greedy"
    v = graphs.views[bucket]
    assert v["repetition"].tolist() == pytest.approx([1.3, 1.0, 1.0, 1.0])
    assert v["frequency"].tolist() == pytest.approx([0.0, 0.0, 0.5, 0.0])
    assert v["presence"].tolist() == pytest.approx([0.0, 0.0, -0.25, 0.0])
    assert v["log_min_p"].tolist() == pytest.approx([-math.inf, -math.inf, math.log(0.5), -math.inf])
    slots = v["slot"].tolist()
    assert slots[1] == slots[3] == 0 and 0 not in (slots[0], slots[2]) and slots[0] != slots[2]
    assert v["banned"].tolist() == [[5, 6, 5, 5], [0] * 4, [0] * 4, [0] * 4]
    assert v["ban"].tolist() == [True, False, False, False]
    assert [c[1] for c in graphs._builds] == [0, 2]  # both slots are built before the step samples
