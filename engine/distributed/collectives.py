"""One engine's tensor-parallel group: its rank, its size and the collectives the layers need.

Every engine has its own TPGroup, and layers keep the group that was current while the model was
built (see `building`), so two engines in one process never share a communicator. With one rank
every collective is a no-op, so single-GPU and CPU runs pay nothing for it. On CUDA, small sums
(decode steps) go over NVLink peer memory (engine/distributed/symm_allreduce.py) and the rest over NCCL.
"""
import contextlib
import contextvars
import os
from datetime import timedelta

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed, almost always because another rank has gone away."""


class TPGroup:
    def __init__(self, rank: int = 0, size: int = 1, backend=None):
        if size > 1 and backend is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a process-group backend")
        self.rank, self.size = rank, size
        self._backend = backend
        self.is_nccl = backend is not None and backend.name().lower() == "nccl"
        # Sums of small CUDA tensors: a symm_allreduce.SymmAllReduce, when every rank could set
        # it up (see create_group).
        self.fast = None

    def _pg(self):
        if self._backend is None:
            raise CollectiveError("this tensor-parallel group has been shut down")
        return self._backend

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Returns the reduction over ranks: a new tensor on the fast path, x reduced in place on
        the backend's. Callers use the result and leave x alone."""
        fast = self.fast
        if fast is not None and op == dist.ReduceOp.SUM and fast.accepts(x):
            if fast.aborted:
                raise CollectiveError("this tensor-parallel group was aborted: a peer has gone")
            return fast(x)
        return self.backend_all_reduce(x, op)

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sum over ranks of x, then the residual add and RMSNorm, in one kernel over peer
        memory: (normed, new residual). None where the fast path does not take these tensors;
        the caller then all-reduces and normalizes separately. See SymmAllReduce.all_reduce_rms_norm
        for slot."""
        fast = self.fast
        if fast is None or not fast.fuses(x, residual):
            return None
        if fast.aborted:
            raise CollectiveError("this tensor-parallel group was aborted: a peer has gone")
        return fast.all_reduce_rms_norm(x, residual, weight, eps, slot)

    def backend_all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """The process-group backend's all-reduce (NCCL or gloo), in place; returns x."""
        if self.size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            try:
                self._pg().allreduce([x], opts).wait()
            except CollectiveError:
                raise
            except RuntimeError as e:  # gloo raises here as soon as a peer's sockets close
                raise CollectiveError(str(e)) from e
        return x

    def gather_to_rank0(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenates each rank's shard along dim on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        try:
            self._pg().gather([parts] if parts else [], [x], opts).wait()
        except CollectiveError:
            raise
        except RuntimeError as e:
            raise CollectiveError(str(e)) from e
        return torch.cat(parts, dim=dim) if parts else None

    def broadcast_from_rank0(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrites x on every other rank with rank 0's x, in place; returns x. On CUDA the
        host does not wait: the copy is ordered on the current stream like a kernel."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            try:
                self._pg().broadcast([x], opts).wait()
            except CollectiveError:
                raise
            except RuntimeError as e:
                raise CollectiveError(str(e)) from e
        return x

    def min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value (each GPU may have room for a different KV cache)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())

    def abort(self) -> None:
        """Called from another thread when a peer has died: NCCL and fast-path kernels waiting on it
        would spin forever, and aborting releases them. Gloo needs nothing, since it errors as soon
        as the peer's sockets close (and its abort does not wake a waiting collective)."""
        backend, fast = self._backend, self.fast
        # The fast path first: NCCL's abort may wait for a stream that one of its kernels holds.
        if fast is not None:
            fast.abort()
        if backend is not None and self.is_nccl:
            backend.abort()

    def destroy(self) -> None:
        """Frees the group. Call once the peers have stopped, or died: anything still waiting on
        them is released, which would corrupt a peer's collective still in flight."""
        backend, self._backend = self._backend, None
        fast, self.fast = self.fast, None
        if fast is not None:
            fast.abort()  # the peers are stopped or gone: release whatever still waits on them
        # abort, not shutdown: it is local, so it cannot wait on ranks that have already exited.
        if backend is not None and self.is_nccl:
            backend.abort()
        if fast is not None:
            fast.close()


SINGLE_RANK = TPGroup()

_current: contextvars.ContextVar[TPGroup] = contextvars.ContextVar("tp_group", default=SINGLE_RANK)


def current_group() -> TPGroup:
    """The group the model being built belongs to; layers keep it for their forward passes."""
    return _current.get()


@contextlib.contextmanager
def building(group: TPGroup):
    """Makes `group` current while a model is built. A context variable rather than a global, so
    two engines built at once on different threads each get their own."""
    token = _current.set(group)
    try:
        yield group
    finally:
        _current.reset(token)


@contextlib.contextmanager
def _env_default(name: str, value: str):
    """Sets an environment variable the backend reads while it is constructed, unless the user
    set it, and restores the environment after."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def create_group(rank: int, size: int, store, device: torch.device, timeout: timedelta) -> TPGroup:
    """A standalone group over `store` (not torch.distributed's global default group, so any number
    of engines can live in one process): NCCL on CUDA, gloo over loopback on CPU."""
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # On an NCCL error or timeout torch's default is to take the whole process down. Rank 0's
        # process is the caller's app: only abort the communicator (2), so the next collective
        # raises and the caller gets an exception instead.
        with _env_default("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"):
            backend = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        # Every rank is on this host; loopback keeps gloo off the network and off hostname lookups.
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = timeout
        backend = dist.ProcessGroupGloo(store, rank, size, opts)
    group = TPGroup(rank, size, backend)
    # Connect now, while every rank is here, rather than lazily inside the first forward pass:
    # NCCL's lazy connect blocks with no way to abort if a peer dies before reaching it.
    group.all_reduce(torch.zeros(1, device=device))
    if device.type == "cuda":
        # start-up: its Triton kernel (0.3 s of imports on the 2-core box) only where it can run
        from engine.distributed import symm_allreduce
        torch.cuda.synchronize(device)
        group.fast = symm_allreduce.connect(rank, size, backend, store, device,
                                            agree=lambda ok: group.min(int(ok), device) == 1)
    return group
