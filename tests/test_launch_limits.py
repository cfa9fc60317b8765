"""The kernels' launch configurations against cards' limits, on CPU: every configuration the GEMV,
decode and prefill attention choose fits the shared memory of an H100, an H200, an A100 and an
RTX 4090 (by the estimates of kernels/launch_limits.py, which tests/gpu/test_launch_limits_gpu.py
holds against Triton's own figures), bf16 and fp16 keep the launches they were tuned with on the
H100 and H200, the float32 launch that failed on an H100 is estimated past its limit and no longer
chosen, and a launch past a card's limit falls back."""
import itertools

import pytest
import torch

from kernels import decode_attention, gemv, launch_limits, prefill_attention
from kernels.launch_limits import A100, H100, H200, RTX_4090, DeviceLimits

CARDS = [H100, H200, A100, RTX_4090]
HOPPER = [H100, H200]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (hidden, heads, kv_heads, head_dim, intermediate, vocab): SmolLM2-135M, Qwen3-0.6B, 1.7B, 4B, 8B, 14B, 32B.
MODELS = [(576, 9, 3, 64, 1536, 49152), (1024, 16, 8, 128, 3072, 151936), (2048, 16, 8, 128, 6144, 151936),
          (2560, 32, 8, 128, 9728, 151936), (4096, 32, 8, 128, 12288, 151936), (5120, 40, 8, 128, 17408, 151936),
          (5120, 64, 8, 128, 25600, 151936)]


def projections(hidden, heads, kv_heads, head_dim, inter, vocab):
    """(N, K, silu, norm, rows) of each GEMV a decode step of 1-8 rows runs: at one row the
    pre-norms fused into qkv and gate_up (with SiLU-mul), at more rows the plain GEMVs."""
    qkv = (heads + 2 * kv_heads) * head_dim
    for rows in range(1, 9):
        fused = rows == 1
        yield qkv, hidden, False, fused, rows
        yield heads * head_dim, hidden, False, False, rows  # o_proj's K is heads * head_dim; N is hidden
        yield 2 * inter, hidden, fused, fused, rows
        yield hidden, inter, False, False, rows
        if rows == 1:
            yield vocab, hidden, False, False, rows


def gemv_cases():
    for model in MODELS:
        for n, k, silu, norm, rows in projections(*model):
            if n == model[1] * model[3]:  # o_proj: W is [hidden, heads * head_dim]
                n, k = model[0], n
            yield n, k, silu, norm, rows


GEMV_CASES = sorted(set(gemv_cases()))


def test_the_float32_gemv_that_failed_on_an_h100_is_estimated_past_its_limit_and_no_longer_chosen():
    """SmolLM2's gate_up (3072 x 576) at 2 rows in float32 asked Triton for 294,912 bytes of the
    H100's 232,448 (issue 26): the estimate of that launch is at least that. The dot kernel now takes
    float32 at most 128 wide (512 wide it spilled registers), which fits the H100 as tuned."""
    failed = ("dot", 32, 512, 4, 4)
    assert gemv.shared_memory(failed, 2, False, False, 4) >= 294_912 > H100.max_shared_mem
    assert gemv.launch_config(3072, 576, 2, dtype=torch.float32) == ("dot", 32, 128, 4, 4)
    assert gemv.launch_config(3072, 576, 2, dtype=torch.float32, limits=H100) == ("dot", 32, 128, 4, 4)


def test_a_launch_past_a_cards_limit_keeps_its_tiles_with_fewer_stages():
    """The same shape in bf16 on an RTX 4090 (101,376 bytes): 4 stages of 32 x 512 tiles are 196,608
    bytes, 2 fit."""
    assert gemv.launch_config(3072, 576, 2, dtype=torch.bfloat16) == ("dot", 32, 512, 4, 4)
    chosen = gemv.launch_config(3072, 576, 2, dtype=torch.bfloat16, limits=RTX_4090)
    assert chosen == ("dot", 32, 512, 4, 2)
    assert gemv.shared_memory(chosen, 2, False, False, 2) <= RTX_4090.max_shared_mem


