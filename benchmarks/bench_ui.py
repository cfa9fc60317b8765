"""The chat app's cost: 8 tabs streaming at once, with the app attached (run headless through
Textual's App.run_test) versus the same 8 requests on the bare EngineThread.

Reports the engine's output tokens/s both ways (and their ratio, the issue's target being >= 90%),
the UI thread's CPU (its share of one core over the run, per pump tick and per token), how often
the visible reply was drawn (draws/s: the app paces them, see nvchat/app/pacing.py) and the UI's
frame times (the gap between the stream pump's ticks, and the time each tick spends draining
streams and drawing; p50 and p99). Every reply runs to --max-tokens (ignore_eos) so both runs do the same
work. Each pair of a --switch-interval value (the GIL switch interval the app sets while it runs)
and a --pump-hz value gets its own pair of runs, headless then with the UI, on one engine:

    python -m benchmarks.bench_ui [--model PATH | --shape qwen3-0.6b] [--tabs 8] [--max-tokens 1536]
                                  [--switch-interval 0.0005 0.0001 ...] [--pump-hz 20 10 ...] [--fixed-rate]
                                  [--replay RATE] [--profile-ui] [--cprofile ui.prof] [--out ui.json]

With no --model it uses the built-in demo model (on CPU here, on the GPU where there is one);
--shape gives a real model's layers with random weights, for GPUs without checkpoints.
--replay RATE runs the app against a replay instead of the engine: the tokens of one headless
run, handed to each stream at RATE tokens/s (e.g. an H200's ~600 on a CPU box), with a KV map
that grows with them. The UI's cost is then the only thing that varies between runs, which makes
A/B comparisons of the app possible on a machine whose engine speed wanders; its "headless" row
is the replay without the app. --fixed-rate draws on every pump tick, without the pacing: the
cost of a draw at a fixed rate, comparable with the app from before the pacer.
--profile-ui samples the UI thread's stack during the UI runs and prints where its time went
(the sampling takes the GIL too, so the throughput of a profiled run is not the benchmark's);
--cprofile PATH writes a cProfile of the UI thread instead, for call counts.
"""
import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import CONFIGS, print_table, write_json
from benchmarks.thread_sampler import sample_current_thread
from engine import EngineThread, RequestStream
from engine.checkpoints.demo_model import ensure_demo_model
from engine.core.block_manager import FREE, USED
from engine.backend import BackendCapabilities, EngineSnapshot
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
    # Run names of equal length ("headless3", "attached3"): every run's prompts are the same
    # length, and share no blocks beyond the system prompt.
    return f"{run} tab {i:02d}: tell me a long story about the number {i}."


def throughput(streams: list[RequestStream]) -> dict:
    start = min(s.submitted_at for s in streams)
    end = max(s.finished_at for s in streams)
    tokens = sum(s.num_completion_tokens for s in streams)
    return {"tokens": tokens, "wall_s": end - start, "tokens_per_s": tokens / (end - start),
            "mean_stream_tokens_per_s": sum(s.tokens_per_second or 0 for s in streams) / len(streams),
            "mean_ttft_ms": 1000 * sum(s.time_to_first_token or 0 for s in streams) / len(streams)}


