"""kv_cache_dtype="fp8" on CUDA: the Triton kernels (prefill, the fused decode kernel, in CUDA graphs
and eagerly) and the torch backend attend over the same e4m3 cache, so a float32 model's greedy
tokens agree; a bf16 engine keeps its cache in half the bytes."""
import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA device with FP8 (compute capability 8.9)")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
FP32 = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512,
            num_kvcache_blocks=256, kv_cache_dtype="fp8")


def test_triton_and_torch_agree_over_an_fp8_cache(tiny_qwen3):
    shared = random_prompts([40], seed=51)[0]
    prompts = [shared + p for p in random_prompts([9, 30], seed=52)] + random_prompts([77, 1], seed=53)
    runs = {}
    for backend, eager in (("triton", False), ("triton", True), ("torch", False), ("torch", True)):
        with LLM(tiny_qwen3, attention_backend=backend, enforce_eager=eager, **FP32) as llm:
            assert llm.runner.kv_cache.dtype == torch.float8_e4m3fn
            first = llm.generate([shared + [5]], GREEDY)[0]["token_ids"]  # then a prefix hit for two of them
            runs[backend, eager] = [first] + [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
    assert len(set(map(str, runs.values()))) == 1, runs


def test_a_bf16_engine_keeps_its_fp8_cache_in_half_the_bytes(tiny_qwen3):
    nbytes = {}
    for kv in ("auto", "fp8"):
        with LLM(tiny_qwen3, device="cuda", dtype="bfloat16", max_model_len=512, num_kvcache_blocks=64,
                 kv_cache_dtype=kv) as llm:
            nbytes[kv] = llm.runner.kv_cache.nbytes
            llm.generate(random_prompts([50, 90], seed=54), GREEDY)  # through its graphs, without an error
    assert nbytes["auto"] == 2 * nbytes["fp8"]
