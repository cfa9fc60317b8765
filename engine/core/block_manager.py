from array import array
from collections import OrderedDict

import xxhash

from engine.core.sequence import Sequence


def chain_hash(prev_hash: int | None, token_ids: list[int]) -> int:
    """xxhash64 of a full block's token ids, chained on the hash of the block before it, so a hit
    on block i implies the whole prefix up to i matches (up to a collision, checked separately)."""
    h = xxhash.xxh64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


# Per-block states for the UI's block map, kept current in a bytearray so a snapshot is one copy.
FREE, CACHED, USED, SHARED = 0, 1, 2, 3


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    """Owns the KV cache's blocks: who holds each one, and which full blocks can be reused by hash.

    A freed block keeps its hash and token ids until it is handed out again, so a later request with
    the same prefix can take it back from the free list (a "cached" block). Free blocks are handed
    out least recently freed first, which keeps recently used prefixes around longest.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one KV block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        # Insertion-ordered set: O(1) pop of the oldest and O(1) removal of a cached hit.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.states = bytearray(num_blocks)
        # Blocks hashed by register_scheduled for the step not yet launched.
        self._unlaunched: list[int] = []
        # The KV cache's lower tiers (engine/core/kv_tiers.py), told of every cached block about to
        # be reused; None when they are off.
        self.tiers = None

    def _update_state(self, block: Block) -> None:
        if block.ref_count == 0:
            self.states[block.block_id] = CACHED if block.hash is not None else FREE
        else:
            self.states[block.block_id] = USED if block.ref_count == 1 else SHARED

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_cached_blocks(self) -> int:
        return self.states.count(CACHED)

    # --- hashing -----------------------------------------------------------------------------

    def _hashes_up_to(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Extends seq.block_hashes lazily; token ids only ever grow, so earlier hashes stay valid."""
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else None, seq.block_tokens(i)))
        return hashes

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached run of seq's leading full blocks. The block holding
        the last token never counts: that token must run to give the next token's logits, and
        writing its K/V into a block other sequences share would change what they read."""
        num_full = (seq.num_tokens - 1) // self.block_size
        hits = []
        # Hashed one block at a time up to the first miss: a new 8K-token prompt would otherwise
        # hash all its blocks (~0.6 ms) inside the step that admits it, while other streams wait.
        # The rest are hashed as they fill.
        for i in range(num_full):
            h = self._hashes_up_to(seq, i + 1)[i]
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.hash != h or block.token_ids != tuple(seq.block_tokens(i)):
                break
            hits.append(block_id)
        return hits

    def commit_full_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Registers the hashes of blocks that filled since the last call (decode, and whatever a
        step's scheduling could not hash: see register_scheduled). num_computed: seq's tokens whose
        K/V are written or queued on the device ahead of any step that could read them (default
        seq.num_computed_tokens). Runs for every sequence after every step; a block fills once per
        block_size decode steps."""
        self._commit(seq, seq.num_computed_tokens if num_computed is None else num_computed, None)

    def register_scheduled(self, seq: Sequence, num_tokens: int) -> None:
        """Registers the full blocks among seq's first num_tokens as the step being scheduled will
        leave them, so that a request admitted later in the same schedule, or in any later step,
        reuses them instead of computing them again.

        Reading them is safe from the moment the step is queued: every layer writes the K/V of all
        the step's tokens into the cache (store_kv, or the fused norm_rope_store) before that
        layer's attention reads it, with every backend (torch, triton, flash_attn), in eager and
        CUDA-graph steps alike, and later steps are queued behind it on the same stream. So a
        sequence that hits these blocks in the same step reads what this step's earlier kernel in
        the same layer wrote. Tensor-parallel ranks run the same plan, each over its own heads.

        Until launched() confirms the step was queued, the blocks are remembered: if it never
        is, forget_unlaunched() takes their hashes back, so K/V nobody wrote is never served."""
        self._commit(seq, num_tokens, self._unlaunched)

    def launched(self) -> None:
        """The step scheduled since the last call is queued on the device: its blocks' K/V will be
        there before anything queued later reads them."""
        self._unlaunched.clear()

    def forget_unlaunched(self) -> set[int]:
        """Drops the hashes registered for a step that never launched; returns those blocks' ids.
        Whoever holds them must recompute them (LLM.step's failure path)."""
        dropped = set(self._unlaunched)
        self._unlaunched.clear()
        for block_id in dropped:
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = block.token_ids = None
            self._update_state(block)
        return dropped

    def _commit(self, seq: Sequence, num_computed: int, newly_hashed: list[int] | None) -> None:
        num_full = num_computed // self.block_size
        if num_full <= seq.num_committed_blocks:
            return
        hashes = self._hashes_up_to(seq, num_full)
        for i in range(seq.num_committed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash != hashes[i]:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.block_tokens(i))
                self.hash_to_block[hashes[i]] = block.block_id
                if newly_hashed is not None:
                    newly_hashed.append(block.block_id)
        seq.num_committed_blocks = num_full

    # --- allocation ----------------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> int:
        """Free-list entries that giving seq room for num_tokens would consume (hits included when
        they sit in the free list as cached blocks)."""
        if not hits:  # every running sequence, every step: keep it short
            new = -(-num_tokens // self.block_size) - len(seq.block_table)
            return new if new > 0 else 0
        new = max(0, seq.num_blocks_for(num_tokens) - len(hits))
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return new + revived

    def allocate(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Gives a sequence with no blocks the cached hits plus fresh blocks up to num_tokens."""
        assert not seq.block_table
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            self._update_state(block)
        seq.block_table = array("i", hits)
        seq.num_committed_blocks = len(hits)
        self.grow(seq, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need <= 0:
            return
        if need > len(self.free):
            raise RuntimeError(f"KV cache out of blocks: need {need}, {len(self.free)} free")
        for _ in range(need):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if self.tiers is not None:
            self.tiers.evicting(block)
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = None
            block.token_ids = None
        block.ref_count = 1
        self._update_state(block)
        return block_id

    def free_blocks_of(self, seq: Sequence) -> None:
        # Tail blocks go back first, so they are evicted before the shared prefix blocks.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free[block_id] = None
            self._update_state(block)
        seq.block_table = array("i")
        seq.num_committed_blocks = 0

    # --- blocks restored from the lower tiers (engine/core/kv_tiers.py) ------------------------------

    def hash_of(self, seq: Sequence, i: int) -> int:
        """The chained hash of seq's full block i."""
        return self._hashes_up_to(seq, i + 1)[i]

    def restore_cached(self, block_hash: int, token_ids: tuple[int, ...]) -> int:
        """Takes the next free block for a lower tier to fill with a copy of this block, and puts it
        back as a cached block under its hash (the most recently freed): a prompt finds it with
        lookup_prefix. Registered as register_scheduled registers, so a step that fails before it
        is queued takes it back. Returns its id."""
        block_id = self._take_free_block()
        block = self.blocks[block_id]
        block.hash, block.token_ids, block.ref_count = block_hash, token_ids, 0
        self.hash_to_block[block_hash] = block_id
        self._unlaunched.append(block_id)
        self.free[block_id] = None
        self._update_state(block)
        return block_id

    def allocate_restored(self, seq: Sequence, hits: list[int | None], num_tokens: int) -> list[int]:
        """allocate(), where a None among hits is a block a lower tier holds: it gets a fresh block,
        registered under seq's hash for it at once (with the step being scheduled, as
        register_scheduled registers), for the tier to fill with a copy ahead of any step that reads
        it. Returns the fresh blocks' ids, in order."""
        assert not seq.block_table
        for block_id in hits:  # first, so that taking the fresh blocks can't evict a hit
            if block_id is not None:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free[block_id]
                block.ref_count += 1
                self._update_state(block)
        table, restored = array("i"), []
        for i, block_id in enumerate(hits):
            if block_id is None:
                block_id = self._take_free_block()
                block = self.blocks[block_id]
                block.hash = self.hash_of(seq, i)
                block.token_ids = tuple(seq.block_tokens(i))
                self.hash_to_block[block.hash] = block_id
                self._unlaunched.append(block_id)
                restored.append(block_id)
            table.append(block_id)
        seq.block_table = table
        seq.num_committed_blocks = len(hits)
        self.grow(seq, num_tokens)
        return restored
