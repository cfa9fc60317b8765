"""Triton kernels for the engine's hot paths.

Importing the package is cheap: each kernel's module, and triton with it, loads on first use. On
purpose there is no ``__version__``: transformers probes the import name ``kernels`` for Hugging
Face's library of that name, and this package must never pass for it.
"""
import importlib

_EXPORTS = {
    "store_kv": "kv_store",
    "paged_decode_attention": "decode_attention",
    "paged_prefill_attention": "prefill_attention",
    "rms_norm": "rmsnorm",
    "silu_and_mul": "silu_mul",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
