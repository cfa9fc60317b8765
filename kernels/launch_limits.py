"""What one program may use on a GPU, and the first launch configuration that fits it.

Triton refuses a launch whose shared memory exceeds the device's opt-in limit per block
(OutOfResources). Tiles tuned for bf16 on an H100 can exceed it at other dtypes or on smaller
cards: SmolLM2-135M's float32 gate/up GEMV at 2-8 rows asked for 294,912 bytes of the H100's
232,448 (issue 26). So each kernel with tiles that big (kernels/gemv.py, decode_attention.py,
prefill_attention.py) chooses its launch configuration with a pure function of the shapes, the
dtype and a `DeviceLimits` record: its tuned configuration where that fits, else the first of its
smaller fallbacks (fewer pipeline stages, then narrower tiles) that does, by an estimate of the
configuration's shared memory that errs high.

How the estimates count, from what Triton does with a loop: its software pipeliner stages each
load in the loop through shared memory, num_stages - 1 buffers of the load's tile (the H100's
294,912 bytes were three buffers of the 96 KiB weight-and-input tiles of a four-stage launch).
The estimates count num_stages buffers, and add once every other tile that goes through shared
memory on its way into a dot. tests/gpu/test_launch_limits_gpu.py holds them against what Triton
allocated on a real card.

Registers never fail a launch the way shared memory does: ptxas caps a thread at 255 registers
and spills past that, so only a block of more warps than max_registers / (255 * 32) (8 on every
card since Volta) could fail to launch, and `fits` refuses those.
"""
import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

_MAX_REGISTERS_PER_THREAD = 255
_WARP = 32


@dataclass(frozen=True)
class DeviceLimits:
    """A CUDA device's limits on one program (a thread block)."""

    name: str
    max_shared_mem: int  # bytes of shared memory a block may opt in to
    max_registers: int = 65536  # 32-bit registers per block

    @property
    def max_warps(self) -> int:
        return self.max_registers // (_MAX_REGISTERS_PER_THREAD * _WARP)

    def fits(self, shared_bytes: int, num_warps: int) -> bool:
        return shared_bytes <= self.max_shared_mem and num_warps <= self.max_warps


# Known cards (cudaDevAttrMaxSharedMemoryPerBlockOptin), for tests of the choices on CPU.
H100 = DeviceLimits("H100", 232_448)
H200 = DeviceLimits("H200", 232_448)
A100 = DeviceLimits("A100", 166_912)
RTX_4090 = DeviceLimits("RTX 4090", 101_376)


@functools.cache
def _cuda_limits(index: int) -> DeviceLimits:
    # start-up: Triton's driver loads only where a kernel is about to launch
    from triton.runtime import driver

    # The very numbers Triton checks a launch against (triton/compiler/compiler.py).
    props = driver.active.utils.get_device_properties(index)
    return DeviceLimits(torch.cuda.get_device_name(index), props["max_shared_mem"], props["max_num_regs"])


def device_limits(device: torch.device) -> DeviceLimits | None:
    """The limits of a CUDA device; None where kernels run in Triton's CPU interpreter, which has
    none (and whose launches keep their own small configurations)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return _cuda_limits(device.index if device.index is not None else torch.cuda.current_device())


def first_fit(what: str, candidates: Iterable, estimate: Callable[..., int], num_warps: Callable[..., int],
              limits: DeviceLimits):
    """The first candidate configuration whose estimated shared memory and warps fit `limits`."""
    smallest = None
    for config in candidates:
        need = estimate(config)
        if limits.fits(need, num_warps(config)):
            return config
        smallest = need if smallest is None else min(smallest, need)
    raise ValueError(f"no launch configuration of {what} fits {limits.name} ({limits.max_shared_mem} bytes of shared "
                     f"memory per block); the smallest needs {smallest}")


def stages_down(stages: int) -> range:
    """Pipeline depths to try, deepest first: the tuned one, down to no pipelining."""
    return range(stages, 0, -1)


def halvings(start: int, floor: int) -> list[int]:
    """start, start / 2, ... down to floor (powers of two)."""
    out = [start]
    while out[-1] // 2 >= floor:
        out.append(out[-1] // 2)
    return out
