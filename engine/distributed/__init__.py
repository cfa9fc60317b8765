"""Tensor parallelism's communication: each engine's rank group and the collectives its layers
call (NCCL or gloo, and one-shot sums over NVLink peer memory for decode-sized tensors).

May import: torch and kernels.
"""
