"""benchmarks/attention_stages.py rebuilds the engine's from-qkv decode attention from its source
with timer reads: the rebuild must keep up with the kernel (it compiles for sm90 with all seven
stamps, or names the landmark it lost), and its reduction of the records must be right on records
whose answer is worked out by hand. Also: benchmarks/bench_kernel_boundary.py's kernels compile
for sm90 (neither tool runs without a GPU)."""
import inspect
import os
import subprocess
import sys

import pytest

from benchmarks import attention_stages


def _in_child(helper: str, *args) -> str:
    """The last word helper(*args) prints, run in a process of its own without Triton's interpreter
    (which this one runs the kernels under): its kernels compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from tests.test_attention_stages import {helper}; print({helper}(*{args!r}))"
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert child.returncode == 0, child.stderr[-2000:]
    return child.stdout.split()[-1]


def _stamped_ptx_timer_reads(directory: str) -> int:
    """How many %globaltimer reads the stamped kernel's sm90 PTX has, launched as the engine launches
    it at Qwen3-0.6B's shape."""
    import torch

    from kernels import decode_attention, pdl
    from tests.test_sm90_codegen import _sm90_compile

    kernel = attention_stages.load_stamped_kernel(directory)
    constants = dict(BLOCK_SIZE=16, GROUP_PAD=16, GROUP_M=2, BLOCK_D=128, BLOCK_N=64, SPLIT_TILE=16, SPLIT=True,
                     PDL=pdl.FIRST, UNMASKED_WHOLE=False, ORDERED=True, HAS_NORM=True, EARLY_TABLE=True,
                     **decode_attention.dot_flags(torch.bfloat16))
    types = dict(qkv_ptr="*bf16", pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", qw_ptr="*bf16", kw_ptr="*bf16",
                 slot_ptr="*i64", k_ptr="*bf16", v_ptr="*bf16", block_tables_ptr="*i32", context_lens_ptr="*i32",
                 order_ptr="*i32", out_ptr="*bf16", part_o_ptr="*fp32", part_lse_ptr="*fp32", counters_ptr="*i32",
                 stamps_ptr="*i64", count_ptr="*i32", qk_scale="fp32", eps="fp32")
    ptx = _sm90_compile(kernel, constants, types, 4, 2, divisible=("num_heads", "head_dim")).asm["ptx"]
    return ptx.count("%globaltimer")


def _boundary_kernels_compile() -> str:
    from benchmarks import bench_kernel_boundary as b
    from tests.test_sm90_codegen import _sm90_compile

    for mode in range(3):
        _sm90_compile(b._link, dict(G=64, MODE=mode), dict(values="*i32"), 4, 2)
    ptx = _sm90_compile(b._flag_link, dict(G=64), dict(values="*i32", arrived="*i32"), 4, 2).asm["ptx"]
    return "ld.acquire.gpu" in ptx and "red.global.gpu.release.add" in ptx


def test_the_stamped_kernel_compiles_for_sm90_with_every_stamp(tmp_path):
    assert _in_child("_stamped_ptx_timer_reads", str(tmp_path)) == str(len(attention_stages.STAGES))


def test_a_lost_landmark_is_named():
    from kernels import decode_attention

    source = inspect.getsource(decode_attention).replace("    # The barrier makes", "    # Stores are seen by")
    with pytest.raises(ValueError, match="The barrier makes"):
        attention_stages.stamped_source(source)


def test_the_boundary_kernels_compile_for_sm90():
    assert _in_child("_boundary_kernels_compile") == "True"


def _record(start, wait, q, stored, attended, counted, end, split=0, merged=False, holds_new=False):
    tags = split + merged * attention_stages.TAG_MERGED + holds_new * attention_stages.TAG_HOLDS_NEW
    return [start, wait, q, stored, attended, counted, end, tags]


def test_records_group_into_calls_and_reduce_to_stage_medians():
    # Call A: split 1 holds the new token and merges; the third program is a sequence of one split,
    # which counts nothing (its counted stamp is 0). Per program, ns: q 800 / 1200 / 1000, attend
    # 2000 / 3000 / 1000, count 1000 / 2000 / -, so the call's medians are 1.0, 2.0 and 1.5 µs.
    a = [_record(1000, 3000, 3800, 3800, 5800, 6800, 7000, split=0),
         _record(1200, 3100, 4300, 5400, 8400, 10400, 11900, split=1, merged=True, holds_new=True),
         _record(1100, 3050, 4050, 4050, 5050, 0, 5550, split=0)]
    # Call B: A's times three times as long, from 30 µs on; the median of two calls is their mean.
    b = [[30000 + 3 * (t - 3000) if i < 7 and t else t for i, t in enumerate(r)] for r in a]
    groups = attention_stages.calls(b + a)
    assert [len(g) for g in groups] == [3, 3] and groups[0][0][1] == 3000 and groups[1][0][1] == 30000
    stages = attention_stages.stage_medians(groups)
    assert stages == pytest.approx({"launched before the release": 4.0, "q": 2.0, "new token stored": 2.2,
                                    "attend": 4.0, "partial stored and counted": 3.0, "merge": 3.0,
                                    "span, first release to last end": 17.8})
