"""The few-row linear layers of a decode step: kernels/skinny_linear.py (norm, matmul and SiLU-mul
in one kernel) against what it replaces (the fused RMSNorm kernel, cuBLAS, the SiLU-mul kernel),
for the Qwen3 projection shapes, timed inside CUDA graphs (GPU time, no launch cost). With
--sweep it also tries a grid of tile configs and prints the best per shape and row count."""
import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import CONFIGS, COPY_BANDWIDTH, print_table, write_json

SUM_CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, USE_DOT=False, num_warps=w, num_stages=3)
               for n, k, w in [(4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 128, 4), (8, 256, 8)]]
DOT_CONFIGS = [dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, USE_DOT=True, num_warps=4, num_stages=3)
               for n, k in [(16, 128), (32, 128), (32, 256), (64, 128), (16, 256)]]


def graph_us(fn, calls: int = 20, replays: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def shapes(config_dir: Path):
    c = json.loads((config_dir / "config.json").read_text())
    h, inter = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    # (name, out features, in features, norm in front, gated)
    return [("qkv", q + 2 * kv, h, True, False), ("o", h, q, False, False),
            ("gate_up", inter, h, True, True), ("down", h, inter, False, False)]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--configs", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", default="benchmarks/out/skinny.json")
    args = p.parse_args()
    from kernels.rmsnorm import rms_norm
    from kernels.silu_mul import silu_and_mul
    from kernels.skinny_linear import default_config, skinny_linear

    dev, dt = "cuda", torch.bfloat16
    rows_out, results = [], []
    for name in args.configs:
        for proj, out_f, in_f, norm, gated in shapes(CONFIGS / name):
            w = torch.randn(out_f * (2 if gated else 1), in_f, device=dev, dtype=dt) / in_f ** 0.5
            nw = torch.ones(in_f, device=dev, dtype=dt) if norm else None
            weight_bytes = w.numel() * 2
            for rows in args.rows:
                x = torch.randn(rows, in_f, device=dev, dtype=dt)
                res = torch.randn(rows, in_f, device=dev, dtype=dt) if norm else None

                def unfused():
                    a = rms_norm(x, nw, 1e-6, res)[0] if norm else x
                    y = F.linear(a, w)
                    return silu_and_mul(y) if gated else y

                def fused(cfg=None):
                    return skinny_linear(x, w, norm_weight=nw, residual=res, gated=gated, config=cfg)

                base = graph_us(unfused)
                ours = graph_us(fused)
                entry = {"model": name, "proj": proj, "rows": rows, "out": out_f, "in": in_f,
                         "unfused_us": base, "skinny_us": ours, "default": default_config(rows, out_f, in_f, True)}
                if args.sweep:
                    tried = []
                    for cfg in SUM_CONFIGS if rows <= 4 else []:
                        tried.append((graph_us(lambda: fused({**cfg, "BLOCK_M": rows})), {**cfg, "BLOCK_M": rows}))
                    for cfg in DOT_CONFIGS:
                        tried.append((graph_us(lambda: fused(cfg)), cfg))
                    best_us, best = min(tried, key=lambda t: t[0])
                    entry.update(best_us=best_us, best=best, tried=[(us, c) for us, c in tried])
                results.append(entry)
                bw = weight_bytes / (ours * 1e-6) / COPY_BANDWIDTH
                row = (name, proj, rows, f"{base:.2f}", f"{ours:.2f}", f"{bw:.0%}")
                if args.sweep:
                    row += (f"{entry['best_us']:.2f}", " ".join(f"{k}={v}" for k, v in entry["best"].items()
                                                                 if k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "USE_DOT", "num_warps")))
                rows_out.append(row)
    header = ("model", "proj", "rows", "cuBLAS+kernels us", "skinny us", "of copy BW")
    if args.sweep:
        header += ("best us", "best config")
    print_table(rows_out, header)
    write_json(args.out, {"results": results})


if __name__ == "__main__":
    main()
