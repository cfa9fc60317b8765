"""The copies between the KV cache's tiers, on one rank: between the device's cache and a pool of
host slots, and between host slots and files on disk. engine/core/kv_tiers.py decides them and
hands each step's as plain data (KVTransfers); tensor-parallel ranks make the same copies of their
own shards.

On a GPU the host pool is pinned memory, allocated a piece at a time while the engine is idle
(pinning tens of GiB at start-up would take seconds, and pinning stalls the GPU's work: HostPool),
and the device <-> host copies run on two copy streams of their own, so that they overlap the
steps' work and each other:
- a save (device -> host) waits for everything queued on the step stream before it (the steps that
  wrote its block) and for the loads queued before it (a slot it overwrites may be one they read);
- a load (host -> device) waits likewise for the step stream (a step in flight may still read the
  block it overwrites), for the saves of earlier steps (its slot may be one they fill) and, before
  it writes a block that a save of its own step reads, for that save's gather (a save reads its
  blocks into a device staging buffer first, so the blocks are free before its copy to the host ends);
- a step waits for the gathers of the saves of the blocks it overwrites (wait_saves) and for the
  loads of the blocks it reads or overwrites (wait_loads, by load batch).
Disk reads and writes run on a thread of their own (DiskStore), each after the device copies that
fill or read its slot (their events).

On CPU the copies are plain copies, made in order on the caller's thread.
"""
import contextlib
import json
import os
import queue
import re
import threading
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor, wait
from math import prod
from pathlib import Path

import torch
import xxhash
from safetensors.torch import save_file

from engine.config import EngineConfig
from engine.core.step_plan import KVTransfers

# Written into every file's metadata, and part of the fingerprint: a new layout changes both.
FORMAT = "nvchat-kv-1"
# The host pool is allocated in pieces of this size (a power of two: torch's pinned-memory
# allocator rounds every allocation up to one).
_CHUNK_BYTES = 256 << 20
# Device <-> host copies go through a device buffer of at most this size at a time: the KV cache
# fills what the GPU has left, and the steps' own memory was measured without it.
_STAGE_BYTES = 32 << 20
# Load batches' events kept for steps to wait on: a batch no step asks for is covered by any later one.
_MAX_LOAD_EVENTS = 256
_FILE_NAME = re.compile(r"([0-9a-f]{16})\.(\d+)\.safetensors")
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8"}
_MAX_HEADER_BYTES = 1 << 20  # a block's header holds its token ids: a few KiB
# Threads reading files side by side: a read and its checksum let go of the GIL, and one thread
# copies from the page cache at a fraction of the memory's bandwidth. A 4,096-token Qwen3-8B
# conversation (256 files of 2.3 MB, page cache warm) was read in 67-86 ms with 8 threads, 78-98
# with 16 and 93-125 with 4, on an H200 machine's 16 cores (benchmarks/HISTORY.md, 2026-11-27).
_READERS = max(2, min(8, os.cpu_count() or 1))
# A file's first read: its header's length and the header (a few KiB at most: token ids and hashes).
_HEAD_READ = 16 << 10
# Reads that end are reported to the engine this many at a time (and the last ones at once): each
# report wakes the engine's loop, which takes the GIL from the readers.
_REPORT_EVERY = 16
_STOP = ("stop",)


