"""The chat app's cost: 8 tabs streaming at once, with the app attached (run headless through
Textual's App.run_test) versus the same 8 requests on the bare EngineThread.

Reports the UI's frame times (the gap between the stream pump's ticks, and the time each tick
spends draining streams and rendering Markdown; p50 and p99) and the engine's output tokens/s
both ways. Every reply runs to --max-tokens (ignore_eos) so both runs do the same work.

    python -m benchmarks.bench_ui [--model PATH | --shape qwen3-0.6b] [--tabs 8] [--max-tokens 256] [--out ui.json]

With no --model it uses the built-in demo model (on CPU here, on the GPU where there is one);
--shape gives a real model's layers with random weights, for GPUs without checkpoints.
"""
import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import CONFIGS, print_table, write_json
from engine import EngineThread, RequestStream
from engine.demo_model import ensure_demo_model
from nvchat.settings import DEFAULT_SYSTEM_PROMPT, Settings


@dataclass
class BenchSettings(Settings):
    def sampling_params(self, **overrides):
        return super().sampling_params(ignore_eos=True, **overrides)


def shaped_demo_model(shape: str, scratch: str) -> Path:
    """A model directory with the layers of benchmarks/configs/<shape> and the demo model's byte
    tokenizer, for random weights. Its vocabulary is the tokenizer's (261 rows instead of ~152k),
    so every sampled token is a character the app has to render."""
    demo = ensure_demo_model()
    target = Path(scratch) / f"shape-{shape}"
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (demo / name).exists():
            shutil.copy(demo / name, target / name)
    config = json.loads((CONFIGS / shape / "config.json").read_text())
    demo_config = json.loads((demo / "config.json").read_text())
    for key in ("vocab_size", "bos_token_id", "eos_token_id"):
        config[key] = demo_config.get(key)
    (target / "config.json").write_text(json.dumps(config))
    return target


def user_message(run: str, i: int) -> str:
    # Run names of equal length ("headless", "attached"): both runs' prompts are the same length,
    # and share no blocks beyond the system prompt.
    return f"{run} tab {i:02d}: tell me a long story about the number {i}."


def throughput(streams: list[RequestStream]) -> dict:
    start = min(s.submitted_at for s in streams)
    end = max(s.finished_at for s in streams)
    tokens = sum(s.num_completion_tokens for s in streams)
    return {"tokens": tokens, "wall_s": end - start, "tokens_per_s": tokens / (end - start),
            "mean_stream_tokens_per_s": sum(s.tokens_per_second or 0 for s in streams) / len(streams),
            "mean_ttft_ms": 1000 * sum(s.time_to_first_token or 0 for s in streams) / len(streams)}


def run_headless(engine: EngineThread, settings: Settings, tabs: int) -> dict:
    params = settings.sampling_params()
    streams = [engine.submit([{"role": "system", "content": settings.system_prompt},
                              {"role": "user", "content": user_message("headless", i)}], params)
               for i in range(tabs)]
    for s in streams:
        s.wait()
    return throughput(streams)


