"""The decode forward graph's GPU time by what the engine ran before it (issue 28).

    python -m benchmarks.bench_graph_states                  # SmolLM2's shape, random weights, 64 streams
    NVCHAT_PDL=0 python -m benchmarks.bench_graph_states     # the same with programmatic dependent launch off

Each round decodes a batch for --steps steps, then replays the decode step's forward graph alone,
back to back, on the inputs the last step staged, and times the replays with CUDA events. A round's
batch is one of (--batches): "plain" (greedy, nothing else), "sampled" (temperature 0.7, top_p 0.9),
"penalty" (greedy, one row with a repetition penalty), "logit_bias" (greedy, one row with a
logit_bias) and "chat" (every row at the app's default sampling, nvchat.settings.FALLBACK_SAMPLING:
temperature, top-k, top-p and a repetition penalty). The last three make the engine sample with its
adjusted sampling graph, as min_tokens and structured output do. The forward graph is the same
captured graph in every round, on inputs of the same shapes and sizes; only what ran before the
replays differs. Every round's prompts are its own, so that no round reads another's cached blocks,
which the replays rewrite.

The step's own time is printed beside it ("ms/step": wall time over the decode steps).
"""
import argparse
import random
import time
from pathlib import Path

from benchmarks.common import CONFIGS, graph_replay_ms, print_table, write_json

# The batches a round can decode before the replays, with how the table names them.
BATCHES = {"plain": "plain", "logit_bias": "1 row with logit_bias", "sampled": "temperature 0.7, top_p 0.9",
           "penalty": "1 row with repetition_penalty", "chat": "the app's default sampling"}


def batch_params(batch: str, streams: int) -> list:
    from engine import SamplingParams  # start-up: the engine (and torch) after argument parsing

    from nvchat.settings import FALLBACK_SAMPLING

    greedy = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    if batch == "chat":
        return [SamplingParams(**FALLBACK_SAMPLING, max_tokens=4096, ignore_eos=True)] * streams
    first = {"plain": greedy,
             "sampled": SamplingParams(temperature=0.7, top_p=0.9, max_tokens=4096, ignore_eos=True),
             "penalty": SamplingParams(temperature=0, repetition_penalty=1.1, max_tokens=4096, ignore_eos=True),
             "logit_bias": SamplingParams(temperature=0, logit_bias={0: -1.0}, max_tokens=4096, ignore_eos=True)}[batch]
    rest = first if batch in ("plain", "sampled") else greedy
    return [first] + [rest] * (streams - 1)


def run_round(llm, batch: str, streams: int, steps: int, replays: int, seed: int) -> dict:
    import torch  # start-up: as in batch_params()

    rng = random.Random(seed)
    vocab = llm.config.hf_config.vocab_size
    seqs = [llm.add_request([rng.randrange(100, vocab) for _ in range(32)], params)
            for params in batch_params(batch, streams)]
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
    ap.add_argument("--rounds", type=int, default=3, help="how many times to run the batches, in turn")
    ap.add_argument("--batches", default=",".join(BATCHES),
                    help=f"the batches run before the replays, in this order each round ({', '.join(BATCHES)})")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    batches = args.batches.split(",")
    unknown = sorted(set(batches) - BATCHES.keys())
    if unknown:
        raise SystemExit(f"unknown --batches {', '.join(unknown)}: choose from {', '.join(BATCHES)}")
    import torch  # start-up: as in batch_params()

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
        for i, batch in enumerate(batches):
            out = run_round(llm, batch, args.streams, args.steps, args.replays, seed=r * len(batches) + i)
            table.append((str(r), BATCHES[batch], f"{out['ms_per_step']:.3f}", f"{out['forward_alone_ms']:.3f}"))
    llm.shutdown()
    pdl_on = pdl.enabled(torch.device("cuda", 0))
    print(f"{Path(args.config).name}, {args.streams} streams; PDL {'on' if pdl_on else 'off'}")
    header = ("round", "batch before", "ms/step", "forward graph alone, ms")
    print_table(table, header)
    write_json(args.json, {"args": vars(args), "pdl": pdl_on,
                           "results": [dict(zip(header, row)) for row in table]})


if __name__ == "__main__":
    main()
