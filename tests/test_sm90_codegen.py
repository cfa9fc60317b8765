"""What the attention kernels and the one-row GEMV compile to for a Hopper GPU, checked without one:
Triton's compiler runs on any machine for an sm90 target (triton.compile with a GPUTarget).

Over an FP8 cache, V's tiles must reach the decode attention's second dot as fp16 by
`ldmatrix.trans`. Left to itself Triton moves their widening behind the trip through shared
memory, and then loads the dot's operand one byte at a time (`ld.shared.b8`: there is no
transposing ldmatrix for 8 bits), which made the attention 18% slower at batch 8 with 4096 tokens
of context on an H200 (benchmarks/HISTORY.md, 2026-11-28, 07:05). kernels/decode_attention.py's
`_attend_tiles` keeps the widening in front with a product by 1 that changes no value; a Triton release
that sees through it fails this test. Both decode kernels are checked: the engine's decode step
runs the one that starts from the qkv projection. The prefill attention over an FP8 cache must
widen each cached value once, to fp16. And by what Triton's own ptxas reports for the kernels as
launched: the four-warp decode attention launch fits the programs a SM its split count assumes, and
the one-row GEMV's whole-band launches and the one-row FP8 GEMV's launches spill nothing. These
compile with the Triton installed here, which may not be the GPU machines' (benchmarks/HISTORY.md
records both).
"""
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch


def _sm90_ptx(kernel, constants: dict, types: dict, num_warps: int, num_stages: int,
              divisible: tuple[str, ...] = ()) -> str:
    """_sm90_compile's PTX."""
    return _sm90_compile(kernel, constants, types, num_warps, num_stages, divisible).asm["ptx"]


def _sm90_compile(kernel, constants: dict, types: dict, num_warps: int, num_stages: int,
                  divisible: tuple[str, ...] = ()):
    """kernel compiled for sm90: every parameter not in constants has the type `types` names, else i32,
    and pointers, strides and the integers named in `divisible` are divisible by 16, as a launch
    specializes each argument that is: name there those of the engine's launch at the shape (a
    head_dim of 128 left unmarked cost the from-qkv attention 163 registers a thread against 108 and
    made its loads scalar). Needs the kernels imported without TRITON_INTERPRET (compiled, not
    interpreted functions)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    aligned = [n for n in names
               if n not in constants and (n.endswith("_ptr") or n.startswith("stride") or n in divisible)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(kernel, signature, {(names.index(n),): v for n, v in constants.items()}, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _decode_ptx(kernel_name: str, cache_type: str, one_warp: bool, early_table: bool | None = None) -> str:
    """_decode_compile's PTX."""
    return _decode_compile(kernel_name, cache_type, one_warp, early_table).asm["ptx"]


def _decode_shared(cache_type: str, early_table: bool) -> str:
    """"shared=N", the bytes of shared memory of the engine's four-warp from-qkv launch (its
    registers are in ptxas's log, which TRITON_DUMP_PTXAS_LOG prints while it compiles)."""
    return f"shared={_decode_compile('_decode_from_qkv_kernel', cache_type, False, early_table).metadata.shared}"


def _decode_compile(kernel_name: str, cache_type: str, one_warp: bool, early_table: bool | None = None):
    """A decode attention kernel at Qwen3-0.6B's attention shape (head_dim 128, two query heads a KV
    head), bf16 queries and qkv, with either launch the engine picks there on an H200, starting its
    sequences in the order the engine gives (seq_order). early_table: the from-qkv kernel's
    EARLY_TABLE, None for the engine's choice (four warps over a bf16 cache)."""
    from kernels import decode_attention, pdl
    from kernels.launch_limits import H200

    kv_dtype = torch.float8_e4m3fn if cache_type == "fp8e4nv" else torch.bfloat16
    block_n, num_warps, num_stages, merge_tile = decode_attention.launch_config(
        torch.bfloat16, 128, 2, H200, kv_dtype, one_warp)
    constants = dict(BLOCK_SIZE=16, GROUP_PAD=16, GROUP_M=2, BLOCK_D=128, BLOCK_N=block_n, SPLIT_TILE=merge_tile,
                     SPLIT=True, PDL=pdl.AFTER_WAIT, UNMASKED_WHOLE=num_warps == 1, ORDERED=True,
                     **decode_attention.dot_flags(torch.bfloat16))
    types = dict(k_ptr=f"*{cache_type}", v_ptr=f"*{cache_type}", block_tables_ptr="*i32", context_lens_ptr="*i32",
                 order_ptr="*i32", out_ptr="*bf16", part_o_ptr="*fp32", part_lse_ptr="*fp32", counters_ptr="*i32",
                 qk_scale="fp32")
    if kernel_name == "_decode_kernel":
        constants.update(MERGE_HERE=True)
        types.update(q_ptr="*bf16")
    else:
        early = not one_warp and cache_type == "bf16" if early_table is None else early_table
        constants.update(HAS_NORM=True, EARLY_TABLE=early)
        types.update(qkv_ptr="*bf16", pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", qw_ptr="*bf16",
                     kw_ptr="*bf16", slot_ptr="*i64", eps="fp32")
    return _sm90_compile(getattr(decode_attention, kernel_name), constants, types, num_warps, num_stages,
                         divisible=("num_heads", "head_dim"))


