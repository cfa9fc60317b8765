"""BlockManager invariants under random allocate / grow / commit / free sequences."""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.block_manager import CACHED, FREE, SHARED, USED, BlockManager
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence

BLOCK = 4
NUM_BLOCKS = 12


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK)
        self.live: list[Sequence] = []
        self.written: dict[int, tuple | None] = {}  # block -> the full block of tokens a queued step wrote

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=10))
    def admit(self, prefix, tail):
        seq = Sequence(prefix + tail, SamplingParams(), BLOCK)
        hits = self.bm.lookup_prefix(seq)
        computed = min(len(hits) * BLOCK, seq.num_tokens - 1)
        if self.bm.blocks_needed(seq, seq.num_tokens, hits) > self.bm.num_free_blocks:
            return
        self.bm.allocate(seq, hits, seq.num_tokens)
        # Cached blocks hold exactly the tokens this sequence has at those positions.
        for i, b in enumerate(hits):
            assert self.bm.blocks[b].token_ids == tuple(seq.block_tokens(i))
        seq.num_computed_tokens = seq.num_tokens
        assert computed <= seq.num_computed_tokens
        self._written_by(seq, len(hits))
        self.bm.commit_full_blocks(seq)
        self.live.append(seq)

    @rule(prompts=st.lists(st.tuples(st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
                                     st.lists(st.integers(0, 3), min_size=1, max_size=10)), min_size=1, max_size=3),
          launches=st.booleans())
    def schedule_step(self, prompts, launches):
        """Prompts admitted in one step, each registering its blocks as it is scheduled (so a later
        one can hit them in the same step); then the step is queued, or fails before it is."""
        admitted = []
        for prefix, tail in prompts:
            seq = Sequence(prefix + tail, SamplingParams(), BLOCK)
            hits = self.bm.lookup_prefix(seq)
            if self.bm.blocks_needed(seq, seq.num_tokens, hits) > self.bm.num_free_blocks:
                break
            self.bm.allocate(seq, hits, seq.num_tokens)
            for b in seq.block_table[len(hits):]:
                self.written[b] = None  # a fresh block: whatever it held is not this step's K/V
            self.bm.register_scheduled(seq, seq.num_tokens)
            admitted.append(seq)
        if launches:
            self.bm.launched()
            for seq in admitted:
                seq.num_computed_tokens = seq.num_tokens
                for i in range(seq.num_tokens // BLOCK):
                    self.written[seq.block_table[i]] = tuple(seq.block_tokens(i))
            self.live += admitted
        else:
            dropped = self.bm.forget_unlaunched()
            for seq in admitted:  # the engine sends them back to recompute (LLM._forget_unlaunched)
                assert set(seq.block_table[:seq.num_tokens // BLOCK]) - {
                    b for b, kv in self.written.items() if kv is not None} <= dropped
                self.bm.free_blocks_of(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode_one(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        if self.bm.blocks_needed(seq, seq.num_tokens + 1) > self.bm.num_free_blocks:
            return
        seq.token_ids.append(token)
        self.bm.grow(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        self._written_by(seq, (seq.num_tokens - 1) // BLOCK)
        self.bm.commit_full_blocks(seq)

    def _written_by(self, seq, first_block):
        """Records the K/V a step wrote into seq's blocks from first_block on (full ones by tokens)."""
        for i in range(first_block, len(seq.block_table)):
            full = (i + 1) * BLOCK <= seq.num_tokens
            self.written[seq.block_table[i]] = tuple(seq.block_tokens(i)) if full else None

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free_blocks_of(seq)

    @invariant()
    def cached_hashes_name_written_kv(self):
        """A hash is only ever served for a block whose K/V a queued step wrote for those tokens."""
        for h, b in self.bm.hash_to_block.items():
            assert self.written.get(b) == self.bm.blocks[b].token_ids

    @invariant()
    def ref_counts_match_holders(self):
        held = {}
        for seq in self.live:
            for b in seq.block_table:
                held[b] = held.get(b, 0) + 1
        for block in self.bm.blocks:
            assert block.ref_count == held.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block.block_id in self.bm.free)
            expected = (CACHED if block.hash is not None else FREE) if block.ref_count == 0 else \
                (USED if block.ref_count == 1 else SHARED)
            assert self.bm.states[block.block_id] == expected

    @invariant()
    def every_sequence_has_room_for_its_tokens(self):
        for seq in self.live:
            assert len(seq.block_table) == seq.num_blocks_for(seq.num_tokens)

    @invariant()
    def hash_table_points_at_matching_blocks(self):
        for h, b in self.bm.hash_to_block.items():
            assert self.bm.blocks[b].hash == h
        assert 0 <= self.bm.num_cached_blocks <= self.bm.num_free_blocks

    @invariant()
    def shared_blocks_hold_identical_tokens(self):
        for seq in self.live:
            for i in range(seq.num_computed_tokens // BLOCK):
                block = self.bm.blocks[seq.block_table[i]]
                if block.token_ids is not None:
                    assert block.token_ids == tuple(seq.block_tokens(i))

    def teardown(self):
        for seq in self.live:
            self.bm.free_blocks_of(seq)
        assert self.bm.num_free_blocks == NUM_BLOCKS


TestBlockManager = BlockManagerMachine.TestCase
# A fixed set of examples (derandomized, no example database), as the fuzz tests run in CI.
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, derandomize=True,
                                     database=None)


def test_prefix_lookup_hashes_a_new_prompt_only_up_to_its_first_miss():
    bm = BlockManager(NUM_BLOCKS, BLOCK)
    cached = Sequence(list(range(9)), SamplingParams(), BLOCK)
    bm.allocate(cached, bm.lookup_prefix(cached), cached.num_tokens)
    bm.commit_full_blocks(cached, cached.num_tokens)
    longer = Sequence(list(range(8)) + [99] * 33, SamplingParams(), BLOCK)
    hits = bm.lookup_prefix(longer)
    assert hits == list(cached.block_table[:2])
    assert len(longer.block_hashes) == 3  # the two hits and the miss, not all ten full blocks
    bm.allocate(longer, hits, longer.num_tokens)
    bm.commit_full_blocks(longer, longer.num_tokens)
    assert len(longer.block_hashes) == 10
