"""`nvchat serve` against the in-process engine: N concurrent streaming requests, same workload.

Phase 1 reads N streams straight from one EngineThread (asyncio tasks on the main thread, as the
server reads them). Phase 2 serves the same engine over HTTP (the server's FastAPI app on uvicorn,
an event-loop thread beside the engine thread, as in `nvchat serve`) and drives N streaming
clients from separate processes (so their parsing does not compete with the server for its GIL).
Each phase gets fresh random prompts of the same lengths, so neither finds the other's prompts
in the prefix cache. Replies have a fixed length (ignore_eos).

Reports output tok/s (all completion tokens over the wall time from the first request to the last
token), TTFT and inter-chunk latency percentiles, the server's share of the in-process rate, and
its event-loop thread's CPU per streamed chunk (time the engine thread may wait for the GIL).

  GPU:  python -m benchmarks.bench_serve --streams 64
  CPU:  python -m benchmarks.bench_serve --config demo --device cpu --streams 8 --prompt-len 64 --max-tokens 32

Imports only the engine, the server's app, uvicorn and httpx (no textual, no prompt_toolkit); uvicorn
uses httptools and uvloop where they are installed (--http/--loop choose), and says which it ran.
"""
import argparse
import asyncio
import importlib.util
import json
import multiprocessing as mp
import random
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from engine import SamplingParams  # the torch-free core: cheap for the client processes

SERVED_NAME = "bench"


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(results: list[dict]) -> dict:
    """results: per request {"start", "arrivals" (content chunk times), "tokens"}; times on the
    system-wide monotonic clock, so processes' results combine."""
    start = min(r["start"] for r in results)
    end = max(r["arrivals"][-1] for r in results if r["arrivals"])
    tokens = sum(r["tokens"] for r in results)
    ttft = [(r["arrivals"][0] - r["start"]) * 1e3 for r in results if r["arrivals"]]
    itl = [(b - a) * 1e3 for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    return {"requests": len(results), "tokens": tokens, "wall_s": end - start, "tok_per_s": tokens / (end - start),
            "ttft_ms": {"p50": percentile(ttft, .5), "p90": percentile(ttft, .9), "p99": percentile(ttft, .99)},
            "itl_ms": {"p50": percentile(itl, .5), "p90": percentile(itl, .9), "p99": percentile(itl, .99),
                       "mean": statistics.fmean(itl) if itl else float("nan")},
            "chunks": sum(len(r["arrivals"]) for r in results)}


def with_word_tokenizer(config_dir: str, vocab_size: int) -> str:
    """A copy of a random-weight shape's config with a tokenizer of vocab_size one-word tokens, so
    the server has text to stream (the shapes ship no tokenizer and nothing can be downloaded on
    the GPU machines). Every token decodes to a short word: text events as many as tokens."""
    # start-up: only the random-weight shapes need a tokenizer built
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0")
    tokenizer = Tokenizer(words)
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    out = tempfile.mkdtemp(prefix="bench-serve-")
    shutil.copy(f"{config_dir}/config.json", out)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(out)
    return out


def workload(num: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(num)]


# --- phase 1: the engine in-process ------------------------------------------------------------------

def run_in_process(engine, prompts, max_tokens: int) -> list[dict]:
    params = SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True)

    async def one(prompt):
        start = time.monotonic()
        stream = engine.submit(prompt, params)
        arrivals = []
        async for delta in stream:
            more = stream.drain()  # as the server does: what queued up goes out as one piece
            if delta.token_ids or (more and more.token_ids):
                arrivals.append(time.monotonic())
        return {"start": start, "arrivals": arrivals, "tokens": stream.num_completion_tokens}

    async def everyone():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(everyone())


# --- phase 2: over HTTP ----------------------------------------------------------------------------

async def _client(http: httpx.AsyncClient, prompt, max_tokens: int) -> dict:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    arrivals, tokens = [], 0
    async with http.stream("POST", "/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event["choices"] and event["choices"][0]["text"]:
                arrivals.append(time.monotonic())
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"start": start, "arrivals": arrivals, "tokens": tokens}


def client_process(url: str, prompts, max_tokens: int, start_line, results) -> None:
    """One client process: its share of the streams, all opened once every process is at the start
    line. A first request beforehand loads what httpx imports lazily, which would count as TTFT."""
    async def run():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as http:
            (await http.get("/models")).raise_for_status()
            await asyncio.to_thread(start_line.wait)
            return await asyncio.gather(*(_client(http, p, max_tokens) for p in prompts))

    try:
        results.put(("ok", asyncio.run(run())))
    except Exception as e:
        results.put(("error", f"{type(e).__name__}: {e}"))


