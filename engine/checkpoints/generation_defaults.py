"""The sampling values a model's makers recommend, as its checkpoint records them: a
generation_config.json's temperature, top_p, top_k, min_p and repetition_penalty (unless it sets
do_sample to false: then they are not meant for sampling), or a GGUF file's general.sampling.*
metadata (llama.cpp's keys). The engine applies none of them itself; front ends offer them as
defaults (nvchat's settings)."""
import json
from pathlib import Path

from engine.checkpoints.gguf import open_gguf
from engine.checkpoints.gguf_paths import is_gguf
from engine.core.sampling_params import SamplingParams

_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


def recommended_sampling(path: Path) -> dict:
    """{SamplingParams field: value} for what the checkpoint at path recommends; values that
    SamplingParams would refuse are left out, as is everything from an unreadable file."""
    found = {}
    if is_gguf(path):
        fields = open_gguf(path).fields
        found = {name: fields[key] for key, name in _GGUF_KEYS.items() if key in fields}
    elif (path / "generation_config.json").is_file():
        try:
            config = json.loads((path / "generation_config.json").read_text())
        except (OSError, ValueError):
            return {}
        if isinstance(config, dict) and config.get("do_sample") is not False:
            found = {k: config[k] for k in _GENERATION_CONFIG_KEYS if k in config}
    usable = {}
    for name, value in found.items():
        if name == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError):
            continue
        usable[name] = value
    return usable
