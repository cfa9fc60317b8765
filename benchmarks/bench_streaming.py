"""Chat scheduling under load: 8 streams decode, then an 8192-token prompt arrives. Reports the
8 streams' inter-token latency (p50, p99) before and during that prompt's prefill, and the engine's
own step times (decode-only steps before, steps carrying a prompt chunk during), which split an ITL
into what the step costs and what delivering its tokens adds."""
import argparse
import gc
import random
import statistics
import sys
import threading
import time

from benchmarks.common import CONFIGS, print_table, write_json
from engine import EngineThread, SamplingParams
from engine.options import CHAT_PREFILL_CHUNK


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def record_steps(llm) -> list[tuple[float, float, int, int]]:
    """Wraps llm.step to log (start, end, prompt tokens, decode tokens) for every step that ran
    anything."""
    log, step = [], llm.step

    def timed_step():
        start = time.perf_counter()
        outputs = step()
        prefill, decode = llm.last_step_tokens
        if prefill or decode:
            log.append((start, time.perf_counter(), prefill, decode))
        return outputs

    llm.step = timed_step
    return log


def record_gc() -> list[tuple[float, float]]:
    """Logs (start, ms) of every garbage collection: a stall of every thread at once."""
    log, started = [], []

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            at = started.pop()
            log.append((at, (time.perf_counter() - at) * 1e3))

    gc.callbacks.append(on_gc)
    return log


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default=str(CONFIGS / "qwen3-0.6b"), help="config dir (random weights), or 'demo'")
    p.add_argument("--device", default=None)
    p.add_argument("--long-prompt", type=int, default=8192)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prefill-chunk", type=int, default=CHAT_PREFILL_CHUNK,
                   help="max_prefill_chunk (the chat default)")
    p.add_argument("--warm-tokens", type=int, default=64, help="tokens per stream before the long prompt")
    p.add_argument("--no-prefill-cuda-graphs", dest="prefill_cuda_graphs", action="store_false",
                   help="run prefill and mixed steps eagerly (decode steps still use graphs)")
    p.add_argument("--block-size", type=int, default=None, help="kvcache_block_size (default: the engine's)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for the run, in seconds (the chat app sets 0.0005)")
    p.add_argument("--full-chunk-context", type=int, default=None,
                   help="the scheduler's full_chunk_context (chunks shrink past it while streams decode)")
    p.add_argument("--min-chunk", type=int, default=None,
                   help="the scheduler's min_chunk (the smallest chunk it shrinks to while streams decode)")
    p.add_argument("--out", default="benchmarks/out/streaming.json")
    args = p.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    if args.config == "demo":
        from engine.checkpoints.demo_model import (
            ensure_demo_model,  # start-up: only for --config demo
        )
        model, extra = str(ensure_demo_model()), {}
    else:
        model, extra = args.config, {"load_format": "random", "dtype": "bfloat16"}
    engine = EngineThread(model, device=args.device, max_model_len=args.long_prompt + 1024, max_num_seqs=64,
                          max_prefill_chunk=args.prefill_chunk, prefill_cuda_graphs=args.prefill_cuda_graphs,
                          kvcache_block_size=args.block_size, **extra).start()
    if args.full_chunk_context is not None:
        engine.llm.scheduler.full_chunk_context = args.full_chunk_context
    if args.min_chunk is not None:
        engine.llm.scheduler.min_chunk = args.min_chunk
    steps = record_steps(engine.llm)
    gc_pauses = record_gc()
    vocab = engine.llm.config.hf_config.vocab_size
    rng = random.Random(0)
    engine.submit([rng.randrange(vocab) for _ in range(32)], SamplingParams(max_tokens=4)).wait()

    arrivals: list[list[float]] = [[] for _ in range(args.streams)]
    streams = [engine.submit([rng.randrange(vocab) for _ in range(64)],
                             SamplingParams(temperature=0.8, max_tokens=100_000 // args.streams, ignore_eos=True))
               for _ in range(args.streams)]

    def reader(i):
        for _ in streams[i]:
            arrivals[i].append(time.perf_counter())

    readers = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(args.streams)]
    for t in readers:
        t.start()
    while min(len(a) for a in arrivals) < args.warm_tokens:
        time.sleep(0.01)
    long_prompt = [rng.randrange(vocab) for _ in range(args.long_prompt)]
    submitted = time.perf_counter()
    long = engine.submit(long_prompt, SamplingParams(max_tokens=1))
    long.wait()
    prefill_done = long.first_token_at
    time.sleep(0.2)
    for s in streams:
        s.abort()
    for t in readers:
        t.join()
    engine.shutdown()

    def gaps(lo, hi):
        out = []
        for a in arrivals:
            out += [(b - x) * 1e3 for x, b in zip(a, a[1:]) if lo <= x and b <= hi]
        return out

    def step_ms(lo, hi, mixed):
        return [(end - start) * 1e3 for start, end, prefill, _ in steps
                if lo <= start and end <= hi and (prefill > 0) == mixed]

    decode_steps, mixed_steps = step_ms(0, submitted, False), step_ms(submitted, prefill_done, True)
    before = gaps(0, submitted)
    during = gaps(submitted, prefill_done)
    rows = [("before", len(before), f"{percentile(before, .5):.2f}", f"{percentile(before, .99):.2f}"),
            ("during prefill", len(during), f"{percentile(during, .5):.2f}", f"{percentile(during, .99):.2f}")]
    print(f"{args.long_prompt}-token prompt prefilled in {(prefill_done - submitted) * 1e3:.0f} ms "
          f"(chunks of {args.prefill_chunk}); {args.streams} streams")
    print_table(rows, ("window", "gaps", "p50 ms", "p99 ms"))
    print(f"engine steps: decode-only before p50 {percentile(decode_steps, .5):.2f} ms "
          f"({len(decode_steps)}); with a prompt chunk during p50 {percentile(mixed_steps, .5):.2f} / "
          f"p99 {percentile(mixed_steps, .99):.2f} ms ({len(mixed_steps)})")
    ratio = percentile(during, .99) / percentile(before, .5)
    print(f"p99 during / p50 before = {ratio:.2f} (target <= 2)")
    write_json(args.out, {"before_ms": before, "during_ms": during, "prefill_ms": (prefill_done - submitted) * 1e3,
                          "p50_before": percentile(before, .5), "p99_before": percentile(before, .99),
                          "p50_during": percentile(during, .5), "p99_during": percentile(during, .99),
                          "ratio": ratio, "decode_step_ms": decode_steps, "mixed_step_ms": mixed_steps,
                          "steps": [(start - submitted, end - start, prefill, decode)
                                    for start, end, prefill, decode in steps],
                          "gc_pauses": [(at - submitted, ms) for at, ms in gc_pauses], "prefill_chunk": args.prefill_chunk,
                          "switch_interval_s": sys.getswitchinterval(),
                          "full_chunk_context": engine.llm.scheduler.full_chunk_context,
                          "min_chunk": engine.llm.scheduler.min_chunk, "config": args.config,
                          "median_before": statistics.median(before) if before else None})


if __name__ == "__main__":
    main()