def _prefill_ptx(cache_type: str) -> str:
    """The prefill attention at Qwen3-0.6B's attention shape, bf16 queries, with the launch the
    engine picks for a big prefill step."""
    from kernels import pdl, prefill_attention
    from kernels.launch_limits import H200

    config = prefill_attention.launch_config(torch.bfloat16, 128, 2, 4096, H200)
    constants = dict(GROUP=2, HEAD_DIM=128, BLOCK_SIZE=16, GROUP_PAD=2, BLOCK_Q=config.block_q,
                     BLOCK_M=config.block_m, BLOCK_D=128, BLOCK_N=config.block_n, PDL=pdl.AFTER_WAIT,
                     **prefill_attention.dot_flags(torch.bfloat16))
    types = dict(q_ptr="*bf16", k_ptr=f"*{cache_type}", v_ptr=f"*{cache_type}", out_ptr="*bf16",
                 part_o_ptr="*fp32", part_lse_ptr="*fp32", cu_seqlens_ptr="*i32", context_lens_ptr="*i32",
                 block_tables_ptr="*i32", items_ptr="*i32", count_ptr="*i32", qk_scale="fp32")
    return _sm90_ptx(prefill_attention._prefill_kernel, constants, types, config.num_warps, config.num_stages,
                     divisible=("num_heads",))


def _gemv_ptx(pdl_mode: int) -> str:
    """The one-row GEMV with the pre-norm taken in, at Qwen3-0.6B's qkv projection (the launch
    launch_config gives it), launched with PDL in `pdl_mode`."""
    return _gemv_compile(4096, 1024, True, False, pdl_mode).asm["ptx"]


def _gemv_compile(rows_w: int, K: int, norm: bool, silu: bool, pdl_mode: int, rows: int = 1):
    """The GEMV of `rows` rows against a bf16 weight [rows_w, K] (gate and up stacked with silu) as
    launch_config launches it on a GPU with PDL: with the pre-norm and its residual taken in where
    norm, in `pdl_mode`."""
    import triton

    from kernels import gemv

    kernel, block_n, block_k, num_warps, num_stages = gemv.launch_config(rows_w, K, rows, silu, norm=norm,
                                                                         whole_band=True)
    constants = dict(BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm, RESIDUAL=norm, SILU=silu, PDL=pdl_mode,
                     SUM_EACH_STEP=block_k >= K)
    types = dict(x_ptr="*bf16", res_ptr="*bf16", nw_ptr="*bf16", res_out_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16",
                 eps="fp32")
    if kernel == "fma":
        constants.update(ROWS=triton.next_power_of_2(max(rows, 2)))
    compiled = {"one": gemv._gemv_kernel, "fma": gemv._gemv_rows_fma_kernel}[kernel]
    return _sm90_compile(compiled, constants, types, num_warps, num_stages, divisible=("N", "K"))


def _gemv_ptxas_log(rows_w: int, K: int, norm: bool, silu: bool, rows: int = 1) -> None:
    """Compiles _gemv_compile's launch with the PDL mode the row count takes, for ptxas's log,
    which TRITON_DUMP_PTXAS_LOG prints while it compiles."""
    from kernels import pdl

    _gemv_compile(rows_w, K, norm, silu, pdl.FIRST if rows <= pdl.FIRST_ROWS else pdl.AFTER_WAIT, rows)


