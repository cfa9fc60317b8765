"""All-reduce over NVLink peer memory, for the small tensors of decode steps.

NCCL takes ~15 us to all-reduce a [1, 5120] bf16 tensor, mostly protocol, and a decode step of a
64-layer model does 129 of them. PyTorch's symmetric memory maps each rank's buffer into every
peer's address space; its one-shot kernel has every rank read all peers' buffers and sum them
itself, and its two-shot kernel (reduce-scatter then all-gather through the same buffers) moves
less data for larger tensors. Both are plain kernels that sync through flags in peer memory, so
CUDA graphs capture them. Only these peer-pointer kernels are used, never multicast (multimem) ones.

What this module manages around torch:
- Groups. torch looks up a group's store, rank and size through a ProcessGroup registered under a
  name. nvchat's groups are standalone, so each gets a fresh name and its own ProcessGroup,
  unregistered at close(); nothing is fixed, so any number of engines share a host or a process.
- The rendezvous sequence. torch numbers the store keys of a rendezvous with a counter global to
  the process, so each rank's process must have made as many rendezvous as the others before this
  one. Workers are fresh processes, but rank 0's process may have set up earlier engines: the
  ranks compare counts, and those behind catch up with rendezvous on a one-rank group of their own.
- Dead peers. The kernels spin, with no timeout, on flags their peers set: one waiting for a rank
  that died would hold the caller's GPU forever. abort() and close() set those flags from this
  side until the device's stream has drained (the results are garbage by then, and unused).
- Anything unexpected at set-up: the ranks agree, and every rank falls back to NCCL, with one log
  line on rank 0.
"""
import contextlib
import logging
import os
import threading
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from kernels.allreduce_rmsnorm import MAX_PROGRAMS as _FUSED_PROGRAMS
from kernels.allreduce_rmsnorm import all_reduce_rms_norm

log = logging.getLogger(__name__)

# Tensors up to this size take this path; larger ones (prefill) stay on NCCL, whose ring is
# bandwidth-optimal for them. A decode step of batch 256 at hidden size 8192 is 4 MiB.
BUFFER_BYTES = 8 << 20
# Past torch's region: the two slots of the all-reduce fused with the add and RMSNorm
# (kernels/allreduce_rmsnorm.py), then its flags. It takes what one-shot takes (one_shot_max).
_FUSED_SLOT_BYTES = 512 << 10
_FLAGS_OFFSET = BUFFER_BYTES + 2 * _FUSED_SLOT_BYTES
_FUSED_MAX_HIDDEN = 16384  # a row is one program's registers
_FUSED_SIZES = (2,)
# One-shot reads every peer's whole tensor, two-shot a 1/N share twice with one more sync: one-shot
# wins while latency dominates. benchmarks/bench_allreduce.py measures where they cross.
ONE_SHOT_MAX_BYTES = {2: 512 << 10}
_ONE_SHOT_MAX_DEFAULT = 256 << 10
_TWO_SHOT_SIZES = (2, 4, 8)  # the world sizes torch builds two_shot_all_reduce_out for
_DTYPES = (torch.bfloat16, torch.float32)  # the dtypes torch builds the kernels for
_ALIGN = 16  # bytes: the kernels' widest vector access, for both size and offset
_SIGNAL_BLOCKS = 32  # torch's symm_max_nblocks: block b syncs through flag b * world_size + peer
# A rendezvous that cannot complete (the ranks' counts out of step) fails in this time rather
# than the engine's ten-minute backstop, and every rank falls back to NCCL.
_RENDEZVOUS_TIMEOUT = timedelta(seconds=60)
_DRAIN_TIMEOUT_S = 30.0
_RELEASE_POLL_S = 0.002
_KEY = "nvchat-symm/"
# "nccl" keeps every all-reduce on NCCL; "unfused" keeps the fast all-reduce apart from the RMSNorm
# after it (two kernels, as before the fused one: for comparisons)
DISABLE_ENV = "NVCHAT_TP_ALLREDUCE"

_lock = threading.Lock()  # one rendezvous at a time per process: they share torch's counter
_rendezvous_made = 0  # rendezvous this process has made, catch-ups included
_unusable: str | None = None  # why this process may not try again
# Buffers whose kernels might still spin (the stream never drained): freeing one waits on the
# device, so they are kept until the process exits.
_stranded: list = []