def run_over_http(engine, prompts, max_tokens: int, client_procs: int, stack: dict,
                  server_cpu: list[float]) -> list[dict]:
    """The clients' results; appends the server thread's CPU seconds (its event loop: HTTP, SSE,
    the routes) to server_cpu once it has stopped."""
    # start-up: the client processes import this module and need none of the server
    import uvicorn

    from benchmarks import (
        bench_serve,  # the client processes find client_process by this name
    )
    from nvchat.server.app import ServerState, create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    server = uvicorn.Server(uvicorn.Config(create_app(ServerState(SERVED_NAME, engine)), log_level="warning",
                                           access_log=False, **stack))
    def serve():
        start = time.thread_time()
        try:
            server.run(sockets=[sock])
        finally:
            server_cpu.append(time.thread_time() - start)

    thread = threading.Thread(target=serve, name="bench-server", daemon=True)
    thread.start()
    ctx = mp.get_context("spawn")
    shares = [share for share in (prompts[i::client_procs] for i in range(client_procs)) if share]
    start_line, results = ctx.Barrier(len(shares) + 1, timeout=600), ctx.Queue()
    procs = [ctx.Process(target=bench_serve.client_process, args=(url, share, max_tokens, start_line, results),
                         daemon=True) for share in shares]
    try:
        for p in procs:
            p.start()
        warm = httpx.post(url + "/completions", json={"model": SERVED_NAME, "prompt": prompts[0][:8],
                                                      "max_tokens": 2}, timeout=600)
        warm.raise_for_status()
        start_line.wait()
        combined = []
        for _ in procs:
            status, payload = results.get()
            if status != "ok":
                raise RuntimeError(f"a client process failed: {payload}")
            combined += payload
        return combined
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(30)
        server.should_exit = True
        thread.join(30)
        sock.close()


def main():
    # start-up: as run_server, the client processes import this module and need none of it
    from benchmarks.common import CONFIGS, print_table, write_json
    from engine import EngineThread

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(CONFIGS / "qwen3-0.6b"), help="config dir (random weights), or 'demo'")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--client-procs", type=int, default=4, help="processes the HTTP clients are spread over")
    p.add_argument("--switch-interval", type=float, default=0.0005,
                   help="sys.setswitchinterval for both phases (nvchat serve sets 0.0005)")
    p.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"], help="uvicorn's HTTP parser")
    p.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"], help="uvicorn's event loop")
    p.add_argument("--out", default="benchmarks/out/serve.json")
    args = p.parse_args()
    sys.setswitchinterval(args.switch_interval)
    # uvicorn's "auto" picks httptools and uvloop when installed; without them, h11 and asyncio.
    stack = {"http": args.http if args.http != "auto" else
             "httptools" if importlib.util.find_spec("httptools") else "h11",
             "loop": args.loop if args.loop != "auto" else
             "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"}

    if args.config == "demo":
        from engine.checkpoints.demo_model import (
            ensure_demo_model,  # start-up: as above
        )
        model, extra = str(ensure_demo_model()), {}
    else:
        vocab_size = json.loads((Path(args.config) / "config.json").read_text())["vocab_size"]
        model, extra = with_word_tokenizer(args.config, vocab_size), {"load_format": "random", "dtype": "bfloat16"}
    engine = EngineThread(model, device=args.device, max_model_len=args.prompt_len + args.max_tokens + 64,
                          max_num_seqs=max(args.streams, 1), **extra).start()
    try:
        vocab = min(engine.llm.config.hf_config.vocab_size, 10_000)
        engine.submit(workload(1, 32, vocab, 99)[0], SamplingParams(max_tokens=4)).wait()  # warm-up
        local = summarize(run_in_process(engine, workload(args.streams, args.prompt_len, vocab, 1), args.max_tokens))
        server_cpu = []
        served = summarize(run_over_http(engine, workload(args.streams, args.prompt_len, vocab, 2), args.max_tokens,
                                         max(1, min(args.client_procs, args.streams)), stack, server_cpu))
        served["server_cpu_us_per_chunk"] = server_cpu[0] / served["chunks"] * 1e6
    finally:
        engine.shutdown()

    share = served["tok_per_s"] / local["tok_per_s"]

    rows = [(name, r["requests"], r["tokens"], f"{r['tok_per_s']:.0f}", f"{r['ttft_ms']['p50']:.1f}",
             f"{r['ttft_ms']['p99']:.1f}", f"{r['itl_ms']['p50']:.2f}", f"{r['itl_ms']['p99']:.2f}")
            for name, r in (("in-process", local), ("nvchat serve", served))]
    print(f"{args.streams} streams, {args.prompt_len}-token prompts, {args.max_tokens} tokens each; "
          f"server on uvicorn with {stack['http']} and {stack['loop']}")
    print_table(rows, ("path", "requests", "tokens", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                       "ITL p99 ms"))
    print(f"server keeps {share:.1%} of in-process throughput; its event-loop thread spent "
          f"{served['server_cpu_us_per_chunk']:.1f} µs of CPU per streamed chunk")
    write_json(args.out, {"streams": args.streams, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                          "client_procs": args.client_procs, "switch_interval": args.switch_interval, **stack,
                          "in_process": local, "served": served, "served_share": share})


if __name__ == "__main__":
    main()
