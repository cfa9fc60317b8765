"""How many replies run to the token limit: 20 everyday prompts, each sent as `nvchat -p` sends it
(pipe mode's Conversation: the default system prompt, the chat template, the app's sampling
defaults), with config.toml kept out (empty XDG directories).

    python -m benchmarks.bench_reply_loops [--runs 1] [--set NAME=VALUE ...] [--pipe]

By default the 20 prompts go at once to one engine in this process, which batches them: the same
requests as 20 `nvchat -p` runs, in a fraction of the time on a CPU. --pipe runs `nvchat -p PROMPT
--json` in a process per prompt instead. --set overrides a setting as config.toml would
(`--set repetition_penalty=1.0` gives the defaults from before the repetition penalty).

A reply that ends with finish_reason "length" reached max_tokens (the app's default, 1024): with
SmolLM2-135M-Instruct that means a loop ("A sea of wonders, a sea of wonders..."), as issue 28 found.
Sampling is random (no seed), so counts vary from run to run; --runs repeats the set.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = [
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain photosynthesis in simple terms.",
    "Tell me a joke about computers.",
    "How do I boil an egg?",
    "Write a haiku about autumn.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet.",
    "Suggest a name for a pet cat.",
    "How does a rainbow form?",
    "Write a short story about a lost dog finding its way home.",
    "What should I pack for a weekend camping trip?",
    "Explain what a black hole is.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Write a thank-you note to a teacher.",
    "What is the difference between weather and climate?",
    "List five fruits that are high in vitamin C.",
    "Describe a sunset over the mountains.",
]
ROOT = Path(__file__).resolve().parent.parent


def batched(overrides: dict) -> list[tuple[str, int]]:
    """(finish_reason, tokens) per prompt, all through one engine as pipe mode builds it."""
    # start-up: the engine loads after argument parsing
    from nvchat.backend import open_backend
    from nvchat.conversation import Conversation
    from nvchat.settings import load_settings

    settings = load_settings().updated(**overrides)
    with open_backend(settings) as engine:
        streams = [Conversation(engine, None, system_prompt=settings.system_prompt, model_name="bench",
                                settings=settings).send(prompt) for prompt in PROMPTS]
        for stream in streams:
            stream.wait()
    return [(s.finish_reason, s.num_completion_tokens) for s in streams]


def piped(overrides: dict) -> list[tuple[str, int]]:
    flags = [x for name, value in overrides.items() for x in (f"--{name.replace('_', '-')}", str(value))]
    results = []
    for prompt in PROMPTS:
        done = subprocess.run([sys.executable, "-m", "nvchat.cli", "-p", prompt, "--json", *flags], cwd=ROOT,
                              capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"nvchat failed on {prompt!r}: {done.stderr.strip()}")
        reply = json.loads(done.stdout)
        results.append((reply["finish_reason"], reply["tokens"]))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a setting, as in config.toml")
    ap.add_argument("--pipe", action="store_true", help="a `nvchat -p` process per prompt")
    args = ap.parse_args()
    overrides = {}
    for item in args.set:
        name, _, value = item.partition("=")
        overrides[name] = json.loads(value)
    with tempfile.TemporaryDirectory() as home:
        os.environ.update(XDG_CONFIG_HOME=f"{home}/config", XDG_DATA_HOME=f"{home}/data")
        counts = []
        for run in range(args.runs):
            results = (piped if args.pipe else batched)(overrides)
            for prompt, (reason, tokens) in zip(PROMPTS, results):
                print(f"run {run + 1}  {'LIMIT' if reason == 'length' else reason:6s} {tokens:5d} tokens  {prompt}",
                      flush=True)
            counts.append(sum(reason == "length" for reason, _ in results))
    print(f"settings {overrides or 'defaults'}: replies that reached the token limit: {counts} of {len(PROMPTS)} "
          "per run")


if __name__ == "__main__":
    main()
