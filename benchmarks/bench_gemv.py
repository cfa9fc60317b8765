"""The Triton GEMV (kernels/gemv.py) against cuBLAS (F.linear) for the decode projections of Qwen3
shapes at batch 1 (with --rows, at chat-sized batches too), as the engine's decode graph runs them:
a CUDA graph of calls over enough distinct weight copies (>= 400 MB) that the weights stream from
HBM, not the 50 MB L2; median µs per call (bench_kernels.time_graph).

    python -m benchmarks.bench_gemv [--rows 1 2 4 8] [--sweep] [--rows-sweep 2 4 8] [--out FILE]
    python -m benchmarks.bench_gemv --fused [--rows 1 2 4 8] [--fused-sweep] [--out FILE]

--sweep also times the 0.6B shapes at one row over launch configs (rows per program, K tile,
warps, stages), and --rows-sweep at several rows over both row kernels' configs: that is how
kernels.gemv.launch_config was chosen. Needs CUDA.

--fused times, instead, a decode step's projections over Qwen3-0.6B's 28 layers (840 MB of
weights, so they stream from HBM) in one CUDA graph: unfused (RMSNorm kernel + qkv GEMV, o GEMV,
RMSNorm + gate_up GEMV + SiLU-mul kernel, down GEMV) against fused (kernels.gemv.rms_norm_gemv
for qkv and for gate_up with SiLU-mul), each with programmatic dependent launch on and off
(kernels/pdl.py); µs per layer. --fused-sweep adds the fused qkv and gate_up kernels alone over
launch configs. Without CUDA (TRITON_INTERPRET=1) --fused runs a 2-layer toy model once as a
smoke test and times nothing.
"""
import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F

from benchmarks.bench_kernels import time_graph
from kernels import pdl
from kernels.gemv import gemv, launch_config, rms_norm_gemv
from kernels.rmsnorm import rms_norm
from kernels.silu_mul import silu_and_mul

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
    for bn, bk, warps, stages in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4)):
        yield "dot", bn, bk, warps, stages
    for bn, bk, warps, stages in itertools.product((1, 2, 4), (512, 1024), (4, 8), (3,)):
        if rows * bn * bk // (32 * warps) <= 64:
            yield "fma", bn, bk, warps, stages


class Layer:
    """One decoder layer's projections and norms (attention left out: q stands in for its output)."""

    def __init__(self, hidden: int, qkv: int, q: int, inter: int, device: str, dtype: torch.dtype):
        def w(n, k):
            return torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5

        def norm():
            return (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)

        self.q = q
        self.n1, self.qkv, self.o, self.n2 = norm(), w(qkv, hidden), w(hidden, q), norm()
        self.gate_up, self.down = w(2 * inter, hidden), w(hidden, inter)

    def unfused(self, x, residual):
        h, residual = rms_norm(x, self.n1, 1e-6, residual)
        x = gemv(gemv(h, self.qkv)[:, :self.q], self.o)
        h, residual = rms_norm(x, self.n2, 1e-6, residual)
        return gemv(silu_and_mul(gemv(h, self.gate_up)), self.down), residual

    def silu_fused(self, x, residual):
        """The norms as their own kernels, SiLU-mul in the gate_up GEMV's epilogue."""
        h, residual = rms_norm(x, self.n1, 1e-6, residual)
        x = gemv(gemv(h, self.qkv)[:, :self.q], self.o)
        h, residual = rms_norm(x, self.n2, 1e-6, residual)
        return gemv(gemv(h, self.gate_up, silu=True), self.down), residual

    def fused(self, x, residual):
        qkv, residual = rms_norm_gemv(x, residual, self.n1, 1e-6, self.qkv)
        x = gemv(qkv[:, :self.q], self.o)
        h, residual = rms_norm_gemv(x, residual, self.n2, 1e-6, self.gate_up, silu=True)
        return gemv(h, self.down), residual


