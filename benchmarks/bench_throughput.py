"""Output tokens/s on nano-vllm's workload (256 sequences, 100..1024 in and out), against the
memory roofline and, with --compare hf, HF transformers' continuous batching in the same run."""
import argparse
import gc
import time
from pathlib import Path

import torch

from benchmarks.common import (
    CONFIGS,
    active_params,
    model_bytes_and_kv,
    nano_vllm_workload,
    print_table,
    throughput_roofline,
    write_json,
)
from engine import LLM, SamplingParams
from engine.options import KV_CACHE_DTYPES


def run_nvchat(args, prompts, max_tokens) -> dict:
    llm = LLM(args.config, load_format="random", dtype="bfloat16", tensor_parallel_size=args.tp,
              max_model_len=2048, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
              async_scheduling=args.overlap == "on", kv_cache_dtype=args.kv_cache_dtype)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in max_tokens]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o["token_ids"]) for o in outs)
    stats = llm.stats()
    llm.shutdown()
    name = "nvchat" if llm.async_scheduling else "nvchat, no overlap"
    return {"engine": name, "seconds": elapsed, "output_tokens": tokens, "tok_per_s": tokens / elapsed,
            "num_blocks": stats.num_blocks, "preemptions": stats.num_preemptions}


def run_hf(args, prompts, max_tokens) -> dict:
    """transformers' own continuous batching (paged|sdpa), random weights in the same shape."""
    # start-up: transformers' modeling code loads only for the --hf comparison
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    config = AutoConfig.from_pretrained(args.config)
    # Built and initialised on the GPU: a Qwen3-30B-A3B shape initialised on the CPU first takes minutes.
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="paged|sdpa").eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    try:
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, max_tokens)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        tokens, done = 0, 0
        while done < len(prompts):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("HF continuous batching stopped answering")
            tokens += len(result.generated_tokens)
            done += 1
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return {"engine": "hf-paged-sdpa", "seconds": elapsed, "output_tokens": tokens, "tok_per_s": tokens / elapsed}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default=str(CONFIGS / "qwen3-0.6b"))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="fp8: the KV cache in e4m3 (the roofline counts its bytes as such)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--overlap", choices=["on", "off"], default="on",
                   help="async_scheduling: the host's step work overlapped with the GPU")
    p.add_argument("--compare", choices=["hf"], default=None)
    p.add_argument("--hf-num-seqs", type=int, default=None, help="run HF on the first N sequences only")
    p.add_argument("--out", default="benchmarks/out/throughput.json")
    args = p.parse_args()

    prompts, max_tokens = nano_vllm_workload(args.num_seqs)
    _, weight_bytes, kv_per_token = model_bytes_and_kv(Path(args.config))

    def roofline_with(kv_bytes_per_token):
        return throughput_roofline(prompts, max_tokens, weight_bytes, kv_bytes_per_token, active_params(Path(args.config)))
    # nvchat's roofline counts its cache's bytes; HF's cache is bf16 either way.
    roofline = roofline_with(kv_per_token // 2 if args.kv_cache_dtype == "fp8" else kv_per_token)
    hf_roofline = roofline_with(kv_per_token)
    results = [run_nvchat(args, prompts, max_tokens)]
    print(f"nvchat: {results[0]['tok_per_s']:,.0f} tok/s ({results[0]['seconds']:.2f} s)", flush=True)
    gc.collect()  # the engine's weights and KV cache, before HF's model takes the card
    torch.cuda.empty_cache()
    if args.compare == "hf":
        n = args.hf_num_seqs or len(prompts)
        results.append({**run_hf(args, prompts[:n], max_tokens[:n]), "num_seqs": n})
    rows = [(r["engine"], r.get("num_seqs", len(prompts)), r["output_tokens"], f"{r['seconds']:.2f}",
             f"{r['tok_per_s']:,.0f}", f"{r['tok_per_s'] / (hf_roofline if r['engine'].startswith('hf') else roofline):.1%}")
            for r in results]
    print(f"workload: {len(prompts)} seqs, {sum(len(x) for x in prompts):,} prompt tokens, "
          f"{sum(max_tokens):,} output tokens; roofline {roofline:,.0f} tok/s")
    print_table(rows, ("engine", "seqs", "out tokens", "s", "tok/s", "of roofline"))
    write_json(args.out, {"roofline_tok_per_s": roofline, "results": results, "tp": args.tp, "config": args.config,
                          "kv_cache_dtype": args.kv_cache_dtype})


if __name__ == "__main__":
    main()
