"""What one kernel boundary costs inside a CUDA graph: chains of tiny kernels, µs a kernel.

A batch-1 decode step is ~150 kernels in a chain, each waiting for the one before, so the price of
a boundary bounds the step. Each kernel here has G programs; program p reads what program
(p + 1) % G of the kernel before wrote and writes its own value, so every kernel depends on all
of the one before, as a projection depends on all of the attention. Modes:

  plain   launched without PDL
  after   PDL: the next kernel's programs launch once every program has passed its wait
  first   PDL: they launch once every program has started (kernels/pdl.py's FIRST)
  flag    no grid wait at all: each program spins (ld.acquire.gpu) on a counter that every
          program of the kernel before bumps (release) after its store

    python -m benchmarks.bench_kernel_boundary
"""
import argparse
import statistics

import torch
import triton
import triton.language as tl

MODES = ("plain", "after", "first", "flag")


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [ptr],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _link(values, i, G: tl.constexpr, MODE: tl.constexpr):
    """MODE 0 plain, 1 after, 2 first."""
    if MODE == 2:
        tl.extra.cuda.gdc_launch_dependents()
    program = tl.program_id(0)
    if MODE != 0:
        tl.extra.cuda.gdc_wait()
    if MODE == 1:
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(values + i * G + (program + 1) % G)
    tl.store(values + (i + 1) * G + program, x + 1)


@triton.jit
def _flag_link(values, arrived, i, G: tl.constexpr):
    tl.extra.cuda.gdc_launch_dependents()
    program = tl.program_id(0)
    if i > 0:
        seen = _load_acquire(arrived + i - 1)
        while seen < G:
            seen = _load_acquire(arrived + i - 1)
    x = tl.load(values + i * G + (program + 1) % G)
    tl.store(values + (i + 1) * G + program, x + 1)
    tl.debug_barrier()
    tl.atomic_add(arrived + i, 1, sem="release", scope="gpu")


def us_per_kernel(mode: str, programs: int, kernels: int = 200, replays: int = 30) -> float:
    """The median over replays of a graph of `kernels` chained launches, per launch; checks that
    every value came through the whole chain."""
    values = torch.zeros((kernels + 1) * programs, dtype=torch.int32, device="cuda")
    arrived = torch.zeros(kernels, dtype=torch.int32, device="cuda")

    def chain():
        if mode == "flag":
            arrived.zero_()
            for i in range(kernels):
                _flag_link[(programs,)](values, arrived, i, G=programs, num_warps=4, launch_pdl=True)
        else:
            code = MODES.index(mode)
            for i in range(kernels):
                _link[(programs,)](values, i, G=programs, MODE=code, num_warps=4, launch_pdl=code > 0)

    chain()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    times = []
    for _ in range(replays):
        values.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / kernels)
        last = values[kernels * programs:]
        assert bool((last == kernels).all()), f"{mode}, {programs} programs: the chain lost a value"
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, nargs="+", default=[8, 64, 132, 264])
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}: µs a kernel in a graph of 200 chained kernels")
    for programs in args.programs:
        print(f"{programs:4d} programs: " + "  ".join(f"{m} {us_per_kernel(m, programs):.2f}" for m in MODES),
              flush=True)


if __name__ == "__main__":
    main()
