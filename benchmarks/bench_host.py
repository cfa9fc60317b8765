"""Host time of one engine step, split by phase, and how long the GPU idles between steps.

With async_scheduling the host schedules, plans and launches step N+1 before it waits for step
N's tokens and post-processes them, so host time only costs GPU time where it exceeds the GPU's
step. This runs the real LLM.step() and times the real calls inside it by wrapping them, with no
synchronization added (host time only):

  schedule   Scheduler.schedule
  plan       plan_step (the scheduler's choice as a StepPlan)
  inputs     ModelRunner.execute minus launch and sample: building and sending the step's inputs
  launch     queuing the model (or replaying its CUDA graph) and the logits; a decode step on
             one GPU replays its sampling graph here too
  sample     queuing the Sampler's kernels (steps not sampled in a graph)
  wait       SampledTokens.tolist: the host waiting for a step's tokens (the GPU is ahead)
  post       the rest of LLM.step: pending tokens, settling (commits, detokenizing, finish checks)
  host       step wall minus wait: what the host spends per step

On CUDA, events around each step's device work (from its inputs landing to its sampled tokens'
copy to the host) give the GPU's busy time per step and the gap it idles between two steps: the
host time the GPU waits through. Without the overlap that gap is about post + schedule + plan +
inputs; with it, near zero while the host keeps up.

Scenarios: decode at batch 1 and batch 256 (context ~600, block size 16), greedy, and batch 256
sampled at temperature 0.6 (what bench_throughput runs), each with the overlap on and off.

Medians over many steps; "step wall" is an uninstrumented llm.step() loop. By default the demo
model (tiny, ~260-token vocabulary), so the figures are host cost; --config runs a real shape
with random weights (for a GPU). On CPU the attention math is stubbed out (--real-attention keeps
it): the torch backend loops over sequences and would take seconds per batch-256 step, and none
of that is host overhead of the engine.

--stream measures the chat app's path instead: the real EngineThread serving --batches streamed
requests (detokenized, sampled at --temperature with the app's top-k/top-p) while reader threads
take their tokens, with the overlap on. Its extra phases:

  detok      IncrementalDetokenizer.push, inside post
  serve      the engine thread's own loop between two steps: delivering outputs to the streams,
             step stats, snapshots, the inbox
  push       RequestStream._push, inside serve
  host       step wall - wait + serve
  engine     host - launch: the engine thread's time per step besides queuing the model (a
             graph replay on a GPU; on CPU the forward, stubbed to the embedding by default). On
             CPU, sample includes the sampling math itself (a sort of the logits, the noise):
             on a GPU those are kernel launches
  wall       the engine loop's wall time per step (host + wait + whatever held the GIL meanwhile)
  readers    CPU time of the reader threads per step (they run under the same GIL)

--readers pump (the app's way: one thread drains every stream 20 times a second) or iter (a
thread per stream blocking in iteration, woken by every token). --ui-busy 0.25 adds a thread
running Python a quarter of the time, as the app's UI thread does; "wall mean" with and without
it shows what the engine loses to the GIL (torch calls release it while they run, and a busy UI
thread can take it then for up to the switch interval). Medians of the steps counted, except
the "mean" columns.

  python -m benchmarks.bench_host [--device cuda] [--config benchmarks/configs/qwen3-0.6b] [--overlap on|off]
  python -m benchmarks.bench_host --stream [--batches 1 8 16] [--readers pump|iter] [--repeats 3] [--ui-busy 0.25]
"""
import argparse
import random
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import torch

import engine.llm as llm_module
import engine.runner.model_runner as runner_module
from benchmarks.common import print_table, write_json
from engine import LLM, EngineThread, RequestStream, SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer

PHASES = ("schedule", "plan", "inputs", "launch", "sample", "wait", "post", "host")
STREAM_PHASES = ("schedule", "plan", "inputs", "launch", "sample", "wait", "detok", "post", "push", "serve",
                 "host", "engine", "wall", "readers")


