"""EngineOptions: every setting the engine takes, declared once.

`LLM(model, **options)` and `EngineThread` take these fields as keywords; nvchat builds its settings,
its config.toml keys and the command-line flags of every mode from them. Adding an option is one
field here plus its use. Each field's metadata holds its one-line doc ("doc") and, where useful,
what None decides ("unset"), its choices ("choices") and a short flag ("flag"). EngineConfig
(engine/config.py) resolves the options against the machine and the checkpoint.

Torch-free, so that the command line can read it without loading torch.
"""
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path


def default_cache_dir() -> Path:
    """nvchat's cache: what the engine builds from a model file (indexes, tokenizers, weights,
    kernels) and the demo model."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nvchat"


ATTENTION_BACKENDS = ("torch", "triton", "flash_attn")
QUANTIZATIONS = ("int8", "int4", "fp8")  # int8/int4: weight-only on CPU (engine/layers/quantized.py); fp8: CUDA
LOAD_FORMATS = ("safetensors", "random")
KV_CACHE_DTYPES = ("auto", "fp8")

# A chat engine serves streams that someone is reading, so an EngineThread that builds its own
# engine prefills a long prompt in chunks of this many tokens (decode tokens included) between their
# tokens. On an H200 (0.6B shape, 8 streams, an 8192-token prompt) chunks of 64 kept the streams' p99
# inter-token latency at 1.9x their p50 before the prompt, against 2.2x with 128, for a prefill of
# about 0.3 s instead of 0.2.
CHAT_PREFILL_CHUNK = 64


def option(default, doc: str, *, unset: str | None = None, choices: tuple | None = None, flag: str | None = None):
    """A field of EngineOptions: its default, a one-line doc, what None decides (unset), its choices
    and a short flag."""
    return field(default=default, metadata={"doc": doc, "unset": unset, "choices": choices, "flag": flag})


@dataclass
class EngineOptions:
    """The engine's options as given. The checks that need neither the checkpoint nor the device
    run here, when one is built (ValueError names a bad value); EngineConfig.create runs the rest.
    (No `from __future__ import annotations` here: the fields' types are read at run time.)"""

    device: str | None = option(None, "cuda, cuda:N or cpu", unset="cuda when available")
    # A torch.dtype does too (LLM(..., dtype=torch.bfloat16)).
    dtype: str | None = option(None, "float32, float16 or bfloat16", unset="the checkpoint's on GPU, float32 on CPU")
    tensor_parallel_size: int = option(1, "GPUs to shard the model over, one worker process per extra one "
                                          "(gloo on CPU)", flag="--tp")
    max_model_len: int = option(4096, "longest sequence in tokens, prompt and reply together (at most the "
                                      "model's own)")
    max_num_seqs: int = option(512, "most sequences batched together")
    max_num_batched_tokens: int = option(16384, "most tokens one step runs, prompt chunks and decodes together")
    kvcache_block_size: int | None = option(None, "tokens per KV-cache block", unset="256 with flash_attn, else 16")
    num_kvcache_blocks: int | None = option(None, "KV-cache blocks",
                                            unset="what gpu_memory_utilization leaves on a GPU, a share of RAM on CPU")
    gpu_memory_utilization: float = option(0.9, "share of the GPU's memory for the weights, the steps, the CUDA "
                                                "graphs and the KV cache")
    enforce_eager: bool = option(False, "no CUDA graphs: every step runs eagerly")
    attention_backend: str | None = option(None, "attention kernels", unset="triton on CUDA, torch on CPU",
                                           choices=ATTENTION_BACKENDS)
    max_prefill_chunk: int | None = option(None, "most prompt tokens one step prefills while other sequences decode",
                                           unset="the whole step's budget")
    load_format: str = option("safetensors", "safetensors (a GGUF file's weights too), or random: the "
                                             "checkpoint's shapes with random weights, for benchmarks",
                              choices=LOAD_FORMATS)
    prefill_cuda_graphs: bool | None = option(None, "CUDA graphs for small prefill and mixed steps too, not only "
                                                    "decode", unset="on, except with flash_attn")
    quantization: str | None = option(None, "int8 or int4: weight-only quantized projections on CPU, faster, not "
                                            "bit-exact; fp8: block-wise FP8 weights on a CUDA GPU with FP8; auto: "
                                            "int4 on one CPU rank for a GGUF file stored in 4 bits or fewer, else "
                                            "none; none: the weights in dtype, bit-exact (an FP8 checkpoint "
                                            "dequantized)",
                                      unset="none, but a block-FP8 checkpoint stays FP8 on a GPU with FP8",
                                      choices=("auto", *QUANTIZATIONS, "none"))
    kv_cache_dtype: str = option("auto", "the KV cache's element type: auto, the model's dtype; fp8, e4m3 without "
                                         "scales: twice the tokens in the same memory and half the bytes a step "
                                         "reads, not bit-exact (a GPU with FP8, or CPU through the torch or "
                                         "Triton attention)", choices=KV_CACHE_DTYPES)
    # engine/llm.py's docstring says how.
    async_scheduling: bool = option(True, "the GPU runs each step while the host settles the one before")
    # The KV cache's lower tiers (engine/core/kv_tiers.py): blocks the device's cache evicts, kept so
    # that a prefix comes back by copy instead of being computed again.
    host_cache_gib: float | None = option(None, "GiB of host memory keeping the KV blocks the device's cache evicts",
                                          unset="a quarter of the free RAM with a GPU; 0 on CPU, where the cache "
                                                "is in RAM already (num_kvcache_blocks gives it more)")
    disk_cache_dir: str | None = option(None, "directory keeping KV blocks across restarts, so that a reopened "
                                              "conversation prefills only its new message",
                                        unset="$XDG_CACHE_HOME/nvchat/kv in nvchat's modes; off for LLM and "
                                              "EngineThread")
    disk_cache_gib: float = option(16.0, "most GiB the disk tier keeps, least recently used out first; 0 turns "
                                         "it off")

    def __post_init__(self):
        for f in fields(EngineOptions):
            value = getattr(self, f.name)
            if f.name == "dtype" and type(value).__name__ == "dtype":
                continue  # a torch.dtype, checked with the strings by EngineConfig
            problem = type_problem(value, f.type)
            if problem:
                raise ValueError(f"{f.name} must be {problem}, got {value!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kvcache_block_size",
                     "num_kvcache_blocks", "max_prefill_chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("host_cache_gib", "disk_cache_gib"):
            value = getattr(self, name)
            if value is not None and not value >= 0:  # NaN too
                raise ValueError(f"{name} must be zero or more, got {value!r}")
        if self.disk_cache_dir is not None and not self.disk_cache_dir.strip():
            raise ValueError("disk_cache_dir must name a directory, got an empty string")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be 'safetensors' or 'random', got {self.load_format!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.quantization not in (None, "auto", "none", *QUANTIZATIONS):
            raise ValueError(f"unsupported quantization {self.quantization!r}; use {', '.join(QUANTIZATIONS)}, "
                             "auto or none")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8" and self.attention_backend == "flash_attn":
            raise ValueError("kv_cache_dtype='fp8' needs attention_backend 'triton' or 'torch': the flash_attn "
                             "backend reads a cache in the model's dtype only")
        if self.prefill_cuda_graphs and self.attention_backend == "flash_attn":
            raise ValueError("prefill_cuda_graphs needs attention_backend='triton': flash-attn's varlen call "
                             "reads the longest context on the host, which a CUDA graph can't capture")

    @classmethod
    def from_keywords(cls, caller: str, keywords: dict) -> "EngineOptions":
        """The options from a caller's keyword arguments; an unknown one is a TypeError naming it
        and the valid ones."""
        unknown = sorted(set(keywords) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"{caller}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                            f"the engine's options are: {', '.join(OPTION_NAMES)}")
        return cls(**keywords)

    def keywords(self) -> dict:
        """The options as keyword arguments for LLM or EngineThread."""
        return {name: getattr(self, name) for name in OPTION_NAMES}


OPTION_NAMES = tuple(f.name for f in fields(EngineOptions))

def value_type(annotation) -> type:
    """The type of a field's value when one is given: `int | None` -> int."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        given = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(given) == 1:
            return given[0]
    return typing.get_origin(annotation) or annotation


def type_problem(value, annotation) -> str | None:
    """What a value of the wrong type should have been ("an integer", "a string or None"), or None if it
    fits the annotation. An int does for a float; a bool is not an int."""
    optional = type(None) in typing.get_args(annotation)
    if value is None and optional:
        return None
    expected = value_type(annotation)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return None
    if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
        return None
    name = _TYPE_NAMES.get(expected, f"a {expected.__name__}")
    return name + (" or None" if optional else "")


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
