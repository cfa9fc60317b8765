"""Resuming a long conversation after other work has evicted its KV blocks from the device: time to
first token (TTFT) of a short new message when the history is computed again, copied back from the
host tier, read from disk after a restart (engine/core/kv_tiers.py), and read from disk after a
restart when the conversation was reopened first (the app's LLM.prefetch while the user types); and
decode throughput on nano-vllm's workload with the host tier on and off.

    python -m benchmarks.bench_resume                                     # CPU: SmolLM2, the default GGUF
    python -m benchmarks.bench_resume --device cuda --model benchmarks/configs/qwen3-8b
    python -m benchmarks.bench_resume --device cuda --model benchmarks/configs/qwen3-8b --throughput \\
        --throughput-blocks 6000                                          # a pool the workload cycles through

Each mode has an engine of its own, all alive at once (with --history-sized pools), and the trials
alternate between them (the CPU may be shared). A trial: a new conversation of --history tokens is prefilled (its first reply,
one token), prompts of other work fill the pool until none of its blocks is left on the device,
then the conversation goes on with --message new tokens, and the clock runs from the request to
its first token. The disk mode's conversations are prefilled by one engine, which is shut down
(writing its cached blocks); a fresh engine, with empty device and host tiers, resumes them: a
restart, with the page cache as warm as the first engine left it. The reopened mode's engine (a
restart too) is asked to prefetch the conversation, as the app does when a chat is reopened, and
the request comes once that has ended (the user was typing); the prefetch's own time is reported
beside it. Whether the modes' tokens agree
is reported. On a GPU the host tier pins its memory a piece at a time while the engine is idle; each
engine here pins all of it before the trials, as a chat app open a while has. --warmup trials run
first, untimed.

A directory of a config.json without weights (benchmarks/configs/*) runs with random weights in
bfloat16. The throughput part runs nano-vllm's workload (bench_throughput's); --throughput-blocks
sizes the KV pool so that the workload cycles through it (with the default pool a GPU holds the
whole workload, and the host tier never sees a block).
"""
import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import environment, nano_vllm_workload, pin_host_tier, print_table, write_json

MODES = ("recompute", "host", "disk", "reopened")


def engine_options(args) -> dict:
    path = Path(args.model)
    options = dict(device=args.device, max_model_len=args.history + args.message + 64, max_num_seqs=8)
    if path.is_dir() and not any(path.glob("*.safetensors")):
        options.update(load_format="random", dtype="bfloat16")
    return options