class NoAttention:
    """Stands in for the attention backend: K/V are not stored and attention returns q."""

    name = "none"

    @staticmethod
    def store_kv(key, value, k_cache, v_cache, slot_mapping):
        pass

    @staticmethod
    def decode(q, k_cache, v_cache, block_tables, context_lens, scale):
        return q

    @staticmethod
    def prefill(q, k_cache, v_cache, meta, scale):
        return q


class PhaseTimer:
    def __init__(self):
        self.step = defaultdict(float)  # seconds per phase in the step being timed

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.step[name] += time.perf_counter() - start
            return out
        return timed


class GpuTimeline:
    """CUDA events at the start of each step's device work (once its inputs are queued) and at
    its end (after its sampled tokens' copy to the host is queued)."""

    def __init__(self):
        self.starts, self.ends = [], []

    def _record(self, events: list):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        events.append(event)

    def _recording_after(self, fn, events):
        def recorded(*args, **kwargs):
            out = fn(*args, **kwargs)
            self._record(events)
            return out
        return recorded

    def wrap_inputs(self, fn):
        return self._recording_after(fn, self.starts)

    def wrap_execute(self, fn):
        return self._recording_after(fn, self.ends)

    def busy_and_gaps_us(self) -> tuple[list[float], list[float]]:
        torch.cuda.synchronize()
        busy = [s.elapsed_time(e) * 1e3 for s, e in zip(self.starts, self.ends)]
        gaps = [e.elapsed_time(s) * 1e3 for e, s in zip(self.ends, self.starts[1:])]
        return busy, gaps


def patch(targets: list) -> Callable[[], None]:
    """Sets each (object, attribute, wrapper factory); returns a function undoing it. Methods get
    a wrapper in the instance's __dict__, which undo deletes; module and class attributes are set
    back."""
    saved = []
    for obj, name, make in targets:  # an attribute may be wrapped twice: save each layer
        saved.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, make(getattr(obj, name)))

    def undo():
        for obj, name, original in reversed(saved):
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)
    return undo


def instrument(llm: LLM, timer: PhaseTimer, timeline: GpuTimeline | None):
    """Wraps the calls inside llm.step(); returns a function undoing it."""
    runner = llm.runner
    timed = [(llm.scheduler, "schedule", "schedule"), (llm_module, "plan_step", "plan"),
             (runner, "execute", "execute"), (runner, "sampler", "sample"), (runner.model, "forward", "launch"),
             (runner.model, "compute_logits", "launch"), (runner_module.SampledTokens, "tolist", "wait")]
    if runner.decode_graphs is not None:
        timed.append((runner.decode_graphs, "replay", "launch"))
    if runner.prefill_graphs is not None:
        timed.append((runner.prefill_graphs, "run", "launch"))
    targets = [(obj, name, lambda fn, phase=phase: timer.wrap(phase, fn)) for obj, name, phase in timed]
    if timeline is not None:
        targets += [(runner, "_step_inputs", timeline.wrap_inputs), (runner, "execute", timeline.wrap_execute)]
        if runner.decode_graphs is not None:
            targets.append((runner.decode_graphs, "stage", timeline.wrap_inputs))
    return patch(targets)


def measure(llm: LLM, steps: int, cuda: bool) -> dict:
    """Median microseconds per phase over `steps` instrumented steps, the GPU's busy time and idle
    gaps, then the plain step wall."""
    timer = PhaseTimer()
    timeline = GpuTimeline() if cuda else None
    undo = instrument(llm, timer, timeline)
    samples = defaultdict(list)
    try:
        for _ in range(steps):
            timer.step.clear()
            start = time.perf_counter()
            llm.step()
            total = time.perf_counter() - start
            s = timer.step
            # The graph's run() is called inside forward's place, never both; launch counts either.
            s["inputs"] = s["execute"] - s["launch"] - s["sample"]
            s["post"] = total - s["schedule"] - s["plan"] - s["execute"] - s["wait"]
            s["host"] = total - s["wait"]
            for name in PHASES:
                samples[name].append(s[name] * 1e6)
    finally:
        undo()
    result = {name: statistics.median(v) for name, v in samples.items()}
    result["mean_host"] = statistics.fmean(samples["host"])
    if timeline is not None:
        busy, gaps = timeline.busy_and_gaps_us()
        result.update(gpu_busy=statistics.median(busy), gpu_gap=statistics.median(gaps),
                      mean_gpu_gap=statistics.fmean(gaps))
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    if cuda:
        torch.cuda.synchronize()
    result["step_wall"] = (time.perf_counter() - start) / steps * 1e6
    return result


