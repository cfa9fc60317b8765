"""N requests sharing one system prompt, sent at once (chat tabs, or one generate call): the time to
each one's first token, and the prompt tokens the engine computed. With prefixes shared in flight
the system prompt is computed once, whichever request gets there first.

    python -m benchmarks.bench_shared_prefix                      # Qwen3-0.6B shape, GPU
    python -m benchmarks.bench_shared_prefix --device cpu --config tests-tiny   # CPU: token counts

Each repeat uses a new random system prompt, so nothing is cached from the repeat before."""
import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import CONFIGS, print_table, write_json
from engine import LLM, SamplingParams


def tiny_config(path: Path) -> Path:
    """A Qwen3 config of the test suite's tiny shape (random weights), for a quick CPU run."""
    import transformers  # start-up: only the --tiny run writes a config
    transformers.Qwen3Config(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=4096, architectures=["Qwen3ForCausalLM"]).save_pretrained(path)
    return path


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def one_burst(llm: LLM, args, vocab: int) -> dict:
    system = [random.randrange(vocab) for _ in range(args.system_tokens)]
    prompts = [system + [random.randrange(vocab) for _ in range(args.user_tokens)] for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    hits_before = llm.stats().prefix_hit_tokens
    sync()
    start = time.perf_counter()
    seqs = [llm.add_request(p, params) for p in prompts]
    first = {}
    computed = steps = 0
    while llm.has_unfinished():
        outputs = llm.step()
        steps += 1
        computed += llm.last_step_tokens[0]
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.seq.seq_id, now)
    total = time.perf_counter() - start
    ttft = sorted((first[s.seq_id] - start) * 1e3 for s in seqs)
    return {"ttft_mean_ms": statistics.mean(ttft), "ttft_max_ms": ttft[-1], "total_ms": total * 1e3,
            "prompt_tokens": sum(map(len, prompts)), "computed_prompt_tokens": computed,
            "prefix_hit_tokens": llm.stats().prefix_hit_tokens - hits_before, "steps": steps}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(CONFIGS / "qwen3-0.6b"),
                   help="a directory holding a config.json (random weights), or 'tests-tiny'")
    p.add_argument("--device", default=None)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-prefill-chunk", type=int, default=None,
                   help="as EngineThread sets it (64) to interleave prompts with decoding streams")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/out/shared_prefix.json")
    args = p.parse_args()
    random.seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        config = tiny_config(Path(tmp)) if args.config == "tests-tiny" else Path(args.config)
        on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        llm = LLM(config, load_format="random", device=args.device, dtype="bfloat16" if on_gpu else "float32",
                  max_model_len=4096, max_num_seqs=64, max_prefill_chunk=args.max_prefill_chunk)
    vocab = min(llm.config.hf_config.vocab_size, 10000)
    one_burst(llm, args, vocab)  # untimed: the first burst compiles the kernels for its shapes
    runs = [one_burst(llm, args, vocab) for _ in range(args.repeats)]
    llm.shutdown()
    result = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    rows = [(key, f"{value:.2f}" if isinstance(value, float) else value) for key, value in result.items()]
    print(f"{args.num_requests} requests of {args.system_tokens} shared + {args.user_tokens} own tokens, "
          f"{args.max_tokens} new each; median of {args.repeats}")
    print_table(rows, ("measure", "median"))
    write_json(args.out, {**result, "runs": runs, "config": str(args.config), "num_requests": args.num_requests,
                          "system_tokens": args.system_tokens, "user_tokens": args.user_tokens})


if __name__ == "__main__":
    main()
