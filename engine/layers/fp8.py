"""Block-wise FP8 weights on CUDA (`quantization="fp8"`, and Qwen's FP8 checkpoints): a layer keeps
its weight in e4m3 (torch.float8_e4m3fn) with a float32 scale per [block_n, block_k] tile,
weight ~= q * scale[n // block_n, k // block_k] (the checkpoints' `weight_scale_inv`). The
products never dequantize the weight to memory, so a decode step reads half of bf16's bytes: one
row runs kernels/fp8.py's GEMV, more rows cuBLAS's block-scaled FP8 product where it takes the
shapes (linear(); at 2-128 rows cut into pieces of K side by side where cuBLAS alone would leave
SMs idle, pieces_for; most products of 2-32 rows through kernels/fp8.py's W8A8 GEMV instead,
w8a8_launch), and kernels/fp8.py's GEMV and GEMM the rest. On CPU such a checkpoint is
dequantized at load time instead (engine/checkpoints/quantization.py).

A layer learns at construction whether its weights arrive in FP8: the runner builds the model
inside `building(block)` when the checkpoint is FP8 and the weights stay so.
"""
import contextlib
import functools
from typing import NamedTuple

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


class QuantizedRows(NamedTuple):
    """bf16 activations already quantized as block_scaled_mm takes them (CUBLAS_ROWS): e4m3 rows
    padded to a multiple of 4, a float32 scale per row and 128 columns laid out by column; the
    first `rows` are real. The RMSNorm and SiLU-mul kernels write them so before a product that
    takes them (_Linear.takes_quantized_rows), which spares the launch that would read their bf16
    output back to quantize it: at Qwen3-8B-FP8's shape 108 launches a step (qkv, gate/up and down
    in 36 layers; o_proj's input comes from the attention and keeps its own), throughput 1.011x
    and batch 8 1.018x (H200, benchmarks/HISTORY.md, 2026-11-28, 11:10)."""

    q: torch.Tensor
    scales: torch.Tensor
    rows: int


# How block_scaled_mm quantizes x (kernels.fp8.quantize_activations' keywords).
CUBLAS_ROWS = dict(group=128, pad_rows_to=4, scales_by_column=True)


def linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
           block: tuple[int, int]) -> torch.Tensor:
    """x @ dequantized(weight).T on CUDA (on CPU an FP8 checkpoint loads dequantized, and
    quantization="fp8" is refused). One row: kernels/fp8.py's GEMV, which reads the FP8 weight at
    1.3-1.7x bf16's speed. More rows, where cuBLAS takes the shapes: x quantized per row and 128
    columns, then cuBLAS's block-scaled FP8 product (bench_kernels: 1.4-1.6x our Triton GEMM and
    1.5x bf16 at prefill sizes, and it keeps 2-8 rows near bf16's time, where the Triton GEMV took
    up to 2x). Otherwise kernels/fp8.py's GEMV or GEMM. QuantizedRows go to block_scaled_mm as they
    are: one row comes so only where the W8A8 GEMV beats the one-row GEMV (block_scaled_mm_takes)."""
    from kernels.fp8 import (
        fp8_linear,  # start-up: Triton loads only where its kernels run
    )
    if isinstance(x, QuantizedRows):
        return block_scaled_mm(x, weight, scale)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > 1 and cublas_takes(rows, weight, scale, block):
        return block_scaled_mm(rows, weight, scale).view(*x.shape[:-1], weight.shape[0])
    return fp8_linear(x, weight, scale, block)


# cuBLAS's block-scaled FP8 product (1x128 blocks of x, 128x128 of W) runs on Hopper from CUDA 12.9.
_CUBLAS_BLOCK = (128, 128)
_cublas_devices: dict[int, bool] = {}


def cublas_block_scaling(device: torch.device) -> bool:
    """Whether this CUDA device runs cuBLAS's block-scaled FP8 product."""
    index = _index(device)
    if index not in _cublas_devices:
        cuda = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
        _cublas_devices[index] = (torch.cuda.get_device_capability(index) == (9, 0) and cuda >= (12, 9)
                                  and hasattr(F, "scaled_mm") and not torch.version.hip)
    return _cublas_devices[index]


