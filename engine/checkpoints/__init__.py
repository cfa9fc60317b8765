"""Finding a model and reading its weights: a checkpoint directory of safetensors (block-FP8 ones
too; any other quantization_config is refused by name), a GGUF file (dequantized, its tokenizer
and chat template from its metadata), a Hugging Face repo id (the local cache, else a download),
and the built-in demo model. Pickled weights and remote code are never
loaded; every problem is a `ModelError` that names it. Also the sampling values a checkpoint
recommends (generation_defaults), and the cache of a GGUF file's CPU-quantized weights
(weight_cache).

May import: engine.core (SamplingParams, to check those values), engine.models (the architectures it
can load), engine.layers (weight placement).
"""