def run_scenario(llm: LLM, batch: int, context: int, temperature: float, steps: int, overlap: bool) -> dict:
    llm.async_scheduling = overlap
    rng = random.Random(0)
    vocab = llm.config.hf_config.vocab_size
    params = SamplingParams(temperature=temperature, max_tokens=llm.config.max_model_len, ignore_eos=True)
    # Lengths spread over a block, so blocks fill on different steps as they do in real batches.
    seqs = [llm.add_request([rng.randrange(vocab) for _ in range(context + i % llm.block_size)], params)
            for i in range(batch)]
    while any(s.num_completion_tokens == 0 for s in seqs):
        llm.step()
    for _ in range(3):
        llm.step()
    assert llm.last_step_tokens == (0, batch), "not a pure decode step: raise num_kvcache_blocks"
    result = measure(llm, steps, llm.runner.device.type == "cuda")
    for s in seqs:
        llm.abort(s)
    llm.step()
    return result


class StreamReaders:
    """Reader threads taking the streams' tokens: "pump" drains all of them at the app's 20 Hz,
    "iter" blocks in each stream's iterator. Counts their CPU time while `counting` is set."""

    PUMP_HZ = 20

    def __init__(self, streams: list[RequestStream], kind: str):
        self.streams, self.cpu_s = streams, 0.0
        self.counting = threading.Event()
        self._lock = threading.Lock()
        if kind == "pump":
            targets = [self._pump]
        else:
            targets = [lambda s=s: self._iterate(s) for s in streams]
        self.threads = [threading.Thread(target=t, daemon=True) for t in targets]
        for t in self.threads:
            t.start()

    def _add_cpu(self, seconds: float) -> None:
        with self._lock:
            self.cpu_s += seconds

    def _pump(self):
        while not all(s.finished for s in self.streams):
            counting, start = self.counting.is_set(), time.thread_time()
            for s in self.streams:
                s.drain()
            if counting:
                self._add_cpu(time.thread_time() - start)
            time.sleep(1 / self.PUMP_HZ)

    def _iterate(self, stream: RequestStream):
        spent, start = 0.0, time.thread_time()
        for _ in stream:
            now = time.thread_time()
            if self.counting.is_set():
                spent += now - start
            start = now
        self._add_cpu(spent)

    def join(self):
        for t in self.threads:
            t.join()


class UiLoad:
    """A thread standing in for the app's UI: pure Python for `busy` of every 50 ms, competing
    with the engine thread for the GIL as Textual's rendering does."""

    PERIOD_S = 0.05

    def __init__(self, busy: float):
        self.busy, self.stopped = busy, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stopped.is_set():
            start = time.perf_counter()
            while time.perf_counter() - start < self.busy * self.PERIOD_S:
                "".join(str(i) for i in range(50))
            self.stopped.wait(max(0.0, self.PERIOD_S - (time.perf_counter() - start)))

    def stop(self):
        self.stopped.set()
        self.thread.join()


