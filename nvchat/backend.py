"""The chat backend the settings ask for: the in-process engine, or a remote OpenAI-compatible
server (--backend URL). Either is a Backend (engine/backend.py)."""
import contextlib
import gc
import os

from engine.backend import Backend
from nvchat import startup_trace
from nvchat.settings import Settings


def open_backend(settings: Settings, progress=None) -> Backend:
    """A backend, not yet started (start() loads the model or reaches the server). progress: told
    each stage of the engine's start-up; each is also a mark of the start-up trace."""
    def report(stage: str) -> None:
        startup_trace.mark(stage)
        if progress is not None:
            progress(stage)

    if settings.backend:
        startup_trace.mark("importing the HTTP client")
        from nvchat.remote_backend import (
            RemoteBackend,  # start-up: httpx only for a remote server
        )
        return RemoteBackend(settings.backend, api_key=settings.api_key, model=settings.model)
    options = settings.engine_options()
    if _gpu_likely(options.device) and not settings.uses_demo_model:
        # A GGUF file's first start builds its tokenizer in a child process: started before the
        # engine's imports (1.7-4.5 s on the H200 machine), which the engine then finds running.
        from engine.text.tokenizer_build import (
            start_gguf_tokenizer_build,  # start-up: torch-free, unlike the engine below
        )
        start_gguf_tokenizer_build(settings.engine_model())
    startup_trace.mark("importing the engine")
    with _collector_paused():
        from engine import (
            EngineThread,  # start-up: torch and the engine only for the local one
        )
        # What the imports made lives as long as the process: out of the collector's reach, the
        # engine's own full collection once it is built (LLM.__init__) walks only what came after.
        gc.freeze()
        return EngineThread(settings.engine_model(), progress=report, **options.keywords())


def _gpu_likely(device: str | None) -> bool:
    """Whether the engine will run on a GPU, guessed without importing torch: asked for, or left to
    the engine on a machine with NVIDIA's driver loaded and its GPUs not hidden. Where the guess is
    wrong the engine stops what was started for it (LLM)."""
    if device:
        return device.startswith("cuda")
    return os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() not in ("", "-1")


@contextlib.contextmanager
def _collector_paused():
    """No automatic garbage collection while torch and the engine load and the model is built:
    full passes over torch's objects as they were created took 0.35 s of a CPU `nvchat -p` start
    (4 of them, timed through gc.callbacks, 2-core box). Loading makes no reference cycles worth
    collecting early, and the engine collects before it freezes what it keeps."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def model_name(settings: Settings, backend: Backend) -> str:
    """The name stored with conversations: the remote server's model, else the settings' model."""
    return backend.capabilities.model_name or settings.model_name
