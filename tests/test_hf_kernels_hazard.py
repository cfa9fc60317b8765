"""Our top-level package is named `kernels`, as is Hugging Face's kernels library, which
transformers probes for and would then import hub kernels from. It must never take that path."""
import importlib.util


def test_transformers_does_not_take_our_kernels_for_hf_kernels():
    assert importlib.util.find_spec("kernels") is not None  # ours is importable here
    from transformers.utils import import_utils
    if hasattr(import_utils.is_kernels_available, "cache_clear"):  # answer afresh, not from the cache
        import_utils.is_kernels_available.cache_clear()
    assert not import_utils.is_kernels_available()
    import kernels
    assert not hasattr(kernels, "__version__")


def test_hub_kernels_integration_stays_disabled():
    from transformers.integrations import hub_kernels
    assert not hasattr(hub_kernels, "get_kernel_hub")
