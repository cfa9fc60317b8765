"""Shared pieces of the GPU benchmarks: the workload, the roofline, and result files."""
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"
# Measured on one H200 (../shared/reference/README.md): device-to-device copy (read + write) and bf16 GEMM.
COPY_BANDWIDTH = 4.25e12
GEMM_FLOPS = 790e12


def graph_replay_ms(graph, replays: int) -> float:
    """Mean GPU time of one replay of a captured CUDA graph, by events around back-to-back replays
    (after one untimed replay)."""
    import torch  # start-up: the client processes of bench_serve import this module without torch
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def nano_vllm_workload(num_seqs: int = 256, seed: int = 0):
    """nano-vllm's bench.py recipe: prompt lengths then output lengths uniform in 100..1024."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(num_seqs)]
    max_tokens = [random.randint(100, 1024) for _ in range(num_seqs)]
    return prompts, max_tokens


def model_bytes_and_kv(config_dir: Path, dtype_bytes: int = 2) -> tuple[int, int, int]:
    """(parameter count, weight bytes, KV bytes per token) of a config, counted from its shapes."""
    c = json.loads((config_dir / "config.json").read_text())
    h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h + 2 * d
    params = layers * per_layer + vocab * h * (1 if c.get("tie_word_embeddings") else 2) + h
    return params, params * dtype_bytes, 2 * layers * kv * dtype_bytes


def throughput_roofline(prompts, max_tokens, weight_bytes: int, kv_per_token: int, params: int) -> float:
    """Output tok/s if every decode step read all weights once plus each active sequence's KV at
    the copy bandwidth, and prefill ran at the GEMM rate."""
    steps = max(max_tokens)
    kv_bytes = sum(kv_per_token * sum(len(p) + t for t in range(n)) for p, n in zip(prompts, max_tokens))
    decode_s = (steps * weight_bytes + kv_bytes) / COPY_BANDWIDTH
    prefill_s = 2 * params * sum(len(p) for p in prompts) / GEMM_FLOPS
    return sum(max_tokens) / (decode_s + prefill_s)


def decode_floor_ms(weight_bytes: int, kv_per_token: int, context: int, batch: int = 1) -> float:
    return (weight_bytes + batch * context * kv_per_token) / COPY_BANDWIDTH * 1e3


def environment() -> dict:
    import torch  # start-up: the client processes of bench_serve import this module without torch
    # NVCHAT_COMMIT first: the GPU machines get a copy of the working tree whose .git may not be
    # the one the run was made from.
    commit = os.environ.get("NVCHAT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip()
        except OSError:
            commit = ""
    return {"date": time.strftime("%Y-%m-%d"), "commit": commit or "unknown",
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])}


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({**environment(), **payload}, indent=2))


def print_table(rows: list[tuple], header: tuple) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