async def run_with_ui(engine: EngineThread, settings: Settings, tabs: int, kv_panel: bool, size) -> dict:
    from nvchat.app import NvchatApp
    from nvchat.app.messages import PromptSubmitted

    class RecordingApp(NvchatApp):
        """Keeps each reply's stream for the numbers. Textual also runs NvchatApp's own handler."""
        streams: list[RequestStream] = []

        def on_reply_started(self, event) -> None:
            self.streams.append(event.pane.stream)

    app = RecordingApp(settings, engine=engine)
    async with app.run_test(size=size) as pilot:
        while not app.ready:
            await pilot.pause(0.05)
        for _ in range(tabs - 1):
            await app.run_action("new_tab")
        if kv_panel:
            await app.run_action("toggle_kv_panel")
        await pilot.pause(0.2)
        panes = list(app._panes)
        app.frame_stats.reset()
        cpu_start, wall_start = time.thread_time(), time.perf_counter()
        for i, pane in enumerate(panes):
            pane.post_message(PromptSubmitted(user_message("attached", i)))
        deadline = time.monotonic() + 600
        # Plain sleeps, not pilot.pause(): that walks the whole widget tree each call, which a
        # real terminal session never does.
        while (len(app.streams) < tabs or any(p.busy for p in panes)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        ui_cpu_s, wall_s = time.thread_time() - cpu_start, time.perf_counter() - wall_start
        intervals, durations = list(app.frame_stats.intervals), list(app.frame_stats.durations)
    pct = app.frame_stats.percentile
    return {**throughput(app.streams), "frames": len(durations), "ui_thread_cpu_share": ui_cpu_s / wall_s,
            "tick_interval_ms": {"p50": 1000 * pct(intervals, 50), "p99": 1000 * pct(intervals, 99)},
            "tick_work_ms": {"p50": 1000 * pct(durations, 50), "p99": 1000 * pct(durations, 99)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir or cached HF repo id (default: the demo model)")
    p.add_argument("--shape", help="a config dir under benchmarks/configs (e.g. qwen3-0.6b): that model's shapes "
                                   "with random weights and the demo model's byte tokenizer")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--tabs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--no-kv-panel", action="store_true", help="leave the KV panel hidden during the UI run")
    p.add_argument("--size", default="160x50", help="terminal size for the headless app, COLSxROWS")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()

    # The app stores conversations and reads config.toml: keep the user's own out of it.
    scratch = tempfile.mkdtemp(prefix="nvchat-bench-ui-")
    os.environ["XDG_CONFIG_HOME"] = os.path.join(scratch, "config")
    os.environ["XDG_DATA_HOME"] = os.path.join(scratch, "data")

    settings = BenchSettings(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                             max_num_seqs=max(16, args.tabs), max_tokens=args.max_tokens, temperature=0.8,
                             system_prompt=DEFAULT_SYSTEM_PROMPT)
    kwargs = settings.engine_kwargs()
    if args.shape:
        kwargs.update(model=str(shaped_demo_model(args.shape, scratch)), load_format="random")
    engine = EngineThread(kwargs.pop("model"), **kwargs).start()
    try:
        # Warm-up: first-call costs, and the shared system prompt in the prefix cache for both runs.
        run_headless(engine, BenchSettings(**{**settings.__dict__, "max_tokens": 8}), 2)
        headless = run_headless(engine, settings, args.tabs)
        cols, rows = (int(x) for x in args.size.split("x"))
        # A short first session: imports, CSS and widget classes' first use are one-time costs.
        warm = BenchSettings(**{**settings.__dict__, "max_tokens": 8})
        asyncio.run(run_with_ui(engine, warm, args.tabs, not args.no_kv_panel, (cols, rows)))
        ui = asyncio.run(run_with_ui(engine, settings, args.tabs, not args.no_kv_panel, (cols, rows)))
    finally:
        engine.shutdown()

    rows_out = [
        ("output tokens", headless["tokens"], ui["tokens"]),
        ("engine tok/s (tokens / wall time)", f"{headless['tokens_per_s']:,.0f}", f"{ui['tokens_per_s']:,.0f}"),
        ("mean per-stream tok/s", f"{headless['mean_stream_tokens_per_s']:,.1f}",
         f"{ui['mean_stream_tokens_per_s']:,.1f}"),
        ("mean TTFT ms", f"{headless['mean_ttft_ms']:,.0f}", f"{ui['mean_ttft_ms']:,.0f}"),
        ("UI tick interval p50 / p99 ms", "-",
         f"{ui['tick_interval_ms']['p50']:.1f} / {ui['tick_interval_ms']['p99']:.1f}"),
        ("UI tick work p50 / p99 ms", "-", f"{ui['tick_work_ms']['p50']:.2f} / {ui['tick_work_ms']['p99']:.2f}"),
        ("UI ticks", "-", ui["frames"]),
        ("UI thread CPU (share of one core)", "-", f"{ui['ui_thread_cpu_share'] * 100:.0f}%"),
    ]
    label = args.model or (f"{args.shape} shape" if args.shape else "demo")
    print(f"{args.tabs} tabs x {args.max_tokens} tokens, model {label}, "
          f"device {engine.llm.config.device}, KV panel {'off' if args.no_kv_panel else 'on'}")
    print_table(rows_out, ("", "headless", "with UI"))
    write_json(args.out, {"tabs": args.tabs, "max_tokens": args.max_tokens, "model": label,
                          "device": str(engine.llm.config.device), "kv_panel": not args.no_kv_panel,
                          "headless": headless, "ui": ui})


if __name__ == "__main__":
    main()
