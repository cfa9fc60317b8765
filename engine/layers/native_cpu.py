"""The CPU engine's native kernel: the int4 product of a decode step, in C (engine/layers/native/).

torch's int4 kernel for CPU computes in float: on the AVX2 box it took 23.3 ms of SmolLM2's 38.7 ms
int4 decode step (one thread), reading ~3 GB/s of weights where a core reads 11. The C kernel
multiplies the 4-bit weights by activations held as integers, as llama.cpp does, in blocks of
four rows read as one stream: 18.8 ms of a 30.8 ms step (benchmarks/HISTORY.md).

It is compiled on first use with the system's C compiler (cc, or $CC) for x86-64 Linux with AVX2
and FMA, and kept in nvchat's cache, named by a hash of its source, flags and compiler; later
starts load that file (~0.3 s to build). Where there is no compiler, another kind of CPU, or
NVCHAT_NATIVE_KERNELS=0, there is no kernel (native_q4_1() returns None, unavailable_reason()
says why) and int4 weights use torch's kernel (engine/layers/quantized.py). The library links
OpenMP: loaded after torch, it shares the libgomp torch has loaded, so its threads are torch's.
"""
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from engine.options import default_cache_dir

SOURCE = Path(__file__).parent / "native" / "q4_1_gemv.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared")
DISABLE_VARIABLE = "NVCHAT_NATIVE_KERNELS"

_lock = threading.Lock()
_loaded: dict[str, object] = {}


def _why_not() -> str | None:
    """Why this machine gets no native kernel, or None."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        return f"{DISABLE_VARIABLE}=0"
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform != "linux":
        return f"the kernel is written for x86-64 Linux, this is {sys.platform} on {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch reports {capability})"
    return None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str, target: Path) -> None:
    """Compiles SOURCE into target, written under a temporary name and renamed into place, so a
    process loading it never sees half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem + "-", suffix=".so.partial")
    os.close(fd)
    try:
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", partial], capture_output=True, text=True, check=False,
                                timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _library(cache_dir: Path | None):
    """The loaded kernel library, or the reason there is none (a str)."""
    reason = _why_not()
    if reason is not None:
        return reason
    compiler = _compiler()
    if compiler is None:
        return "no C compiler (cc, gcc or $CC) to build it"
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + compiler.encode()).hexdigest()[:16]
    target = (cache_dir or default_cache_dir()) / "native" / f"q4_1_gemv-{key}.so"
    try:
        if not target.exists():
            _build(compiler, target)
            # Builds of other sources (earlier versions of nvchat) go: a process that has one
            # loaded keeps its mapping.
            for older in target.parent.glob("q4_1_gemv-*.so"):
                if older != target:
                    older.unlink(missing_ok=True)
        library = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"building or loading {target.name} failed: {e}"
    gemv = library.nvchat_q4_1_gemv
    gemv.restype = ctypes.c_int
    gemv.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return gemv


def native_q4_1(cache_dir: Path | None = None):
    """The C kernel's function, or None where this machine has none (see unavailable_reason)."""
    key = str(cache_dir)
    with _lock:
        if key not in _loaded:
            _loaded[key] = _library(cache_dir)
    found = _loaded[key]
    return None if isinstance(found, str) else found


def unavailable_reason(cache_dir: Path | None = None) -> str | None:
    """Why native_q4_1() is None, or None where it is not."""
    native_q4_1(cache_dir)
    found = _loaded[str(cache_dir)]
    return found if isinstance(found, str) else None


def q4_1_product(x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor, n: int,
                 out: torch.Tensor | None = None, two_parts: bool = True) -> torch.Tensor:
    """x [rows, K] float32 (contiguous) @ the transpose of a Q4_1 weight of n rows in blocks of four
    (engine/layers/quantized.py's Q4_1Weight): [rows, n] float32. nibbles [ceil(n / 4), K / 32, 4,
    16] uint8, scales and minimums [ceil(n / 4), K / 32, 4] float16, all contiguous. Needs the
    kernel (native_q4_1() not None). two_parts: the activations to 2^-16 of each group's largest
    value; False: one int8 each (faster, llama.cpp's precision)."""
    gemv = native_q4_1()
    rows, k = x.shape
    if out is None:
        out = torch.empty(rows, n)
    if gemv(x.data_ptr(), rows, k, nibbles.data_ptr(), scales.data_ptr(), minimums.data_ptr(), n, out.data_ptr(),
            torch.get_num_threads(), two_parts) != 0:
        raise MemoryError(f"the int4 kernel could not allocate scratch for {rows} x {k} activations")
    return out