def kv_fingerprint(config: EngineConfig, block_shape: tuple[int, ...]) -> str:
    """What a block's K/V depends on beyond its tokens: the model's files (name, size and
    modification time: their identity, without reading gigabytes), its config, the dtype, the
    quantization, the block's shape on one rank, the tensor-parallel layout, the device type, the
    attention kernels (which round differently) and a cache dtype other than the model's. A disk
    directory keeps each fingerprint apart."""
    path = config.model_path
    files = [path] if path.is_file() else sorted(p for p in path.iterdir()
                                                 if p.suffix in (".safetensors", ".json", ".gguf"))
    identity = {
        "format": FORMAT,
        "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "hf_config": config.hf_config.to_dict(),
        "architecture": config.architecture.__name__,
        "load_format": config.load_format,
        "quantization": config.quantization,
        "dtype": str(config.dtype),
        "block_shape": list(block_shape),
        "tensor_parallel_size": config.tensor_parallel_size,
        "device": config.device.type,
        "attention_backend": config.attention_backend,
    }
    if config.kv_dtype != config.dtype:  # absent otherwise, so that earlier versions' directories still match
        identity["kv_dtype"] = str(config.kv_dtype)
    return xxhash.xxh3_128_hexdigest(json.dumps(identity, sort_keys=True, default=str).encode())


