"""kernels/warm_start.py: Triton's cache key, computed on a thread while the engine loads a model,
is what the first kernel launch then uses instead of computing it again."""
import pytest

from kernels.warm_start import hash_triton_in_background


def test_the_thread_leaves_tritons_cache_key_computed_for_the_first_launch():
    cache = pytest.importorskip("triton.runtime.cache")
    cache.triton_key.cache_clear()
    thread = hash_triton_in_background()
    thread.join()
    assert thread.daemon and cache.triton_key.cache_info().currsize == 1
    misses = cache.triton_key.cache_info().misses
    assert cache.triton_key().startswith(__import__("triton").__version__)
    assert cache.triton_key.cache_info().misses == misses  # found, not hashed again
