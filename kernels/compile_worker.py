"""A process that compiles Triton kernels into Triton's disk cache for a GPU target it is told,
without a GPU: kernels/warm_start.py's CompileWorkers start it and write it one job per line,
    {"function": "module:qualname", "specialization": <JITFunction specialization JSON>,
     "target": [backend, arch, warp_size]}
and it answers each with {"compiled": true} or {"compiled": false, "error": "..."}. The JSON is
the one Triton's jit_cache_hook hands over; it is read back as JITFunction.preload reads it, and the
kernel compiled as JITFunction._do_compile compiles it, so that the key it is cached under is the
one the launch that needs it looks for.
"""
import importlib
import json
import sys

import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler import compile as triton_compile


def _constexpr(value):
    if isinstance(value, str) and tl.dtype.is_dtype(value):
        return tl.dtype(value)
    if isinstance(value, dict) and "constexpr" in value:
        return tl.constexpr(value["constexpr"])
    return value


def _as_tuples(value):
    """JSON gave lists where Triton had tuples (no kernel argument is a list)."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


def compile_job(job: dict) -> None:
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
    target = GPUTarget(*job["target"])
    options = make_backend(target).parse_options(
        {name: tuple(v) if isinstance(v, list) else v for name, v in spec["options"].items()})
    triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def main() -> None:
    for line in sys.stdin:
        try:
            compile_job(json.loads(line))
            reply = {"compiled": True}
        except Exception as e:  # noqa: BLE001 - reported; the launch that needs the kernel compiles it
            reply = {"compiled": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
