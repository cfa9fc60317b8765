"""nvchat's inference engine: paged KV cache, prefix caching, continuous batching."""
from engine.engine_thread import EngineSnapshot, EngineThread
from engine.llm import LLM, EngineStats
from engine.stream import Delta, RequestStream
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineStats", "EngineThread", "EngineSnapshot", "RequestStream", "Delta"]
