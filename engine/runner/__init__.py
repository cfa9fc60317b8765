"""Runs a planned step on the device: `ModelRunner` builds the model, sizes and holds the KV cache,
replays CUDA graphs for decode and small prefill steps, and samples; `TensorParallelRunner` drives
one worker process per extra GPU through the same calls.

May import: engine.core, engine.distributed, engine.layers, engine.models, engine.checkpoints,
engine.config and kernels.
"""