def run_stream_scenario(llm: LLM, batch: int, context: int, steps: int, params: SamplingParams,
                        readers: str, ui_busy: float = 0.0) -> dict:
    """Median host microseconds per phase over `steps` pure-decode steps of the EngineThread
    serving `batch` streamed requests; the loop's wall time per step too ("wall": what a UI thread
    busy for ui_busy of the time adds to it is the GIL's cost)."""
    rng = random.Random(batch)
    vocab = llm.config.hf_config.vocab_size
    timer, between = PhaseTimer(), PhaseTimer()  # inside llm.step; in the engine loop between steps
    records = []  # (step start, step end, its tokens, its phases, push time in the gap before it)
    recording = threading.Event()
    step = llm.step

    def timed_step():
        pushed = between.step["push"]
        timer.step.clear()
        between.step.clear()
        start = time.perf_counter()
        outputs = step()
        end = time.perf_counter()
        if recording.is_set():
            records.append((start, end, llm.last_step_tokens, dict(timer.step), pushed))
        return outputs

    undo = instrument(llm, timer, None)
    undo_more = patch([(IncrementalDetokenizer, "push", lambda fn: timer.wrap("detok", fn)),
                       (RequestStream, "_push", lambda fn: between.wrap("push", fn))])
    llm.step = timed_step
    engine = EngineThread(llm).start()
    try:
        streams = [engine.submit([rng.randrange(vocab) for _ in range(context + i % llm.block_size)], params)
                   for i in range(batch)]
        reading = StreamReaders(streams, readers)
        while any(not s.token_ids for s in streams):
            time.sleep(0.01)
        ui = UiLoad(ui_busy) if ui_busy else None
        time.sleep(0.05)
        recording.set()
        reading.counting.set()
        while len(records) < steps + 1 and not all(s.finished for s in streams):
            time.sleep(0.01)
        reading.counting.clear()
        recording.clear()
        if ui is not None:
            ui.stop()
        counted = len(records) - 1
        for s in streams:
            s.abort()
        reading.join()
    finally:
        engine.shutdown()
        del llm.step
        undo_more()
        undo()
    assert counted >= steps, f"the streams ended after {counted} steps: raise max_tokens"
    samples = defaultdict(list)
    decode_steps = 0
    # A step's push time falls in the serve gap after it, with the outputs it settled.
    for (start, end, tokens, s, _), (next_start, _, _, _, pushed) in zip(records, records[1:]):
        if tokens != (0, batch):
            continue
        decode_steps += 1
        s = defaultdict(float, s, push=pushed)
        total = end - start
        s["serve"] = next_start - end
        s["wall"] = next_start - start
        s["inputs"] = s["execute"] - s["launch"] - s["sample"]
        s["post"] = total - s["schedule"] - s["plan"] - s["execute"] - s["wait"] - s["detok"]
        s["host"] = total - s["wait"] + s["serve"]
        s["engine"] = s["host"] - s["launch"]
        for name in STREAM_PHASES[:-1]:
            samples[name].append(s[name] * 1e6)
    result = {name: statistics.median(v) for name, v in samples.items()}
    result["mean_engine"] = statistics.fmean(samples["engine"])
    result["mean_wall"] = statistics.fmean(samples["wall"])  # 1 / the steps' rate
    result["readers"] = reading.cpu_s / counted * 1e6
    result["steps"] = decode_steps
    return result


