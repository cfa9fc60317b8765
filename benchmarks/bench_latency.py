"""Chat-sized decode latency: ms per step at batches 1, 2, 4 and 8 (a chat app's handful of streams;
at batch 1 that is ms per output token) at 512- and 4096-token contexts, and time to first token
for a 50-token message after a 2048-token system prompt, cached vs uncached.

--repetition-penalty 1.1 (the app's recommended sampling) decodes with a penalty, which the decode
graphs sample in their adjusted kinds; --compare-eager-sampling also times each batch with those
rows sampled on the runner after the graph's forward pass, as before the adjusted kinds, the two
alternating run by run:
    python -m benchmarks.bench_latency --repetition-penalty 1.1 --compare-eager-sampling --skip-ttft
"""
import argparse
import contextlib
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import (
    CONFIGS,
    decode_floor_ms,
    graph_replay_ms,
    model_bytes_and_kv,
    pin_host_tier,
    print_table,
    step_weight_bytes,
    write_json,
)
from engine import LLM, SamplingParams
from engine.options import KV_CACHE_DTYPES


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def sampling_on_the_runner(llm: LLM):
    """Rows that are not plain sample on the runner (the eager Sampler), the forward pass staying
    in the decode graph: the decode graphs as they were before their adjusted kinds."""
    graphs = getattr(llm.runner, "decode_graphs", None)
    if graphs is None:
        yield
        return
    graphs._stage_counts = lambda plan: False  # the graphs' own answer for a row they cannot sample
    try:
        yield
    finally:
        del graphs._stage_counts


