"""Programmatic dependent launch (PDL): on Hopper and newer, a kernel launched with it may start
while the kernel before it in the stream is still finishing, so its launch, and any loads that do
not depend on that kernel, overlap the other's tail. A batch-1 decode step is 149 kernels of a few µs
each at Qwen3-0.6B's shape, 393 at Qwen3-30B-A3B's (profile_step, H200), so that overlap is a large
part of a step.

The contract every kernel launched with `launch_pdl=True` keeps (a kernel that breaks it races):
- Before `wait(PDL)` it may only read what no kernel of the step writes: weights, and the step's
  inputs (context lengths, positions, slots, block tables), copied in before the step's first
  kernel. Every other load, and every store, comes after the wait (a store before it could
  overwrite what the kernel before is still reading).
- Every program calls the wait, even one with nothing to do: the kernel after relies on this one
  having waited, so that waiting on it also means waiting on the ones before it.
- Its first statement is `start(PDL)` (but for the two kernels named below, which trigger the
  next kernel themselves).

When the next kernel's programs may launch (they then hold SM slots while they spin in their own
wait) is the PDL constexpr's value, which `mode` picks for a launch:
- AFTER_WAIT: once every program of this one has waited, so they fill the SMs this one's
  programs leave.
- FIRST: once every program of this one has started. The next kernel's programs then load their
  weights while this one waits and computes, and, all started too, let the one after them launch:
  at a few rows a step becomes a cascade of kernels each loading ahead. Launches of at most
  FIRST_ROWS rows take it. Against AFTER_WAIT everywhere (H200, benchmarks/HISTORY.md,
  2026-11-28, session of 22:39), Qwen3-0.6B at 512 context took 0.722-0.724 against 0.740 ms a
  step at batch 1, 0.919 against 0.959 at 2 and 0.998 against 1.023 at 4, Qwen3-30B-A3B 2.582
  against 2.636 at batch 1; with FIRST at 8 rows too, batch 8 took 1.220-1.225 against 1.205-1.209 and
  Qwen3-30B-A3B's batch 8 8.593 against 8.080. The fused MoE's kernels take FIRST at one token only
  (kernels/fused_moe.py says why).
Kernels that place their trigger elsewhere (kernels/fp8.py's W8A8 GEMV after its K loop,
kernels/allreduce_rmsnorm.py's after its barrier) take AFTER_WAIT and call the trigger themselves.

Kernels take a `PDL: tl.constexpr` and launch with `launch_pdl=PDL > 0`, where PDL is `mode(...)`.
"""
import functools
import os

import torch
import triton
import triton.language as tl


OFF, AFTER_WAIT, FIRST = 0, 1, 2
FIRST_ROWS = 4


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def supported(device: torch.device) -> bool:
    """Whether `device` is a CUDA device of compute capability 9.0 or more, which has PDL (whether or
    not `enabled` uses it)."""
    return device.type == "cuda" and _capable(device.index if device.index is not None else torch.cuda.current_device())


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a device that `supported` names, compiled
    kernels (not Triton's CPU interpreter), and not turned off with NVCHAT_PDL=0 (which benchmarks
    use to measure what it is worth)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("NVCHAT_PDL") == "0":
        return False
    return supported(device)


def mode(device: torch.device, rows: int | None = None, first_rows: int = FIRST_ROWS) -> int:
    """The PDL constexpr of a launch on `device` of `rows` rows (tokens or sequences; None: a launch
    that is not for a few rows, or a kernel that triggers its dependents itself): FIRST at most
    first_rows rows."""
    if not enabled(device):
        return OFF
    return FIRST if rows is not None and rows <= first_rows else AFTER_WAIT


@triton.jit
def start(PDL: tl.constexpr):
    """A PDL kernel's first statement: with FIRST, the next kernel's programs may launch now."""
    if PDL == 2:  # FIRST
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Waits for the kernel before (with PDL); with AFTER_WAIT, the next kernel's programs may
    launch once every program has passed this."""
    if PDL != 0:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:  # AFTER_WAIT
        tl.extra.cuda.gdc_launch_dependents()


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
