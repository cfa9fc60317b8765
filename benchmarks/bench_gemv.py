"""The Triton GEMV (kernels/gemv.py) against cuBLAS (F.linear) for the decode projections of Qwen3
shapes at batch 1 (with --rows, at chat-sized batches too), as the engine's decode graph runs them:
a CUDA graph of calls over enough distinct weight copies (>= 400 MB) that the weights stream from
HBM, not the 50 MB L2; median µs per call (bench_kernels.time_graph).

    python -m benchmarks.bench_gemv [--rows 1 2 4 8] [--sweep] [--rows-sweep 2 4 8] [--out FILE]

--sweep also times the 0.6B shapes at one row over launch configs (rows per program, K tile,
warps, stages), and --rows-sweep at several rows over both row kernels' configs: that is how
kernels.gemv.launch_config was chosen. Needs CUDA.
"""
import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from benchmarks.bench_kernels import time_graph
from kernels.gemv import gemv, launch_config

# (N, K) of each projection, one tensor-parallel rank.
SHAPES = {
    "0.6B": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "1.7B": {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)},
    "4B": {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
    "8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
}


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    copies = max(2, int(400e6 // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]


def compare(x: torch.Tensor, weights: list[torch.Tensor], **launch) -> tuple[float, float]:
    """(cuBLAS µs, GEMV µs) per call, after checking the GEMV against a float32 product."""
    want = F.linear(x.float(), weights[0].float())
    torch.testing.assert_close(gemv(x, weights[0], **launch).float(), want, rtol=2e-2, atol=2e-2)
    cublas = time_graph(lambda: [F.linear(x, w) for w in weights], len(weights)) * 1000
    ours = time_graph(lambda: [gemv(x, w, **launch) for w in weights], len(weights)) * 1000
    return cublas, ours


def rows_configs(m: int):
    rows = max(2, 1 << (m - 1).bit_length())
    for bn, bk, warps, stages in itertools.product((16, 32), (128, 256, 512), (4,), (3, 4)):
        yield "dot", bn, bk, warps, stages
    for bn, bk, warps, stages in itertools.product((1, 2, 4), (512, 1024), (4, 8), (3,)):
        if rows * bn * bk // (32 * warps) <= 64:
            yield "fma", bn, bk, warps, stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--rows-sweep", type=int, nargs="*", default=[])
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"{'model':5s} {'rows':>4s} {'proj':8s} {'MB':>6s}  {'cuBLAS us':>9s} {'TB/s':>5s}  {'gemv us':>8s} {'TB/s':>5s}  launch")
    for m in args.rows:
        for model, shapes in SHAPES.items():
            total = [0.0, 0.0]
            for name, (n, k) in shapes.items():
                weights = weight_copies(n, k)
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                cublas, ours = compare(x, weights)
                mb = n * k * 2 / 1e6
                total[0] += cublas
                total[1] += ours
                rows.append({"model": model, "rows": m, "proj": name, "N": n, "K": k, "cublas_us": cublas,
                             "gemv_us": ours, "launch": launch_config(n, k, m)})
                print(f"{model:5s} {m:4d} {name:8s} {mb:6.1f}  {cublas:9.2f} {mb / cublas:5.2f}  {ours:8.2f} "
                      f"{mb / ours:5.2f}  {launch_config(n, k, m)}", flush=True)
                del weights
            print(f"{model:5s} {m} rows, per layer: cuBLAS {total[0]:.1f} us, gemv {total[1]:.1f} us", flush=True)
    sweep = []
    if args.sweep:
        configs = list(itertools.product((1, 2, 4, 8), (256, 512, 1024), (2, 4, 8), (1, 2, 3, 4)))
        for name, (n, k) in SHAPES["0.6B"].items():
            weights = weight_copies(n, k)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            timed = []
            for block_n, block_k, warps, stages in configs:
                launch = dict(kernel="one", block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)
                us = time_graph(lambda: [gemv(x, w, **launch) for w in weights], len(weights)) * 1000
                timed.append((us, (block_n, block_k, warps, stages)))
            timed.sort()
            sweep.append({"proj": name, "best": timed[:8]})
            print(f"sweep 0.6B {name:8s} best (us, (block_n, block_k, warps, stages)): {timed[:4]}", flush=True)
            del weights
    for name, (n, k) in SHAPES["0.6B"].items() if args.rows_sweep else []:
        weights = weight_copies(n, k)
        for m in args.rows_sweep:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x.float(), weights[0].float())
            cublas = time_graph(lambda: [F.linear(x, w) for w in weights], len(weights)) * 1000
            timed = []
            for cfg in rows_configs(m):
                kernel, bn, bk, warps, stages = cfg
                launch = dict(kernel=kernel, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
                try:
                    torch.testing.assert_close(gemv(x, weights[0], **launch).float(), want, rtol=2e-2, atol=2e-2)
                    us = time_graph(lambda: [gemv(x, w, **launch) for w in weights], len(weights)) * 1000
                except Exception as e:  # noqa: BLE001 (a sweep: report and go on)
                    print(f"  {cfg} failed: {str(e)[:100]}", flush=True)
                    continue
                timed.append((round(us, 2), cfg))
            timed.sort()
            best = {v: next((t for t in timed if t[1][0] == v), None) for v in ("dot", "fma")}
            sweep.append({"proj": name, "rows": m, "cublas_us": cublas, "best": timed[:10]})
            print(f"rows {m} {name:8s} cuBLAS {cublas:.2f} us; best dot {best['dot']}; best fma {best['fma']}; "
                  f"top {timed[:4]}", flush=True)
        del weights
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "sweep": sweep}, f, indent=1)


if __name__ == "__main__":
    main()