def stream_main(args, llm: LLM) -> dict:
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_tokens=args.steps_stream * 4 + 256, ignore_eos=True)
    model = llm.runner.model
    if llm.runner.device.type == "cpu" and not args.real_model:
        # On a GPU the forward is one graph replay; on CPU its layers would take milliseconds and
        # flush the caches the engine's Python runs from. The embedding alone keeps the shapes.
        embed = model.model.embed_tokens
        model.forward = lambda input_ids, positions, meta: embed(input_ids)
    # The app's GIL switch interval (nvchat.app): it decides how long a reader holds the engine up.
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(args.switch_interval)
    results = defaultdict(list)
    try:
        for _ in range(args.repeats):
            for batch in args.batches:
                results[f"stream_b{batch}"].append(run_stream_scenario(
                    llm, batch, args.context, args.steps_stream, params, args.readers, args.ui_busy))
    finally:
        sys.setswitchinterval(old_interval)
        vars(model).pop("forward", None)
    columns = (*STREAM_PHASES, "mean_engine", "mean_wall")
    header = ("scenario", *(f"{p} us" for p in STREAM_PHASES), "engine mean", "wall mean")
    rows = []
    for name, runs in results.items():
        for i, r in enumerate(runs):
            rows.append((f"{name} #{i + 1}", *(f"{r[c]:.1f}" for c in columns)))
        if len(runs) > 1:
            rows.append((f"{name} median", *(f"{statistics.median(r[c] for r in runs):.1f}" for c in columns)))
    print(f"device {llm.runner.device}, streaming through EngineThread, readers={args.readers}, "
          f"t={args.temperature} top_k={args.top_k} top_p={args.top_p}, ui busy {args.ui_busy:.0%}: "
          f"medians over {args.steps_stream} steps")
    print_table(rows, header)
    return {name: runs for name, runs in results.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a model config directory, run with random weights (default: the demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--steps-b1", type=int, default=300)
    p.add_argument("--steps-b256", type=int, default=40)
    p.add_argument("--overlap", choices=["on", "off", "both"], default="both", help="async_scheduling")
    p.add_argument("--real-attention", action="store_true", help="on CPU, run the real attention backend")
    p.add_argument("--stream", action="store_true", help="the EngineThread streaming scenarios instead")
    p.add_argument("--real-model", action="store_true",
                   help="--stream on CPU: run the model's layers (by default only its embedding runs)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16], help="--stream: streams per run")
    p.add_argument("--steps-stream", type=int, default=1000, help="--stream: decode steps counted per run")
    p.add_argument("--repeats", type=int, default=3, help="--stream: runs of each batch (interleaved)")
    p.add_argument("--readers", choices=["pump", "iter"], default="pump", help="--stream: how tokens are read")
    p.add_argument("--temperature", type=float, default=0.8, help="--stream: sampling temperature")
    p.add_argument("--top-k", type=int, default=20, help="--stream: top-k (the app's default)")
    p.add_argument("--top-p", type=float, default=0.95, help="--stream: top-p (the app's default)")
    p.add_argument("--switch-interval", type=float, default=0.0005, help="--stream: GIL switch interval (the app's)")
    p.add_argument("--ui-busy", type=float, default=0.0, help="--stream: share of the time a UI-like thread runs Python")
    p.add_argument("--out", default=None, help="also write the results to this JSON file")
    args = p.parse_args()
    if args.device == "cpu":
        # One thread: on a shared box an OpenMP pool stalls when a core is taken, which is noise here.
        torch.set_num_threads(1)
    if args.config:
        model, load_format, dtype = args.config, "random", args.dtype or "bfloat16"
    else:
        from engine.checkpoints.demo_model import (
            ensure_demo_model,  # start-up: only without --config
        )
        model, load_format, dtype = ensure_demo_model(), "safetensors", args.dtype
    # 256 contexts of ~600 tokens plus the steps run, in blocks of 16, with room to spare.
    blocks = 256 * (-(-(args.context + 16 + 4 * args.steps_b256 + 16) // 16))
    llm = LLM(model, device=args.device, dtype=dtype, load_format=load_format, max_model_len=args.context + 2048,
              max_num_seqs=256, max_num_batched_tokens=16384, kvcache_block_size=16, num_kvcache_blocks=blocks)
    cuda = llm.runner.device.type == "cuda"
    if not cuda and not args.real_attention:
        for attn in llm.runner.attention_layers:
            attn.backend = NoAttention
    if args.stream:
        results = stream_main(args, llm)
        llm.shutdown()
        write_json(args.out, {"model": str(model), "device": args.device, "context": args.context,
                              "readers": args.readers, **results})
        return
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.overlap]
    results = {}
    for name, batch, temperature, steps in (("decode_b1", 1, 0.0, args.steps_b1),
                                            ("decode_b256", 256, 0.0, args.steps_b256),
                                            ("decode_b256_t0.6", 256, 0.6, args.steps_b256)):
        for overlap in modes:
            key = f"{name}_{'overlap' if overlap else 'sync'}"
            results[key] = run_scenario(llm, batch, args.context, temperature, steps, overlap)
    llm.shutdown()
    gpu = ("gpu_busy", "gpu_gap", "mean_gpu_gap") if cuda else ()
    header = ("scenario", *(f"{p} us" for p in PHASES), "host mean", *(f"{g} us" for g in gpu), "step wall us")
    rows = [(name, *(f"{r[p]:.1f}" for p in PHASES), f"{r['mean_host']:.1f}", *(f"{r[g]:.1f}" for g in gpu),
             f"{r['step_wall']:.0f}") for name, r in results.items()]
    print(f"device {llm.runner.device}, model {model}: medians over the steps (host = step wall - wait)")
    print_table(rows, header)
    write_json(args.out, {"model": str(model), "device": args.device, "context": args.context, **results})


if __name__ == "__main__":
    main()