def pool_blocks(args, block_size: int) -> int:
    """The conversation's blocks and a few more: the other work evicts it with a pool's worth."""
    return -(-(args.history + args.message + 64) // block_size) + 16


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch  # start-up: torch loads with the engine, after the flags are read
        torch.cuda.synchronize()


def first_token(llm, prompt: list[int], new_tokens: int, device: str) -> tuple[float, list[int], int]:
    """(seconds to the first token, the tokens, prompt tokens found cached) of one request, alone."""
    from engine import SamplingParams  # start-up: as sync's
    sync(device)
    start = time.perf_counter()
    seq = llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    while seq.num_completion_tokens == 0:
        llm.step()
    # With async scheduling the step that samples the first token has only been queued: the token
    # is there once the device has run it.
    sync(device)
    elapsed = time.perf_counter() - start
    while not seq.is_finished:
        llm.step()
    return elapsed, seq.completion_token_ids, seq.num_cached_tokens


def evict(llm, history: list[int], rng: random.Random, vocab: int) -> None:
    """Runs other prompts until no block of the history is left on the device."""
    from engine import SamplingParams  # start-up: as sync's
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    length = llm.config.max_model_len // 2
    while llm.blocks.lookup_prefix(llm.make_sequence(history)):
        llm.generate([[rng.randrange(vocab) for _ in range(length)]], one)


def resume_ttft(args) -> dict:
    from engine import LLM, EngineOptions, SamplingParams  # start-up: as sync's
    from engine.config import EngineConfig  # start-up: as sync's

    rng = random.Random(0)
    options = engine_options(args)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    disk_dir = Path(tempfile.mkdtemp(prefix="nvchat-bench-kv-"))
    try:
        config = EngineConfig.create(args.model, EngineOptions(**options))  # the checkpoint's config, no weights
        vocab = min(config.hf_config.vocab_size, 32000)
        blocks = pool_blocks(args, config.kvcache_block_size)
        options["num_kvcache_blocks"] = blocks
        runs = args.warmup + args.trials
        histories = [[rng.randrange(100, vocab) for _ in range(args.history)] for _ in range(runs)]
        messages = [[rng.randrange(100, vocab) for _ in range(args.message)] for _ in range(runs)]

        # The disk mode's first engine: prefills every conversation, then shuts down (writing them).
        replies = []
        with LLM(args.model, host_cache_gib=0, disk_cache_dir=str(disk_dir), **options) as writer:
            for history in histories:
                replies.append(writer.generate([history], one)[0]["token_ids"])
                # As between a chat's turns: the engine idles long enough to write what it computed.
                writer.flush_disk_cache()
        engines = {
            "recompute": LLM(args.model, host_cache_gib=0, **options),
            "host": LLM(args.model, host_cache_gib=args.host_gib, **options),
            "disk": LLM(args.model, host_cache_gib=0, disk_cache_dir=str(disk_dir), **options),
            "reopened": LLM(args.model, host_cache_gib=0, disk_cache_dir=str(disk_dir), **options),
        }
        results = {mode: [] for mode in MODES}
        try:
            for llm in engines.values():
                pin_host_tier(llm)
            for trial, (history, message) in enumerate(zip(histories, messages)):
                for mode in MODES:  # alternated, trial by trial
                    llm = engines[mode]
                    if mode in ("recompute", "host"):  # the others' were prefilled before their restart
                        assert llm.generate([history], one)[0]["token_ids"] == replies[trial]
                    evict(llm, history, rng, vocab)
                    # As while the user types the next message: the engine idles, writing what the other
                    # work computed (only the disk mode writes). Writes still under way would hold the host
                    # slots the resumed prompt's reads land in, and its first token would wait for them.
                    llm.flush_disk_cache()
                    prefetch_s = None
                    if mode == "reopened":  # the chat is reopened; the user types while its blocks come back
                        sync(args.device)
                        start = time.perf_counter()
                        llm.prefetch(history + replies[trial])
                        while llm.has_unfinished():
                            llm.step()
                        sync(args.device)
                        prefetch_s = time.perf_counter() - start
                    before = llm.stats()
                    ttft, tokens, cached = first_token(llm, history + replies[trial] + message, args.new_tokens,
                                                       args.device)
                    after = llm.stats()
                    if trial < args.warmup:
                        print(f"warm-up {mode:9s} TTFT {ttft * 1e3:8.1f} ms  cached {cached}", flush=True)
                        continue
                    results[mode].append(dict(ttft_s=ttft, tokens=tokens, cached=cached, prefetch_s=prefetch_s,
                                              host_hits=after.host_hit_tokens - before.host_hit_tokens,
                                              disk_hits=after.disk_hit_tokens - before.disk_hit_tokens))
                    reopen = f"  (prefetched in {prefetch_s * 1e3:.1f} ms)" if prefetch_s is not None else ""
                    print(f"trial {trial} {mode:9s} TTFT {ttft * 1e3:8.1f} ms  cached {cached}{reopen}", flush=True)
        finally:
            for llm in engines.values():
                llm.shutdown()
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    # Restored blocks hold the bytes computed at first; a recomputed prefix runs as one prefill
    # instead, whose rounding may differ (as with any prefix-cache hit).
    agree = all(len({tuple(results[mode][t]["tokens"]) for mode in MODES}) == 1 for t in range(args.trials))
    print(f"the modes' tokens agree: {'yes' if agree else 'no'}")
    summary = {mode: statistics.median(r["ttft_s"] for r in runs) for mode, runs in results.items()}
    return {"pool_blocks": blocks, "trials": results, "median_ttft_s": summary, "tokens_agree": agree,
            "host_over_recompute": summary["host"] / summary["recompute"],
            "disk_over_recompute": summary["disk"] / summary["recompute"],
            "reopened_over_recompute": summary["reopened"] / summary["recompute"],
            "median_prefetch_s": statistics.median(r["prefetch_s"] for r in results["reopened"])}


def throughput(args) -> dict:
    from engine import LLM, SamplingParams  # start-up: as sync's

    prompts, max_tokens = nano_vllm_workload(args.throughput_seqs)
    scale = args.throughput_scale
    prompts = [p[:max(1, int(len(p) * scale))] for p in prompts]
    max_tokens = [max(1, int(n * scale)) for n in max_tokens]
    options = engine_options(args)
    options.update(max_model_len=2048, max_num_seqs=args.throughput_max_num_seqs)
    if args.throughput_blocks:
        options["num_kvcache_blocks"] = args.throughput_blocks
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in max_tokens]
    host_gib = {"tiers off": 0, "host tier": args.host_gib}
    rates = {name: [] for name in host_gib}
    for _ in range(args.throughput_rounds):
        for name, gib in host_gib.items():  # alternated, round by round
            # One engine at a time: on a GPU each sizes its pool to the memory it finds free.
            with LLM(args.model, host_cache_gib=gib, **options) as llm:
                llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
                sync(args.device)
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                sync(args.device)
                rate = sum(len(o["token_ids"]) for o in outs) / (time.perf_counter() - start)
                stats = llm.stats()
            rates[name].append(rate)
            print(f"{name:9s} {rate:10,.1f} tok/s  pool {stats.num_blocks} blocks  host blocks {stats.host_blocks}  "
                  f"preemptions {stats.num_preemptions}", flush=True)
    pool = stats.num_blocks
    medians = {name: statistics.median(r) for name, r in rates.items()}
    return {"seqs": len(prompts), "output_tokens": sum(max_tokens), "pool_blocks": pool, "tok_per_s": rates,
            "median_tok_per_s": medians, "on_over_off": medians["host tier"] / medians["tiers off"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2's GGUF on CPU, benchmarks/configs/qwen3-8b on CUDA")
    p.add_argument("--device", default="cpu")
    p.add_argument("--history", type=int, default=4096, help="tokens of conversation before the new message")
    p.add_argument("--message", type=int, default=50, help="tokens of the new message")
    p.add_argument("--new-tokens", type=int, default=4, help="tokens generated per resume, compared across modes")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed trials first")
    p.add_argument("--host-gib", type=float, default=4.0, help="the host tier's size in the host modes")
    p.add_argument("--throughput", action="store_true", help="also decode throughput, host tier on and off")
    p.add_argument("--throughput-seqs", type=int, default=256)
    p.add_argument("--throughput-scale", type=float, default=1.0, help="scales the workload's prompt and output lengths")
    p.add_argument("--throughput-max-num-seqs", type=int, default=512)
    p.add_argument("--throughput-blocks", type=int, default=None, help="KV pool size for the throughput runs")
    p.add_argument("--throughput-rounds", type=int, default=2)
    p.add_argument("--skip-resume", action="store_true")
    p.add_argument("--out", default="benchmarks/out/resume.json")
    args = p.parse_args()
    if args.model is None:
        if args.device == "cpu":
            from nvchat import default_model  # start-up: only without --model on CPU
            args.model = str(default_model.bundled_gguf())
        else:
            args.model = str(Path(__file__).parent / "configs" / "qwen3-8b")

    payload = {"model": args.model, "device": args.device, "history": args.history, "message": args.message}
    if not args.skip_resume:
        resume = resume_ttft(args)
        payload["resume"] = resume
        ttft = resume["median_ttft_s"]
        print_table([(mode, f"{ttft[mode] * 1e3:,.1f}", f"{ttft[mode] / ttft['recompute']:.1%}") for mode in MODES],
                    ("history from", "median TTFT ms", "of recompute"))
        print(f"reopened: the prefetch took {resume['median_prefetch_s'] * 1e3:,.1f} ms (median) before its message")
    if args.throughput:
        result = throughput(args)
        payload["throughput"] = result
        print_table([(name, f"{rate:,.1f}") for name, rate in result["median_tok_per_s"].items()],
                    ("engine", "median tok/s"))
        print(f"host tier on / off: {result['on_over_off']:.3f}")
    write_json(args.out, payload)
    print({k: v for k, v in environment().items() if k != "command"})


if __name__ == "__main__":
    main()
