"""Programmatic dependent launch (PDL): on Hopper and newer, a kernel launched with it may start
while the kernel before it in the stream is still finishing, so its launch, and any loads that do
not depend on that kernel, overlap the other's tail. A chat-sized decode step is ~250 kernels of a
few µs each, so that overlap is a large part of a step.

The contract every kernel launched with `launch_pdl=True` keeps (a kernel that breaks it races):
- Before `tl.extra.cuda.gdc_wait()` it may only read what no kernel of the step writes: weights,
  and the step's inputs (context lengths, positions, slots, block tables), copied in before the
  step's first kernel. Every other load, and every store, comes after the wait (a store before it
  could overwrite what the kernel before is still reading).
- Every program calls the wait, even one with nothing to do: the kernel after relies on this one
  having waited, so that waiting on it also means waiting on the ones before it.
- `tl.extra.cuda.gdc_launch_dependents()` may come right after the wait: the next kernel's
  programs then launch once every program of this one has started, and spin in their own wait.

Kernels take a `PDL: tl.constexpr` and launch with `launch_pdl=PDL`, where PDL is `enabled(...)`.
"""
import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a CUDA device of compute capability 9.0 or
    more, compiled kernels (not Triton's CPU interpreter), and not turned off with NVCHAT_PDL=0
    (which benchmarks use to measure what it is worth)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("NVCHAT_PDL") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def _wait_kernel(scratch):
    tl.extra.cuda.gdc_wait()
    tl.store(scratch, 1)


@functools.cache
def _scratch(device_index: int) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=f"cuda:{device_index}")


def restore_graph_overlap(device: torch.device) -> None:
    """Launches one kernel with PDL, outside any graph, that waits and writes a word nothing reads.

    Measured (benchmarks/HISTORY.md, session of 02:16): once three kernels without PDL have been
    launched outside a graph, a captured graph's PDL launches gain less than nothing. SmolLM2's
    64-row decode forward graph then takes 0.977 ms per replay instead of 0.862 (H100; 0.925 with
    PDL off), and stays so for any number of replays. One kernel launched with PDL outside a graph,
    this one included, brings back the fast replays. Graph launches change the state neither way.
    Launched before every replay, this kernel leaves the replays slow, and so do torch's replays of
    a sampling graph that draws random numbers, with it or without (H200; why is not known): hence
    DecodeGraphs launches it once after eager kernels, not every step."""
    if enabled(device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        _wait_kernel[(1,)](_scratch(index), num_warps=1, launch_pdl=True)
