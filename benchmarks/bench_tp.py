"""Tensor-parallel scaling: batch-1 decode latency and nano-vllm's throughput workload at each
tensor-parallel size, on random weights in a real model's shapes (no checkpoint needed).

    python -m benchmarks.bench_tp --config benchmarks/configs/qwen3-8b --tp 1 2 4 --out benchmarks/out/tp-8b.json

Every size runs in this process, one engine after another; rank 0 is cuda:0, rank r is cuda:r.
Small all-reduces go over NVLink peer memory where it sets up (engine/distributed/symm_allreduce.py), the rest
over NCCL (gloo on CPU), each one fused with the RMSNorm after it where it can be;
`--allreduce auto unfused nccl` runs each size above 1 each way.
"""
import argparse
import gc
import itertools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `engine` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import CONFIGS, nano_vllm_workload, pin_host_tier, print_table, write_json
from engine import LLM, SamplingParams
from engine.distributed.symm_allreduce import DISABLE_ENV

NANO_VLLM_OUTPUT_TOKENS = 133_966  # what the 256-sequence workload must generate


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_ms_per_token(llm: LLM, context: int, new_tokens: int, repeats: int) -> tuple[float, list[float]]:
    """Batch 1: a fresh `context`-token prompt, then `new_tokens` greedy tokens. The prefill step
    (which also samples the first token) is left out; every later step is one decode."""
    runs = []
    for _ in range(repeats):
        prompt = [random.randint(0, 10000) for _ in range(context)]
        seq = llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
        llm.step()
        sync()
        start = time.perf_counter()
        while not seq.is_finished:
            llm.step()
        sync()
        runs.append((time.perf_counter() - start) * 1e3 / (new_tokens - 1))
    return statistics.median(runs), runs


def throughput(llm: LLM, num_seqs: int) -> dict:
    prompts, max_tokens = nano_vllm_workload(num_seqs)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in max_tokens]
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    seconds = time.perf_counter() - start
    tokens = sum(len(o["token_ids"]) for o in outs)
    if num_seqs == 256 and tokens != NANO_VLLM_OUTPUT_TOKENS:
        print(f"warning: generated {tokens:,} tokens, nano-vllm's workload makes {NANO_VLLM_OUTPUT_TOKENS:,}",
              file=sys.stderr)
    return {"seconds": seconds, "output_tokens": tokens, "tok_per_s": tokens / seconds,
            "prompt_tokens": sum(map(len, prompts)), "preemptions": llm.stats().num_preemptions}


def run_one(args, tp: int, allreduce: str, overlap: str) -> dict:
    # Read when the engine sets up its group, here and in the workers it spawns.
    os.environ[DISABLE_ENV] = allreduce
    start = time.perf_counter()
    llm = LLM(args.config, load_format="random", dtype="bfloat16", tensor_parallel_size=tp,
              enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
              async_scheduling=overlap == "on", host_cache_gib=args.host_cache_gib)
    result = {"tp": tp, "allreduce": allreduce, "overlap": overlap, "fast_all_reduce": getattr(llm.runner, "fast_all_reduce", False),
              "startup_s": time.perf_counter() - start, "num_blocks": llm.stats().num_blocks}
    try:
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
        pin_host_tier(llm)
        random.seed(0)
        ms, runs = decode_ms_per_token(llm, args.context, args.new_tokens, args.repeats)
        result["decode"] = {"context": args.context, "new_tokens": args.new_tokens, "ms_per_token": ms, "runs": runs}
        if not args.skip_throughput:
            result["throughput"] = throughput(llm, args.num_seqs)
    finally:
        llm.shutdown()
        del llm
        gc.collect()  # free this size's weights and cache before the next size starts
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(CONFIGS / "qwen3-8b"), help="a config directory (weights not needed)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes to run, in order")
    p.add_argument("--skip-throughput", action="store_true", help="only the batch-1 decode latency")
    p.add_argument("--out", default=None, help="write the results to this JSON file")
    p.add_argument("--context", type=int, default=512, help="prompt tokens before the timed decode")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="decode runs per size; the median is reported")
    p.add_argument("--num-seqs", type=int, default=256, help="sequences in the throughput workload")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--host-cache-gib", type=float, default=4.0,
                   help="the KV cache's host tier, pinned whole before the timed runs")
    p.add_argument("--allreduce", nargs="+", default=["auto"], choices=["auto", "unfused", "nccl"],
                   help="auto: symmetric memory for small all-reduces where it sets up, fused with the "
                        "RMSNorm after them; unfused: the same, but the all-reduce and norm apart; nccl: NCCL only")
    p.add_argument("--overlap", nargs="+", default=["on"], choices=["on", "off"],
                   help="async_scheduling: each step's host work overlapped with the GPUs (on), or not")
    args = p.parse_args()

    results = []
    for tp in args.tp:
        for allreduce, overlap in itertools.product(args.allreduce if tp > 1 else args.allreduce[:1], args.overlap):
            results.append(run_one(args, tp, allreduce, overlap))
            # Each run as it finishes, so a run cut short by a time limit still reports what it did.
            print(json.dumps({k: v for k, v in results[-1].items() if k != "runs"}), flush=True)
            write_json(args.out, {"config": args.config, "results": results, "complete": False})
    # Each size against TP=1 with the same overlap setting.
    bases = {r["overlap"]: r for r in results if r["tp"] == 1}
    rows = []
    for r in results:
        ms = r["decode"]["ms_per_token"]
        base = bases.get(r["overlap"])
        path = "-" if r["tp"] == 1 else "nccl" if not r["fast_all_reduce"] else \
            "symm+nccl, unfused" if r["allreduce"] == "unfused" else "symm+nccl"
        row = [r["tp"], path, r["overlap"], f"{ms:.3f}", f"{ms / base['decode']['ms_per_token']:.2f}x" if base else "-"]
        if "throughput" in r:
            t = r["throughput"]
            row += [f"{t['output_tokens']:,}", f"{t['seconds']:.1f}", f"{t['tok_per_s']:,.0f}",
                    f"{t['tok_per_s'] / base['throughput']['tok_per_s']:.2f}x" if base else "-"]
        rows.append(tuple(row + [r["num_blocks"], f"{r['startup_s']:.1f}"]))
    header = ["tp", "all-reduce", "overlap", f"decode ms/token ({args.context} ctx)", "of tp1"]
    if not args.skip_throughput:
        header += ["out tokens", "s", "tok/s", "vs tp1"]
    graphs = torch.cuda.is_available() and not args.enforce_eager
    print(f"{Path(args.config).name}, bf16, random weights, {'CUDA graphs' if graphs else 'eager'}")
    print_table(rows, tuple(header + ["KV blocks", "startup s"]))
    write_json(args.out, {"config": args.config, "results": results, "complete": True})


if __name__ == "__main__":
    main()
