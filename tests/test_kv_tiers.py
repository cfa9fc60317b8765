"""The KV cache's lower tiers on CPU: a prefix the device's pool evicted comes back from host memory,
or after a restart from disk, and gives exactly the tokens a cold run computes (float32, greedy);
a corrupt or foreign file on disk is skipped and removed; tensor-parallel ranks restore their shards."""
import threading

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.block_manager import BlockManager, chain_hash
from engine.core.kv_tiers import FETCHING, DiskTier, KVTiers
from engine.core.sequence import Sequence
from engine.runner.kv_tiers import DiskStore
from tests.conftest import INJECTED_FAULT, fail_next_launch, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BLOCK = 8
# 24 blocks of 8 tokens: the long prompt (15 blocks) and three of the others fill it.
SMALL = dict(device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=24, max_model_len=256)
LONG = random_prompts([120], seed=31)[0]
OTHERS = random_prompts([60] * 4, seed=32)
LONG_HIT_TOKENS = (len(LONG) - 1) // BLOCK * BLOCK  # its full blocks but the one holding its last token
# The tiny model's K/V: 2 layers x 2 heads x 16 dims x (K, V) x 4 bytes = 512 bytes a token.
HOST_64_BLOCKS = 64 * BLOCK * 512 / 2**30


@pytest.fixture(scope="module")
def cold(tiny_qwen3):
    """Completions computed from scratch, by an engine with no lower tier."""
    memo = {}

    def complete(prompt, params=GREEDY):
        key = (tuple(prompt), params.max_tokens)
        if key not in memo:
            with LLM(tiny_qwen3, **SMALL) as llm:
                assert llm.tiers is None
                memo[key] = llm.generate([prompt], params)[0]["token_ids"]
        return memo[key]
    return complete


def evict_long_prompt(llm) -> None:
    for other in OTHERS:
        llm.generate([other], GREEDY)
    assert llm.blocks.lookup_prefix(llm.make_sequence(LONG)) == []  # none of its blocks left on the device


