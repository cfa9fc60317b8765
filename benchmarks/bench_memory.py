"""Does the engine stay within gpu_memory_utilization? Starts an engine in a real model's shape
(random weights), then runs the steps that need the most memory beside the KV cache: a decode step
of max_num_seqs rows sampling with top-k/top-p (a sort over the vocabulary per row) and full
prefill batches. Reports how the memory was shared out and the peak the process reached."""
import argparse

import torch

from benchmarks.common import CONFIGS, print_table, write_json
from engine import LLM, SamplingParams

GIB = 2**30
FILTERED = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_tokens=3, ignore_eos=True)


def peak_use(llm: LLM, max_num_seqs: int, max_model_len: int) -> dict:
    """Runs the memory-hungry steps; returns the budget and the peak bytes this process held on
    the GPU: torch's peak reservation plus what lies outside it (the CUDA context, the NCCL and
    cuBLAS workspaces), which stays put."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    outside_torch = total - free - torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    llm.generate([[i % 1000 + 1] * 16 for i in range(max_num_seqs)], FILTERED)
    llm.generate([[5] * (max_model_len - 8) for _ in range(8)], FILTERED)
    torch.cuda.synchronize()
    return {"budget": total * llm.config.gpu_memory_utilization, "peak": outside_torch + torch.cuda.max_memory_reserved()}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default=str(CONFIGS / "qwen3-0.6b"))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--out", default="benchmarks/out/memory.json")
    args = p.parse_args()
    with LLM(args.config, load_format="random", dtype="bfloat16", max_model_len=args.max_model_len,
             max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization) as llm:
        plan = dict(llm.runner.memory_plan)
        kv = llm.runner.kv_cache.numel() * llm.runner.kv_cache.element_size()
        use = peak_use(llm, args.max_num_seqs, args.max_model_len)
    rows = [("weights, context, other (before the KV cache)", plan["used"]), ("KV cache", kv),
            ("set aside: step activations and sampling", plan["activations"]),
            ("set aside: CUDA graph pool", plan["graph_pool"]), ("CUDA graph pool, as captured", plan["graph_pool_captured"]),
            ("budget (gpu_memory_utilization x total)", use["budget"]), ("peak held by the process", use["peak"]),
            ("headroom left at the peak", use["budget"] - use["peak"])]
    print_table([(name, f"{value / GIB:.3f}") for name, value in rows], ("", "GiB"))
    write_json(args.out, {"config": args.config, "args": vars(args), "memory_plan": plan, "kv_cache": kv, **use})


if __name__ == "__main__":
    main()
