"""Loads safetensors checkpoints and GGUF files (engine/checkpoints/gguf.py) into the model through
the weight_loader of the layer that owns each parameter, so every tensor-parallel rank reads only
its own slices (of safetensors files; a GGUF tensor is dequantized whole). Pickled formats are
never opened.

The loaders are looked up on the layers, not hung on the parameters: a parameter holding its
layer's bound method would make a reference cycle of every layer, which only the garbage collector
can free, and the engine freezes its objects out of the collector's reach (LLM.__init__), so the
model's memory would outlive the engine."""
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.checkpoints.errors import ModelError
from engine.checkpoints.gguf import forget_opened, open_gguf
from engine.checkpoints.gguf_paths import is_gguf
from engine.checkpoints.quantization import dequantized
from engine.checkpoints.resolve import weight_files
from engine.layers import fp8
from engine.layers.weights import default_weight_loader

# Buffers some exporters write that the engine recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_weights(model: nn.Module, path: Path, fp8_block: tuple[int, int] | None = None) -> None:
    """Weights from a safetensors checkpoint directory or a GGUF file. fp8_block: the checkpoint's
    FP8 block shape, if it is block-FP8 (engine/checkpoints/quantization.py): its weights go into
    the model's FP8 parameters as they are, or are dequantized if the model was built without any."""
    if path.is_file() and is_gguf(path):
        # On a GPU each tensor is placed as soon as it is ready. On CPU each is quantized as it
        # comes, more slowly than the threads dequantize: with 1 GiB waiting, SmolLM2's first start
        # peaked at 1,207 MB against 1,039 one tensor at a time, with 64 MiB at 1,066 (2-core box).
        on_gpu = next(model.parameters()).device.type == "cuda"
        tensors = open_gguf(path).tensors(waiting_bytes_bound=(1 << 30) if on_gpu else (64 << 20))
        place_weights(model, ((path.name, name, w) for name, w in tensors), path)
        forget_opened()  # the parsed metadata is not needed again
        return
    weights = _safetensors_weights(path)
    if fp8_block is not None and not any(p.dtype == fp8.FP8 for p in model.parameters()):
        weights = dequantized(weights, fp8_block)
    place_weights(model, weights, path)


def _safetensors_weights(path: Path):
    for file in weight_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield file.name, name, f.get_slice(name)


def place_weights(model: nn.Module, weights, path: Path) -> None:
    """Hands each (file name, checkpoint name, tensor or lazy slice) to the loader of the layer that
    owns it, then checks that every parameter was loaded."""
    params = dict(model.named_parameters())
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for source, name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target, shard_id = model.weight_target(name)
        param = params.get(target)
        if param is None:
            raise ModelError(f"{source} has weight {name!r}, which this model has no place for")
        loader = getattr(model.get_submodule(target.rpartition(".")[0]), "weight_loader", None)
        try:
            if loader is None:
                default_weight_loader(param, tensor)
            elif shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as e:
            raise ModelError(f"{source}: {name}: {e}") from None
        loaded.add(target)
    missing = sorted(set(params) - loaded - ({"lm_head.weight"} if tied else set()))
    # Layers whose parameters take many checkpoint tensors each (a layer's stacked experts) say
    # which parts no tensor filled.
    for name, module in model.named_modules():
        if hasattr(module, "missing_weights"):
            missing += [f"{name}.{part}" for part in module.missing_weights()]
    if missing:
        raise ModelError(f"checkpoint in {path} lacks weights: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def init_random_weights(model: nn.Module, seed: int = 0) -> None:
    """Fills every parameter with small random values in place: real shapes, no file read. FP8
    weights get standard normal values and scales of 0.02, the same spread once scaled."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith("_scale_inv"):
            param.data.fill_(0.02)
        elif param.dtype == fp8.FP8:
            for part in param.data.view(-1, param.shape[-1]).split(4096):  # bounded float32 scratch
                part.copy_(torch.randn(part.shape, generator=g, device=part.device))
        else:
            param.data.normal_(0.0, 0.02, generator=g)
