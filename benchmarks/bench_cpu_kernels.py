"""The CPU engine's C kernels (engine/layers/native/) on SmolLM2's shapes, without the rest of the
engine: a decode step's 120 quantized products (30 layers' qkv, o, gate_up and down, each layer's
weights its own, so that they stream from memory as in a real step) in int8 and int4, and decode
attention over 150 to 2,000 keys. With --baseline-tree the library is also built from another
checkout's sources and the two alternate round by round in one process, so both meet the same
machine load: on a shared box that is the only fair before/after.

    python -m benchmarks.bench_cpu_kernels [--threads 1] [--baseline-tree DIR] [--rounds 15] [--json out.json]

Each figure is the median over the rounds: ms for the step's products (and the GB/s of weights that
makes), µs for one attention call.
"""
import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import print_table, write_json
from engine.layers import native_cpu
from engine.layers.quantized import NativeInt8Weight, Q4_1Weight

LAYERS = 30
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64  # SmolLM2-135M
PRODUCTS = [((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTERMEDIATE, HIDDEN),
            (HIDDEN, INTERMEDIATE)]  # (out, in): qkv, o, gate_up, down
# SmolLM2's attention, and Qwen3-0.6B's (16 query heads on 8 KV heads of 128).
ATTENTION = [(HEADS, KV_HEADS, HEAD_DIM, keys) for keys in (150, 600, 2000)] + \
            [(16, 8, 128, keys) for keys in (150, 600, 2000)]


def build(tree: Path, out_dir: Path, name: str) -> native_cpu.NativeKernels:
    """The library compiled from tree's kernel sources, as native_cpu compiles this tree's."""
    sources = [tree / path.relative_to(Path(native_cpu.__file__).parents[2]) for path in native_cpu.SOURCES]
    target = out_dir / f"{name}.so"
    subprocess.run([os.environ.get("CC", "cc"), *native_cpu.FLAGS, *map(str, sources), "-o", str(target)], check=True)
    return native_cpu.NativeKernels(ctypes.CDLL(str(target)))


def product_step(kernels, layers, threads: int):
    """A function running the step's products once, and the weight bytes it reads."""
    calls, total = [], 0
    inputs = {k: torch.randn(1, k) for k in (HIDDEN, INTERMEDIATE)}
    outputs = {n: torch.empty(1, n) for n, _ in PRODUCTS}
    for layer in layers:
        for w in layer:
            x, y = inputs[w.in_features], outputs[w.out_features]
            if isinstance(w, Q4_1Weight):
                calls.append((kernels.q4_1_gemv, (x.data_ptr(), 1, w.in_features, w.nibbles.data_ptr(), w.scales.data_ptr(),
                                                  w.minimums.data_ptr(), w.out_features, y.data_ptr(), threads, 1)))
                total += w.nibbles.numel() + 2 * (w.scales.numel() + w.minimums.numel())
            else:
                calls.append((kernels.q8_gemv, (x.data_ptr(), 1, w.in_features, w.q.data_ptr(), w.scales.data_ptr(),
                                                w.out_features, y.data_ptr(), threads, 1)))
                total += w.q.numel() + 4 * w.scales.numel()

    def step():
        for function, args in calls:
            function(*args)
    step.keep = (layers, inputs, outputs)  # the calls hold only their addresses
    return step, total


def attention_call(kernels, heads: int, kv_heads: int, head_dim: int, keys: int, threads: int):
    cache = [torch.randn(4096, kv_heads, head_dim) for _ in range(2)]
    q, out = torch.randn(1, heads, head_dim), torch.empty(1, heads * head_dim)
    table, lengths = torch.arange(keys).view(1, -1), torch.tensor([keys])
    args = (q.data_ptr(), 1, heads, kv_heads, head_dim, cache[0].data_ptr(), cache[1].data_ptr(), table.data_ptr(),
            keys, lengths.data_ptr(), HEAD_DIM ** -0.5, out.data_ptr(), threads)

    def call():
        kernels.decode_attention(*args)
    call.keep = (cache, q, out, table, lengths)  # the call holds only their addresses
    return call


def timed(function, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--baseline-tree", help="another nvchat checkout, whose kernel sources are built and alternated with")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    torch.manual_seed(0)
    trees = {"this tree": Path(__file__).resolve().parents[1]}
    if args.baseline_tree:
        trees["baseline"] = Path(args.baseline_tree).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {name: build(tree, Path(tmp), f"kernels{i}") for i, (name, tree) in enumerate(trees.items())}
        cases = {}
        for kind, weight in (("int8", NativeInt8Weight), ("int4", Q4_1Weight)):
            layers = [[weight(torch.randn(n, k) / k ** 0.5) for n, k in PRODUCTS] for _ in range(LAYERS)]
            cases[f"{kind} products, ms a step"] = {name: product_step(k, layers, args.threads) for name, k in kernels.items()}
        for heads, kv_heads, head_dim, keys in ATTENTION:
            cases[f"attention {heads}/{kv_heads} heads of {head_dim}, {keys} keys, us"] = {
                name: (attention_call(k, heads, kv_heads, head_dim, keys, args.threads), None) for name, k in kernels.items()}
        times = {case: {name: [] for name in trees} for case in cases}
        for _ in range(args.rounds + 1):  # the first round warms up and is dropped
            for case, by_tree in cases.items():
                for name, (function, _) in by_tree.items():
                    times[case][name].append(timed(function, 5 if "products" in case else 100))
    rows, results = [], {}
    for case, by_tree in times.items():
        medians = {name: statistics.median(t[1:]) * (1e3 if "products" in case else 1e6) for name, t in by_tree.items()}
        row = [case, *(f"{m:.2f}" for m in medians.values())]
        weight_bytes = next(iter(cases[case].values()))[1]
        if weight_bytes:
            row[1] += f" ({weight_bytes / medians['this tree'] / 1e6:.1f} GB/s)"
        if "baseline" in medians:
            row.append(f"{medians['this tree'] / medians['baseline']:.2f}")
        rows.append(tuple(row))
        results[case] = medians
    print(f"threads={args.threads}, median of {args.rounds} rounds")
    print_table(rows, ("case", *trees, *(("this / baseline",) if len(trees) > 1 else ())))
    write_json(args.json, {"threads": args.threads, "rounds": args.rounds, "results": results})


if __name__ == "__main__":
    main()
