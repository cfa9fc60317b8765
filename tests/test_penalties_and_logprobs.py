"""Penalties, logit_bias, min_p, min_tokens and logprobs: the sampler against references written
here as plain loops over the vocabulary, and the engine's greedy decoding against HF transformers'
own logits with those references applied."""
import math
from array import array

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.step_plan import SampleContext
from engine.runner.sampler import Sampler


@pytest.mark.parametrize("bad, named", [
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"), (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(n=0), "n"), (dict(n=1.5), "n"), (dict(temperature=float("inf")), "temperature"),
])
def test_bad_sampling_values_are_refused_by_name(bad, named):
    with pytest.raises(ValueError, match=named):
        SamplingParams(**bad)


def test_logit_bias_takes_the_openai_apis_string_keys():
    assert SamplingParams(logit_bias={"50": -100, 7: 2.5}).logit_bias == {50: -100.0, 7: 2.5}


def reference_adjust(logits: list[float], params: SamplingParams, history: list[int], num_prompt: int,
                     last: int, banned=()) -> list[float]:
    """The documented order, one token at a time: bias, bans, then the penalties over the prompt and
    completion (the input token `last` included)."""
    out = list(logits)
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    for token in banned:
        out[token] = -math.inf
    tokens = history + [last]
    completion = tokens[num_prompt:]
    for t in range(len(out)):
        if t in tokens and params.repetition_penalty != 1.0:
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
        count = completion.count(t)
        out[t] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


def test_penalties_bias_and_bans_match_a_reference_computed_from_the_logits():
    g = torch.Generator().manual_seed(0)
    vocab = 40
    logits = torch.randn(5, vocab, generator=g) * 3
    rows = [  # (params, history, prompt length, last token, banned)
        (SamplingParams(temperature=0, repetition_penalty=1.7), [3, 3, 9, 12, 30], 3, 9, ()),
        (SamplingParams(temperature=0, frequency_penalty=0.9, presence_penalty=0.6), [1, 2, 2, 5, 5, 5], 2, 5, ()),
        (SamplingParams(temperature=0, logit_bias={4: 30.0, 6: -100.0}), [], 0, 0, ()),
        (SamplingParams(temperature=0), [], 0, 0, ()),
        (SamplingParams(temperature=0, repetition_penalty=0.5, presence_penalty=-1.0, frequency_penalty=2.0,
                        logit_bias={0: 5.0}, min_tokens=3), [7, 8, 7], 1, 7, (11, 13)),
    ]
    params = [r[0] for r in rows]
    contexts = [None if p.plain else SampleContext(array("q", h) if p.has_penalties else None, n, banned)
                for p, h, n, _, banned in rows]
    last = torch.tensor([r[3] for r in rows])
    adjusted = Sampler(torch.device("cpu")).adjust_logits(logits, params, contexts, last, None)
    for row, (p, history, num_prompt, last_token, banned) in enumerate(rows):
        expected = torch.tensor(reference_adjust(logits[row].tolist(), p, history, num_prompt, last_token, banned))
        assert torch.allclose(adjusted[row], expected, atol=1e-5), row
    # And the greedy tokens are the argmax of those logits.
    tokens, _ = Sampler(torch.device("cpu")).sample(logits, params, [0] * 5, contexts, last)
    assert tokens.tolist() == adjusted.argmax(-1).tolist()


def test_a_ban_that_would_leave_no_token_is_lifted():
    """Structured output that allows only the end of the reply, before min_tokens: the end stays."""
    logits = torch.randn(1, 64)
    allowed = torch.zeros(1, 2, dtype=torch.int32)
    allowed[0, 0] = 1 << 5  # token 5 only
    context = SampleContext(None, 0, banned=(5,), constrained=True)
    tokens, _ = Sampler(torch.device("cpu")).sample(logits, [SamplingParams(temperature=0, min_tokens=2)], [0],
                                                    [context], torch.zeros(1, dtype=torch.long), ([0], allowed))
    assert tokens.tolist() == [5]