def cublas_takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether block_scaled_mm runs this product. cuBLAS reads W's scales in runs of 4 K blocks:
    with K not a multiple of 512 it multiplied wrongly (15-56% off at K = 640-1664, H200, CUDA
    13.0) rather than refusing, so those shapes stay with the Triton kernels, as do float32 x (the
    exact path the tests compare to HF), fp16 x and N not a multiple of 16."""
    N, K = weight.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and tuple(block) == _CUBLAS_BLOCK and K % 512 == 0
            and N % 16 == 0 and weight.is_contiguous() and scale.is_contiguous()
            and cublas_block_scaling(x.device))


def block_scaled_mm(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16) @ dequantized(weight).T through cuBLAS, as bf16: x is quantized per row and 128
    columns (kernels/fp8.py), its rows padded to a multiple of 4 and its scales laid out by column,
    the layout cuBLAS requires (unless it comes so, QuantizedRows); the padding rows' products are
    cut off. Where w8a8_launch says so, kernels/fp8.py's w8a8_gemv runs it instead; otherwise, where
    k_pieces says so, it runs in pieces of K side by side."""
    if not isinstance(x, QuantizedRows):
        from kernels.fp8 import quantize_activations  # start-up: Triton loads only where its kernels run
        x = QuantizedRows(*quantize_activations(x, **CUBLAS_ROWS), x.shape[0])
    w8a8 = w8a8_launch_on(x.rows, *weight.shape, weight.device)
    if w8a8 is not None:
        from kernels.fp8 import w8a8_gemv  # start-up: Triton loads only where its kernels run
        arrivals = _w8a8_arrivals(weight.device) if w8a8.pieces > 1 else None
        return w8a8_gemv(x.q, x.scales, x.rows, weight, scale, _CUBLAS_BLOCK, **w8a8._asdict(), arrivals=arrivals)
    pieces = k_pieces(x.rows, *weight.shape, weight.device)
    if pieces > 1:
        return _product_in_k_pieces(x, weight, scale, pieces)
    out = F.scaled_mm(x.q, weight.t(), x.scales, F.ScalingType.BlockWise1x128,
                      scale.t(), F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    return out[:x.rows]


# What w8a8_launch decides by: the narrowest W it runs whole from 17 rows and the rows it takes in
# all; the widest K it cuts into pieces, the columns a piece takes at least, and the most pieces.
_W8A8_MIN_N, _W8A8_ROWS = 16384, 32
_W8A8_MAX_PIECED_K, _W8A8_MIN_PIECE_K, _W8A8_MAX_PIECES = 8192, 256, 4
_W8A8_BAND = 64  # kernels/fp8.py's w8a8_gemv's default block_n: the rows of W a program takes


class W8A8Launch(NamedTuple):
    pieces: int
    num_warps: int
    groups: int


def block_scaled_mm_takes(rows: int, N: int, K: int, device: torch.device) -> bool:
    """Whether block_scaled_mm is the product of `rows` rows against W [N, K] on `device`, where
    cuBLAS takes the shapes (cublas_takes): from 2 rows always; one row only where the W8A8 GEMV
    runs it (w8a8_launch), since the one-row FP8 GEMV is faster than cuBLAS there (linear)."""
    return rows > 1 or w8a8_launch_on(rows, N, K, device) is not None


def w8a8_launch_on(rows: int, N: int, K: int, device: torch.device) -> W8A8Launch | None:
    """How block_scaled_mm runs a product of `rows` rows and W [N, K] on `device` through the W8A8
    GEMV (w8a8_launch says when); None: through cuBLAS."""
    if device.type != "cuda":
        return None
    return w8a8_launch(rows, N, K, _sm_count(_index(device)))


@functools.cache
def w8a8_launch(rows: int, N: int, K: int, sms: int) -> W8A8Launch | None:
    """How kernels/fp8.py's w8a8_gemv runs a block-scaled product of `rows` quantized rows against
    W [N, K] on a GPU of `sms` SMs, or None where cuBLAS runs it (block_scaled_mm).

    1-16 rows with K up to 8192: four warps (e4m3 wgmma), K cut into the fewest pieces (a power of
    two up to 4, each at least 256 columns) that make two programs an SM. At Qwen3-8B's shapes
    that is qkv and o_proj in 4 pieces and gate/up whole. At 2-16 rows they took 11.4-11.8, 9.7-10.9
    and 26.4-26.8 us against the 12.6-13.0, 11.6-11.7 and 35.8-36.8 of cuBLAS and the two-warp GEMV
    whole; 8 pieces were slower than 4 at every shape and row count. down (K 12,288) stays on
    cuBLAS, which took 22.5-23.1 us against 21.4-27.2 in pieces (H200, benchmarks/HISTORY.md,
    2026-11-28, 15:26; bench_kernels --w8a8 times the same products).
    One row: whole, where W's bands of 64 rows are at least one an SM, and otherwise the one-row
    FP8 GEMV with x unquantized (linear). Whole it took 25.71 us at 24576 x 4096 (Qwen3-8B's gate
    and up), 17.03 at 10240 x 5120 and 67.85 at 51200 x 5120 (Qwen3-32B's qkv and gate/up) against
    the one-row GEMV's 27.96, 19.59 and 71.44; at Qwen3-8B's qkv (6144 x 4096, 96 bands) 11.86
    whole and 11.92 in 4 pieces against 11.23, at 5120 x 2048 (Qwen3-30B-A3B's qkv) 6.39 against
    5.68, and slower again at o_proj and down (bench_kernels --w8a8; benchmarks/HISTORY.md,
    2026-11-28, session of 19:22).
    17-32 rows: the GEMV whole on two warps against a W of at least 16,384 rows (gate and up): at
    24576 x 4096 it took 26.7-30.2 us against cuBLAS's 31.8-33.7 (session of 13:49)."""
    if 1 <= rows <= 16 and K <= _W8A8_MAX_PIECED_K:
        bands = cdiv(N, _W8A8_BAND)
        if rows == 1:
            return W8A8Launch(1, num_warps=4, groups=2) if bands >= sms else None
        pieces = 1
        while (bands * pieces < 2 * sms and pieces < _W8A8_MAX_PIECES
               and K % (2 * pieces * _CUBLAS_BLOCK[1]) == 0 and K // (2 * pieces) >= _W8A8_MIN_PIECE_K):
            pieces *= 2
        return W8A8Launch(pieces, num_warps=4, groups=1 if pieces > 1 else 2)
    if 17 <= rows <= _W8A8_ROWS and N >= _W8A8_MIN_N:
        return W8A8Launch(1, num_warps=2, groups=2)
    return None


# One counter a band of W's rows for products in pieces: enough for a W of a million rows.
_W8A8_ARRIVALS = 16384
_w8a8_arrivals_by_device: dict[int, torch.Tensor] = {}


def _w8a8_arrivals(device: torch.device) -> torch.Tensor:
    """The counters kernels/fp8.py's w8a8_gemv in pieces takes, zero between products, one set a
    device: the products of a device run one after another on the engine's stream. Allocated at the
    first product, which runs eagerly (the runner's warm-up) before any CUDA graph captures one; a
    buffer first allocated inside a capture would belong to the graph's pool."""
    index = _index(device)
    if index not in _w8a8_arrivals_by_device:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the W8A8 GEMV's counters must be allocated before a CUDA graph is captured: run one "
                               "product in pieces eagerly first")
        _w8a8_arrivals_by_device[index] = torch.zeros(_W8A8_ARRIVALS, dtype=torch.int32, device=device)
    return _w8a8_arrivals_by_device[index]


# The pieces k_pieces allows: K a multiple of 512 each (cublas_takes says why), at least 1024, and
# at most 4 of them (the most measured).
_PIECE_K_STEP, _MIN_PIECE_K, _MAX_PIECES = 512, 1024, 4


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def k_pieces(rows: int, N: int, K: int, device: torch.device) -> int:
    """Into how many pieces of K block_scaled_mm cuts a product of `rows` rows on `device`
    (pieces_for says when); 1: not cut."""
    if device.type != "cuda":
        return 1
    return pieces_for(rows, N, K, _sm_count(_index(device)))


@functools.cache
def pieces_for(rows: int, N: int, K: int, sms: int) -> int:
    """Into how many pieces of K a product of `rows` rows and W [N, K] is cut on a GPU of `sms` SMs,
    each piece multiplied by cuBLAS on a stream of its own at once and their float32 partials
    summed (kernels.fp8.sum_k_pieces); 1: not cut.

    From 32 to 128 rows cuBLAS took as long for a product as at 256 (4096 x 12288: 36 us at 32-224
    rows, against 20-23 at 2-16), working on too few output tiles to fill the GPU; at 2-16 rows the
    same for K up to 8192 (4096 x 4096: 14.2-15.1 us at every row count from 2 to 224). There,
    pieces ran up to 1.8x faster: 4096 x 12288 in 3 pieces 20.1-22.9 us at 32-128 rows, 4096 x 4096
    in 2 12.1-13.0 at 2-128, 5120 x 25600 in 2 42.6-44.1 against 70 at 32-96, 2560 x 4096 in 4
    1.27-1.35x; 6144 x 4096 in 2 only 1.04-1.11x, 5120 x 8192 at 2 rows 1.01x. Above 128 rows
    Qwen3-8B's and Qwen3-32B's products ran slower in pieces (0.49-0.89x), but for Qwen3-8B's down
    in 3, 1.04-1.09x faster at 136-224 rows and 0.75x at 256, so every product above 128 rows stays
    whole. Pieces whose tiles (one per 128 columns of N each) would more than fill three quarters
    of the SMs ran slower (0.68-0.92x), and pieces of 512 gained less or lost (1024 x 3072 in 6
    0.82-1.20x against 1.21-1.26x in 3, 4096 x 4096 in 8 0.64-0.70x) (H200, CUDA 13.0,
    benchmarks/HISTORY.md, 2026-11-28, 12:22)."""
    if rows > 128 or (rows < 32 and K > 8192):
        return 1
    best = 1
    for pieces in range(2, min(K // _MIN_PIECE_K, _MAX_PIECES) + 1):
        if K % (pieces * _PIECE_K_STEP) == 0 and 4 * cdiv(N, 128) * pieces <= 3 * sms:
            best = pieces
    return best


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_side_streams: dict[int, list[torch.cuda.Stream]] = {}


def _streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    """Side streams for the pieces on `device`, drawn once from torch's stream pool, which hands
    the same streams to other users too: work of theirs queued on one only makes a piece wait."""
    streams = _side_streams.setdefault(_index(device), [])
    while len(streams) < count:
        streams.append(torch.cuda.Stream(device))
    return streams[:count]


def _piece_scales(scale: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    """W's scales for each piece of K, each contiguous ([N/128, K/128/pieces]): cuBLAS refuses a
    slice of the whole. Kept on the scale tensor for the life of the layer (a layer loads its scales
    once, before its first product), so no stream ever reads copies that were freed."""
    kept = getattr(scale, "_nvchat_k_pieces", None)
    if kept is None:
        kept = scale._nvchat_k_pieces = {}
    if pieces not in kept:
        kept[pieces] = [part.contiguous() for part in scale.chunk(pieces, dim=1)]
    return kept[pieces]


def _product_in_k_pieces(x: QuantizedRows, weight: torch.Tensor, scale: torch.Tensor, pieces: int) -> torch.Tensor:
    """block_scaled_mm's product as `pieces` cuBLAS products over pieces of K, the first on the
    current stream and the others each on a side stream, joined before their float32 partials are
    summed. The partials and x were allocated on the current stream, which waits for the pieces
    before its next kernel, so none of them goes back to the allocator while a piece may still use
    it (W's piece scales are never freed); a CUDA graph captures the fork and the join."""
    from kernels.fp8 import sum_k_pieces  # start-up: Triton loads only where its kernels run
    N, K = weight.shape
    width = K // pieces
    groups = width // _CUBLAS_BLOCK[1]
    parts = torch.empty(pieces, x.q.shape[0], N, dtype=torch.float32, device=weight.device)
    scales = _piece_scales(scale, pieces)
    current = torch.cuda.current_stream(weight.device)
    side = _streams(weight.device, pieces - 1)
    for piece, stream in reversed(list(enumerate([current, *side]))):  # the side streams first
        if stream is not current:
            stream.wait_stream(current)
        with torch.cuda.stream(stream):
            columns = slice(piece * width, (piece + 1) * width)
            # The op behind F.scaled_mm, for its out= form: each piece writes its own slice of
            # `parts` rather than allocating on a side stream.
            torch.ops.aten._scaled_mm_v2.out(
                x.q[:, columns], weight[:, columns].t(), [x.scales[:, piece * groups:(piece + 1) * groups]],
                [F.ScalingType.BlockWise1x128.value], [], [scales[piece].t()], [F.ScalingType.BlockWise128x128.value],
                [], None, torch.float32, [], False, out=parts[piece])
    for stream in side:
        current.wait_stream(stream)
    return sum_k_pieces(parts, x.rows)


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