@pytest.mark.parametrize("card", CARDS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_gemv_launch_of_a_decode_step_fits_the_card(card, dtype):
    whole_band = card in HOPPER  # the GPUs with PDL take the whole-band one-row launches
    for n, k, silu, norm, rows in GEMV_CASES:
        kernel, block_n, block_k, num_warps, num_stages = config = gemv.launch_config(
            n, k, rows, silu, dtype=dtype, norm=norm, limits=card, whole_band=whole_band)
        where = f"{card.name} {dtype} N={n} K={k} rows={rows} silu={silu} norm={norm}: {config}"
        assert gemv.shared_memory(config, rows, silu, norm, dtype.itemsize) <= card.max_shared_mem, where
        assert num_warps <= card.max_warps and num_stages >= 1, where
        assert block_k <= triton_pow2(k) and block_n >= (16 if kernel == "dot" else 1), where
        assert kernel == gemv.launch_config(n, k, rows, silu)[0], where  # the kernel itself never changes


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("card", HOPPER, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("whole_band", [True, False], ids=["with_pdl", "without"])
def test_half_precision_decode_steps_keep_their_tuned_gemv_launches_on_hopper(card, dtype, whole_band):
    for n, k, silu, norm, rows in GEMV_CASES:
        assert gemv.launch_config(n, k, rows, silu, dtype=dtype, norm=norm, limits=card, whole_band=whole_band) == \
            gemv.launch_config(n, k, rows, silu, dtype=dtype, norm=norm, whole_band=whole_band), (n, k, rows, norm)


def test_a_smaller_card_gets_fewer_stages_or_narrower_tiles():
    for n, k, rows in [(4096, 2048, 8), (3072, 576, 2), (1024, 3072, 8)]:
        on_h100 = gemv.launch_config(n, k, rows, dtype=torch.bfloat16, limits=H100)
        on_4090 = gemv.launch_config(n, k, rows, dtype=torch.bfloat16, limits=RTX_4090)
        assert gemv.shared_memory(on_4090, rows, False, False, 2) < gemv.shared_memory(on_h100, rows, False, False, 2)


def test_float32_takes_the_dot_kernel_at_most_128_wide():
    for n, k, silu, norm, rows in GEMV_CASES:
        for card in (None, *CARDS):
            kernel, _, block_k, _, _ = gemv.launch_config(n, k, rows, silu, dtype=torch.float32, norm=norm, limits=card)
            assert kernel != "dot" or block_k <= 128, (n, k, rows, card)


ATTENTION_SHAPES = list(itertools.product([64, 128, 256], [1, 2, 3, 4, 5, 7, 8, 16]))  # head_dim, group


@pytest.mark.parametrize("card", CARDS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_decode_attention_launch_fits_the_card(card, dtype):
    for (head_dim, group), one_warp in itertools.product(ATTENTION_SHAPES, [False, True]):
        block_n, num_warps, num_stages, merge_tile = config = decode_attention.launch_config(
            dtype, head_dim, group, card, one_warp=one_warp)
        where = f"{card.name} {dtype} head_dim={head_dim} group={group} one_warp={one_warp}: {config}"
        assert decode_attention.shared_memory(config, group, head_dim, dtype.itemsize) <= card.max_shared_mem, where
        assert num_warps <= card.max_warps and num_stages >= 1 and block_n >= 16 and merge_tile >= 2, where


@pytest.mark.parametrize("card", [H100, H200], ids=lambda c: c.name)
def test_decode_attention_keeps_its_tuned_launch_on_hopper(card):
    for dtype, (head_dim, group) in itertools.product(DTYPES, itertools.product([64, 128], [1, 2, 3, 4, 5, 8])):
        tuned = (32, 4, 2) if dtype == torch.float32 else (64, 4, 2)
        assert decode_attention.launch_config(dtype, head_dim, group, card) == (*tuned, decode_attention.MERGE_TILE)
        assert decode_attention.launch_config(dtype, head_dim, group, card, one_warp=True) == \
            (32, 1, 2, decode_attention.MERGE_TILE)


@pytest.mark.parametrize("card", CARDS, ids=lambda c: c.name)
def test_decode_attention_over_an_fp8_cache_takes_the_same_launch_and_fits(card):
    for dtype, (head_dim, group), one_warp in itertools.product(DTYPES, ATTENTION_SHAPES, [False, True]):
        config = decode_attention.launch_config(dtype, head_dim, group, card, torch.float8_e4m3fn, one_warp)
        assert decode_attention.shared_memory(config, group, head_dim, dtype.itemsize) <= card.max_shared_mem
        assert config == decode_attention.launch_config(dtype, head_dim, group, card, one_warp=one_warp), \
            (card.name, dtype, head_dim, one_warp)


@pytest.mark.parametrize("card", CARDS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_prefill_attention_launch_fits_the_card(card, dtype):
    for (head_dim, group), tokens in itertools.product(ATTENTION_SHAPES, [1, 128, 129, 4096]):
        config = prefill_attention.launch_config(dtype, head_dim, group, tokens, card)
        where = f"{card.name} {dtype} head_dim={head_dim} group={group} tokens={tokens}: {config}"
        assert prefill_attention.shared_memory(config, head_dim, dtype.itemsize) <= card.max_shared_mem, where
        assert config.num_warps <= card.max_warps and config.num_stages >= 1 and config.block_n >= 16, where
        # tl.dot takes 16 rows at least; a tile's rows are whole padded GQA groups.
        assert config.block_m >= 16 and config.block_m == config.block_q * triton_pow2(group), where


@pytest.mark.parametrize("card", [H100, H200], ids=lambda c: c.name)
def test_prefill_attention_keeps_its_tuned_launches_on_hopper(card):
    for dtype, tokens in itertools.product([torch.float16, torch.bfloat16], [1, 128, 129, 4096]):
        config = prefill_attention.launch_config(dtype, 128, 2, tokens, card)
        big = tokens > prefill_attention.SMALL_STEP_TOKENS
        assert (config.block_m, config.block_n, config.num_warps, config.num_stages, config.per_sm) == \
            ((128, 128, 8, 2, 1) if big else (64, 64, 4, 3, 2)), (dtype, tokens)
    config = prefill_attention.launch_config(torch.float32, 128, 2, 4096, card)
    assert (config.block_m, config.block_n, config.num_warps, config.num_stages) == (32, 32, 8, 2)


def test_a_card_too_small_for_any_launch_is_named_in_the_error():
    tiny = DeviceLimits("a tiny card", 4096)
    with pytest.raises(ValueError, match=r"no launch configuration of the dot GEMV .* fits a tiny card \(4096 bytes"):
        gemv.launch_config(6144, 1024, 8, dtype=torch.float32, limits=tiny)


def test_configs_off_cuda_are_the_interpreters_own():
    """On CPU (Triton's interpreter) there are no limits and the launches stay small."""
    assert launch_limits.device_limits(torch.device("cpu")) is None
    assert decode_attention.launch_config(torch.float32, 128, 2, None) == (32, 1, 1, decode_attention.MERGE_TILE)
    config = prefill_attention.launch_config(torch.bfloat16, 128, 2, 4096, None)
    assert (config.block_m, config.block_n, config.num_warps, config.num_stages) == (32, 32, 1, 1)


def test_a_block_is_never_given_more_warps_than_its_registers_allow():
    """ptxas gives a thread at most 255 registers, so 8 warps always fit 65,536 registers; more
    might not."""
    assert H100.max_warps == 8 and H100.fits(0, 8) and not H100.fits(0, 16)


def test_one_row_launches_take_all_of_k_only_on_gpus_with_pdl():
    """On a GPU with PDL a one-row projection's programs each load their whole band of W, all of K,
    before the wait (kernels/gemv.py); elsewhere they keep the launches tuned without PDL. Qwen3-0.6B's
    qkv, o and down projections, and gate/up with SiLU."""
    for n, k, silu in ((4096, 1024, False), (1024, 2048, False), (1024, 3072, False), (6144, 1024, True)):
        whole = kernel, block_n, block_k, _, num_stages = gemv.launch_config(n, k, 1, silu, whole_band=True)
        assert kernel == "one" and block_k >= k and num_stages == 1
        assert block_n * block_k * (2 if silu else 1) <= gemv.WHOLE_BAND_ELEMENTS
        tuned = gemv.launch_config(n, k, 1, silu, whole_band=False)
        assert tuned[0] == "one" and tuned[4] > 1 and tuned != whole
    # the LM head is not a whole band anywhere
    assert gemv.launch_config(151936, 1024, 1, whole_band=True) == gemv.launch_config(151936, 1024, 1)


def test_two_row_launches_take_all_of_k_on_gpus_with_pdl_and_three_or_four_rows_keep_their_tiles():
    """At two rows the FMA kernel's programs take all of K in one step (Qwen3-0.6B's o and down,
    Qwen3-30B-A3B's o) where the GPU has PDL; three and four rows, and GPUs without PDL, keep steps
    of 1,024, and projections of more than 2,048 rows keep the tensor-core kernel (without the norm
    taken in; with it, kernels.gemv.fuses_norm says which take the FMA kernel)."""
    for n, k in ((1024, 2048), (1024, 3072), (2048, 4096)):
        kernel, block_n, block_k, _, _ = gemv.launch_config(n, k, 2, whole_band=True)
        assert kernel == "fma" and block_k >= k and block_n * block_k <= gemv.WHOLE_BAND_ELEMENTS
        for rows, whole_band in ((2, False), (3, True), (4, True)):
            assert gemv.launch_config(n, k, rows, whole_band=whole_band)[:3] == ("fma", 2, 1024)
    assert gemv.launch_config(4096, 1024, 2, whole_band=True)[0] == "dot"
    assert gemv.launch_config(2048, 6144, 2, whole_band=True)[2] == 1024  # K past the whole band
