"""All-reduce time per call on decode-sized bf16 tensors: NCCL against the symmetric-memory one-shot
and two-shot kernels (engine/distributed/symm_allreduce.py), "auto", the one TPGroup.all_reduce picks, and
"fused", the all-reduce with the residual add and RMSNorm after it in one kernel (kernels/allreduce_rmsnorm.py,
which the decode step uses where it takes the tensor). Each is timed inside a CUDA graph of back-to-back
calls, as the decode graphs run them.

    python -m benchmarks.bench_allreduce --gpus 2 4 --out benchmarks/out/allreduce.json

One process per GPU (GPUs 0..N-1), spawned here, over the engine's own collectives.create_group. A
time is the slowest rank's; a blank cell is a kernel that does not take that size.
"""
import argparse
import multiprocessing
import queue
import sys
import traceback
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `engine` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.common import graph_replay_ms, print_table, write_json
from engine.distributed import collectives

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COLS = (1024, 2048, 5120, 8192)  # 2048: Qwen3-30B-A3B
_HOST = "127.0.0.1"
_TIMEOUT = timedelta(minutes=5)
_KERNELS = ("nccl", "one_shot", "two_shot", "auto", "fused")


def _barrier(group, device) -> None:
    group.backend_all_reduce(torch.zeros(1, device=device))
    torch.cuda.synchronize(device)


def _time_us(group, reduce, x, calls: int, replays: int) -> float:
    """Microseconds per all-reduce: a graph of `calls` of them, replayed `replays` times."""
    device = x.device
    reduce(x)  # warm-up: lazy set-up stays out of the graph
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            reduce(x)  # x holds zeros, so NCCL's in-place sums stay zero
    _barrier(group, device)
    us = torch.tensor([graph_replay_ms(graph, replays) * 1e3 / calls], dtype=torch.float64, device=device)
    del graph
    return group.backend_all_reduce(us, dist.ReduceOp.MAX).item()


def _fused(fast, residual, weight):
    """The fused all-reduce as the decode step calls it: consecutive call sites alternate slots."""
    calls = 0

    def reduce(x):
        nonlocal calls
        calls += 1
        return fast.all_reduce_rms_norm(x, residual, weight, 1e-6, calls % 2)
    return reduce


def _auto_path(group, x) -> str:
    fast = group.fast
    if fast is None or not fast.accepts(x):
        return "nccl"
    return "one_shot" if x.numel() * x.element_size() <= fast.one_shot_max else "two_shot"


def _rank_main(rank: int, size: int, port: int, args, results) -> None:
    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=_TIMEOUT)
        group = collectives.create_group(rank, size, store, device, _TIMEOUT)
        fast = group.fast
        dtype = getattr(torch, args.dtype)
        rows = []
        for r in ROWS:
            for c in COLS:
                x = torch.zeros(r, c, dtype=dtype, device=device)
                kernels = {"nccl": group.backend_all_reduce, "auto": group.all_reduce}
                if fast is not None and fast.accepts(x):
                    kernels["one_shot"] = fast.one_shot
                    if fast.max_bytes > fast.one_shot_max:
                        kernels["two_shot"] = fast.two_shot
                residual, weight = torch.zeros_like(x), torch.ones(c, dtype=dtype, device=device)
                if fast is not None and fast.fuses(x, residual):
                    kernels["fused"] = _fused(fast, residual, weight)
                row = {"rows": r, "cols": c, "bytes": x.numel() * x.element_size(), "auto_path": _auto_path(group, x)}
                for name, reduce in kernels.items():
                    row[f"{name}_us"] = _time_us(group, reduce, x, args.calls, args.replays)
                rows.append(row)
                torch.cuda.empty_cache()
        _barrier(group, device)  # every rank's kernels done before any rank releases its flags
        group.destroy()
        if rank == 0:
            results.put({"fast_all_reduce": fast is not None, "rows": rows})
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
        raise


def run(size: int, args) -> dict:
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(rank, size, store.port, args, results)) for rank in range(size)]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=_TIMEOUT.total_seconds())
    except queue.Empty:
        out = {"error": f"no result within {_TIMEOUT}"}
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    if "error" in out:
        raise RuntimeError(f"{size} GPUs, rank {out.get('rank', '?')}:\n{out['error']}")
    return out


def _cell(row: dict, name: str) -> str:
    us = row.get(f"{name}_us")
    return "" if us is None else f"{us:.1f}"


def print_result(size: int, result: dict, dtype: str) -> None:
    print(f"\n{size} GPUs, {dtype}, us per all-reduce (slowest rank); symmetric memory "
          f"{'on' if result['fast_all_reduce'] else 'OFF: only NCCL ran'}")
    table = []
    for row in result["rows"]:
        speedup = row["nccl_us"] / row["auto_us"] if row["auto_us"] else float("nan")
        table.append((f"{row['rows']}x{row['cols']}", f"{row['bytes'] / 1024:.0f}",
                      *(_cell(row, k) for k in _KERNELS), row["auto_path"], f"{speedup:.2f}x"))
    print_table(table, ("shape", "KiB", "nccl", "one-shot", "two-shot", "auto", "fused", "auto path", "nccl/auto"))
    decode = next((r for r in result["rows"] if (r["rows"], r["cols"]) == (1, 5120)), None)
    if decode:
        print(f"batch-1 decode of a 64-layer, 5120-wide model (129 all-reduces per token): "
              f"NCCL {129 * decode['nccl_us'] / 1e3:.2f} ms, auto {129 * decode['auto_us'] / 1e3:.2f} ms per token")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[2], help="group sizes to run, in order")
    p.add_argument("--calls", type=int, default=100, help="all-reduces per captured graph")
    p.add_argument("--replays", type=int, default=20, help="graph replays timed per size and kernel")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out", default="benchmarks/out/allreduce.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_allreduce needs CUDA devices")
    results = {}
    for size in args.gpus:
        if size > torch.cuda.device_count():
            print(f"skipping {size} GPUs: {torch.cuda.device_count()} visible", file=sys.stderr)
            continue
        results[size] = run(size, args)
        print_result(size, results[size], args.dtype)
        write_json(args.out, {"dtype": args.dtype, "calls": args.calls, "replays": args.replays,
                              "results": {str(k): v for k, v in results.items()}})


if __name__ == "__main__":
    main()