def block_files(directory, prompt) -> list:
    """The disk tier's files (rank 0's) for the prompt's full blocks, in order."""
    [fingerprint_dir] = directory.iterdir()
    hashes, previous = [], None
    for i in range((len(prompt) - 1) // BLOCK):
        previous = chain_hash(previous, prompt[i * BLOCK:(i + 1) * BLOCK])
        hashes.append(previous)
    return [fingerprint_dir / f"{h:016x}.0.safetensors" for h in hashes]


def test_the_tiers_are_off_on_cpu_unless_asked_for(tiny_qwen3):
    with LLM(tiny_qwen3, **SMALL) as llm:
        assert llm.config.host_cache_gib == 0 and llm.config.disk_cache_dir is None
        assert llm.tiers is None and llm.runner.tiers is None
        stats = llm.stats()
        assert (stats.host_capacity_blocks, stats.disk_capacity_bytes) == (0, 0)


def test_bad_tier_settings_are_named_before_the_model_loads(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"disk_cache_dir .*a-file/kv can't be used .*disk_cache_gib to 0"):
        LLM(tmp_path / "never-read", disk_cache_dir=str(tmp_path / "a-file" / "kv"))
    with pytest.raises(ValueError, match="host_cache_gib must be zero or more, got -1"):
        LLM(tmp_path / "never-read", host_cache_gib=-1)


def test_an_evicted_prefix_comes_back_from_the_host_tier_with_the_same_tokens(tiny_qwen3, cold):
    with LLM(tiny_qwen3, host_cache_gib=HOST_64_BLOCKS, **SMALL) as llm:
        assert llm.generate([LONG], GREEDY)[0]["token_ids"] == cold(LONG)
        evict_long_prompt(llm)
        before = llm.stats()
        seq = llm.add_request(LONG, GREEDY)
        while not seq.is_finished:
            llm.step()
        after = llm.stats()
    assert seq.completion_token_ids == cold(LONG)
    assert seq.num_cached_tokens == LONG_HIT_TOKENS
    assert after.host_hit_tokens - before.host_hit_tokens == LONG_HIT_TOKENS
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == LONG_HIT_TOKENS
    assert after.disk_hit_tokens == 0


def test_a_prompt_whose_blocks_come_back_waits_for_its_copies_while_another_stream_decodes(tiny_qwen3, cold):
    stream_prompt = random_prompts([20], seed=33)[0]
    stream_params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(tiny_qwen3, host_cache_gib=HOST_64_BLOCKS, **SMALL) as llm:
        llm.generate([LONG], GREEDY)
        evict_long_prompt(llm)
        stream = llm.add_request(stream_prompt, stream_params)
        while stream.num_completion_tokens < 3:
            llm.step()
        long_seq = llm.add_request(LONG, GREEDY)
        llm.step()  # admits it: its blocks are copied back while the stream decodes alone
        assert long_seq in llm.scheduler.running and long_seq.num_computed_tokens == LONG_HIT_TOKENS
        assert llm.last_step_tokens == (0, 1)
        llm.step()  # its copies have ended: its last tokens run beside the stream's
        assert llm.last_step_tokens == (len(LONG) - LONG_HIT_TOKENS, 1)
        while not (stream.is_finished and long_seq.is_finished):
            llm.step()
        assert llm.stats().host_hit_tokens == LONG_HIT_TOKENS
    assert long_seq.completion_token_ids == cold(LONG)
    assert stream.completion_token_ids == cold(stream_prompt, stream_params)


@pytest.mark.parametrize("fails", ["before its copies are queued", "after its copies are queued"])
def test_a_step_that_fails_around_its_copies_leaves_the_tiers_serving_the_right_blocks(tiny_qwen3, cold, fails):
    with LLM(tiny_qwen3, host_cache_gib=HOST_64_BLOCKS, **SMALL) as llm:
        llm.generate([LONG], GREEDY)
        evict_long_prompt(llm)
        if fails == "before its copies are queued":
            transfer = llm.runner.transfer

            def fail(kv):
                llm.runner.transfer = transfer
                raise RuntimeError(INJECTED_FAULT)
            llm.runner.transfer = fail
        else:
            fail_next_launch(llm)
        with pytest.raises(RuntimeError, match=INJECTED_FAULT):
            llm.generate([LONG], GREEDY)
        before = llm.stats().host_hit_tokens
        assert llm.generate([LONG], GREEDY)[0]["token_ids"] == cold(LONG)
        assert llm.stats().host_hit_tokens - before == LONG_HIT_TOKENS


def test_after_a_restart_a_conversation_prefills_only_its_new_message_from_disk(tiny_qwen3, cold, tmp_path):
    new_message = random_prompts([6], seed=34)[0]
    with LLM(tiny_qwen3, disk_cache_dir=str(tmp_path), **SMALL) as llm:
        assert llm.config.host_cache_gib == 0 and llm.tiers.host.num_slots > 0  # slots for disk reads to land in
        reply = llm.generate([LONG], GREEDY)[0]["token_ids"]
    assert reply == cold(LONG)
    assert all(f.exists() for f in block_files(tmp_path, LONG))
    second_turn = LONG + reply + new_message
    with LLM(tiny_qwen3, disk_cache_dir=str(tmp_path), **SMALL) as llm:
        assert llm.stats().disk_bytes > 0
        outs = llm.generate([second_turn], GREEDY)
        stats = llm.stats()
    # Every full block of the first turn's prompt and reply came from disk: the prefill was the
    # new message and the first turn's last partial block.
    history_hits = (len(LONG) + len(reply) - 1) // BLOCK * BLOCK
    assert stats.disk_hit_tokens == stats.prefix_hit_tokens == history_hits
    assert outs[0]["token_ids"] == cold(second_turn)


def prefetch_and_wait(llm, prompt) -> int:
    """LLM.prefetch, then the steps that carry it on (an idle engine thread runs them as well)."""
    started = llm.prefetch(prompt)
    while llm.has_unfinished():
        llm.step()
    return started


def test_a_conversation_prefetched_after_a_restart_is_on_the_device_before_its_next_message(
        tiny_qwen3, cold, tmp_path):
    new_message = random_prompts([6], seed=36)[0]
    with LLM(tiny_qwen3, disk_cache_dir=str(tmp_path), **SMALL) as llm:
        reply = llm.generate([LONG], GREEDY)[0]["token_ids"]
    history = LONG + reply
    history_blocks = (len(history) - 1) // BLOCK  # the reply's last token never ran: its block is not full
    with LLM(tiny_qwen3, disk_cache_dir=str(tmp_path), **SMALL) as llm:
        assert prefetch_and_wait(llm, history) == history_blocks
        # On the device as cached blocks, with no request run: nothing computed, nothing counted yet.
        assert len(llm.blocks.lookup_prefix(llm.make_sequence(history + new_message))) == history_blocks
        assert llm.stats().prompt_tokens == llm.stats().disk_hit_tokens == 0
        assert prefetch_and_wait(llm, history) == 0  # all there already
        outs = llm.generate([history + new_message], GREEDY)
        stats = llm.stats()
    assert stats.disk_hit_tokens == stats.prefix_hit_tokens == history_blocks * BLOCK
    assert outs[0]["token_ids"] == cold(history + new_message)


def test_a_prefetch_brings_an_evicted_prefix_back_from_the_host_tier(tiny_qwen3, cold):
    with LLM(tiny_qwen3, **SMALL) as llm:
        assert llm.prefetch(LONG) == 0  # no lower tier: nothing to bring back
    with LLM(tiny_qwen3, host_cache_gib=HOST_64_BLOCKS, **SMALL) as llm:
        llm.generate([LONG], GREEDY)
        evict_long_prompt(llm)
        assert prefetch_and_wait(llm, LONG) == len(LONG) // BLOCK
        assert len(llm.blocks.lookup_prefix(llm.make_sequence(LONG))) == LONG_HIT_TOKENS // BLOCK
        before = llm.stats()
        assert llm.generate([LONG], GREEDY)[0]["token_ids"] == cold(LONG)
        after = llm.stats()
    assert after.host_hit_tokens - before.host_hit_tokens == LONG_HIT_TOKENS
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == LONG_HIT_TOKENS
    assert after.disk_hit_tokens == 0


def test_tensor_parallel_ranks_prefetch_their_shards_from_disk(tiny_qwen3, cold, tmp_path):
    with LLM(tiny_qwen3, tensor_parallel_size=2, disk_cache_dir=str(tmp_path), **SMALL) as llm:
        reply = llm.generate([LONG], GREEDY)[0]["token_ids"]
    history = LONG + reply
    with LLM(tiny_qwen3, tensor_parallel_size=2, disk_cache_dir=str(tmp_path), **SMALL) as llm:
        assert prefetch_and_wait(llm, history) == (len(history) - 1) // BLOCK
        outs = llm.generate([history], GREEDY)
        stats = llm.stats()
    assert stats.disk_hit_tokens == stats.prefix_hit_tokens == (len(history) - 1) // BLOCK * BLOCK
    assert outs[0]["token_ids"] == cold(history)


def test_corrupt_and_foreign_files_on_disk_are_skipped_removed_and_computed_instead(tiny_qwen3, cold, tmp_path):
    with LLM(tiny_qwen3, disk_cache_dir=str(tmp_path), **SMALL) as llm:
        llm.generate([LONG], GREEDY)
    files = block_files(tmp_path, LONG)
    flipped, cut_short, other_model, other_block, not_safetensors = 5, 7, 9, 11, 12
    data = bytearray(files[flipped].read_bytes())
    data[-1] ^= 0xFF
    files[flipped].write_bytes(bytes(data))
    files[cut_short].write_bytes(files[cut_short].read_bytes()[:-100])
    # Another model's block under this one's name: its fingerprint differs.
    [fingerprint] = [d.name for d in tmp_path.iterdir()]
    other = DiskStore(tmp_path, "0" * 32, 0, (2, 2, BLOCK, 2, 16), torch.float32)
    other_hash = int(files[other_model].name[:16], 16)
    other.write(other_hash, LONG[other_model * BLOCK:(other_model + 1) * BLOCK], torch.randn(2, 2, BLOCK, 2, 16), None)
    other.drain()
    other.close()
    (tmp_path / ("0" * 32) / files[other_model].name).replace(files[other_model])
    files[other_block].write_bytes(files[3].read_bytes())  # this model's, but another block's
    files[not_safetensors].write_bytes(b"not a safetensors file" * 200)

    with LLM(tiny_qwen3, disk_cache_dir=str(tmp_path), **SMALL) as llm:
        seq = llm.add_request(LONG, GREEDY)
        while seq.num_computed_tokens == 0:  # its blocks are read (and checked) before it is admitted
            llm.step()
        assert llm.stats().disk_hit_tokens == flipped * BLOCK  # up to the first bad file
        for bad in (flipped, cut_short, other_model, other_block, not_safetensors):
            assert not files[bad].exists(), f"block {bad}'s file was kept"
        assert all(files[i].exists() for i in range(len(files)) if i < flipped or i in (6, 8, 10, 13))
        while not seq.is_finished:
            llm.step()
    assert seq.completion_token_ids == cold(LONG)
    assert tmp_path.joinpath(fingerprint).is_dir()


def test_the_disk_tier_keeps_to_its_cap(tiny_qwen3, tmp_path):
    cap_gib = 6 * 5000 / 2**30  # six blocks' files (4 KiB of K/V and a header each)
    with LLM(tiny_qwen3, disk_cache_dir=str(tmp_path), disk_cache_gib=cap_gib, **SMALL) as llm:
        for prompt in [LONG, *OTHERS]:
            llm.generate([prompt], GREEDY)
        assert llm.stats().disk_bytes <= cap_gib * 2**30
    on_disk = list(tmp_path.glob("*/*.safetensors"))
    assert 0 < len(on_disk) <= 6
    assert sum(f.stat().st_size for f in on_disk) <= cap_gib * 2**30


def test_tensor_parallel_ranks_restore_their_shards_from_host_and_then_disk(tiny_qwen3, cold, tmp_path):
    more_others = random_prompts([60] * 12, seed=35)
    # max_model_len 512 gives 65 host slots (a full-length prompt's blocks, for reads from disk):
    # the long prompt's 14 and the first four others' 28 fit; the next twelve others' 84 push them out.
    with LLM(tiny_qwen3, tensor_parallel_size=2, disk_cache_dir=str(tmp_path),
             **{**SMALL, "max_model_len": 512}) as llm:
        assert llm.generate([LONG], GREEDY)[0]["token_ids"] == cold(LONG)
        evict_long_prompt(llm)
        assert llm.generate([LONG], GREEDY)[0]["token_ids"] == cold(LONG)
        assert (llm.stats().host_hit_tokens, llm.stats().disk_hit_tokens) == (LONG_HIT_TOKENS, 0)
        for other in more_others:
            llm.generate([other], GREEDY)
        assert llm.generate([LONG], GREEDY)[0]["token_ids"] == cold(LONG)
        assert (llm.stats().host_hit_tokens, llm.stats().disk_hit_tokens) == (LONG_HIT_TOKENS, LONG_HIT_TOKENS)
    assert {f.name.split(".")[1] for f in tmp_path.glob("*/*.safetensors")} == {"0", "1"}  # each rank its shard


def test_no_save_of_a_step_lands_in_a_host_slot_that_a_load_of_the_same_step_reads():
    """The runner makes a step's saves before its loads: a save that evicted an entry a load reads
    would hand the load another block's K/V. (The scheduling core alone, no model.)"""
    size = 4
    blocks = BlockManager(num_blocks=11, block_size=size)
    tiers = KVTiers(blocks, host_slots=4)

    def cached(tokens) -> Sequence:
        """A prompt whose full blocks are computed and back in the free list, cached."""
        seq = Sequence(tokens, SamplingParams(), size)
        blocks.allocate(seq, [], len(tokens))
        blocks.register_scheduled(seq, len(tokens))
        blocks.launched()
        blocks.free_blocks_of(seq)
        return seq

    first = list(range(1, 18))  # 4 full blocks and one token
    cached(first)
    cached(list(range(100, 123)))  # 5 more full blocks and a partial one: the pool is all cached blocks
    taker = Sequence(list(range(200, 217)), SamplingParams(), size)
    blocks.allocate(taker, [], 17)  # takes the first prompt's 5 blocks back: its 4 full ones are saved
    assert len(tiers.take_transfers().saves) == 4
    tiers.queued()
    blocks.free_blocks_of(taker)

    again = Sequence(first, SamplingParams(), size)
    found = tiers.lookup(again, 0)
    assert len(found) == 4 and blocks.lookup_prefix(again) == []
    tiers.admit(again, [], found, 17, hold=False, count=True)
    other = Sequence(list(range(300, 317)), SamplingParams(), size)
    blocks.allocate(other, [], 17)  # evicts more cached blocks in the same step: their saves need slots
    kv = tiers.take_transfers()
    assert len(kv.loads) == 4
    assert not {slot for _, slot in kv.saves} & {slot for slot, _ in kv.loads}
    tiers.queued()
    assert all(entry.pins == 0 for entry in tiers.host.entries.values())


def test_the_host_tier_saves_only_into_slots_whose_memory_the_runner_has_allocated():
    """On a GPU the host pool is pinned a piece at a time while the engine is idle (pinning stalls the
    device's work): until a piece is there, its slots are not handed out, and a block with no slot
    to go to is simply not saved. (The scheduling core alone, no model.)"""
    size = 4
    blocks = BlockManager(num_blocks=9, block_size=size)
    tiers = KVTiers(blocks, host_slots=8, usable_host_slots=2)

    def cycle(start) -> tuple[list[int], int]:
        """Caches a prompt of 8 full blocks (and one token), then has them all handed out again:
        (the host slots its saves went to, in order, the host tier's entries after)."""
        seq = Sequence(list(range(start, start + 33)), SamplingParams(), size)
        blocks.allocate(seq, [], 33)
        blocks.register_scheduled(seq, 33)
        blocks.launched()
        blocks.free_blocks_of(seq)
        taker = Sequence(list(range(start + 1000, start + 1033)), SamplingParams(), size)
        blocks.allocate(taker, [], 33)
        saves = tiers.take_transfers().saves
        tiers.queued()
        blocks.free_blocks_of(taker)
        return sorted(slot for _, slot in saves), len(tiers.host)

    # One copy per slot: a step evicting more blocks than there are slots saves as many as fit,
    # rather than copy blocks into slots its later copies overwrite.
    assert cycle(0) == ([0, 1], 2)
    tiers.host.grow(6)
    assert cycle(5000) == (list(range(6)), 6)  # over the first prompt's two: each slot once
    tiers.host.grow(100)  # never past the tier's size
    assert tiers.host.usable_slots == 8
    assert cycle(9000) == (list(range(8)), 8)


def test_each_block_read_from_disk_is_loaded_to_the_device_while_the_rest_are_still_read():
    """A block is loaded as soon as its read ends (restored ahead, as a cached block under its hash),
    not once the prompt's last read has: the copies to the device overlap the reads. The prompt
    waits until all its blocks are in, then takes them as device hits, counted as disk hits.
    (The scheduling core alone, no model.)"""
    size = 4
    blocks = BlockManager(num_blocks=12, block_size=size)
    prompt = list(range(1, 18))  # 4 full blocks and one token
    hashes, previous = [], None
    for i in range(4):
        previous = chain_hash(previous, prompt[i * size:(i + 1) * size])
        hashes.append(previous)
    tiers = KVTiers(blocks, host_slots=8, disk=DiskTier(1 << 30, 100, [(h, 100, 0.0) for h in hashes]))
    seq = Sequence(prompt, SamplingParams(), size)

    assert tiers.lookup(seq, 0) is FETCHING
    fetches = tiers.take_transfers().fetches
    assert [h for h, _, _ in fetches] == hashes
    tiers.queued()

    tiers.io_done([("fetched", hashes[0], True), ("fetched", hashes[2], True)])
    loads = tiers.take_transfers().loads
    tiers.queued()
    assert len(loads) == 2
    restored = [block for _, block in loads]
    assert blocks.lookup_prefix(seq) == restored[:1]  # block 1 is still being read
    assert tiers.lookup(seq, 1) is FETCHING
    assert blocks.num_free_blocks == 12  # restored blocks are cached blocks in the free list

    tiers.io_done([("fetched", hashes[1], True), ("fetched", hashes[3], True)])
    loads = tiers.take_transfers().loads
    tiers.queued()
    restored = [restored[0], loads[0][1], restored[1], loads[1][1]]
    hits = blocks.lookup_prefix(seq)
    assert hits == restored
    assert tiers.lookup(seq, len(hits)) == []
    assert tiers.restores(hits, [])  # its loads are not waited for yet: its first step waits for them
    tiers.admit(seq, hits, [], 17, hold=False, count=True)
    kv = tiers.take_transfers()
    assert kv.wait_loads > tiers.loads_waited
    tiers.queued()
    assert tiers.disk_hit_tokens == 16 and tiers.host_hit_tokens == 0
    assert list(seq.block_table[:4]) == restored


def test_disk_reads_go_ahead_of_the_writes_queued_before_them(tmp_path):
    """A resumed prompt waits for its reads; nobody waits for a write. The disk thread is held in a
    write (its `after` gate stands for the device copy that fills the slot) while more writes and
    then a read are queued: the read ends before any of the queued writes."""
    shape = (2, 2, BLOCK, 2, 16)
    store = DiskStore(tmp_path, "f" * 32, 0, shape, torch.float32)
    try:
        stored = torch.randn(shape)
        store.write(1, range(BLOCK), stored, None)
        store.drain()
        assert store.poll() == [("written", 1, True, store.path(1).stat().st_size)]

        class Gate:
            """Stands for a CUDA event: the write waits on it."""
            def __init__(self):
                self.reached, self.opened = threading.Event(), threading.Event()

            def synchronize(self):
                self.reached.set()
                self.opened.wait()
        gate = Gate()
        store.write(2, range(BLOCK), torch.randn(shape), gate)
        gate.reached.wait()
        for block_hash in (3, 4, 5):
            store.write(block_hash, range(BLOCK), torch.randn(shape), None)
        target = torch.full(shape, float("nan"))
        store.fetch(1, range(BLOCK), target, (None, None))
        gate.opened.set()
        store.drain()
        order = [(kind, block_hash) for kind, block_hash, *_ in store.poll()]
        assert order == [("written", 2), ("fetched", 1), ("written", 3), ("written", 4), ("written", 5)]
        assert torch.equal(target, stored)
    finally:
        store.close()


def test_a_block_restored_ahead_keeps_its_host_slot_from_the_save_its_device_block_makes():
    """Restoring a block ahead takes the free list's next device block, whose cached K/V is saved
    first: that save must not go into the slot the restore's load reads. (The scheduling core alone.)"""
    size = 4
    blocks = BlockManager(num_blocks=2, block_size=size)
    on_disk = list(range(1, 6))  # one full block and one token
    disk_hash = chain_hash(None, on_disk[:size])
    tiers = KVTiers(blocks, host_slots=1, disk=DiskTier(1 << 30, 100, [(disk_hash, 100, 0.0)]))
    cached = Sequence(list(range(50, 58)), SamplingParams(), size)  # the pool: two cached blocks, on no tier
    blocks.allocate(cached, [], 8)
    blocks.register_scheduled(cached, 8)
    blocks.launched()
    blocks.free_blocks_of(cached)

    assert tiers.lookup(Sequence(on_disk, SamplingParams(), size), 0) is FETCHING
    tiers.take_transfers()
    tiers.queued()
    tiers.io_done([("fetched", disk_hash, True)])
    kv = tiers.take_transfers()
    assert len(kv.loads) == 1 and blocks.blocks[kv.loads[0][1]].hash == disk_hash
    assert not {slot for _, slot in kv.saves} & {slot for slot, _ in kv.loads}
    tiers.queued()


def test_a_prompt_whose_reads_find_every_slot_held_by_writes_waits_for_them_instead_of_computing():
    """Writes of other blocks (a turn that just ended, written in the background) hold every host
    slot: the resumed prompt waits for them to end, then reads its blocks, rather than computing
    them again. (The scheduling core alone, no model.)"""
    size = 4
    blocks = BlockManager(num_blocks=8, block_size=size)
    prompt = list(range(1, 10))  # 2 full blocks and one token
    first = chain_hash(None, prompt[:size])
    hashes = [first, chain_hash(first, prompt[size:2 * size])]
    tiers = KVTiers(blocks, host_slots=2, disk=DiskTier(1 << 30, 100, [(h, 100, 0.0) for h in hashes]))
    other = Sequence(list(range(100, 109)), SamplingParams(), size)  # another conversation's turn ends
    blocks.allocate(other, [], 9)
    blocks.register_scheduled(other, 9)
    blocks.launched()
    blocks.free_blocks_of(other)
    tiers.persist()  # the engine is idle: its two full blocks are written, through both host slots
    written = [block_hash for _, block_hash, _ in tiers.take_transfers().writes]
    assert len(written) == 2
    tiers.queued()
    seq = Sequence(prompt, SamplingParams(), size)

    assert tiers.lookup(seq, 0) is FETCHING and tiers.fetching  # the engine waits for disk work
    assert not tiers.take_transfers()
    tiers.io_done([("written", written[0], True, 100)])
    assert tiers.lookup(seq, 0) is FETCHING
    assert [h for h, _, _ in tiers.take_transfers().fetches] == hashes[:1]
    tiers.queued()
    tiers.io_done([("fetched", hashes[0], True), ("written", written[1], True, 100)])
    tiers.take_transfers()
    tiers.queued()
    hits = blocks.lookup_prefix(seq)
    assert len(hits) == 1
    assert tiers.lookup(seq, 1) is FETCHING
    assert [h for h, _, _ in tiers.take_transfers().fetches] == hashes[1:]
    tiers.queued()
    tiers.io_done([("fetched", hashes[1], True)])
    tiers.take_transfers()
    tiers.queued()
    assert len(blocks.lookup_prefix(seq)) == 2 and not tiers.fetching
