"""What the decode attention compiles to for a Hopper GPU, checked without one: Triton's compiler
runs on any machine for an sm90 target (triton.compile with a GPUTarget).

Over an FP8 cache, V's tiles must reach the second dot as fp16 by `ldmatrix.trans`. Left to itself
Triton moves their widening behind the trip through shared memory, and then loads the dot's
operand one byte at a time (`ld.shared.b8`: there is no transposing ldmatrix for 8 bits), which
made the attention 18% slower at batch 8 with 4096 tokens of context on an H200
(benchmarks/HISTORY.md, 2026-11-28, 07:05). kernels/decode_attention.py's `_attend` keeps the
widening in front with a product by 1 that changes no value; a Triton release that sees through it
fails this test."""
import inspect
import os
import subprocess
import sys

import pytest
import torch


def _h200_ptx(kernel, constants: dict, pointers: dict, num_warps: int, num_stages: int) -> str:
    """kernel's PTX for an H200: every parameter not in constants is a pointer of the type pointers
    names, else an i32, and pointers and strides are divisible by 16, as a launch over the cache
    specializes them. Needs the kernels imported without TRITON_INTERPRET (compiled, not
    interpreted functions)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
    aligned = [n for n in names if n not in constants and (n.endswith("_ptr") or n.startswith("stride"))]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(kernel, signature, {(names.index(n),): v for n, v in constants.items()}, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    return compiled.asm["ptx"]


def _decode_kernel_ptx(cache_type: str) -> str:
    """The decode attention at Qwen3-0.6B's attention shape (head_dim 128, two query heads a KV
    head), bf16 queries, with the launch the engine picks there."""
    from kernels import decode_attention
    from kernels.launch_limits import H200

    kv_dtype = torch.float8_e4m3fn if cache_type == "fp8e4nv" else torch.bfloat16
    block_n, num_warps, num_stages, merge_tile = decode_attention.launch_config(torch.bfloat16, 128, 2, H200, kv_dtype)
    constants = dict(BLOCK_SIZE=16, GROUP_PAD=16, GROUP_M=2, BLOCK_D=128, BLOCK_N=block_n, SPLIT_TILE=merge_tile,
                     SPLIT=True, MERGE_HERE=True, PDL=True, **decode_attention.dot_flags(torch.bfloat16))
    pointers = dict(q_ptr="*bf16", k_ptr=f"*{cache_type}", v_ptr=f"*{cache_type}", block_tables_ptr="*i32",
                    context_lens_ptr="*i32", out_ptr="*bf16", part_o_ptr="*fp32", part_lse_ptr="*fp32",
                    counters_ptr="*i32", qk_scale="fp32")
    return _h200_ptx(decode_attention._decode_kernel, constants, pointers, num_warps, num_stages)


def _prefill_kernel_ptx(cache_type: str) -> str:
    """The prefill attention at Qwen3-0.6B's attention shape, bf16 queries, with the launch the
    engine picks for a big prefill step."""
    from kernels import prefill_attention
    from kernels.launch_limits import H200

    config = prefill_attention.launch_config(torch.bfloat16, 128, 2, 4096, H200)
    constants = dict(GROUP=2, HEAD_DIM=128, BLOCK_SIZE=16, GROUP_PAD=2, BLOCK_Q=config.block_q,
                     BLOCK_M=config.block_m, BLOCK_D=128, BLOCK_N=config.block_n, PDL=True,
                     **prefill_attention.dot_flags(torch.bfloat16))
    pointers = dict(q_ptr="*bf16", k_ptr=f"*{cache_type}", v_ptr=f"*{cache_type}", out_ptr="*bf16",
                    part_o_ptr="*fp32", part_lse_ptr="*fp32", cu_seqlens_ptr="*i32", context_lens_ptr="*i32",
                    block_tables_ptr="*i32", items_ptr="*i32", count_ptr="*i32", qk_scale="fp32")
    return _h200_ptx(prefill_attention._prefill_kernel, constants, pointers, config.num_warps, config.num_stages)


def _compiled_ptx(helper: str, cache_type: str) -> str:
    """helper(cache_type) run in a process of its own: this one runs the kernels under Triton's
    interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from tests.test_sm90_codegen import {helper}; print({helper}({cache_type!r}))"
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert child.returncode == 0, child.stderr[-2000:]
    return child.stdout


@pytest.mark.parametrize("cache_type", ["fp8e4nv", "bf16"])
def test_v_reaches_the_second_dot_by_ldmatrix_trans_not_byte_loads(cache_type):
    ptx = _compiled_ptx("_decode_kernel_ptx", cache_type)
    assert "ld.shared.b8" not in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    if cache_type == "fp8e4nv":
        assert "cvt.rn.f16x2.e4m3x2" in ptx  # the widening to fp16 in one instruction


def test_prefill_over_an_fp8_cache_widens_e4m3_once_to_fp16():
    """With bf16 queries over an e4m3 cache the products run in fp16: each cached value is widened
    by one instruction, never on to bf16 (`cvt.bf16.f16`, a second conversion per value)."""
    ptx = _compiled_ptx("_prefill_kernel_ptx", "fp8e4nv")
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert "cvt.bf16.f16" not in ptx
