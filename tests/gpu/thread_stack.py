"""The CUDA context's stack size a thread (CU_LIMIT_STACK_SIZE), read and reset through the driver.

A kernel that spills registers past what the context's stack holds makes the driver grow the stack,
and it reserves that much local memory for every thread the card can hold, for as long as the
context lives: 20,048 bytes a thread was ~4.9 GiB of an H100. Setting the limit back frees it."""
import ctypes
import functools

_CU_LIMIT_STACK_SIZE = 0
DEFAULT_STACK_BYTES = 1024  # the driver's own default


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def stack_bytes() -> int | None:
    """The current context's stack size a thread (torch's context, once CUDA is initialised), or
    None where this thread has no current context (a test that used CUDA only in processes it
    started)."""
    value = ctypes.c_size_t()
    if _driver().cuCtxGetLimit(ctypes.byref(value), _CU_LIMIT_STACK_SIZE):
        return None
    return value.value


def reset_stack() -> None:
    if _driver().cuCtxSetLimit(_CU_LIMIT_STACK_SIZE, ctypes.c_size_t(DEFAULT_STACK_BYTES)):
        raise RuntimeError("cuCtxSetLimit failed")
