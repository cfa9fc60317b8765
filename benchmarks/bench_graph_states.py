"""The decode forward graph's GPU time by what the engine ran before it (issue 28).

    python -m benchmarks.bench_graph_states                  # SmolLM2's shape, random weights, 64 streams
    NVCHAT_PDL=0 python -m benchmarks.bench_graph_states     # the same with programmatic dependent launch off

Each round decodes a batch for --steps steps, then replays the decode step's forward graph alone,
back to back, on the inputs the last step staged, and times the replays with CUDA events. Rounds
alternate a plain batch (greedy, nothing else) with the same batch but one row under logit_bias,
which makes the engine sample the step with its adjusted sampling graph (as penalties, min_tokens
and structured output do). The forward graph is the same captured graph in both, on inputs of the
same shapes and sizes; only what ran before the replays differs. Every round's prompts are its
own, so that no round reads another's cached blocks, which the replays rewrite.

The step's own time is printed beside it ("ms/step": wall time over the decode steps).
"""
import argparse
import random
import time
from pathlib import Path

from benchmarks.common import CONFIGS, graph_replay_ms, print_table, write_json


def run_round(llm, biased_rows: int, streams: int, steps: int, replays: int, seed: int) -> dict:
    import torch  # start-up: the engine (and torch) after argument parsing

    from engine import SamplingParams

    rng = random.Random(seed)
    vocab = llm.config.hf_config.vocab_size
    plain = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    biased = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True, logit_bias={0: -1.0})
    seqs = [llm.add_request([rng.randrange(100, vocab) for _ in range(32)], biased if i < biased_rows else plain)
            for i in range(streams)]
    try:
        while any(s.num_completion_tokens < 2 for s in seqs):  # every prompt prefilled and decoding
            llm.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - start) / steps * 1e3
        graphs = llm.runner.decode_graphs
        forward_ms = graph_replay_ms(graphs.graphs[graphs.bucket_for(streams)], replays)
    finally:
        for s in seqs:
            llm.abort(s)
        while llm.has_unfinished():
            llm.step()
    return {"ms_per_step": step_ms, "forward_alone_ms": forward_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(CONFIGS / "smollm2-135m"), help="random weights in this shape")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3, help="pairs of rounds: plain, then one biased row")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    import torch  # start-up: as in run_round()

    from engine import LLM
    from kernels import pdl

    if not torch.cuda.is_available():
        raise SystemExit("bench_graph_states times CUDA graphs: it needs a GPU")
    llm = LLM(args.config, load_format="random", dtype="bfloat16", max_model_len=4096 + 256,
              max_num_seqs=args.streams)
    if llm.runner.decode_graphs is None or llm.runner.decode_graphs.bucket_for(args.streams) is None:
        raise SystemExit(f"no decode CUDA graph holds {args.streams} rows")
    table = []
    for r in range(args.rounds):
        for biased_rows, label in ((0, "plain"), (1, "1 row with logit_bias")):
            out = run_round(llm, biased_rows, args.streams, args.steps, args.replays, seed=2 * r + biased_rows)
            table.append((str(r), label, f"{out['ms_per_step']:.3f}", f"{out['forward_alone_ms']:.3f}"))
    llm.shutdown()
    print(f"{Path(args.config).name}, {args.streams} streams; PDL {'on' if pdl.enabled(torch.device('cuda', 0)) else 'off'}")
    header = ("round", "batch before", "ms/step", "forward graph alone, ms")
    print_table(table, header)
    write_json(args.json, {"args": vars(args), "pdl": pdl.enabled(torch.device("cuda", 0)),
                           "results": [dict(zip(header, row)) for row in table]})


if __name__ == "__main__":
    main()
