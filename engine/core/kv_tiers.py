"""The KV cache's lower tiers, below the device's block pool (BlockManager): host memory, and a
directory on disk that outlives the process. Bookkeeping only, torch-free: which chained hash
(block_manager.chain_hash) each host slot and disk file holds, and what each step copies
(KVTransfers, engine/core/step_plan.py). The runner makes the copies (engine/runner/kv_tiers.py).

How a block moves:
- save (device -> host): a cached block (hash registered, no sequence holding it) that the pool is
  about to hand out again is copied to a host slot first, unless a tier holds its hash already. With
  spill_ahead (on a GPU), the blocks the free list hands out next are saved a step early, on a copy
  stream, so that the step that reuses one rarely waits for its copy.
- load (host -> device): a prompt whose next full blocks are on the host gets fresh blocks,
  registered under their hashes at once, and copies of them. While other work can run, the prompt
  waits for its copies (rank 0 reports them done) instead of holding that work up; otherwise its
  step waits for them on the device.
- write (host -> disk): with a disk directory, a block saved to the host is written to a file in
  the background, and so is every cached block once the engine goes idle (a chat's turn has ended),
  so that a restart finds them. A slot stays put until its write has read it.
- fetch (disk -> host): a prompt whose next full blocks are on disk waits at the head of the queue
  while they are read into host slots (checked there: a corrupt or foreign file is removed, and its
  block computed instead), and, when writes hold the slots its reads need, while they end. Each
  block read is loaded at once into a free device block, registered under its hash as a cached
  block (restored ahead), so that the copies to the device run beside the reads still under way;
  the prompt then finds its blocks on the device.
- prefetch: a conversation reopened before its next message asks for its blocks ahead (prefetch()):
  those on the host are loaded into free device blocks at once, those on disk read and loaded as
  their reads end, each registered as a cached block, so that the next message's prompt finds them
  on the device and prefills only itself.

Host slots and disk files each go least recently used first. The device-side ordering (a copy
after the steps that wrote its block, a step after the copies it reads) is the runner's: it is
told which copies each step waits for.
"""
from collections import OrderedDict

from engine.core.block_manager import Block, BlockManager
from engine.core.sequence import Sequence
from engine.core.step_plan import KVTransfers

# lookup()'s answer for a prompt some of whose blocks are being read from disk: it waits.
FETCHING = "fetching"


class HostEntry:
    __slots__ = ("slot", "token_ids", "pins", "ready", "from_disk")

    def __init__(self, slot: int, token_ids: tuple[int, ...]):
        self.slot = slot
        self.token_ids = token_ids
        self.pins = 0  # disk reads or writes of the slot under way: it is not reused until they end
        self.ready = True  # False while a fetch fills the slot
        self.from_disk = False  # fetched and not loaded yet: its first load counts as a disk hit


class HostTier:
    """Host slots, each holding one block's K/V under its chained hash, least recently used first."""

    def __init__(self, num_slots: int, usable_slots: int | None = None):
        self.num_slots = num_slots
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()
        self.usable_slots = 0  # slots 0 .. usable_slots - 1 have their memory (the runner's pool grows)
        self._free_slots: list[int] = []  # pop() hands out the lowest first
        self.grow(num_slots if usable_slots is None else usable_slots)

    def grow(self, usable_slots: int) -> None:
        """The runner's pool now has memory for slots 0 .. usable_slots - 1."""
        usable_slots = min(usable_slots, self.num_slots)
        if usable_slots > self.usable_slots:
            self._free_slots[:0] = range(usable_slots - 1, self.usable_slots - 1, -1)
            self.usable_slots = usable_slots

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, block_hash: int, token_ids: tuple[int, ...]) -> HostEntry | None:
        """The entry holding this block (its token ids checked, as the device's cache checks them),
        now the most recently used; None if there is none."""
        entry = self.entries.get(block_hash)
        if entry is None or entry.token_ids != token_ids:
            return None
        self.entries.move_to_end(block_hash)
        return entry

    def reserve(self, block_hash: int, token_ids: tuple[int, ...], keep=frozenset()) -> HostEntry | None:
        """A slot for a block not held yet: a free one, else the least recently used one no disk
        operation holds; None when every slot is held so, or when that one is among `keep` (the
        step's own saves: a step that evicts more blocks than the tier has slots would copy each
        into a slot that a later copy of the same step overwrites)."""
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h, e in self.entries.items() if not e.pins), None)
            if victim is None or victim in keep:
                return None
            slot = self.entries.pop(victim).slot
        entry = self.entries[block_hash] = HostEntry(slot, token_ids)
        return entry

    def drop(self, block_hash: int) -> None:
        entry = self.entries.pop(block_hash, None)
        if entry is not None:
            self._free_slots.append(entry.slot)