def decode_ms_per_step(llm: LLM, context: int, batch: int = 1, new_tokens: int = 128,
                       params: SamplingParams | None = None) -> float:
    """`batch` streams decoding together, each with a mean context of `context`: a prompt stops
    half the generated tokens short of it. The prompts differ, so no prefix is shared."""
    params = params or SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    seqs = [llm.add_request([random.randint(0, 10000) for _ in range(context - new_tokens // 2)], params)
            for _ in range(batch)]
    while any(s.num_completion_tokens < 1 for s in seqs):
        llm.step()  # prefill and first tokens
    sync()
    steps, start = 0, time.perf_counter()
    while not all(s.is_finished for s in seqs):
        llm.step()
        steps += 1
    sync()
    return (time.perf_counter() - start) * 1e3 / steps


def decode_graph_ms(llm: LLM, batch: int = 1, replays: int = 200) -> float | None:
    """GPU time of one captured decode forward (no host work): the step time minus this is host
    time and launch gaps outside the graph (input copies, sampling, the sync, scheduling)."""
    graphs = getattr(llm.runner, "decode_graphs", None)
    if graphs is None or batch not in graphs.graphs:
        return None
    graphs.stage_padding(batch)  # the bucket's own inputs: padding rows, which write no K/V
    return graph_replay_ms(graphs.graphs[batch], replays)


def time_to_first_token_ms(llm: LLM, prompt: list[int]) -> float:
    sync()
    start = time.perf_counter()
    seq = llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while not seq.is_finished:
        llm.step()
    return (time.perf_counter() - start) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default=str(CONFIGS / "qwen3-0.6b"))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="fp8: the KV cache in e4m3 (the floors count its bytes as such)")
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--no-prefill-cuda-graphs", dest="prefill_cuda_graphs", action="store_false",
                   help="run prefill and mixed steps eagerly (decode steps still use graphs)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="decode with this repetition penalty (the app sends 1.1)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--compare-eager-sampling", action="store_true",
                   help="also time each batch with the penalized rows sampled on the runner, not in the graph")
    p.add_argument("--host-cache-gib", type=float, default=4.0,
                   help="the KV cache's host tier, pinned whole before the runs")
    p.add_argument("--out", default="benchmarks/out/latency.json")
    args = p.parse_args()
    params = SamplingParams(temperature=args.temperature, max_tokens=128, ignore_eos=True,
                            repetition_penalty=args.repetition_penalty)
    paths = ["graph", "eager"] if args.compare_eager_sampling else ["graph"]
    random.seed(0)

    _, _, kv_per_token = model_bytes_and_kv(Path(args.config))
    if args.kv_cache_dtype == "fp8":
        kv_per_token //= 2  # one byte an element against bf16's two
    llm = LLM(args.config, load_format="random", dtype="bfloat16", tensor_parallel_size=args.tp, max_model_len=8192,
              max_num_seqs=64, enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
              prefill_cuda_graphs=args.prefill_cuda_graphs, host_cache_gib=args.host_cache_gib,
              kv_cache_dtype=args.kv_cache_dtype)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    pin_host_tier(llm)
    rows, result = [], {"decode": {}, "decode_graph_gpu_ms": {}, "ttft": {},
                        "sampling": {"temperature": args.temperature, "repetition_penalty": args.repetition_penalty}}
    for ctx in args.contexts:
        for batch in args.batches:
            by_path = {path: [] for path in paths}
            for _ in range(args.repeats):
                for path in paths:
                    with sampling_on_the_runner(llm) if path == "eager" else contextlib.nullcontext():
                        by_path[path].append(decode_ms_per_step(llm, ctx, batch, params=params))
            if "eager" in by_path:
                eager_ms = statistics.median(by_path["eager"])
                result["decode"][f"{ctx}x{batch}-eager-sampling"] = {
                    "context": ctx, "batch": batch, "ms_per_step": eager_ms, "runs": by_path["eager"]}
                rows.append((f"batch-{batch} decode, {ctx} ctx, sampled on the runner", f"{eager_ms:.3f} ms/step",
                             "", ""))
                print(*rows[-1], flush=True)
            runs = by_path["graph"]
            ms = statistics.median(runs)
            # A mixture of experts reads more of its experts the more rows a step has.
            floor = decode_floor_ms(step_weight_bytes(Path(args.config), batch), kv_per_token // args.tp * args.tp,
                                    ctx, batch)
            result["decode"][f"{ctx}x{batch}"] = {"context": ctx, "batch": batch, "ms_per_step": ms, "runs": runs,
                                                  "floor_ms": floor}
            one = result["decode"].get(f"{ctx}x1")
            # Against batch 1, with the floors' own ratio: more rows read more KV, so batch 8 at a long
            # context cannot come near batch 1 however fast the kernels.
            vs1 = (f", {ms / one['ms_per_step']:.2f}x batch 1 (floors {floor / one['floor_ms']:.2f}x)"
                   if batch > 1 and one else "")
            rows.append((f"batch-{batch} decode, {ctx} ctx", f"{ms:.3f} ms/step", f"floor {floor:.3f} ms",
                         f"{floor / ms:.0%}{vs1}"))
            print(*rows[-1], flush=True)
    for batch in args.batches if torch.cuda.is_available() else []:
        graph_ms = decode_graph_ms(llm, batch)
        if graph_ms is not None:
            result["decode_graph_gpu_ms"][batch] = graph_ms
            rows.append((f"  batch-{batch} GPU (graph replay)", f"{graph_ms:.3f} ms", "", ""))
            print(*rows[-1], flush=True)
    if not args.skip_ttft:
        uncached, cached = [], []
        for _ in range(args.repeats):
            system = [random.randint(0, 10000) for _ in range(2048)]
            uncached.append(time_to_first_token_ms(llm, system + [random.randint(0, 10000) for _ in range(50)]))
            cached.append(time_to_first_token_ms(llm, system + [random.randint(0, 10000) for _ in range(50)]))
        result["ttft"] = {"uncached_ms": statistics.median(uncached), "cached_ms": statistics.median(cached),
                          "uncached_runs": uncached, "cached_runs": cached}
        rows.append(("TTFT 2048 sys + 50, uncached", f"{result['ttft']['uncached_ms']:.2f} ms", "", ""))
        rows.append(("TTFT 2048 sys + 50, cached", f"{result['ttft']['cached_ms']:.2f} ms", "", ""))
    llm.shutdown()
    print_table(rows, ("measure", "median", "roofline", "fraction"))
    write_json(args.out, {**result, "tp": args.tp, "config": args.config, "kv_cache_dtype": args.kv_cache_dtype})


if __name__ == "__main__":
    main()
