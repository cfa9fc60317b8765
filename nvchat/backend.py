"""The chat backend the settings ask for: the in-process engine, or a remote OpenAI-compatible
server (--backend URL). Either is a Backend (engine/backend.py)."""
from engine.backend import Backend
from nvchat.settings import Settings


def open_backend(settings: Settings, progress=None) -> Backend:
    """A backend, not yet started (start() loads the model or reaches the server)."""
    if settings.backend:
        from nvchat.remote_backend import (
            RemoteBackend,  # start-up: httpx only for a remote server
        )
        return RemoteBackend(settings.backend, api_key=settings.api_key, model=settings.model)
    from engine import (
        EngineThread,  # start-up: torch and the engine only for the local one
    )
    return EngineThread(settings.engine_model(), progress=progress, **settings.engine_options().keywords())


def model_name(settings: Settings, backend: Backend) -> str:
    """The name stored with conversations: the remote server's model, else the settings' model."""
    return backend.capabilities.model_name or settings.model_name
