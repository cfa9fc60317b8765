"""nvchat's inference engine: paged KV cache, prefix caching, continuous batching.

The public API is `LLM` (batch generation and step-by-step control), `EngineThread` (the engine on a
background thread, streaming to any number of callers), `EngineOptions` (every option either takes),
`SamplingParams` (with `StructuredOutput`), `RequestStream`, `TokenLogprobs` (what logprobs=N reports
per token), and `Backend`, the interface EngineThread offers a chat app.

The package is layered; a module imports only from layers below its own (tests/test_layering.py
checks it), bottom to top:

    options       EngineOptions: every engine setting declared once, torch-free
    core          the scheduling core, torch-free: requests, blocks, the scheduler, step plans
    distributed   the tensor-parallel group and its collectives
    layers        the model's building blocks and the attention backends
    models        model definitions, assembled from layers
    checkpoints   finding, checking and reading weights: safetensors, GGUF, the Hub, the demo model
    text          tokenizers and incremental detokenization
    config        EngineConfig: the engine's options, resolved against the machine and the checkpoint
    runner        runs a planned step on the device: model, CUDA graphs, sampler, TP workers
    llm           LLM: the tokenizer, scheduler and runner driven step by step
    request_stream   RequestStream: one request's tokens, for callers on other threads
    backend       the Backend protocol a chat app talks to, its capabilities and snapshot
    engine_thread EngineThread: the LLM on a background thread, a Backend

Names are exported lazily, so importing a submodule (the torch-free core, say) loads only what it
needs.
"""
import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "EngineStats": "engine.llm",
    "EngineThread": "engine.engine_thread",
    "EngineOptions": "engine.options",
    "Backend": "engine.backend",
    "BackendCapabilities": "engine.backend",
    "EngineSnapshot": "engine.backend",
    "RequestStream": "engine.request_stream",
    "Delta": "engine.request_stream",
    "SamplingParams": "engine.core.sampling_params",
    "StructuredOutput": "engine.core.sampling_params",
    "TokenLogprobs": "engine.core.sequence",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
