"""The KV cache's lower tiers on a CUDA device: saves and loads on copy streams of their own, pinned
host memory allocated a piece at a time while the engine is idle, steps that wait on events for the
copies they depend on. A block brought back from the host or from disk holds the very bytes it held
when it was computed, and decodes as a hit in the device's own cache does. Skipped without a CUDA device (TP=2 without two)."""
import pytest
import torch

from benchmarks.common import CONFIGS
from engine import LLM, SamplingParams
from engine.core.block_manager import chain_hash
from tests.conftest import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
# Qwen3-0.6B's shape with random weights: 1.8 MiB blocks of 16 tokens, so a 4,096-token prompt's
# 256 blocks go through several staging buffers and host pieces.
MODEL = str(CONFIGS / "qwen3-0.6b")
SHAPE = dict(device="cuda", load_format="random", dtype="bfloat16", max_model_len=8192, max_num_seqs=16,
             num_kvcache_blocks=400)
VOCAB = 150000
LONG, OTHER = 4096, 1000  # prompt lengths: 8 others fill the 400-block pool past the long one


def hashes(prompt, block_size):
    out, previous = [], None
    for i in range((len(prompt) - 1) // block_size):
        previous = chain_hash(previous, prompt[i * block_size:(i + 1) * block_size])
        out.append(previous)
    return out


def kv_of(llm, prompt) -> torch.Tensor:
    """The K/V of the prompt's cached full blocks as the device holds them, once every queued copy has run."""
    if llm.runner.kv_cache.is_cuda:
        torch.cuda.synchronize()
    ids = [llm.blocks.hash_to_block[h] for h in hashes(prompt, llm.block_size)]
    return llm.runner.kv_cache[:, :, ids].clone()


def evict(llm, prompt, others) -> None:
    for other in others:
        llm.generate([other], ONE)
    assert llm.blocks.lookup_prefix(llm.make_sequence(prompt)) == []


def test_blocks_come_back_from_pinned_host_memory_bit_for_bit_and_decode_as_device_hits():
    prompt = random_prompts([LONG], vocab=VOCAB, seed=1)[0]
    others = random_prompts([OTHER] * 8, vocab=VOCAB, seed=2)
    with LLM(MODEL, host_cache_gib=2, **SHAPE) as llm:
        host = llm.runner.tiers.host
        assert host.allocated_slots == host.per_chunk  # one piece pinned at start-up, the rest while idle
        llm.generate([prompt], ONE)
        assert host.allocated_slots == 2 * host.per_chunk  # the step that left the engine idle pinned one
        assert llm.tiers.host.usable_slots == host.allocated_slots
        computed = kv_of(llm, prompt)
        device_hit = llm.generate([prompt], GREEDY)[0]["token_ids"]
        evict(llm, prompt, others)
        assert host.allocated_bytes > 0 and host.pinned == llm.runner.kv_cache.is_cuda
        before = llm.stats().host_hit_tokens
        restored = llm.generate([prompt], GREEDY)[0]["token_ids"]
        assert llm.stats().host_hit_tokens - before == len(hashes(prompt, llm.block_size)) * llm.block_size
        assert torch.equal(kv_of(llm, prompt), computed)
    assert restored == device_hit


def test_blocks_reused_right_after_their_saves_ahead_come_back_intact():
    """Rounds of batched prompts cycle a small pool: the free list's next blocks are saved a step
    ahead on the save stream while steps reuse blocks saved before (waiting for those saves); then
    prompts restored in one batch load while others run, or wait for their copies."""
    length = OTHER * 7 // 10
    firsts = random_prompts([length] * 6, vocab=VOCAB, seed=3)
    rounds = [random_prompts([length] * 6, vocab=VOCAB, seed=10 + r) for r in range(3)]
    pool = 6 * -(-(length + 40) // 16) + 10  # one round's blocks, and a few more
    with LLM(MODEL, host_cache_gib=2, **{**SHAPE, "num_kvcache_blocks": pool}) as llm:
        llm.generate(firsts, ONE)
        computed = [kv_of(llm, p) for p in firsts]
        for batch in rounds:
            llm.generate(batch, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        before = llm.stats().host_hit_tokens
        llm.generate(firsts[:3] + rounds[0][:3], ONE)
        assert llm.stats().host_hit_tokens > before
        for p, kv in zip(firsts[:3], computed):
            assert torch.equal(kv_of(llm, p), kv)


def test_a_restored_conversation_waits_for_its_copies_while_a_stream_decodes():
    """The oracle is the same schedule with the prompt a device hit: in bf16 a row's tokens depend
    on the batch it decodes in (one row and two take different GEMV kernels), so the restored prompt
    is compared with itself decoding beside the stream, not alone. (The stream's own tokens differ
    between the two runs: the second run finds its prompt cached.)"""
    stream_prompt = random_prompts([50], vocab=VOCAB, seed=4)[0]
    stream_params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompt = random_prompts([LONG], vocab=VOCAB, seed=5)[0]
    others = random_prompts([OTHER] * 8, vocab=VOCAB, seed=6)

    def beside_the_stream(llm, expect_hold):
        stream = llm.add_request(stream_prompt, stream_params)
        while stream.num_completion_tokens < 4:
            llm.step()
        request = llm.add_request(prompt, GREEDY)
        llm.step()
        if expect_hold:  # admitted, its blocks copied on the load stream while the stream decodes
            assert request in llm.scheduler.running and llm.last_step_tokens == (0, 1)
        while not (stream.is_finished and request.is_finished):
            llm.step()
        assert stream.num_completion_tokens == stream_params.max_tokens
        return request.completion_token_ids

    with LLM(MODEL, host_cache_gib=2, **SHAPE) as llm:
        llm.generate([prompt], ONE)
        computed = kv_of(llm, prompt)
        device_hit = beside_the_stream(llm, expect_hold=False)
        evict(llm, prompt, others)
        before = llm.stats().host_hit_tokens
        restored = beside_the_stream(llm, expect_hold=True)
        assert llm.stats().host_hit_tokens > before
        assert torch.equal(kv_of(llm, prompt), computed)
    assert restored == device_hit


def test_blocks_come_back_from_disk_after_a_restart_bit_for_bit(tmp_path):
    prompt = random_prompts([LONG // 2], vocab=VOCAB, seed=7)[0]
    with LLM(MODEL, disk_cache_dir=str(tmp_path), **SHAPE) as llm:
        llm.generate([prompt], ONE)
        computed = kv_of(llm, prompt)
        device_hit = llm.generate([prompt], GREEDY)[0]["token_ids"]
    with LLM(MODEL, disk_cache_dir=str(tmp_path), **SHAPE) as llm:
        restored = llm.generate([prompt], GREEDY)[0]["token_ids"]
        assert llm.stats().disk_hit_tokens == len(hashes(prompt, llm.block_size)) * llm.block_size
        assert torch.equal(kv_of(llm, prompt), computed)
    assert restored == device_hit


def test_a_prefetch_beside_a_decoding_stream_brings_a_conversation_back_from_disk_bit_for_bit(tmp_path):
    """A chat reopened after a restart while another streams: its blocks are read and loaded between
    the stream's steps, and its next prompt finds them on the device."""
    prompt = random_prompts([LONG // 2], vocab=VOCAB, seed=8)[0]
    stream_prompt = random_prompts([50], vocab=VOCAB, seed=9)[0]
    with LLM(MODEL, disk_cache_dir=str(tmp_path), **SHAPE) as llm:
        llm.generate([prompt], ONE)
        computed = kv_of(llm, prompt)
        device_hit = llm.generate([prompt], GREEDY)[0]["token_ids"]
    with LLM(MODEL, disk_cache_dir=str(tmp_path), **SHAPE) as llm:
        stream = llm.add_request(stream_prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        while stream.num_completion_tokens < 4:
            llm.step()
        assert llm.prefetch(prompt) == len(prompt) // llm.block_size
        while llm.has_unfinished():
            llm.step()
        assert stream.num_completion_tokens == 64
        assert len(llm.blocks.lookup_prefix(llm.make_sequence(prompt))) == len(hashes(prompt, llm.block_size))
        assert torch.equal(kv_of(llm, prompt), computed)
        restored = llm.generate([prompt], GREEDY)[0]["token_ids"]
        assert llm.stats().disk_hit_tokens == len(hashes(prompt, llm.block_size)) * llm.block_size
    assert restored == device_hit


def test_an_idle_engine_pins_no_host_piece_while_a_prefetch_runs(tmp_path):
    """Pinning a piece of the host pool holds the engine's thread ~0.1 s: a chat reopened right after
    start-up, while the pool still grows, would get its blocks that much later."""
    prompt = random_prompts([LONG // 2], vocab=VOCAB, seed=10)[0]
    with LLM(MODEL, disk_cache_dir=str(tmp_path), **SHAPE) as llm:
        llm.generate([prompt], ONE)
    with LLM(MODEL, disk_cache_dir=str(tmp_path), **SHAPE) as llm:
        host = llm.tiers.host
        pinned = host.usable_slots
        assert pinned < host.num_slots  # pieces are left to pin
        assert llm.prefetch(prompt) == len(prompt) // llm.block_size
        steps = 0
        while llm.tiers.prefetching:
            llm.step()
            steps += 1
            assert host.usable_slots == pinned or not llm.tiers.prefetching
        assert steps and len(llm.blocks.lookup_prefix(llm.make_sequence(prompt))) == len(hashes(prompt, llm.block_size))
        llm.step()  # idle now: the pool grows again
        assert host.usable_slots > pinned


@pytest.mark.whole_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.two_gpus
def test_tensor_parallel_ranks_restore_their_shards_from_host_and_disk_over_nccl(tiny_qwen3, tmp_path):
    prompt = random_prompts([300], seed=8)[0]
    others = random_prompts([200] * 6, seed=9)
    engine = dict(device="cuda", dtype="float32", tensor_parallel_size=2, max_model_len=1024, max_num_seqs=8,
                  num_kvcache_blocks=64, kvcache_block_size=16, disk_cache_dir=str(tmp_path))
    with LLM(tiny_qwen3, host_cache_gib=0.01, **engine) as llm:
        llm.generate([prompt], ONE)
        device_hit = llm.generate([prompt], GREEDY)[0]["token_ids"]
        evict(llm, prompt, others)
        assert llm.generate([prompt], GREEDY)[0]["token_ids"] == device_hit
        assert llm.stats().host_hit_tokens > 0
    with LLM(tiny_qwen3, **engine) as llm:
        assert llm.generate([prompt], GREEDY)[0]["token_ids"] == device_hit
        assert llm.stats().disk_hit_tokens > 0
