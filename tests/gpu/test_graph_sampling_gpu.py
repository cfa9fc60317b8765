"""Penalties, min_p, logit_bias, min_tokens and structured output's masks sampled inside captured decode
CUDA graphs (the adjusted kinds of engine.runner.decode_graphs), against the eager Sampler. Skipped
without a CUDA device."""
import json
import random

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutput
from engine.runner.decode_graphs import ADJUSTED, SAMPLE_KINDS, DecodeGraphs
from engine.runner.sampler import Sampler, filter_top_k_top_p
from engine.runner.step_graphs import capture_graph
from tests.conftest import random_prompts
from tests.gpu.test_sampling_gpu import GPU, count_replays
from tests.test_decode_graphs import record_masked_kinds
from tests.test_graph_sampling import (
    EOS,
    _Logits,
    _random_masks,
    _random_params,
    _stage_random_step,
    _step_plan,
    _Stream,
    chat_params,
    tiny_with_eos,  # noqa: F401
)
from tests.test_penalties_and_logprobs import hf_model, hf_reference_decode
from tests.test_structured_output import REGEX, SCHEMA

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_penalized_rows_sample_in_the_graph_as_the_eager_engine_does(tiny_with_eos, async_scheduling):
    prompts = random_prompts([30, 5, 41, 16, 9, 23, 12, 7, 19], seed=31)
    params = chat_params(EOS)
    with LLM(tiny_with_eos, enforce_eager=True, **GPU) as llm:
        want = [o["token_ids"] for o in llm.generate(prompts, params)]
    with LLM(tiny_with_eos, async_scheduling=async_scheduling, **GPU) as llm:
        replays = count_replays(llm)
        got = [o["token_ids"] for o in llm.generate(prompts, params)]
    assert got == want
    assert replays.count(ADJUSTED + "greedy") >= 15
    # And the eager engine is the documented reference on HF's logits (two rows, checked there).
    model = hf_model(tiny_with_eos)
    for row in (0, 1):
        assert want[row] == hf_reference_decode(model, prompts[row], params[row], len(want[row]))[0]


def _captured_graphs(vocab: int, buckets: list[int]) -> DecodeGraphs:
    graphs = DecodeGraphs(_Logits(), buckets=buckets, max_blocks_per_seq=1, hidden_size=vocab,
                          sampled=torch.zeros(buckets[-1], dtype=torch.int64, device="cuda"),
                          device=torch.device("cuda"), dtype=torch.float32, sample=True, vocab_size=vocab)
    with torch.inference_mode():
        for bucket in buckets:
            for kind in SAMPLE_KINDS:
                graphs.stage_padding(bucket)
                graphs.sample_graphs[(bucket, kind)] = capture_graph(lambda: graphs._sample(bucket, kind))
    return graphs


@torch.inference_mode()
def test_captured_adjusted_kinds_give_the_eager_samplers_greedy_tokens_as_rows_come_and_go():
    vocab, bucket, eos = 1000, 4, 3
    rng = random.Random(5)
    graphs = _captured_graphs(vocab, [1, 2, bucket])
    eager = Sampler(torch.device("cuda"))
    streams, next_id, kinds = [], 0, set()
    for step in range(200):
        rows = rng.choice([1, 2, bucket])
        streams = [s for s in streams if rng.random() > 0.08][:rows]
        while len(streams) < rows:
            params = _random_params(rng, vocab, eos)
            params.temperature = 0
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
            streams.append(_Stream(next_id, prompt, params, eos))
            next_id += 1
        rng.shuffle(streams)
        plan, kind, logits = _stage_random_step(graphs, streams, rows, vocab, "cuda")
        kinds.add(kind)
        want, _ = eager.sample(logits, plan.sample_params, plan.sample_positions, plan.sample_contexts or None,
                               torch.tensor(plan.input_ids, device="cuda"))
        graphs.sample(rows, kind)
        got = graphs.sampled[:rows].tolist()
        assert got == want.tolist(), (step, kind)
        for s, token in zip(streams, got):
            s.tokens.append(token)
    assert ADJUSTED + "greedy" in kinds