class DiskTier:
    """The files a disk directory holds for this engine's model and KV layout, by chained hash,
    least recently used first, within cap_bytes. files: (hash, bytes, last use) as the runner
    listed them at start-up."""

    def __init__(self, cap_bytes: int, file_bytes: int, files: list[tuple[int, int, float]] = ()):
        self.cap_bytes = cap_bytes
        self.file_bytes = file_bytes  # a block's files, all ranks together (for the cap before writing)
        self.files: OrderedDict[int, int] = OrderedDict((h, n) for h, n, _ in sorted(files, key=lambda f: f[2]))
        self.bytes = sum(self.files.values())
        self.writing: set[int] = set()
        self.fetching: set[int] = set()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.files or block_hash in self.writing

    def make_room(self, more: int = 1) -> list[int] | None:
        """Hashes of the files to remove, least recently used first, so that the files being
        written and `more` blocks' files fit the cap (never one being read); None if they can't."""
        excess = self.bytes + (len(self.writing) + more) * self.file_bytes - self.cap_bytes
        if excess <= 0:
            return []
        victims = []
        for block_hash, size in self.files.items():
            if block_hash in self.fetching:
                continue
            victims.append(block_hash)
            excess -= size
            if excess <= 0:
                break
        if excess > 0:
            return None
        for block_hash in victims:
            self.bytes -= self.files.pop(block_hash)
        return victims

    def add(self, block_hash: int, size: int) -> list[int]:
        """A file written: returns those to remove to keep to the cap (file_bytes, the size
        expected of one, was short of this one's)."""
        self.bytes += size - self.files.pop(block_hash, 0)
        self.files[block_hash] = size
        self.file_bytes = max(self.file_bytes, size)
        return self.make_room(more=0) or []

    def forget(self, block_hash: int) -> None:
        self.bytes -= self.files.pop(block_hash, 0)


