"""Exp(1) noise for the sampling graphs, from a seed that the graph itself advances.

engine.runner.sampler.draw takes each token as argmax(p / E), E ~ Exp(1). Drawn with torch's
exponential_ inside a captured graph, E comes from torch's graph-safe RNG, whose replays first set
the RNG's seed and offset on the device, outside the graph. After such steps the decode forward
graph replays in its slow state (kernels.pdl.restore_graph_overlap): 0.976 ms against 0.860 after
greedy steps (SmolLM2's shape, 64 rows, H200). Here E is a function of (seed, element index):
Philox keyed by a seed read on the device, which the caller's graph advances after each draw, so
that a replay runs nothing outside the graph.
"""
import torch
import triton
import triton.language as tl

# The smallest E: exp1's floor.
SMALLEST = 2.0**-25


@triton.jit
def exp1(seed, offsets):
    """Exp(1) samples, one per offset, a function of (seed, offset) only: what exponential_noise
    stores at those element indices, for kernels that draw without storing the noise."""
    bits = tl.randint(seed, offsets).to(tl.uint32, bitcast=True)
    # The top 24 bits as an integer, exact in float32: v in [0, 1) on a grid of 2^-24, and 1 - v
    # exact too. E = -log(1 - v); near 0, where a fast log of 1 - v (close to 1) loses its digits,
    # the series v + v^2/2 + v^3/3 (the terms left out under 2^-26 of E, below float32 rounding).
    v = (bits >> 8).to(tl.float32) * (1.0 / 16777216.0)
    e = tl.where(v < 1.0 / 256.0, v * (1.0 + v * (0.5 + v * (1.0 / 3.0))), -tl.log(1.0 - v))
    # 2^-25, the floor: as torch's exponential_, never 0 (p / 0 would outrank every other token).
    return tl.maximum(e, 2.9802322387695312e-08)


@triton.jit
def _exponential_kernel(out_ptr, seed_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, exp1(tl.load(seed_ptr), offsets), mask=offsets < n)


def exponential_noise(shape: tuple[int, ...], seed: torch.Tensor) -> torch.Tensor:
    """A new float32 tensor of `shape` on seed's device, each element an Exp(1) sample that is a
    function of seed[0] (int64) and its own index: the same seed gives the same tensor, and elements
    are independent. seed is read on the device, not changed, and never copied to the host."""
    out = torch.empty(shape, dtype=torch.float32, device=seed.device)
    n = out.numel()
    if n >= 2**31:
        raise ValueError(f"exponential_noise draws at most 2^31 - 1 elements, not {n}")
    if n:
        block = 1024
        _exponential_kernel[(triton.cdiv(n, block),)](out, seed, n, BLOCK=block, num_warps=4)
    return out