def _replayed_frequencies(graphs: DecodeGraphs, plan, kind: str, logits: torch.Tensor, draws: int) -> torch.Tensor:
    """[rows, vocab] counts of each token over `draws` replays of the staged step's sampling graph."""
    rows, vocab = logits.shape
    graphs.hidden.copy_(logits)
    graphs.input_ids[:rows] = torch.tensor(plan.input_ids, device="cuda")
    seen = torch.zeros(rows, vocab, device="cuda")
    for _ in range(draws):
        graphs.sample(rows, kind)
        seen[torch.arange(rows), graphs.sampled[:rows]] += 1
    return seen


@torch.inference_mode()
def test_captured_adjusted_sampling_draws_from_the_eager_samplers_distribution():
    """Rows whose distribution stays put from draw to draw (bias, min_p, top-k, top-p; no
    penalties): the frequencies of 20,000 graph draws against the eager adjustment's
    probabilities. The seed is fixed, so the figure is the same every run; the bound is over 2.5x
    the total variation distance expected of 20,000 draws from the exact distribution over 40
    tokens (~0.018)."""
    vocab, rows, draws = 40, 4, 20_000
    torch.manual_seed(0)
    graphs = _captured_graphs(vocab, [rows])
    params = [SamplingParams(temperature=0.9, logit_bias={3: 2.5, 7: -3.0}),
              SamplingParams(temperature=1.2, min_p=0.1),
              SamplingParams(temperature=0.7, top_k=6, logit_bias={0: 1.0}),
              SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05)]
    streams = [_Stream(i, [1, 2, 3], p, EOS) for i, p in enumerate(params)]
    logits = torch.randn(rows, vocab, device="cuda") * 2
    plan = _step_plan(streams)
    kind = graphs.stage(plan, rows)
    assert kind == ADJUSTED + "filter"
    seen = _replayed_frequencies(graphs, plan, kind, logits, draws)
    eager = Sampler(torch.device("cuda"))
    adjusted = eager.adjust_logits(logits, params, plan.sample_contexts, None, None)
    temps = torch.tensor([p.temperature for p in params], device="cuda")[:, None]
    scaled = eager._min_p(adjusted / temps, params)
    probs = filter_top_k_top_p(scaled, torch.tensor([p.top_k for p in params], device="cuda"),
                               torch.tensor([p.top_p for p in params], device="cuda")).softmax(-1)
    distance = 0.5 * (seen / draws - probs).abs().sum(-1)
    assert distance.max().item() < 0.05, distance.tolist()
    assert (seen[probs == 0] == 0).all()  # nothing outside what the filters keep