def _fp8_gemv_ptxas_log(rows_w: int, K: int, norm: bool) -> None:
    """Compiles the one-row FP8 GEMV against an e4m3 weight [rows_w, K] in scale blocks of 128 x 128
    as kernels.fp8 launches it on a GPU with PDL (the pre-norm and its residual taken in where norm),
    for ptxas's log, which TRITON_DUMP_PTXAS_LOG prints while it compiles."""
    import triton

    from kernels import fp8, pdl

    kernel, block_n, block_k, num_warps, num_stages, unroll = fp8.gemv_launch_config(rows_w, K, 1)
    assert kernel == "one", kernel
    block_k = min(block_k, triton.next_power_of_2(K))
    constants = dict(BLOCK_N=block_n, UNROLL=unroll, GROUPS=block_k // 128, GROUP_K=128, SCALE_N=128, SCALE_K=128,
                     NORM_BLOCK_K=min(triton.next_power_of_2(K), 512 * num_warps), NORM=norm, RESIDUAL=norm,
                     PDL=pdl.FIRST, SUM_EACH_STEP=fp8.one_row_sums_each_step(block_n, block_k, num_warps))
    types = dict(x_ptr="*bf16", res_ptr="*bf16", nw_ptr="*bf16", res_out_ptr="*bf16", w_ptr="*fp8e4nv",
                 s_ptr="*fp32", y_ptr="*bf16", eps="fp32")
    _sm90_compile(fp8._fp8_gemv_one_kernel, constants, types, num_warps, num_stages, divisible=("N", "K"))


def _run_in_child(helper: str, *args, env: dict | None = None) -> str:
    """What running helper(*args) and printing its result writes to stdout, in a process of its own
    (with `env` added to its environment): this one runs the kernels under Triton's interpreter."""
    child_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    code = f"from tests.test_sm90_codegen import {helper}; print({helper}(*{args!r}))"
    child = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=300,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert child.returncode == 0, child.stderr[-2000:]
    return child.stdout


@pytest.mark.parametrize("one_warp", [False, True], ids=["four_warps", "one_warp"])
@pytest.mark.parametrize("cache_type", ["fp8e4nv", "bf16"])
@pytest.mark.parametrize("kernel_name", ["_decode_kernel", "_decode_from_qkv_kernel"])
def test_v_reaches_the_second_dot_by_ldmatrix_trans_not_byte_loads(kernel_name, cache_type, one_warp):
    ptx = _run_in_child("_decode_ptx", kernel_name, cache_type, one_warp)
    assert "ld.shared.b8" not in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    if cache_type == "fp8e4nv":
        assert "cvt.rn.f16x2.e4m3x2" in ptx  # the widening to fp16 in one instruction


def test_the_from_qkv_attention_loads_its_first_tiles_block_ids_before_the_wait():
    """With EARLY_TABLE (the engine's four-warp launch over a bf16 cache) the kernel issues more
    global loads before the PDL wait than without: the block ids of its split's first tile."""
    def loads_before_the_wait(ptx):
        return ptx[:ptx.index("griddepcontrol.wait")].count("ld.global")

    early = _run_in_child("_decode_ptx", "_decode_from_qkv_kernel", "bf16", False, True)
    late = _run_in_child("_decode_ptx", "_decode_from_qkv_kernel", "bf16", False, False)
    assert loads_before_the_wait(early) > loads_before_the_wait(late)


# Hopper's per-SM limits (the CUDA programming guide, compute capability 9.0): 65,536 registers,
# allocated to a warp 256 at a time (8 a thread), and 233,472 bytes of shared memory, of which each
# resident block also takes 1,024 for the system.
SM90_REGISTERS, SM90_SHARED, SHARED_PER_BLOCK = 65_536, 233_472, 1_024


