"""The CPU engine's native kernels, in C (engine/layers/native/): the int4 and int8 products of a
decode step (quantized_gemv.c), and the small operations between the products (decode_ops.c: RMSNorm, RoPE with the
K/V store, attention, SiLU).

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

SOURCES = (Path(__file__).parent / "native" / "quantized_gemv.c", Path(__file__).parent / "native" / "decode_ops.c")
LIBRARY = "cpu_kernels"
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
    """Compiles SOURCES into target, written under a temporary name and renamed into place, so a
    process loading it never sees half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem + "-", suffix=".so.partial")
    os.close(fd)
    try:
        result = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", partial], capture_output=True, text=True, check=False,
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
    source = b"".join(path.read_bytes() for path in SOURCES)
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + compiler.encode()).hexdigest()[:16]
    target = (cache_dir or default_cache_dir()) / "native" / f"{LIBRARY}-{key}.so"
    try:
        if not target.exists():
            _build(compiler, target)
            # Builds of other sources (earlier versions of nvchat, and the one-kernel library
            # before decode_ops.c) go: a process that has one loaded keeps its mapping.
            for older in (*target.parent.glob(f"{LIBRARY}-*.so"), *target.parent.glob("q4_1_gemv-*.so")):
                if older != target:
                    older.unlink(missing_ok=True)
        library = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"building or loading {target.name} failed: {e}"
    return NativeKernels(library)


_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def _typed(function, restype, *argtypes):
    function.restype, function.argtypes = restype, list(argtypes)
    return function


class NativeKernels:
    """The library's functions with their C signatures (arguments: data pointers and sizes)."""

    def __init__(self, library: ctypes.CDLL):
        self.q4_1_gemv = _typed(library.nvchat_q4_1_gemv, _INT, _P, _I64, _I64, _P, _P, _P, _I64, _P, _INT, _INT)
        self.q8_gemv = _typed(library.nvchat_q8_gemv, _INT, _P, _I64, _I64, _P, _P, _I64, _P, _INT, _INT)
        self.add_rms_norm = _typed(library.nvchat_add_rms_norm, None, _P, _P, _P, _F32, _P, _I64, _I64)
        self.rope_store = _typed(library.nvchat_rope_store, None, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _F32,
                                 _P, _P, _P, _P)
        self.decode_attention = _typed(library.nvchat_decode_attention, _INT, _P, _I64, _I64, _I64, _I64, _P, _P,
                                       _P, _I64, _P, _F32, _P, _INT)
        self.silu_mul = _typed(library.nvchat_silu_mul, None, _P, _I64, _I64, _P)


def native_kernels(cache_dir: Path | None = None) -> NativeKernels | None:
    """The C kernels, or None where this machine has none (see unavailable_reason)."""
    key = str(cache_dir)
    with _lock:
        if key not in _loaded:
            _loaded[key] = _library(cache_dir)
    found = _loaded[key]
    return None if isinstance(found, str) else found


def native_q4_1(cache_dir: Path | None = None):
    """The int4 product's C function, or None where this machine has none (see unavailable_reason)."""
    kernels = native_kernels(cache_dir)
    return kernels.q4_1_gemv if kernels is not None else None


def unavailable_reason(cache_dir: Path | None = None) -> str | None:
    """Why native_kernels() is None, or None where it is not."""
    native_kernels(cache_dir)
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


def q8_product(x: torch.Tensor, weights: torch.Tensor, row_scales: torch.Tensor, n: int,
               out: torch.Tensor | None = None, two_parts: bool = True) -> torch.Tensor:
    """x [rows, K] float32 (contiguous) @ the transpose of an int8 weight of n rows in blocks of four
    (engine/layers/quantized.py's NativeInt8Weight): [rows, n] float32. weights [ceil(n / 4), K / 32,
    4, 32] int8, row_scales [ceil(n / 4) * 4] float32, both contiguous. Needs the kernels
    (native_kernels() not None). two_parts as q4_1_product's."""
    rows, k = x.shape
    if out is None:
        out = torch.empty(rows, n)
    if native_kernels().q8_gemv(x.data_ptr(), rows, k, weights.data_ptr(), row_scales.data_ptr(), n, out.data_ptr(),
                                torch.get_num_threads(), two_parts) != 0:
        raise MemoryError(f"the int8 kernel could not allocate scratch for {rows} x {k} activations")
    return out


# --- decode_ops.c on tensors: float32, contiguous; out and the caches written in place -----------------

def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor) -> None:
    """residual += x (x None: nothing added), then out = RMSNorm(residual) * weight; [rows, dim]."""
    rows, dim = residual.shape
    native_kernels().add_rms_norm(x.data_ptr() if x is not None else None, residual.data_ptr(), weight.data_ptr(),
                                  eps, out.data_ptr(), rows, dim)


def rope_store(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
               q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, slots: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, q_out: torch.Tensor) -> None:
    """qkv [rows, (heads + 2 kv_heads) head_dim]: q and k normed per head (q_norm, k_norm: Qwen3's, or
    None) and rotated (cos, sin [rows, head_dim], sin's first half negated: RotaryEmbedding.rows), q
    into q_out [rows, heads, head_dim], k and v into the caches ([slots, kv_heads, head_dim]) at
    slots (int64 [rows])."""
    native_kernels().rope_store(qkv.data_ptr(), qkv.shape[0], heads, kv_heads, head_dim, cos.data_ptr(),
                                sin.data_ptr(), q_norm.data_ptr() if q_norm is not None else None,
                                k_norm.data_ptr() if k_norm is not None else None, eps, slots.data_ptr(),
                                k_cache.data_ptr(), v_cache.data_ptr(), q_out.data_ptr())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_table: torch.Tensor,
                     lengths: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """q [rows, heads, head_dim] over each row's first lengths[r] slots of slot_table (int64
    [rows, width]) in the caches ([slots, kv_heads, head_dim]), grouped-query; out [rows, heads *
    head_dim]."""
    rows, heads, head_dim = q.shape
    if native_kernels().decode_attention(q.data_ptr(), rows, heads, k_cache.shape[-2], head_dim, k_cache.data_ptr(),
                                         v_cache.data_ptr(), slot_table.data_ptr(), slot_table.shape[1],
                                         lengths.data_ptr(), scale, out.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError("the attention kernel could not allocate its scores")


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """out [rows, n] = silu(gate) * up of gate_up [rows, 2n] (gate first)."""
    rows, n = out.shape
    native_kernels().silu_mul(gate_up.data_ptr(), rows, n, out.data_ptr())