class HostPool:
    """num_slots host slots of one block each (block_shape), in pieces of _CHUNK_BYTES.

    Pinned memory is allocated a piece at a time by grow(), which the engine calls only while it is
    idle: pinning holds up the CUDA calls of every other thread in the driver (measured on an
    H200: 1 GiB pinned on a side thread stalled the step thread's launches for 140 ms), so pinning
    while steps run slowed decoding and the first tokens of resumed prompts. Pageable memory (on
    CPU) is allocated whole at once: untouched pages cost nothing."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, pinned: bool):
        self.num_slots = num_slots
        self.block_shape = block_shape
        self.dtype = dtype
        self.pinned = pinned
        self.slot_bytes = prod(block_shape) * dtype.itemsize
        self.per_chunk = max(1, _CHUNK_BYTES // self.slot_bytes)
        self._chunks: list[torch.Tensor] = []
        self.grow(1 if pinned else -(-num_slots // self.per_chunk))

    @property
    def allocated_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self._chunks)

    @property
    def allocated_slots(self) -> int:
        """Slots 0 .. allocated_slots - 1 have their memory."""
        return min(self.num_slots, len(self._chunks) * self.per_chunk)

    def grow(self, pieces: int = 1) -> int:
        """Allocates up to `pieces` more pieces; returns allocated_slots."""
        for _ in range(pieces):
            slots = min(self.per_chunk, self.num_slots - len(self._chunks) * self.per_chunk)
            if slots <= 0:
                break
            self._chunks.append(torch.empty((slots, *self.block_shape), dtype=self.dtype, pin_memory=self.pinned))
        return self.allocated_slots

    def chunk(self, i: int) -> torch.Tensor:
        return self._chunks[i]

    def slot(self, s: int) -> torch.Tensor:
        return self.chunk(s // self.per_chunk)[s % self.per_chunk]

    def runs(self, slots: list[int]):
        """(first, end, piece, offset): slots[first:end] are piece[offset:offset + end - first]."""
        per = self.per_chunk
        first = 0
        for k in range(1, len(slots) + 1):
            if k == len(slots) or slots[k] != slots[k - 1] + 1 or slots[k] // per != slots[first] // per:
                yield first, k, self.chunk(slots[first] // per), slots[first] % per
                first = k

    def close(self) -> None:
        self._chunks = []


class DiskStore:
    """One rank's files in a disk directory: `<directory>/<fingerprint>/<hash>.<rank>.safetensors`,
    one block each: its K/V ("kv") and, as metadata, the format, the fingerprint, the chained hash,
    the block's token ids and an xxh3 checksum of the K/V bytes. A file is written under a
    temporary name and renamed, so that no reader sees half of one; a file that fails any check is
    removed and reported not fetched.

    Files are written with the safetensors library; they are read by their header's offsets,
    straight into the host slot (the library would make a tensor of its own first: one more copy of
    every byte, on the path of a prompt's first token). Writes and removals run in order on a thread
    of their own; reads go ahead of those queued, and run side by side on a few more threads (a
    resumed conversation's blocks come in together). poll() returns their ends: ("written", hash,
    ok, bytes) and ("fetched", hash, ok)."""

    def __init__(self, directory: Path, fingerprint: str, rank: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype):
        self.dir = directory / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.rank = rank
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_bytes = prod(block_shape) * dtype.itemsize
        self._header_tensor = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(self.block_shape),
                               "data_offsets": [0, self.block_bytes]}
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._results: list[tuple] = []
        self._queued = 0  # operations submitted and not yet done
        self._readers: ThreadPoolExecutor | None = None
        self._thread = threading.Thread(target=self._serve, name=f"nvchat-kv-disk-{rank}", daemon=True)
        self._thread.start()

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}.{self.rank}.safetensors"

    def files(self) -> list[tuple[int, int, float]]:
        """(hash, bytes, last use) of this rank's files."""
        found = []
        with os.scandir(self.dir) as entries:
            for entry in entries:
                match = _FILE_NAME.fullmatch(entry.name)
                if match and int(match[2]) == self.rank:
                    try:
                        stat = entry.stat()
                    except OSError:
                        continue
                    found.append((int(match[1], 16), stat.st_size, stat.st_mtime))
        return found

    # --- the caller's side ------------------------------------------------------------------------

    def write(self, block_hash: int, token_ids, source: torch.Tensor, after) -> None:
        """Writes `source` (a host slot) once `after` (the event of the copy filling it) has ended."""
        self._submit(("write", block_hash, tuple(token_ids), source, after))

    def fetch(self, block_hash: int, token_ids, target: torch.Tensor, after: tuple) -> None:
        """Reads into `target` (a host slot) once the copies in `after` (events) that may still read
        or fill it have ended."""
        self._submit(("fetch", block_hash, tuple(token_ids), target, after))

    def delete(self, block_hash: int) -> None:
        self._submit(("delete", block_hash))

    def _submit(self, op) -> None:
        with self._cv:
            self._queued += 1
        self._ops.put(op)

    def poll(self) -> list[tuple]:
        with self._cv:
            results, self._results = self._results, []
        return results

    def wait(self, timeout: float) -> None:
        """Returns once a result is in to poll, nothing is queued, or after timeout seconds."""
        with self._cv:
            self._cv.wait_for(lambda: self._results or not self._queued, timeout)

    def drain(self) -> None:
        """Returns once every operation submitted so far has ended."""
        with self._cv:
            self._cv.wait_for(lambda: not self._queued)

    def close(self) -> None:
        self._ops.put(_STOP)
        self._thread.join()
        if self._readers is not None:
            self._readers.shutdown()

    # --- the disk thread --------------------------------------------------------------------------

    def _serve(self) -> None:
        pending: deque = deque()
        while True:
            if not pending:
                pending.append(self._ops.get())
            with contextlib.suppress(queue.Empty):
                while True:
                    pending.append(self._ops.get_nowait())
            # Reads go ahead of the writes and removals queued before them: a prompt waits for its
            # reads, nobody waits for a write. (Reordering is safe: a slot being written is not
            # handed to a read before its write ends, nor is a file read before its write ends.)
            fetches = [op for op in pending if op[0] == "fetch"]
            if fetches:
                pending = deque(op for op in pending if op[0] != "fetch")
                self._fetch_side_by_side(fetches)
                continue
            op = pending.popleft()
            if op is _STOP:
                return
            self._done(self._run(op))

    def _done(self, result: tuple | None) -> None:
        with self._cv:
            if result is not None:
                self._results.append(result)
            self._queued -= 1
            self._cv.notify_all()

    def _fetch_side_by_side(self, fetches: list[tuple]) -> None:
        """Runs the reads on the reader threads, reported as they end (the engine loads blocks to the
        device while the rest are read); returns once they all have."""
        if self._readers is None:
            self._readers = ThreadPoolExecutor(_READERS, thread_name_prefix=f"nvchat-kv-read-{self.rank}")
        # The device copies the reads wait for: once each, not once a file.
        for event in {id(e): e for op in fetches for e in op[4] if e is not None}.values():
            event.synchronize()

        def read(share: list[tuple]) -> None:
            for op in share:
                result = self._run((*op[:4], ()))
                with self._cv:
                    self._results.append(result)
                    self._queued -= 1
                    if len(self._results) >= _REPORT_EVERY:
                        self._cv.notify_all()
        # A share of the reads a thread, not a task a read: a task costs the GIL more than a read does.
        wait([self._readers.submit(read, fetches[i::_READERS]) for i in range(min(_READERS, len(fetches)))])
        with self._cv:
            self._cv.notify_all()

    def _run(self, op) -> tuple | None:
        kind, block_hash = op[0], op[1]
        try:
            if kind == "write":
                return self._write(*op[1:])
            if kind == "fetch":
                return self._fetch(*op[1:])
            self.path(block_hash).unlink(missing_ok=True)
        except Exception:  # a full disk, a permission: the block is simply not kept
            return ("written", block_hash, False, 0) if kind == "write" else ("fetched", block_hash, False)
        return None

    @staticmethod
    def _checksum(tensor: torch.Tensor) -> str:
        return xxhash.xxh3_64_hexdigest(tensor.view(torch.uint8).numpy())

    def _write(self, block_hash: int, token_ids: tuple, source: torch.Tensor, after) -> tuple:
        if after is not None:
            after.synchronize()
        metadata = {"format": FORMAT, "fingerprint": self.fingerprint, "hash": f"{block_hash:016x}",
                    "token_ids": " ".join(map(str, token_ids)), "xxh3": self._checksum(source)}
        path = self.path(block_hash)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file({"kv": source}, str(temporary), metadata=metadata)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        return ("written", block_hash, True, path.stat().st_size)

    def _fetch(self, block_hash: int, token_ids: tuple, target: torch.Tensor, after: tuple) -> tuple:
        # As few calls as a read allows: each hands the GIL to another thread and back, and with
        # several readers those hand-offs cost more than the copying.
        path = self.path(block_hash)
        for event in after:  # the copies that may still read or fill the slot
            if event is not None:
                event.synchronize()
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return ("fetched", block_hash, False)
        try:
            metadata, data_offset = self._header(fd, block_hash, token_ids)
            ok = metadata is not None and self._read_checked(fd, data_offset, target) == metadata.get("xxh3")
        except OSError:
            ok = False
        finally:
            os.close(fd)
        if not ok:
            path.unlink(missing_ok=True)
            return ("fetched", block_hash, False)
        with contextlib.suppress(OSError):
            os.utime(path)  # the next start-up lists files least recently used first
        return ("fetched", block_hash, True)

    def _read_checked(self, fd: int, offset: int, target: torch.Tensor) -> str | None:
        """Reads the file from offset into target, in one call; the xxh3 checksum of what it read,
        or None if the file holds more or fewer bytes than a block."""
        view = memoryview(target.view(torch.uint8).numpy()).cast("B")
        if os.preadv(fd, [view, bytearray(1)], offset) != self.block_bytes:
            return None
        return xxhash.xxh3_64_hexdigest(view)

    def _header(self, fd: int, block_hash: int, token_ids: tuple) -> tuple[dict | None, int]:
        """(metadata, where the K/V start) if the file's safetensors header describes this engine's
        block: one tensor "kv" of the block's dtype and shape, and the same format, fingerprint,
        hash and tokens (a file copied in from another model's directory, or a hash collision,
        differs); else (None, 0)."""
        head = os.pread(fd, _HEAD_READ, 0)
        if len(head) < 8:
            return None, 0
        length = int.from_bytes(head[:8], "little")
        if length > _MAX_HEADER_BYTES:
            return None, 0
        if 8 + length > len(head):
            head += os.pread(fd, 8 + length - len(head), len(head))
        try:
            header = json.loads(head[8:8 + length])
        except (UnicodeDecodeError, ValueError):
            return None, 0
        if not isinstance(header, dict) or header.get("kv") != self._header_tensor:
            return None, 0
        metadata = header.get("__metadata__")
        if not (isinstance(metadata, dict) and metadata.get("format") == FORMAT
                and metadata.get("fingerprint") == self.fingerprint and metadata.get("hash") == f"{block_hash:016x}"
                and metadata.get("token_ids") == " ".join(map(str, token_ids))):
            return None, 0
        return metadata, 8 + length


class KVTierCopies:
    """One rank's side of the lower tiers: its host pool, its copy streams and its disk store."""

    def __init__(self, kv_cache: torch.Tensor, num_slots: int, disk: DiskStore | None = None):
        # kv_cache is (2, layers, blocks, block_size, kv_heads, head_dim): seen block-first, a
        # block's K/V are one row to gather or scatter, and a host slot holds one contiguously.
        self.by_block = kv_cache.permute(2, 0, 1, 3, 4, 5)
        self.block_shape = tuple(self.by_block.shape[1:])
        self.device = kv_cache.device
        cuda = self.device.type == "cuda"
        self.host = HostPool(num_slots, self.block_shape, kv_cache.dtype, pinned=cuda)
        self.disk = disk
        self._stage_blocks = max(1, _STAGE_BYTES // self.host.slot_bytes)
        self._save_stream = torch.cuda.Stream(self.device) if cuda else None
        self._load_stream = torch.cuda.Stream(self.device) if cuda else None
        self._last_save: torch.cuda.Event | None = None  # every save's copy to the host has ended
        # Every saved block has been read into a staging buffer: a step may overwrite it. (A save
        # gathers its blocks on the device, then copies them to the host: the blocks are free well
        # before the copy ends.)
        self._last_gather: torch.cuda.Event | None = None
        self._gathers: list[torch.cuda.Event] = []  # the last run's, stage by stage
        self._last_load: torch.cuda.Event | None = None
        self._load_events: OrderedDict[int, torch.cuda.Event] = OrderedDict()  # load batch -> its end
        self._loads_done = 0  # on CPU, the last load batch (made at once); on a GPU, the last seen ended

    def grow_host(self) -> tuple[int, bool]:
        """One more piece of the host pool: (slots allocated, whether any piece is left to allocate)."""
        try:
            slots = self.host.grow(1)
        except RuntimeError:  # the system refused more pinned memory: the pool stays as it is
            self.host.num_slots = slots = self.host.allocated_slots
        return slots, slots < self.host.num_slots

    def run(self, kv: KVTransfers) -> None:
        """Queues a step's transfers: saves, then loads, then the step stream's waits for them, then
        the disk operations."""
        earlier_saves = self._last_save
        gathered = self._save(kv.saves) if kv.saves else {}
        if kv.loads:
            self._load(kv.loads, kv.batch, earlier_saves, gathered)
        if self._save_stream is not None:
            step_stream = torch.cuda.current_stream(self.device)
            if kv.wait_saves and self._last_gather is not None:
                step_stream.wait_event(self._last_gather)
            if kv.wait_loads:
                event = self._load_event(kv.wait_loads)
                if event is not None:
                    step_stream.wait_event(event)
        if self.disk is not None:
            for block_hash in kv.deletes:
                self.disk.delete(block_hash)
            for slot, block_hash, token_ids in kv.writes:
                self.disk.write(block_hash, token_ids, self.host.slot(slot), self._last_save)
            for block_hash, slot, token_ids in kv.fetches:
                self.disk.fetch(block_hash, token_ids, self.host.slot(slot), (self._last_save, self._last_load))

    def _index(self, ids: list[int]) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.int64)
        if self.device.type == "cuda":  # pinned, so the copy is queued without a wait on the host
            index = index.pin_memory().to(self.device, non_blocking=True)
        return index

    def _save(self, saves: list[tuple[int, int]]) -> dict[int, int]:
        """Queues the saves; on a GPU returns {device block: the stage (self._gathers) that reads it}."""
        if self._save_stream is None:  # on CPU, gathered straight into the slots
            for first, end, piece, offset in self.host.runs([slot for _, slot in saves]):
                index = self._index([block for block, _ in saves[first:end]])
                torch.index_select(self.by_block, 0, index, out=piece[offset:offset + end - first])
            return {}
        stream = self._save_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if self._last_load is not None:
            stream.wait_event(self._last_load)
        gathered = {}
        self._gathers = []
        with torch.cuda.stream(stream):
            for start in range(0, len(saves), self._stage_blocks):
                part = saves[start:start + self._stage_blocks]
                # Made on the copy stream, so the allocator hands the memory out again only to
                # work queued after these copies on it.
                staged = self.by_block.index_select(0, self._index([block for block, _ in part]))
                self._gathers.append(stream.record_event())
                for block, _ in part:
                    gathered[block] = len(self._gathers) - 1
                for first, end, piece, offset in self.host.runs([slot for _, slot in part]):
                    piece[offset:offset + end - first].copy_(staged[first:end], non_blocking=True)
        self._last_gather = self._gathers[-1]
        self._last_save = stream.record_event()
        return gathered

    def _load(self, loads: list[tuple[int, int]], batch: int, earlier_saves, gathered: dict[int, int]) -> None:
        """Queues the loads. earlier_saves: the end of the saves queued before this step's (a slot a
        load reads may be one they fill); gathered: this step's saves' blocks (_save's), each of
        which a load overwrites only once its save has read it. The two copy directions overlap:
        a stage's blocks wait for the save stage that reads them, not for every save to reach the host."""
        if self._load_stream is None:  # on CPU, scattered straight from the slots
            for first, end, piece, offset in self.host.runs([slot for slot, _ in loads]):
                index = self._index([block for _, block in loads[first:end]])
                self.by_block.index_copy_(0, index, piece[offset:offset + end - first])
            self._loads_done = batch
            return
        stream = self._load_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if earlier_saves is not None:
            stream.wait_event(earlier_saves)
        with torch.cuda.stream(stream):
            for start in range(0, len(loads), self._stage_blocks):
                part = loads[start:start + self._stage_blocks]
                staged = torch.empty((len(part), *self.block_shape), dtype=self.host.dtype, device=self.device)
                for first, end, piece, offset in self.host.runs([slot for slot, _ in part]):
                    staged[first:end].copy_(piece[offset:offset + end - first], non_blocking=True)
                stage = max((gathered[block] for _, block in part if block in gathered), default=None)
                if stage is not None:
                    stream.wait_event(self._gathers[stage])
                self.by_block.index_copy_(0, self._index([block for _, block in part]), staged)
        self._last_load = self._load_events[batch] = stream.record_event()
        while len(self._load_events) > _MAX_LOAD_EVENTS:
            self._load_events.popitem(last=False)

    def _load_event(self, batch: int) -> "torch.cuda.Event | None":
        """The end of the first load batch from `batch` on that is still kept (loads are queued in
        order, so it covers every batch before it), or None if `batch` has ended. The ones before it
        are dropped: no step asks for them again (KVTiers.loads_waited)."""
        if batch <= self._loads_done:
            return None
        while self._load_events:
            first, event = next(iter(self._load_events.items()))
            if first >= batch:
                return event
            self._load_events.popitem(last=False)
        return None

    def loads_done(self) -> int:
        """The last load batch that has ended, with every one before it (rank 0's view)."""
        while self._load_events:
            batch, event = next(iter(self._load_events.items()))
            if not event.query():
                break
            self._loads_done = batch
            self._load_events.popitem(last=False)
        return self._loads_done

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        self.host.close()
