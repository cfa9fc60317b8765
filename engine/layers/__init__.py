"""The model's building blocks, one operation a module: linear layers sharded for tensor
parallelism, embeddings and the LM head, RMSNorm, rotary embeddings, SiLU, weight-only
quantized products for CPU, and attention with its backends (Triton, flash-attn, torch).

May import: engine.core, engine.distributed and kernels.
"""