def test_min_p_keeps_exactly_the_tokens_within_min_p_of_the_most_likely():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.randn(2, 30) * 2
    params = [SamplingParams(temperature=0.7, min_p=0.2), SamplingParams(temperature=1.0)]
    kept = torch.isfinite(sampler._min_p(logits / torch.tensor([[0.7], [1.0]]), params))
    probs = (logits[0] / 0.7).softmax(-1)
    assert kept[0].tolist() == (probs >= 0.2 * probs.max()).tolist()
    assert kept[1].all()
    seeds = [SamplingParams(temperature=0.7, min_p=0.2, seed=s) for s in range(200)]
    draws = sampler(logits[:1].expand(200, 30), seeds, list(range(200)))
    assert set(draws.tolist()) <= set(kept[0].nonzero().flatten().tolist())


def hf_model(path):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_reference_decode(model, prompt: list[int], params: SamplingParams, steps: int):
    """Greedy decoding on HF's logits with reference_adjust; each step's log_softmax of the adjusted
    logits divided by `temperature` (1 for greedy), as logprobs reports them."""
    ids = list(prompt)
    log_probs = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].tolist()
            adjusted = reference_adjust(logits, params, ids[:-1], len(prompt), ids[-1])
            token = max(range(len(adjusted)), key=adjusted.__getitem__)
            log_probs.append(torch.tensor(adjusted).log_softmax(-1))
            ids.append(token)
    return ids[len(prompt):], log_probs


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_decoding_with_penalties_matches_hf_logits_with_the_reference_applied(tiny_qwen3, async_scheduling):
    prompts = [[5, 9, 9, 14, 200, 3, 77, 5], [100, 101, 102, 103, 104, 105]]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8,
                             frequency_penalty=0.4),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=1.5,
                             logit_bias={17: 3.0, 42: -2.0})]
    model = hf_model(tiny_qwen3)
    expected = [hf_reference_decode(model, p, sp, 12)[0] for p, sp in zip(prompts, params)]
    with LLM(tiny_qwen3, device="cpu", async_scheduling=async_scheduling) as llm:
        outs = llm.generate(prompts, params)
        plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o["token_ids"] for o in outs] == expected
    assert [o["token_ids"] for o in plain] != expected  # the penalties changed something


def test_logprobs_agree_with_log_softmax_of_hfs_logits_for_greedy_decoding(tiny_qwen3):
    prompt = [3, 14, 15, 92, 65, 35]
    model = hf_model(tiny_qwen3)
    expected_ids, expected_log_probs = hf_reference_decode(model, prompt, SamplingParams(temperature=0), 8)
    with LLM(tiny_qwen3, device="cpu") as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3))[0]
        none = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert out["token_ids"] == expected_ids and none["logprobs"] is None
    assert len(out["logprobs"]) == 8
    for step, (entry, reference) in enumerate(zip(out["logprobs"], expected_log_probs)):
        assert entry.token_id == expected_ids[step]
        assert entry.logprob == pytest.approx(reference[entry.token_id].item(), abs=1e-4)
        top_values, top_ids = reference.topk(3)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)


def test_sampled_logprobs_are_of_the_tempered_distribution(tiny_qwen3):
    """Under temperature the logprobs are log_softmax(logits / T): the distribution drawn from."""
    prompt = [8, 6, 7, 5, 3, 0, 9]
    with LLM(tiny_qwen3, device="cpu") as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0.5, seed=4, max_tokens=1, logprobs=0))[0]
    with torch.no_grad():
        logits = hf_model(tiny_qwen3)(torch.tensor([prompt])).logits[0, -1]
    token = out["token_ids"][0]
    assert out["logprobs"][0].top == []
    assert out["logprobs"][0].logprob == pytest.approx((logits / 0.5).log_softmax(-1)[token].item(), abs=1e-4)


def test_min_tokens_keeps_the_end_of_sequence_out_until_reached(demo_model_path):
    with LLM(demo_model_path, device="cpu") as llm:
        eos = min(llm.eos_ids)
        hurry = dict(temperature=0, max_tokens=20, logit_bias={eos: 100.0})
        ended = llm.generate(["hi"], SamplingParams(**hurry))[0]
        held = llm.generate(["hi"], SamplingParams(**hurry, min_tokens=5, stop=["\x00never"]))[0]
    assert ended["token_ids"] == [eos] and ended["finish_reason"] == "stop"
    assert len(held["token_ids"]) == 6 and held["token_ids"][-1] == eos and eos not in held["token_ids"][:-1]
    assert held["finish_reason"] == "stop"
