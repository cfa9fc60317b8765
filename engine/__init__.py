"""nvchat's inference engine: paged KV cache, prefix caching, continuous batching."""
from engine.llm import LLM, EngineStats
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineStats"]