class ReplayEngine:
    """Stands in for EngineThread as the app's Backend: each request gets the next recorded reply,
    one token per step, steps rate times a second. Its thread sleeps between steps, as the engine
    thread waits on the GPU, and needs the GIL only briefly to hand tokens over."""

    # No tokenizer: conversations send their messages whole, as to a remote server.
    capabilities = BackendCapabilities(model_name=None, context_length=None, tokenizes=False, block_stats=True)
    fatal_error = None

    def __init__(self, replies: list[list[str]], rate: float, template: EngineSnapshot) -> None:
        self.replies, self.step_s, self.template = replies, 1 / rate, template
        self._ids = itertools.count(1)
        self._live: dict[int, list] = {}  # request id -> [stream, pieces, next piece]
        self._lock = threading.Lock()
        self._stopping = False
        self._snapshot = self._snap()
        self._thread = threading.Thread(target=self._run, name="replay-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt, sampling_params=None, *, enable_thinking=None, tag=None) -> RequestStream:
        request_id = next(self._ids)
        stream = RequestStream(request_id, 64, self._abort, tag)
        pieces = self.replies[request_id % len(self.replies)]
        if sampling_params is not None:
            pieces = pieces[:sampling_params.max_tokens]
        with self._lock:
            self._live[request_id] = [stream, pieces, 0]
        return stream

    def _abort(self, stream: RequestStream) -> None:
        with self._lock:
            self._live.pop(stream.request_id, None)
        stream._finish("abort")

    def _run(self) -> None:
        due = time.perf_counter()
        while not self._stopping:
            due += self.step_s
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            else:
                due = time.perf_counter()  # late (the GIL): no burst to catch up
            with self._lock:
                live = list(self._live.items())
            for request_id, entry in live:
                stream, pieces, at = entry
                if at < len(pieces):
                    stream._push(pieces[at], [at])
                    entry[2] = at + 1
                if entry[2] >= len(pieces):
                    with self._lock:
                        self._live.pop(request_id, None)
                    stream._finish("length")
            self._snapshot = self._snap()

    def _snap(self) -> EngineSnapshot:
        t = self.template
        with self._lock:
            live = [(request_id, entry[2]) for request_id, entry in self._live.items()]
        states, holders, at = bytearray([FREE]) * t.num_blocks, {}, 0
        for request_id, tokens in live:
            n = min(math.ceil((64 + tokens) / t.block_size), t.num_blocks - at)
            holders[request_id] = list(range(at, at + n))
            states[at:at + n] = bytes([USED]) * n
            at += n
        return dataclasses.replace(t, num_free_blocks=t.num_blocks - at, num_running=len(live), num_waiting=0,
                                   decode_tokens_per_s=len(live) / self.step_s, prefill_tokens_per_s=0.0,
                                   kv_bytes_used=t.kv_bytes_total * at // max(1, t.num_blocks),
                                   block_states=bytes(states), block_holders=holders, taken_at=time.perf_counter())

    def tokenize_chat(self, messages, enable_thinking=None) -> list[int]:
        raise RuntimeError("a replay has no tokenizer")

    def prefetch(self, prompt_token_ids) -> None:
        pass  # a replay keeps no KV cache

    def stats(self) -> EngineSnapshot:
        return self._snapshot

    def shutdown(self) -> None:
        self._stopping = True
        self._thread.join()


def record_replies(engine: EngineThread, settings: Settings, tabs: int) -> list[list[str]]:
    """Each reply of one headless run, token by token, for ReplayEngine."""
    params = settings.sampling_params()
    streams = [engine.submit([{"role": "system", "content": settings.system_prompt},
                              {"role": "user", "content": user_message("recorded0", i)}], params)
               for i in range(tabs)]
    return [[delta.text for delta in stream] for stream in streams]


def run_headless(engine: EngineThread, settings: Settings, tabs: int, run: int) -> dict:
    params = settings.sampling_params()
    streams = [engine.submit([{"role": "system", "content": settings.system_prompt},
                              {"role": "user", "content": user_message(f"headless{run}", i)}], params)
               for i in range(tabs)]
    for s in streams:
        s.wait()
    return throughput(streams)


async def run_with_ui(engine: EngineThread, settings: Settings, tabs: int, kv_panel: bool, size, run: int,
                      switch_interval: float, pump_hz: int, profile: bool = False, cprofile: str | None = None,
                      fixed_rate: bool = False) -> dict:
    # start-up: Textual loads only for the runs that draw
    from nvchat.app import NvchatApp
    from nvchat.app.events import PromptSubmitted

    class RecordingApp(NvchatApp):
        """Keeps each reply's stream for the numbers. Textual also runs NvchatApp's own handler."""
        GIL_SWITCH_INTERVAL_S = switch_interval
        PUMP_HZ = pump_hz
        # The draw pacer's floor at its ceiling: every tick draws, whatever it costs.
        MIN_DRAW_HZ = pump_hz if fixed_rate else getattr(NvchatApp, "MIN_DRAW_HZ", None)
        streams: list[RequestStream] = []

        def on_chat_pane_reply_started(self, event) -> None:
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
        panes = list(app.tabs.panes)
        app.pump.frame_stats.reset()
        with sample_current_thread() if profile else contextlib.nullcontext() as sampler, \
                _cprofiled(cprofile) as profiler:
            cpu_start, wall_start = time.thread_time(), time.perf_counter()
            for i, pane in enumerate(panes):
                pane.post_message(PromptSubmitted(user_message(f"attached{run}", i)))
            deadline = time.monotonic() + 600
            # Plain sleeps, not pilot.pause(): that walks the whole widget tree each call, which a
            # real terminal session never does.
            while (len(app.streams) < tabs or any(p.busy for p in panes)) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            ui_cpu_s, wall_s = time.thread_time() - cpu_start, time.perf_counter() - wall_start
        if profiler is not None:
            profiler.dump_stats(cprofile)
            print(f"--- cProfile of the UI thread written to {cprofile} ---")
        if sampler is not None:
            print(f"--- UI thread profile, switch interval {switch_interval * 1000:g} ms, pump {pump_hz} Hz ---")
            print(sampler.report())
        intervals, durations = list(app.pump.frame_stats.intervals), list(app.pump.frame_stats.durations)
    pct = app.pump.frame_stats.percentile
    # An app from before the pump paced its draws drew the visible reply on every tick.
    draws = getattr(app.pump.frame_stats, "draws", len(durations))
    return {**throughput(app.streams), "frames": len(durations), "draws": draws,
            "ui_thread_cpu_s": ui_cpu_s,
            "ui_thread_cpu_share": ui_cpu_s / wall_s, "ui_cpu_ms_per_tick": 1000 * ui_cpu_s / max(1, len(durations)),
            "ui_cpu_ms_per_token": 1000 * ui_cpu_s / max(1, sum(s.num_completion_tokens for s in app.streams)),
            "draws_per_s": draws / wall_s,
            "tick_interval_ms": {"p50": 1000 * pct(intervals, 50), "p99": 1000 * pct(intervals, 99)},
            "tick_work_ms": {"p50": 1000 * pct(durations, 50), "p99": 1000 * pct(durations, 99)}}


@contextlib.contextmanager
def _cprofiled(path: str | None):
    """cProfile of the calling thread (the app runs in the benchmark's own event loop, so this is
    the UI thread). Python 3.11's cProfile hooks the calling thread only; its per-call cost weighs
    Textual's many small calls more than the sampler does, so read it for call counts."""
    if path is None:
        yield None
        return
    import cProfile  # start-up: only for --cprofile
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield profiler
    finally:
        profiler.disable()


def main() -> None:
    from nvchat.app import NvchatApp  # start-up: as in run_with_ui

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir or cached HF repo id (default: the demo model)")
    p.add_argument("--shape", help="a config dir under benchmarks/configs (e.g. qwen3-0.6b): that model's shapes "
                                   "with random weights and the demo model's byte tokenizer")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--tabs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1536,
                   help="tokens per reply (the default keeps the UI run several seconds long on an H200)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--switch-interval", type=float, nargs="+", default=[NvchatApp.GIL_SWITCH_INTERVAL_S],
                   help="GIL switch interval(s) in seconds for the app's runs (default: the app's own)")
    p.add_argument("--pump-hz", type=int, nargs="+", default=[NvchatApp.PUMP_HZ],
                   help="the app's stream pump rate(s), the visible reply's most updates a second "
                        "(default: the app's); every --switch-interval runs at every rate")
    p.add_argument("--replay", type=float, default=None, metavar="RATE",
                   help="run the app against a replay of recorded replies at RATE tokens/s per stream, "
                        "not the engine (see above)")
    p.add_argument("--fixed-rate", action="store_true",
                   help="draw the visible reply on every pump tick (no pacing): the cost of a draw at a fixed rate, "
                        "comparable with builds from before the pacer")
    p.add_argument("--no-kv-panel", action="store_true", help="leave the KV panel hidden during the UI run")
    p.add_argument("--size", default="160x50", help="terminal size for the headless app, COLSxROWS")
    p.add_argument("--profile-ui", action="store_true",
                   help="sample the UI thread's stack and print where its time goes")
    p.add_argument("--cprofile", default=None, metavar="PATH",
                   help="cProfile the UI thread during the (last) UI run and write its stats here (pstats format)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()

    # The app stores conversations and reads config.toml: keep the user's own out of it.
    scratch = tempfile.mkdtemp(prefix="nvchat-bench-ui-")
    os.environ["XDG_CONFIG_HOME"] = os.path.join(scratch, "config")
    os.environ["XDG_DATA_HOME"] = os.path.join(scratch, "data")

    settings = BenchSettings(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                             max_num_seqs=max(16, args.tabs), max_tokens=args.max_tokens, temperature=0.8,
                             system_prompt=DEFAULT_SYSTEM_PROMPT)
    model, options = settings.engine_model(), settings.engine_options().keywords()
    if args.shape:
        model, options["load_format"] = str(shaped_demo_model(args.shape, scratch)), "random"
    engine = EngineThread(model, **options).start()
    cols, rows = (int(x) for x in args.size.split("x"))
    kv_panel = not args.no_kv_panel
    runs = []
    try:
        # Warm-up: first-call costs, and the shared system prompt in the prefix cache for every run;
        # a short first app session takes the one-time costs of imports, CSS and widget classes.
        short = BenchSettings(**{**settings.__dict__, "max_tokens": 8})
        run_headless(engine, short, 2, 0)
        if args.replay:
            replies, template = record_replies(engine, settings, args.tabs), engine.stats()
            engine.shutdown()
            engine = ReplayEngine(replies, args.replay, template)
        asyncio.run(run_with_ui(engine, short, args.tabs, kv_panel, (cols, rows), 0, args.switch_interval[0],
                                args.pump_hz[0]))
        for run, (interval, hz) in enumerate(itertools.product(args.switch_interval, args.pump_hz), 1):
            headless = run_headless(engine, settings, args.tabs, run)
            ui = asyncio.run(run_with_ui(engine, settings, args.tabs, kv_panel, (cols, rows), run, interval, hz,
                                         args.profile_ui, args.cprofile, args.fixed_rate))
            runs.append({"switch_interval_s": interval, "pump_hz": hz, "headless": headless, "ui": ui,
                         "ui_vs_headless": ui["tokens_per_s"] / headless["tokens_per_s"]})
    finally:
        engine.shutdown()

    label = args.model or (f"{args.shape} shape" if args.shape else "demo")
    device = f"replayed at {args.replay:g} tok/s per stream" if args.replay else engine.llm.config.device
    print(f"{args.tabs} tabs x {args.max_tokens} tokens, model {label}, device {device}, "
          f"KV panel {'on' if kv_panel else 'off'}{', fixed draw rate' if args.fixed_rate else ''}")
    print_table([(f"{r['switch_interval_s'] * 1000:g}", r["pump_hz"],
                  f"{r['headless']['tokens_per_s']:,.0f}", f"{r['ui']['tokens_per_s']:,.0f}",
                  f"{r['ui_vs_headless'] * 100:.0f}%",
                  f"{r['headless']['mean_stream_tokens_per_s']:,.0f} / {r['ui']['mean_stream_tokens_per_s']:,.0f}",
                  f"{r['headless']['mean_ttft_ms']:,.0f} / {r['ui']['mean_ttft_ms']:,.0f}",
                  f"{r['ui']['ui_thread_cpu_share'] * 100:.0f}%", f"{r['ui']['ui_cpu_ms_per_tick']:.2f}",
                  f"{r['ui']['ui_cpu_ms_per_token']:.3f}",
                  r["ui"]["frames"], f"{r['ui']['draws_per_s']:.1f}",
                  f"{r['ui']['tick_interval_ms']['p50']:.1f} / {r['ui']['tick_interval_ms']['p99']:.1f}",
                  f"{r['ui']['tick_work_ms']['p50']:.2f} / {r['ui']['tick_work_ms']['p99']:.2f}")
                 for r in runs],
                ("switch ms", "pump Hz", "headless tok/s", "UI tok/s", "UI/headless", "per-stream tok/s h / UI",
                 "TTFT ms h / UI", "UI thread CPU", "UI CPU ms/tick", "UI CPU ms/token", "ticks", "draws/s",
                 "tick gap p50/p99 ms", "tick work p50/p99 ms"))
    write_json(args.out, {"tabs": args.tabs, "max_tokens": args.max_tokens, "model": label,
                          "device": str(device), "replay_rate": args.replay, "fixed_rate": args.fixed_rate,
                          "kv_panel": kv_panel, "size": args.size,
                          "runs": runs})


if __name__ == "__main__":
    main()
