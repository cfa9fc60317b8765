"""Where an engine step's time goes: a torch.profiler trace of a few steps in each situation
(decode of 1, 2, 4 and 8 rows, full-batch decode over even contexts and over contexts as spread as
bench_throughput's, a prompt chunk mixed into 8 decoding streams early and late in a long prompt,
prefills), reduced to wall time per step, GPU-busy time per step, kernels per step, the costliest
kernels by their own durations, and the costliest by how far each moves the end of the GPU's work
(`frontier_advance`: with PDL on, a kernel's own duration counts the time its early programs wait
on the kernel before; run with NVCHAT_PDL=0 to read the first list)."""
import argparse
import contextlib
import random
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import CONFIGS, write_json
from engine import LLM, SamplingParams
from engine.options import KV_CACHE_DTYPES


def _busy_us(intervals) -> float:
    """Length of the union of [start, end) intervals: time the GPU ran at least one kernel."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def frontier_advance(kernels) -> dict[str, tuple[int, float]]:
    """{name: (count, µs)}: how far each kernel moves the end of the GPU's work, by name. Kernels
    are (name, start, end) in µs; taken in order of their starts, each adds the part of it that
    ends past every kernel before it and does not overlap them. The advances sum to the busy time
    (_busy_us), each kernel's part of a step's chain whether or not its programs started early."""
    by_name: dict[str, tuple[int, float]] = {}
    frontier = float("-inf")
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        count, total = by_name.get(name, (0, 0.0))
        by_name[name] = (count + 1, total + max(0.0, end - max(frontier, start)))
        frontier = max(frontier, end)
    return by_name


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_steps(llm: LLM, steps: int) -> dict:
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        sync()
        wall_us = (time.perf_counter() - start) * 1e6
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    chain = frontier_advance((e.name, e.time_range.start, e.time_range.end) for e in kernels)
    return {
        "wall_us_per_step": wall_us / steps,
        "gpu_busy_us_per_step": _busy_us((e.time_range.start, e.time_range.end) for e in kernels) / steps,
        "kernel_us_per_step": sum(t for _, t in by_name.values()) / steps,
        "kernels_per_step": len(kernels) / steps,
        "top": [{"name": name[:90], "per_step": n / steps, "us_per_step": t / steps, "us_each": t / n}
                for name, (n, t) in top],
        "chain": [{"name": name[:90], "per_step": n / steps, "us_per_step": t / steps, "us_each": t / n}
                  for name, (n, t) in sorted(chain.items(), key=lambda kv: -kv[1][1])[:15]],
    }


def report(title: str, r: dict) -> None:
    print(f"\n== {title}: wall {r['wall_us_per_step']:.0f} us/step, GPU busy {r['gpu_busy_us_per_step']:.0f} us, "
          f"{r['kernels_per_step']:.0f} kernels/step")
    for k in r["top"]:
        print(f"  {k['us_per_step']:8.1f} us/step  {k['per_step']:6.1f}x  {k['us_each']:7.2f} us each  {k['name']}")
    print("  by how far each moves the end of the GPU's work:")
    for k in r["chain"]:
        print(f"  {k['us_per_step']:8.1f} us/step  {k['per_step']:6.1f}x  {k['us_each']:7.2f} us each  {k['name']}")


@contextlib.contextmanager
def prompts_at_full_budget(llm: LLM):
    """Prompts prefill at the whole step budget while other sequences decode. Under the
    chat-sized max_prefill_chunk (128), once the first of 256 prompts decodes the rest are fed
    32-128 tokens a step, thousands of steps for 256 prompts of 600 tokens (the likely reason the
    profile at Qwen3-8B-FP8's shape outran the 100 s it had, benchmarks/HISTORY.md, 2026-11-28,
    08:18)."""
    chunk = llm.scheduler.max_prefill_chunk
    llm.scheduler.max_prefill_chunk = llm.scheduler.max_num_batched_tokens
    try:
        yield
    finally:
        llm.scheduler.max_prefill_chunk = chunk


SCENARIOS = ["decode_b1_ctx512", "decode_b2_ctx512", "decode_b4_ctx512", "decode_b8_ctx512",
             "decode_b256_ctx600", "decode_b256_ctx100-1024", "mixed_8_decode_plus_120_chunk",
             "mixed_8_streams_at_8k", "cached_2048_plus_50_prefill"]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default=str(CONFIGS / "qwen3-0.6b"))
    p.add_argument("--no-prefill-cuda-graphs", dest="prefill_cuda_graphs", action="store_false",
                   help="run prefill and mixed steps eagerly (decode steps still use graphs)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (rank 0's kernels are profiled)")
    p.add_argument("--only", nargs="+", choices=SCENARIOS, default=SCENARIOS, help="scenarios to run")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the KV cache's dtype (fp8: e4m3, half the bytes a token)")
    p.add_argument("--out", default="benchmarks/out/profile.json")
    args = p.parse_args()
    rng = random.Random(0)
    llm = LLM(args.config, load_format="random", dtype="bfloat16", max_model_len=9216, max_num_seqs=256,
              max_num_batched_tokens=16384, max_prefill_chunk=128, enforce_eager=args.enforce_eager,
              prefill_cuda_graphs=args.prefill_cuda_graphs, tensor_parallel_size=args.tp,
              kv_cache_dtype=args.kv_cache_dtype)
    vocab = llm.config.hf_config.vocab_size

    def prompt(n):
        return [rng.randrange(vocab) for _ in range(n)]

    decode_only = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    streaming = SamplingParams(temperature=0.8, max_tokens=4096, ignore_eos=True)
    results = {}

    def end(seqs):
        for s in seqs:
            llm.abort(s)
        llm.step()
        llm.step()

    if "decode_b1_ctx512" in args.only:
        seq = llm.add_request(prompt(512), decode_only)
        for _ in range(5):
            llm.step()
        results["decode_b1_ctx512"] = profile_steps(llm, 20)
        end([seq])

    # The last: contexts as spread as bench_throughput's prompts (100..1024 tokens in one batch).
    for name, batch, contexts, steps in (("decode_b2_ctx512", 2, (512, 512), 20),
                                         ("decode_b4_ctx512", 4, (512, 512), 20),
                                         ("decode_b8_ctx512", 8, (512, 512), 20),
                                         ("decode_b256_ctx600", 256, (600, 600), 5),
                                         ("decode_b256_ctx100-1024", 256, (100, 1024), 5)):
        if name not in args.only:
            continue
        seqs = [llm.add_request(prompt(rng.randint(*contexts)), decode_only) for _ in range(batch)]
        with prompts_at_full_budget(llm):
            while any(s.num_completion_tokens == 0 for s in seqs):
                llm.step()
        llm.step()
        results[name] = profile_steps(llm, steps)
        end(seqs)

    if "mixed_8_decode_plus_120_chunk" in args.only:
        seqs = [llm.add_request(prompt(64), decode_only) for _ in range(8)]
        for _ in range(4):
            llm.step()
        seqs.append(llm.add_request(prompt(4096), SamplingParams(max_tokens=1)))
        results["mixed_8_decode_plus_120_chunk"] = profile_steps(llm, 4)
        end(seqs)

    if "mixed_8_streams_at_8k" in args.only:
        # bench_streaming's situation near the end of its 8192-token prompt: 8 sampled streams
        # and 64-token chunks (shrunk past 4K of context by the scheduler) over ~7.5K keys.
        llm.scheduler.max_prefill_chunk = 64
        seqs = [llm.add_request(prompt(64), streaming) for _ in range(8)]
        for _ in range(4):
            llm.step()
        long = llm.add_request(prompt(8192), SamplingParams(max_tokens=1))
        seqs.append(long)
        while long.num_computed_tokens < 7500:
            llm.step()
        results["mixed_8_streams_at_8k"] = profile_steps(llm, 4)
        while long.num_computed_tokens < 8192 - 64:
            llm.step()
        results["mixed_8_streams_last_chunks"] = profile_steps(llm, 3)
        end(seqs)
        llm.scheduler.max_prefill_chunk = 128

    if "cached_2048_plus_50_prefill" in args.only:
        seq = llm.add_request(prompt(2048), SamplingParams(max_tokens=1))
        while not seq.is_finished:
            llm.step()
        llm.add_request(seq.token_ids[:2048] + prompt(50), SamplingParams(max_tokens=1))
        results["cached_2048_plus_50_prefill"] = profile_steps(llm, 1)
        llm.add_request(prompt(2098), SamplingParams(max_tokens=1))
        results["uncached_2098_prefill"] = profile_steps(llm, 1)
    llm.shutdown()
    for title, r in results.items():
        report(title, r)
    write_json(args.out, {"config": args.config, "prefill_cuda_graphs": args.prefill_cuda_graphs,
                          "kv_cache_dtype": args.kv_cache_dtype, **results})


if __name__ == "__main__":
    main()