class SymmAllReduce:
    """One rank's side of a group's symmetric-memory all-reduce. Sums bf16 or float32 tensors of
    up to BUFFER_BYTES whose size is a multiple of 16 bytes; accepts() says whether a tensor fits.
    Every rank reduces in the same order, so all ranks get the same bits."""

    def __init__(self, name: str, rank: int, size: int, device: torch.device, buffer: torch.Tensor, handle, pg):
        self.name, self.rank, self.size, self.device = name, rank, size, device
        self._buffer, self._handle, self._pg = buffer, handle, pg
        self.one_shot_max = ONE_SHOT_MAX_BYTES.get(size, _ONE_SHOT_MAX_DEFAULT)
        self.max_bytes = BUFFER_BYTES if size in _TWO_SHOT_SIZES else self.one_shot_max
        # torch >= 2.8 copies the input into the buffer inside the one-shot kernel.
        self._copy_in = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
        self._signals = [handle.get_signal_pad(r, [_SIGNAL_BLOCKS * size], torch.int32).view(_SIGNAL_BLOCKS, size)
                         for r in range(size)]
        self._fused_flags = [handle.get_buffer(r, [_FUSED_PROGRAMS, size], torch.int32, _FLAGS_OFFSET // 4)
                             for r in range(size)]
        with torch.cuda.device(device):
            self._fused_flags[rank].zero_()  # before the self-test, whose barrier every peer's first signal follows
            self._buffer_ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
            self._flag_ptrs = self._buffer_ptrs + _FLAGS_OFFSET
        self._side = torch.cuda.Stream(device)
        # bench_tp on the 32B shape, 4 x H200: fused, TP=2's decode step is 4% faster; at TP=4
        # the one program of a batch-1 row reads three peers in turn, and torch's kernel wins by 1.5%.
        self.fuse_norm = size in _FUSED_SIZES and os.environ.get(DISABLE_ENV, "").lower() != "unfused"
        self.aborted = False
        self._closed = False
        self._stop = threading.Event()
        self._releaser: threading.Thread | None = None

    def accepts(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.dtype in _DTYPES and 0 < nbytes <= self.max_bytes and nbytes % _ALIGN == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, as a new tensor. Collective: every rank calls it with the same shape."""
        if x.numel() * x.element_size() <= self.one_shot_max:
            return self.one_shot(x)
        return self.two_shot(x)

    def fuses(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether all_reduce_rms_norm takes x (with this residual)."""
        return (self.fuse_norm and x.dtype in _DTYPES and x.dim() == 2 and x.device == self.device and x.is_contiguous()
                and 0 < x.numel() * x.element_size() <= min(self.one_shot_max, _FUSED_SLOT_BYTES)
                and x.shape[1] <= _FUSED_MAX_HIDDEN and residual.shape == x.shape
                and residual.dtype == x.dtype and residual.is_contiguous())

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(sum + residual) * weight, sum + residual), the sum over ranks of x, in one kernel
        (see fuses()). Collective; each call site keeps to its own slot, and consecutive sites
        alternate between slots 0 and 1."""
        with self._on_device():
            return all_reduce_rms_norm(x, residual, weight, eps, buffer_ptrs=self._buffer_ptrs,
                                       flag_ptrs=self._flag_ptrs, rank=self.rank,
                                       slot_offset=(BUFFER_BYTES + slot * _FUSED_SLOT_BYTES) // x.element_size())

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        flat, buf, out = self._operands(x)
        with self._on_device():
            if self._copy_in:
                torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, flat, "sum", self.name, out)
            else:
                buf.copy_(flat)
                torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", self.name, out)
        return out.view(x.shape)

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        flat, buf, out = self._operands(x)
        with self._on_device():
            buf.copy_(flat)
            torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", self.name, out)
        return out.view(x.shape)

    def _operands(self, x: torch.Tensor):
        if x.device != self.device:
            raise ValueError(f"all-reduce of a tensor on {x.device} in a group on {self.device}")
        # The kernels take the local input at the buffer's (zero) offset alignment.
        if not x.is_contiguous() or x.storage_offset() * x.element_size() % _ALIGN:
            x = x.clone(memory_format=torch.contiguous_format)
        flat = x.view(-1)
        buf = self._buffer[: flat.numel() * flat.element_size()].view(flat.dtype)
        return flat, buf, torch.empty_like(flat)

    def _on_device(self):
        # torch's symm_mem ops launch on the current device's stream, with no device guard of their own.
        if torch.cuda.current_device() == self.device.index:
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def self_test(self) -> None:
        """Runs each kernel this rank will use once and checks the sum, so that a torch lacking a
        kernel, or peers not really mapped, fall back at start-up rather than mid-generation.
        Every kernel runs before any check raises: a rank that left early would strand its peers."""
        x = torch.full((_ALIGN // 4,), float(self.rank + 1), dtype=torch.float32, device=self.device)
        outs = [self.one_shot(x)] + ([self.two_shot(x)] if self.max_bytes > self.one_shot_max else [])
        for slot in (0, 1):
            rows = x.view(1, -1)
            outs.append(self.all_reduce_rms_norm(rows, torch.zeros_like(rows), torch.ones_like(x), 1e-6, slot)[1].view(-1))
        expected = self.size * (self.size + 1) / 2
        for out in outs:
            got = out.tolist()
            if got != [expected] * len(got):
                raise RuntimeError(f"self-test all-reduce gave {got}, expected {expected} everywhere")

    # --- failure and shutdown -------------------------------------------------------------------

    def abort(self) -> None:
        """Once a peer is gone (from any thread): later calls are refused by the group, and a thread
        opens this rank's waits until close(), so kernels already queued run through."""
        if self.aborted:
            return
        self.aborted = True
        releaser = threading.Thread(target=self._release_until_closed, name="nvchat-tp-release", daemon=True)
        try:
            releaser.start()
        except RuntimeError:  # the interpreter is exiting (no new threads): close() drains on its own
            return
        self._releaser = releaser

    def _open_signals(self) -> None:
        """Sets every flag this rank's kernels wait on as if each peer had arrived, and clears the
        flags it sets at its peers, so that its next arrival does not wait for them to be taken."""
        with torch.cuda.device(self.device), torch.cuda.stream(self._side):
            for flags in (self._signals, self._fused_flags):
                mine = flags[self.rank]
                for peer in range(self.size):
                    if peer != self.rank:
                        mine[:, peer].fill_(1)
                        flags[peer][:, self.rank].fill_(0)
            self._side.synchronize()

    def _release_until_closed(self) -> None:
        while not self._stop.is_set():
            try:
                self._open_signals()
            except Exception:
                pass  # e.g. another thread is capturing a graph: the next round may get through
            # The poll interval of a GPU-side wait that nothing can signal to the host.
            self._stop.wait(_RELEASE_POLL_S)

    def _drain(self) -> bool:
        """Opens flags until the work queued on the device's default stream has run: the engine
        launches there, and its CUDA graphs replay there. False if it has not in _DRAIN_TIMEOUT_S."""
        done = torch.cuda.Event()
        done.record(torch.cuda.default_stream(self.device))
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        while not done.query():
            if time.monotonic() > deadline:
                return False
            self._open_signals()
        return True

    def close(self) -> None:
        """Frees the buffer and the group's name. Call with the peers stopped or gone, after abort()
        when they might have died: kernels still queued are released first. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._releaser is not None:
            self._releaser.join()
        try:
            drained = self._drain()
        except Exception:  # a broken CUDA context: nothing more can run on it
            drained = False
        if not drained:
            # Freeing syncs the device (and raises in a destructor if it cannot): keep it instead.
            _stranded.append((self._buffer, self._handle, self._signals, self._fused_flags))
        self._buffer = self._handle = self._signals = self._fused_flags = None
        _unregister(self.name)
        self._pg = None


def connect(rank: int, size: int, backend, store, device: torch.device, agree) -> SymmAllReduce | None:
    """Sets up the group's fast all-reduce; collective over the group's ranks. `backend` is the
    group's NCCL backend, `store` its TCPStore, `agree(ok)` True when every rank's ok is. Returns
    None on every rank when any rank cannot use it, or when NVCHAT_TP_ALLREDUCE=nccl."""
    disabled = os.environ.get(DISABLE_ENV, "").lower() == "nccl"
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        reason = f"{DISABLE_ENV}=nccl" if disabled else _why_not(rank, size, device)
    except Exception as e:
        reason = f"{type(e).__name__}: {e}"
    if not agree(reason is None):
        if rank == 0 and not disabled:
            log.warning("tensor parallelism: all-reduce over NCCL only (%s)",
                        reason or "another rank cannot set up symmetric memory")
        return None
    fast, error = None, None
    with _lock:
        try:
            fast = _rendezvous(rank, size, backend, store, device)
        except Exception as e:
            error = e
    if fast is not None:
        try:
            fast.self_test()
        except Exception as e:
            error = e
    if not agree(error is None):
        if fast is not None:
            fast.close()
        if rank == 0:
            why = f"{type(error).__name__}: {error}".splitlines()[0] if error else "it failed on another rank"
            log.warning("tensor parallelism: symmetric-memory all-reduce set-up failed, using NCCL (%s)", why)
        return None
    return fast


def _why_not(rank: int, size: int, device: torch.device) -> str | None:
    if _unusable:
        return _unusable
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    try:  # optional: torch's private symmetric-memory API, absent from some builds
        import torch.distributed._symmetric_memory  # noqa: F401  (rendezvous)
        from torch._C import _distributed_c10d as c10d
        _SymmetricMemory, _ = c10d._SymmetricMemory, c10d._register_process_group
    except (ImportError, AttributeError) as e:
        return f"this torch has no symmetric memory: {e}"
    for op in ("one_shot_all_reduce_out", "two_shot_all_reduce_out"):
        if not hasattr(torch.ops.symm_mem, op):
            return f"this torch has no symm_mem.{op}"
    get_backend = getattr(_SymmetricMemory, "get_backend", None)
    backend = get_backend(device) if get_backend else "CUDA"
    if backend not in (None, "CUDA"):
        return f"symmetric memory is set to its {backend} backend; this path needs CUDA's"
    base = device.index - rank  # rank r runs on the r-th GPU from the group's first
    for peer in range(size):
        if peer != rank and not torch.cuda.can_device_access_peer(device.index, base + peer):
            return f"cuda:{device.index} cannot access cuda:{base + peer} directly (no peer-to-peer)"
    return None


def _rendezvous(rank: int, size: int, backend, store, device: torch.device) -> SymmAllReduce:
    global _rendezvous_made, _unusable
    # optional: torch's private symmetric-memory API (_why_not checked that it exists)
    import torch.distributed._symmetric_memory as symm_mem
    from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory

    # Only peer pointers are used; keep torch from making multicast objects (a hard rule of the
    # shared GPU machines, and never needed here). A user's explicit setting stands.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if rank == 0:
        store.set(_KEY + "name", f"nvchat-tp-{uuid.uuid4().hex}")
    store.set(f"{_KEY}made/{rank}", str(_rendezvous_made))
    name = store.get(_KEY + "name").decode()
    behind = max(int(store.get(f"{_KEY}made/{r}")) for r in range(size)) - _rendezvous_made
    exchange = _exchange_store(store)
    registered = False
    try:
        for i in range(behind):
            _catch_up(dist.PrefixStore(f"catch-up/{rank}/{i}", exchange), device)
        pg = dist.ProcessGroup(exchange, rank, size)
        # The backend only gives the group a name torch can report; the rendezvous uses the store.
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
        pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        pg._set_group_name(name)
        _register_process_group(name, pg)
        registered = True
        # Allocated directly, not from torch's symmetric-memory pool: freed, it is unmapped at once
        # instead of staying mapped to peers that are gone.
        nbytes = _FLAGS_OFFSET + _FUSED_PROGRAMS * size * 4
        buffer = _SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8, device)
        _rendezvous_made += 1
        handle = symm_mem.rendezvous(buffer, name)
    except BaseException:
        # Where this process's rendezvous counter stands is unknown now.
        _unusable = "an earlier symmetric-memory set-up in this process failed"
        if registered:
            _unregister(name)
        raise
    try:
        return SymmAllReduce(name, rank, size, device, buffer, handle, pg)
    except BaseException:
        _unregister(name)
        raise


def _catch_up(store, device: torch.device) -> None:
    """One rendezvous on a group of this rank alone: it advances torch's counter as a real one does."""
    global _rendezvous_made
    # optional: torch's private symmetric-memory API (_why_not checked that it exists)
    import torch.distributed._symmetric_memory as symm_mem
    from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory

    name = f"nvchat-catch-up-{uuid.uuid4().hex}"
    pg = dist.ProcessGroup(store, 0, 1)
    _register_process_group(name, pg)
    try:
        scratch = _SymmetricMemory.empty_strided_p2p((_ALIGN,), (1,), torch.uint8, device)
        _rendezvous_made += 1
        symm_mem.rendezvous(scratch, name)
    finally:
        _unregister(name)


def _exchange_store(store):
    """The store the rendezvous exchanges through: its own connection to the engine's TCPStore,
    with a short timeout (see _RENDEZVOUS_TIMEOUT)."""
    port = getattr(store, "port", None)
    if port is not None:
        store = dist.TCPStore(store.host, port, is_master=False, timeout=_RENDEZVOUS_TIMEOUT)
    return dist.PrefixStore(_KEY + "exchange", store)


def _unregister(name: str) -> None:
    from torch._C._distributed_c10d import (
        _unregister_process_group,  # optional: as in _rendezvous
    )
    _unregister_process_group(name)
