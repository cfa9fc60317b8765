"""Block-wise FP8 weights on CUDA (`quantization="fp8"`, and Qwen's FP8 checkpoints): a layer keeps
its weight in e4m3 (torch.float8_e4m3fn) with a float32 scale per [block_n, block_k] tile,
weight ~= q * scale[n // block_n, k // block_k] (the checkpoints' `weight_scale_inv`). The
products run in kernels/fp8.py without dequantizing the weight to memory, so a decode step reads
half of bf16's bytes. On CPU such a checkpoint is dequantized at load time instead
(engine/checkpoints/quantization.py).

A layer learns at construction whether its weights arrive in FP8: the runner builds the model
inside `building(block)` when the checkpoint is FP8 and the weights stay so.
"""
import contextlib

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# The block of Qwen's and DeepSeek's FP8 releases, and of quantization="fp8" at load time.
DEFAULT_BLOCK = (128, 128)

_block: tuple[int, int] | None = None


@contextlib.contextmanager
def building(block: tuple[int, int] | None):
    """Layers built inside take their weights in FP8 with scales in blocks of `block` (None: the
    default dtype, as outside)."""
    global _block
    previous, _block = _block, (tuple(block) if block is not None else None)
    try:
        yield
    finally:
        _block = previous


def current_block() -> tuple[int, int] | None:
    return _block


def cdiv(n: int, d: int) -> int:
    return -(-n // d)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scales' shape for a weight of `shape` ([..., N, K]) in blocks of `block`."""
    *lead, n, k = shape
    return (*lead, cdiv(n, block[0]), cdiv(k, block[1]))


def _expand(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """Each block's scale repeated over its weights, cut to the weight's shape."""
    n, k = shape[-2:]
    return scale.repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(block[1], -1)[..., :k]


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (e4m3 of its shape, float32 scales [..., cdiv(N, bn), cdiv(K, bk)]),
    each block scaled so that its largest magnitude maps to 448."""
    n, k = weight.shape[-2:]
    bn, bk = block
    w = weight.float()
    padded = F.pad(w, (0, cdiv(k, bk) * bk - k, 0, cdiv(n, bn) * bn - n))
    tiles = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [..., N/bn, bn, K/bk, bk]
    scale = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=1e-12)
    q = (w / _expand(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * its block's scale, in float32, then `dtype`."""
    return (q.float() * _expand(scale.float(), q.shape, block)).to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x @ dequantized(weight).T through kernels/fp8.py: CUDA only (on CPU an FP8 checkpoint
    loads dequantized, and quantization="fp8" is refused)."""
    from kernels.fp8 import (
        fp8_linear,  # start-up: Triton loads only where its kernels run
    )
    return fp8_linear(x, weight, scale, block)


def is_fp8(loaded) -> bool:
    """Whether a checkpoint tensor (a torch tensor or a lazy safetensors slice) is stored in e4m3."""
    if isinstance(loaded, torch.Tensor):
        return loaded.dtype == FP8
    return loaded.get_dtype() == "F8_E4M3"


def scale_span(start: int, size: int, block: int, scale_rows: int, what: str) -> tuple[int, int]:
    """The scale rows (or columns) that weight rows [start, start + size) use, of a scale tensor of
    `scale_rows` along that dimension: (first, count). The span must begin on a block, and end on
    one unless its block is the tensor's last (which may be partial): a block split between two
    shards has one scale for both, which neither shard can take alone."""
    first, count = start // block, cdiv(size, block)
    if start % block or (size % block and first + count != scale_rows) or first + count > scale_rows:
        raise ValueError(f"{what}: rows {start}..{start + size} do not fall on its FP8 scale blocks of {block} "
                         f"rows; tensor_parallel_size must split it at multiples of {block}")
    return first, count