def fused_chains(rows_list: list[int], sweep: bool) -> list[dict]:
    cuda = torch.cuda.is_available()
    hidden, qkv, q, inter, layers = (1024, 4096, 2048, 3072, 28) if cuda else (64, 128, 64, 96, 2)
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = [Layer(hidden, qkv, q, inter, device, dtype) for _ in range(layers)]
    results = []
    print(f"{'rows':>4s} {'chain':8s} {'PDL':>3s} {'us/layer':>9s}")
    for m in rows_list:
        x0 = torch.randn(m, hidden, device=device, dtype=dtype)
        r0 = torch.randn(m, hidden, device=device, dtype=dtype)
        # The two chains agree on one layer (28 random layers drift apart in bf16).
        want = model[0].unfused(x0, r0)
        for got in (model[0].fused(x0, r0), model[0].silu_fused(x0, r0)):
            for a, b in zip(want, got):
                torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)
        for chain, pdl_on in itertools.product(("unfused", "silu_fused", "fused"), ("1", "0")):
            os.environ["NVCHAT_PDL"] = pdl_on

            def step():
                x, residual = x0, r0
                for layer in model:
                    x, residual = getattr(layer, chain)(x, residual)
                return x

            if cuda:
                us = round(time_graph(step, layers) * 1000, 2)
            else:
                step()
                us = None
            results.append({"rows": m, "chain": chain, "pdl": pdl_on == "1", "us_per_layer": us})
            print(f"{m:4d} {chain:10s} {'on' if pdl_on == '1' else 'off':>3s} {us if us is not None else '-':>9}",
                  flush=True)
    os.environ.pop("NVCHAT_PDL", None)
    if sweep and cuda:
        results += fused_sweep(model, rows_list, hidden)
    return results


def fused_sweep(model: list[Layer], rows_list: list[int], hidden: int) -> list[dict]:
    """The fused qkv and gate_up kernels alone, over launch configs, weights of all 28 layers rotated."""
    out = []
    for m in rows_list:
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        for name, silu in (("qkv", False), ("gate_up", True)):
            kernels = ("one",) if m == 1 else ("fma", "dot")
            configs = [(kern, bn, bk, warps, stages)
                       for kern in kernels
                       for bn in ((16, 32) if kern == "dot" else (1, 2, 4))
                       for bk in (256, 512, 1024) for warps in (2, 4, 8) for stages in (2, 3)
                       if kern != "fma" or m * bn * bk // (32 * warps) <= 128]
            timed = []
            for kern, bn, bk, warps, stages in configs:
                launch = dict(kernel=kern, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
                try:
                    us = time_graph(lambda: [rms_norm_gemv(x, r, layer.n1, 1e-6, getattr(layer, name), silu=silu,
                                                           **launch) for layer in model], len(model)) * 1000
                except Exception as e:  # noqa: BLE001 (a sweep: report and go on)
                    print(f"  {launch} failed: {str(e)[:100]}", flush=True)
                    continue
                timed.append((round(us, 2), (kern, bn, bk, warps, stages)))
            timed.sort()
            default = launch_config(getattr(model[0], name).shape[0], hidden, m, silu,
                                    whole_band=pdl.supported(torch.device("cuda")))
            out.append({"rows": m, "proj": name, "default": default, "best": timed[:8]})
            print(f"fused sweep rows {m} {name:8s} default {default}; best {timed[:4]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="default: 1; with --fused 1 2 4 8")
    parser.add_argument("--rows-sweep", type=int, nargs="*", default=[])
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--fused-sweep", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.fused or args.fused_sweep:
        results = fused_chains(args.rows or [1, 2, 4, 8], args.fused_sweep)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"fused": results}, f, indent=1)
        return
    rows = []
    print(f"{'model':5s} {'rows':>4s} {'proj':8s} {'MB':>6s}  {'cuBLAS us':>9s} {'TB/s':>5s}  {'gemv us':>8s} {'TB/s':>5s}  launch")
    for m in args.rows or [1]:
        for model, shapes in SHAPES.items():
            total = [0.0, 0.0]
            for name, (n, k) in shapes.items():
                weights = weight_copies(n, k)
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                cublas, ours = compare(x, weights)
                mb = n * k * 2 / 1e6
                total[0] += cublas
                total[1] += ours
                launch = launch_config(n, k, m, whole_band=pdl.supported(torch.device("cuda")))
                rows.append({"model": model, "rows": m, "proj": name, "N": n, "K": k, "cublas_us": cublas,
                             "gemv_us": ours, "launch": launch})
                print(f"{model:5s} {m:4d} {name:8s} {mb:6.1f}  {cublas:9.2f} {mb / cublas:5.2f}  {ours:8.2f} "
                      f"{mb / ours:5.2f}  {launch}", flush=True)
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