@torch.inference_mode()
def test_sampling_graphs_draw_without_torchs_rng_and_from_the_softmax():
    """The sampling graphs that draw (kernels.exponential_noise) leave torch's CUDA RNG as it was,
    so that a replay launches nothing outside the graph, and their tokens follow the softmax at
    the row's temperature: the frequencies of 20,000 draws, bound as in the test above, and one
    draw's token independent of the draw's before (each row's likeliest token twice running)."""
    vocab, rows, draws = 40, 4, 20_000
    torch.manual_seed(1)
    graphs = _captured_graphs(vocab, [rows])
    params = [SamplingParams(temperature=t) for t in (0.5, 0.9, 1.0, 1.6)]
    plan = _step_plan([_Stream(i, [1, 2, 3], p, EOS) for i, p in enumerate(params)])
    kind = graphs.stage(plan, rows)
    assert kind == "sample"
    logits = torch.randn(rows, vocab, device="cuda") * 2
    graphs.hidden.copy_(logits)
    rng_state = torch.cuda.get_rng_state()
    tokens = torch.zeros(draws, rows, dtype=torch.int64, device="cuda")
    for i in range(draws):
        graphs.sample(rows, kind)
        tokens[i] = graphs.sampled[:rows]
    assert torch.equal(torch.cuda.get_rng_state(), rng_state)
    seen = torch.zeros(rows, vocab, device="cuda").scatter_add_(1, tokens.T, torch.ones(rows, draws, device="cuda"))
    temps = torch.tensor([p.temperature for p in params], device="cuda")[:, None]
    distance = 0.5 * (seen / draws - (logits / temps).softmax(-1)).abs().sum(-1)
    assert distance.max().item() < 0.05, distance.tolist()
    likeliest = (tokens == seen.argmax(-1)).double()
    p = likeliest.mean(0)
    twice = (likeliest[1:] * likeliest[:-1]).mean(0)
    # Overlapping pairs: the variance of their mean is (p^2 (1 - p^2) + 2 p^3 (1 - p)) / draws.
    bound = 6 * ((p**2 * (1 - p**2) + 2 * p**3 * (1 - p)) / draws).sqrt()
    assert ((twice - p**2).abs() < bound).all(), (twice.tolist(), (p**2).tolist())


@torch.inference_mode()
def test_captured_adjusted_kinds_apply_structured_outputs_masks_as_the_eager_sampler():
    """Rows under structured output among rows with penalties and bans, in captured graphs: the
    masks copied in after the forward pass (sample_masked) give the eager Sampler's greedy tokens."""
    vocab, bucket, eos = 1000, 4, 3
    rng = random.Random(9)
    graphs = _captured_graphs(vocab, [1, 2, bucket])
    eager = Sampler(torch.device("cuda"))
    constraint = StructuredOutput(regex="[a-z]+")
    streams, next_id, masked = [], 0, 0
    for step in range(200):
        rows = rng.choice([1, 2, bucket])
        streams = [s for s in streams if rng.random() > 0.1][:rows]
        while len(streams) < rows:
            params = _random_params(rng, vocab, eos)
            params.temperature = 0
            if rng.random() < 0.35:
                params.structured_output = constraint
            streams.append(_Stream(next_id, [rng.randrange(vocab) for _ in range(rng.randint(1, 40))], params, eos))
            next_id += 1
        rng.shuffle(streams)
        plan, kind, logits = _stage_random_step(graphs, streams, rows, vocab, "cuda")
        given = [row for row, s in enumerate(streams) if s.params.structured_output is not None]
        masks = _random_masks(rng, len(given), vocab)
        want, _ = eager.sample(logits, plan.sample_params, plan.sample_positions, plan.sample_contexts or None,
                               torch.tensor(plan.input_ids, device="cuda"), (given, masks) if given else None)
        if given:
            graphs.sample_masked(rows, kind, given, masks)
            masked += 1
        else:
            graphs.sample(rows, kind)
        got = graphs.sampled[:rows].tolist()
        assert got == want.tolist(), (step, kind)
        for s, token in zip(streams, got):
            s.tokens.append(token)
    assert masked > 60


def test_constrained_rows_keep_the_graphs_and_the_eager_engines_tokens(demo_model_path):
    """A quarter of a batch under structured output (JSON schema and regex, greedy and drawn at a
    temperature that leaves only the argmax): every step samples in a captured graph, after its
    masks, and every row's tokens are the eager engine's."""
    schema = StructuredOutput(json_schema=SCHEMA)
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.1)
    params = [SamplingParams(temperature=0, max_tokens=120, structured_output=schema),
              SamplingParams(temperature=1e-4, max_tokens=40, structured_output=StructuredOutput(regex=REGEX))]
    params += [plain] * 6
    prompts = [f"prompt {i}" for i in range(8)]
    with LLM(demo_model_path, enforce_eager=True, **GPU) as llm:
        want = [o["token_ids"] for o in llm.generate(prompts, params)]
    with LLM(demo_model_path, **GPU) as llm:
        graphs = llm.runner.decode_graphs
        masked = record_masked_kinds(graphs)
        outs = llm.generate(prompts, params)
    assert [o["token_ids"] for o in outs] == want
    jsonschema.validate(json.loads(outs[0]["text"]), SCHEMA)
    assert outs[1]["finish_reason"] == "stop"
    assert len(masked) > 20 and set(masked) <= {ADJUSTED + "greedy", ADJUSTED + "sample"}


