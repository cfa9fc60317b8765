"""The model's building blocks, one operation a module: linear layers sharded for tensor
parallelism, embeddings and the LM head, RMSNorm, rotary embeddings, SiLU, a mixture of experts,
weight-only quantized products for CPU, block-FP8 weights for CUDA, and attention with its
backends (Triton, flash-attn, torch).

May import: engine.core, engine.distributed and kernels.
"""