@pytest.mark.parametrize("cache_type, early_table", [("bf16", True), ("bf16", False), ("fp8e4nv", False)])
def test_the_four_warp_attention_launch_fits_its_programs_a_sm_at_once(cache_type, early_table, tmp_path):
    """default_num_splits splits a four-warp decode attention launch into FOUR_WARP_PROGRAMS_PER_SM
    programs a SM, which must all be resident at once, or the last of each launch runs as a second
    wave. The from-qkv kernel as the engine launches it at Qwen3-0.6B's shape (with its early block
    ids over a bf16 cache, without over e4m3), compiled for sm90 by Triton's own ptxas."""
    from kernels.decode_attention import FOUR_WARP_PROGRAMS_PER_SM

    out = _run_in_child("_decode_shared", cache_type, early_table,
                        env=dict(TRITON_DUMP_PTXAS_LOG="1", TRITON_CACHE_DIR=str(tmp_path)))
    used, shared = re.search(r"Used (\d+) registers", out), re.search(r"shared=(\d+)", out)
    assert used and shared, out[-2000:]
    registers, shared = int(used.group(1)), int(shared.group(1))
    threads = 4 * 32
    assert FOUR_WARP_PROGRAMS_PER_SM * threads * -(-registers // 8) * 8 <= SM90_REGISTERS, registers
    assert FOUR_WARP_PROGRAMS_PER_SM * (shared + SHARED_PER_BLOCK) <= SM90_SHARED, shared


# Projections whose launches hold their whole band of W (rows of W, K, norm taken in, SiLU-mul, rows of x):
# at one row Qwen3-0.6B's qkv, o, gate_up and down, Qwen3-30B-A3B's qkv and o, Qwen3-8B's qkv and o; at two rows
# Qwen3-0.6B's o and down and Qwen3-30B-A3B's o, and (the norm taken in) Qwen3-0.6B's qkv and gate_up.
WHOLE_BAND_PROJECTIONS = [(4096, 1024, True, False, 1), (1024, 2048, False, False, 1), (6144, 1024, True, True, 1),
                          (1024, 3072, False, False, 1), (5120, 2048, True, False, 1), (2048, 4096, False, False, 1),
                          (6144, 4096, True, False, 1), (4096, 4096, False, False, 1),
                          (1024, 2048, False, False, 2), (1024, 3072, False, False, 2), (2048, 4096, False, False, 2),
                          (4096, 1024, True, False, 2), (6144, 1024, True, True, 2)]


@pytest.mark.parametrize("rows_w, K, norm, silu, rows", WHOLE_BAND_PROJECTIONS)
def test_the_whole_band_gemv_launches_hold_their_band_and_spill_nothing(rows_w, K, norm, silu, rows, tmp_path):
    """A one-row (or two-row) GEMV launch on a GPU with PDL loads its whole band of W, up to 16,384
    elements a program, into registers before its wait (kernels/gemv.py says why): a spill would
    send part of it to local memory and back after the wait. Its one step's products are summed as
    they are formed, so no fp32 tile of them is held besides: at most 168 registers, 3 programs of
    4 warps a SM (the tile took 232-239 at the larger one-row projections). Compiled for sm90 as
    launched, by Triton's own ptxas."""
    out = _run_in_child("_gemv_ptxas_log", rows_w, K, norm, silu, rows,
                        env=dict(TRITON_DUMP_PTXAS_LOG="1", TRITON_CACHE_DIR=str(tmp_path)))
    used = re.search(r"Used (\d+) registers", out)
    assert used and int(used.group(1)) <= 168, out[-2000:]
    assert not re.search(r"\b[1-9]\d* bytes spill (stores|loads)", out), out[-2000:]


# One-row FP8 products (rows of W, K, norm taken in): Qwen3-8B-FP8's qkv, o and down, and
# Qwen3-30B-A3B-FP8's qkv with its pre-norm (kernels.fp8.one_row_fuses_norm).
FP8_ONE_ROW_PROJECTIONS = [(6144, 4096, False), (4096, 4096, False), (4096, 12288, False), (5120, 2048, True)]


@pytest.mark.parametrize("rows_w, K, norm", FP8_ONE_ROW_PROJECTIONS)
def test_the_one_row_fp8_gemv_launches_spill_nothing(rows_w, K, norm, tmp_path):
    """The one-row FP8 GEMV loads its first step of W (8 rows of up to 4,096 e4m3 columns) before its
    wait and sums each step's products as they are formed: at most 168 registers, 3 programs of 4
    warps a SM, and nothing spilled, with the norm's prologue as without it. Compiled for sm90 as
    launched, by Triton's own ptxas."""
    out = _run_in_child("_fp8_gemv_ptxas_log", rows_w, K, norm,
                        env=dict(TRITON_DUMP_PTXAS_LOG="1", TRITON_CACHE_DIR=str(tmp_path)))
    used = re.search(r"Used (\d+) registers", out)
    assert used and int(used.group(1)) <= 168, out[-2000:]
    assert not re.search(r"\b[1-9]\d* bytes spill (stores|loads)", out), out[-2000:]


def test_prefill_over_an_fp8_cache_widens_e4m3_once_to_fp16():
    """With bf16 queries over an e4m3 cache the products run in fp16: each cached value is widened
    by one instruction, never on to bf16 (`cvt.bf16.f16`, a second conversion per value)."""
    ptx = _run_in_child("_prefill_ptx", "fp8e4nv")
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert "cvt.bf16.f16" not in ptx


def test_pdl_first_lets_the_next_kernel_launch_before_the_weights_and_the_wait():
    """pdl.FIRST (launches of at most pdl.FIRST_ROWS rows): the trigger comes ahead
    of the weight loads and the wait; pdl.AFTER_WAIT: the weights load, then the wait, then the
    trigger."""
    from kernels import pdl

    first = _run_in_child("_gemv_ptx", pdl.FIRST)
    assert first.index("griddepcontrol.launch_dependents") < first.index("ld.global") \
        < first.index("griddepcontrol.wait")
    after = _run_in_child("_gemv_ptx", pdl.AFTER_WAIT)
    assert after.index("ld.global") < after.index("griddepcontrol.wait") \
        < after.index("griddepcontrol.launch_dependents")
    assert first.count("griddepcontrol.launch_dependents") == after.count("griddepcontrol.launch_dependents") == 1
