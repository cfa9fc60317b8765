"""How much a busy second Python thread slows the engine thread, without the app.

The chat app's UI thread and the engine thread share one GIL. This stands a synthetic thread in
for the UI: it spins in pure Python for BUSY ms, sleeps for IDLE ms, and repeats, while 8
streams decode on an EngineThread. Reported: the engine's tokens/s with each busy/idle pattern
against the same run without the busy thread, and the busy thread's share of a core. Holding the
CPU share fixed and varying the burst length shows whether the engine loses to the UI's total CPU
or to the length of its bursts (bench_ui measures the app itself):

    python -m benchmarks.bench_gil_contention [--shape qwen3-0.6b] [--patterns 40/160 5/20 1/4]
                                              [--switch-interval 0.0005] [--repeats 2] [--out gil.json]
"""
import argparse
import random
import statistics
import sys
import tempfile
import threading
import time

from benchmarks.bench_ui import shaped_demo_model
from benchmarks.common import print_table, write_json
from engine import EngineThread, SamplingParams


def busy_thread(stop: threading.Event, busy_s: float, idle_s: float, cpu: list[float]) -> None:
    while not stop.is_set():
        start, start_cpu = time.perf_counter(), time.thread_time()
        while time.perf_counter() - start < busy_s:
            sum(range(100))  # bytecode, holding the GIL like the UI's own Python
        cpu[0] += time.thread_time() - start_cpu
        time.sleep(idle_s)


def run(engine: EngineThread, params: SamplingParams, streams: int, pattern: tuple[float, float] | None,
        seed: int) -> tuple[float, float]:
    """(engine tokens/s, the busy thread's share of a core) for one batch of streams."""
    rng = random.Random(seed)
    stop, cpu = threading.Event(), [0.0]
    hog = threading.Thread(target=busy_thread, args=(stop, pattern[0] / 1e3, pattern[1] / 1e3, cpu)) if pattern else None
    if hog:
        hog.start()
    start = time.perf_counter()
    running = [engine.submit([rng.randrange(3, 250) for _ in range(24)], params) for _ in range(streams)]
    for stream in running:
        stream.wait(600)
    wall = time.perf_counter() - start
    stop.set()
    if hog:
        hog.join()
    return sum(s.num_completion_tokens for s in running) / wall, cpu[0] / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b", help="a config dir under benchmarks/configs, random weights")
    p.add_argument("--device", default=None)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1536)
    p.add_argument("--patterns", nargs="+", default=["40/160", "5/20", "1/4"], help="BUSY/IDLE ms of the busy thread")
    p.add_argument("--switch-interval", type=float, nargs="+", default=[0.0005], help="sys.setswitchinterval values (s)")
    p.add_argument("--greedy", action="store_true", help="also run greedy sampling (fewer torch calls per step)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    model = shaped_demo_model(args.shape, tempfile.mkdtemp(prefix="nvchat-bench-gil-"))
    engine = EngineThread(str(model), device=args.device, load_format="random", max_model_len=2048,
                          max_num_seqs=max(16, args.streams)).start()
    modes = {"sampled": SamplingParams(temperature=0.8, top_p=0.95, top_k=20, max_tokens=args.max_tokens,
                                       ignore_eos=True)}  # the app's kind of request
    if args.greedy:
        modes["greedy"] = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    patterns = [tuple(float(x) for x in s.split("/")) for s in args.patterns]
    results, rows = [], []
    try:
        for params in modes.values():
            run(engine, params, args.streams, None, 0)  # warm-up
        for interval in args.switch_interval:
            sys.setswitchinterval(interval)
            for mode, params in modes.items():
                alone, hogged = [], {pattern: [] for pattern in patterns}
                for repeat in range(args.repeats):
                    alone.append(run(engine, params, args.streams, None, repeat)[0])
                    for pattern in patterns:
                        hogged[pattern].append(run(engine, params, args.streams, pattern, repeat))
                base = statistics.mean(alone)
                rows.append((f"{interval * 1e3:g}", mode, "none", f"{base:,.0f}", "", "100%"))
                for pattern, runs in hogged.items():
                    tps = [t for t, _ in runs]
                    share = statistics.mean(s for _, s in runs)
                    rows.append((f"{interval * 1e3:g}", mode, f"{pattern[0]:g}/{pattern[1]:g}", f"{statistics.mean(tps):,.0f}",
                                 f"{share:.0%}", " ".join(f"{t / base:.0%}" for t in tps)))
                    results.append({"switch_interval_s": interval, "mode": mode, "busy_ms": pattern[0],
                                    "idle_ms": pattern[1], "tokens_per_s": tps, "busy_cpu_share": share,
                                    "alone_tokens_per_s": alone})
    finally:
        engine.shutdown()
    print(f"{args.streams} streams x {args.max_tokens} tokens, {args.shape} shape, random weights")
    print_table(rows, ("switch ms", "sampling", "busy/idle ms", "engine tok/s", "busy CPU", "of alone, each run"))
    write_json(args.out, {"command": " ".join(sys.argv), "shape": args.shape, "streams": args.streams,
                          "max_tokens": args.max_tokens, "results": results})


if __name__ == "__main__":
    main()
