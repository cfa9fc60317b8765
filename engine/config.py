from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoints.errors import ModelError
from engine.checkpoints.gguf import open_gguf
from engine.checkpoints.resolve import (
    architecture_of,
    check_checkpoint,
    resolve_model_path,
)
from engine.layers.attention_backends import default_backend
from engine.layers.quantized import QUANTIZATIONS

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
           "float": torch.float32}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"unsupported dtype {dtype!r}; use float32, float16 or bfloat16")


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


@dataclass
class EngineConfig:
    """Every engine setting, resolved and checked once: the path, device, dtype and sizes."""

    model_path: Path
    hf_config: object
    architecture: type
    device: torch.device
    dtype: torch.dtype
    tensor_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kvcache_blocks: int | None
    gpu_memory_utilization: float
    enforce_eager: bool
    attention_backend: str
    # Prompt tokens one step may prefill while other sequences decode; keeps their tokens flowing.
    max_prefill_chunk: int | None = None
    # "safetensors" (a GGUF file's weights too), or "random" for benchmarks in real model shapes
    # without weights on disk.
    load_format: str = "safetensors"
    # CUDA graphs for small prefill and mixed steps too, not only decode: a chat turn after a cached
    # prefix, or a prompt chunk mixed into decoding streams, is otherwise bound by launch cost.
    # On by default, except with flash-attn (see create).
    prefill_cuda_graphs: bool = True
    # "int8" or "int4": weight-only quantized projections and LM head on CPU
    # (engine/layers/quantized.py); None: the weights in `dtype`, as HF computes them. create()
    # also takes "none", and "auto": int4 on one CPU rank for a GGUF file whose layers are
    # stored in 4 bits or fewer (~2.5x the decode rate of float32 weights), else none.
    quantization: str | None = None

    @classmethod
    def create(cls, model, *, device=None, dtype=None, tensor_parallel_size=1, max_model_len=4096,
               max_num_seqs=512, max_num_batched_tokens=16384, kvcache_block_size=None, num_kvcache_blocks=None,
               gpu_memory_utilization=0.9, enforce_eager=False, attention_backend=None, max_prefill_chunk=None,
               load_format="safetensors", prefill_cuda_graphs=None, quantization=None, progress=None):
        from transformers import (
            AutoConfig,  # start-up: ~2 s, and a GGUF file does without it
        )

        if load_format not in ("safetensors", "random"):
            raise ValueError(f"load_format must be 'safetensors' or 'random', got {load_format!r}")
        # Before the model: a bad device must not wait for a download.
        device = _parse_device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' asked for, but no CUDA device is available")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}, but only {torch.cuda.device_count()} CUDA device(s) are visible")
        path = resolve_model_path(model, progress)
        gguf = None
        if path.is_file():  # a GGUF file (resolve_model_path refuses other files)
            gguf = open_gguf(path)
            raw, hf_config, architecture = {}, gguf.hf_config, gguf.architecture
        else:
            raw = check_checkpoint(path, need_weights=load_format == "safetensors")
            architecture = architecture_of(raw)
            try:
                hf_config = AutoConfig.from_pretrained(path, trust_remote_code=False)
            except Exception as e:
                raise ModelError(f"can't read {path / 'config.json'}: {e}") from None

        if quantization == "auto":
            four_bit_file = gguf is not None and gguf.projections_at_four_bits
            quantization = "int4" if device.type == "cpu" and tensor_parallel_size == 1 and four_bit_file else None
        elif quantization == "none":
            quantization = None
        if quantization is not None:
            if quantization not in QUANTIZATIONS:
                raise ValueError(f"unsupported quantization {quantization!r}; use {', '.join(QUANTIZATIONS)}, auto or none")
            if device.type != "cpu":
                raise ValueError(f"quantization={quantization!r} runs on CPU only (torch's quantized weight kernels); "
                                 f"on {device.type} leave it unset")
        if prefill_cuda_graphs is None:
            # The torch backend's prefill reads context lengths on the host (on CPU nothing is captured).
            prefill_cuda_graphs = attention_backend != "flash_attn" and not (
                attention_backend == "torch" and device.type == "cuda")
        if prefill_cuda_graphs and attention_backend == "flash_attn":
            raise ValueError("prefill_cuda_graphs needs attention_backend='triton': flash-attn's varlen call "
                             "reads the longest context on the host, which a CUDA graph can't capture")
        if prefill_cuda_graphs and attention_backend == "torch" and device.type == "cuda":
            raise ValueError("prefill_cuda_graphs needs attention_backend='triton': the torch backend's prefill "
                             "reads each sequence's context length on the host, which a CUDA graph can't capture")
        if dtype is None:
            ckpt_dtype = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
            dtype = parse_dtype(ckpt_dtype) if device.type == "cuda" else torch.float32
        dtype = parse_dtype(dtype)

        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
        if hf_config.num_attention_heads % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide the model's "
                             f"{hf_config.num_attention_heads} attention heads")
        for name, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        max_model_len = min(max_model_len, getattr(hf_config, "max_position_embeddings", max_model_len))

        backend = attention_backend or default_backend(device.type)
        if kvcache_block_size is None:
            kvcache_block_size = 256 if backend == "flash_attn" else 16
        if not isinstance(kvcache_block_size, int) or kvcache_block_size < 1:
            raise ValueError(f"kvcache_block_size must be a positive integer, got {kvcache_block_size!r}")
        if num_kvcache_blocks is not None and (not isinstance(num_kvcache_blocks, int) or num_kvcache_blocks < 1):
            raise ValueError(f"num_kvcache_blocks must be a positive integer, got {num_kvcache_blocks!r}")
        if max_prefill_chunk is not None and max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be a positive integer, got {max_prefill_chunk!r}")

        return cls(model_path=path, hf_config=hf_config, architecture=architecture, device=device,
                   dtype=dtype, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                   block_size=kvcache_block_size, num_kvcache_blocks=num_kvcache_blocks,
                   gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                   attention_backend=backend, max_prefill_chunk=max_prefill_chunk,
                   load_format=load_format, prefill_cuda_graphs=bool(prefill_cuda_graphs),
                   quantization=quantization)

    @property
    def kv_bytes_per_token(self) -> int:
        """Per rank: K and V for every layer."""
        c = self.hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = max(1, c.num_key_value_heads // self.tensor_parallel_size)
        return 2 * c.num_hidden_layers * kv_heads * head_dim * self.dtype.itemsize
