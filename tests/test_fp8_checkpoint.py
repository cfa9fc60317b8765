"""Block-wise FP8 checkpoints (Qwen's FP8 releases' format: e4m3 projections, a float32
weight_scale_inv per block, quantization_config quant_method "fp8" with weight_block_size) load on
CPU dequantized: greedy completions equal HF transformers' own loading of the same files (which
dequantizes them itself) token for token in float32, dense and mixture-of-experts. Checkpoints
quantized any other way are refused by name.

The FP8 files are written here from tiny save_pretrained models, quantized by the test's own
reference (tests/kernel_checks.fp8_blocks), not by the engine's quantizer."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.checkpoints.errors import ModelError
from engine.checkpoints.loader import load_weights
from engine.distributed import collectives
from engine.layers import fp8
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from tests.conftest import hf_greedy, random_prompts, save_tiny_hf_model
from tests.kernel_checks import fp8_blocks, fp8_dequantized

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}


def write_fp8_checkpoint(path, block, *, split_files=False, arch="qwen3"):
    """A tiny model saved by transformers, its projections (experts included) then rewritten in
    block FP8. With split_files, two shards with an index, each projection's scales in the other
    file from its weight."""
    save_tiny_hf_model(path, tie=False, arch=arch, seed=5)
    tensors = load_file(path / "model.safetensors")
    first, second = {}, {}
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):
            q, scales = fp8_blocks(tensor, block)
            first[name] = q
            (second if split_files else first)[name.removesuffix("weight") + "weight_scale_inv"] = scales
        else:
            first[name] = tensor
    (path / "model.safetensors").unlink()
    if split_files:
        save_file(first, path / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
        save_file(second, path / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
        weight_map = {**{n: "model-00001-of-00002.safetensors" for n in first},
                      **{n: "model-00002-of-00002.safetensors" for n in second}}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(first, path / "model.safetensors", metadata={"format": "pt"})
    set_quantization_config(path, dict(FP8_CONFIG, weight_block_size=list(block)))
    return path


def set_quantization_config(path, quantization_config):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("block, split_files", [((16, 32), True), ((128, 128), False)])
def test_fp8_checkpoint_matches_hf_on_the_same_files(tmp_path, block, split_files):
    """Blocks of 16x32 (several per projection), and Qwen's 128x128, larger than these
    projections (one partial block each)."""
    path = write_fp8_checkpoint(tmp_path, block, split_files=split_files)
    prompts = random_prompts([4, 19, 40], seed=6)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    with LLM(path, device="cpu", kvcache_block_size=8) as llm:
        assert llm.config.quantization is None  # dequantized on CPU
        assert llm.runner.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY)] == expected


def test_fp8_moe_checkpoint_matches_hf_on_the_same_files(tmp_path):
    path = write_fp8_checkpoint(tmp_path, (16, 32), arch="qwen3_moe")
    prompts = random_prompts([4, 19, 40], seed=7)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    with LLM(path, device="cpu", kvcache_block_size=8) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quantized with 'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quantized with 'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantized with 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors"}, "quantized with 'compressed-tensors'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
    (dict(FP8_CONFIG, weight_block_size=[128, 128], activation_scheme="static"), "activation_scheme 'static'"),
])
def test_unsupported_quantization_is_named(tmp_path, tiny_qwen3, quantization_config, message):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_qwen3 / name).read_bytes())
    set_quantization_config(tmp_path, quantization_config)
    with pytest.raises(ModelError, match=message):
        LLM(tmp_path, device="cpu")


def test_an_fp8_weight_without_its_scales_is_named(tmp_path):
    path = write_fp8_checkpoint(tmp_path, (16, 32))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"model\.layers\.1\.mlp\.down_proj\.weight is FP8 but has no weight_scale_inv"):
        LLM(path, device="cpu")


def test_fp8_quantization_needs_a_gpu_with_fp8(tiny_qwen3):
    with pytest.raises(ValueError, match="quantization='fp8' needs a CUDA GPU with FP8"):
        LLM(tiny_qwen3, device="cpu", quantization="fp8")


class _NoCollectives:
    """A process group stand-in: these layers are built and loaded, never run."""

    def name(self):
        return "none"


def _build_fp8_rank(path, block, rank, size):
    """The MoE model of rank `rank` of `size` built with FP8 weights (as on a GPU with FP8), on CPU,
    and its weights loaded."""
    group = collectives.TPGroup(rank, size, _NoCollectives() if size > 1 else None)
    with collectives.building(group), fp8.building(block):
        model = Qwen3MoeForCausalLM(transformers.AutoConfig.from_pretrained(path), max_position=64)
    load_weights(model, path, block)
    return model


@pytest.mark.parametrize("size", [1, 2])
def test_fp8_weights_load_with_their_scales_into_each_ranks_part(tmp_path, size):
    """Kept in FP8, each rank's projections and experts dequantize to its part of the checkpoint's
    dequantized weights: q, k and v rows and gate and up rows stacked, o and down columns split."""
    block = (16, 16)
    path = write_fp8_checkpoint(tmp_path, block, arch="qwen3_moe")
    tensors = load_file(path / "model.safetensors")

    def checkpoint(name, rows=None, cols=None):
        w = fp8_dequantized(tensors[name + ".weight"], tensors[name + ".weight_scale_inv"], block)
        return w[rows or slice(None)][:, cols or slice(None)]

    for rank in range(size):
        model = _build_fp8_rank(path, block, rank, size)
        part = lambda n: slice(rank * n // size, (rank + 1) * n // size)  # noqa: E731
        for i, layer in enumerate(model.model.layers):
            pre = f"model.layers.{i}"
            qkv, o = layer.self_attn.qkv_proj, layer.self_attn.o_proj
            assert qkv.weight.dtype == torch.float8_e4m3fn
            want = torch.cat([checkpoint(f"{pre}.self_attn.{p}_proj", rows=part(n))
                              for p, n in (("q", 64), ("k", 32), ("v", 32))])
            assert torch.equal(fp8_dequantized(qkv.weight, qkv.weight_scale_inv, block), want)
            assert torch.equal(fp8_dequantized(o.weight, o.weight_scale_inv, block),
                               checkpoint(f"{pre}.self_attn.o_proj", cols=part(64)))
            experts = layer.mlp.experts
            for e in range(8):
                w13 = fp8_dequantized(experts.w13[e], experts.w13_scale_inv[e], block)
                w2 = fp8_dequantized(experts.w2[e], experts.w2_scale_inv[e], block)
                gate_up = [checkpoint(f"{pre}.mlp.experts.{e}.{p}_proj", rows=part(32)) for p in ("gate", "up")]
                assert torch.equal(w13, torch.cat(gate_up))
                assert torch.equal(w2, checkpoint(f"{pre}.mlp.experts.{e}.down_proj", cols=part(32)))


def test_a_tensor_parallel_split_inside_an_fp8_block_is_named(tmp_path):
    """Two ranks split each expert's 32 down-projection columns at 16, inside a 32-wide block."""
    path = write_fp8_checkpoint(tmp_path, (16, 32), arch="qwen3_moe")
    with pytest.raises(ModelError, match="tensor_parallel_size must split it at multiples of 32"):
        _build_fp8_rank(path, (16, 32), 1, 2)
