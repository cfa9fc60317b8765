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


def pin_host_tier(llm) -> None:
    """Pins the KV cache's whole host tier now. The tier pins its memory a piece at a time whenever
    the engine goes idle (as between a chat's turns), ~0.1 s a piece: the step that ends a timed
    decode run would take one, ~1 ms of every step's average over 100 steps. An app open a while
    has pinned all of it."""
    while llm.grow_host_cache():
        pass


def nano_vllm_workload(num_seqs: int = 256, seed: int = 0):
    """nano-vllm's bench.py recipe: prompt lengths then output lengths uniform in 100..1024."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(num_seqs)]
    max_tokens = [random.randint(100, 1024) for _ in range(num_seqs)]
    return prompts, max_tokens


def _parameter_groups(config_dir: Path) -> dict:
    """A config's parameters by what reads them: "projections" (attention and dense MLPs, every
    layer), "experts" (all of them) and "expert" (one expert of one layer) with the count of
    "sparse_layers" and "top_k", and "other" (embeddings, head, norms, routers); "fp8": whether the
    projections and experts are block-FP8 (quantization_config)."""
    c = json.loads((config_dir / "config.json").read_text())
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    experts = c.get("num_experts") or 0
    dense_only = set(c.get("mlp_only_layers") or [])
    step = c.get("decoder_sparse_step") or 1
    sparse = sum(1 for i in range(layers) if experts and i not in dense_only and (i + 1) % step == 0)
    expert = 3 * h * c.get("moe_intermediate_size", 0)
    projections = layers * (h * (q + 2 * kv) + q * h) + (layers - sparse) * 3 * h * c["intermediate_size"]
    other = vocab * h * (1 if c.get("tie_word_embeddings") else 2) + h + layers * (2 * h + 2 * d) + sparse * experts * h
    fp8 = (c.get("quantization_config") or {}).get("quant_method") == "fp8"
    return dict(projections=projections, experts=sparse * experts * expert, expert=expert, sparse_layers=sparse,
                num_experts=experts, top_k=c.get("num_experts_per_tok", 0), other=other, fp8=fp8,
                kv_per_token_elems=2 * layers * kv)


def _weight_bytes(g: dict, matrix_params: float, dtype_bytes: int) -> float:
    # FP8: a byte a weight and a float32 scale per 128x128 block.
    per_param = (1 + 4 / 128 ** 2) if g["fp8"] else dtype_bytes
    return matrix_params * per_param + g["other"] * dtype_bytes


def model_bytes_and_kv(config_dir: Path, dtype_bytes: int = 2) -> tuple[int, int, int]:
    """(parameter count, weight bytes, KV bytes per token) of a config, counted from its shapes:
    every parameter, experts included; FP8 projections and experts at a byte each."""
    g = _parameter_groups(config_dir)
    params = g["projections"] + g["experts"] + g["other"]
    return params, int(_weight_bytes(g, g["projections"] + g["experts"], dtype_bytes)), \
        g["kv_per_token_elems"] * dtype_bytes


def active_params(config_dir: Path) -> int:
    """Parameters one token runs through: a mixture of experts' chosen experts only."""
    g = _parameter_groups(config_dir)
    return g["projections"] + g["sparse_layers"] * g["top_k"] * g["expert"] + g["other"]


def step_weight_bytes(config_dir: Path, batch: int, dtype_bytes: int = 2) -> int:
    """Weight bytes a decode step of `batch` rows reads: all of a dense model's; of a mixture of
    experts, the experts its rows choose, E * (1 - (1 - k/E)**batch) a layer if the router picks
    uniformly (Qwen3-30B-A3B: 8 of 128 at batch 1, ~60 at 8)."""
    g = _parameter_groups(config_dir)
    experts = 0.0
    if g["num_experts"]:
        chosen = g["num_experts"] * (1 - (1 - g["top_k"] / g["num_experts"]) ** batch)
        experts = g["sparse_layers"] * chosen * g["expert"]
    return int(_weight_bytes(g, g["projections"] + experts, dtype_bytes))


def throughput_roofline(prompts, max_tokens, weight_bytes: int, kv_per_token: int, params: int) -> float:
    """Output tok/s if every decode step read all weights once plus each active sequence's KV at
    the copy bandwidth, and prefill ran at the GEMM rate. params: those a token runs through
    (active_params: a mixture of experts' chosen experts)."""
    steps = max(max_tokens)
    kv_bytes = sum(kv_per_token * sum(len(p) + t for t in range(n)) for p, n in zip(prompts, max_tokens))
    decode_s = (steps * weight_bytes + kv_bytes) / COPY_BANDWIDTH
    prefill_s = 2 * params * sum(len(p) for p in prompts) / GEMM_FLOPS
    return sum(max_tokens) / (decode_s + prefill_s)


def decode_floor_ms(weight_bytes: int, kv_per_token: int, context: int, batch: int = 1) -> float:
    return (weight_bytes + batch * context * kv_per_token) / COPY_BANDWIDTH * 1e3


def _git_commit(where: Path) -> str:
    """HEAD's short hash, "+wt" after it when tracked files differ from it; "" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=where)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, cwd=where)
    except OSError:
        return ""
    if head.returncode or not head.stdout.strip():
        return ""
    return head.stdout.strip() + ("+wt" if changed.returncode == 0 and changed.stdout.strip() else "")


def environment() -> dict:
    import torch  # start-up: the client processes of bench_serve import this module without torch
    # NVCHAT_COMMIT first: the GPU machines get a copy of the working tree whose .git may not be
    # the one the run was made from. Without it, a tree whose tracked files differ from HEAD is
    # HEAD "+wt", as benchmarks/HISTORY.md writes it: a stale .git shows as such, not as HEAD.
    commit = os.environ.get("NVCHAT_COMMIT") or _git_commit(Path(__file__).parent)
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
