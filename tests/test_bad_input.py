"""Each bad input is a clear error naming the problem, and the engine stays usable."""
import json
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.checkpoints.errors import ModelError

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_missing_path(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        LLM(tmp_path / "nope", device="cpu")


def test_empty_path():
    with pytest.raises(ModelError, match="the model path is empty"):
        LLM("", device="cpu")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        LLM(tmp_path, device="cpu")


def test_directory_without_weights(tmp_path, tiny_qwen3):
    shutil.copy(tiny_qwen3 / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelError, match=r"no \*\.safetensors weights.*pickled weights are never loaded"):
        LLM(tmp_path, device="cpu")


def test_unsupported_architecture(tmp_path, tiny_qwen3):
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(tiny_qwen3 / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match="unsupported model architecture MambaForCausalLM"):
        LLM(tmp_path, device="cpu")


@pytest.mark.parametrize("device", ["mps", "tpu", "cuda:x"])
def test_unsupported_device(tmp_path, device):
    # Named before the model is even looked for (a missing path here), so no download waits for it.
    with pytest.raises(ValueError, match=rf"unsupported device '{device}'; use cuda \(or cuda:N\) or cpu"):
        LLM(tmp_path / "nope", device=device)


def test_tensor_parallel_size_must_divide_heads(tiny_qwen3):
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(tiny_qwen3, device="cpu", tensor_parallel_size=3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(stop=[""]), "stop"),
])
def test_bad_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_request_errors_leave_the_engine_usable(tiny_qwen3):
    with LLM(tiny_qwen3, device="cpu", max_model_len=64, kvcache_block_size=4, num_kvcache_blocks=8) as llm:
        with pytest.raises(ValueError, match="prompt is empty"):
            llm.generate([[]], GREEDY)
        with pytest.raises(ValueError, match="too long for max_model_len=64"):
            llm.generate([[1] * 64], GREEDY)
        with pytest.raises(ValueError, match="needs 9 KV-cache blocks but the cache holds only 8"):
            llm.generate([[1] * 33], GREEDY)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[5, 10_000]], GREEDY)
        with pytest.raises(ValueError, match="has no tokenizer"):
            llm.generate(["text needs a tokenizer"], GREEDY)
        # A batch with one bad prompt queues none of them.
        with pytest.raises(ValueError):
            llm.generate([[1, 2], []], GREEDY)
        s = llm.stats()
        assert s.num_waiting == s.num_running == 0 and s.num_free_blocks == 8
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0]["token_ids"]) == 4
