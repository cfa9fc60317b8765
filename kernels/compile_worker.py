"""A process that compiles Triton kernels into Triton's disk cache for a GPU target it is given,
without a GPU: kernels/warm_start.py's CompileWorkers start it as
    python -m kernels.compile_worker BACKEND ARCH WARP_SIZE      (cuda 90 32 for an H100 or H200)
and write it one job per line,
    {"function": "module:qualname", "specialization": <JITFunction specialization JSON>}
which it answers with {"compiled": true}, or {"compiled": false, "error": ...}. The JSON is the
one Triton's jit_cache_hook hands over; it is read back as JITFunction.preload reads it, and the
kernel compiled as JITFunction._do_compile compiles it, so that the key it is cached under is the
one the launch that needs it looks for. On CUDA it also builds the kernel's launcher (a C extension
per argument signature, compiled with the system's C compiler into the same cache), which the
launch would otherwise build on its first run.
"""
import importlib
import json
import sys

import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import driver as nvidia_driver
from triton.compiler import ASTSource, make_backend
from triton.compiler import compile as triton_compile
from triton.runtime.cache import triton_key


def _constexpr(value):
    if isinstance(value, str) and tl.dtype.is_dtype(value):
        return tl.dtype(value)
    if isinstance(value, dict) and "constexpr" in value:
        return tl.constexpr(value["constexpr"])
    return value


def _as_tuples(value):
    """JSON gave lists where Triton had tuples (no kernel argument is a list)."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


def prepare(target: GPUTarget) -> None:
    """A process's first compile's one-time work (Triton's hash of its own compiler, the backend's
    tools), done while no job is waiting."""
    triton_key()
    make_backend(target).hash()
    if target.backend == "cuda":
        nvidia_driver.library_dirs()


def compile_job(job: dict, target: GPUTarget) -> None:
    """Compiles the job's kernel, and on CUDA builds its launcher."""
    module, qualname = job["function"].split(":")
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    spec = json.loads(job["specialization"])
    if spec["name"] != fn._fn_name:
        raise ValueError(f"the specialization is {spec['name']}'s, not {fn._fn_name}'s")
    constexprs = {tuple(k): _constexpr(v) for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = dict(zip(map(tuple, spec["attrs_keys"]), spec["attrs_vals"]))
    signature = {name: _as_tuples(kind) for name, kind in spec["signature"].items()}
    options = make_backend(target).parse_options(
        {name: tuple(v) if isinstance(v, list) else v for name, v in spec["options"].items()})
    kernel = triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    if target.backend == "cuda":
        nvidia_driver.CudaLauncher(kernel.src, kernel.metadata)


def main() -> None:
    backend, arch, warp_size = sys.argv[1:4]
    target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, int(warp_size))
    try:
        prepare(target)
    except Exception:  # noqa: BLE001 - the first job does this work again, and reports what fails
        pass
    for line in sys.stdin:
        try:
            compile_job(json.loads(line), target)
            reply = {"compiled": True}
        except Exception as e:  # noqa: BLE001 - reported; the launch that needs the kernel compiles it
            reply = {"compiled": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
