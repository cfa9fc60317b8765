"""A start whose Triton cache is empty compiles its kernels in worker processes before the
warm-up's steps (kernels/warm_start.py, ModelRunner._compile_ahead), and its answers stay exact.
Only a start that sizes its KV cache from the memory the device has free compiles ahead; this one
shares the GPU with the suite's other tests all the same: what they hold counts as used and only
shrinks its tiny model's cache, and no figure here depends on the size.
Run (one GPU): PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_compile_ahead_gpu.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# In a fresh process with empty caches: the kernels in Triton's cache once the engine is built (a
# compiled kernel is a folder holding a .cubin), the children left, greedy answers, and the kernels
# in the cache after them.
_START_COLD = """
import json, os, sys
from pathlib import Path
from engine import LLM, SamplingParams
with LLM(sys.argv[1], device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8,
         max_num_batched_tokens=512, gpu_memory_utilization=0.5) as llm:
    cubins = len({p.parent for p in Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin")})
    children = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
    ahead = llm.runner.kernels_compiled_ahead
    outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    served = len({p.parent for p in Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin")})
print(json.dumps({"cubins": cubins, "served": served, "children": children, "ahead": ahead,
                  "tokens": [o["token_ids"] for o in outs]}))
"""


def test_a_cold_start_compiles_its_kernels_ahead_in_workers_and_answers_exactly(tiny_qwen3, tmp_path):
    prompts = random_prompts([1, 17, 100, 300], seed=5)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), TRITON_CACHE_DIR=str(tmp_path / "triton"),
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", _START_COLD, str(tiny_qwen3), json.dumps(prompts)], env=env,
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"compiled ahead: {run['ahead']}; kernels in Triton's cache once built: {run['cubins']}")
    # Every kernel the start compiled, the workers compiled: the warm-up's own launches found them.
    assert run["ahead"] >= 10 and run["cubins"] == run["ahead"]
    assert run["served"] == run["cubins"], "the answers compiled kernels the start had not"
    assert run["children"] == [], "the compile workers outlived the start"
    assert run["tokens"] == hf_greedy(tiny_qwen3, prompts, 24)
