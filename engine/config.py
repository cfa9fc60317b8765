"""EngineConfig: the engine's options (engine/options.py) resolved against the machine and the checkpoint."""
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoints.errors import ModelError
from engine.checkpoints.gguf import open_gguf
from engine.checkpoints.model_config import MODEL_TYPES, ModelConfig
from engine.checkpoints.quantization import fp8_block
from engine.checkpoints.resolve import (
    architecture_of,
    check_checkpoint,
    resolve_model_path,
)
from engine.layers.attention_backends import default_backend
from engine.options import EngineOptions

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
           "float": torch.float32}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"unsupported dtype {dtype!r}; use float32, float16 or bfloat16")


def _has_fp8(device: torch.device) -> bool:
    """Whether `device` multiplies FP8: Triton's e4m3 type needs compute capability 8.9 or more."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _parse_device(device) -> torch.device:
    if not device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device {str(device)!r}; use cuda (or cuda:N) or cpu")
    return parsed


def _available_ram_bytes() -> int:
    """What the kernel reckons it can hand out without swapping (MemAvailable), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _default_host_cache_gib(device: torch.device) -> float:
    """A quarter of the free RAM with a GPU: pinned for fast copies, and allocated only as blocks
    arrive (engine/runner/kv_tiers.py). Nothing on CPU: there the device's cache is in RAM already, and
    a second pool in the same RAM holds less than growing the first (num_kvcache_blocks) would,
    behind a copy."""
    if device.type != "cuda":
        return 0.0
    return round(_available_ram_bytes() / 4 / 2**30, 2)


