"""Host time of one engine step, split by phase, on a model whose forward costs next to nothing.

The engine is synchronous: from the .tolist() that ends one step's sampling to the graph launch
of the next, the host post-processes, schedules, plans and builds inputs while the GPU waits.
This runs the real LLM.step() and times the real calls inside it by wrapping them:

  schedule   Scheduler.schedule
  plan       plan_step (the scheduler's choice as a StepPlan)
  inputs     ModelRunner.execute minus forward, logits and sample: building the step's tensors
  forward    the model or its CUDA graph (device work, not host time; synchronized on CUDA)
  logits     compute_logits on the sampled rows (synchronized on CUDA)
  sample     the Sampler, its kernels and the .tolist() sync included
  post       LLM.step minus all of the above: appending tokens, committing blocks, finish checks

Scenarios: decode at batch 1 and batch 256 (context ~600, block size 16), greedy, and batch 256
sampled at temperature 0.6 (what bench_throughput runs). Medians over many steps; "step wall" is
an uninstrumented llm.step() loop. By default the demo model (tiny, ~260-token vocabulary), so
the figures are host cost; --config runs a real shape with random weights (for a GPU). On CPU the
attention math is stubbed out (--real-attention keeps it): the torch backend loops over sequences
and would take seconds per batch-256 step, and none of that is host overhead of the engine.

  python -m benchmarks.bench_host [--device cuda] [--config benchmarks/configs/qwen3-0.6b]
"""
import argparse
import random
import statistics
import time
from collections import defaultdict

import torch

import engine.llm as llm_module
from benchmarks.common import print_table, write_json
from engine import LLM, SamplingParams

PHASES = ("schedule", "plan", "inputs", "forward", "logits", "sample", "post")
HOST_PHASES = ("schedule", "plan", "inputs", "sample", "post")


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
    def __init__(self, sync: bool):
        self.sync = sync
        self.step = defaultdict(float)  # seconds per phase in the step being timed

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.sync:
                torch.cuda.synchronize()
            self.step[name] += time.perf_counter() - start
            return out
        return timed


def instrument(llm: LLM, timer: PhaseTimer):
    """Wraps the calls inside llm.step(); returns a function undoing it."""
    runner = llm.runner
    targets = [(llm.scheduler, "schedule", "schedule"), (llm_module, "plan_step", "plan"),
               (runner, "execute", "execute"), (runner, "sampler", "sample"), (runner.model, "forward", "forward"),
               (runner.model, "compute_logits", "logits")]
    if runner.decode_graphs is not None:
        targets.append((runner.decode_graphs, "run", "forward"))
    # Methods get a wrapper in the instance's __dict__, which undo deletes; plain attributes and
    # module functions are set back.
    saved = [(obj, name, vars(obj).get(name)) for obj, name, _ in targets]
    for obj, name, phase in targets:
        setattr(obj, name, timer.wrap(phase, getattr(obj, name)))

    def undo():
        for obj, name, original in saved:
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)
    return undo


def measure(llm: LLM, steps: int, sync: bool) -> dict:
    """Median microseconds per phase over `steps` instrumented steps, then the plain step wall."""
    timer = PhaseTimer(sync)
    undo = instrument(llm, timer)
    samples = defaultdict(list)
    try:
        for _ in range(steps):
            timer.step.clear()
            start = time.perf_counter()
            llm.step()
            if sync:
                torch.cuda.synchronize()
            total = time.perf_counter() - start
            s = timer.step
            s["inputs"] = s["execute"] - s["forward"] - s["logits"] - s["sample"]
            s["post"] = total - s["schedule"] - s["plan"] - s["execute"]
            s["host"] = sum(s[p] for p in HOST_PHASES)
            for name in (*PHASES, "host"):
                samples[name].append(s[name] * 1e6)
    finally:
        undo()
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    if sync:
        torch.cuda.synchronize()
    result = {name: statistics.median(v) for name, v in samples.items()}
    result["mean_host"] = statistics.fmean(samples["host"])
    result["step_wall"] = (time.perf_counter() - start) / steps * 1e6
    return result


def run_scenario(llm: LLM, batch: int, context: int, temperature: float, steps: int, sync: bool) -> dict:
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
    result = measure(llm, steps, sync)
    for s in seqs:
        llm.abort(s)
    llm.step()
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a model config directory, run with random weights (default: the demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--steps-b1", type=int, default=300)
    p.add_argument("--steps-b256", type=int, default=40)
    p.add_argument("--real-attention", action="store_true", help="on CPU, run the real attention backend")
    p.add_argument("--out", default=None, help="also write the results to this JSON file")
    args = p.parse_args()
    if args.device == "cpu":
        # One thread: on a shared box an OpenMP pool stalls when a core is taken, which is noise here.
        torch.set_num_threads(1)
    if args.config:
        model, load_format, dtype = args.config, "random", args.dtype or "bfloat16"
    else:
        from engine.demo_model import ensure_demo_model
        model, load_format, dtype = ensure_demo_model(), "safetensors", args.dtype
    # 256 contexts of ~600 tokens plus the steps run, in blocks of 16, with room to spare.
    blocks = 256 * (-(-(args.context + 16 + 4 * args.steps_b256 + 16) // 16))
    llm = LLM(model, device=args.device, dtype=dtype, load_format=load_format, max_model_len=args.context + 2048,
              max_num_seqs=256, max_num_batched_tokens=16384, kvcache_block_size=16, num_kvcache_blocks=blocks)
    sync = llm.runner.device.type == "cuda"
    if not sync and not args.real_attention:
        for attn in llm.runner.attention_layers:
            attn.backend = NoAttention
    results = {
        "decode_b1": run_scenario(llm, 1, args.context, 0.0, args.steps_b1, sync),
        "decode_b256": run_scenario(llm, 256, args.context, 0.0, args.steps_b256, sync),
        "decode_b256_t0.6": run_scenario(llm, 256, args.context, 0.6, args.steps_b256, sync),
    }
    llm.shutdown()
    header = ("scenario", *(f"{p} us" for p in PHASES), "host us", "host mean", "step wall us")
    rows = [(name, *(f"{r[p]:.1f}" for p in PHASES), f"{r['host']:.1f}", f"{r['mean_host']:.1f}",
             f"{r['step_wall']:.0f}") for name, r in results.items()]
    print(f"device {llm.runner.device}, model {model}: medians over the steps "
          "(host = schedule + plan + inputs + sample + post)")
    print_table(rows, header)
    write_json(args.out, {"model": str(model), "device": args.device, "context": args.context, **results})


if __name__ == "__main__":
    main()
