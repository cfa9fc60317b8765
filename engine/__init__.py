"""nvchat's inference engine: paged KV cache, prefix caching, continuous batching.

The public API is `LLM` (batch generation and step-by-step control), `EngineThread` (the engine on a
background thread, streaming to any number of callers), `SamplingParams` (with `StructuredOutput`),
`RequestStream`, and `TokenLogprobs` (what logprobs=N reports per token).

The package is layered; a module imports only from layers below its own (tests/test_layering.py
checks it), bottom to top:

    core          the scheduling core, torch-free: requests, blocks, the scheduler, step plans
    distributed   the tensor-parallel group and its collectives
    layers        the model's building blocks and the attention backends
    models        model definitions, assembled from layers
    checkpoints   finding, checking and reading weights: safetensors, GGUF, the Hub, the demo model
    text          tokenizers and incremental detokenization
    config        EngineConfig: the engine's settings, resolved against the checkpoint
    runner        runs a planned step on the device: model, CUDA graphs, sampler, TP workers
    llm           LLM: the tokenizer, scheduler and runner driven step by step
    request_stream, engine_thread   streaming to callers on other threads

Names are exported lazily, so importing a submodule (the torch-free core, say) loads only what it
needs.
"""
import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "EngineStats": "engine.llm",
    "EngineThread": "engine.engine_thread",
    "EngineSnapshot": "engine.engine_thread",
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