def _nucleus_probs(logits, params, adjusted_by: Sampler | None = None, contexts=None):
    """What the sort keeps and how likely each kept token is, for rows with top_p and no top_k."""
    if adjusted_by is not None:
        logits = adjusted_by.adjust_logits(logits, params, contexts, None, None)
    temps = torch.tensor([p.temperature for p in params], device="cuda")[:, None]
    scaled = Sampler(torch.device("cuda"))._min_p(logits / temps, params)
    return filter_top_k_top_p(scaled, torch.zeros(len(params), dtype=torch.int64, device="cuda"),
                              torch.tensor([p.top_p for p in params], device="cuda")).softmax(-1)


@torch.inference_mode()
@pytest.mark.parametrize("adjusted", [False, True])
def test_captured_top_p_kind_draws_from_the_sorts_nucleus(adjusted):
    """Rows with top_p and no top_k take the "top_p" kind (kernels.top_p_sampling, no sort): the
    frequencies of 20,000 graph draws against the sort's nucleus, bound as in the tests above."""
    vocab, rows, draws = 40, 4, 20_000
    torch.manual_seed(2)
    graphs = _captured_graphs(vocab, [rows])
    extra = dict(min_p=0.05) if adjusted else {}
    params = [SamplingParams(temperature=0.8, top_p=0.5, **extra), SamplingParams(temperature=1.0, top_p=0.9, **extra),
              SamplingParams(temperature=1.3, **extra), SamplingParams(temperature=0.6, top_p=0.75, **extra)]
    plan = _step_plan([_Stream(i, [1, 2, 3], p, EOS) for i, p in enumerate(params)])
    kind = graphs.stage(plan, rows)
    assert kind == (ADJUSTED if adjusted else "") + "top_p"
    logits = torch.randn(rows, vocab, device="cuda") * 2
    seen = _replayed_frequencies(graphs, plan, kind, logits, draws)
    probs = _nucleus_probs(logits, params, Sampler(torch.device("cuda")) if adjusted else None, plan.sample_contexts)
    distance = 0.5 * (seen / draws - probs).abs().sum(-1)
    assert distance.max().item() < 0.05, distance.tolist()
    assert (seen[probs == 0] == 0).all()


@torch.inference_mode()
def test_the_eager_sampler_draws_top_p_rows_without_the_sort_from_its_nucleus():
    """Big batches sample eagerly: rows with top_p and no top_k there take the kernel too. 20,000
    copies of two rows in one call, against the sort's nucleus."""
    vocab, draws = 40, 20_000
    torch.manual_seed(3)
    params = [SamplingParams(temperature=0.8, top_p=0.6), SamplingParams(temperature=1.1, top_p=0.9)]
    sampler = Sampler(torch.device("cuda"))
    assert sampler._row_settings(params * draws, vocab)[2][0] is None
    base = torch.randn(2, vocab, device="cuda") * 2
    tokens = sampler(base.repeat(draws, 1), params * draws, list(range(2 * draws))).view(draws, 2)
    seen = torch.zeros(2, vocab, device="cuda").scatter_add_(1, tokens.T, torch.ones(2, draws, device="cuda"))
    probs = _nucleus_probs(base, params)
    distance = 0.5 * (seen / draws - probs).abs().sum(-1)
    assert distance.max().item() < 0.05, distance.tolist()
    assert (seen[probs == 0] == 0).all()