def _check_disk_cache_dir(path: Path) -> None:
    """Creates the directory if need be; a ValueError naming it if it can't be written to."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        problem = None if os.access(path, os.W_OK | os.X_OK) else "not writable"
    except OSError as e:
        problem = e.strerror or str(e)
    if problem:
        raise ValueError(f"disk_cache_dir {path} can't be used ({problem}); name another directory, or set "
                         "disk_cache_gib to 0 to keep no KV blocks on disk")


@dataclass(kw_only=True)
class EngineConfig(EngineOptions):
    """The engine's options resolved and checked once, against the machine and the checkpoint: the
    model's path and config, and every option with None ("decide for me") decided."""

    model_path: Path
    hf_config: object
    architecture: type
    # Resolved from the options of the same name: parsed, and never None.
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype  # from kv_cache_dtype: dtype, or torch.float8_e4m3fn
    kvcache_block_size: int
    attention_backend: str
    prefill_cuda_graphs: bool
    host_cache_gib: float
    disk_cache_dir: Path | None  # None: the disk tier is off (no directory, or disk_cache_gib=0)
    # quantization stays an option's value, "auto" and "none" decided: "int8" or "int4" (CPU,
    # engine/layers/quantized.py), "fp8" (block-wise FP8 on CUDA, engine/layers/fp8.py: a block-FP8
    # checkpoint's own, kept by default on a GPU that has FP8, or quantized at load time), or None:
    # the weights in `dtype`, as HF computes them (a block-FP8 checkpoint dequantized).

    def __post_init__(self):
        pass  # built by create() from options already checked; the resolved ones have other types

    @classmethod
    def create(cls, model, options: EngineOptions, progress=None) -> "EngineConfig":
        # Before the model: a bad device must not wait for a download.
        device = _parse_device(options.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' asked for, but no CUDA device is available")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}, but only {torch.cuda.device_count()} CUDA device(s) are visible")
        if options.kv_cache_dtype == "fp8" and device.type == "cuda" and not _has_fp8(device):
            raise ValueError("kv_cache_dtype='fp8' needs a CUDA GPU with FP8 (compute capability 8.9 or more: Ada, "
                             "Hopper, Blackwell); on this GPU leave it at auto")
        disk_cache_dir = None
        if options.disk_cache_dir is not None and options.disk_cache_gib > 0:
            disk_cache_dir = Path(options.disk_cache_dir).expanduser().resolve()
            _check_disk_cache_dir(disk_cache_dir)
        path = resolve_model_path(model, progress)
        gguf = None
        if path.is_file():  # a GGUF file (resolve_model_path refuses other files)
            gguf = open_gguf(path)
            raw, hf_config, architecture = {}, gguf.hf_config, gguf.architecture
            checkpoint_fp8 = False
        else:
            raw = check_checkpoint(path, need_weights=options.load_format == "safetensors")
            checkpoint_fp8 = fp8_block(raw.get("quantization_config"), str(path / "config.json")) is not None
            architecture = architecture_of(raw)
            hf_config = _model_config(path, raw)

        tp = options.tensor_parallel_size
        quantization = options.quantization
        if quantization in (None, "auto") and checkpoint_fp8 and _has_fp8(device):
            quantization = "fp8"
        elif quantization == "auto":
            four_bit_file = gguf is not None and gguf.projections_at_four_bits
            quantization = "int4" if device.type == "cpu" and tp == 1 and four_bit_file else None
        elif quantization == "none":
            quantization = None
        if quantization == "fp8":
            if not _has_fp8(device):
                raise ValueError("quantization='fp8' needs a CUDA GPU with FP8 (compute capability 8.9 or more: "
                                 "Ada, Hopper, Blackwell); elsewhere leave it unset (an FP8 checkpoint then loads "
                                 "dequantized)")
        elif quantization is not None and device.type != "cpu":
            raise ValueError(f"quantization={quantization!r} runs on CPU only (torch's quantized weight kernels); "
                             f"on {device.type} leave it unset or use fp8")
        prefill_cuda_graphs = options.prefill_cuda_graphs
        torch_on_cuda = options.attention_backend == "torch" and device.type == "cuda"
        if prefill_cuda_graphs is None:
            # The torch backend's prefill reads context lengths on the host (on CPU nothing is captured).
            prefill_cuda_graphs = options.attention_backend != "flash_attn" and not torch_on_cuda
        if prefill_cuda_graphs and torch_on_cuda:
            raise ValueError("prefill_cuda_graphs needs attention_backend='triton': the torch backend's prefill "
                             "reads each sequence's context length on the host, which a CUDA graph can't capture")
        dtype = options.dtype
        if dtype is None:
            ckpt_dtype = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
            dtype = parse_dtype(ckpt_dtype) if device.type == "cuda" else torch.float32
        dtype = parse_dtype(dtype)
        kv_dtype = torch.float8_e4m3fn if options.kv_cache_dtype == "fp8" else dtype

        if hf_config.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                             f"{hf_config.num_attention_heads} attention heads")
        max_model_len = min(options.max_model_len, getattr(hf_config, "max_position_embeddings", options.max_model_len))
        backend = options.attention_backend or default_backend(device.type)
        block_size = options.kvcache_block_size or (256 if backend == "flash_attn" else 16)

        host_cache_gib = options.host_cache_gib
        if host_cache_gib is None:
            host_cache_gib = _default_host_cache_gib(device)

        resolved = dict(device=device, dtype=dtype, max_model_len=max_model_len, kvcache_block_size=block_size,
                        attention_backend=backend, prefill_cuda_graphs=bool(prefill_cuda_graphs),
                        quantization=quantization, host_cache_gib=host_cache_gib, disk_cache_dir=disk_cache_dir)
        return cls(**{**options.keywords(), **resolved}, model_path=path, hf_config=hf_config,
                   architecture=architecture, kv_dtype=kv_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """Per rank: K and V for every layer."""
        c = self.hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = max(1, c.num_key_value_heads // self.tensor_parallel_size)
        return 2 * c.num_hidden_layers * kv_heads * head_dim * self.kv_dtype.itemsize


def _model_config(path: Path, raw: dict):
    """config.json as the engine reads it: a ModelConfig for the model types it knows the defaults
    of, else transformers' AutoConfig."""
    if raw.get("model_type") in MODEL_TYPES:
        try:
            return ModelConfig(**raw)
        except TypeError as e:  # a field that clashes with the model type's, or no model_type
            raise ModelError(f"can't read {path / 'config.json'}: {e}") from None
    from transformers import (
        AutoConfig,  # start-up: ~4 s of CPU; only for model types ModelConfig does not know
    )
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as e:
        raise ModelError(f"can't read {path / 'config.json'}: {e}") from None
