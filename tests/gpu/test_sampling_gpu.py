"""Penalties, logprobs, n samples and structured output on a CUDA device, with the decode CUDA
graphs on: rows with logprobs or a seeded draw sample eagerly while the forward pass stays in the
graph (penalties and structured output sample in it: test_graph_sampling_gpu.py). Skipped without
one."""
import json

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutput
from tests.conftest import random_prompts
from tests.test_penalties_and_logprobs import hf_model, hf_reference_decode
from tests.test_structured_output import REGEX, SCHEMA

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# A fixed KV cache: engines in other test processes share the GPU (see conftest.py).
GPU = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8, num_kvcache_blocks=256)


def count_replays(llm) -> list:
    """Counts the decode graphs' forward replays (the spy keeps the real replay)."""
    replays = []
    graphs = llm.runner.decode_graphs
    replay = graphs.replay

    def spy(bucket, kind):
        replays.append(kind)
        return replay(bucket, kind)
    graphs.replay = spy
    return replays


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_penalties_in_graph_decode_match_hf_logits_with_the_reference(tiny_qwen3, async_scheduling):
    prompts = [[5, 9, 9, 14, 200, 3, 77, 5], [100, 101, 102, 103, 104, 105]]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8,
                             frequency_penalty=0.4, logprobs=3),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=1.5, min_p=0.1,
                             logit_bias={17: 3.0, 42: -2.0})]
    model = hf_model(tiny_qwen3)
    expected = [hf_reference_decode(model, p, sp, 16) for p, sp in zip(prompts, params)]
    with LLM(tiny_qwen3, async_scheduling=async_scheduling, **GPU) as llm:
        replays = count_replays(llm)
        outs = llm.generate(prompts, params)
    assert [o["token_ids"] for o in outs] == [e[0] for e in expected]
    assert len(replays) >= 14 and set(replays) == {None}  # graph forward, eager sampling
    for entry, reference in zip(outs[0]["logprobs"], expected[0][1]):
        assert entry.logprob == pytest.approx(reference[entry.token_id].item(), abs=1e-3)


def test_a_constrained_quarter_of_a_graph_batch_keeps_valid_json_and_greedy_rows_unchanged(demo_model_path):
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [f"prompt {i}" for i in range(8)]
    schema = StructuredOutput(json_schema=SCHEMA)
    params = [SamplingParams(temperature=0, max_tokens=120, structured_output=schema),
              SamplingParams(temperature=0.8, seed=1, max_tokens=40, structured_output=StructuredOutput(regex=REGEX))]
    params += [plain] * 6
    with LLM(demo_model_path, **GPU) as llm:
        alone = llm.generate(prompts[2:], plain)
        replays = count_replays(llm)
        outs = llm.generate(prompts, params)
    assert [o["token_ids"] for o in outs[2:]] == [a["token_ids"] for a in alone]
    jsonschema.validate(json.loads(outs[0]["text"]), SCHEMA)
    assert outs[1]["finish_reason"] == "stop"
    assert replays  # the decode graphs ran the batch's forward passes


def test_n_samples_on_the_gpu_share_the_prompt_and_match_the_cpu(tiny_qwen3):
    prompt = random_prompts([40], seed=7)[0]
    params = SamplingParams(temperature=0, n=3, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    with LLM(tiny_qwen3, **GPU) as llm:
        gpu = llm.generate([prompt], params)[0]
        assert llm.stats().prefix_hit_tokens > 0
    with LLM(tiny_qwen3, device="cpu") as llm:
        cpu = llm.generate([prompt], params)[0]
    assert [s["token_ids"] for s in gpu["samples"]] == [s["token_ids"] for s in cpu["samples"]]