class KVTiers:
    """The lower tiers of one engine's KV cache, driven by its Scheduler (lookup, admit) and
    BlockManager (evicting), and by LLM.step, which hands each step's transfers to the runner.

    A step's transfers are gathered in take_transfers(); once the runner has queued them, queued()
    settles them, or forget_unqueued() takes them back if it never did."""

    def __init__(self, blocks: BlockManager, host_slots: int, disk: DiskTier | None = None, spill_ahead: int = 0,
                 usable_host_slots: int | None = None):
        self.blocks = blocks
        blocks.tiers = self
        self.host = HostTier(host_slots, usable_host_slots)
        self.disk = disk
        self.spill_ahead = spill_ahead
        self._next = KVTransfers()
        # What _next did to the host and disk bookkeeping, for forget_unqueued: host entries it
        # filled by saves, and those it reserved for fetches.
        self._saved_hashes: list[int] = []
        self._saved_now: set[int] = set()  # _saved_hashes as a set
        self._fetched_hashes: list[int] = []
        self._load_pins: list[HostEntry] = []  # the entries _next's loads read, held until they are queued
        self._batches = 0  # load batches named so far
        # Device blocks whose saves the device's steps have not waited for yet: a step reusing one does.
        self._saved_unwaited: set[int] = set()
        # Device block -> the load batch filling it, until a queued step has waited for that batch.
        self._loading: dict[int, int] = {}
        # Running prompts -> the load batch they must wait for before their next step.
        self.awaiting: dict[Sequence, int] = {}
        self.loads_waited = 0  # every step queued from now on runs after the loads up to this batch
        self.loads_ready = 0  # the loads up to this batch have ended on rank 0 (a hint for scheduling)
        self._fetched_for: set[int] = set()  # sequences whose fetches have been issued: one round each
        self._slots_awaited = False  # a prompt waits for writes to free host slots for its reads
        # Device blocks restored ahead (from disk, or from the host for a prefetch) that no sequence
        # has taken yet -> whether it came from disk: a prompt that takes one counts it as that tier's hit.
        self._restored_ahead: dict[int, bool] = {}
        self._prefetch_reads: set[int] = set()  # hashes read from disk for prefetch(), not ended yet
        self.host_hit_tokens = 0
        self.disk_hit_tokens = 0

    @property
    def io_pending(self) -> bool:
        """Disk reads or writes are under way, whose ends the runner will report."""
        return self.disk is not None and bool(self.disk.writing or self.disk.fetching)

    @property
    def prefetching(self) -> bool:
        """A prefetch's reads are under way, or copies (a prefetch's loads) wait for a step to queue them."""
        return bool(self._prefetch_reads) or bool(self._next.loads)

    @property
    def fetching(self) -> bool:
        """A prompt waits for reads from disk, or for writes to free host slots for them."""
        return self.disk is not None and bool(self.disk.fetching or self._slots_awaited)

    # --- the device's cache hands a block out ------------------------------------------------

    def evicting(self, block: Block) -> None:
        """BlockManager is handing `block` out to be written: its cached K/V is saved first, and the
        step writing it waits for the copies still reading or filling it."""
        if block.hash is not None:
            self._save(block.block_id, block.hash, block.token_ids)
        self._restored_ahead.pop(block.block_id, None)
        if block.block_id in self._saved_unwaited:
            self._next.wait_saves = True
        batch = self._loading.pop(block.block_id, 0)
        if batch > self.loads_waited:
            self._next.wait_loads = max(self._next.wait_loads, batch)

    def _save(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Copies a device block to a host slot, and on to disk; False if a tier holds it already or
        no slot is free of disk operations."""
        if block_hash in self.host.entries or (self.disk is not None and block_hash in self.disk):
            return False
        entry = self.host.reserve(block_hash, token_ids, self._saved_now)
        if entry is None:
            return False
        self._next.saves.append((block_id, entry.slot))
        self._saved_hashes.append(block_hash)
        self._saved_now.add(block_hash)
        self._saved_unwaited.add(block_id)
        if self.disk is not None:
            self._write(block_hash, entry)
        return True

    def _write(self, block_hash: int, entry: HostEntry) -> None:
        victims = self.disk.make_room()
        if victims is None:
            return
        self._next.deletes += victims
        self.disk.writing.add(block_hash)
        entry.pins += 1
        self._next.writes.append((entry.slot, block_hash, entry.token_ids))

    def _save_ahead(self) -> None:
        """Saves the cached blocks among the next spill_ahead the free list will hand out."""
        blocks = self.blocks.blocks
        for n, block_id in enumerate(self.blocks.free):
            if n == self.spill_ahead:
                break
            block = blocks[block_id]
            if block.hash is not None:
                self._save(block_id, block.hash, block.token_ids)

    # --- a prompt is admitted -----------------------------------------------------------------

    def lookup(self, seq: Sequence, start: int):
        """After seq's first `start` full blocks (found in the device's cache), the host entries
        holding its next ones, in order, up to the first block no tier holds. FETCHING when some of
        them are on disk: their reads are issued (once per sequence), and seq waits for them."""
        size = self.blocks.block_size
        found, missing = [], []
        for i in range(start, (seq.num_tokens - 1) // size):  # never the last token's block (lookup_prefix)
            block_hash = self.blocks.hash_of(seq, i)
            token_ids = tuple(seq.token_ids[i * size:(i + 1) * size])
            entry = self.host.get(block_hash, token_ids)
            if entry is not None:
                if not entry.ready:
                    return FETCHING
                found.append(entry)
            elif (self.disk is not None and block_hash in self.disk.files and block_hash not in self.disk.fetching
                  and seq.seq_id not in self._fetched_for):
                if not missing:
                    first_missing = len(found)
                missing.append((block_hash, token_ids))
                found.append(None)
            else:
                break
        if not missing:
            return found
        issued = self._fetch(missing)
        if issued < len(missing) and self.disk.writing:
            # The slots are held by writes, which end in milliseconds: seq waits for them, and its
            # other blocks are read then (computing them instead would take far longer).
            self._slots_awaited = True
            return FETCHING
        self._fetched_for.add(seq.seq_id)
        if issued:
            return FETCHING
        return found[:first_missing]  # no slot free of disk operations: what the host holds already

    def _fetch(self, missing: list[tuple[int, tuple[int, ...]]]) -> int:
        """Issues the disk reads of (block hash, token ids) in order, as far as host slots free of
        disk operations allow; returns how many."""
        issued = 0
        for block_hash, token_ids in missing:
            entry = self.host.reserve(block_hash, token_ids)
            if entry is None:
                break
            entry.ready = False
            entry.pins += 1
            self.disk.fetching.add(block_hash)
            self.disk.files.move_to_end(block_hash)
            self._next.fetches.append((block_hash, entry.slot, token_ids))
            self._fetched_hashes.append(block_hash)
            issued += 1
        return issued

    def restores(self, hits: list[int], found: list[HostEntry]) -> bool:
        """Whether a prompt with these device hits and host entries reads blocks still being loaded."""
        return bool(found) or self._loading_batch(hits) > self.loads_waited

    def _loading_batch(self, block_ids) -> int:
        loading = self._loading
        return max((loading.get(b, 0) for b in block_ids), default=0) if loading else 0

    def admit(self, seq: Sequence, hits: list[int], found: list[HostEntry], num_tokens: int, *, hold: bool,
              count: bool) -> None:
        """Gives seq its device hits, fresh blocks loaded from the host entries found, and fresh blocks
        up to num_tokens. hold: seq runs no token this step, and waits for its loads before it does;
        else this step waits for them. count: add its hits to the per-tier statistics."""
        if self._restored_ahead:
            size = self.blocks.block_size
            for block_id in hits:
                from_disk = self._restored_ahead.pop(block_id, None)
                if count and from_disk is not None:
                    if from_disk:
                        self.disk_hit_tokens += size
                    else:
                        self.host_hit_tokens += size
        if not found:
            self.blocks.allocate(seq, hits, num_tokens)
            batch = self._loading_batch(hits)
        else:
            # The runner makes a step's saves before its loads: no save of this step (those that
            # taking the fresh blocks makes, for one) may go into a slot a load of it reads.
            for entry in found:
                entry.pins += 1
            self._load_pins += found
            restored = self.blocks.allocate_restored(seq, hits + [None] * len(found), num_tokens)
            if not self._next.batch:
                self._batches += 1
                self._next.batch = self._batches
            batch = self._next.batch
            self._next.loads += [(entry.slot, block_id) for entry, block_id in zip(found, restored)]
            for block_id in restored:
                self._loading[block_id] = batch
            size = self.blocks.block_size
            for entry in found:
                if count:
                    if entry.from_disk:
                        self.disk_hit_tokens += size
                    else:
                        self.host_hit_tokens += size
                entry.from_disk = False
            batch = max(batch, self._loading_batch(hits))
        self._fetched_for.discard(seq.seq_id)
        if batch > self.loads_waited:
            if hold:
                self.awaiting[seq] = batch
            else:
                self._next.wait_loads = max(self._next.wait_loads, batch)

    # --- running prompts that wait for their loads ----------------------------------------------

    def held(self, running: list[Sequence], waiting) -> set[Sequence]:
        """The running sequences to leave out of this step: those waiting for loads rank 0 has not
        seen end, as long as other work can run instead (else the step runs them, and the device
        waits for their copies)."""
        done = max(self.loads_ready, self.loads_waited)
        held = {seq for seq, batch in self.awaiting.items() if batch > done}
        if held and (waiting or any(seq not in held and seq.num_tokens < seq.max_num_tokens for seq in running)):
            return held
        return set()

    def runs(self, seq: Sequence) -> None:
        """seq, waiting for loads, runs in this step: the step waits for them."""
        self._next.wait_loads = max(self._next.wait_loads, self.awaiting[seq])

    def forget(self, seq: Sequence) -> None:
        """seq has been preempted or has finished."""
        self.awaiting.pop(seq, None)
        self._fetched_for.discard(seq.seq_id)

    # --- a step's transfers ---------------------------------------------------------------------

    def take_transfers(self) -> KVTransfers | None:
        """The copies to queue with this step, with the saves ahead of the free list's next blocks;
        None if there are none."""
        if self.spill_ahead:
            self._save_ahead()
        return self._next if self._next else None

    def queued(self) -> None:
        """The runner has queued take_transfers()'s copies (and the step's waits for them)."""
        kv = self._next
        if kv.wait_saves:
            self._saved_unwaited.clear()
        if kv.wait_loads > self.loads_waited:
            self.loads_waited = kv.wait_loads
            self._loading = {b: k for b, k in self._loading.items() if k > self.loads_waited}
            self.awaiting = {s: k for s, k in self.awaiting.items() if k > self.loads_waited}
        self._clear()

    def forget_unqueued(self) -> None:
        """The step failed before the runner queued its copies: what they were to fill is dropped.
        (The device blocks loads were to fill are dropped with the step's other registrations:
        BlockManager.forget_unlaunched.)"""
        self._prefetch_reads.difference_update(self._fetched_hashes)
        for block_hash in self._saved_hashes + self._fetched_hashes:
            entry = self.host.entries.get(block_hash)
            if entry is not None:
                self.host.drop(block_hash)
            if self.disk is not None:
                self.disk.writing.discard(block_hash)
                self.disk.fetching.discard(block_hash)
        self._fetched_for.clear()
        self._clear()

    def _clear(self) -> None:
        for entry in self._load_pins:
            entry.pins -= 1
        self._next = KVTransfers()
        self._saved_hashes = []
        self._saved_now = set()
        self._fetched_hashes = []
        self._load_pins = []

    def _restore_ahead(self, block_hash: int, entry: HostEntry) -> bool:
        """Loads a block from its host slot (just read from disk, or asked for by prefetch) into a
        free device block, registered under its hash as a cached block: a read block's copy runs
        while the prompt's other blocks are still being read. Not when
        the device holds it already, nor when the free list's next block is itself still loading
        (the pool is smaller than what is being read: the prompt then loads its blocks as it is
        admitted). Returns whether it did."""
        blocks = self.blocks
        if blocks.hash_to_block.get(block_hash) is not None or not blocks.free:
            return False
        if next(iter(blocks.free)) in self._loading:
            return False
        # Held before the block is taken: the save of the block it evicts must not take this slot.
        entry.pins += 1
        self._load_pins.append(entry)
        block_id = blocks.restore_cached(block_hash, entry.token_ids)
        if not self._next.batch:
            self._batches += 1
            self._next.batch = self._batches
        self._next.loads.append((entry.slot, block_id))
        self._loading[block_id] = self._next.batch
        self._restored_ahead[block_id] = entry.from_disk
        entry.from_disk = False
        return True

    def prefetch(self, seq: Sequence) -> int:
        """Starts bringing seq's full blocks that the device lacks back from the lower tiers, up to
        the first block no tier holds: host entries are loaded into free device blocks now, files
        read from disk and loaded as their reads end (_restore_ahead), each a cached block under
        its hash. Nothing waits for them: a prompt that starts the same way finds them on the
        device once loaded, as with a read it waited for. Returns the blocks started."""
        size = self.blocks.block_size
        hits = self.blocks.lookup_prefix(seq)
        started, missing = 0, []
        for i in range(len(hits), seq.num_tokens // size):
            block_hash = self.blocks.hash_of(seq, i)
            if block_hash in self.blocks.hash_to_block:
                continue  # on the device already (lookup_prefix stopped at an earlier block)
            token_ids = tuple(seq.token_ids[i * size:(i + 1) * size])
            entry = self.host.get(block_hash, token_ids)
            if entry is not None:
                if entry.ready:
                    started += self._restore_ahead(block_hash, entry)
                # else: a read under way fills it, and loads it as it ends
            elif self.disk is not None and block_hash in self.disk.files:
                if block_hash not in self.disk.fetching:
                    missing.append((block_hash, token_ids))
            else:
                break
        issued = self._fetch(missing) if missing else 0
        self._prefetch_reads.update(block_hash for block_hash, _ in missing[:issued])
        return started + issued

    def persist(self) -> None:
        """The engine is idle: the cached blocks the disk lacks, most recently used first, go to it
        (through host slots), as far as slots free of disk operations and the disk's cap allow."""
        if self.disk is None:
            return
        blocks = self.blocks.blocks
        for block_hash in reversed(self.blocks.hash_to_block):
            block = blocks[self.blocks.hash_to_block[block_hash]]
            if block.ref_count or block.hash != block_hash or block_hash in self.disk:
                continue
            entry = self.host.entries.get(block_hash)
            if entry is None:
                if not self._save(block.block_id, block_hash, block.token_ids):
                    return  # every slot is being read or written: the rest waits for the next idle time
            elif entry.ready:
                self._write(block_hash, entry)
        for block_hash, entry in reversed(self.host.entries.items()):
            if entry.ready and block_hash not in self.disk:
                self._write(block_hash, entry)

    # --- reports from the runner ----------------------------------------------------------------

    def io_done(self, results: list[tuple]) -> None:
        """The ends of disk operations, as the runner reports them: ("written", hash, ok, bytes)
        and ("fetched", hash, ok)."""
        for result in results:
            kind, block_hash, ok = result[:3]
            entry = self.host.entries.get(block_hash)
            if entry is not None and entry.pins:
                entry.pins -= 1
            if kind == "written":
                self.disk.writing.discard(block_hash)
                self._slots_awaited = False
                if ok:
                    self._next.deletes += self.disk.add(block_hash, result[3])
            else:
                self.disk.fetching.discard(block_hash)
                self._prefetch_reads.discard(block_hash)
                if ok and entry is not None:
                    entry.ready = entry.from_disk = True
                    self._restore_ahead(block_hash, entry)
                else:
                    # Missing, corrupt or foreign (the runner removed it), or its slot dropped:
                    # every rank removes its file, and the block is computed instead.
                    self.host.drop(block_hash)
                    self.disk.forget(block_hash)
                    self._next.deletes.append(block_hash)
